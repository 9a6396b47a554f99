"""The timeline simulator: one plan + costs -> when everything happens.

This is the objective every planner optimizes and the picture every plot
draws. All times are in seconds from the start of the forward pass.

Compute stream (one, in order). The forward pass takes ``costs.forward``.
Then the backward pass computes the leaves in the model's backward-ready
order (``backward_order``: the one ``jaxfuse.plan`` found and kept in the
plan's provenance; else ``plan.ready_order``, bucket after bucket), each
taking ``costs.backward[leaf]``: the buckets do not reorder the model's
backward, so a bucket is ready when the last of its leaves in that order
is. Right after that, the bucket is sparsified on the same stream (it
shares the GPU, so it delays the later backward work): the sum over its
selection units (``plans.units``) of ``costs.compress.time(unit.size)``,
plus its scheme's extra compute ``costs.scheme_time(scheme, Σ capacity)``
(0 for all_gather), plus ``costs.bucket``, what a sparse bucket computes
beyond its units' compression (its own selection call, reductions,
packing and decoding: a plan of many small buckets pays it many times);
buckets ready at the same leaf in plan order. A dense (``"psum"``) bucket,
and one whose units are all sent whole (density 1), has no compression. The compute stream ends at
``compute_end = forward + Σ backward + Σ compression``.

Link (one; collectives never run at the same time, so the contention γ of
the costs does not enter). Buckets are communicated in plan order; in the
ideal wait-free backpropagation of the papers (Cupcake Fig. 3, ASC-WFBP
Fig. 1b) bucket i starts at max(its compression end, end of bucket i-1) and
lasts the time of its scheme's wire steps on K workers,
``costs.steps_time(collectives.bucket_steps(compile_plan(plan), K)[i], K)`` (K defaults
to the costs' ``workers``; at K₀ an all_gather or psum bucket takes exactly
its measured line).

Overlap calibration (η = ``costs.overlap``). XLA does not hide as much as the
ideal schedule. The rule used here: *XLA keeps a share η of what the ideal
schedule hides*, H (the ideal link's busy time before the compute stream
ends): the link may be busy for at most η·H seconds before ``compute_end``.
It follows the ideal schedule until it has spent that budget; then the
bucket on the link pauses until ``compute_end`` and everything left follows
back to back. Hence

  hidden = η·H
  iteration = compute_end + G − η·H = (1 − η)·T_none + η·T_ideal

(T_none = compute_end + G, no overlap; T_ideal the ideal WFBP iteration):
η = 1 gives the ideal timeline, η = 0 no overlap, and a plan whose ideal
schedule hides less (a large last bucket, ready only when the backward
ends) is slower at every η < 1. Whenever the ideal schedule could hide
everything, the simulated overlap ratio is exactly η. The iteration time
is non-decreasing in every time, byte count, α and β, and non-increasing
in η. (Why a share of the ideal saving instead of a cap, measured
against cap-style models: docs/, planner accuracy.)
"""

from __future__ import annotations

import dataclasses
import math

from jaxfuse import collectives
from jaxfuse import plans
from jaxfuse.sync import bucket_steps
from jaxfuse.planning.costs import Costs


@dataclasses.dataclass(frozen=True)
class BucketTimes:
  """One bucket. ``ready``: its last leaf's gradient exists; compression on
  the compute stream runs ``[compress_start, compress_end)`` (empty for a
  dense bucket); its collective is on the link ``[comm_start, comm_end)``
  (pausing during ``Timeline.pause`` if that falls inside)."""
  ready: float
  compress_start: float
  compress_end: float
  comm_start: float
  comm_end: float
  collective: str
  wire_bytes: int


