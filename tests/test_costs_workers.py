"""The cost model on K workers: each measured line read as its ring
algorithm on K₀ devices (jaxfuse.planning.costs), and auto's per-bucket
choice of collective."""

import json
import math

from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
import jax
import pytest

import jaxfuse
from jaxfuse import collectives
from jaxfuse.planning.costs import Costs
from jaxfuse.planning.costs import CostsError
from jaxfuse.planning.costs import LinearCost
from jaxfuse.planning.simulate import simulate


def _costs(workers=2, **extra):
  lines = {"allgather": LinearCost(1e-4, 1e-9), "psum": LinearCost(2e-4, 3e-9)}
  lines.update(extra)
  return Costs(lines, LinearCost(0.0, 0.0), (), workers=workers)


def test_at_the_measured_count_the_lines_are_the_measurements():
  c = _costs(workers=4)
  assert c.primitive_time("allgather", 1000) == pytest.approx(1e-4 + 1e-6)
  assert c.primitive_time("allreduce", 1000) == pytest.approx(2e-4 + 3e-6)


def test_other_worker_counts_follow_the_ring_algorithms():
  c = _costs(workers=2)  # K0 = 2: the all_gather line is one message
  # all_gather on K = 5: 4 messages of x.
  assert c.primitive_time("allgather", 1000, 5) == pytest.approx(
      4 * (1e-4 + 1e-6))
  # all_reduce on 5: (K-1)/(K0-1)·α + (K-1)K0/(K(K0-1))·β·x = 4α + 1.6βx.
  assert c.primitive_time("allreduce", 1000, 5) == pytest.approx(
      4 * 2e-4 + 1.6 * 3e-6)
  # ppermute without its own line: one all_gather message.
  assert c.primitive_time("ppermute", 1000, 5) == pytest.approx(1e-4 + 1e-6)
  # all_to_all without its own line: K-1 messages of x/K.
  assert c.primitive_time("alltoall", 1000, 5) == pytest.approx(
      4 * (1e-4 + 1e-9 * 200))
  # Measured lines win: ppermute does not depend on K.
  m = _costs(workers=2, ppermute=LinearCost(5e-5, 2e-9))
  assert m.primitive_time("ppermute", 1000, 7) == pytest.approx(5e-5 + 2e-6)
  assert c.primitive_time("allgather", 1000, 1) == 0.0


def test_costs_json_keeps_workers_and_optional_lines(tmp_path):
  c = _costs(workers=6, alltoall=LinearCost(1e-5, 1e-9))
  c.save(tmp_path / "c.json")
  back = Costs.load(tmp_path / "c.json")
  assert back.workers == 6 and set(back.collectives) == {
      "allgather", "psum", "alltoall"}
  body = json.loads(c.to_json())
  del body["workers"]                 # a file from before: K0 from its mesh
  body["version"] = 1
  body["provenance"] = {"devices": {"mesh": {"data": 3}}}
  assert Costs.from_json(json.dumps(body)).workers == 3
  body["collectives"]["bogus"] = {"alpha": 0, "beta": 0}
  with pytest.raises(CostsError, match="may have"):
    Costs.from_json(json.dumps(body))
  with pytest.raises(CostsError, match="workers"):
    _costs(workers=1)


def test_simulated_allgather_bucket_grows_with_workers_and_dense_does_not_much():
  params = [jax.ShapeDtypeStruct((512, 512), "float32")]
  plan = jaxfuse.plan(params, density=0.01, strategy="single")
  dense = jaxfuse.plan(params, density=1.0, strategy="single")
  c = Costs({"allgather": LinearCost(0.0, 1e-9),
             "psum": LinearCost(0.0, 1e-9)}, LinearCost(0.0, 0.0), (0.0,),
            overlap=0.0, workers=2)
  payload = plan.bytes_per_worker()
  for k in (2, 4, 8):
    assert simulate(plan, c, k).communication == pytest.approx(
        (k - 1) * 1e-9 * payload)
    assert simulate(dense, c, k).communication == pytest.approx(
        (k - 1) * 2 / k * 1e-9 * 512 * 512 * 4)


