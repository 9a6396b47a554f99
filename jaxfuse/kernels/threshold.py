"""Exact k-th largest magnitude without sorting everything.

``kth_largest_magnitude(x, k)`` equals ``lax.top_k(|x|, k)[0][k − 1]`` for
finite x (the reference, which sorts all n elements):

1. **Bracket**: a uniform sample of s elements, sorted, gives two bounds
   τ_hi ≥ τ_lo around the rank k·s/n it should hold the k-th largest at,
   MARGIN sample deviations on each side (``band_plan``).
2. **Band** with the selection kernel (``select_band_pallas``: one read of
   x): the m elements with τ_lo ≤ |x| < τ_hi, x ≠ 0, into C slots, and the
   count a of |x| ≥ τ_hi.
3. If a < k ≤ a + m ≤ a + C the k-th largest of x is the (k − a)-th largest
   of the band: a sort of C slots (C ≪ n). Otherwise (an unlucky sample, or
   fewer than k non-zeros) the reference runs instead (``lax.cond``), so the
   result is always exact.

Under ``jax.vmap`` (``sparse_sync`` vmaps same-shape units) a batching rule
keeps the ``cond`` outside the batch: the reference runs for the whole batch
only if some bracket missed. The ``"topk"`` estimator uses this on the Pallas
backend (``jaxfuse.kernels.kth_largest_magnitude``), where it pays from
``PAYS_FROM`` elements for one array and ``BATCHED_PAYS_FROM`` per row under
vmap (the rows share the kernels' launches; ``lax.top_k`` sorts each row).
"""

from __future__ import annotations

import functools
import math

import jax
from jax import lax
import jax.numpy as jnp

from jaxfuse import _compat
from jaxfuse.kernels import reference
from jaxfuse.kernels import selection

SAMPLE = 1 << 18      # sample size s
MARGIN = 4.0          # sample standard deviations on each side of rank k
MIN_SIZE = 1 << 16    # below this, the reference always runs
# Where the kernel path starts to pay (dispatch, kernels.kth_largest_magnitude):
# lax.top_k grows faster with the row than the sampled kernel path, which
# has a fixed cost of a few launches; one array pays from about 4M elements,
# rows under vmap from about 512K each (measured at density 0.01:
# docs/benchmarks.md).
PAYS_FROM = 1 << 22
BATCHED_PAYS_FROM = 1 << 19


def kth_largest_magnitude_reference(x: jax.Array, k: int) -> jax.Array:
  """The k-th largest |x| by ``lax.top_k`` (a sort of all n elements)."""
  return reference.kth_largest(jnp.abs(x), k)


def band_plan(k: int, n: int) -> tuple[int, int, int, int]:
  """(s, r_hi, r_lo, C): τ_hi is the sample's r_hi-th largest magnitude (no
  upper bound if r_hi = 0), τ_lo its r_lo-th, C the band's slots.

  In a sample of s, rank k of n sits at r = k·s/n with standard deviation
  ≈ √r, so r_hi = ⌊r − d⌋ and r_lo = ⌈r + d⌉ with d = MARGIN·√r + 1 hold
  rank k between them but for a ≈ 3·10⁻⁵ chance each; the band then holds
  about (r_lo − r_hi)·n/s elements, and C is twice that plus 1024.
  """
  s = min(n, SAMPLE)
  r = k * s / n
  d = MARGIN * math.sqrt(r) + 1
  r_hi = max(0, math.floor(r - d))
  r_lo = min(s, math.ceil(r + d))
  return s, r_hi, r_lo, 2 * math.ceil((r_lo - r_hi) * n / s) + 1024


def _band(x, k: int, interpret: bool):
  """((|band| in C slots, rank of the k-th largest inside the band), ok).

  The sample is the same on every call, so the result is deterministic."""
  n = x.shape[0]
  s, r_hi, r_lo, capacity = band_plan(k, n)
  sample = jnp.sort(jnp.abs(x[reference.uniform_index(jnp.uint32(0x5EED), s,
                                                     n)]))
  lo = sample[s - r_lo]
  hi = sample[s - r_hi] if r_hi else jnp.asarray(jnp.inf, x.dtype)
  values, _, count, above = _select_band(x, lo, hi, capacity,
                                         interpret=interpret)
  rank = k - above
  ok = (rank >= 1) & (rank <= count) & (count <= capacity)
  return (jnp.abs(values), rank), ok


def _kth_of_band(state):
  mags, rank = state
  return jnp.sort(mags)[mags.shape[0] - rank]     # empty slots (0) sort first


_select_band = selection.select_band_pallas   # a seam for tests (shard_map)


@functools.lru_cache(maxsize=None)
def _kth_fn(k: int, interpret: bool, single_from: int, batched_from: int):
  """The fast path for one k, with a batching rule.

  Unbatched, a ``lax.cond`` picks the fast answer or the reference. Under
  ``jax.vmap`` a per-example ``cond`` would become a select that runs both
  branches (the full sort included); the rule instead runs the fast path on
  every example and takes the reference for the whole batch only if any
  bracket missed. Rows shorter than ``single_from`` (one array or a batch of
  one) or ``batched_from`` (a batch) take the reference.
  """
  fast = lambda x: _band(x, k, interpret)
  reference = lambda x: kth_largest_magnitude_reference(x, k)

  @jax.custom_batching.custom_vmap
  def kth(x):
    if x.shape[0] < single_from:
      return reference(x)
    state, ok = fast(x)
    return lax.cond(ok, lambda: _kth_of_band(state), lambda: reference(x))

  @kth.def_vmap
  def _rule(axis_size, in_batched, x):
    if not in_batched[0]:
      return kth(x), False
    if x.shape[1] < (single_from if axis_size == 1 else batched_from):
      return jax.vmap(reference)(x), True
    state, ok = jax.vmap(fast)(x)
    return lax.cond(jnp.all(ok), lambda: jax.vmap(_kth_of_band)(state),
                    lambda: jax.vmap(reference)(x)), True

  return kth


@_compat.x32
@functools.partial(jax.jit, static_argnames=("k", "interpret", "pays_from"))
def kth_largest_magnitude(x: jax.Array, k: int, *, interpret: bool = False,
                          pays_from: tuple[int, int] = (0, 0)) -> jax.Array:
  """The exact k-th largest |x| of a flat finite x (module docstring).

  Args:
    x: flat float array (float32, bfloat16 or float16), finite.
    k: rank, 1 ≤ k ≤ n (static).
    interpret: run the selection kernel in the Pallas interpreter.
    pays_from: (one array, per row under vmap): sizes below which the
      reference runs instead of the fast path (which never runs below
      ``MIN_SIZE``). Default: the fast path from ``MIN_SIZE``.
  """
  if x.ndim != 1:
    raise ValueError(f"x must be flat (1-D), got shape {x.shape}")
  n = x.shape[0]
  if not 1 <= k <= n:
    raise ValueError(f"k must be in [1, {n}], got {k}")
  if n < max(MIN_SIZE, min(pays_from)) or band_plan(k, n)[3] >= n:
    return kth_largest_magnitude_reference(x, k)
  return _kth_fn(k, interpret, *pays_from)(x)
