"""The ``jaxfuse`` command against inputs it must check: costs of another
model, a costs file's missing or absurd fields, collectives that cannot run
on K, one-device profiles, failing models; the η a plan was made for; and
whole-or-nothing charts. In process, nothing profiled (cheap)."""

import dataclasses
import json
import os
import pathlib
import re
import textwrap

import jax
import pytest

import jaxfuse
from jaxfuse.planning import cli
from jaxfuse.planning import profiling
from jaxfuse.planning import timeline_plot
from jaxfuse.planning.costs import Costs
from jaxfuse.planning.costs import CostsError
from jaxfuse.planning.costs import LinearCost
from jaxfuse.planning.simulate import simulate

REPO = pathlib.Path(__file__).resolve().parent.parent

MODELS = textwrap.dedent('''
    import jax.numpy as jnp
    import numpy as np

    def make():
      """Two dense layers, four leaves, and a sample batch."""
      rng = np.random.default_rng(0)
      params = {
          "dense1": {"kernel": rng.standard_normal((256, 512), np.float32),
                     "bias": np.zeros(512, np.float32)},
          "dense2": {"kernel": rng.standard_normal((512, 8), np.float32),
                     "bias": np.zeros(8, np.float32)},
      }
      x = rng.standard_normal((16, 256), np.float32)

      def loss_fn(p, x):
        h = jnp.tanh(x @ p["dense1"]["kernel"] + p["dense1"]["bias"])
        return jnp.mean((h @ p["dense2"]["kernel"] + p["dense2"]["bias"]) ** 2)
      return loss_fn, params, x

    def other():
      """Another model of four leaves."""
      params = {"a": {"b": np.zeros(64, np.float32),
                      "w": np.ones((128, 64), np.float32)},
                "c": {"b": np.zeros(4, np.float32),
                      "w": np.ones((64, 4), np.float32)}}
      return params

    def failing_loss():
      def loss_fn(p, x):
        raise RuntimeError("the loss broke")
      return loss_fn, {"w": np.ones((64, 64), np.float32)}, np.ones(3)
''')
# make()'s leaves as jaxfuse.plan and `jaxfuse profile --model` name them
LEAVES = [["['dense1']['bias']", [512]], ["['dense1']['kernel']", [256, 512]],
          ["['dense2']['bias']", [8]], ["['dense2']['kernel']", [512, 8]]]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
  d = tmp_path_factory.mktemp("cli_inputs")
  (d / "models.py").write_text(MODELS)
  return d


def error_of(capsys, *argv) -> str:
  assert cli.main(list(argv)) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "Traceback" not in err, err
  return err


def hand_costs(leaves=None, **changes):
  provenance = {} if leaves is None else {"leaves": leaves}
  return Costs({"allgather": LinearCost(1e-4, 1e-9),
                "psum": LinearCost(1e-4, 2e-9)}, LinearCost(1e-5, 1e-8),
               (1e-3,) * 4, overlap=0.5, forward=2e-3,
               provenance=provenance).replace(**changes)


def predicted(out: str) -> str:
  return re.search(r"predicted step (\S+ ms)", out).group(1)


# --- the η a plan was made for ------------------------------------------------

def test_show_simulates_at_the_overlap_the_plan_was_made_for(
    workdir, capsys, monkeypatch, tmp_path):
  """`plan --overlap 1` records η = 1 (the costs' is 0.5); `show` predicts
  the step `plan` printed, at η = 1, and `show --overlap 0` at 0."""
  monkeypatch.chdir(workdir)
  costs = hand_costs()
  costs.save(tmp_path / "c.json")
  plan_file = str(tmp_path / "p.json")
  assert cli.main(["plan", "models:make", "--strategy", "mgwfbp", "--costs",
                   str(tmp_path / "c.json"), "--overlap", "1", "-o",
                   plan_file]) == 0
  planned = capsys.readouterr().out
  plan = jaxfuse.Plan.load(plan_file)
  assert plan.provenance["overlap"] == 1.0
  at = {eta: f"{simulate(plan, costs.replace(overlap=eta)).iteration * 1e3:.3f}"
        " ms" for eta in (0.0, 0.5, 1.0)}
  assert len(set(at.values())) == 3   # η matters for this plan
  assert predicted(planned) == at[1.0]
  assert cli.main(["show", plan_file, "--costs", str(tmp_path / "c.json")]) == 0
  out = capsys.readouterr().out
  assert predicted(out) == at[1.0] and "η = 1.00, the plan's" in out
  assert cli.main(["show", plan_file, "--costs", str(tmp_path / "c.json"),
                   "--overlap", "0"]) == 0
  out = capsys.readouterr().out
  assert predicted(out) == at[0.0] and "η = 0.00, --overlap" in out
  # a plan made before η was recorded: the costs' η
  old = dataclasses.replace(plan, provenance={
      k: v for k, v in plan.provenance.items() if k != "overlap"})
  old.save(tmp_path / "old.json")
  assert cli.main(["show", str(tmp_path / "old.json"), "--costs",
                   str(tmp_path / "c.json")]) == 0
  out = capsys.readouterr().out
  assert predicted(out) == at[0.5] and "η = 0.50, the costs'" in out
  assert "give --costs" in error_of(capsys, "show", plan_file, "--overlap",
                                    "0.5")


