"""The plan compiled once (``jaxfuse.bucket_steps``): every leaf placed exactly
once, contiguously inside its unit, buckets of the kind their units make,
in the plan's order; warm-up phases compile to the same layout."""

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

SHAPES = {"a": (30, 20), "b": (20,), "c": (64, 8), "d": (5,), "e": (48, 48)}


def _plan(strategy, sparse_wire="gradient", **kw):
  return jaxfuse.plan({n: jax.ShapeDtypeStruct(s, jnp.float32)
                       for n, s in SHAPES.items()}, density=0.05,
                      strategy=strategy, **kw,
                      settings=jaxfuse.Settings(min_sparse_size=64,
                                                sparse_wire=sparse_wire))


@pytest.mark.parametrize("strategy", ["layerwise", "single", "aligned",
                                      "size", "behind"])
def test_every_leaf_placed_once_in_its_unit(strategy):
  plan = _plan(strategy, **({"bucket_bytes": 4096}
                            if strategy in ("size", "behind") else {}))
  sched = bucket_steps.compile_plan(plan)
  assert [b.index for b in sched.buckets] == list(range(len(plan.buckets)))
  placed = []
  for b, bucket in zip(sched.buckets, plan.buckets):
    assert b.collective == bucket.collective
    assert b.leaves == tuple(bucket.leaves)
    if bucket.collective == "psum":
      assert b.kind == bucket_steps.PSUM and b.units == () and b.groups == ()
      placed += list(bucket.leaves)
      continue
    assert b.kind == bucket_steps.SPARSE
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
  sparse = bucket_steps.compile_plan(plan)
  dense = bucket_steps.compile_plan(jaxfuse.with_density(plan, 1.0))
  for s, d in zip(sparse.buckets, dense.buckets):
    assert (s.units, s.groups, s.placement) == (d.units, d.groups,
                                                d.placement)
    assert d.kind == (bucket_steps.PSUM if s.kind == bucket_steps.PSUM
                      else bucket_steps.FULL)
  assert sparse.groups == dense.groups
  assert sparse.group_dtypes == dense.group_dtypes == tuple(
      "float32" for _ in sparse.groups)
  assert len(plan_lib.units(plan)[0]) == len(sparse.units)


# Worked by hand: leaves a (600), b (20), c (512), d (5), e (2304) in
# pytree order; no loss, so ready order is reverse pytree: e, d, c, b, a.
# b and d are below min_sparse_size (dense). Capacity ⌈0.05·n·1.5⌉: e 173,
# c 39, a 45; c and a concatenated ("behind") ⌈0.05·1112·1.5⌉ = 84. "size"
# closes a bucket once it reaches 4096 bytes: e (9216 B) alone, then c and
# a (2048 + 2400 B). Units of one bucket share a state group only if they
# have the same size, and none do here.
HAND = {
    "single": dict(units=[((4,), 2304, 173), ((2,), 512, 39), ((0,), 600, 45)],
                   bucket_units=[(0, 1, 2), ()],
                   placement=[((0, ((4, 0),)), (1, ((2, 0),)), (2, ((0, 0),))),
                              ()]),
    "size": dict(units=[((4,), 2304, 173), ((2,), 512, 39), ((0,), 600, 45)],
                 bucket_units=[(0,), (1, 2), ()],
                 placement=[((0, ((4, 0),)),),
                            ((1, ((2, 0),)), (2, ((0, 0),))), ()]),
    "behind": dict(units=[((4,), 2304, 173), ((2, 0), 1112, 84)],
                   bucket_units=[(0,), (1,), ()],
                   placement=[((0, ((4, 0),)),), ((1, ((2, 0), (0, 512))),),
                              ()]),
}


@pytest.mark.parametrize("strategy", sorted(HAND))
def test_the_schedule_of_a_hand_worked_plan(strategy):
  plan = _plan(strategy, **({"bucket_bytes": 4096}
                            if strategy in ("size", "behind") else {}))
  sched = bucket_steps.compile_plan(plan)
  want = HAND[strategy]
  assert [(u.leaves, u.size, u.capacity) for u in sched.units] == \
      want["units"]
  assert [b.units for b in sched.buckets] == want["bucket_units"]
  assert [b.placement for b in sched.buckets] == want["placement"]
  num_units = len(want["units"])
  assert sched.groups == tuple((u,) for u in range(num_units))
  assert sched.group_of_unit == tuple(range(num_units))
  assert [b.kind for b in sched.buckets] == [bucket_steps.SPARSE] * (
      len(sched.buckets) - 1) + [bucket_steps.PSUM]
  assert sched.buckets[-1].leaves == (3, 1)


