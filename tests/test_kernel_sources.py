"""``benchmarks/kernels.py kernel-sources``: a compiled program's kernels,
attributed to the source lines that traced them, on programs whose kernels are known."""

import importlib
import pathlib
import re
import sys

import jax
import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent

MODULE = '''\
import jax
import jax.numpy as jnp
from jax import lax
import outside


def two_kernels(x, y):
  a = jnp.sort(x)
  b = jnp.sort(y[::-1])
  return a, b


def looped(x):
  return lax.fori_loop(0, 3, lambda i, v: jnp.sort(v) * 2.0, x)


def through_a_helper(x):
  return outside.sort_it(x)
'''
SORT_LINES = (8, 9)   # of the two sorts in two_kernels
LOOP_LINE = 14
HELPER_LINE = 18      # the call of a function outside the package


@pytest.fixture(scope="module")
def ks(tmp_path_factory):
  root = tmp_path_factory.mktemp("src")
  (root / "pkgx").mkdir()
  (root / "pkgx" / "__init__.py").write_text("")
  (root / "pkgx" / "ops.py").write_text(MODULE)
  (root / "outside.py").write_text(
      "import jax.numpy as jnp\n\n\ndef sort_it(x):\n  return jnp.sort(x)\n")
  sys.path[:0] = [str(root), str(REPO / "benchmarks" / "tools")]
  try:
    yield (importlib.import_module("kernel_sources"),
           importlib.import_module("pkgx.ops"))
  finally:
    sys.path.remove(str(root))
    sys.path.remove(str(REPO / "benchmarks" / "tools"))


def _hlo(fn, *args):
  return jax.jit(fn).lower(*args).compile().as_text()


def test_each_sort_is_counted_on_its_own_line(ks):
  kernel_sources, ops = ks
  x = jax.numpy.arange(64.0)
  counts = kernel_sources.count_by_source(_hlo(ops.two_kernels, x, x), "pkgx")
  for line in SORT_LINES:
    assert counts[f"pkgx/ops.py:{line} (two_kernels)"] >= 1, counts
  # nothing of the program is lost: every kernel has some source
  text = _hlo(ops.two_kernels, x, x)
  assert sum(counts.values()) == len(kernel_sources.kernels_called(text))


def test_an_op_traced_outside_the_package_goes_to_the_calling_line(ks):
  kernel_sources, ops = ks
  text = _hlo(ops.through_a_helper, jax.numpy.arange(64.0))
  assert kernel_sources.count_by_source(text, "pkgx")[
      f"pkgx/ops.py:{HELPER_LINE} (through_a_helper)"] >= 1
  # with no frame in the package, the innermost frame's file and function
  assert kernel_sources.count_by_source(text, "nopkg")[
      "outside.py (sort_it)"] >= 1


def _defined_in(text, predicate):
  """Instruction names defined in the computations whose header line
  satisfies ``predicate``."""
  names, inside = set(), False
  for line in text.splitlines():
    if line and not line.startswith(" "):
      inside = line.endswith("{") and predicate(line)
    elif inside and " = " in line:
      names.add(line.split(" = ")[0].strip().removeprefix("ROOT ").lstrip(
          "%"))
  return names


def test_a_loop_body_counts_and_fusion_insides_do_not(ks):
  kernel_sources, ops = ks
  text = _hlo(ops.looped, jax.numpy.arange(64.0))
  counts = kernel_sources.count_by_source(text, "pkgx")
  assert counts[f"pkgx/ops.py:{LOOP_LINE} (looped)"] >= 1, counts
  called = kernel_sources.kernels_called(text)
  loop = re.search(r"body=%?([\w.\-]+)", text).group(1)
  body = _defined_in(text, lambda l: l.split(" ")[0].lstrip("%") == loop)
  fused = _defined_in(text, lambda l: "fused" in l.split(" ")[0])
  assert body and fused        # the program has both
  assert called & body         # the loop body's kernels run
  assert not called & fused    # a fusion's insides are part of its kernel


def test_the_difference_between_two_programs(ks, tmp_path):
  kernel_sources, ops = ks
  x = jax.numpy.arange(64.0)
  one = tmp_path / "one.hlo.txt"
  two = tmp_path / "two.hlo.txt"
  one.write_text(_hlo(lambda a: ops.two_kernels(a, a)[0], x))
  two.write_text(_hlo(lambda a: ops.two_kernels(a, a), x))
  result = kernel_sources.main([str(one), str(two), "--package", "pkgx"])
  # the second sort only in the second program (the first compiles away
  # its unused half)
  assert result["delta"].get(f"pkgx/ops.py:{SORT_LINES[1]} (two_kernels)",
                             0) >= 1
  assert f"pkgx/ops.py:{SORT_LINES[0]} (two_kernels)" not in result["delta"]


def test_profile_times_go_to_their_lines(ks):
  kernel_sources, ops = ks
  x = jax.numpy.arange(64.0)
  text = _hlo(ops.two_kernels, x, x)
  names = kernel_sources.kernel_sources(text, "pkgx")
  by_line = {}
  for name, src in names.items():
    by_line.setdefault(src, []).append(name)
  first = by_line[f"pkgx/ops.py:{SORT_LINES[0]} (two_kernels)"][0]
  second = by_line[f"pkgx/ops.py:{SORT_LINES[1]} (two_kernels)"][0]
  # a GPU trace names kernels after instructions, "." written as "_"
  gpu = lambda n: n.replace(".", "_")
  pallas = ("pkgx_pass1", "pkgx_pass1__3")  # a pallas_call's kernels
  prof = kernel_sources.profile_by_source(
      text, {gpu(first): 2.0, gpu(second): 1.0, "Memset": 1.0,
             pallas[0]: 1.0, pallas[1]: 1.0},
      {gpu(first): 10.0, gpu(second): 4.0, "Memset": 0.5, pallas[0]: 3.0,
       pallas[1]: 2.0}, "pkgx")
  assert prof[f"pkgx/ops.py:{SORT_LINES[0]} (two_kernels)"] == (2.0, 10.0)
  assert prof[f"pkgx/ops.py:{SORT_LINES[1]} (two_kernels)"] == (1.0, 4.0)
  assert prof["Memset"] == (1.0, 0.5)
  assert prof["pkgx/ Pallas pkgx_pass1"] == (2.0, 5.0)
