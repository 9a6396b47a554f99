"""The Pallas selection kernel equals ``reference.select`` bit for bit.

On CPU the kernels run in the Pallas interpreter with small blocks (several
blocks, a partial tail block, staged blocks and blocks whose mask pass 2
peels, words with up to 32 candidates). With ``JAXFUSE_TEST_GPU=1`` on a GPU backend (set ``JAX_PLATFORMS=cuda,cpu``:
conftest defaults to cpu) the same checks run the compiled Triton kernels, and
the larger cases marked ``gpu_only`` run too.
"""

import functools
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxfuse.kernels import reference
from jaxfuse.kernels.compare import round_to_bfloat16
from jaxfuse.kernels.selection import select_band_pallas
from jaxfuse.kernels.selection import select_pallas

from _harness import triton_kernels_for_cuda

try:
  from hypothesis import given
  from hypothesis import settings
  from hypothesis import strategies as st
except ImportError:  # pragma: no cover - hypothesis is a test dependency
  given = None

ON_GPU = (os.environ.get("JAXFUSE_TEST_GPU") == "1"
          and jax.default_backend() == "gpu")
INTERPRET = not ON_GPU
gpu_only = pytest.mark.skipif(not ON_GPU, reason="needs JAXFUSE_TEST_GPU=1 "
                              "and a GPU backend")

N = 1000          # 7 full blocks of 128 and a tail of 104
BLOCK = 128
BF16 = jnp.bfloat16


@functools.partial(jax.jit, static_argnums=2)
def _reference(acc, tau, capacity, offset):
  return reference.select(acc, tau, capacity, offset)


# Jitted, as _reference: run op by op, the reference compiles each of its
# operations again for every new shape.
_reference_band = jax.jit(reference.select_band, static_argnums=3)


def _bits(v):
  v = np.asarray(v)
  return v.view({2: np.uint16, 4: np.uint32}[v.dtype.itemsize])


def check(acc, tau, capacity, offset, **kw):
  kw.setdefault("block", BLOCK)
  got = select_pallas(acc, tau, capacity, offset, interpret=INTERPRET, **kw)
  want = _reference(acc, tau, capacity, offset)
  (gv, gi, gc), (wv, wi, wc) = (map(np.asarray, got), map(np.asarray, want))
  assert gv.dtype == wv.dtype == np.asarray(acc).dtype
  assert gv.shape == gi.shape == (capacity,)
  assert gi.dtype == np.int32 and gc.dtype == np.int32 and gc.shape == ()
  np.testing.assert_array_equal(gc, wc)
  np.testing.assert_array_equal(gi, wi)
  np.testing.assert_array_equal(_bits(gv), _bits(wv))
  return int(gc)


def _normal(rng, n, dtype, zeros=0.2):
  acc = rng.normal(size=n).astype(np.float32)
  acc[rng.random(n) < zeros] = 0
  return jnp.asarray(acc, dtype)


