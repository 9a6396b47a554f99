"""What ``make_train_step`` is given, checked: the optimizer as a factory
``plan -> optax transform`` (a recipe by name with its settings, or a
function), the transform it builds, and ``StepOptions.grad_at``'s point of
differentiation against the plan's dtypes.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxfuse import plans
from jaxfuse.optim import recipes
from jaxfuse.state import placement


def in_plan_dtypes(params: Any, plan: plans.Plan) -> Any:
  """``params`` cast to the dtypes ``plan`` records for its leaves (those
  of the gradients it syncs), or ``params`` where they are the same.

  Args:
    params: the parameters.
    plan: the plan the gradients are synced with.

  Returns:
    ``params``, each leaf in its plan leaf's dtype (``params`` itself when
    they match or the leaf counts differ: ``init_state`` names those).

  Raises:
    Nothing.
  """
  leaves, treedef = jax.tree.flatten(params)
  if len(leaves) != len(plan.leaves) or all(
      str(jnp.result_type(x)) == leaf.dtype
      for x, leaf in zip(leaves, plan.leaves)):
    return params    # (init_state names a plan of other leaves)
  return jax.tree.unflatten(treedef, [
      x.astype(leaf.dtype) for x, leaf in zip(leaves, plan.leaves)])


def check_grad_at(grad_at: Callable, params: Any, opt_state: Any,
                   plan: plans.Plan) -> None:
  """Check that ``grad_at(params, opt_state)`` has the params' structure
  and shapes, and the dtypes ``plan`` was made for.

  Args:
    grad_at: ``StepOptions.grad_at``.
    params: the parameters.
    opt_state: the optimizer state.
    plan: the final phase's plan.

  Returns:
    None.

  Raises:
    TypeError: ``grad_at`` fails, or returns another structure, shape or
      dtype (naming the leaf and the fix).
  """
  try:
    shapes = jax.eval_shape(grad_at, params, opt_state)
  except Exception as e:  # pylint: disable=broad-except
    raise TypeError(f"StepOptions.grad_at(params, opt_state) failed ({e}); "
                    "it must take the params and the optimizer state and "
                    "return the params to differentiate at.") from e
  if jax.tree.structure(shapes) != jax.tree.structure(params):
    raise TypeError(
        "StepOptions.grad_at returned another structure than the params "
        f"({jax.tree.structure(shapes)} against "
        f"{jax.tree.structure(params)}); return the params, e.g. cast.")
  for (path, x), s, leaf in zip(jax.tree_util.tree_leaves_with_path(params),
                                jax.tree.leaves(shapes), plan.leaves):
    where = f"params{jax.tree_util.keystr(path)}"
    if np.shape(x) != s.shape:
      raise TypeError(
          f"StepOptions.grad_at: {where} has shape {np.shape(x)}, but "
          f"grad_at returns {s.shape}; return each leaf in its own shape "
          "(a cast or a shift of it).")
    if str(s.dtype) != leaf.dtype:
      raise TypeError(
          f"StepOptions.grad_at returns {where} as {s.dtype}, but the plan "
          f"was made for {leaf.dtype}; make the plan from the params as "
          "grad_at returns them (jaxfuse.plan(<params cast to that "
          "dtype>, ...)).")


def as_factory(optimizer: Any) -> Callable[[plans.Plan], Any]:
  """``optimizer`` as a function ``plan -> optax transform``.

  Args:
    optimizer: a factory, a recipe name, or ``(name, settings)``.

  Returns:
    The factory (a recipe's with its settings bound).

  Raises:
    TypeError: a built transform, or not a factory or recipe.
    ValueError: an unknown recipe or setting, or a missing one.
  """
  if isinstance(optimizer, str):
    optimizer = (optimizer, {})
  if isinstance(optimizer, tuple) and optimizer and isinstance(optimizer[0],
                                                               str):
    return _recipe_factory(*optimizer)
  if callable(getattr(optimizer, "init", None)) and callable(
      getattr(optimizer, "update", None)):
    raise TypeError(
        "optimizer: got a built optax transform; make_train_step builds one "
        "per phase from the phase's plan, so pass a factory plan -> "
        "transform, e.g. functools.partial(jaxfuse.onebit_adamw, "
        "learning_rate=3e-4), or a recipe by name: ('onebit_adamw', "
        "{'learning_rate': 3e-4}).")
  if not callable(optimizer):
    raise TypeError(f"optimizer: expected a factory plan -> optax transform "
                    f"or a recipe name, got {type(optimizer).__name__}.")
  return optimizer


def _recipe_factory(name: str, settings: dict | None = None, *rest):
  """``RECIPES[name]`` with ``settings`` bound, checked against its
  signature."""
  if rest or not isinstance(settings, dict):
    raise TypeError(f"optimizer=({name!r}, ...): give the recipe's settings "
                    "as one dict, e.g. ('sgd', {'learning_rate': 0.1}).")
  if name not in recipes.RECIPES:
    raise ValueError(f"optimizer={name!r} is not a recipe; use one of "
                     f"{', '.join(sorted(recipes.RECIPES))} or a factory "
                     "plan -> optax transform.")
  recipe = recipes.RECIPES[name]
  params = list(inspect.signature(recipe).parameters.values())[1:]
  known = {p.name for p in params}
  unknown = sorted(set(settings) - known)
  if unknown:
    raise ValueError(f"optimizer=({name!r}, ...): jaxfuse.{name} has no "
                     f"setting {', '.join(unknown)}; it takes "
                     f"{', '.join(sorted(known))}.")
  missing = [p.name for p in params if p.default is inspect.Parameter.empty
             and p.kind != inspect.Parameter.VAR_KEYWORD
             and p.name not in settings]
  if missing:
    raise ValueError(f"optimizer={name!r}: jaxfuse.{name} needs "
                     f"{', '.join(missing)}; give it with the name, e.g. "
                     f"({name!r}, {{{missing[0]!r}: ...}}).")
  return functools.partial(recipe, **settings)


def build(factory: Callable, plan: plans.Plan):
  """``factory(plan)``, checked to be an optax transform.

  Args:
    factory: ``plan -> optax transform``.
    plan: the phase's plan.

  Returns:
    The transform.

  Raises:
    TypeError: ``factory(plan)`` is not an optax transform.
  """
  opt = factory(plan)
  placement.require_transform(opt, "make_train_step's optimizer(plan)")
  return opt
