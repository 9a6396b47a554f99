"""``jaxfuse.relayout``: a state carried from one plan to another of the
same leaves keeps what every worker owes, leaf by leaf."""

from hypothesis import given, settings
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxfuse
from jaxfuse.sync import grouped
from jaxfuse.sync import bucket_steps
from jaxfuse import sparsify

from _harness import NUM_WORKERS as K
from _harness import shard, sharded_update

# Two leaves of one shape (a swap would go unseen by the shapes), one of
# another, and a dense bias.
PARAMS = {"a": jnp.ones((32, 48)), "b": jnp.ones((32, 48)),
          "c": jnp.ones((40, 40)), "bias": jnp.ones(16)}


def _plans():
  old = jaxfuse.plan(PARAMS, density=0.05, strategy="aligned", num_buckets=3,
                     estimator="dgc")
  # one concatenated unit per bucket, in the other ready order
  behind = jaxfuse.plan(PARAMS, density=0.05, strategy="behind",
                        bucket_bytes=16 * 1024, estimator="dgc",
                        order=[3, 2, 1, 0])
  # per-leaf units again, in the other order
  reordered = jaxfuse.plan(PARAMS, density=0.05, strategy="single",
                           estimator="dgc",
                           order=[3, 2, 1, 0])
  return old, behind, reordered


def _grads(seed):
  keys = jax.random.split(jax.random.key(seed), len(PARAMS))
  return {name: jax.random.normal(k, (K,) + x.shape)
          for k, (name, x) in zip(keys, sorted(PARAMS.items()))}


def _step(tx, mesh, state):
  return jax.jit(sharded_update(tx, mesh, jaxfuse.state_specs(state)))


def _onebit_step(tx, mesh, state, seed):
  step = jax.jit(sharded_update(tx, mesh, jaxfuse.state_specs(state),
                                with_params=True))
  return step(shard(mesh, _grads(seed)), state, PARAMS)[1]


def _trained(plan, mesh, momentum):
  tx = jaxfuse.sparse_sync(plan, momentum=momentum)
  state = jaxfuse.init_state(tx, PARAMS, mesh)
  step = _step(tx, mesh, state)
  for seed in range(3):
    _, state = step(shard(mesh, _grads(seed)), state)
    jax.block_until_ready(state)
  return state


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_a_dense_step_after_relayout_sends_what_the_old_plan_owed(
    mesh, momentum):
  # A density-1 step sends everything owed, (1/K)·Σ_k (x_k + r_k) per
  # element: through the old plan, or through the new one after relayout,
  # the same numbers leave.
  old, behind, reordered = _plans()
  state = _trained(old, mesh, momentum)
  assert all(np.abs(np.asarray(r)).max() > 0 for r in state.residuals)
  grads = shard(mesh, _grads(7))
  full = lambda plan, s: _step(
      jaxfuse.sparse_sync(jaxfuse.with_density(plan, 1.0), momentum=momentum),
      mesh, s)(grads, s)[0]
  want = full(old, state)
  for new in (behind, reordered):
    moved = jaxfuse.relayout(state, old, new)
    assert moved.layout == jaxfuse.init_state(
        jaxfuse.sparse_sync(new, momentum=momentum), PARAMS, mesh).layout
    assert all(r.sharding.spec[0] == "data" for r in moved.residuals)
    got = full(new, moved)
    for name in PARAMS:
      np.testing.assert_allclose(np.asarray(got[name]),
                                 np.asarray(want[name]), rtol=1e-6,
                                 atol=1e-7, err_msg=name)
    # and the sparse step runs on it
    _, after = _step(jaxfuse.sparse_sync(new, momentum=momentum), mesh,
                     moved)(grads, moved)
    assert np.asarray(after.step).tolist() == [4] * K


