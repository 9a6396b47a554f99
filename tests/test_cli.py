"""The ``jaxfuse`` command: profile -> plan -> show end to end in subprocesses
on 8 simulated CPU devices, and one-line errors (exit 2) for bad input."""

import os
import pathlib
import subprocess
import sys
import textwrap
import tomllib

import jax
import pytest

import jaxfuse
from jaxfuse.planning import cli
from jaxfuse.planning.costs import Costs
from jaxfuse.planning.costs import LinearCost
from jaxfuse.planning.simulate import simulate

from _harness import cpu_env
from _harness import repo_modules

REPO = pathlib.Path(__file__).resolve().parent.parent
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

MODEL = textwrap.dedent('''
    import jax.numpy as jnp
    import numpy as np

    def make():
      """Two dense layers of very different sizes and a sample batch."""
      rng = np.random.default_rng(0)
      params = {
          "dense1": {"kernel": rng.standard_normal((256, 512), np.float32)
                               / 16,
                     "bias": np.zeros(512, np.float32)},
          "dense2": {"kernel": rng.standard_normal((512, 8), np.float32) / 22,
                     "bias": np.zeros(8, np.float32)},
      }
      x = rng.standard_normal((256, 256), np.float32)

      def loss_fn(p, x):
        h = jnp.tanh(x @ p["dense1"]["kernel"] + p["dense1"]["bias"])
        return jnp.mean((h @ p["dense2"]["kernel"] + p["dense2"]["bias"]) ** 2)
      return loss_fn, params, x

    def params_only():
      return make()[1]

    def broken():
      raise RuntimeError("no weights here")

    NOT_A_FUNCTION = 3
''')
NUM_LEAVES = 4


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
  d = tmp_path_factory.mktemp("cli")
  (d / "tinymodel.py").write_text(MODEL)
  return d


def run(workdir, *args, compile_cache=None):
  return subprocess.run([sys.executable, "-m", "jaxfuse", *args], cwd=workdir,
                        env=cpu_env(8, compile_cache), capture_output=True,
                        text=True, timeout=300)


@pytest.mark.example   # subprocesses end to end: one interpreter runs it
@pytest.mark.second    # the Python 3.12 one, beside the first's examples
def test_profile_plan_show_end_to_end(workdir, compile_cache, capsys,
                                      monkeypatch):
  # profile: a tiny sweep, with the model
  # sizes far apart, so that β > 0 stands out of a loaded machine's noise:
  # compressing 1M elements takes ~20 ms on a CPU, 1K ~0.1 ms (64K, ~1 ms,
  # is within a loaded CI machine's jitter)
  r = run(workdir, "profile", "--model", "tinymodel:make", "--sizes", "4K",
          "4M", "--compress-sizes", "1K", "1M", "--repeats", "3",
          "--chain", "2", "-o", "costs.json", compile_cache=compile_cache)
  assert r.returncode == 0, r.stderr
  assert "profiling on 8 x cpu" in r.stderr
  bars = [l for l in r.stderr.splitlines() if l.startswith("[")]
  # 4 collectives x 2 sizes, 2 compress sizes, bucket, schemes, γ, η,
  # forward, backward
  assert bars[-1] == "[" + "#" * 24 + "] 16/16 done", bars[-1]
  costs = Costs.load(workdir / "costs.json")
  assert set(costs.collectives) == {"allgather", "psum", "alltoall",
                                    "ppermute"}
  assert costs.workers == 8
  assert costs.collectives["allgather"].beta > 0
  assert costs.collectives["psum"].beta > 0
  assert costs.compress.beta > 0
  assert len(costs.backward) == NUM_LEAVES and min(costs.backward) >= 0
  assert sum(costs.backward) > 0 and costs.forward > 0
  assert costs.provenance["devices"]["mesh"] == {"data": 8}
  # the model's leaves, so that costs of another model are refused
  assert costs.provenance["leaves"] == [
      ["['dense1']['bias']", [512]], ["['dense1']['kernel']", [256, 512]],
      ["['dense2']['bias']", [8]], ["['dense2']['kernel']", [512, 8]]]
  assert [s[0] for s in costs.provenance["samples"]["psum"]] == [4096, 4 << 20]

  # plan: aligned buckets over the backward-ready order, with the costs
  r = run(workdir, "plan", "tinymodel:make", "--density", "0.01",
          "--strategy", "aligned", "--num-buckets", "2", "--costs",
          "costs.json", "-o", "plan.json")
  assert r.returncode == 0, r.stderr
  assert "saved plan.json" in r.stdout and "predicted step" in r.stdout
  plan = jaxfuse.Plan.load(workdir / "plan.json")
  sys.path.insert(0, str(workdir))
  try:
    import tinymodel  # pylint: disable=g-import-not-at-top
  finally:
    sys.path.remove(str(workdir))
  loss_fn, params, x = tinymodel.make()
  plan.validate(params)
  assert sorted(plan.ready_order) == list(range(NUM_LEAVES))
  assert plan.provenance["ready_order"] == "jaxpr"
  order = jaxfuse.planning.ordering.ready_order(loss_fn, params, x)
  # two groups of the ready order, each a sparse and a dense bucket
  assert len(plan.buckets) == 4
  assert {i for b in plan.buckets[:2] for i in b.leaves} == set(order[:2])
  assert {b.collective for b in plan.buckets} == {"allgather", "psum"}

  # show: every bucket in the table, the prediction, and the chart
  r = run(workdir, "show", "plan.json", "--costs", "costs.json", "-o",
          "timeline.png")
  assert r.returncode == 0, r.stderr
  rows = {line.split()[0] for line in r.stdout.splitlines() if line}
  assert {f"b{i}" for i in range(len(plan.buckets))} <= rows
  assert f"b{len(plan.buckets)}" not in rows
  assert "predicted step" in r.stdout and "hidden" in r.stdout
  png = (workdir / "timeline.png").read_bytes()
  assert png[:8] == PNG_SIGNATURE and len(png) > 10_000
  # no extension: a PNG, and the name it was saved under (the command
  # in this process: its end to end run is the one above)
  monkeypatch.chdir(workdir)
  capsys.readouterr()
  assert cli.main(["show", "plan.json", "--costs", "costs.json", "-o",
                   "chart"]) == 0
  assert capsys.readouterr().out.splitlines()[-1] == "saved chart.png"
  chart = (workdir / "chart.png").read_bytes()
  assert chart[:8] == PNG_SIGNATURE and len(chart) > 10_000
  assert not (workdir / "chart").exists()


