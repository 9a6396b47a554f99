"""The kernel switch on a JAX without Pallas's Triton backend.

JAX 0.12 deprecates that backend; a release without it must leave jaxfuse
importable and its results unchanged, on the XLA reference."""

import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest

from jaxfuse import _compat
from jaxfuse import kernels

from _harness import cpu_env


@pytest.fixture
def no_triton(monkeypatch):
  """This process as if JAX shipped no ``jax.experimental.pallas.triton``."""
  monkeypatch.setattr(_compat, "pallas_triton", lambda: None)
  monkeypatch.setattr(kernels, "_warned", False)
  yield
  kernels.set_backend("auto")


def test_auto_on_gpu_falls_back_with_one_warning(no_triton, monkeypatch):
  monkeypatch.setattr(kernels.jax, "default_backend", lambda: "gpu")
  kernels.set_backend("auto")
  with pytest.warns(RuntimeWarning, match="no Pallas Triton backend"):
    assert kernels.backend() == "reference"
  with warnings.catch_warnings(action="error"):
    assert kernels.backend() == "reference"   # warned once only


def test_auto_off_gpu_is_silent(no_triton, monkeypatch):
  monkeypatch.setattr(kernels.jax, "default_backend", lambda: "cpu")
  kernels.set_backend("auto")
  with warnings.catch_warnings(action="error"):
    assert kernels.backend() == "reference"


def test_forced_pallas_is_an_error_naming_the_switch(no_triton):
  kernels.set_backend("pallas")
  with pytest.raises(kernels.KernelError,
                     match="JAXFUSE_KERNELS=auto or reference"):
    kernels.backend()


@pytest.mark.parametrize("kernel", ["select_pallas", "sparsify_pass_pallas",
                                    "hash_partition_pallas"])
def test_calling_a_kernel_directly_names_it_and_the_fix(no_triton, kernel):
  from jaxfuse.kernels import fused_pass  # pylint: disable=g-import-not-at-top
  from jaxfuse.kernels import hash_partition as hp  # pylint: disable=g-import-not-at-top
  from jaxfuse.kernels import selection  # pylint: disable=g-import-not-at-top
  # Shapes no other test uses, so no jit cache holds a traced kernel.
  x = np.linspace(-1, 1, 233, dtype=np.float32)
  call = {
      "select_pallas": lambda: selection.select_pallas(
          x, 0.5, 7, 0, interpret=True),
      "sparsify_pass_pallas": lambda: fused_pass.sparsify_pass_pallas(
          x, np.zeros_like(x), 0.5, 7, 0, interpret=True),
      "hash_partition_pallas": lambda: hp.hash_partition_pallas(
          np.arange(11, dtype=np.int32) * 5, 3, 97, interpret=True),
  }[kernel]
  with pytest.raises(ImportError, match=f"{kernel}: JAX .* no Pallas Triton"):
    call()


def test_with_triton_the_switch_is_unchanged(monkeypatch):
  if _compat.pallas_triton() is None:
    pytest.skip("this JAX has no Pallas Triton backend")
  monkeypatch.setattr(kernels.jax, "default_backend", lambda: "gpu")
  kernels.set_backend("auto")
  try:
    assert kernels.backend() == "pallas"
  finally:
    kernels.set_backend("auto")


def test_hash_partition_auto_follows_the_switch(no_triton, monkeypatch):
  from jaxfuse.kernels import hash_partition as hp
  called = []
  monkeypatch.setattr(hp, "hash_partition_pallas",
                      lambda *a, **k: called.append(1))
  monkeypatch.setattr(hp.jax, "default_backend", lambda: "gpu")
  kernels.set_backend("auto")
  idx = np.arange(8, dtype=np.int32) * 3
  with pytest.warns(RuntimeWarning):
    out = hp.hash_partition(idx, 2, 64)
  assert not called   # the reference ran: its lists, bit for bit
  want = hp.hash_partition_reference(idx, 2, 64)
  np.testing.assert_array_equal(np.asarray(hp.extract(out)),
                                np.asarray(hp.extract(want)))
  np.testing.assert_array_equal(np.asarray(out.counts),
                                np.asarray(want.counts))
  listed = np.asarray(hp.extract(out)).ravel()
  assert sorted(listed[listed < 64].tolist()) == idx.tolist()   # each once


def test_imports_and_trains_where_the_module_is_gone(tmp_path):
  """A child process whose JAX raises ImportError for the Triton module
  imports every kernel module and runs a sparse step, bitwise as here."""
  (tmp_path / "sitecustomize.py").write_text(textwrap.dedent("""
      import importlib.abc, sys
      class _Gone(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
          if name == "jax.experimental.pallas.triton":
            raise ImportError("no Triton backend in this JAX")
          return None
      sys.meta_path.insert(0, _Gone())
      """))
  script = textwrap.dedent("""
      import jax, jax.numpy as jnp, numpy as np
      import jaxfuse
      from jaxfuse import _compat, kernels
      from jaxfuse.kernels import selection, fused_pass, hash_partition
      assert _compat.pallas_triton() is None
      x = jnp.asarray(np.random.default_rng(0).normal(size=4096), jnp.float32)
      out = kernels.sparsify_pass(x, jnp.zeros_like(x), 1.5, 64, 0)
      print(int(out.count), " ".join(map(str, np.asarray(out.indices))))
      print(np.asarray(out.values).tobytes().hex())
      print(np.asarray(out.residual).tobytes().hex())
      """)
  env = cpu_env(1)
  env["PYTHONPATH"] = f"{tmp_path}:{env['PYTHONPATH']}"
  run = subprocess.run([sys.executable, "-c", script], env=env,
                       capture_output=True, text=True, timeout=300,
                       check=False)
  assert run.returncode == 0, run.stderr[-2000:]
  x = np.random.default_rng(0).normal(size=4096).astype(np.float32)
  counts, values, residual = run.stdout.strip().splitlines()[-3:]
  count, *indices = map(int, counts.split())
  hits = np.flatnonzero(np.abs(x) >= 1.5)        # the first 64, in order
  assert count == len(hits) > 64 and indices == list(hits[:64])
  assert np.frombuffer(bytes.fromhex(values), np.float32).tolist() == (
      x[hits[:64]].tolist())
  kept = x.copy()
  kept[hits[:64]] = 0
  assert np.frombuffer(bytes.fromhex(residual), np.float32).tolist() == (
      kept.tolist())
