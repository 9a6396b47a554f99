"""jaxfuse.make_train_step beyond the Quickstart (8 CPU workers, a small
MLP): auxiliary outputs reduced over the workers, a model's non-parameter
state averaged so that every replica keeps the same, resume from a
checkpoint inside the warm-up bitwise the uninterrupted run, replica
checks, and the errors a first step can meet, each naming its fix."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxfuse
from jaxfuse.state import checkpoint
from jaxfuse.optim import train_step

from _harness import NUM_WORKERS, mesh_of, mlp_loss, mlp_problem

K = NUM_WORKERS
ROWS = 4   # per worker


def _problem(steps=3):
  return mlp_problem(steps, K, ROWS)


def _plan(params):
  return jaxfuse.plan(params, density=0.1,
                      settings=jaxfuse.Settings(min_sparse_size=64))


SGD = functools.partial(jaxfuse.sgd, learning_rate=0.05, momentum=0.9)


def _bits(tree):
  return [np.asarray(x).tobytes() for x in jax.tree.leaves(
      jax.device_get(tree))]


def _rows(x, k):
  """Worker k's rows of a global batch."""
  return x[k * ROWS:(k + 1) * ROWS]


def test_aux_floats_are_the_workers_mean_and_counts_their_sum():
  params, batches = _problem(1)
  mesh = mesh_of(K)

  def loss_fn(p, batch):
    x, y = batch
    aux = {"first": jnp.mean(x[:, 0]), "positive": jnp.sum(y[:, 0] > 0),
           "same": jnp.float32(2.0)}
    return mlp_loss(p, batch), aux

  state, step = jaxfuse.make_train_step(
      loss_fn, params, SGD, _plan(params), mesh,
      jaxfuse.StepOptions(has_aux=True))
  state, (loss, aux) = step(state, batches[0])
  x, y = batches[0]
  per_worker_first = [np.mean(_rows(x, k)[:, 0]) for k in range(K)]
  np.testing.assert_allclose(float(aux["first"]), np.mean(per_worker_first),
                             rtol=1e-6)
  assert int(aux["positive"]) == int(np.sum(y[:, 0] > 0))   # whole batch
  assert float(aux["same"]) == 2.0          # equal on every worker: as is
  per_worker_loss = [mlp_loss(params, (_rows(x, k), _rows(y, k)))
                     for k in range(K)]
  np.testing.assert_allclose(float(loss), np.mean(per_worker_loss),
                             rtol=1e-6)
  assert state.step == 1


def test_model_state_is_the_workers_mean_on_every_replica():
  """A BatchNorm-like running mean: each worker's update from its own rows,
  then the mean over the workers, the same bits on all 8 devices."""
  params, batches = _problem(2)
  mesh = mesh_of(K)
  start = {"mean": np.full(32, 0.5, np.float32), "count": np.int32(0)}

  def loss_fn(p, model_state, batch):
    x, _ = batch
    new = {"mean": 0.9 * model_state["mean"] + 0.1 * jnp.mean(x, 0),
           "count": model_state["count"] + 1}
    return mlp_loss(p, batch), new

  state, step = jaxfuse.make_train_step(
      loss_fn, params, SGD, _plan(params), mesh,
      jaxfuse.StepOptions(model_state=start, check_replicas=True))
  expected = start["mean"].astype(np.float64)
  for batch in batches:
    state, _ = step(state, batch)
    expected = np.mean([0.9 * expected + 0.1 * np.mean(_rows(batch[0], k), 0)
                        for k in range(K)], axis=0)
  running = state.model_state["mean"]
  copies = {np.asarray(s.data).tobytes() for s in running.addressable_shards}
  assert len(running.addressable_shards) == K and len(copies) == 1
  np.testing.assert_allclose(np.asarray(running), expected, rtol=1e-5)
  assert int(state.model_state["count"]) == 2
  assert not np.allclose(expected, 0.5)


