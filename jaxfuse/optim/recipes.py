"""Optimizer recipes around ``sparse_sync``: where the momentum, the
preconditioner and the error feedback sit decides whether sparse training
converges. Each alias is a whole optimizer, like ``optax.adamw``; chain
nothing before it. docs/convergence.md has the figures behind each.

K workers, worker k's gradient g_k, sent_k the top slots of what it
accumulates, ⟨·⟩ = (1/K)·Σ_k (what the collective computes), η the
learning rate, λ the weight decay:

``sgd`` (DGC: momentum correction and factor masking, Lin et al. 2018)::

  u_k ← m·u_k + g_k ;  v_k ← v_k + u_k ;  send top(v_k), zero u_k, v_k there
  x ← x − η·⟨sent⟩

``local_adamw`` (error feedback in update units, Karimireddy et al. 2019)::

  m_k, v_k ← Adam moments of g_k (per worker) ;  a_k = m̂_k / (√v̂_k + ε)
  e_k ← e_k + a_k ;  send top(e_k) ;  x ← x − η·(⟨sent⟩ + λ·x)

``sync_adamw`` (the baseline: sync the gradient, then AdamW)::

  e_k ← e_k + g_k ;  send top(e_k) ;  x ← AdamW(⟨sent⟩)

``onebit_adamw`` (1-bit Adam's two stages, Tang et al. 2021, sparse)::

  dense phase:  ĝ = ⟨g⟩ ; m ← β₁m + (1−β₁)ĝ ; v ← β₂v + (1−β₂)ĝ²
  sparse phase: e_k ← e_k + β₁m + (1−β₁)g_k ; send top(e_k) ; m ← ⟨sent⟩ ;
                v frozen
  x ← x − η·(m̂ / (√v̂ + ε) + λ·x)

``demo`` (decoupled momentum, Peng, Kingma et al. 2024; top-k extraction)::

  m_k ← β·m_k + g_k ;  send top(m_k), m_k ← m_k − sent_k
  x ← x − η·(sign(⟨sent⟩) + λ·x)

The dense phase of a warm-up (``jaxfuse.density_warmup``) runs any of them
on a density-1 plan: every element is sent, and each recipe becomes its
dense optimizer (``sgd``: plain SGD, DGC's masking clears the velocity).

0.2's keywords (``b1``, ``b2``, ``nesterov``, ``mask_momentum``,
``residual_decay``, ``clip_norm``, ``mask``, ``axis_name``) still work
until 0.4, with a ``DeprecationWarning`` naming their new place
(``betas=``, ``sgd_options=``, ``options=``): ``recipe_checks.upgrade``
through ``jaxfuse._deprecated.legacy_keywords``. ``onebit_adamw``'s
moments and state are in ``jaxfuse.optim.moments``.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxfuse import _compat
from jaxfuse import _deprecated
from jaxfuse.optim import clipping
from jaxfuse.sync import grouped
from jaxfuse.state import placement
from jaxfuse import plans
from jaxfuse.sync import bucket_steps
from jaxfuse.optim import moments
from jaxfuse.optim import recipe_checks
from jaxfuse import transform

ScalarOrSchedule = float | Callable[[jax.Array], jax.Array]
RecipeOptions = recipe_checks.RecipeOptions
SGDOptions = recipe_checks.SGDOptions
STATIC_ARGS = recipe_checks.STATIC_ARGS
local_clip_by_global_norm = clipping.local_clip_by_global_norm
OnebitState = moments.OnebitState
first_moment = moments.first_moment
second_moment = moments.second_moment
second_moment_change = moments.second_moment_change


def _bucket_clip(plan, max_norm, axis_name):
  """Each bucket clipped at its share of max_norm·√K (jaxfuse.clipping),
  with per-worker state; None: identity."""
  recipe_checks.check_clip(max_norm)
  if max_norm is None:
    return optax.identity()
  return transform.per_worker(
      clipping.clip_by_bucket_norm(plan, max_norm, axis_name),
      float32_state=False)


def require_trainable(plan, where: str) -> None:
  """A ``Plan`` whose every leaf is floating point: a recipe updates every
  leaf, and an integer leaf's gradient (``float0``) supports no arithmetic."""
  plans.require_plan(plan, where)
  ints = [f"{l.path} ({l.dtype})" for l in plan.leaves
          if not _compat.is_float_dtype(l.dtype)]
  if ints:
    raise plans.PlanError(
        f"{where}: leaves {ints[:5]} are not floating point and cannot be "
        "trained. Plan and differentiate the floating-point parameters "
        "only (keep integer state in a tree of its own), or chain "
        "jaxfuse.sparse_sync, which passes their float0 gradients "
        "through, with transforms that handle them.")