def test_thresholds_are_kept_for_the_same_units_only(mesh):
  old, behind, reordered = _plans()
  state = _trained(old, mesh, 0.0)
  old_units = bucket_steps.compile_plan(old).units
  before = np.asarray(state.control.threshold)
  assert (before > 0).all()
  moved = jaxfuse.relayout(state, old, reordered)
  after = np.asarray(moved.control.threshold)
  for u, unit in enumerate(bucket_steps.compile_plan(reordered).units):
    (o,) = [i for i, v in enumerate(old_units) if v.leaves == unit.leaves]
    np.testing.assert_array_equal(after[:, u], before[:, o])
  # to another density: kept too, with the k it was tuned for, so the
  # next step sees a unit of another k, estimates τ afresh and restarts
  # the controller's step (test_momentum_and_phases)
  denser = jaxfuse.with_density(reordered, 0.2)
  moved = jaxfuse.relayout(state, old, denser)
  for u, unit in enumerate(bucket_steps.compile_plan(denser).units):
    (o,) = [i for i, v in enumerate(old_units) if v.leaves == unit.leaves]
    for field in ("threshold", "log_scale", "log_step", "target"):
      np.testing.assert_array_equal(
          np.asarray(getattr(moved.control, field))[:, u],
          np.asarray(getattr(state.control, field))[:, o])
    tuned = -(-unit.size * 5 // 100)     # ⌈0.05·n⌉ in integers
    assert (np.asarray(moved.control.target)[:, u] == tuned).all()
    assert -(-unit.size * 2 // 10) != tuned
  # behind: each unit joins several leaves, none is an old unit; topk:
  # the old units with another estimator
  topk = jaxfuse.plan(PARAMS, density=0.05, strategy="aligned",
                      num_buckets=3, estimator="topk")
  fresh = sparsify.initial_control(1)
  for new in (behind, topk):
    moved = jaxfuse.relayout(state, old, new)
    for field, start in zip(moved.control, fresh):
      np.testing.assert_array_equal(
          np.asarray(field), np.broadcast_to(np.asarray(start[0]),
                                             field.shape))


def test_onebit_moments_move_and_clip_norms_restart(mesh):
  old, behind, _ = _plans()
  make = lambda plan: jaxfuse.onebit_adamw(plan, 1e-3, clip_norm=1.0)
  phases = {0: jaxfuse.with_density(old, 1.0), 1: old}
  state = jaxfuse.init_state(make(old), PARAMS, mesh)
  for seed, phase in enumerate((0, 1, 1)):
    state = _onebit_step(make(phases[phase]), mesh, state, seed)
    jax.block_until_ready(state)
  moved = jaxfuse.relayout(state, old, behind)
  want = jaxfuse.first_moment(state, old)
  got = jaxfuse.first_moment(moved, behind)
  for name in PARAMS:
    np.testing.assert_array_equal(np.asarray(got[name]),
                                  np.asarray(want[name]))
    assert np.abs(np.asarray(want[name])).max() > 0
  (one, _), (moved_one, _) = state, moved   # (OnebitState, the rest)
  for x, y in zip(jax.tree.leaves(one.nu), jax.tree.leaves(moved_one.nu)):
    assert x is y
  norms = moved_one.clip.inner.norms
  assert np.asarray(one.clip.inner.norms).any()
  assert norms.shape == (K, len(behind.buckets))
  assert not np.asarray(norms).any()
  after = _onebit_step(make(behind), mesh, moved, 9)
  assert int(np.asarray(after[0].count)) == 4


def test_onebit_first_moment_moves_leaf_by_leaf(mesh):
  old, behind, _ = _plans()
  make = lambda plan: jaxfuse.onebit_adamw(plan, 1e-3, clip_norm=1.0)
  state = jaxfuse.init_state(make(jaxfuse.with_density(old, 1.0)), PARAMS,
                             mesh)
  state = _onebit_step(make(jaxfuse.with_density(old, 1.0)), mesh, state, 0)
  one, rest = state
  # m := a known tree, leaf i's elements 1000·(i + 1) + position, so the
  # moved moment is checked against numbers fixed here, not read back
  # through the same ungroup that relayout uses
  names = sorted(PARAMS)
  known = {n: (1000.0 * (i + 1) + np.arange(PARAMS[n].size,
                                            dtype=np.float32)
               ).reshape(PARAMS[n].shape) for i, n in enumerate(names)}
  mu = grouped.group(grouped.layout(old), known)
  mu = jax.tree.map(lambda new, was: jax.device_put(new, was.sharding),
                    mu, one.mu)
  state = (one._replace(mu=mu), rest)
  moved = jaxfuse.relayout(state, old, behind)
  got = jaxfuse.first_moment(moved, behind)
  for n in names:
    np.testing.assert_array_equal(np.asarray(got[n]), known[n], err_msg=n)


def test_resuming_a_checkpoint_with_a_new_plan(tmp_path, mesh):
  # The README's recipe: restore with the saved plan, then relayout.
  from jaxfuse.state import checkpoint  # pylint: disable=g-import-not-at-top
  old, behind, _ = _plans()
  state = _trained(old, mesh, 0.9)
  mngr = checkpoint.manager(tmp_path)
  checkpoint.save(mngr, 3, {"opt": state}, old)
  like = {"opt": jaxfuse.init_state(jaxfuse.sparse_sync(behind, momentum=0.9),
                                    PARAMS, mesh)}
  with pytest.raises(checkpoint.CheckpointError,
                     match=r"saved_plan\(manager\)\), then carry the state "
                     r"to this plan with jaxfuse.relayout"):
    checkpoint.restore(mngr, like, behind)
  saved = checkpoint.saved_plan(mngr)
  # the saved plan with a `like` of the new plan: its arrays would be
  # read as the new layout's
  with pytest.raises(checkpoint.CheckpointError, match="`like` was made for "
                     "a plan whose selection units differ from `plan`'s"):
    checkpoint.restore(mngr, like, saved)
  with pytest.raises(checkpoint.CheckpointError, match="checkpoint.save: the "
                     "state was made for a plan whose selection units "
                     "differ from `plan`'s.*Nothing was written"):
    checkpoint.save(mngr, 4, like, saved)
  assert mngr.all_steps() == [3]
  like = {"opt": jaxfuse.init_state(jaxfuse.sparse_sync(saved, momentum=0.9),
                                    PARAMS, mesh)}
  step, restored = checkpoint.restore(mngr, like, saved)
  got = jaxfuse.relayout(restored, saved, behind)["opt"]
  want = jaxfuse.relayout(state, old, behind)
  assert step == 3 and got.layout == want.layout
  for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_the_old_specs_name_the_plan_layout(mesh):
  # After relayout the old state's specs carry the old layout: shard_map's
  # structure error must say that a jaxfuse plan layout differs (not only
  # hashes), and the new state's specs step it.
  old, behind, _ = _plans()
  state = _trained(old, mesh, 0.0)
  moved = jaxfuse.relayout(state, old, behind)
  tx = jaxfuse.sparse_sync(behind)
  stale = jax.jit(sharded_update(tx, mesh, jaxfuse.state_specs(state)))
  with pytest.raises(ValueError, match=r"jaxfuse plan layout\(leaves="):
    stale(shard(mesh, _grads(4)), moved)
  _, after = _step(tx, mesh, moved)(shard(mesh, _grads(4)), moved)
  assert int(np.asarray(after.step)[0]) == 4
  # the digest is its plain tuple of hashes to ==, hash and a restored
  # state's structure (a serializer gives back a plain tuple)
  plain = tuple(moved.layout)
  assert type(plain) is tuple and moved.layout == plain
  assert hash(moved.layout) == hash(plain)
  assert (jax.tree.structure(moved._replace(layout=plain))
          == jax.tree.structure(moved))
  assert repr(moved.layout).startswith("jaxfuse plan layout(leaves=")


def _per_leaf(plan, state, velocity):
  """Each sparse leaf's (K, size) rows, read through unit_residuals."""
  out = {}
  rows = jaxfuse.unit_residuals(plan, state, velocity=velocity)
  for unit, row in zip(bucket_steps.compile_plan(plan).units, rows):
    start = 0
    for j in unit.leaves:
      size = plan.leaves[j].size
      out[j] = np.asarray(row[:, start:start + size])
      start += size
  return out


_PLAN_SHAPES = [(32, 40), (1280,), (16, 80), (64, 20), (7,)]


@settings(max_examples=30, deadline=None)
@given(data=st.data(),
       shapes=st.lists(st.sampled_from(_PLAN_SHAPES), min_size=2, max_size=5),
       strategies=st.tuples(*[st.sampled_from(
           ["aligned", "size", "behind", "single"])] * 2),
       momentum=st.booleans())
def test_relayout_keeps_every_leafs_rows_and_round_trips(
    mesh, data, shapes, strategies, momentum):
  params = [jnp.zeros(s, jnp.float32) for s in shapes]
  order = lambda: data.draw(st.permutations(range(len(shapes))))
  first, second = (jaxfuse.plan(params, density=0.05, strategy=s,
                                num_buckets=2, bucket_bytes=8 * 1024,
                                settings=jaxfuse.Settings(min_sparse_size=64),
                                order=order())
                   for s in strategies)
  tx = jaxfuse.sparse_sync(first, momentum=0.9 if momentum else 0.0)
  state = jaxfuse.init_state(tx, params, mesh)
  rng = np.random.default_rng(len(shapes))
  fill = lambda arrays: tuple(jax.device_put(
      rng.standard_normal(r.shape).astype(r.dtype), r.sharding)
                              for r in arrays)
  state = state._replace(residuals=fill(state.residuals),
                         velocity=fill(state.velocity))
  moved = jaxfuse.relayout(state, first, second)
  for velocity in ((False, True) if momentum else (False,)):
    want, got = (_per_leaf(first, state, velocity),
                 _per_leaf(second, moved, velocity))
    assert sorted(want) == sorted(got)
    for j in want:
      np.testing.assert_array_equal(got[j], want[j])
  back = jaxfuse.relayout(moved, second, first)
  assert back.layout == state.layout
  for x, y in zip(back.residuals + back.velocity,
                  state.residuals + state.velocity):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_what_relayout_refuses(mesh):
  old, behind, reordered = _plans()
  state = _trained(old, mesh, 0.0)
  wider = jaxfuse.plan(dict(PARAMS, c=jnp.ones((40, 41))), density=0.05)
  with pytest.raises(jaxfuse.PlanError, match=r"relayout: leaf 3 is \['c'\] "
                     r"float32 \[40, 40\] sparse in the old plan and \['c'\] "
                     r"float32 \[40, 41\] sparse in the new one"):
    jaxfuse.relayout(state, old, wider)
  # the same leaves, but a and b (1536 elements) fall below min_sparse_size
  split = jaxfuse.plan(PARAMS, density=0.05,
                       settings=jaxfuse.Settings(min_sparse_size=1600))
  with pytest.raises(jaxfuse.PlanError, match=r"relayout: leaf 0 is \['a'\] "
                     r"float32 \[32, 48\] sparse in the old plan and \['a'\] "
                     r"float32 \[32, 48\] dense in the new one; .* the same "
                     r"dense/sparse split \(the same min_sparse_size\)"):
    jaxfuse.relayout(state, old, split)
  more = jaxfuse.plan(dict(PARAMS, d=jnp.ones((40, 40))), density=0.05)
  with pytest.raises(jaxfuse.PlanError, match="relayout: the old plan has 4 "
                     "leaves, the new 5; make both from the same parameters"):
    jaxfuse.relayout(state, old, more)
  with pytest.raises(jaxfuse.PlanError, match="relayout: a sparse_sync state "
                     "in the tree was made for another plan than the old "
                     "one"):
    jaxfuse.relayout(state, behind, reordered)
  with pytest.raises(TypeError, match="relayout expects a jaxfuse.Plan"):
    jaxfuse.relayout(state, old, PARAMS)
  with pytest.raises(jaxfuse.PlanError, match="relayout: the tree holds no "
                     "sparse_sync state; pass the optimizer state"):
    jaxfuse.relayout(PARAMS, old, behind)


def test_first_moment_checks_the_plan(mesh):
  old, behind, _ = _plans()
  state = jaxfuse.init_state(jaxfuse.onebit_adamw(old, 1e-3), PARAMS, mesh)
  moved = jaxfuse.relayout(state, old, behind)
  with pytest.raises(jaxfuse.PlanError, match="first_moment: the state was "
                     "made for a plan whose selection units differ"):
    jaxfuse.first_moment(moved, old)
  assert sorted(jaxfuse.first_moment(moved, behind)) == sorted(PARAMS)


def test_plans_equal_under_eq_share_a_layout_digest(mesh):
  # 2 and 2.0, a numpy scalar and its float: equal plans, one state
  import dataclasses  # pylint: disable=g-import-not-at-top
  two, two_f = (jaxfuse.plan(PARAMS, density=0.05,
                             settings=jaxfuse.Settings(headroom=h))
                for h in (2, 2.0))
  assert two == two_f
  assert bucket_steps.layout_digest(two) == bucket_steps.layout_digest(two_f)
  numpy_seed = dataclasses.replace(two, settings=dataclasses.replace(
      two.settings, headroom=np.float64(2.0)))
  assert bucket_steps.layout_digest(numpy_seed) == bucket_steps.layout_digest(two)
  other = jaxfuse.plan(PARAMS, density=0.05,
                       settings=jaxfuse.Settings(headroom=2.5))
  assert bucket_steps.digest_difference(bucket_steps.layout_digest(other),
                                    bucket_steps.layout_digest(two)) == "settings"
  state = jaxfuse.init_state(jaxfuse.sparse_sync(two), PARAMS, mesh)
  grads = shard(mesh, _grads(0))
  _, after = _step(jaxfuse.sparse_sync(two_f), mesh, state)(grads, state)
  assert after.layout == state.layout
