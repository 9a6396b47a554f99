"""Checkpoint and resume (jaxfuse.checkpoint, orbax): bitwise continuation
in a fresh process, shardings kept, plan checks, bad directories."""

import pathlib
import shutil
import subprocess
import sys
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxfuse
from jaxfuse.state import checkpoint

from _harness import cpu_env, init, list_plan, sync
from _harness import NUM_WORKERS as K

WORKER = pathlib.Path(__file__).with_name("_checkpoint_worker.py")


def _run(compile_cache, *args):
  env = cpu_env(8, compile_cache)
  r = subprocess.run([sys.executable, str(WORKER), *map(str, args)],
                     capture_output=True, text=True, env=env, timeout=300)
  assert r.returncode == 0, r.stderr[-3000:]


def test_resume_in_a_fresh_process_is_bitwise_the_straight_run(
    tmp_path, compile_cache):
  """0→6 straight (saving at 3) vs restore 3 in a new process → 6: every
  leaf of params and optimizer state (residuals, controller, per-worker
  moments, stats) bitwise equal."""
  _run(compile_cache, "--dir", tmp_path / "ck", "--stop", 6, "--save-at", 3,
       "--out", tmp_path / "straight.npz")
  _run(compile_cache, "--dir", tmp_path / "ck", "--start", 3, "--stop", 6,
       "--resume", "--out", tmp_path / "resumed.npz")
  a, b = np.load(tmp_path / "straight.npz"), np.load(tmp_path / "resumed.npz")
  assert sorted(a.files) == sorted(b.files)
  for k in a.files:
    np.testing.assert_array_equal(a[k], b[k], err_msg=k)
  residual = a["['opt'][0].sync.residuals[0]"]
  assert residual.shape[0] == 8 and np.abs(residual).sum() > 0
  assert not np.array_equal(residual[0], residual[1])  # per worker


@pytest.fixture(name="trained")
def _trained(mesh):
  plan = list_plan([(64, 64), (32,)], density=0.05,
                   settings=jaxfuse.Settings(min_sparse_size=256))
  state = init(plan, mesh)
  grads = [jax.random.normal(jax.random.PRNGKey(i), (K,) + l.shape)
           for i, l in enumerate(plan.leaves)]
  for _ in range(2):
    _, state = sync(plan, mesh, grads, state)
  return plan, state


def test_per_worker_leaves_come_back_sharded_and_equal(tmp_path, trained):
  plan, state = trained
  mngr = checkpoint.manager(tmp_path)
  checkpoint.save(mngr, 2, state, plan)
  like = jax.tree.map(jnp.zeros_like, state)
  step, back = checkpoint.restore(mngr, like, plan)
  assert step == 2
  for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(back)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert b.sharding == a.sharding
  assert back.residuals[0].sharding.spec[0] == "data"  # not gathered
  assert np.abs(np.asarray(back.residuals[0])).sum() > 0
  with pytest.raises(checkpoint.CheckpointError, match="already saved"):
    checkpoint.save(mngr, 2, state, plan)