def test_model_state_with_aux_and_a_batch_dependent_integer():
  params, batches = _problem(1)
  mesh = mesh_of(K)

  def loss_fn(p, model_state, batch, dtype=jnp.float32):
    x, _ = batch
    new = {"seen": model_state["seen"] + jnp.sum(x[:, 0] > 0).astype(dtype)}
    return mlp_loss(p, batch), (new, jnp.max(x[:, 0]))

  state, step = jaxfuse.make_train_step(
      loss_fn, params, SGD, _plan(params), mesh,
      jaxfuse.StepOptions(has_aux=True,
                          model_state={"seen": np.float32(1.0)}))
  state, (_, aux) = step(state, batches[0])
  x = batches[0][0]
  counts = [np.sum(_rows(x, k)[:, 0] > 0) for k in range(K)]
  assert float(state.model_state["seen"]) == pytest.approx(
      1.0 + np.mean(counts))
  assert float(aux) == pytest.approx(
      np.mean([np.max(_rows(x, k)[:, 0]) for k in range(K)]))

  state, step = jaxfuse.make_train_step(
      functools.partial(loss_fn, dtype=jnp.int32), params, SGD,
      _plan(params), mesh,
      jaxfuse.StepOptions(has_aux=True, model_state={"seen": np.int32(0)}))
  with pytest.raises(TypeError, match=r"model_state\['seen'\].*float"):
    step(state, batches[0])


def test_resume_inside_the_warm_up_is_bitwise_the_straight_run(tmp_path):
  params, batches = _problem(6)
  mesh = mesh_of(K)
  plan = jaxfuse.plan(params, density=0.05,
                      settings=jaxfuse.Settings(min_sparse_size=64))
  phases = jaxfuse.density_warmup(plan, dense_steps=2, steps=2,
                                  densities=(0.25,))
  assert [p.start for p in phases] == [0, 2, 4]
  opt = functools.partial(jaxfuse.onebit_adamw, learning_rate=1e-2)

  straight, step = jaxfuse.make_train_step(mlp_loss, params, opt, phases,
                                           mesh)
  for batch in batches:
    straight, _ = step(straight, batch)

  mngr = checkpoint.manager(tmp_path)
  state, step = jaxfuse.make_train_step(mlp_loss, params, opt, phases, mesh)
  for batch in batches[:3]:       # into the 25 % phase
    state, _ = step(state, batch)
  step.save(mngr, state, extra={"epoch": 0})
  del state

  # a new process would do exactly this: build, restore, go on from state.step
  state, step = jaxfuse.make_train_step(mlp_loss, params, opt, phases, mesh)
  fresh = _bits(state.params)
  state = step.restore(mngr, state)
  assert state.step == 3 and step.phase_at(state.step) is phases[1]
  assert _bits(state.params) != fresh
  for batch in batches[state.step:]:
    state, _ = step(state, batch)
  assert state.step == straight.step == 6
  assert _bits(state.params) == _bits(straight.params)
  assert _bits(state.opt_state) == _bits(straight.opt_state)
  assert checkpoint.saved_extra(mngr) == {"epoch": 0}


def test_restore_without_a_checkpoint_returns_the_state(tmp_path):
  params, _ = _problem(0)
  state, step = jaxfuse.make_train_step(mlp_loss, params, SGD,
                                        _plan(params), mesh_of(K))
  assert step.restore(checkpoint.manager(tmp_path), state) is state
  with pytest.raises(checkpoint.CheckpointError):
    step.restore(checkpoint.manager(tmp_path), state, step=5)


def test_a_recipe_by_name_steps_as_its_factory():
  params, batches = _problem(1)
  mesh = mesh_of(K)
  plan = _plan(params)
  results = []
  for opt in (SGD, ("sgd", {"learning_rate": 0.05, "momentum": 0.9})):
    state, step = jaxfuse.make_train_step(mlp_loss, params, opt, plan, mesh)
    state, _ = step(state, batches[0])
    results.append(_bits(state))
  assert results[0] == results[1]