def test_bucket_wire_of_the_allgather_scheme():
  params = [jax.ShapeDtypeStruct((100, 100), "float32"),
            jax.ShapeDtypeStruct((10,), "float32")]
  plan = jaxfuse.plan(params, density=0.01, strategy="single",
                      settings=jaxfuse.Settings(min_sparse_size=100))
  sparse, dense = collectives.bucket_wire(plan, 8)
  c = plan.leaves[0].capacity
  assert sparse == collectives.Wire(7 * 8 * c, 7 * 8 * c)
  assert dense == collectives.Wire(70, 70)  # ceil(2·7/8·40)


def test_auto_picks_each_sparse_buckets_collective_for_k():
  """Many workers over a slow link: SparDL's O(C) beats allgather's (K−1)·C;
  on two workers allgather's one message wins. The choice is the argmin of
  the schemes' own step times."""
  params = [jax.ShapeDtypeStruct((256, 256), "float32") for _ in range(3)]
  costs = Costs({"allgather": LinearCost(1e-5, 1e-9),
                 "psum": LinearCost(1e-5, 1e-9)}, LinearCost(0.0, 0.0),
                (1e-4,) * 3, overlap=0.0, workers=2)
  for k, want in ((64, "spardl"), (2, "allgather")):
    plan = jaxfuse.plan(params, density=0.01, strategy="auto", costs=costs,
                        num_workers=k)
    chosen = plan.provenance["auto"]["collectives"]
    sparse = [b for b in plan.buckets if b.collective != "psum"]
    assert sparse and plan.provenance["num_workers"] == k
    for b, times in zip(plan.buckets, chosen):
      if times:
        assert b.collective == min(times, key=times.get) == want, times


def test_auto_runs_the_schemes_it_picks_as_the_tuple_configures_them():
  """collective=(AllGather(), SparDL(block=4.0)): the rule strategies use
  the first; "auto" picks SparDL on 64 workers and keeps block=4.0."""
  params = [jax.ShapeDtypeStruct((256, 256), "float32") for _ in range(3)]
  costs = Costs({"allgather": LinearCost(1e-5, 1e-9),
                 "psum": LinearCost(1e-5, 1e-9)}, LinearCost(0.0, 0.0),
                (1e-4,) * 3, overlap=0.0, workers=2)
  given = (collectives.AllGather(), collectives.SparDL(block=4.0))
  auto = jaxfuse.plan(params, density=0.01, strategy="auto", costs=costs,
                      num_workers=64, collective=given)
  sparse = [b for b in auto.buckets if b.collective != "psum"]
  assert sparse and all(b.scheme == collectives.SparDL(teams=1, block=4.0)
                        for b in sparse)
  rule = jaxfuse.plan(params, density=0.01, strategy="single",
                      collective=given)
  assert [b.scheme for b in rule.buckets] == [collectives.AllGather()]
  with pytest.raises(jaxfuse.PlanError, match="names a scheme twice"):
    jaxfuse.plan(params, collective=(collectives.Zen(), "zen"))
  with pytest.raises(jaxfuse.PlanError, match="at least one scheme"):
    jaxfuse.plan(params, collective=())


