"""``jaxfuse.delayed``: the inner optimizer on the previous step's
gradients (first update zero, its state untouched), per-worker pending
gradients that checkpoints and elastic restarts keep, and collectives that
wait for no gradient of the step they run in; with ``predict=True`` the
last update, ``predicted_params`` and the stable rates it widens."""

import functools

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

import jaxfuse
from jaxfuse.state import elastic

from _harness import NUM_WORKERS
from _harness import mesh_of
from _harness import shard

SHAPES = {"b": (7,), "w": (40, 30)}


def _problem(seed, steps, k):
  rng = np.random.default_rng(seed)
  params = {n: rng.normal(size=s).astype(np.float32)
            for n, s in SHAPES.items()}
  grads = [{n: rng.normal(size=(k,) + s).astype(np.float32)
            for n, s in SHAPES.items()} for _ in range(steps)]
  plan = jaxfuse.plan({n: jax.ShapeDtypeStruct(s, jnp.float32)
                       for n, s in SHAPES.items()}, density=0.05, estimator="topk",
                      settings=jaxfuse.Settings(min_sparse_size=64))
  return plan, params, grads


def _updates(opt, mesh, params, grads):
  state = jaxfuse.init_state(opt, params, mesh)
  specs = jaxfuse.state_specs(state)

  def local(params, state, g):
    return opt.update(jax.tree.map(lambda x: x[0], g), state, params)
  update = jax.jit(jax.shard_map(local, mesh=mesh,
                                 in_specs=(P(), specs, P("data")),
                                 out_specs=(P(), specs)))
  x = jax.device_put(params, NamedSharding(mesh, P()))
  out = []
  for g in grads:
    u, state = jax.block_until_ready(update(x, state, shard(mesh, g)))
    out.append({n: np.asarray(v) for n, v in u.items()})
  return out, state


@pytest.mark.parametrize("recipe", ["sgd", "onebit_adamw"])
def test_delayed_is_the_inner_optimizer_one_step_late(recipe):
  mesh = mesh_of(4)
  plan, params, grads = _problem(0, 5, 4)
  if recipe == "sgd":
    make = lambda: jaxfuse.sgd(plan, 0.1, 0.9, clip_norm=5.0)
  else:   # its dense phase (the sparse one's updates are 0 until ν > 0)
    make = lambda: jaxfuse.onebit_adamw(jaxfuse.with_density(plan, 1.0), 0.1,
                                        clip_norm=5.0)
  got, state = _updates(jaxfuse.delayed(make()), mesh, params, grads)
  want, inner = _updates(make(), mesh, params, grads[:-1])
  for n in SHAPES:
    np.testing.assert_array_equal(got[0][n], 0)
  assert all(np.abs(w[n]).max() > 1e-3 for w in want for n in SHAPES)
  for t in range(1, len(grads)):
    for n in SHAPES:
      np.testing.assert_allclose(got[t][n], want[t - 1][n], rtol=1e-6,
                                 atol=1e-7, err_msg=f"step {t}, leaf {n}")
  # The inner state is the inner optimizer's after the first 4 gradients,
  # and the last gradient waits, per worker.
  for a, b in zip(jax.tree.leaves(state.inner), jax.tree.leaves(inner)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6,
                               atol=1e-7)
  for n in SHAPES:
    np.testing.assert_array_equal(np.asarray(state.pending.inner[n]),
                                  grads[-1][n])
  assert int(state.count) == len(grads)


def test_predict_keeps_the_last_update_and_predicts_with_it():
  """predict=True changes no update; the state holds u_{t−1} and
  predicted_params is θ + u_{t−1} (replicated, like the parameters)."""
  mesh = mesh_of(4)
  plan, params, grads = _problem(3, 4, 4)
  make = lambda: jaxfuse.sgd(plan, 0.1, 0.9, clip_norm=5.0)
  got, state = _updates(jaxfuse.delayed(make(), predict=True), mesh, params,
                        grads)
  want, _ = _updates(jaxfuse.delayed(make()), mesh, params, grads)
  for g, w in zip(got, want):
    for n in SHAPES:
      np.testing.assert_array_equal(g[n], w[n])
  assert jaxfuse.state_specs(state).last_update == {n: P() for n in SHAPES}
  predicted = jaxfuse.predicted_params(params, state)
  for n in SHAPES:
    assert np.abs(got[-1][n]).max() > 1e-3
    np.testing.assert_array_equal(np.asarray(state.last_update[n]),
                                  got[-1][n])
    np.testing.assert_allclose(np.asarray(predicted[n]),
                               params[n] + got[-1][n], rtol=1e-6)


