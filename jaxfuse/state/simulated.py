"""K workers on one device: ``simulated_mesh`` and ``vmap_workers``.

Each worker is a slice of a named ``jax.vmap`` axis whose name is the mesh
axis name, and JAX's collectives (``psum``, ``all_gather``,
``all_to_all``, ``ppermute``, ``axis_index``) run over a vmap axis as over
a mesh axis. ``vmap_workers(f, mesh, in_specs, out_specs)`` is
``jax.shard_map(f, mesh=..., in_specs, out_specs)`` with the workers on
one device: an argument of spec ``P("data")`` and global shape
(K·n, ...) reaches worker k as its block k of shape (n, ...), as
``shard_map`` gives it, and an argument of spec ``P()`` reaches every
worker whole. A per-worker state leaf (K, ...) thus keeps its leading
axis of 1 on each worker, and a batch (K·b, ...) gives each worker its
b rows.

What comes out with ``P()`` must not depend on the worker: ``vmap``
returns it unbatched (``out_axes=None``), and refuses at trace time a
value that is batched, as ``shard_map`` refuses a value that varies.
The results of ``psum``, ``pmean`` and ``all_gather`` are unbatched, so
the params after the sync and the mean loss come back as one array.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import PartitionSpec as P


@dataclasses.dataclass(frozen=True, eq=False)
class SimulatedMesh:
  """K workers on one device, where a ``jax.sharding.Mesh`` goes
  (``simulated_mesh``).

  Attributes:
    devices: an array of the mesh's shape (K,) or (H, L) holding the one
      device every worker runs on.
    axis_names: the workers' axis names, ``("data",)`` or
      ``("host", "local")``.
  """
  devices: np.ndarray
  axis_names: tuple[str, ...]

  @property
  def shape(self) -> dict[str, int]:
    """``{axis name: workers along it}``, as ``Mesh.shape``."""
    return dict(zip(self.axis_names, self.devices.shape))

  @property
  def size(self) -> int:
    """K, the number of workers."""
    return int(self.devices.size)

  @property
  def device(self) -> jax.Device:
    """The one device all the workers run on."""
    return self.devices.flat[0]


def simulated_mesh(workers: int | tuple[int, int] = 8,
                   axis_name: str | tuple[str, str] = "data",
                   device: jax.Device | None = None) -> SimulatedMesh:
  """K data-parallel workers simulated on one device.

  Pass it where a ``jax.sharding.Mesh`` goes: ``make_train_step``,
  ``init_state``, and ``vmap_workers`` in place of ``jax.shard_map``. Each
  worker is a slice of a named ``jax.vmap`` axis, so worker k computes
  what device k of a K-device mesh computes, on its own rows and its own
  per-worker state; the collectives run over the vmap axis.

  Args:
    workers: K, or a pair (H, L) for a two-level mesh of H hosts of L
      workers (``jaxfuse.make_mesh(local=L)``'s shape, for ``"hier"``).
    axis_name: the axis name (default ``"data"``), or the pair of names
      for a two-level mesh (default ``("host", "local")``).
    device: the device (default ``jax.devices()[0]``).

  Returns:
    A ``SimulatedMesh``.

  Raises:
    ValueError: ``workers`` is not a positive integer (or a pair of
      them), or ``axis_name`` does not match its shape.
  """
  shape = workers if isinstance(workers, tuple) else (workers,)
  if not (1 <= len(shape) <= 2 and all(
      isinstance(n, numbers.Integral) and not isinstance(n, bool) and n >= 1
      for n in shape)):
    raise ValueError(f"simulated_mesh: workers={workers!r} must be a "
                     "positive integer K, or a pair (hosts, workers per "
                     "host) for a two-level mesh.")
  if len(shape) == 2 and axis_name == "data":
    axis_name = ("host", "local")
  names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
  if len(names) != len(shape) or not all(isinstance(a, str) for a in names):
    raise ValueError(f"simulated_mesh: axis_name={axis_name!r} must name "
                     f"each axis of workers={workers!r} (a string for K, a "
                     "pair of strings for (hosts, workers per host)).")
  device = jax.devices()[0] if device is None else device
  grid = np.empty(tuple(int(n) for n in shape), dtype=object)
  grid.fill(device)
  return SimulatedMesh(grid, tuple(names))


def is_simulated(mesh: Any) -> bool:
  """Whether ``mesh`` is a ``SimulatedMesh``."""
  return isinstance(mesh, SimulatedMesh)


def _split_axes(spec: P, mesh: SimulatedMesh, where: str) -> tuple:
  """The mesh axes a spec splits the leading axis over, in mesh order; a
  ``ValueError`` naming ``where`` for a spec ``vmap`` cannot mirror."""
  if not isinstance(spec, P):
    raise ValueError(f"vmap_workers: {where} is {spec!r}, not a "
                     "PartitionSpec (P('data') or P()).")
  if any(s is not None for s in tuple(spec)[1:]):
    raise ValueError(f"vmap_workers: {where} is {spec}; simulated workers "
                     "split only the leading axis (P('data') or P()).")
  first = tuple(spec)[0] if len(spec) else None
  names = () if first is None else (
      first if isinstance(first, tuple) else (first,))
  order = [a for a in mesh.axis_names if a in names]
  if set(names) - set(mesh.axis_names) or tuple(order) != tuple(names):
    raise ValueError(f"vmap_workers: {where} is {spec}, but the simulated "
                     f"mesh has axes {mesh.axis_names}; name them in that "
                     "order.")
  return names


def vmap_workers(f: Callable, mesh: SimulatedMesh, in_specs, out_specs
                 ) -> Callable:
  """``jax.shard_map(f, mesh=..., in_specs, out_specs)`` over simulated
  workers: ``f`` runs as a named ``jax.vmap`` over each axis of ``mesh``.

  An argument of spec ``P(axis)`` and global shape (K·n, ...) is reshaped
  to (K, n, ...) and mapped (``in_axes=0``), so worker k gets rows
  k·n … (k+1)·n − 1 as under ``shard_map``; ``P()`` is passed whole to
  every worker (``in_axes=None``). Outputs map back the same way; a
  ``P()`` output must be the same on every worker (unbatched), else
  ``jax.vmap`` stops at trace time. Wrap the result in ``jax.jit``.

  Args:
    f: the per-worker function (``shard_map``'s).
    mesh: a ``jaxfuse.simulated_mesh(workers=K)``.
    in_specs: a tuple with one ``PartitionSpec`` (or tree of them) per
      argument of ``f``, as for ``shard_map``.
    out_specs: a ``PartitionSpec`` or tree of them for ``f``'s output.

  Returns:
    A function of the global arrays, returning the global outputs.

  Raises:
    TypeError: ``mesh`` is not a ``SimulatedMesh``.
    ValueError: (when called) a spec that splits another axis than the
      leading one, names an axis the mesh lacks, or a leading axis that
      does not split over the workers (named).
  """
  if not is_simulated(mesh):
    raise TypeError(f"vmap_workers: mesh is a {type(mesh).__name__}; pass "
                    "jaxfuse.simulated_mesh(workers=K) (for a real "
                    "jax.sharding.Mesh use jax.shard_map).")
  names, sizes = mesh.axis_names, mesh.devices.shape

  def split(x, spec, where):
    axes = _split_axes(spec, mesh, where)
    if not axes:
      return x
    k = int(np.prod([mesh.shape[a] for a in axes]))
    if not np.ndim(x) or np.shape(x)[0] % k:
      raise ValueError(
          f"vmap_workers: {where} has shape {np.shape(x)}, whose leading "
          f"axis does not split over the {k} workers of {spec}; give it a "
          f"multiple of {k} rows.")
    return x.reshape(*(mesh.shape[a] for a in axes), -1, *np.shape(x)[1:])

  def merge(x, spec, where):
    axes = _split_axes(spec, mesh, where)
    if not axes:
      return x
    return x.reshape(-1, *np.shape(x)[len(axes) + 1:])

  def mapped(*args):
    specs = tuple(in_specs) if isinstance(in_specs, (tuple, list)) else (
        in_specs,)
    if len(specs) != len(args):
      raise ValueError(f"vmap_workers: {len(args)} arguments, but in_specs "
                       f"has {len(specs)}; give one spec (or tree) each.")
    leaves, tree = jax.tree.flatten(args)
    flat_specs = [s for spec, arg in zip(specs, args)
                  for s in _leaf_specs(spec, arg)]
    where = [f"argument {jax.tree_util.keystr(p)}" for p, _ in
             jax.tree_util.tree_flatten_with_path(args)[0]]
    leaves = [split(x, s, w) for x, s, w in zip(leaves, flat_specs, where)]
    fn = lambda *flat: f(*jax.tree.unflatten(tree, flat))
    for level in reversed(range(len(sizes))):   # the innermost first
      name = names[level]
      in_axes = tuple(0 if name in _split_axes(s, mesh, w) else None
                      for s, w in zip(flat_specs, where))
      out_axes = jax.tree.map(
          lambda s, name=name: 0 if name in _split_axes(s, mesh, "out_specs")
          else None, out_specs, is_leaf=lambda s: isinstance(s, P))
      fn = jax.vmap(fn, in_axes=in_axes, out_axes=out_axes, axis_name=name,
                    axis_size=sizes[level])
    out = fn(*leaves)
    out_leaves, out_tree = jax.tree.flatten(out)
    out_leaves = [merge(x, s, "out_specs") for x, s in
                  zip(out_leaves, _leaf_specs(out_specs, out))]
    return jax.tree.unflatten(out_tree, out_leaves)

  return mapped


def _leaf_specs(spec, tree) -> list:
  """One ``PartitionSpec`` per leaf of ``tree``, from ``spec`` (a spec for
  the whole tree, or a tree of specs that is a prefix of it)."""
  is_spec = lambda s: isinstance(s, P)
  if is_spec(spec):
    return [spec] * len(jax.tree.leaves(tree))
  subtrees = jax.tree.structure(spec, is_leaf=is_spec).flatten_up_to(tree)
  return [s for s, sub in zip(jax.tree.leaves(spec, is_leaf=is_spec),
                              subtrees) for _ in jax.tree.leaves(sub)]


def worker_map(f: Callable, mesh: Any, in_specs, out_specs) -> Callable:
  """``jax.shard_map`` on a ``jax.sharding.Mesh``, ``vmap_workers`` on a
  ``SimulatedMesh``: the step builder's one call for either."""
  if is_simulated(mesh):
    return vmap_workers(f, mesh, in_specs, out_specs)
  return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs)


def put(tree: Any, mesh: Any, spec: P) -> Any:
  """``tree`` placed as ``spec`` says on a real mesh; on a simulated one,
  whole on its device (the global arrays: the same shapes)."""
  if is_simulated(mesh):
    return jax.device_put(tree, mesh.device)
  return jax.device_put(tree, jax.sharding.NamedSharding(mesh, spec))
