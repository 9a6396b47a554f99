"""Exact k-th largest magnitude without sorting everything.

``kth_largest_magnitude(x, k)`` equals ``lax.top_k(|x|, k)[0][k − 1]`` for
finite x (the reference, which sorts all n elements):

1. **Bracket**: a uniform sample of s elements gives τ_lo, its r-th largest
   magnitude, r = ⌈1.5·k·s/n⌉, so that about 1.5·k elements pass |x| ≥ τ_lo
   (the sample's relative error at that rank is ≈ 1/√(1.5·k·s/n)).
2. **Compact** with the selection kernel (``select_pallas``: about one read
   of x): the m elements with |x| ≥ τ_lo, x ≠ 0, into C = 2k + 1024 slots.
3. If k ≤ m ≤ C the k-th largest of x is the k-th largest of those m (every
   other element is smaller than all of them): ``lax.top_k`` on C slots,
   not n. Otherwise (an unlucky sample, or fewer than k non-zeros) the
   reference runs instead (``lax.cond``), so the result is always exact.

Under ``jax.vmap`` (``sparse_sync`` vmaps same-shape units) a batching rule
keeps the ``cond`` outside the batch: the reference runs for the whole batch
only if some bracket missed. The ``"topk"`` estimator uses this on the Pallas
backend (``jaxfuse.kernels.kth_largest_magnitude``).
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
MIN_SIZE = 1 << 16    # below this, the reference always runs
# Where the kernel path starts to pay (dispatch, kernels.kth_largest_magnitude):
# on an H100, lax.top_k takes 0.12-0.16 ms at 1M elements (the kernel path
# 0.13-0.22) and 0.71 ms at 16M (the kernel path 0.23-0.31).
PAYS_FROM = 1 << 22


def kth_largest_magnitude_reference(x: jax.Array, k: int) -> jax.Array:
  """The k-th largest |x| by ``lax.top_k`` (a sort of all n elements)."""
  return sparsify._kth_largest(jnp.abs(x), k)  # pylint: disable=protected-access


def capacity_for(k: int) -> int:
  """Slots of the compaction: C = 2k + 1024."""
  return 2 * k + 1024


def _bracket(x, k: int):
  """τ_lo: the r-th largest magnitude of a uniform sample (same one on every
  call, so the result is deterministic), r = ⌈1.5·k·s/n⌉."""
  n = x.shape[0]
  s = min(n, SAMPLE)
  rank = min(s, math.ceil(OVERSHOOT * k * s / n))
  sample = jnp.abs(x[sparsify.uniform_index(jnp.uint32(0x5EED), s, n)])
  return lax.top_k(sample, rank)[0][rank - 1]


def _compact(x, k: int, interpret: bool):
  """(|candidates| in C slots, zeros after them; whether they hold the k-th
  largest: k ≤ m ≤ C)."""
  capacity = capacity_for(k)
  values, _, count = _select(x, _bracket(x, k), capacity, 0,
                             interpret=interpret)
  return jnp.abs(values), (count >= k) & (count <= capacity)


def _kth_of_compacted(mags, k: int, final: str):
  """k-th largest of the C compacted magnitudes (the empty slots are 0)."""
  if final == "sort":
    return jnp.sort(mags)[mags.shape[0] - k]
  return lax.top_k(mags, k)[0][k - 1]


_select = selection.select_pallas      # a seam for tests (shard_map on CPU)
FINALS = ("sort", "top_k")


@functools.lru_cache(maxsize=None)
def _kth_fn(k: int, interpret: bool, final: str):
  """The fast path for one (k, interpret, final), with a batching rule.

  Unbatched, a ``lax.cond`` picks the compacted answer or the reference.
  Under ``jax.vmap`` a per-example ``cond`` would become a select that runs
  both branches (the full sort included); the rule instead compacts every
  example and takes the reference for the whole batch only if any bracket
  missed.
  """

  @jax.custom_batching.custom_vmap
  def kth(x):
    mags, ok = _compact(x, k, interpret)
    return lax.cond(ok, lambda: _kth_of_compacted(mags, k, final),
                    lambda: kth_largest_magnitude_reference(x, k))

  @kth.def_vmap
  def _rule(axis_size, in_batched, x):
    del axis_size
    if not in_batched[0]:
      return kth(x), False
    mags, ok = jax.vmap(lambda v: _compact(v, k, interpret))(x)
    out = lax.cond(
        jnp.all(ok),
        lambda: jax.vmap(lambda m: _kth_of_compacted(m, k, final))(mags),
        lambda: jax.vmap(lambda v: kth_largest_magnitude_reference(v, k))(x))
    return out, True

  return kth


@functools.partial(jax.jit, static_argnames=("k", "interpret", "final"))
def kth_largest_magnitude(x: jax.Array, k: int, *, interpret: bool = False,
                          final: str = "top_k") -> jax.Array:
  """The exact k-th largest |x| of a flat finite x (module docstring).

  Args:
    x: flat float array (float32, bfloat16 or float16), finite.
    k: rank, 1 ≤ k ≤ n (static).
    interpret: run the selection kernel in the Pallas interpreter.
    final: how step 3 ranks the C compacted magnitudes: ``"top_k"``
      (default; as fast or faster on an H100 from 16M elements up) or
      ``"sort"`` (a keys-only sort).
  """
  if x.ndim != 1:
    raise ValueError(f"x must be flat (1-D), got shape {x.shape}")
  n = x.shape[0]
  if not 1 <= k <= n:
    raise ValueError(f"k must be in [1, {n}], got {k}")
  if final not in FINALS:
    raise ValueError(f"final must be one of {FINALS}, got {final!r}")
  if n < MIN_SIZE or capacity_for(k) >= n:
    return kth_largest_magnitude_reference(x, k)
  return _kth_fn(k, interpret, final)(x)