def test_a_python_number_in_the_state_comes_back(tmp_path, trained, mesh):
  # flax TrainState.create keeps step=0 as a Python int; restore used to
  # fail in abstract() ('int' object has no attribute 'shape'), on the
  # same worker count and on the elastic path alike.
  plan, opt = trained
  mngr = checkpoint.manager(tmp_path)
  checkpoint.save(mngr, 2, {"opt": opt, "step": 7, "scale": 0.5}, plan)
  _, back = checkpoint.restore(
      mngr, {"opt": init(plan, mesh), "step": 0, "scale": 1.0}, plan)
  assert back["step"] == 7 and type(back["step"]) is int
  assert back["scale"] == 0.5 and type(back["scale"]) is float
  np.testing.assert_array_equal(np.asarray(back["opt"].residuals[0]),
                                np.asarray(opt.residuals[0]))
  if K < 2:    # one GPU: no smaller worker count to restore onto
    return
  half = jaxfuse.make_mesh(K // 2)
  _, back = checkpoint.restore(
      mngr, {"opt": init(plan, half), "step": 0, "scale": 1.0}, plan)
  assert back["step"] == 7 and type(back["step"]) is int
  assert back["scale"] == 0.5 and type(back["scale"]) is float
  assert back["opt"].residuals[0].shape[0] == K // 2


def test_plan_checks(tmp_path, trained):
  plan, state = trained
  mngr = checkpoint.manager(tmp_path)
  checkpoint.save(mngr, 2, state, plan)
  like = jax.tree.map(jnp.zeros_like, state)
  # Only densities differ (a warm-up phase): the state fits.
  step, restored = checkpoint.restore(mngr, like,
                                      jaxfuse.with_density(plan, 0.2))
  assert step == 2
  assert jax.tree.structure(restored) == jax.tree.structure(state)
  for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  assert checkpoint.saved_plan(mngr) == plan
  other = list_plan([(64, 64), (32,)], density=0.05,
                    estimator="topk",
                    settings=jaxfuse.Settings(min_sparse_size=256))
  with pytest.raises(checkpoint.CheckpointError,
                     match="selection units differ.*saved_plan"):
    checkpoint.restore(mngr, like, other)
  with pytest.raises(checkpoint.CheckpointError, match="no step 5"):
    checkpoint.restore(mngr, like, plan, step=5)


def test_empty_corrupt_and_interrupted_directories(tmp_path, trained):
  plan, state = trained
  like = jax.tree.map(jnp.zeros_like, state)
  with pytest.raises(checkpoint.CheckpointError, match="no checkpoint"):
    checkpoint.restore(checkpoint.manager(tmp_path / "empty"), like, plan)
  mngr = checkpoint.manager(tmp_path / "run")
  checkpoint.save(mngr, 1, state, plan)
  # A save that died half-way: orbax writes into a temporary directory and
  # renames it when complete; one left behind is not a checkpoint.
  shutil.copytree(tmp_path / "run" / "1",
                  tmp_path / "run" / "2.orbax-checkpoint-tmp-1234567890")
  mngr = checkpoint.manager(tmp_path / "run")
  step, back = checkpoint.restore(mngr, like, plan)
  assert step == 1 and mngr.all_steps() == [1]
  np.testing.assert_array_equal(np.asarray(back.residuals[0]),
                                np.asarray(state.residuals[0]))
  # A corrupt step: its plan item is gone.
  shutil.rmtree(tmp_path / "run" / "1" / "plan")
  with pytest.raises(checkpoint.CheckpointError, match="corrupt"):
    checkpoint.restore(checkpoint.manager(tmp_path / "run"), like, plan)


EXAMPLE = WORKER.parents[1] / "examples" / "train_lm.py"
EXAMPLE_ARGS = ["--preset", "tiny", "--steps", "12", "--cpu-devices", "8",
                "--optimizer", "local_adamw", "--eval-batches", "1",
                "--lr", "1e-3",
                "--batch-size", "16", "--seq-len", "32", "--log-every", "4",
                "--corpus-mb", "1", "--checkpoint-every", "6"]


def _example(tmp_path, compile_cache, name, *extra):
  """The example's command and environment; the three runs share one
  compilation cache (each program is compiled by the first, straight run)."""
  cmd = [sys.executable, str(EXAMPLE), *EXAMPLE_ARGS, "--json-out",
         str(tmp_path / f"{name}.json"), *map(str, extra)]
  env = cpu_env(8, compile_cache)
  return cmd, env


@pytest.mark.example
def test_example_killed_after_a_save_resumes_bitwise(tmp_path, compile_cache):
  """train_lm: an uninterrupted run vs one SIGKILLed right after its step-6
  save and restarted with --resume: steps 7..12 and the final validation
  loss are bitwise the same (params, optimizer state and data position
  all come back)."""
  import json  # pylint: disable=g-import-not-at-top
  cmd, env = _example(tmp_path, compile_cache, "straight", "--checkpoint-dir",
                      tmp_path / "a")
  r = subprocess.run(cmd, capture_output=True, text=True, env=env,
                     timeout=300)
  assert r.returncode == 0, r.stderr[-3000:]
  cmd, env = _example(tmp_path, compile_cache, "killed", "--checkpoint-dir",
                      tmp_path / "b")
  proc = subprocess.Popen(cmd, stdout=subprocess.PIPE,
                          stderr=subprocess.DEVNULL, text=True, env=env)
  for line in proc.stdout:
    if line.startswith("checkpoint saved at step 6"):
      proc.kill()
      break
  proc.wait(timeout=60)
  assert proc.returncode != 0 and not (tmp_path / "killed.json").exists()
  cmd, env = _example(tmp_path, compile_cache, "resumed", "--checkpoint-dir",
                      tmp_path / "b", "--resume")
  r = subprocess.run(cmd, capture_output=True, text=True, env=env,
                     timeout=300)
  assert r.returncode == 0, r.stderr[-3000:]
  assert "resumed from step 6" in r.stdout
  a = json.loads((tmp_path / "straight.json").read_text())
  b = json.loads((tmp_path / "resumed.json").read_text())
  assert b["start_step"] == 6 and len(b["losses"]) == 6
  assert a["losses"][6:] == b["losses"]
  assert a["final_val_loss"] == b["final_val_loss"]
  # The throughput the benchmarks report: the last phase's median step,
  # each run's compile step left out (step 0, and step 6 on resuming).
  assert [p["steps"] for p in a["phase_steps"]] == [11]
  assert [p["steps"] for p in b["phase_steps"]] == [5]
  assert a["steady_step_time_s"] == float(np.median(a["step_times_s"][1:]))
  # Two more steps with a plan of another layout: the state is carried over.
  cmd, env = _example(tmp_path, compile_cache, "replanned", "--checkpoint-dir",
                      tmp_path / "a", "--resume", "--steps", "14",
                      "--strategy", "aligned")
  r = subprocess.run(cmd, capture_output=True, text=True, env=env,
                     timeout=300)
  assert r.returncode == 0, r.stderr[-3000:]
  assert "resumed from step 12" in r.stdout
  assert "optimizer state was carried over (jaxfuse.relayout)" in r.stdout
  c = json.loads((tmp_path / "replanned.json").read_text())
  assert c["start_step"] == 12 and len(c["losses"]) == 2
  assert all(np.isfinite(c["losses"]))


def test_a_jaxfuse_0_1_checkpoint_is_regrouped(tmp_path, mesh):
  """jaxfuse 0.1 saved one residual per unit and no layout key: restore
  stacks them into today's state groups, bitwise, on the same worker count
  and (through the elastic path) on half of it."""
  ocp = pytest.importorskip("orbax.checkpoint")
  plan = list_plan([(64, 64), (64, 64), (32,)], density=0.05, num_buckets=1,
                   settings=jaxfuse.Settings(min_sparse_size=256))
  assert any(len(ids) == 2 for ids in jaxfuse.plans.state_groups(plan))
  state = init(plan, mesh)
  grads = [jax.random.normal(jax.random.PRNGKey(i), (K,) + l.shape)
           for i, l in enumerate(plan.leaves)]
  _, state = sync(plan, mesh, grads, state)
  old = _without_targets(state._replace(
      residuals=tuple(jaxfuse.unit_residuals(plan, state))))
  _check_legacy(tmp_path, ocp, old, {checkpoint.WORKERS: K}, state, plan,
                lambda m: init(plan, m), mesh)


class _Control3(NamedTuple):
  """The controller's state as jaxfuse 0.2 saved it (state layout 3)."""
  threshold: jax.Array
  log_scale: jax.Array
  log_step: jax.Array
  flag: jax.Array


def _without_targets(tree):
  """``tree`` with every sparse_sync state's controller as layouts 1-3
  kept it."""
  is_sync = lambda x: isinstance(x, jaxfuse.transform.SparseSyncState)
  return jax.tree.map(
      lambda x: x._replace(control=_Control3(*x.control[:4]))
      if is_sync(x) else x, tree, is_leaf=is_sync)


def test_a_controller_without_targets_gets_the_saved_plans(tmp_path, mesh):
  """State layout 3 kept no k per unit: restore sets the saved plan's,
  ⌈0.05·4096⌉ = 205 for both units (the (32,) leaf is dense, no unit),
  bitwise today's state after the same step, on K workers and K/2."""
  ocp = pytest.importorskip("orbax.checkpoint")
  plan = list_plan([(64, 64), (64, 64), (32,)], density=0.05, num_buckets=1,
                   settings=jaxfuse.Settings(min_sparse_size=256))
  state = init(plan, mesh)
  grads = [jax.random.normal(jax.random.PRNGKey(i), (K,) + l.shape)
           for i, l in enumerate(plan.leaves)]
  _, state = sync(plan, mesh, grads, state)
  assert (np.asarray(state.control.target) == 205).all()
  assert np.asarray(state.control.target).shape == (K, 2)
  old = _without_targets(state)
  _check_legacy(tmp_path, ocp, old, {checkpoint.WORKERS: K,
                                     checkpoint.LAYOUT: 3}, state, plan,
                lambda m: init(plan, m), mesh)


def _check_legacy(tmp_path, ocp, old, extra, state, plan, like, mesh):
  """``old`` (``state`` in an earlier layout, ``extra`` as that version
  saved it) restores to ``state`` bitwise, shardings included; on K/2
  workers, to the same numbers as today's layout restored there.
  ``like(mesh)``: a fresh state on that mesh."""
  legacy = checkpoint.manager(tmp_path / "legacy")
  legacy.save(1, args=ocp.args.Composite(
      state=ocp.args.StandardSave(old),
      plan=ocp.args.JsonSave(__import__("json").loads(plan.to_json())),
      extra=ocp.args.JsonSave(extra)), force=True)
  legacy.wait_until_finished()
  step, back = checkpoint.restore(legacy, like(mesh), plan)
  assert step == 1
  assert jax.tree.structure(back) == jax.tree.structure(state)
  for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(back)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert a.sharding == b.sharding
  if K < 2:    # one GPU: no smaller worker count to restore onto
    return
  current = checkpoint.manager(tmp_path / "current")
  checkpoint.save(current, 1, state, plan)
  half = jaxfuse.make_mesh(K // 2)
  _, want = checkpoint.restore(current, like(half), plan)
  _, got = checkpoint.restore(legacy, like(half), plan)
  for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_per_unit_layout_round_trip_with_velocity(mesh):
  """``_per_unit`` (shapes) and ``_grouped`` (arrays) are inverse, for the
  residuals and the velocity of every state group."""
  plan = list_plan([(64, 64), (64, 64), (32, 64), (64, 64)], density=0.05, num_buckets=1,
                   settings=jaxfuse.Settings(min_sparse_size=256))
  params = [jnp.zeros(l.shape) for l in plan.leaves]
  state = jaxfuse.init_state(jaxfuse.sparse_sync(plan, momentum=0.9), params,
                             mesh)
  rng = np.random.default_rng(0)
  state = state._replace(
      residuals=tuple(jnp.asarray(rng.normal(size=r.shape), r.dtype)
                      for r in state.residuals),
      velocity=tuple(jnp.asarray(rng.normal(size=v.shape), v.dtype)
                     for v in state.velocity))
  units = state._replace(
      residuals=tuple(jaxfuse.unit_residuals(plan, state)),
      velocity=tuple(jaxfuse.unit_residuals(plan, state, velocity=True)))
  shapes = checkpoint._per_unit(state, plan)  # pylint: disable=protected-access
  assert [(s.shape, s.dtype) for s in jax.tree.leaves(shapes)] == [
      (u.shape, u.dtype) for u in jax.tree.leaves(units)]
  back = checkpoint._grouped(  # pylint: disable=protected-access
      units, plan, jnp.stack)
  for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(back)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert max(len(ids) for ids in jaxfuse.plans.state_groups(plan)) == 3


def test_a_leafwise_onebit_moment_is_regrouped(tmp_path, mesh):
  """jaxfuse 0.2 kept ``onebit_adamw``'s m in the params' shapes (state
  layout 2): restore groups it as the all-gather decode writes it,
  bitwise, on the same worker count and on half of it."""
  ocp = pytest.importorskip("orbax.checkpoint")
  plan = list_plan([(64, 64), (64, 64), (32,)], density=0.05, num_buckets=1,
                   settings=jaxfuse.Settings(min_sparse_size=256))
  params = [jnp.zeros(l.shape) for l in plan.leaves]
  opt = jaxfuse.onebit_adamw(plan, 1e-3)
  state = jaxfuse.init_state(opt, params, mesh)
  rng = np.random.default_rng(0)
  one = state[0]
  mu = jax.tree.map(lambda x: jax.device_put(
      jnp.asarray(rng.normal(size=x.shape), x.dtype), x.sharding), one.mu)
  assert [r.shape for r in mu.rows] == [(2, 64 * 64)]
  state = (one._replace(mu=mu),) + tuple(state[1:])
  # m leaf by leaf, as 0.2 kept it: each matrix is its unit's row of the
  # one state group (plans.unit_rows), the vector loose
  all_units, _ = jaxfuse.plans.units(plan)
  rows = {all_units[u].leaves[0]: i
          for u, (g, i) in enumerate(jaxfuse.plans.unit_rows(plan))}
  assert sorted(rows) == [0, 1]
  leafwise = [mu.rows[0][rows[0]].reshape(64, 64),
              mu.rows[0][rows[1]].reshape(64, 64), mu.loose[0]]
  for a, b in zip(jaxfuse.first_moment(state, plan), leafwise):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  old = _without_targets((one._replace(mu=leafwise),) + tuple(state[1:]))
  _check_legacy(tmp_path, ocp, old, {checkpoint.WORKERS: K,
                                     checkpoint.LAYOUT: 2}, state, plan,
                lambda m: jaxfuse.init_state(opt, params, m), mesh)
  # saved without a plan: restore needs one to regroup m
  bare = checkpoint.manager(tmp_path / "bare")
  bare.save(1, args=ocp.args.Composite(
      state=ocp.args.StandardSave(old), plan=ocp.args.JsonSave({}),
      extra=ocp.args.JsonSave({checkpoint.WORKERS: K,
                               checkpoint.LAYOUT: 2})), force=True)
  bare.wait_until_finished()
  with pytest.raises(checkpoint.CheckpointError, match="saved without a "
                     "plan, which regrouping it needs"):
    checkpoint.restore(bare, jaxfuse.init_state(opt, params, mesh), None)


def _state(value):
  return {"w": jnp.full((4,), value, jnp.float32)}


def test_step_zero_is_saved_and_a_negative_step_is_not(tmp_path):
  mngr = checkpoint.manager(tmp_path)
  checkpoint.save(mngr, 0, _state(1.0), None)
  mngr.wait_until_finished()
  step, back = checkpoint.restore(mngr, _state(0.0), None)
  assert step == 0
  np.testing.assert_array_equal(np.asarray(back["w"]), np.ones(4))
  with pytest.raises(checkpoint.CheckpointError, match="step=-1 must be"):
    checkpoint.save(mngr, -1, _state(1.0), None)


@pytest.mark.parametrize("key", [checkpoint.WORKERS, checkpoint.LAYOUT])
def test_both_of_jaxfuses_keys_are_reserved_in_extra(tmp_path, key):
  mngr = checkpoint.manager(tmp_path)
  with pytest.raises(checkpoint.CheckpointError, match="is jaxfuse's own"):
    checkpoint.save(mngr, 1, _state(1.0), None, extra={key: 3})
  assert mngr.all_steps() == []


def test_the_latest_step_is_the_highest_whatever_the_order_saved(tmp_path):
  mngr = checkpoint.manager(tmp_path, max_to_keep=None)
  for step in (5, 7, 6):
    checkpoint.save(mngr, step, _state(float(step)), None,
                    extra={"at": step})
  mngr.wait_until_finished()
  step, back = checkpoint.restore(mngr, _state(0.0), None)
  assert step == 7
  np.testing.assert_array_equal(np.asarray(back["w"]), np.full(4, 7.0))
  assert checkpoint.saved_extra(mngr) == {"at": 7}
  assert checkpoint.saved_extra(mngr, 5) == {"at": 5}


def test_a_manager_keeps_the_last_three_steps_by_default(tmp_path):
  mngr = checkpoint.manager(tmp_path)
  for step in range(1, 6):
    checkpoint.save(mngr, step, _state(float(step)), None)
  mngr.wait_until_finished()
  assert sorted(mngr.all_steps()) == [3, 4, 5]
