"""Cost-model strategies: valid plans, "auto" never worse, hand-computed
SAFusion / MG-WFBP / ASC-WFBP cases, Cupcake's optimum, and bad costs."""

import math

from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
import jax
import pytest

import jaxfuse
from jaxfuse.planning import optimal
from jaxfuse.planning import strategies
from jaxfuse.planning.costs import Costs
from jaxfuse.planning.costs import LinearCost
from jaxfuse.planning.simulate import simulate

ALL = jaxfuse.STRATEGIES + jaxfuse.COST_STRATEGIES
OTHERS = [s for s in ALL if s not in ("auto", "behind")]  # behind may starve


def params_of(sizes):
  return [jax.ShapeDtypeStruct((s,), "float32") for s in sizes]


def make_costs(backward, ag=(0.0, 0.0), ps=(0.0, 0.0), compress=(0.0, 0.0),
               overlap=1.0, forward=0.0, contention=1.0, provenance=None):
  return Costs({"allgather": LinearCost(*ag), "psum": LinearCost(*ps)},
               LinearCost(*compress), tuple(backward), contention=contention,
               overlap=overlap, forward=forward, provenance=provenance or {})


@st.composite
def models(draw, max_leaves=16):
  """(sizes, ready order, costs, density) over compute-, compression- and
  communication-bound scales, slow links and NVLink-like ones."""
  n = draw(st.integers(1, max_leaves))
  sizes = [draw(st.one_of(st.integers(1, 900), st.integers(1000, 400_000)))
           for _ in range(n)]
  order = draw(st.permutations(range(n)))
  u = st.floats(0, 1)
  compute = draw(st.sampled_from([1e-6, 1e-5, 1e-4, 1e-3]))
  beta = draw(st.sampled_from([5e-12, 1e-10, 1e-9, 1e-8]))
  costs = make_costs(
      [draw(u) * compute for _ in range(n)],
      ag=(draw(u) * 1e-3, draw(u) * beta), ps=(draw(u) * 1e-3, draw(u) * beta),
      compress=(draw(u) * 2e-4, draw(u) * 1e-9),
      overlap=draw(st.sampled_from([0.0, 0.25, 0.6, 1.0])),
      forward=draw(u) * 1e-2, contention=draw(st.sampled_from([1.0, 1.3, 2.0])))
  density = draw(st.sampled_from([0.001, 0.01, 0.2, 1.0]))
  return sizes, list(order), costs, density


def make(sizes, order, costs, strategy, density=0.01, **kw):
  return jaxfuse.plan(params_of(sizes), strategy=strategy, density=density, costs=costs,
                      **kw,
                      settings=jaxfuse.Settings(min_sparse_size=1000),
                      order=order)


def predicted(plan, costs):
  return simulate(plan, costs).iteration


def groups_in_positions(plan, order):
  """The plan's groups as lists of ready positions (a group is one sparse
  bucket and/or the dense bucket after it, covering a contiguous run)."""
  pos = {leaf: p for p, leaf in enumerate(order)}
  groups, current, kinds, done = [], [], [], 0
  for b in plan.buckets:
    current += [pos[j] for j in b.leaves]
    kinds.append(b.collective)
    if sorted(current) == list(range(done, done + len(current))):
      assert kinds in (["allgather"], ["psum"], ["allgather", "psum"]), kinds
      groups.append(sorted(current))
      done += len(current)
      current, kinds = [], []
  assert not current, "a bucket pair is not a contiguous run of ready order"
  return groups


# --- every strategy: a valid plan ---------------------------------------------

@settings(max_examples=100, deadline=None)
@given(models(), st.integers(1, 6), st.sampled_from([2**10, 2**16, 2**22]))
def test_every_strategy_gives_a_valid_plan(model, num_buckets, bucket_bytes):
  sizes, order, costs, density = model
  for strategy in ALL:
    plan = make(sizes, order, costs, strategy, density,
                num_buckets=num_buckets, bucket_bytes=bucket_bytes)
    assert sorted(plan.ready_order) == list(range(len(sizes)))
    pos = {leaf: p for p, leaf in enumerate(order)}
    for b in plan.buckets:  # ready order kept inside each bucket
      assert [pos[j] for j in b.leaves] == sorted(pos[j] for j in b.leaves)
    groups = groups_in_positions(plan, order)
    assert [p for g in groups for p in g] == list(range(len(sizes)))
    for leaf, size in zip(plan.leaves, sizes):
      want = "sparse" if density < 1 and size >= 1000 else "dense"
      # Only "auto" may make a leaf dense that could be sparse, never back.
      assert leaf.mode == want or (strategy == "auto" and leaf.mode == "dense")
    assert plan.provenance["strategy"] == strategy
    assert plan.provenance["predicted_iteration"] == predicted(plan, costs)
    plan.validate(params_of(sizes))


