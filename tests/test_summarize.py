"""``jaxfuse.stats``: what ``summarize`` makes of each field over several
workers and its check of the counts against the plan's slots; the overflow
of a non-finite leaf, and a "behind" bucket's zeros, which are no
candidates. Expected values are counted by hand."""

import jax.numpy as jnp
import numpy as np
import pytest

import jaxfuse

from _harness import NUM_WORKERS as K
from _harness import init, list_plan, sync


def _plan():
  # a (1200) and b (2000) sparse, capacity ⌈0.05·n·1.5⌉ = 90 and 150;
  # c (10) dense.
  params = {"a": jnp.zeros(1200), "b": jnp.zeros(2000), "c": jnp.zeros(10)}
  plan = jaxfuse.plan(params, density=0.05,
                      settings=jaxfuse.Settings(headroom=1.5))
  assert [l.mode for l in plan.leaves] == ["sparse", "sparse", "dense"]
  assert [l.capacity for l in plan.leaves[:2]] == [90, 150]
  return plan


def _stats(selected, missing, nonfinite, wire_bytes):
  ints = lambda rows: jnp.asarray(rows, jnp.int32)
  return jaxfuse.stats.SyncStats(
      selected=ints(selected), candidates=ints(selected),
      overflow=jnp.zeros_like(ints(selected)),
      threshold=jnp.ones(ints(selected).shape),
      missing=jnp.asarray(missing, bool),
      nonfinite=jnp.asarray(nonfinite, bool),
      wire_bytes=jnp.asarray(wire_bytes, jnp.float32))


def test_summary_means_missing_leaves_and_counts_each_nonfinite_leaf_once():
  # Two workers: worker 0 missed a, worker 1 missed a and b: 1.5 leaves a
  # worker. Leaf a was non-finite on both workers, b on none: one leaf.
  # Every worker sent 1800 bytes: the step's bytes a worker are 1800.
  stats = _stats(selected=[[0, 100, 10], [0, 0, 10]],
                 missing=[[True, False, False], [True, True, False]],
                 nonfinite=[[True, False, False], [True, False, False]],
                 wire_bytes=[1800.0, 1800.0])
  summary = jaxfuse.summarize(stats, _plan())
  assert summary["missing_leaves"] == 1.5
  assert summary["nonfinite_leaves"] == 1
  assert summary["wire_bytes"] == 1800


def test_summary_refuses_one_count_past_a_units_slots():
  # Leaf b has 150 slots: 150 selected is a full unit, 151 cannot come from
  # this plan's step (another phase's stats).
  plan = _plan()
  ok = _stats([[90, 150, 10]], [[False] * 3], [[False] * 3], [1.0])
  assert jaxfuse.summarize(ok, plan)["slot_fill"] == 1.0
  bad = _stats([[90, 151, 10]], [[False] * 3], [[False] * 3], [1.0])
  with pytest.raises(ValueError, match="selected 151 elements, more than "
                     "the 150 slots"):
    jaxfuse.summarize(bad, plan)


def test_overflow_of_a_non_finite_leaf_is_zero(mesh):
  # A NaN on one worker: that worker sends a NaN in slot 0 and counts no
  # candidate; capacity held nothing back, so its overflow is 0 (never
  # negative), as on the other workers.
  plan = list_plan([(4096,)], density=0.01,
                   estimator="topk",
                   settings=jaxfuse.Settings(min_sparse_size=64))
  grads = np.tile(np.arange(1, 4097, dtype=np.float32) / 4096, (K, 1))
  grads[K - 1, 17] = np.nan
  _, state = sync(plan, mesh, [grads], init(plan, mesh), fast_compile=True)
  stats = state.stats
  assert np.asarray(stats.nonfinite)[:, 0].tolist() == [False] * (K - 1) + [
      True]
  # The finite workers sent their 41 largest of 4096 distinct magnitudes:
  # k = ⌈0.01·4096⌉ = 41 candidates, all sent.
  assert np.asarray(stats.selected)[:K - 1, 0].tolist() == [41] * (K - 1)
  assert np.asarray(stats.overflow)[:, 0].tolist() == [0] * K
  assert jaxfuse.summarize(stats, plan)["overflow"] == 0.0


def test_a_behind_buckets_zeros_are_no_candidates(mesh):
  # "behind" over a (all zeros) and b (3 non-zero entries), "topk" at 0.05:
  # k = ⌈0.05·8192⌉ = 410 > 3 non-zeros, so τ is 0. Only non-zero
  # entries with |acc| ≥ τ are candidates: a has none, b its 3, all sent.
  plan = list_plan([(4096,), (4096,)], density=0.05,
                   estimator="topk", strategy="behind", bucket_bytes=1 << 20,
                   settings=jaxfuse.Settings(min_sparse_size=64))
  (bucket,) = plan.buckets
  assert bucket.sparsify == "behind" and bucket.capacity == 410
  a = np.zeros((K, 4096), np.float32)
  b = np.zeros((K, 4096), np.float32)
  b[:, [5, 600, 4000]] = [1.0, -2.0, 3.0]
  _, state = sync(plan, mesh, [a, b], init(plan, mesh), fast_compile=True)
  stats = state.stats
  assert np.asarray(stats.candidates).tolist() == [[0, 3]] * K
  assert np.asarray(stats.selected).tolist() == [[0, 3]] * K
  assert np.asarray(stats.overflow).tolist() == [[0, 0]] * K
  assert not np.asarray(stats.missing).any()


def test_a_behind_buckets_inf_flags_its_leaf_non_finite(mesh):
  # The plan of the test above (one compile). An inf (not a NaN) in b on
  # the last worker: b is non-finite there, a nowhere; summarize counts
  # one leaf.
  plan = list_plan([(4096,), (4096,)], density=0.05,
                   estimator="topk", strategy="behind", bucket_bytes=1 << 20,
                   settings=jaxfuse.Settings(min_sparse_size=64))
  a = np.ones((K, 4096), np.float32)
  b = np.ones((K, 4096), np.float32)
  b[K - 1, 100] = np.inf
  _, state = sync(plan, mesh, [a, b], init(plan, mesh), fast_compile=True)
  flags = np.asarray(state.stats.nonfinite).tolist()
  assert flags == [[False, False]] * (K - 1) + [[False, True]]
  assert jaxfuse.summarize(state.stats, plan)["nonfinite_leaves"] == 1
