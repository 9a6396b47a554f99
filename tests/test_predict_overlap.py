"""``benchmarks/planner.py predict-overlap``: ``overhead.py overlap``'s
measured steps against the simulator, η fitted on the ``size`` plan of the same call."""

import json
import math

import pytest

from jaxfuse import plans as plan_lib
from jaxfuse.planning.costs import Costs
from jaxfuse.planning.costs import LinearCost
from jaxfuse.planning import simulate

from _harness import repo_modules


@pytest.fixture(scope="module")
def po():
  with repo_modules("benchmarks/tools", "predict_overlap") as module:
    yield module


def _leaf(i, n, cap):
  return plan_lib.LeafPlan(f"[{i}]", (n,), "float32", "sparse", 0.01, cap,
                           "dgc")


LEAVES = (_leaf(0, 4000, 40), _leaf(1, 8000, 80), _leaf(2, 2000, 20))
SIZE = plan_lib.Plan(LEAVES, (plan_lib.BucketPlan((2, 1), "allgather"),
                              plan_lib.BucketPlan((0,), "allgather")))
SPLIT = plan_lib.Plan(LEAVES, (plan_lib.BucketPlan((2,), "allgather"),
                               plan_lib.BucketPlan((1,), "allgather"),
                               plan_lib.BucketPlan((0,), "allgather")))
COSTS = Costs({"allgather": LinearCost(1e-4, 1e-8),
               "psum": LinearCost(1e-4, 1e-9)}, LinearCost(1e-5, 1e-9),
              (4e-3, 3e-3, 2e-3), forward=2e-3, bucket=2e-4)


def _call(tmp_path, t1, g, size_step, split_step):
  """One overlap.py call: the plain step's file (T₁, G) and two send_early
  variants, the size plan's (its plan saved beside, as overlap.py does) and
  a saved plan's."""
  common = {"preset": "tiny", "density": 0.05, "strategy": "size",
            "bucket_mb": 64}
  (tmp_path / "default_.json").write_text(json.dumps(dict(
      common, plan_file=None, send_early=False, one_gpu_step_s=t1[0],
      one_gpu_step_pipelined_s=t1[1], comm_s=g,
      variants={"default_base": {"step_s": 1.0}})))
  size = tmp_path / "early_size_.json"
  size.write_text(json.dumps(dict(
      common, plan_file=None, send_early=True, variants={
          "size": {"step_s": size_step[0],
                   "step_pipelined_s": size_step[1]}})))
  SIZE.save(tmp_path / "early_size_.plan.json")
  split_file = tmp_path / "split_plan.json"
  SPLIT.save(split_file)
  split = tmp_path / "early_split_.json"
  split.write_text(json.dumps(dict(   # an absolute plan_file stays as is
      common, send_early=True, plan_file=str(split_file), variants={
          "split": {"step_s": split_step[0],
                    "step_pipelined_s": split_step[1]}})))
  return [tmp_path / "default_.json", size, split]


def test_eta_is_fitted_on_the_size_plan_and_predicts_the_others(po,
                                                                tmp_path):
  files = _call(tmp_path, t1=(0.020, 0.018), g=0.004,
                size_step=(0.022, 0.0195), split_step=(0.021, 0.019))
  # A glob of the call's files takes the plans saved beside them too.
  call = po.read_calls(files + [tmp_path / "early_size_.plan.json"])[0.05]
  assert [v["name"] for v in call["variants"]] == ["size", "split"]
  rows = {r["plan"]: r for r in po.predict(call, COSTS)}
  ideal_size = simulate.simulate(SIZE, COSTS)
  ideal_split = simulate.simulate(SPLIT, COSTS)
  for which, (t1, t_size) in enumerate(((0.020, 0.022), (0.018, 0.0195))):
    eta = (t1 + ideal_size.communication - t_size) / ideal_size.hidden
    # The size plan is its own measurement; the split plan runs on T₁
    # plus its three buckets' extra compression, at the same η.
    assert rows["size"]["predicted_s"][which] == pytest.approx(t_size)
    want = (t1 + ideal_split.compute_end - ideal_size.compute_end
            + ideal_split.communication - eta * ideal_split.hidden)
    assert rows["split"]["predicted_s"][which] == pytest.approx(want)
    assert rows["split"]["eta"][which] == pytest.approx(eta)