# --- auto ---------------------------------------------------------------------

@settings(max_examples=100, deadline=None)
@given(models(), st.integers(1, 6), st.sampled_from([2**10, 2**16, 2**22]))
def test_auto_is_never_worse_than_any_strategy_or_all_dense(
    model, num_buckets, bucket_bytes):
  sizes, order, costs, density = model
  kw = dict(num_buckets=num_buckets, bucket_bytes=bucket_bytes)
  auto = make(sizes, order, costs, "auto", density, **kw)
  best = predicted(auto, costs)
  assert best == auto.provenance["predicted_iteration"]
  report = auto.provenance["auto"]
  assert report["candidates"][report["winner"]] == best
  assert best == min(report["candidates"].values())
  for strategy in OTHERS:
    assert best <= predicted(make(sizes, order, costs, strategy, density,
                                  **kw), costs), strategy
  for strategy in ALL:  # all dense, however grouped
    assert best <= predicted(make(sizes, order, costs, strategy, 1.0, **kw),
                             costs), strategy


def nvlink(n):
  """NVLink-like: ~10 µs latency, 150 GB/s; sparsifying costs 40 µs + 0.1
  ns per element, more than sending the dense bytes."""
  return make_costs([2e-4] * n, ag=(1e-5, 1 / 150e9), ps=(1e-5, 1 / 150e9),
                    compress=(4e-5, 1e-10), overlap=0.25, forward=1e-3)


def test_auto_on_nvlink_is_all_dense():
  sizes = [4096, 300, 250_000, 1_000_000, 512, 65_536]
  order = list(range(6))[::-1]
  costs = nvlink(6)
  auto = make(sizes, order, costs, "auto")
  assert all(l.mode == "dense" for l in auto.leaves)
  dense = min(predicted(make(sizes, order, costs, s, 1.0), costs)
              for s in ALL)
  sparse = min(predicted(make(sizes, order, costs, s), costs) for s in OTHERS)
  assert predicted(auto, costs) <= dense < sparse


def test_auto_makes_dense_only_the_group_where_sparse_does_not_pay():
  # Leaf 0: 10M elements, leaf 1: 2000, both sparse at ρ = 1%; ready order
  # [0, 1]; backward 1 ms each; both links 1 GB/s with 0.1 ms latency;
  # compression 1 ms + 0.1 ns/element. Sparse, leaf 0 sends 150000 slots
  # (1.2 MB, 1.3 ms) instead of 40 MB (40 ms) and pays 2 ms compression:
  # that pays. Leaf 1 pays 1 ms compression to save < 8 µs: it does not.
  # All sparse: compute 1 + 2 + 1 + 1 = 5 ms then ≥ 0.1 ms of sending; with
  # leaf 1 dense compute ends at 4 ms and leaf 0 (1.3 ms from 3 ms) is done
  # by 4.3 ms, leaf 1's psum (8 KB) by 4.41 ms.
  sizes, order = [10_000_000, 2000], [0, 1]
  costs = make_costs([1e-3, 1e-3], ag=(1e-4, 1e-9), ps=(1e-4, 1e-9),
                     compress=(1e-3, 1e-10))
  auto = make(sizes, order, costs, "auto")
  assert [l.mode for l in auto.leaves] == ["sparse", "dense"]
  assert "+dense(1 leaves)" in auto.provenance["auto"]["winner"]
  assert predicted(auto, costs) == pytest.approx(4.3e-3 + 1e-4 + 8e-6)
  others = [predicted(make(sizes, order, costs, s, d), costs)
            for s in OTHERS for d in (0.01, 1.0)]
  assert predicted(auto, costs) < min(others)


# --- cupcake ------------------------------------------------------------------

@settings(max_examples=60, deadline=None)
@given(models())
def test_cupcake_is_optimal_grouping(model):
  sizes, order, costs, density = model
  plan = make(sizes, order, costs, "cupcake", density)
  base = make(sizes, order, costs, "layerwise", density)
  best = optimal.optimal_grouping(base, costs, order=order)
  assert plan.provenance["predicted_iteration"] == pytest.approx(best.time,
                                                                  rel=1e-9)
  if len(sizes) <= 8:
    assert best.time == pytest.approx(
        optimal.brute_force_grouping(base, costs, order=order).time, rel=1e-9)


