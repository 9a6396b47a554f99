"""``local_steps``: H inner steps on each worker, then one sync of the
pseudo-gradient (DiLoCo, Douillard et al. 2023; SparseLoCo, Sarfi et al.
2025), as an Optax transform like the other recipes.

The params the step holds are the anchor θ, the same on every worker. Each
worker k keeps its own copy θ_k and its inner optimizer's state, and takes
its gradient at θ_k (``inner_params``; ``make_train_step`` does it). Step t
of worker k, with I the inner optimizer and H = ``every``::

  θ_k ← θ_k + I(∇L_k(θ_k))                        (no communication)
  every H-th step:
    Δ_k = θ − θ_k                                  (the pseudo-gradient)
    acc_k = Δ_k + d·e_k ;  sent_k = top(acc_k) ;  e_k ← acc_k − sent_k
    θ ← θ + O(⟨sent⟩) ;  θ_k ← θ                   (⟨·⟩ = (1/K)·Σ_k)

The sync is ``jaxfuse.sparse_sync``'s: threshold selection with error
feedback e_k (decay d = ``residual_decay``), the plan's fused buckets and
one collective per bucket. O is the outer optimizer, any optax transform
of the synced pseudo-gradient:

- SparseLoCo (the default): ``optax.sgd(1.0)`` with d = 0.95. The
  decaying error feedback stands in for outer momentum.
- DiLoCo: ``optax.sgd(0.7, momentum=0.9, nesterov=True)`` on a density-1
  plan (``jaxfuse.with_density(plan, 1.0)``: an exact float32 mean).

Between syncs the anchor does not move (the updates are zero), so what a
step returns is the same on every worker, as for every recipe.

What the workers owe the anchor is conserved: after a sync,
K·⟨sent⟩ + Σ_k e_k' = Σ_k (Δ_k + d·e_k) (``sparse_sync``'s identity), and
between syncs Σ_k (θ − θ_k) is each worker's progress, kept in its θ_k
(float32 for narrower params; Δ_k travels in the params' dtype and its
rounding stays in θ_k for the next block).
A checkpoint holds θ_k, e_k and the inner states, so a restart resumes
bitwise anywhere inside an H-block; ``jaxfuse.elastic`` carries the
workers' mean of θ_k and e_k to another worker count.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
from jax import lax
import jax.numpy as jnp
import optax

from jaxfuse import _compat
from jaxfuse import plans
from jaxfuse import transform
from jaxfuse.optim import recipe_checks
from jaxfuse.optim import recipes
from jaxfuse.sync import bucket_sync


class LocalStepsState(NamedTuple):
  """``local_steps``' state.

  Attributes:
    count: steps taken, (), replicated (every worker's is the same).
    local: each worker's params θ_k, a ``PerWorkerState`` (leading worker
      axis; float32 where the params are narrower).
    inner: each worker's inner optimizer state, a ``PerWorkerState``.
    sync: the pseudo-gradient's ``SparseSyncState`` (error feedback e_k).
    outer: the outer optimizer's state, replicated.
  """
  count: jax.Array
  local: transform.PerWorkerState
  inner: transform.PerWorkerState
  sync: transform.SparseSyncState
  outer: Any


def _wide(tree):
  """Floating leaves in at least float32: θ_k and the inner steps keep
  float32 where the params are narrower (H small steps would round away)."""
  return jax.tree.map(
      lambda x: x.astype(jnp.promote_types(jnp.result_type(x), jnp.float32)),
      tree)


def _is_local_steps(x) -> bool:
  return isinstance(x, LocalStepsState)


def holds_local_steps(opt_state: Any) -> bool:
  """Whether an optimizer state holds a ``LocalStepsState``.

  Args:
    opt_state: any optimizer state (or its abstract shapes).

  Returns:
    True when ``local_steps``' state is in it.

  Raises:
    Nothing.
  """
  return transform.holds(opt_state, _is_local_steps)


def inner_params(params: Any, opt_state: Any) -> Any:
  """The params worker k differentiates at: its own θ_k.

  Pass it as ``jaxfuse.StepOptions(grad_at=...)`` in a hand-written step;
  ``make_train_step`` uses it by itself for a ``local_steps`` optimizer.

  Args:
    params: the anchor θ (the step's params; gives the structure).
    opt_state: the optimizer state inside the per-worker step (per-worker
      leaves with a leading axis of size 1).

  Returns:
    θ_k, a tree of ``params``' structure, shapes and dtypes.

  Raises:
    SyncError: ``opt_state`` holds no ``local_steps`` state.
  """
  found = [x for x in jax.tree.leaves(opt_state, is_leaf=_is_local_steps)
           if _is_local_steps(x)]
  if not found:
    raise transform.SyncError(
        "inner_params: this optimizer state holds no jaxfuse.local_steps "
        "state; pass the state of a local_steps optimizer, or differentiate "
        "at the params.")
  local = jax.tree.map(lambda x: x[0], found[0].local.inner)
  return jax.tree.map(lambda x, p: x.astype(jnp.result_type(p)), local,
                      params)


def local_steps(plan: plans.Plan,
                inner: optax.GradientTransformation | float,
                every: int = 30, *,
                outer: optax.GradientTransformation | None = None,
                residual_decay: float = 0.95,
                options: recipe_checks.RecipeOptions | None = None
                ) -> optax.GradientTransformationExtraArgs:
  """H inner steps per worker, then a sparse sync of the pseudo-gradient
  and an outer step (module doc).

  Examples:
    >>> opt = jaxfuse.local_steps(plan, 3e-4, every=30)   # SparseLoCo
    >>> diloco = jaxfuse.local_steps(
    ...     jaxfuse.with_density(plan, 1.0), optax.adamw(3e-4), every=30,
    ...     outer=optax.sgd(0.7, momentum=0.9, nesterov=True))

  Args:
    plan: the ``jaxfuse.Plan`` the pseudo-gradients are synced with (its
      density, buckets and collectives; density 1: a dense mean).
    inner: the inner optimizer, any optax transform, run on each worker's
      own gradients; a number or schedule: ``optax.adamw`` at that
      learning rate with weight decay 1e-4.
    every: H >= 1, the inner steps between syncs (the sync runs at the
      end of steps H, 2H, ...).
    outer: the optax transform of the synced pseudo-gradient whose update
      moves the anchor; None: ``optax.sgd(1.0)`` (the anchor moves to the
      workers' synced mean).
    residual_decay: d in (0, 1], the error feedback's decay.
    options: ``jaxfuse.RecipeOptions``: ``clip_norm`` clips each worker's
      gradient (its global norm) before the inner step; ``axis_name``
      the workers' axis; ``mask`` is the inner optimizer's to take.

  Returns:
    An optax ``GradientTransformationExtraArgs``; make its state with
    ``jaxfuse.init_state``. Its ``update(grads, state, params)`` runs
    inside the per-worker step with ``grads`` taken at
    ``inner_params(params, state)``, and returns the anchor's update
    (zero between syncs).

  Raises:
    PlanError: ``plan`` is not a plan, or has leaves that are not
      floating point.
    SyncError: ``every`` not an integer >= 1, ``residual_decay`` out of
      range, ``inner`` or ``outer`` not an optax transform, a ``mask``
      in ``options``, or a bad ``clip_norm``.
  """
  clip_norm, mask, axis_name = recipe_checks.options("local_steps", options)
  recipes.require_trainable(plan, "local_steps")
  if isinstance(every, bool) or not isinstance(every, int) or every < 1:
    raise transform.SyncError(
        f"local_steps: every={every!r} must be an integer >= 1, the inner "
        "steps between syncs (e.g. 30).")
  transform.check_rate("local_steps", "residual_decay", residual_decay,
                       "(0, 1]")
  if mask is not None:
    raise transform.SyncError(
        "local_steps: options.mask is the inner optimizer's to take; pass "
        "inner=optax.adamw(lr, weight_decay=..., mask=...) instead.")
  recipe_checks.check_clip(clip_norm)
  if not isinstance(inner, optax.GradientTransformation):
    (lr,) = recipe_checks.numbers("local_steps", learning_rate=inner)
    inner = optax.adamw(lr, weight_decay=1e-4)
  outer = optax.sgd(1.0) if outer is None else outer
  for name, tx in (("inner", inner), ("outer", outer)):
    if not isinstance(tx, optax.GradientTransformation):
      raise transform.SyncError(
          f"local_steps: {name}={tx!r} must be an optax transform (e.g. "
          f"optax.{'adamw(3e-4)' if name == 'inner' else 'sgd(1.0)'}).")
  if clip_norm is not None:
    inner = optax.chain(optax.clip_by_global_norm(clip_norm), inner)
  inner = transform.per_worker(inner)
  outer = optax.with_extra_args_support(outer)
  sync = transform.sparse_sync(plan, axis_name,
                               residual_decay=float(residual_decay))

  def init_fn(params):
    plan.validate(params)
    return LocalStepsState(
        jnp.zeros((), jnp.int32),
        transform.PerWorkerState(jax.tree.map(lambda p: p[None],
                                              _wide(params))),
        inner.init(params), sync.init(params), outer.init(params))

  def update_fn(grads, state, params=None, **extra_args):
    del extra_args
    if params is None:
      raise transform.SyncError(
          "local_steps.update needs the params (the anchor): "
          "opt.update(grads, state, params).")
    local = jax.tree.map(lambda x: x[0], state.local.inner)
    step, inner_state = inner.update(_wide(grads), state.inner, local)
    local = optax.apply_updates(local, step)
    count = state.count + 1

    def sync_now(local, sync_state, outer_state):
      wide = jax.tree.map(lambda p, x: p.astype(x.dtype) - x, params, local)
      # Δ in the plan's (the params') dtype, rounded explicitly; its
      # rounding stays with θ_k
      sent = jax.tree.map(lambda w, p: bucket_sync.round_to(w, p.dtype)[0],
                          wide, params)
      carry = jax.tree.map(lambda w, r: w - r, wide, sent)
      delta = jax.tree.map(lambda r, p: r.astype(p.dtype), sent, params)
      mean, sync_state = sync.update(delta, sync_state, params)
      update, outer_state = outer.update(mean, outer_state, params)
      update = jax.tree.map(lambda u, p: u.astype(p.dtype), update, params)
      # the new anchor as the step rounds it (explicitly: XLA may keep a
      # bfloat16 sum in float32 here), less the carried rounding
      local = jax.tree.map(
          lambda p, u, c: bucket_sync.round_to(
              p.astype(c.dtype) + u.astype(c.dtype), p.dtype)[0] - c,
          params, update, carry)
      # per-worker values, typed so in both branches
      local, sync_state = _compat.to_varying((local, sync_state), axis_name)
      return update, local, sync_state, outer_state

    def keep(local, sync_state, outer_state):
      return (jax.tree.map(jnp.zeros_like, params), local, sync_state,
              outer_state)

    update, local, sync_state, outer_state = lax.cond(
        count % every == 0, sync_now, keep, local, state.sync, state.outer)
    new_local = transform.PerWorkerState(jax.tree.map(lambda x: x[None],
                                                      local))
    return update, LocalStepsState(count, new_local, inner_state, sync_state,
                                   outer_state)

  return recipes.as_recipe("local_steps", plan, optax.GradientTransformation(
      init_fn, update_fn), axis_name)
