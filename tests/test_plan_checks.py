"""``jaxfuse.plan_checks``: each setting's range at both ends (the
documented intervals), the int32 index limit, and the bucket checks of a
hand-made plan."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import pytest

import jaxfuse
from jaxfuse import collectives
from jaxfuse import plans as plan_lib


def _base():
  return jaxfuse.plan([jax.ShapeDtypeStruct((4096,), jnp.float32)],
                      density=0.05,
                      settings=jaxfuse.Settings(min_sparse_size=64))


# Where each of 0.2's settings lives now: the estimators' knobs in
# settings.estimation, the schemes' in each bucket's scheme.
_ESTIMATION = ("refresh", "feedback", "sample_fraction", "sidco_stages")
_SCHEME = {"zen_table": (collectives.Zen, "table"),
           "zen_union": (collectives.Zen, "union"),
           "spardl_teams": (collectives.SparDL, "teams"),
           "spardl_block": (collectives.SparDL, "block"),
           "packed_indices": (collectives.AllGather, "packed_indices")}


def _with(**fields):
  """The base plan with one setting (0.2's name) changed where it lives."""
  (name, value), = fields.items()
  base = _base()
  if name in _SCHEME:
    kind, field = _SCHEME[name]
    return dataclasses.replace(base, buckets=tuple(
        dataclasses.replace(b, collective=kind.name,
                            scheme=kind(**{field: value}))
        for b in base.buckets))
  if name in _ESTIMATION:
    return dataclasses.replace(base, settings=dataclasses.replace(
        base.settings, estimation=dataclasses.replace(
            base.settings.estimation, **{name: value})))
  return dataclasses.replace(
      base, settings=dataclasses.replace(base.settings, **{name: value}))


def _read(plan, name):
  if name in _SCHEME:
    return getattr(plan.buckets[0].scheme, _SCHEME[name][1])
  if name in _ESTIMATION:
    return getattr(plan.settings.estimation, name)
  return getattr(plan.settings, name)


def _field(name) -> str:
  """How a check names the field: settings.x, settings.estimation.x, or
  the bucket's scheme, Zen(table=...)."""
  if name in _SCHEME:
    kind, field = _SCHEME[name]
    return rf"bucket 0: {kind.__name__}\({field}="
  if name in _ESTIMATION:
    return f"settings.estimation.{name}="
  return f"settings.{name}="


@pytest.mark.parametrize("name,value", [
    ("sidco_stages", 1), ("sidco_stages", 8),
    ("zen_union", 1.0), ("zen_union", 1e-6),
    ("sample_fraction", 1.0), ("sample_fraction", 1e-6),
    ("spardl_block", 1e-6), ("headroom", 1.0), ("zen_table", 1.0),
    ("refresh", 1), ("min_sparse_size", 1), ("spardl_teams", 1)])
def test_each_setting_accepts_the_ends_of_its_range(name, value):
  assert _read(_with(**{name: value}), name) == value


@pytest.mark.parametrize("name,value", [
    ("sidco_stages", 0), ("sidco_stages", 9),
    ("zen_union", 0.0), ("zen_union", 1.01),
    ("sample_fraction", 0.0), ("sample_fraction", 1.01),
    ("spardl_block", 0.0), ("headroom", 0.99), ("zen_table", 0.99),
    ("refresh", 0), ("min_sparse_size", 0), ("spardl_teams", 0)])
def test_each_setting_refuses_just_past_its_range(name, value):
  with pytest.raises(plan_lib.PlanError, match=_field(name)):
    _with(**{name: value})


@pytest.mark.parametrize("name,value,message", [
    ("seed", -1, r"settings.seed=-1 must be an integer in \[0, 2\*\*32\)"),
    ("seed", 2**32, r"settings.seed=4294967296 must be an integer in"),
    ("zen_table", float("inf"), r"bucket 0: Zen\(table=inf\) must be a "
     "finite"),
    ("spardl_block", float("inf"),
     r"bucket 0: SparDL\(block=inf\) must be a finite"),
])
def test_settings_a_step_could_not_use_are_refused(name, value, message):
  # each used to pass the plan and fail in the step with a bare
  # OverflowError (uint32 seed; ⌈∞·C⌉ slots)
  with pytest.raises(plan_lib.PlanError, match=message):
    _with(**{name: value})
  assert _with(seed=2**32 - 1).settings.seed == 2**32 - 1


@pytest.mark.parametrize("collective", ["zen", "spardl", "hier"])
def test_a_bucket_indexed_as_one_space_fits_int32(collective):
  # two sparse leaves of 1.2e9 elements: 2.4e9 > 2**31 - 2 in one bucket
  # index space (zen, spardl, hier); allgather indexes each leaf alone.
  params = [jax.ShapeDtypeStruct((1_200_000_000,), jnp.float32)] * 2
  with pytest.raises(plan_lib.PlanError, match=(
      f"bucket 0: '{collective}' indexes the bucket's 2400000000 elements "
      "as one int32 space")):
    jaxfuse.plan(params, density=0.01, strategy="single",
                 collective=collective)
  jaxfuse.plan(params, density=0.01, strategy="single",
               collective="allgather")
  split = jaxfuse.plan(params, density=0.01, strategy="layerwise",
                       collective=collective)
  assert [b.collective for b in split.buckets] == [collective] * 2


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


@pytest.mark.parametrize("provenance", ["abc", [1, 2]])
def test_a_plan_file_with_a_bad_provenance_is_a_plan_error(provenance):
  body = json.loads(_base().to_json())
  body["provenance"] = provenance
  with pytest.raises(plan_lib.PlanError, match="the file is corrupted"):
    plan_lib.Plan.from_json(json.dumps(body))


def test_packed_indices_must_be_a_bool():
  assert _with(packed_indices=True).buckets[0].scheme.packed_indices is True
  with pytest.raises(plan_lib.PlanError,
                     match=r"bucket 0: AllGather\(packed_indices=1\) must "
                     "be True or False"):
    _with(packed_indices=1)


def test_a_sparse_leaf_has_between_one_and_size_slots():
  # capacity == size (every element a slot) is the largest a leaf may have
  leaf = lambda c: plan_lib.LeafPlan("[0]", (100,), "float32", "sparse", 0.1,
                                     c, "dgc")
  ok = plan_lib.Plan((leaf(100),), (plan_lib.BucketPlan((0,), "allgather"),))
  assert ok.leaves[0].capacity == 100
  with pytest.raises(plan_lib.PlanError, match=r"leaf \[0\]: capacity=101 "
                     r"must be an integer in \[1, 100\]"):
    plan_lib.Plan((leaf(101),), (plan_lib.BucketPlan((0,), "allgather"),))


def test_an_integer_leaf_cannot_be_sparse():
  leaf = plan_lib.LeafPlan("[0]", (100,), "int32", "sparse", 0.1, 10, "dgc")
  with pytest.raises(plan_lib.PlanError,
                     match=r"leaf \[0\]: dtype int32 cannot be sparse"):
    plan_lib.Plan((leaf,), (plan_lib.BucketPlan((0,), "allgather"),))


@pytest.mark.parametrize("mode,collective,message", [
    ("sparse", "psum", "sparse leaves need collective 'allgather' or 'zen'"),
    ("dense", "allgather", "dense leaves need collective 'psum', not "
     "'allgather'")])
def test_a_buckets_collective_matches_its_mode(mode, collective, message):
  leaf = (_sparse_leaf(100, "[0]") if mode == "sparse" else
          _dense_leaf(100))
  with pytest.raises(plan_lib.PlanError, match=f"bucket 0: {message}"):
    plan_lib.Plan((leaf,), (plan_lib.BucketPlan((0,), collective),))


@pytest.mark.parametrize("ids", [(0, 2), (0, -1)])
def test_a_leaf_id_past_either_end_is_a_plan_error(ids):
  # two leaves: ids 0 and 1; 2 (one past the end) and -1 are out of range
  leaves = (_dense_leaf(8, "[0]"), _dense_leaf(8, "[1]"))
  with pytest.raises(plan_lib.PlanError, match=r"bucket 0: leaf ids .* out "
                     r"of range \[0, 2\)"):
    plan_lib.Plan(leaves, (plan_lib.BucketPlan(ids, "psum"),))


@pytest.mark.parametrize("collective", ["zen", "spardl", "hier"])
def test_a_bucket_of_exactly_the_int32_limit_is_accepted(collective):
  # 2 · (2**30 − 1) = 2**31 − 2 elements: the largest one index space
  half = 2**30 - 1
  leaves = tuple(plan_lib.LeafPlan(f"[{i}]", (half,), "float32", "sparse",
                                   0.01, 1000, "dgc") for i in range(2))
  plan = plan_lib.Plan(leaves, (plan_lib.BucketPlan((0, 1), collective),))
  assert sum(l.size for l in plan.leaves) == plan_lib.MAX_LEAF_SIZE
  big = tuple(dataclasses.replace(l, shape=(half + 1,)) for l in leaves)
  with pytest.raises(plan_lib.PlanError, match="as one int32 space"):
    plan_lib.Plan(big, (plan_lib.BucketPlan((0, 1), collective),))


@pytest.mark.parametrize("density", [0.0, 1.5])
def test_a_behind_buckets_density_is_checked(density):
  leaves = (_sparse_leaf(100, "[0]"), _sparse_leaf(50, "[1]"))
  with pytest.raises(plan_lib.PlanError,
                     match=f"bucket 0: density={density!r} must be in"):
    plan_lib.Plan(leaves, (plan_lib.BucketPlan(
        (0, 1), "allgather", "behind", 15, "dgc", density),))