def test_a_plan_for_k_workers_sends_the_fewest_bytes_losslessly():
  """num_workers=K and no collective: each sparse bucket takes ZEN where it
  sends under 90 % of the all-gather's bytes (which grow as (K − 1)·c);
  never SparDL (its reduction drops slots). Without K, or with
  a collective given, nothing changes."""
  params = [jax.ShapeDtypeStruct((512, 512), "float32") for _ in range(4)]
  c = math.ceil(0.05 * 512 * 512 * 1.5)     # slots of a leaf at ρ = 0.05
  for k, want in ((2, "allgather"), (8, "zen"), (64, "zen")):
    plan = jaxfuse.plan(params, density=0.05, num_workers=k)
    assert [b.collective for b in plan.buckets] == [want] * 4, k
    for sent in plan.provenance["bytes_sent"]:
      assert sent["allgather"] == (k - 1) * c * 8   # (value, index) pairs
      assert "spardl" not in sent
      if want == "zen":
        assert sent["zen"] <= 0.9 * sent["allgather"]
    assert plan.provenance["parameters"]["collective"] == "fewest bytes"
  # past ZEN's 64 workers the all-gather is all that is left
  assert {b.collective for b in jaxfuse.plan(
      params, density=0.05, num_workers=128).buckets} == {"allgather"}
  assert {b.collective for b in jaxfuse.plan(params, density=0.05).buckets
          } == {"allgather"}
  assert {b.collective for b in jaxfuse.plan(
      params, density=0.05, num_workers=8, collective="allgather").buckets
          } == {"allgather"}


def test_a_schemes_measured_compute_can_change_autos_choice():
  """On 64 workers SparDL's wire steps win; with SparDL and ZEN charged
  1 s of compute per bucket, allgather wins, and the simulated step counts
  that second on the compute stream."""
  params = [jax.ShapeDtypeStruct((256, 256), "float32") for _ in range(3)]
  base = Costs({"allgather": LinearCost(1e-5, 1e-9),
                "psum": LinearCost(1e-5, 1e-9)}, LinearCost(0.0, 0.0),
               (1e-4,) * 3, overlap=0.0, workers=2)
  slow = base.replace(schemes={"spardl": LinearCost(1.0, 0.0),
                               "zen": LinearCost(1.0, 0.0)})
  for costs, want in ((base, "spardl"), (slow, "allgather")):
    plan = jaxfuse.plan(params, density=0.01, strategy="auto", costs=costs,
                        num_workers=64)
    sparse = [b.collective for b in plan.buckets if b.collective != "psum"]
    assert sparse and set(sparse) == {want}
  forced = jaxfuse.plan(params, density=0.01, strategy="single",
                        costs=base, num_workers=64, collective="spardl")
  gap = (simulate(forced, slow, 64).compute_end -
         simulate(forced, base, 64).compute_end)
  assert gap == pytest.approx(1.0)
  assert slow.scheme_time("allgather", 10**6) == 0.0
  assert slow.replace(schemes={}).scheme_time("zen", 10**6) == 0.0


def test_costs_json_keeps_scheme_lines_and_checks_their_names():
  costs = _costs(workers=4).replace(
      schemes={"zen": LinearCost(1e-4, 2e-9)}, bucket=2e-4)
  back = Costs.from_json(costs.to_json())
  assert back == costs and back.scheme_time("zen", 1000) == pytest.approx(
      1e-4 + 2e-6)
  body = json.loads(costs.to_json())
  body["schemes"]["allgather"] = {"alpha": 0, "beta": 0}
  with pytest.raises(CostsError, match="'schemes'"):
    Costs.from_json(json.dumps(body))
  body["schemes"] = {"zen": {"alpha": -1, "beta": 0}}
  with pytest.raises(CostsError, match="schemes.zen"):
    Costs.from_json(json.dumps(body))
  with pytest.raises(CostsError, match="schemes="):
    _costs().replace(schemes={"psum": LinearCost(0, 0)})
  with pytest.raises(CostsError, match="schemes=5"):
    _costs().replace(schemes=5)



