"""``"hier"``: hosts × local devices on the 8 CPU devices (2 × 4 and 4 × 2).

One plan, three buckets: a 1024-element unit alone (c = 64, the shard
selection runs: c_s = C = 64 < S), two units of 600 + 501 elements at
density ½ (N = 1101 is padded to L·S; c_s = S, everything is sent) and a
dense leaf (psum over both axes). Each mesh is compiled once and fed
integer-valued gradients, so every sum is exact in float32 whatever the
order: the 2-level result must equal the flat ``"allgather"`` one bitwise.
"""

import functools

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxfuse
from jaxfuse import collectives
from jaxfuse import plans as plan_lib
from jaxfuse.collectives import hier

from _harness import assert_replicas_identical
from _harness import gathered_words

K, C0 = 8, 64
HIER = ("host", "local")
SHAPES = [(32, 32), (600,), (501,), (7,)]
SIZES = [int(np.prod(s)) for s in SHAPES]

pytestmark = pytest.mark.skipif(len(jax.devices()) < K,
                                reason="needs 8 devices")


def _plan(collective, inner="allgather", sparse_wire="gradient",
          packed_indices=False):
  mk = functools.partial(plan_lib.LeafPlan, dtype="float32")
  leaves = (mk("[0]", SHAPES[0], mode="sparse", density=C0 / SIZES[0],
               capacity=C0, estimator="topk"),
            mk("[1]", SHAPES[1], mode="sparse", density=0.5, capacity=300,
               estimator="topk"),
            mk("[2]", SHAPES[2], mode="sparse", density=0.5, capacity=251,
               estimator="topk"),
            mk("[3]", SHAPES[3], mode="dense", density=1.0, capacity=7,
               estimator=None))
  scheme = _scheme(collective, inner, packed_indices)
  buckets = (plan_lib.BucketPlan((0,), collective, scheme=scheme),
             plan_lib.BucketPlan((1, 2), collective, scheme=scheme),
             plan_lib.BucketPlan((3,), "psum"))
  return plan_lib.Plan(leaves, buckets, plan_lib.Settings(
      sparse_wire=sparse_wire))


def _scheme(collective, inner="allgather", packed_indices=False):
  """The scheme of ``collective`` (``"hier"`` over ``inner``), its
  all-gather packing indices where asked."""
  gather = collectives.AllGather(packed_indices=packed_indices)
  if collective == "hier":
    return collectives.Hier(inner=gather if inner == "allgather" else inner)
  return gather if collective == "allgather" else None


def _params():
  return [jnp.zeros(s, jnp.float32) for s in SHAPES]


def _runner(plan, mesh, axis):
  """(step, fresh state) for sparse_sync under shard_map over ``axis``."""
  tx = jaxfuse.sparse_sync(plan, axis_name=axis)
  state = jaxfuse.init_state(tx, _params(), mesh, axis)
  specs = jaxfuse.state_specs(state, axis)
  step = jax.jit(jax.shard_map(
      lambda g, s: tx.update([x[0] for x in g], s), mesh=mesh,
      in_specs=(P(axis), specs), out_specs=(P(), specs)))
  put = lambda g: jax.device_put(g, NamedSharding(mesh, P(axis)))
  return (lambda g, s: step(put(g), s)), state


def _big(rng, positions):
  """(K, 1024) small integers (|x| ≤ 3) plus, for worker k, distinct large
  ones (≥ 100) at ``positions[k]``: top-64 selects exactly those."""
  g = rng.integers(-3, 4, (K, SIZES[0])).astype(np.float32)
  for k, pos in enumerate(positions):
    g[k, pos] = rng.permutation(np.arange(100, 100 + C0)) * rng.choice(
        [-1, 1], C0)
  return g.reshape((K,) + SHAPES[0])


def _grads(rng, positions, integer=True):
  rest = [rng.integers(-8, 9, (K,) + s).astype(np.float32) if integer
          else rng.normal(size=(K,) + s).astype(np.float32)
          for s in SHAPES[1:]]
  return [_big(rng, positions)] + rest


