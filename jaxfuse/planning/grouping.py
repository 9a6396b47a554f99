"""Groups of leaves (ids in backward-ready order) -> the plan's buckets.

The one step every strategy shares, below them all: the rules in
``planner``, the cost groupings in ``strategies`` and ``optimal``.
"""

from __future__ import annotations

from jaxfuse import plans


def cut_last(groups, nbytes, limit: int) -> list[list[int]]:
  """``groups`` with the last one cut in two where it holds more than
  ``limit`` bytes: the final part is the longest run of its trailing
  leaves with Σ nbytes ≤ ``limit`` (at least its last leaf), the first
  part the rest. A group of one leaf stays whole.

  Under ``send_early`` the last group's collective is the one no backward
  can hide (its gradients are complete only when the backward ends), so
  a small final part shortens what the step waits for at its end."""
  if not groups:
    return []
  *before, last = [list(g) for g in groups]
  if len(last) < 2 or sum(nbytes[i] for i in last) <= limit:
    return before + [last]
  cut, held = len(last) - 1, nbytes[last[-1]]
  while cut > 1 and held + nbytes[last[cut - 1]] <= limit:
    cut -= 1
    held += nbytes[last[cut]]
  return before + [last[:cut], last[cut:]]


def buckets_from_groups(leaves, groups, *, behind: bool, headroom: float,
                        collective="allgather"
                        ) -> tuple[plans.BucketPlan, ...]:
  """Each group (leaf ids in ready order) -> a sparse bucket moved by
  ``collective`` (a scheme's name, or a scheme object of
  ``jaxfuse.collectives`` that the bucket keeps as its ``scheme``), then a
  dense one (``"psum"``).

  With ``behind`` a sparse bucket is selected jointly: one τ over the fused
  buffer, capacity ⌈ρ·Σn·headroom⌉ (``"topk"``: ⌈ρ·Σn⌉).
  """
  name, scheme = ((collective, None) if isinstance(collective, str) else
                  (collective.name, collective))
  buckets = []
  for group in groups:
    sparse = [i for i in group if leaves[i].mode == "sparse"]
    dense = [i for i in group if leaves[i].mode == "dense"]
    if sparse and behind:
      density, estimator = (leaves[sparse[0]].density,
                            leaves[sparse[0]].estimator)
      size = sum(leaves[i].size for i in sparse)
      cap = plans.capacity(density, size, estimator, headroom)
      buckets.append(plans.BucketPlan(tuple(sparse), name, "behind",
                                         cap, estimator, float(density),
                                         scheme))
    elif sparse:
      buckets.append(plans.BucketPlan(tuple(sparse), name,
                                         scheme=scheme))
    if dense:
      buckets.append(plans.BucketPlan(tuple(dense), "psum"))
  return tuple(buckets)
