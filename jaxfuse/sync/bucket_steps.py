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
import weakref

from jaxfuse.sync import bucket_pass
from jaxfuse import plans
from jaxfuse.collectives import configs

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
  settings: plans.Settings
  """The plan's settings: the estimators' knobs, the wire dtypes."""
  unit_specs: tuple[plans.Unit, ...]   # of ``units``, in that order
  wire_specs: tuple[plans.Unit, ...]   # as they travel (``wire_unit``)
  group_units: tuple[tuple[int, ...], ...]  # per group of ``groups``
  group_dtypes: tuple[str, ...]           # per group: its residuals' dtype
  leaf_shapes: tuple[tuple[int, tuple[int, ...]], ...]  # (leaf id, shape)
  blends: frozenset[int]
  """The groups whose stream the fused pass forms from a ``Blend``'s parts
  when m comes leaf by leaf: those of matrices, vectors and scalars
  (``blendable``)."""
  batches: tuple[bucket_pass.Batch, ...]  # sparse: rows of one selection
  scheme: object = None
  """The bucket's collective with its configuration (``BucketPlan.scheme``,
  ``collectives.of_bucket``): it receives the bucket's slots and plans
  nothing."""

  def unit(self, u: int) -> plans.Unit:
    """Unit ``u`` of this bucket (a unit id of ``units``)."""
    return self.unit_specs[self.units.index(u)]

  def units_of(self, g: int) -> tuple[int, ...]:
    """The unit ids of state group ``g`` (one of ``groups``), in row order."""
    return self.group_units[self.groups.index(g)]

  def dtype_of(self, g: int) -> str:
    """The residual dtype of state group ``g`` (one of ``groups``)."""
    return self.group_dtypes[self.groups.index(g)]

  def leaf_shape(self, j: int) -> tuple[int, ...]:
    return dict(self.leaf_shapes)[j]


