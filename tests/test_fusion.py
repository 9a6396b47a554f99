"""Wire buffers: any dtype packs into uint32 words and back, bit for bit."""

from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

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
  # two workers' different slots
  parts = [[(jnp.arange(5, dtype=jnp.float32) - 2.5,
             jnp.array([1, 7, 99, 100, 100], jnp.int32)),
            (jnp.array([1.5, -2, 3], jnp.bfloat16),
             jnp.array([49, 0, 50], jnp.int32))],
           [(jnp.array([9, 8, 7, 6, 5], jnp.float32),
             jnp.array([0, 2, 4, 6, 100], jnp.int32)),
            (jnp.array([-0.5, 0, 4], jnp.bfloat16),
             jnp.array([3, 50, 50], jnp.int32))]]
  words = [fusion.pack_groups(p, units) for p in parts]
  assert words[0].shape == (5 + 5 + 2 + 3,)
  stacked = jnp.stack(words)  # as all_gather returns it: (K, W)
  groups = fusion.unpack_groups(stacked, units)
  assert [members for members, _, _ in groups] == [[0], [1]]
  for n, (_, v2, i2) in enumerate(groups):
    for k in range(2):
      v, i = parts[k][n]
      np.testing.assert_array_equal(np.asarray(v2[k, 0]), np.asarray(v))
      np.testing.assert_array_equal(np.asarray(i2[k, 0]), np.asarray(i))


@settings(max_examples=30, deadline=None)
@given(dtype=st.sampled_from(DTYPES), rows=st.integers(1, 4),
       count=st.integers(1, 9), seed=st.integers(0, 1000))
def test_words_of_rows_are_each_rows_words(dtype, rows, count, seed):
  rng = np.random.default_rng(seed)
  bits = rng.integers(0, 2**8, size=rows * count * jnp.dtype(dtype).itemsize,
                      dtype=np.uint8)
  host = bits.view(jnp.dtype(dtype)).reshape(rows, count)
  words = fusion.to_words(jnp.asarray(host))
  assert words.shape == (rows, plan_lib.num_words(count, dtype))
  for r in range(rows):
    # each row taken on the host: slicing a JAX float array is a float op,
    # which XLA may compile (some options, e.g. the legacy CPU emitters)
    # to one that makes a NaN's payload canonical
    np.testing.assert_array_equal(
        np.asarray(words[r]), np.asarray(fusion.to_words(jnp.asarray(host[r]))))
  back = fusion.from_words(words, dtype, count)
  np.testing.assert_array_equal(np.asarray(back).view(np.uint8).reshape(-1),
                                bits)


# one compiled program per shape, as in a step, instead of every small op
# compiled on its own for each example's new shapes (the word round trips
# above stay op by op: jitted, a random bfloat16 NaN's payload came back
# changed in one of the two programs compared)
_pack = jax.jit(fusion.pack_indices, static_argnums=(1, 2))
_unpack = jax.jit(fusion.unpack_indices, static_argnums=(1, 2))
_pack_groups = jax.jit(fusion.pack_groups, static_argnums=1)
_unpack_groups = jax.jit(fusion.unpack_groups, static_argnums=1)


@settings(max_examples=60, deadline=None)
@given(bits=st.integers(1, 32), count=st.integers(1, 100),
       rows=st.integers(1, 3), seed=st.integers(0, 1000))
def test_packed_indices_round_trip(bits, count, rows, seed):
  """c indices of b bits in ⌈c·b/32⌉ words, back bit for bit; one outside
  [0, size] comes back as size (the empty slot)."""
  size = 2**bits - 1 if bits < 32 else 2**31 - 2
  rng = np.random.default_rng(seed)
  x = rng.integers(0, size, (rows, count), endpoint=True).astype(np.int32)
  words = _pack(jnp.asarray(x), bits, size)
  assert words.dtype == jnp.uint32
  assert words.shape == (rows, -(-count * bits // 32))
  np.testing.assert_array_equal(
      np.asarray(_unpack(words, bits, count)), x)
  # each index's bits at i·b: read them back with Python integers
  stream = sum(int(w) << (32 * n) for n, w in enumerate(np.asarray(words[0])))
  assert [(stream >> (i * bits)) & (2**bits - 1) for i in range(count)] == [
      int(v) for v in x[0]]
  if bits < 32:   # a smaller size, and indices past it or below 0
    small = 2**(bits - 1) + rng.integers(0, 2**(bits - 1) - 1, endpoint=True)
    bad = np.minimum(x, small)
    bad[0, 0], bad[-1, -1] = -1, rng.integers(small + 1, 2**bits,
                                              endpoint=True)
    back = np.asarray(_unpack(_pack(
        jnp.asarray(bad), bits, int(small)), bits, count))
    want = np.where((bad < 0) | (bad > small), small, bad)
    np.testing.assert_array_equal(back, want)
    with pytest.raises(ValueError, match="does not fit"):
      _pack(jnp.asarray(x), bits, 2**bits)


@settings(max_examples=25, deadline=None)
@given(kinds=st.lists(st.sampled_from([(100, 5, "float32"), (100, 5, "bfloat16"),
                                       (100, 3, "float32"), (40, 5, "float16")]),
                      min_size=1, max_size=7),
       packed=st.booleans(), seed=st.integers(0, 1000))
def test_groups_pack_every_units_slots_and_give_them_back(kinds, packed, seed):
  rng = np.random.default_rng(seed)
  units = [plan_lib.Unit((n,), size, cap, 0.05, "dgc", dtype,
                         plan_lib.index_bits(size) if packed else 32)
           for n, (size, cap, dtype) in enumerate(kinds)]
  parts = [[(jnp.asarray(rng.standard_normal(u.capacity).astype(u.dtype)),
             jnp.asarray(rng.integers(0, u.size + 1, u.capacity), jnp.int32))
            for u in units] for _ in range(2)]    # two workers' slots
  units = tuple(units)
  words = [_pack_groups(p, units) for p in parts]
  # each unit's payload, in one buffer
  assert words[0].shape == (sum(plan_lib.payload_bytes(u)
                                for u in units) // 4,)
  gathered = jnp.stack(words)   # (K=2, W)
  seen = []
  for members, values, indices in _unpack_groups(gathered, units):
    members = [int(n) for n in members]    # jit returned them as arrays
    assert {(units[n].size, units[n].capacity, units[n].dtype)
            for n in members} == {kinds[members[0]]}
    assert values.shape == indices.shape == (2, len(members),
                                             units[members[0]].capacity)
    for row, n in enumerate(members):
      for k in range(2):
        np.testing.assert_array_equal(
            np.asarray(values[k, row]).view(np.uint8),
            np.asarray(parts[k][n][0]).view(np.uint8))
        np.testing.assert_array_equal(np.asarray(indices[k, row]),
                                      np.asarray(parts[k][n][1]))
    seen += members
  assert sorted(seen) == list(range(len(units)))
