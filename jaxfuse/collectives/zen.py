"""``"zen"``: ZEN's Balanced Parallelism (OSDI'25 §3): push, reduce, pull.

One sparse bucket, its units flattened to one index space [0, N) (C slots,
sentinel N), K workers, h0 the seeded first-level hash of
``kernels.hash_partition`` (the same on every worker) and its classes
I_j = {i ∈ [0, N) : h0(i) = j}:

  push    Alg. 1 (hierarchical hash) puts this worker's indices into K rows
          of r1 = ⌈table·C/K⌉ parallel + r2 = ⌈r1/4⌉ serial slots; each
          row is compacted to P = min(r1 + r2, ⌈C/K + 4·√(C/K)⌉) slots
          (the balanced share plus four standard deviations of its
          binomial spread: h0 is data independent, Theorem 2) and row j
          (indices and values, packed) goes to worker j in one tiled
          all_to_all. A slot that finds no room in the table (``stored``
          False) or on the wire is kept by its sender.
  reduce  worker j adds the K rows it received, in rank order, into a dense
          f32 sum s_j (i ∈ I_j) and a hit mask; within a row the indices are
          distinct, so each element's sum order is the rank order whatever
          the slot positions (thread timing, backend).
  pull    U = min(⌈union·C⌉, B) slots (B = max_j |I_j|) take s_j/K
          at the hits of I_j, in increasing index order; when more than U
          hit, the U largest |s_j| go and the others stay with the reducer
          (kept_j += s_j: late, not lost, and growing there until they go).
          One all_gather of the K reduced partitions (and a non-finite flag
          per worker); they are disjoint, so the mean is one scatter,
          bitwise the same on every worker.

Conservation (every sent slot is kept by its sender, or lands in one s_j and
is pulled or kept by the reducer)::

  K·ĝ + Σ_k kept_k = Σ_k sent_k          (up to the rounding of s/K)

Pull encoding (Alg. 2, hash bitmap): partition j as ⌈B/32⌉ words of bits
over I_j in increasing order, plus its values in that order, instead of U
int32 indices; chosen statically iff ⌈B/32⌉ < U (the union slots are denser
than 1/32 of I_j). Decoding needs rank(i) = |{i' < i : h0(i') = h0(i)}|
(``_ranks``: per-partition bit masks of 32 indices and their popcounts, no
sort; the same on every worker); then
bit(i) = word_{h0(i)}[rank >> 5] >> (rank & 31) and its value sits at
popcount(words before) + popcount(lower bits of its word).

With Zen(union=1) and tables that do not overflow, ĝ equals ``"allgather"``'s
bit for bit: the same f32 sums in rank order, the same division by K.
A non-finite value sent by any worker makes all of the bucket's ĝ NaN on
every worker (even where it overflowed) and is never kept, so
``optax.apply_if_finite`` skips the step and no residual is poisoned.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import ClassVar, NamedTuple, Sequence

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from jaxfuse import _compat
from jaxfuse import fusion
from jaxfuse import plans
from jaxfuse.collectives import base
from jaxfuse.kernels import hash_partition as hp

_CHUNK = 1 << 22          # host hashing of [0, N) in chunks (bounded memory)
MAX_BUCKET = 2**31 - 2    # one int32 index space with a sentinel left over
PUSH_SPREAD = 4.0         # push slots: C/K plus this many sqrt(C/K)


# --- on the host: sizes of the classes I_j and of the pulled unions ---------

@functools.lru_cache(maxsize=256)
def partition_sizes(size: int, num_partitions: int,
                    seed: int = 0) -> tuple[int, ...]:
  """|I_j| for j < K: how h0 splits [0, N) (host, O(N) once per N, K, seed)."""
  counts = np.zeros(num_partitions, np.int64)
  for start in range(0, size, _CHUNK):
    idx = np.arange(start, min(size, start + _CHUNK), dtype=np.int64)
    counts += np.bincount(
        hp.partition_of_host(idx, num_partitions, seed=seed),
        minlength=num_partitions)
  return tuple(int(c) for c in counts)


def union_sizes(index_sets: Sequence, num_partitions: int, size: int, *,
                seed: int = 0) -> np.ndarray:
  """|∪_k {i ∈ S_k : h0(i) = j}| per partition j (int64 (K,)).

  What partition j's pull carries before the U cap, for per-worker selected
  index sets S_k (entries outside [0, N) are ignored): C/K on average when
  the workers pick the same indices, up to C when they pick disjoint ones.
  """
  sets = [np.asarray(s, np.int64).reshape(-1) for s in index_sets]
  union = np.unique(np.concatenate(sets)) if sets else np.zeros(0, np.int64)
  union = union[(union >= 0) & (union < size)]
  return np.bincount(hp.partition_of_host(union, num_partitions, seed=seed),
                     minlength=num_partitions).astype(np.int64)


# --- static layout ------------------------------------------------------------

class TableLayout(NamedTuple):
  """A bucket's ZEN sizes: hash table, push rows, pull union, encoding."""
  size: int          # N
  slots: int         # C
  dtype: np.dtype    # the bucket's values
  r1: int            # parallel slots per push row
  r2: int            # serial slots per push row
  push: int          # P, slots per partition on the wire
  union: int         # U, pull slots per partition
  class_max: int     # B = max_j |I_j|
  bitmap: bool       # pull indices as a hash bitmap (else int32)

  @property
  def width(self) -> int:
    return self.r1 + self.r2

  @property
  def bitmap_words(self) -> int:
    return -(-self.class_max // 32)

  @property
  def push_words(self) -> tuple[int, int]:
    """uint32 words of one push row: values, indices."""
    return plans.num_words(self.push, self.dtype), self.push

  @property
  def pull_words(self) -> tuple[int, int, int]:
    """uint32 words of one reduced partition: values, index code, and the
    sender's non-finite flag."""
    return (plans.num_words(self.union, self.dtype),
            self.bitmap_words if self.bitmap else self.union, 1)


def layout(units: Sequence[plans.Unit], num_workers: int,
           settings: plans.Settings, config: "Zen | None" = None
           ) -> TableLayout:
  """Table, union and encoding sizes: a function of N, C, K, the seed
  (``settings.seed``) and the scheme's ``config`` (None: its defaults,
  ``Zen()``)."""
  if config is None:
    config = Zen()
  size = sum(u.size for u in units)
  slots = sum(u.capacity for u in units)
  dtype = np.dtype(jnp.result_type(*[u.dtype for u in units]))
  k = num_workers
  r1 = max(1, math.ceil(plans.decimal_product(slots, config.table)
                        / k))
  r2 = math.ceil(r1 / 4)
  class_max = max(partition_sizes(size, k, settings.seed))
  share = slots / k
  push = min(r1 + r2, slots, class_max,
             math.ceil(share + PUSH_SPREAD * math.sqrt(share)))
  union = max(1, min(plans.ceil_product(slots, config.union),
                     class_max))
  bitmap = -(-class_max // 32) < union
  return TableLayout(size, slots, dtype, r1, r2, push, union, class_max,
                     bitmap)


# --- in-graph pieces ----------------------------------------------------------

def _acc_dtype(dtype):
  return jnp.promote_types(dtype, jnp.float32)


def _reduce(values, indices, size: int, axis_name: str):
  """K received rows -> (Σ_r scatter(idx_r, v_r) in f32, hit mask), rows
  added one at a time in rank order (one writer per element per row)."""
  ok = (indices >= 0) & (indices < size)       # a negative index must not wrap
  indices = jnp.where(ok, indices, size)
  acc = jnp.zeros((size,), _acc_dtype(values.dtype))
  hit = jnp.zeros((size,), jnp.bool_)

  def add(r, carry):
    acc, hit = carry
    return (acc.at[indices[r]].add(values[r].astype(acc.dtype), mode="drop"),
            hit.at[indices[r]].set(True, mode="drop"))

  # A loop, not K unrolled scatters: the same order, less to compile. The
  # carry varies over every axis the rows vary over (more than axis_name
  # when an outer scheme, "hier", runs this one over its host axis).
  axes = (_compat.varying_axes(values) | _compat.varying_axes(indices) |
          set(axis_name if isinstance(axis_name, tuple) else (axis_name,)))
  init = _compat.to_varying((acc, hit), tuple(sorted(axes)))
  return lax.fori_loop(0, values.shape[0], add, init)


def _take(hit, sums, union: int, bound: int):
  """Which hits fill the U pull slots: all when they fit, else the U largest
  |s| (the rest wait in the reducer's residual, where they grow; taking the
  lowest indices instead would starve the top of I_j). The hits, at most
  ``bound`` (K rows of P), are compacted first, so the top-k is over them,
  not over N."""
  size = hit.shape[0]

  def largest():
    pos = jnp.cumsum(hit, dtype=jnp.int32) - 1
    cand = jnp.full((bound,), size, jnp.int32).at[
        jnp.where(hit, pos, bound)].set(jnp.arange(size, dtype=jnp.int32),
                                        mode="drop")
    mag = jnp.abs(sums.at[cand].get(mode="fill", fill_value=0))
    mag = jnp.where((cand < size) & ~jnp.isnan(mag), mag, -1)
    _, top = lax.top_k(mag, union)
    return hit & jnp.zeros_like(hit).at[cand[top]].set(True, mode="drop")
  return lax.cond(jnp.sum(hit, dtype=jnp.int32) <= union, lambda: hit,
                  largest)


def _ranks(size: int, num_partitions: int, seed: int):
  """(h0(i), rank of i inside I_{h0(i)}) for every i in [0, N), int32.

  No sort: in blocks of 32 consecutive indices, m[b, p] has bit t set iff
  h0(32b + t) = p, so with i = 32b + t and p = h0(i)
  rank(i) = Σ_{b' < b} popcount(m[b', p]) + popcount(m[b, p] & (2^t − 1))
  (N·K compares fused into one reduction; N·K/32 words).
  """
  blocks = -(-size // 32)
  pos = jnp.arange(blocks * 32, dtype=jnp.int32)
  part = jnp.where(pos < size, hp.partition_of(pos, num_partitions, seed=seed),
                   num_partitions).reshape(blocks, 32)
  bit = jnp.left_shift(jnp.uint32(1), jnp.arange(32, dtype=jnp.uint32))
  masks = jnp.sum(jnp.where(part[:, :, None] == jnp.arange(num_partitions),
                            bit[None, :, None], jnp.uint32(0)),
                  axis=1, dtype=jnp.uint32)                  # (blocks, K)
  counts = lax.population_count(masks).astype(jnp.int32)
  before = jnp.cumsum(counts, axis=0) - counts
  p = jnp.minimum(part, num_partitions - 1)
  lower = jnp.take_along_axis(masks, p, axis=1) & (bit - jnp.uint32(1))
  rank = (jnp.take_along_axis(before, p, axis=1) +
          lax.population_count(lower).astype(jnp.int32))
  return part.reshape(-1)[:size], rank.reshape(-1)[:size]


def _bitmap_encode(slot_index, rank, size: int, words: int):
  """Bits rank(i) of the pulled i (sentinel ``size``: none; all in one class
  I_j) as uint32 words; the U slots are scattered, not all N."""
  ok = slot_index < size
  r = rank.at[slot_index].get(mode="fill", fill_value=0)
  bit = jnp.left_shift(jnp.uint32(1), (r & 31).astype(jnp.uint32))
  return jnp.zeros((words,), jnp.uint32).at[
      jnp.where(ok, r >> 5, words)].add(bit, mode="drop")


def _bitmap_decode(bitmaps, values, part, rank):
  """(K, words) bitmaps and (K, U) values -> dense (N,) (Alg. 2 decode)."""
  word = bitmaps[part, rank >> 5]
  shift = (rank & 31).astype(jnp.uint32)
  bit = (word >> shift) & jnp.uint32(1)
  count = lax.population_count(bitmaps).astype(jnp.int32)
  before = jnp.cumsum(count, axis=1) - count
  lower = word & (jnp.left_shift(jnp.uint32(1), shift) - jnp.uint32(1))
  slot = before[part, rank >> 5] + lax.population_count(lower).astype(
      jnp.int32)
  slot = jnp.minimum(slot, values.shape[1] - 1)
  return jnp.where(bit == 1, values[part, slot], jnp.zeros((), values.dtype))


def _compact_rows(table, size: int, push: int):
  """(K, W) table rows -> (K, P) rows of their entries in slot order (the
  sentinel ``size`` pads), and the entries past P, flat (sentinel padded)."""
  valid = (table >= 0) & (table < size)
  pos = jnp.cumsum(valid, axis=1, dtype=jnp.int32) - 1
  fits = valid & (pos < push)
  row = jnp.arange(table.shape[0])[:, None]
  rows = jnp.full((table.shape[0], push), size, jnp.int32).at[
      row, jnp.where(fits, pos, push)].set(table, mode="drop")
  return rows, jnp.where(valid & ~fits, table, size).reshape(-1)


def _hash(indices, lay: TableLayout, num_workers: int, seed: int):
  """Alg. 1 as ``jaxfuse.kernels.backend()`` says (``backend="auto"``):
  the Pallas kernel wherever it is "pallas" (compiled on GPU, inside
  shard_map too: its outputs vary as the indices do), else the jnp
  reference (the same rows as sets, the same ``stored``)."""
  return hp.hash_partition(indices, num_workers, lay.size, r1=lay.r1,
                           r2=lay.r2, seed=seed, backend="auto")


# --- the scheme ---------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Zen(base.AnyMesh):
  """``"zen"`` and its configuration.

  table: push hash-table slots per partition over the balanced share,
    r1 = ⌈table·C/K⌉ (C: the bucket's slots), plus r2 = ⌈r1/4⌉ serial
    slots; each row goes on the wire in C/K + 4·√(C/K) slots; what finds
    no slot stays in the sender's residual.
  union: pull slots per reduced partition as a share of the bucket's C (1:
    lossless even with no overlap; the union of K workers' partitions is
    between C/K and C); past it the largest sums go and the rest stay in
    the reducing worker's residual.
  """
  table: float = 2.0
  union: float = 1.0
  name: ClassVar[str] = "zen"
  sparse: ClassVar[bool] = True
  packs_indices: ClassVar[bool] = False   # int32 indices

  def check(self, where: str, num_workers: int, settings) -> None:
    del settings
    if num_workers > hp.MAX_PARTITIONS:
      raise base.SchemeError(
          f"{where}: collective 'zen' hashes into one partition per worker "
          f"and takes at most {hp.MAX_PARTITIONS} workers, got {num_workers}; "
          "use 'allgather' for this bucket, or Hier(inner=Zen()) "
          f"over at most {hp.MAX_PARTITIONS} hosts.")

  def sync(self, parts, units, axis_name, settings) -> base.Synced:
    k = _compat.axis_size(axis_name)
    size = sum(u.size for u in units)
    if size > MAX_BUCKET:
      raise base.SchemeError(
          f"collective 'zen': a bucket of {size} elements exceeds one int32 "
          "index space; split it into smaller buckets (bucket_bytes).")
    lay = layout(units, k, settings, self)
    n, dtype = lay.size, lay.dtype
    acc_dtype = _acc_dtype(dtype)
    values, indices = base.to_bucket(parts, units)
    valid = (indices >= 0) & (indices < n)
    indices = jnp.where(valid, indices, n)

    # Push: Alg. 1 rows, each compacted to P slots; what finds no slot in
    # the table or on the wire stays here.
    table = _hash(indices, lay, k, settings.seed)
    dense = jnp.zeros((n,), dtype).at[indices].set(values, mode="drop")
    rows, late = _compact_rows(table.table, n, lay.push)
    row_values = dense.at[rows].get(mode="fill", fill_value=0)
    lost = jnp.concatenate([jnp.where(table.stored, n, indices), late])
    kept = jnp.zeros((n,), acc_dtype).at[lost].add(
        dense.at[lost].get(mode="fill", fill_value=0).astype(acc_dtype),
        mode="drop")
    send = jnp.concatenate([jax.vmap(fusion.to_words)(row_values),
                            lax.bitcast_convert_type(rows, jnp.uint32)],
                           axis=1)
    got = lax.all_to_all(send, axis_name, 0, 0, tiled=True)
    nv, _ = lay.push_words
    sums, hit = _reduce(fusion.from_words(got[:, :nv], dtype, lay.push),
                        lax.bitcast_convert_type(got[:, nv:], jnp.int32), n,
                        axis_name)

    # Pull: U slots of I_j's hits (the largest if more), in index order;
    # the rest stay here.
    take = _take(hit, sums, lay.union,
                 min(k * lay.push, lay.class_max, n))
    taken = jnp.cumsum(take, dtype=jnp.int32) - 1
    kept = kept + jnp.where(hit & ~take, sums, 0)
    pos = jnp.arange(n, dtype=jnp.int32)
    slot_index = jnp.full((lay.union,), n, jnp.int32).at[
        jnp.where(take, taken, lay.union)].set(pos, mode="drop")
    mean = (sums / k).astype(dtype)
    if jnp.dtype(dtype) != acc_dtype:
      # The reducer keeps what its sums lose on a narrower wire:
      # Σ = K·wire(Σ/K) + kept, up to acc_dtype's rounding.
      kept = kept + jnp.where(take, sums - k * mean.astype(acc_dtype), 0)
    pull_values = mean.at[slot_index].get(mode="fill", fill_value=0)
    if lay.bitmap:
      part, rank = _ranks(n, k, settings.seed)
      code = _bitmap_encode(slot_index, rank, n, lay.bitmap_words)
    else:
      code = lax.bitcast_convert_type(slot_index, jnp.uint32)
    bad = ~jnp.all(jnp.isfinite(jnp.where(valid, values, 0)))
    words = jnp.concatenate([fusion.to_words(pull_values), code,
                             bad.astype(jnp.uint32)[None]])
    gathered = _compat.all_gather_invariant(words, axis_name)   # (K, W)
    nv, ni, _ = lay.pull_words
    got_values = fusion.from_words(gathered[:, :nv], dtype, lay.union)
    if lay.bitmap:
      out = _bitmap_decode(gathered[:, nv:nv + ni], got_values, part, rank)
    else:
      got_index = lax.bitcast_convert_type(gathered[:, nv:nv + ni], jnp.int32)
      out = jnp.zeros((n,), dtype).at[got_index.reshape(-1)].set(
          got_values.reshape(-1), mode="drop")
    # A non-finite value sent anywhere shows in ĝ on every worker even if it
    # overflowed, and never enters a residual.
    out = jnp.where(jnp.any(gathered[:, -1] != 0), jnp.nan, out).astype(dtype)
    kept = jnp.where(jnp.isfinite(kept), kept, 0)
    return base.Synced(base.from_bucket(out, units),
                       base.from_bucket(kept, units, acc_dtype))

  def steps(self, units, num_workers, settings):
    """all_to_all of K push rows, all_gather of one reduced partition."""
    lay = layout(units, num_workers, settings, self)
    return (base.Step("alltoall", 4 * num_workers * sum(lay.push_words)),
            base.Step("allgather", 4 * sum(lay.pull_words)))
