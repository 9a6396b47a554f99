"""``jaxfuse.grouped``: a params-shaped tree in the all-gather decode's
layout, and ``onebit_adamw``'s m kept that way (no row copied out of the
decoded array, none stacked into the fused pass)."""

import dataclasses
import os
import re

from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxfuse
from jaxfuse.sync import bucket_steps
from jaxfuse.sync import grouped
from jaxfuse import kernels
from jaxfuse import plans as plan_lib

from _harness import CLASSIC_EMITTERS, list_plan, mesh_of, pass1_segments
from _harness import run_under_fusion_emitters, shard

ON_GPU = (os.environ.get("JAXFUSE_TEST_GPU") == "1"
          and jax.default_backend() == "gpu")
K = min(2, len(jax.devices()))   # one GPU: one worker
# a state group of 4 matrices, one of a 3-d leaf (both kept as rows), two
# leaves below min_sparse_size (a psum bucket: loose)
SHAPES = [(64, 64), (64, 64), (16, 256), (64, 64), (4, 8, 64), (32,), (8, 8)]


@settings(max_examples=15, deadline=None)
@given(shapes=st.lists(st.sampled_from([(64, 64), (16, 256), (300,), (32,),
                                        (4, 8, 16)]), min_size=1,
                       max_size=7),
       buckets=st.integers(1, 3), behind=st.booleans(),
       zen=st.booleans(), seed=st.integers(0, 2**16))
def test_group_then_ungroup_is_the_tree(shapes, buckets, behind, zen, seed):
  """Every leaf lands in exactly one place (a row of an all-gather state
  group, or loose) and comes back bit for bit; rows are the state groups'
  units in their order, a unit's leaves one after another."""
  plan = list_plan(shapes, density=0.05,
                   strategy="behind" if behind else "size",
                   bucket_bytes=buckets * 30000,
                   settings=jaxfuse.Settings(min_sparse_size=256))
  if zen:   # the first sparse bucket on another scheme: its leaves loose
    b = next((i for i, b in enumerate(plan.buckets)
              if b.collective != "psum"), None)
    if b is not None:
      plan = dataclasses.replace(plan, buckets=tuple(
          dataclasses.replace(x, collective="zen", scheme=None) if i == b
          else x
          for i, x in enumerate(plan.buckets)))
  lay = grouped.layout(bucket_steps.compile_plan(plan))
  rng = np.random.default_rng(seed)
  tree = [jnp.asarray(rng.normal(size=s), jnp.float32) for s in shapes]
  g = grouped.group(lay, tree)
  # expected from the plan itself: a unit of an all-gather bucket is row i
  # of state group s (plans.unit_rows), its leaves one after another
  all_units, per_bucket = jaxfuse.plans.units(plan)
  gathered = {u for b, ids in zip(plan.buckets, per_bucket)
              if b.collective == "allgather" for u in ids}
  unit_rows = jaxfuse.plans.unit_rows(plan)
  assert list(lay.group_ids) == sorted({unit_rows[u][0] for u in gathered})
  in_rows = set()
  for u in gathered:
    s, i = unit_rows[u]
    want = np.concatenate([np.asarray(tree[j]).reshape(-1)
                           for j in all_units[u].leaves])
    np.testing.assert_array_equal(
        np.asarray(g.rows[lay.group_ids.index(s)][i]), want)
    in_rows |= set(all_units[u].leaves)
  assert list(lay.loose) == [j for j in range(len(shapes))
                             if j not in in_rows]
  back = grouped.ungroup(lay, g, jax.tree.structure(tree))
  for a, b in zip(tree, back):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_another_layout_is_refused_with_both_shapes():
  lay = grouped.layout(bucket_steps.compile_plan(list_plan(
      SHAPES, density=0.05, strategy="single",
      settings=jaxfuse.Settings(min_sparse_size=256))))
  other = grouped.layout(bucket_steps.compile_plan(list_plan(
      SHAPES[:3], density=0.05, strategy="single",
      settings=jaxfuse.Settings(min_sparse_size=256))))
  g = grouped.group(other, [jnp.zeros(s) for s in SHAPES[:3]])
  with pytest.raises(jaxfuse.PlanError, match=r"rows \[\(3, 4096\)\] and 0 "
                     r"loose.*this plan lays it out as rows \[\(1, 2048\), "
                     r"\(4, 4096\)\] and 2 loose"):
    grouped.ungroup(lay, g, jax.tree.structure([0] * len(SHAPES)))
  with pytest.raises(jaxfuse.PlanError, match="expected a Grouped"):
    grouped.check(lay, [jnp.zeros(s) for s in SHAPES])
  with pytest.raises(jaxfuse.PlanError, match="the tree has 3 leaves"):
    grouped.group(lay, [jnp.zeros(s) for s in SHAPES[:3]])
  with pytest.raises(jaxfuse.PlanError, match=r"leaf \[2\] has shape "
                     r"\[256, 16\], the plan \[16, 256\]"):
    grouped.group(lay, [jnp.zeros(s[::-1]) for s in SHAPES])
  with pytest.raises(jaxfuse.PlanError, match="the tree has 3 leaves"):
    grouped.ungroup(lay, grouped.group(lay, [jnp.zeros(s) for s in SHAPES]),
                    jax.tree.structure([0] * 3))


