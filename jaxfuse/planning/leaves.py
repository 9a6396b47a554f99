"""The leaves of a plan: a ``LeafPlan`` per parameter, and the parameter
trees that are refused with their fix (flax NNX objects and state, a linen
model's variables, PRNG keys, anything but arrays)."""

from __future__ import annotations

import math
from typing import Mapping

import jax
import numpy as np

from jaxfuse import _compat
from jaxfuse import plans


def leaf_plans(params, density: float, estimator: str,
                settings: plans.Settings) -> list[plans.LeafPlan]:
  """A ``LeafPlan`` per leaf of ``params``.

  Args:
    params: the parameter pytree (arrays or ``jax.ShapeDtypeStruct``s).
    density: ρ of each sparse leaf.
    estimator: the sparse leaves' threshold estimator.
    settings: the plan's ``Settings`` (``min_sparse_size``, ``headroom``).

  Returns:
    Per leaf in pytree order: sparse where it is a float leaf of at least
    ``min_sparse_size`` elements and ρ < 1, else dense.

  Raises:
    PlanError: a leaf that cannot be planned (complex, empty, not an
      array, PRNG keys, flax state), named with the fix.
  """
  _refuse_nnx_object(params)
  _refuse_linen_variables(params)
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  if not flat:
    raise plans.PlanError("params has no array leaves to plan for.")
  leaves = []
  for path, x in flat:
    name = jax.tree_util.keystr(path)
    dtype = _leaf_dtype(name, x)
    shape = tuple(int(d) for d in np.shape(x))
    size = math.prod(shape)
    if jax.numpy.issubdtype(dtype, jax.numpy.complexfloating):
      raise plans.PlanError(
          f"leaf {name}: {dtype} parameters are not supported (jaxfuse "
          "averages and sparsifies real gradients); keep the real and "
          "imaginary parts as two float leaves.")
    if size == 0:
      raise plans.PlanError(
          f"leaf {name}: has zero elements; remove it from the parameters.")
    sparse = (density < 1 and size >= settings.min_sparse_size and
              _compat.is_float_dtype(dtype))
    if sparse:
      cap = plans.capacity(density, size, estimator, settings.headroom)
      leaves.append(plans.LeafPlan(name, shape, dtype, "sparse",
                                   float(density), cap, estimator))
    else:
      leaves.append(plans.LeafPlan(name, shape, dtype, "dense", 1.0,
                                   size, None))
  return leaves


_NNX_SPLIT = ("`graphdef, params, rest = nnx.split(model, nnx.Param, ...)`, "
              "then `jaxfuse.plan(params, ...)` (docs/choosing.md, \"With "
              "flax NNX\")")


def _leaf_dtype(name: str, x) -> str:
  """The dtype of a parameter leaf: an array (or array-like with shape and
  dtype) or a Python/numpy number; ``PlanError`` naming the leaf for
  anything else (a string, a dtype, an unregistered dataclass, PRNG
  keys)."""
  where = f"leaf {name}" if name else "params"
  dtype = getattr(x, "dtype", None)
  if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
    raise plans.PlanError(
        f"{where}: holds {dtype} values (PRNG keys), which have no "
        f"gradient; plan the trained parameters only (with flax NNX, "
        f"{_NNX_SPLIT}).")
  numeric = isinstance(x, (bool, int, float, complex, np.number)) or (
      hasattr(x, "shape") and dtype is not None and (
          jax.numpy.issubdtype(dtype, jax.numpy.number) or
          jax.numpy.issubdtype(dtype, jax.numpy.bool_)))
  if not numeric:
    what = (f"the type {x.__name__}" if isinstance(x, type) else
            f"an array of {dtype}" if hasattr(x, "shape") else
            f"a {type(x).__name__}")
    raise plans.PlanError(
        f"{where}: {what}, not a numeric array: params must be a pytree of "
        "arrays. Register a dataclass as a pytree "
        "(jax.tree_util.register_dataclass, flax.struct.dataclass) and keep "
        "strings, dtypes and other settings out of the tree.")
  return str(jax.numpy.result_type(x))


def _nnx_classes(x) -> list[str]:
  """Names of the flax NNX classes ``x`` is an instance of (none when flax
  is not in use: detected by the classes' module, so that flax stays an
  optional dependency)."""
  return [c.__name__ for c in type(x).__mro__
          if c.__module__.startswith("flax.nnx")]


# NNX variable types that hold no trained parameters
_NNX_STATE = ("BatchStat", "RngState", "Cache", "Intermediate", "OptState")


# flax linen variable collections that hold no trained parameters
_LINEN_STATE = ("batch_stats", "cache", "intermediates", "perturbations",
                "losses")


def _refuse_linen_variables(params) -> None:
  """A flax linen ``variables`` dict (``model.init``'s whole output) with
  collections besides ``"params"``: the running statistics would be
  planned, and their gradients synced, as if trained."""
  if not isinstance(params, Mapping) or "params" not in params:
    return
  others = sorted(k for k in params if k in _LINEN_STATE)
  if others:
    raise plans.PlanError(
        f"params holds the flax collections {['params', *others]}: a linen "
        "model's variables, not its parameters. Plan variables['params'] "
        "(and differentiate with respect to it); keep the other "
        "collections out of the optimizer.")


def _refuse_nnx_object(params) -> None:
  """A flax NNX object (a ``Module``, an ``Optimizer``) anywhere in
  ``params``, or an NNX variable that is no parameter (batch statistics,
  RNG state, an optimizer's state): its ``nnx.Param`` part is what a plan
  covers."""
  def stop(x) -> bool:
    names = _nnx_classes(x)
    return bool(names) and "State" not in names
  for path, x in jax.tree_util.tree_flatten_with_path(params,
                                                       is_leaf=stop)[0]:
    names = _nnx_classes(x)
    where = (f"params{jax.tree_util.keystr(path)}" if path else "params")
    if names and "Variable" not in names and "State" not in names:
      raise plans.PlanError(
          f"{where} is a flax NNX {names[0]} ({type(x).__name__}), which "
          "can hold batch statistics, RNG state or an optimizer's state "
          f"besides parameters; plan its parameters: {_NNX_SPLIT}.")
    kind = next((n for n in names if n in _NNX_STATE), None)
    if kind:
      raise plans.PlanError(
          f"{where} is an nnx.{type(x).__name__} ({kind}), not a "
          f"parameter; plan the model's parameters: {_NNX_SPLIT}.")


def dense(leaf: plans.LeafPlan) -> plans.LeafPlan:
  """``leaf`` synchronized dense (density 1, every element a slot)."""
  return plans.LeafPlan(leaf.path, leaf.shape, leaf.dtype, "dense", 1.0,
                        leaf.size, None)