def test_check_replicas_names_the_leaf_that_differs():
  mesh = mesh_of(K)
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  devices = list(mesh.devices.flat)
  copies = [jax.device_put(np.full(3, float(d == devices[-1]), np.float32), d)
            for d in devices]
  bad = jax.make_array_from_single_device_arrays((3,), sharding, copies)
  good = jax.device_put(np.ones(3, np.float32), sharding)
  train_step.check_replicas({"ok": good}, 4)
  with pytest.raises(jaxfuse.SyncError,
                     match=r"after step 4, \['w'\] on .* differs"):
    train_step.check_replicas({"ok": good, "w": bad}, 4)


def test_errors_name_the_fix():
  params, batches = _problem(1)
  mesh = mesh_of(K)
  plan = _plan(params)
  with pytest.raises(TypeError, match=r"factory.*functools.partial"):
    jaxfuse.make_train_step(mlp_loss, params, jaxfuse.sgd(plan, 0.1), plan,
                            mesh)
  with pytest.raises(TypeError, match="no jaxfuse.sparse_sync.*sync_adamw"):
    jaxfuse.make_train_step(mlp_loss, params, lambda p: optax.sgd(0.1), plan,
                            mesh)
  with pytest.raises(ValueError, match=r"needs learning_rate.*\('sgd', "):
    jaxfuse.make_train_step(mlp_loss, params, "sgd", plan, mesh)
  with pytest.raises(ValueError, match="not a recipe; use one of"):
    jaxfuse.make_train_step(mlp_loss, params, ("adam", {}), plan, mesh)
  with pytest.raises(ValueError, match="no setting lr"):
    jaxfuse.make_train_step(mlp_loss, params, ("sgd", {"lr": 0.1}), plan,
                            mesh)
  # phases that leave steps without a plan (no open last phase)
  with pytest.raises(jaxfuse.PlanError, match=r"stop=None"):
    jaxfuse.make_train_step(mlp_loss, params, SGD,
                            [jaxfuse.Phase(0, 10, plan)], mesh)
  with pytest.raises(jaxfuse.PlanError, match=r"start=5: must be 0"):
    jaxfuse.make_train_step(mlp_loss, params, SGD,
                            [jaxfuse.Phase(5, None, plan)], mesh)
  with pytest.raises(ValueError, match="not 'batch'"):
    jaxfuse.make_train_step(mlp_loss, params, SGD, plan, mesh,
                            jaxfuse.StepOptions(axis_name="batch"))
  with pytest.raises(TypeError, match="has_aux"):
    jaxfuse.StepOptions(has_aux=1)

  state, step = jaxfuse.make_train_step(
      lambda p, b: (mlp_loss(p, b), {"n": 1}), params, SGD, plan, mesh,
      jaxfuse.StepOptions(donate=False))
  with pytest.raises(TypeError, match=r"StepOptions\(has_aux=True\)"):
    step(state, batches[0])
  x, y = batches[0]
  with pytest.raises(ValueError,
                     match=r"batch\[0\]: shape \(31, 32\).*multiple of 8"):
    step(state, (x[:31], y[:31]))
  with pytest.raises(TypeError, match="jaxfuse.TrainState"):
    step((state.params, state.opt_state), batches[0])


def test_send_early_and_no_donation_step_bitwise_alike():
  """``send_early`` (on by default only on several GPUs) reorders the step,
  never its results; without donation the state passed in stays usable."""
  params, batches = _problem(2)
  mesh = mesh_of(K)
  plan = _plan(params)
  results = []
  for options in (jaxfuse.StepOptions(),
                  jaxfuse.StepOptions(send_early=True, donate=False)):
    state, step = jaxfuse.make_train_step(mlp_loss, params, SGD, plan, mesh,
                                          options)
    first = state
    for batch in batches:
      state, loss = step(state, batch)
    results.append(_bits((state, loss)))
  assert results[0] == results[1]
  assert _bits(first.params) == _bits(jax.tree.map(np.asarray, params))


def _half_square(p, batch):
  """½‖θ‖²: its gradient is the point it is taken at."""
  del batch
  return 0.5 * sum(jnp.sum(x.astype(jnp.float32) ** 2)
                   for x in jax.tree.leaves(p))


