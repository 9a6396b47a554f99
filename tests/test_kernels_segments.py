"""A bucket's fused pass as segments of one Pallas call per pass.

``segments.segmented_call`` runs several (rows × blocks) kernels as one;
``fused_pass.sparsify_pass_bucket_pallas`` uses it for every batch of a
bucket and must equal ``sparsify_pass_rows_reference`` of each batch, bit
for bit, whatever the batches' lengths, streams (arrays, rows apart,
blends) and where their scans run. On CPU the kernels run in the Pallas
interpreter; with ``JAXFUSE_TEST_GPU=1`` on a GPU the compiled kernels.
"""

import functools
import os

from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxfuse.kernels import fused_pass as sp
from jaxfuse.kernels import reference
from jaxfuse.kernels import segments

from _harness import triton_kernels_for_cuda

ON_GPU = (os.environ.get("JAXFUSE_TEST_GPU") == "1"
          and jax.default_backend() == "gpu")


def _bits(v):
  v = np.asarray(v)
  return v.view(np.uint32) if v.dtype == np.float32 else v


def test_each_segment_runs_its_kernel_on_its_own_refs():
  """Two kernels of different grids and operands in one call: each output
  is what its kernel alone writes (row g, block b of its own grid), and an
  aliased operand is updated in place."""
  def scale(x_ref, o_ref, *, ids):      # grid 2 × 3: o[g, b] = 10·x + g
    g, b = ids
    o_ref[b] = x_ref[b] * 10 + g

  def count(y_ref, o_ref, *, ids):      # grid 1 × 5: y[b] += b (aliased)
    o_ref[ids[1]] = y_ref[ids[1]] + ids[1]

  x = jnp.arange(6, dtype=jnp.int32).reshape(2, 3)
  y = jnp.full((5,), 7, jnp.int32)
  row = ((None, 3), lambda g, b: (g, 0))
  out_a, out_b = segments.segmented_call(
      [segments.Segment(scale, [x], [row],
                        [jax.ShapeDtypeStruct((2, 3), jnp.int32)], [row],
                        {}, rows=2, blocks=3),
       segments.Segment(count, [y], [None],
                        [jax.ShapeDtypeStruct((5,), jnp.int32)], [None],
                        {0: 0}, rows=1, blocks=5)],
      compiler_params=None, interpret=not ON_GPU, name="test_segments")
  np.testing.assert_array_equal(out_a[0], [[0, 10, 20], [31, 41, 51]])
  np.testing.assert_array_equal(out_b[0], [7, 8, 9, 10, 11])
  with pytest.raises(ValueError, match="one spec per operand"):
    segments.segmented_call(
        [segments.Segment(count, [y], [], [y], [None], {}, 1, 5)],
        compiler_params=None, interpret=True, name="bad")


def _stream(rng, shape, zeros=0.2):
  x = rng.normal(size=shape).astype(np.float32)
  x[rng.random(shape) < zeros] = 0
  return jnp.asarray(x)