def test_a_blend_cut_two_ways_forms_the_same_rows():
  """m and g cut into chunks of their own (or one a (G, n) array): the
  formed stream is β·m + (1 − β)·g row for row."""
  rng = np.random.default_rng(0)
  m, g = (jnp.asarray(rng.normal(size=(5, 40)), jnp.float32)
          for _ in range(2))
  want = np.asarray(0.9 * m + (1 - 0.9) * g)
  for mp, gp in (([m[:2], m[2:]], [g[:1], g[1:4], g[4]]),
                 (m, [g[i] for i in range(5)]), ([m[0], m[1:]], g)):
    got = kernels.formed(kernels.Blend(mp, gp, 0.9))
    got = np.concatenate([np.asarray(x).reshape(-1, 40) for x in got])
    np.testing.assert_array_equal(got, want)


def _onebit_steps(plan, backend, grads, dense_steps):
  """``onebit_adamw`` over the steps of ``grads`` (the first
  ``dense_steps`` on the density-1 phase): updates and states, on
  ``backend``."""
  mesh = mesh_of(K)
  params = [jnp.zeros(l.shape) for l in plan.leaves]
  opts = [jaxfuse.onebit_adamw(jaxfuse.with_density(plan, 1.0), 1e-3),
          jaxfuse.onebit_adamw(plan, 1e-3)]
  state = jaxfuse.init_state(opts[1], params, mesh)
  specs = jaxfuse.state_specs(state)
  kernels.set_backend(backend)
  out = []
  try:
    steps = [jax.jit(jax.shard_map(
        lambda g, s, o=o: o.update([x[0] for x in g], s, params), mesh=mesh,
        in_specs=(P("data"), specs), out_specs=(P(), specs),
        check_vma=ON_GPU)) for o in opts]
    for t, g in enumerate(grads):
      update, state = steps[t >= dense_steps](shard(mesh, g), state)
      out.append(jax.tree.map(np.asarray, (update, state)))
  finally:
    kernels.set_backend("auto")
  return out