class _AdamWArgs(NamedTuple):
  learning_rate: ScalarOrSchedule
  b1: float
  b2: float
  eps: float
  weight_decay: float
  clip_norm: float | None
  mask: Any
  axis_name: str


def _adamw_args(name: str, plan, betas, options, **numbers) -> _AdamWArgs:
  """An AdamW recipe's checked arguments (``numbers``: learning_rate, eps,
  weight_decay), each error raised in the recipe's order: betas' form,
  options' kind, the plan, the numbers, the betas' range, clip_norm."""
  b1, b2 = recipe_checks.betas(name, betas)
  clip_norm, mask, axis_name = recipe_checks.options(name, options)
  require_trainable(plan, name)
  learning_rate, b1, b2, eps, weight_decay, clip_norm = recipe_checks.numbers(
      name, learning_rate=numbers["learning_rate"], b1=b1, b2=b2,
      eps=numbers["eps"], weight_decay=numbers["weight_decay"],
      clip_norm=clip_norm)
  recipe_checks.check_betas(name, b1=b1, b2=b2)
  recipe_checks.check_clip(clip_norm)
  return _AdamWArgs(learning_rate, b1, b2, eps, weight_decay, clip_norm,
                    mask, axis_name)


def _kinds(state) -> tuple:
  """A state's type and its parts' types (a chain's state is a tuple)."""
  parts = (tuple("array" if hasattr(x, "shape") else type(x).__name__
                 for x in state)
           if isinstance(state, tuple) else ())
  return (type(state).__name__,) + parts


def as_recipe(name: str, plan: plans.Plan, tx: optax.GradientTransformation,
            axis_name) -> optax.GradientTransformationExtraArgs:
  """``tx``, whose update first checks that the state has the parts its
  init makes (types, at the top level; ``sparse_sync`` checks its own
  state's layout), naming the recipe instead of optax's chain error, and
  that its per-worker parts came into the step per-worker
  (``placement.check_worker_state``)."""
  tx = optax.with_extra_args_support(tx)
  wanted = {}   # the updates' treedef -> the kinds init makes (or None)

  def update_fn(updates, state, params=None, **extra_args):
    treedef = jax.tree.structure(updates)
    if treedef.num_leaves == len(plan.leaves):
      if treedef not in wanted:
        like = jax.tree.unflatten(treedef, [
            jax.ShapeDtypeStruct(l.shape, l.dtype) for l in plan.leaves])
        try:
          wanted[treedef] = _kinds(jax.eval_shape(tx.init, like))
        except plans.PlanError:   # other leaves: sparse_sync names them
          wanted[treedef] = None
      want = wanted[treedef]
      if want is not None and _kinds(state) != want:
        raise transform.SyncError(
            f"{name}: the optimizer state is not one this optimizer made "
            f"(it is {_show(_kinds(state))}; {name}'s is {_show(want)}: "
            f"another recipe's, or {name}'s with other settings such as "
            f"clip_norm). Create it with jaxfuse.init_state({name}(plan, "
            "...), params, mesh), or restore a checkpoint into a `like` "
            "made so.")
    placement.check_worker_state(updates, state, axis_name, name)
    out, new_state = tx.update(updates, state, params, **extra_args)
    recipe_checks.warn_if_nonfinite(name, plan, transform.sync_stats(new_state))
    return out, new_state

  return optax.GradientTransformationExtraArgs(tx.init, update_fn)


def _show(kinds: tuple) -> str:
  return kinds[0] + (f"({', '.join(kinds[1:])})" if len(kinds) > 1 else "")