# Spread: worker k's 64 at k + 16j, so any host's shard holds exactly 64
# (= c_s) of them on both meshes. Skewed: all in [0, 256), in shard 0 of
# either mesh, distinct within a host: a host's shard 0 has 128 or 256.
SPREAD = [k + 16 * np.arange(C0) for k in range(K)]
SKEWED = [k % 4 + 4 * np.arange(C0) for k in range(K)]


def _sync_run(plan, mesh, axis, feeds):
  """Per feed (a list of per-step grads, from a fresh state): per step
  (synced, residuals, state)."""
  step, state0 = _runner(plan, mesh, axis)
  out = []
  for grads in feeds:
    state, steps = state0, []
    for g in grads:
      synced, state = step(g, state)
      steps.append((synced, [np.asarray(r) for r in
                             jaxfuse.unit_residuals(plan, state)], state))
    out.append(steps)
  return out


@pytest.fixture(scope="module")
def feeds():
  rng = np.random.default_rng(0)
  out = [[_grads(rng, SPREAD), _grads(rng, SPREAD)],          # ample
         [_grads(rng, SKEWED), _grads(rng, SKEWED)],          # drops
         [_grads(rng, SPREAD, integer=False)],                # floats
         [_grads(rng, SPREAD)]]                               # NaN
  out[3][0][0][3, 0, 5] = np.nan  # worker 3, unit 0: a non-finite step
  return out


@pytest.fixture(scope="module")
def runs(feeds):
  meshes = {"flat": (jaxfuse.make_mesh(K), "data"),
            "2x4": (jaxfuse.make_mesh(K, local=4), HIER),
            "4x2": (jaxfuse.make_mesh(K, local=2), HIER)}
  out = {}
  for name, (mesh, axis) in meshes.items():
    plan = _plan("allgather" if name == "flat" else "hier")
    out[name] = _sync_run(plan, mesh, axis, feeds)
  return feeds, out


def _check_conservation(feed, run, flat_run, hosts):
  """K·ĝ + Σ_k r_k' = Σ_k (g_k + r_k) per unit and step, exactly; and,
  given the flat run, that the shard selection really dropped entries."""
  owed = [np.zeros((K, n), np.float32) for n in SIZES[:3]]  # Σ r_k so far
  for step, (grads, (synced, res, _)) in enumerate(zip(feed, run)):
    for u in range(3):
      total = (grads[u].reshape(K, -1) + owed[u]).sum(0)
      got = K * np.asarray(synced[u]).reshape(-1) + res[u].sum(0)
      np.testing.assert_array_equal(got, total, err_msg=f"unit {u}")
      owed[u] = res[u]
    if flat_run is None:
      continue
    flat, flat_res, _ = flat_run[step]
    # Only the local rank 0 of each host has nonzeros (shard 0), and it
    # sends c_s = 64 of its 128 or 256.
    assert np.count_nonzero(np.asarray(synced[0])) <= hosts * C0
    assert not np.array_equal(np.asarray(synced[0]), np.asarray(flat[0]))
    assert np.abs(res[0]).sum() > np.abs(flat_res[0]).sum()
    np.testing.assert_array_equal(np.asarray(synced[3]), np.asarray(flat[3]))


def _check_equal(run, flat_run):
  for (want, want_r, _), (got, got_r, _) in zip(flat_run, run):
    for w, g in zip(want + want_r, got + got_r):
      np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_make_mesh_2d():
  mesh = jaxfuse.make_mesh(local=4)
  assert mesh.axis_names == HIER and mesh.devices.shape == (2, 4)
  assert [d.id for d in mesh.devices.flat] == [d.id for d in jax.devices()]
  assert jaxfuse.make_mesh(4).axis_names == ("data",)
  with pytest.raises(ValueError, match="local=3"):
    jaxfuse.make_mesh(local=3)


