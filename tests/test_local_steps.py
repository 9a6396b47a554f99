"""jaxfuse.local_steps (4 CPU workers, a small MLP): DiLoCo on a density-1
plan is the hand-written DiLoCo; between syncs the anchor stays and the
workers part; the sparse sync conserves what the workers owe (property);
simulated workers compute what devices do; a restart inside an H-block is
bitwise the straight run, and one on another worker count keeps the owed
mean; each misuse names its fix."""

import functools

from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxfuse
from jaxfuse import plans as plan_lib
from jaxfuse.state import checkpoint

from _harness import mesh_of, mlp_loss, mlp_problem

K = 4
ROWS = 4   # per worker
H = 3
NO_DONATION = jaxfuse.StepOptions(donate=False)


def _problem(steps, seed=0):
  return mlp_problem(steps, K, ROWS, seed)


PARAMS, BATCHES = _problem(8)
PLAN = jaxfuse.plan(PARAMS, density=0.1,
                    settings=jaxfuse.Settings(min_sparse_size=64))
DENSE = jaxfuse.with_density(PLAN, 1.0)


def _bits(tree):
  return [np.asarray(x).tobytes() for x in jax.tree.leaves(
      jax.device_get(tree))]


def _diloco(plan, every=H):
  """DiLoCo's outer step (Nesterov, lr 0.7, momentum 0.9) on ``plan``."""
  return jaxfuse.local_steps(
      plan, optax.adam(1e-2), every,
      outer=optax.sgd(0.7, momentum=0.9, nesterov=True))


def _reference_diloco(params, batches, every, lr=1e-2):
  """DiLoCo by hand: K workers' Adam steps on their rows, then Nesterov
  (lr 0.7, momentum 0.9) on the mean of anchor − θ_k."""
  inner = optax.adam(lr)
  grad = jax.jit(jax.grad(mlp_loss))
  anchor = jax.tree.map(jnp.asarray, params)
  theta = [anchor] * K
  states = [inner.init(anchor)] * K
  momentum = jax.tree.map(jnp.zeros_like, anchor)
  for t, (x, y) in enumerate(batches):
    for k in range(K):
      rows = slice(k * ROWS, (k + 1) * ROWS)
      g = grad(theta[k], (x[rows], y[rows]))
      u, states[k] = inner.update(g, states[k], theta[k])
      theta[k] = optax.apply_updates(theta[k], u)
    if (t + 1) % every == 0:
      delta = jax.tree.map(lambda a, *ts: sum(a - t for t in ts) / K,
                           anchor, *theta)
      momentum = jax.tree.map(lambda m, d: 0.9 * m + d, momentum, delta)
      anchor = jax.tree.map(lambda a, d, m: a - 0.7 * (d + 0.9 * m),
                            anchor, delta, momentum)
      theta = [anchor] * K
  return anchor


def test_diloco_on_a_dense_plan_is_the_hand_written_diloco():
  state, step = jaxfuse.make_train_step(mlp_loss, PARAMS, _diloco,
                                        DENSE, mesh_of(K))
  for batch in BATCHES[:7]:   # two syncs and one inner step after them
    state, _ = step(state, batch)
  want = _reference_diloco(PARAMS, BATCHES[:7], H)
  for got, ref in zip(jax.tree.leaves(state.params), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=2e-5,
                               atol=2e-6)
  # the anchor moved (two outer steps)
  assert _bits(state.params) != _bits(PARAMS)


def test_between_syncs_the_anchor_stays_and_the_workers_part():
  opt = functools.partial(jaxfuse.local_steps, inner=optax.adam(1e-2),
                          every=H)
  state, step = jaxfuse.make_train_step(mlp_loss, PARAMS, opt, PLAN,
                                        mesh_of(K), NO_DONATION)
  for t, batch in enumerate(BATCHES[:H + 1]):
    before = state
    state, _ = step(state, batch)
    local = jax.device_get(state.opt_state.local.inner["w1"])
    if t + 1 == H:   # the sync: the anchor moves, every θ_k is the anchor
      assert _bits(state.params) != _bits(before.params)
      for k in range(K):
        np.testing.assert_array_equal(local[k], state.params["w1"])
    else:            # an inner step: the anchor stays, each θ_k its own
      assert _bits(state.params) == _bits(before.params)
      assert len({local[k].tobytes() for k in range(K)}) == K
  assert int(state.opt_state.count) == H + 1