@dataclasses.dataclass(frozen=True)
class Timeline:
  """What ``simulate`` returns (plain data; ``to_dict`` for JSON or plots).

  leaves: per leaf in the plan's leaf (pytree) order, backward (start, end).
  buckets: per bucket in plan order.
  pause: the link's forced idle interval (start, end) when the η budget ran
    out during backward, else None.
  """
  leaves: tuple[tuple[float, float], ...]
  buckets: tuple[BucketTimes, ...]
  forward: float
  backward: float        # Σ backward compute
  compression: float     # Σ compression
  compute_end: float     # forward + backward + compression
  communication: float   # G: Σ communication time of all buckets
  iteration: float
  pause: tuple[float, float] | None = None

  @property
  def non_overlapped(self) -> float:
    """Communication not hidden: iteration − forward − backward − compression
    (computed as iteration − compute_end, kept in [0, communication] against
    rounding)."""
    return min(max(0.0, self.iteration - self.compute_end), self.communication)

  @property
  def hidden(self) -> float:
    return self.communication - self.non_overlapped

  @property
  def overlap_ratio(self) -> float:
    """Hidden communication / total communication (1 if there is none)."""
    if self.communication <= 0:
      return 1.0
    return self.hidden / self.communication

  def to_dict(self) -> dict:
    out = dataclasses.asdict(self)
    out["leaves"] = [list(x) for x in self.leaves]
    out["pause"] = list(self.pause) if self.pause else None
    out.update(non_overlapped=self.non_overlapped, hidden=self.hidden,
               overlap_ratio=self.overlap_ratio)
    return out


def eta_from_hidden(hidden_time: float, ideal: Timeline) -> float | None:
  """The overlap η that hides ``hidden_time`` seconds of communication:
  hidden_time / H, H what ``ideal`` (the plan simulated at η = 1) hides;
  None if that hides nothing. Not clamped to [0, 1]: a measured step may
  hide more or less than the rule allows. From a step T_K measured
  against the same per-worker work alone T₁: hidden_time = T₁ + G − T_K;
  from a trace's hidden share s of the link time: s·G."""
  if ideal.hidden <= 0:
    return None
  return hidden_time / ideal.hidden


def step_at(compute: float, eta: float, ideal: Timeline) -> float:
  """The rule's step with ``compute`` as the compute stream (e.g. a
  measured one-GPU step T₁): compute + G − η·H, G and H from ``ideal``."""
  return compute + ideal.communication - eta * ideal.hidden


def step_from_one_worker(t1: float, eta: float, ideal: Timeline,
                         anchor: Timeline) -> float:
  """A plan's step from another plan's measured one-GPU step T₁ (the
  anchor, e.g. the ``size`` plan that ran alone): ``step_at`` with compute
  T₁ + (the plan's simulated compute end − the anchor's), so a plan of more
  buckets pays their extra compression. ``ideal``, ``anchor``: both plans
  simulated with the same costs at η = 1."""
  return step_at(t1 + ideal.compute_end - anchor.compute_end, eta, ideal)


def compression_times(plan: plans.Plan, costs: Costs, *,
                      sched: bucket_steps.Schedule | None = None
                      ) -> list[float]:
  """Per sparse bucket: Σ over its selection units of
  compress.time(unit.size), plus ``costs.scheme_time`` of its scheme for its
  slots (Σ capacity) and ``costs.bucket``. ``sched``: the plan already
  compiled (``bucket_steps.compile_plan(plan)``)."""
  if sched is None:
    sched = bucket_steps.compile_plan(plan)
  out = []
  for b in sched.buckets:
    if b.kind != bucket_steps.SPARSE:   # psum, or every unit sent whole:
      out.append(0.0)                   # nothing to select
      continue
    units = sched.bucket_units(b)
    extra = costs.scheme_time(b.collective, sum(
        u.capacity for u in units)) + costs.bucket
    out.append(sum(costs.compress.time(u.size) for u in units) + extra)
  return out


def backward_order(plan: plans.Plan) -> tuple[int, ...]:
  """The order the model's backward makes the leaves in: the plan's
  ``provenance["backward_order"]`` when it holds each leaf id once (what
  ``jaxfuse.plan`` records), else ``plan.ready_order``."""
  order = plan.provenance.get("backward_order")
  n = len(plan.leaves)
  if (isinstance(order, (list, tuple)) and
      all(isinstance(i, int) for i in order) and
      plans.is_leaf_order(order, n)):
    return tuple(order)
  return plan.ready_order


