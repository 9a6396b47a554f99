"""Groups of leaves (ids in backward-ready order) -> the plan's buckets.

The one step every strategy shares, below them all: the rules in
``planner``, the cost groupings in ``strategies`` and ``optimal``.
"""

from __future__ import annotations

from jaxfuse import plans as plan_lib


def buckets_from_groups(leaves, groups, *, behind: bool, headroom: float,
                        collective: str = "allgather"
                        ) -> tuple[plan_lib.BucketPlan, ...]:
  """Each group (leaf ids in ready order) -> a sparse bucket moved by
  ``collective``, then a dense one (``"psum"``).

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
      cap = plan_lib.capacity(density, size, estimator, headroom)
      buckets.append(plan_lib.BucketPlan(tuple(sparse), collective, "behind",
                                         cap, estimator, float(density)))
    elif sparse:
      buckets.append(plan_lib.BucketPlan(tuple(sparse), collective))
    if dense:
      buckets.append(plan_lib.BucketPlan(tuple(dense), "psum"))
  return tuple(buckets)