def _adversarial(rng, dtype):
  """(name, acc, tau) cases; each runs at several capacities and offsets."""
  f32 = np.float32
  base = _normal(rng, N, dtype)
  mags = np.abs(np.asarray(base, np.float32))
  ties = rng.choice(np.array([-1, 1, 0.5, -0.5, 0, -0.0], f32), N)
  special = rng.normal(size=N).astype(f32)
  where = rng.choice(6, N, p=[.7, .06, .06, .06, .06, .06])
  special[where == 1] = np.nan
  special[where == 2] = np.inf
  special[where == 3] = -np.inf
  special[where == 4] = 0.0
  special[where == 5] = -0.0
  ramp = np.linspace(-1, 1, N).astype(f32)          # runs of candidates
  dense_blocks = np.where((np.arange(N) // BLOCK) % 2 == 0, 1.0, 1e-3)
  dense_blocks = (dense_blocks * rng.normal(size=N)).astype(f32)
  cases = [
      ("below", base, f32(mags.max() * 2 + 1)),
      ("above", jnp.asarray(np.where(mags == 0, 1, mags), dtype), f32(0)),
      ("tau0_zeros", base, f32(0)),
      ("median", base, f32(np.quantile(mags, 0.5))),
      ("q99", base, f32(np.quantile(mags, 0.99))),
      ("max", base, f32(mags.max())),
      ("ties_half", jnp.asarray(ties, dtype), f32(0.5)),
      ("ties_one", jnp.asarray(ties, dtype), f32(1.0)),
      ("special_0", jnp.asarray(special, dtype), f32(0)),
      ("special_1", jnp.asarray(special, dtype), f32(1.0)),
      ("special_inf", jnp.asarray(special, dtype), f32(np.inf)),
      ("special_nan", jnp.asarray(special, dtype), f32(np.nan)),
      ("ramp", jnp.asarray(ramp, dtype), f32(0.25)),
      ("dense_blocks", jnp.asarray(dense_blocks, dtype), f32(0.01)),
      ("all_zero", jnp.zeros((N,), dtype), f32(0)),
  ]
  return cases


OFFSETS = (0, 1, 127, 128, 500, 900, N - 1)   # 900: inside the tail block


@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("capacity", [1, 50, N])
def test_adversarial_inputs(dtype, capacity):
  rng = np.random.default_rng(capacity)
  for name, acc, tau in _adversarial(rng, dtype):
    for offset in OFFSETS:
      try:
        check(acc, tau, capacity, offset)
      except AssertionError as e:
        raise AssertionError(f"case {name}, offset {offset}") from e


def test_counts_and_sentinels_explicitly():
  acc = jnp.asarray(np.array([0, 3, -1, np.nan, 2, 0, -5, np.inf], np.float32))
  # candidates (|a| >= 2, a != 0): positions 1, 4, 6, 7; from offset 5: 6, 7, 1, 4
  values, indices, count = select_pallas(acc, 2.0, 3, 5, block=32,
                                         interpret=INTERPRET)
  assert int(count) == 4
  np.testing.assert_array_equal(np.asarray(indices), [6, 7, 1])
  np.testing.assert_array_equal(np.asarray(values), [-5, np.inf, 3])
  values, indices, count = select_pallas(acc, 2.0, 6, 5, block=32,
                                         interpret=INTERPRET)
  np.testing.assert_array_equal(np.asarray(indices), [6, 7, 1, 4, 8, 8])
  np.testing.assert_array_equal(np.asarray(values), [-5, np.inf, 3, 2, 0, 0])
  check(acc, 2.0, 6, 5, block=32)


@pytest.mark.parametrize("stage", [1, 4, BLOCK])
def test_stage_sizes(stage):
  """stage=1: nearly every block peels its mask in pass 2; stage=block: every
  block copies its staged candidates."""
  rng = np.random.default_rng(stage)
  for name, acc, tau in _adversarial(rng, np.float32)[:8]:
    for offset in (0, 333, N - 1):
      try:
        check(acc, tau, 50, offset, stage=stage)
      except AssertionError as e:
        raise AssertionError(f"case {name}, offset {offset}") from e


def test_band_equals_the_reference():
  """Two bounds, in one block and several (one partial), both dtypes."""
  rng = np.random.default_rng(12)
  for dtype in (np.float32, BF16):
    for name, acc, tau in _adversarial(rng, dtype):
      mags = np.abs(np.asarray(acc, np.float32))
      finite = mags[np.isfinite(mags)]
      hi_q = np.float32(np.quantile(finite, 0.95)) if finite.size else 1.0
      cases = ((acc, tau, hi_q, 50), (acc, tau, np.inf, N),
               (acc, 0.0, tau, 7), (acc, tau, tau, 5),
               (acc[:700], tau, hi_q, 50))    # 6 blocks: counts padded to 8
      for a, lo, hi, capacity in cases:
        got = select_band_pallas(a, np.float32(lo), np.float32(hi),
                                 capacity, block=BLOCK, interpret=INTERPRET)
        want = _reference_band(a, np.float32(lo), np.float32(hi), capacity)
        try:
          for g, w in zip(got, want):
            np.testing.assert_array_equal(_bits(g) if g.ndim else g,
                                          _bits(w) if w.ndim else w)
        except AssertionError as e:
          raise AssertionError(f"case {name} {dtype}, band [{lo}, {hi})") from e
  # The default block, several of them, on a larger input.
  x = jax.random.normal(jax.random.PRNGKey(8), (69635,), jnp.float32)
  x = x.at[::7].set(0)
  lo, hi = jnp.float32(0.5), jnp.float32(2.0)
  got = select_band_pallas(x, lo, hi, 30000, interpret=INTERPRET)
  for g, w in zip(got, _reference_band(x, lo, hi, 30000)):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@pytest.mark.parametrize("block,tile", [(32, None), (None, None), (512, 128),
                                        (256, 32)])
def test_block_and_tile_sizes(block, tile):
  """Several blocks of one tile, one block, and blocks looping over tiles."""
  rng = np.random.default_rng(7)
  acc = _normal(rng, N, np.float32)
  for q in (0.0, 0.9, 0.995):
    tau = np.float32(np.quantile(np.abs(np.asarray(acc)), q))
    for offset in (0, 17, 640, N - 1):
      check(acc, tau, 50, offset, block=block, tile=tile)
  if tile is not None:
    for name, acc, tau in _adversarial(rng, np.float32):
      for offset in (0, 300, N - 1):
        try:
          check(acc, tau, 50, offset, block=block, tile=tile)
        except AssertionError as e:
          raise AssertionError(f"case {name}, offset {offset}") from e


def test_pass_two_loops_over_mask_words():
  """Blocks of more than 256 mask words (pass 2 loops), one partial, and
  words with every bit set (32 peels)."""
  n = 20000
  rng = np.random.default_rng(9)
  acc = _normal(rng, n, np.float32, zeros=0.05)
  mags = np.abs(np.asarray(acc))
  for q in (0.99, 0.5, 0.0):
    tau = np.float32(np.quantile(mags, q))
    for capacity, offset in ((int(1.5 * (1 - q) * n) + 1, 0), (300, 12345),
                             (n, n - 1)):
      check(acc, tau, capacity, offset, block=16384, tile=4096, stage=64)


def test_sentinel_fill_loops_over_many_slots():
  """One program writing more than one fill tile of sentinels."""
  n = 3000
  rng = np.random.default_rng(5)
  acc = _normal(rng, n, np.float32, zeros=0.5)
  for tau, offset in ((0.0, 0), (1.0, 1234), (np.inf, n - 1)):
    check(acc, np.float32(tau), n, offset, block=4096, tile=1024)


def test_offsets_outside_the_range_behave_as_the_reference():
  rng = np.random.default_rng(9)
  acc = _normal(rng, N, np.float32)
  for offset in (-3, N, N + 77, 2 * N):
    check(acc, np.float32(0.5), 50, offset)


def test_threshold_promotion_follows_the_reference():
  """A Python-float τ is rounded to bfloat16 for bfloat16 acc (weak type),
  a float32 τ is not: the kernel compares as the reference does."""
  v = 0.10009765625                      # a bfloat16 value
  acc = jnp.asarray(np.array([v, -v, 0.5, 0.0625] * 50, np.float32), BF16)
  tau = v + 1e-5                         # rounds down to v in bfloat16
  assert check(acc, tau, 40, 3) == 150                     # weak: bf16 compare
  assert check(acc, np.float32(tau), 40, 3) == 50          # f32 compare
  assert check(acc, jnp.float32(tau), 40, 3) == 50


def test_bfloat16_rounding_of_tau_is_round_to_nearest_even():
  """τ is rounded to bfloat16 on its bits (XLA on GPU may drop a
  float32→bfloat16→float32 convert pair): it must equal the real rounding."""
  rng = np.random.default_rng(0)
  bits = np.concatenate([
      rng.integers(0, 2**32, 20000, dtype=np.uint64).astype(np.uint32),
      np.array([0, 0x80000000, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F800000, 0xFF800000,
                0x7FC00000, 0x00000001, 0x00008000, 0x00018000, 0x3F808000,
                0x3F818000, 0x3F807FFF, 0x7F7F8000, 0x7F7F7FFF], np.uint32)])
  x = bits.view(np.float32)
  with np.errstate(invalid="ignore"):
    want = x.astype(ml_dtypes.bfloat16).astype(np.float32)
  got = np.asarray(jax.jit(round_to_bfloat16)(jnp.asarray(x)))
  nan = np.isnan(want)
  np.testing.assert_array_equal(np.isnan(got), nan)
  np.testing.assert_array_equal(got[~nan].view(np.uint32),
                                want[~nan].view(np.uint32))


def test_denormals():
  acc = np.zeros(N, np.float32)
  acc[::7] = 1e-40
  acc[::11] = -3e-39
  acc[::13] = 1.0
  for tau in (0.0, 1e-41, 2e-39, 0.5):
    for offset in (0, 500):
      check(jnp.asarray(acc), np.float32(tau), 50, offset)


def test_tiny_sizes():
  for n in (1, 2, 3):
    for capacity in range(1, n + 1):
      for offset in range(n):
        acc = jnp.asarray(np.array([1.0, -2.0, 0.0][:n], np.float32))
        check(acc, 1.0, capacity, offset)


def test_vmap_and_outer_jit():
  rng = np.random.default_rng(3)
  acc = jnp.stack([_normal(rng, N, np.float32) for _ in range(3)])
  tau = jnp.asarray([0.5, 1.5, 10.0], jnp.float32)
  offset = jnp.asarray([0, 500, N - 1], jnp.int32)
  got = jax.jit(jax.vmap(lambda a, t, o: select_pallas(
      a, t, 60, o, block=BLOCK, interpret=INTERPRET)))(acc, tau, offset)
  want = jax.vmap(lambda a, t, o: _reference(a, t, 60, o))(acc, tau, offset)
  for g, w in zip(got, want):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def _shard_mapped(fn, mesh, check_vma):
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top

  def local(acc, tau, offset):
    v, i, c = fn(acc[0], tau[0], offset)
    return v[None], i[None], c[None]

  return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("data"),
                                                           P("data"), P()),
                               out_specs=P("data"), check_vma=check_vma))


