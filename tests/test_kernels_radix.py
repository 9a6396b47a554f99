"""The one-kernel radix select (``kernels.radix``) equals a sort's k-th
largest bit for bit, reads each row only up to its own length, and lowers
to one Triton kernel (in Pallas's interpreter off GPU; compiled with
JAXFUSE_TEST_GPU=1 on a GPU)."""

import os

from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
from jax import lax
import numpy as np
import pytest

from jaxfuse import kernels
from jaxfuse.kernels import radix_select
from jaxfuse.kernels import radix

from _harness import MAGNITUDES
from _harness import magnitude_rows
from _harness import triton_kernels_for_cuda

ON_GPU = (os.environ.get("JAXFUSE_TEST_GPU") == "1"
          and jax.default_backend() == "gpu")
INTERPRET = not ON_GPU


def _sorted_kth(a, k):
  return -np.sort(-a, axis=-1)[..., k - 1]


def _bits(a):
  return np.asarray(a).view(np.uint32)


@settings(max_examples=20, deadline=None)
@given(widths=st.lists(st.integers(1, 300), min_size=1, max_size=3),
       kind=st.sampled_from(sorted(MAGNITUDES)),
       zeros=st.floats(0, 1), tile=st.sampled_from([32, 128]),
       data=st.data())
def test_pallas_method_is_the_sorted_kth(widths, kind, zeros, tile, data):
  """Rows of several widths in one kernel (a program each, tiles of
  ``tile``, the last one partial): each row's k-th largest is the sort's,
  bitwise, with zeros, ties, infinities, NaN and denormals."""
  rows, ranks = magnitude_rows(
      np.random.default_rng(sum(widths) + tile), kind, widths, zeros,
      lambda w: data.draw(st.integers(1, w)), nan=True)
  width = max(widths)
  bits = np.concatenate([np.pad(a.view(np.int32), ((0, 0), (0, width - w)),
                                constant_values=2**31 - 1)  # never read
                         for a, w in zip(rows, widths)])
  k = np.repeat(ranks, 2).astype(np.int32)
  got = radix.radix_rows_pallas(jnp.asarray(bits), jnp.asarray(k),
                                tuple(np.repeat(widths, 2)), tile=tile,
                                interpret=INTERPRET)
  want = np.concatenate([
      np.asarray(lax.top_k(jnp.asarray(a), r)[0][:, r - 1])
      for a, r in zip(rows, ranks)])
  np.testing.assert_array_equal(_bits(got), _bits(want))


def test_reads_each_row_only_up_to_its_length():
  """Past a row's length the patterns are never counted: a row padded with
  the largest pattern gives the k-th largest of its first n."""
  a = np.arange(1, 101, dtype=np.float32)[None]          # 1 … 100
  bits = np.concatenate([a.view(np.int32),
                         np.full((1, 60), 2**31 - 1, np.int32)], axis=1)
  got = radix.radix_rows_pallas(jnp.asarray(bits), jnp.asarray([3]), (100,),
                                tile=32, interpret=INTERPRET)
  assert float(np.asarray(got).view(np.float32)[0]) == 98.0
  full = radix.radix_rows_pallas(jnp.asarray(bits), jnp.asarray([3]),
                                 tile=32, interpret=INTERPRET)
  assert int(np.asarray(full)[0]) == 2**31 - 1


def test_kth_largest_rows_pallas_agrees_with_radix_and_sort():
  """``kth_largest_rows(method="pallas")`` as the other two methods, on a
  gpt2-small-like bucket's row shapes (scaled down)."""
  rng = np.random.default_rng(0)
  rows = [jnp.asarray(np.abs(rng.standard_t(3, size=s)).astype(np.float32))
          for s in ((12, 590), (5, 2359), (2, 26), (3, 26))]
  ranks = [6, 24, 1, 3]
  got = {m: radix_select.kth_largest_rows(rows, ranks, method=m)
         for m in ("pallas", "radix", "sort")}
  for i, (a, r) in enumerate(zip(rows, ranks)):
    want = _sorted_kth(np.asarray(a), r)
    for m, g in got.items():
      np.testing.assert_array_equal(_bits(g[i]), _bits(want), err_msg=m)