@functools.partial(jax.jit, static_argnames=("predict", "steps"))
def _heavy_ball_run(curvature, predict, steps):
  opt = jaxfuse.delayed(optax.sgd(1.0, momentum=0.9), predict=predict)
  theta = {"w": jnp.ones((2,), jnp.float32)}

  def step(_, carry):
    theta, state = carry
    at = jaxfuse.predicted_params(theta, state) if predict else theta
    u, state = opt.update({"w": curvature * at["w"]}, state, theta)
    return optax.apply_updates(theta, u), state
  theta, _ = jax.lax.fori_loop(0, steps, step, (theta, opt.init(theta)))
  return jnp.abs(theta["w"]).max()


def _heavy_ball_distance(curvature, predict, steps=300):
  """|θ| after ``steps`` of delayed heavy ball (η = 1, β = 0.9) on
  ½·h·θ², the gradient at ``predicted_params`` or at θ: the steps in one
  compiled loop (one program per ``predict``, the curvature an argument),
  not 300 steps of operations dispatched one by one."""
  return float(_heavy_ball_run(jnp.float32(curvature), predict, steps))


@pytest.mark.parametrize("curvature, stale, predicted", [
    (0.05, "converges", "converges"),
    (0.2, "diverges", "converges"),
    (0.5, "diverges", "diverges"),
])
def test_prediction_widens_stale_heavy_balls_stable_rates(curvature, stale,
                                                          predicted):
  """Heavy ball (β = 0.9) on ½·h·θ² is stable for η·h < 2(1 + β) = 3.8
  fresh, < 1 − β = 0.1 one step stale, and < 0.27 with the gradient at
  θ + u_{t−1} (the recurrences' spectral radii; docs/convergence.md)."""
  for predict, expect in ((False, stale), (True, predicted)):
    distance = _heavy_ball_distance(curvature, predict)
    assert (distance < 1e-3 if expect == "converges" else distance > 1e3), (
        f"h={curvature} predict={predict}: |θ| = {distance:.3g}")


def test_predicted_params_needs_a_predicting_delayed_state():
  plan, params, _ = _problem(4, 1, 1)
  with pytest.raises(jaxfuse.SyncError, match="predict=True"):
    jaxfuse.predicted_params(params, jaxfuse.delayed(
        jaxfuse.sgd(plan, 0.1)).init(params))
  with pytest.raises(jaxfuse.SyncError, match="found 0 DelayedState"):
    jaxfuse.predicted_params(params, jaxfuse.sgd(plan, 0.1).init(params))
  state = jaxfuse.delayed(jaxfuse.sgd(plan, 0.1), predict=True).init(params)
  with pytest.raises(jaxfuse.SyncError, match="structure"):
    jaxfuse.predicted_params({"w": params["w"]}, state)
  with pytest.raises(jaxfuse.SyncError, match="predict=1"):
    jaxfuse.delayed(jaxfuse.sgd(plan, 0.1), predict=1)


@pytest.mark.parametrize("predict", [False, True])
def test_pending_gradients_are_per_worker_and_kept_on_resize(predict):
  mesh = mesh_of(4)
  plan, params, grads = _problem(1, 2, 4)
  opt = jaxfuse.delayed(jaxfuse.sgd(plan, 0.1), predict=predict)
  _, state = _updates(opt, mesh, params, grads)
  specs = jaxfuse.state_specs(state)
  assert all(s == P("data") for s in jax.tree.leaves(
      specs.pending, is_leaf=lambda x: isinstance(x, P)))
  assert specs.count == P()
  mask = jaxfuse.per_worker_mask(state)
  before = elastic.owed(jax.device_get(state), mask)
  after = elastic.owed(elastic.resize_tree(jax.device_get(state), mask, 2),
                       mask)
  for a, b in zip(before, after):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
  if predict:   # the last update is replicated: a resize keeps it as is
    resized = elastic.resize_tree(jax.device_get(state), mask, 2)
    for n in SHAPES:
      assert np.abs(np.asarray(state.last_update[n])).max() > 0
      np.testing.assert_array_equal(np.asarray(resized.last_update[n]),
                                    np.asarray(state.last_update[n]))
  # The pending gradients are the last step's, per worker; on 2 workers
  # their worker mean is kept, leaf by leaf (NumPy means of the inputs).
  resized = elastic.resize_tree(jax.device_get(state), mask, 2)
  for n in SHAPES:
    g = np.asarray(grads[-1][n], np.float64)
    np.testing.assert_allclose(
        np.asarray(state.pending.inner[n], np.float64), g, rtol=1e-6)
    kept = np.asarray(resized.pending.inner[n], np.float64)
    assert kept.shape == (2,) + g.shape[1:]
    np.testing.assert_allclose(kept.mean(0), g.mean(0), rtol=1e-6,
                               atol=1e-7)


