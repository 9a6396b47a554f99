"""The few JAX and optax APIs that moved between versions, guarded in one place.

Supported: JAX >= 0.10 (``jax.shard_map``,
``jax.make_mesh(..., axis_types=...)`` and varying-manual-axes typing all
exist there).
"""

from __future__ import annotations

import functools
import inspect
import numbers

import jax
from jax import lax
import numpy as np
import optax

_ALL_GATHER_HAS_TO = "to" in inspect.signature(lax.all_gather).parameters


def make_mesh(num_devices: int | None = None, axis_name="data",
              devices=None, *, local: int | None = None
              ) -> jax.sharding.Mesh:
  """A data-parallel mesh with an explicit ``axis_types``.

  Without ``local``: 1-D, the first ``num_devices`` devices along
  ``axis_name``. With ``local=L``: 2-D, axes ``("host", "local")`` (or the
  pair passed as ``axis_name``) of shape (num_devices/L, L) for the
  hierarchical ``"hier"`` collective, host-major. One process: rows of L
  consecutive ``devices`` (2 × 4 emulates 2 hosts on 8 CPU devices). Under
  ``jax.distributed``: one row per process, in ``process_index`` order, so
  L must be each process's device count.

  Args:
    num_devices: how many devices (default: all).
    axis_name: the axis name, or for ``local`` the pair of names.
    devices: the devices to use (default ``jax.devices()``).
    local: L, devices per host for a 2-level mesh; None: 1-D.

  Returns:
    A ``jax.sharding.Mesh`` with ``Explicit`` axis types.

  Raises:
    ValueError: ``num_devices`` is more than there are, ``local`` does not
      divide them (or is not each process's device count), or
      ``axis_name`` is not a pair with ``local``.
  """
  devices = list(jax.devices() if devices is None else devices)
  num_devices = len(devices) if num_devices is None else num_devices
  if not (isinstance(num_devices, numbers.Integral) and
          not isinstance(num_devices, bool) and
          1 <= num_devices <= len(devices)):
    raise ValueError(
        f"num_devices={num_devices!r}: this process sees {len(devices)} "
        "devices; pick an integer between 1 and that.")
  num_devices = int(num_devices)
  if local is None:
    return jax.make_mesh((num_devices,), (axis_name,),
                         axis_types=(jax.sharding.AxisType.Explicit,),
                         devices=devices[:num_devices])
  names = ("host", "local") if axis_name == "data" else axis_name
  if not (isinstance(names, tuple) and len(names) == 2 and
          all(isinstance(a, str) for a in names)):
    raise ValueError(f"axis_name={axis_name!r}: a 2-level mesh (local=...) "
                     "takes a pair of axis names, e.g. ('host', 'local').")
  if not (isinstance(local, numbers.Integral) and not isinstance(local, bool)
          and 1 <= local and num_devices % local == 0):
    raise ValueError(f"local={local!r} must be a positive integer dividing "
                     f"num_devices={num_devices}.")
  local = int(local)
  grid = np.array(devices[:num_devices], dtype=object).reshape(-1, local)
  if jax.process_count() > 1:
    devices = sorted(devices, key=lambda d: d.process_index)  # stable
    grid = np.array(devices[:num_devices], dtype=object).reshape(-1, local)
    for row in grid:
      procs = {d.process_index for d in row}
      count = sum(d.process_index == row[0].process_index for d in devices)
      if len(procs) != 1 or count != local:
        raise ValueError(
            f"local={local}: under jax.distributed a host row is one "
            f"process's devices; process {row[0].process_index} has {count}. "
            "Pass local=jax.local_device_count().")
  return jax.sharding.Mesh(
      grid, names, axis_types=(jax.sharding.AxisType.Explicit,) * 2)


def varying_axes(x) -> frozenset:
  """Worker axes over which ``x`` may differ: the manual (``shard_map``)
  axes its type says it varies over, and the named ``vmap`` axes it is
  batched along (``batched_axes``). Empty outside both."""
  aval = jax.typeof(x)
  vma = getattr(aval, "vma", None)
  if vma is None:
    mat = getattr(aval, "mat", None)
    vma = (getattr(mat, "varying", frozenset()) if mat is not None
           else frozenset())
  return frozenset(vma) | batched_axes(x)