@pytest.fixture(name="any_mesh")
def _any_mesh():
  """All devices of the default backend (8 CPUs here, 1 GPU on a GPU run)."""
  import jaxfuse  # pylint: disable=g-import-not-at-top
  return jaxfuse.make_mesh()


def test_inside_shard_map(any_mesh):
  """Per worker, as the reference. (The Pallas interpreter needs
  check_vma=False; compiled on GPU it runs under check_vma=True.)"""
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  mesh = any_mesh
  k = mesh.devices.size
  rng = np.random.default_rng(4)
  acc = jax.device_put(jnp.stack([_normal(rng, N, np.float32)
                                  for _ in range(k)]),
                       NamedSharding(mesh, P("data")))
  tau = jax.device_put(jnp.linspace(0.5, 2.5, k, dtype=jnp.float32),
                       NamedSharding(mesh, P("data")))
  offset = jax.device_put(jnp.int32(321), NamedSharding(mesh, P()))
  kernel = lambda a, t, o: select_pallas(a, t, 60, o, block=BLOCK,
                                         interpret=INTERPRET)
  got = _shard_mapped(kernel, mesh, check_vma=not INTERPRET)(acc, tau, offset)
  want = _shard_mapped(lambda a, t, o: reference.select(a, t, 60, o), mesh,
                       check_vma=True)(acc, tau, offset)
  for g, w in zip(got, want):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
  if INTERPRET:
    with pytest.raises(NotImplementedError, match="check_vma=False"):
      _shard_mapped(kernel, mesh, check_vma=True)(acc, tau, offset)