# --- a bucket is one pmean only when every unit has density 1 -----------------

def _mixed_plan():
  # One all-gather bucket of two 4096-element "topk" units: a at density 1
  # (all 4096 slots), b at 0.05 (⌈0.05·4096⌉ = 205 slots), e.g. a plan
  # file edited by hand.
  leaf = lambda path, density, capacity: plan_lib.LeafPlan(
      path, (4096,), "float32", "sparse", density, capacity, "topk")
  return plan_lib.Plan((leaf("[0]", 1.0, 4096), leaf("[1]", 0.05, 205)),
                       (plan_lib.BucketPlan((0, 1), "allgather"),))


def test_a_bucket_with_one_sparse_unit_is_not_full():
  plan = _mixed_plan()
  (step,) = bucket_steps.compile_plan(plan).buckets
  assert step.kind == bucket_steps.SPARSE
  full = jaxfuse.with_density(plan, 1.0)
  assert bucket_steps.compile_plan(full).buckets[0].kind == bucket_steps.FULL


def test_the_sparse_unit_of_such_a_bucket_sends_at_most_its_slots(mesh):
  # Every worker sends the same gradients: a's mean is a itself; b, at
  # "topk" capacity 205, sends its 205 largest magnitudes (all distinct:
  # 1 … 4096 scaled), so 205 entries of the mean are non-zero and equal
  # b's, the rest stays in the residual.
  plan = _mixed_plan()
  a = (np.arange(4096, dtype=np.float32) - 2048) / 1024   # sums exact
  b = np.arange(1, 4097, dtype=np.float32) / 4096
  grads = [np.broadcast_to(a, (K, 4096)), np.broadcast_to(b, (K, 4096))]
  synced, _ = sync(plan, mesh, grads, init(plan, mesh), fast_compile=True)
  np.testing.assert_array_equal(np.asarray(synced[0]), a)
  out = np.asarray(synced[1])
  assert np.count_nonzero(out) == 205
  np.testing.assert_array_equal(out[-205:], b[-205:])


def test_a_leaf_of_another_name_is_named_in_the_difference():
  # Same shapes, dtypes and modes, other paths: the message names both.
  a = jaxfuse.plan({"a": jax.ShapeDtypeStruct((64,), jnp.float32)})
  b = jaxfuse.plan({"b": jax.ShapeDtypeStruct((64,), jnp.float32)})
  assert bucket_steps.layout_difference(a, b) == (
      "leaves (['a']: float32 [64] dense, against ['b']: float32 [64] dense)")
  assert bucket_steps.layout_difference(a, a) is None


def test_layout_ignores_the_wire_dtypes_and_counts_leaves():
  """The state holds no wire dtype: plans that differ only in
  ``sparse_wire`` or ``full_wire`` share one layout (and digest); plans
  of other leaf counts differ in their "leaves"."""
  plan = _plan("size", bucket_bytes=4096)
  for field in ("sparse_wire", "full_wire"):
    wired = dataclasses.replace(plan, settings=dataclasses.replace(
        plan.settings, **{field: "bfloat16"}))
    assert wired != plan
    assert bucket_steps.layout_difference(plan, wired) is None
    assert bucket_steps.layout_digest(plan) == bucket_steps.layout_digest(wired)
  fewer = jaxfuse.plan({n: jax.ShapeDtypeStruct(s, jnp.float32)
                        for n, s in SHAPES.items() if n != "d"},
                       density=0.05, strategy="size", bucket_bytes=4096,
                       settings=jaxfuse.Settings(min_sparse_size=64))
  assert bucket_steps.layout_difference(plan, fewer) == "leaves"
  assert bucket_steps.digest_difference(bucket_steps.layout_digest(plan),
                                    bucket_steps.layout_digest(fewer)) == "leaves"


