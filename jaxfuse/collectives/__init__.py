"""Collective schemes: one per module, one interface (``base.Scheme``).

  allgather   AGsparse: all_gather of the packed slots (lossless)
  zen         ZEN Balanced Parallelism: hash partition, all_to_all, reduce,
              all_gather of the reduced partitions (hash bitmap)
  spardl      SparDL: Spar-Reduce-Scatter (Bruck rounds of ppermute, global
              residual) then Spar-All-Gather (teams: R-SAG / B-SAG)
  hier        hosts × local devices: dense reduce-scatter over the fast
              local axis, a sparse scheme over the host axis, all_gather back
  psum        dense buckets: one all-reduce

``transform`` runs a bucket's configured scheme (``of_bucket(bucket)``);
``planning`` asks the same object for its wire steps and their cost.
"""

from __future__ import annotations

import math
import warnings

import numpy as np

from jaxfuse import plans
from jaxfuse.collectives import base
from jaxfuse.collectives import hier
from jaxfuse.collectives.allgather import AllGather
from jaxfuse.collectives.base import Scheme
from jaxfuse.collectives.base import SchemeError
from jaxfuse.collectives.base import Step
from jaxfuse.collectives.base import Synced
from jaxfuse.collectives.base import Wire
from jaxfuse.collectives.configs import of_bucket
from jaxfuse.collectives.hier import Hier
from jaxfuse.collectives.psum import Psum
from jaxfuse.collectives.spardl import SparDL
from jaxfuse.collectives.zen import Zen

SCHEMES: dict[str, Scheme] = {
    s.name: s for s in (AllGather(), Zen(), SparDL(), Hier(), Psum())}


def get(name: str) -> Scheme:
  """The scheme called ``name`` (``plans.COLLECTIVES``) with its default
  configuration; a plan's buckets run their own (``of_bucket``).

  Args:
    name: a collective's name, e.g. ``"allgather"`` or ``"zen"``.

  Returns:
    The ``Scheme``.

  Raises:
    PlanError: no scheme has that name (the message lists those that do).
  """
  if name not in SCHEMES:
    raise plans.PlanError(f"collective {name!r} is not available; use one "
                             f"of {tuple(SCHEMES)}.")
  return SCHEMES[name]


def _compiled(steps, where: str):
  """``steps`` as compiled bucket steps: a ``Plan`` (0.2's argument) is
  compiled here for one more release, with a DeprecationWarning."""
  if not isinstance(steps, plans.Plan):
    return steps
  warnings.warn(
      f"collectives.{where}(plan, ...) is deprecated (removed in 0.4): "
      f"pass the compiled plan, collectives.{where}("
      "jaxfuse.sync.bucket_steps.compile_plan(plan), ...).", DeprecationWarning,
      stacklevel=3)
  # pylint: disable-next=g-import-not-at-top
  from jaxfuse.sync.bucket_steps import compile_plan
  return compile_plan(steps)


def bucket_steps(steps, num_workers: int, *, sched=None
                 ) -> list[tuple[Step, ...]]:
  """Per bucket, the primitives its scheme puts on the wire.

  Args:
    steps: the plan compiled (``bucket_steps.compile_plan(plan)``, a
      ``Schedule``); a ``Plan`` still works until 0.4, with a
      DeprecationWarning.
    num_workers: K.
    sched: deprecated spelling of ``steps`` (0.2 took the plan first).

  Returns:
    Per bucket, its ``Step``s for K workers (a density-1 sparse bucket goes
    through one all-reduce, like dense).
  Raises:
    Nothing for a compiled plan (a ``Plan`` is compiled here, with a
    ``DeprecationWarning``, until 0.4).
  """
  steps = _compiled(sched if sched is not None else steps, "bucket_steps")
  settings, out = steps.settings, []
  for b in steps.buckets:
    if b.kind == "sparse":
      out.append(b.scheme.steps(list(b.wire_specs), num_workers, settings))
    elif b.kind == "full":
      leaves = [(u.size, plans.full_wire_dtype(u, settings))
                for u in b.unit_specs]
      out.append(SCHEMES["psum"].steps(leaves, num_workers, settings))
    else:
      leaves = [(math.prod(steps.leaf_shapes[j]), steps.leaf_dtypes[j])
                for j in b.leaves]
      out.append(SCHEMES["psum"].steps(leaves, num_workers, settings))
  return out


