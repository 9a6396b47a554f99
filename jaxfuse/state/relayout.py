"""Carry a train state from one plan to another plan of the same leaves.

A state belongs to its plan's layout (``bucket_steps.layout``): which leaf
each residual row holds, how ``onebit_adamw``'s m is grouped, one clip
norm per bucket. ``relayout(tree, old, new)`` rebuilds each such piece
for ``new`` (another strategy, bucket size, ready order or estimator),
moving every leaf's numbers to where ``new`` keeps them::

  r_new[leaf] = r_old[leaf]   (residual and velocity, per worker; m)

so what the workers owe, (1/K)·Σ_k r_k, is unchanged and a step after
the switch sends what the old plan would have left owed. The controller
keeps a unit's threshold where ``new`` has the same unit (its leaves and
estimator) and starts afresh elsewhere (and where the unit's density
changed, at the next step: ``sparsify``); per-bucket clip norms restart
at 0 (the next step's shares are then the buckets' sizes); step counts
and per-leaf stats are kept. Bit for bit, except with
``residual_dtype="gradient"`` where a leaf leaves a group of a wider
dtype (a ``"behind"`` unit joining bfloat16 and float32 leaves) for one
of its own dtype: its numbers are rounded to that dtype, as a step of
the new plan rounds its residual.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxfuse.optim import clipping
from jaxfuse.sync import grouped
from jaxfuse.state import placement
from jaxfuse import plans
from jaxfuse.optim import recipes
from jaxfuse.sync import bucket_steps
from jaxfuse import sparsify
from jaxfuse import transform


def relayout(tree: Any, old: plans.Plan, new: plans.Plan) -> Any:
  """``tree`` (a train state, or any pytree holding optimizer states made
  with ``old``) with its plan-shaped parts rebuilt for ``new``; arrays
  keep their shardings. ``new`` must have ``old``'s leaves (paths,
  shapes, dtypes, dense or sparse).

  Args:
    tree: a pytree holding optimizer states made with ``old``.
    old: the plan the states were made with.
    new: the plan to rebuild them for.

  Returns:
    ``tree`` with its plan-shaped parts for ``new``.

  Raises:
    PlanError: ``new`` differs from ``old`` in its leaves (naming the leaf
      and field), or ``tree`` holds states of another layout than
      ``old``'s.
  """
  plans.require_plan(old, "relayout")
  plans.require_plan(new, "relayout")
  _check_leaves(old, new)
  if not transform.holds(tree, transform.is_sync_state):
    raise plans.PlanError(
        "relayout: the tree holds no sparse_sync state; pass the optimizer "
        "state (or the train state holding it).")
  move = _Move(old, new)
  kinds = (transform.SparseSyncState, recipes.OnebitState,
           clipping.BucketClipState)
  is_part = lambda x: isinstance(x, kinds)

  def rebuild(x):
    if isinstance(x, recipes.OnebitState):
      return x._replace(mu=move.moment(x.mu, jax.tree.structure(x.nu)),
                        sync=move.sync(x.sync),
                        clip=jax.tree.map(rebuild, x.clip, is_leaf=is_part))
    if isinstance(x, transform.SparseSyncState):
      return move.sync(x)
    if isinstance(x, clipping.BucketClipState):
      return move.clip(x)
    return x

  return jax.tree.map(rebuild, tree, is_leaf=is_part)


def _check_leaves(old: plans.Plan, new: plans.Plan) -> None:
  if len(old.leaves) != len(new.leaves):
    raise plans.PlanError(
        f"relayout: the old plan has {len(old.leaves)} leaves, the new "
        f"{len(new.leaves)}; make both from the same parameters.")
  for j, (a, b) in enumerate(zip(old.leaves, new.leaves)):
    if (a.path, a.shape, a.dtype, a.mode) != (b.path, b.shape, b.dtype,
                                              b.mode):
      raise plans.PlanError(
          f"relayout: leaf {j} is {a.path} {a.dtype} {list(a.shape)} "
          f"{a.mode} in the old plan and {b.path} {b.dtype} "
          f"{list(b.shape)} {b.mode} in the new one; both plans must be "
          "made from the same parameters with the same dense/sparse "
          "split (the same min_sparse_size).")


class _Move:
  """Where each leaf sits in both plans' state groups."""

  def __init__(self, old: plans.Plan, new: plans.Plan):
    self.old, self.new = old, new
    self.old_sched = bucket_steps.compile_plan(old)
    self.new_sched = bucket_steps.compile_plan(new)
    self.old_digest = bucket_steps.layout_digest(old, self.old_sched)
    self.new_digest = bucket_steps.layout_digest(new, self.new_sched)

  def _per_leaf(self, state, velocity: bool) -> dict[int, jax.Array]:
    """Each sparse leaf's (K, size) slice of its old unit's row."""
    rows = transform.unit_residuals(self.old, state, velocity=velocity)
    return {j: rows[u][:, start:start + self.old.leaves[j].size]
            for u, placed in enumerate(self.old_sched.unit_placement())
            for j, start in placed}

  def _groups(self, per_leaf, like) -> tuple[jax.Array, ...]:
    """The new plan's (K, G, n) groups from per-leaf slices, in the new
    groups' dtypes, sharded as ``like`` (an old group array)."""
    placed_in = self.new_sched.unit_placement()
    out = []
    for ids, dtype in zip(self.new_sched.groups, self.new_sched.group_dtypes):
      stacked = jnp.stack([jnp.concatenate([per_leaf[j] for j, _ in
                                            placed_in[u]], axis=1)
                           for u in ids], axis=1).astype(dtype)
      out.append(_like(stacked, like))
    return tuple(out)

  def sync(self, state: transform.SparseSyncState
           ) -> transform.SparseSyncState:
    part = state.layout and bucket_steps.digest_difference(state.layout,
                                                           self.old_digest)
    if part:
      raise plans.PlanError(
          f"relayout: a sparse_sync state in the tree was made for another "
          f"plan than the old one (its {part} differ); relayout each part "
          "of an optax.multi_transform with its own plans.")
    like = state.residuals[0] if state.residuals else None
    carry = lambda velocity: (
        self._groups(self._per_leaf(state, velocity), like)
        if (state.velocity if velocity else state.residuals) else ())
    return state._replace(residuals=carry(False), velocity=carry(True),
                          control=self._control(state.control),
                          layout=self.new_digest)

  def _control(self, control: sparsify.Control) -> sparsify.Control:
    """Per new unit: the old unit's column where it is the same unit
    (leaves, estimator), else the initial control."""
    key = lambda u: (u.leaves, u.estimator)
    old_of = {key(u): i for i, u in enumerate(self.old_sched.units)}
    workers = control.threshold.shape[0]
    fresh = sparsify.initial_control(max(1, len(self.new_sched.units)))

    def column(i, u, field, start):
      if u is not None and key(u) in old_of:
        return field[:, old_of[key(u)]]
      return jnp.broadcast_to(start[i], (workers,))

    units = list(self.new_sched.units) or [None]
    return jax.tree.map(
        lambda field, start: _like(jnp.stack(
            [column(i, u, field, start) for i, u in enumerate(units)],
            axis=1), field),
        control, fresh)

  def clip(self, state: clipping.BucketClipState) -> clipping.BucketClipState:
    norms = state.norms
    zeros = jnp.zeros(norms.shape[:-1] + (len(self.new.buckets),),
                      norms.dtype)
    return clipping.BucketClipState(_like(zeros, norms))

  def moment(self, mu: grouped.Grouped, treedef) -> grouped.Grouped:
    tree = grouped.ungroup(grouped.layout(self.old, self.old_sched), mu,
                           treedef)
    out = grouped.group(grouped.layout(self.new, self.new_sched), tree)
    like = (mu.rows + mu.loose)[0] if (mu.rows or mu.loose) else None
    return jax.tree.map(lambda x: _like(x, like), out)


def _like(x: jax.Array, like) -> jax.Array:
  """``x`` placed as ``like`` is laid along its leading axis."""
  sharding = getattr(like, "sharding", None)
  return (x if sharding is None else
          jax.device_put(x, placement.on_worker_axis(sharding)))