# --- costs of another model ---------------------------------------------------

def test_profile_records_the_model_leaves():
  params = {"dense1": {"kernel": jax.ShapeDtypeStruct((256, 512), "float32"),
                       "bias": jax.ShapeDtypeStruct((512,), "float32")},
            "dense2": {"kernel": jax.ShapeDtypeStruct((512, 8), "float32"),
                       "bias": jax.ShapeDtypeStruct((8,), "float32")}}
  assert profiling._model_leaves(params) == LEAVES  # pylint: disable=protected-access


def test_costs_of_another_model_are_refused(workdir, capsys, monkeypatch,
                                            tmp_path):
  """Costs measured on make()'s four leaves: planning other() (four leaves
  too) is refused naming the first leaf that differs and the fix; costs
  without the record (older files) still plan any model of four leaves."""
  monkeypatch.chdir(workdir)
  hand_costs(LEAVES).save(tmp_path / "c.json")
  err = error_of(capsys, "plan", "models:other", "--costs",
                 str(tmp_path / "c.json"), "-o", str(tmp_path / "p.json"))
  assert ("leaf 0 is ['dense1']['bias'] [512] in the costs but "
          "['a']['b'] [64] in params" in err)
  assert "`jaxfuse profile --model MODULE:FUNCTION`" in err
  assert not (tmp_path / "p.json").exists()
  # the same leaves: planned; show refuses those costs for other()'s plan
  assert cli.main(["plan", "models:make", "--costs", str(tmp_path / "c.json"),
                   "-o", str(tmp_path / "p.json")]) == 0
  assert cli.main(["plan", "models:other", "--strategy", "single", "-o",
                   str(tmp_path / "other.json")]) == 0
  capsys.readouterr()
  err = error_of(capsys, "show", str(tmp_path / "other.json"), "--costs",
                 str(tmp_path / "c.json"))
  assert "leaf 0 is ['dense1']['bias'] [512] in the costs but ['a']['b'] [64]" \
      in err
  # only the last leaf differs: that one is named
  changed = [*LEAVES[:3], ["['dense2']['kernel']", [512, 9]]]
  with pytest.raises(CostsError, match=re.escape(
      "leaf 3 is ['dense2']['kernel'] [512, 9] in the costs but "
      "['dense2']['kernel'] [512, 8] in the plan")):
    simulate(jaxfuse.Plan.load(tmp_path / "p.json"), hand_costs(changed))
  # no record: loads and plans (no check)
  hand_costs().save(tmp_path / "old.json")
  assert "leaves" not in json.loads(
      (tmp_path / "old.json").read_text())["provenance"]
  assert cli.main(["plan", "models:other", "--costs",
                   str(tmp_path / "old.json"), "-o",
                   str(tmp_path / "p2.json")]) == 0
  capsys.readouterr()
  with pytest.raises(CostsError, match="provenance.leaves"):
    hand_costs([["['a']", "wide"]])


# --- profiles -----------------------------------------------------------------

def test_profile_refuses_one_device(capsys, tmp_path):
  err = error_of(capsys, "profile", "--devices", "1", "-q", "-o",
                 str(tmp_path / "c.json"))
  assert "at least 2 devices" in err and "--devices 2 or more" in err
  assert not (tmp_path / "c.json").exists()
  mesh = jaxfuse.make_mesh(1)
  with pytest.raises(profiling.ProfileError, match="has one device"):
    profiling.profile(mesh)


def test_profile_errors_are_one_line(workdir, capsys, monkeypatch, tmp_path):
  """A model whose loss fails is reported before measuring; running out
  of memory names the sweeps to shrink (--debug: the traceback)."""
  monkeypatch.chdir(workdir)
  err = error_of(capsys, "profile", "--model", "models:failing_loss", "-q",
                 "-o", str(tmp_path / "c.json"))
  assert "--model models:failing_loss" in err
  assert "RuntimeError: the loss broke" in err

  def out_of_memory(*args, **kwargs):
    raise MemoryError("Unable to allocate 8.00 TiB for an array")
  monkeypatch.setattr(profiling, "profile", out_of_memory)
  assert cli.main(["profile", "-q", "--sizes", "4K", "1024G", "-o",
                   str(tmp_path / "c.json")]) == 2
  started, err = capsys.readouterr().err.splitlines()   # no traceback
  assert started.startswith("profiling on ")
  assert "out of memory while profiling" in err and "8.00 TiB" in err
  assert "smaller --sizes" in err
  with pytest.raises(cli.UsageError) as e:
    cli.main(["--debug", "profile", "-q", "-o", str(tmp_path / "c.json")])
  assert isinstance(e.value.__cause__, MemoryError)


