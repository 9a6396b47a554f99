"""Momentum correction's conservation, density warm-up phases, per-worker
state, and the errors that name the field (the recipes' equations:
test_recipes.py)."""

import dataclasses
import functools
import re

from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
import jax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxfuse
from jaxfuse import plans as plan_lib

from _harness import assert_replicas_identical
from _harness import init, list_plan, per_device, shard, sync
from _harness import NUM_WORKERS as K


# 2. Conservation with momentum correction -------------------------------------

@functools.lru_cache(maxsize=None)
def _momentum_sync_fn(plan_json, mesh, momentum, nesterov, mask_momentum):
  plan = jaxfuse.Plan.from_json(plan_json)
  tx = jaxfuse.sparse_sync(plan, momentum=momentum, nesterov=nesterov,
                           mask_momentum=mask_momentum)
  params = [jnp.zeros(l.shape, l.dtype) for l in plan.leaves]
  state = jaxfuse.init_state(tx, params, mesh)
  specs = jaxfuse.state_specs(state)
  fn = jax.jit(jax.shard_map(
      lambda g, s: tx.update([x[0] for x in g], s), mesh=mesh,
      in_specs=(P("data"), specs), out_specs=(P(), specs)))
  return fn, state


@settings(max_examples=4, deadline=None)
@given(shapes=st.lists(st.one_of(
    st.sampled_from([(32, 40), (1300,)]),
    st.tuples(st.integers(1, 40), st.integers(1, 70))), min_size=1, max_size=3),
       density=st.sampled_from([0.01, 0.05, 0.3]),
       momentum=st.sampled_from([0.5, 0.9]),
       nesterov=st.booleans(), mask_momentum=st.booleans(),
       strategy=st.sampled_from(["layerwise", "single", "aligned"]),
       estimator=st.sampled_from(["topk", "dgc", "gaussian", "redsync",
                                  "sidco"]),
       seed=st.integers(0, 2**16))
def test_momentum_conserves_what_workers_owe(mesh, shapes, density, momentum,
                                             nesterov, mask_momentum,
                                             strategy, estimator, seed):
  """Per unit: Σ_k (sent_k + v_k') = Σ_k (v_k + u_k'), u_k' = m·u_k + g_k
  before masking (Nesterov: u_k' = m·(u_k + g_k), and g_k is added too);
  u_k'' is u_k' with the sent slots zeroed (or kept: mask_momentum=False)."""
  plan = list_plan(shapes, density=density, strategy=strategy, num_buckets=2, estimator=estimator,
                   settings=jaxfuse.Settings(min_sparse_size=64))
  fn, state = _momentum_sync_fn(plan.to_json(), mesh, momentum, nesterov,
                                mask_momentum)
  units, _ = plan_lib.units(plan)
  rng = np.random.default_rng(seed)
  for _ in range(2):
    grads = [rng.normal(size=(K,) + tuple(s)).astype(np.float32)
             for s in shapes]
    u = [np.asarray(x, np.float64)
         for x in jaxfuse.unit_residuals(plan, state, velocity=True)]
    r = [np.asarray(x, np.float64) for x in jaxfuse.unit_residuals(plan, state)]
    synced, state = jax.block_until_ready(fn(shard(mesh, grads), state))
    for j, leaf in enumerate(plan.leaves):
      if leaf.mode == "dense":
        np.testing.assert_allclose(np.asarray(synced[j], np.float64) * K,
                                   grads[j].sum(0), rtol=1e-5, atol=1e-5)
    for i, unit in enumerate(units):
      (j,) = unit.leaves
      g = grads[j].reshape(K, -1).astype(np.float64)
      if nesterov:
        u_new = momentum * (u[i] + g)
        owed = r[i] + g + u_new
      else:
        u_new = momentum * u[i] + g
        owed = r[i] + u_new
      sent = K * np.asarray(synced[j], np.float64).ravel()
      r_new = np.asarray(jaxfuse.unit_residuals(plan, state)[i], np.float64)
      np.testing.assert_allclose(sent + r_new.sum(0), owed.sum(0), rtol=1e-5,
                                 atol=1e-5 * (1 + np.abs(owed).max()))
      # Sent slots are those the residual zeroed (acc is never 0 here).
      was_sent = r_new == 0
      assert was_sent.any(axis=1).all()
      want_u = np.where(was_sent, 0.0, u_new) if mask_momentum else u_new
      np.testing.assert_allclose(
          np.asarray(jaxfuse.unit_residuals(plan, state, velocity=True)[i]),
          want_u, rtol=1e-5, atol=1e-6)


