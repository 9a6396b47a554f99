"""examples/train_lm.py's ``--send-early-window`` (checked where it is
parsed, and handed to ``jaxfuse.send_early`` as its window),
``--trace-steps`` (checked, and resolved against the run's steps), the
plan's options (``--headroom`` reaching the plan's slot counts) and
``--predict`` (the gradient at ``jaxfuse.predicted_params``), and the
log's bytes line (what a worker sends against a dense all-reduce)."""

import math
import os
import pathlib
import re

import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from _harness import repo_modules


@pytest.fixture(scope="module")
def example():
  with repo_modules("examples", "train_lm", "train_lm_args") as modules:
    yield modules


@pytest.mark.parametrize("argv, message", [
    (["--send-early-window", "2"], "give --send-early too"),
    (["--send-early-window", "1"], "give --send-early too"),
    (["--send-early", "--send-early-window", "-1"],
     "--send-early-window -1: give a number of points >= 1, or 0"),
    (["--trace-steps", "3:5"], "give --trace-dir too"),
    (["--trace-dir", "t", "--trace-steps", "5:5"],
     "'5:5': give the first step and the step after the last, like 300:305"),
    (["--trace-dir", "t", "--trace-steps", "7"], "like 300:305"),
    (["--headroom", "0.8"], "--headroom 0.8: give a number >= 1"),
    (["--predict"], "--predict predicts where a delayed gradient lands: add "
     "--delay"),
    (["--apply-if-finite", "-1"], "--apply-if-finite -1: give the number of "
     "skips in a row (>= 0)"),
    # 0 used to read as "the preset's"; a negative count failed deep inside
    (["--steps", "0"], "--steps 0: give a number > 0 (leave it out for the "
     "preset's)"),
    (["--steps", "-1"], "--steps -1: give a number > 0"),
    (["--lr", "0"], "--lr 0: give a number > 0"),
    (["--batch-size", "0"], "--batch-size 0: give a number > 0"),
    (["--log-every", "0"], "--log-every 0: give a number > 0"),
    (["--bucket-bytes", "0"], "--bucket-bytes 0: give a number > 0"),
    (["--corpus-mb", "0.01"], "--corpus-mb 0.01: give at least 0.1"),
    (["--eval-every", "-1"], "--eval-every -1: give a number >= 0"),
    (["--dense-warmup", "-5"], "--dense-warmup -5: give a number >= 0"),
    (["--density", "1.5"], "--density 1.5: give a share of each sparse leaf "
     "in (0, 1]"),
    (["--dense-warmup", "0"], "the README recipe: 10% of the steps)"),
    (["--momentum", "0.5"], "--momentum is sgd's and demo's; --optimizer "
     "onebit_adamw has none"),
    (["--plan", "p.json", "--sync", "dense"], "--plan is a jaxfuse plan; "
     "--sync dense makes none"),
    (["--plan", "/nonexistent/p.json"], "--plan /nonexistent/p.json: no "
     "such file"),
    (["--json-out", "/nonexistent/r.json"], "its folder does not exist"),
    (["--warmup-densities", ","], "',': give densities like 0.25,0.0625"),
])
def test_bad_arguments_stop_with_the_fix(example, capsys, argv, message):
  _, args_lib = example
  with pytest.raises(SystemExit):
    args_lib.parse_args(argv)
  assert message in capsys.readouterr().err


def test_a_dense_warmup_as_long_as_the_run_is_refused(example):
  train_lm, args_lib = example
  args = args_lib.parse_args(["--dense-warmup", "10"])
  with pytest.raises(SystemExit, match="--dense-warmup 10 covers all 3 "
                     "steps, so no step would be sparse"):
    train_lm.resolve_warmup_steps(args, 3)
  args = args_lib.parse_args(["--dense-warmup", "10", "--sync", "dense"])
  train_lm.resolve_warmup_steps(args, 3)   # dense training: every step is
  assert args.dense_warmup == 10


def test_cpu_devices_flag_wins_over_the_exported_count(example,
                                                       monkeypatch):
  train_lm, _ = example
  monkeypatch.setenv("XLA_FLAGS", "")
  monkeypatch.setenv("JAX_NUM_CPU_DEVICES", "8")
  train_lm._cpu_devices_env(["--cpu-devices", "4"])  # pylint: disable=protected-access
  assert os.environ["JAX_NUM_CPU_DEVICES"] == "4"
  assert "device_count=4" in os.environ["XLA_FLAGS"]
  monkeypatch.setenv("XLA_FLAGS", "")
  train_lm._cpu_devices_env([])  # pylint: disable=protected-access
  assert os.environ["JAX_NUM_CPU_DEVICES"] == "4"   # exported: kept
  assert "device_count=4" in os.environ["XLA_FLAGS"]


