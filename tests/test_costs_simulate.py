"""Cost model (JSON, fits) and the timeline simulator: hand-computed timelines
(ASC-WFBP Fig. 3, the η rule) and monotonicity properties."""

import dataclasses
import json

from hypothesis import assume
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
import pytest

from jaxfuse.planning import costs as costs_lib
from jaxfuse import plans as plan_lib
from jaxfuse.planning.costs import Costs
from jaxfuse.planning.costs import CostsError
from jaxfuse.planning.costs import LinearCost
from jaxfuse.planning.simulate import simulate
from jaxfuse.planning import simulate as sim

approx = lambda x: pytest.approx(x, rel=1e-9, abs=1e-12)


# --- helpers ------------------------------------------------------------------

def dense(i, n):
  """A float32 dense leaf of n elements: 4n bytes in a psum."""
  return plan_lib.LeafPlan(f"[{i}]", (n,), "float32", "dense", 1.0, n, None)


def sparse(i, n, cap):
  """A float32 sparse leaf sending cap (value, index) slots: 8·cap bytes."""
  return plan_lib.LeafPlan(f"[{i}]", (n,), "float32", "sparse", 0.01, cap,
                           "dgc")


def make_plan(leaves, buckets):
  """buckets: lists of leaf ids; the collective follows the leaves' mode."""
  return plan_lib.Plan(tuple(leaves), tuple(
      plan_lib.BucketPlan(tuple(b), "allgather" if leaves[b[0]].mode ==
                          "sparse" else "psum") for b in buckets))


def make_costs(backward, ag=(0.0, 0.0), ps=(0.0, 0.0), compress=(0.0, 0.0),
               overlap=1.0, forward=0.0, contention=1.0, bucket=0.0):
  return Costs({"allgather": LinearCost(*ag), "psum": LinearCost(*ps)},
               LinearCost(*compress), tuple(backward), contention=contention,
               overlap=overlap, forward=forward, bucket=bucket)


# --- hand-computed timelines --------------------------------------------------

def _fig3(backward_lm1):
  """ASC-WFBP Fig. 3: layers l+1, l, l-1 (ready in that order), dense.

  All-Reduce t(m) = a + b·m with a = 1, b = 0.01 per byte. Layer l+1: 400
  bytes (t = 5), computed in 1; layer l: 200 bytes (t = 3), computed in 1;
  layer l-1: 100 bytes (t = 2), computed in ``backward_lm1``. Forward 2, so
  backward starts at 2 and layer l+1's communication is on the link over
  [3, 8]: layer l, ready at 4, must wait: τ_c^(l) = 8.
  """
  leaves = [dense(0, 25), dense(1, 50), dense(2, 100)]  # pytree: l-1, l, l+1
  costs = make_costs([backward_lm1, 1.0, 1.0], ps=(1.0, 0.01), forward=2.0)
  wfbp = make_plan(leaves, [[2], [1], [0]])
  merged = make_plan(leaves, [[2], [1, 0]])
  return simulate(wfbp, costs), simulate(merged, costs)


