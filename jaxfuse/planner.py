"""``jaxfuse.plan``: simple-rule plans (the cost-model planners come later).

Every strategy walks the leaves in backward-ready order and cuts that
sequence into contiguous groups; each group becomes up to two buckets, one
of its sparse leaves (``all_gather``) and one of its dense leaves (``psum``).

  layerwise  one leaf per group (WFBP)
  single     one group
  aligned    SAFusion §3.2: N = ⌈L/M⌉ leaves per group, M = ``num_buckets``
  size       fill a group up to ``bucket_bytes`` dense bytes (Horovod / DDP)
  behind     as ``size``, but each sparse bucket is selected with ONE
             threshold over the fused buffer (sparsification-behind baseline)
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import jax
import numpy as np

from jaxfuse import ordering
from jaxfuse import plans as plan_lib
from jaxfuse.version import __version__

STRATEGIES = ("layerwise", "single", "aligned", "size", "behind")
DEFAULT_BUCKET_BYTES = 25 * 2**20


def _groups(strategy, order, nbytes, num_buckets, bucket_bytes):
  if strategy == "layerwise":
    return [[i] for i in order]
  if strategy == "single":
    return [list(order)]
  if strategy == "aligned":
    per = math.ceil(len(order) / num_buckets)
    return [list(order[i:i + per]) for i in range(0, len(order), per)]
  groups, current, filled = [], [], 0
  for i in order:  # "size" and "behind"
    current.append(i)
    filled += nbytes[i]
    if filled >= bucket_bytes:
      groups.append(current)
      current, filled = [], 0
  return groups + ([current] if current else [])


def plan(params, *, density: float = 0.01, strategy: str = "aligned",
         estimator: str = "dgc", num_buckets: int = 4,
         bucket_bytes: int = DEFAULT_BUCKET_BYTES, headroom: float = 1.5,
         min_sparse_size: int = 1024, refresh: int = 1, feedback: bool = True,
         sample_fraction: float = 0.01, sidco_stages: int = 2, seed: int = 0,
         loss_fn: Callable | None = None, example_args: Sequence = (),
         ready_order: Sequence[int] | None = None) -> plan_lib.Plan:
  """Make a plan for ``params`` (arrays or ``jax.ShapeDtypeStruct``s).

  Args:
    params: the parameter pytree the gradients will have.
    density: share ρ of each sparse leaf to send per step, in (0, 1]; 1 means
      every leaf dense.
    strategy: one of ``STRATEGIES`` (module docstring).
    estimator: threshold estimator, one of ``plan.ESTIMATORS``.
    num_buckets: M for ``"aligned"``.
    bucket_bytes: dense bytes per bucket for ``"size"`` and ``"behind"``.
    headroom: capacity c = ⌈ρ·n·headroom⌉ (``"topk"``: c = ⌈ρ·n⌉ exactly).
    min_sparse_size: leaves with fewer elements (and non-float leaves) go dense.
    refresh, feedback, sample_fraction, sidco_stages, seed: ``plan.Settings``.
    loss_fn, example_args: ``loss_fn(params, *example_args)``; its gradient's
      jaxpr gives the backward-ready order. Without it, reverse pytree order.
    ready_order: leaf ids in ready order, overriding ``loss_fn``.
  """
  if strategy not in STRATEGIES:
    raise plan_lib.PlanError(f"strategy={strategy!r}; use one of {STRATEGIES}.")
  if estimator not in plan_lib.ESTIMATORS:
    raise plan_lib.PlanError(
        f"estimator={estimator!r}; use one of {plan_lib.ESTIMATORS}.")
  if not isinstance(density, (int, float)) or not 0 < density <= 1:
    raise plan_lib.PlanError(f"density={density!r} must be in (0, 1].")
  if not (isinstance(num_buckets, int) and num_buckets >= 1):
    raise plan_lib.PlanError(f"num_buckets={num_buckets!r} must be an int >= 1.")
  if not bucket_bytes > 0:
    raise plan_lib.PlanError(f"bucket_bytes={bucket_bytes!r} must be > 0.")
  if not (isinstance(min_sparse_size, int) and min_sparse_size >= 1):
    raise plan_lib.PlanError(
        f"min_sparse_size={min_sparse_size!r} must be an int >= 1.")
  settings = plan_lib.Settings(headroom=headroom, min_sparse_size=min_sparse_size,
                               refresh=refresh, feedback=feedback,
                               sample_fraction=sample_fraction,
                               sidco_stages=sidco_stages, seed=seed)

  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  if not flat:
    raise plan_lib.PlanError("params has no array leaves to plan for.")
  leaves = []
  for path, x in flat:
    name = jax.tree_util.keystr(path)
    shape = tuple(int(d) for d in np.shape(x))
    dtype = str(jax.numpy.result_type(x))
    size = math.prod(shape)
    if size == 0:
      raise plan_lib.PlanError(
          f"leaf {name}: has zero elements; remove it from the parameters.")
    sparse = (density < 1 and size >= min_sparse_size and
              plan_lib._is_float(dtype))  # pylint: disable=protected-access
    if sparse:
      cap = (plan_lib.target_count(density, size) if estimator == "topk" else
             plan_lib.capacity_for(density, size, headroom))
      leaves.append(plan_lib.LeafPlan(name, shape, dtype, "sparse",
                                      float(density), cap, estimator))
    else:
      leaves.append(plan_lib.LeafPlan(name, shape, dtype, "dense", 1.0,
                                      size, None))

  if ready_order is not None:
    order, source = [int(i) for i in ready_order], "given"
    if sorted(order) != list(range(len(leaves))):
      raise plan_lib.PlanError(
          f"ready_order must list each of the {len(leaves)} leaf ids once.")
  elif loss_fn is not None:
    order, source = ordering.ready_order(loss_fn, params, *example_args), "jaxpr"
  else:
    order, source = ordering.reverse_order(len(leaves)), "reverse_pytree"

  nbytes = [l.size * jax.numpy.dtype(l.dtype).itemsize for l in leaves]
  groups = _groups(strategy, order, nbytes, num_buckets, bucket_bytes)
  buckets = buckets_from_groups(leaves, groups, behind=strategy == "behind",
                                headroom=headroom)

  provenance = {
      "strategy": strategy, "jaxfuse_version": __version__,
      "ready_order": source,
      "parameters": {"density": density, "estimator": estimator,
                     "num_buckets": num_buckets, "bucket_bytes": bucket_bytes},
  }
  return plan_lib.Plan(tuple(leaves), buckets, settings, provenance)


def buckets_from_groups(leaves, groups, *, behind: bool,
                        headroom: float) -> tuple[plan_lib.BucketPlan, ...]:
  """Each group (leaf ids in ready order) -> a sparse bucket, then a dense one.

  With ``behind`` a sparse bucket is selected jointly: one τ over the fused
  buffer, capacity ⌈ρ·Σn·headroom⌉ (``"topk"``: ⌈ρ·Σn⌉).
  """
  buckets = []
  for group in groups:
    sparse = [i for i in group if leaves[i].mode == "sparse"]
    dense = [i for i in group if leaves[i].mode == "dense"]
    if sparse and behind:
      density, estimator = leaves[sparse[0]].density, leaves[sparse[0]].estimator
      size = sum(leaves[i].size for i in sparse)
      cap = (plan_lib.target_count(density, size) if estimator == "topk" else
             plan_lib.capacity_for(density, size, headroom))
      buckets.append(plan_lib.BucketPlan(tuple(sparse), "allgather", "behind",
                                         cap, estimator, float(density)))
    elif sparse:
      buckets.append(plan_lib.BucketPlan(tuple(sparse), "allgather"))
    if dense:
      buckets.append(plan_lib.BucketPlan(tuple(dense), "psum"))
  return tuple(buckets)
