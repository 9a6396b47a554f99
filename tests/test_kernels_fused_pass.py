"""The fused sparsify pass equals its jnp reference bit for bit.

``sparsify_pass_pallas`` (acc = x + r, selection, lone element, residual,
finiteness, non-zero flag in three kernels) against
``sparsify_pass_reference``, also with the stream given as a blend
β·m + (1 − β)·g that pass 1 forms as it reads. On CPU the kernels run in the Pallas
interpreter with small blocks; with ``JAXFUSE_TEST_GPU=1`` on a GPU backend
the compiled Triton kernels run, on larger units too.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxfuse import kernels
from jaxfuse.kernels import fused_pass as sp
from jaxfuse.kernels import reference

from _harness import triton_kernels_for_cuda

try:
  from hypothesis import given
  from hypothesis import settings
  from hypothesis import strategies as st
except ImportError:  # pragma: no cover - hypothesis is a test dependency
  given = None

ON_GPU = (os.environ.get("JAXFUSE_TEST_GPU") == "1"
          and jax.default_backend() == "gpu")


def _bits(v):
  v = np.asarray(v)
  if v.dtype.kind != "f" and v.dtype.name != "bfloat16":
    return v
  return v.view({2: np.uint16, 4: np.uint32}[v.dtype.itemsize])


# Where the scan runs: its own kernel (0), or inside pass 2 for every unit
# here (``fused_pass.SCAN_IN_PASS2_BLOCKS``).
SCANS = pytest.mark.parametrize("scan_blocks", [0, 4096])


# ``sparsify_pass_reference`` of each row of a (G, n) stack, jitted: run op
# by op, the reference compiles each of its operations again for every new
# shape. The tests stack (and blend) the rows themselves.
_reference_rows = jax.jit(sp.sparsify_pass_rows_reference, static_argnums=3)


def _check(x, r, tau, capacity, offset, **kw):
  got = sp.sparsify_pass_pallas(x, r, tau, capacity, offset,
                                interpret=not ON_GPU, **kw)
  want = jax.jit(sp.sparsify_pass_reference, static_argnums=3)(
      x, r, tau, capacity, offset)
  for name, g, w in zip(sp.PassResult._fields, got, want):
    g, w = np.asarray(g), np.asarray(w)
    assert (g.dtype, g.shape) == (w.dtype, w.shape), name
    np.testing.assert_array_equal(_bits(g), _bits(w), err_msg=name)
  return want


def _stream(rng, n, dtype=np.float32, zeros=0.2):
  x = rng.normal(size=n).astype(np.float32)
  x[rng.random(n) < zeros] = 0
  return jnp.asarray(x, dtype)


# (n, capacity, τ, offset, block, what the case covers)
CASES = [
    (1000, 40, 1.5, 333, 128, "several blocks, a tail, rotation"),
    (1000, 8, 1.0, 990, 128, "overflow: the blocks after the offset win"),
    (100, 8, 1.5, 7, None, "one short block"),
    (1000, 20, 99.0, 0, 128, "nothing passes: the largest is sent alone"),
    (1000, 20, 0.0, 5, 256, "every non-zero is a candidate"),
]


@SCANS
@pytest.mark.parametrize("n,capacity,tau,offset,block,_", CASES)
def test_pass_equals_reference(n, capacity, tau, offset, block, _,
                               scan_blocks):
  rng = np.random.default_rng(n + capacity)
  x, r = _stream(rng, n), _stream(rng, n, zeros=0.5)
  out = _check(x, r, jnp.float32(tau), capacity, offset, block=block,
               tile=None if block is None else 64, scan_blocks=scan_blocks)
  acc = np.asarray(x) + np.asarray(r)
  # The reference's meaning, independently: r' = acc where not sent.
  sent = np.asarray(out.indices)[np.asarray(out.indices) < n]
  want_r = acc.copy()
  want_r[sent] = 0
  np.testing.assert_array_equal(np.asarray(out.residual), want_r)
  assert bool(out.finite) and bool(out.nonzero)
  if tau == 99.0:
    assert int(out.count) == 0 and list(sent) == [np.argmax(np.abs(acc))]


@SCANS
def test_nonfinite_keeps_the_residual_and_sends_nan(scan_blocks):
  rng = np.random.default_rng(1)
  x, r = _stream(rng, 1000), _stream(rng, 1000)
  x = x.at[700].set(jnp.inf)
  out = _check(x, r, jnp.float32(1.0), 16, 3, block=128, tile=64,
               scan_blocks=scan_blocks)
  np.testing.assert_array_equal(np.asarray(out.residual), np.asarray(r))
  assert not bool(out.finite) and int(out.count) == 0
  assert np.isnan(np.asarray(out.values)).all()
  assert list(np.asarray(out.indices)) == [0] + [1000] * 15


@SCANS
def test_all_zero_sends_nothing_and_flags_it(scan_blocks):
  z = jnp.zeros((1000,), jnp.float32)
  out = _check(z, z, jnp.float32(0.0), 8, 0, block=128, tile=64,
               scan_blocks=scan_blocks)
  assert list(np.asarray(out.indices)) == [1000] * 8
  assert not bool(out.nonzero) and bool(out.finite)


def test_vmap_rows_and_float32_only():
  rng = np.random.default_rng(2)
  x = jnp.stack([_stream(rng, 600) for _ in range(3)])
  r = jnp.stack([_stream(rng, 600) for _ in range(3)])
  taus = jnp.array([1.0, 2.0, 50.0], jnp.float32)
  offsets = jnp.array([0, 123, 599])
  got = jax.vmap(lambda *a: sp.sparsify_pass_pallas(
      *a[:3], 24, a[3], block=128, tile=64, interpret=not ON_GPU))(
          x, r, taus, offsets)
  want = _reference_rows(x, r, taus, 24, offsets)
  for g, w in zip(got, want):
    np.testing.assert_array_equal(_bits(g), _bits(w))
  with pytest.raises(ValueError, match="float32"):
    sp.sparsify_pass_pallas(x[0].astype(jnp.bfloat16),
                            r[0].astype(jnp.bfloat16), 1.0, 8, 0,
                            interpret=True)


@pytest.mark.skipif(not ON_GPU, reason="needs JAXFUSE_TEST_GPU=1 and a GPU")
@SCANS
@pytest.mark.parametrize("n", [2**20 + 77, 3 * 2**21])
def test_large_units_on_gpu(n, scan_blocks):
  rng = np.random.default_rng(n)
  x, r = _stream(rng, n), _stream(rng, n, zeros=0.9)
  for tau, capacity in ((2.5, n // 100), (2.0, n // 1000)):
    _check(x, r, jnp.float32(tau), capacity, n // 3, scan_blocks=scan_blocks)


# --- G units at once, their streams read where they are ------------------------

def _check_rows(xs, r, taus, capacity, offsets, **kw):
  got = sp.sparsify_pass_rows_pallas(xs, r, taus, capacity, offsets,
                                     interpret=not ON_GPU, **kw)
  x = jnp.concatenate([c.reshape(-1, c.shape[-1]) for c in xs])
  want = _reference_rows(x, r, taus, capacity, offsets)
  for name, g, w in zip(sp.PassResult._fields, got, want):
    g, w = np.asarray(g), np.asarray(w)
    assert (g.dtype, g.shape) == (w.dtype, w.shape), name
    np.testing.assert_array_equal(_bits(g), _bits(w), err_msg=name)
  return want


@SCANS
@pytest.mark.parametrize("n,block", [(1000, 128), (600, 256), (100, None)])
def test_rows_equal_each_row_alone(n, block, scan_blocks):
  """Row i's program reads xs[i] (a switch on the program id): each row's
  result is its own pass's, whatever the other rows hold; one row is
  non-finite, one all zero, one with nothing past τ."""
  rng = np.random.default_rng(n)
  xs = [_stream(rng, n) for _ in range(4)]
  xs[1] = xs[1].at[n // 2].set(jnp.nan)
  xs[3] = jnp.zeros((n,), jnp.float32)
  r = jnp.stack([_stream(rng, n, zeros=0.5) for _ in range(3)]
                + [jnp.zeros((n,), jnp.float32)])
  taus = jnp.array([1.0, 1.5, 50.0, 0.5], jnp.float32)
  offsets = jnp.array([0, n // 3, n - 1, 7], jnp.int32)
  want = _check_rows(xs, r, taus, 24, offsets, block=block,
                     tile=None if block is None else 64,
                     scan_blocks=scan_blocks)
  assert list(np.asarray(want.finite)) == [True, False, True, True]
  assert list(np.asarray(want.nonzero)) == [True, True, True, False]
  assert int(want.count[2]) == 0 and int(want.indices[2, 0]) < n


def test_rows_in_chunks_equal_each_row_alone():
  """Row g is row g mod R of chunk g div R: five rows as chunks of 2, 2, 1
  (the short block too)."""
  for n, block in ((900, 128), (70, None)):
    rng = np.random.default_rng(n)
    x = jnp.stack([_stream(rng, n) for _ in range(5)])
    r = jnp.stack([_stream(rng, n, zeros=0.5) for _ in range(5)])
    taus = jnp.array([0.5, 1.0, 1.5, 2.0, 2.5], jnp.float32)
    offsets = jnp.array([0, 1, n // 2, n - 1, 3], jnp.int32)
    _check_rows([x[0:2], x[2:4], x[4]], r, taus, 16, offsets, block=block,
                tile=None if block is None else 64)


def test_rows_of_a_stack_and_bad_operands():
  rng = np.random.default_rng(3)
  x = jnp.stack([_stream(rng, 500) for _ in range(2)])
  r = jnp.stack([_stream(rng, 500) for _ in range(2)])
  taus, offsets = jnp.array([1.0, 2.0], jnp.float32), jnp.array([4, 400])
  got = sp.sparsify_pass_rows_pallas(x, r, taus, 16, offsets, block=128,
                                     tile=64, interpret=not ON_GPU)
  want = sp.sparsify_pass_rows_reference(list(x), r, taus, 16, offsets)
  for g, w in zip(got, want):
    np.testing.assert_array_equal(_bits(g), _bits(w))
  with pytest.raises(ValueError, match=r"\(3, n\) for 3 rows"):
    sp.sparsify_pass_rows_pallas([x[0]] * 3, r, taus, 8, offsets,
                                 interpret=True)
  with pytest.raises(ValueError, match="float32"):
    sp.sparsify_pass_rows_pallas([x[0].astype(jnp.bfloat16)] * 2, r, taus,
                                 8, offsets, interpret=True)
  with pytest.raises(ValueError, match="same number of rows"):
    sp.sparsify_pass_rows_pallas([x[:1], x], jnp.concatenate([r, r[:1]]),
                                 jnp.ones((3,)), 8, jnp.zeros((3,), int),
                                 interpret=True)


def test_rows_pass_stacks_nothing():
  """No (G, n) array of the streams is built: pass 1 takes the G rows as
  operands (the jaxpr has no concatenate), and the G rows take three
  kernels in all (two with the scan in pass 2), not three each."""
  xs = [jnp.ones((1000,), jnp.float32)] * 3
  for scan_blocks, calls in ((0, 3), (4096, 2)):
    jaxpr = str(jax.make_jaxpr(lambda xs, r: sp.sparsify_pass_rows_pallas(
        xs, r, jnp.ones((3,)), 8, jnp.zeros((3,), jnp.int32), block=128,
        tile=64, interpret=True, scan_blocks=scan_blocks))(
            xs, jnp.zeros((3, 1000))))
    assert "concatenate" not in jaxpr
    assert jaxpr.count("pallas_call[") == calls, scan_blocks


def _blend_xla(m, g, beta):
  """β·m + (1 − β)·g as XLA compiles the recipe's expression (it may fuse
  a product and the sum into one multiply-add, as XLA on CPUs does)."""
  return jax.jit(lambda m, g: beta * m + (1 - beta) * g)(
      jnp.asarray(m), jnp.asarray(g))


@pytest.mark.parametrize("per,per_m", [(1, 1), (2, 2), (5, 5), (1, 5),
                                       (2, 3)])
def test_blend_rows_equal_the_pass_of_the_blended_stream(per, per_m):
  """Pass 1 forms x = β·m + (1 − β)·g as it loads m and g: the result is
  the pass of that x, bit for bit, however the rows are chunked (m and g
  each their own way: m one (G, n) array and g row by row, as the recipe
  passes them); one row's m is NaN, one row blends to all zeros, one has
  nothing past τ."""
  n, beta = 900, 0.9
  rng = np.random.default_rng(per + 7 * per_m)
  m = np.stack([rng.normal(size=n).astype(np.float32) for _ in range(5)])
  g = np.stack([_stream(rng, n) for _ in range(5)])
  m[1, 17] = np.nan
  m[3], g[3] = 0, 0
  r = jnp.stack([_stream(rng, n, zeros=0.5) for _ in range(5)])
  taus = jnp.array([0.5, 1.0, 50.0, 0.5, 1.5], jnp.float32)
  offsets = jnp.array([0, 1, n // 2, n - 1, 3], jnp.int32)
  cut = lambda a, per: [jnp.asarray(a[i:i + per]) for i in range(0, 5, per)]
  parts = reference.Blend(cut(m, per_m), cut(g, per), beta)
  want = _check_rows([_blend_xla(m, g, beta)], r, taus, 16,
                     offsets, block=128, tile=64)
  got = sp.sparsify_pass_rows_pallas(
      parts, r, taus, 16, offsets, block=128, tile=64,
      interpret=not ON_GPU)
  for name, a, b in zip(sp.PassResult._fields, got, want):
    np.testing.assert_array_equal(_bits(a), _bits(b), err_msg=name)
  assert list(np.asarray(want.finite)) == [True, False, True, True, True]
  assert list(np.asarray(want.nonzero)) == [True, True, True, False, True]
  ref = jax.jit(sp.sparsify_pass_rows_reference, static_argnums=3)(
      parts, r, taus, 16, offsets)
  for name, a, b in zip(sp.PassResult._fields, ref, want):
    np.testing.assert_array_equal(_bits(a), _bits(b), err_msg=name)


def test_blend_parts_must_cover_the_same_rows():
  x = jnp.ones((2, 300), jnp.float32)
  for m, g in (([x], [x[0]]), ([x], [x[:, :200], x[:, 200:]])):
    with pytest.raises(ValueError, match="m and g of the same rows"):
      sp.sparsify_pass_rows_pallas(reference.Blend(m, g, 0.9),
                                   x, jnp.ones((2,)), 8,
                                   jnp.zeros((2,), jnp.int32), interpret=True)


if given is not None:

  @settings(max_examples=8, deadline=None)
  @given(beta=st.floats(0.0, 0.999), per=st.integers(1, 3),
         per_m=st.integers(1, 3), seed=st.integers(0, 2**16))
  def test_any_blend_is_the_pass_of_its_stream(beta, per, per_m, seed):
    """For any β and any chunking of m and of g, the blended pass is the
    pass of XLA's β·m + (1 − β)·g."""
    n, rows = 300, 3
    rng = np.random.default_rng(seed)
    m = np.stack([_stream(rng, n) for _ in range(rows)]) * 3
    g = np.stack([_stream(rng, n) for _ in range(rows)])
    r = jnp.stack([_stream(rng, n, zeros=0.5) for _ in range(rows)])
    taus = jnp.asarray(rng.uniform(0.0, 2.5, rows), jnp.float32)
    offsets = jnp.asarray(rng.integers(0, n, rows), jnp.int32)
    cut = lambda a, per: [jnp.asarray(a[i:i + per])
                          for i in range(0, rows, per)]
    got = sp.sparsify_pass_rows_pallas(
        reference.Blend(cut(m, per_m), cut(g, per), beta), r, taus, 12,
        offsets,
        block=64, tile=32, interpret=not ON_GPU)
    want = _reference_rows(_blend_xla(m, g, beta), r, taus, 12, offsets)
    for name, a, b in zip(sp.PassResult._fields, got, want):
      np.testing.assert_array_equal(_bits(a), _bits(b), err_msg=name)

  @settings(max_examples=8, deadline=None)
  @given(rows=st.integers(1, 5), per=st.integers(1, 5),
         n=st.sampled_from([37, 300]), seed=st.integers(0, 2**16))
  def test_any_chunking_of_the_rows_gives_each_rows_pass(rows, per, n, seed):
    """However the G streams are cut into chunks of R rows, row g's result
    is the pass of row g alone."""
    rng = np.random.default_rng(seed)
    x = jnp.stack([_stream(rng, n) for _ in range(rows)])
    r = jnp.stack([_stream(rng, n, zeros=0.5) for _ in range(rows)])
    taus = jnp.asarray(rng.uniform(0.0, 2.5, rows), jnp.float32)
    offsets = jnp.asarray(rng.integers(0, n, rows), jnp.int32)
    _check_rows([x[i:i + per] for i in range(0, rows, per)], r, taus, 12,
                offsets, block=64, tile=32)


