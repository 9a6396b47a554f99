"""A params-shaped float32 tree kept the way ``sparse_sync``'s decode
writes it: one (G, n) array per state group of an all-gather bucket.

An all-gather bucket decodes each state group's worker means into one
(G, n) array (``collectives.allgather``). A recipe that keeps those means
as state (``onebit_adamw``'s m) in the params' shapes would copy every
row out of it into a leaf of its own each step; kept as ``Grouped``, the
decoded array is the new state itself and nothing is copied. Rows of a
group are its units (``plans.state_groups``, the order the residuals
use), a unit's leaves flattened one after another::

  rows[s][i] = concat(flat(leaf) for leaf in unit i of stacked group s)
  loose      = every other leaf (psum buckets, other schemes), in order

``group`` and ``ungroup`` are each other's inverse; under ``jit`` XLA
folds an ``ungroup`` followed by a ``group`` of the same rows into no
work at all.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxfuse import plans


class Grouped(NamedTuple):
  """A float32 tree in the state groups' layout (module docstring)."""
  rows: tuple[jax.Array, ...]    # per stacked state group: (G, n)
  loose: tuple[jax.Array, ...]   # every other leaf, in leaf order


class Layout(NamedTuple):
  """Where each leaf of a plan's params goes in a ``Grouped`` tree."""
  group_ids: tuple[int, ...]                  # stacked state groups
  groups: tuple[tuple[int, ...], ...]         # their unit ids
  units: tuple[tuple[tuple[int, int], ...], ...]  # per unit: (leaf, start)
  loose: tuple[int, ...]                      # leaf ids kept as they are
  shapes: tuple[tuple[int, ...], ...]         # every leaf's shape
  paths: tuple[str, ...]                      # and path

  @property
  def row_shapes(self) -> list[tuple[int, int]]:
    return [(len(ids), sum(math.prod(self.shapes[j]) for j, _ in
                           self.units[ids[0]])) for ids in self.groups]


def layout(steps, sched=None) -> Layout:
  """The ``Layout`` of a compiled plan: the state groups of its all-gather
  buckets (the only scheme whose decode writes a group as one array) as
  rows, every other leaf loose. It depends on the plan's layout only
  (``bucket_steps.layout_difference``), so every phase of a warm-up shares it.

  Args:
    steps: the compiled plan (``bucket_steps.compile_plan(plan)``); a ``Plan``
      still works until 0.4, with a DeprecationWarning.
    sched: 0.2's second argument, the plan compiled; used where given.

  Returns:
    The ``Layout``.

  Raises:
    Nothing for a compiled plan (a ``Plan`` is compiled here, with a
    ``DeprecationWarning``, until 0.4).
  """
  if sched is None and isinstance(steps, plans.Plan):
    warnings.warn(
        "grouped.layout(plan) is deprecated (removed in 0.4): pass the "
        "compiled plan, grouped.layout(jaxfuse.sync.bucket_steps.compile_plan("
        "plan)).", DeprecationWarning, stacklevel=2)
    from jaxfuse.sync import bucket_steps  # pylint: disable=g-import-not-at-top
    sched = bucket_steps.compile_plan(steps)
  sched = sched or steps
  gather = {g for b in sched.buckets if b.collective == "allgather"
            for g in b.groups}
  group_ids = tuple(g for g in range(len(sched.groups)) if g in gather)
  groups = tuple(sched.groups[g] for g in group_ids)
  units = sched.unit_placement()
  in_rows = {j for ids in groups for u in ids for j, _ in units[u]}
  return Layout(group_ids, groups, units,
                tuple(j for j in range(sched.num_leaves) if j not in in_rows),
                tuple(sched.leaf_shapes), tuple(sched.leaf_paths))


def group(lay: Layout, tree: Any) -> Grouped:
  """A params-shaped tree (leaves in the plan's order) as ``Grouped``,
  float32.

  Args:
    lay: the plan's ``layout``.
    tree: a pytree with the plan's leaves, in its order and shapes.

  Returns:
    The ``Grouped`` tree: the all-gather groups' units as rows, the other
    leaves loose, all float32.

  Raises:
    PlanError: another leaf count, or a leaf of another shape (named).
  """
  flat = [jnp.asarray(x, jnp.float32) for x in jax.tree.leaves(tree)]
  _check_count(lay, len(flat))
  for x, shape, path in zip(flat, lay.shapes, lay.paths):
    if tuple(x.shape) != tuple(shape):
      raise plans.PlanError(
          f"grouped: leaf {path} has shape {list(x.shape)}, the plan "
          f"{list(shape)}; make the plan from these parameters.")
  row = lambda u: jnp.concatenate([flat[j].reshape(-1)
                                   for j, _ in lay.units[u]])
  return Grouped(tuple(jnp.stack([row(u) for u in ids]) for ids in lay.groups),
                 tuple(flat[j] for j in lay.loose))


def ungroup(lay: Layout, grouped: Grouped, treedef) -> Any:
  """Inverse of ``group``: the tree of ``treedef`` (the params').

  Args:
    lay: the plan's ``layout``.
    grouped: a ``Grouped`` tree of that layout.
    treedef: the params' tree structure (``jax.tree.structure(params)``).

  Returns:
    The tree of ``treedef``, each leaf in the plan's shape.

  Raises:
    PlanError: ``grouped`` is not of this layout (``check``), or
      ``treedef`` has another leaf count.
  """
  check(lay, grouped)
  _check_count(lay, treedef.num_leaves)
  out = [None] * len(lay.shapes)
  for rows, ids in zip(grouped.rows, lay.groups):
    for i, u in enumerate(ids):
      for j, start in lay.units[u]:
        out[j] = rows[i, start:start + math.prod(lay.shapes[j])].reshape(
            lay.shapes[j])
  for j, x in zip(lay.loose, grouped.loose):
    out[j] = x
  return jax.tree.unflatten(treedef, out)


def _check_count(lay: Layout, num_leaves: int) -> None:
  if num_leaves != len(lay.shapes):
    raise plans.PlanError(
        f"grouped: the tree has {num_leaves} leaves, the plan "
        f"{len(lay.shapes)}; make the plan from these parameters.")


def check(lay: Layout, grouped: Any) -> None:
  """Check that ``grouped`` has the layout ``lay``.

  Args:
    lay: the plan's ``layout``.
    grouped: the tree to check (a ``Grouped``, e.g. ``OnebitState.mu``).

  Returns:
    None.

  Raises:
    PlanError: ``grouped`` is not a ``Grouped``, or its rows or loose
      leaves have other shapes (a state made with another plan).
  """
  if not isinstance(grouped, Grouped):
    raise plans.PlanError(
        f"expected a Grouped tree, got {type(grouped).__name__}.")
  want = lay.row_shapes
  got = [tuple(getattr(r, "shape", ())) for r in grouped.rows]
  loose = [tuple(getattr(x, "shape", ())) for x in grouped.loose]
  if got != want or loose != [lay.shapes[j] for j in lay.loose]:
    raise plans.PlanError(
        f"a Grouped tree with rows {got} and {len(loose)} loose leaves; this "
        f"plan lays it out as rows {want} and {len(lay.loose)} loose "
        "leaves. The state was made with another plan: create it with "
        "this one.")
