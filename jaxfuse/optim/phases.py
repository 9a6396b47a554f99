"""Density warm-up: a schedule of plans over the same selection units.

Error feedback delays each coordinate by about 1/ρ steps, which hurts most
early in training, when the gradient changes fastest. DGC therefore ramps
the density down (25 % → 6.25 % → 1.56 % → 0.4 % → ρ) and 1-bit Adam runs
dense first. Plans are static (XLA shapes), so a warm-up is a tuple of
``Phase``s: the same leaves, buckets and modes, only densities and
capacities differ. ``sparse_sync``'s state (residuals, velocity, threshold
control per unit) has the same shapes in every phase, so one state carries
through them; each phase compiles its own step, once. A unit's threshold
and controller step were tuned for the last phase's density: the first
step of a phase of another density estimates τ afresh and restarts the
controller's step (``sparsify``).

A density-1 phase (``with_density(plan, 1.0)``) sends everything with one
``pmean`` per bucket: exactly dense training, residual zero.

  phases = jaxfuse.density_warmup(plan, steps=50, dense_steps=100)
  for phase in phases:                    # one jitted step per phase
    step = make_step(make_optimizer(phase.plan))
    for t in range(phase.start, phase.stop or total_steps): ...
"""

from __future__ import annotations

import dataclasses
from typing import Sequence
import warnings

from jaxfuse import _deprecated
from jaxfuse import collectives
from jaxfuse import plans
from jaxfuse.sync import bucket_steps

DGC_RAMP = (0.25, 0.0625, 0.015625, 0.004)


@dataclasses.dataclass(frozen=True)
class Phase:
  """Steps [start, stop) train with ``plan`` (stop None: to the end)."""
  start: int
  stop: int | None
  plan: plans.Plan


def with_density(plan: plans.Plan, density: float) -> plans.Plan:
  """The same plan with every sparse unit at ``density`` (capacities
  recomputed as the planner does; 1 sends everything with a ``pmean``).

  Args:
    plan: the plan.
    density: the new density of every sparse unit, in (0, 1].

  Returns:
    A new ``Plan`` of the same layout (leaves, buckets, modes), its
    provenance noting ``phase_density``.

  Raises:
    PlanError: ``plan`` is not a plan, or ``density`` is out of range.
  """
  plans.require_plan(plan, "with_density")
  if not plans.is_real(density) or not 0 < density <= 1:
    raise plans.PlanError(f"with_density: density={density!r} must be in "
                          "(0, 1].")
  headroom = plan.settings.headroom
  leaves = tuple(
      dataclasses.replace(l, density=float(density),
                          capacity=plans.capacity(density, l.size,
                                                  l.estimator, headroom))
      if l.mode == "sparse" else l for l in plan.leaves)
  buckets = []
  for b in plan.buckets:
    if b.collective != "psum" and b.sparsify == "behind":
      size = sum(plan.leaves[j].size for j in b.leaves)
      b = dataclasses.replace(b, density=float(density),
                              capacity=plans.capacity(
                                  density, size, b.estimator, headroom))
    buckets.append(b)
  provenance = dict(plan.provenance, phase_density=float(density))
  return plans.Plan(leaves, tuple(buckets), plan.settings, provenance)


def check_phases(phases: Sequence[Phase]) -> None:
  """Raise ``PlanError`` naming the phase and field that break the schedule:
  phases must tile [0, ∞) in order and share one layout.

  Args:
    phases: the schedule, a sequence of ``Phase``.

  Returns:
    None.

  Raises:
    PlanError: the schedule is empty, a phase is not a ``Phase`` of a
      ``Plan``, the phases do not tile the steps from 0 in order, or a
      phase's plan has another layout than the first's.
  """
  if not phases:
    raise plans.PlanError("phases: empty; give at least one Phase.")
  expected_start = 0
  for i, phase in enumerate(phases):
    if not isinstance(phase, Phase) or not isinstance(phase.plan,
                                                      plans.Plan):
      raise plans.PlanError(f"phases[{i}]: expected a jaxfuse.Phase with "
                            "a jaxfuse.Plan.")
    if phase.start != expected_start:
      raise plans.PlanError(
          f"phases[{i}].start={phase.start}: must be {expected_start} (the "
          "phases tile the steps in order, from 0).")
    last = i == len(phases) - 1
    if last != (phase.stop is None):
      raise plans.PlanError(
          f"phases[{i}].stop={phase.stop!r}: only the last phase has stop="
          "None (it runs to the end).")
    if not last and not phase.stop > phase.start:
      raise plans.PlanError(f"phases[{i}]: stop={phase.stop} must be > "
                            f"start={phase.start}.")
    name = bucket_steps.layout_difference(phases[0].plan, phase.plan)
    if name:
      raise plans.PlanError(
          f"phases[{i}].plan: its {name} differ from phases[0].plan's; a "
          "warm-up schedule keeps one layout and changes only densities "
          "(make each phase with jaxfuse.with_density(plan, d)).")
    expected_start = phase.stop