def test_a_bucket_is_ready_when_its_last_leaf_is_in_the_backward_order():
  """Buckets do not reorder the model's backward. One sparse bucket {S1,
  S2} and one dense {D1, D2} (``single``), the backward making S2, D1, S1,
  D2: the sparse bucket is ready after three leaves, not after its own
  two (what the bucket order S1, S2, D1, D2 would say)."""
  s1, s2, d1, d2 = 0, 1, 2, 3
  leaves = [sparse(s1, 1000, 10), sparse(s2, 1000, 10), dense(d1, 10),
            dense(d2, 10)]
  plan = make_plan(leaves, [[s1, s2], [d1, d2]])
  backward = [1.0, 2.0, 4.0, 8.0]
  costs = make_costs(backward, ag=(1.0, 0.0), ps=(1.0, 0.0),
                     compress=(0.5, 0.0), forward=3.0)
  order = (s2, d1, s1, d2)
  t = simulate(plan, costs, order=order)
  ready_s = 3 + 2 + 4 + 1                  # forward, S2, D1, S1
  sparse_b, dense_b = t.buckets
  assert (sparse_b.ready, sparse_b.compress_end) == approx((ready_s,
                                                            ready_s + 1.0))
  assert t.leaves[d2] == approx((ready_s + 1.0, ready_s + 9.0))  # after it
  assert dense_b.ready == approx(ready_s + 9.0)
  assert t.iteration == approx(ready_s + 9.0 + 1.0)  # the psum, last
  # the order recorded in the provenance is the default; a bad one falls
  # back to the bucket order (S1, S2, then the dense leaves)
  recorded = plan_lib.Plan(plan.leaves, plan.buckets, plan.settings,
                           {"backward_order": list(order)})
  assert simulate(recorded, costs) == t
  stale = plan_lib.Plan(plan.leaves, plan.buckets, plan.settings,
                        {"backward_order": [0, 1, 2]})
  assert simulate(stale, costs).buckets[0].ready == approx(3 + 1 + 2)
  with pytest.raises(ValueError, match="each of the 4 leaf ids once"):
    simulate(plan, costs, order=(0, 1, 2, 2))


def test_fig3_merging_pays_when_q2_holds():
  # Layer l-1 computed over [4, 7]: τ_b^(l-1) + t_b^(l-1) = 7 < τ_c^(l) + a = 9
  # (Q2), and 7 < τ_c^(l) + t_c^(l) = 11 (Q1 false).
  wfbp, merged = _fig3(3.0)
  assert wfbp.leaves == ((4.0, 7.0), (3.0, 4.0), (2.0, 3.0))
  assert [(b.comm_start, b.comm_end) for b in wfbp.buckets] == [
      approx((3.0, 8.0)), approx((8.0, 11.0)), approx((11.0, 13.0))]
  # Eq. 15: π_WFBP = τ_c^(l) + 2a + b(m_l + m_{l-1}) = 8 + 2 + 3 = 13.
  assert wfbp.iteration == approx(8 + 2 * 1 + 0.01 * 300)
  # Eq. 16: π_MG = max{τ_c^(l), 7} + a + b(300) = 8 + 1 + 3 = 12.
  assert merged.buckets[1].comm_start == approx(8.0)
  assert merged.iteration == approx(max(8, 7) + 1 + 0.01 * 300)
  # Eq. 6: the gain is a − max{0, 7 − τ_c^(l)} = 1.
  assert wfbp.iteration - merged.iteration == approx(1 - max(0, 7 - 8))


def test_fig3_merging_loses_when_q2_fails():
  # Layer l-1 computed over [4, 10]: 10 >= τ_c^(l) + a = 9 (Q2 false), and
  # 10 < τ_c^(l) + t_c^(l) = 11 (Q1 false). WFBP: l over [8, 11], l-1 over
  # [11, 13]; MG: both over [10, 14].
  wfbp, merged = _fig3(6.0)
  assert wfbp.iteration == approx(13.0)
  assert merged.iteration == approx(10 + 1 + 3)
  assert wfbp.iteration - merged.iteration == approx(1 - max(0, 10 - 8))


def test_fig3_normal_layer_when_q1_holds():
  # Layer l-1 computed over [4, 14]: layer l's communication [8, 11] ends
  # before (Q1): WFBP sends l-1 at 14 → 16; merging waits for 14 → 18.
  wfbp, merged = _fig3(10.0)
  assert wfbp.iteration == approx(14 + 2)
  assert merged.iteration == approx(14 + 1 + 3)
  assert wfbp.overlap_ratio == approx((5 + 3) / (5 + 3 + 2))


