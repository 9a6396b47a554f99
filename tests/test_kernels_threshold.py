"""The exact k-th largest magnitude equals ``lax.top_k``'s, on the fast path
(bracketed by a sample and compacted by the selection kernel) and on the
fallback (the bracket missed). CPU: the kernel in interpret mode."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxfuse.kernels import threshold
from jaxfuse.kernels.threshold import kth_largest_magnitude

INTERPRET = jax.default_backend() != "gpu"
N = threshold.MIN_SIZE + 4099          # above MIN_SIZE: the fast path runs


def _check(x, k):
  got = kth_largest_magnitude(x, k, interpret=INTERPRET)
  want = jnp.sort(jnp.abs(x))[::-1][k - 1]          # by a full sort
  assert got.dtype == x.dtype
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("k", [1, 7, 300, N // 100])
def test_normal_values(k):
  x = jax.random.normal(jax.random.PRNGKey(k), (N,), jnp.float32)
  _check(x, k)


def test_ties_and_zeros():
  rng = np.random.default_rng(1)
  x = rng.choice(np.array([0.0, -0.0, 1.0, -1.0, 0.5, 2.0], np.float32), N)
  for k in (1, 10, 500, N // 3):
    _check(jnp.asarray(x), k)


def test_fewer_nonzeros_than_k_falls_back_to_zero():
  x = np.zeros(N, np.float32)
  x[::1000] = np.arange(1, N // 1000 + 2, dtype=np.float32)[:len(x[::1000])]
  _check(jnp.asarray(x), 200)            # only 70 non-zeros: the answer is 0
  assert float(kth_largest_magnitude(jnp.asarray(x), 200,
                                     interpret=INTERPRET)) == 0.0


def test_missed_bracket_falls_back(monkeypatch):
  """A sample that misleads: every sampled magnitude is tiny, so τ_lo lets
  everything through (m > C) and the reference path must answer."""
  x = np.full(N, 1e-3, np.float32)
  x[:100] = np.arange(100, 0, -1)        # the large values, never sampled
  monkeypatch.setattr(threshold, "SAMPLE", 16)
  kth_largest_magnitude.clear_cache()
  try:
    _check(jnp.asarray(x), 50)
  finally:
    kth_largest_magnitude.clear_cache()


def test_bfloat16_and_small_sizes():
  x = jax.random.normal(jax.random.PRNGKey(3), (N,), jnp.bfloat16)
  _check(x, 123)
  small = jax.random.normal(jax.random.PRNGKey(4), (1000,), jnp.float32)
  _check(small, 10)                       # below MIN_SIZE: the reference


def test_rejects_bad_arguments():
  x = jnp.ones((N,), jnp.float32)
  with pytest.raises(ValueError, match="k must be"):
    kth_largest_magnitude(x, 0)
  with pytest.raises(ValueError, match="flat"):
    kth_largest_magnitude(x.reshape(-1, 1), 1)
