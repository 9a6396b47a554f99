"""Exact k-th largest magnitude without sorting everything.

``kth_largest_magnitude(x, k)`` equals ``lax.top_k(|x|, k)[0][k − 1]`` for
finite x (the reference, which sorts all n elements):

1. **Bracket**: a uniform sample of s elements gives τ_lo, its r-th largest
   magnitude, r = ⌈1.5·k·s/n⌉, so that about 1.5·k elements pass |x| ≥ τ_lo
   (the sample's relative error at that rank is ≈ 1/√(1.5·k·s/n)).
2. **Compact** with the selection kernel (``select_pallas``: about one read
   of x): the m elements with |x| ≥ τ_lo, x ≠ 0, into C = 2k + 1024 slots.
3. If k ≤ m ≤ C the k-th largest of x is the k-th largest of those m (every
   other element is smaller than all of them): ``lax.top_k`` on C slots, not
   n. Otherwise (an unlucky sample, or fewer than k non-zeros) the
   reference runs instead (``lax.cond``), so the result is always exact.

Not yet used by the ``"topk"`` estimator: it waits for a GPU measurement
(``benchmarks/kernels.py --methods kth,kth_ref``). Under ``jax.vmap`` the
``lax.cond`` becomes a select that runs both branches, so same-shape units
(which ``sparse_sync`` vmaps) would need a per-unit loop to gain from it.
"""

from __future__ import annotations

import functools
import math

import jax
from jax import lax
import jax.numpy as jnp

from jaxfuse import sparsify
from jaxfuse.kernels import selection

SAMPLE = 65536        # sample size s
OVERSHOOT = 1.5       # aim the bracket at this many times k
MIN_SIZE = 1 << 16    # below this, the reference is as fast


def kth_largest_magnitude_reference(x: jax.Array, k: int) -> jax.Array:
  """The k-th largest |x| by ``lax.top_k`` (a sort of all n elements)."""
  return sparsify._kth_largest(jnp.abs(x), k)  # pylint: disable=protected-access


def capacity_for(k: int) -> int:
  """Slots of the compaction: C = 2k + 1024."""
  return 2 * k + 1024


@functools.partial(jax.jit, static_argnames=("k", "interpret"))
def kth_largest_magnitude(x: jax.Array, k: int, *,
                          interpret: bool = False) -> jax.Array:
  """The exact k-th largest |x| of a flat finite x (module docstring).

  Args:
    x: flat float array (float32, bfloat16 or float16), finite.
    k: rank, 1 ≤ k ≤ n (static).
    interpret: run the selection kernel in the Pallas interpreter.
  """
  if x.ndim != 1:
    raise ValueError(f"x must be flat (1-D), got shape {x.shape}")
  n = x.shape[0]
  if not 1 <= k <= n:
    raise ValueError(f"k must be in [1, {n}], got {k}")
  capacity = capacity_for(k)
  if n < MIN_SIZE or capacity >= n:
    return kth_largest_magnitude_reference(x, k)
  s = min(n, SAMPLE)
  rank = min(s, math.ceil(OVERSHOOT * k * s / n))
  sample = jnp.abs(x[sparsify.uniform_index(jnp.uint32(0x5EED), s, n)])
  tau = lax.top_k(sample, rank)[0][rank - 1]
  values, _, count = selection.select_pallas(x, tau, capacity, 0,
                                             interpret=interpret)
  return lax.cond(
      (count >= k) & (count <= capacity),
      lambda: lax.top_k(jnp.abs(values), k)[0][k - 1],
      lambda: kth_largest_magnitude_reference(x, k))
