"""SparDL: the paper's send schedule, conservation, replica identity, equality
with the lossless all-gather where nothing is dropped, wire bytes, teams."""

import math

from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import jax.numpy as jnp
import numpy as np
import pytest

import jaxfuse
from jaxfuse import plans as plan_lib
from jaxfuse.collectives import allgather
from jaxfuse.collectives import base
from jaxfuse.collectives import spardl

from _harness import all_eqns
from _harness import assert_replicas_identical
from _harness import init, list_plan, mesh_of, per_device, random_normal
from _harness import sync


# --- the send schedule --------------------------------------------------------

# Rank 0's bags, written from §III-B: B_1 = {1}, B_2 = {2, 3}, B_3 = {4, …},
# sent last bag first, bag B_j to the worker 2^{j−1} ahead (Example 1 and 2:
# 6 workers, bag {5, 6} of worker 1 goes 4 ahead, {3, 4} 2 ahead, {2} 1 ahead).
PAPER_RANK0 = {
    4: [(2, (2, 3)), (1, (1,))],
    6: [(4, (4, 5)), (2, (2, 3)), (1, (1,))],
    8: [(4, (4, 5, 6, 7)), (2, (2, 3)), (1, (1,))],
}


@pytest.mark.parametrize("k", sorted(PAPER_RANK0))
def test_rank0_schedule_is_the_papers(k):
  assert [rnd[0] for rnd in spardl.send_schedule(k)] == PAPER_RANK0[k]


@pytest.mark.parametrize("k", range(1, 10))
def test_schedule_reduces_scatters_on_any_k(k):
  """Every rank sends every other block once, in ⌈log₂k⌉ rounds, and only
  blocks its peer still holds (Theorem 1); each rank ends with its own."""
  rounds = spardl.send_schedule(k)
  assert len(rounds) == math.ceil(math.log2(k))
  held = [set(range(k)) for _ in range(k)]
  for rnd in rounds:
    assert sorted(peer for peer, _ in rnd) == list(range(k))  # a permutation
    for r, (peer, blocks) in enumerate(rnd):
      assert set(blocks) <= held[peer] and set(blocks) <= held[r]
    for r, (_, blocks) in enumerate(rnd):
      held[r] -= set(blocks)
  assert held == [{r} for r in range(k)]


# --- sync on meshes of any size -------------------------------------------------