# 4. Density warm-up: one state through every phase ----------------------------

def _bits(tree):
  return [(np.asarray(x).dtype, np.asarray(x).shape, np.asarray(x).tobytes())
          for x in jax.tree.leaves(tree)]


def test_warmup_phases_share_one_state_bitwise(mesh):
  shapes = [(40, 30), (7,), (300,)]
  plan = list_plan(shapes, density=0.05,
                   settings=jaxfuse.Settings(min_sparse_size=64))
  phases = jaxfuse.density_warmup(plan, steps=2, densities=[0.3],
                                  dense_steps=2)
  jaxfuse.check_phases(phases)
  assert [(p.start, p.stop) for p in phases] == [(0, 2), (2, 4), (4, None)]
  sparse = [j for j, l in enumerate(plan.leaves) if l.mode == "sparse"]
  assert sparse == [0, 2]
  for phase, density in zip(phases, [1.0, 0.3, 0.05]):
    assert [phase.plan.leaves[j].density for j in sparse] == [density] * 2
  assert [jaxfuse.phase_index(phases, t) for t in range(7)] == [
      0, 0, 1, 1, 2, 2, 2]
  capacities = {tuple(p.plan.leaves[j].capacity for j in sparse)
                for p in phases}
  assert len(capacities) == 3  # every phase has its own static shapes

  params = [jnp.zeros(s, jnp.float32) for s in shapes]
  state = jaxfuse.init_state(jaxfuse.sparse_sync(phases[0].plan, momentum=0.9),
                             params, mesh)
  specs = jaxfuse.state_specs(state)
  types = jax.tree.map(jax.typeof, state)
  pmean = jax.jit(jax.shard_map(lambda g: [lax.pmean(x[0], "data") for x in g],
                                mesh=mesh, in_specs=P("data"), out_specs=P()))
  rng = np.random.default_rng(0)
  traces = [[] for _ in phases]
  step, current = None, None
  for t in range(7):
    i = jaxfuse.phase_index(phases, t)
    if i != current:
      current = i
      tx = jaxfuse.sparse_sync(phases[i].plan, momentum=0.9)

      def local(g, s, tx=tx, i=i):
        traces[i].append(1)
        synced, new = tx.update([x[0] for x in g], s)
        return synced, new, s   # s: what this step received

      step = jax.jit(jax.shard_map(local, mesh=mesh,
                                   in_specs=(P("data"), specs),
                                   out_specs=(P(), specs, specs)))
    grads_np = [rng.normal(size=(K,) + s).astype(np.float32) for s in shapes]
    grads = shard(mesh, grads_np)
    owes = lambda tree, velocity=False: [
        np.asarray(x, np.float64) for x in jaxfuse.unit_residuals(
            phases[i].plan, tree, velocity=velocity)]
    r_prev, u_prev = owes(state), owes(state, velocity=True)
    synced, new, received = jax.block_until_ready(step(grads, state))
    assert _bits(received) == _bits(state), f"step {t}: state changed"
    assert jax.tree.map(jax.typeof, new) == types
    assert int(np.asarray(new.step)[0]) == t + 1
    if i == 0:  # density 1: exactly dense training
      assert _bits(synced) == _bits(pmean(grads))
      for x in new.residuals + new.velocity:
        np.testing.assert_array_equal(np.asarray(x), 0)
    else:
      assert all(np.asarray(x).any() for x in new.residuals)
      selected = np.asarray(new.stats.selected)
      for j in sparse:
        assert (selected[:, j] <= phases[i].plan.leaves[j].capacity).all()
        assert (selected[:, j] > 0).all()
      # what the workers owe carries over the switch: Σ_k (r_k + u_k') =
      # K·ĝ + Σ_k r_k', r and u from the state the last phase left
      for u, unit in enumerate(plan_lib.units(phases[i].plan)[0]):
        (j,) = unit.leaves
        owed = r_prev[u] + 0.9 * u_prev[u] + grads_np[j].reshape(K, -1)
        sent = K * np.asarray(synced[j], np.float64).ravel()
        np.testing.assert_allclose(
            sent + owes(new)[u].sum(0), owed.sum(0), rtol=1e-5,
            atol=1e-5 * (1 + np.abs(owed).max()), err_msg=f"step {t}")
    state = new
  assert [len(x) for x in traces] == [1, 1, 1]