# --- MG-WFBP and ASC-WFBP on ASC-WFBP Fig. 3 ----------------------------------

def fig3(backward_lm1, contention=1.0):
  """Layers l+1, l, l-1 ready in that order (pytree ids 2, 1, 0), dense:
  400, 200, 100 bytes; All-Reduce a = 1, b = 0.01/byte (t = 5, 3, 2);
  backward 1, 1 and ``backward_lm1``; forward 2. So l+1 is ready at 3 and on
  the link over [3, 8]; l is ready at 4; l-1 at 4 + backward_lm1."""
  sizes, order = [25, 50, 100], [2, 1, 0]
  costs = make_costs([backward_lm1, 1.0, 1.0], ps=(1.0, 0.01), forward=2.0,
                     contention=contention)
  return sizes, order, costs


def bucket_leaves(plan):
  return [list(b.leaves) for b in plan.buckets]


@pytest.mark.parametrize("backward_lm1, want", [
    # l+1 then l: l ready at 4, not before τ_c^(l+1) + a = 3 + 1: no merge.
    # l-1 ready at 7 < τ_c^(l) + a = 8 + 1 (Eq. 5): merge l and l-1.
    (3.0, [[2], [1, 0]]),
    # l-1 ready at 10 >= 9: gain a − (10 − 8) < 0, no merge.
    (6.0, [[2], [1], [0]]),
])
def test_mgwfbp_fig3(backward_lm1, want):
  sizes, order, costs = fig3(backward_lm1)
  assert bucket_leaves(make(sizes, order, costs, "mgwfbp", 1.0)) == want


def test_mgwfbp_merges_a_leaf_ready_within_a_of_the_start():
  # Backward 1, 0.5, 10: ready at 3, 3.5, 13.5. l+1 would start at 3; l is
  # ready at 3.5 < 3 + a: gain 1 − 0.5 > 0, merge; the message starts at 3.5
  # and takes 1 + 6 = 7. l-1 is ready at 13.5: gain 1 − 10 < 0.
  sizes, order = [25, 50, 100], [2, 1, 0]
  costs = make_costs([10.0, 0.5, 1.0], ps=(1.0, 0.01), forward=2.0)
  assert bucket_leaves(make(sizes, order, costs, "mgwfbp", 1.0)) == [[2, 1],
                                                                      [0]]


N, M, S = strategies.NORMAL, strategies.MERGED, strategies.SIMULTANEOUS


@pytest.mark.parametrize("backward_lm1, contention, types, want", [
    # l-1 ready at 12: Q1 τ_c^(l) + t_c^(l) = 8 + 3 = 11 <= 12: l normal.
    (8.0, 1.0, (N, N, N), [[2], [1], [0]]),
    # Ready at 7: ¬Q1 (11 > 7), Q2 (7 < 8 + 1), ¬Q3 (SC of l from 4 would end
    # at 4 + 3 = 7, not before 7): l merged. l-1 is then ready at 7 while
    # the link is busy to 8: a simultaneous leaf.
    (3.0, 1.0, (N, M, S), [[2], [1, 0]]),
    # Ready at 10: ¬Q1 (11 > 10), ¬Q2 (10 >= 9): l simultaneous (the link is
    # busy at 4), sent alone; l-1 ready at 10 after the link is free at 8.
    (6.0, 1.0, (N, S, N), [[2], [1], [0]]),
    # Ready at 8.5: ¬Q1, Q2 (8.5 < 9). Q3: SC from 4 with penalty (γ − 1)·
    # b·400·(1 − (4 − 3)/5) = 3.2(γ − 1): 4 + 3 + 0.64 < 8.5 at γ = 1.2,
    # simultaneous; 4 + 3 + 1.6 >= 8.5 at γ = 1.5, merged (and l-1, ready
    # at 8.5 after the link frees at 8, normal).
    (4.5, 1.2, (N, S, N), [[2], [1], [0]]),
    (4.5, 1.5, (N, M, N), [[2], [1, 0]]),
])
def test_asc_fig3(backward_lm1, contention, types, want):
  sizes, order, costs = fig3(backward_lm1, contention)
  plan = make(sizes, order, costs, "asc", 1.0)
  assert bucket_leaves(plan) == want
  p = strategies.problem(plan.leaves, order, costs)
  assert strategies.asc_types(p, contention) == types