def _capacity(n, c, k, teams=1):
  """m from the module's documented rule, rederived here."""
  g = k // teams
  m = min(-(-n // g), max(1, 2 * c // g))
  return teams * -(-m // teams)


def _conserved(plan, k, grads, old, synced, state):
  """K·ĝ + Σ_k r_k' = Σ_k (g_k + r_k) per unit, float64."""
  units, _ = plan_lib.units(plan)
  new = [np.asarray(r, np.float64).sum(0)
         for r in jaxfuse.unit_residuals(plan, state)]
  for u, unit in enumerate(units):
    g = np.concatenate([np.asarray(grads[j], np.float64).sum(0).ravel()
                        for j in unit.leaves])
    sent = np.concatenate([k * np.asarray(synced[j], np.float64).ravel()
                           for j in unit.leaves])
    np.testing.assert_allclose(sent + new[u], g + old[u], rtol=1e-5,
                               atol=1e-5 * (1 + np.abs(g).max()))


def _residual_sums(plan, state):
  return [np.asarray(r, np.float64).sum(0)
          for r in jaxfuse.unit_residuals(plan, state)]


def _random_steps(plan, mesh, k, shapes, seed, steps=2):
  """Yields each step's synced output for random gradients, after checking
  conservation and replica identity."""
  state = init(plan, mesh)
  key = jax.random.PRNGKey(seed)
  for _ in range(steps):
    key, sub = jax.random.split(key)
    grads = [random_normal(kk, (k,) + s)
             for kk, s in zip(jax.random.split(sub, len(shapes)), shapes)]
    old = _residual_sums(plan, state)
    synced, state = sync(plan, mesh, grads, state, fast_compile=True)
    _conserved(plan, k, grads, old, synced, state)
    assert_replicas_identical(synced)
    yield synced


def _shard(mesh, x):
  return jax.device_put(x, NamedSharding(mesh, P("data")))


# (K, T, shapes, also run the "allgather" plan: one compile more each)
@pytest.mark.parametrize("k,teams,shapes,vs_allgather", [
    (3, 1, [(600,)], False), (5, 1, [(600,)], False), (6, 1, [(600,)], False),
    (7, 1, [(600,)], False), (8, 1, [(20, 30), (500,)], True),
    (8, 4, [(600,)], False), (6, 3, [(600,)], True)])
def test_sync_conserves_is_identical_and_lossless_when_it_fits(
    k, teams, shapes, vs_allgather):
  mesh = mesh_of(k)
  plan = list_plan(shapes, density=0.05,
                   estimator="topk", strategy="single",
                   settings=jaxfuse.Settings(min_sparse_size=100),
                   collective=jaxfuse.collectives.SparDL(teams=teams))
  assert len(plan.buckets) == 1
  n = sum(math.prod(s) for s in shapes)
  c = sum(l.capacity for l in plan.leaves)
  # Random gradients: merges drop, residuals collect.
  for synced in _random_steps(plan, mesh, k, shapes, k + 10 * teams):
    nnz = sum(int(np.count_nonzero(np.asarray(x))) for x in synced)
    assert nnz <= k // teams * _capacity(n, c, k, teams), nnz

  # Integer gradients on a common support of ≤ m elements: every worker
  # sends all of it, no block overflows, sums are exact in any order, so
  # the result is the exact mean (the lossless all-gather's, bitwise) and
  # nothing is owed.
  support = np.random.default_rng(k).choice(n, 7, replace=False)
  flat = np.zeros((k, n), np.float32)
  flat[:, support] = np.random.default_rng(teams).integers(-4, 5, (k, 7))
  offs = np.cumsum([0] + [math.prod(s) for s in shapes])
  grads = [flat[:, a:b].reshape((k,) + s)
           for a, b, s in zip(offs[:-1], offs[1:], shapes)]
  got, state = sync(plan, mesh, grads, init(plan, mesh), fast_compile=True)
  for a, g in zip(got, grads):
    np.testing.assert_allclose(np.asarray(a), np.asarray(g).sum(0) / k,
                               rtol=1e-6)  # XLA may multiply by 1/K
  if vs_allgather:
    lossless = list_plan(shapes, density=0.05, collective="allgather",
                         estimator="topk",
                         strategy="single",
                         settings=jaxfuse.Settings(min_sparse_size=100))
    want, _ = sync(lossless, mesh, grads, init(lossless, mesh),
                   fast_compile=True)
    for a, b in zip(got, want):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert all(np.all(np.asarray(r) == 0) for r in state.residuals)

  # A NaN on one worker: non-finite everywhere, no residual poisoned.
  grads = [np.array(g) for g in grads]
  grads[0][1].flat[3] = np.nan
  got, state = sync(plan, mesh, grads, state, fast_compile=True)
  assert all(np.isnan(c).any() for c in per_device(got[0]))
  assert all(np.all(np.isfinite(np.asarray(r))) for r in state.residuals)


def test_bsag_conserves_on_a_bfloat16_wire():
  """Teams of a count that is no power of two (B-SAG): each merge hands
  back the rounding of its sums to the wire's bfloat16, split over the
  teams that hold the sum; K·ĝ + Σ_k r'_k = Σ_k acc_k still holds."""
  k, teams, shapes = 6, 3, [(600,)]
  mesh = mesh_of(k)
  plan = list_plan(shapes, density=0.3,
                   estimator="topk", strategy="single",
                   settings=jaxfuse.Settings(
                       min_sparse_size=100, sparse_wire="bfloat16"),
                   collective=jaxfuse.collectives.SparDL(teams=teams))
  for _ in _random_steps(plan, mesh, k, shapes, 5):
    pass


@settings(max_examples=4, deadline=None)
@given(k=st.sampled_from([3, 5, 7]),
       shapes=st.lists(st.sampled_from([(300,), (12, 50)]), min_size=1,
                       max_size=2),
       density=st.sampled_from([0.02, 0.1, 0.5]),
       seed=st.integers(0, 2**16))
def test_conservation_any_shape_density_k(k, shapes, density, seed):
  mesh = mesh_of(k)
  plan = list_plan(shapes, density=density, collective="spardl",
                   estimator="topk", strategy="single",
                   settings=jaxfuse.Settings(min_sparse_size=100))
  for _ in _random_steps(plan, mesh, k, shapes, seed):
    pass


# --- wire bytes -------------------------------------------------------------

UNITS = [plan_lib.Unit((0,), 10_000, 100, 0.01, "topk", "float32"),
         plan_lib.Unit((1,), 3_000, 30, 0.01, "topk", "float32")]


@pytest.mark.parametrize("k", range(2, 9))
def test_bytes_within_table_one_while_allgather_grows(k):
  s = plan_lib.Settings()
  c = sum(u.capacity for u in UNITS)
  bound = 4 * c * (4 + 4)  # 4·C (value, index) pairs
  got = base.wire(spardl.SparDL().steps(UNITS, k, s), k)
  assert got.received == got.sent <= bound
  ag = base.wire(allgather.AllGather().steps(UNITS, k, s), k)
  assert ag.received == (k - 1) * c * 8
  assert (ag.received > bound) == (k > 5)


def _wire_ops(jaxpr):
  """(primitive, bytes of its operand) of every collective, in order."""
  for e in all_eqns(jaxpr):
    if e.primitive.name in ("ppermute", "all_gather", "all_gather_invariant"):
      a = e.invars[0].aval
      yield ("allgather" if "gather" in e.primitive.name else "ppermute",
             a.size * a.dtype.itemsize)


@pytest.mark.parametrize("k,teams", [(8, 1), (7, 1), (8, 2), (6, 3), (8, 4)])
def test_steps_are_what_the_program_sends(k, teams):
  units = [plan_lib.Unit((0,), 1000, 40, 0.04, "topk", "float32"),
           plan_lib.Unit((1,), 300, 13, 0.04, "topk", "bfloat16")]
  s = plan_lib.Settings()
  mesh = mesh_of(k)

  def local(*xs):
    parts = [(xs[0][0], xs[1][0]), (xs[2][0], xs[3][0])]
    out = spardl.SparDL(teams=teams).sync(parts, units, "data", s)
    return out.means, [x[None] for x in out.kept]

  sh = NamedSharding(mesh, P("data"))
  args = [jax.ShapeDtypeStruct((k, u.capacity), d, sharding=sh)
          for u in units for d in (jnp.dtype(u.dtype), jnp.int32)]
  jaxpr = jax.make_jaxpr(jax.shard_map(
      local, mesh=mesh, in_specs=P("data"), out_specs=(P(), P("data"))))(
          *args)
  steps = spardl.SparDL(teams=teams).steps(units, k, s)
  assert list(_wire_ops(jaxpr.jaxpr)) == [tuple(x) for x in steps]
  rounds = math.ceil(math.log2(k // teams)) + math.ceil(math.log2(teams))
  assert len(steps) == rounds + 1


# --- teams that cannot be formed ------------------------------------------------

@pytest.mark.parametrize("k,teams,why", [(6, 4, "does not divide"),
                                         (8, 8, "teams of 1"),
                                         (7, 2, "does not divide")])
def test_teams_that_cannot_form_raise_naming_the_bucket(k, teams, why):
  s = plan_lib.Settings()
  with pytest.raises(base.SchemeError,
                     match=rf"bucket 3: .*{why}.*SparDL\(teams="):
    spardl.SparDL(teams=teams).check("bucket 3", k, s)
  with pytest.raises(base.SchemeError, match=(
      rf"^spardl bucket of leaves \[0, 1\]: SparDL\(teams={teams}\) .*{why}")):
    spardl.SparDL(teams=teams).steps(UNITS, k, s)
  spardl.SparDL().check("bucket 3", k, plan_lib.Settings())  # T = 1: any K
  spardl.SparDL(teams=2).check("bucket 3", 8, plan_lib.Settings())


def test_sparse_sync_refuses_teams_that_cannot_form():
  mesh = mesh_of(6)
  plan = list_plan([(600,)], density=0.05,
                   settings=jaxfuse.Settings(min_sparse_size=100),
                   collective=jaxfuse.collectives.SparDL(teams=4))
  # "bucket 0: …" from check_axes, or "spardl bucket of leaves [0]: …"
  with pytest.raises(base.SchemeError, match=r"bucket.*SparDL\(teams=4\)"):
    sync(plan, mesh, [np.ones((6, 600), np.float32)], init(plan, mesh))


def test_a_merges_drops_stay_on_the_worker_that_merged():
  """K = 2, one unit of 40 (blocks [0, 20) and [20, 40)), c = m = 4 slots.
  Worker 1 sends its block-0 slots to worker 0, which merges them with its
  own (index 3 summed: 3 + 1), keeps the top 4 by |v| and keeps what the
  cut drops (0.25 at index 5) in its own residual; worker 1 keeps nothing.
  Worked by hand from the module's steps, not from its code."""
  mesh = mesh_of(2)
  unit = plan_lib.Unit((0,), 40, 4, 0.1, "topk", "float32")
  values = np.array([[5.0, -0.5, 3.0, 1.0], [1.0, 0.25, -4.0, -1.5]],
                    np.float32)
  indices = np.array([[1, 2, 3, 25], [3, 5, 6, 30]], np.int32)

  def f(v, i):
    out = spardl.SparDL().sync([(v[0], i[0])], [unit], "data",
                               plan_lib.Settings())
    return out.means[0], out.kept[0][None]
  means, kept = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("data"),
                                      out_specs=(P(), P("data"))))(
      _shard(mesh, values), _shard(mesh, indices))
  want_mean = np.zeros(40)
  want_mean[[1, 2, 3, 6, 25, 30]] = [5.0, -0.5, 4.0, -4.0, 1.0, -1.5]
  np.testing.assert_array_equal(np.asarray(means, np.float64),
                                want_mean / 2)
  want_kept = np.zeros((2, 40))
  want_kept[0, 5] = 0.25
  np.testing.assert_array_equal(np.asarray(kept, np.float64), want_kept)
