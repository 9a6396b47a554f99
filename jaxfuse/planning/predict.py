"""A run's predicted wall time on K real workers over a given network.

The maths of K workers does not need K devices (``jaxfuse.simulated_mesh``
runs them on one), but their time does: each step of a run on K devices is
its phase's plan simulated (``jaxfuse.planning.simulate``) under costs
whose compute was measured on one device and whose link is the network's::

  t_step(s)   = simulate(phase(s).plan, costs, K).iteration
  wall(s)     = Σ_{s' ≤ s} t_step(s')

with ``costs.with_compute(T₁)`` for the measured compute T₁ of one
worker's dense step at its batch, and ``costs.on_link(GB/s, latency)``
for a network given by its bandwidth and latency (or the lines ``jaxfuse
profile`` measured on the real one). The overlap is the costs' η: 0 to
1 of what the ideal wait-free schedule would hide behind the backward.
Every time this module returns is a prediction, not a measurement; say
which costs it used wherever it is shown.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from jaxfuse import plans
from jaxfuse.optim import phases
from jaxfuse.planning.costs import Costs
from jaxfuse.planning.simulate import simulate


def phase_step_times(run_phases: Sequence[phases.Phase], costs: Costs,
                     num_workers: int) -> tuple[float, ...]:
  """The predicted seconds of one step of each phase on K workers.

  Args:
    run_phases: the run's phases (``jaxfuse.density_warmup``), each with a
      plan. A dense baseline is the plan at density 1
      (``jaxfuse.with_density(plan, 1.0)``: every bucket a ``pmean``).
    costs: the costs (``jaxfuse.planning.costs.Costs``), their compute
      for one worker's batch and their link for the network.
    num_workers: K, an int >= 1 (1: no communication).

  Returns:
    One simulated iteration time in seconds per phase, in order.

  Raises:
    PlanError: the phases are not phases, or one has no plan (name the
      dense baseline's plan as above).
    CostsError: the costs were measured on a model of other leaves, or
      ``num_workers`` is not an int >= 1.
  """
  for i, phase in enumerate(run_phases):
    if isinstance(phase, phases.Phase) and phase.plan is None:
      raise plans.PlanError(
          f"phase_step_times: phase {i} has no plan (a dense pmean of no "
          "plan has no leaves to simulate); give the dense baseline as "
          "jaxfuse.with_density(plan, 1.0).")
  phases.check_phases(run_phases)
  return tuple(simulate(p.plan, costs.on_workers(num_workers),
                        num_workers).iteration for p in run_phases)


def predicted_wall_time(run_phases: Sequence[phases.Phase], costs: Costs,
                        num_workers: int, steps: int) -> np.ndarray:
  """The predicted wall time at the end of each step of a run on K workers.

  wall[s] = Σ over steps s' <= s of their phase's ``phase_step_times``;
  compilation, evaluation and the host's work between steps are left out.

  Args:
    run_phases: the run's phases, each with a plan (``phase_step_times``).
    costs: the costs for one worker's compute and the network's link.
    num_workers: K, an int >= 1.
    steps: the run's length, an int >= 1.

  Returns:
    A float64 array of ``steps`` cumulative seconds.

  Raises:
    PlanError: as ``phase_step_times``; or ``steps`` is not an int >= 1.
    CostsError: as ``phase_step_times``.
  """
  if not plans.is_int(steps) or steps < 1:
    raise plans.PlanError(f"predicted_wall_time: steps={steps!r} must be an "
                          "int >= 1.")
  per_phase = phase_step_times(run_phases, costs, num_workers)
  each = np.array([per_phase[phases.phase_index(run_phases, s)]
                   for s in range(int(steps))], np.float64)
  return np.cumsum(each)
