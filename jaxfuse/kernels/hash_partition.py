"""ZEN hierarchical hashing (Algorithm 1): lossless, balanced index
partitioning.

Given the selected indices ``I ⊂ [0, G)`` of one worker's gradient (a fixed
capacity ``N`` of int32 slots; the sentinel ``G`` marks an empty slot), split
``I`` into ``n`` partitions, one per server, so that

* the partition of an index depends only on the index and a seed shared by all
  workers: the same index goes to the same server from every worker
  (ZEN Technique #3);
* the partitions are balanced whatever the distribution of ``I``;
* nothing is lost: every index lands in exactly one slot of the output table.

Maths (ZEN §3.2)::

  h0 : [0, G) → [n]       first level, picks the partition; depends on `seed`
  H  = {h1, …, hk}        second level, hi : [0, G) → [r1]; may differ per
                          worker (`local_seed`), it only picks a slot
  x  ∈ Z^{n × (r1 + r2)}  the hash memory; row p = partition p:
                          r1 "parallel" slots then r2 "serial" slots
  for idx ∈ I in parallel:
    p ← h0(idx)
    for i = 1..k: claim x[p][hi(idx)] if it is free, else rehash
    if every probe failed: q ← atomicAdd(c[p], 1); x[p][r1 + q] ← idx

Every hash is a 32-bit ``lowbias32`` mix of ``idx XOR key``, the key derived
from the seed; ``h(idx) mod m`` maps it to a range (the modulo bias is at
most m / 2^32).

Imbalance (Definition 8): for partitions I^1..I^n of I, the imbalance ratio is
``n · max_j |I^j| / |I|`` (1 is perfect).  Theorem 2: since only h0 decides the
partition, and h0 is data independent, the loads are ``|I|`` balls in ``n``
bins, so with probability ≥ 1 − 1/n the ratio is at most
``1 + Θ(sqrt(n log n / |I|))`` (|I| = |G|·d_G) — e.g. ≈ 1.02 for
``|I| = 10^5, n = 8``, for any set of indices that is not chosen knowing the
seed.  :func:`imbalance_ratio` measures it.

Sizes.  The paper's defaults are ``r1 = 2|G|d_G`` (twice the number of
indices) and ``r2 = r1/10``, with ``k = 3`` (§5.3).  :func:`default_sizes`
takes them per partition with ``|G|d_G = N`` (the capacity), so even if every
index falls into one partition its parallel region is at most half full: each
probe then fails with probability ≤ 1/2, so on average at most N/2^k (N/8 for
k = 3) indices of a partition fail all k probes, and overflowing the serial
region needs more than ``r2 ≥ N/5`` of them.
For ``N ≤ 32`` the default ``r2`` is at least N, so overflow cannot happen at
all.  Smaller tables (e.g. ``r1 ≈ 2N/n``) are valid and much cheaper when h0
balances the load; whatever the sizes, an index that finds no slot is never
dropped silently: ``overflowed`` counts them and ``stored`` marks, per input
slot, which indices are in the table (keep the others in the residual).

Lossless claiming in the kernel.  Pallas' ``atomic_cas`` only takes a scalar
ref (it cannot address one element of a table per lane), so a slot is claimed
with the equivalent test-and-set: ``atomic_add(claim[slot], 1)`` returns the
previous count and exactly one claimant ever sees 0 — no check-then-write
race; on a GPU the winner writes its index.  In interpret mode (where lanes
of one vector that hit the same claim word are not serialized) each claimant
writes a token unique to its input position and reads it back (ZEN's
read-after-write check, Technique #4) to keep one winner.  (Doing the same
on a GPU left tokens in the table, cause not established; the atomic claim
alone is race-free there.)  The serial region takes one
``atomic_add`` per partition and block: the failed lanes of a block are ranked
within their partition, the first of each group reserves the group, and each
lane writes at ``r1 + base + rank`` (warp-aggregated atomics).  Claim words and
counters are float32 (exact for integers below 2^24) because JAX 0.10's Triton
lowering turns every vector ``atomic_add`` into a float add; see ``_pallas``.

Determinism.  Slot positions depend on thread timing, the *set* of indices in
each row does not (it is ``{idx ∈ I : h0(idx) = p}``).  :func:`extract` sorts
each row, so its output is identical on every worker, for both backends.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from jaxfuse import _compat

__all__ = [
    "HashPartition", "default_sizes", "extract", "hash_partition",
    "hash_partition_pallas", "hash_partition_reference", "imbalance_ratio",
    "partition_of", "partition_of_host",
]

INT32_MAX = 2**31 - 1
MAX_PARTITIONS = 64
MAX_REHASH = 16
MAX_ONEHOT = 2**15  # block × partitions of the serial step (int32: 128 KiB)
MAX_PALLAS_INDICES = 2**24
_GOLDEN = 0x9E3779B9
_MASK32 = 0xFFFFFFFF


class HashPartition(NamedTuple):
  """Output of Algorithm 1 for one worker.

  table:         int32 (n, r1 + r2); row p holds the indices of partition p,
                 in the parallel slots [0, r1) and the serial slots
                 [r1, r1 + r2); an empty slot holds the sentinel G.
  counts:        int32 (n,), indices stored in each row.
  serial_counts: int32 (n,), of which in the serial slots.
  overflowed:    int32 (), indices that found no slot (0 unless the serial
                 region of some partition filled up); never dropped silently.
  stored:        bool (N,), per input slot: its index is in the table.  False
                 for sentinel/out-of-range slots and for overflowed indices.
  """
  table: jax.Array
  counts: jax.Array
  serial_counts: jax.Array
  overflowed: jax.Array
  stored: jax.Array


# --- hashing ------------------------------------------------------------------

def _mix32_int(x: int) -> int:
  """lowbias32 on a Python int (for deriving keys on the host)."""
  x &= _MASK32
  x ^= x >> 16
  x = (x * 0x7FEB352D) & _MASK32
  x ^= x >> 15
  x = (x * 0x846CA68B) & _MASK32
  x ^= x >> 16
  return x


def _mix32(x):
  """lowbias32 (C. Wellons) on uint32 arrays; works inside Pallas kernels."""
  x = x ^ (x >> 16)
  x = x * np.uint32(0x7FEB352D)
  x = x ^ (x >> 15)
  x = x * np.uint32(0x846CA68B)
  return x ^ (x >> 16)


def _keys(seed: int, local_seed: int, k: int) -> tuple[int, ...]:
  """Keys of h0 (from `seed`) and h1..hk (from `local_seed`), all distinct."""
  keys = [_mix32_int(_mix32_int(seed) ^ _GOLDEN)]
  for i in range(1, k + 1):
    key = _mix32_int(_mix32_int(local_seed + 0x632BE5AB * i) + _GOLDEN * i)
    while key in keys:
      key = _mix32_int(key + 1)
    keys.append(key)
  return tuple(keys)


def _hash_mod(u, key, modulus: int):
  """h(u) mod `modulus` for uint32 u, as int32 (key: int or uint32 scalar)."""
  key = np.uint32(key) if isinstance(key, int) else key
  h = _mix32(u ^ key)
  return lax.rem(h, np.uint32(modulus)).astype(jnp.int32)


def _partition_key(seed) -> int:
  """The key of h0 (the same on every worker)."""
  return _keys(_seed32(seed), 0, 0)[0]


def partition_of(indices, num_partitions: int, *, seed: int = 0) -> jax.Array:
  """h0: the partition in [0, n) of each index (same on every worker)."""
  _check_int("num_partitions", num_partitions, 1, MAX_PARTITIONS)
  u = jnp.asarray(indices).astype(jnp.uint32)
  return _hash_mod(u, _partition_key(seed), num_partitions)


def partition_of_host(indices, num_partitions: int, *,
                      seed: int = 0) -> np.ndarray:
  """``partition_of`` in numpy on the host, for any number of partitions
  (sizes of ZEN's classes I_j and pulled unions, planned offline)."""
  u = np.asarray(indices).astype(np.uint32)
  mixed = _mix32(u ^ np.uint32(_partition_key(seed)))
  return (mixed % np.uint32(num_partitions)).astype(np.int64)


def imbalance_ratio(counts) -> jax.Array:
  """ZEN Definition 8: n · max_j |I^j| / |I| (= max / mean); 1.0 if |I| = 0."""
  counts = jnp.asarray(counts)
  n = counts.shape[-1]
  total = jnp.sum(counts, axis=-1).astype(jnp.float32)
  ratio = n * jnp.max(counts, axis=-1).astype(jnp.float32) / jnp.maximum(
      total, 1.0)
  return jnp.where(total > 0, ratio, 1.0)


# --- sizes and checks ---------------------------------------------------------

def default_sizes(num_indices: int) -> tuple[int, int]:
  """(r1, r2) per partition from the paper: r1 = 2N,
  r2 = max(r1/10, min(N, 32)).

  N is the capacity (the length of the index array, an upper bound on
  |I| = |G|·d_G).  Taking ``r2 ≥ N`` for small N makes overflow impossible
  there; for larger N see the module docstring.
  """
  n_idx = max(int(num_indices), 1)
  r1 = 2 * n_idx
  r2 = max(-(-r1 // 10), min(n_idx, 32))
  return r1, r2


def _check_int(name, value, lo, hi):
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise TypeError(f"{name} must be a Python int, got {value!r}")
  if not lo <= value <= hi:
    raise ValueError(f"{name}={value} must be in [{lo}, {hi}]")


def _seed32(seed) -> int:
  if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
    raise TypeError(
        f"seed must be a Python int (the hash functions are baked into the "
        f"kernel; all workers must pass the same seed), got {seed!r}")
  return int(seed) & _MASK32


class _Config(NamedTuple):
  num_partitions: int
  tensor_size: int
  r1: int
  r2: int
  k: int
  keys: tuple[int, ...]


def _config(indices, num_partitions, tensor_size, r1, r2, k, seed,
            local_seed) -> _Config:
  if indices.ndim != 1:
    raise ValueError(f"indices must be 1-D, got shape {indices.shape}")
  if not jnp.issubdtype(indices.dtype, jnp.integer):
    raise TypeError(f"indices must be integers, got {indices.dtype}")
  _check_int("num_partitions", num_partitions, 1, MAX_PARTITIONS)
  _check_int("tensor_size", tensor_size, 1, INT32_MAX)
  _check_int("k", k, 0, MAX_REHASH)
  d1, d2 = default_sizes(indices.shape[0])
  r1 = d1 if r1 is None else r1
  r2 = d2 if r2 is None else r2
  _check_int("r1", r1, 1, INT32_MAX)
  _check_int("r2", r2, 0, INT32_MAX)
  if num_partitions * (r1 + r2) + 1 > INT32_MAX:
    raise ValueError(
        f"table of {num_partitions} x ({r1} + {r2}) slots does not fit int32 "
        "addressing; use fewer partitions or smaller r1/r2")
  seed = _seed32(seed)
  local_seed = seed if local_seed is None else _seed32(local_seed)
  return _Config(int(num_partitions), int(tensor_size), int(r1), int(r2),
                 int(k), _keys(seed, local_seed, int(k)))


def _finish(table, serial_requests, stored, *, n, width, r2,
            sentinel) -> HashPartition:
  table = table.reshape(n, width)
  counts = jnp.sum(table != sentinel, axis=1, dtype=jnp.int32)
  serial_counts = jnp.minimum(serial_requests, r2).astype(jnp.int32)
  overflowed = jnp.sum(jnp.maximum(serial_requests - r2, 0), dtype=jnp.int32)
  return HashPartition(table, counts, serial_counts, overflowed, stored)


# --- reference (pure jnp) -----------------------------------------------------

def _reference(indices, cfg: _Config) -> HashPartition:
  """The seeds' keys and G are traced: one compilation per shape and sizes."""
  return _reference_jit(indices, jnp.asarray(cfg.keys, jnp.uint32),
                        jnp.int32(cfg.tensor_size),
                        (cfg.num_partitions, cfg.r1, cfg.r2))


@functools.partial(jax.jit, static_argnums=(3,))
def _reference_jit(indices, keys, g, sizes) -> HashPartition:
  n, r1, r2 = sizes
  width = r1 + r2
  size = n * width                    # out-of-range address = "nowhere"
  num = indices.shape[0]
  idx = indices.astype(jnp.int32)
  pos = jnp.arange(num, dtype=jnp.int32)
  valid = (idx >= 0) & (idx < g)
  u = idx.astype(jnp.uint32)
  part = _hash_mod(u, keys[0], n)
  table = jnp.full((size,), g, jnp.int32)
  pending = valid
  # Parallel region: round i probes h_i for every pending index at once; of
  # the indices that hit one free slot, the lowest input position wins.
  for i in range(1, keys.shape[0]):
    addr = part * width + _hash_mod(u, keys[i], r1)
    cand = pending & (table[addr] == g)
    claim = jnp.full((size,), num, jnp.int32).at[
        jnp.where(cand, addr, size)].min(pos, mode="drop")
    won = cand & (claim[addr] == pos)
    table = table.at[jnp.where(won, addr, size)].set(idx, mode="drop")
    pending = pending & ~won
  # Serial region: the j-th failed index of partition p goes to r1 + j.
  key = jnp.where(pending, part, n)
  order = jnp.argsort(key, stable=True)
  sorted_key = key[order]
  rank_sorted = pos - jnp.searchsorted(sorted_key, sorted_key, side="left")
  rank = jnp.zeros_like(pos).at[order].set(rank_sorted.astype(jnp.int32))
  ok = pending & (rank < r2)
  addr = part * width + r1 + rank
  table = table.at[jnp.where(ok, addr, size)].set(idx, mode="drop")
  serial_requests = jnp.zeros((n + 1,), jnp.int32).at[key].add(1)[:n]
  stored = valid & (~pending | ok)
  return _finish(table, serial_requests, stored, n=n, width=width, r2=r2,
                 sentinel=g)


def hash_partition_reference(indices, num_partitions: int, tensor_size: int, *,
                             r1: int | None = None, r2: int | None = None,
                             k: int = 3, seed: int = 0,
                             local_seed: int | None = None) -> HashPartition:
  """Algorithm 1 in plain jnp (any backend; vmap-able; deterministic slots).

  Args:
    indices: int 1-D (N,), distinct indices in [0, tensor_size); entries equal
      to ``tensor_size`` (or otherwise outside [0, tensor_size)) are empty
      slots and ignored.  Duplicates are each stored (a multiset).
    num_partitions: n, 1..64.
    tensor_size: G; also the sentinel that marks empty table slots.
    r1, r2: parallel / serial slots per partition (default: `default_sizes`).
    k: number of rehash functions h1..hk.
    seed: picks h0; must be the same on every worker.
    local_seed: picks h1..hk (default: `seed`); may differ per worker.
  """
  indices = jnp.asarray(indices)
  cfg = _config(indices, num_partitions, tensor_size, r1, r2, k, seed,
                local_seed)
  return _reference(indices, cfg)


# --- Pallas (Triton) kernel ---------------------------------------------------

def _next_pow2(x: int) -> int:
  return 1 << max(int(x) - 1, 0).bit_length()


def _hash_kernel(idx_ref, table_in, claim_in, counter_in,
                 table_ref, claim_ref, counter_ref, stored_ref, *,
                 cfg: _Config, block: int, n_pad: int, use_masks: bool):
  """One program places `block` consecutive input slots."""
  del table_in, claim_in, counter_in   # aliased to the outputs
  from jax.experimental import pallas as pl  # pylint: disable=g-import-not-at-top
  plt = _compat.pallas_triton()

  n, g, r1, r2 = cfg.num_partitions, cfg.tensor_size, cfg.r1, cfg.r2
  width = r1 + r2
  dump_table = n * width                 # scratch slots: masked-off lanes
  dump_claim = n * r1                    # point there, never at a real slot
  start = pl.program_id(0) * block
  offs = start + lax.broadcasted_iota(jnp.int32, (block,), 0)
  idx = idx_ref[pl.ds(start, block)]
  valid = (idx >= 0) & (idx < g)
  u = idx.astype(jnp.uint32)
  part = _hash_mod(u, cfg.keys[0], n)
  token = -2 - offs                      # unique per input slot, never an index

  def atomic_add(ref, addr, val, active):
    # float32 words: see _pallas.  Interpret mode has no masked atomics;
    # adding 0 at a scratch address is the same no-op.  On the GPU the mask
    # saves the memory traffic.
    val = jnp.where(active, val.astype(jnp.float32), 0.0)
    return plt.atomic_add(ref, addr, val, mask=active if use_masks else None)

  pending = valid
  for key in cfg.keys[1:]:
    slot = _hash_mod(u, key, r1)
    claim_addr = jnp.where(pending, part * r1 + slot, dump_claim)
    prev = atomic_add(claim_ref, claim_addr, jnp.ones_like(slot), pending)
    got = pending & (prev == 0.0)        # test-and-set: one claimant sees 0
    addr = jnp.where(got, part * width + slot, dump_table)
    if use_masks:
      won = got  # GPU: the atomic claim has exactly one winner per slot
    else:
      # Interpret mode does not serialize lanes of one vector that hit the
      # same claim word: all of them see 0. Write a token per lane and read
      # it back (ZEN's read-after-write check) to keep one winner.
      plt.store(table_ref.at[addr], token, mask=got)
      back = plt.load(table_ref.at[addr], mask=got, other=0)
      won = got & (back == token)
    plt.store(table_ref.at[jnp.where(won, addr, dump_table)], idx, mask=won)
    pending = pending & ~won

  stored_ref[pl.ds(start, block)] = (valid & ~pending).astype(jnp.int32)

  @pl.when(jnp.sum(pending.astype(jnp.int32)) > 0)
  def _serial():
    # Rank the failed lanes of this block within their partition; the first
    # of each partition (its leader) reserves the whole group with one
    # atomic_add, and the base it gets back is spread to the group by
    # reductions over a (block, n_pad) one-hot matrix.  Every atomic result
    # is used only by the lane that issued it (a (block,) tensor, one element
    # per thread), never broadcast from a smaller replicated tensor.
    cols = lax.broadcasted_iota(jnp.int32, (block, n_pad), 1)
    onehot = ((part[:, None] == cols) & pending[:, None]).astype(jnp.int32)
    rank = jnp.sum((jnp.cumsum(onehot, axis=0) - onehot) * onehot, axis=1)
    group = jnp.sum(onehot, axis=0)                           # (n_pad,)
    group_of = jnp.sum(onehot * group[None, :], axis=1)       # (block,)
    leader = pending & (rank == 0)
    old = atomic_add(counter_ref, jnp.where(leader, part, n), group_of, leader)
    old = jnp.where(leader, old.astype(jnp.int32), 0)
    base_of = jnp.sum(onehot * old[:, None], axis=0)          # (n_pad,)
    q = jnp.sum(onehot * base_of[None, :], axis=1) + rank
    ok = pending & (q < r2)
    addr = jnp.where(ok, part * width + r1 + q, dump_table)
    plt.store(table_ref.at[addr], idx, mask=ok)
    stored_ref[pl.ds(start, block)] = (valid & (~pending | ok)).astype(
        jnp.int32)


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def _pallas(indices, cfg: _Config, block: int, interpret: bool,
            num_warps: int) -> HashPartition:
  from jax.experimental import pallas as pl  # pylint: disable=g-import-not-at-top

  n, g, r1, r2 = cfg.num_partitions, cfg.tensor_size, cfg.r1, cfg.r2
  num = indices.shape[0]
  num_blocks = max(pl.cdiv(num, block), 1)
  padded = num_blocks * block
  idx = jnp.full((padded,), g, jnp.int32).at[:num].set(
      indices.astype(jnp.int32))
  n_pad = max(_next_pow2(n), 2)
  table = jnp.full((n * (r1 + r2) + 1,), g, jnp.int32)
  # Claim words and serial counters are float32 on purpose: JAX 0.10's Triton
  # lowering emits `atomic_rmw fadd` for any vector atomic_add (it tests the
  # tensor type, not its element type, for "integer"), so int32 words would
  # be added as floats (and denormals flushed to zero on the GPU).  Small
  # integers are exact in float32: a claim word only has to tell 0 from > 0,
  # and a counter stays below 2^24 because N <= 2^24.
  claim = jnp.zeros((n * r1 + 1,), jnp.float32)
  counter = jnp.zeros((n + 1,), jnp.float32)      # [n]: scratch
  # Inside shard_map (check_vma): operands and outputs vary as the indices.
  (idx, table, claim, counter), out = _compat.kernel_operands(
      idx, table, claim, counter, interpret=interpret,
      kernel="hash_partition_pallas", reference="hash_partition_reference")
  kernel = functools.partial(_hash_kernel, cfg=cfg, block=block, n_pad=n_pad,
                             use_masks=not interpret)
  compiler_params = _compat.triton_params("hash_partition_pallas", num_warps)
  params = {} if interpret else {"compiler_params": compiler_params}
  table, _, counter, stored = pl.pallas_call(
      kernel,
      grid=(num_blocks,),
      out_shape=(out(table.shape, jnp.int32), out(claim.shape, jnp.float32),
                 out(counter.shape, jnp.float32), out((padded,), jnp.int32)),
      input_output_aliases={1: 0, 2: 1, 3: 2},
      interpret=interpret,
      name="zen_hierarchical_hash",
      **params,
  )(idx, table, claim, counter)
  return _finish(table[:-1], counter[:n].astype(jnp.int32),
                 stored[:num].astype(bool), n=n, width=r1 + r2, r2=r2,
                 sentinel=g)


@_compat.x32
def hash_partition_pallas(indices, num_partitions: int, tensor_size: int, *,
                          r1: int | None = None, r2: int | None = None,
                          k: int = 3, seed: int = 0,
                          local_seed: int | None = None,
                          block_size: int = 128, num_warps: int = 4,
                          interpret: bool = False) -> HashPartition:
  """Algorithm 1 as a Pallas (Triton) kernel; arguments as the reference.

  Slot positions depend on GPU thread timing; the set of indices per row, the
  counts and `stored` (when nothing overflows) do not.  `interpret=True` runs
  the same kernel on any backend (sequential programs; for testing).

  On the GPU `block_size` (indices per program) must be at least
  ``32 * num_warps``, so that every lane of an atomic is owned by exactly one
  thread: some Triton versions return an atomic's old value only to one of
  the threads that replicate a lane (triton-lang/triton#7402).
  """
  indices = jnp.asarray(indices)
  cfg = _config(indices, num_partitions, tensor_size, r1, r2, k, seed,
                local_seed)
  _check_int("block_size", block_size, 16, 4096)
  _check_int("num_warps", num_warps, 1, 32)
  if block_size & (block_size - 1):
    raise ValueError(f"block_size={block_size} must be a power of two")
  if not interpret and block_size < 32 * num_warps:
    raise ValueError(
        f"block_size={block_size} < 32 * num_warps = {32 * num_warps}: "
        "lanes would be replicated across threads; raise block_size or lower "
        "num_warps")
  if block_size * max(_next_pow2(num_partitions), 2) > MAX_ONEHOT:
    raise ValueError(
        f"block_size={block_size} with {num_partitions} partitions: the serial "
        f"step's (block, partitions) matrix exceeds {MAX_ONEHOT} elements, "
        "more than a GPU's shared memory holds; lower block_size")
  if indices.shape[0] > MAX_PALLAS_INDICES:
    raise ValueError(
        f"{indices.shape[0]} indices: the kernel takes at most 2^24 per call "
        "(its float32 counters are exact up to there); split the array or use "
        "backend='reference'")
  return _pallas(indices, cfg, block_size, bool(interpret), num_warps)


# --- dispatch and extraction --------------------------------------------------

def hash_partition(indices, num_partitions: int, tensor_size: int, *,
                   backend: str = "auto", **kwargs) -> HashPartition:
  """Algorithm 1: the Pallas kernel or the jnp reference.

  backend: "auto" | "pallas" | "reference"; "auto" follows
  ``jaxfuse.kernels.backend()`` as every kernel does (Pallas on GPU by
  default; forced Pallas off GPU runs interpreted).  Other keyword
  arguments as :func:`hash_partition_reference` (plus the Pallas-only
  `block_size`, `num_warps`, `interpret`).
  """
  if backend not in ("auto", "pallas", "reference"):
    raise ValueError(
        f"backend={backend!r}: pick 'auto', 'pallas' or 'reference'")
  if backend == "auto":
    from jaxfuse import kernels  # pylint: disable=g-import-not-at-top
    backend = kernels.backend()
    if backend == "pallas":
      kwargs.setdefault(
          "interpret", jax.default_backend() not in ("gpu", "cuda", "rocm"))
  if backend == "pallas":
    return hash_partition_pallas(indices, num_partitions, tensor_size,
                                 **kwargs)
  for name in ("block_size", "num_warps", "interpret"):
    kwargs.pop(name, None)
  return hash_partition_reference(indices, num_partitions, tensor_size,
                                  **kwargs)


def extract(table, size: int | None = None, *,
            sentinel: int | None = None) -> jax.Array:
  """Per-partition index lists, sorted ascending, sentinel-padded: (n, size).

  Algorithm 1 lines 19-23.  Sorting makes the result independent of where
  each index landed (thread timing, backend, `local_seed`), so every worker
  gets the same lists for the same set.  The sentinel G is larger than every
  index, so it sorts to the end.  With `size` below the widest row's count
  the largest indices are cut: check ``counts <= size`` (or size the lists
  with ``max(counts)``).  `sentinel` is needed only to pad past r1 + r2.
  """
  if isinstance(table, HashPartition):
    table = table.table
  table = jnp.asarray(table)
  width = table.shape[-1]
  size = width if size is None else int(size)
  if size < 0:
    raise ValueError(f"size={size} must be >= 0")
  if size > width:
    if sentinel is None:
      raise ValueError(f"size={size} > r1 + r2 = {width}: pass sentinel= "
                       "(the tensor size G) to pad")
    table = jnp.pad(table, [(0, 0)] * (table.ndim - 1) + [(0, size - width)],
                    constant_values=sentinel)
    width = size
  if size == width:
    return jnp.sort(table, axis=-1)
  return -lax.top_k(-table, size)[0]
