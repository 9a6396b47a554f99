"""``Settings(sparse_wire="int8" | "int4" | "int2")``: each worker's
selected values go as b-bit codes with a float32 scale per 64 slots. The
codes are the nearest of 2^b levels (checked against numpy, property), the
rounding stays in the residual (conservation to float32 rounding on 8
workers), the all-gather carries exactly the words the plan counts, and a
scheme that cannot decode them is refused, or not picked."""

import functools

from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
import jax
import numpy as np
import pytest

import jaxfuse
from jaxfuse import fusion
from jaxfuse import plans as plan_lib

from _harness import NUM_WORKERS, gathered_words, init, list_plan, sync

K = NUM_WORKERS
SHAPES = [(64, 64), (300,)]
BITS = {"int8": 8, "int4": 4, "int2": 2}


@functools.lru_cache(maxsize=None)
def _round_trip(bits, count):
  """(words, v̂) of ``count`` values, compiled once per (bits, count)."""
  def run(v):
    words = fusion.quantize_values(v, bits)
    return words, fusion.dequantize_values(words, bits, count)
  return jax.jit(run)


def _plan(wire, **kwargs):
  return list_plan(SHAPES, density=0.05, settings=jaxfuse.Settings(
      min_sparse_size=64, sparse_wire=wire), **kwargs)


@settings(max_examples=30, deadline=None)
@given(bits=st.sampled_from([2, 4, 8]), count=st.sampled_from([1, 64, 130]),
       scale=st.sampled_from([1e-6, 1.0, 1e4]), seed=st.integers(0, 2**16),
       zeros=st.booleans())
def test_each_value_goes_as_the_nearest_level_of_its_chunk(bits, count,
                                                           scale, seed,
                                                           zeros):
  """Levels (j + ½)·s, s = max|v| / (2^(b−1) − ½) per 64 slots, computed
  here in numpy: v̂ is the level nearest v (within s/2), ±max|v| come
  back exactly, and the words are ⌈c·b/32⌉ codes + ⌈c/64⌉ scales."""
  rng = np.random.default_rng(seed)
  v = (rng.standard_normal(count) * scale).astype(np.float32)
  if zeros:
    v[: count // 2] = 0       # a chunk may be all zeros (an empty tail)
  words, got = _round_trip(bits, count)(v)
  assert words.shape == (-(-count * bits // 32) + -(-count // 64),)
  got = np.asarray(got)
  half = 2 ** (bits - 1)
  for start in range(0, count, 64):
    chunk, back = v[start:start + 64], got[start:start + 64]
    top = np.abs(chunk).max()
    if top == 0:
      np.testing.assert_array_equal(back, 0.5)   # s = 1: the ½ level
      continue
    s = np.float32(top) / np.float32(half - 0.5)
    levels = (np.arange(-half, half) + 0.5) * s
    gaps = np.abs(chunk[:, None] - levels[None])
    # one of the levels, at the least distance (0 lies between two)
    assert (np.abs(back[:, None] - levels[None]) <= 1e-6 * top).any(1).all()
    np.testing.assert_allclose(np.abs(back - chunk), gaps.min(1), rtol=1e-5,
                               atol=1e-6 * top)
    assert np.abs(back - chunk).max() <= s / 2 * (1 + 1e-5)
    i = np.abs(chunk).argmax()
    np.testing.assert_allclose(back[i], chunk[i], rtol=1e-6)


@pytest.mark.parametrize("wire", ["int8", "int4", "int2"])
def test_the_rounding_stays_in_the_residual(mesh, wire):
  """K·ĝ + Σ_k r'_k = Σ_k (g_k + r_k) over two steps, element by element;
  each worker's residual differs from its acc in at most c slots."""
  plan = _plan(wire)
  units, _ = plan_lib.units(plan)
  state = init(plan, mesh)
  for step in range(2):
    grads = [np.random.default_rng(step).normal(size=(K,) + s)
             .astype(np.float32) for s in SHAPES]
    old = [np.asarray(r, np.float64) for r in
           jaxfuse.unit_residuals(plan, state)]
    synced, state = sync(plan, mesh, grads, state)
    new = [np.asarray(r, np.float64) for r in
           jaxfuse.unit_residuals(plan, state)]
    for u, unit in enumerate(units):
      (j,) = unit.leaves
      acc = grads[j].reshape(K, -1).astype(np.float64) + old[u]
      total = K * np.asarray(synced[j], np.float64).ravel() + new[u].sum(0)
      np.testing.assert_allclose(total, acc.sum(0), rtol=1e-5,
                                 atol=1e-5 * np.abs(acc).max())
      # at most c slots of a worker changed: the sent ones (in float32,
      # as the transform adds g + r); the rest keep acc bit for bit
      acc32 = grads[j].reshape(K, -1) + old[u].astype(np.float32)
      changed = (new[u].astype(np.float32) != acc32).sum(1)
      assert (changed > 0).all() and (changed <= unit.capacity).all()


def test_the_all_gather_carries_the_words_the_plan_counts(mesh):
  """'int2', c = ⌈0.05·4096·1.5⌉ = 308 slots: ⌈308·2/32⌉ = 20 words of
  codes, ⌈308/64⌉ = 5 scales, 308 int32 indices; c = 23 for the 300
  vector: 2 + 1 + 23. Bytes: 4·(333 + 26) = 1,436 a worker."""
  plan = _plan("int2")
  assert plan.bytes_per_worker() == 4 * (20 + 5 + 308 + 2 + 1 + 23)
  assert gathered_words(plan, mesh) == [26, 333]


def test_a_scheme_that_cannot_decode_them_is_refused_or_not_picked():
  with pytest.raises(jaxfuse.PlanError, match="only 'allgather' decodes"):
    _plan("int4", collective="zen")
  # on 8 workers the float32 wire's plan takes ZEN for the matrix (fewer
  # bytes); the quantized one keeps the all-gather everywhere
  assert "zen" in {b.collective for b in _plan(
      "gradient", num_workers=8).buckets}
  assert {b.collective for b in _plan("int2", num_workers=8).buckets} == {
      "allgather"}
