"""``jaxfuse.plan_checks``: each setting's range at both ends (the
documented intervals), the int32 index limit, and the bucket checks of a
hand-made plan."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

import jaxfuse
from jaxfuse import plans as plan_lib


def _base():
  return jaxfuse.plan([jax.ShapeDtypeStruct((4096,), jnp.float32)],
                      density=0.05, min_sparse_size=64)


def _with(**settings):
  base = _base()
  return dataclasses.replace(
      base, settings=dataclasses.replace(base.settings, **settings))


@pytest.mark.parametrize("name,value", [
    ("sidco_stages", 1), ("sidco_stages", 8),
    ("zen_union", 1.0), ("zen_union", 1e-6),
    ("sample_fraction", 1.0), ("sample_fraction", 1e-6),
    ("spardl_block", 1e-6), ("headroom", 1.0), ("zen_table", 1.0),
    ("refresh", 1), ("min_sparse_size", 1), ("spardl_teams", 1)])
def test_each_setting_accepts_the_ends_of_its_range(name, value):
  assert getattr(_with(**{name: value}).settings, name) == value


@pytest.mark.parametrize("name,value", [
    ("sidco_stages", 0), ("sidco_stages", 9),
    ("zen_union", 0.0), ("zen_union", 1.01),
    ("sample_fraction", 0.0), ("sample_fraction", 1.01),
    ("spardl_block", 0.0), ("headroom", 0.99), ("zen_table", 0.99),
    ("refresh", 0), ("min_sparse_size", 0), ("spardl_teams", 0)])
def test_each_setting_refuses_just_past_its_range(name, value):
  with pytest.raises(plan_lib.PlanError, match=f"settings.{name}="):
    _with(**{name: value})


def _dense_leaf(size, path="[0]"):
  return plan_lib.LeafPlan(path, (size,), "float32", "dense", 1.0, size, None)


def test_a_leaf_may_have_up_to_two_to_the_31_minus_2_elements():
  # int32 indices with one value left for the empty slot: n <= 2**31 - 2
  # (no array is made: the plan only describes it).
  largest = 2**31 - 2
  plan_lib.Plan((_dense_leaf(largest),), (plan_lib.BucketPlan((0,), "psum"),))
  with pytest.raises(plan_lib.PlanError, match="exceed int32 indices"):
    plan_lib.Plan((_dense_leaf(largest + 1),),
                  (plan_lib.BucketPlan((0,), "psum"),))


def test_a_leaf_listed_twice_is_refused():
  leaves = (_dense_leaf(8, "[0]"), _dense_leaf(8, "[1]"))
  with pytest.raises(plan_lib.PlanError, match="exactly one bucket"):
    plan_lib.Plan(leaves, (plan_lib.BucketPlan((0,), "psum"),
                           plan_lib.BucketPlan((0, 1), "psum")))


def _sparse_leaf(size, path):
  return plan_lib.LeafPlan(path, (size,), "float32", "sparse", 0.1,
                           size // 10, "dgc")


def test_a_behind_bucket_has_at_most_its_fused_size_in_slots():
  leaves = (_sparse_leaf(100, "[0]"), _sparse_leaf(50, "[1]"))
  bucket = lambda c: plan_lib.BucketPlan((0, 1), "allgather", "behind", c,
                                         "dgc", 0.1)
  assert plan_lib.Plan(leaves, (bucket(150),)).buckets[0].capacity == 150
  with pytest.raises(plan_lib.PlanError, match=r"capacity=151 must be in "
                     r"\[1, 150\]"):
    plan_lib.Plan(leaves, (bucket(151),))


def test_a_bucket_of_sparse_and_dense_leaves_is_refused():
  leaves = (_sparse_leaf(100, "[0]"), _dense_leaf(8, "[1]"))
  with pytest.raises(plan_lib.PlanError, match="mixes sparse and dense"):
    plan_lib.Plan(leaves, (plan_lib.BucketPlan((0, 1), "allgather"),))
