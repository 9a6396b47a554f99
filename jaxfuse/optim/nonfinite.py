"""``apply_if_finite``: skip a step whose synced update is not finite, on
every worker at once.

``optax.apply_if_finite(inner, n)`` skips ``inner`` when the gradient it is
given has a NaN or Inf. Around a jaxfuse optimizer that gradient is each
worker's own: one worker would skip the collectives the others run, and the
counts it keeps would differ per worker (``state_specs`` refuses it). This
one decides on what ``inner`` returns: the update after the sync, the same
on every worker (a leaf with a NaN/Inf on any worker comes out non-finite
on every worker, as a dense ``pmean`` would). With u, s' = inner(g, s)::

  finite  = all(isfinite(u))
  skipped = 0 if finite else skipped + 1
  apply   = finite or skipped > max_consecutive_errors
  out, s  = (u, s') if apply else (0, s with sparse_sync's states from s')

A skipped step keeps the inner state as it was (moments, counts, per-worker
states), except ``sparse_sync``'s own: it has already kept the residual and
velocity of each non-finite unit on the worker that had the NaN, so nothing
is poisoned; the other workers' residuals give up what they sent in the
skipped step (a dense ``apply_if_finite`` drops the whole step's gradient),
and its stats are the skipped step's, so ``stats.nonfinite`` names the leaves
and the worker. Keeping the residuals too would hold the old and the new
alive together, a second copy of every residual written each step (the
cost is measured in docs/). The inner optimizer runs every step, so every
worker issues the same collectives.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxfuse import _compat
from jaxfuse.optim import delay
from jaxfuse.state import placement
from jaxfuse.plans import checks as plan_checks
from jaxfuse import transform


class ApplyIfFiniteState(NamedTuple):
  """Replicated counts (the decision is the same on every worker)."""
  notfinite_count: jax.Array   # consecutive skipped steps, int32
  last_finite: jax.Array       # the last step's update was finite, bool
  total_notfinite: jax.Array   # skipped steps in all, int32
  inner: Any                   # the inner optimizer's state


def _is_delayed(x) -> bool:
  return isinstance(x, delay.DelayedState)


def _select(apply, old, new):
  """``new`` where ``apply``, else ``old``; ``sparse_sync``'s states always
  ``new`` (module doc)."""
  def pick(o, n):
    if transform.is_sync_state(o):
      return n
    return jnp.where(apply, n, o)
  return jax.tree.map(pick, old, new, is_leaf=transform.is_sync_state)


def apply_if_finite(inner: optax.GradientTransformation,
                    max_consecutive_errors: int
                    ) -> optax.GradientTransformationExtraArgs:
  """``inner``, with a step skipped on every worker when its synced update
  has a NaN or Inf (module doc); after more than ``max_consecutive_errors``
  skips in a row the update is applied anyway, as in optax.

  Wrap a whole jaxfuse recipe: ``apply_if_finite(jaxfuse.onebit_adamw(plan,
  lr), 5)``. With ``jaxfuse.delayed``, put ``delayed`` outside.

  Args:
    inner: the optimizer to guard (a whole jaxfuse recipe).
    max_consecutive_errors: skips in a row after which a non-finite update
      is applied anyway (an int >= 0).

  Returns:
    An optax ``GradientTransformationExtraArgs`` whose state is an
    ``ApplyIfFiniteState``.

  Raises:
    SyncError: ``max_consecutive_errors`` is not an int >= 0; at the
      update, ``inner`` holds a ``jaxfuse.delayed`` (put it outside) or
      the state is not this wrapper's (naming the fix).
  """
  placement.require_transform(inner, "apply_if_finite")
  if not (plan_checks.is_int(max_consecutive_errors) and
          max_consecutive_errors >= 0):
    raise transform.SyncError(
        f"apply_if_finite: max_consecutive_errors={max_consecutive_errors!r}"
        " must be an integer >= 0 (the skips in a row before an update is "
        "applied anyway).")
  limit = int(max_consecutive_errors)
  inner = optax.with_extra_args_support(inner)

  def init_fn(params):
    state = inner.init(params)
    if transform.holds(state, _is_delayed):
      raise transform.SyncError(
          "apply_if_finite around jaxfuse.delayed would skip the delayed "
          "gradient again on every later step; put delayed outside: "
          "jaxfuse.delayed(jaxfuse.apply_if_finite(optimizer, n)).")
    return ApplyIfFiniteState(jnp.zeros((), jnp.int32),
                              jnp.array(True, jnp.bool_),
                              jnp.zeros((), jnp.int32), state)

  def update_fn(updates, state, params=None, **extra_args):
    if not isinstance(state, ApplyIfFiniteState):
      raise transform.SyncError(
          f"apply_if_finite expects its ApplyIfFiniteState, got "
          f"{type(state).__name__}; create the state with "
          "jaxfuse.init_state(optimizer, ...).")
    out, new_inner = inner.update(updates, state.inner, params, **extra_args)
    floats = _compat.is_float_value
    finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(u))
                                for u in jax.tree.leaves(out) if floats(u)]
                               or [jnp.array(True)]))
    skipped = jnp.where(finite, 0, state.notfinite_count + 1)
    apply = finite | (skipped > limit)
    out = jax.tree.map(
        lambda u: jnp.where(apply, u, jnp.zeros_like(u)) if floats(u) else u,
        out)
    return out, ApplyIfFiniteState(
        skipped.astype(jnp.int32), finite,
        state.total_notfinite + (~finite).astype(jnp.int32),
        _select(apply, state.inner, new_inner))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