def _tail(learning_rate, weight_decay, mask):
  return optax.chain(optax.add_decayed_weights(weight_decay, mask),
                     optax.scale_by_learning_rate(learning_rate))


@_deprecated.legacy_keywords(recipe_checks.upgrade(
    "sgd", SGDOptions._fields + RecipeOptions._fields))
def sgd(plan: plans.Plan, learning_rate: ScalarOrSchedule,
        momentum: float = 0.9, *, weight_decay: float = 0.0,
        sgd_options: SGDOptions | None = None,
        options: RecipeOptions | None = None
        ) -> optax.GradientTransformationExtraArgs:
  """SGD with DGC's momentum correction and factor masking (module doc).

  Momentum lives on each worker, before the sparsification: momentum applied
  after the sync (``chain(sparse_sync, optax.sgd(η, m))``) multiplies the
  bursts error feedback releases a second time and diverges. Leaves the plan
  syncs dense get ordinary momentum after their exact mean (the same as
  momentum on each worker, the mean being linear).

  Which settings: keep the defaults (heavy-ball momentum, full error
  feedback) at the learning rate tuned for dense; on easy problems they
  match dense. If the loss diverges at that rate (a stiff problem, a low
  density such as 0.01), set ``residual_decay=0.8``: a coordinate then
  holds about 1/(1 − d) = 5 steps of velocity instead of about 1/ρ, and
  its release stays a stable step at the dense rate (it drops what error
  feedback would deliver late, so it costs a little where the default is
  stable). ``nesterov=True`` is not recommended at high learning rates:
  at a low density it diverged at and above dense's best rate.
  ``mask_momentum=True`` is stable only for η ≤ 2ρ·η_max (η_max: dense
  momentum SGD's largest stable rate). docs/convergence.md, "SGD with
  momentum", has the measurements.

  Args:
    plan: the ``jaxfuse.Plan`` (of this phase) for the parameters.
    learning_rate: η, a number or an optax schedule.
    momentum: m in [0, 1), each worker's velocity u ← m·u + g.
    weight_decay: λ, decoupled (x ← x − η·λ·x).
    sgd_options: ``jaxfuse.SGDOptions(nesterov, mask_momentum,
      residual_decay)``; None: the defaults.
    options: ``jaxfuse.RecipeOptions(clip_norm, mask, axis_name)``; None:
      the defaults.

  Returns:
    An optax ``GradientTransformationExtraArgs``; make its state with
    ``jaxfuse.init_state``.

  Raises:
    PlanError: ``plan`` is not a plan, or has leaves that are not
      floating point.
    SyncError: a hyperparameter is not a number or out of range, or one
      of ``STATIC_ARGS["sgd"]`` is traced.
    TypeError: an unknown keyword.
  """
  clip_norm, mask, axis_name = recipe_checks.options("sgd", options)
  nesterov, mask_momentum, residual_decay = recipe_checks.options(
      "sgd", sgd_options, SGDOptions, "sgd_options")
  require_trainable(plan, "sgd")
  (learning_rate, momentum, clip_norm, weight_decay,
   residual_decay) = recipe_checks.numbers(
      "sgd", learning_rate=learning_rate, momentum=momentum,
      clip_norm=clip_norm, weight_decay=weight_decay,
      residual_decay=residual_decay)
  recipe_checks.check_betas("sgd", momentum=momentum)
  recipe_checks.check_betas("sgd", upper_closed=True,
                            residual_decay=residual_decay)
  dense = [l.mode == "dense" for l in plan.leaves]
  dense_mask = lambda tree: jax.tree.unflatten(jax.tree.structure(tree),
                                               dense)
  return as_recipe("sgd", plan, optax.chain(
      _bucket_clip(plan, clip_norm, axis_name),
      transform.sparse_sync(plan, axis_name, momentum=momentum,
                            nesterov=nesterov, mask_momentum=mask_momentum,
                            residual_decay=residual_decay),
      optax.masked(optax.trace(momentum, nesterov), dense_mask)
      if momentum and any(dense) else optax.identity(),
      _tail(learning_rate, weight_decay, mask)), axis_name)


