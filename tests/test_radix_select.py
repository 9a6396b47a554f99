"""The radix-select k-th largest equals a sort's, bit for bit (the default
method off GPU is the sort itself, so the radix is asked for by name)."""

from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
import jax.numpy as jnp
import numpy as np
import pytest

from jaxfuse.kernels import radix_select

from _harness import MAGNITUDES
from _harness import fast_jit
from _harness import magnitude_rows


@settings(max_examples=25, deadline=None)
@given(widths=st.lists(st.integers(1, 700), min_size=1, max_size=4),
       kind=st.sampled_from(sorted(MAGNITUDES)), zeros=st.floats(0, 1),
       data=st.data())
def test_kth_largest_rows_is_the_sorted_kth(widths, kind, zeros, data):
  """Rows of several widths in one call: each row's k-th largest is the
  sort's, bitwise (zeros, ties, infinities, denormals, any k)."""
  rows, ranks = magnitude_rows(np.random.default_rng(sum(widths)), kind,
                               widths, zeros,
                               lambda w: data.draw(st.integers(1, w)))
  got = fast_jit(lambda r: radix_select.kth_largest_rows(   # one-off
      r, ranks, method="radix"))([jnp.asarray(a) for a in rows])
  for a, k, g in zip(rows, ranks, got):
    want = -np.sort(-a, axis=1)[:, k - 1]
    np.testing.assert_array_equal(np.asarray(g).view(np.uint32),
                                  want.view(np.uint32))


def test_kth_largest_rows_rejects_bad_ranks():
  with pytest.raises(ValueError, match="1 <= k <= s"):
    radix_select.kth_largest_rows([jnp.ones((2, 5))], [6])
  with pytest.raises(ValueError, match="float32"):
    radix_select.kth_largest_rows([jnp.ones((5,))], [1])
  with pytest.raises(ValueError, match="2 row arrays but 1 ranks"):
    radix_select.kth_largest_rows([jnp.ones((1, 5))] * 2, [1])
  with pytest.raises(ValueError, match="use one of .'radix', 'pallas', 'sort'."):
    radix_select.kth_largest_rows([jnp.ones((1, 5))], [1], method="heap")


@pytest.mark.parametrize("platform,kernels_backend,method", [
    ("cpu", "reference", "sort"), ("gpu", "pallas", "pallas"),
    ("gpu", "reference", "radix"),     # a JAX without Pallas's Triton
])
def test_default_method_follows_the_platform(monkeypatch, platform,
                                             kernels_backend, method):
  """Where the Pallas kernels run, ``DEFAULT_GPU_METHOD`` ("auto": the
  one-kernel radix for these short rows); the XLA rounds on other GPUs
  (they are plain JAX); the sort on CPUs."""
  used = []
  monkeypatch.setattr(radix_select.jax, "default_backend", lambda: platform)
  monkeypatch.setattr(radix_select.kernels, "backend",
                      lambda: kernels_backend)
  assert radix_select.DEFAULT_GPU_METHOD == "auto"
  top_k, rows_xla = radix_select.lax.top_k, radix_select.radix_rows
  rows_pallas = radix_select.radix.radix_rows_pallas
  monkeypatch.setattr(radix_select.lax, "top_k",
                      lambda *a: used.append("sort") or top_k(*a))
  monkeypatch.setattr(radix_select, "radix_rows",
                      lambda *a: used.append("radix") or rows_xla(*a))
  monkeypatch.setattr(  # in the interpreter: this machine has no GPU
      radix_select.radix, "radix_rows_pallas",
      lambda *a, **kw: used.append("pallas") or rows_pallas(
          *a, **dict(kw, interpret=True)))
  rows = jnp.asarray(np.arange(12, dtype=np.float32).reshape(2, 6))
  got = radix_select.kth_largest_rows([rows], [2])
  assert used == [method]
  assert np.asarray(got[0]).tolist() == [4.0, 10.0]