def test_compression_runs_on_the_compute_stream():
  # Two sparse buckets; compression α_h = 0.5, β_h = 0.001/element, on the
  # compute stream right after each bucket's last leaf.
  leaves = [sparse(0, 1000, 10), sparse(1, 2000, 20), dense(2, 5)]
  costs = make_costs([1.0, 2.0, 0.25], ag=(0.5, 0.01), ps=(0.25, 0.05),
                     compress=(0.5, 0.001), forward=1.0)
  t = simulate(make_plan(leaves, [[1], [0], [2]]), costs)
  # leaf 1: [1, 3]; compress 0.5 + 2 = 2.5 → [3, 5.5]; its allgather of
  # 8·20 = 160 bytes takes 0.5 + 1.6 = 2.1 → [5.5, 7.6].
  # leaf 0: [5.5, 6.5]; compress 0.5 + 1 → [6.5, 8]; 80 bytes: 1.3 → [8, 9.3].
  # leaf 2 (dense): [8, 8.25]; psum of 20 bytes: 1.25 → [9.3, 10.55].
  assert [x for l in t.leaves for x in l] == approx([5.5, 6.5, 1, 3, 8, 8.25])
  got = [(b.ready, b.compress_start, b.compress_end, b.comm_start, b.comm_end)
         for b in t.buckets]
  assert got == [approx((3.0, 3.0, 5.5, 5.5, 7.6)),
                 approx((6.5, 6.5, 8.0, 8.0, 9.3)),
                 approx((8.25, 8.25, 8.25, 9.3, 10.55))]
  assert [b.wire_bytes for b in t.buckets] == [160, 80, 20]
  assert t.backward == approx(3.25) and t.compression == approx(4.0)
  assert t.compute_end == approx(8.25) and t.iteration == approx(10.55)
  assert t.communication == approx(2.1 + 1.3 + 1.25)
  assert t.non_overlapped == approx(10.55 - 1 - 3.25 - 4.0)
  assert t.hidden == approx(4.65 - 2.3)
  assert t.overlap_ratio == approx(2.35 / 4.65)
  json.dumps(t.to_dict())  # plain data


def test_each_sparse_bucket_pays_the_bucket_cost_on_the_compute_stream():
  # The plan above with 0.2 of compute per sparse bucket, after its
  # compression: leaf 1 ends at 3, its bucket compressed by 5.7 (was 5.5)
  # and sent [5.7, 7.8]; leaf 0 ends at 6.7, its bucket by 8.4, sent
  # [8.4, 9.7]; the dense leaf ends at 8.65 and its psum (no bucket cost)
  # follows the link: [9.7, 10.95].
  leaves = [sparse(0, 1000, 10), sparse(1, 2000, 20), dense(2, 5)]
  costs = make_costs([1.0, 2.0, 0.25], ag=(0.5, 0.01), ps=(0.25, 0.05),
                     compress=(0.5, 0.001), forward=1.0, bucket=0.2)
  t = simulate(make_plan(leaves, [[1], [0], [2]]), costs)
  assert [(b.compress_end, b.comm_start, b.comm_end) for b in t.buckets] == [
      approx((5.7, 5.7, 7.8)), approx((8.4, 8.4, 9.7)),
      approx((8.65, 9.7, 10.95))]
  assert t.compute_end == approx(8.65) and t.iteration == approx(10.95)
  assert t.compression == approx(2.7 + 1.7)
  assert t.communication == approx(2.1 + 1.3 + 1.25)   # the link's alone
  # One sparse bucket instead of two pays it once: compressed by
  # 4 + 2.5 + 1.5 + 0.2 = 8.2, sent for 0.5 + 2.4.
  one = simulate(make_plan(leaves, [[1, 0], [2]]), costs)
  assert one.compute_end == approx(8.45)
  assert (one.buckets[0].comm_start, one.buckets[0].comm_end) == approx(
      (8.2, 11.1))


def _four_layers(overlap):
  """Backward 4 × 19.25 ms = 77 ms, each layer's psum 27 ms (108 ms in all):
  the scale of the issue's 2×H200 measurement."""
  leaves = [dense(i, 27000) for i in range(4)]  # 108000 bytes each
  costs = make_costs([0.01925] * 4, ps=(0.0, 0.25e-6), overlap=overlap)
  return simulate(make_plan(leaves, [[3], [2], [1], [0]]), costs)


