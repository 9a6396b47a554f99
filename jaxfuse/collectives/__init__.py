"""Collective schemes: one per module, one interface (``base.Scheme``).

  allgather   AGsparse: all_gather of the packed slots (lossless)
  zen         ZEN Balanced Parallelism: hash partition, all_to_all, reduce,
              all_gather of the reduced partitions (hash bitmap)
  spardl      SparDL: Spar-Reduce-Scatter (Bruck rounds of ppermute, global
              residual) then Spar-All-Gather (teams: R-SAG / B-SAG)
  hier        hosts × local devices: dense reduce-scatter over the fast
              local axis, a sparse scheme over the host axis, all_gather back
  psum        dense buckets: one all-reduce

``transform`` looks a bucket's scheme up with ``get(bucket.collective)``;
``planning`` asks the same object for its wire steps and their cost.
"""

from __future__ import annotations

from jaxfuse import plans as plan_lib
from jaxfuse import schedule as schedule_lib
from jaxfuse.collectives import base
from jaxfuse.collectives import hier
from jaxfuse.collectives.allgather import AllGather
from jaxfuse.collectives.base import Scheme
from jaxfuse.collectives.base import SchemeError
from jaxfuse.collectives.base import Step
from jaxfuse.collectives.base import Synced
from jaxfuse.collectives.base import Wire
from jaxfuse.collectives.hier import Hier
from jaxfuse.collectives.psum import Psum
from jaxfuse.collectives.spardl import SparDL
from jaxfuse.collectives.zen import Zen

SCHEMES: dict[str, Scheme] = {
    s.name: s for s in (AllGather(), Zen(), SparDL(), Hier(), Psum())}


def get(name: str) -> Scheme:
  """The scheme called ``name`` (``plans.COLLECTIVES``)."""
  if name not in SCHEMES:
    raise plan_lib.PlanError(f"collective {name!r} is not available; use one "
                             f"of {tuple(SCHEMES)}.")
  return SCHEMES[name]


def bucket_steps(plan: plan_lib.Plan, num_workers: int, *,
                 sched: schedule_lib.Schedule | None = None
                 ) -> list[tuple[Step, ...]]:
  """Per bucket, the primitives its scheme puts on the wire for K workers
  (a density-1 sparse bucket goes through one all-reduce, like dense).
  ``sched``: the plan already compiled (``schedule.compile_plan(plan)``)."""
  if sched is None:
    sched = schedule_lib.compile_plan(plan)
  out = []
  for b in sched.buckets:
    if b.kind == schedule_lib.SPARSE:
      out.append(get(b.collective).steps(sched.bucket_wire_units(b),
                                         num_workers, plan.settings))
    elif b.kind == schedule_lib.FULL:
      leaves = [(u.size, plan_lib.full_wire_dtype(u, plan.settings))
                for u in sched.bucket_units(b)]
      out.append(SCHEMES["psum"].steps(leaves, num_workers, plan.settings))
    else:
      leaves = [(plan.leaves[j].size, plan.leaves[j].dtype) for j in b.leaves]
      out.append(SCHEMES["psum"].steps(leaves, num_workers, plan.settings))
  return out


def bucket_wire(plan: plan_lib.Plan, num_workers: int,
                mesh_sizes: tuple[int, ...] | None = None, *,
                sched: schedule_lib.Schedule | None = None) -> list[Wire]:
  """Per bucket, bytes one worker sends and receives per step on K workers;
  with ``mesh_sizes`` (H, L) of a (host, local) mesh a ``"hier"`` bucket
  counts its host steps on H and its local steps on L."""
  if sched is None:
    sched = schedule_lib.compile_plan(plan)
  out = []
  for b, steps in zip(sched.buckets,
                      bucket_steps(plan, num_workers, sched=sched)):
    if (b.collective == "hier" and b.kind == schedule_lib.SPARSE and
        mesh_sizes and len(mesh_sizes) == 2):
      out.append(hier.mesh_wire(sched.bucket_wire_units(b), *mesh_sizes,
                                plan.settings))
    else:
      out.append(base.wire(steps, num_workers))
  return out


def bytes_sent(plan: plan_lib.Plan, num_workers: int,
               mesh_sizes: tuple[int, ...] | None = None) -> tuple[int, int]:
  """(what one worker sends per step under ``plan`` on K workers, what it
  sends in a ring all-reduce of the dense gradients, ⌈2(K−1)/K · D⌉).

  The payload (``plan.bytes_per_worker()``) understates the first for an
  all-gather, which hands it to each of the K − 1 others: on 8 workers a
  payload of 0.157 × D sends 0.60 × the all-reduce's bytes. A ``"hier"``
  bucket counts both axes with ``mesh_sizes`` (H, L); without them its
  host-axis steps on K (``bucket_wire``)."""
  sent = sum(w.sent for w in bucket_wire(plan, num_workers, mesh_sizes))
  return sent, all_reduce_sent(plan.dense_bytes(), num_workers)


def all_reduce_sent(nbytes: int, num_workers: int) -> int:
  """Bytes one worker sends in a ring all-reduce of ``nbytes`` on K
  workers: ⌈2(K−1)/K · nbytes⌉."""
  return base.step_wire(Step("allreduce", nbytes), num_workers).sent


__all__ = ["AllGather", "Hier", "Psum", "SCHEMES", "Scheme", "SchemeError",
           "SparDL", "Step", "Synced", "Wire", "Zen", "base", "bucket_steps",
           "all_reduce_sent", "bucket_wire", "bytes_sent", "get"]