def test_the_window_reaches_send_early(example, monkeypatch):
  train_lm, args_lib = example
  assert args_lib.parse_args(["--send-early"]).send_early_window == 2
  assert args_lib.parse_args(
      ["--send-early", "--send-early-window", "1"]).send_early_window == 1
  seen = []

  def recording(step, *, window):
    seen.append(window)
    return step

  monkeypatch.setattr(train_lm.jaxfuse, "send_early", recording)
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), (train_lm.AXIS,))
  for window in (1, 2, 0):
    train_lm.make_train_step(lambda p, b: 0.0, optax.sgd(0.1), mesh, P(),
                             "jaxfuse", send_early=True, window=window)
  train_lm.make_train_step(lambda p, b: 0.0, optax.sgd(0.1), mesh, P(),
                           "jaxfuse", send_early=False, window=2)
  assert seen == [1, 2, None]


def test_predict_takes_the_gradient_at_the_predicted_parameters(example):
  """With ``predict`` the step differentiates at θ + u_{t−1}: on ½‖θ‖² the
  gradient is the point it is taken at, which waits in the state."""
  train_lm, _ = example
  import jaxfuse  # pylint: disable=g-import-not-at-top
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), (train_lm.AXIS,))
  params = {"w": jax.numpy.arange(1.0, 4.0)}
  plan = jaxfuse.with_density(jaxfuse.plan(params), 1.0)
  opt = jaxfuse.delayed(jaxfuse.sgd(plan, 0.25, momentum=0.0), predict=True)
  state = jaxfuse.init_state(opt, params, mesh)
  step = train_lm.make_train_step(
      lambda p, b: 0.5 * jax.numpy.sum(p["w"] ** 2), opt, mesh,
      jaxfuse.state_specs(state), "jaxfuse", predict=True)
  batch = np.zeros((1, 2), np.int32)
  history = [np.asarray(params["w"])]
  for _ in range(3):
    params, state, _ = step(params, state, batch)
    history.append(np.asarray(params["w"]))
  # θ3 = θ2 + u2 with u2 = −0.25·(θ1 + u0), u0 = 0: the gradient of step 1.
  np.testing.assert_allclose(history[3] - history[2], -0.25 * history[1])
  # Step 2's gradient, waiting, was taken at θ2 + u1 (not at θ2).
  np.testing.assert_allclose(
      np.asarray(state.pending.inner["w"])[0],
      history[2] + (history[2] - history[1]))


@pytest.mark.parametrize("headroom", [1.5, 1.2])
def test_headroom_sets_the_plans_slots(example, headroom):
  """c = ⌈ρ·n·headroom⌉ slots per sparse leaf, and the estimator, bucket
  size and density given reach the plan too."""
  train_lm, args_lib = example
  argv = ["--density", "0.05", "--strategy", "size", "--bucket-bytes",
          str(10_000), "--estimator", "gaussian"]
  if headroom != 1.5:
    argv += ["--headroom", str(headroom)]
  args = args_lib.parse_args(argv)
  params = {"a": np.zeros((100, 100), np.float32),
            "b": np.zeros((3000,), np.float32)}
  plan = train_lm.jaxfuse.plan(params, **train_lm.plan_options(args))
  assert [l.capacity for l in plan.leaves] == [
      math.ceil(0.05 * 10_000 * headroom), math.ceil(0.05 * 3000 * headroom)]
  assert {l.estimator for l in plan.leaves} == {"gaussian"}
  assert len(plan.buckets) == 2   # 12 and 40 kB against 10 kB: a leaf each
  assert plan.provenance["strategy"] == "size"
  assert plan.provenance["parameters"]["bucket_bytes"] == 10_000


