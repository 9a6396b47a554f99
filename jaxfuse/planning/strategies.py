"""Cost-model groupings: SAFusion §3.3, Cupcake Alg. 1, ASC-WFBP, MG-WFBP.

Pure functions over a ``GroupingProblem`` (``jaxfuse.planning.optimal``):
the leaves in backward-ready order, positions p = 0 … N-1, with backward
b_p, compression h_p (sparse leaves, one unit each), wire bytes w_p, the two
collective lines and η. Each returns groups of leaf ids in ready order;
``jaxfuse.plan`` turns a group into a sparse and a dense bucket. Times below
are those of the papers' ideal timeline (one link, wait-free backprop):

  ready_p   = forward + Σ_{q<=p} (b_q + h_q)     (the leaf is computed and
                                                  compressed)
  C(a..j)   = Σ over the collectives present in the group of α + β·Σ w
  saved(a..j, p) = the α's that joining p to group a..j saves (those of
                                                  the collectives they share)

``densify`` switches groups to dense where the simulator says sparse does not
pay. Which of all the plans wins is decided in ``jaxfuse.planning.planner`` by
``jaxfuse.planning.simulate``; docs/planner.md has the maths and the XLA
mapping.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Sequence

from jaxfuse.planning.costs import Costs
from jaxfuse.planning import optimal
from jaxfuse.planning import grouping
from jaxfuse import plans

Groups = tuple[tuple[int, ...], ...]
NORMAL, MERGED, SIMULTANEOUS = "normal", "merged", "simultaneous"


def problem(leaves: Sequence[plans.LeafPlan], order: Sequence[int],
            costs: Costs,
            settings: plans.Settings | None = None,
            collective="allgather") -> optimal.GroupingProblem:
  """The leaves (pytree order) in ready ``order``, with their costs; a
  sparse leaf's wire bytes as ``collective`` (a name or a configured
  scheme object) sends its slots under
  ``settings`` (default ``Settings()``)."""
  layerwise = grouping.buckets_from_groups(leaves, [[i] for i in order],
                                          behind=False, headroom=1.0,
                                          collective=collective)
  return optimal.GroupingProblem.from_plan(
      plans.Plan(tuple(leaves), layerwise,
                 settings or plans.Settings()), costs, order)


class _Line:
  """Prefix sums of a problem: ready times and group communication in O(1)."""

  def __init__(self, p: optimal.GroupingProblem):
    cum = lambda xs: list(itertools.accumulate(xs, initial=0.0))
    self.p, self.n = p, len(p)
    self.fuse = [b + h for b, h in zip(p.backward, p.compress)]
    self.ready = [p.forward + t for t in cum(self.fuse)[1:]]
    self.back = cum(p.backward)
    self.sw = cum(w if s else 0 for w, s in zip(p.wire, p.sparse))
    self.dw = cum(0 if s else w for w, s in zip(p.wire, p.sparse))
    self.ns = cum(1 if s else 0 for s in p.sparse)

  def _modes(self, a, j):
    ns = self.ns[j + 1] - self.ns[a]
    return ns > 0, ns < j + 1 - a

  def comm(self, a: int, j: int) -> float:
    """C(a..j): one collective per mode present."""
    s, d = self._modes(a, j)
    ag, ps = self.p.allgather, self.p.psum
    sw, dw = self.sw[j + 1] - self.sw[a], self.dw[j + 1] - self.dw[a]
    return ((ag.alpha + ag.beta * sw if s else 0.0) +
            (ps.alpha + ps.beta * dw if d else 0.0))

  def alphas(self, a: int, j: int) -> float:
    s, d = self._modes(a, j)
    return (self.p.allgather.alpha if s else 0.0) + (
        self.p.psum.alpha if d else 0.0)

  def saved(self, a: int, j: int, q: int) -> float:
    """The α saved by sending q with group a..j instead of on its own."""
    s, d = self._modes(a, j)
    if self.p.sparse[q]:
      return self.p.allgather.alpha if s else 0.0
    return self.p.psum.alpha if d else 0.0

  def fusion(self, a: int, j: int) -> float:
    """F(a..j) = Σ (b + h): SAFusion's sparse tensor fusion time."""
    return math.fsum(self.fuse[a:j + 1])