# --- costs files --------------------------------------------------------------

def _body(**changes):
  body = json.loads(hand_costs().to_json())
  for key, value in changes.items():
    if value is KeyError:
      del body[key]
    else:
      body[key] = value
  return body


@pytest.mark.parametrize("field", ["overlap", "workers", "forward"])
def test_version_2_costs_need_the_fields_profile_writes(field):
  with pytest.raises(CostsError, match=re.escape(
      f"(version 2) is missing the field {field!r}")) as e:
    Costs.from_json(json.dumps(_body(**{field: KeyError})))
  assert "`jaxfuse profile`" in str(e.value)
  # version 1 (before they were all written): the defaults
  old = Costs.from_json(json.dumps(_body(**{field: KeyError, "version": 1})))
  assert getattr(old, field) == {"overlap": 1.0, "workers": 2,
                                 "forward": 0.0}[field]


@pytest.mark.parametrize("changes, message", [
    ({"forward": 10**400}, "forward=1" + "0" * 19 + "…"),
    ({"backward": [1e308] * 4}, "backward[0]=1e+308"),
    ({"collectives": {"allgather": {"alpha": 1e300, "beta": 0},
                      "psum": {"alpha": 0, "beta": 0}}},
     "'collectives.allgather': alpha=1e+300"),
    ({"bucket": 2e9}, "bucket=2000000000.0"),
])
def test_absurd_numbers_are_refused_at_load(changes, message):
  with pytest.raises(CostsError, match=re.escape(message)) as e:
    Costs.from_json(json.dumps(_body(**changes)))
  assert "must be finite and in [0, 1e+09]" in str(e.value)


@pytest.mark.parametrize("mesh", [[8], {"data": "x"}, {"data": 0}, "8"])
def test_a_malformed_mesh_of_an_old_file_is_named(mesh):
  body = _body(workers=KeyError, version=1)
  body["provenance"] = {"devices": {"mesh": mesh}}
  with pytest.raises(CostsError, match=re.escape(
      "'provenance.devices.mesh'")) as e:
    Costs.from_json(json.dumps(body))
  assert "Add 'workers'" in str(e.value)
  body["provenance"] = {"devices": {"mesh": {"hosts": 2, "data": 4}}}
  assert Costs.from_json(json.dumps(body)).workers == 8


def test_cli_reports_bad_costs_numbers_in_one_line(workdir, capsys,
                                                   monkeypatch, tmp_path):
  monkeypatch.chdir(workdir)
  assert cli.main(["plan", "models:make", "--strategy", "single", "-o",
                   str(tmp_path / "p.json")]) == 0
  capsys.readouterr()
  for name, body in (("huge", _body(backward=[1e308] * 4)),
                     ("big_int", _body(forward=10**400))):
    (tmp_path / f"{name}.json").write_text(json.dumps(body))
    err = error_of(capsys, "show", str(tmp_path / "p.json"), "--costs",
                   str(tmp_path / f"{name}.json"))
    assert "must be finite" in err


# --- plans --------------------------------------------------------------------

def test_a_plan_whose_leaf_path_is_not_a_string(capsys, tmp_path):
  plan = jaxfuse.plan([jax.ShapeDtypeStruct((4096,), "float32")])
  body = json.loads(plan.to_json())
  body["leaves"][0]["path"] = None
  (tmp_path / "p.json").write_text(json.dumps(body))
  err = error_of(capsys, "show", str(tmp_path / "p.json"))
  assert "leaf 0: path=None must be a string" in err


def test_capacity_error_gives_the_right_fix():
  plan = jaxfuse.plan([jax.ShapeDtypeStruct((4096,), "float32")])
  for capacity in (0, 5000):
    leaf = dataclasses.replace(plan.leaves[0], capacity=capacity)
    with pytest.raises(jaxfuse.plans.PlanError) as e:
      jaxfuse.Plan((leaf,), plan.buckets, plan.settings)
    message = str(e.value)
    assert f"capacity={capacity} must be an integer in [1, 4096]" in message
    assert "raise density" not in message
    assert "make the plan again" in message