def test_overlap_one_is_ideal_wfbp():
  # Ready at 19.25, 38.5, 57.75, 77 ms; the link: [19.25, 46.25],
  # [46.25, 73.25], [73.25, 100.25], [100.25, 127.25].
  t = _four_layers(1.0)
  assert [b.comm_end for b in t.buckets] == approx(
      [0.04625, 0.07325, 0.10025, 0.12725])
  assert t.iteration == approx(0.12725) and t.pause is None
  assert t.hidden == approx(0.108 - 0.05025)


def test_overlap_zero_is_no_overlap():
  t = _four_layers(0.0)
  assert t.iteration == approx(0.077 + 0.108)  # forward + backward + all comm
  assert t.buckets[0].comm_start == approx(0.077)
  assert t.overlap_ratio == approx(0.0)


def test_overlap_budget_ends_between_buckets():
  # The ideal link is busy 27 + 27 + 3.75 = 57.75 ms before backward ends
  # (H). At η = 27/57.75 the budget η·H is 27 ms: bucket 1 uses it all
  # ([19.25, 46.25]), so the link pauses until 77 and the rest follows:
  # 77 + 3·27 = 158 = 77 + 108 − η·H.
  t = _four_layers(27 / 57.75)
  assert t.pause == approx((0.04625, 0.077))
  assert [(b.comm_start, b.comm_end) for b in t.buckets] == [
      approx((0.01925, 0.04625)), approx((0.077, 0.104)),
      approx((0.104, 0.131)), approx((0.131, 0.158))]
  assert t.iteration == approx(0.158)
  assert t.overlap_ratio == approx(27 / 108)


def test_overlap_budget_ends_inside_a_bucket():
  # η = 0.8: budget 0.8·57.75 = 46.2 ms; bucket 1 hides 27, bucket 2 starts
  # at 46.25 and runs 19.2 more until 65.45, pauses to 77, finishes its 7.8
  # at 84.8; iteration 77 + 108 − 46.2.
  t = _four_layers(0.8)
  assert t.pause == approx((0.06545, 0.077))
  assert (t.buckets[1].comm_start, t.buckets[1].comm_end) == approx(
      (0.04625, 0.0848))
  assert t.iteration == approx(0.077 + 0.108 - 0.0462)


def test_overlap_is_a_share_of_the_ideal_saving():
  # iteration = (1 − η)·(no overlap) + η·(ideal), at every η.
  none, ideal = 0.077 + 0.108, 0.12725
  for eta in (0.1, 0.25, 0.5, 0.9):
    assert _four_layers(eta).iteration == approx(
        (1 - eta) * none + eta * ideal)


def test_costs_must_match_the_plan():
  plan = make_plan([dense(0, 4), dense(1, 4)], [[0, 1]])
  with pytest.raises(CostsError, match="2 leaves"):
    simulate(plan, make_costs([1.0]))


# --- properties ---------------------------------------------------------------

@st.composite
def instances(draw, max_leaves=7):
  n = draw(st.integers(1, max_leaves))
  leaves = []
  for i in range(n):
    size = draw(st.integers(1, 5000))
    if draw(st.booleans()):
      leaves.append(sparse(i, size, draw(st.integers(1, size))))
    else:
      leaves.append(dense(i, size))
  order = draw(st.permutations(range(n)))
  cuts = sorted(draw(st.sets(st.integers(1, n - 1), max_size=n)) | {n}) if \
      n > 1 else [1]
  buckets, a = [], 0
  for c in cuts:  # each group: its sparse bucket, then its dense bucket
    group = order[a:c]
    a = c
    for mode in ("sparse", "dense"):
      ids = [i for i in group if leaves[i].mode == mode]
      if ids:
        buckets.append(ids)
  time = st.floats(0, 1e-2, allow_nan=False)
  line = st.tuples(time, st.one_of(st.just(0.0), st.floats(1e-12, 1e-6)))
  costs = make_costs([draw(time) for _ in range(n)], ag=draw(line),
                     ps=draw(line), compress=draw(line),
                     overlap=draw(st.floats(0, 1)), forward=draw(time),
                     bucket=draw(st.sampled_from([0.0, 1e-3])))
  return make_plan(leaves, buckets), costs


