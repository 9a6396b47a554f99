"""The update rules of ``train_lm.py``: ``--optimizer``'s recipe around
the plan (or its dense twin for ``--sync dense``), ``--local-steps``'
``jaxfuse.local_steps`` (SparseLoCo's or DiLoCo's outer step), and the
dense arm with 1-bit Adam's frozen second moment (``--freeze-v-at``).

Imported after ``train_lm`` has set up the simulated CPU devices: it
imports JAX.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

import jaxfuse
from train_lm_args import AXIS

# --outer: (outer learning rate, Nesterov momentum or None, error
# feedback decay) of SparseLoCo (Sarfi et al. 2025) and DiLoCo (Douillard
# et al. 2023)
OUTER = {"sparseloco": (1.0, None, 0.95), "diloco": (0.7, 0.9, 1.0)}


def make_optimizer(args, schedule, decay_mask, plan):
  """The update rule of ``--optimizer`` (``--local-steps``:
  ``local_steps_rule``); ``plan`` None: its dense twin (the gradients are
  ``pmean``ed first: AdamW, or SGD with momentum)."""
  clip = args.clip if args.clip > 0 else None
  if plan is not None and args.local_steps:
    return local_steps_rule(args, schedule, decay_mask, plan)
  if plan is None:
    if args.optimizer == "sgd":
      rule = optax.chain(optax.add_decayed_weights(args.weight_decay,
                                                   decay_mask),
                         optax.sgd(schedule, momentum=args.momentum or 0.9))
    else:
      rule = optax.adamw(schedule, b2=0.999 if args.b2 is None else args.b2,
                         weight_decay=args.weight_decay, mask=decay_mask)
      if args.freeze_v_at:
        rule = optax.chain(
            frozen_second_moment(0.9, 0.999 if args.b2 is None else args.b2,
                                 args.freeze_v_at),
            optax.add_decayed_weights(args.weight_decay, decay_mask),
            optax.scale_by_learning_rate(schedule))
    rule = optax.chain(optax.clip_by_global_norm(clip) if clip
                       else optax.identity(), rule)
    # the gradient is the mean here, the same on every worker
    return (rule if args.apply_if_finite is None else
            optax.apply_if_finite(rule, args.apply_if_finite))
  options = dict(weight_decay=args.weight_decay,
                 options=jaxfuse.RecipeOptions(clip_norm=clip, mask=decay_mask,
                                               axis_name=AXIS))
  if args.momentum is not None:
    options["momentum"] = args.momentum
  if args.b2 is not None:
    options["betas"] = (0.9, args.b2)
  rule = jaxfuse.RECIPES[args.optimizer](plan, schedule, **options)
  if args.apply_if_finite is not None:
    rule = jaxfuse.apply_if_finite(rule, args.apply_if_finite)
  return jaxfuse.delayed(rule, predict=args.predict) if args.delay else rule


class FrozenMomentsState(NamedTuple):
  """``frozen_second_moment``'s state: steps taken, m and v."""
  count: jax.Array
  mu: optax.Updates
  nu: optax.Updates


def frozen_second_moment(b1: float, b2: float, freeze_at: int
                         ) -> optax.GradientTransformation:
  """Adam's scaling (``optax.scale_by_adam``, ε = 1e-8) whose second
  moment v stops updating after ``freeze_at`` steps, as in 1-bit Adam:

    m_t = β₁·m + (1 − β₁)·g;   v_t = β₂·v + (1 − β₂)·g²  while t <= N,
                                v_t = v_N                  after
    update = m̂_t / (√v̂_t + ε),  m̂ = m_t / (1 − β₁ᵗ),
                                v̂ = v_t / (1 − β₂^min(t, N))

  The ``--sync dense`` arm with the recipe's frozen v and nothing else of
  it (``--freeze-v-at``)."""
  def init(params):
    zeros = jax.tree.map(jnp.zeros_like, params)
    return FrozenMomentsState(jnp.zeros([], jnp.int32), zeros, zeros)

  def update(grads, state, params=None):
    del params
    count = state.count + 1
    live = count <= freeze_at
    mu = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, state.mu, grads)
    nu = jax.tree.map(lambda v, g: jnp.where(live, b2 * v + (1 - b2) * g * g,
                                             v), state.nu, grads)
    t = count.astype(jnp.float32)
    c1 = 1 - b1 ** t
    c2 = 1 - b2 ** jnp.minimum(t, float(freeze_at))
    out = jax.tree.map(lambda m, v: (m / c1) / (jnp.sqrt(v / c2) + 1e-8),
                       mu, nu)
    return out, FrozenMomentsState(count, mu, nu)

  return optax.GradientTransformation(init, update)


def local_steps_rule(args, schedule, decay_mask, plan):
  """``--local-steps H``: ``jaxfuse.local_steps`` with the dense twin's
  AdamW (clip, β₂, weight decay and its mask) as the inner optimizer and
  ``--outer``'s outer step (``--outer-lr`` over its default)."""
  lr, momentum, decay = OUTER[args.outer]
  lr = args.outer_lr or lr
  outer = (optax.sgd(lr) if momentum is None else
           optax.sgd(lr, momentum=momentum, nesterov=True))
  inner = optax.chain(
      optax.clip_by_global_norm(args.clip) if args.clip > 0
      else optax.identity(),
      optax.adamw(schedule, b2=0.999 if args.b2 is None else args.b2,
                  weight_decay=args.weight_decay, mask=decay_mask))
  return jaxfuse.local_steps(plan, inner, args.local_steps, outer=outer,
                             residual_decay=decay,
                             options=jaxfuse.RecipeOptions(axis_name=AXIS))