def test_show_without_costs_lists_buckets(workdir, capsys, monkeypatch):
  monkeypatch.chdir(workdir)
  assert cli.main(["plan", "tinymodel:params_only", "--strategy",
                   "layerwise", "-o", "params_plan.json"]) == 0
  out = capsys.readouterr().out
  assert "4 leaves (2 sparse)" in out and "reverse_pytree" in out
  assert cli.main(["show", "params_plan.json"]) == 0
  out = capsys.readouterr().out
  for i in range(NUM_LEAVES):  # layerwise: one bucket per leaf
    assert f"\nb{i} " in out
  assert "allgather/ahead" in out and "predicted" not in out
  assert cli.main(["plan", "tinymodel:params_only", "--strategy",
                   "layerwise", "--collective", "zen", "-o",
                   "zen_plan.json"]) == 0
  capsys.readouterr()
  assert cli.main(["show", "zen_plan.json"]) == 0
  out = capsys.readouterr().out
  assert "zen/ahead" in out and "allgather" not in out


def test_plan_last_bucket_bytes(workdir, capsys, monkeypatch):
  """``--last-bucket-bytes 2K`` cuts the one group of ``single`` (reverse
  pytree order: dense2's kernel and bias, dense1's kernel, dense1's bias
  of 2048 bytes last) so that dense1's bias goes alone."""
  monkeypatch.chdir(workdir)
  assert cli.main(["plan", "tinymodel:params_only", "--strategy", "single",
                   "--last-bucket-bytes", "2K", "-o", "cut_plan.json"]) == 0
  capsys.readouterr()
  plan = jaxfuse.Plan.load(workdir / "cut_plan.json")
  paths = [[plan.leaves[i].path for i in b.leaves] for b in plan.buckets]
  assert paths == [["['dense2']['kernel']", "['dense1']['kernel']"],
                   ["['dense2']['bias']"], ["['dense1']['bias']"]]
  assert plan.provenance["parameters"]["last_bucket_bytes"] == 2048
  assert "whole number" in error_of(capsys, "plan", "tinymodel:params_only",
                                    "--last-bucket-bytes", "0")