@pytest.mark.parametrize("strategy", ["size", "auto"])
def test_scheme_flags_configure_the_schemes_auto_may_pick(example, strategy):
  """--spardl-block and --packed-indices reach the schemes a plan runs:
  the --collective one under a rule strategy, and every one auto may pick."""
  train_lm, args_lib = example
  collectives = train_lm.jaxfuse.collectives
  args = args_lib.parse_args(["--strategy", strategy, "--spardl-block", "3",
                              "--packed-indices"])
  scheme = train_lm.plan_options(args)["collective"]
  gather = collectives.AllGather(packed_indices=True)
  if strategy == "size":
    assert scheme == gather
  else:
    assert scheme == (gather, collectives.SparDL(block=3.0))


def test_trace_steps_default_to_the_last_five_within_the_run(example):
  _, args_lib = example
  parse = lambda *a: args_lib.parse_args(list(a))
  assert args_lib.trace_steps(parse(), 0, 100) == range(0)
  assert args_lib.trace_steps(parse("--trace-dir", "t"), 0, 100) == range(
      95, 100)
  assert args_lib.trace_steps(parse("--trace-dir", "t"), 98, 100) == range(
      98, 100)                                   # resumed near the end
  assert args_lib.trace_steps(
      parse("--trace-dir", "t", "--trace-steps", "300:305"), 0, 1000) == (
          range(300, 305))
  with pytest.raises(SystemExit, match=r"--trace-steps 300:305: give steps "
                     r"within this run's 0:200"):
    args_lib.trace_steps(
        parse("--trace-dir", "t", "--trace-steps", "300:305"), 0, 200)


def test_the_log_names_what_a_worker_sends_against_a_dense_all_reduce(
    example):
  """Two sparse leaves of 500 and 150 exact slots (8 bytes each) on one
  all-gather each: a worker sends its 5,200 B to each of K − 1 = 3 peers,
  15,600 B, against a ring all-reduce's 2·3/4 of the 52,000 dense bytes."""
  train_lm, args_lib = example
  args = args_lib.parse_args(["--density", "0.05", "--strategy", "size",
                              "--bucket-bytes", "10000", "--estimator",
                              "topk"])
  params = {"a": np.zeros((100, 100), np.float32),
            "b": np.zeros((3000,), np.float32)}
  plan = train_lm.jaxfuse.plan(params, **train_lm.plan_options(args))
  assert plan.bytes_per_worker() == 5_200
  assert train_lm.sent_line(plan, 4, 52_000) == (
      "; on 4 workers each sends 15,600 B = 0.2000 x a dense "
      "all-reduce's (78,000 B)")
  assert train_lm.sent_line(None, 4, 52_000).endswith(
      "78,000 B = 1.0000 x a dense all-reduce's (78,000 B)")
  assert train_lm.sent_line(plan, 1, 52_000) == ""   # one worker sends none


def test_the_warmup_line_names_a_density_that_runs_dense(example):
  """At ρ = 6.25 % with 1.5 slots per element sent, an all-gather
  receives 0.0625·1.5·8 B·(K − 1) per element: 5.25 B on 8 workers, more
  than a bfloat16 ring all-reduce's 2·(7/8)·2 B = 3.5 (that phase runs
  dense), 0.75 B on 2 workers, less than 2 B (it stays)."""
  train_lm, args_lib = example
  args = args_lib.parse_args(["--density", "0.05", "--dense-warmup", "20",
                              "--warmup-steps", "10", "--warmup-densities",
                              "0.0625", "--dense-wire", "bfloat16"])
  plan = train_lm.jaxfuse.plan({"w": np.zeros((100, 100), np.float32)},
                               density=0.05, estimator="topk")
  line = lambda k: args_lib.warmup_line(
      args, args_lib.warmup_phases(args, plan, 20, k), 100, k)
  assert line(8) == ("warm-up: steps 0-30 density 1, steps 30-100 density "
                     "0.05 (density 0.0625 runs dense on 8 workers: its "
                     "all-gather would receive at least a dense step's "
                     "bytes)")
  assert line(2) == ("warm-up: steps 0-20 density 1, steps 20-30 density "
                     "0.0625, steps 30-100 density 0.05")


