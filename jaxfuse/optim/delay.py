"""``delayed``: apply an optimizer to the previous step's gradients, so that
their synchronization runs while this step's forward and backward compute.

Within one step a bucket's collective can only start once the backward has
made its gradients, and XLA's scheduler, left to itself, starts the sparse
all-gathers after the whole backward pass (docs/benchmarks.md, "Overlap").
Handing the optimizer the gradient of step t−1 at step t makes everything
it sends an input of the step: every collective can start at once and move
while step t computes, the compiler can place it anywhere.

Worker k, its local gradient g_k,t at step t, ``inner`` any optimizer of
local gradients (a jaxfuse recipe)::

  u_t = inner(g_{·,t−1})      (t ≥ 1; u_0 = 0 and inner's state is kept)
  pending_k ← g_k,t           (per worker, in the gradient's dtype)

The parameters' trajectory is that of ``inner`` on gradients one step old
(a staleness of one step). What the workers owe is the inner optimizer's
debt plus the pending gradients, (1/K)·Σ_k pending_k: a checkpoint keeps
them, an elastic restart redistributes them like residuals. The pending
gradients cost one gradient's memory per worker.

**Weight prediction** (``predict=True``): the gradient taken at step t
is applied at step t+1, to θ_{t+1} = θ_t + u_t. Taking it instead at the
predicted parameters (SpecTrain's weight prediction)::

  θ̂_t = θ_t + u_{t−1}        (``predicted_params(params, state)``)

makes it nearly the fresh gradient of the parameters it updates, whenever
consecutive updates are alike (u_t ≈ u_{t−1}). The state keeps u_{t−1}
(replicated, one parameter copy).

For the collectives to start early on GPUs the scheduler must know what
they cost: ``jaxfuse.xla_flags(network_gbytes_s=...)``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxfuse import _compat
from jaxfuse.state import placement
from jaxfuse import transform


class DelayedState(NamedTuple):
  count: jax.Array                   # steps taken, int32 (replicated)
  pending: transform.PerWorkerState  # the previous step's local gradients
  inner: Any                         # the inner optimizer's state
  last_update: Any = None            # u_{t−1} (predict=True), else None


def delayed(inner: optax.GradientTransformation, *, predict: bool = False
            ) -> optax.GradientTransformationExtraArgs:
  """``inner`` applied to the previous step's gradients (module doc).

  ``predict=True`` keeps the last update for ``predicted_params``: take
  the step's gradient at ``predicted_params(params, opt_state)`` instead
  of ``params``. The prediction is right only when ``delayed`` is the
  outermost transform and its updates are applied as they are.

  Use it around a whole jaxfuse recipe, ``delayed(jaxfuse.onebit_adamw(
  plan, ...))``; its state holds per-worker gradients, so create it with
  ``jaxfuse.init_state`` and pass ``jaxfuse.state_specs`` as usual.
  Non-float leaves (no gradient) pass through undelayed.

  Args:
    inner: the optimizer to delay by one step (a whole jaxfuse recipe).
    predict: keep the last update for ``predicted_params``.

  Returns:
    An optax ``GradientTransformationExtraArgs`` whose state is a
    ``DelayedState``.

  Raises:
    SyncError: ``predict`` is not a bool; at the update, ``inner`` is
      itself delayed or the state is not a ``DelayedState`` (naming the
      fix).
  """
  placement.require_transform(inner, "delayed")
  if not isinstance(predict, bool):
    raise transform.SyncError(f"delayed: predict={predict!r} must be True "
                              "or False.")
  inner = optax.with_extra_args_support(inner)

  def init_fn(params):
    pending = jax.tree.map(
        lambda p: jnp.zeros((1,) + jnp.shape(p), jnp.result_type(p))
        if _compat.is_float_value(p) else jnp.zeros((1,), jnp.bool_), params)
    last = jax.tree.map(jnp.zeros_like, params) if predict else None
    inner_state = inner.init(params)
    if transform.holds(inner_state, lambda x: isinstance(x, DelayedState)):
      raise transform.SyncError(
          "delayed(delayed(...)): the gradients would be two steps old; "
          "wrap the optimizer in jaxfuse.delayed once.")
    return DelayedState(jnp.zeros((), jnp.int32),
                        transform.PerWorkerState(pending), inner_state, last)

  def update_fn(updates, state, params=None, **extra_args):
    if not isinstance(state, DelayedState):
      raise transform.SyncError(
          f"delayed expects its DelayedState, got {type(state).__name__}; "
          "create the state with jaxfuse.init_state(optimizer, ...).")
    floats = _compat.is_float_value
    previous = jax.tree.map(
        lambda g, p: p[0].astype(g.dtype) if floats(g) else g,
        updates, state.pending.inner)
    out, new_inner = inner.update(previous, state.inner, params, **extra_args)
    first = state.count == 0
    out = jax.tree.map(lambda o: jnp.where(first, jnp.zeros_like(o), o), out)
    new_inner = jax.tree.map(lambda old, new: jnp.where(first, old, new),
                             state.inner, new_inner)
    pending = jax.tree.map(
        lambda g, p: g.astype(p.dtype)[None] if floats(g) else p,
        updates, state.pending.inner)
    last = (jax.tree.map(lambda o, l: o.astype(l.dtype) if floats(l) else l,
                         out, state.last_update) if predict else None)
    return out, DelayedState(state.count + 1,
                             transform.PerWorkerState(pending), new_inner,
                             last)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def predicted_params(params, opt_state):
  """θ̂ = θ + u_{t−1}: where the step's gradient will be applied, for a
  ``delayed(..., predict=True)`` optimizer's state (module doc). Take the
  gradient at it: ``jax.grad(loss)(predicted_params(params, state), ...)``.
  u_{t−1} is what ``delayed`` returned last: right when it is the
  outermost transform and its updates are applied as they are.

  Args:
    params: the parameters.
    opt_state: the state of a ``delayed(..., predict=True)`` optimizer
      (or a pytree holding one).

  Returns:
    θ̂, a pytree like ``params``.

  Raises:
    SyncError: ``opt_state`` holds no single ``DelayedState`` of a
      ``predict=True`` optimizer, or ``params`` have another structure
      than the state was made for.
  """
  found = [s for s in jax.tree.leaves(
      opt_state, is_leaf=lambda x: isinstance(x, DelayedState))
           if isinstance(s, DelayedState)]
  if len(found) != 1 or found[0].last_update is None:
    raise transform.SyncError(
        "predicted_params needs the state of one jaxfuse.delayed(..., "
        f"predict=True) optimizer; found {len(found)} DelayedState(s)"
        + (" without predict=True" if found and found[0].last_update is None
           else "") + ".")
  last = found[0].last_update
  if jax.tree.structure(last) != jax.tree.structure(params):
    raise transform.SyncError(
        "predicted_params: params do not have the structure the optimizer "
        "state was created for (jaxfuse.init_state(optimizer, params, "
        "mesh)).")
  return jax.tree.map(lambda p, u: (p + u.astype(p.dtype))
                      if _compat.is_float_value(p) else p, params, last)