def _conservation_run(decay, seed):
  """(owed before the second sync, what K·⟨sent⟩ + Σ e' holds after it),
  per selection unit, float64; SparseLoCo's outer step (the anchor moves
  by −⟨sent⟩)."""
  _, batches = _problem(2 * H, seed)
  sync, hold = _steps(decay)
  state = sync[0]
  for batch in batches[:2 * H - 1]:
    state, _ = sync[1](state, batch)
  # θ_k after step 2H's inner step, before its sync: the same state
  # stepped once with syncs further off (the inner steps are the same)
  pre, _ = hold[1](state, batches[-1])
  post, _ = sync[1](state, batches[-1])
  units, _ = plan_lib.units(PLAN)

  def flat(tree, unit, workers=False):
    """The unit's elements of ``tree`` (per worker: (K, n)), float64."""
    leaves = jax.tree.leaves(tree)
    return np.concatenate([
        np.asarray(leaves[j], np.float64).reshape((K, -1) if workers else -1)
        for j in unit.leaves], axis=-1)

  old_e = [np.asarray(r, np.float64) for r in jaxfuse.unit_residuals(
      PLAN, state.opt_state.sync)]
  new_e = [np.asarray(r, np.float64) for r in jaxfuse.unit_residuals(
      PLAN, post.opt_state.sync)]
  owed, held = [], []
  for u, unit in enumerate(units):
    delta = flat(state.params, unit)[None] - flat(
        pre.opt_state.local.inner, unit, workers=True)
    update = flat(jax.tree.map(lambda a, b: np.asarray(a, np.float64) -
                               np.asarray(b, np.float64), post.params,
                               state.params), unit)
    owed.append((delta + decay * old_e[u]).sum(0))
    held.append(-K * update + new_e[u].sum(0))
  return owed, held, units


@functools.lru_cache(maxsize=None)
def _steps(decay):
  """(state0, step) syncing every H steps, and the same with syncs 2H + 1
  apart; compiled once per decay."""
  out = []
  for every in (H, 2 * H + 1):
    opt = functools.partial(jaxfuse.local_steps, inner=optax.adam(1e-2),
                            every=every, residual_decay=decay)
    out.append(jaxfuse.make_train_step(mlp_loss, PARAMS, opt, PLAN,
                                       mesh_of(K), NO_DONATION))
  return tuple(out)


@settings(max_examples=4, deadline=None)
@given(decay=st.sampled_from([0.5, 1.0]), seed=st.integers(0, 2**16))
def test_the_sync_conserves_what_the_workers_owe(decay, seed):
  """Σ_k (θ − θ_k + d·e_k) = K·⟨sent⟩ + Σ_k e_k' at the second sync
  (e_k ≠ 0 there), element by element; and sparse: at most K·c slots."""
  owed, held, units = _conservation_run(decay, seed)
  for o, h, unit in zip(owed, held, units):
    np.testing.assert_allclose(h, o, rtol=1e-5,
                               atol=1e-5 * (1 + np.abs(o).max()))
  sparse = [u for u, unit in enumerate(units) if unit.capacity < unit.size]
  assert sparse, "the plan has a sparse unit"


def test_simulated_workers_compute_what_devices_do():
  opt = functools.partial(jaxfuse.local_steps, inner=optax.adam(1e-2),
                          every=H)
  out = []
  for mesh in (mesh_of(K), jaxfuse.simulated_mesh(K)):
    state, step = jaxfuse.make_train_step(mlp_loss, PARAMS, opt, PLAN, mesh)
    for batch in BATCHES[:2 * H]:
      state, _ = step(state, batch)
    out.append(jax.device_get((state.params, state.opt_state)))
  # the same maths; XLA may order a mean's sum differently on each
  for a, b in zip(jax.tree.leaves(out[0]), jax.tree.leaves(out[1])):
    np.testing.assert_allclose(np.asarray(a, np.float64),
                               np.asarray(b, np.float64), rtol=1e-5,
                               atol=1e-6)


def test_resume_inside_an_h_block_is_bitwise_the_straight_run(tmp_path):
  opt = functools.partial(jaxfuse.local_steps, inner=optax.adam(1e-2),
                          every=H)
  mesh = mesh_of(K)
  straight, step = jaxfuse.make_train_step(mlp_loss, PARAMS, opt, PLAN, mesh)
  for batch in BATCHES[:2 * H]:
    straight, _ = step(straight, batch)

  mngr = checkpoint.manager(tmp_path)
  state, step = jaxfuse.make_train_step(mlp_loss, PARAMS, opt, PLAN, mesh)
  for batch in BATCHES[:H + 1]:     # one inner step into the second block
    state, _ = step(state, batch)
  step.save(mngr, state)
  state, step = jaxfuse.make_train_step(mlp_loss, PARAMS, opt, PLAN, mesh)
  state = step.restore(mngr, state)
  assert state.step == H + 1
  for batch in BATCHES[state.step:2 * H]:
    state, _ = step(state, batch)
  assert _bits(state.params) == _bits(straight.params)
  assert _bits(state.opt_state) == _bits(straight.opt_state)


