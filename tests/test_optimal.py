"""The optimal grouping (Cupcake Algorithm 1): its fast objective against the
simulator, exactness against brute force, pruning, speed, and the plans."""

import math
import random
import time

from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
import jax
import pytest

import jaxfuse
from jaxfuse.planning import optimal
from jaxfuse import collectives
from jaxfuse import plans as plan_lib
from jaxfuse.planning import planner
from jaxfuse.planning.costs import Costs
from jaxfuse.planning.costs import LinearCost
from jaxfuse.planning.simulate import simulate

FLAGS = [dict(prune_bound=b, prune_dominance=d, prune_states=s)
         for b in (True, False) for d in (True, False) for s in (True, False)]


def leaf(i, size, is_sparse):
  if is_sparse:
    return plan_lib.LeafPlan(f"[{i}]", (size,), "float32", "sparse", 0.01,
                             plan_lib.capacity_for(0.01, size, 1.5), "dgc")
  return plan_lib.LeafPlan(f"[{i}]", (size,), "float32", "dense", 1.0, size,
                           None)


def layerwise(leaves, order, plan_settings=plan_lib.Settings(),
              packed=False):
  """One bucket per leaf in ``order``: ready_order is the true order (the
  sparse ones all-gathered, their indices ``packed``)."""
  gather = collectives.AllGather(packed_indices=packed)
  return plan_lib.Plan(tuple(leaves), tuple(
      plan_lib.BucketPlan((i,), "allgather", scheme=gather)
      if leaves[i].mode == "sparse" else plan_lib.BucketPlan((i,), "psum")
      for i in order), plan_settings)


@st.composite
def instances(draw, max_leaves=14):
  n = draw(st.integers(1, max_leaves))
  leaves = [leaf(i, draw(st.integers(1024, 300_000)), True)
            if draw(st.booleans()) else leaf(i, draw(st.integers(1, 3000)),
                                             False) for i in range(n)]
  order = draw(st.permutations(range(n)))
  # Scales where compute, compression or communication dominates.
  compute = draw(st.sampled_from([1e-6, 1e-5, 1e-4, 1e-3]))
  comm = draw(st.sampled_from([1e-10, 1e-9, 1e-8]))
  u = st.floats(0, 1)
  costs = Costs(
      {"allgather": LinearCost(draw(u) * 1e-3, draw(u) * comm),
       "psum": LinearCost(draw(u) * 1e-3, draw(u) * comm)},
      LinearCost(draw(u) * 2e-4, draw(u) * 1e-9),
      tuple(draw(u) * compute for _ in range(n)),
      overlap=draw(st.sampled_from([0.0, 0.25, 0.6, 1.0])),
      forward=draw(u) * 1e-2,
      bucket=draw(st.sampled_from([0.0, 1e-4, 1e-3])))
  wire = draw(st.sampled_from(plan_lib.SPARSE_WIRES))  # values of 4 or 2 B
  packed = draw(st.booleans())                 # indices of 32 or ~17 bits
  return layerwise(leaves, order, plan_lib.Settings(sparse_wire=wire),
                   packed), costs


def random_cuts(rng, n):
  return tuple(sorted({rng.randrange(n - 1) for _ in range(rng.randrange(n))}
                      )) + (n - 1,) if n > 1 else (0,)


# --- the fast objective is the simulator --------------------------------------

@settings(max_examples=40, deadline=None)
@given(instances(max_leaves=10), st.integers(0, 2**31))
def test_fast_objective_equals_simulate(inst, seed):
  plan, costs = inst
  problem = optimal.GroupingProblem.from_plan(plan, costs)
  rng = random.Random(seed)
  for _ in range(3):
    cuts = random_cuts(rng, len(plan.leaves))
    groups = problem.groups(cuts)
    assert [i for g in groups for i in g] == list(plan.ready_order)
    made = optimal.plan_from_groups(plan, groups)
    assert problem.time(cuts) == pytest.approx(
        simulate(made, costs).iteration, rel=1e-9, abs=1e-15)


