"""Per-bucket clipping (jaxfuse.clipping) against its maths: the clipped
norm never exceeds the limit, it equals the global clip when the norm is
spread as the step before, a spike is clipped in its own bucket only, and
a non-finite step keeps the shares."""

import jax
import jax.numpy as jnp
from hypothesis import given, settings, strategies as st
import numpy as np
import pytest

import jaxfuse
from jaxfuse.optim import clipping

SHAPES = {"a": (30,), "b": (8, 5), "c": (12,), "d": (50,)}


def _plan():
  plan = jaxfuse.plan({n: jax.ShapeDtypeStruct(s, jnp.float32)
                       for n, s in SHAPES.items()}, density=0.1,
                      strategy="layerwise",
                      settings=jaxfuse.Settings(min_sparse_size=1))
  assert len(plan.buckets) == len(SHAPES)
  return plan


PLAN = _plan()
CLIP = clipping.clip_by_bucket_norm(PLAN, 1.0)   # outside shard_map: K = 1


def _grads(rng, scales):
  return {n: (s * rng.normal(size=SHAPES[n])).astype(np.float32)
          for n, s in zip(SHAPES, scales)}


def _norm(tree):
  return float(np.sqrt(sum(float(np.sum(np.square(x)))
                           for x in jax.tree.leaves(tree))))


def _bucket_of(name):
  (b,) = [i for i, bk in enumerate(PLAN.buckets)
          if any(PLAN.leaves[j].path == f"['{name}']" for j in bk.leaves)]
  return b


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1),
       prev=st.lists(st.floats(0, 10), min_size=4, max_size=4),
       scales=st.lists(st.floats(0.01, 5), min_size=4, max_size=4))
def test_clipped_norm_never_exceeds_the_limit(seed, prev, scales):
  g = _grads(np.random.default_rng(seed), scales)
  state = clipping.BucketClipState(jnp.asarray(prev, jnp.float32))
  out, new = CLIP.update(g, state)
  assert _norm(out) <= 1.0 * (1 + 1e-5)
  # Each bucket only scaled down, never up or rotated.
  for n in SHAPES:
    ratio = np.asarray(out[n]) / np.where(g[n] == 0, 1, g[n])
    assert np.allclose(ratio, ratio.flat[0], rtol=1e-5)
    assert ratio.flat[0] <= 1 + 1e-6
  # The state is this step's bucket norms, before clipping.
  for n in SHAPES:
    np.testing.assert_allclose(float(new.norms[_bucket_of(n)]),
                               np.linalg.norm(g[n]), rtol=1e-5)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), total=st.floats(0.1, 20))
def test_same_spread_as_before_is_the_global_clip(seed, total):
  rng = np.random.default_rng(seed)
  g = _grads(rng, rng.uniform(0.1, 3, size=4))
  g = {n: x * np.float32(total / _norm(g)) for n, x in g.items()}
  prev = np.zeros(4, np.float32)
  for n in SHAPES:   # the step before had the same spread, another size
    prev[_bucket_of(n)] = 0.37 * np.linalg.norm(g[n])
  out, _ = CLIP.update(g, clipping.BucketClipState(jnp.asarray(prev)))
  scale = min(1.0, 1.0 / total)
  for n in SHAPES:
    np.testing.assert_allclose(np.asarray(out[n]), g[n] * scale, rtol=1e-5,
                               atol=1e-7)


def test_a_spike_is_clipped_in_its_own_bucket_only():
  rng = np.random.default_rng(0)
  g = _grads(rng, [0.01] * 4)
  prev = np.asarray([float(n) for n in clipping.bucket_norms(PLAN, g)])
  g["c"] = g["c"] * np.float32(1e4)        # the spike: far over the limit
  out, _ = CLIP.update(g, clipping.BucketClipState(jnp.asarray(prev)))
  for n in ("a", "b", "d"):
    np.testing.assert_array_equal(np.asarray(out[n]), g[n])
  share = prev[_bucket_of("c")] / np.linalg.norm(prev)
  np.testing.assert_allclose(np.linalg.norm(out["c"]), share, rtol=1e-5)


def test_first_step_shares_are_the_bucket_sizes():
  g = _grads(np.random.default_rng(1), [10.0] * 4)  # every bucket clipped
  out, _ = CLIP.update(g, CLIP.init(g))
  total = sum(np.prod(s) for s in SHAPES.values())
  for n, s in SHAPES.items():
    np.testing.assert_allclose(np.linalg.norm(out[n]),
                               np.sqrt(np.prod(s) / total), rtol=1e-5)


def test_a_bucket_without_a_norm_takes_its_size_share_of_the_others():
  """p = (3, 0, 4, 0) by bucket of a, b, c, d: b and d have no norm yet and
  take ‖p‖·√(n_b/N) = 5·√(n_b/132); the shares are the filled p over its
  norm, and every bucket (all far over the limit) ends at its share."""
  g = _grads(np.random.default_rng(3), [10.0] * 4)
  prev = np.zeros(4, np.float32)
  prev[_bucket_of("a")], prev[_bucket_of("c")] = 3.0, 4.0
  filled = {"a": 3.0, "b": 5.0 * np.sqrt(40 / 132), "c": 4.0,
            "d": 5.0 * np.sqrt(50 / 132)}
  total = np.sqrt(sum(v * v for v in filled.values()))
  out, new = CLIP.update(g, clipping.BucketClipState(jnp.asarray(prev)))
  for n in SHAPES:
    np.testing.assert_allclose(np.linalg.norm(out[n]), filled[n] / total,
                               rtol=1e-5)
  # An all-zero bucket stays zero (no 0/0) and records a norm of 0.
  g["b"] = np.zeros_like(g["b"])
  out, new = CLIP.update(g, clipping.BucketClipState(jnp.asarray(prev)))
  np.testing.assert_array_equal(np.asarray(out["b"]), 0)
  assert float(new.norms[_bucket_of("b")]) == 0.0


def test_a_non_finite_step_keeps_the_shares():
  g = _grads(np.random.default_rng(2), [1.0] * 4)
  g["a"] = g["a"].copy()
  g["a"][3] = np.nan
  prev = jnp.asarray([1.0, 2.0, 3.0, 4.0])
  _, new = CLIP.update(g, clipping.BucketClipState(prev))
  b = _bucket_of("a")
  assert float(new.norms[b]) == float(prev[b])
  # the finite buckets record this step's norms, as on any step
  for n in ("b", "c", "d"):
    np.testing.assert_allclose(float(new.norms[_bucket_of(n)]),
                               np.linalg.norm(g[n]), rtol=1e-5)


@pytest.mark.parametrize("bad", [0, -1.0, True, "1"])
def test_bad_limits_name_the_field(bad):
  with pytest.raises(clipping.ClipError, match="clip_norm"):
    clipping.clip_by_bucket_norm(PLAN, bad)