def batched_axes(x) -> frozenset:
  """The named ``jax.vmap`` axes along which ``x`` is batched, read from
  its batching tracers (a value that does not depend on an axis is not
  batched along it). Empty outside ``vmap``, and inside a ``jit`` or
  ``lax`` control-flow body traced under it (its values are not batching
  tracers there); a ``vmap`` without ``axis_name`` is not named."""
  try:   # JAX's batching tracers: private, so guarded here alone
    from jax._src.interpreters import batching  # pylint: disable=g-import-not-at-top
  except ImportError:   # pragma: no cover - a JAX that moved them
    return frozenset()
  names = set()
  while isinstance(x, batching.BatchTracer):
    # an unnamed vmap's name is None or a sentinel object(), never a str
    name = getattr(x._trace.axis_data, "name", None)  # pylint: disable=protected-access
    if isinstance(name, str) and x.batch_dim is not getattr(
        batching, "not_mapped", None):
      names.add(name)
    x = x.val
  return frozenset(names)


def manual_axes() -> frozenset:
  """The manual axes of the enclosing ``shard_map`` (empty outside one)."""
  return frozenset(jax.sharding.get_abstract_mesh().manual_axes)


def vmap_axis(axis_name) -> bool:
  """Whether ``axis_name`` (a name or a tuple of names) is bound, and each
  of its names by a named ``jax.vmap`` rather than a ``shard_map``: the
  workers simulated on one device (``jaxfuse.simulated_mesh``)."""
  names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
  return axis_size(axis_name) is not None and not set(names) & manual_axes()


def vary_alike(*xs):
  """Cast xs to vary over the union of their varying manual (shard_map) axes;
  a no-op outside shard_map."""
  mats = [getattr(jax.typeof(x), "mat", None) for x in xs]
  if any(m is None for m in mats):
    return xs
  axes = frozenset().union(*(m.varying for m in mats))
  return tuple(
      lax.pcast(x, tuple(sorted(axes - m.varying)), to="varying")
      if axes - m.varying else x for x, m in zip(xs, mats))


@functools.cache
def pallas_triton():
  """``jax.experimental.pallas.triton``, or None where this JAX no longer
  ships Pallas's Triton backend (deprecated in JAX 0.12)."""
  try:
    from jax.experimental.pallas import triton  # pylint: disable=g-import-not-at-top
  except ImportError:
    return None
  return triton


def x32(fn):
  """``fn`` traced with JAX's 32-bit defaults whatever ``jax_enable_x64``
  says. The kernels are written for int32 and float32: under x64, Python
  numbers and integer sums inside them would turn 64-bit (a ref store of an
  int64 into an int32 buffer, ``pl.cdiv`` of an int32 by an int64)."""
  @functools.wraps(fn)
  def in_x32(*args, **kwargs):
    with jax.enable_x64(False):
      return fn(*args, **kwargs)
  if hasattr(fn, "clear_cache"):     # a jitted fn's, for tests and users
    in_x32.clear_cache = fn.clear_cache
  return in_x32


def triton_params(kernel: str, num_warps: int):
  """``CompilerParams(num_warps=...)`` of Pallas's Triton backend, or an
  ImportError naming ``kernel`` and the fix where this JAX has none."""
  triton = pallas_triton()
  if triton is None:
    raise ImportError(
        f"{kernel}: JAX {jax.__version__} has no Pallas Triton backend "
        "(jax.experimental.pallas.triton); call jaxfuse.kernels' dispatch "
        "with JAXFUSE_KERNELS=auto or reference, which runs the XLA "
        "reference (the same results, bit for bit).")
  return triton.CompilerParams(num_warps=num_warps)


def kernel_operands(*xs, interpret: bool, kernel: str, reference: str):
  """A ``pallas_call``'s operands made to vary alike (``vary_alike``), and
  ``(shape, dtype) -> ShapeDtypeStruct`` for its outputs, which vary as
  they do: under shard_map's ``check_vma`` untyped outputs are rejected.
  The Pallas interpreter of JAX 0.10-0.12 fails on varying operands, so
  ``interpret`` there is an error naming ``reference``."""
  xs = vary_alike(*xs)
  if interpret and varying_axes(xs[0]) & manual_axes():
    raise NotImplementedError(
        f"{kernel}(interpret=True) inside shard_map needs check_vma=False "
        "(the Pallas interpreter of JAX 0.10-0.12 fails on operands that "
        f"vary over manual axes); off GPU use {reference} instead.")
  mat = getattr(jax.typeof(xs[0]), "mat", None)
  return xs, lambda shape, dtype: jax.ShapeDtypeStruct(
      shape, dtype, manual_axis_type=mat)


