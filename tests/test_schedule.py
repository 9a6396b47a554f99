"""The plan compiled once (``jaxfuse.schedule``): every leaf placed exactly
once, contiguously inside its unit, buckets of the kind their units make,
in the plan's order; warm-up phases compile to the same layout."""

import jax
import jax.numpy as jnp
import pytest

import jaxfuse
from jaxfuse import plans as plan_lib
from jaxfuse import schedule

SHAPES = {"a": (30, 20), "b": (20,), "c": (64, 8), "d": (5,), "e": (48, 48)}


def _plan(strategy, **kw):
  return jaxfuse.plan({n: jax.ShapeDtypeStruct(s, jnp.float32)
                       for n, s in SHAPES.items()}, density=0.05,
                      strategy=strategy, min_sparse_size=64, **kw)


@pytest.mark.parametrize("strategy", ["layerwise", "single", "aligned",
                                      "size", "behind"])
def test_every_leaf_placed_once_in_its_unit(strategy):
  plan = _plan(strategy, **({"bucket_bytes": 4096}
                            if strategy in ("size", "behind") else {}))
  sched = schedule.compile_plan(plan)
  assert [b.index for b in sched.buckets] == list(range(len(plan.buckets)))
  placed = []
  for b, bucket in zip(sched.buckets, plan.buckets):
    assert b.collective == bucket.collective
    assert b.leaves == tuple(bucket.leaves)
    if bucket.collective == "psum":
      assert b.kind == schedule.PSUM and b.units == () and b.groups == ()
      placed += list(bucket.leaves)
      continue
    assert b.kind == schedule.SPARSE
    assert sorted(j for _, ls in b.placement for j, _ in ls) == sorted(
        bucket.leaves)
    for u, leaves in b.placement:
      unit = sched.units[u]
      assert tuple(j for j, _ in leaves) == unit.leaves
      # Contiguous, in order, filling the unit exactly.
      end = 0
      for j, start in leaves:
        assert start == end
        end += plan.leaves[j].size
      assert end == unit.size
      assert sched.group_of_unit[u] in b.groups
      placed += [j for j, _ in leaves]
  assert sorted(placed) == list(range(len(plan.leaves)))
  # Each state group lies in one bucket.
  owner = {}
  for b in sched.buckets:
    for g in b.groups:
      assert owner.setdefault(g, b.index) == b.index


def test_a_dense_phase_is_full_with_the_same_layout():
  plan = _plan("aligned")
  sparse = schedule.compile_plan(plan)
  dense = schedule.compile_plan(jaxfuse.with_density(plan, 1.0))
  for s, d in zip(sparse.buckets, dense.buckets):
    assert (s.units, s.groups, s.placement) == (d.units, d.groups,
                                                d.placement)
    assert d.kind == (schedule.PSUM if s.kind == schedule.PSUM
                      else schedule.FULL)
  assert sparse.groups == dense.groups
  assert sparse.group_dtypes == dense.group_dtypes == tuple(
      "float32" for _ in sparse.groups)
  assert len(plan_lib.units(plan)[0]) == len(sparse.units)


@pytest.mark.parametrize("strategy", ["layerwise", "single", "size", "behind"])
def test_the_schedule_agrees_with_the_plans_views(strategy):
  plan = _plan(strategy, **({"bucket_bytes": 4096}
                            if strategy in ("size", "behind") else {}))
  sched = schedule.compile_plan(plan)
  all_units, per_bucket = plan_lib.units(plan)
  assert sched.units == all_units
  assert tuple(b.units for b in sched.buckets) == per_bucket
  assert sched.groups == plan_lib.state_groups(plan)
  assert sched.group_of_unit == tuple(g for g, _ in plan_lib.unit_rows(plan))
  for b, ids in zip(sched.buckets, per_bucket):
    assert sched.bucket_units(b) == tuple(all_units[u] for u in ids)
    for u, leaves in b.placement:
      assert tuple(o for _, o in leaves) == plan_lib.leaf_offsets(
          plan, all_units[u])