def _no_less(a, b):
  return a >= b - 1e-12 * max(1.0, abs(b))


@settings(max_examples=60, deadline=None)
@given(instances(), st.sampled_from(["allgather", "psum", "compress"]),
       st.sampled_from(["alpha", "beta"]), st.floats(1.0, 10.0),
       st.floats(0, 1e-3))
def test_costlier_lines_never_help(inst, which, field, factor, extra):
  plan, costs = inst
  before = simulate(plan, costs).iteration
  line = costs.compress if which == "compress" else costs.collectives[which]
  more = dataclasses.replace(line, **{field: getattr(line, field) * factor +
                                      extra})
  if which == "compress":
    costs2 = costs.replace(compress=more)
  else:
    costs2 = costs.replace(collectives=dict(costs.collectives, **{which: more}))
  assert _no_less(simulate(plan, costs2).iteration, before)


@settings(max_examples=40, deadline=None)
@given(instances(), st.floats(0, 1e-3))
def test_a_costlier_bucket_never_helps(inst, extra):
  plan, costs = inst
  before = simulate(plan, costs).iteration
  more = costs.replace(bucket=costs.bucket + extra)
  assert _no_less(simulate(plan, more).iteration, before)


@settings(max_examples=60, deadline=None)
@given(instances(), st.data())
def test_more_bytes_or_compute_never_helps(inst, data):
  plan, costs = inst
  before = simulate(plan, costs)
  i = data.draw(st.integers(0, len(plan.leaves) - 1))
  # More backward time for one leaf.
  backward = list(costs.backward)
  backward[i] += data.draw(st.floats(0, 1e-2))
  assert _no_less(simulate(plan, costs.replace(backward=backward)).iteration,
                  before.iteration)
  # More bytes: a larger leaf (dense), or more slots (sparse; larger unit).
  leaf = plan.leaves[i]
  if leaf.mode == "dense":
    bigger = dense(i, leaf.size + data.draw(st.integers(1, 1000)))
  else:
    bigger = sparse(i, leaf.size + 1000,
                    leaf.capacity + data.draw(st.integers(0, 1000)))
  leaves = list(plan.leaves)
  leaves[i] = bigger
  plan2 = dataclasses.replace(plan, leaves=tuple(leaves))
  assert sum(b.wire_bytes for b in simulate(plan2, costs).buckets) >= sum(
      b.wire_bytes for b in before.buckets)
  assert _no_less(simulate(plan2, costs).iteration, before.iteration)
  # More forward time adds exactly.
  d = data.draw(st.floats(0, 1e-2))
  assert simulate(plan, costs.replace(forward=costs.forward + d)).iteration \
      == approx(before.iteration + d)


@settings(max_examples=60, deadline=None)
@given(instances(), st.floats(0, 1), st.floats(0, 1))
def test_more_overlap_never_hurts(inst, eta1, eta2):
  plan, costs = inst
  lo, hi = sorted([eta1, eta2])
  t_lo = simulate(plan, costs.replace(overlap=lo))
  t_hi = simulate(plan, costs.replace(overlap=hi))
  assert _no_less(t_lo.iteration, t_hi.iteration)
  # Exact bounds: between the ideal schedule and no overlap at all.
  ideal = simulate(plan, costs.replace(overlap=1.0)).iteration
  none = simulate(plan, costs.replace(overlap=0.0))
  assert none.iteration == approx(none.compute_end + none.communication)
  for t in (t_lo, t_hi):
    assert _no_less(t.iteration, ideal) and _no_less(none.iteration,
                                                     t.iteration)
    assert 0 <= t.overlap_ratio <= 1
  # hidden = η·(ideal hidden)
  ideal_t = simulate(plan, costs.replace(overlap=1.0))
  assert t_lo.hidden == pytest.approx(lo * ideal_t.hidden, rel=1e-9,
                                      abs=1e-12)


