"""The fast objective of ``optimal``: a plan's leaves in ready order with
their costs (``GroupingProblem``), and the iteration time of a grouping of
them with O(1) work per group from prefix sums (the model is in
``optimal``'s module docstring). ``optimal`` re-exports ``GroupingProblem``.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Sequence

import jax.numpy as jnp
import numpy as np

from jaxfuse.planning.costs import Costs
from jaxfuse.planning.costs import LinearCost
from jaxfuse import plans
from jaxfuse.planning import simulate


def _leaf_wire_bytes(leaf: plans.LeafPlan, settings: plans.Settings,
                     collective) -> int:
  """A dense leaf's bytes, or a sparse leaf's slots as ``collective``
  carries them (``plans.wire_unit``)."""
  if leaf.mode == "dense":
    return leaf.size * jnp.dtype(leaf.dtype).itemsize
  unit = plans.Unit((0,), leaf.size, leaf.capacity, leaf.density,
                    leaf.estimator, leaf.dtype)
  return plans.payload_bytes(plans.wire_unit(unit, settings,
                                          collective))


@dataclasses.dataclass(frozen=True)
class GroupingProblem:
  """A plan's leaves in ready order with their costs, for grouping search.

  Positions 0..N-1 follow ``order`` (leaf ids). ``time(cuts)`` is the
  iteration time of the grouping whose groups end at positions ``cuts``.
  """
  order: tuple[int, ...]
  sparse: tuple[bool, ...]
  backward: tuple[float, ...]
  compress: tuple[float, ...]
  wire: tuple[int, ...]
  allgather: LinearCost
  psum: LinearCost
  forward: float
  overlap: float
  bucket: float = 0.0   # compute per sparse bucket (``costs.bucket``)

  @classmethod
  def from_plan(cls, plan: plans.Plan, costs: Costs,
                order: Sequence[int] | None = None) -> "GroupingProblem":
    """The problem of grouping ``plan``'s leaves under ``costs``.

    Args:
      plan: the plan whose leaves (modes, sizes, capacities) are grouped.
      costs: ``Costs`` for ``plan``'s leaves.
      order: leaf ids in backward-ready order. Default
        ``simulate.backward_order(plan)``, the order ``jaxfuse.plan``
        recorded (within a mixed bucket pair the plan lists sparse leaves
        before dense ones, so ``plan.ready_order`` is the true order only
        for plans without mixed groups).

    Returns:
      The ``GroupingProblem``.

    Raises:
      PlanError: if ``order`` does not list each leaf id once.
      CostsError: if ``costs`` does not fit ``plan``'s leaves.
    """
    costs.check(len(plan.leaves))
    order = tuple(int(i) for i in (simulate.backward_order(plan)
                                   if order is None else order))
    if not plans.is_leaf_order(order, len(plan.leaves)):
      raise plans.PlanError(f"order must list each of the "
                            f"{len(plan.leaves)} leaf ids once.")
    leaves = [plan.leaves[i] for i in order]
    sparse = tuple(l.mode == "sparse" for l in leaves)
    collective_of = {j: plans.bucket_scheme(b) for b in plan.buckets
                     for j in b.leaves}
    return cls(order, sparse,
               tuple(costs.backward[i] for i in order),
               tuple(costs.compress.time(l.size) if s else 0.0
                     for l, s in zip(leaves, sparse)),
               tuple(_leaf_wire_bytes(l, plan.settings, collective_of[i])
                     for i, l in zip(order, leaves)),
               costs.collectives["allgather"], costs.collectives["psum"],
               costs.forward, costs.overlap, costs.bucket)

  def __post_init__(self):
    n = len(self.order)
    for name in ("sparse", "backward", "compress", "wire"):
      if len(getattr(self, name)) != n:
        raise ValueError(f"GroupingProblem.{name} has "
                         f"{len(getattr(self, name))} entries for {n} leaves.")
    if n == 0:
      raise ValueError("GroupingProblem has no leaves.")
    for name in ("backward", "compress", "wire"):
      if any(not x >= 0 for x in getattr(self, name)):
        raise ValueError(f"GroupingProblem.{name} must be >= 0.")
    if not 0 <= self.overlap <= 1:
      raise ValueError(f"GroupingProblem.overlap={self.overlap} must be in "
                       "[0, 1].")
    if not self.bucket >= 0:
      raise ValueError(f"GroupingProblem.bucket={self.bucket} must be >= 0.")

  def __len__(self):
    return len(self.order)

  def _tables(self):
    t = self.__dict__.get("_t")
    if t is None:
      n = len(self)
      cum = lambda xs: list(itertools.accumulate(xs, initial=0.0))
      s = self.sparse
      t = dict(
          pos=cum(b + h for b, h in zip(self.backward, self.compress)),
          sb=cum(b + h if x else 0.0
                 for b, h, x in zip(self.backward, self.compress, s)),
          sw=cum(w if x else 0 for w, x in zip(self.wire, s)),
          dw=cum(0 if x else w for w, x in zip(self.wire, s)),
          ns=cum(1 if x else 0 for x in s), n=n,
          # after_sparse[t]: 1 + the last sparse position below t (0: none)
          after_sparse=list(itertools.accumulate(
              (p + 1 if x else 0 for p, x in enumerate(s)), max,
              initial=0)))
      object.__setattr__(self, "_t", t)
    return t

  def groups(self, cuts: Sequence[int]) -> tuple[tuple[int, ...], ...]:
    """Leaf ids of each group, from the last position of each group.

    Args:
      cuts: the last position of each group, increasing.

    Returns:
      One tuple of leaf ids per group.
    """
    out, a = [], 0
    for j in cuts:
      out.append(self.order[a:j + 1])
      a = j + 1
    return tuple(out)

  def time(self, cuts: Sequence[int]) -> float:
    """Iteration time of the grouping ending its groups at ``cuts``.

    Args:
      cuts: the last position of each group, increasing, the last one N-1.

    Returns:
      The iteration time in seconds (the module docstring's objective).

    Raises:
      ValueError: if ``cuts`` do not increase or do not end at N-1.
    """
    t = self._tables()
    n = t["n"]
    if not cuts or cuts[-1] != n - 1 or any(
        b <= a for a, b in zip(cuts, cuts[1:])) or cuts[0] < 0:
      raise ValueError(f"cuts {list(cuts)} must increase and end at {n - 1}.")
    link, comm, a, shift = 0.0, 0.0, 0, 0.0
    for j in cuts:
      link, g, shift = self._group(a, j, link, shift)
      comm += g
      a = j + 1
    return self.forward + _objective(t["pos"][n] + shift, link, comm,
                                     self.overlap)

  def _group(self, a, j, link, shift):
    """(link, comm, shift) after group [a..j], starting with the link free at
    ``link`` and the compute stream ``shift`` seconds behind the prefix sums
    (the per-bucket compute of the sparse buckets before): the link time,
    the group's communication time and the shift after the group."""
    t = self._tables()
    ag, ps = self.allgather, self.psum
    pos, ns = t["pos"], t["ns"]
    nsp = ns[j + 1] - ns[a]
    comm = 0.0
    if nsp:
      shift += self.bucket
      g = ag.alpha + ag.beta * (t["sw"][j + 1] - t["sw"][a])
      ready = pos[t["after_sparse"][j + 1]] + shift
      link = (ready if ready > link else link) + g
      comm += g
    if nsp < j + 1 - a:
      g = ps.alpha + ps.beta * (t["dw"][j + 1] - t["dw"][a])
      ready = pos[j + 1] + shift
      link = (ready if ready > link else link) + g
      comm += g
    return link, comm, shift


def _objective(compute, link, comm, eta):
  """Iteration time after the forward: (1 − η)·(compute + comm) +
  η·max(link, compute), for a final link time ``link`` and communication
  ``comm`` (numbers or numpy arrays). Non-decreasing in link and comm."""
  return (1 - eta) * (compute + comm) + eta * np.maximum(link, compute)