def test_lowers_for_gpu_inside_shard_map(any_mesh):
  """The Triton lowering under shard_map with check_vma=True (no GPU needed
  where JAX can lower for CUDA without one)."""
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  mesh = any_mesh
  k = mesh.devices.size
  fn = _shard_mapped(lambda a, t, o: select_pallas(a, t, 1500, o), mesh,
                     check_vma=True)
  spec = lambda shape, dtype, s: jax.ShapeDtypeStruct(
      shape, dtype, sharding=NamedSharding(mesh, s))
  assert triton_kernels_for_cuda(
      fn, spec((k, 100003), jnp.float32, P("data")),
      spec((k,), jnp.float32, P("data")),
      spec((), jnp.int32, P())) == 3                    # mask, scan, write


def test_rejects_bad_arguments():
  acc = jnp.ones((N,), jnp.float32)
  with pytest.raises(ValueError, match="flat"):
    select_pallas(acc.reshape(10, 100), 1.0, 5, 0, interpret=True)
  with pytest.raises(ValueError, match="power of two"):
    select_pallas(acc, 1.0, 5, 0, block=100, interpret=True)
  with pytest.raises(ValueError, match="power of two >= 32"):
    select_pallas(acc, 1.0, 5, 0, block=16, interpret=True)
  with pytest.raises(ValueError, match="tile"):
    select_pallas(acc, 1.0, 5, 0, block=128, tile=256, interpret=True)
  with pytest.raises(ValueError, match="stage"):
    select_pallas(acc, 1.0, 5, 0, block=128, stage=256, interpret=True)
  with pytest.raises(ValueError, match="float"):
    select_pallas(acc.astype(jnp.int32), 1.0, 5, 0, interpret=True)


