"""``radix_select.radix_rows`` in one Pallas kernel: a program per row.

For row i of n_i patterns b (int32, 0 ≤ b < 2³¹: bitcast magnitudes) and
rank k_i, the k-th largest pattern, a digit per round from the top bit
down (``ROUNDS``: 3 bits, then seven 4-bit digits)::

  t ← 0;  for (shift, width) in ROUNDS:
    c_d = #{j < n_i : b_j ≥ t | d·2^shift}     d = 0 … 2^width − 1
    t ← t | (#{d : c_d ≥ k_i} − 1)·2^shift

The XLA formulation does each round as a reduction over all rows at once
(2–4 kernels a round, about 30 a call, every row padded to the widest);
here program i runs the eight rounds over its own n_i patterns: one kernel
a call, and no work on padding. It reads them in tiles of ``tile``; each
lane keeps its own count of every candidate through a round (a (tile,
2^width) accumulator), summed across lanes once a round. Lanes past n_i
load −1, below every candidate, so a row padded with anything gives the
same t. Equal to ``radix_select.radix_rows`` on the first n_i patterns of
each row, bit for bit. A row runs on one SM, so rows of very different
lengths leave most of the card idle while the longest finishes.
"""

from __future__ import annotations

import functools

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
import numpy as np

from jaxfuse import _compat

plgpu = _compat.pallas_triton()  # None: this JAX has no Triton backend

# (shift, digit width) of each round: 3 bits, then seven 4-bit digits, 31
# in all (the XLA rounds of ``radix_select`` use them too; any cut of the 31
# bits gives the same t).
ROUNDS = ((28, 3),) + tuple((s, 4) for s in range(24, -1, -4))

DEFAULT_TILE = 256
DEFAULT_NUM_WARPS = 4


def _radix_kernel(k_ref, n_ref, bits_ref, out_ref, *, width, tile):
  """Program i: row i of the flat (R·width,) patterns, its k and n."""
  i = pl.program_id(0)
  k, n = k_ref[i], n_ref[i]
  base = i * width
  lanes = lax.broadcasted_iota(jnp.int32, (tile,), 0)
  t = jnp.int32(0)
  for shift, bits in ROUNDS:
    digits = lax.broadcasted_iota(jnp.int32, (1, 1 << bits), 1)
    cands = t | (digits << shift)                       # (1, 2^bits)

    def count(j, acc, cands=cands):
      pos = j * tile + lanes
      b = plgpu.load(bits_ref.at[pl.ds(base + j * tile, tile)],
                     mask=pos < n, other=-1)
      return acc + (b[:, None] >= cands).astype(jnp.int32)

    # Per lane and candidate, summed across lanes once a round.
    acc = lax.fori_loop(0, pl.cdiv(n, tile), count,
                        jnp.zeros((tile, 1 << bits), jnp.int32))
    counts = jnp.sum(acc, axis=0, keepdims=True)        # (1, 2^bits)
    t = t | ((jnp.sum((counts >= k).astype(jnp.int32)) - 1) << shift)
  out_ref[i] = t


@_compat.x32
@functools.partial(jax.jit, static_argnames=("lengths", "tile", "num_warps",
                                             "interpret"))
def radix_rows_pallas(bits: jax.Array, k: jax.Array, lengths=None, *,
                      tile: int = DEFAULT_TILE, num_warps: int | None = None,
                      interpret: bool = False) -> jax.Array:
  """(R, W) int32 patterns ≥ 0 and (R,) ranks -> (R,) int32: row i's
  k_i-th largest among its first ``lengths[i]`` patterns (default W; a
  static tuple), 1 ≤ k_i ≤ lengths[i]. ``radix_select.radix_rows`` of those
  patterns, bit for bit (module docstring)."""
  if bits.ndim != 2 or bits.dtype != jnp.int32:
    raise ValueError(f"bits must be (R, W) int32, got {bits.dtype}"
                     f"{list(bits.shape)}")
  rows, width = bits.shape
  lengths = (width,) * rows if lengths is None else tuple(lengths)
  if len(lengths) != rows or not all(1 <= n <= width for n in lengths):
    raise ValueError(f"lengths must be {rows} values in [1, {width}], got "
                     f"{lengths}")
  if tile < 1 or tile & (tile - 1):
    raise ValueError(f"tile must be a power of two, got {tile}")
  if rows * width + tile >= 2**31:
    raise ValueError(f"{rows} x {width} patterns are too many for int32 "
                     "positions")
  params = _compat.triton_params("radix_rows_pallas",
                                 num_warps or DEFAULT_NUM_WARPS)
  (k, n, flat), out = _compat.kernel_operands(
      jnp.reshape(k, (rows,)).astype(jnp.int32),
      jnp.asarray(np.asarray(lengths, np.int32)),
      # The interpreter slices masked tiles too (clamped into the buffer):
      # one tile of slack keeps the last row's last tile where it is.
      jnp.pad(jnp.reshape(bits, (-1,)), (0, tile if interpret else 0)),
      interpret=interpret, kernel="radix_rows_pallas",
      reference="jaxfuse.kernels.radix_select.radix_rows")
  whole = pl.BlockSpec()
  return pl.pallas_call(
      functools.partial(_radix_kernel, width=width, tile=tile),
      out_shape=out((rows,), jnp.int32), grid=(rows,),
      in_specs=[whole] * 3, out_specs=whole,
      compiler_params=params, interpret=interpret,
      name="jaxfuse_radix_rows")(k, n, flat)