@SCANS
def test_scan_in_several_chunks(monkeypatch, scan_blocks):
  """The scan over the block counts in chunks of 2 (four chunks for eight
  blocks), in its own kernel or in every pass-2 program: the same pass."""
  from jaxfuse.kernels import selection  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(selection, "MAX_SCAN_CHUNK", 2)
  rng = np.random.default_rng(5)
  x, r = _stream(rng, 1001), _stream(rng, 1001, zeros=0.5)   # a new trace
  for tau, capacity, offset in ((1.0, 40, 517), (0.3, 12, 999)):
    _check(x, r, jnp.float32(tau), capacity, offset, block=128, tile=64,
           scan_blocks=scan_blocks)


def test_scan_in_pass2_launches_one_kernel_fewer(monkeypatch):
  """With the scan folded into pass 2 a group's pass is two kernels; the
  dispatch (``kernels.sparsify_pass_rows``) reads the module's switch each
  time it traces."""
  x = jnp.ones((3, 1000), jnp.float32)
  taus, offsets = jnp.ones((3,), jnp.float32), jnp.zeros((3,), jnp.int32)
  count = lambda blocks: str(jax.make_jaxpr(
      lambda x: sp.sparsify_pass_rows_pallas(
          x, x, taus, 8, offsets, block=128, interpret=True,
          scan_blocks=blocks))(x)).count("pallas_call")
  assert (count(0), count(8), count(7)) == (3, 2, 3)   # 1000 = 8 blocks
  monkeypatch.setattr(kernels, "_backend", "pallas")
  y = jnp.ones((3, 100_000), jnp.float32)              # 13 blocks of 8192
  dispatched = lambda: str(jax.make_jaxpr(lambda y: kernels.sparsify_pass_rows(
      y, y, taus, 8, offsets))(y)).count("pallas_call")
  for blocks, kernels_per_group in ((0, 3), (13, 2), (12, 3)):
    monkeypatch.setattr(sp, "SCAN_IN_PASS2_BLOCKS", blocks)
    assert dispatched() == kernels_per_group


@SCANS
def test_lowers_to_triton(scan_blocks):
  """Both placements of the scan lower to Triton for CUDA (three kernels,
  or two with the scan in pass 2; no GPU needed where JAX can lower for
  CUDA without one)."""
  fn = jax.jit(lambda x, r, t, o: sp.sparsify_pass_rows_pallas(
      x, r, t, 500, o, scan_blocks=scan_blocks))
  rows = jax.ShapeDtypeStruct((3, 100003), jnp.float32)
  assert triton_kernels_for_cuda(
      fn, rows, rows, jax.ShapeDtypeStruct((3,), jnp.float32),
      jax.ShapeDtypeStruct((3,), jnp.int32)) == (2 if scan_blocks else 3)