def cuts_of(p: optimal.GroupingProblem, groups: Sequence[Sequence[int]]
            ) -> tuple[int, ...]:
  """The last ready position of each group (contiguous in ready order)."""
  cuts, end = [], -1
  for g in groups:
    end += len(g)
    cuts.append(end)
  if [i for g in groups for i in g] != list(p.order):
    raise ValueError("groups must cut the ready order into contiguous runs.")
  return tuple(cuts)


# --- SAFusion §3.3 ------------------------------------------------------------

def safusion(p: optimal.GroupingProblem, num_buckets: int = 4) -> Groups:
  """SAFusion's adaptive buffer sizing on top of the aligned buckets.

  Buffer 1 (Eq. 2): starting from the aligned count ⌈L/M⌉ (§3.2, M =
  ``num_buckets``), the most leaves N_1 <= ⌈L/M⌉ with
  T_b^1 + T_cm^1 < Σ_{j in buffer 1} T_cm^j (backward of the buffer plus its
  one communication beats layer-wise communication); N_1 = 1 if none.
  Buffer i >= 2 (Eq. 1, Fig. 10): add leaves until its fusion time
  F_i = T_b^i + T_cp^i reaches C_{i-1} = T_cm^{i-1}, so buffer i is ready
  just as buffer i-1 leaves the link.
  Long tail (Eq. 3): with the M buffers so made, the first M' < M with
  Σ_{i<=M'} C_i > Σ_{j>=2} F_j: buffers M' … M become one.
  """
  line, n = _Line(p), len(p)
  first, alone = 1, 0.0
  for j in range(min(n, math.ceil(n / num_buckets))):
    alone += line.comm(j, j)
    if line.back[j + 1] + line.comm(0, j) < alone:
      first = j + 1
  cuts = [first - 1]
  while cuts[-1] < n - 1:
    a, prev = cuts[-1] + 1, line.comm(cuts[-2] + 1 if len(cuts) > 1 else 0,
                                      cuts[-1])
    j, fused = a, line.fuse[a]
    while fused < prev and j < n - 1:
      j += 1
      fused += line.fuse[j]
    cuts.append(j)
  starts = [0] + [c + 1 for c in cuts[:-1]]
  tail = math.fsum(line.fusion(a, j) for a, j in zip(starts[1:], cuts[1:]))
  sent = 0.0
  for m in range(len(cuts) - 1):
    sent += line.comm(starts[m], cuts[m])
    if sent > tail:
      cuts = cuts[:m] + [n - 1]
      break
  return p.groups(cuts)


# --- Cupcake Algorithm 1 -----------------------------------------------------

def cupcake(p: optimal.GroupingProblem) -> Groups:
  """The optimal contiguous grouping (``optimal.search``, both prunings)."""
  return optimal.search(p).groups


# --- ASC-WFBP and MG-WFBP -----------------------------------------------------