@pytest.mark.parametrize("estimator,refresh", [
    ("gaussian", 10), ("dgc", 10), ("gaussian", 1)])
def test_a_phase_of_another_density_retunes_the_threshold(mesh, estimator,
                                                           refresh):
  """25 % for 6 steps, then 6.25 % (k = ⌈0.0625·20000⌉ = 1250, capacity
  ⌈1.5·1250⌉ = 1875) off a refresh step: the new phase's first step
  estimates τ for its own k: no worker passes more than the capacity, and
  the workers pass k/4 or more on average (the τ kept from 25 % passes
  about a quarter of the 20000 elements, past the capacity; a fresh
  estimate is rougher than the controller's range: DGC's reads 256
  samples). The controller, left at
  its converged step ±1e-3, starts again from its initial +0.1 (a
  step of +0.1, or −0.05 where it reverses at once)."""
  n = 20000
  plan = list_plan([(n,)], density=0.0625, estimator=estimator, strategy="single",
                   settings=jaxfuse.Settings(
                       estimation=jaxfuse.Estimation(refresh=refresh)))
  assert (plan.leaves[0].mode, plan.leaves[0].capacity) == ("sparse", 1875)
  phases = jaxfuse.density_warmup(plan, steps=6, densities=[0.25])
  assert [(p.start, p.stop) for p in phases] == [(0, 6), (6, None)]
  state = init(plan, mesh)
  rng = np.random.default_rng(0)
  for t in range(7):
    if t == 6:   # as if the 25 % phase had converged
      state = state._replace(control=state.control._replace(
          log_step=jnp.full_like(state.control.log_step, 1e-3),
          flag=jnp.ones_like(state.control.flag)))
    grads = [rng.normal(size=(K, n)).astype(np.float32)]
    phase = phases[jaxfuse.phase_index(phases, t)]
    _, state = jax.block_until_ready(sync(phase.plan, mesh, grads, state))
  candidates = np.asarray(state.stats.candidates)[:, 0]
  assert (candidates <= 1875).all() and candidates.mean() >= 313, candidates
  np.testing.assert_array_equal(np.asarray(state.control.target)[:, 0], 1250)
  steps = np.asarray(state.control.log_step)[:, 0]
  assert np.isin(steps, np.float32([0.1, -0.05])).all(), steps


# 5. Errors that name the field ------------------------------------------------

def _small_plan(min_sparse_size=64, **kwargs):
  return list_plan([(40, 30), (100,), (7,)], **dict(
      dict(density=0.05,
           settings=jaxfuse.Settings(min_sparse_size=min_sparse_size)),
      **kwargs))


@pytest.mark.parametrize("kwargs,field", [
    (dict(momentum=1.0), "momentum"),
    (dict(momentum=-0.1), "momentum"),
    (dict(momentum=True), "momentum"),
    (dict(residual_decay=0), "residual_decay"),
    (dict(residual_decay=1.5), "residual_decay"),
    (dict(nesterov=True), "nesterov"),
    (dict(nesterov=1, momentum=0.9), "nesterov"),
])
def test_sparse_sync_rejects_bad_options(kwargs, field):
  with pytest.raises(jaxfuse.SyncError, match=field):
    jaxfuse.sparse_sync(_small_plan(), **kwargs)


@pytest.mark.parametrize("name,value,interval", [
    ("momentum", 1.0, "[0, 1)"), ("momentum", -0.1, "[0, 1)"),
    ("momentum", float("nan"), "[0, 1)"), ("momentum", "0.9", "[0, 1)"),
    ("residual_decay", 0, "(0, 1]"), ("residual_decay", 1.5, "(0, 1]"),
    ("residual_decay", np.ones(2), "(0, 1]"),
])
def test_sparse_sync_names_the_rate_and_its_range(name, value, interval):
  with pytest.raises(jaxfuse.SyncError, match=re.escape(
      f"sparse_sync: {name}={value!r} must be in {interval}.")):
    jaxfuse.sparse_sync(_small_plan(), **{name: value})
  if name == "momentum":   # the ends the range keeps
    jaxfuse.sparse_sync(_small_plan(), momentum=0.0)
  else:
    jaxfuse.sparse_sync(_small_plan(), residual_decay=1.0)