def wire_received(plan: plans.Plan, num_workers: int,
                  mesh_sizes: tuple[int, int] | None = None) -> int:
  """Bytes one worker receives per step of ``plan`` on K workers (every
  bucket; ``collectives.bucket_wire``; a ``"hier"`` bucket on the (H, L)
  mesh of ``mesh_sizes``). An all-gather at density ρ moves about
  K·ρ·headroom·(value + index bytes)/(2·wire bytes) times what the dense
  ring all-reduce moves, so on many workers a high warm-up density costs
  more than dense.

  Args:
    plan: the plan.
    num_workers: K.
    mesh_sizes: (H, L) for a plan with ``"hier"`` buckets; None: 1-D.

  Returns:
    Bytes received per worker per step, an int.

  Raises:
    Nothing of its own (a scheme's byte count may refuse K).
  """
  return sum(w.received for w in collectives.bucket_wire(
      bucket_steps.compile_plan(plan), num_workers, mesh_sizes))


def _has_sparse_hier(plan: plans.Plan) -> bool:
  return any(b.kind == bucket_steps.SPARSE and b.collective == "hier"
             for b in bucket_steps.compile_plan(plan).buckets)


def _workers(plan, workers, where: str = "density_warmup"
             ) -> tuple[int | None, tuple[int, int] | None]:
  """(K, mesh sizes or None) from ``workers``: K, or (hosts, devices per
  host) of a ``"hier"`` plan's mesh (``PlanError`` naming the argument)."""
  if workers is None:
    return None, None
  if isinstance(workers, (tuple, list)):
    if (len(workers) != 2 or
        not all(plans.is_int(s) and s >= 1 for s in workers)):
      raise plans.PlanError(
          f"{where}: workers={workers!r} must be K (an integer >= 1, the "
          "mesh size) or (hosts, devices per host) of the 'hier' mesh, "
          "e.g. mesh.devices.shape.")
    sizes = (int(workers[0]), int(workers[1]))
    return sizes[0] * sizes[1], sizes
  if not plans.is_int(workers) or workers < 1:
    raise plans.PlanError(f"{where}: workers={workers!r} must be an "
                          "integer >= 1 (the mesh size, mesh.size).")
  if workers > 1 and _has_sparse_hier(plan):
    raise plans.PlanError(
        f"{where}: the plan's 'hier' buckets move bytes on both mesh "
        "axes, which a worker count alone cannot count; give workers="
        "(hosts, devices per host) instead (e.g. mesh.devices.shape).")
  return int(workers), None


def _upgrade_workers(kwargs: dict) -> dict:
  """``density_warmup``'s keywords with 0.2's ``num_workers=`` /
  ``mesh_sizes=`` made ``workers=`` (a ``DeprecationWarning``; removed in
  0.4): the upgrade of ``_deprecated.legacy_keywords``."""
  legacy = {k: kwargs.pop(k) for k in ("num_workers", "mesh_sizes")
            if k in kwargs}
  if legacy:
    kwargs["workers"] = _legacy_workers(kwargs.get("workers"), legacy)
  return kwargs