@settings(max_examples=60, deadline=None)
@given(instances(max_leaves=6), st.data())
def test_merging_two_back_to_back_buckets_saves_one_alpha(inst, data):
  # With no compute, every bucket is ready at once and the link is the whole
  # story: merging two neighbouring buckets of one collective saves its α.
  plan, costs = inst
  costs = costs.replace(backward=[0.0] * len(plan.leaves),
                        compress=LinearCost(0.0, 0.0), bucket=0.0)
  pairs = [i for i in range(len(plan.buckets) - 1)
           if plan.buckets[i].collective == plan.buckets[i + 1].collective]
  assume(pairs)
  i = data.draw(st.sampled_from(pairs))
  b = plan.buckets
  merged = dataclasses.replace(plan, buckets=b[:i] + (dataclasses.replace(
      b[i], leaves=b[i].leaves + b[i + 1].leaves),) + b[i + 2:])
  saved = (simulate(plan, costs).iteration -
           simulate(merged, costs).iteration)
  assert saved == approx(costs.collectives[b[i].collective].alpha)


@settings(max_examples=60, deadline=None)
@given(instances(), st.floats(1e-6, 1e-2))
def test_the_bucket_cost_lengthens_the_compute_stream_once_per_sparse_bucket(
    inst, bucket):
  plan, costs = inst
  costs = costs.replace(compress=LinearCost(0.0, 0.0), bucket=bucket)
  t = simulate(plan, costs)
  sparse_buckets = sum(b.collective != "psum" for b in plan.buckets)
  assert t.compute_end == approx(costs.forward + sum(costs.backward) +
                                 sparse_buckets * bucket)
  assert t.compression == approx(sparse_buckets * bucket)
  # the link's time is its lines' alone
  assert t.communication == approx(
      simulate(plan, costs.replace(bucket=0.0)).communication)


@settings(max_examples=40, deadline=None)
@given(st.floats(0.1, 10), st.floats(0.1, 10), st.floats(0.1, 10),
       st.floats(0.1, 5), st.floats(0.01, 0.1))
def test_merge_gain_is_asc_wfbp_eq6(t_lp1, t_l, t_lm1, a, b):
  # Two dense layers behind a third whose communication delays layer l
  # (τ_c^(l) > its ready time); when layer l-1's communication would follow
  # layer l's at once (Q1 false), merging gains
  # a − max{0, ready_{l-1} − τ_c^(l)}.
  leaves = [dense(0, 25), dense(1, 50), dense(2, 100)]
  costs = make_costs([t_lm1, t_l, t_lp1], ps=(a, b))
  wfbp = simulate(make_plan(leaves, [[2], [1], [0]]), costs)
  merged = simulate(make_plan(leaves, [[2], [1, 0]]), costs)
  tau_c = wfbp.buckets[1].comm_start
  ready = wfbp.buckets[2].ready
  if ready > wfbp.buckets[1].comm_end:  # Q1: layer l-1 is a normal layer
    assert _no_less(merged.iteration, wfbp.iteration)
    return
  gain = wfbp.iteration - merged.iteration
  assert gain == pytest.approx(a - max(0.0, ready - tau_c), abs=1e-9)


# --- the cost model -----------------------------------------------------------

def _costs():
  return make_costs([1e-3, 2e-3, 0.5e-3], ag=(5e-5, 2e-9), ps=(3e-5, 1e-9),
                    compress=(4e-5, 1e-10), overlap=0.25, forward=0.01,
                    contention=1.4)


def test_costs_json_round_trip(tmp_path):
  costs = dataclasses.replace(_costs(), provenance={"devices": "2xH200"})
  assert Costs.from_json(costs.to_json()) == costs
  costs.save(tmp_path / "c.json")
  back = Costs.load(tmp_path / "c.json")
  assert back == costs and back.collectives["psum"] == LinearCost(3e-5, 1e-9)
  body = json.loads(costs.to_json())
  assert body["format"] == "jaxfuse.costs" and body["version"] == 2
  with_bucket = costs.replace(bucket=3e-4)
  assert Costs.from_json(with_bucket.to_json()).bucket == 3e-4