@_deprecated.legacy_keywords(recipe_checks.upgrade(
    "local_adamw", ("b1", "b2") + RecipeOptions._fields))
def local_adamw(plan: plans.Plan, learning_rate: ScalarOrSchedule,
                betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                weight_decay: float = 1e-4, *,
                options: RecipeOptions | None = None
                ) -> optax.GradientTransformationExtraArgs:
  """AdamW preconditioned on each worker, error feedback on the update
  (module doc).

  Args:
    plan: the ``jaxfuse.Plan`` (of this phase) for the parameters.
    learning_rate: η, a number or an optax schedule.
    betas: (β₁, β₂), each in [0, 1).
    eps: ε, added to √v̂.
    weight_decay: λ, decoupled (x ← x − η·λ·x).
    options: ``jaxfuse.RecipeOptions(clip_norm, mask, axis_name)``; None:
      the defaults.

  Returns:
    An optax ``GradientTransformationExtraArgs``; make its state with
    ``jaxfuse.init_state``.

  Raises:
    PlanError: ``plan`` is not a plan, or has leaves that are not
      floating point.
    SyncError: a hyperparameter is not a number or out of range
      (``betas`` not a pair), or one of ``STATIC_ARGS[name]`` is traced.
    TypeError: an unknown keyword.
  """
  (learning_rate, b1, b2, eps, weight_decay, clip_norm, mask,
   axis_name) = _adamw_args("local_adamw", plan, betas, options,
                            learning_rate=learning_rate, eps=eps,
                            weight_decay=weight_decay)
  return as_recipe("local_adamw", plan, optax.chain(
      _bucket_clip(plan, clip_norm, axis_name),
      transform.per_worker(optax.scale_by_adam(b1, b2, eps)),
      transform.sparse_sync(plan, axis_name),
      _tail(learning_rate, weight_decay, mask)), axis_name)


@_deprecated.legacy_keywords(recipe_checks.upgrade(
    "sync_adamw", ("b1", "b2") + RecipeOptions._fields))
def sync_adamw(plan: plans.Plan, learning_rate: ScalarOrSchedule,
               betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
               weight_decay: float = 1e-4, *,
               options: RecipeOptions | None = None
               ) -> optax.GradientTransformationExtraArgs:
  """The baseline: sparse-sync the gradient, then AdamW (``clip_norm``
  clips the synced gradient's global norm, after the sync).

  Args:
    plan: the ``jaxfuse.Plan`` (of this phase) for the parameters.
    learning_rate: η, a number or an optax schedule.
    betas: (β₁, β₂), each in [0, 1).
    eps: ε, added to √v̂.
    weight_decay: λ, decoupled (x ← x − η·λ·x).
    options: ``jaxfuse.RecipeOptions(clip_norm, mask, axis_name)``; None:
      the defaults.

  Returns:
    An optax ``GradientTransformationExtraArgs``; make its state with
    ``jaxfuse.init_state``.

  Raises:
    PlanError: ``plan`` is not a plan, or has leaves that are not
      floating point.
    SyncError: a hyperparameter is not a number or out of range
      (``betas`` not a pair), or one of ``STATIC_ARGS[name]`` is traced.
    TypeError: an unknown keyword.
  """
  (learning_rate, b1, b2, eps, weight_decay, clip_norm, mask,
   axis_name) = _adamw_args("sync_adamw", plan, betas, options,
                            learning_rate=learning_rate, eps=eps,
                            weight_decay=weight_decay)
  return as_recipe("sync_adamw", plan, optax.chain(
      transform.sparse_sync(plan, axis_name),
      optax.clip_by_global_norm(clip_norm) if clip_norm else optax.identity(),
      optax.adamw(learning_rate, b1, b2, eps, weight_decay=weight_decay,
                  mask=mask)), axis_name)


@_deprecated.legacy_keywords(recipe_checks.upgrade(
    "onebit_adamw", ("b1", "b2") + RecipeOptions._fields))
