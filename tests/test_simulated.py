"""K = 8 workers simulated on one CPU device against 8 CPU devices.

``jaxfuse.vmap_workers`` and ``make_train_step(..., simulated_mesh(8))``
run the same per-worker step as a named ``jax.vmap`` on
``jax.devices()[0]``; ``jax.shard_map`` runs it on the 8 devices of the
mesh. Same params, batches and seed, 3 steps.

Bitwise: params, optimizer state (residuals, thresholds, velocities,
moments), stats and losses of ``sgd``, ``onebit_adamw``, ``sync_adamw``
and ``demo`` with the order-statistic estimators (``topk``, ``dgc``)
over each sparse collective scheme (all-gather, ZEN,
SparDL, and hier on a 2 × 4 mesh, whose dense reduce-scatter over the
local axis is bitwise too). Their sums run in an order the code fixes
(the gathered rows added in worker order), and each worker's own
arithmetic is the same.

To rounding (``assert_allclose(rtol=1e-5)``): the thresholds of the
estimators that sum over each worker's gradient (``gaussian``,
``redsync``, ``sidco``: XLA adds a row of the (K, n) batch in another
order than one worker's (n,)); the dense ``psum`` buckets, whose all-reduce XLA's CPU runtime adds in another order than
a reduction over the vmap axis (the last bit of a sum of 8 differs);
and ``local_adamw``, whose per-worker Adam update, fused into the sync,
comes out of XLA up to an ulp apart under the two mappings. Its
first-step updates all lie near ±1 (m/√v of one gradient), so on a
sparse plan an ulp at the threshold changes which slots are selected:
the test runs it on a dense plan (the sync is then a ``pmean``).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxfuse
from jaxfuse.state import checkpoint

from _harness import doc_snippet
from _harness import mesh_of

# the all-gather of density 0.1 on 8 workers outgrows a dense step: said once
pytestmark = pytest.mark.filterwarnings("ignore:phase .* receives:UserWarning")
K = 8
ROWS = 4   # per worker
HIER = ("host", "local")


def _loss(p, batch):
  x, y = batch
  return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] + p.get("b", 0) - y) ** 2)


def _problem(steps=3, bias=False):
  rng = np.random.default_rng(0)
  params = {"w1": rng.normal(size=(32, 64)).astype(np.float32) / 6,
            "w2": rng.normal(size=(64, 8)).astype(np.float32) / 8}
  if bias:   # 8 elements: a dense leaf, synced in a psum bucket
    params["b"] = np.full((8,), 0.1, np.float32)
  batches = [(rng.normal(size=(ROWS * K, 32)).astype(np.float32),
              rng.normal(size=(ROWS * K, 8)).astype(np.float32))
             for _ in range(steps)]
  return params, batches


def _plan(params, collective, estimator, density=0.1):
  return jaxfuse.plan(params, density=density, collective=collective,
                      estimator=estimator,
                      settings=jaxfuse.Settings(min_sparse_size=64))


def _low_level(opt, mesh, axis, params, batches):
  """The low-level step (docs/low_level.md) on ``mesh``: shard_map on a
  real mesh, vmap_workers on a simulated one."""
  def local(params, opt_state, batch):
    loss, grads = jax.value_and_grad(_loss)(
        jaxfuse.local_params(params, axis), batch)
    updates, opt_state = opt.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state,
            jax.lax.pmean(loss, axis))

  state = jaxfuse.init_state(opt, params, mesh, axis)
  specs = jaxfuse.state_specs(state, axis)
  args = ((P(), specs, P(axis)), (P(), specs, P()))
  if isinstance(mesh, jax.sharding.Mesh):
    step = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=args[0],
                                 out_specs=args[1]))
    params = jax.device_put(params, NamedSharding(mesh, P()))
    place = lambda b: jax.device_put(b, NamedSharding(mesh, P(axis)))
  else:
    step = jax.jit(jaxfuse.vmap_workers(local, mesh, *args))
    place = lambda b: b
  losses = []
  for batch in batches:
    params, state, loss = step(params, state, place(batch))
    losses.append(loss)
  return jax.device_get((params, state, losses))


def _assert_bitwise(got, want):
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(want),
                          jax.tree.leaves(got)):
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape and a.tobytes() == b.tobytes(), (
        jax.tree_util.keystr(path))


CASES = [   # (recipe, collective, estimator): each scheme and recipe once
    ("sgd", "allgather", "dgc"),
    ("onebit_adamw", "zen", "topk"),
    ("sync_adamw", "spardl", "topk"),
    ("demo", jaxfuse.collectives.AllGather(packed_indices=True), "dgc"),
    ("sgd", "hier", "topk"),
]


def _recipe(name, plan, axis):
  options = {"options": jaxfuse.RecipeOptions(axis_name=axis)}
  if name == "sgd":
    return jaxfuse.sgd(plan, 0.05, momentum=0.9, **options)
  return getattr(jaxfuse, name)(plan, 1e-3, **options)


@pytest.mark.parametrize("recipe,collective,estimator", CASES,
                         ids=lambda c: getattr(c, "name", str(c)))
def test_simulated_workers_are_bitwise_the_devices(recipe, collective,
                                                   estimator):
  params, batches = _problem()
  hier = collective == "hier"
  axis = HIER if hier else "data"
  opt = _recipe(recipe, _plan(params, collective, estimator), axis)
  real = _low_level(opt, mesh_of(K, local=4) if hier else mesh_of(K), axis,
                    params, batches)
  sim_mesh = jaxfuse.simulated_mesh((2, 4) if hier else K)
  sim = _low_level(opt, sim_mesh, axis, params, batches)
  _assert_bitwise(sim, real)
  stats = jaxfuse.sync_stats(sim[1])
  assert np.asarray(stats.selected).shape[0] == K     # a row per worker
  assert np.all(np.asarray(stats.wire_bytes) > 0)


def test_psum_buckets_and_local_adamw_match_to_rounding():
  params, batches = _problem(bias=True)
  opt = jaxfuse.local_adamw(_plan(params, "allgather", "dgc", density=1.0),
                            1e-3)
  real = _low_level(opt, mesh_of(K), "data", params, batches)
  sim = _low_level(opt, jaxfuse.simulated_mesh(K), "data", params, batches)
  for a, b in zip(jax.tree.leaves(real), jax.tree.leaves(sim)):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5,
                               atol=1e-7)


@pytest.mark.parametrize("estimator", ["gaussian", "redsync", "sidco"])
def test_estimators_of_moments_match_to_rounding(estimator):
  params, batches = _problem()
  opt = jaxfuse.sgd(_plan(params, "allgather", estimator), 0.05)
  real = _low_level(opt, mesh_of(K), "data", params, batches)
  sim = _low_level(opt, jaxfuse.simulated_mesh(K), "data", params, batches)
  for a, b in zip(jax.tree.leaves(real), jax.tree.leaves(sim)):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5,
                               atol=1e-7)


def test_each_worker_has_its_own_rows_and_residual():
  params, batches = _problem(1)
  x, y = batches[0]
  opt = jaxfuse.sgd(_plan(params, "allgather", "topk"), 0.05)
  _, state, (loss,) = _low_level(opt, jaxfuse.simulated_mesh(K), "data",
                                 params, batches)
  per_worker = [_loss(params, (x[k * ROWS:(k + 1) * ROWS],
                               y[k * ROWS:(k + 1) * ROWS]))
                for k in range(K)]
  np.testing.assert_allclose(float(loss), np.mean(per_worker), rtol=1e-6)
  plan = _plan(params, "allgather", "topk")
  residuals = np.asarray(jaxfuse.unit_residuals(plan, _sync(state))[0])
  assert residuals.shape[0] == K
  rows = [residuals[k].tobytes() for k in range(K)]
  assert len(set(rows)) == K          # different data, different residuals
  assert np.all(np.abs(residuals).reshape(K, -1).sum(axis=1) > 0)


def _sync(state):
  """The ``SparseSyncState`` inside a recipe's state."""
  return next(x for x in jax.tree.leaves(
      state, is_leaf=lambda x: isinstance(x, jaxfuse.SparseSyncState))
              if isinstance(x, jaxfuse.SparseSyncState))


