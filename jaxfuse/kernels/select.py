"""Pallas (Triton backend) kernel for fixed-capacity threshold selection.

``select_pallas(acc, tau, capacity, offset)`` returns exactly what
:func:`jaxfuse.sparsify.select` returns, bit for bit: the candidates
``M = {i : |acc_i| ≥ τ, acc_i ≠ 0}`` ranked in the rotated order
``offset, offset+1, …, n−1, 0, …, offset−1``, the first ``capacity`` written to
slots ``0, 1, …`` (value in ``acc``'s dtype, int32 index), the other slots
holding the sentinel index ``n`` and the value 0, and the true count ``|M|``.

The reference does a full-length cumsum and a scatter of n elements; this
reads ``acc`` about once. With blocks of B elements (B a power of two):

* **Pass 1** (one program per block): mask, local inclusive cumsum ``lc``;
  store the block's candidate counts before / from ``offset`` (``lo``, ``hi``)
  and *stage* the block's first S candidates, compacted in position order
  (value, index), at ``stage[b·S + lc − 1]`` (S = B/8 by default).
* **Glue** (XLA, over ⌈n/B⌉ numbers): ``cnt = lo + hi``; ``start`` = exclusive
  cumsum of ``cnt``; ``total = Σ cnt``; ``before = Σ lo`` (candidates in
  ``[0, offset)``).
* **Pass 2** (one program per block): the j-th candidate of block b has the
  global inclusive rank ``r = start_b + j + 1`` and, as in the reference, the
  rotated slot ``r − before − 1`` if its position is ≥ offset, else
  ``r + total − before − 1``. A block whose smallest slot is ≥ capacity does
  nothing (with the rotation, only the blocks right after ``offset`` win when
  the candidates overflow). A block with ≤ S candidates scatters its staged
  (value, index) pairs — ``acc`` is not read again; a denser block re-reads
  its ``acc`` block and redoes the local cumsum. The outputs are pre-filled
  with (0, n) and aliased in, so the slots nobody writes hold the sentinel.

Every slot is written by at most one element, whose position is fixed by the
scan: the result is deterministic, no atomics.

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

DEFAULT_BLOCK = 8192
DEFAULT_NUM_WARPS = 8


def _comparison_threshold(acc_dtype, tau) -> jax.Array:
  """τ as the float32 ``t`` with  |a| ≥ τ  ⟺  f32(|a|) ≥ t  for every a.

  The promotion is the reference's own (``jnp.abs(acc) >= tau``): adding τ to
  a zero of ``acc``'s dtype converts it exactly as the comparison would.
  A wider-than-float32 τ is rounded *up* to the next float32, which keeps the
  comparison exact for float32 and narrower magnitudes.
  """
  t = jnp.zeros((), acc_dtype) + tau
  if t.size != 1:
    raise ValueError(f"tau must be a scalar, got shape {t.shape}")
  t = jnp.reshape(t, ())
  t32 = t.astype(jnp.float32)
  if jnp.dtype(t.dtype).itemsize > 4:
    t32 = jnp.where(t32.astype(t.dtype) < t,
                    jnp.nextafter(t32, jnp.float32(jnp.inf)), t32)
  return jnp.reshape(t32, (1,))


def _candidates(x, pos, n, tau):
  xf = x.astype(jnp.float32)
  return (pos < n) & (jnp.abs(xf) >= tau) & (xf != 0)


def _count_kernel(scal_ref, tau_ref, acc_ref, lo_ref, hi_ref, sv_ref, si_ref,
                  *, n, block, stage):
  b = pl.program_id(0)
  offset = scal_ref[0]
  tau = tau_ref[0]
  x = acc_ref[...]
  pos = b * block + lax.broadcasted_iota(jnp.int32, (block,), 0)
  m = _candidates(x, pos, n, tau)
  mi = m.astype(jnp.int32)
  cnt = jnp.sum(mi)
  lo = jnp.sum(jnp.where(pos < offset, mi, 0))
  lo_ref[b] = lo
  hi_ref[b] = cnt - lo
  lc = jnp.cumsum(mi)                                # inclusive local rank
  ok = m & (lc <= stage)
  slot = jnp.where(ok, lc - 1, stage)                # masked lanes: out of block
  plgpu.store(sv_ref.at[slot], x, mask=ok)
  plgpu.store(si_ref.at[slot], pos, mask=ok)


def _write_kernel(scal_ref, tau_ref, cnt_ref, start_ref, acc_ref, sv_ref,
                  si_ref, v0_ref, i0_ref, v_ref, i_ref, *, n, block, stage,
                  capacity):
  del v0_ref, i0_ref  # aliased into v_ref, i_ref (pre-filled with 0, n)
  b = pl.program_id(0)
  offset = scal_ref[0]
  before = scal_ref[1]
  total = scal_ref[2]
  cnt = cnt_ref[b]
  start = start_ref[b]
  first_pos = b * block
  # Smallest rotated slot of the block (0 if the block straddles offset).
  first = jnp.where(first_pos >= offset, start - before,
                    jnp.where(first_pos + block <= offset,
                              start + total - before, 0))
  need = (cnt > 0) & (first < capacity)

  def emit(rank, pos, vals, valid):
    slot = jnp.where(pos >= offset, rank - before, rank + total - before) - 1
    ok = valid & (slot < capacity)
    slot = jnp.where(ok, slot, capacity)             # masked lanes: out of range
    plgpu.store(v_ref.at[slot], vals, mask=ok)
    plgpu.store(i_ref.at[slot], pos, mask=ok)

  @pl.when(need & (cnt <= stage))
  def _staged():
    j = lax.broadcasted_iota(jnp.int32, (stage,), 0)
    valid = j < cnt
    vals = plgpu.load(sv_ref, mask=valid)
    pos = plgpu.load(si_ref, mask=valid)
    emit(start + j + 1, pos, vals, valid)

  @pl.when(need & (cnt > stage))
  def _dense():
    tau = tau_ref[0]
    x = acc_ref[...]
    pos = first_pos + lax.broadcasted_iota(jnp.int32, (block,), 0)
    m = _candidates(x, pos, n, tau)
    emit(start + jnp.cumsum(m.astype(jnp.int32)), pos, x, m)


def _is_pow2(v: int) -> bool:
  return v >= 1 and (v & (v - 1)) == 0


@functools.partial(jax.jit, static_argnames=("capacity", "block", "stage",
                                             "num_warps", "interpret"))
def select_pallas(acc: jax.Array, tau, capacity: int, offset, *,
                  block: int | None = None, stage: int | None = None,
                  num_warps: int | None = None, interpret: bool = False
                  ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Drop-in for :func:`jaxfuse.sparsify.select` as two Pallas kernels.

  Args:
    acc: flat float array (float32, bfloat16 or float16) of n elements.
    tau: scalar threshold (any float; promoted with ``acc`` as the reference).
    capacity: number of output slots (static).
    offset: int scalar in [0, n): where the rotated order starts.
    block: elements per program, a power of two (default 8192, or n rounded
      up to a power of two if smaller).
    stage: staged candidates per block, a power of two ≤ block (default
      block/8); blocks with more candidates re-read ``acc`` in pass 2.
    num_warps: Triton warps per program (default 8).
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
  if stage is None:
    stage = max(1, block // 8)
  if not _is_pow2(stage) or stage > block:
    raise ValueError(f"stage must be a power of two <= block, got {stage}")
  num_blocks = pl.cdiv(n, block)
  if num_blocks * block + block >= 2**31 or capacity >= 2**31 - 1:
    raise ValueError(f"acc too large for int32 positions: n={n}")
  params = plgpu.CompilerParams(num_warps=num_warps or DEFAULT_NUM_WARPS)

  tau32 = _comparison_threshold(acc.dtype, tau)
  offset = jnp.asarray(offset, jnp.int32)
  whole = pl.BlockSpec()                   # the whole array in every program
  acc_spec = pl.BlockSpec((block,), lambda b: (b,))
  stage_spec = pl.BlockSpec((stage,), lambda b: (b,))
  grid = (num_blocks,)

  lo, hi, staged_v, staged_i = pl.pallas_call(
      functools.partial(_count_kernel, n=n, block=block, stage=stage),
      out_shape=(jax.ShapeDtypeStruct((num_blocks,), jnp.int32),
                 jax.ShapeDtypeStruct((num_blocks,), jnp.int32),
                 jax.ShapeDtypeStruct((num_blocks * stage,), acc.dtype),
                 jax.ShapeDtypeStruct((num_blocks * stage,), jnp.int32)),
      grid=grid,
      in_specs=[whole, whole, acc_spec],
      out_specs=(whole, whole, stage_spec, stage_spec),
      compiler_params=params,
      interpret=interpret,
      name="jaxfuse_select_count",
  )(jnp.reshape(offset, (1,)), tau32, acc)

  cnt = lo + hi
  inclusive = jnp.cumsum(cnt, dtype=jnp.int32)
  start = inclusive - cnt
  total = inclusive[-1]
  before = jnp.sum(lo, dtype=jnp.int32)
  scal = jnp.stack([offset, before, total])

  values, indices = pl.pallas_call(
      functools.partial(_write_kernel, n=n, block=block, stage=stage,
                        capacity=capacity),
      out_shape=(jax.ShapeDtypeStruct((capacity,), acc.dtype),
                 jax.ShapeDtypeStruct((capacity,), jnp.int32)),
      grid=grid,
      in_specs=[whole, whole, whole, whole, acc_spec, stage_spec, stage_spec,
                whole, whole],
      out_specs=(whole, whole),
      input_output_aliases={7: 0, 8: 1},
      compiler_params=params,
      interpret=interpret,
      name="jaxfuse_select_write",
  )(scal, tau32, cnt, start, acc, staged_v, staged_i,
    jnp.zeros((capacity,), acc.dtype), jnp.full((capacity,), n, jnp.int32))
  return values, indices, total
