"""A run's predicted wall time on K workers over a given link
(``Costs.on_link``, ``Costs.with_compute``, ``jaxfuse.planning.predict``):
hand-computed ring times and step times, and the link's invariants."""

from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
import numpy as np
import pytest

import jaxfuse
from jaxfuse import plans as plan_lib
from jaxfuse.planning import predict
from jaxfuse.planning.costs import Costs
from jaxfuse.planning.costs import CostsError
from jaxfuse.planning.costs import LinearCost

approx = lambda x: pytest.approx(x, rel=1e-9, abs=1e-15)


def _costs(workers=2, backward=(0.01, 0.02), forward=0.01, overlap=0.0,
           compress=(0.0, 0.0)):
  line = LinearCost(0.5, 0.5)   # replaced by on_link in every test here
  return Costs({"allgather": line, "psum": line}, LinearCost(*compress),
               backward, overlap=overlap, forward=forward, workers=workers)


# --- on_link -----------------------------------------------------------------

def test_a_link_gives_each_collective_its_ring_time():
  """1 GB/s and 0.1 ms a message: one message of x bytes takes
  1e-4 + x·1e-9 s. On K = 4 workers, 1 MB per worker:
    all_gather  3 messages of 1 MB        3·(1e-4 + 1e-3)    = 3.3e-3
    all_reduce  6 messages of 1 MB / 4    6·(1e-4 + 0.25e-3) = 2.1e-3
    all_to_all  3 messages of 1 MB / 4    3·(1e-4 + 0.25e-3) = 1.05e-3
    ppermute    1 message of 1 MB         1e-4 + 1e-3        = 1.1e-3"""
  link = _costs().on_link(1.0, 1e-4)
  assert link.primitive_time("allgather", 1e6, 4) == approx(3.3e-3)
  assert link.primitive_time("allreduce", 1e6, 4) == approx(2.1e-3)
  assert link.primitive_time("alltoall", 1e6, 4) == approx(1.05e-3)
  assert link.primitive_time("ppermute", 1e6, 4) == approx(1.1e-3)
  # on the profiled K0 = 2 the all-gather line is one message
  assert link.comm_time("allgather", 1e6) == approx(1.1e-3)


def test_a_link_keeps_the_compute_and_the_overlap():
  costs = _costs(overlap=0.4, compress=(1e-4, 1e-9))
  link = costs.on_link(3.0, 3e-4)
  assert (link.forward, link.backward, link.overlap, link.compress) == (
      costs.forward, costs.backward, 0.4, costs.compress)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([2, 3, 4, 8]), st.sampled_from([2, 5, 8, 16, 64]),
       st.sampled_from(["allgather", "allreduce", "alltoall", "ppermute"]),
       st.floats(1e3, 1e9), st.floats(0.01, 100.0), st.floats(0.0, 1e-3))
def test_a_links_time_does_not_depend_on_where_the_costs_were_profiled(
    k0, k, primitive, nbytes, gbytes, latency):
  """The ring on K workers is the ring on K workers, whichever K0 the
  profile's lines were measured on."""
  here = _costs(workers=k0).on_link(gbytes, latency)
  there = _costs(workers=2).on_link(gbytes, latency)
  assert here.primitive_time(primitive, nbytes, k) == pytest.approx(
      there.primitive_time(primitive, nbytes, k), rel=1e-9)


@settings(max_examples=40, deadline=None)
@given(st.sampled_from([2, 4, 16]), st.floats(1e4, 1e8),
       st.floats(0.01, 10.0), st.floats(1.01, 100.0))
def test_a_faster_link_is_never_slower(k, nbytes, gbytes, speedup):
  slow = _costs().on_link(gbytes, 1e-4)
  fast = _costs().on_link(gbytes * speedup, 1e-4)
  for primitive in ("allgather", "allreduce", "alltoall", "ppermute"):
    assert fast.primitive_time(primitive, nbytes, k) < slow.primitive_time(
        primitive, nbytes, k)


