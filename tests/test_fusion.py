"""Wire buffers: any dtype packs into uint32 words and back, bit for bit."""

from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
import jax.numpy as jnp
import numpy as np

from jaxfuse import fusion
from jaxfuse import plans as plan_lib

DTYPES = ["float32", "bfloat16", "float16", "int32", "int8"]


@settings(max_examples=60, deadline=None)
@given(dtype=st.sampled_from(DTYPES), count=st.integers(1, 37),
       seed=st.integers(0, 1000))
def test_words_round_trip_bitwise(dtype, count, seed):
  rng = np.random.default_rng(seed)
  bits = rng.integers(0, 2**8, size=count * jnp.dtype(dtype).itemsize,
                      dtype=np.uint8)
  x = jnp.asarray(bits.view(jnp.dtype(dtype)))
  words = fusion.to_words(x)
  assert words.dtype == jnp.uint32
  assert words.shape == (plan_lib.num_words(count, dtype),)
  back = fusion.from_words(words, dtype, count)
  np.testing.assert_array_equal(np.asarray(back).view(np.uint8), bits)


def test_sparse_buffer_round_trip_with_leading_worker_axis():
  units = [plan_lib.Unit((0,), 100, 5, 0.05, "dgc", "float32"),
           plan_lib.Unit((1,), 50, 3, 0.05, "dgc", "bfloat16")]
  parts = [(jnp.arange(5, dtype=jnp.float32) - 2.5,
            jnp.array([1, 7, 99, 100, 100], jnp.int32)),
           (jnp.array([1.5, -2, 3], jnp.bfloat16),
            jnp.array([49, 0, 50], jnp.int32))]
  words = fusion.pack_sparse(parts)
  assert words.shape == (5 + 5 + 2 + 3,)
  stacked = jnp.stack([words, words])  # as all_gather returns it: (K, W)
  for (v, i), (v2, i2) in zip(parts, fusion.unpack_sparse(stacked, units)):
    for k in range(2):
      np.testing.assert_array_equal(np.asarray(v2[k]), np.asarray(v))
      np.testing.assert_array_equal(np.asarray(i2[k]), np.asarray(i))