@pytest.mark.parametrize("name", sorted(jaxfuse.RECIPES))
def test_recipes_reject_unknown_options(name):
  plan = _small_plan()
  jaxfuse.RECIPES[name](plan, 0.1, clip_norm=1.0)  # the known ones work
  with pytest.raises(TypeError, match="momentun"):
    jaxfuse.RECIPES[name](plan, 0.1, momentun=0.9)


@pytest.mark.parametrize("name", sorted(jaxfuse.RECIPES))
@pytest.mark.parametrize("clip_norm", [0.0, -1.0])
def test_recipes_reject_bad_clip_norm(name, clip_norm):
  with pytest.raises(jaxfuse.SyncError, match="clip_norm"):
    jaxfuse.RECIPES[name](_small_plan(), 0.1, clip_norm=clip_norm)


def test_recipes_reject_bad_momenta():
  plan = _small_plan()
  # named by the recipe and the argument the user gave (demo's momentum
  # is its residual decay, whose range it keeps)
  with pytest.raises(jaxfuse.SyncError, match=r"^sgd: momentum=1.0 must "
                     r"be in \[0, 1\)"):
    jaxfuse.sgd(plan, 0.1, momentum=1.0)
  with pytest.raises(jaxfuse.SyncError, match=r"^demo: momentum=0.0 must "
                     r"be in \(0, 1\]"):
    jaxfuse.demo(plan, 0.1, momentum=0.0)
  with pytest.raises(jaxfuse.SyncError, match=r"^onebit_adamw: b1=1.0"):
    jaxfuse.onebit_adamw(plan, 0.1, b1=1.0)


def test_check_phases_names_the_phase_and_field():
  plan = _small_plan()
  half = jaxfuse.with_density(plan, 0.5)
  jaxfuse.check_phases([jaxfuse.Phase(0, 5, half),
                        jaxfuse.Phase(5, None, plan)])
  other_model = list_plan([(40, 31), (100,), (7,)], density=0.05,
                          settings=jaxfuse.Settings(min_sparse_size=64))
  all_dense = _small_plan(min_sparse_size=2000)
  others = [other_model, all_dense] + [_small_plan(strategy=s) for s in
                                       ("single", "behind")]
  for other in others:
    with pytest.raises(jaxfuse.PlanError, match=r"phases\[1\]\.plan"):
      jaxfuse.check_phases([jaxfuse.Phase(0, 5, half),
                            jaxfuse.Phase(5, None, other)])
  with pytest.raises(jaxfuse.PlanError, match=r"phases\[1\]\.start=6"):
    jaxfuse.check_phases([jaxfuse.Phase(0, 5, half),
                          jaxfuse.Phase(6, None, plan)])
  with pytest.raises(jaxfuse.PlanError, match=r"phases\[0\]\.start=1"):
    jaxfuse.check_phases([jaxfuse.Phase(1, None, plan)])
  with pytest.raises(jaxfuse.PlanError, match=r"phases\[0\]\.stop=None"):
    jaxfuse.check_phases([jaxfuse.Phase(0, None, half),
                          jaxfuse.Phase(5, None, plan)])
  with pytest.raises(jaxfuse.PlanError, match="empty"):
    jaxfuse.check_phases([])


@pytest.mark.parametrize("workers,wire,folded", [
    (1, "gradient", []),                 # nothing on the wire
    (2, "gradient", []),                 # K·ρ·headroom = 0.75 < 1
    (2, "bfloat16", [0.25]),             # 0.75 >= 0.5: bf16 halves dense
    (4, "gradient", [0.25]),             # 1.5 >= 1; 0.0625: 0.375 < 1
    (8, "bfloat16", [0.25, 0.0625]),     # 0.75 >= 0.5; 0.015625: 0.19
])
def test_density_warmup_runs_dense_where_sparse_moves_more(workers, wire,
                                                            folded):
  """On K workers an all-gather at density ρ (value and index, 8 bytes a
  slot, headroom 1.5) receives (K−1)·8·1.5·ρ·n bytes; the ring all-reduce
  2(K−1)/K·(4 or 2)·n. Where the first is not smaller the warm-up density
  runs dense, on the dense wire, and the dense phase grows by its steps."""
  plan = list_plan([(1 << 20,)], density=0.01,
                   settings=jaxfuse.Settings(min_sparse_size=64))
  phases = jaxfuse.density_warmup(plan, steps=10, dense_steps=5,
                                  dense_wire=wire, workers=workers)
  dense = 5 + 10 * len(folded)
  ramp = [d for d in jaxfuse.optim.phases.DGC_RAMP if d > 0.01 and d not in folded]
  assert [(p.start, p.stop) for p in phases] == (
      [(0, dense)] + [(dense + 10 * i, dense + 10 * (i + 1))
                      for i in range(len(ramp))]
      + [(dense + 10 * len(ramp), None)])
  assert [p.plan.leaves[0].density for p in phases] == [1.0, *ramp, 0.01]
  assert phases[0].plan.settings.full_wire == wire
  assert all(p.plan.settings.full_wire == "gradient" for p in phases[1:])
  with pytest.raises(jaxfuse.PlanError, match="num_workers=0"):
    jaxfuse.density_warmup(plan, steps=10, num_workers=0)
  with pytest.raises(jaxfuse.PlanError, match="workers=0"):
    jaxfuse.density_warmup(plan, steps=10, workers=0)


