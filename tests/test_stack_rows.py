"""How a state group's streams are stacked changes nothing but the program:
``bucket_sync.stack_rows`` by one concatenate or by nested concatenates of
at most four operands gives the same synced gradients and state, bit for
bit, over several steps of a recipe with momentum (groups of several rows,
velocity, residuals) on 8 workers with shard_map's type checks on."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxfuse
from jaxfuse import bucket_sync

from _harness import fast_jit, list_plan, mesh_of, sharded_update, shard

# One sparse bucket: a group of 18 rows (two levels of nesting), one of
# three, one of one row; dense leaves.
SHAPES = [(30, 40), (500,), (30, 40), (500,), (2000,), (30, 40), (8,),
          (500,)] + [(30, 40)] * 15


def _steps(method, monkeypatch, grads_per_step):
  monkeypatch.setattr(bucket_sync, "stack_method", method)
  plan = list_plan(SHAPES, density=0.05, strategy="single",
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
      state))).lower(shard(mesh, grads_per_step[0]), state).compile(
      ).as_text()


def _row_stacks(hlo):
  """Operand counts of the compiled program's concatenates of (30, 40)
  rows: the 18-row group's stack, in one piece or nested."""
  return [len(re.findall(r"%[\w.-]+", args)) for args in re.findall(
      r"= f32\[\d+,1200\]\{1,0\} concatenate\(([^)]*)\)", hlo)]


def test_nested_concatenates_equal_one_concatenate(monkeypatch):
  rng = np.random.default_rng(0)
  grads_per_step = [[rng.standard_t(3, size=(8,) + s).astype(np.float32)
                     for s in SHAPES] for _ in range(3)]
  ref, ref_hlo = _steps("concatenate", monkeypatch, grads_per_step)
  got, got_hlo = _steps("tree", monkeypatch, grads_per_step)
  # The compiled programs differ: 18 rows in one concatenate, against
  # 18 -> 5 -> 2 parts of at most four ...
  assert _row_stacks(ref_hlo) == [18]
  assert sorted(_row_stacks(got_hlo)) == [2, 2, 4, 4, 4, 4, 4]
  assert max(_row_stacks(got_hlo)) <= bucket_sync.TREE_FANIN
  # ... and their results do not.
  for a, b in zip(ref, got):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
      assert x.dtype == y.dtype and x.shape == y.shape
      assert x.tobytes() == y.tobytes()
  # Something was sent.
  assert any(np.abs(x).sum() > 0 for x in jax.tree.leaves(ref[-1][0]))


def test_unknown_method_names_the_setting(monkeypatch):
  monkeypatch.setattr(bucket_sync, "stack_method", "gather")
  with pytest.raises(ValueError, match="stack_method='gather'.*tree"):
    bucket_sync.stack_rows([jnp.zeros(3), jnp.ones(3)])