def _legacy_workers(workers, legacy: dict):
  """``workers`` from 0.2's ``num_workers=`` / ``mesh_sizes=``."""
  warnings.warn(
      "density_warmup: num_workers= and mesh_sizes= are now one argument, "
      "workers= (K, or (hosts, devices per host) for a 'hier' plan); the "
      "old names go in 0.4.", DeprecationWarning, stacklevel=4)
  if workers is not None:
    raise plans.PlanError(
        f"density_warmup: workers={workers!r} given with "
        f"{', '.join(sorted(legacy))}=; give workers= only.")
  num_workers = legacy.get("num_workers")
  mesh_sizes = legacy.get("mesh_sizes")
  if mesh_sizes is None:
    if num_workers is not None and (not plans.is_int(num_workers) or
                                    num_workers < 1):
      raise plans.PlanError(
          f"density_warmup: num_workers={num_workers!r} must be an integer "
          ">= 1 (the mesh size); spell it workers= (0.3).")
    return num_workers
  if (not isinstance(mesh_sizes, (tuple, list)) or len(mesh_sizes) != 2
      or not all(plans.is_int(s) and s >= 1 for s in mesh_sizes)):
    raise plans.PlanError(
        f"density_warmup: mesh_sizes={mesh_sizes!r} must be (hosts, "
        "devices per host) of the 'hier' mesh, e.g. mesh.devices.shape; "
        "spell it workers= (0.3).")
  size = int(mesh_sizes[0]) * int(mesh_sizes[1])
  if num_workers is not None and num_workers != size:
    raise plans.PlanError(
        f"density_warmup: num_workers={num_workers!r} is not the "
        f"{size} workers of mesh_sizes={tuple(mesh_sizes)}; give one.")
  return tuple(mesh_sizes)


def has_sparse_units(plan: plans.Plan) -> bool:
  """Whether ``plan`` sparsifies anything: a sparse leaf, or a ``"behind"``
  bucket that is not a plain ``psum``.

  Args:
    plan: the plan.

  Returns:
    True if any unit is sparse (at any density).

  Raises:
    Nothing of its own.
  """
  return any(l.mode == "sparse" for l in plan.leaves) or any(
      b.sparsify == "behind" and b.collective != "psum"
      for b in plan.buckets)


def _dense_plan(plan: plans.Plan, dense_wire: str) -> plans.Plan:
  return dataclasses.replace(with_density(plan, 1.0),
                             settings=dataclasses.replace(
                                 plan.settings, full_wire=dense_wire))


def wire_warnings(phases: Sequence[Phase], workers,
                  dense_wire: str | None = None) -> list[str]:
  """Warn for each sparse phase that receives more bytes than dense would.

  An all-gather at density ρ receives about
  K·ρ·headroom·(value + index bytes) per element where the ring all-reduce
  receives 2·(K−1)/K·(wire bytes), so on many workers a sparse step can
  move more than the dense step it replaces. For each phase whose plan
  sparsifies, this compares ``wire_received`` of its plan with that of the
  same plan at density 1 on ``dense_wire`` and warns (``UserWarning``)
  naming the phase, both byte counts and the fix.

  Args:
    phases: the schedule (e.g. ``density_warmup``'s).
    workers: K, the number of workers (``mesh.size``), or (hosts, devices
      per host) for a plan with ``"hier"`` buckets.
    dense_wire: the dense step's wire dtype to compare with
      (``Settings.full_wire``); None: the dense phase's of ``phases`` if
      there is one, else each phase plan's own.

  Returns:
    The warnings' messages, one per costly phase (empty: none is).

  Raises:
    PlanError: ``workers`` is not K or (hosts, devices per host), or the
      plan has ``"hier"`` buckets and ``workers`` is a bare K.
  """
  check_phases(phases)
  num_workers, sizes = _workers(phases[0].plan, workers, "wire_warnings")
  if num_workers < 2:
    return []
  if dense_wire is None:
    dense_wire = next((p.plan.settings.full_wire for p in phases
                       if not has_sparse_units(p.plan) or
                       final_density(p.plan) == 1.0), None)
  messages = []
  for i, phase in enumerate(phases):
    if not has_sparse_units(phase.plan) or final_density(phase.plan) == 1.0:
      continue
    wire = dense_wire or phase.plan.settings.full_wire
    sparse = wire_received(phase.plan, num_workers, sizes)
    dense = wire_received(_dense_plan(phase.plan, wire), num_workers, sizes)
    if sparse <= dense:
      continue
    stop = "the end" if phase.stop is None else phase.stop
    messages.append(
        f"phase {i} (steps {phase.start} to {stop}, density "
        f"{final_density(phase.plan):g}) receives {sparse:,} bytes per "
        f"worker per step on {num_workers} workers, more than the "
        f"{dense:,} of a dense step on a {wire!r} wire: an all-gather's "
        "bytes grow with K. Plan for the K workers (jaxfuse.plan(..., "
        f"num_workers={num_workers}) picks ZEN where it sends fewer bytes), "
        "pass a scheme that does not grow with K (collective='zen', "
        "'spardl' or 'hier'), a lower density, or train this phase dense.")
  for message in messages:
    warnings.warn(message, UserWarning, stacklevel=2)
  return messages