# --- SAFusion §3.3 ------------------------------------------------------------

@pytest.mark.parametrize("num_buckets, want", [
    # ⌈8/2⌉ = 4. Eq. 2 (Σb < (N − 1)·a here, the bytes cancel): N = 2: 0.4 <
    # 1, N = 3: 0.6 < 2, N = 4: 3.6 >= 3: buffer 1 = [0, 1, 2], C_1 = 1 + 3.
    # Eq. 1: F grows 3, 3.5, 4.5 >= 4: [3, 4, 5], C_2 = 4; then 5 >= 4: [6],
    # C_3 = 2; [7]. Eq. 3: Σ_{j>=2} F_j = 4.5 + 5 + 0.1 = 9.6; C sums 4, 8,
    # 10 > 9.6 at M' = 3: buffers 3 and 4 merge.
    (2, [[0, 1, 2], [3, 4, 5], [6, 7]]),
    # ⌈8/4⌉ = 2: N_1 = 2 (0.4 < 1), C_1 = 3. F: 0.2, 3.2 >= 3: [2, 3], C_2 =
    # 3; 0.5, 1.5, 6.5 >= 3: [4, 5, 6], C_3 = 4; [7]. Σ_{j>=2} F_j = 3.2 +
    # 6.5 + 0.1 = 9.8; C sums 3, 6, 10 > 9.8 at M' = 3: [4 … 7].
    (4, [[0, 1], [2, 3], [4, 5, 6, 7]]),
])
def test_safusion_eq_1_to_3(num_buckets, want):
  backward = (0.2, 0.2, 0.2, 3.0, 0.5, 1.0, 5.0, 0.1)
  p = optimal.GroupingProblem(
      order=tuple(range(8)), sparse=(False,) * 8, backward=backward,
      compress=(0.0,) * 8, wire=(100,) * 8, allgather=LinearCost(1, 0.01),
      psum=LinearCost(1, 0.01), forward=0.0, overlap=1.0)
  assert [list(g) for g in strategies.safusion(p, num_buckets)] == want


def test_safusion_fusion_time_counts_compression():
  # Two sparse leaves then a third: all-gather a = 1, 0 per byte. Eq. 2 with
  # M = 3: N_1 = 1. C_1 = 1. Leaf 1: backward 0.5 + compression 0.25 = 0.75
  # < 1, so leaf 2 joins buffer 2 (F = 1.5 >= 1). Without the compression
  # (0.5 < 1) it would too; with compression 0.5 (F = 1.0 >= 1) it stops.
  def groups(h):
    p = optimal.GroupingProblem(
        order=(0, 1, 2), sparse=(True,) * 3, backward=(0.5, 0.5, 0.5),
        compress=(h,) * 3, wire=(8,) * 3, allgather=LinearCost(1, 0),
        psum=LinearCost(1, 0), forward=0.0, overlap=1.0)
    return [list(g) for g in strategies.safusion(p, 3)]
  assert groups(0.25) == [[0], [1, 2]]
  assert groups(0.5) == [[0], [1], [2]]


# --- provenance, costs path, old strategies unchanged -------------------------

def test_provenance_and_costs_from_a_path(tmp_path):
  sizes, order = [5000, 10, 3000, 2000, 7, 9000], [5, 4, 3, 2, 1, 0]
  costs = make_costs([1e-4] * 6, ag=(1e-4, 1e-9), ps=(5e-5, 1e-9),
                     compress=(2e-5, 1e-10), overlap=0.25,
                     provenance={"devices": "2xH200"})
  path = tmp_path / "costs.json"
  costs.save(path)
  for strategy in jaxfuse.COST_STRATEGIES:
    plan = make(sizes, order, costs, strategy)
    assert make(sizes, order, str(path), strategy) == plan
    assert make(sizes, order, path, strategy) == plan
    assert plan.provenance["costs"] == {"devices": "2xH200"}
    assert jaxfuse.Plan.from_json(plan.to_json()) == plan
  auto = make(sizes, order, costs, "auto")
  assert auto.provenance["auto"]["winner"] in auto.provenance["auto"][
      "candidates"]