@pytest.mark.parametrize("density", [0.05, 0.1])
def test_the_defaults_are_the_readme_recipe(example, density):
  """examples/train_lm.py with no plan or warm-up flags trains the README
  recipe: onebit_adamw on a `size` 64 MiB plan made for the run's K
  workers (each sparse bucket's scheme the one that sends the fewest
  bytes on K); 10 % of the steps dense
  on a bfloat16 wire, then 5 % at density 6.25 % (left out when the plan
  is as dense), then the plan. DGC's ramp is one flag away."""
  train_lm, args_lib = example
  jaxfuse = train_lm.jaxfuse
  k = min(2, jax.device_count())   # one GPU: one worker
  params = {"w": np.zeros((64, 64), np.float32),
            "b": np.zeros((64,), np.float32)}
  loss_fn = lambda p, x: ((x @ p["w"] + p["b"]) ** 2).mean()
  batch = np.ones((4, 64), np.float32)
  mesh = jaxfuse.make_mesh(k, train_lm.AXIS)

  resolved = {}   # the warm-up densities the run's JSON records

  def phases_of(argv):
    args = args_lib.parse_args(["--density", str(density)] + argv)
    train_lm.resolve_warmup_steps(args, 1000)
    make_opt = lambda plan: train_lm.make_optimizer(
        args, 1e-3, jax.tree.map(lambda x: x.ndim >= 2, params), plan)
    phases = train_lm.setup_sync(args, 1000, params, loss_fn, batch, mesh,
                                 make_opt, np.float32, lambda *a: None).phases
    resolved[" ".join(argv)] = args.warmup_densities
    return phases

  plan = jaxfuse.plan(params, density=density, strategy="size",
                      bucket_bytes=64 * 2**20, num_workers=k,
                      order=jaxfuse.planning.ordering.FromLoss(
                          loss_fn, (batch,)))
  assert plan.provenance["parameters"]["bucket_bytes"] == 64 * 2**20
  assert plan.provenance["parameters"]["collective"] == (
      "fewest bytes" if k > 1 else "allgather")
  ramp = (0.0625,) if density < 0.0625 else ()
  want = jaxfuse.density_warmup(plan, dense_steps=100,
                                steps=50 if ramp else 0, densities=ramp,
                                dense_wire="bfloat16", workers=k)
  got = phases_of([])
  assert [(p.start, p.stop, p.plan) for p in got] == [
      (p.start, p.stop, p.plan) for p in want]
  assert got[0].plan.settings.full_wire == "bfloat16"
  assert [p.stop for p in got] == ([100, 150, None] if ramp else [100, None])
  assert resolved[""] == list(ramp)
  dgc = jaxfuse.density_warmup(plan, dense_steps=100, steps=50,
                               dense_wire="bfloat16", workers=k)
  assert [(p.start, p.stop, p.plan) for p in phases_of(
      ["--warmup-densities", "dgc"])] == [(p.start, p.stop, p.plan)
                                          for p in dgc]
  assert resolved["--warmup-densities dgc"] == "dgc"
  # on 2 workers DGC's 25 % runs dense (its all-gather would move more
  # than the dense step); 6.25 % (when above ρ) stays sparse
  want_stops = {2: [150, 200, None] if ramp else [150, None],
                1: [100, 150, 200, None] if ramp else [100, 150, None]}[k]
  assert [p.stop for p in dgc] == want_stops


def test_the_readme_spells_out_the_defaults(example):
  """The README's spelled-out recipe flags change nothing of the
  defaults: the two cannot drift apart unnoticed."""
  train_lm, args_lib = example
  readme = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
  spelled = re.search(r"spelled out, the same run is `([^`]*)`", readme,
                      re.S).group(1).split()
  assert "--strategy" in spelled and "--dense-warmup" in spelled
  base = ["--preset", "gpt2-small", "--steps", "1000"]
  default, given = (args_lib.parse_args(base + extra)
                    for extra in ([], spelled))
  for args in (default, given):
    train_lm.resolve_warmup_steps(args, 1000)
  assert train_lm.plan_options(default) == train_lm.plan_options(given)
  for field in ("optimizer", "density", "dense_warmup", "dense_wire",
                "warmup_steps"):
    assert getattr(default, field) == getattr(given, field), field
  assert default.warmup_densities is None   # resolved against the plan
  assert given.warmup_densities == list(args_lib.ONEBIT_WARMUP_DENSITIES)


@pytest.mark.parametrize("argv, bucket_bytes", [
    ([], 64 * 2**20),                              # the README recipe's
    (["--bucket-bytes", "1000"], 1000),
    (["--strategy", "aligned"], None),             # jaxfuse.plan's own
    (["--sync", "behind"], None),
    (["--sync", "dense"], None),                   # no plan at all
])
def test_the_bucket_size_is_resolved_where_the_run_records_it(
    example, argv, bucket_bytes):
  """The run's JSON (``config``) holds the bucket size the plan was made
  with, not the flag's absence."""
  train_lm, args_lib = example
  args = args_lib.parse_args(argv)
  assert args.bucket_bytes == bucket_bytes
  assert train_lm.plan_options(args).get("bucket_bytes") == bucket_bytes