def test_grad_at_moves_where_the_gradient_is_taken():
  """``grad_at`` picks the point each worker differentiates at; the step
  still moves ``params``: θ1 = θ0 − η·(θ0 + 1) on ½‖θ‖² at θ + 1."""
  params, batches = _problem(1)
  plan = jaxfuse.with_density(_plan(params), 1.0)
  opt = functools.partial(jaxfuse.sgd, learning_rate=0.25, momentum=0.0)
  state, step = jaxfuse.make_train_step(
      _half_square, params, opt, plan, mesh_of(K),
      jaxfuse.StepOptions(grad_at=lambda p, s: jax.tree.map(
          lambda x: x + 1.0, p)))
  state, _ = step(state, batches[0])
  for name in params:
    np.testing.assert_allclose(
        np.asarray(state.params[name]),
        params[name] - 0.25 * (params[name] + 1.0), rtol=1e-6, atol=1e-6)


def test_grad_at_a_bfloat16_copy_steps_by_the_bfloat16_gradient():
  """At a bfloat16 copy the gradient is bfloat16: on ½‖θ‖², θ1 = θ0 −
  η·bf16(θ0), not θ0 − η·θ0; the params stay float32 and the optimizer
  state is the one ``init_state`` makes at the cast params."""
  params, batches = _problem(1)
  cast = lambda p, s: jax.tree.map(lambda x: x.astype(jnp.bfloat16), p)
  # the plan of what is differentiated; density 1: the mean of the workers'
  plan = jaxfuse.with_density(_plan(cast(params, None)), 1.0)
  opt = functools.partial(jaxfuse.sgd, learning_rate=0.25, momentum=0.0)
  state, step = jaxfuse.make_train_step(
      _half_square, params, opt, plan, mesh_of(K),
      jaxfuse.StepOptions(grad_at=cast))
  want = jaxfuse.init_state(opt(plan), cast(params, None), mesh_of(K))
  assert ([x.dtype for x in jax.tree.leaves(state.opt_state)] ==
          [x.dtype for x in jax.tree.leaves(want)])
  state, _ = step(state, batches[0])
  for name, x in params.items():
    got = np.asarray(state.params[name])
    assert got.dtype == np.float32
    at = np.asarray(jnp.asarray(x).astype(jnp.bfloat16).astype(np.float32))
    np.testing.assert_allclose(got, x - 0.25 * at, rtol=1e-6, atol=1e-7)
    assert not np.allclose(got, x - 0.25 * x, rtol=1e-6, atol=1e-7)


def test_grad_at_errors_name_the_fix():
  params, _ = _problem(0)
  plan = _plan(params)
  with pytest.raises(TypeError, match=r"grad_at=3 must be a function"):
    jaxfuse.StepOptions(grad_at=3)
  with pytest.raises(TypeError, match="another structure than the params"):
    jaxfuse.make_train_step(
        mlp_loss, params, SGD, plan, mesh_of(K),
        jaxfuse.StepOptions(grad_at=lambda p, s: p["w1"]))
  with pytest.raises(TypeError, match=r"\['w2'\] has shape \(64, 8\)"):
    jaxfuse.make_train_step(
        mlp_loss, params, SGD, plan, mesh_of(K),
        jaxfuse.StepOptions(grad_at=lambda p, s: {**p, "w2": p["w2"].T}))
  with pytest.raises(TypeError, match=r"\['w1'\] as bfloat16, but the plan "
                     r"was made for float32; make the plan from"):
    jaxfuse.make_train_step(
        mlp_loss, params, SGD, plan, mesh_of(K),
        jaxfuse.StepOptions(grad_at=lambda p, s: jax.tree.map(
            lambda x: x.astype(jnp.bfloat16), p)))