@pytest.mark.parametrize("gbytes, latency, field", [
    (0, 1e-4, "gbytes_per_s"), (-1.0, 1e-4, "gbytes_per_s"),
    (float("inf"), 1e-4, "gbytes_per_s"), ("10", 1e-4, "gbytes_per_s"),
    (True, 1e-4, "gbytes_per_s"), (1.0, -1e-6, "latency_s"),
    (1.0, float("nan"), "latency_s")])
def test_a_bad_link_is_refused_by_name(gbytes, latency, field):
  with pytest.raises(CostsError, match=field):
    _costs().on_link(gbytes, latency)


# --- with_compute --------------------------------------------------------------

def test_the_measured_compute_keeps_the_profiles_shares():
  """forward 0.01, backward (0.01, 0.02): 0.04 s; measured 0.08 s doubles
  each."""
  scaled = _costs(compress=(1e-4, 1e-9)).with_compute(0.08)
  assert scaled.forward == approx(0.02)
  assert scaled.backward == (approx(0.02), approx(0.04))
  assert scaled.compress == LinearCost(1e-4, 1e-9)   # per parameter, kept


@pytest.mark.parametrize("seconds", [0, -0.1, float("nan"), None, True])
def test_a_bad_compute_is_refused(seconds):
  with pytest.raises(CostsError, match="seconds"):
    _costs().with_compute(seconds)


def test_costs_without_compute_cannot_be_scaled():
  with pytest.raises(CostsError, match="no forward or backward"):
    _costs(backward=(0.0, 0.0), forward=0.0).with_compute(0.1)


# --- predict -------------------------------------------------------------------

def _plan():
  """Two float32 leaves in one bucket: 'b' (100 elements, dense) and 'w'
  (1000, sparse at 0.1 with topk: 100 slots)."""
  leaves = (plan_lib.LeafPlan("['b']", (100,), "float32", "dense", 1.0, 100,
                              None),
            plan_lib.LeafPlan("['w']", (1000,), "float32", "sparse", 0.1,
                              100, "topk"))
  return plan_lib.Plan(leaves, (plan_lib.BucketPlan((1,), "allgather"),
                                plan_lib.BucketPlan((0,), "psum")))


def test_one_worker_steps_take_the_compute_alone():
  """K = 1 moves nothing: the dense phase (density 1: nothing selected)
  takes forward + backward (0.01 + 0.03 s), the sparse phase that plus
  its one compression unit (1e-3 + 1000·1e-6 = 2e-3 s); wall time is
  their running sum."""
  plan = _plan()
  phases = (jaxfuse.Phase(0, 2, jaxfuse.with_density(plan, 1.0)),
            jaxfuse.Phase(2, None, plan))
  costs = _costs(compress=(1e-3, 1e-6))
  assert predict.phase_step_times(phases, costs, 1) == (
      approx(0.04), approx(0.042))
  np.testing.assert_allclose(
      predict.predicted_wall_time(phases, costs, 1, 4),
      [0.04, 0.08, 0.122, 0.164], rtol=1e-9)


def test_the_link_adds_its_ring_time_where_nothing_overlaps():
  """K = 4, 1 GB/s, 0.1 ms a message, η = 0 (nothing hidden). The sparse
  bucket all-gathers 100 (value, index) slots = 800 B: 3·(1e-4 + 8e-7);
  the dense bucket all-reduces 400 B: 6·(1e-4 + 1e-7). Compute 0.04 s,
  no compression cost."""
  costs = _costs().on_link(1.0, 1e-4)
  (t,) = predict.phase_step_times((jaxfuse.Phase(0, None, _plan()),), costs,
                                  4)
  assert t == approx(0.04 + 3 * (1e-4 + 8e-7) + 6 * (1e-4 + 1e-7))


