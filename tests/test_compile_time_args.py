"""``benchmarks/overhead.py compile-time`` builds ``overlap.py``'s step: each
``--plans`` entry becomes arguments that ``overlap.build`` accepts, the
entry's plan with overlap.py's defaults for the rest."""

import inspect
import math

import jax
import pytest

import jaxfuse

from _harness import repo_modules


@pytest.fixture(scope="module")
def ct():
  with repo_modules("benchmarks/tools", "compile_time") as module:
    yield module


@pytest.mark.parametrize("spec,want", [
    ("size:16", dict(strategy="size", bucket_mb=16.0, plan=None)),
    ("layerwise", dict(strategy="layerwise", bucket_mb=64, plan=None)),
    ("plans/cupcake.json", dict(strategy="size", plan="plans/cupcake.json")),
])
def test_each_plan_spec_sets_its_plan_and_keeps_the_defaults(ct, spec, want):
  args = ct.plan_args(spec, 0.01, "tiny")
  assert {k: getattr(args, k) for k in want} == want
  assert (args.preset, args.density, args.dtype, args.estimator) == (
      "tiny", 0.01, "float32", "dgc")
  assert args.headroom == inspect.signature(
      jaxfuse.plan).parameters["settings"].default.headroom


def test_overlap_build_takes_them(ct):
  """The tiny model's size plan, built as compile_time.py builds it."""
  args = ct.plan_args("size:64", 0.05, "tiny")
  *_, plan = ct.overlap.build(args, jax.devices()[:1])
  sparse = [leaf for leaf in plan.leaves if leaf.estimator]
  assert sparse and all(
      leaf.capacity == math.ceil(0.05 * math.prod(leaf.shape) * args.headroom)
      for leaf in sparse)