def asc_types(p: optimal.GroupingProblem, contention: float = 1.0
              ) -> tuple[str, ...]:
  """ASC-WFBP Theorem 1, decided leaf by leaf in ready order (Alg. 1).

  For the message holding leaf l (l and the merged leaves before it) and the
  next leaf l-1 (ready at r' = ready of the next position):
    τ_c  = max(ready_l, link free, start of the merged leaves)   (normal)
    t_c  = C(message)
    Q1: τ_c + t_c <= r'                          -> normal
    Q2: saved − max(0, r' − τ_c) > 0             (Eq. 6: merging gains)
    Q3: ready_l + t_c + penalty < r'             (SC hidden by compute, Eq. 17)
    ¬Q1 ∧ Q2 ∧ ¬Q3 -> merged, otherwise simultaneous (Definition 3: only
    while the link is still busy at ready_l; else it is a normal leaf).
  penalty = (γ − 1)·β·m of the message in flight still unsent when l
  starts (Eq. 13). An SC message starts at ready_l and ends t_c + penalty
  later; a normal one waits for the link (every message sent so far).
  """
  line, n = _Line(p), len(p)
  types, link, a, floor = [], p.forward, 0, -math.inf
  last = None  # the message sent last: (start, duration, its β·m part)
  for l in range(n):
    t_c = line.comm(a, l)
    tau = max(line.ready[l], link, floor)
    if l == n - 1:
      types.append(NORMAL if line.ready[l] >= link else SIMULTANEOUS)
      break
    nxt = line.ready[l + 1]
    q1 = tau + t_c <= nxt
    q2 = line.saved(a, l, l + 1) - max(0.0, nxt - tau) > 0
    penalty = 0.0
    if last is not None and last[1] > 0:
      offset = min(max(line.ready[l] - last[0], 0.0), last[1])
      penalty = (contention - 1) * last[2] * (1 - offset / last[1])
    q3 = line.ready[l] + t_c + penalty < nxt
    if not q1 and q2 and not q3:
      types.append(MERGED)
      floor = tau
      continue
    kind = NORMAL if q1 or line.ready[l] >= link else SIMULTANEOUS
    start = tau if kind == NORMAL else line.ready[l]
    end = start + t_c + (penalty if kind == SIMULTANEOUS else 0.0)
    types.append(kind)
    link, last = max(link, end), (start, end - start,
                                  t_c - line.alphas(a, l))
    a, floor = l + 1, -math.inf
  return tuple(types)


def asc(p: optimal.GroupingProblem, contention: float = 1.0) -> Groups:
  """ASC-WFBP on one link: a merged leaf joins the next leaf's group; normal
  and simultaneous leaves end their group. XLA issues a program's
  collectives one after another, so a simultaneous leaf's bucket queues
  behind the one in flight (what ``simulate`` models); γ enters only the
  decision between merging and not."""
  types = asc_types(p, contention)
  return p.groups([l for l, t in enumerate(types) if t != MERGED])


def mgwfbp(p: optimal.GroupingProblem) -> Groups:
  """MG-WFBP (ASC-WFBP Eq. 5-6): in ready order, merge leaf l-1 into the
  message of leaf l when t_gain = saved − max{0, ready_{l-1} − τ_c^(l)} > 0,
  i.e. τ_b^(l-1) + t_b^(l-1) < τ_c^(l) + a; else send the message when the
  link frees (τ_c = max(ready, link free)) and start a new one."""
  line, n = _Line(p), len(p)
  cuts, link, a, floor = [], p.forward, 0, -math.inf
  for l in range(n):
    tau = max(line.ready[l], link, floor)
    if l < n - 1 and line.saved(a, l, l + 1) > max(
        0.0, line.ready[l + 1] - tau):
      floor = tau
      continue
    cuts.append(l)
    link, a, floor = tau + line.comm(a, l), l + 1, -math.inf
  return p.groups(cuts)


# --- dense where sparse does not pay ------------------------------------------

def densify(p: optimal.GroupingProblem, groups: Sequence[Sequence[int]],
            dense_wire: Sequence[int]) -> tuple[int, ...]:
  """Leaf ids to switch to dense: group by group in ready order, make the
  group's sparse leaves dense (psum, w_p = ``dense_wire[p]``, no
  compression) when that lowers ``p.time``; repeat until nothing changes.
  ``dense_wire`` is per ready position."""
  cuts = cuts_of(p, groups)
  best, dense = p.time(cuts), set()
  starts = [0] + [c + 1 for c in cuts[:-1]]
  changed = True
  while changed:
    changed = False
    for a, j in zip(starts, cuts):
      span = [q for q in range(a, j + 1) if p.sparse[q]]
      if not span:
        continue
      sparse, compress, wire = (list(p.sparse), list(p.compress),
                                list(p.wire))
      for q in span:
        sparse[q], compress[q], wire[q] = False, 0.0, dense_wire[q]
      trial = dataclasses.replace(p, sparse=tuple(sparse),
                                  compress=tuple(compress), wire=tuple(wire))
      time = trial.time(cuts)
      if time < best:
        p, best, changed = trial, time, True
        dense.update(p.order[q] for q in span)
  return tuple(sorted(dense))