def test_collective_that_cannot_run_on_k_is_refused_at_plan_time(
    workdir, capsys, monkeypatch):
  monkeypatch.chdir(workdir)
  err = error_of(capsys, "plan", "models:make", "--collective", "zen",
                 "--workers", "128")
  assert ("collective 'zen' hashes into one partition per worker and takes "
          "at most 64 workers, got 128" in err)
  params = [jax.ShapeDtypeStruct((4096,), "float32")]
  with pytest.raises(jaxfuse.plans.PlanError, match="at most 64 workers"):
    jaxfuse.plan(params, collective="zen", num_workers=128)
  with pytest.raises(jaxfuse.plans.PlanError, match="at most 64 workers"):
    jaxfuse.plan(params, collective="zen", costs=hand_costs(
        workers=128, backward=(1e-3,)))
  # 64 workers, or every leaf dense: nothing for zen to refuse
  assert jaxfuse.plan(params, collective="zen", num_workers=64).buckets
  assert jaxfuse.plan(params, collective="zen", num_workers=128,
                      density=1.0).buckets


def test_plan_messages_name_the_flags(workdir, capsys, monkeypatch, tmp_path):
  monkeypatch.chdir(workdir)
  err = error_of(capsys, "plan", "models:make", "--strategy", "auto")
  assert "--strategy auto" in err and "give --costs COSTS.json" in err
  assert "costs=" not in err
  hand_costs().save(tmp_path / "c.json")
  err = error_of(capsys, "plan", "models:make", "--costs",
                 str(tmp_path / "c.json"), "--last-bucket-bytes", "16M")
  assert ("--strategy auto (the default with --costs) chooses its groups "
          "from the costs" in err)
  assert "strategy='auto'" not in err and "last_bucket_bytes" not in err
  err = error_of(capsys, "plan", "models:make", "--costs",
                 str(tmp_path / "c.json"), "--strategy", "cupcake",
                 "--last-bucket-bytes", "16M")
  assert "but --strategy cupcake chooses" in err


# --- charts -------------------------------------------------------------------

def test_a_chart_is_written_whole_or_not_at_all(tmp_path, monkeypatch):
  """A savefig that fails half-way leaves the old chart as it was and no
  temporary file; one that works replaces it, keeping its mode."""
  pytest.importorskip("matplotlib")
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top
  plan = jaxfuse.plan([jax.ShapeDtypeStruct((4096,), "float32")])
  costs = hand_costs(backward=(1e-3,))
  timeline = simulate(plan, costs)
  target = tmp_path / "t.png"
  target.write_bytes(b"old chart")
  os.chmod(target, 0o640)
  real = Figure.savefig

  def broken(self, fname, **kwargs):
    del self, kwargs
    if isinstance(fname, (str, os.PathLike)):
      pathlib.Path(fname).write_bytes(b"half")
    else:
      fname.write(b"half")
    raise RuntimeError("disk full")
  monkeypatch.setattr(Figure, "savefig", broken)
  with pytest.raises(RuntimeError, match="disk full"):
    timeline_plot.plot_timeline(plan, timeline, target)
  assert target.read_bytes() == b"old chart"
  assert sorted(p.name for p in tmp_path.iterdir()) == ["t.png"]
  monkeypatch.setattr(Figure, "savefig", real)
  timeline_plot.plot_timeline(plan, timeline, target)
  assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert os.stat(target).st_mode & 0o777 == 0o640
  assert sorted(p.name for p in tmp_path.iterdir()) == ["t.png"]
  timeline_plot.plot_timeline(plan, timeline, tmp_path / "chart")
  assert (tmp_path / "chart.png").read_bytes()[:4] == b"\x89PNG"
  timeline_plot.plot_timeline(plan, timeline, tmp_path / "t.svg")
  assert b"<svg" in (tmp_path / "t.svg").read_bytes()[:1000]


# --- docs ---------------------------------------------------------------------

def test_cli_doc_worked_example_is_what_plan_prints(capsys, tmp_path):
  """docs/cli.md's ratios of the tiny LM's plan at density 0.05 on 8
  workers are the ones `jaxfuse plan` prints."""
  pytest.importorskip("flax")
  doc = " ".join((REPO / "docs" / "cli.md").read_text().split())
  command = ("jaxfuse plan examples/lm_model.py:tiny --density 0.05 "
             "--workers 8")
  assert command in doc
  assert cli.main(["plan", str(REPO / "examples" / "lm_model.py") + ":tiny",
                   "--density", "0.05", "--workers", "8", "-o",
                   str(tmp_path / "p.json")]) == 0
  out = capsys.readouterr().out
  payload, sent = re.search(r"dense \(([\d.]+)%\); on 8 workers each sends "
                            r"[\d,]+ B, ([\d.]+)%", out).groups()
  assert f"payload of {payload} % of dense" in doc
  assert f"sends {sent} % of the all-reduce's bytes" in doc
