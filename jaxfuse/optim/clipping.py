"""Gradient clipping that keeps the plan's buckets apart.

A global-norm clip taken on each worker before the sync (DGC's local
clipping) makes every bucket's collective wait for every gradient leaf:
the norm needs them all. Then no bucket can move while the backward pass
is still computing, which is where fused sparse sync gets its speed.

``clip_by_bucket_norm`` clips each bucket on its own, at its share of the
limit, the shares taken from the previous step's bucket norms. Worker k,
bucket b, g_b its local gradient, p_b the norm ‖g_b‖ of the step before
(a bucket with none yet, p_b = 0, takes ‖p‖·√(n_b/N), its size's share;
before the first step all do), K workers::

  ℓ = max_norm·√K                   (a clip of the worker mean at max_norm)
  ℓ_b = ℓ · p_b / ‖p‖               (Σ_b ℓ_b² = ℓ²)
  g_b ← g_b · min(1, ℓ_b / ‖g_b‖)
  p_b ← ‖g_b‖                       (before clipping; kept if not finite)

When the gradient's norm is spread over the buckets as it was the step
before (‖g_b‖ ∝ p_b), the scale is min(1, ℓ/‖g‖) in every bucket: the
global clip exactly. A spike confined to a few buckets is clipped in the
same step, in those buckets only. The clipped gradient's norm is at most
ℓ, as with the global clip. Each bucket's clip reads only its own leaves
(and the state), so its collective can start as soon as its gradients
exist.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxfuse import _compat
from jaxfuse import plans
from jaxfuse import transform


class ClipError(ValueError):
  """A clip limit that cannot work."""


class BucketClipState(NamedTuple):
  """The previous step's local gradient norm of each bucket, (B,) float32
  (0 before the first step: the shares are then the buckets' sizes)."""
  norms: jax.Array


def check_max_norm(max_norm) -> None:
  """Check a clip norm as the recipes take it.

  Args:
    max_norm: the clip norm to check.

  Returns:
    None.

  Raises:
    ClipError: ``max_norm`` is not a number > 0 or None.
  """
  if max_norm is not None and not (
      plans.is_real(max_norm) and max_norm > 0):
    raise ClipError(f"clip_norm={max_norm!r} must be a number > 0 (or None: "
                    "no clipping).")


def bucket_norms(plan: plans.Plan, grads) -> list[jax.Array]:
  """‖g_b‖ for every bucket of ``plan``, float32 scalars; each from its own
  leaves only (non-float leaves count 0). Kept apart: one array of all of
  them would make every bucket's clip wait for every norm.

  Args:
    plan: the plan whose buckets to measure.
    grads: the gradient pytree (the plan's leaves).

  Returns:
    One float32 scalar per bucket, in bucket order.

  Raises:
    Nothing of its own.
  """
  flat = jax.tree.leaves(grads)
  norms = []
  for bucket in plan.buckets:
    squares = [jnp.sum(jnp.square(flat[j].astype(jnp.float32)))
               for j in bucket.leaves
               if _compat.is_float_dtype(flat[j].dtype)]
    norms.append(jnp.sqrt(sum(squares)) if squares else jnp.float32(0))
  return norms


def _recorded(norms: list[jax.Array], old: jax.Array) -> BucketClipState:
  """The state holding this step's bucket norms (the old one where a norm
  is not finite)."""
  new = jnp.stack(norms) if norms else jnp.zeros((0,), jnp.float32)
  return BucketClipState(jnp.where(jnp.isfinite(new), new, old))


def _size_shares(plan: plans.Plan) -> np.ndarray:
  sizes = np.array([sum(plan.leaves[j].size for j in b.leaves
                        if _compat.is_float_dtype(plan.leaves[j].dtype))
                    for b in plan.buckets], np.float64)
  return np.sqrt(sizes / max(sizes.sum(), 1.0)).astype(np.float32)


def _shares(prev, size_shares):
  """p/‖p‖, a bucket without a norm yet (0) taking its size's share of ‖p‖
  (all of them: the size shares): Σ_b share_b² = 1."""
  total = jnp.sqrt(jnp.sum(jnp.square(prev)))
  filled = jnp.where(prev > 0, prev,
                     jnp.where(total > 0, total, 1.0) * size_shares)
  return filled / jnp.sqrt(jnp.sum(jnp.square(filled)))


def clip_by_bucket_norm(plan: plans.Plan, max_norm: float,
                        axis_name: str | tuple = "data"
                        ) -> optax.GradientTransformation:
  """Clip each bucket's local gradient at its share of max_norm·√K (module
  doc). Its state, (B,) norms, differs per worker: wrap it in
  ``jaxfuse.per_worker`` (the recipes do) so ``init_state`` shards it.

  Args:
    plan: the plan whose buckets to clip.
    max_norm: the norm the worker mean should stay under, > 0.
    axis_name: the workers' mesh axis (K is its size).

  Returns:
    An optax ``GradientTransformation`` with a ``BucketClipState``.

  Raises:
    ClipError: ``max_norm`` is not a number > 0.
  """
  check_max_norm(max_norm)
  plans.require_plan(plan, "clip_by_bucket_norm")
  max_norm = float(max_norm)
  num_buckets = len(plan.buckets)
  size_shares = jnp.asarray(_size_shares(plan))

  def init_fn(params):
    del params
    return BucketClipState(jnp.zeros((num_buckets,), jnp.float32))

  def update_fn(updates, state, params=None):
    del params
    num_workers = _compat.axis_size(axis_name) or 1
    limit = max_norm * num_workers ** 0.5
    norms = bucket_norms(plan, updates)
    limits = limit * _shares(state.norms, size_shares)  # from the state only
    flat, tree = jax.tree.flatten(updates)
    for b, bucket in enumerate(plan.buckets):
      scale = jnp.minimum(1.0, limits[b] / jnp.maximum(norms[b], 1e-30))
      for j in bucket.leaves:
        if _compat.is_float_dtype(flat[j].dtype):
          flat[j] = (flat[j] * scale).astype(flat[j].dtype)
    return jax.tree.unflatten(tree, flat), _recorded(norms, state.norms)

  return optax.GradientTransformation(init_fn, update_fn)


def record_bucket_norms(plan: plans.Plan, grads,
                        state: BucketClipState) -> BucketClipState:
  """The state after a step that does not clip per bucket (a dense phase,
  which clips the synced mean): the norms of this step's local gradient,
  so the shares are current when bucket clipping starts.

  Args:
    plan: the plan whose buckets to measure.
    grads: this step's local gradient.
    state: the bucket-clip state to update.

  Returns:
    The new ``BucketClipState``.

  Raises:
    Nothing of its own.
  """
  return _recorded(bucket_norms(plan, grads), state.norms)


def local_clip_by_global_norm(max_norm: float | None, axis_name: str = "data"
                              ) -> optax.GradientTransformation:
  """DGC's local gradient clipping, for a worker *mean*: each worker clips
  its own gradient's global norm to max_norm·√K. The mean of K independent
  gradients of norm n has norm ≈ n/√K, so this clips about when a dense
  clip of the mean at ``max_norm`` would (DGC's N^(−1/2) is for a sum).
  None: identity.

  Its norm needs every leaf, so chained before ``sparse_sync`` it makes
  every bucket's collective wait for the whole backward pass. The recipes'
  ``clip_norm`` clips per bucket instead (``clip_by_bucket_norm``).

  Args:
    max_norm: the norm the worker mean should stay under, > 0; None: no
      clipping.
    axis_name: the workers' mesh axis (K is its size).

  Returns:
    An optax ``GradientTransformation`` (stateless).

  Raises:
    SyncError: ``max_norm`` is not a number > 0 or None.
  """
  try:
    check_max_norm(max_norm)
  except ClipError as e:
    raise transform.SyncError(str(e)) from None
  if max_norm is None:
    return optax.identity()
  max_norm = float(max_norm)

  def update_fn(updates, state, params=None):
    del params
    num_workers = _compat.axis_size(axis_name) or 1
    limit = max_norm * num_workers ** 0.5
    norm = _compat.global_norm(updates)
    scale = jnp.where(norm > limit, limit / jnp.maximum(norm, 1e-30), 1.0)
    return jax.tree.map(lambda g: (g * scale).astype(g.dtype), updates), state

  return optax.GradientTransformation(lambda _: optax.EmptyState(), update_fn)
