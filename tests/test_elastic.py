"""Elastic restart: a state saved on K workers resumed on K' (jaxfuse.elastic
and jaxfuse.checkpoint.restore)."""

import functools

from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

import jaxfuse
from jaxfuse.state import checkpoint
from jaxfuse.state import elastic

from _harness import assert_replicas_identical, list_plan, mesh_of
from _harness import NUM_WORKERS as K
from _harness import repo_modules

SHAPES = [(64, 48), (48,), (2000,)]


@settings(max_examples=40, deadline=None)
@given(k_old=st.integers(1, 16), k_new=st.integers(1, 16),
       seed=st.integers(0, 2**16))
def test_resize_keeps_the_worker_mean_of_every_float_leaf(k_old, k_new, seed):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(k_old, 5, 3)).astype(np.float32)
  b = elastic.shares(k_old, k_new)
  assert b.shape == (k_new, k_old) and (b >= 0).all()
  np.testing.assert_allclose(b.sum(1), 1.0, rtol=1e-12)   # a weighted mean
  y = elastic.resize(x, k_new)
  assert y.shape == (k_new, 5, 3) and y.dtype == np.float32
  np.testing.assert_allclose(y.astype(np.float64).mean(0),
                             x.astype(np.float64).mean(0), rtol=1e-5,
                             atol=1e-6)
  flags = rng.integers(0, 2, size=(k_old, 4)).astype(bool)
  picked = elastic.resize(flags, k_new)   # bools: one old worker's row each
  assert all(any((row == f).all() for f in flags) for row in picked)


def test_divisible_counts_are_group_means_and_copies():
  x = np.arange(8 * 3, dtype=np.float32).reshape(8, 3) ** 2
  np.testing.assert_array_equal(elastic.resize(x, 4),
                                (x[0::2] + x[1::2]) / 2)
  np.testing.assert_array_equal(elastic.resize(x, 2),
                                x.reshape(2, 4, 3).mean(1))
  np.testing.assert_array_equal(elastic.resize(x[:4], 8),
                                np.repeat(x[:4], 2, axis=0))
  steps = np.array([[5], [5], [7], [7]], np.int32)
  np.testing.assert_array_equal(elastic.resize(steps, 2), [[5], [7]])
  # each new worker covers two old ones equally: the first of them
  ids = np.array([[1], [2], [3], [4]], np.int32)
  np.testing.assert_array_equal(elastic.resize(ids, 2), [[1], [3]])
  # 3 -> 2: new worker 0 covers old 0 (2/3 of it) and old 1 (1/3)
  np.testing.assert_array_equal(elastic.resize(ids[:3], 2), [[1], [3]])


def _setup(k):
  """Mesh of the first k devices; an optimizer with every kind of
  per-worker leaf: a recipe's moments (per_worker Adam), residuals,
  velocity (momentum), controller and stats. Built once per k (a pure
  step and immutable arrays), so each k's step is compiled once."""
  mesh_of(k)   # skips where fewer devices exist (not cached)
  return _setup_once(k)


@functools.lru_cache(maxsize=None)
def _setup_once(k):
  mesh = mesh_of(k)
  params = jax.device_put([jax.random.normal(jax.random.PRNGKey(i), s) * 0.1
                           for i, s in enumerate(SHAPES)],
                          jax.sharding.NamedSharding(mesh, P()))
  plan = list_plan(SHAPES, density=0.05,
                   settings=jaxfuse.Settings(min_sparse_size=256))
  opt = optax.chain(jaxfuse.per_worker(optax.scale_by_adam()),
                    jaxfuse.sparse_sync(plan, momentum=0.9),
                    optax.sgd(0.1))
  state = jaxfuse.init_state(opt, params, mesh)
  specs = jaxfuse.state_specs(state)

  def local(p, s, x):
    grads = jax.grad(lambda q: sum(jnp.sum(jnp.sin(a * x[0, 0]) ** 2)
                                   for a in q))(jaxfuse.local_params(p))
    u, s = opt.update(grads, s, p)
    return optax.apply_updates(p, u), s

  step = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), specs,
                                                           P("data")),
                               out_specs=(P(), specs)))
  data = lambda i: jax.device_put(
      jnp.linspace(1.0, 2.0, k)[:, None] + i,
      jax.sharding.NamedSharding(mesh, P("data")))
  return plan, params, state, step, data


def _run(step, data, params, state, steps, first=0):
  for i in range(first, first + steps):
    params, state = step(params, state, data(i))
    jax.block_until_ready(state)
  return params, state


# On 8 CPU workers: 8 → 4, 8 → 2, 4 → 8 (a GPU run: its own count, halved).
@pytest.mark.parametrize("k_old,k_new", [(K, K // 2), (K, K // 4),
                                         (K // 2, K)])
def test_restore_on_other_worker_count_keeps_what_is_owed(tmp_path, k_old,
                                                          k_new):
  if min(k_old, k_new) < 1:
    pytest.skip(f"{K} workers cannot be quartered")
  plan, params, state, step, data = _setup(k_old)
  params, state = _run(step, data, params, state, 3)
  mask = jaxfuse.per_worker_mask(state)
  before = elastic.owed(jax.tree.map(np.asarray, state), mask)
  mngr = checkpoint.manager(tmp_path)
  checkpoint.save(mngr, 3, {"params": params, "opt": state}, plan)

  plan2, params2, like, step2, data2 = _setup(k_new)
  got, back = checkpoint.restore(mngr, {"params": params2, "opt": like},
                                 plan2)
  assert got == 3
  new = back["opt"]
  for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(like)):
    assert a.shape == b.shape and a.sharding == b.sharding
  after = elastic.owed(jax.tree.map(np.asarray, new),
                       jaxfuse.per_worker_mask(new))
  assert len(after) == len(before) > 6    # residuals, velocity, moments, τ
  for x, y in zip(before, after):
    np.testing.assert_allclose(y, x, rtol=1e-5, atol=1e-7)
  assert np.asarray(jaxfuse.sync_stats(new).selected).shape[0] == k_new
  assert np.abs(np.asarray(new[1].residuals[0])).sum() > 0
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(back["params"])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # Training goes on on the new mesh, replicas identical.
  p, s = _run(step2, data2, back["params"], new, 2, first=3)
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(p))
  assert_replicas_identical(jax.tree.leaves(p), k_new)
  assert int(np.asarray(s[1].step)[0]) == 5


def test_extra_key_of_jaxfuse_is_reserved(tmp_path):
  plan, params, state, _, _ = _setup(2)
  mngr = checkpoint.manager(tmp_path)
  with pytest.raises(checkpoint.CheckpointError, match="jaxfuse's own"):
    checkpoint.save(mngr, 1, state, plan, {checkpoint.WORKERS: 1})
  checkpoint.save(mngr, 1, state, plan, {"rng": 7})
  assert checkpoint.saved_extra(mngr) == {"rng": 7}


def test_example_on_a_count_that_does_not_divide_the_batch(tmp_path):
  """Resuming the example on K' = 3 of a global batch of 32: one clear
  line before anything is loaded or written."""
  mesh_of(3)   # skips where fewer devices exist
  with repo_modules("examples", "train_lm") as train_lm:
    with pytest.raises(SystemExit, match="32 must divide over 3 devices.*"
                       "a device count that divides the batch"):
      train_lm.main(["--devices", "3", "--checkpoint-dir", str(tmp_path),
                     "--resume"])
  assert not any(tmp_path.iterdir())
