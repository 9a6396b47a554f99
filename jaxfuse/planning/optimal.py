"""The optimal contiguous grouping: Cupcake's Algorithm 1 (MLSys '23, §4).

The leaves, in backward-ready order T_0 … T_{N-1}, are cut into contiguous
groups; like every jaxfuse strategy, each group becomes at most one sparse
(``all_gather``) bucket and one dense (``psum``) bucket (``plan_from_groups``).
``optimal_grouping`` returns a grouping that minimizes ``simulate``'s
iteration time, exactly, by branch and bound over the recurrence
F(M, k) = min_{k <= j < N} F(M + fuse(k, j), j + 1) (Cupcake Eq. 2-3).

Fast objective. ``GroupingProblem`` evaluates a grouping with O(1) work per
group from prefix sums; it is the simulator restricted to plans made by
``plan_from_groups`` (tested equal to ``simulate`` on such plans). With
positions p in ready order, backward b_p, compression h_p (sparse leaves:
``costs.compress.time(size)``, one unit per leaf), wire bytes w_p, and a
group [a..j] starting on the compute stream at P_a = Σ_{p<a} (b_p + h_p):

  sparse bucket ready  r_s = P_{s+1}, s the group's last sparse position
                       (the backward keeps the model's order; the bucket
                       is compressed once its last leaf exists)
  dense bucket ready   r_d = P_{j+1}     (or earlier, where the group ends
                                          sparse: it waits behind the
                                          sparse bucket on the link anyway)
  link                 E ← max(r_s, E) + g_ag(Σ sparse w);
                       E ← max(r_d, E) + g_ps(Σ dense w)
  iteration            forward + (1 − η)·(P_N + G) + η·max(E_final, P_N)

With a per-bucket compute cost c = ``costs.bucket`` (``simulate`` adds it
to each sparse bucket's compression), every time on the compute stream
after a group's sparse bucket moves by c: with m sparse buckets up to and
including the group's, r_s and r_d above are P + m·c, and P_N becomes
P_N + M·c (M: all sparse buckets).

(G: total communication, η: ``costs.overlap``: the iteration is (1 − η)·(no
overlap) + η·(the ideal schedule); see ``jaxfuse.planning.simulate``).
P_a at a group boundary depends on the grouping only through m·c: the
compute time of a group is its backward plus one compression per sparse
leaf, plus c if it has a sparse leaf.

The two prunings of Algorithm 1, adapted to this model and proven safe in
it (``prune_bound`` / ``prune_dominance`` turn them off, for tests):

1. Bound (Cupcake insight #1, Eq. 4, lines 19-23): the optimistic outcome
   of a branch whose next group is [k..j] is the objective at a lower bound
   of each of its two arguments (it grows with both). The final link time
   is at least the largest of: the link time after that group plus the
   rest's least communication (its bytes at β and one α per collective
   still needed; "the rest as one group, sent right after"); P_N plus the
   cheapest possible last bucket (no communication overhead but the last);
   P_k − SB_k + max_{q>=k} (SB_{q+1} + rest_q) (a bucket with a leaf at q
   or later is ready no earlier than P_k + SB(k..q), and all bytes from q
   on follow it). G is at least G so far plus the rest's least
   communication. A branch whose optimistic
   outcome is no better than the best grouping found is cut; since the first
   of these only grows with j once the group's ready time passes the link
   time, the scan over j stops there. Each of those bounds holds shifted by
   the m·c a partial grouping has already paid. The best of a few equal-count
   groupings (as §4.2 suggests) is the first incumbent.

2. Dominance (insight #2, Eq. 5, lines 9-16): let j* be the last j with
   P_{j+1} + (m + 1)·c <= E, E the time the link frees (M.delay = E − P_k),
   m the sparse buckets so far: one group [k..j], j <= j*, finishes
   computing before the link is free.
   (a) Any completion whose first two groups both end at or before j* is no
   better than the one that merges all its groups inside [k..j*] into one:
   the merged group is ready when the link frees, so its buckets go first
   and back to back, and merging only saves α's and c's; nothing after
   moves later (max-plus
   monotonicity). So a first group ending at j < j* is only followed by a
   group ending after j*. (b) If moreover T_k … T_J are all sparse (J <=
   j*), Cupcake's rule itself holds: a first group ending before J is no
   better than [k..J] with the next group cut at J (the next group's sparse
   bucket is ready at the same time, one α is saved), so it is skipped.
   Cupcake states (b) up to j*; here the dense leaves of a group follow its
   sparse bucket's compression, so (b) is not safe past a dense leaf (a
   5-leaf counterexample is in the tests) and (a) is what remains there.

3. State dominance (``prune_states``): as Cupcake's Fig. 5 notes, the rest
   of the search depends on M only through a few numbers, here the link-free
   time E, the communication so far G, the constraint from 2(a) and (when
   c > 0) the sparse buckets so far m. Partial
   groupings are visited by the position where their next group starts, in
   increasing order (a breadth-first form of Algorithm 1's recursion), so
   all those reaching k are known before any is extended; one no better in
   all three than another is dropped (G does not count at η = 1). At
   each position the candidate groups of all live partial groupings are
   evaluated at once with numpy.

Each pruning keeps an optimal grouping (tested against brute force and
against the search with each pruning off). With 3 alone the search is an
exact dynamic program: at each of the N positions it extends the live
labels by one group each, so its work is N times the labels kept, never
the 2^(N-1) groupings. 1 and 2 keep that number small. A per-bucket cost
c > 0 makes the search slower, since labels of different m compare on one
more number and dominate each other less. The slow cases are those where
many groupings come within 0.1% of the optimum: the bound cuts a branch
only once it is worse than the best found. ``benchmarks/planner.py
timing`` measures the search on synthetic models of up to 1000 leaves.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple, Sequence

import numpy as np

from jaxfuse.planning.costs import Costs
from jaxfuse.planning import grouping
from jaxfuse import plans
from jaxfuse.planning import simulate
from jaxfuse.planning._grouping_problem import GroupingProblem
from jaxfuse.planning._grouping_problem import _objective


# --- plans from groups -------------------------------------------------------

def _gather_of(base: plans.Plan):
  """The all-gather of ``base``'s buckets as configured there (alone, or
  as a hier's host-axis scheme), or ``"allgather"``'s defaults."""
  for b in base.buckets:
    scheme = getattr(b.scheme, "inner", b.scheme)
    if getattr(scheme, "name", None) == "allgather":
      return scheme
  return "allgather"


def plan_from_groups(base: plans.Plan, groups: Sequence[Sequence[int]], *,
                     sparsify: str = "ahead", strategy: str = "optimal",
                     provenance: dict | None = None) -> plans.Plan:
  """The plan whose buckets are ``groups`` (leaf ids, in ready order).

  As in ``jaxfuse.plan``: each group becomes at most one sparse bucket (its
  sparse leaves, ``"allgather"``, configured as ``base``'s all-gather is:
  ``_gather_of``) followed by one dense bucket (its dense
  leaves, ``"psum"``). Leaves, settings and provenance come from ``base``;
  ``provenance["strategy"]`` becomes ``strategy``. With ``sparsify="behind"``
  each sparse bucket is selected jointly, with capacity from the leaves'
  density and estimator and ``base.settings.headroom`` as the planner does.

  Args:
    base: the plan whose leaves, settings and provenance are kept.
    groups: leaf ids per group, in ready order.
    sparsify: ``"ahead"`` (one selection unit per sparse leaf) or
      ``"behind"`` (one per sparse bucket).
    strategy: the name recorded as ``provenance["strategy"]``.
    provenance: more provenance entries, set last.

  Returns:
    The ``Plan``.

  Raises:
    PlanError: for an unknown ``sparsify`` or a leaf id out of range.
  """
  if sparsify not in plans.SPARSIFY:
    raise plans.PlanError(f"sparsify={sparsify!r}; use one of "
                          f"{plans.SPARSIFY}.")
  leaves = base.leaves
  groups = [[int(i) for i in group] for group in groups]
  for group in groups:
    if any(not 0 <= i < len(leaves) for i in group):
      raise plans.PlanError(f"group {group} has leaf ids out of range "
                            f"[0, {len(leaves)}).")
  buckets = grouping.buckets_from_groups(leaves, groups,
                                        behind=sparsify == "behind",
                                        headroom=base.settings.headroom,
                                        collective=_gather_of(base))
  prov = dict(base.provenance)
  prov["strategy"] = strategy
  made = [i for group in groups for i in group]
  if plans.is_leaf_order(made, len(leaves)):   # groups in ready order
    prov["backward_order"] = made
  prov.update(provenance or {})
  return plans.Plan(leaves, buckets, base.settings, prov)


# --- search -------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Grouping:
  """A grouping and its simulated iteration time.

  groups: leaf ids per group, in ready order. cuts: the last ready position
  of each group. nodes: partial groupings the search kept and extended
  (brute force: groupings scored).
  """
  groups: tuple[tuple[int, ...], ...]
  cuts: tuple[int, ...]
  time: float
  nodes: int


def _heuristics(n: int):
  """Starting incumbents (Cupcake §4.2 suggests equal-count groups)."""
  yield (n - 1,)
  yield tuple(range(n))
  for m in (2, 3, 4, 6, 8, 12, 16, 24, 32):
    if m < n:
      per = math.ceil(n / m)
      yield tuple(sorted({min(n - 1, i + per - 1) for i in range(0, n, per)}))


def optimal_grouping(plan: plans.Plan, costs: Costs, *,
                     order: Sequence[int] | None = None,
                     prune_bound: bool = True,
                     prune_dominance: bool = True,
                     prune_states: bool = True) -> Grouping:
  """The contiguous grouping of the ready-ordered leaves that minimizes
  ``simulate(plan_from_groups(plan, groups), costs).iteration`` (exactly).

  Cupcake's Algorithm 1 (branch and bound) with both of its prunings and
  state dominance (module docstring; the flags turn each off, for tests).
  Sparse leaves are planned "ahead" (one selection unit each), as
  ``plan_from_groups`` makes them.

  Args:
    plan: the plan whose leaves are grouped.
    costs: ``Costs`` for ``plan``'s leaves.
    order: leaf ids in backward-ready order, as in
      ``GroupingProblem.from_plan``.
    prune_bound: pruning 1 (the bound).
    prune_dominance: pruning 2 (dominance).
    prune_states: pruning 3 (state dominance).

  Returns:
    The optimal ``Grouping``.

  Raises:
    PlanError: if ``order`` does not list each leaf id once.
    CostsError: if ``costs`` does not fit ``plan``'s leaves.
  """
  problem = GroupingProblem.from_plan(plan, costs, order)
  return search(problem, prune_bound=prune_bound,
                prune_dominance=prune_dominance, prune_states=prune_states)


def search(problem: GroupingProblem, *, prune_bound: bool = True,
           prune_dominance: bool = True, prune_states: bool = True) -> Grouping:
  """Branch and bound on a ``GroupingProblem`` (see ``optimal_grouping``).

  Args:
    problem: the ``GroupingProblem``.
    prune_bound: pruning 1 (the bound).
    prune_dominance: pruning 2 (dominance).
    prune_states: pruning 3 (state dominance).

  Returns:
    The optimal ``Grouping``; ``nodes`` counts the partial groupings kept.
  """
  t = problem._tables()  # pylint: disable=protected-access
  n = t["n"]
  pos, sb = np.asarray(t["pos"]), np.asarray(t["sb"])
  after_sparse = np.asarray(t["after_sparse"])
  sw, dw = np.asarray(t["sw"], np.float64), np.asarray(t["dw"], np.float64)
  ns = np.asarray(t["ns"])
  ag, ps = problem.allgather, problem.psum
  eta, fwd, c = problem.overlap, problem.forward, problem.bucket
  compute = float(pos[n])     # the compute stream's end, before any m·c
  sparse = np.asarray(problem.sparse, bool)

  # rest[i]: least communication of positions i.. (all in one group: one α
  # per collective still needed). rest[n] = 0.
  has_s = ns[n] - ns > 0
  has_d = (n - np.arange(n + 1)) - (ns[n] - ns) > 0
  rest = (np.where(has_s, ag.alpha + ag.beta * (sw[n] - sw), 0.0) +
          np.where(has_d, ps.alpha + ps.beta * (dw[n] - dw), 0.0))
  wire = np.asarray(problem.wire, np.float64)
  # The last bucket is ready exactly when the compute stream ends.
  if sparse[-1]:
    last = ag.alpha + ag.beta * wire[-1]
    if not sparse.all():
      last = min(last, ps.alpha + ps.beta * wire[~sparse].min())
  else:
    last = ps.alpha + ps.beta * wire[-1]
  # reach[k]: the final link time of any completion from position k is at
  # least compute + last, and at least P_k − SB_k + max_{q >= k} (SB_{q+1} +
  # rest[q]): a bucket holding a leaf at q or later is ready no earlier than
  # P_{q+1} >= P_k + SB(k..q), and every byte from q on goes after it.
  tail = np.maximum.accumulate((sb[1:] + rest[:n])[::-1])[::-1]
  reach = np.append(np.maximum(compute + last, pos[:n] - sb[:n] + tail),
                    compute + last)
  # run[k]: end of the run of sparse leaves starting at k (k-1 if k is dense).
  run = np.arange(n) - 1
  for k in range(n - 1, -1, -1):
    if sparse[k]:
      run[k] = run[k + 1] if k + 1 < n and sparse[k + 1] else k

  best_cuts, room = None, math.inf  # room: the best link-relative time
  for cuts in _heuristics(n):
    time = problem.time(cuts) - fwd
    if time < room:
      best_cuts, room = cuts, time

  # Partial groupings ("labels") are visited by the position k where their
  # next group starts, in increasing k: every label reaching k is known
  # before any is extended, so the dominated ones are dropped first (a
  # breadth-first form of Algorithm 1's recursion). At each position t the
  # group [K..t-1] of every live label is evaluated at once (numpy). A
  # label's shift is the per-bucket compute m·c its sparse buckets paid.
  parent, cut = [-1], [-1]                  # per label id: path back
  zero = np.zeros(1, np.int64)
  fixed = _Fixed(c, pos, run, prune_dominance)
  lo, jstar = _limits(zero, np.zeros(1), zero, np.zeros(1), fixed)
  live = dict(k=zero, link=np.zeros(1), comm=np.zeros(1), shift=np.zeros(1),
              lo=lo, jstar=jstar, id=zero)
  nodes = 1
  for tpos in range(1, n + 1):
    j = tpos - 1
    kk, link, comm, shift = live["k"], live["link"], live["comm"], \
        live["shift"]
    # the group's sparse bucket (P_K where it has no sparse leaf yet)
    ready = pos[np.maximum(after_sparse[tpos], kk)]
    if prune_bound:
      # Every group [K..j'], j' >= j, sends its first bucket no earlier than
      # max(link, ready + shift), and all bytes from K after it: dead for
      # good.
      alive = _objective(compute + shift,
                         np.maximum(link, ready + shift) + rest[kk],
                         comm + rest[kk], eta) < room
      if not alive.all():
        live = {key: v[alive] for key, v in live.items()}
        kk, link, comm, shift, ready = (kk[alive], link[alive], comm[alive],
                                        shift[alive], ready[alive])
    use = live["lo"] <= j
    child_min = np.zeros(len(kk), np.int64)
    if prune_dominance:
      jstar = live["jstar"]
      cross = j < jstar
      use &= ~(cross & (jstar == n - 1))
      child_min = np.where(cross, jstar + 1, 0)
    if not use.any():
      continue
    kk, link, comm, shift, ready, child_min, ids = (
        kk[use], link[use], comm[use], shift[use], ready[use],
        child_min[use], live["id"][use])
    nsp = ns[tpos] - ns[kk]
    shift2 = shift + np.where(nsp > 0, c, 0.0)
    g_s = np.where(nsp > 0, ag.alpha + ag.beta * (sw[tpos] - sw[kk]), 0.0)
    link2 = np.where(nsp > 0, np.maximum(ready + shift2, link) + g_s, link)
    nd = (tpos - kk) - nsp
    g_d = np.where(nd > 0, ps.alpha + ps.beta * (dw[tpos] - dw[kk]), 0.0)
    link2 = np.where(nd > 0, np.maximum(pos[tpos] + shift2, link2) + g_d,
                     link2)
    comm2 = comm + (g_s + g_d)
    if tpos == n:
      time = _objective(compute + shift2, link2, comm2, eta)
      i = int(np.argmin(time))
      if time[i] < room:
        room, best_cuts = float(time[i]), _path(parent, cut, ids[i], j)
      break
    if prune_bound:
      ok = _objective(compute + shift2,
                      np.maximum(link2 + rest[tpos], reach[tpos] + shift2),
                      comm2 + rest[tpos], eta) < room
      link2, comm2, shift2, child_min, ids = (
          link2[ok], comm2[ok], shift2[ok], child_min[ok], ids[ok])
    if not len(link2):
      continue
    if prune_states and len(link2) > 1:
      # The objective grows with the link time, the communication (at η = 1
      # the communication does not enter) and the shift.
      keep_ = _front(link2, comm2 if eta < 1 else np.zeros_like(comm2),
                     child_min, shift2)
      link2, comm2, shift2, child_min, ids = (
          link2[keep_], comm2[keep_], shift2[keep_], child_min[keep_],
          ids[keep_])
    # New labels start their next group at tpos.
    new_ids = np.arange(len(parent), len(parent) + len(ids))
    parent.extend(ids.tolist())
    cut.extend([j] * len(ids))
    nodes += len(ids)
    kk_new = np.full(len(ids), tpos, np.int64)
    lo, jstar = _limits(kk_new, link2, child_min, shift2, fixed)
    # Complete each at once with the rest as one group: an early incumbent.
    nsp = ns[n] - ns[tpos]
    e, shift3 = link2, shift2 + (c if nsp else 0.0)
    if nsp:
      e = np.maximum(pos[after_sparse[n]] + shift3, e) + (
          ag.alpha + ag.beta * (sw[n] - sw[tpos]))
    if n - tpos - nsp:
      e = np.maximum(compute + shift3, e) + (
          ps.alpha + ps.beta * (dw[n] - dw[tpos]))
    time = _objective(compute + shift3, e, comm2 + rest[tpos], eta)
    i = int(np.argmin(time))
    if time[i] < room:
      room, best_cuts = float(time[i]), _path(parent, cut, int(new_ids[i]),
                                              n - 1)
    live = {key: np.concatenate([live[key], v]) for key, v in
            dict(k=kk_new, link=link2, comm=comm2, shift=shift2, lo=lo,
                 jstar=jstar, id=new_ids).items()}

  return Grouping(problem.groups(best_cuts), best_cuts,
                  problem.time(best_cuts), nodes)


class _Fixed(NamedTuple):
  """What every label's ``_limits`` share in one search: the per-bucket
  compute c, the prefix sums P, the sparse runs (``search``'s ``run``) and
  whether pruning 2 is on."""
  bucket: float
  pos: np.ndarray
  run: np.ndarray
  prune_dominance: bool


def _limits(k, link, minend, shift, fixed: _Fixed):
  """Per label: the first allowed end of its next group, and j*.

  j* = the last j with P_{j+1} + shift + c <= link (one group [k..j],
  with its own per-bucket compute c, computed before the link frees; k-1 if
  none). Pruning 2 (module docstring): the next group ends at >= min(j*,
  run[k]) and, ending before j*, must be followed by a group ending after
  j*.
  """
  jstar = np.searchsorted(fixed.pos, link - (shift + fixed.bucket),
                          side="right") - 2
  lo = np.maximum(k, minend)
  if fixed.prune_dominance:
    lo = np.where(jstar >= k,
                  np.maximum(lo, np.minimum(jstar, fixed.run[k])), lo)
  return lo, jstar


def _front(link, comm, minend, shift):
  """Mask of the labels no other label dominates: A dominates B when
  link_A <= link_B, comm_A <= comm_B, minend_A <= minend_B and shift_A <=
  shift_B."""
  order = np.lexsort((shift, minend, comm, link))
  comm, minend, shift = comm[order], minend[order], shift[order]

  def undominated(comm, minend, shift, m, s):
    # Exclusive running minimum of comm over earlier labels with minend <= m
    # and shift <= s.
    c = np.where((minend <= m) & (shift <= s), comm, np.inf)
    before = np.minimum.accumulate(np.concatenate([[np.inf], c[:-1]]))
    return ~(before <= comm)

  # The least constrained labels (minend 0, the least shift) first: they
  # dominate most. What they dominate cannot dominate anything they do not
  # (transitivity).
  least = shift.min()
  kept = undominated(comm, minend, shift, 0, least)
  sub = np.flatnonzero(kept)
  if len(sub) > 1:
    c, e, h = comm[sub], minend[sub], shift[sub]
    ok = np.ones(len(sub), bool)
    for m, s in {(m, s) for m, s in zip(e.tolist(), h.tolist())
                 if m > 0 or s > least}:
      ok &= (e != m) | (h != s) | undominated(c, e, h, m, s)
    kept[sub] = ok
  out = np.zeros(len(order), bool)
  out[order[kept]] = True
  return out


def _path(parent, cut, label, last) -> tuple[int, ...]:
  cuts = [last]
  while label > 0:
    cuts.append(cut[label])
    label = parent[label]
  return tuple(reversed(cuts))


def brute_force_grouping(plan: plans.Plan, costs: Costs, *,
                         order: Sequence[int] | None = None,
                         exact: bool = False) -> Grouping:
  """Every one of the 2^(N-1) contiguous groupings; for tests (N <= ~16).

  Args:
    plan: the plan whose leaves are grouped.
    costs: ``Costs`` for ``plan``'s leaves.
    order: leaf ids in backward-ready order, as in
      ``GroupingProblem.from_plan``.
    exact: score each grouping with ``simulate`` on its plan (slow) instead
      of the fast objective.

  Returns:
    The best ``Grouping``; ``nodes`` counts the groupings scored.

  Raises:
    ValueError: for more than 22 leaves.
  """
  problem = GroupingProblem.from_plan(plan, costs, order)
  if not exact:
    return brute_force(problem)
  score = lambda cuts: simulate.simulate(
      plan_from_groups(plan, problem.groups(cuts)), costs,
      order=problem.order).iteration
  return brute_force(problem, score)


def brute_force(problem: GroupingProblem, score=None) -> Grouping:
  """The best of all 2^(N-1) groupings of ``problem``.

  Args:
    problem: the ``GroupingProblem``.
    score: ``score(cuts)`` -> seconds; default ``problem.time``.

  Returns:
    The best ``Grouping``; ``nodes`` counts the groupings scored.

  Raises:
    ValueError: for more than 22 leaves.
  """
  n = len(problem)
  if n > 22:
    raise ValueError(f"brute force over {n} leaves is 2^{n - 1} groupings; "
                     "use optimal_grouping.")
  score = score or problem.time
  best = (math.inf, None)
  count = 0
  for mask in range(2 ** (n - 1)):
    cuts = tuple(i for i in range(n - 1) if mask >> i & 1) + (n - 1,)
    time = score(cuts)
    count += 1
    if time < best[0]:
      best = (time, cuts)
  return Grouping(problem.groups(best[1]), best[1], best[0], count)