def test_a_version_1_costs_file_reads_with_no_bucket_cost():
  body = json.loads(_costs().replace(bucket=5e-4).to_json())
  del body["bucket"], body["schemes"]
  body["version"] = 1
  assert Costs.from_json(json.dumps(body)) == _costs()


def test_costs_are_immutable():
  costs = _costs()
  with pytest.raises(dataclasses.FrozenInstanceError):
    costs.overlap = 1.0
  with pytest.raises(TypeError):
    costs.collectives["psum"] = LinearCost(0, 0)
  assert isinstance(costs.backward, tuple)


def _edit(**changes):
  body = json.loads(_costs().to_json())
  for key, value in changes.items():
    if value is KeyError:
      del body[key]
    else:
      body[key] = value
  return json.dumps(body)


@pytest.mark.parametrize("text, field", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "'format'"),
    (_edit(format="jaxfuse.plan"), "'format'"),
    (_edit(version="1"), "'version'"),
    (_edit(version=0), "'version'"),
    (_edit(version=3), "newer"),
    (_edit(backward=KeyError), "'backward'"),
    (_edit(collectives=KeyError), "'collectives'"),
    (_edit(compress=KeyError), "'compress'"),
    (_edit(surprise=1), "surprise"),
    (_edit(collectives={"allgather": {"alpha": 0, "beta": 0}}), "collectives"),
    (_edit(collectives={"allgather": {"alpha": 0, "beta": 0},
                        "psum": {"alpha": -1, "beta": 0}}), "collectives.psum"),
    (_edit(collectives={"allgather": {"alpha": "0", "beta": 0},
                        "psum": {"alpha": 0, "beta": 0}}),
     "collectives.allgather"),
    (_edit(compress={"alpha": 0}), "compress"),
    (_edit(backward="fast"), "backward"),
    (_edit(backward=[1e-3, float("nan")]), r"backward\[1\]"),
    (_edit(backward=[1e-3, -1]), r"backward\[1\]"),
    (_edit(overlap=1.5), "overlap"),
    (_edit(contention=0.5), "contention"),
    (_edit(forward=None), "forward"),
    (_edit(bucket=-1e-3), "bucket"),
    (_edit(provenance=[1]), "provenance"),
])
def test_bad_costs_files_say_which_field(text, field):
  with pytest.raises(CostsError, match=field):
    Costs.from_json(text)
  assert issubclass(CostsError, ValueError)


def test_costs_constructor_checks():
  with pytest.raises(CostsError, match="psum"):
    Costs({"allgather": LinearCost(0, 0)}, LinearCost(0, 0), (1.0,))
  with pytest.raises(CostsError, match="alpha"):
    LinearCost(-1e-6, 0)
  with pytest.raises(CostsError, match="overlap"):
    make_costs([1.0], overlap=-0.1)


def test_fit_linear():
  x = [0, 1e3, 1e4, 1e5, 1e6]
  fit = costs_lib.fit_linear(x, [2e-5 + 3e-9 * s for s in x])
  assert fit.alpha == pytest.approx(2e-5) and fit.beta == pytest.approx(3e-9)
  # A negative intercept is clipped: the best line through the origin.
  fit = costs_lib.fit_linear([1, 2, 3], [0.5, 2.5, 4.5])
  assert fit.alpha == 0 and fit.beta == pytest.approx(
      (0.5 + 5 + 13.5) / (1 + 4 + 9))
  # A negative slope is clipped: the mean.
  fit = costs_lib.fit_linear([1, 2, 3], [3.0, 2.0, 1.0])
  assert fit.beta == 0 and fit.alpha == pytest.approx(2.0)
  with pytest.raises(CostsError, match="two distinct sizes"):
    costs_lib.fit_linear([5, 5], [1.0, 1.1])
  with pytest.raises(CostsError, match="2 sizes but 3 times"):
    costs_lib.fit_linear([1, 2], [1.0, 1.1, 1.2])