@pytest.mark.parametrize("predict", [False, True])
def test_a_checkpoint_keeps_the_pending_gradients_and_last_update(
    tmp_path, predict):
  from jaxfuse.state import checkpoint  # pylint: disable=g-import-not-at-top
  mesh = mesh_of(4)
  plan, params, grads = _problem(5, 2, 4)
  opt = jaxfuse.delayed(jaxfuse.sgd(plan, 0.1, 0.9), predict=predict)
  _, state = _updates(opt, mesh, params, grads)
  mngr = checkpoint.manager(tmp_path)
  checkpoint.save(mngr, 2, state, plan)
  mngr.wait_until_finished()
  _, back = checkpoint.restore(mngr, jaxfuse.init_state(opt, params, mesh),
                               plan)
  assert (back.last_update is None) == (not predict)
  for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(back)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert any(np.abs(np.asarray(x)).max() > 0
             for x in jax.tree.leaves(back.pending))


def test_delayed_rejects_a_foreign_state():
  plan, params, grads = _problem(2, 1, 1)
  opt = jaxfuse.delayed(jaxfuse.sgd(plan, 0.1))
  with pytest.raises(jaxfuse.SyncError, match="DelayedState"):
    opt.update(params, jaxfuse.sgd(plan, 0.1).init(params), params)


def test_xla_flags_name_the_network():
  flags = jaxfuse.xla_flags(3.0, gpus_per_node=8)
  assert "--xla_gpu_enable_latency_hiding_scheduler=true" in flags.split()
  assert "nic_speed_gbps=3,gpus_per_node=8,partition_size=8" in flags
  for bad in (0, -1.0, True, "3"):
    with pytest.raises(ValueError, match="network_gbytes_s"):
      jaxfuse.xla_flags(bad)
  with pytest.raises(ValueError, match="gpus_per_node"):
    jaxfuse.xla_flags(3.0, gpus_per_node=0)


def test_predicted_params_refuses_two_delayed_states():
  opt = jaxfuse.delayed(optax.sgd(1.0), predict=True)
  params = {"w": jnp.ones((3,), jnp.float32)}
  one = opt.init(params)
  assert jnp.array_equal(jaxfuse.predicted_params(params, one)["w"],
                         jnp.ones(3))   # u_{-1} = 0
  with pytest.raises(jaxfuse.SyncError, match=r"found 2 DelayedState\(s\)"):
    jaxfuse.predicted_params(params, (one, opt.init(params)))


def test_predict_with_an_integer_leaf_steps_as_without():
  # A non-float leaf passes through undelayed (its float0 gradient); the
  # kept last update used to cast that per-worker value into the int leaf,
  # which shard_map's replicated out_spec refused.
  mesh = mesh_of(NUM_WORKERS)
  params = {"w": jnp.ones((40, 40), jnp.float32),
            "n": jnp.zeros((3,), jnp.int32)}
  plan = jaxfuse.plan(params, density=0.05,
                      settings=jaxfuse.Settings(min_sparse_size=64))
  x = shard(mesh, np.ones((NUM_WORKERS, 40), np.float32))
  updates = {}
  for predict in (False, True):
    opt = jaxfuse.delayed(jaxfuse.sparse_sync(plan), predict=predict)
    state = jaxfuse.init_state(opt, params, mesh)
    specs = jaxfuse.state_specs(state)

    def local(params, state, x, opt=opt):
      loss = lambda p: jnp.sum((x @ p["w"]) ** 2) + 0 * p["n"].sum()
      g = jax.grad(loss, allow_int=True)(jaxfuse.local_params(params))
      u, state = opt.update(g, state, params)
      return u["w"], state

    step = jax.jit(jax.shard_map(local, mesh=mesh,
                                 in_specs=(P(), specs, P("data")),
                                 out_specs=(P(), specs)))
    for _ in range(2):
      u, state = jax.block_until_ready(step(params, state, x))
    updates[predict] = np.asarray(u)
    if predict:
      np.testing.assert_array_equal(np.asarray(state.last_update["n"]),
                                    np.zeros(3, np.int32))
  assert np.abs(updates[False]).sum() > 0
  np.testing.assert_array_equal(updates[True], updates[False])