def test_local_steps_pay_the_whole_sync_every_h_steps():
  """The same plan and link as above, with η = 1 (a per-step sync would
  hide it all): an inner step is the compute alone, 0.04 s; a sync step
  adds the compression (1e-3 + 1000·1e-6) and both collectives in full,
  3·(1e-4 + 8e-7) + 6·(1e-4 + 1e-7), whatever η. H = 3: the walls at
  steps 1..6 are 0.04, 0.08, 0.08 + sync, ..."""
  costs = _costs(overlap=1.0, compress=(1e-3, 1e-6)).on_link(1.0, 1e-4)
  comm = 3 * (1e-4 + 8e-7) + 6 * (1e-4 + 1e-7)
  sync = 0.04 + 2e-3 + comm
  assert predict.local_steps_times(_plan(), costs, 4) == (approx(0.04),
                                                          approx(sync))
  wall = predict.predicted_wall_time((jaxfuse.Phase(0, None, _plan()),),
                                     costs, 4, 6, every=3)
  np.testing.assert_allclose(
      wall, np.cumsum([0.04, 0.04, sync, 0.04, 0.04, sync]), rtol=1e-9)
  with pytest.raises(jaxfuse.PlanError, match="every=0"):
    predict.predicted_wall_time((jaxfuse.Phase(0, None, _plan()),), costs,
                                4, 6, every=0)
  two = (jaxfuse.Phase(0, 2, _plan()), jaxfuse.Phase(2, None, _plan()))
  with pytest.raises(jaxfuse.PlanError, match="run one phase"):
    predict.predicted_wall_time(two, costs, 4, 6, every=3)


def test_a_phase_without_a_plan_is_refused_with_the_fix():
  phases = (jaxfuse.Phase(0, None, None),)
  with pytest.raises(jaxfuse.PlanError, match=r"with_density\(plan, 1.0\)"):
    predict.phase_step_times(phases, _costs(), 2)


@pytest.mark.parametrize("steps", [0, -3, 2.5, None])
def test_a_bad_step_count_is_refused(steps):
  with pytest.raises(jaxfuse.PlanError, match="steps"):
    predict.predicted_wall_time((jaxfuse.Phase(0, None, _plan()),),
                                _costs(), 2, steps)


# --- profile_on_link and `jaxfuse profile --link` ------------------------------

def test_profile_link_measures_the_compute_and_takes_the_link(tmp_path,
                                                               capsys):
  """One device is enough with --link: the saved lines are the ring on
  1.25 GB/s (0.8 ns a byte) at 0.3 ms a message, the all-reduce's two
  passes 2·(K0−1)/K0 = 1 of them; η 0; the compression measured."""
  from jaxfuse.planning import cli
  out = tmp_path / "costs.json"
  assert cli.main(["profile", "--link", "1.25,3e-4", "-o", str(out),
                   "--compress-sizes", "4K", "64K", "--repeats", "1",
                   "--warmup", "1", "--chain", "1", "-q"]) == 0
  costs = Costs.load(out)
  lines = {name: (line.alpha, line.beta)
           for name, line in costs.collectives.items()}
  assert lines["allgather"] == (approx(3e-4), approx(0.8e-9))
  assert lines["psum"] == (approx(6e-4), approx(0.8e-9))
  assert costs.overlap == 0.0 and costs.contention == 1.0
  assert [x for x, _ in costs.provenance["samples"]["compress"]] == [
      4096, 65536]                          # measured here
  assert costs.backward == ()
  assert costs.provenance["link"] == {"gbytes_per_s": 1.25,
                                      "latency_s": 3e-4}
  assert "1.25 GB/s" in capsys.readouterr().out


@pytest.mark.parametrize("link", ["1.25", "0,3e-4", "1.25,-1", "a,b",
                                  "inf,0"])
def test_profile_link_refuses_a_bad_link_before_measuring(tmp_path, capsys,
                                                          link):
  from jaxfuse.planning import cli
  assert cli.main(["profile", "--link", link, "-o",
                   str(tmp_path / "c.json")]) == 2
  err = capsys.readouterr().err
  assert "--link" in err and ("GB/S,LATENCY_S" in err or "bandwidth" in err)
  assert not (tmp_path / "c.json").exists()
