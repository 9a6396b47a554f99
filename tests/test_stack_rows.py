"""How a state group's streams are stacked changes nothing but the program:
``bucket_sync.stack_rows`` by one concatenate or by rows written in place
gives the same synced gradients and state, bit for bit, over several steps
of a recipe with momentum (groups of several rows, velocity, residuals)
on 8 workers with shard_map's type checks on."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxfuse
from jaxfuse import bucket_sync

from _harness import fast_jit, list_plan, mesh_of, sharded_update, shard

# Three groups of several rows (sparse), one of one row, dense leaves.
SHAPES = [(30, 40), (500,), (30, 40), (500,), (2000,), (30, 40), (8,),
          (500,)]


def _steps(method, monkeypatch, grads_per_step):
  monkeypatch.setattr(bucket_sync, "stack_method", method)
  plan = list_plan(SHAPES, density=0.05, strategy="aligned", num_buckets=2,
                   min_sparse_size=64)
  mesh = mesh_of(8)
  tx = jaxfuse.sparse_sync(plan, momentum=0.9, residual_decay=0.95)
  state = jaxfuse.init_state(tx, [jnp.zeros(s) for s in SHAPES], mesh)
  step = fast_jit(sharded_update(tx, mesh, jaxfuse.state_specs(state)))
  out = []
  for grads in grads_per_step:
    synced, state = step(shard(mesh, grads), state)
    out.append(jax.tree.map(np.asarray, (synced, state)))
  return out, jax.jit(sharded_update(tx, mesh, jaxfuse.state_specs(
      state))).lower(shard(mesh, grads_per_step[0]), state).as_text()


def test_in_place_rows_equal_one_concatenate(monkeypatch):
  rng = np.random.default_rng(0)
  grads_per_step = [[rng.standard_t(3, size=(8,) + s).astype(np.float32)
                     for s in SHAPES] for _ in range(3)]
  ref, ref_hlo = _steps("concatenate", monkeypatch, grads_per_step)
  got, got_hlo = _steps("in_place", monkeypatch, grads_per_step)
  # The two programs differ (a concatenate against updates in place) ...
  assert "dynamic_update_slice" in got_hlo
  assert "dynamic_update_slice" not in ref_hlo
  # ... and their results do not.
  for a, b in zip(ref, got):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
      assert x.dtype == y.dtype and x.shape == y.shape
      assert x.tobytes() == y.tobytes()
  # Something was sent.
  assert any(np.abs(x).sum() > 0 for x in jax.tree.leaves(ref[-1][0]))


def test_unknown_method_names_the_setting(monkeypatch):
  monkeypatch.setattr(bucket_sync, "stack_method", "gather")
  with pytest.raises(ValueError, match="stack_method='gather'.*in_place"):
    bucket_sync.stack_rows([jnp.zeros(3), jnp.ones(3)])