@pytest.mark.parametrize("sync", ["jaxfuse", "dense"])
def test_apply_if_finite_wraps_the_update_rule(example, sync):
  """jaxfuse's wrapper around a recipe (it decides on the synced update),
  optax's around the dense rule (its gradient is already the mean); inside
  --delay."""
  train_lm, args_lib = example
  params = {"w": jax.ShapeDtypeStruct((64, 64), np.float32)}
  plan = (train_lm.jaxfuse.plan(params, density=0.05) if sync == "jaxfuse"
          else None)
  for delay in ([], ["--delay"]) if sync == "jaxfuse" else ([],):
    args = args_lib.parse_args(["--sync", sync, "--apply-if-finite", "2",
                                "--optimizer", "sgd", *delay])
    opt = train_lm.make_optimizer(args, 1e-3, None, plan)
    state = jax.eval_shape(opt.init, params)
    if delay:
      state = state.inner
    want = (train_lm.jaxfuse.ApplyIfFiniteState if sync == "jaxfuse"
            else optax.ApplyIfFiniteState)
    assert type(state) is want   # pylint: disable=unidiomatic-typecheck


def test_flush_steps_lie_between_the_warm_up_phases(example):
  """``--flush-every 4`` on a 2-dense-step warm-up of 10 steps: steps 3
  and 7 on the density-1 plan, the others on their phase's plan (one
  object per plan: each compiles once), the last phase open."""
  train_lm, _ = example
  jaxfuse = train_lm.jaxfuse
  plan = jaxfuse.plan({"w": np.zeros((64, 64), np.float32)}, density=0.05)
  dense, sparse = jaxfuse.with_density(plan, 1.0), plan
  phases = (jaxfuse.Phase(0, 2, dense), jaxfuse.Phase(2, None, sparse))
  flush = jaxfuse.with_density(plan, 1.0)
  got = train_lm.with_flushes(phases, flush, 4, 10)
  assert [(p.start, p.stop) for p in got] == [
      (0, 2), (2, 3), (3, 4), (4, 7), (7, 8), (8, None)]
  assert [p.plan for p in got] == [dense, sparse, flush, sparse, flush,
                                   sparse]
  assert all(a.plan is not b.plan for a, b in zip(got, got[1:]))
  assert train_lm.with_flushes(phases, flush, 0, 10) == tuple(phases)
  assert train_lm.with_flushes(phases, None, 4, 10) == tuple(phases)


@pytest.mark.parametrize("grad_dtype", [None, "bfloat16"])
def test_the_builders_step_is_the_hand_written_one(example, grad_dtype):
  """``--delay --predict`` (and ``--grad-dtype bfloat16``) through
  ``jaxfuse.make_train_step`` with ``step_options``: bitwise the step the
  demo wrote by hand, state and params, over three steps."""
  train_lm, args_lib = example
  import jaxfuse  # pylint: disable=g-import-not-at-top
  argv = ["--delay", "--predict"] + (
      ["--grad-dtype", grad_dtype] if grad_dtype else [])
  args = args_lib.parse_args(argv)
  mesh = jaxfuse.make_mesh(min(2, jax.device_count()), train_lm.AXIS)
  params = {"w": jax.numpy.arange(1.0, 9.0).reshape(2, 4),
            "b": jax.numpy.arange(4.0)}
  plan = jaxfuse.plan(train_lm.cast_params(params, grad_dtype),
                      density=0.5,
                      settings=jaxfuse.Settings(min_sparse_size=4))
  make_opt = lambda plan: jaxfuse.delayed(
      jaxfuse.sgd(plan, 0.25, momentum=0.5), predict=True)
  loss_fn = lambda p, b: jax.numpy.sum(
      (b @ p["w"].astype(jax.numpy.float32) + p["b"]) ** 2)
  batches = [np.arange(k, k + 4 * mesh.size, dtype=np.float32).reshape(
      2 * mesh.size, 2) / 8 for k in range(3)]

  state, step = jaxfuse.make_train_step(
      loss_fn, params, make_opt, plan, mesh,
      train_lm.step_options(args, grad_dtype, {}))
  opt_state = jaxfuse.init_state(
      make_opt(plan), train_lm.cast_params(params, grad_dtype), mesh)
  by_hand = train_lm.make_train_step(
      loss_fn, make_opt(plan), mesh, jaxfuse.state_specs(opt_state),
      "jaxfuse", {}, grad_dtype, predict=True)
  hand = (jax.tree.map(jax.numpy.array, params), opt_state)
  for batch in batches:
    state, loss = step(state, batch)
    *hand, hand_loss = by_hand(*hand, step.place(batch))
  bits = lambda t: [np.asarray(x).tobytes() for x in jax.tree.leaves(t)]
  assert bits((state.params, state.opt_state, loss)) == bits(
      (hand[0], hand[1], hand_loss))