@_deprecated.legacy_keywords(_upgrade_workers)
def density_warmup(plan: plans.Plan, *, steps: int | Sequence[int],
                   densities: Sequence[float] | None = None,
                   dense_steps: int = 0, dense_wire: str = "gradient",
                   workers: int | tuple[int, int] | None = None
                   ) -> tuple[Phase, ...]:
  """Phases: ``dense_steps`` dense, then ``steps`` at each warm-up density,
  then ``plan`` to the end.

  A plan with nothing sparse (every leaf dense, e.g. ``strategy="auto"``
  on a machine where dense is cheapest) has no densities to ramp from:
  its phases are the dense steps (if any) and then ``plan``; given
  warm-up densities, a ``UserWarning`` says that they were dropped and
  why.

  Args:
    plan: the plan to end with (its densities are the final ones).
    steps: steps per warm-up density (0: none), or one count per density
      of ``densities`` (e.g. ``densities=[0.25, 0.05], steps=[50, 150]``:
      hold a higher density longer before the plan's, a ramp that lowers
      ρ as training settles).
    densities: the ramp; default DGC's (25 %, 6.25 %, 1.56 %, 0.4 %), only
      the values above the plan's largest sparse density.
    dense_steps: dense steps first (1-bit Adam's warm-up).
    dense_wire: the dense steps' wire dtype (``Settings.full_wire``):
      ``"bfloat16"`` halves their bytes, each worker's rounding carried in
      its residual to the next step.
    workers: K, the number of workers (``mesh.size``), or for a plan with
      ``"hier"`` buckets (H, L) of its (host, local) mesh (K = H·L, its
      buckets' bytes counted on both axes). Given, a warm-up density whose
      phase would receive at least the dense phase's bytes per worker
      (``wire_received``) runs dense instead, on ``dense_wire``: the dense
      phase grows by its steps, since a step's time follows its bytes on a
      bandwidth-bound network. A sparse phase left that receives more
      than dense is named in a ``UserWarning`` (``wire_warnings``). None:
      every density as given.
      0.2's ``num_workers=`` and ``mesh_sizes=`` still work until 0.4,
      as ``workers=`` (``DeprecationWarning``).

  Returns:
    The ``Phase``s, tiling the steps from 0; the last is ``plan``'s, with
    ``stop=None``.

  Raises:
    PlanError: naming the argument that is out of range or of the wrong
      kind (``steps``, ``densities``, ``dense_steps``, ``dense_wire``,
      ``workers``), or a density not above the plan's.
  """
  plans.require_plan(plan, "density_warmup")
  if densities is not None and not isinstance(densities, (list, tuple)):
    raise plans.PlanError(f"density_warmup: densities={densities!r} must "
                          "be a list of densities, e.g. (0.0625,).")
  num_workers, mesh_sizes = _workers(plan, workers)
  if dense_wire not in plans.FULL_WIRES:
    raise plans.PlanError(
        f"density_warmup: dense_wire={dense_wire!r}; use one of "
        f"{', '.join(map(repr, plans.FULL_WIRES))}.")
  per_density = not plans.is_int(steps)
  if per_density:
    counts = list(steps) if isinstance(steps, (list, tuple)) else None
    if (counts is None or densities is None or
        len(counts) != len(densities) or
        not all(plans.is_int(c) and c >= 1 for c in counts)):
      raise plans.PlanError(
          f"density_warmup: steps={steps!r}: give one integer >= 1 per "
          "density of densities= (or one integer for all).")
  for name, value in (("steps", 0 if per_density else steps),
                      ("dense_steps", dense_steps)):
    if not plans.is_int(value) or value < 0:
      raise plans.PlanError(f"density_warmup: {name}={value!r} must be an "
                            "integer >= 0.")
  final = final_density(plan)
  if densities is None:
    densities = [d for d in DGC_RAMP if d > final] if steps else []
  densities = list(densities)
  if densities and not has_sparse_units(plan):
    warnings.warn(
        f"density_warmup: the plan has no sparse leaves (all "
        f"{len(plan.leaves)} are dense, e.g. strategy='auto' found dense "
        f"cheapest here), so the warm-up densities {densities} were "
        "dropped: the phases are the dense steps and then the plan. For "
        "sparse training plan with a fixed strategy (jaxfuse.plan(..., "
        "strategy='size')) or a lower min_sparse_size.",
        UserWarning, stacklevel=2)
    densities = []
  below = [d for d in densities if not (plans.is_real(d) and final < d <= 1)]
  if below:
    raise plans.PlanError(
        f"density_warmup: densities {below} must each be in ({final:g}, 1]: "
        "a warm-up sends more than the plan it ends with.")
  if densities and not steps:
    raise plans.PlanError("density_warmup: densities given with steps=0; "
                          "give steps per warm-up density.")
  ramp = [(float(d), int(n)) for d, n in zip(
      densities, counts if per_density else [steps] * len(densities))]
  dense_steps = int(dense_steps)
  if num_workers is not None and num_workers > 1 and ramp:
    dense_bytes = wire_received(_dense_plan(plan, dense_wire), num_workers,
                                mesh_sizes)
    costly = [d < 1.0 and wire_received(with_density(plan, d), num_workers,
                                        mesh_sizes) >= dense_bytes
              for d, _ in ramp]
    dense_steps += sum(n for (_, n), c in zip(ramp, costly) if c)
    ramp = [r for r, c in zip(ramp, costly) if not c]
  schedule = ([(1.0, dense_steps)] if dense_steps else []) + ramp
  phases, start = [], 0
  for density, length in schedule:
    phase_plan = (_dense_plan(plan, dense_wire) if density == 1.0
                  else with_density(plan, density))
    phases.append(Phase(start, start + length, phase_plan))
    start += length
  phases.append(Phase(start, None, plan))
  check_phases(phases)
  if num_workers is not None and num_workers > 1:
    wire_warnings(phases, mesh_sizes or num_workers, dense_wire)
  return tuple(phases)


