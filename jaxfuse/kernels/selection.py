"""Pallas (Triton backend) kernel for fixed-capacity threshold selection.

``select_pallas(acc, tau, capacity, offset)`` returns exactly what
:func:`jaxfuse.sparsify.select` returns, bit for bit: the candidates
``M = {i : |acc_i| ≥ τ, acc_i ≠ 0}`` ranked in the rotated order
``offset, offset+1, …, n−1, 0, …, offset−1``, the first ``capacity`` written to
slots ``0, 1, …`` (value in ``acc``'s dtype, int32 index), the other slots
holding the sentinel index ``n`` and the value 0, and the true count ``|M|``.

The reference does a full-length cumsum and a scatter of n elements; this
reads ``acc`` about once. ``acc`` is cut in blocks of B elements (one program
each), a block in tiles of T (B, T powers of two; T < B makes the program loop
over its tiles, loading tile t+1 before working on tile t):

* **Pass 1**: per tile, the candidate mask and its inclusive cumsum (plus the
  running count of the block) give each candidate its rank ``lc`` in the
  block; the first S candidates are *staged*, compacted in position order,
  as (value, index) at ``stage[b·S + lc − 1]`` (S = B/8 by default). Output:
  the block's count.
* **Glue** (XLA, over ⌈n/B⌉ numbers): ``start`` = exclusive cumsum of the
  counts, ``total`` = their sum, ``before`` = candidates in ``[0, offset)`` =
  ``start`` of offset's block + the candidates of that block before offset
  (one block of ``acc`` re-read by XLA).
* **Pass 2**: the j-th candidate of block b has the global inclusive rank
  ``r = start_b + j + 1`` and, as in the reference, the slot
  ``r − before − 1`` if its position is ≥ offset, else ``r + total − before −
  1``; it is written if the slot is < capacity. A block whose smallest slot
  is ≥ capacity does nothing (with the rotation, only the blocks right after
  ``offset`` win when the candidates overflow). A block with ≤ S candidates
  scatters its staged pairs (``acc`` is not read again); a denser block
  re-reads its ``acc`` tiles and redoes the cumsum. Each program also writes
  the sentinel (0, n) into its share of the slots ``[min(total, capacity),
  capacity)``, so every slot is written exactly once.

Slot positions follow from the scans alone: the result is deterministic, no
atomics.

Comparison semantics: ``|acc| ≥ τ`` is evaluated as the reference evaluates
it (τ is promoted with ``acc``'s dtype by JAX's rules, so a Python float τ is
rounded to bfloat16 for a bfloat16 ``acc``), then compared in float32, which
is exact. NaN never passes; +inf passes any finite τ; τ = +inf keeps only
±inf; τ = NaN keeps nothing.
"""

from __future__ import annotations

import functools

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

# Fastest of the configurations swept on an H100 (benchmarks/kernels.py).
DEFAULT_BLOCK = 8192
DEFAULT_TILE = 1024
DEFAULT_NUM_WARPS = 4
FILL_TILE = 1024


def _round_to_bfloat16(t32: jax.Array) -> jax.Array:
  """float32 → the float32 value of its bfloat16 rounding (to nearest even).

  Done on the bits: XLA on GPU may drop a float32→bfloat16→float32 round
  trip of converts (it allows excess precision), which would change τ.
  """
  bits = lax.bitcast_convert_type(t32, jnp.uint32)
  bits = (bits + jnp.uint32(0x7FFF) + ((bits >> 16) & jnp.uint32(1))) & (
      jnp.uint32(0xFFFF0000))
  return jnp.where(jnp.isnan(t32), t32,
                   lax.bitcast_convert_type(bits, jnp.float32))


