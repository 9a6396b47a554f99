"""A plan compiled once into what a sync step walks: per bucket, in the
plan's (backward-ready) order, its kind, units, state groups and where
each leaf sits in its unit.

``sparse_sync`` reads this instead of re-deriving ``plans.units``,
``plans.state_groups`` and leaf offsets per bucket while it traces; a
mechanism that runs buckets elsewhere (inside the backward pass, a step
later) reads the same object, and so do the wire accounting
(``collectives.bucket_steps``), the simulator, the planner, the warm-up
phases' layout check and the checkpoint's per-unit view.

A plan's *layout* (``layout``) is what its state's arrays mean: which
leaf each residual row belongs to. Plans of one layout (a warm-up's
phases) share a state; ``layout_digest`` is the layout reduced to short
hashes that a state carries in its pytree structure, so that a step can
refuse a state made for another layout at trace time.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import numbers

from jaxfuse import plans as plan_lib

PSUM, FULL, SPARSE = "psum", "full", "sparse"


@dataclasses.dataclass(frozen=True)
class BucketStep:
  """One bucket of the step.

  kind: ``"psum"`` (dense leaves, one ``pmean``), ``"full"`` (every unit at
  density 1: one ``pmean`` of the accumulated streams, residual kept as
  the wire's rounding) or ``"sparse"`` (selection, then the collective).
  """
  index: int
  collective: str
  kind: str
  leaves: tuple[int, ...]          # leaf ids, as the plan lists them
  units: tuple[int, ...]           # unit ids in ready order (its layout)
  groups: tuple[int, ...]          # the state groups of its units
  placement: tuple[tuple[int, tuple[tuple[int, int], ...]], ...]
  """Per unit of ``units``: (unit id, ((leaf id, offset in the unit), …))."""


@dataclasses.dataclass(frozen=True)
class Schedule:
  units: tuple[plan_lib.Unit, ...]           # every unit, ``plans.units``
  groups: tuple[tuple[int, ...], ...]        # ``plans.state_groups``
  group_dtypes: tuple[str, ...]              # their residuals' dtype
  group_of_unit: tuple[int, ...]
  buckets: tuple[BucketStep, ...]
  num_leaves: int
  wire_units: tuple[plan_lib.Unit, ...]      # as they travel, ``wire_unit``

  def bucket_units(self, b: BucketStep) -> tuple[plan_lib.Unit, ...]:
    """The units of bucket ``b``, in its ready order."""
    return tuple(self.units[u] for u in b.units)

  def unit_placement(self) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Per unit (``units`` order): ((leaf id, offset in the unit), …)."""
    where = {u: leaves for b in self.buckets for u, leaves in b.placement}
    return tuple(where[u] for u in range(len(self.units)))

  def bucket_wire_units(self, b: BucketStep) -> tuple[plan_lib.Unit, ...]:
    """The units of bucket ``b`` as its collective carries them (values in
    ``Settings.sparse_wire``), in its ready order."""
    return tuple(self.wire_units[u] for u in b.units)


def compile_plan(plan: plan_lib.Plan) -> Schedule:
  """The plan's ``Schedule``: made once per transform, read at every trace."""
  all_units, per_bucket = plan_lib.units(plan)
  groups = plan_lib.group_units(all_units, per_bucket)
  group_of = {u: g for g, ids in enumerate(groups) for u in ids}
  group_of_unit = tuple(group_of[u] for u in range(len(all_units)))
  group_dtypes = tuple(plan_lib.state_dtype(all_units[ids[0]], plan.settings)
                       for ids in groups)
  steps = []
  for i, (bucket, ids) in enumerate(zip(plan.buckets, per_bucket)):
    if bucket.collective == "psum":
      kind = PSUM
    elif all(plan_lib.is_full(all_units[u]) for u in ids):
      kind = FULL
    else:
      kind = SPARSE
    placement = tuple(
        (u, tuple(zip(all_units[u].leaves,
                      plan_lib.leaf_offsets(plan, all_units[u]))))
        for u in ids)
    steps.append(BucketStep(i, bucket.collective, kind, tuple(bucket.leaves),
                            tuple(ids),
                            tuple(sorted({group_of_unit[u] for u in ids})),
                            placement))
  collective_of = {u: b.collective for b, ids in zip(plan.buckets, per_bucket)
                   for u in ids}
  return Schedule(all_units, groups, group_dtypes, group_of_unit,
                  tuple(steps), len(plan.leaves),
                  tuple(plan_lib.wire_unit(unit, plan.settings,
                                           collective_of[u])
                        for u, unit in enumerate(all_units)))


def layout(plan: plan_lib.Plan, sched: Schedule | None = None) -> tuple:
  """What a state's arrays mean, which must not change between phases
  (``LAYOUT_PARTS``): leaves, units (without capacity or density),
  buckets, modes, dtypes, settings (but the wire dtypes ``full_wire`` and
  ``sparse_wire``, which the state does not hold)."""
  sched = sched or compile_plan(plan)
  return (tuple((l.path, l.shape, l.dtype, l.mode) for l in plan.leaves),
          tuple((u.leaves, u.size, u.dtype, u.estimator)
                for u in sched.units),
          tuple(b.units for b in sched.buckets),
          tuple((b.leaves, b.collective, b.sparsify) for b in plan.buckets),
          dataclasses.replace(plan.settings, full_wire="gradient",
                              sparse_wire="gradient"))


LAYOUT_PARTS = ("leaves", "selection units", "buckets' units", "buckets",
                "settings")


def layout_difference(a: plan_lib.Plan, b: plan_lib.Plan) -> str | None:
  """The first part of the layout (``LAYOUT_PARTS``) in which two plans
  differ, or None: plans with one layout have state of the same shapes.
  For the leaves, the first that differs, e.g. "leaves (['w']: float32
  [64, 64] dense, against bfloat16 [64, 64] dense)"."""
  for name, x, y in zip(LAYOUT_PARTS, layout(a), layout(b)):
    if x != y:
      if name == "leaves" and len(x) == len(y):
        (p, s, d, m), (q, t, e, n) = next(
            (u, v) for u, v in zip(x, y) if u != v)
        return (f"leaves ({p}: {d} {list(s)} {m}, against "
                f"{f'{q}: ' if q != p else ''}{e} {list(t)} {n})")
      return name
  return None


class LayoutDigest(tuple):
  """A plan's ``layout_digest``: a tuple of hashes (equal to the plain
  tuple of them) whose repr names the parts, so a JAX pytree error about
  a state's structure says that a plan's layout differs."""
  __slots__ = ()

  def __repr__(self):
    return "jaxfuse plan layout(" + ", ".join(
        f"{name}={h}" for name, h in zip(LAYOUT_PARTS, self)) + ")"


def layout_digest(plan: plan_lib.Plan,
                  sched: Schedule | None = None) -> LayoutDigest:
  """One short hash per part of ``layout`` (``LAYOUT_PARTS``): equal
  digests, equal layouts under ``==`` (2 and 2.0, a numpy scalar and its
  Python number alike; up to a 64-bit hash collision)."""
  return LayoutDigest(
      hashlib.sha256(repr(_plain(part)).encode()).hexdigest()[:16]
      for part in layout(plan, sched))


def _plain(x):
  """``x`` with numbers as Python ints (integral values) or floats,
  containers and dataclasses as tuples: values equal under ``==`` get
  one ``repr``."""
  if x is None or isinstance(x, (bool, str)):
    return x
  if isinstance(x, numbers.Integral) and not isinstance(x, bool):
    return int(x)
  if isinstance(x, numbers.Real):
    v = float(x)
    return int(v) if math.isfinite(v) and v.is_integer() else v
  if dataclasses.is_dataclass(x):
    return (type(x).__name__,) + tuple(
        (f.name, _plain(getattr(x, f.name))) for f in dataclasses.fields(x))
  if isinstance(x, dict):
    return tuple(sorted((str(k), _plain(v)) for k, v in x.items()))
  if isinstance(x, (tuple, list)):
    return tuple(_plain(v) for v in x)
  return x.item() if hasattr(x, "item") else x


def digest_difference(a: tuple[str, ...], b: tuple[str, ...]) -> str | None:
  """The first part of the layout in which two digests differ, or None."""
  return next((name for name, x, y in zip(LAYOUT_PARTS, a, b) if x != y),
              None)