@pytest.mark.parametrize("mesh_name", ["2x4", "4x2"])
def test_ample_capacity_equals_flat_bitwise(runs, mesh_name):
  """Nothing dropped: ĝ and the residuals are the flat scheme's, bitwise
  (integer gradients: every sum is exact in any order); 2 steps."""
  _, out = runs
  _check_equal(out[mesh_name][0], out["flat"][0])
  # The shard selection ran (c_s = 64 < S) and the mean is really sparse.
  assert np.count_nonzero(np.asarray(out[mesh_name][0][-1][0][0])) == K * C0


@pytest.mark.parametrize("mesh_name", ["2x4", "4x2"])
def test_float_gradients_equal_flat_to_rounding(runs, mesh_name):
  """Float gradients: only the summation order differs (a host's sum
  first); |Δ| ≤ K·ε·max Σ_k |sent_k|."""
  feeds, out = runs
  (want, _, _), = out["flat"][2]
  (got, _, _), = out[mesh_name][2]
  bound = K * np.finfo(np.float32).eps * max(np.abs(g).sum(0).max()
                                             for g in feeds[2][0])
  for w, g in zip(want, got):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=0,
                               atol=bound)


@pytest.mark.parametrize("mesh_name", ["2x4", "4x2"])
def test_conservation_when_the_shard_selection_drops(runs, mesh_name):
  feeds, out = runs
  _check_conservation(feeds[1], out[mesh_name][1], out["flat"][1],
                      K // int(mesh_name[-1]))


@pytest.mark.parametrize("inner", ["spardl", "zen"])
def test_inner_scheme_over_the_host_axis(feeds, runs, inner):
  """Hier(inner=spardl / zen) on 2 × 4: the host-axis scheme's own kept
  joins the shard's, conservation stays exact (both feeds); SparDL is
  lossless here, so ample equals flat bitwise (ZEN's pull slots,
  Zen's union·c_s, may keep some: its means are not compared)."""
  _, out = runs
  run = _sync_run(_plan("hier", inner), jaxfuse.make_mesh(K, local=4), HIER,
                  feeds[:2])
  if inner == "spardl":
    _check_equal(run[0], out["flat"][0])
  _check_conservation(feeds[0], run[0], None, 2)
  _check_conservation(feeds[1], run[1], out["flat"][1], 2)


@pytest.mark.parametrize("mesh_name", ["2x4", "4x2"])
def test_nonfinite_step_stays_visible_and_residuals_finite(runs, mesh_name):
  """A NaN gradient makes ĝ NaN where the flat scheme's is (its slot goes
  first in the shard selection); no NaN reaches a residual."""
  _, out = runs
  ((want, _, _),), ((got, res, _),) = out["flat"][3], out[mesh_name][3]
  assert np.isnan(np.asarray(want[0])).any()
  for w, g in zip(want, got):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
  assert all(np.isfinite(r).all() for r in res)


def test_replicas_bitwise_identical(runs):
  _, out = runs
  for name in ("2x4", "4x2"):
    for feed in out[name]:
      for synced, _, _ in feed:
        assert_replicas_identical(synced, K)


def test_wire_bytes(runs):
  """Per worker: host all_gather of c_s slots on H, the dense local
  reduce-scatter + all_gather (a ring all-reduce) on L, psum on K."""
  _, out = runs
  def ring(x, n):
    return -(-2 * (n - 1) * x // n)
  for name, local in (("2x4", 4), ("4x2", 2)):
    hosts = K // local
    want = ring(7 * 4, K)
    for n, c in ((SIZES[0], C0), (SIZES[1] + SIZES[2], 551)):
      s = -(-n // local)
      want += (hosts - 1) * 8 * min(s, c) + ring(4 * s * local, local)
    stats = out[name][0][0][2].stats
    assert (np.asarray(stats.wire_bytes) == want).all(), name
  assert collectives.get("hier").steps(
      [plan_lib.units(_plan("hier"))[0][0]], 2, plan_lib.Settings()) == (
          collectives.base.Step("allgather", 8 * C0),)


def test_bfloat16_sparse_wire_is_exact_on_small_integers(feeds, runs):
  """Every value, partial sum and mean of the ample feed is an integer
  below 256 (or one over K): exact in bfloat16, so with
  ``sparse_wire="bfloat16"`` ĝ and the residuals equal the float32 run's
  bitwise, on fewer bytes: 6 per host slot (bfloat16 value, int32 index),
  and the local ring in float32 one way, bfloat16 the other."""
  _, out = runs
  mesh = jaxfuse.make_mesh(K, local=4)
  (run,) = _sync_run(_plan("hier", sparse_wire="bfloat16"), mesh, HIER,
                     feeds[:1])
  _check_equal(run, out["flat"][0])
  hosts, local = 2, 4
  want = -(-2 * (K - 1) * 7 * 4 // K)
  for n, c in ((SIZES[0], C0), (SIZES[1] + SIZES[2], 551)):
    s = -(-n // local)
    want += (hosts - 1) * 4 * (-(-min(s, c) // 2) + min(s, c))  # words
    want += -(-2 * (local - 1) * (3 * s * local) // local)
  assert (np.asarray(run[0][2].stats.wire_bytes) == want).all()


def test_packed_indices_on_the_host_axis(feeds, runs):
  """``packed_indices``: the host all-gather sends each shard index in
  ⌈log₂(S + 1)⌉ bits (S = 256: 9; 276: 9); ĝ and the residuals equal the
  flat run's bitwise, with drops too."""
  _, out = runs
  mesh = jaxfuse.make_mesh(K, local=4)
  ample, drops = _sync_run(_plan("hier", packed_indices=True), mesh, HIER,
                           feeds[:2])
  _check_equal(ample, out["flat"][0])
  _check_equal(drops, out["2x4"][1])
  hosts, local = 2, 4
  want = -(-2 * (K - 1) * 7 * 4 // K)
  for n, c in ((SIZES[0], C0), (SIZES[1] + SIZES[2], 551)):
    s = -(-n // local)
    m = min(s, c)
    want += (hosts - 1) * 4 * (m + -(-m * 9 // 32))
    want += -(-2 * (local - 1) * (4 * s * local) // local)
  assert (np.asarray(ample[0][2].stats.wire_bytes) == want).all()
  # the compiled host all-gathers: c_s values and ⌈9·c_s/32⌉ index words
  assert gathered_words(_plan("hier", packed_indices=True), mesh, HIER) == [
      C0 + -(-9 * C0 // 32), 276 + -(-9 * 276 // 32)]
  assert gathered_words(_plan("hier"), mesh, HIER) == [2 * C0, 2 * 276]


@pytest.mark.parametrize("inner", ["allgather", "zen", "spardl"])
def test_bfloat16_sparse_wire_conserves_to_float32(inner):
  """Float values (not bfloat16-representable) that overlap across workers
  and overflow the shard selection: the bfloat16 wire's roundings (each
  host's slots, the inner scheme's, the mean's on the local all-gather)
  all stay in residuals, K·ĝ + Σ_k r'_k = Σ_k (g_k + r_k) to float32
  rounding, as on a float32 wire."""
  rng = np.random.default_rng(0)
  spots = [2 * np.arange(C0) + (k % 2) for k in range(K)]   # shared by pairs
  feed = [[x * np.float32(4 / 3) for x in _grads(rng, spots, integer=False)]
          for _ in range(3)]
  (run,) = _sync_run(_plan("hier", inner, sparse_wire="bfloat16"),
                     jaxfuse.make_mesh(K, local=4), HIER, [feed])
  owed = [np.zeros((K, n)) for n in SIZES[:3]]
  for grads, (synced, res, _) in zip(feed, run):
    for u in range(3):
      total = (grads[u].reshape(K, -1) + owed[u]).sum(0)
      got = K * np.asarray(synced[u], np.float64).ravel() + res[u].sum(0)
      assert np.abs(got - total).max() <= 1e-6 * np.abs(total).max(), u
      owed[u] = res[u].astype(np.float64)
    assert (np.asarray(synced[0]) != np.asarray(synced[0], jnp.bfloat16)
            ).sum() == 0          # ĝ came over the bfloat16 local wire


def _trace(plan, mesh, axis):
  step, state = _runner(plan, mesh, axis)
  return step([np.zeros((K,) + s, np.float32) for s in SHAPES], state)


def test_hier_on_a_1d_mesh_names_the_bucket():
  with pytest.raises(collectives.SchemeError,
                     match=r"bucket 0: .*'hier'.*axis_name='data'.*"
                     r"axis_name=\('host', 'local'\)"):
    _trace(_plan("hier"), jaxfuse.make_mesh(K), "data")


def test_local_params_and_state_over_both_axes():
  """Replicated params need ``local_params(params, ("host", "local"))``,
  else the gradient is already summed over the axes: a clear error."""
  mesh = jaxfuse.make_mesh(K, local=4)
  tx = jaxfuse.sparse_sync(_plan("hier"), axis_name=HIER)
  with pytest.raises(jaxfuse.SyncError, match=r"not \('host', 'local'\)"):
    jaxfuse.init_state(tx, _params(), jaxfuse.make_mesh(K), HIER)
  state = jaxfuse.init_state(tx, _params(), mesh, HIER)
  specs = jaxfuse.state_specs(state, HIER)
  params = jax.device_put(_params(), NamedSharding(mesh, P()))
  x = jax.device_put(np.arange(K, dtype=np.float32),
                     NamedSharding(mesh, P(HIER)))
  loss = lambda p, x: sum(jnp.sum(w * x) for w in p)

  def lower(local):
    def f(p, s, x):
      return tx.update(jax.grad(loss)(
          jaxfuse.local_params(p, HIER) if local else p, x[0]), s)
    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P(), specs, P(HIER)),
                                 out_specs=(P(), specs))).lower(params, state, x)
  with pytest.raises(jaxfuse.SyncError, match=r"local_params\(params, "
                     r"\('host', 'local'\)\)"):
    lower(False)
  lower(True)


def test_inner_scheme_that_cannot_run_is_a_clear_error():
  """Hier's inner scheme's own check runs on the H hosts, named after the
  bucket: SparDL with 4 teams cannot run over 2 hosts."""
  plan = _plan("hier", collectives.SparDL(teams=4))
  with pytest.raises(collectives.SchemeError,
                     match=r"bucket 0 \(Hier\(inner='spardl'\) over the 2 "
                     r"hosts of axis 'host'\).*SparDL\(teams="):
    _trace(plan, jaxfuse.make_mesh(K, local=4), HIER)


def test_decode_past_the_unroll_limit():
  """More than ``base.UNROLL_WORKERS`` hosts: rows varying over ``local``
  decode in a loop whose carry varies like them; same sums as unrolled."""
  rows = collectives.base.UNROLL_WORKERS + 4
  rng = np.random.default_rng(1)
  vals = rng.integers(-9, 10, (K, rows, 16)).astype(np.float32)
  idx = np.stack([np.stack([rng.permutation(40)[:16] for _ in range(rows)])
                  for _ in range(K)]).astype(np.int32)
  mesh = jaxfuse.make_mesh(K, local=4)
  f = jax.jit(jax.shard_map(
      lambda v, i: collectives.base.decode(v[0], i[0], 32, 8)[None],
      mesh=mesh,
      in_specs=P(HIER), out_specs=P(HIER)))
  put = lambda x: jax.device_put(x, NamedSharding(mesh, P(HIER)))
  got = np.asarray(f(put(vals), put(idx)))
  for k in range(K):
    want = np.zeros(40, np.float32)
    for r in range(rows):
      np.add.at(want, idx[k, r], vals[k, r])
    np.testing.assert_array_equal(got[k], want[:32] / 8)


def test_shard_unit_shape():
  units = plan_lib.units(_plan("hier"))[0]
  assert hier._layout(units[1:3], 4)[:3] == (1101, 276, 276)
  assert hier._layout(units[:1], 2)[:3] == (1024, 512, C0)


def test_a_shards_unsent_entries_stay_on_the_worker_holding_it():
  """2 hosts × 2 local workers, one unit of 8 (shards [0, 4) and [4, 8)),
  c = 2 slots, so each shard sends c_s = 2. Host 0's workers send
  {0: 1, 5: 2} and {1: −3, 2: 0.5}; host 1's send nothing. Worker (0, 0)
  holds shard 0, y = [1, −3, 0.5, 0]: it sends −3 and 1 and keeps 0.5,
  which came from worker (0, 1); every other residual stays zero.
  Worked by hand from the module's steps."""
  mesh = jaxfuse.make_mesh(4, local=2)
  unit = plan_lib.Unit((0,), 8, 2, 0.25, "topk", "float32")
  values = np.array([[1.0, 2.0], [-3.0, 0.5], [0, 0], [0, 0]], np.float32)
  indices = np.array([[0, 5], [1, 2], [8, 8], [8, 8]], np.int32)

  def f(v, i):
    out = collectives.get("hier").sync([(v[0], i[0])], [unit], HIER,
                                       plan_lib.Settings())
    return out.means[0], out.kept[0][None]
  spec = P(HIER)
  means, kept = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=spec,
                                      out_specs=(P(), spec)))(
      jax.device_put(values, NamedSharding(mesh, spec)),
      jax.device_put(indices, NamedSharding(mesh, spec)))
  np.testing.assert_array_equal(np.asarray(means, np.float64),
                                np.array([1, -3, 0, 0, 0, 2, 0, 0]) / 4)
  want_kept = np.zeros((4, 8))
  want_kept[0, 2] = 0.5
  np.testing.assert_array_equal(np.asarray(kept, np.float64), want_kept)


@pytest.mark.parametrize("recipe", ["sgd", "onebit_adamw"])
def test_recipes_over_the_host_and_local_axes_equal_flat_bitwise(feeds,
                                                                  recipe):
  """A recipe given ``axis_name=("host", "local")`` steps as on the flat
  axis with ``"allgather"`` (the ample integer feed and β = ½: every sum
  is exact),
  through ``onebit_adamw``'s dense phase and its sparse one: the recipes
  carry the pair of axes to every collective and to their clip."""
  def train(name, mesh, axis):
    plan = _plan(name)
    make = lambda plan: jaxfuse.RECIPES[recipe](
        plan, 0.5, axis_name=axis, clip_norm=1e4,
        **({"momentum": 0.5} if recipe == "sgd" else {"b1": 0.5}))
    phases = ((jaxfuse.with_density(plan, 1.0), plan)
              if recipe == "onebit_adamw" else (plan,))
    state = jaxfuse.init_state(make(plan), _params(), mesh, axis)
    specs = jaxfuse.state_specs(state, axis)
    params = _params()
    for phase in phases:
      opt = make(phase)

      def local(g, s, p, opt=opt):
        updates, s = opt.update([x[0] for x in g], s, p)
        return optax.apply_updates(p, updates), s

      step = jax.jit(jax.shard_map(local, mesh=mesh,
                                   in_specs=(P(axis), specs, P()),
                                   out_specs=(P(), specs)))
      for g in feeds[0]:
        params, state = step(jax.device_put(g, NamedSharding(mesh, P(axis))),
                             state, params)
        jax.block_until_ready(params)
    return params

  want = train("allgather", jaxfuse.make_mesh(K), "data")
  got = train("hier", jaxfuse.make_mesh(K, local=4), HIER)
  for a, b in zip(got, want, strict=True):
    assert np.array_equal(np.asarray(a), np.asarray(b))
  assert any(np.any(np.asarray(a)) for a in got)