@pytest.mark.parametrize("final,ramp", [
    (0.001, [0.25, 0.0625, 0.015625, 0.004]),   # DGC's whole ramp
    (0.01, [0.25, 0.0625, 0.015625]),           # only those above ρ
    (0.1, [0.25]),
    (0.25, []),                                 # none above: no warm-up
])
def test_density_warmup_default_ramp_is_dgcs(final, ramp):
  """Without densities= the ramp is DGC's warm-up (Lin et al. 2018:
  sparsity 75 %, 93.75 %, 98.4375 %, 99.6 %), the densities above the
  plan's, each for ``steps``, and the plan after."""
  plan = list_plan([(1 << 12,)], density=final,
                   settings=jaxfuse.Settings(min_sparse_size=64))
  phases = jaxfuse.density_warmup(plan, steps=3)
  assert [p.plan.leaves[0].density for p in phases] == [*ramp, final]
  assert [(p.start, p.stop) for p in phases] == (
      [(3 * i, 3 * i + 3) for i in range(len(ramp))] + [(3 * len(ramp), None)])
  assert phases[-1].plan is plan


@pytest.mark.parametrize("wire,sparse", [
    ("bfloat16", []), ("gradient", [0.0625, 0.015625])])
def test_density_warmup_counts_hier_buckets_on_both_axes(wire, sparse):
  """A "hier" bucket of n = 2²⁰ float32 on a (2 hosts, 4 local) mesh
  receives, per worker, its local reduce-scatter and all-gather, 2·(3/4)·
  4 MiB = 6 291 456 bytes, plus the other host's shard of c_s = min(n/4,
  ⌈1.5·ρ·n⌉) slots of 8 bytes: 8 388 608 at ρ = 0.25, 7 077 888 at
  0.0625, 6 488 064 at 0.015625. The dense phase receives 2·(7/8)·n
  words: 3 670 016 bytes in bfloat16 (every density runs dense) and
  7 340 032 in float32 (only 0.25 does). Counted as an all-gather on 8
  workers, (7·8·c) bytes, 0.015625 would have looked cheaper than
  bfloat16's dense (1 376 256), so num_workers alone is refused."""
  plan = list_plan([(1 << 20,)], density=0.01, collective="hier",
                   strategy="single")
  assert plan.buckets[0].collective == "hier"
  ramp = [0.25, 0.0625, 0.015625]
  phases = jaxfuse.density_warmup(plan, steps=10, densities=ramp,
                                  dense_wire=wire, workers=(2, 4))
  dense = 10 * (len(ramp) - len(sparse))
  assert [(p.start, p.stop, p.plan.leaves[0].density) for p in phases] == (
      [(0, dense, 1.0)] + [(dense + 10 * i, dense + 10 * (i + 1), d)
                           for i, d in enumerate(sparse)]
      + [(30, None, 0.01)])
  assert jaxfuse.density_warmup(plan, steps=10, densities=ramp,
                                dense_wire=wire, mesh_sizes=[2, 4],
                                num_workers=8) == phases
  with pytest.raises(jaxfuse.PlanError, match=r"give workers=\(hosts"):
    jaxfuse.density_warmup(plan, steps=10, workers=8)
  with pytest.raises(jaxfuse.PlanError, match=r"give workers=\(hosts"):
    jaxfuse.density_warmup(plan, steps=10, num_workers=8)
  with pytest.raises(jaxfuse.PlanError, match="num_workers=4 is not the 8"):
    jaxfuse.density_warmup(plan, steps=10, num_workers=4, mesh_sizes=(2, 4))
  for bad in ((2,), (2, 0), 8, (2.0, 4)):
    with pytest.raises(jaxfuse.PlanError, match="mesh_sizes="):
      jaxfuse.density_warmup(plan, steps=10, mesh_sizes=bad)
  for bad in ((2,), (2, 0), (2.0, 4), "8"):
    with pytest.raises(jaxfuse.PlanError, match="workers="):
      jaxfuse.density_warmup(plan, steps=10, workers=bad)
  # one worker moves nothing: every density as given
  alone = jaxfuse.density_warmup(plan, steps=10, densities=ramp,
                                 workers=1)
  assert [p.plan.leaves[0].density for p in alone] == ramp + [0.01]