def test_send_early_window_and_compiler_options_reach_the_step(monkeypatch):
  params, batches = _problem(1)
  plan = _plan(params)
  seen = []

  def recording(local, **kwargs):
    seen.append(kwargs)
    return local

  monkeypatch.setattr(jaxfuse.overlap, "send_early", recording)
  for send in (True, 3, 0, False):
    _, step = jaxfuse.make_train_step(
        mlp_loss, params, SGD, plan, mesh_of(K),
        jaxfuse.StepOptions(send_early=send))
    step.compiled(0)
  assert seen == [{}, {"window": 3}, {"window": None}]
  with pytest.raises(TypeError, match=r"send_early=-1 must be .* >= 0"):
    jaxfuse.StepOptions(send_early=-1)
  with pytest.raises(TypeError, match=r"compiler_options='x' must be a dict"):
    jaxfuse.StepOptions(compiler_options="x")
  state, step = jaxfuse.make_train_step(
      mlp_loss, params, SGD, plan, mesh_of(K),
      jaxfuse.StepOptions(compiler_options={"no_such_xla_option": "1"}))
  with pytest.raises(Exception, match="no_such_xla_option"):
    step(state, batches[0])


def test_with_phases_shares_the_steps_compiled_for_a_plan():
  """Phases of one ``Plan`` object share one compiled step (a plan that
  comes back, e.g. a density-1 step every N steps), and ``with_phases``
  (a warm-up that ends early) keeps what is compiled; the old step keeps
  its phases."""
  params, batches = _problem(4)
  plan = _plan(params)
  dense = jaxfuse.with_density(plan, 1.0)
  every_other = [jaxfuse.Phase(0, 1, dense), jaxfuse.Phase(1, 2, plan),
                 jaxfuse.Phase(2, 3, dense), jaxfuse.Phase(3, None, plan)]
  state, step = jaxfuse.make_train_step(mlp_loss, params, SGD, every_other,
                                        mesh_of(K))
  assert step.compiled(0) is step.compiled(2)
  assert step.compiled(1) is step.compiled(3)
  assert step.compiled(0) is not step.compiled(1)
  shorter = step.with_phases([jaxfuse.Phase(0, 1, dense),
                              jaxfuse.Phase(1, None, plan)])
  assert shorter.compiled(1) is step.compiled(1)
  assert len(step.phases) == 4 and len(shorter.phases) == 2
  # the straight run on the shorter phases, bitwise
  straight, alone = jaxfuse.make_train_step(
      mlp_loss, params, SGD, [jaxfuse.Phase(0, 1, dense),
                              jaxfuse.Phase(1, None, plan)], mesh_of(K))
  state, _ = step(state, batches[0])
  straight, _ = alone(straight, batches[0])
  for batch in batches[1:]:
    state, _ = shorter(state, batch)
    straight, _ = alone(straight, batch)
  assert _bits(state) == _bits(straight)
  with pytest.raises(jaxfuse.PlanError, match=r"stop=None"):
    step.with_phases([jaxfuse.Phase(0, 3, plan)])


def test_the_builder_names_a_phase_whose_sparse_steps_outweigh_dense():
  """On 8 workers an all-gather at density 0.25 receives about
  K·ρ·headroom·8 = 24 bytes per element against the ring all-reduce's
  2·(K − 1)/K·4 = 7: make_train_step warns once, naming that phase (and
  only it: the dense phase before it moves dense's bytes)."""
  params, _ = _problem()
  plan = jaxfuse.plan(params, density=0.25, min_sparse_size=64,
                      collective="allgather")
  phases = [jaxfuse.Phase(0, 2, jaxfuse.with_density(plan, 1.0)),
            jaxfuse.Phase(2, None, plan)]
  with pytest.warns(UserWarning, match=r"phase 1 \(steps 2 to the end, "
                    r"density 0\.25\) receives") as caught:
    jaxfuse.make_train_step(mlp_loss, params, SGD, phases, mesh_of(K))
  wire = [w for w in caught if "receives" in str(w.message)]
  assert len(wire) == 1 and "phase 0" not in str(wire[0].message)
  # a density whose all-gather is lighter than dense: no such warning
  light = jaxfuse.with_density(plan, 0.01)
  import warnings as warnings_lib
  with warnings_lib.catch_warnings(record=True) as quiet:
    warnings_lib.simplefilter("always")
    jaxfuse.make_train_step(mlp_loss, params, SGD, light, mesh_of(K))
  assert not [w for w in quiet if "receives" in str(w.message)]
