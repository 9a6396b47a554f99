"""Backward-ready order: when the backward pass produces each gradient.

We trace ``jax.grad(loss_fn)`` to a jaxpr. Equations in a jaxpr are in a
valid execution order, and the transposed (backward) program emits the last
layer's gradients first. The *ready key* of a gradient leaf is the position
of the equation that defines it, taken hierarchically through call-like
equations (``pjit``, ``remat``, ``custom_vjp``, …): the key is the tuple of
equation indices from the outer program down to the defining equation.
Leaves sorted by key are in backward-ready order. A gradient that is an input
or a literal (an unused parameter: zero gradient) is ready at once (key ()).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxfuse.plans import checks as plan_checks


class LossOutputError(plan_checks.PlanError):
  """The loss returns something other than one scalar (a tuple such as
  NNX's ``(loss, state)``, or a per-example array)."""


def check_scalar_loss(loss_fn: Callable, params, *args) -> None:
  """Raise ``LossOutputError`` unless ``loss_fn(params, *args)`` is a scalar.

  Only the output's shape is traced (``jax.eval_shape``); an error the
  loss itself raises (e.g. from wrong ``args``) propagates unchanged.

  Args:
    loss_fn: the loss, ``loss_fn(params, *args)``.
    params: the parameters (arrays or ``jax.ShapeDtypeStruct``s).
    *args: the arguments the loss takes after ``params``.

  Raises:
    LossOutputError: naming what the loss returned and both fixes.
  """
  out = jax.eval_shape(loss_fn, params, *args)
  leaves = jax.tree.leaves(out)
  if len(leaves) == 1 and not isinstance(out, (tuple, list, dict)) and (
      np.shape(leaves[0]) == ()):
    return
  if isinstance(out, (tuple, list)):
    what = (f"a {type(out).__name__} of {len(out)} parts (e.g. NNX's or a "
            "has_aux loss's (loss, state))")
  else:
    shapes = [tuple(np.shape(x)) for x in leaves]
    what = (f"{type(out).__name__} of shapes {shapes}" if len(leaves) != 1
            else f"an array of shape {shapes[0]}")
  raise LossOutputError(
      f"loss_fn returned {what}; the planner differentiates it and needs "
      "the scalar loss. Pass a function that returns only the loss: "
      "loss_fn=lambda params, *args: f(params, *args)[0] for a loss that "
      "returns (loss, aux), or the mean of per-example losses.")


def _sub_jaxprs(eqn):
  for name in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
    sub = eqn.params.get(name)
    if sub is not None:
      return getattr(sub, "jaxpr", sub)
  return None


def _ready_keys(jaxpr) -> dict:
  """var -> ready key for every variable an equation of ``jaxpr`` defines."""
  keys = {}
  for i, eqn in enumerate(jaxpr.eqns):
    sub = _sub_jaxprs(eqn)
    sub_keys = _ready_keys(sub) if sub is not None else {}
    for j, v in enumerate(eqn.outvars):
      inner = ()
      if sub is not None and j < len(sub.outvars):
        inner = sub_keys.get(sub.outvars[j], ())
      keys[v] = (i,) + inner
  return keys


class FromLoss(NamedTuple):
  """The backward-ready order read from the gradient of
  ``loss_fn(params, *example_args)`` (``jaxfuse.plan(order=FromLoss(
  loss_fn, (batch,)))``; ``example_args``: one worker's batch, arrays or
  ``jax.ShapeDtypeStruct``s)."""
  loss_fn: Callable
  example_args: tuple = ()


def ready_order(loss_fn: Callable, params, *args) -> list[int]:
  """Leaf ids of ``params`` (pytree order) sorted by backward-ready time."""
  unsharded = lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x))
  params, args = jax.tree.map(unsharded, (params, args))
  check_scalar_loss(loss_fn, params, *args)
  closed = jax.make_jaxpr(jax.grad(loss_fn))(params, *args)
  keys = _ready_keys(closed.jaxpr)
  out_keys = [() if hasattr(v, "val") else keys.get(v, ())  # Literal: ()
              for v in closed.jaxpr.outvars]
  return sorted(range(len(out_keys)), key=lambda i: (out_keys[i], -i))


def reverse_order(num_leaves: int) -> list[int]:
  """Fallback when no loss is given: reverse pytree order."""
  return list(reversed(range(num_leaves)))
