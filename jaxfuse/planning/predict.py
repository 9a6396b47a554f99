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
profile`` measured on the real one). ``profile_on_link`` measures one device's compute and takes the network
as given, for a link you do not have. The overlap is the costs' η: 0 to
1 of what the ideal wait-free schedule would hide behind the backward.
Every time this module returns is a prediction, not a measurement; say
which costs it used wherever it is shown.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import numpy as np

from jaxfuse import plans
from jaxfuse.optim import phases
from jaxfuse.planning import profiling
from jaxfuse.planning._measuring import Compression
from jaxfuse.planning._measuring import Model
from jaxfuse.planning._measuring import Sweep
from jaxfuse.planning.costs import Costs
from jaxfuse.planning.costs import LinearCost
from jaxfuse.planning.costs import fit_linear
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
  return tuple(simulate(p.plan, costs, num_workers).iteration
               for p in run_phases)


def local_steps_times(plan: plans.Plan, costs: Costs, num_workers: int
                      ) -> tuple[float, float]:
  """The predicted seconds of ``jaxfuse.local_steps``' two kinds of step
  on K workers: an inner step and a step that syncs.

    inner = forward + Σ backward          (no communication)
    sync  = inner + compression + G       (G: every bucket's collective)

  The sync runs after the step's update (it sends the pseudo-gradient of
  the whole H-block), so nothing hides it: η does not enter. An H-block
  takes (H − 1)·inner + sync, and its compute utilisation is
  H·inner / ((H − 1)·inner + sync).

  Args:
    plan: the plan the pseudo-gradients are synced with.
    costs: the costs for one worker's compute and the network's link.
    num_workers: K, an int >= 1.

  Returns:
    ``(inner, sync)`` in seconds.

  Raises:
    CostsError: costs measured on a model of other leaves, or
      ``num_workers`` not an int >= 1.
  """
  timeline = simulate(plan, costs, num_workers)
  inner = timeline.forward + timeline.backward
  return inner, timeline.compute_end + timeline.communication


def predicted_wall_time(run_phases: Sequence[phases.Phase], costs: Costs,
                        num_workers: int, steps: int,
                        every: int | None = None) -> np.ndarray:
  """The predicted wall time at the end of each step of a run on K workers.

  wall[s] = Σ over steps s' <= s of their phase's ``phase_step_times``
  (``every`` = H: of ``local_steps_times``, the sync at steps H, 2H, ...);
  compilation, evaluation and the host's work between steps are left out.

  Args:
    run_phases: the run's phases, each with a plan (``phase_step_times``).
    costs: the costs for one worker's compute and the network's link.
    num_workers: K, an int >= 1.
    steps: the run's length, an int >= 1.
    every: None for a per-step recipe; H >= 1 for ``jaxfuse.local_steps``
      (one phase, its plan the pseudo-gradients').

  Returns:
    A float64 array of ``steps`` cumulative seconds.

  Raises:
    PlanError: as ``phase_step_times``; ``steps`` or ``every`` is not an
      int >= 1, or local steps of several phases.
    CostsError: as ``phase_step_times``.
  """
  for name, value in (("steps", steps), ("every", every)):
    if (value is not None or name == "steps") and (
        not plans.is_int(value) or value < 1):
      raise plans.PlanError(f"predicted_wall_time: {name}={value!r} must be "
                            "an int >= 1.")
  if every is not None:
    if len(run_phases) != 1:
      raise plans.PlanError(
          f"predicted_wall_time: local steps (every={every}) run one phase, "
          f"not {len(run_phases)}; pass (jaxfuse.Phase(0, None, plan),).")
    inner, sync = local_steps_times(run_phases[0].plan, costs, num_workers)
    each = np.where(np.arange(1, int(steps) + 1) % every == 0, sync, inner)
    return np.cumsum(each.astype(np.float64))
  per_phase = phase_step_times(run_phases, costs, num_workers)
  each = np.array([per_phase[phases.phase_index(run_phases, s)]
                   for s in range(int(steps))], np.float64)
  return np.cumsum(each)


def profile_on_link(gbytes_per_s: float, latency_s: float, *,
                    model: Model | None = None, sweep: Sweep = Sweep(),
                    compression: Compression = Compression(),
                    progress: profiling.Progress | None = None) -> Costs:
  """Measure one device's compute and take the network as given: the
  costs of K workers on a link you do not have (``Costs.on_link``).

  On the first device: ``compress``, ``bucket`` and, with a ``model``,
  the forward and per-leaf backward times, as ``profile`` measures them.
  The collective lines are the ring on the link; the overlap η is 0
  (nothing hidden: a plain step over sockets measured 0.01 to 0.25, one
  under ``send_early`` about 0.8; set yours with ``costs.replace(
  overlap=η)``), the contention 1, and the schemes' extra compute 0.

  Args:
    gbytes_per_s: the link's bandwidth in GB/s (G Gbit/s: G/8).
    latency_s: seconds per message on the link.
    model: the ``Model`` to measure the compute of, or None.
    sweep: the compression sizes measured and their ``Timing``.
    compression: the sparse step a plan would use (a ``Compression``).
    progress: ``progress(done, total, what)``, as for ``profile``.

  Returns:
    A ``Costs`` of K₀ = 2 workers on that link (any K reads it as its
    ring), its provenance naming the link.

  Raises:
    CostsError: a bandwidth or latency out of range (before measuring).
    ProfileError: a sweep with fewer than two distinct sizes.
  """
  nothing = LinearCost(0.0, 0.0)
  link = Costs({"allgather": nothing, "psum": nothing}, nothing, ()
               ).on_link(gbytes_per_s, latency_s).collectives
  compress_sizes = tuple(int(s) for s in (
      sweep.compress_sizes or profiling.default_compress_sizes()))
  if len(set(compress_sizes)) < 2:
    raise profiling.ProfileError(
        f"compress_sizes={compress_sizes}: give at least two distinct "
        "sizes (one cannot separate the latency from the cost per unit).")
  timing, done = sweep.timing, [0]
  total = len(compress_sizes) + 1 + (2 if model else 0)

  def step(what):
    if progress:
      progress(done[0], total, what)
    done[0] += 1

  samples = profiling.measure_compress(
      compress_sizes, compression=compression, timing=timing, progress=step)
  step("bucket cost: one sparse bucket against one per layer")
  one = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
  bucket, bucket_raw = profiling.measure_bucket_cost(
      one, compression=compression, timing=timing)
  forward, backward, backward_raw = profiling.measure_model(model, timing,
                                                           step)
  if progress:
    progress(total, total, "done")
  provenance: dict[str, Any] = {
      **profiling.provenance_head("jaxfuse profile --link", {"data": 1}),
      "link": {"gbytes_per_s": float(gbytes_per_s),
               "latency_s": float(latency_s)},
      "timing": timing._asdict(), "compress": compression._asdict(),
      "samples": {"compress": [[int(x), float(t)] for x, t in samples]},
      "bucket": bucket_raw, "overlap": {"model": "not measured: 0"},
  }
  if backward_raw:
    provenance["leaves"] = backward_raw.pop("leaves")
    provenance["backward"] = backward_raw
  return profiling.same_on_every_process(Costs(
      link, fit_linear(*zip(*samples)), backward, overlap=0.0,
      forward=forward, provenance=provenance, bucket=bucket))