@pytest.mark.parametrize("density, wire", [(0.02, "gradient"),
                                           (0.3, "bfloat16")])
def test_the_recipe_sends_bfloat16_values_where_float32_ones_cost_more(
    example, density, wire):
  """On K = 8 workers a plan at density 0.3 all-gathers more bytes than a
  bfloat16 dense step (its float32 (value, index) slots: 8·0.3·1.5·7 per
  element against 2·2·7/8), so the demo sends the values in bfloat16 and
  says so; at 0.02 (8·0.02·1.5·7 = 1.68) the float32 values pay and stay.
  A --sparse-wire given is kept either way."""
  train_lm, args_lib = example
  jaxfuse = train_lm.jaxfuse
  params = {"w": np.zeros((64, 64), np.float32)}
  loss_fn = lambda p, x: ((x @ p["w"]) ** 2).mean()
  mesh = jaxfuse.make_mesh(8, train_lm.AXIS)
  said = []

  def plan_of(argv):
    args = args_lib.parse_args(["--density", str(density),
                                "--collective", "allgather"] + argv)
    train_lm.resolve_warmup_steps(args, 1000)
    make_opt = lambda plan: train_lm.make_optimizer(
        args, 1e-3, jax.tree.map(lambda x: x.ndim >= 2, params), plan)
    return train_lm.setup_sync(args, 1000, params, loss_fn,
                               np.ones((4, 64), np.float32), mesh, make_opt,
                               np.float32, said.append).plan

  assert plan_of([]).settings.sparse_wire == wire
  assert any("bfloat16" in s and "8 workers" in s for s in said) == (
      wire == "bfloat16")
  assert plan_of(["--sparse-wire", "gradient"]).settings.sparse_wire == (
      "gradient")


@pytest.mark.parametrize("argv, message", [
    (["--simulated-workers", "-2"], "give K >= 1"),
    (["--simulated-workers", "4", "--devices", "2"], "leave out --devices"),
    (["--simulated-workers", "4", "--num-processes", "2"],
     "one process")])
def test_simulated_workers_refuse_what_cannot_apply(example, capsys, argv,
                                                    message):
  _, args_lib = example
  with pytest.raises(SystemExit):
    args_lib.parse_args(argv)
  assert message in capsys.readouterr().err


def test_a_frozen_second_moment_stops_after_n_steps(example):
  """β = (0.9, 0.999), N = 1. Step 1, g = 2: m = 0.2, v = 0.004,
  m̂ = 2, v̂ = 4: update 2 / (2 + ε). Step 2, g = 1: m = 0.28, v stays
  0.004 (v̂ = 0.004 / (1 − 0.999¹) = 4), m̂ = 0.28 / 0.19: update
  (0.28 / 0.19) / 2. Unfrozen (N past the run) it is optax's Adam."""
  del example   # imported train_lm_rules' dependencies
  with repo_modules("examples", "train_lm_rules") as rules:
    _frozen_second_moment_checks(rules.frozen_second_moment)


def _frozen_second_moment_checks(frozen_second_moment):
  tx = frozen_second_moment(0.9, 0.999, 1)
  state = tx.init({"w": np.zeros(3, np.float32)})
  u1, state = tx.update({"w": np.full(3, 2.0, np.float32)}, state)
  u2, state = tx.update({"w": np.ones(3, np.float32)}, state)
  # float32: 1 − 0.999 is 0.0009999871 there
  np.testing.assert_allclose(u1["w"], 2 / (2 + 1e-8), rtol=2e-5)
  np.testing.assert_allclose(state.nu["w"], 0.004, rtol=2e-5)
  np.testing.assert_allclose(u2["w"], 0.28 / 0.19 / 2, rtol=2e-5)
  live, adam = frozen_second_moment(0.9, 0.95, 10), (
      optax.scale_by_adam(0.9, 0.95))
  grads = [{"w": np.random.default_rng(i).normal(size=3).astype(np.float32)}
           for i in range(5)]
  s, t = live.init(grads[0]), adam.init(grads[0])
  for g in grads:
    a, s = live.update(g, s)
    b, t = adam.update(g, t)
    np.testing.assert_allclose(a["w"], b["w"], rtol=1e-5)


