"""The sampler behind DGC's threshold and the topk bracket
(``kernels.reference.uniform_index``) against a NumPy copy of its maths:
index i = lowbias32(salt ^ (i · 0x9E3779B9 mod 2³²)) mod n. A sampler that
missed part of the tensor would bias every sampled threshold."""

import math

from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
import jax.numpy as jnp
import numpy as np
import pytest

from jaxfuse import plans as plan_lib
from jaxfuse import sparsify
from jaxfuse.kernels import reference

M = np.uint64(0xFFFFFFFF)


def _lowbias32(x):
  x = np.asarray(x, np.uint64) & M
  x = ((x ^ (x >> np.uint64(16))) * np.uint64(0x7FEB352D)) & M
  x = ((x ^ (x >> np.uint64(15))) * np.uint64(0x846CA68B)) & M
  return x ^ (x >> np.uint64(16))


def _numpy_uniform_index(salt, count, n):
  i = (np.arange(max(count, 1), dtype=np.uint64) * np.uint64(0x9E3779B9)) & M
  return (_lowbias32(np.uint64(salt) ^ i) % np.uint64(n)).astype(np.int64)


@settings(max_examples=50, deadline=None)
@given(salt=st.integers(0, 2**32 - 1), count=st.integers(1, 600),
       n=st.integers(1, 2**31 - 1))
def test_uniform_index_is_lowbias32_of_the_counter(salt, count, n):
  got = np.asarray(reference.uniform_index(jnp.uint32(salt), count, n))
  np.testing.assert_array_equal(got, _numpy_uniform_index(salt, count, n))


@pytest.mark.parametrize("n", [300, 10_007, 2**20 + 3])
def test_uniform_index_covers_every_fifth_of_the_tensor(n):
  """40 000 draws: each fifth of [0, n) gets 20 % ± 1.5 % of them (about
  7 standard deviations); the last fifth included."""
  idx = np.asarray(reference.uniform_index(jnp.uint32(12345), 40_000, n))
  share = np.bincount(idx * 5 // n, minlength=5) / idx.size
  np.testing.assert_allclose(share, 0.2, atol=0.015)
  assert idx.max() >= n - 1 - n // 100       # reaches the very end


@pytest.mark.parametrize("n", [300, 100_000])
def test_dgc_is_the_rank_of_its_sample(n):
  """The round(ρ·s)-th largest |g + r| of the s = max(f·n, 256) positions
  the NumPy copy draws."""
  rng = np.random.default_rng(3)
  g = rng.normal(size=n).astype(np.float32)
  r = rng.normal(size=n).astype(np.float32)
  settings_ = plan_lib.Settings()
  density, salt = 0.05, sparsify.salt(7, 3, 11)
  tau = float(sparsify.estimate_threshold(
      jnp.asarray(g), jnp.asarray(r), estimator="dgc", density=density,
      salt_=salt, settings=settings_))
  s = min(n, max(256, math.ceil(settings_.estimation.sample_fraction * n)))
  idx = _numpy_uniform_index(int(salt), s, n)
  magnitudes = np.sort(np.abs(g[idx] + r[idx]))[::-1]
  assert tau == magnitudes[max(1, round(density * s)) - 1]