@dataclasses.dataclass(frozen=True)
class Schedule:
  units: tuple[plans.Unit, ...]           # every unit, ``plans.units``
  groups: tuple[tuple[int, ...], ...]        # ``plans.state_groups``
  group_dtypes: tuple[str, ...]              # their residuals' dtype
  group_of_unit: tuple[int, ...]
  buckets: tuple[BucketStep, ...]
  num_leaves: int
  wire_units: tuple[plans.Unit, ...]      # as they travel, ``wire_unit``
  settings: plans.Settings = plans.Settings()
  leaf_shapes: tuple[tuple[int, ...], ...] = ()   # every leaf's, in order
  leaf_dtypes: tuple[str, ...] = ()
  leaf_paths: tuple[str, ...] = ()

  def bucket_units(self, b: BucketStep) -> tuple[plans.Unit, ...]:
    """The units of bucket ``b``, in its ready order."""
    return tuple(self.units[u] for u in b.units)

  def unit_placement(self) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Per unit (``units`` order): ((leaf id, offset in the unit), …)."""
    where = {u: leaves for b in self.buckets for u, leaves in b.placement}
    return tuple(where[u] for u in range(len(self.units)))

  def bucket_wire_units(self, b: BucketStep) -> tuple[plans.Unit, ...]:
    """The units of bucket ``b`` as its collective carries them (values in
    ``Settings.sparse_wire``), in its ready order."""
    return tuple(self.wire_units[u] for u in b.units)


def blendable(shapes) -> bool:
  """Whether a state group of leaves of ``shapes`` has its stream formed by
  the fused pass from a ``Blend``'s parts when m comes leaf by leaf: when
  its leaves are all matrices, vectors or scalars. A gradient of more
  dimensions (an attention projection's (d, heads, head_dim), a
  convolution's kernel) is often a slice of a fused dot's result or in
  another layout; the kernel would need it copied out first, costing what
  forming x saves, whereas XLA fuses the slice or transpose into forming x
  itself. A group whose m comes as rows (``jaxfuse.grouped``) is always
  formed in the pass: the pass reads the rows where they are, where XLA
  would read a row of m's stack as a strided slice."""
  return all(len(shape) <= 2 for shape in shapes)


def compile_plan(plan: plans.Plan) -> Schedule:
  """The plan's ``Schedule``: made once per transform, read at every trace.

  Args:
    plan: a ``jaxfuse.Plan``.

  Returns:
    Its ``Schedule``: per bucket a ``BucketStep`` that carries what the
    bucket's stages need (its units, their dtypes and capacities, its
    state groups, its leaves' shapes, the settings), so nothing below the
    transform reads the plan.
  """
  hit = _COMPILED.get(id(plan))
  if hit is not None and hit[0]() is plan:
    return hit[1]
  sched = _compile(plan)
  _COMPILED[id(plan)] = (weakref.ref(plan), sched)
  weakref.finalize(plan, _COMPILED.pop, id(plan), None)
  return sched


# Plans compiled so far, by id while the plan lives: a recipe and the
# ``sparse_sync`` inside it (and ``relayout``, ``checkpoint``) share one
# compile of a plan object. Plans are frozen, so a compile never goes stale.
_COMPILED: dict = {}


def _compile(plan: plans.Plan) -> Schedule:
  all_units, per_bucket = plans.units(plan)
  groups = plans.group_units(all_units, per_bucket)
  group_of = {u: g for g, ids in enumerate(groups) for u in ids}
  group_of_unit = tuple(group_of[u] for u in range(len(all_units)))
  group_dtypes = tuple(plans.state_dtype(all_units[ids[0]], plan.settings)
                       for ids in groups)
  schemes = [configs.of_bucket(b) for b in plan.buckets]
  scheme_of = {u: s for s, ids in zip(schemes, per_bucket) for u in ids}
  wire_units = tuple(plans.wire_unit(unit, plan.settings, scheme_of[u])
                     for u, unit in enumerate(all_units))
  steps = []
  for i, (bucket, ids) in enumerate(zip(plan.buckets, per_bucket)):
    if bucket.collective == "psum":
      kind = PSUM
    elif all(plans.is_full(all_units[u]) for u in ids):
      kind = FULL
    else:
      kind = SPARSE
    placement = tuple(
        (u, tuple(zip(all_units[u].leaves,
                      plans.leaf_offsets(plan, all_units[u]))))
        for u in ids)
    gids = tuple(sorted({group_of_unit[u] for u in ids}))
    shapes = lambda g: [plan.leaves[j].shape for u in groups[g]
                        for j in all_units[u].leaves]
    steps.append(BucketStep(
        i, bucket.collective, kind, tuple(bucket.leaves), tuple(ids), gids,
        placement, plan.settings, tuple(all_units[u] for u in ids),
        tuple(wire_units[u] for u in ids), tuple(groups[g] for g in gids),
        tuple(group_dtypes[g] for g in gids),
        tuple((j, plan.leaves[j].shape) for j in bucket.leaves),
        frozenset(g for g in gids if blendable(shapes(g))),
        tuple(bucket_pass.batches(all_units, groups, gids))
        if kind == SPARSE else (), schemes[i]))
  return Schedule(all_units, groups, group_dtypes, group_of_unit,
                  tuple(steps), len(plan.leaves), wire_units, plan.settings,
                  tuple(l.shape for l in plan.leaves),
                  tuple(l.dtype for l in plan.leaves),
                  tuple(l.path for l in plan.leaves))


def layout(plan: plans.Plan, sched: Schedule | None = None) -> tuple:
  """What a state's arrays mean, which must not change between phases
  (``LAYOUT_PARTS``): leaves, units (without capacity or density),
  buckets (each with its scheme's configuration), modes, dtypes, settings
  (but the wire dtypes ``full_wire`` and ``sparse_wire``, which the state
  does not hold)."""
  sched = sched or compile_plan(plan)
  return (tuple((l.path, l.shape, l.dtype, l.mode) for l in plan.leaves),
          tuple((u.leaves, u.size, u.dtype, u.estimator)
                for u in sched.units),
          tuple(b.units for b in sched.buckets),
          tuple((b.leaves, b.collective, b.sparsify, step.scheme)
                for b, step in zip(plan.buckets, sched.buckets)),
          dataclasses.replace(plan.settings, full_wire="gradient",
                              sparse_wire="gradient"))


LAYOUT_PARTS = ("leaves", "selection units", "buckets' units", "buckets",
                "settings")


def layout_difference(a: plans.Plan, b: plans.Plan) -> str | None:
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


def layout_digest(plan: plans.Plan,
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