def simulate(plan: plans.Plan, costs: Costs,
             num_workers: int | None = None, *,
             order: tuple[int, ...] | None = None) -> Timeline:
  """The timeline of one training step of ``plan`` under ``costs`` on K =
  ``num_workers`` workers (default ``costs.workers``); ``order``: the
  backward's leaf order (default ``backward_order(plan)``).

  See the module docstring for the model. Raises ``CostsError`` when the
  costs do not have one backward time per leaf of the plan, or were
  measured on a model of other leaves (``Costs.check``).
  """
  costs.check(len(plan.leaves),
              leaves=[(l.path, l.shape) for l in plan.leaves])
  k = costs.workers if num_workers is None else num_workers
  sched = bucket_steps.compile_plan(plan)
  wire = plans.bucket_payload_bytes(plan)
  compress = compression_times(plan, costs, sched=sched)
  order = backward_order(plan) if order is None else tuple(order)
  if not plans.is_leaf_order(order, len(plan.leaves)):
    raise ValueError(f"order must list each of the {len(plan.leaves)} leaf "
                     "ids once.")

  # Compute stream: forward, then the leaves in backward order; each bucket
  # is compressed once its last leaf in that order is made.
  position = {leaf: p for p, leaf in enumerate(order)}
  done_at = [[] for _ in order]          # per position: buckets it completes
  for i, b in enumerate(sched.buckets):
    if b.leaves:
      done_at[max(position[j] for j in b.leaves)].append(i)
  t = costs.forward
  leaf_times = [None] * len(plan.leaves)
  marks = [(t, t)] * len(sched.buckets)  # per bucket (ready, compress_end)
  for p, j in enumerate(order):
    leaf_times[j] = (t, t + costs.backward[j])
    t += costs.backward[j]
    for i in done_at[p]:
      ready = t
      t += compress[i]   # 0 unless the bucket selects (compression_times)
      marks[i] = (ready, t)
  compute_end = t
  backward = math.fsum(costs.backward)
  compression = math.fsum(compress)

  # Link: ideal WFBP order until the η budget of busy-during-compute is used.
  durations = [costs.steps_time(steps, k) for steps in
               collectives.bucket_steps(sched, k)]
  total = math.fsum(durations)
  slack = 1e-12 * total  # rounding of the sums must not start a pause at η = 1
  compressed = [c for _, c in marks]
  _, ideal_hidden, _ = _link(costs.forward, durations, compressed,
                             compute_end, math.inf, slack)
  spans, _, pause = _link(costs.forward, durations, compressed, compute_end,
                          costs.overlap * ideal_hidden, slack)
  buckets = [BucketTimes(ready, ready, done, start, end, b.collective, int(n))
             for b, n, (ready, done), (start, end) in zip(
                 sched.buckets, wire, marks, spans)]
  free = spans[-1][1] if spans else costs.forward
  iteration = max(compute_end, free)
  return Timeline(tuple(leaf_times), tuple(buckets), costs.forward, backward,
                  compression, compute_end, total, iteration, pause)


def _link(start, durations, compressed, compute_end, budget, slack):
  """The link's (start, end) per bucket, its busy time before
  ``compute_end`` and its pause: buckets in plan order, each at max(its
  compression end, the previous bucket's end) (the ideal WFBP schedule)
  until the link has been busy ``budget`` seconds before ``compute_end``;
  then it pauses until ``compute_end`` and the rest follows back to back.
  With an infinite budget: the ideal schedule, whose busy time is H."""
  busy, free, pause, spans = 0.0, start, None, []
  for g, done in zip(durations, compressed):
    begin = max(done, free)
    if pause is None and begin < compute_end:
      before = min(begin + g, compute_end) - begin
      if busy + before > budget + slack:
        ran = max(0.0, budget - busy)
        pause = (begin + ran, compute_end)
        if ran <= 0:
          begin = compute_end
        end, busy = compute_end + (g - ran), budget
      else:
        end, busy = begin + g, busy + before
    else:
      end = begin + g
    free = end
    spans.append((begin, end))
  return spans, busy, pause