SGD = functools.partial(jaxfuse.sgd, learning_rate=0.05, momentum=0.9)


def _builder(mesh, phases, params, batches, options=None):
  state, step = jaxfuse.make_train_step(_loss, params, SGD, phases, mesh,
                                        options)
  losses = []
  for batch in batches:
    state, loss = step(state, batch)
    losses.append(loss)
  return state, step, jax.device_get(losses)


def test_the_builder_on_a_simulated_mesh_is_bitwise_the_devices():
  params, batches = _problem()
  plan = _plan(params, "allgather", "dgc")
  phases = jaxfuse.density_warmup(plan, steps=1, densities=(0.5,))
  assert len(phases) == 2          # two compiled steps, sparse both
  options = jaxfuse.StepOptions(check_replicas=True, send_early=True)
  real, _, real_losses = _builder(mesh_of(K), phases, params, batches,
                                  options)
  sim, step, sim_losses = _builder(jaxfuse.simulated_mesh(K), phases,
                                   params, batches, options)
  _assert_bitwise((sim.params, sim.opt_state, sim_losses),
                  (real.params, real.opt_state, real_losses))
  assert sim.step == 3 and len(step._compiled) == 2
  leaves = jax.tree.leaves((sim.params, sim.opt_state))
  assert {x.sharding.device_set.pop() for x in leaves} == {jax.devices()[0]}