def onebit_adamw(plan: plans.Plan, learning_rate: ScalarOrSchedule,
                  betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                  weight_decay: float = 1e-4, *,
                  options: RecipeOptions | None = None
                  ) -> optax.GradientTransformationExtraArgs:
  """1-bit Adam's scheme with top-k in place of 1-bit (module doc).

  Its plan decides the stage: a density-1 plan (``with_density(plan, 1)``,
  the dense phase of ``density_warmup(plan, dense_steps=...)``) is exact
  Adam (on a bfloat16 ``dense_wire``, Adam on the rounded mean, each
  worker's rounding carried to the next step) and updates v; any other
  plan sparsifies the momentum with error feedback and keeps v frozen.
  Train at least one dense step first (v = 0 would make the first sparse
  steps huge); the update is zero until then.
  ``clip_norm`` clips the mean gradient in the dense phase (exactly dense
  AdamW's clip, after the sync) and, in the others, each worker's gradient
  per bucket at its share of clip_norm·√K (``jaxfuse.clipping``: no bucket
  waits for another's gradients); the dense phase records the bucket norms
  that the first sparse step's shares start from. A sparse step before any
  dense step warns (once): it would train nothing.

  Args:
    plan: the ``jaxfuse.Plan`` (of this phase) for the parameters.
    learning_rate: η, a number or an optax schedule.
    betas: (β₁, β₂), each in [0, 1).
    eps: ε, added to √v̂.
    weight_decay: λ, decoupled (x ← x − η·λ·x).
    options: ``jaxfuse.RecipeOptions(clip_norm, mask, axis_name)``; None:
      the defaults.

  Returns:
    An optax ``GradientTransformationExtraArgs``; make its state with
    ``jaxfuse.init_state``.

  Raises:
    PlanError: ``plan`` is not a plan, or has leaves that are not
      floating point.
    SyncError: a hyperparameter is not a number or out of range
      (``betas`` not a pair), or one of ``STATIC_ARGS[name]`` is traced.
    TypeError: an unknown keyword.
  """
  (learning_rate, b1, b2, eps, weight_decay, clip_norm, mask,
   axis_name) = _adamw_args("onebit_adamw", plan, betas, options,
                            learning_rate=learning_rate, eps=eps,
                            weight_decay=weight_decay)
  sched = bucket_steps.compile_plan(plan)
  dense_phase = all(b.kind != bucket_steps.SPARSE for b in sched.buckets)
  sync = transform.sparse_sync(plan, axis_name)
  # m as the all-gather decode writes it: the decoded array is the new m
  lay = grouped.layout(plan, sched)
  mean_clip = (optax.clip_by_global_norm(clip_norm) if clip_norm
               else optax.identity())
  bucket_clip = _bucket_clip(plan, clip_norm, axis_name)

  def init_fn(params):
    plan.validate(params)   # names the leaves that differ, before grouping
    zeros = jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), jnp.float32),
                         params)
    return moments.OnebitState(
        jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32),
        grouped.group(lay, zeros), zeros, sync.init(params),
        bucket_clip.init(params) if clip_norm else ())

  def update_fn(updates, state, params=None, **extra_args):
    del extra_args
    cast = lambda tree, like: jax.tree.map(lambda x, y: x.astype(y.dtype),
                                           tree, like)
    moments.check_moment(lay, state.mu)
    treedef = jax.tree.structure(updates)
    clip_state = state.clip
    if dense_phase:
      if clip_norm:
        clip_state = _record_bucket_norms(plan, updates, clip_state)
      g, sync_state = sync.update(updates, state.sync, params)
      g, _ = mean_clip.update(g, optax.EmptyState())
      g = jax.tree.map(lambda x: x.astype(jnp.float32), g)
      # group by group: a group's rows of the mean are one slice of the
      # all-reduced buffer, so this is one kernel per group
      mu = jax.tree.map(lambda m, x: b1 * m + (1 - b1) * x, state.mu,
                        grouped.group(lay, g))
      nu = jax.tree.map(lambda v, x: b2 * v + (1 - b2) * x * x, state.nu, g)
      nu_count = state.nu_count + 1
    else:
      recipe_checks.warn_if_no_dense_step(state.nu_count)
      if clip_norm:
        updates, clip_state = bucket_clip.update(updates, clip_state)
      if all(x.dtype == jnp.float32 for x in jax.tree.leaves(updates)):
        # x = b1·m + (1 − b1)·g, formed where the fused pass reads m and g
        mean, sync_state = sync.update(updates, state.sync, params,
                                       blend=(state.mu, b1))
      else:
        m = grouped.ungroup(lay, state.mu, treedef)
        local = jax.tree.map(lambda m, x: b1 * m + (1 - b1) * x, m, updates)
        mean, sync_state = sync.update(cast(local, updates), state.sync,
                                       params)
      # with float32 gradients the decoded rows themselves: XLA folds
      # the regrouping away
      mu = grouped.group(lay, mean)
      nu, nu_count = state.nu, state.nu_count
    count = state.count + 1
    c1 = 1 - b1 ** count.astype(jnp.float32)
    c2 = 1 - b2 ** jnp.maximum(nu_count, 1).astype(jnp.float32)
    step = jax.tree.map(
        lambda m, v: jnp.where(nu_count > 0,
                               (m / c1) / (jnp.sqrt(v / c2) + eps), 0.0),
        grouped.ungroup(lay, mu, treedef), nu)
    new_state = moments.OnebitState(count, nu_count, mu, nu, sync_state,
                                    clip_state)
    return cast(step, updates), new_state

  return as_recipe("onebit_adamw", plan, optax.chain(
      optax.GradientTransformationExtraArgs(init_fn, update_fn),
      _tail(learning_rate, weight_decay, mask)), axis_name)