def test_a_restart_on_fewer_workers_keeps_the_owed_mean(tmp_path):
  opt = functools.partial(jaxfuse.local_steps, inner=optax.adam(1e-2),
                          every=H)
  state, step = jaxfuse.make_train_step(mlp_loss, PARAMS, opt, PLAN,
                                        mesh_of(K))
  for batch in BATCHES[:H + 2]:     # residuals, and θ_k apart
    state, _ = step(state, batch)
  mngr = checkpoint.manager(tmp_path)
  step.save(mngr, state)
  owed = lambda s: [np.asarray(x, np.float64).mean(0) for x in
                    jax.tree.leaves((s.local.inner, s.sync.residuals))]
  before = owed(jax.device_get(state.opt_state))
  small, step2 = jaxfuse.make_train_step(mlp_loss, PARAMS, opt, PLAN,
                                         mesh_of(K // 2))
  small = step2.restore(mngr, small)
  after = owed(jax.device_get(small.opt_state))
  for a, b in zip(after, before):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
  assert int(small.opt_state.count) == H + 2
  small, _ = step2(small, (BATCHES[0][0][:ROWS * 2], BATCHES[0][1][:ROWS * 2]))
  assert int(small.opt_state.count) == H + 3   # the sync of the block ran
  local = jax.device_get(small.opt_state.local.inner["w1"])
  np.testing.assert_array_equal(local[0], small.params["w1"])


def test_misuse_names_the_fix():
  with pytest.raises(jaxfuse.SyncError, match="every=0 must be an integer"):
    jaxfuse.local_steps(PLAN, 1e-3, every=0)
  with pytest.raises(jaxfuse.SyncError, match="residual_decay"):
    jaxfuse.local_steps(PLAN, 1e-3, residual_decay=0.0)
  with pytest.raises(jaxfuse.SyncError, match="inner=optax.adamw"):
    jaxfuse.local_steps(PLAN, 1e-3, options=jaxfuse.RecipeOptions(
        mask=lambda p: p))
  with pytest.raises(jaxfuse.SyncError, match="outer=.*optax transform"):
    jaxfuse.local_steps(PLAN, 1e-3, outer="nesterov")
  with pytest.raises(jaxfuse.SyncError, match="inner_params: .*no "
                     "jaxfuse.local_steps"):
    jaxfuse.inner_params(PARAMS, ())
  opt = functools.partial(jaxfuse.local_steps, inner=1e-3)
  with pytest.raises(TypeError, match="leave grad_at None"):
    jaxfuse.make_train_step(mlp_loss, PARAMS, opt, PLAN, mesh_of(K),
                            jaxfuse.StepOptions(grad_at=lambda p, s: p))


def test_bfloat16_params_keep_float32_local_steps_and_their_rounding():
  """θ_k is float32 for bfloat16 params; after a sync θ_k = anchor −
  (Δ_k's rounding to bfloat16), so θ_k − anchor is below a bfloat16 ulp
  of Δ_k and not all zero."""
  params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), PARAMS)
  plan = jaxfuse.plan(params, density=0.1,
                      settings=jaxfuse.Settings(min_sparse_size=64))
  opt = functools.partial(jaxfuse.local_steps, inner=optax.adam(1e-2),
                          every=H)
  state, step = jaxfuse.make_train_step(mlp_loss, params, opt, plan,
                                        mesh_of(K))
  assert {x.dtype for x in jax.tree.leaves(state.opt_state.local)} == {
      jnp.dtype(jnp.float32)}
  for batch in BATCHES[:H]:
    state, loss = step(state, batch)
  assert np.isfinite(float(loss))
  assert {x.dtype for x in jax.tree.leaves(state.params)} == {
      jnp.dtype(jnp.bfloat16)}
  local = np.asarray(state.opt_state.local.inner["w1"], np.float32)
  anchor = np.asarray(state.params["w1"], np.float32)
  gap = np.abs(local - anchor[None])
  assert gap.max() > 0 and gap.max() <= 2.0**-8 * 0.1