def test_a_given_eta_predicts_the_size_plan_too(po, tmp_path):
  """--eta W,P: no fit; every plan, the size plan included, is T₁ plus its
  extra compression, plus G − η·H with the given η."""
  files = _call(tmp_path, t1=(0.020, 0.018), g=0.004,
                size_step=(0.030, 0.028), split_step=(0.021, 0.019))
  out = tmp_path / "report.json"
  po.main([*map(str, files), "--costs", str(_costs_file(tmp_path)),
           "--eta", "0.5,0.75", "--out", str(out)])
  rows = {r["plan"]: r for r in json.loads(out.read_text())["densities"][
      "0.05"]["rows"]}
  ideal_size = simulate.simulate(SIZE, COSTS)
  ideal_split = simulate.simulate(SPLIT, COSTS)
  for which, (t1, eta) in enumerate(((0.020, 0.5), (0.018, 0.75))):
    want_size = t1 + ideal_size.communication - eta * ideal_size.hidden
    assert rows["size"]["predicted_s"][which] == pytest.approx(want_size)
    assert rows["size"]["error"][which] == pytest.approx(
        want_size / (0.030, 0.028)[which] - 1)
    assert rows["split"]["predicted_s"][which] == pytest.approx(
        t1 + ideal_split.compute_end - ideal_size.compute_end
        + ideal_split.communication - eta * ideal_split.hidden)


@pytest.mark.parametrize("bad", ["0.8", "0.8,0", "0.8,1.2", "a,b"])
def test_eta_must_be_two_shares(po, tmp_path, bad, capsys):
  with pytest.raises(SystemExit):
    po.main([str(tmp_path / "none.json"), "--costs", "c.json", "--eta", bad])
  assert "give η waited for and pipelined as W,P" in capsys.readouterr().err


def test_anchor_link_matches_the_measured_collectives(po, tmp_path):
  """--anchor-link: the size plan simulated on the scaled link takes the
  G the call measured."""
  g = 3 * simulate.simulate(SIZE, COSTS).communication
  files = _call(tmp_path, t1=(0.02, 0.018), g=g, size_step=(0.03, 0.028),
                split_step=(0.031, 0.029))
  out = tmp_path / "report.json"
  po.main([*map(str, files), "--costs", str(_costs_file(tmp_path)),
           "--anchor-link", "--out", str(out)])
  scaled = COSTS.link_scaled(3.0)
  report = json.loads(out.read_text())["densities"]["0.05"]
  assert simulate.simulate(SIZE, scaled).communication == pytest.approx(g)
  size_row = next(r for r in report["rows"] if r["plan"] == "size")
  assert size_row["eta"][0] == pytest.approx(simulate.eta_from_hidden(
      0.02 + g - 0.03, simulate.simulate(SIZE, scaled)))


@pytest.mark.parametrize("estimator,headroom", [("dgc", 1.2), (None, None)])
def test_a_result_without_its_plan_rebuilds_it_as_overlap_py_did(
    po, tmp_path, estimator, headroom):
  """No plan file and none saved beside: the size plan is built again from
  the result's preset, density, estimator and headroom (an older result
  without the last two: overlap.py's defaults, dgc and 1.5)."""
  result = {"preset": "tiny", "strategy": "size", "bucket_mb": 64,
            "density": 0.05, "dtype": "float32", "plan_file": None,
            "estimator": estimator, "headroom": headroom}
  plan = po._plan(tmp_path / "early_.json", result)  # pylint: disable=protected-access
  sparse = [leaf for leaf in plan.leaves if leaf.estimator]
  assert sparse and {leaf.estimator for leaf in sparse} == {"dgc"}
  for leaf in sparse:
    assert leaf.capacity == math.ceil(0.05 * math.prod(leaf.shape)
                                      * (headroom or 1.5))


def _costs_file(tmp_path):
  path = tmp_path / "costs.json"
  COSTS.save(path)
  return path


def test_swapped_names_the_pairs_ranked_against_the_measurement(po):
  rows = [{"plan": "a", "measured_s": [1.0, 1.0], "predicted_s": [1.1, 1.0]},
          {"plan": "b", "measured_s": [2.0, 0.5], "predicted_s": [1.0, 0.6]},
          {"plan": "c", "measured_s": [3.0, 0.4], "predicted_s": [3.0, 0.4]}]
  # Waited for: a < b measured, b < a predicted, 10 % of b's 1.0 apart.
  assert po.swapped(rows, 0) == [("a", "b", pytest.approx(0.1))]
  # Pipelined: every pair in the measured order.
  assert po.swapped(rows, 1) == []