def bucket_wire(steps, num_workers: int,
                mesh_sizes: tuple[int, ...] | None = None, *,
                sched=None) -> list[Wire]:
  """Per bucket, bytes one worker sends and receives per step on K workers.

  Args:
    steps: the compiled plan (``bucket_steps.compile_plan(plan)``); a ``Plan``
      still works until 0.4, with a DeprecationWarning.
    num_workers: K.
    mesh_sizes: (H, L) of a (host, local) mesh: a ``"hier"`` bucket then
      counts its host steps on H and its local steps on L.
    sched: deprecated spelling of ``steps``.

  Returns:
    One ``Wire`` per bucket.
  Raises:
    Nothing for a compiled plan (a ``Plan`` is compiled here, with a
    ``DeprecationWarning``, until 0.4).
  """
  steps = _compiled(sched if sched is not None else steps, "bucket_wire")
  out = []
  for b, wire in zip(steps.buckets, bucket_steps(steps, num_workers)):
    if (b.collective == "hier" and b.kind == "sparse" and
        mesh_sizes and len(mesh_sizes) == 2):
      out.append(hier.mesh_wire(list(b.wire_specs), *mesh_sizes,
                                steps.settings, b.scheme))
    else:
      out.append(base.wire(wire, num_workers))
  return out


def bytes_sent(steps, num_workers: int,
               mesh_sizes: tuple[int, ...] | None = None) -> tuple[int, int]:
  """(what one worker sends per step on K workers, what it sends in a ring
  all-reduce of the dense gradients, ⌈2(K−1)/K · D⌉).

  The payload (``plan.bytes_per_worker()``) understates the first for an
  all-gather, which hands it to each of the K − 1 others: on 8 workers a
  payload of 0.157 × D sends 0.60 × the all-reduce's bytes.

  Args:
    steps: the compiled plan (``bucket_steps.compile_plan(plan)``); a ``Plan``
      still works until 0.4, with a DeprecationWarning.
    num_workers: K.
    mesh_sizes: (H, L): a ``"hier"`` bucket counts both axes; without
      them its host-axis steps on K (``bucket_wire``).

  Returns:
    (sparse bytes sent, dense all-reduce bytes sent) per worker and step.
  Raises:
    Nothing for a compiled plan (a ``Plan`` is compiled here, with a
    ``DeprecationWarning``, until 0.4).
  """
  steps = _compiled(steps, "bytes_sent")
  sent = sum(w.sent for w in bucket_wire(steps, num_workers, mesh_sizes))
  dense = sum(math.prod(shape) * np.dtype(dtype).itemsize
              for shape, dtype in zip(steps.leaf_shapes, steps.leaf_dtypes))
  return sent, all_reduce_sent(dense, num_workers)


def all_reduce_sent(nbytes: int, num_workers: int) -> int:
  """Bytes one worker sends in a ring all-reduce of ``nbytes`` on K
  workers: ⌈2(K−1)/K · nbytes⌉.

  Args:
    nbytes: the all-reduced buffer's bytes.
    num_workers: K.

  Returns:
    The bytes sent per worker, an int (0 on one worker).

  Raises:
    Nothing.
  """
  return base.step_wire(Step("allreduce", nbytes), num_workers).sent


__all__ = ["AllGather", "Hier", "Psum", "SCHEMES", "Scheme", "SchemeError",
           "SparDL", "Step", "Synced", "Wire", "Zen", "base", "bucket_steps",
           "of_bucket",
           "all_reduce_sent", "bucket_wire", "bytes_sent", "get"]