@pytest.mark.parametrize("argv, message", [
    (["--b2", "1.0"], "in [0, 1)"),
    (["--optimizer", "sgd", "--b2", "0.95"], "AdamW family"),
    (["--freeze-v-at", "100"], "--sync dense"),
    (["--sync", "dense", "--freeze-v-at", "0"], "N >= 1"),
    (["--local-steps", "-1"], "give H >= 1 inner steps"),
    (["--local-steps", "5", "--optimizer", "sgd"], "(no --optimizer)"),
    (["--local-steps", "5", "--sync", "dense"], "with the jaxfuse --sync"),
    (["--outer-lr", "0.5"], "give --local-steps H and a rate > 0")])
def test_the_arms_flags_refuse_what_cannot_apply(example, capsys, argv,
                                                 message):
  _, args_lib = example
  with pytest.raises(SystemExit):
    args_lib.parse_args(argv)
  assert message in capsys.readouterr().err


def test_b2_reaches_the_recipe_and_the_dense_twin(example, monkeypatch):
  """The same gradients: with β₂ = 0.5 the dense twin's second step
  differs from β₂ = 0.999's; the recipe is built with betas (0.9, 0.5)."""
  train_lm, args_lib = example
  params = {"w": np.ones((4, 4), np.float32)}
  grads = [{"w": np.full((4, 4), v, np.float32)} for v in (1.0, 3.0)]
  mask = {"w": True}

  def second_update(argv):
    args = args_lib.parse_args(["--sync", "dense"] + argv)
    tx = train_lm.make_optimizer(args, 1e-3, mask, None)
    state = tx.init(params)
    for g in grads:
      u, state = tx.update(g, state, params)
    return float(np.asarray(u["w"]).ravel()[0])

  assert second_update(["--b2", "0.5"]) != second_update([])
  built = {}
  monkeypatch.setitem(train_lm.jaxfuse.RECIPES, "onebit_adamw",
                      lambda plan, lr, **kw: built.update(kw))
  train_lm.make_optimizer(args_lib.parse_args(["--b2", "0.5"]), 1e-3, mask,
                          train_lm.jaxfuse.plan(params, density=1.0))
  assert built["betas"] == (0.9, 0.5)


@pytest.mark.parametrize("outer, lr, decay, nesterov", [
    ("sparseloco", 1.0, 0.95, False), ("diloco", 0.7, 1.0, True)])
def test_local_steps_builds_its_outer_step(example, monkeypatch, outer, lr,
                                           decay, nesterov):
  """--outer picks the outer step and the error feedback's decay: one
  outer update of a pseudo-gradient 1 (after a first of 1: Nesterov's
  momentum is then 0.9·1 + 1) is −lr·1 (SparseLoCo) or −0.7·(1 + 0.9·1.9)
  (DiLoCo); --outer-lr replaces the rate."""
  train_lm, args_lib = example
  built = {}
  monkeypatch.setattr(train_lm.jaxfuse, "local_steps",
                      lambda plan, inner, every, **kw: built.update(
                          kw, every=every))
  params = {"w": np.ones((4, 4), np.float32)}
  plan = train_lm.jaxfuse.plan(params, density=1.0)
  for argv, rate in (([], lr), (["--outer-lr", "0.5"], 0.5)):
    args = args_lib.parse_args(["--local-steps", "7", "--outer", outer] +
                               argv)
    train_lm.make_optimizer(args, 1e-3, {"w": True}, plan)
    assert built["every"] == 7 and built["residual_decay"] == decay
    tx = built["outer"]
    state = tx.init(params)
    for _ in range(2):
      u, state = tx.update({"w": np.ones((4, 4), np.float32)}, state)
    want = -rate * (1 + 0.9 * 1.9) if nesterov else -rate
    np.testing.assert_allclose(np.asarray(u["w"]), want, rtol=1e-6)