def test_aux_and_model_state_are_reduced_over_simulated_workers():
  """The builder's reductions read which values differ between workers
  from the vmap's batching: a float aux and model state averaged, an
  integer count summed, a value equal on every worker as it is."""
  params, batches = _problem(1)
  x, y = batches[0]
  rows = lambda a, k: a[k * ROWS:(k + 1) * ROWS]

  def loss_fn(p, model_state, batch):
    bx, by = batch
    new = {"mean": 0.9 * model_state["mean"] + 0.1 * jnp.mean(bx, 0),
           "count": model_state["count"] + 1}
    aux = {"first": jnp.mean(bx[:, 0]), "positive": jnp.sum(by[:, 0] > 0),
           "same": jnp.float32(2.0)}
    return _loss(p, batch), (new, aux)

  start = {"mean": np.full(32, 0.5, np.float32), "count": np.int32(0)}
  state, step = jaxfuse.make_train_step(
      loss_fn, params, SGD, _plan(params, "allgather", "topk"),
      jaxfuse.simulated_mesh(K),
      jaxfuse.StepOptions(has_aux=True, model_state=start))
  state, (loss, aux) = step(state, batches[0])
  np.testing.assert_allclose(
      float(aux["first"]), np.mean([np.mean(rows(x, k)[:, 0])
                                    for k in range(K)]), rtol=1e-6)
  assert int(aux["positive"]) == int(np.sum(y[:, 0] > 0))   # whole batch
  assert float(aux["same"]) == 2.0 and np.shape(aux["same"]) == ()
  np.testing.assert_allclose(
      np.asarray(state.model_state["mean"]),
      np.mean([0.45 + 0.1 * np.mean(rows(x, k), 0) for k in range(K)], 0),
      rtol=1e-5)
  assert int(state.model_state["count"]) == 1
  np.testing.assert_allclose(
      float(loss), np.mean([_loss(params, (rows(x, k), rows(y, k)))
                            for k in range(K)]), rtol=1e-6)


def test_a_checkpoint_moves_between_simulated_and_real_workers(tmp_path):
  params, batches = _problem(2)
  plan = _plan(params, "allgather", "dgc")
  sim, sim_step, _ = _builder(jaxfuse.simulated_mesh(K), plan, params,
                              batches[:1])
  sim_step.save(checkpoint.manager(tmp_path / "sim"), sim)
  fresh, real_step = jaxfuse.make_train_step(_loss, params, SGD, plan,
                                             mesh_of(K))
  restored = real_step.restore(checkpoint.manager(tmp_path / "sim"), fresh)
  _assert_bitwise((restored.params, restored.opt_state),
                  (sim.params, sim.opt_state))
  assert restored.step == 1
  real_state, real_loss = real_step(restored, batches[1])
  sim_state, sim_loss = sim_step(sim, batches[1])
  _assert_bitwise((sim_state.params, sim_state.opt_state, sim_loss),
                  (real_state.params, real_state.opt_state, real_loss))
  real_step.save(checkpoint.manager(tmp_path / "real"), real_state)
  fresh, _ = jaxfuse.make_train_step(_loss, params, SGD, plan,
                                     jaxfuse.simulated_mesh(K))
  back = sim_step.restore(checkpoint.manager(tmp_path / "real"), fresh)
  _assert_bitwise((back.params, back.opt_state),
                  (real_state.params, real_state.opt_state))


def _steps(opt, mesh, params, state, batches):
  """``opt``'s low-level step on ``mesh`` (axis "data") from ``state``;
  the params and state stay on the mesh."""
  def local(params, opt_state, batch):
    grads = jax.grad(_loss)(jaxfuse.local_params(params), batch)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  specs = jaxfuse.state_specs(state)
  args = ((P(), specs, P("data")), (P(), specs))
  if isinstance(mesh, jax.sharding.Mesh):
    step = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=args[0],
                                 out_specs=args[1]))
    batches = [jax.device_put(b, NamedSharding(mesh, P("data")))
               for b in batches]
  else:
    step = jax.jit(jaxfuse.vmap_workers(local, mesh, *args))
  for batch in batches:
    params, state = step(params, state, batch)
  return params, state