@pytest.mark.parametrize("strategy", jaxfuse.STRATEGIES)
def test_rule_strategies_keep_their_buckets_with_costs(strategy):
  sizes, order = [5000, 10, 3000, 2000, 7, 9000], [0, 2, 1, 3, 5, 4]
  costs = make_costs([1e-4] * 6, ag=(1e-4, 1e-9), ps=(5e-5, 1e-9))
  without = make(sizes, order, None, strategy, num_buckets=3,
                 bucket_bytes=20000)
  with_costs = make(sizes, order, costs, strategy, num_buckets=3,
                    bucket_bytes=20000)
  assert with_costs.buckets == without.buckets
  assert "predicted_iteration" not in without.provenance
  assert with_costs.provenance["predicted_iteration"] == predicted(
      without, costs)


# --- errors -------------------------------------------------------------------

@pytest.mark.parametrize("strategy", jaxfuse.COST_STRATEGIES)
def test_cost_strategy_without_costs(strategy):
  with pytest.raises(jaxfuse.PlanError,
                     match=f"strategy='{strategy}' needs costs=.*jaxfuse "
                     r"profile.*Costs\.load"):
    make([5000, 10], [1, 0], None, strategy)


def test_bad_costs():
  sizes, order = [5000, 10, 3000], [2, 1, 0]
  with pytest.raises(jaxfuse.PlanError,
                     match=r"costs.backward has 2 times but params has 3 "
                     "leaves.*jaxfuse profile --model MODULE:FUNCTION"):
    make(sizes, order, make_costs([1.0, 1.0]), "cupcake")
  with pytest.raises(jaxfuse.PlanError, match="costs.backward has 4"):
    make(sizes, order, make_costs([1.0] * 4), "layerwise")
  with pytest.raises(jaxfuse.PlanError, match="costs must be a jaxfuse"):
    make(sizes, order, {"backward": [1, 1, 1]}, "cupcake")


def test_bad_costs_path(tmp_path):
  missing = tmp_path / "nope.json"
  with pytest.raises(jaxfuse.PlanError, match="nope.json.*cannot be read"):
    make([5000, 10], [1, 0], missing, "auto")
  corrupt = tmp_path / "bad.json"
  corrupt.write_text(make_costs([1.0, 1.0]).to_json()[:-10])
  with pytest.raises(jaxfuse.PlanError, match="bad.json.*cannot be read"):
    make([5000, 10], [1, 0], str(corrupt), "asc")
  other = tmp_path / "plan.json"
  make([5000, 10], [1, 0], None, "single").save(other)
  with pytest.raises(jaxfuse.PlanError, match="plan.json.*cannot be read"):
    make([5000, 10], [1, 0], other, "mgwfbp")


def test_unknown_strategy_lists_all():
  with pytest.raises(jaxfuse.PlanError, match="'greedy'.*safusion.*auto"):
    make([5000], [0], None, "greedy")


def test_auto_on_314_leaves_is_fast():
  import random, time  # pylint: disable=g-import-not-at-top,multiple-imports
  rng = random.Random(0)
  sizes = [rng.choice([64, 256, 2048]) if i % 3 else
           rng.choice([4096, 65536, 589824]) for i in range(314)]
  costs = make_costs([rng.uniform(2e-5, 5e-4) for _ in sizes],
                     ag=(1e-4, 5e-9), ps=(5e-5, 1.6e-9),
                     compress=(5e-5, 1e-10), overlap=0.25, forward=0.05)
  start = time.perf_counter()
  auto = make(sizes, list(range(314))[::-1], costs, "auto")
  assert time.perf_counter() - start < 5.0
  assert math.isfinite(auto.provenance["predicted_iteration"])


def test_default_strategy_is_aligned_and_single_on_one_worker():
  """Nothing to overlap on one worker: the default there is one sparse
  bucket; a strategy asked for is kept."""
  params = [jax.ShapeDtypeStruct((4096,), "float32") for _ in range(8)]
  def sparse_buckets(p):
    return [b for b in p.buckets if b.collective != "psum"]
  default = jaxfuse.plan(params, density=0.05)
  assert default.provenance["strategy"] == "aligned"
  assert len(sparse_buckets(default)) == 4          # num_buckets' default
  for k in (2, 8):
    assert jaxfuse.plan(params, density=0.05, num_workers=k).provenance[
        "strategy"] == "aligned"
  one = jaxfuse.plan(params, density=0.05, num_workers=1)
  assert one.provenance["strategy"] == "single"
  assert [len(b.leaves) for b in sparse_buckets(one)] == [8]
  asked = jaxfuse.plan(params, density=0.05, num_workers=1,
                       strategy="aligned")
  assert len(sparse_buckets(asked)) == 4