def final_density(plan: plans.Plan) -> float:
  """The plan's largest sparse density (1.0 for an all-dense plan): a
  warm-up density must lie above it.

  Args:
    plan: the plan.

  Returns:
    The density, a float in (0, 1].

  Raises:
    Nothing of its own.
  """
  return max([l.density for l in plan.leaves if l.mode == "sparse"] +
             [b.density for b in plan.buckets if b.sparsify == "behind"
              and b.collective != "psum"] or [1.0])


def phase_index(phases: Sequence[Phase], step: int) -> int:
  """Index of the phase that trains ``step`` (an int, numpy or concrete JAX
  integer: e.g. a ``TrainState``'s step).

  Args:
    phases: the schedule (e.g. ``density_warmup``'s).
    step: the step, counted from 0.

  Returns:
    The index into ``phases``.

  Raises:
    ValueError: ``step`` is not an integer >= 0, or no phase trains it
      (the last phase's stop is not None).
  """
  step = plans.as_python(step)
  if not plans.is_int(step) or step < 0:
    raise ValueError(f"phase_index: step={step!r} must be an integer >= 0 "
                     "(steps count from 0).")
  for i, phase in enumerate(phases):
    if phase.stop is None or step < phase.stop:
      return i
  raise ValueError(f"phase_index: no phase trains step {step}: the last of "
                   f"{len(phases)} phases must have stop=None (as "
                   "density_warmup's does).")