def test_default_gpu_method_switch(monkeypatch):
  """Where the Pallas kernels run, ``DEFAULT_GPU_METHOD`` picks the
  method: "pallas" launches the one kernel, "radix" the XLA rounds, and
  "auto" the kernel only for rows of at most ``PALLAS_MAX_WIDTH``; all
  give the same k-th largests."""
  calls = []
  real = radix.radix_rows_pallas
  monkeypatch.setattr(radix, "radix_rows_pallas",
                      lambda *a, **k: calls.append(1) or real(*a, **k))
  monkeypatch.setattr(kernels, "backend", lambda: "pallas")
  short = jnp.asarray(np.arange(12, dtype=np.float32).reshape(2, 6))
  wide = jnp.asarray(np.arange(14, dtype=np.float32).reshape(2, 7))
  monkeypatch.setattr(radix_select, "PALLAS_MAX_WIDTH", 6)
  for method, rows, kernel, want in [
      ("pallas", wide, True, [5.0, 12.0]),
      ("radix", short, False, [4.0, 10.0]),
      ("auto", short, True, [4.0, 10.0]),
      ("auto", wide, False, [5.0, 12.0]),
      # The widest row decides for the whole call.
      ("auto", [short, wide], False, [4.0, 10.0, 5.0, 12.0])]:
    calls.clear()
    monkeypatch.setattr(radix_select, "DEFAULT_GPU_METHOD", method)
    rows = rows if isinstance(rows, list) else [rows]
    got = radix_select.kth_largest_rows(rows, [2] * len(rows))
    assert bool(calls) == kernel, (method, rows)
    assert np.concatenate([np.asarray(g) for g in got]).tolist() == want
  monkeypatch.setattr(radix_select, "DEFAULT_GPU_METHOD", "sort")
  with pytest.raises(ValueError, match="DEFAULT_GPU_METHOD='sort'; use one "
                     "of \\('auto'"):
    radix_select.kth_largest_rows([short], [2])


def test_rejects_bad_arguments():
  bits = jnp.zeros((2, 8), jnp.int32)
  k = jnp.ones((2,), jnp.int32)
  with pytest.raises(ValueError, match=r"\(R, W\) int32"):
    radix.radix_rows_pallas(bits.astype(jnp.float32), k, interpret=True)
  with pytest.raises(ValueError, match="lengths must be 2 values"):
    radix.radix_rows_pallas(bits, k, (8,), interpret=True)
  with pytest.raises(ValueError, match=r"in \[1, 8\]"):
    radix.radix_rows_pallas(bits, k, (8, 9), interpret=True)
  with pytest.raises(ValueError, match="power of two"):
    radix.radix_rows_pallas(bits, k, tile=48, interpret=True)


def test_lowers_to_one_triton_kernel_inside_shard_map():
  """Under shard_map with check_vma=True, as ``sparse_sync`` calls it on
  GPUs: one Triton kernel for all rows (no GPU needed where JAX can lower
  for CUDA without one)."""
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  import jaxfuse  # pylint: disable=g-import-not-at-top
  mesh = jaxfuse.make_mesh()
  n = mesh.devices.size
  fn = jax.jit(jax.shard_map(
      lambda b, k: radix.radix_rows_pallas(b[0], k[0], (700, 700, 37))[None],
      mesh=mesh, in_specs=(P("data"), P("data")), out_specs=P("data"),
      check_vma=True))
  spec = lambda shape: jax.ShapeDtypeStruct(
      shape, jnp.int32, sharding=NamedSharding(mesh, P("data")))
  assert triton_kernels_for_cuda(fn, spec((n, 3, 700)), spec((n, 3))) == 1
