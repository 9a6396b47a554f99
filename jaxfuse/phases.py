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

from jaxfuse import collectives
from jaxfuse import plans as plan_lib
from jaxfuse import bucket_steps

DGC_RAMP = (0.25, 0.0625, 0.015625, 0.004)


@dataclasses.dataclass(frozen=True)
class Phase:
  """Steps [start, stop) train with ``plan`` (stop None: to the end)."""
  start: int
  stop: int | None
  plan: plan_lib.Plan


def with_density(plan: plan_lib.Plan, density: float) -> plan_lib.Plan:
  """The same plan with every sparse unit at ``density`` (capacities
  recomputed as the planner does; 1 sends everything with a ``pmean``)."""
  plan_lib.require_plan(plan, "with_density")
  if not plan_lib.is_real(density) or not 0 < density <= 1:
    raise plan_lib.PlanError(f"with_density: density={density!r} must be in "
                             "(0, 1].")
  headroom = plan.settings.headroom
  leaves = tuple(
      dataclasses.replace(l, density=float(density),
                          capacity=plan_lib.capacity(density, l.size,
                                                     l.estimator, headroom))
      if l.mode == "sparse" else l for l in plan.leaves)
  buckets = []
  for b in plan.buckets:
    if b.collective != "psum" and b.sparsify == "behind":
      size = sum(plan.leaves[j].size for j in b.leaves)
      b = dataclasses.replace(b, density=float(density),
                              capacity=plan_lib.capacity(
                                  density, size, b.estimator, headroom))
    buckets.append(b)
  provenance = dict(plan.provenance, phase_density=float(density))
  return plan_lib.Plan(leaves, tuple(buckets), plan.settings, provenance)


def check_phases(phases: Sequence[Phase]) -> None:
  """Raise ``PlanError`` naming the phase and field that break the schedule:
  phases must tile [0, ∞) in order and share one layout."""
  if not phases:
    raise plan_lib.PlanError("phases: empty; give at least one Phase.")
  expected_start = 0
  for i, phase in enumerate(phases):
    if not isinstance(phase, Phase) or not isinstance(phase.plan,
                                                      plan_lib.Plan):
      raise plan_lib.PlanError(f"phases[{i}]: expected a jaxfuse.Phase with "
                               "a jaxfuse.Plan.")
    if phase.start != expected_start:
      raise plan_lib.PlanError(
          f"phases[{i}].start={phase.start}: must be {expected_start} (the "
          "phases tile the steps in order, from 0).")
    last = i == len(phases) - 1
    if last != (phase.stop is None):
      raise plan_lib.PlanError(
          f"phases[{i}].stop={phase.stop!r}: only the last phase has stop="
          "None (it runs to the end).")
    if not last and not phase.stop > phase.start:
      raise plan_lib.PlanError(f"phases[{i}]: stop={phase.stop} must be > "
                               f"start={phase.start}.")
    name = bucket_steps.layout_difference(phases[0].plan, phase.plan)
    if name:
      raise plan_lib.PlanError(
          f"phases[{i}].plan: its {name} differ from phases[0].plan's; a "
          "warm-up schedule keeps one layout and changes only densities "
          "(make each phase with jaxfuse.with_density(plan, d)).")
    expected_start = phase.stop


def wire_received(plan: plan_lib.Plan, num_workers: int,
                  mesh_sizes: tuple[int, int] | None = None) -> int:
  """Bytes one worker receives per step of ``plan`` on K workers (every
  bucket; ``collectives.bucket_wire``; a ``"hier"`` bucket on the (H, L)
  mesh of ``mesh_sizes``). An all-gather at density ρ moves about
  K·ρ·headroom·(value + index bytes)/(2·wire bytes) times what the dense
  ring all-reduce moves, so on many workers a high warm-up density costs
  more than dense."""
  return sum(w.received for w in collectives.bucket_wire(
      bucket_steps.compile_plan(plan), num_workers, mesh_sizes))


def _has_sparse_hier(plan: plan_lib.Plan) -> bool:
  return any(b.kind == bucket_steps.SPARSE and b.collective == "hier"
             for b in bucket_steps.compile_plan(plan).buckets)


def _workers(plan, num_workers, mesh_sizes) -> int | None:
  """K for ``density_warmup`` (``PlanError`` naming the argument)."""
  if mesh_sizes is not None:
    if (not isinstance(mesh_sizes, (tuple, list)) or len(mesh_sizes) != 2
        or not all(plan_lib.is_int(s) and s >= 1 for s in mesh_sizes)):
      raise plan_lib.PlanError(
          f"density_warmup: mesh_sizes={mesh_sizes!r} must be (hosts, "
          "devices per host) of the 'hier' mesh, e.g. mesh.devices.shape.")
    size = int(mesh_sizes[0]) * int(mesh_sizes[1])
    if num_workers is not None and num_workers != size:
      raise plan_lib.PlanError(
          f"density_warmup: num_workers={num_workers!r} is not the "
          f"{size} workers of mesh_sizes={tuple(mesh_sizes)}; give one.")
    return size
  if num_workers is not None and num_workers > 1 and _has_sparse_hier(plan):
    raise plan_lib.PlanError(
        "density_warmup: the plan's 'hier' buckets move bytes on both mesh "
        "axes, which num_workers alone cannot count; give mesh_sizes="
        "(hosts, devices per host) instead (e.g. mesh.devices.shape).")
  return num_workers