def test_onebit_on_the_pallas_pass_is_the_reference_bit_for_bit(request):
  """The fused pass reads the Grouped m's rows where they are and forms
  1-bit Adam's stream itself: updates and states equal the XLA
  reference's, every step (one dense, three sparse). Under XLA's default
  emitters: the classic CPU ones round the in-kernel blend's last bit
  unlike the reference's in about 1 % of the elements."""
  if CLASSIC_EMITTERS:
    run_under_fusion_emitters(request)
    return
  plan = list_plan(SHAPES, density=0.05,
                   strategy="single",
                   settings=jaxfuse.Settings(min_sparse_size=256))
  assert [r.shape for r in grouped.group(grouped.layout(bucket_steps.compile_plan(plan)), [
      jnp.zeros(s) for s in SHAPES]).rows] == [(1, 2048), (4, 4096)]
  rng = np.random.default_rng(1)
  grads = [[rng.normal(size=(K,) + s).astype(np.float32) for s in SHAPES]
           for _ in range(4)]
  want = _onebit_steps(plan, "reference", grads, 1)
  got = _onebit_steps(plan, "pallas", grads, 1)
  assert all(np.abs(r).sum() > 0 for r in want[-1][1][0].mu.rows)
  for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
    np.testing.assert_array_equal(a, b)


@pytest.mark.skipif(ON_GPU, reason="reads the CPU compiler's HLO")
def test_onebit_keeps_the_decoded_rows_as_its_m():
  """The sparse step's new m is the all-gather decode's (G, n) array
  itself, and the fused pass reads m's rows as one operand: nothing
  stacks a group's rows (not m into the fused pass, not the synced mean
  into the state) or cuts m into rows for the pass."""
  plan = list_plan(SHAPES, density=0.05,
                   strategy="single",
                   settings=jaxfuse.Settings(min_sparse_size=256))
  mesh = mesh_of(K)
  params = [jnp.zeros(s) for s in SHAPES]
  opt = jaxfuse.onebit_adamw(plan, 1e-3)
  state = jaxfuse.init_state(opt, params, mesh)
  specs = jaxfuse.state_specs(state)
  assert grouped.layout(bucket_steps.compile_plan(plan)).loose == (5, 6)
  grads = shard(mesh, [np.ones((K,) + s, np.float32) for s in SHAPES])
  step = jax.shard_map(
      lambda g, s: opt.update([x[0] for x in g], s, params), mesh=mesh,
      in_specs=(P("data"), specs), out_specs=(P(), specs), check_vma=False)
  kernels.set_backend("pallas")
  try:
    with pass1_segments() as calls:
      hlo = jax.jit(step).lower(grads, state).compile().as_text()
  finally:
    kernels.set_backend("auto")
  # per state group pass 1 takes τ, m's rows as one operand, g's rows
  # apart, r (the 3-d leaf's too: its m is a row of its own group)
  assert sorted(seg for call in calls for seg in call) == [
      [(1,), (2048,), (2048,), (1, 2048)],
      [(4,), (4 * 4096,)] + [(4096,)] * 4 + [(4, 4096)]]
  stacks = re.findall(r"concatenate\S* = f32\[4,4096\]|"
                      r"= f32\[4,4096\]\S* concatenate\(", hlo)
  assert not stacks, stacks


def test_check_refuses_loose_leaves_of_another_plan():
  # (64, 64) sparse: one all-gather row of 4096; (32,) and (8, 8) below
  # min_sparse_size: a psum bucket, loose, in leaf order.
  plan = list_plan([(64, 64), (32,), (8, 8)], density=0.05, strategy="single",
                   settings=jaxfuse.Settings(min_sparse_size=256))
  lay = grouped.layout(bucket_steps.compile_plan(plan))
  assert lay.row_shapes == [(1, 4096)] and lay.loose == (1, 2)
  rows = (jnp.zeros((1, 4096)),)
  grouped.check(lay, grouped.Grouped(rows, (jnp.zeros(32), jnp.zeros((8, 8)))))
  for loose in ((jnp.zeros(32), jnp.zeros((8, 9))),    # another shape
                (jnp.zeros(32),),                        # one missing
                (jnp.zeros(32), jnp.zeros((8, 8)), jnp.zeros(3))):  # extra
    with pytest.raises(plan_lib.PlanError, match="loose leaves"):
      grouped.check(lay, grouped.Grouped(rows, loose))