def test_density_warmup_takes_a_step_count_per_density():
  """steps=[...]: each density its own length (a ramp that holds 0.05 for
  longer before the plan's 0.01); folded densities add their own count."""
  plan = list_plan([(1 << 20,)], density=0.01,
                   settings=jaxfuse.Settings(min_sparse_size=64))
  phases = jaxfuse.density_warmup(plan, densities=[0.25, 0.05],
                                  steps=[10, 30], dense_steps=5)
  assert [(p.start, p.stop) for p in phases] == [(0, 5), (5, 15), (15, 45),
                                                  (45, None)]
  assert [p.plan.leaves[0].density for p in phases] == [1.0, 0.25, 0.05, 0.01]
  # on 4 workers 0.25 moves more than dense: its 10 steps join the dense 5
  folded = jaxfuse.density_warmup(plan, densities=[0.25, 0.05],
                                  steps=[10, 30], dense_steps=5,
                                  workers=4)
  assert [(p.start, p.stop) for p in folded] == [(0, 15), (15, 45),
                                                  (45, None)]
  for bad in ([10], [10, 0], (10, 2.5), "10"):
    with pytest.raises(jaxfuse.PlanError, match="one integer >= 1 per"):
      jaxfuse.density_warmup(plan, densities=[0.25, 0.05], steps=bad)
  with pytest.raises(jaxfuse.PlanError, match="one integer >= 1 per"):
    jaxfuse.density_warmup(plan, steps=[10, 30])   # no densities to pair


@pytest.mark.parametrize("kwargs,field", [
    (dict(steps=-1), "steps=-1"),
    (dict(steps=1.5), "steps=1.5"),
    (dict(steps=10, dense_steps=-2), "dense_steps=-2"),
    (dict(steps=0, densities=[0.5]), "steps=0"),
])
def test_density_warmup_rejects_bad_steps(kwargs, field):
  with pytest.raises(jaxfuse.PlanError, match=field):
    jaxfuse.density_warmup(_small_plan(), **kwargs)


@pytest.mark.parametrize("estimator", ["dgc", "topk"])
@pytest.mark.parametrize("strategy", ["aligned", "behind"])
def test_with_density_sets_every_sparse_units_capacity(strategy, estimator):
  # per leaf (sparsify ahead) and per bucket (behind: one unit of the
  # bucket's leaves): c = capacity(ρ', n), the same as a plan made at ρ'
  plan = _small_plan(strategy=strategy, estimator=estimator)
  half = jaxfuse.with_density(plan, 0.3)
  made = _small_plan(strategy=strategy, estimator=estimator, density=0.3)
  units = plan_lib.units(half)[0]
  assert units == plan_lib.units(made)[0]
  for unit in units:
    assert unit.density == 0.3
    assert unit.capacity == plan_lib.capacity(0.3, unit.size, estimator,
                                              plan.settings.headroom)
  assert sum(u.capacity for u in units) > sum(
      u.capacity for u in plan_lib.units(plan)[0])


@pytest.mark.parametrize("density", [0, -0.5, 1.5, True])
def test_with_density_rejects_out_of_range(density):
  with pytest.raises(jaxfuse.PlanError, match="density"):
    jaxfuse.with_density(_small_plan(), density)


# 6. per_worker ----------------------------------------------------------------