def density_warmup(plan: plan_lib.Plan, *, steps: int | Sequence[int],
                   densities: Sequence[float] | None = None,
                   dense_steps: int = 0, dense_wire: str = "gradient",
                   num_workers: int | None = None,
                   mesh_sizes: tuple[int, int] | None = None
                   ) -> tuple[Phase, ...]:
  """Phases: ``dense_steps`` dense, then ``steps`` at each warm-up density,
  then ``plan`` to the end.

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
    num_workers: K. Given, a warm-up density whose phase would receive at
      least the dense phase's bytes per worker (``wire_received``) runs
      dense instead, on ``dense_wire``: the dense phase grows by its steps
      (measured, 4 × H200 over sockets: the 25 % phase took 335 ms a step,
      the bfloat16 dense one 145 ms). None: every density as given.
    mesh_sizes: for a plan with ``"hier"`` buckets, (H, L) of its (host,
      local) mesh in place of ``num_workers`` (K = H·L): its buckets'
      bytes are counted on both axes.
  """
  plan_lib.require_plan(plan, "density_warmup")
  if densities is not None and not isinstance(densities, (list, tuple)):
    raise plan_lib.PlanError(f"density_warmup: densities={densities!r} must "
                             "be a list of densities, e.g. (0.0625,).")
  if num_workers is not None and (not plan_lib.is_int(num_workers) or
                                  num_workers < 1):
    raise plan_lib.PlanError(f"density_warmup: num_workers={num_workers!r} "
                             "must be an integer >= 1 (the mesh size).")
  num_workers = _workers(plan, num_workers, mesh_sizes)
  if dense_wire not in plan_lib.FULL_WIRES:
    raise plan_lib.PlanError(
        f"density_warmup: dense_wire={dense_wire!r}; use one of "
        f"{', '.join(map(repr, plan_lib.FULL_WIRES))}.")
  per_density = not plan_lib.is_int(steps)
  if per_density:
    counts = list(steps) if isinstance(steps, (list, tuple)) else None
    if (counts is None or densities is None or
        len(counts) != len(densities) or
        not all(plan_lib.is_int(c) and c >= 1 for c in counts)):
      raise plan_lib.PlanError(
          f"density_warmup: steps={steps!r}: give one integer >= 1 per "
          "density of densities= (or one integer for all).")
  for name, value in (("steps", 0 if per_density else steps),
                      ("dense_steps", dense_steps)):
    if not plan_lib.is_int(value) or value < 0:
      raise plan_lib.PlanError(f"density_warmup: {name}={value!r} must be an "
                               "integer >= 0.")
  final = final_density(plan)
  if densities is None:
    densities = [d for d in DGC_RAMP if d > final] if steps else []
  densities = list(densities)
  below = [d for d in densities if not (plan_lib.is_real(d) and final < d <= 1)]
  if below:
    raise plan_lib.PlanError(
        f"density_warmup: densities {below} must each be in ({final:g}, 1]: "
        "a warm-up sends more than the plan it ends with.")
  if densities and not steps:
    raise plan_lib.PlanError("density_warmup: densities given with steps=0; "
                             "give steps per warm-up density.")
  ramp = [(float(d), int(n)) for d, n in zip(
      densities, counts if per_density else [steps] * len(densities))]
  dense_steps = int(dense_steps)
  def dense_plan():
    return dataclasses.replace(with_density(plan, 1.0),
                               settings=dataclasses.replace(
                                   plan.settings, full_wire=dense_wire))
  if num_workers is not None and num_workers > 1 and ramp:
    sizes = tuple(mesh_sizes) if mesh_sizes is not None else None
    dense_bytes = wire_received(dense_plan(), num_workers, sizes)
    costly = [d < 1.0 and wire_received(with_density(plan, d), num_workers,
                                        sizes) >= dense_bytes
              for d, _ in ramp]
    dense_steps += sum(n for (_, n), c in zip(ramp, costly) if c)
    ramp = [r for r, c in zip(ramp, costly) if not c]
  schedule = ([(1.0, dense_steps)] if dense_steps else []) + ramp
  phases, start = [], 0
  for density, length in schedule:
    phase_plan = dense_plan() if density == 1.0 else with_density(plan, density)
    phases.append(Phase(start, start + length, phase_plan))
    start += length
  phases.append(Phase(start, None, plan))
  check_phases(phases)
  return tuple(phases)


def final_density(plan: plan_lib.Plan) -> float:
  """The plan's largest sparse density (1.0 for an all-dense plan): a
  warm-up density must lie above it."""
  return max([l.density for l in plan.leaves if l.mode == "sparse"] +
             [b.density for b in plan.buckets if b.sparsify == "behind"
              and b.collective != "psum"] or [1.0])


def phase_index(phases: Sequence[Phase], step: int) -> int:
  """Index of the phase that trains ``step`` (an int, numpy or concrete JAX
  integer: e.g. a ``TrainState``'s step)."""
  step = plan_lib.as_python(step)
  if not plan_lib.is_int(step) or step < 0:
    raise ValueError(f"phase_index: step={step!r} must be an integer >= 0 "
                     "(steps count from 0).")
  for i, phase in enumerate(phases):
    if phase.stop is None or step < phase.stop:
      return i
  raise ValueError(f"phase_index: no phase trains step {step}: the last of "
                   f"{len(phases)} phases must have stop=None (as "
                   "density_warmup's does).")