def test_layout_digest_equal_for_numbers_equal_under_eq():
  """2 and 2.0, numpy and Python numbers, hash alike; 2.5 does not."""
  plan = _plan("single")
  def headroom(h):
    return bucket_steps.layout_digest(dataclasses.replace(
        plan, settings=dataclasses.replace(plan.settings, headroom=h)))
  assert headroom(2) == headroom(2.0) == headroom(np.float32(2.0))
  assert headroom(np.int64(2)) == headroom(2)
  assert headroom(2.5) == headroom(np.float64(2.5)) != headroom(2)


def test_old_spellings_warn_and_give_the_same():
  """0.2's spellings work until 0.4, each with a DeprecationWarning naming
  the new one: ``jaxfuse.schedule``, and a Plan where the compiled plan is
  now taken (``collectives.bucket_wire`` / ``bucket_steps`` /
  ``bytes_sent``, ``grouped.layout``)."""
  import importlib  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  sys.modules.pop("jaxfuse.schedule", None)
  with pytest.warns(DeprecationWarning,
                    match=r"jaxfuse\.schedule moved to jaxfuse\.sync\.bucket_steps"):
    old = importlib.import_module("jaxfuse.schedule")
  assert old.compile_plan is bucket_steps.compile_plan
  plan = _plan("aligned", collective="zen")
  sched = bucket_steps.compile_plan(plan)
  for name, args in (("bucket_wire", (K,)), ("bucket_steps", (K,)),
                     ("bytes_sent", (K,))):
    fn = getattr(jaxfuse.collectives, name)
    with pytest.warns(DeprecationWarning,
                      match=f"collectives.{name}.*compile_plan"):
      got = fn(plan, *args)
    assert got == fn(sched, *args)
  assert jaxfuse.collectives.bucket_wire(None, K, sched=sched) == (
      jaxfuse.collectives.bucket_wire(sched, K))
  with pytest.warns(DeprecationWarning, match="grouped.layout.*compile_plan"):
    lay = jaxfuse.grouped.layout(plan)
  assert lay == jaxfuse.grouped.layout(sched)
  assert lay.paths == tuple(l.path for l in plan.leaves)


def test_a_bucket_step_carries_what_its_stages_read():
  """Each bucket's step holds its units (as selected and as they travel),
  its groups' unit ids and dtypes, its leaves' shapes and the settings:
  the same as the schedule's tables, so nothing below the transform needs
  the plan."""
  plan = _plan("size", bucket_bytes=4000, sparse_wire="bfloat16")
  sched = bucket_steps.compile_plan(plan)
  assert len(sched.buckets) > 1
  for b in sched.buckets:
    assert b.settings == plan.settings
    assert b.unit_specs == tuple(sched.units[u] for u in b.units)
    assert b.wire_specs == tuple(sched.wire_units[u] for u in b.units)
    assert b.group_units == tuple(sched.groups[g] for g in b.groups)
    assert b.group_dtypes == tuple(sched.group_dtypes[g] for g in b.groups)
    assert dict(b.leaf_shapes) == {j: plan.leaves[j].shape
                                   for j in b.leaves}
    if b.kind == bucket_steps.SPARSE:
      assert sorted(u for batch in b.batches for u in batch.units) == sorted(
          b.units)
      assert {w.dtype for w in b.wire_specs} == {"bfloat16"}
    else:
      assert b.batches == ()


def test_a_recipe_compiles_its_plan_once(monkeypatch):
  """``onebit_adamw`` and the ``sparse_sync`` inside it read one compile of
  the plan; an equal but new plan object is compiled afresh."""
  calls = []
  compile_ = bucket_steps._compile  # pylint: disable=protected-access
  monkeypatch.setattr(bucket_steps, "_compile",
                      lambda p: calls.append(p) or compile_(p))
  plan = _plan("aligned")
  jaxfuse.onebit_adamw(plan, 1e-3)
  assert calls == [plan]
  assert bucket_steps.compile_plan(plan) is bucket_steps.compile_plan(plan)
  assert len(calls) == 1
  again = _plan("aligned")
  assert bucket_steps.compile_plan(again) == bucket_steps.compile_plan(plan)
  assert len(calls) == 2