def test_per_worker_state_is_sharded_and_params_stay_identical(mesh):
  shapes = {"b": (7,), "w": (40, 30)}
  plan = jaxfuse.plan({n: jax.ShapeDtypeStruct(s, jnp.float32)
                       for n, s in shapes.items()}, density=0.05,
                      settings=jaxfuse.Settings(min_sparse_size=64))
  b1, b2 = 0.8, 0.9
  opt = optax.chain(jaxfuse.per_worker(optax.scale_by_adam(b1, b2)),
                    jaxfuse.sparse_sync(plan), optax.adam(1e-2))
  rng = np.random.default_rng(0)
  params0 = {n: rng.normal(size=s).astype(np.float32)
             for n, s in shapes.items()}
  params = jax.device_put(params0, NamedSharding(mesh, P()))
  state = jaxfuse.init_state(opt, params, mesh)
  specs = jaxfuse.state_specs(state)
  worker, sync, replicated = specs
  assert isinstance(worker, jaxfuse.PerWorkerState)
  assert jax.tree.leaves(worker) and all(
      s == P("data") for s in jax.tree.leaves(worker))
  assert all(s == P("data") for s in jax.tree.leaves(sync))
  assert jax.tree.leaves(replicated) and all(
      s == P() for s in jax.tree.leaves(replicated))
  inner = state[0].inner  # ScaleByAdamState, a leading worker axis
  assert inner.count.shape == (K,)
  assert inner.mu["w"].shape == (K, 40, 30)
  assert state[2][0].mu["w"].shape == (40, 30)

  def local(params, state, grads):
    updates, state = opt.update(jax.tree.map(lambda g: g[0], grads), state,
                                params)
    return optax.apply_updates(params, updates), state
  step = jax.jit(jax.shard_map(local, mesh=mesh,
                               in_specs=(P(), specs, P("data")),
                               out_specs=(P(), specs)))
  mu = {n: np.zeros((K,) + s) for n, s in shapes.items()}
  nu = {n: np.zeros((K,) + s) for n, s in shapes.items()}
  for _ in range(3):
    grads = {n: rng.normal(size=(K,) + s).astype(np.float32)
             for n, s in shapes.items()}
    for n in shapes:
      mu[n] = b1 * mu[n] + (1 - b1) * grads[n]
      nu[n] = b2 * nu[n] + (1 - b2) * grads[n].astype(np.float64) ** 2
    params, state = jax.block_until_ready(step(params, state,
                                               shard(mesh, grads)))
  inner = state[0].inner
  for n in shapes:
    shards = [np.asarray(s.data) for s in sorted(
        inner.mu[n].addressable_shards, key=lambda s: s.index[0].start)]
    assert len(shards) == K and shards[0].shape == (1,) + shapes[n]
    for k, s in enumerate(shards):  # worker k's moments of its own gradients
      np.testing.assert_allclose(s[0], mu[n][k], rtol=1e-5, atol=1e-6)
    if K > 1:   # differ per worker
      assert not np.allclose(shards[0], shards[1])
    np.testing.assert_allclose(np.asarray(inner.nu[n]), nu[n], rtol=1e-5,
                               atol=1e-7)
  np.testing.assert_array_equal(np.asarray(inner.count), 3)
  assert_replicas_identical(params.values(), K)
  for n, leaf in params.items():
    assert not np.allclose(per_device(leaf)[0], params0[n])  # it trained


def test_plan_mixing_density_one_and_sparse_buckets_keeps_its_state(mesh):
  """A hand-edited plan with one density-1 bucket among sparse ones: the
  threshold state keeps one entry per unit, and the density-1 leaf is the
  exact worker mean."""
  base = list_plan([(40, 30), (300,)], density=0.05,
                   strategy="layerwise",
                   settings=jaxfuse.Settings(min_sparse_size=64))
  for full in (0, 1):
    leaves = list(base.leaves)
    leaves[full] = dataclasses.replace(leaves[full], density=1.0,
                                       capacity=leaves[full].size)
    plan = jaxfuse.Plan(tuple(leaves), base.buckets, base.settings,
                        base.provenance)
    unit = [u for u, x in enumerate(plan_lib.units(plan)[0])
            if x.leaves == (full,)][0]
    state = init(plan, mesh)
    rng = np.random.default_rng(full)
    for _ in range(2):
      grads = [rng.standard_normal((K, 40, 30)).astype(np.float32),
               rng.standard_normal((K, 300)).astype(np.float32)]
      synced, new = sync(plan, mesh, grads, state)
      assert jax.tree.map(np.shape, new.control) == jax.tree.map(
          np.shape, state.control)
      np.testing.assert_allclose(np.asarray(synced[full]),
                                 grads[full].mean(0), rtol=1e-5, atol=1e-6)
      assert np.all(np.asarray(jaxfuse.unit_residuals(plan, new)[unit]) == 0)
      assert np.any(np.asarray(jaxfuse.unit_residuals(plan, new)[1 - unit]))
      state = new