def _comparison_threshold(acc_dtype, tau) -> jax.Array:
  """τ as the float32 ``t`` with  |a| ≥ τ  ⟺  f32(|a|) ≥ t  for every a.

  The comparison dtype is the reference's own (``jnp.abs(acc) >= tau``
  promotes by JAX's rules: a weakly typed τ, e.g. a Python float, takes
  ``acc``'s dtype and is rounded to it; a float32 τ stays float32). τ rounded
  to that dtype, as float32, compares exactly like the reference. A
  wider-than-float32 τ is rounded *up* to the next float32, which keeps the
  comparison exact for float32 and narrower magnitudes.
  """
  cmp_dtype = jnp.dtype(jnp.result_type(acc_dtype, tau))
  t = jnp.asarray(tau)
  if t.size != 1:
    raise ValueError(f"tau must be a scalar, got shape {t.shape}")
  t = jnp.reshape(t, ())
  if cmp_dtype.itemsize > 4:
    t = t.astype(cmp_dtype)
    t32 = t.astype(jnp.float32)
    return jnp.where(t32.astype(cmp_dtype) < t,
                     jnp.nextafter(t32, jnp.float32(jnp.inf)), t32)
  t32 = t.astype(jnp.float32)
  if cmp_dtype == jnp.bfloat16:
    return _round_to_bfloat16(t32)
  if cmp_dtype == jnp.float16:
    return lax.reduce_precision(t32, exponent_bits=5, mantissa_bits=10)
  return t32


def _candidates(x, pos, n, tau):
  xf = x.astype(jnp.float32)
  return (pos < n) & (jnp.abs(xf) >= tau) & (xf != 0)


def _masked_index(ok, index, out_of_range, interpret):
  # Triton never touches masked lanes; the interpreter scatters them, so they
  # must point out of range (where the scatter drops them).
  return jnp.where(ok, index, out_of_range) if interpret else index


def _for_each_tile(acc_ref, b, n, block, tile, body, carry):
  """carry = body(pos, x, carry) over the tiles of block b, in order.

  ``acc_ref`` is the whole array. Full blocks load without a mask (so the
  loads vectorize whatever n is); only the last block, if partial, masks.
  With several tiles, the load of tile t+1 is issued before the work on
  tile t.
  """
  ntiles = block // tile
  lanes = lax.broadcasted_iota(jnp.int32, (tile,), 0)

  def run(masked):
    def load(t):
      pos = b * block + t * tile + lanes
      ref = acc_ref.at[pl.ds(b * block + t * tile, tile)]
      return pos, (plgpu.load(ref, mask=pos < n) if masked else ref[...])

    if ntiles == 1:
      return body(*load(0), carry)

    def step(t, state):
      pos, x, c = state
      nxt = load(jnp.minimum(t + 1, ntiles - 1))
      return (*nxt, body(pos, x, c))

    return lax.fori_loop(0, ntiles, step, (*load(0), carry))[2]

  size = acc_ref.shape[0]                  # n, or block if n < block (padded)
  if size % block == 0:
    return run(masked=False)
  last = size // block                     # the partial block
  return lax.cond(b == last, lambda: run(masked=True),
                  lambda: run(masked=False))


def _count_kernel(tau_ref, acc_ref, cnt_ref, sv_ref, si_ref, *, n, block, tile,
                  stage, interpret):
  b = pl.program_id(0)
  tau = tau_ref[0]

  def body(pos, x, run):
    m = _candidates(x, pos, n, tau)
    mi = m.astype(jnp.int32)
    lc = run + jnp.cumsum(mi)                        # inclusive rank in block
    ok = m & (lc <= stage)
    slot = _masked_index(ok, lc - 1, stage, interpret)
    plgpu.store(sv_ref.at[slot], x, mask=ok)
    plgpu.store(si_ref.at[slot], pos, mask=ok)
    return run + jnp.sum(mi)

  cnt_ref[b] = _for_each_tile(acc_ref, b, n, block, tile, body, jnp.int32(0))