def test_the_lines_on_k_workers_are_the_ring_readings():
  c = _costs(workers=2, alltoall=LinearCost(3e-5, 4e-9),
             ppermute=LinearCost(5e-5, 2e-9))
  on5 = c.on_workers(5)
  assert on5.workers == 5
  # all_gather: ×(K−1)/(K0−1) = ×4; all_reduce and all_to_all: α ×4,
  # β ×(K−1)K0/(K(K0−1)) = ×1.6; ppermute: one message whatever K.
  assert on5.collectives["allgather"].alpha == pytest.approx(4e-4)
  assert on5.collectives["allgather"].beta == pytest.approx(4e-9)
  assert on5.collectives["psum"].alpha == pytest.approx(8e-4)
  assert on5.collectives["psum"].beta == pytest.approx(4.8e-9)
  assert on5.collectives["alltoall"].alpha == pytest.approx(1.2e-4)
  assert on5.collectives["alltoall"].beta == pytest.approx(6.4e-9)
  assert on5.collectives["ppermute"] == LinearCost(5e-5, 2e-9)
  assert c.on_workers(2) is c
  one = c.on_workers(1)
  assert all(line == LinearCost(0.0, 0.0)
             for line in one.collectives.values())
  with pytest.raises(CostsError, match="num_workers=0"):
    c.on_workers(0)


@settings(max_examples=40, deadline=None)
@given(k0=st.integers(2, 16), k=st.integers(1, 128),
       x=st.floats(0, 1e9), optional=st.booleans())
def test_on_workers_agrees_with_primitive_time(k0, k, x, optional):
  extra = dict(alltoall=LinearCost(3e-5, 4e-9),
               ppermute=LinearCost(5e-5, 2e-9)) if optional else {}
  c = _costs(workers=k0, **extra)
  on_k = c.on_workers(k)
  for primitive in ("allgather", "allreduce", "alltoall", "ppermute"):
    assert on_k.primitive_time(primitive, x) == pytest.approx(
        c.primitive_time(primitive, x, k), rel=1e-12, abs=1e-15)


def test_a_plan_for_k_workers_is_grouped_for_k():
  # Lines measured on K0 = 2, the plan made for K = 64: the all_gather is
  # 63 times dearer per bucket there, so the cost strategies fuse. Before,
  # they grouped for K0 and "auto" came out slower on K than "single".
  n = 12
  params = [jax.ShapeDtypeStruct((200_000,), "float32") for _ in range(n)]
  costs = Costs({"allgather": LinearCost(50e-6, 1e-10),
                 "psum": LinearCost(50e-6, 2e-10)},
                LinearCost(5e-6, 1e-10), (2e-4,) * n, forward=1e-3,
                workers=2)
  predicted = {}
  for strategy in ("auto", "cupcake", "safusion", "single", "aligned",
                   "layerwise"):
    plan = jaxfuse.plan(params, density=0.01, strategy=strategy,
                        costs=costs, num_workers=64)
    predicted[strategy] = plan.provenance["predicted_iteration"]
    if strategy in ("cupcake", "safusion"):
      same = jaxfuse.plan(params, density=0.01, strategy=strategy,
                          costs=costs.on_workers(64))
      assert plan.buckets == same.buckets
  assert predicted["auto"] <= min(predicted.values())
  assert predicted["cupcake"] <= predicted["single"] * (1 + 1e-9)
  assert predicted["cupcake"] < predicted["layerwise"] / 2


def test_auto_never_picks_one_index_space_for_a_bucket_over_int32():
  # One fused bucket of 2.4e9 elements on K = 512, where SparDL's wire
  # would be cheapest: SparDL, ZEN and hier index the whole bucket in
  # int32, so auto keeps such a bucket on allgather (per-leaf indices).
  params = [jax.ShapeDtypeStruct((1_200_000_000,), "float32")] * 2
  costs = Costs({"allgather": LinearCost(0.5, 1e-10),
                 "psum": LinearCost(0.5, 1e-9)},
                LinearCost(5e-6, 1e-10), (1e-6,) * 2, forward=1e-6,
                workers=2)
  plan = jaxfuse.plan(params, density=0.01, strategy="auto", costs=costs,
                      num_workers=512)
  (bucket,) = plan.buckets
  assert bucket.leaves == (1, 0) and bucket.collective == "allgather"
  assert list(plan.provenance["auto"]["collectives"][0]) == ["allgather"]