def test_relayout_on_simulated_workers_is_bitwise_the_devices():
  params, batches = _problem(2)
  old = _plan(params, "allgather", "topk")
  new = jaxfuse.plan(params, density=0.1, strategy="single",
                     estimator="topk",
                     settings=jaxfuse.Settings(min_sparse_size=64))
  assert len(new.buckets) != len(old.buckets)
  results = []
  for mesh in (mesh_of(K), jaxfuse.simulated_mesh(K)):
    p = (jax.device_put(params, NamedSharding(mesh, P()))
         if isinstance(mesh, jax.sharding.Mesh) else params)
    opt = jaxfuse.sgd(old, 0.05)
    p, state = _steps(opt, mesh, p, jaxfuse.init_state(opt, p, mesh),
                      batches[:1])
    state = jaxfuse.relayout(state, old, new)
    results.append(jax.device_get(_steps(jaxfuse.sgd(new, 0.05), mesh, p,
                                         state, batches[1:])))
  _assert_bitwise(results[1], results[0])


def test_a_replicated_output_that_depends_on_the_worker_is_refused():
  def local(x):
    return x * jax.lax.axis_index("data")
  step = jaxfuse.vmap_workers(local, jaxfuse.simulated_mesh(K), (P(),), P())
  with pytest.raises(ValueError, match="out_axes"):
    jax.jit(step)(jnp.ones(3))
  with pytest.raises(ValueError, match=r"does not split over the 8"):
    jaxfuse.vmap_workers(lambda x: x, jaxfuse.simulated_mesh(K),
                         (P("data"),), P("data"))(jnp.ones(12))


def test_a_bare_vmap_that_drops_the_worker_axis_names_vmap_workers():
  params, batches = _problem(1)
  opt = jaxfuse.sgd(_plan(params, "allgather", "topk"), 0.05)
  state = jaxfuse.init_state(opt, params, jaxfuse.simulated_mesh(K))
  specs = jaxfuse.state_specs(state)
  axes = jax.tree.map(lambda s: 0 if s == P("data") else None, specs,
                      is_leaf=lambda s: isinstance(s, P))

  def local(params, opt_state, batch):
    grads = jax.grad(_loss)(params, batch)
    return opt.update(grads, opt_state, params)

  x, y = batches[0]
  batch = (x.reshape(K, ROWS, -1), y.reshape(K, ROWS, -1))
  step = jax.vmap(local, in_axes=(None, axes, 0), axis_name="data")
  with pytest.raises(jaxfuse.SyncError, match=r"vmap_workers\(local"):
    step(params, state, batch)


def test_the_docs_snippets_run_as_written():
  """docs/low_level.md's vmap_workers step gives the 8 devices' bits;
  docs/choosing.md's builder form trains 16 workers on one device."""
  params, batches = _problem(1)
  opt = jaxfuse.sgd(_plan(params, "allgather", "topk"), 0.05)

  def local(params, opt_state, batch):
    loss, grads = jax.value_and_grad(_loss)(jaxfuse.local_params(params),
                                            batch)
    updates, opt_state = opt.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state,
            jax.lax.pmean(loss, "data"))

  user = dict(jax=jax, jaxfuse=jaxfuse, P=P, opt=opt, params=params,
              local=local, batch=batches[0])
  exec(doc_snippet("docs/low_level.md", "## K workers on one device"), user)  # pylint: disable=exec-used
  real = _low_level(opt, mesh_of(K), "data", params, batches)
  _assert_bitwise(jax.device_get(
      (user["params"], user["opt_state"], [user["loss"]])), real)

  rng = np.random.default_rng(1)
  rows = [(rng.normal(size=(16 * 2, 32)).astype(np.float32),
           rng.normal(size=(16 * 2, 8)).astype(np.float32))
          for _ in range(2)]
  user = dict(jaxfuse=jaxfuse, loss_fn=_loss, params=params, batches=rows,
              opt=SGD, phases=_plan(params, "zen", "topk"))
  exec(doc_snippet("docs/choosing.md", "## K workers on one device"), user)  # pylint: disable=exec-used
  state = user["state"]
  assert state.step == 2 and np.isfinite(float(user["loss"]))
  assert np.asarray(jaxfuse.sync_stats(state.opt_state).selected).shape[0] == 16


def test_only_named_vmap_axes_a_value_depends_on_count_as_varying():
  from jaxfuse import _compat  # pylint: disable=g-import-not-at-top
  seen = {}

  def record(key):
    def fn(x, y):
      seen[key] = (_compat.varying_axes(x), _compat.varying_axes(y))
      return x
    return fn

  x, y = jnp.ones((2, 4, 3)), jnp.ones(3)
  jax.vmap(jax.vmap(record("named"), in_axes=(0, None), axis_name="local"),
           in_axes=(0, None), axis_name="host")(x, y)
  jax.vmap(jax.vmap(record("inner unnamed"), in_axes=(0, None)),
           in_axes=(0, None), axis_name="data")(x, y)
  jax.vmap(record("unnamed"), in_axes=(0, None))(x[0], y)
  assert seen == {"named": ({"host", "local"}, set()),
                  "inner unnamed": ({"data"}, set()),
                  "unnamed": (set(), set())}