def _write_kernel(scal_ref, tau_ref, cnt_ref, start_ref, acc_ref, sv_ref,
                  si_ref, v_ref, i_ref, *, n, block, tile, stage, capacity,
                  fill_per_program, interpret):
  b = pl.program_id(0)
  offset = scal_ref[0]
  before = scal_ref[1]
  total = scal_ref[2]
  cnt = cnt_ref[b]
  start = start_ref[b]
  first_pos = b * block
  # Smallest slot of the block (0 if the block straddles offset).
  first = jnp.where(first_pos >= offset, start - before,
                    jnp.where(first_pos + block <= offset,
                              start + total - before, 0))
  need = (cnt > 0) & (first < capacity)

  def emit(rank, pos, vals, valid):
    slot = jnp.where(pos >= offset, rank - before, rank + total - before) - 1
    ok = valid & (slot < capacity)
    slot = _masked_index(ok, slot, capacity, interpret)
    plgpu.store(v_ref.at[slot], vals, mask=ok)
    plgpu.store(i_ref.at[slot], pos, mask=ok)

  @pl.when(need & (cnt <= stage))
  def _staged():
    j = lax.broadcasted_iota(jnp.int32, (stage,), 0)
    valid = j < cnt
    emit(start + j + 1, plgpu.load(si_ref, mask=valid),
         plgpu.load(sv_ref, mask=valid), valid)

  @pl.when(need & (cnt > stage))
  def _dense():
    tau = tau_ref[0]

    def body(pos, x, run):
      m = _candidates(x, pos, n, tau)
      mi = m.astype(jnp.int32)
      emit(start + run + jnp.cumsum(mi), pos, x, m)
      return run + jnp.sum(mi)

    _for_each_tile(acc_ref, b, n, block, tile, body, jnp.int32(0))

  # Sentinels: program b fills its share of [min(total, capacity), capacity).
  fill_tile = min(FILL_TILE, fill_per_program)
  fill_from = jnp.minimum(total, capacity) + b * fill_per_program
  lanes = lax.broadcasted_iota(jnp.int32, (fill_tile,), 0)

  def fill(k, carry):
    slot = fill_from + k * fill_tile + lanes
    ok = slot < capacity
    slot = _masked_index(ok, slot, capacity, interpret)
    plgpu.store(v_ref.at[slot], jnp.zeros((fill_tile,), v_ref.dtype), mask=ok)
    plgpu.store(i_ref.at[slot], jnp.full((fill_tile,), n, jnp.int32), mask=ok)
    return carry

  if fill_per_program == fill_tile:
    fill(0, 0)
  else:
    lax.fori_loop(0, fill_per_program // fill_tile, fill, 0)


def _vary_alike(*xs):
  """Cast xs to vary over the union of their varying manual (shard_map) axes;
  a no-op outside shard_map."""
  mats = [getattr(jax.typeof(x), "mat", None) for x in xs]
  if any(m is None for m in mats):
    return xs
  axes = frozenset().union(*(m.varying for m in mats))
  return tuple(
      lax.pcast(x, tuple(sorted(axes - m.varying)), to="varying")
      if axes - m.varying else x for x, m in zip(xs, mats))


def _is_pow2(v: int) -> bool:
  return v >= 1 and (v & (v - 1)) == 0


@functools.partial(jax.jit, static_argnames=("capacity", "block", "tile",
                                             "stage", "num_warps",
                                             "interpret"))
def select_pallas(acc: jax.Array, tau, capacity: int, offset, *,
                  block: int | None = None, tile: int | None = None,
                  stage: int | None = None, num_warps: int | None = None,
                  interpret: bool = False
                  ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Drop-in for :func:`jaxfuse.sparsify.select` as two Pallas kernels.

  Args:
    acc: flat float array (float32, bfloat16 or float16) of n elements.
    tau: scalar threshold (any float; promoted with ``acc`` as the reference).
    capacity: number of output slots (static).
    offset: int scalar, where the rotated order starts (in [0, n); values
      outside behave as in the reference).
    block: elements per program, a power of two (default 8192, or n rounded
      up to a power of two if smaller).
    tile: elements per step inside a program, a power of two dividing
      ``block`` (default min(1024, block)).
    stage: staged candidates per block, a power of two ≤ block (default
      block/8); blocks with more candidates re-read ``acc`` in pass 2.
    num_warps: Triton warps per program (default 4).
    interpret: run the kernels in the Pallas interpreter (any backend).

  Returns:
    (values[capacity] in acc's dtype, indices[capacity] int32, count int32).
  """
  if acc.ndim != 1:
    raise ValueError(f"acc must be flat (1-D), got shape {acc.shape}")
  n = acc.shape[0]
  if n < 1:
    raise ValueError("acc must not be empty")
  if not jnp.issubdtype(acc.dtype, jnp.floating) or acc.dtype.itemsize > 4:
    raise ValueError(f"acc must be float32/bfloat16/float16, got {acc.dtype}")
  if capacity < 1:
    raise ValueError(f"capacity must be >= 1, got {capacity}")
  if block is None:
    block = min(DEFAULT_BLOCK, max(16, pl.next_power_of_2(n)))
  if not _is_pow2(block) or block < 2:
    raise ValueError(f"block must be a power of two >= 2, got {block}")
  if tile is None:
    tile = min(DEFAULT_TILE, block)
  if not _is_pow2(tile) or tile > block or tile < 2:
    raise ValueError(f"tile must be a power of two in [2, block], got {tile}")
  if stage is None:
    stage = max(1, block // 8)
  if not _is_pow2(stage) or stage > block:
    raise ValueError(f"stage must be a power of two <= block, got {stage}")
  num_blocks = pl.cdiv(n, block)
  if num_blocks * block + block >= 2**31 or capacity >= 2**30:
    raise ValueError(f"acc too large for int32 positions: n={n}")
  # Sentinel slots per program: a power of two, so a multiple of the fill tile.
  fill_per_program = pl.next_power_of_2(pl.cdiv(capacity, num_blocks))
  params = plgpu.CompilerParams(num_warps=num_warps or DEFAULT_NUM_WARPS)

  tau32 = _comparison_threshold(acc.dtype, tau)
  offset = jnp.asarray(offset, jnp.int32)
  # The kernels read acc whole (tiles by pl.ds); a single short block is
  # padded (with zeros, which are never candidates) so no tile overhangs.
  acc_k = jnp.pad(acc, (0, block - n)) if n < block else acc
  whole = pl.BlockSpec()                   # the whole array in every program
  stage_spec = pl.BlockSpec((stage,), lambda b: (b,))
  grid = (num_blocks,)

  # Inside shard_map (check_vma): every kernel operand and output varies over
  # the union of the mesh axes that acc, tau and offset vary over.
  acc_k, tau32, offset = _vary_alike(acc_k, tau32, offset)
  mat = getattr(jax.typeof(acc_k), "mat", None)
  if interpret and mat is not None and mat.varying:
    raise NotImplementedError(
        "select_pallas(interpret=True) inside shard_map needs "
        "check_vma=False: the Pallas interpreter of JAX 0.10-0.12 fails on "
        "operands that vary over manual axes. Off GPU, use "
        "jaxfuse.sparsify.select (the reference) instead.")
  out = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype,
                                                  manual_axis_type=mat)

  counts, staged_v, staged_i = pl.pallas_call(
      functools.partial(_count_kernel, n=n, block=block, tile=tile,
                        stage=stage, interpret=interpret),
      out_shape=(out((num_blocks,), jnp.int32),
                 out((num_blocks * stage,), acc.dtype),
                 out((num_blocks * stage,), jnp.int32)),
      grid=grid,
      in_specs=[whole, whole],
      out_specs=(whole, stage_spec, stage_spec),
      compiler_params=params,
      interpret=interpret,
      name="jaxfuse_select_count",
  )(jnp.reshape(tau32, (1,)), acc_k)

  inclusive = jnp.cumsum(counts, dtype=jnp.int32)
  start = inclusive - counts
  total = inclusive[-1]
  # before = candidates in [0, offset): whole blocks from the scan, the rest
  # of offset's block re-read here (one block of acc).
  ob = jnp.clip(offset, 0, n - 1) // block
  span = min(block, n)
  lo = jnp.clip(ob * block, 0, n - span)
  seg = lax.dynamic_slice(acc, (lo,), (span,))
  pos = lo + jnp.arange(span, dtype=jnp.int32)
  in_block = _candidates(seg, pos, n, tau32) & (pos >= ob * block) & (
      pos < offset)
  before = start[ob] + jnp.sum(in_block, dtype=jnp.int32)
  before = jnp.where(offset <= 0, 0, jnp.where(offset >= n, total, before))
  scal = jnp.stack([offset, before, total])

  values, indices = pl.pallas_call(
      functools.partial(_write_kernel, n=n, block=block, tile=tile,
                        stage=stage, capacity=capacity,
                        fill_per_program=fill_per_program,
                        interpret=interpret),
      out_shape=(out((capacity,), acc.dtype), out((capacity,), jnp.int32)),
      grid=grid,
      in_specs=[whole, whole, whole, whole, whole, stage_spec, stage_spec],
      out_specs=(whole, whole),
      compiler_params=params,
      interpret=interpret,
      name="jaxfuse_select_write",
  )(scal, jnp.reshape(tau32, (1,)), counts, start, acc_k, staged_v,
    staged_i)
  return values, indices, total