def _record_bucket_norms(plan, grads, state: transform.PerWorkerState):
  """The bucket-clip state after a step that clipped the mean instead."""
  local = clipping.BucketClipState(state.inner.norms[0])
  return transform.PerWorkerState(clipping.BucketClipState(
      clipping.record_bucket_norms(plan, grads, local).norms[None]))


@_deprecated.legacy_keywords(recipe_checks.upgrade(
    "demo", RecipeOptions._fields))
def demo(plan: plans.Plan, learning_rate: ScalarOrSchedule,
         momentum: float = 0.999, weight_decay: float = 1e-4, *,
         sign: bool = True, options: RecipeOptions | None = None
         ) -> optax.GradientTransformationExtraArgs:
  """DeMo: the decaying local momentum is the error-feedback buffer
  (module doc).

  Args:
    plan: the ``jaxfuse.Plan`` (of this phase) for the parameters.
    learning_rate: η, a number or an optax schedule.
    momentum: β in (0, 1], each worker's m ← β·m + g (the residual decay).
    weight_decay: λ, decoupled (x ← x − η·λ·x).
    sign: step by the sign of the synced momentum (DeMo's); False: by it.
    options: ``jaxfuse.RecipeOptions(clip_norm, mask, axis_name)``; None:
      the defaults.

  Returns:
    An optax ``GradientTransformationExtraArgs``; make its state with
    ``jaxfuse.init_state``.

  Raises:
    PlanError: ``plan`` is not a plan, or has leaves that are not
      floating point.
    SyncError: a hyperparameter is not a number or out of range, or one
      of ``STATIC_ARGS["demo"]`` is traced.
    TypeError: an unknown keyword.
  """
  clip_norm, mask, axis_name = recipe_checks.options("demo", options)
  require_trainable(plan, "demo")
  learning_rate, momentum, weight_decay, clip_norm = recipe_checks.numbers(
      "demo", learning_rate=learning_rate, momentum=momentum,
      weight_decay=weight_decay, clip_norm=clip_norm)
  recipe_checks.check_betas("demo", upper_closed=True, momentum=momentum)
  return as_recipe("demo", plan, optax.chain(
      _bucket_clip(plan, clip_norm, axis_name),
      transform.sparse_sync(plan, axis_name, residual_decay=momentum),
      optax.GradientTransformation(
          lambda _: optax.EmptyState(),
          lambda u, s, p=None: (jax.tree.map(jnp.sign, u), s))
      if sign else optax.identity(),
      _tail(learning_rate, weight_decay, mask)), axis_name)


RECIPES = {
    "sgd": sgd,
    "local_adamw": local_adamw,
    "sync_adamw": sync_adamw,
    "onebit_adamw": onebit_adamw,
    "demo": demo,
}