def axis_size(axis_name) -> int | None:
  """Size of a bound mesh axis (a tuple: the product), or ``None`` when
  ``axis_name`` is not bound."""
  try:
    return int(lax.axis_size(axis_name))
  except NameError:
    return None


def to_varying(tree, axis_name):
  """Mark every array leaf as varying over ``axis_name`` (a name or a tuple
  of names; no data moves). Names bound by a ``jax.vmap`` are skipped: a
  vmap axis has no such typing (``vmap_axis``)."""
  names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
  manual = manual_axes()
  names = tuple(a for a in names if a in manual or axis_size(a) is None)
  if not names:
    return tree
  if isinstance(axis_name, tuple):
    def cast(x):
      missing = tuple(a for a in names if a not in varying_axes(x))
      return lax.pcast(x, missing, to="varying") if missing else x
    return jax.tree.map(cast, tree)

  def cast_one(x):
    if axis_name in varying_axes(x):
      return x
    return lax.pcast(x, axis_name, to="varying")
  return jax.tree.map(cast_one, tree)


def all_gather_invariant(x, axis_name: str):
  """``all_gather`` whose result is typed as identical on every worker
  (over a ``jax.vmap`` axis a plain ``all_gather``, which comes out
  unbatched)."""
  if vmap_axis(axis_name):
    return lax.all_gather(x, axis_name)
  if _ALL_GATHER_HAS_TO:
    return lax.all_gather(x, axis_name, to="invarying")
  from jax._src.lax import parallel  # pylint: disable=g-import-not-at-top
  return parallel.all_gather_invariant(x, axis_name)


def is_tracer(x) -> bool:
  """Whether ``x`` is a traced value (inside ``jit``, ``grad``, ...)."""
  tracer = getattr(jax.core, "Tracer", None)
  if tracer is None:   # moved out of jax.core
    from jax._src import core  # pylint: disable=g-import-not-at-top
    tracer = core.Tracer
  return isinstance(x, tracer)


def is_float_dtype(dtype) -> bool:
  try:
    return bool(jax.numpy.issubdtype(jax.numpy.dtype(dtype),
                                     jax.numpy.floating))
  except TypeError:
    return False


def is_float_value(x) -> bool:
  """Whether ``x`` (an array, scalar or ShapeDtypeStruct) holds floats."""
  return is_float_dtype(jax.numpy.result_type(x))


def global_norm(tree):
  """√Σ x² over a pytree: ``optax.tree.norm`` (optax ≥ 0.2.5), else the
  deprecated ``optax.global_norm``."""
  tree_lib = getattr(optax, "tree", None)
  if tree_lib is not None and hasattr(tree_lib, "norm"):
    return tree_lib.norm(tree)
  return optax.global_norm(tree)


def ordered_effects(effects) -> list:
  """The effects among ``effects`` whose order the program must keep
  (``io_callback(ordered=True)``, state); all but the collectives' named-axis
  effects where JAX's internal registry has moved."""
  try:
    # pylint: disable-next=g-import-not-at-top
    from jax._src import effects as jax_effects
    return [e for e in effects if jax_effects.ordered_effects.contains(e)]
  except (ImportError, AttributeError):
    return [e for e in effects if type(e).__name__ != "NamedAxisEffect"]


def xla_hints(start_early: bool = False):
  """A context that gives the ops traced in it, with ``start_early``, the
  XLA frontend attribute ``scheduler_hint=force_delay_async`` (an async
  collective starts as early and ends as late as it can); otherwise none."""
  import contextlib  # pylint: disable=g-import-not-at-top
  if not start_early:
    return contextlib.nullcontext()
  from jax.experimental import xla_metadata  # pylint: disable=g-import-not-at-top
  return xla_metadata.set_xla_metadata(scheduler_hint="force_delay_async")


def debug_info_for(info, num_args: int, num_results: int):
  """A jaxpr's ``DebugInfo`` for a part of it with other arguments and
  results (unnamed); None where the type has moved."""
  try:
    return info._replace(arg_names=("",) * num_args,
                         result_paths=("",) * num_results)
  except (AttributeError, TypeError, ValueError):
    return None
