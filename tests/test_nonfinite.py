"""``jaxfuse.apply_if_finite``: a step whose gradient has a NaN on one worker
is skipped on every worker, the optimizer's state kept but for
sparse_sync's, and training goes on; optax's wrappers that would part the
workers are refused."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxfuse

from _harness import NUM_WORKERS, fast_jit, mesh_of, shard, sharded_update

K = NUM_WORKERS
SHAPES = {"w": (64, 48), "b": (48,)}


def _params():
  rng = np.random.default_rng(1)
  return {k: rng.normal(size=s).astype(np.float32) / 8
          for k, s in SHAPES.items()}


def _plan(collective="allgather"):
  return jaxfuse.plan(_params(), density=0.05,
                      collective=collective,
                      settings=jaxfuse.Settings(min_sparse_size=64))


def _grads(seed, nan=False):
  """(K, ...) gradients; ``nan``: one NaN in "w" on the last worker only."""
  rng = np.random.default_rng(seed)
  g = {k: rng.normal(size=(K,) + s).astype(np.float32)
       for k, s in SHAPES.items()}
  if nan:
    g["w"][K - 1, 3, 5] = np.nan
  return g


def _runner(tx, mesh):
  """(params, state, run): the placed parameters, the initial state, and
  run(params, state, grads) -> (params, state, updates), one step under
  shard_map, compiled once."""
  params = jax.device_put(_params(), NamedSharding(mesh, P()))
  state = jaxfuse.init_state(tx, params, mesh)
  specs = jaxfuse.state_specs(state)

  update = sharded_update(tx, mesh, specs, with_params=True)

  def train(params, state, grads):
    updates, state = update(grads, state, params)
    return optax.apply_updates(params, updates), state, updates

  step = fast_jit(train)

  def run(params, state, grads):
    out = step(params, state, shard(mesh, grads))
    return jax.block_until_ready(out)
  return params, state, run


def _equal(a, b) -> bool:
  return all(np.array_equal(np.asarray(x), np.asarray(y), equal_nan=True)
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b),
                             strict=True))


RECIPES = {
    "sgd": lambda plan: jaxfuse.sgd(plan, 0.05, momentum=0.9),
    "sgd_zen": lambda plan: jaxfuse.sgd(plan, 0.05, momentum=0.9),
    "sgd_spardl": lambda plan: jaxfuse.sgd(plan, 0.05),
    "local_adamw": lambda plan: jaxfuse.local_adamw(plan, 1e-3),
    "sync_adamw": lambda plan: jaxfuse.sync_adamw(plan, 1e-3),
    "onebit_adamw_dense": lambda plan: jaxfuse.onebit_adamw(
        jaxfuse.with_density(plan, 1.0), 1e-3),
    "demo": lambda plan: jaxfuse.demo(plan, 0.05, clip_norm=1.0),
    "onebit_adamw_sparse": lambda plan: jaxfuse.onebit_adamw(plan, 1e-3),
}
COLLECTIVE = {"sgd_zen": "zen", "sgd_spardl": "spardl"}
# the first step's optimizer, where not the recipe's own: 1-bit Adam's
# sparse phase follows a dense step (its update is zero until then)
FIRST = {"onebit_adamw_sparse": RECIPES["onebit_adamw_dense"]}


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_a_skipped_step_moves_nothing_and_keeps_the_state(recipe):
  """A NaN on one worker: the step moves nothing; the inner state is the
  one before, but for sparse_sync's, which is the unwrapped step's (it
  guards its own residuals); nothing is poisoned, and training goes on."""
  collective = COLLECTIVE.get(recipe, "allgather")
  if collective != "allgather" and K < 2:
    pytest.skip(f"{collective} needs 2 or more workers")
  mesh = mesh_of(K)
  plan = _plan(collective)
  tx = jaxfuse.apply_if_finite(RECIPES[recipe](plan), 3)
  params, state, run = _runner(tx, mesh)
  if recipe in FIRST:
    _, _, first = _runner(jaxfuse.apply_if_finite(FIRST[recipe](plan), 3),
                          mesh)
    p1, s1, _ = first(params, state, _grads(1))
  else:
    p1, s1, _ = run(params, state, _grads(1))
  p_nan, s_nan, u_nan = run(p1, s1, _grads(2, nan=True))
  assert all(not np.any(np.asarray(u)) for u in jax.tree.leaves(u_nan))
  assert _equal(p_nan, p1)
  _, _, bare = _runner(RECIPES[recipe](plan), mesh)
  _, s_bare, u_bare = bare(p1, s1.inner, _grads(2, nan=True))
  assert not all(np.isfinite(np.asarray(u)).all()
                 for u in jax.tree.leaves(u_bare))   # what was skipped
  is_sync = lambda s: isinstance(s, jaxfuse.SparseSyncState)
  want = jax.tree.map(lambda old, new: new if is_sync(old) else old,
                      s1.inner, s_bare, is_leaf=is_sync)
  assert _equal(s_nan.inner, want)
  stats_free = jax.tree.map(lambda s: s._replace(stats=()) if is_sync(s)
                            else s, s_nan, is_leaf=is_sync)
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(
      stats_free) if np.issubdtype(np.asarray(x).dtype, np.floating))
  # the stats are the skipped step's: they name the leaf and the worker
  nonfinite = np.asarray(jaxfuse.sync_stats(s_nan).nonfinite)
  w = [l.path for l in plan.leaves].index("['w']")
  assert nonfinite[K - 1, w] and not nonfinite[:K - 1, w].any()
  assert (int(s_nan.notfinite_count), bool(s_nan.last_finite),
          int(s_nan.total_notfinite)) == (1, False, 1)

  p2, s2, u2 = run(p_nan, s_nan, _grads(3))
  assert all(np.isfinite(np.asarray(u)).all() for u in jax.tree.leaves(u2))
  assert not _equal(p2, p1)          # a real step was taken
  assert (int(s2.notfinite_count), bool(s2.last_finite),
          int(s2.total_notfinite)) == (0, True, 1)


@pytest.mark.parametrize("decay", [1.0, 0.8])
@pytest.mark.parametrize("sparse_wire", ["gradient", "bfloat16"])
def test_a_non_finite_worker_keeps_its_residual_as_it_was(sparse_wire, decay):
  """sparse_sync alone: the worker whose gradient has a NaN keeps the
  residual it had, undecayed (residual_decay) and free of the wire's
  rounding; the other workers step."""
  mesh = mesh_of(K)
  plan = jaxfuse.plan(_params(), density=0.05,
                      settings=jaxfuse.Settings(
                          min_sparse_size=64, sparse_wire=sparse_wire))
  tx = jaxfuse.sparse_sync(plan, residual_decay=decay)
  state = jaxfuse.init_state(tx, _params(), mesh)
  step = fast_jit(sharded_update(tx, mesh, jaxfuse.state_specs(state)))
  _, s1 = jax.block_until_ready(step(shard(mesh, _grads(1)), state))
  _, s2 = jax.block_until_ready(step(shard(mesh, _grads(2, nan=True)), s1))
  (u,) = [i for i, unit in enumerate(jaxfuse.sync.bucket_steps.compile_plan(
      plan).units) if plan.leaves[unit.leaves[0]].path == "['w']"]
  before = np.asarray(jaxfuse.unit_residuals(plan, s1)[u])
  after = np.asarray(jaxfuse.unit_residuals(plan, s2)[u])
  assert np.abs(before[K - 1]).max() > 0
  np.testing.assert_array_equal(after[K - 1], before[K - 1])
  assert all(np.isfinite(np.asarray(r)).all() for r in s2.residuals)
  if K > 1:
    assert not np.array_equal(after[:K - 1], before[:K - 1])


@pytest.mark.parametrize("limit", [0, 1])
def test_after_max_consecutive_errors_the_update_is_applied(limit):
  """optax's rule: the (limit + 1)-th non-finite step in a row goes
  through (here a NaN update); a finite step resets the count."""
  mesh = mesh_of(K)
  tx = jaxfuse.apply_if_finite(jaxfuse.sgd(_plan(), 0.05), limit)
  params, state, run = _runner(tx, mesh)
  for n in range(1, limit + 2):
    params, state, updates = run(params, state, _grads(n, nan=True))
    finite = all(np.isfinite(np.asarray(u)).all()
                 for u in jax.tree.leaves(updates))
    assert finite == (n <= limit), n
    assert int(state.notfinite_count) == n
  params, state, _ = run(params, state, _grads(9))
  assert (int(state.notfinite_count), int(state.total_notfinite)) == (
      0, limit + 1)


def test_optax_wrappers_that_would_part_the_workers_are_refused():
  """Around a sync, optax.apply_if_finite and optax.MultiSteps decide on or
  keep each worker's own gradient: refused with what to use; after the
  sync (its output is the same everywhere) they are fine."""
  mesh = mesh_of(K)
  params, plan = _params(), _plan()
  with pytest.raises(jaxfuse.SyncError, match="jaxfuse.apply_if_finite"):
    jaxfuse.init_state(optax.apply_if_finite(jaxfuse.sgd(plan, 0.1), 3),
                       params, mesh)
  with pytest.raises(jaxfuse.SyncError, match="Gradient accumulation"):
    jaxfuse.state_specs(jax.eval_shape(
        optax.MultiSteps(jaxfuse.onebit_adamw(plan, 1e-3), 4).init, params))
  after = optax.chain(jaxfuse.sparse_sync(plan),
                      optax.apply_if_finite(optax.sgd(0.1), 3))
  specs = jaxfuse.state_specs(jaxfuse.init_state(after, params, mesh))
  assert specs[1].notfinite_count == P()
  assert all(s == P("data") for s in jax.tree.leaves(
      specs[0], is_leaf=lambda x: isinstance(x, P)))


@pytest.mark.parametrize("limit", [-1, 1.5, True, "3"])
def test_max_consecutive_errors_must_be_a_count(limit):
  with pytest.raises(jaxfuse.SyncError, match="max_consecutive_errors"):
    jaxfuse.apply_if_finite(jaxfuse.sgd(_plan(), 0.1), limit)


def test_delayed_goes_outside():
  """Inside, a skip would bring the delayed NaN gradient back every step;
  outside, the NaN gradient is skipped once, one step late."""
  params, plan = _params(), _plan()
  with pytest.raises(jaxfuse.SyncError, match="put delayed outside"):
    jaxfuse.apply_if_finite(jaxfuse.delayed(jaxfuse.sgd(plan, 0.1)), 3
                            ).init(params)
  tx = jaxfuse.delayed(jaxfuse.apply_if_finite(jaxfuse.sgd(plan, 0.1), 3))
  params, state, run = _runner(tx, mesh_of(K))
  counts = []
  for grads in (_grads(1), _grads(2, nan=True), _grads(3), _grads(4)):
    params, state, _ = run(params, state, grads)
    counts.append((int(state.inner.notfinite_count),
                   int(state.inner.total_notfinite)))
  assert counts == [(0, 0), (0, 0), (1, 1), (0, 1)]
  assert all(np.isfinite(np.asarray(p)).all() for p in jax.tree.leaves(
      params))


def test_a_wrapped_state_checkpoints_and_restores(tmp_path):
  """apply_if_finite around an inject_hyperparams recipe: its state (counts,
  a bool, the hyperparameters' dict, the per-worker sync state) saves and
  comes back bitwise, sharded as it was."""
  mesh = mesh_of(K)
  plan = _plan()
  tx = jaxfuse.apply_if_finite(optax.inject_hyperparams(
      jaxfuse.sgd, static_args=jaxfuse.optim.recipes.STATIC_ARGS["sgd"])(
          plan=plan, learning_rate=0.05), 3)
  params, state, run = _runner(tx, mesh)
  params, state, _ = run(params, state, _grads(1))
  params, state, _ = run(params, state, _grads(2, nan=True))
  mngr = jaxfuse.checkpoint.manager(tmp_path)
  jaxfuse.checkpoint.save(mngr, 2, {"params": params, "opt": state}, plan)
  like = jax.tree.map(jnp.zeros_like, {"params": params, "opt": state})
  step, back = jaxfuse.checkpoint.restore(mngr, like, plan)
  assert step == 2 and int(back["opt"].total_notfinite) == 1
  for a, b in zip(jax.tree.leaves((params, state)),
                  jax.tree.leaves((back["params"], back["opt"])),
                  strict=True):
    # (the skipped step's stats hold the NaN worker's threshold, NaN)
    assert np.array_equal(np.asarray(a), np.asarray(b), equal_nan=True)
    assert b.sharding == a.sharding


@pytest.mark.parametrize("limit", [0, 1])
def test_counts_follow_optax_when_a_non_finite_update_goes_through(limit):
  params = {"w": jnp.ones((3,), jnp.float32)}
  nan = {"w": jnp.array([1.0, jnp.nan, 1.0], jnp.float32)}
  ok = {"w": jnp.ones((3,), jnp.float32)}
  ours = jaxfuse.apply_if_finite(optax.sgd(0.1), limit)
  ref = optax.apply_if_finite(optax.sgd(0.1), limit)   # the reference
  s, r = ours.init(params), ref.init(params)
  counts = lambda x: (int(x.notfinite_count), bool(x.last_finite),
                      int(x.total_notfinite))
  for n in range(1, limit + 2):
    u, s = ours.update(nan, s, params)
    v, r = ref.update(nan, r, params)
    assert counts(s) == counts(r), n
    assert jnp.array_equal(u["w"], v["w"], equal_nan=True), n
  # The (limit + 1)-th NaN step in a row went through, NaN and all; it was
  # not finite, and limit + 1 steps were.
  assert bool(jnp.isnan(u["w"][1]))
  assert counts(s) == (limit + 1, False, limit + 1)
  u, s = ours.update(ok, s, params)
  assert counts(s) == (0, True, limit + 1)


def _builder_run(recipe, batches, phases=None):
  """``make_train_step`` over a small least squares with ``recipe`` (8 CPU
  workers); the states and losses of ``batches``."""
  params = {"w": jnp.ones((64, 32)) / 64, "b": jnp.zeros((32,))}
  plan = jaxfuse.plan(params, density=0.1,
                      settings=jaxfuse.Settings(min_sparse_size=64))

  def loss_fn(p, x):
    return jnp.mean((x[:, :64] @ p["w"] + p["b"]) ** 2) + 0 * jnp.sum(x)

  opt = (recipe, {"learning_rate": 0.1})
  state, step = jaxfuse.make_train_step(
      loss_fn, params, opt, phases(plan) if phases else plan,
      jaxfuse.make_mesh(NUM_WORKERS))
  losses = []
  for x in batches:
    state, loss = step(state, x)
    losses.append(loss)
  return state, losses, step


@pytest.mark.parametrize("recipe", ["sgd", "onebit_adamw"])
def test_a_nonfinite_loss_under_the_step_builder_is_reported(recipe):
  """One worker's NaN under a recipe: the step builder warns once, naming
  the step, the diverged loss and the fixes; finite steps say nothing."""
  x = jnp.ones((NUM_WORKERS * 2, 64)) / 64
  dense_first = lambda plan: jaxfuse.density_warmup(plan, dense_steps=2,
                                                    steps=1)
  import warnings as warnings_lib
  with warnings_lib.catch_warnings():
    warnings_lib.simplefilter("error")
    # the ramp's 25 % phase moves more than dense on 8 workers: said apart
    warnings_lib.filterwarnings("ignore", message=r"phase \d+ .* receives")
    _builder_run(recipe, [x, x], dense_first)
  bad = x.at[-2, 0].set(jnp.nan)   # the last worker's batch
  with pytest.warns(UserWarning, match=r"make_train_step: the loss of step 1 "
                    r"is nan.*learning rate.*jaxfuse\.apply_if_finite") as rec:
    _, losses, _ = _builder_run(recipe, [x, bad, bad], dense_first)
  assert len([r for r in rec if "the loss of step" in str(r.message)]) == 1
  assert np.isfinite(float(losses[0])) and not np.isfinite(float(losses[1]))


def test_no_host_callback_inside_a_recipe_step():
  """The checks stay out of the compiled step: a host callback there, even
  under a ``lax.cond``, makes a GPU wait for the host every step."""
  x = jnp.ones((NUM_WORKERS * 2, 64)) / 64
  for recipe in ("sgd", "onebit_adamw"):
    state, _, step = _builder_run(recipe, [x])
    args = (state.params, state.opt_state, state.model_state, step.place(x))
    text = step.compiled(0).lower(*args).as_text()
    assert "callback" not in text.lower(), recipe