@settings(max_examples=8, deadline=None)
@given(instances(max_leaves=6))
def test_brute_force_by_simulate_agrees(inst):
  plan, costs = inst
  fast = optimal.brute_force_grouping(plan, costs)
  exact = optimal.brute_force_grouping(plan, costs, exact=True)
  assert fast.time == pytest.approx(exact.time, rel=1e-9)


# --- exact, with and without pruning ------------------------------------------

@settings(max_examples=40, deadline=None)
@given(instances())
def test_optimal_equals_brute_force(inst):
  plan, costs = inst
  best = optimal.brute_force_grouping(plan, costs)
  for flags in FLAGS:
    got = optimal.optimal_grouping(plan, costs, **flags)
    assert got.time == pytest.approx(best.time, rel=1e-9), flags
    problem = optimal.GroupingProblem.from_plan(plan, costs)
    assert problem.time(got.cuts) == got.time
    assert got.groups == problem.groups(got.cuts)
  pruned = optimal.optimal_grouping(plan, costs)
  made = optimal.plan_from_groups(plan, pruned.groups)
  assert simulate(made, costs).iteration == pytest.approx(best.time, rel=1e-9)


def test_pruning_agrees_on_larger_instances():
  # Too many leaves for brute force; the state-dominance search alone is an
  # exact dynamic program, and every pruning must find the same optimum.
  rng = random.Random(0)
  for trial in range(6):
    n = rng.randint(25, 45)
    leaves = [leaf(i, rng.randint(1024, 200_000), True) if rng.random() < 0.6
              else leaf(i, rng.randint(1, 2000), False) for i in range(n)]
    plan = layerwise(leaves, list(range(n))[::-1])
    costs = Costs({"allgather": LinearCost(3e-4, 4e-9),
                   "psum": LinearCost(1e-4, 2e-9)}, LinearCost(5e-5, 1e-10),
                  tuple(rng.uniform(0, 4e-4) for _ in range(n)),
                  overlap=(1.0, 0.6, 0.25)[trial % 3],
                  bucket=(0.0, 2e-4)[trial // 3])
    reference = optimal.optimal_grouping(plan, costs, prune_bound=False,
                                         prune_dominance=False)
    for flags in FLAGS:
      if not flags["prune_states"]:
        continue  # exponential without it
      got = optimal.optimal_grouping(plan, costs, **flags)
      assert got.time == pytest.approx(reference.time, rel=1e-9), flags


def test_cupcake_insight_2_taken_literally_misses_this_optimum():
  # Five leaves in ready order: D0 S1 D2 S3 D4 (S sparse, D dense), no
  # backward time, compression of S1 200 µs and of S3 800 µs; all-gather
  # 500 µs + 1 ns/byte, psum 300 µs + 1 ns/byte (times in µs below).
  problem = optimal.GroupingProblem(
      order=(0, 1, 2, 3, 4), sparse=(False, True, False, True, False),
      backward=(0, 0, 0, 0, 0), compress=(0, 200, 0, 800, 0),
      wire=(4000, 10000, 5000, 50000, 1000),
      allgather=LinearCost(500, 0.001), psum=LinearCost(300, 0.001),
      forward=0, overlap=1.0)
  # [D0] [S1] [D2 S3 D4]: psum D0 [0, 304]; S1 compressed by 200, all-gather
  # [304, 814]; the last group compresses S3 over [200, 1000], all-gathers
  # it [1000, 1550], then psums D2+D4 (6000 bytes) [1550, 1856].
  assert problem.time((0, 1, 4)) == 1856
  # After [D0] the link is busy until 304 and S1, D2 are computed by 200:
  # j* = 2, and Cupcake's rule would skip a group ending at S1. What is
  # left is worse: [S1 D2] costs a third psum α, one group [S1 … D4]
  # delays S1's 10000 bytes behind S3: all-gather [1000, 1560], psum to 1866.
  assert problem.time((0, 2, 4)) == 1970
  assert problem.time((0, 4)) == 1866
  assert optimal.brute_force(problem).time == 1856
  for flags in FLAGS:
    got = optimal.search(problem, **flags)
    assert got.cuts == (0, 1, 4) and got.time == 1856, flags


# --- speed --------------------------------------------------------------------

def resnet_like(n, seed=0):
  """ResNet-101-like: a third of the leaves are conv weights (sparse, 4K-2.4M
  elements, backward ∝ size), the rest small dense BN/bias vectors; 10 GbE-
  like all-gather and psum lines, 50 µs per compression, 2×H200-like η."""
  rng = random.Random(seed)
  leaves, backward = [], []
  for i in range(n):
    if i % 3 == 0:
      size = (rng.choice([64, 128, 256, 512]) * rng.choice([64, 128, 256, 512])
              * rng.choice([1, 9]))
      leaves.append(leaf(i, size, True))
      backward.append(2e-4 + size * 2e-10 * rng.uniform(1, 20))
    else:
      leaves.append(leaf(i, rng.choice([64, 256, 1024, 2048]), False))
      backward.append(2e-5)
  plan = layerwise(leaves, list(range(n))[::-1])
  costs = Costs({"allgather": LinearCost(1e-4, 5e-9),
                 "psum": LinearCost(5e-5, 1.6e-9)}, LinearCost(5e-5, 1e-10),
                tuple(backward), overlap=0.25, forward=0.05)
  return plan, costs


@pytest.mark.parametrize("overlap,bucket", [(1.0, 0.0), (0.25, 0.0),
                                            (1.0, 1e-4), (0.25, 1e-4)])
def test_314_leaves_in_under_a_second(overlap, bucket):
  plan, costs = resnet_like(314)
  costs = costs.replace(overlap=overlap, bucket=bucket)
  start = time.perf_counter()
  got = optimal.optimal_grouping(plan, costs)
  seconds = time.perf_counter() - start
  assert seconds < 1.0, seconds
  # No worse than any fixed rule, and what simulate says of its plan.
  problem = optimal.GroupingProblem.from_plan(plan, costs)
  for cuts in optimal._heuristics(314):  # pylint: disable=protected-access
    assert got.time <= problem.time(cuts)
  made = optimal.plan_from_groups(plan, got.groups)
  assert simulate(made, costs).iteration == pytest.approx(got.time, rel=1e-9)


def test_a_per_bucket_compute_cost_merges_the_sparse_groups():
  """Free buckets let the ideal schedule send almost every sparse leaf on
  its own; at 0.1 ms of compute each, the grouping keeps a few, and the
  free grouping costs more under that cost than the one found for it."""
  plan, costs = resnet_like(120)
  free_costs = costs.replace(overlap=1.0)
  dear_costs = free_costs.replace(bucket=1e-4)
  free = optimal.optimal_grouping(plan, free_costs)
  dear = optimal.optimal_grouping(plan, dear_costs)
  sparse_ids = {l.path for l in plan.leaves if l.mode == "sparse"}

  def sparse_groups(grouping):
    return sum(any(plan.leaves[i].path in sparse_ids for i in g)
               for g in grouping.groups)
  assert sparse_groups(dear) < sparse_groups(free) // 4
  problem = optimal.GroupingProblem.from_plan(plan, dear_costs)
  assert problem.time(free.cuts) > dear.time
  # and exactly what the simulator says of each plan under that cost
  for grouping in (free, dear):
    made = optimal.plan_from_groups(plan, grouping.groups)
    assert simulate(made, dear_costs).iteration == pytest.approx(
        problem.time(grouping.cuts), rel=1e-9)


# --- plans --------------------------------------------------------------------

def _params(sizes):
  return [jax.ShapeDtypeStruct((s,), "float32") for s in sizes]


@pytest.mark.parametrize("strategy", ["aligned", "size", "behind", "single"])
def test_plan_from_groups_builds_buckets_like_the_planner(strategy):
  sizes = [5000, 10, 3000, 2000, 7, 9000, 40, 1500, 1200]
  order = [8, 7, 6, 5, 4, 3, 2, 1, 0]
  kw = dict(density=0.01, settings=jaxfuse.Settings(min_sparse_size=1000),
            num_buckets=3, bucket_bytes=20000, order=order)
  want = jaxfuse.plan(_params(sizes), strategy=strategy, **kw)
  base = jaxfuse.plan(_params(sizes), strategy="layerwise", **kw)
  nbytes = [4 * s for s in sizes]
  groups = planner._groups(  # pylint: disable=protected-access
      strategy, order, nbytes, 3, 20000)
  got = optimal.plan_from_groups(
      base, groups, sparsify="behind" if strategy == "behind" else "ahead",
      strategy=strategy)
  assert got.buckets == want.buckets
  assert got.provenance["strategy"] == strategy
  assert got.ready_order == want.ready_order


def test_plan_from_groups_and_problem_errors():
  plan = layerwise([leaf(0, 5000, True), leaf(1, 10, False)], [1, 0])
  with pytest.raises(plan_lib.PlanError, match="out of range"):
    optimal.plan_from_groups(plan, [[1, 2]])
  with pytest.raises(plan_lib.PlanError, match="exactly one bucket"):
    optimal.plan_from_groups(plan, [[1]])
  with pytest.raises(plan_lib.PlanError, match="sparsify"):
    optimal.plan_from_groups(plan, [[1, 0]], sparsify="sideways")
  costs = Costs({"allgather": LinearCost(0, 0), "psum": LinearCost(0, 0)},
                LinearCost(0, 0), (1.0, 1.0))
  with pytest.raises(plan_lib.PlanError, match="order"):
    optimal.GroupingProblem.from_plan(plan, costs, order=[0, 0])
  with pytest.raises(ValueError, match="2 leaves"):
    optimal.GroupingProblem.from_plan(plan, costs.replace(backward=[1.0]))
  problem = optimal.GroupingProblem.from_plan(plan, costs, order=[0, 1])
  assert problem.order == (0, 1)
  with pytest.raises(ValueError, match="cuts"):
    problem.time((0,))
  got = optimal.optimal_grouping(plan, costs, order=[0, 1])
  assert sorted(i for g in got.groups for i in g) == [0, 1]
  assert math.isfinite(got.time)


def test_wire_bytes_of_the_problem_follow_the_scheme():
  """Packed indices shrink a sparse leaf's wire in the grouping problem
  for ``allgather`` buckets only (ZEN sends int32 indices)."""
  leaves = [leaf(0, 100_000, True), leaf(1, 50, False)]
  costs = Costs({"allgather": LinearCost(1e-4, 1e-9),
                 "psum": LinearCost(1e-4, 1e-9)}, LinearCost(1e-5, 1e-9),
                (1e-4, 1e-4))
  def wire(collective, packed):
    plan = layerwise(leaves, [0, 1])
    scheme = (collectives.AllGather(packed_indices=packed)
              if collective == "allgather" else collective)
    plan = plan_lib.Plan(plan.leaves, tuple(
        b if b.collective == "psum" else
        plan_lib.BucketPlan(b.leaves, collective, scheme=(
            None if isinstance(scheme, str) else scheme))
        for b in plan.buckets), plan.settings)
    return optimal.GroupingProblem.from_plan(plan, costs).wire
  c = leaves[0].capacity
  assert wire("allgather", False) == wire("zen", True) == (8 * c, 200)
  # (ZEN has no packed indices: "packed" asks nothing of it)
  assert wire("allgather", True) == (4 * (c + -(-17 * c // 32)), 200)