def test_plan_sparse_wire(workdir, capsys, monkeypatch):
  """``--sparse-wire bfloat16`` is saved in the plan's settings, and the
  plan's bytes per worker shrink: each sparse slot 6 bytes instead of 8
  (bfloat16 values two to a word, int32 indices)."""
  monkeypatch.chdir(workdir)
  for wire in ("gradient", "bfloat16"):
    assert cli.main(["plan", "tinymodel:params_only", "--strategy", "single",
                     "--sparse-wire", wire, "-o", f"{wire}.json"]) == 0
  capsys.readouterr()
  exact, half = (jaxfuse.Plan.load(workdir / f"{w}.json")
                 for w in ("gradient", "bfloat16"))
  assert (exact.settings.sparse_wire, half.settings.sparse_wire) == (
      "gradient", "bfloat16")
  dense = sum(l.size * 4 for l in exact.leaves if l.mode == "dense")
  caps = [u.capacity for u in jaxfuse.plans.units(exact)[0]]
  assert exact.bytes_per_worker() == dense + sum(8 * c for c in caps)
  assert half.bytes_per_worker() == dense + sum(
      4 * (-(-c // 2) + c) for c in caps)
  assert cli.main(["plan", "tinymodel:params_only", "--strategy", "single",
                   "--packed-indices", "-o", "packed.json"]) == 0
  capsys.readouterr()
  packed = jaxfuse.Plan.load(workdir / "packed.json")
  packs = lambda plan: [b.scheme.packed_indices for b in plan.buckets
                        if b.collective == "allgather"]
  assert packs(packed) == [True] and packs(exact) == [False]
  units = jaxfuse.plans.units(packed)[0]
  assert packed.bytes_per_worker() == dense + sum(
      4 * (u.capacity + -(-u.capacity * u.size.bit_length() // 32))
      for u in units)
  err = error_of(capsys, "plan", "tinymodel:params_only", "--sparse-wire",
                 "float16")
  assert "--sparse-wire" in err and "'bfloat16'" in err


def test_show_workers_gives_what_a_worker_sends(workdir, capsys,
                                                monkeypatch):
  """``show --workers 4`` adds what one worker sends: the sparse bucket's
  8-byte slots to each of its 3 peers, the dense biases' ring all-reduce
  (2·3/4 of their bytes), against the all-reduce of all 542,752 bytes."""
  monkeypatch.chdir(workdir)
  assert cli.main(["plan", "tinymodel:params_only", "--strategy", "single",
                   "--workers", "4", "-o", "sent_plan.json"]) == 0
  out = capsys.readouterr().out
  plan = jaxfuse.Plan.load(workdir / "sent_plan.json")
  slots = sum(l.capacity for l in plan.leaves if l.mode == "sparse")
  biases = 4 * (512 + 8)
  sent = 3 * 8 * slots + 3 * biases // 2
  dense = 3 * 4 * (256 * 512 + 512 + 512 * 8 + 8) // 2
  line = (f"on 4 workers each sends {sent:,} B, {100 * sent / dense:.2f}% "
          f"of a dense all-reduce's {dense:,} B")
  assert line in out
  assert cli.main(["show", "sent_plan.json", "--workers", "4"]) == 0
  assert line in capsys.readouterr().out
  assert cli.main(["show", "sent_plan.json"]) == 0   # no K: payload only
  assert "each sends" not in capsys.readouterr().out


def test_show_local_counts_hier_on_its_mesh(workdir, capsys, monkeypatch):
  """``--local 2`` on 4 workers: a ``hier`` bucket of N elements and C
  slots sends, on 2 hosts × 2 devices, its shard's c_s = min(⌈N/2⌉, C)
  8-byte slots to the other host plus the local ring all-reduce of
  ⌈N/2⌉·2 elements at (4 + 4)/2 bytes (2·1/2 of it); without ``--local``
  its host steps count on K = 4 (3 × 8·C). ``--local`` that does not
  divide K is refused before anything is written."""
  monkeypatch.chdir(workdir)
  assert cli.main(["plan", "tinymodel:params_only", "--strategy", "single",
                   "--collective", "hier", "--workers", "4", "--local", "2",
                   "-o", "hier_plan.json"]) == 0
  out = capsys.readouterr().out
  plan = jaxfuse.Plan.load(workdir / "hier_plan.json")
  assert {b.collective for b in plan.buckets} == {"hier", "psum"}
  n = 256 * 512 + 512 * 8
  c = sum(l.capacity for l in plan.leaves if l.mode == "sparse")
  shard = -(-n // 2)
  biases = 3 * 4 * (512 + 8) // 2
  dense = 3 * 4 * (n + 512 + 8) // 2
  on_mesh = 8 * min(shard, c) + 8 * shard + biases
  assert (f"on 4 workers (2 hosts x 2) each sends {on_mesh:,} B, "
          f"{100 * on_mesh / dense:.2f}% of a dense all-reduce's {dense:,} B"
          in out)
  assert cli.main(["show", "hier_plan.json", "--workers", "4"]) == 0
  on_k = 3 * 8 * c + biases
  assert f"on 4 workers each sends {on_k:,} B" in capsys.readouterr().out
  assert cli.main(["plan", "tinymodel:params_only", "--collective", "hier",
                   "--workers", "4", "--local", "3",
                   "-o", "not_written.json"]) == cli.EXIT_USAGE
  assert ("--local 3: 4 workers do not split into hosts of 3 devices"
          in capsys.readouterr().err)
  assert not (workdir / "not_written.json").exists()
  assert cli.main(["show", "hier_plan.json", "--local", "2"]) == cli.EXIT_USAGE
  assert "give --workers K" in capsys.readouterr().err


def hand_costs(num_leaves):
  return Costs({"allgather": LinearCost(1e-4, 1e-9),
                "psum": LinearCost(1e-4, 2e-9)}, LinearCost(1e-5, 1e-8),
               (1e-3,) * num_leaves, overlap=0.5, forward=2e-3)


def test_costs_without_backward_are_shown_as_communication_only(
    workdir, capsys, monkeypatch, tmp_path):
  monkeypatch.chdir(workdir)
  assert cli.main(["plan", "tinymodel:params_only", "--strategy", "single",
                   "-o", str(tmp_path / "p.json")]) == 0
  hand_costs(0).save(tmp_path / "c.json")
  capsys.readouterr()
  assert cli.main(["show", str(tmp_path / "p.json"), "--costs",
                   str(tmp_path / "c.json")]) == 0
  out = capsys.readouterr().out
  assert "no backward times" in out
  # single: one allgather (2 sparse leaves) and one psum (2 dense leaves);
  # no compute, so no overlap: step = Σ compression + Σ communication
  plan = jaxfuse.Plan.load(tmp_path / "p.json")
  t = simulate(plan, hand_costs(NUM_LEAVES).replace(
      backward=(0.0,) * NUM_LEAVES))
  assert f"predicted step {t.iteration * 1e3:.3f} ms" in out
  assert t.iteration == pytest.approx(2e-3 + t.compression + t.communication)


def test_plan_overlap_replaces_the_costs_eta(workdir, capsys, monkeypatch,
                                             tmp_path):
  """--overlap ETA plans and predicts with η = ETA (the costs' is 0.5), and
  asks for --costs without which it means nothing."""
  monkeypatch.chdir(workdir)
  hand_costs(NUM_LEAVES).save(tmp_path / "c.json")
  predicted = {}
  for eta in ("0", "1"):
    out = tmp_path / f"p{eta}.json"
    assert cli.main(["plan", "tinymodel:make", "--strategy", "mgwfbp",
                     "--costs", str(tmp_path / "c.json"), "--overlap", eta,
                     "-o", str(out)]) == 0
    plan = jaxfuse.Plan.load(out)
    expected = simulate(plan, hand_costs(NUM_LEAVES).replace(
        overlap=float(eta))).iteration
    predicted[eta] = plan.provenance["predicted_iteration"]
    assert predicted[eta] == pytest.approx(expected, rel=1e-9)
  assert predicted["1"] < predicted["0"]   # more of the link hidden
  capsys.readouterr()
  assert "give --costs" in error_of(capsys, "plan", "tinymodel:make",
                                    "--overlap", "0.5")
  assert cli.main(["plan", "tinymodel:make", "--costs",
                   str(tmp_path / "c.json"), "--overlap", "1.5"]) == 2
  assert "must be a number in [0, 1]" in capsys.readouterr().err


def test_plan_and_show_predict_on_the_workers_planned_for(
    workdir, capsys, monkeypatch, tmp_path):
  """--workers K: the printed prediction is for K (the costs' K₀ is 2):
  on one worker nothing is communicated, so the step is forward +
  backward + compression; ``show`` of a plan made for K predicts for K
  too."""
  monkeypatch.chdir(workdir)
  costs = hand_costs(NUM_LEAVES)
  assert costs.workers == 2
  costs.save(tmp_path / "c.json")
  for k in (1, 4):
    out = tmp_path / f"p{k}.json"
    capsys.readouterr()
    assert cli.main(["plan", "tinymodel:make", "--strategy", "single",
                     "--costs", str(tmp_path / "c.json"), "--workers", str(k),
                     "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    plan = jaxfuse.Plan.load(out)
    t = simulate(plan, costs, k)
    if k == 1:
      assert t.communication == 0
      assert t.iteration == pytest.approx(
          2e-3 + NUM_LEAVES * 1e-3 + t.compression)
    else:
      assert t.communication > simulate(plan, costs).communication
    assert f"predicted step {t.iteration * 1e3:.3f} ms" in printed
    assert f"communication {t.communication * 1e3:.3f} ms" in printed
    assert cli.main(["show", str(out), "--costs", str(tmp_path / "c.json")
                     ]) == 0
    shown = capsys.readouterr().out
    assert f"predicted step {t.iteration * 1e3:.3f} ms" in shown
    assert ("workers" not in shown) if k == 1 else ("on 4 workers" in shown)


def test_outputs_that_cannot_take_the_file_are_refused_first(
    workdir, capsys, monkeypatch, tmp_path):
  """-o in a missing folder, onto a folder or onto Python source (the
  model's own file, say) is refused before any work, in one line, and
  leaves the source as it was."""
  monkeypatch.chdir(workdir)
  source = (workdir / "tinymodel.py").read_text()
  assert "the folder" in error_of(capsys, "plan", "tinymodel:make", "-o",
                                  str(tmp_path / "no" / "plan.json"))
  assert "not a regular file" in error_of(capsys, "plan", "tinymodel:make",
                                          "-o", str(tmp_path))
  assert "is Python source" in error_of(capsys, "plan", "tinymodel:make",
                                        "-o", "tinymodel.py")
  # profile refuses before measuring (the model would fail to load)
  assert "is Python source" in error_of(
      capsys, "profile", "--model", "tinymodel:broken", "-o", "tinymodel.py")
  assert (workdir / "tinymodel.py").read_text() == source


def test_debug_after_the_command_and_a_closed_pipe(workdir, tmp_path,
                                                  monkeypatch, capsys):
  """--debug after the command shows the traceback (it was refused as
  an unknown argument); output into a pipe whose reader left (`| head
  -1`) ends with status 1 and no traceback."""
  r = run(workdir, "show", str(tmp_path / "none.json"), "--debug")
  assert "Traceback" in r.stderr and "UsageError: cannot read plan" in (
      r.stderr) and "unrecognized arguments" not in r.stderr
  monkeypatch.chdir(workdir)
  assert cli.main(["plan", "tinymodel:make", "-o",
                   str(tmp_path / "p.json")]) == 0
  capsys.readouterr()
  read_end, write_end = os.pipe()
  os.close(read_end)
  with os.fdopen(write_end, "w", buffering=1) as closed:
    monkeypatch.setattr(sys, "stdout", closed)
    assert cli.main(["show", str(tmp_path / "p.json")]) == 1
    monkeypatch.undo()
  assert capsys.readouterr().err == ""


def error_of(capsys, *argv) -> str:
  assert cli.main(list(argv)) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "Traceback" not in err, err
  return err


def test_bad_model_names(workdir, capsys, monkeypatch):
  monkeypatch.chdir(workdir)
  assert "MODULE:FUNCTION" in error_of(capsys, "plan", "tinymodel")
  assert "'no_such_module'" in error_of(capsys, "plan", "no_such_module:make")
  assert "no attribute 'nope'" in error_of(capsys, "plan", "tinymodel:nope")
  assert "not a function" in error_of(capsys, "plan",
                                      "tinymodel:NOT_A_FUNCTION")
  err = error_of(capsys, "plan", "tinymodel:broken")
  assert "RuntimeError: no weights here" in err
  assert "no such file" in error_of(capsys, "plan", "missing/model.py:make")
  assert "returned only params" in error_of(
      capsys, "profile", "--model", "tinymodel:params_only")
  with pytest.raises(cli.UsageError) as e:  # --debug: the traceback
    cli.main(["--debug", "plan", "tinymodel:broken"])
  assert isinstance(e.value.__cause__, RuntimeError)


def test_bad_files(workdir, capsys, monkeypatch, tmp_path):
  monkeypatch.chdir(workdir)
  assert "cannot read plan" in error_of(capsys, "show",
                                        str(tmp_path / "missing.json"))
  bad = tmp_path / "bad.json"
  bad.write_text("{not json")
  assert "not valid JSON" in error_of(capsys, "show", str(bad))
  other = tmp_path / "other.json"
  other.write_text('{"format": "something", "version": 1}')
  assert "'format' field must be 'jaxfuse.plan'" in error_of(
      capsys, "show", str(other))
  plan = jaxfuse.plan([jax.ShapeDtypeStruct((4096,), "float32")])
  plan.save(tmp_path / "plan.json")
  assert "not a jaxfuse costs file" in error_of(
      capsys, "show", str(tmp_path / "plan.json"), "--costs",
      str(tmp_path / "plan.json"))
  assert "cannot read costs" in error_of(
      capsys, "plan", "tinymodel:make", "--costs", str(tmp_path / "no.json"))
  assert "needs --costs" in error_of(capsys, "show",
                                     str(tmp_path / "plan.json"), "-o",
                                     str(tmp_path / "t.png"))
  hand_costs(NUM_LEAVES).save(tmp_path / "costs.json")  # another model's
  assert "4 times but the plan has 1 leaves" in error_of(
      capsys, "show", str(tmp_path / "plan.json"), "--costs",
      str(tmp_path / "costs.json"))


def test_bad_arguments(workdir, capsys, monkeypatch):
  monkeypatch.chdir(workdir)
  assert "(0, 1]" in error_of(capsys, "plan", "tinymodel:make", "--density",
                              "2")
  assert "strategy='fastest'" in error_of(capsys, "plan", "tinymodel:make",
                                          "--strategy", "fastest")
  assert "not a size" in error_of(capsys, "profile", "--sizes", "lots")
  assert "invalid choice" in error_of(capsys, "frobnicate")
  assert "required" in error_of(capsys)
  assert "two distinct" in error_of(capsys, "profile", "-q", "--sizes", "4K",
                                    "4K")


def test_help_and_sizes(capsys):
  for command in ("profile", "plan", "show"):
    with pytest.raises(SystemExit) as e:
      cli.main([command, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert f"usage: jaxfuse {command}" in out and "--output" in out
    if command == "plan":   # jaxfuse.plan's defaults, as docs/cli.md gives
      flat = " ".join(out.split())
      for option, default in [("--density", "0.01"), ("--estimator", "dgc"),
                              ("--num-buckets", "4"),
                              ("--bucket-bytes", "25M"),
                              ("--headroom", "1.5"),
                              ("--min-sparse-size", "1024"),
                              ("--collective", "allgather")]:
        help_text = flat.split(f" {option} ", 2)[-1].split(" --", 1)[0]
        assert f"(default: {default})" in help_text, (option, help_text)
  assert [cli.parse_size(s) for s in ("4096", "64K", "1M", "2MiB")] == [
      4096, 65536, 2**20, 2**21]


def test_console_script_and_test_extra_are_declared():
  project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
  assert project["scripts"]["jaxfuse"] == "jaxfuse.planning.cli:main"
  assert any(d.startswith("matplotlib")
             for d in project["optional-dependencies"]["test"])


@pytest.mark.example
def test_example_lm_profile_auto_plan_show_and_train(tmp_path, compile_cache):
  """The README's workflow on the example LM: profile it, plan with "auto"
  from those costs, draw the plan, and train two steps with it. (The steps
  share a compilation cache: what one compiled, the next loads.)"""
  target = f"{REPO / 'examples' / 'lm_model.py'}:tiny"
  r = run(tmp_path, "profile", "--model", target, "--sizes", "4K", "256K",
          "--compress-sizes", "1K", "64K", "--repeats", "2", "--chain", "2",
          "-q", "-o", "costs.json", compile_cache=compile_cache)
  assert r.returncode == 0, r.stderr
  r = run(tmp_path, "plan", target, "--strategy", "auto", "--costs",
          "costs.json", "-o", "plan.json", compile_cache=compile_cache)
  assert r.returncode == 0, r.stderr
  plan = jaxfuse.Plan.load(tmp_path / "plan.json")
  with repo_modules("examples", "lm_model") as lm_model:
    _, params, _ = lm_model.tiny()
  plan.validate(params)
  auto = plan.provenance["auto"]
  assert auto["winner"] in auto["candidates"]
  # the best candidate, or better after switching groups to dense
  assert plan.provenance["predicted_iteration"] <= (
      min(auto["candidates"].values()) * (1 + 1e-12))
  r = run(tmp_path, "show", "plan.json", "--costs", "costs.json", "-o",
          "timeline.png", compile_cache=compile_cache)
  assert r.returncode == 0, r.stderr
  assert (tmp_path / "timeline.png").read_bytes()[:8] == PNG_SIGNATURE
  env = cpu_env(8, compile_cache)
  out = subprocess.run(
      [sys.executable, str(REPO / "examples" / "train_lm.py"), "--plan",
       "plan.json", "--steps", "2", "--eval-batches", "0",
       "--corpus-mb", "1", "--xla-option",
       "xla_gpu_all_reduce_combine_threshold_bytes=0"], cwd=tmp_path, env=env,
      capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-2000:]
  assert "parameters bitwise identical on all 8 devices: True" in out.stdout
  # two steps leave onebit_adamw one dense step: the run says what follows
  assert "warning: a dense warm-up of 1 step(s)" in out.stdout
  # and the README's demo path: a plan made inside train_lm (one step)
  demo = subprocess.run(
      [sys.executable, str(REPO / "examples" / "train_lm.py"), "--steps", "1",
       "--eval-batches", "0", "--corpus-mb", "1", "--strategy", "auto",
       "--costs", "costs.json"], cwd=tmp_path, env=env, capture_output=True,
      text=True, timeout=300)
  assert demo.returncode == 0, demo.stderr[-2000:]
  assert "strategy=auto" in demo.stdout
  bad = subprocess.run(
      [sys.executable, str(REPO / "examples" / "train_lm.py"),
       "--xla-option", "no_such_xla_option=1"], cwd=tmp_path, env=env,
      capture_output=True, text=True, timeout=300)
  assert bad.returncode != 0
  assert "--xla-option: XLA rejects" in bad.stderr
  assert "no_such_xla_option" in bad.stderr and "Traceback" not in bad.stderr


def test_profile_summary_says_what_was_not_measured():
  """A costs file from before the bucket and scheme costs were profiled
  reads them as 0: the summary says they were not measured, not "0 µs"."""
  line = LinearCost(1e-5, 1e-9)
  old = Costs({"allgather": line, "psum": line}, line, ())
  text = cli.format_costs(old)
  assert "bucket    not measured" in text and "per sparse bucket" not in text
  assert "zen, spardl, hier compute not measured" in text
  new = old.replace(bucket=2.5e-4, schemes={"zen": LinearCost(0.0, 1e-9)},
                    provenance={"bucket": {}})
  text = cli.format_costs(new)
  assert "bucket    250 µs per sparse bucket" in text
  assert "zen       compute α = 0 µs" in text
  assert "spardl, hier compute not measured" in text
  # Measured as 0 (timing noise below α) is a measurement: shown as such.
  assert "bucket    0 µs per sparse bucket" in cli.format_costs(
      old.replace(provenance={"bucket": {}}))


def test_plan_refuses_to_write_over_its_costs(workdir, capsys, monkeypatch,
                                              tmp_path):
  """-o naming the --costs file is refused and the costs stay; a headroom
  of inf is one line of error, not a traceback."""
  monkeypatch.chdir(workdir)
  costs = tmp_path / "c.json"
  hand_costs(NUM_LEAVES).save(costs)
  before = costs.read_text()
  assert "would overwrite the costs" in error_of(
      capsys, "plan", "tinymodel:make", "--costs", str(costs), "-o",
      str(costs))
  assert costs.read_text() == before
  assert "headroom=inf must be a finite number" in error_of(
      capsys, "plan", "tinymodel:make", "--headroom", "inf", "-o",
      str(tmp_path / "p.json"))
  assert not (tmp_path / "p.json").exists()