if given is not None:

  @settings(max_examples=30, deadline=None)
  @given(data=st.data(), n=st.sampled_from([1, 5, 257, N]),
         capacity=st.sampled_from([1, 50, None]),
         quantile=st.floats(0, 1), zeros=st.sampled_from([0.0, 0.3, 0.9]),
         bf16=st.booleans(), seed=st.integers(0, 2**16))
  def test_random_inputs(data, n, capacity, quantile, zeros, bf16, seed):
    capacity = n if capacity is None else min(capacity, n)
    rng = np.random.default_rng(seed)
    acc = _normal(rng, n, BF16 if bf16 else np.float32, zeros)
    tau = np.float32(np.quantile(np.abs(np.asarray(acc, np.float32)),
                                 quantile))
    offset = data.draw(st.integers(0, n - 1))
    check(acc, tau, capacity, offset)


# Configurations the benchmark sweeps (benchmarks/kernels.py), checked on GPU.
GPU_CONFIGS = [
    dict(),
    dict(block=4096, tile=4096),
    dict(block=8192, tile=1024),
    dict(block=8192, tile=8192, num_warps=8),
    dict(block=8192, tile=2048, stage=1024),
    dict(block=16384, tile=2048, num_warps=8),
    dict(block=16384, tile=4096),
    dict(block=32768, tile=4096, num_warps=8),
]


@gpu_only
@pytest.mark.parametrize("config", GPU_CONFIGS, ids=str)
def test_large_on_gpu(config):
  config = {"block": None, **config}       # block=None: the default
  n = (1 << 21) + 12345
  rng = np.random.default_rng(11)
  for dtype, density in ((np.float32, 0.01), (BF16, 0.3)):
    acc = _normal(rng, n, dtype, zeros=0.1)
    mags = np.abs(np.asarray(acc, np.float32))
    tau = np.float32(np.quantile(mags, 1 - density))
    capacity = int(1.5 * density * n)
    for offset in (0, 8192, n - 1):
      check(acc, tau, capacity, offset, **config)
  check(acc, tau, 7, n // 3, **config)                 # heavy overflow
  check(acc, np.float32(0), n, 5, **config)            # everything non-zero
