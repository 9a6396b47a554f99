"""``jaxfuse.plans``' bookkeeping: the state groups' key (size and dtype),
a "behind" unit's dtype, capacities, and the wire bytes of packed indices
and density-1 buckets. Every expected value is worked by hand."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxfuse
from jaxfuse import plans as plan_lib
from jaxfuse.sync import bucket_steps

from _harness import NUM_WORKERS as K
from _harness import init, sync


def _sds(shape, dtype):
  return jax.ShapeDtypeStruct(shape, dtype)


def test_units_of_one_size_but_two_dtypes_get_a_state_group_each():
  # a (bfloat16) and b (float32), both 4096 elements, in one sparse bucket.
  # Ready order is reverse pytree order: unit 0 is b, unit 1 is a. A state
  # group is one (G, n) array of one dtype, so they cannot share one.
  params = {"a": _sds((64, 64), jnp.bfloat16), "b": _sds((64, 64), jnp.float32)}
  plan = jaxfuse.plan(params, density=0.05, strategy="single",
                      settings=jaxfuse.Settings(
                          min_sparse_size=64, residual_dtype="gradient"))
  assert len(plan.buckets) == 1
  assert plan_lib.state_groups(plan) == ((0,), (1,))
  sched = bucket_steps.compile_plan(plan)
  assert sched.group_dtypes == ("float32", "bfloat16")
  state = jax.eval_shape(jaxfuse.sparse_sync(plan).init, params)
  assert [(r.shape, str(r.dtype)) for r in state.residuals] == [
      ((1, 1, 4096), "float32"), ((1, 1, 4096), "bfloat16")]


def test_a_behind_bucket_of_mixed_dtypes_goes_on_the_wire_promoted():
  # "behind" over a (bfloat16, 4096) then b (float32, 1024): one unit of
  # 5120 elements whose values are float32 (bfloat16 and float32 promote to
  # float32), capacity ⌈0.05·5120·1.5⌉ = 384: 384 float32 values and 384
  # int32 indices, 8 bytes a slot.
  params = {"a": _sds((64, 64), jnp.bfloat16), "b": _sds((32, 32), jnp.float32)}
  plan = jaxfuse.plan(params, density=0.05, strategy="behind",
                      settings=jaxfuse.Settings(min_sparse_size=64),
                      order=[0, 1])
  (bucket,) = plan.buckets
  assert bucket.leaves == (0, 1) and bucket.capacity == 384
  (unit,), _ = plan_lib.units(plan)
  assert unit.dtype == "float32"
  assert plan.bytes_per_worker() == 384 * 8


def test_packed_index_bits_hold_the_empty_slot():
  # An index of a unit of n elements is in [0, n], n itself the empty slot:
  # n = 4096 needs 13 bits (4096 = 2**12 does not fit in 12), n = 4095 12.
  assert plan_lib.index_bits(4096) == 13
  assert plan_lib.index_bits(4095) == 12
  assert plan_lib.index_bits(1) == 1
  # 4096 elements at density 0.01, "topk": c = ⌈40.96⌉ = 41 slots; packed
  # indices take ⌈41·13/32⌉ = 17 words, the values 41 words: 232 bytes.
  plan = jaxfuse.plan([_sds((4096,), jnp.float32)], density=0.01,
                      estimator="topk",
                      settings=jaxfuse.Settings(min_sparse_size=64),
                      collective=jaxfuse.collectives.AllGather(
                          packed_indices=True))
  assert plan.leaves[0].capacity == 41
  assert plan.bytes_per_worker() == 4 * (41 + 17)


def test_hier_over_allgather_packs_indices_too():
  # AllGather(packed_indices=True) packs alone and as "hier"'s host-axis
  # scheme (Hier(inner=AllGather(...))); "hier" over ZEN keeps int32.
  params = [_sds((4096,), jnp.float32)]
  packed = jaxfuse.plan(params, density=0.01, estimator="topk",
                        settings=jaxfuse.Settings(min_sparse_size=64),
                        collective=jaxfuse.collectives.Hier(
                            inner=jaxfuse.collectives.AllGather(
                                packed_indices=True)))
  assert packed.bytes_per_worker() == 4 * (41 + 17)
  over_zen = jaxfuse.plan(params, density=0.01, estimator="topk",
                          settings=jaxfuse.Settings(min_sparse_size=64),
                          collective=jaxfuse.collectives.Hier(
                              inner=jaxfuse.collectives.Zen()))
  assert over_zen.bytes_per_worker() == 4 * (41 + 41)


def test_a_density_one_bucket_counts_its_full_wire_dtype():
  # A dense warm-up phase (density 1) of a float32 leaf of 4096 elements
  # with full_wire="bfloat16" sends 2 bytes an element, not 4.
  plan = jaxfuse.plan([_sds((4096,), jnp.float32)], density=0.05,
                      settings=jaxfuse.Settings(min_sparse_size=64))
  dense = jaxfuse.with_density(plan, 1.0)
  assert dense.bytes_per_worker() == 4096 * 4
  half = dataclasses.replace(
      dense, settings=dataclasses.replace(dense.settings,
                                          full_wire="bfloat16"))
  assert half.bytes_per_worker() == 4096 * 2


def test_topk_capacity_is_the_target_count_without_headroom():
  # "topk" selects exactly k = ⌈ρ·n⌉: 10000 elements at 0.01 -> 100 slots
  # (the sampled estimators: ⌈0.01·10000·1.5⌉ = 150).
  params = [_sds((10000,), jnp.float32)]
  assert jaxfuse.plan(params, estimator="topk").leaves[0].capacity == 100
  assert jaxfuse.plan(params, estimator="dgc").leaves[0].capacity == 150


# The two-decimal densities whose binary value times a round n lands just
# above an integer (0.07 · 100 = 7.000000000000001 in float64).
TWO_DECIMAL_DENSITIES = (7, 14, 17, 27, 28, 34, 54, 55, 56, 67, 68, 81)


@pytest.mark.parametrize("percent", TWO_DECIMAL_DENSITIES)
def test_a_decimal_density_selects_what_it_says(percent):
  # ρ = percent/100 of n = 100 is exactly `percent` elements, and with
  # headroom 1.5 of n = 200 exactly 3·percent (capped at n); one more slot
  # per leaf is wire and selection the user did not ask for.
  density = percent / 100
  assert plan_lib.target_count(density, 100) == percent
  assert plan_lib.target_count(density, 1400) == 14 * percent
  assert plan_lib.capacity_for(density, 200, 1.5) == min(200, 3 * percent)
  assert plan_lib.capacity_for(density, 1400, 1.5) == min(1400, 21 * percent)
  # and just above an integer still rounds up: 0.07 · 101 = 7.07 -> 8
  assert plan_lib.target_count(density, 101) == percent + 1
  # every n up to 5000, in integer arithmetic: ⌈p·n/100⌉ and ⌈3·p·n/200⌉
  for n in range(1, 5001):
    assert plan_lib.target_count(density, n) == -(-percent * n // 100), n
    assert plan_lib.capacity_for(density, n, 1.5) == min(
        n, -(-3 * percent * n // 200)), n


def test_a_plan_at_a_decimal_density_has_the_decimal_capacity():
  params = [_sds((1400,), jnp.float32)]
  topk = jaxfuse.plan(params, density=0.07, estimator="topk",
                      settings=jaxfuse.Settings(min_sparse_size=1))
  dgc = jaxfuse.plan(params, density=0.07, estimator="dgc",
                     settings=jaxfuse.Settings(min_sparse_size=1))
  assert topk.leaves[0].capacity == 98       # 0.07 · 1400
  assert dgc.leaves[0].capacity == 147       # 0.07 · 1400 · 1.5


def test_a_bfloat16_wire_never_rounds_a_float16_gradient(mesh):
  # Settings.full_wire / sparse_wire = "bfloat16" take the narrower of the
  # gradient's dtype and bfloat16; float16 is no wider, so a float16
  # gradient keeps its own dtype (bfloat16 has 3 fewer mantissa bits).
  unit = plan_lib.Unit((0,), 4096, 41, 0.01, "topk", "float16")
  wide = dataclasses.replace(plan_lib.Settings(), full_wire="bfloat16",
                             sparse_wire="bfloat16")
  assert plan_lib.full_wire_dtype(unit, wide) == "float16"
  assert plan_lib.wire_unit(unit, wide).dtype == "float16"
  # A dense warm-up phase of a float16 leaf, every worker sending
  # 1 + 2**-8 (exact in float16, and so is every partial sum of up to 16
  # of them; bfloat16 rounds it to 1): the mean is 1 + 2**-8.
  plan = jaxfuse.with_density(jaxfuse.plan(
      [_sds((4096,), jnp.float16)], density=0.05,
      settings=jaxfuse.Settings(min_sparse_size=64)), 1.0)
  plan = dataclasses.replace(plan, settings=dataclasses.replace(
      plan.settings, full_wire="bfloat16"))
  value = np.float16(1 + 2**-8)
  grads = [np.full((K, 4096), value, np.float16)]
  synced, _ = sync(plan, mesh, grads, init(plan, mesh), fast_compile=True)
  np.testing.assert_array_equal(np.asarray(synced[0]),
                                np.full((4096,), value, np.float16))


def test_the_schemes_sizes_read_their_settings_as_decimals():
  # Each figure by hand; binary floats gave one more (99, 155, 9801) or one
  # less (28) on these values.
  from jaxfuse import sparsify  # pylint: disable=g-import-not-at-top
  from jaxfuse.collectives import spardl  # pylint: disable=g-import-not-at-top
  from jaxfuse.collectives import zen  # pylint: disable=g-import-not-at-top
  unit = plan_lib.Unit((0,), 200_000, 1400, 0.007, "dgc", "float32")
  lay = zen.layout([unit], 10, plan_lib.Settings(),
                   zen.Zen(table=1.1, union=0.07))
  assert lay.union == 98        # ⌈0.07 · 1400⌉
  assert lay.r1 == 154          # ⌈1.1 · 1400 / 10⌉
  assert spardl.block_capacity(10_000, 100, 2, 1, 0.58) == 29  # ⌊58 / 2⌋
  spec = sparsify.dgc_sample_spec(
      140_000, 0.01, plan_lib.Settings(
          estimation=plan_lib.Estimation(sample_fraction=0.07)))
  assert spec.size == 9800      # ⌈0.07 · 140000⌉