def _batches(rng, lengths, kinds):
  """Per batch: (xs, r, taus, capacity, offsets) of ``kind`` "array" (a
  (G, n) array), "rows" (flat rows), "blend" (m as an array, g's rows) or
  "special" (rows: non-finite, all zero, a τ above all)."""
  out = []
  for n, kind in zip(lengths, kinds):
    g = 2 if kind != "special" else 3
    r = _stream(rng, (g, n), zeros=0.5)
    if kind == "array":
      xs = _stream(rng, (g, n))
    elif kind == "rows":
      xs = [_stream(rng, (n,)) for _ in range(g)]
    elif kind == "blend":
      xs = reference.Blend(_stream(rng, (g, n)),
                           [_stream(rng, (n,)) for _ in range(g)], 0.9)
    else:
      rows = [_stream(rng, (n,)) for _ in range(g)]
      rows[0] = rows[0].at[n // 2].set(jnp.nan)
      rows[1] = jnp.zeros((n,), jnp.float32)
      r = r.at[1].set(0.0)
      xs = rows
    taus = jnp.asarray(rng.uniform(0.5, 2.0, g), jnp.float32)
    if kind == "special":
      taus = taus.at[2].set(99.0)        # nothing passes: the lone largest
    offsets = jnp.asarray(rng.integers(0, n, g), jnp.int32)
    out.append((xs, r, taus, int(rng.integers(1, n // 4 + 2)), offsets))
  return out


def _check_bucket(batches, **kw):
  xs, r, taus, caps, offsets = map(list, zip(*batches))
  got = sp.sparsify_pass_bucket_pallas(
      xs, r, taus, tuple(caps), offsets, interpret=not ON_GPU, **kw)
  for i, batch in enumerate(batches):
    want = jax.jit(sp.sparsify_pass_rows_reference, static_argnums=3)(
        *batch)
    for name, g, w in zip(sp.PassResult._fields, got[i], want):
      np.testing.assert_array_equal(_bits(g), _bits(w),
                                    err_msg=f"batch {i}: {name}")


@pytest.mark.parametrize("scan_blocks", [0, 4, 4096])
def test_bucket_equals_each_batch_alone(scan_blocks):
  """Batches of other lengths and stream kinds, with non-finite, all-zero
  and lone rows; every scan in pass 2, none, or only the short batches'
  (scan_blocks = 4: the 900-element batch's 8 blocks keep their scan)."""
  rng = np.random.default_rng(scan_blocks)
  _check_bucket(_batches(rng, [900, 300, 70, 500],
                         ["array", "blend", "rows", "special"]),
                block=128, tile=64, scan_blocks=scan_blocks)


@settings(max_examples=6, deadline=None)
@given(lengths=st.lists(st.integers(40, 700), min_size=1, max_size=3),
       kinds=st.lists(st.sampled_from(["array", "rows", "blend", "special"]),
                      min_size=3, max_size=3),
       seed=st.integers(0, 2**16))
def test_bucket_of_any_batches_equals_each_alone(lengths, kinds, seed):
  _check_bucket(_batches(np.random.default_rng(seed), lengths, kinds),
                block=128, tile=64, scan_blocks=4096)


def test_bucket_launches_two_kernels_and_checks_its_lists():
  """A bucket of three batches: one pass 1 and one pass 2 in all (a
  batch past ``scan_blocks`` adds its scan and pass 2); lists of unequal
  length name the fix."""
  rng = np.random.default_rng(0)
  xs, r, taus, caps, offsets = map(list, zip(*_batches(
      rng, [900, 300, 70], ["array", "blend", "rows"])))
  count = lambda blocks: str(jax.make_jaxpr(functools.partial(
      sp.sparsify_pass_bucket_pallas, capacities=tuple(caps), block=128,
      tile=64, interpret=True, scan_blocks=blocks))(
          xs, r, taus, offsets=offsets)).count("pallas_call")
  assert (count(4096), count(4)) == (2, 4)
  with pytest.raises(ValueError, match="one xs, r, taus, capacity"):
    sp.sparsify_pass_bucket_pallas(xs, r[:2], taus, tuple(caps), offsets,
                                   interpret=True)


def test_bucket_lowers_to_triton():
  """Three batches of other lengths lower to two Triton kernels for CUDA
  (no GPU needed where JAX can lower for CUDA without one)."""
  def spec(*shape, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(shape, dtype)
  lengths = (100003, 40000, 3000)
  fn = jax.jit(lambda xs, r, t, o: sp.sparsify_pass_bucket_pallas(
      xs, r, t, (500, 200, 30), o, scan_blocks=4096))
  assert triton_kernels_for_cuda(
      fn, [spec(2, n) for n in lengths], [spec(2, n) for n in lengths],
      [spec(2)] * 3, [spec(2, dtype=jnp.int32)] * 3) == 2
