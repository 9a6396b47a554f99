"""Every kernel with ``jax_enable_x64`` on: the same outputs, values and
dtypes, as with it off. The kernels are written for int32 and float32;
under x64 a Python number or an integer sum inside them turned 64-bit (a
store of int64 into an int32 buffer, ``pl.cdiv`` of an int32 by an int64)
and a user's x64 program failed on GPU. On CPU in the Pallas interpreter,
on a GPU run compiled."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxfuse.kernels import fused_pass
from jaxfuse.kernels import hash_partition
from jaxfuse.kernels import radix
from jaxfuse.kernels import reference
from jaxfuse.kernels import selection
from jaxfuse.kernels import threshold

INTERPRET = not (os.environ.get("JAXFUSE_TEST_GPU") == "1"
                 and jax.default_backend() == "gpu")


def _inputs():
  rng = np.random.default_rng(0)
  x = rng.normal(size=700).astype(np.float32)
  rows = rng.normal(size=(2, 700)).astype(np.float32)
  return dict(
      x=x, r=(0.1 * rng.normal(size=700)).astype(np.float32), rows=rows,
      rr=(0.1 * rng.normal(size=(2, 700))).astype(np.float32),
      bits=rng.integers(0, 2**30, (3, 500)).astype(np.int32),
      indices=rng.choice(100_000, 300, replace=False).astype(np.int32))


CALLS = {
    "radix_rows": lambda d: radix.radix_rows_pallas(
        jnp.asarray(d["bits"]), jnp.array([1, 5, 100], jnp.int32),
        interpret=INTERPRET),
    "sparsify_pass": lambda d: fused_pass.sparsify_pass_pallas(
        jnp.asarray(d["x"]), jnp.asarray(d["r"]), 1.5, 32, 7,
        interpret=INTERPRET),
    "sparsify_pass_rows_of_a_blend": lambda d: fused_pass.sparsify_pass_rows_pallas(
        reference.Blend(jnp.asarray(d["rows"]),
                        [jnp.asarray(v) for v in d["rows"][::-1]], 0.9),
        jnp.asarray(d["rr"]), jnp.array([1.5, 2.0], jnp.float32), 32,
        jnp.array([3, 9], jnp.int32), interpret=INTERPRET),
    "sparsify_pass_bucket": lambda d: fused_pass.sparsify_pass_bucket_pallas(
        [jnp.asarray(d["rows"]), jnp.asarray(d["rows"][:, :300])],
        [jnp.asarray(d["rr"]), jnp.asarray(d["rr"][:, :300])],
        [jnp.array([1.5, 2.0], jnp.float32)] * 2, (32, 10),
        [jnp.array([3, 9], jnp.int32)] * 2, interpret=INTERPRET),
    "select": lambda d: selection.select_pallas(
        jnp.asarray(d["x"]), 1.5, 32, 5, interpret=INTERPRET),
    "select_band": lambda d: selection.select_band_pallas(
        jnp.asarray(d["x"]), 1.0, 2.0, 32, interpret=INTERPRET),
    "kth_largest_magnitude": lambda d: threshold.kth_largest_magnitude(
        jnp.asarray(d["x"]), 30, interpret=INTERPRET),
    "hash_partition": lambda d: hash_partition.hash_partition_pallas(
        jnp.asarray(d["indices"]), 4, 100_000, interpret=INTERPRET),
}


def _hash_canonical(out):
  """What the hash partition fixes: on a GPU its atomic claims place each
  partition's indices in an order (and a serial/parallel split) that
  varies from run to run."""
  return (np.sort(np.asarray(out.table), axis=1), np.asarray(out.counts),
          np.asarray(out.overflowed), np.asarray(out.stored))


CANONICAL = {"hash_partition": _hash_canonical}


@pytest.mark.parametrize("name", sorted(CALLS))
def test_kernel_under_x64_is_the_kernel_under_x32(name):
  data = _inputs()
  canonical = CANONICAL.get(name, lambda out: out)
  call = lambda d: canonical(CALLS[name](d))
  want = jax.tree.map(np.asarray, call(data))
  jax.clear_caches()   # nothing traced under x32 reused (another test's)
  with jax.enable_x64(True):
    got = jax.tree.map(np.asarray, call(data))
    # and inside a jitted x64 program, as a user's step calls it
    inside, wide = jax.jit(lambda s: (CALLS[name](data), s * 2))(
        np.float64(1.0))
  assert wide.dtype == np.float64
  for out in (got, jax.tree.map(np.asarray, canonical(inside))):
    assert jax.tree.structure(out) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(want)):
      assert a.dtype == b.dtype, name
      np.testing.assert_array_equal(a, b, err_msg=name)
