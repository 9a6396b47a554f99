"""The few JAX and optax APIs that moved between versions, guarded in one place.

Supported: JAX >= 0.10 (``jax.shard_map``, ``jax.make_mesh(..., axis_types=...)``
and varying-manual-axes typing all exist there).
"""

from __future__ import annotations

import inspect

import jax
from jax import lax
import optax

_ALL_GATHER_HAS_TO = "to" in inspect.signature(lax.all_gather).parameters


def make_mesh(num_devices: int | None = None, axis_name: str = "data",
              devices=None) -> jax.sharding.Mesh:
  """A 1-D data-parallel mesh with an explicit ``axis_types``."""
  devices = list(jax.devices() if devices is None else devices)
  num_devices = len(devices) if num_devices is None else num_devices
  if num_devices < 1 or num_devices > len(devices):
    raise ValueError(
        f"num_devices={num_devices}: this process sees {len(devices)} devices; "
        "pick a number between 1 and that.")
  return jax.make_mesh((num_devices,), (axis_name,),
                       axis_types=(jax.sharding.AxisType.Explicit,),
                       devices=devices[:num_devices])


def varying_axes(x) -> frozenset:
  """Mesh axes over which ``x`` may differ (empty outside ``shard_map``)."""
  aval = jax.typeof(x)
  vma = getattr(aval, "vma", None)
  if vma is None:
    mat = getattr(aval, "mat", None)
    vma = getattr(mat, "varying", frozenset()) if mat is not None else frozenset()
  return frozenset(vma)


def axis_size(axis_name: str) -> int | None:
  """Size of a bound mesh axis, or ``None`` when ``axis_name`` is not bound."""
  try:
    return int(lax.axis_size(axis_name))
  except NameError:
    return None


def to_varying(tree, axis_name: str):
  """Mark every array leaf as varying over ``axis_name`` (no data moves)."""
  def cast(x):
    if axis_name in varying_axes(x):
      return x
    return lax.pcast(x, axis_name, to="varying")
  return jax.tree.map(cast, tree)


def all_gather_invariant(x, axis_name: str):
  """``all_gather`` whose result is typed as identical on every worker."""
  if _ALL_GATHER_HAS_TO:
    return lax.all_gather(x, axis_name, to="invarying")
  from jax._src.lax import parallel  # pylint: disable=g-import-not-at-top
  return parallel.all_gather_invariant(x, axis_name)


def is_float_dtype(dtype) -> bool:
  try:
    return bool(jax.numpy.issubdtype(jax.numpy.dtype(dtype),
                                     jax.numpy.floating))
  except TypeError:
    return False


def global_norm(tree):
  """√Σ x² over a pytree: ``optax.tree.norm`` (optax ≥ 0.2.5), else the
  deprecated ``optax.global_norm``."""
  tree_lib = getattr(optax, "tree", None)
  if tree_lib is not None and hasattr(tree_lib, "norm"):
    return tree_lib.norm(tree)
  return optax.global_norm(tree)