def test_density_warmup_on_a_plan_with_no_sparse_leaves():
  """An all-dense plan (e.g. ``auto`` on CPU) has no density to ramp from:
  the README recipe's densities=(0.0625,) are dropped with a warning that
  says so, and the phases are the dense steps, then the plan (it used to
  stop with 'densities [0.0625] must each be in (1, 1]')."""
  plan = list_plan([(1 << 12,)], density=0.05,
                   settings=jaxfuse.Settings(min_sparse_size=1 << 20))
  assert all(l.mode == "dense" for l in plan.leaves)
  with pytest.warns(UserWarning, match="no sparse leaves") as record:
    phases = jaxfuse.density_warmup(plan, dense_steps=5, steps=3,
                                    densities=(0.0625,),
                                    dense_wire="bfloat16", workers=8)
  assert "strategy='size'" in str(record[0].message)
  assert [(p.start, p.stop) for p in phases] == [(0, 5), (5, None)]
  assert phases[0].plan.settings.full_wire == "bfloat16"
  assert phases[-1].plan is plan
  # no dense steps: one phase, the plan itself
  with pytest.warns(UserWarning, match="no sparse leaves"):
    only = jaxfuse.density_warmup(plan, steps=3, densities=[0.25])
  assert [(p.start, p.stop, p.plan) for p in only] == [(0, None, plan)]


def test_wire_warnings_name_a_sparse_phase_that_moves_more_than_dense():
  """An all-gather at ρ = 0.25 on 8 workers receives 7·8·c bytes (c =
  the leaf's slots, about 1.5·ρ·n), the float32 ring all-reduce of n =
  2²⁰ elements 2·(7/8)·4·n = 7 340 032: the plan's own phase is named,
  with both counts and the fix. On 2 workers at ρ = 0.01 (7·... < dense)
  nothing is said."""
  plan = list_plan([(1 << 20,)], density=0.25,
                   settings=jaxfuse.Settings(min_sparse_size=64))
  slots = plan.leaves[0].capacity
  assert slots >= 1.5 * 0.25 * (1 << 20)
  with pytest.warns(UserWarning, match="phase 0") as record:
    phases = jaxfuse.density_warmup(plan, steps=0, workers=8)
  message = str(record[0].message)
  assert f"{7 * 8 * slots:,} bytes" in message
  assert "7,340,032" in message and "collective='zen'" in message
  assert jaxfuse.optim.phases.wire_warnings(phases, 8) == [message]
  # a bfloat16 dense warm-up halves the dense bytes the phase is held to
  with pytest.warns(UserWarning, match="phase 1") as record:
    jaxfuse.density_warmup(plan, steps=0, dense_steps=4,
                           dense_wire="bfloat16", workers=8)
  assert "3,670,016" in str(record[0].message)
  cheap = list_plan([(1 << 20,)], density=0.01,
                    settings=jaxfuse.Settings(min_sparse_size=64))
  import warnings as warnings_lib
  with warnings_lib.catch_warnings():
    warnings_lib.simplefilter("error")
    assert jaxfuse.optim.phases.wire_warnings(
        jaxfuse.density_warmup(cheap, steps=0, workers=2), 2) == []


def test_density_warmup_old_worker_arguments_warn_and_agree():
  """0.2's num_workers= / mesh_sizes= still work until 0.4, with a
  DeprecationWarning naming workers=."""
  plan = list_plan([(1 << 20,)], density=0.01,
                   settings=jaxfuse.Settings(min_sparse_size=64))
  with pytest.warns(DeprecationWarning, match="workers="):
    old = jaxfuse.density_warmup(plan, steps=10, num_workers=4)
  assert old == jaxfuse.density_warmup(plan, steps=10, workers=4)
  with pytest.raises(jaxfuse.PlanError, match="give workers= only"):
    jaxfuse.density_warmup(plan, steps=10, workers=4, num_workers=4)
  with pytest.raises(TypeError, match="num_worker"):
    jaxfuse.density_warmup(plan, steps=10, num_worker=4)