def test_contention_penalty_is_asc_wfbp_eq13():
  line = LinearCost(1.0, 0.01)  # t(400 bytes) = 5
  # Fully overlapped (Eq. 11): (γ − 1)·b·m.
  assert costs_lib.contention_penalty(line, 1.5, 400, 0.0) == approx(
      0.5 * 0.01 * 400)
  # Half of the message overlapped (Fig. 2(c)): half the penalty.
  assert costs_lib.contention_penalty(line, 1.5, 400, 2.5) == approx(
      0.5 * 0.01 * 400 / 2)
  with pytest.raises(CostsError, match="offset"):
    costs_lib.contention_penalty(line, 1.5, 400, 6.0)


def test_eta_from_a_measured_step_and_back():
  # _four_layers: compute 77 ms, G = 108 ms, the ideal schedule hides
  # H = 108 − 50.25 = 57.75 ms. A step of 150 ms against 77 ms alone hid
  # 77 + 108 − 150 = 35 ms: η = 35/57.75; the rule then gives the step back.
  ideal = _four_layers(1.0)
  eta = sim.eta_from_hidden(0.077 + 0.108 - 0.150, ideal)
  assert eta == approx(0.035 / 0.05775)
  assert sim.step_at(0.077, eta, ideal) == approx(0.150)
  assert _four_layers(eta).iteration == approx(0.150)
  # Unclamped: hiding more than the ideal schedule gives η > 1.
  assert sim.eta_from_hidden(0.06, ideal) == approx(0.06 / 0.05775)
  # A schedule that hides nothing has no η.
  assert sim.eta_from_hidden(0.01, _four_layers(0.0)) is None


def test_a_plan_from_another_plans_one_worker_step():
  # The bucket-cost example: two sparse buckets compute to 8.65, one to
  # 8.45 (one bucket cost fewer). Anchored on the two-bucket plan's
  # measured T₁ = 9.0 and η = 0.5, the one-bucket plan runs on
  # 9.0 − 0.2 = 8.8 of compute: 8.8 + G − 0.5·H of its own timeline.
  leaves = [sparse(0, 1000, 10), sparse(1, 2000, 20), dense(2, 5)]
  costs = make_costs([1.0, 2.0, 0.25], ag=(0.5, 0.01), ps=(0.25, 0.05),
                     compress=(0.5, 0.001), forward=1.0, bucket=0.2)
  two = simulate(make_plan(leaves, [[1], [0], [2]]), costs)
  one = simulate(make_plan(leaves, [[1, 0], [2]]), costs)
  assert sim.step_from_one_worker(9.0, 0.5, one, two) == approx(
      8.8 + one.communication - 0.5 * one.hidden)
  # The anchor itself: step_at with T₁ as its compute.
  assert sim.step_from_one_worker(9.0, 0.5, two, two) == approx(
      sim.step_at(9.0, 0.5, two))


@settings(max_examples=50, deadline=None)
@given(factor=st.floats(0.1, 10.0), nbytes=st.floats(0.0, 1e9))
def test_link_scaled_scales_every_collective_and_nothing_else(factor,
                                                               nbytes):
  costs = make_costs([1.0, 2.0], ag=(0.5, 0.01), ps=(0.25, 0.05),
                     compress=(0.5, 0.001), forward=1.0, bucket=0.2)
  slow = costs.link_scaled(factor)
  for name in ("allgather", "psum"):
    assert slow.comm_time(name, nbytes) == pytest.approx(
        factor * costs.comm_time(name, nbytes), rel=1e-12)
  assert (slow.compress, slow.backward, slow.forward, slow.bucket) == (
      costs.compress, costs.backward, costs.forward, costs.bucket)


def test_link_scaled_rejects_a_factor_that_is_not_positive():
  costs = make_costs([1.0])
  for bad in (0, -1.0, float("nan"), float("inf"), True, "2"):
    with pytest.raises(CostsError, match="factor=.* must be a finite number"):
      costs.link_scaled(bad)
