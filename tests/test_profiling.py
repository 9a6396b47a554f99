"""Profiling: measured costs grow with size, the derived per-leaf backward
times add up to the measured backward, and the program's costs go to the
leaves that cause them."""

import io
import math

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxfuse import plans
from jaxfuse.planning import _measuring
from jaxfuse.planning import bucket_cost
from jaxfuse.planning import costs as costs_lib
from jaxfuse.planning import ordering
from jaxfuse.planning import profiling

from _harness import mesh_of

FAST = dict(repeats=3, warmup=1)
FAST_TIMING = profiling.Timing(**FAST)
ON_GPU = jax.default_backend() == "gpu"
# A "big" size whose time dwarfs a small one's latency on this backend.
BIG = 2**27 if ON_GPU else 2**21
# Collectives on 8 simulated CPU devices share 2 cores and rendezvous on
# every call: a size 8x past BIG keeps the growth above that noise.
BIG_COLLECTIVE = 2**27 if ON_GPU else 2**24


def two_layers(rows=64):
  """A big layer (256 x 1024) then a small one (1024 x 4); pytree order puts
  the small one first ("a_small" < "b_big"), ready order the same."""
  rng = np.random.default_rng(0)
  params = {"b_big": rng.standard_normal((256, 1024), np.float32) / 16,
            "a_small": rng.standard_normal((1024, 4), np.float32) / 32}
  x = rng.standard_normal((rows, 256), np.float32)

  def loss_fn(p, x):
    h = jax.nn.relu(x @ p["b_big"])
    return jnp.mean((h @ p["a_small"]) ** 2)
  return loss_fn, params, (x,)


# --- measured sweeps ------------------------------------------------------------

@pytest.mark.parametrize("kind", ["allgather", "psum"])
def test_collective_time_grows_with_size(mesh, kind):
  sizes = (2**12, BIG_COLLECTIVE)
  points = profiling.measure_collective(
      kind, mesh, sizes, timing=FAST_TIMING._replace(chain=2))
  assert [x for x, _ in points] == list(sizes)
  (_, small), (_, big) = points
  assert big > small > 0
  fit = costs_lib.fit_linear(*zip(*points))
  assert fit.beta > 0
  assert fit.time(sizes[1]) > fit.time(sizes[0])


def test_compress_time_grows_with_size():
  """What one more unit costs, measured: a unit of 2^18 elements (2^24 on
  GPUs) costs more than one of 2^10, whose cost may be below the timing
  noise (0, never negative). On a GPU five rounds: its 0.23 ms
  difference per 2^24 unit (1 × H200) once fell under three rounds'
  median."""
  points = profiling.measure_compress(
      (2**10, BIG // 8),
      timing=profiling.Timing(repeats=5, warmup=2) if ON_GPU else FAST_TIMING)
  (_, small), (_, big) = points
  assert big > small >= 0
  assert costs_lib.fit_linear(*zip(*points)).beta > 0


def test_compress_is_the_time_of_one_more_unit(monkeypatch):
  """An update of c units of x elements taking 0.5 ms (dispatch and the
  bucket's own kernels) + c·(20 µs + x·1 ns): h(x) = 20 µs + x·1 ns, from
  c = 4 and 8 units timed together; the old time-per-unit would have
  given 20 µs + x ns + 0.5 ms / 4. Noise that makes the larger update
  faster gives 0."""
  runs = []

  def fake(mesh_, size_lists, strategy, **kw):
    runs.append((strategy, [len(s) for s in size_lists],
                 kw["timing"].repeats))
    return [5e-4 + len(s) * (2e-5 + s[0] * 1e-9) for s in size_lists]
  monkeypatch.setattr(bucket_cost, "_time_sparse_steps", fake)
  points = profiling.measure_compress((1000, 10**6),
                                      timing=profiling.Timing(repeats=3))
  assert runs == [("single", [4, 8], 3)] * 2
  assert points[0] == (1000, pytest.approx(2e-5 + 1e-6))
  assert points[1] == (10**6, pytest.approx(2e-5 + 1e-3))
  fit = costs_lib.fit_linear(*zip(*points))
  assert fit.alpha == pytest.approx(2e-5) and fit.beta == pytest.approx(1e-9)
  monkeypatch.setattr(bucket_cost, "_time_sparse_steps",
                      lambda *a, **kw: [2e-3, 1.9e-3])
  assert profiling.measure_compress(
      (10, 20), timing=profiling.Timing(chain=2)) == [(10, 0.0), (20, 0.0)]
  with pytest.raises(profiling.ProfileError, match="chain=0"):
    profiling.measure_compress((10, 20), timing=profiling.Timing(chain=0))


def test_bucket_cost_is_the_time_per_extra_bucket(mesh, monkeypatch):
  """One bucket of 8 layers in 1.0 ms, 8 buckets of one layer in 2.4 ms:
  7 more buckets at 0.2 ms each; on one device of the mesh."""
  timed, built = [], []
  real_step = bucket_cost.early_step

  def spy(mesh_, strategy, **kw):
    built.append((mesh_.devices.size, strategy, kw["units"]))
    return real_step(mesh_, strategy, **kw)

  def fake(calls, **kw):
    timed.append(len(calls))
    return [1.0e-3, 2.4e-3]
  monkeypatch.setattr(bucket_cost, "early_step", spy)
  monkeypatch.setattr(bucket_cost, "time_calls", fake)
  c, raw = profiling.measure_bucket_cost(mesh, units=8, elements=4096)
  assert built == [(1, "single", 8), (1, "layerwise", 8)] and timed == [2]
  assert c == pytest.approx(0.2e-3)
  assert raw["one_bucket"] == 1.0e-3 and raw["bucket_per_unit"] == 2.4e-3
  assert raw["elements"] == 4096 and raw["units"] == 8
  # Timing noise that makes more buckets faster gives 0, never a negative
  # cost.
  monkeypatch.setattr(bucket_cost, "time_calls", lambda calls, **kw: [2e-3,
                                                                      1e-3])
  assert profiling.measure_bucket_cost(mesh, units=3, elements=256)[0] == 0.0
  with pytest.raises(profiling.ProfileError, match="units=1"):
    profiling.measure_bucket_cost(mesh, units=1)


def test_the_bucket_steps_are_fenced_and_update_alike(mesh):
  """The timed programs: every layer sparse, one bucket against one per
  layer, the second under send_early's fences; bucketing changes nothing
  the update sends (each layer is its own selection unit either way)."""
  from jaxfuse.planning import planner  # pylint: disable=g-import-not-at-top
  one_device = jax.sharding.Mesh(np.asarray(mesh.devices).flat[:1], ("data",))
  made, updates, fenced = [], [], []
  real_plan = planner.plan

  def spy(*a, **kw):
    made.append(real_plan(*a, **kw))
    return made[-1]
  with pytest.MonkeyPatch.context() as m:
    m.setattr(planner, "plan", spy)
    for strategy in ("single", "layerwise"):
      step, args = bucket_cost.early_step(
          one_device, strategy, units=3, width=64,
          compression=profiling.Compression("dgc", 0.05, 1.5))
      # traced as the top-level jit (on a GPU it carries compiler options,
      # which make_jaxpr would refuse on a nested jit)
      fenced.append("optimization_barrier" in str(step.trace(*args).jaxpr))
      updates.append(jax.tree.leaves(step(*args)[0]))
  one, each = made
  assert all(l.mode == "sparse" for l in one.leaves + each.leaves)
  assert [b.collective for b in one.buckets] == ["allgather"]
  assert [b.collective for b in each.buckets] == ["allgather"] * 3
  assert fenced == [False, True]
  for a, b in zip(*updates):
    np.testing.assert_array_equal(a, b)
  assert all(np.abs(a).sum() > 0 for a in updates[0])


def test_scheme_cost_is_its_time_over_allgather_past_the_wire(
    mesh, monkeypatch):
  """With free collective lines the wire steps cost nothing, so e is the
  scheme's step less all_gather's: at 4 units of 2^14 (984 slots) zen
  adds 1 ms, at 2^17 (7868 slots) 3 ms: e(c) = α + β·c through both."""
  from jaxfuse.planning import planner  # pylint: disable=g-import-not-at-top
  mesh = mesh_of(max(2, mesh.size))   # the schemes and Costs need 2 workers

  def fake(mesh_, sizes, strategy, collective="allgather", **kw):
    del mesh_, kw
    plan = planner.plan([jax.ShapeDtypeStruct((n,), "float32")
                         for n in sizes], density=0.01, strategy=strategy,
                        collective=collective,
                        settings=plans.Settings(
                            headroom=1.5, min_sparse_size=1))
    extra = {"allgather": 0.0, "zen": 1e-3 if sizes[0] == 2**14 else 3e-3,
             "spardl": 0.0}[collective]
    return 5e-3 + extra, plan
  monkeypatch.setattr(bucket_cost, "_time_sparse_step", fake)
  free = costs_lib.Costs({"allgather": costs_lib.LinearCost(0, 0),
                          "psum": costs_lib.LinearCost(0, 0)},
                         costs_lib.LinearCost(0, 0), (), workers=mesh.size)
  fits, raw = profiling.measure_scheme_costs(mesh, free,
                                             sizes=(2**14, 2**17))
  slots = [c for c, *_ in raw["points"]["zen"]]
  assert slots == [4 * 246, 4 * 1967]   # ⌈0.01 · 1.5 · n⌉ per leaf
  beta = 2e-3 / (slots[1] - slots[0])
  assert fits["zen"].beta == pytest.approx(beta)
  assert fits["zen"].alpha == pytest.approx(1e-3 - beta * slots[0])
  assert fits["spardl"].time(10**5) == pytest.approx(0.0, abs=1e-12)
  with pytest.raises(profiling.ProfileError, match="two distinct"):
    profiling.measure_scheme_costs(mesh, free, sizes=(2**14, 2**14))


# The timed programs are the real collectives on all n words: every worker
# holds its own block (k·n … k·n + n − 1) and each result is worked by hand.
def _own_inputs(mesh, x):
  """The chain's inputs replaced by worker-distinct blocks: worker k holds
  k*n .. k*n + n - 1."""
  k = mesh.shape["data"]
  n = x.shape[0] // k
  data = np.arange(k * n).astype(x.dtype)
  return jax.device_put(data, NamedSharding(mesh, P("data"))), data, k, n


@pytest.mark.parametrize("chain", [1, 2])
def test_allgather_chain_returns_the_last_workers_whole_block(mesh, chain):
  fn, (x,) = profiling.collective_chain("allgather", mesh, 64, chain=chain)
  x, data, k, n = _own_inputs(mesh, x)
  assert n == 16                                    # 64 bytes = 16 words
  (y,) = fn(x)
  # every round takes block K-1 of the gather; the next round gathers it again
  np.testing.assert_array_equal(np.asarray(y), data[(k - 1) * n:])
  assert np.asarray(y).dtype == np.uint32


@pytest.mark.parametrize("chain", [1, 2])
def test_psum_chain_sums_the_workers_blocks(mesh, chain):
  fn, (x,) = profiling.collective_chain("psum", mesh, 64, chain=chain)
  x, data, k, n = _own_inputs(mesh, x)
  (y,) = fn(x)
  j = np.arange(n)
  once = n * k * (k - 1) / 2 + k * j     # Σ_w (w·n + j), exact in float32
  np.testing.assert_array_equal(np.asarray(y), once * k ** (chain - 1))


def test_ppermute_chain_shifts_each_block_one_worker_per_round(mesh):
  fn, (x,) = profiling.collective_chain("ppermute", mesh, 64, chain=2)
  x, data, k, n = _own_inputs(mesh, x)
  (y,) = fn(x)
  blocks = data.reshape(k, n)
  # worker i receives worker (i-1)'s block each round: after 2, (i-2)'s
  np.testing.assert_array_equal(np.asarray(y).reshape(k, n),
                                blocks[(np.arange(k) - 2) % k])


def test_alltoall_chain_transposes_the_tiles(mesh):
  fn, (x,) = profiling.collective_chain("alltoall", mesh, 64, chain=1)
  x, data, k, n = _own_inputs(mesh, x)
  (y,) = fn(x)
  tiles = data.reshape(k, k, n // k)            # [worker, tile, word]
  # worker i's tile j is worker j's tile i
  np.testing.assert_array_equal(np.asarray(y).reshape(k, k, n // k),
                                tiles.transpose(1, 0, 2))


def test_overlap_and_contention_formulas():
  # η = (T_bwd + T_comm − T_both) / T_comm, clipped to [0, 1]
  assert profiling.overlap_factor(10.0, 10.0, 15.0) == pytest.approx(0.5)
  assert profiling.overlap_factor(10.0, 10.0, 10.0) == 1.0
  assert profiling.overlap_factor(10.0, 10.0, 25.0) == 0.0
  assert profiling.overlap_factor(10.0, 0.0, 10.0) == 1.0
  # a share of what could hide: the shorter of the two
  assert profiling.overlap_factor(10.0, 20.0, 25.0) == pytest.approx(0.5)
  assert profiling.overlap_factor(20.0, 10.0, 25.0) == pytest.approx(0.5)
  assert profiling.overlap_factor(10.0, 20.0, 20.0) == 1.0
  # γ = (T₂ − α)/(T₁ − α), clipped to [1, 2]
  assert profiling.contention_factor(3.0, 4.5, 1.0) == pytest.approx(1.75)
  assert profiling.contention_factor(3.0, 9.0, 1.0) == 2.0
  assert profiling.contention_factor(3.0, 2.0, 1.0) == 1.0
  assert profiling.contention_factor(1.0, 5.0, 1.0) == 1.0


# --- per-leaf backward --------------------------------------------------------------

def test_attribution_follows_the_work():
  loss_fn, params, args = two_layers()
  a = profiling.analyze_backward(loss_fn, params, args, rates=(1e11, 1e10))
  small, big = 0, 1  # pytree order: a_small, b_big
  assert list(a.order) == ordering.ready_order(loss_fn, params, *args)
  assert list(a.order) == [small, big]
  assert a.ready[small] < a.ready[big] <= a.total
  assert min(a.shares) >= 0
  # dW_big = xᵀ·dh (2·64·256·1024 FLOPs) and dh = dy·W_smallᵀ come after
  # dW_small (2·64·1024·4 FLOPs, but it reads h: 256 KiB): the big leaf gets
  # by far the larger share.
  assert a.shares[big] > 5 * a.shares[small]
  assert sum(a.shares) == pytest.approx(a.ready[big] - a.forward)
  assert 0 < a.forward < a.total
  b = profiling.analyze_backward(loss_fn, params, args, rates=(1e11, 1e10),
                                 attribution="position")
  assert b.order == a.order  # ready[big]: + the work no gradient needs
  assert a.ready[big] <= b.ready[big] == pytest.approx(a.ready[big], rel=1e-2)
  assert b.shares[big] > 5 * b.shares[small] and min(b.shares) >= 0
  with pytest.raises(profiling.ProfileError, match="attribution="):
    profiling.analyze_backward(loss_fn, params, args, attribution="guess")


def test_attribution_of_a_scan():
  """Control flow is one opaque step: a scan costs length x its body."""
  def loss_fn(p, x):
    h, _ = lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, p["stack"])
    return jnp.mean((h @ p["head"]) ** 2)
  params = {"stack": jnp.ones((6, 128, 128)) / 128, "head": jnp.ones((128, 2))}
  a = profiling.analyze_backward(loss_fn, params, (jnp.ones((32, 128)),),
                                 rates=(1e11, 1e10))
  head, stack = 0, 1
  assert list(a.order) == [head, stack]
  assert a.shares[stack] > 10 * a.shares[head] > 0


def test_scale_shares():
  assert profiling.scale_shares([1.0, 3.0], 2.0) == pytest.approx((0.5, 1.5))
  assert profiling.scale_shares([0.0, 0.0], 3.0, sizes=[1, 2]) == \
      pytest.approx((1.0, 2.0))
  assert profiling.scale_shares([0.0, 0.0], 1.0) == pytest.approx((0.5, 0.5))
  assert profiling.scale_shares([1.0, 1.0], -1.0) == (0.0, 0.0)


def test_derived_backward_sums_to_the_measured_backward():
  # A batch whose backward is well above launch latency and timing noise
  # (at 64 rows on a loaded CPU, forward + backward timed no longer than
  # the forward alone).
  loss_fn, params, args = two_layers(rows=2**16 if ON_GPU else 2**11)
  forward, measured = profiling.measure_forward_backward(loss_fn, params, args,
                                                         **FAST)
  assert forward > 0 and measured > 0
  rates = profiling.machine_rates(**FAST)
  assert all(r > 0 and math.isfinite(r) for r in rates)
  back = profiling.derive_backward(loss_fn, params, args, measured=measured,
                                   rates=rates)
  assert len(back) == 2 and min(back) >= 0
  assert sum(back) == pytest.approx(measured, rel=1e-9)
  assert back[1] > back[0]  # b_big


def test_validate_backward_reports_prefixes():
  # 64 rows run backward in less time than the timing noise (measured 0 on
  # an H200, and on a loaded 2-core CPU): enough rows for a real backward.
  loss_fn, params, args = two_layers(rows=2**16 if ON_GPU else 2**12)
  back = (0.25, 0.75)
  report = profiling.validate_backward(profiling.Model(loss_fn, params, args),
                                       back, num_prefixes=1,
                                       timing=FAST_TIMING)
  (row,) = report["prefixes"]
  assert row["leaves"] == 1
  assert row["derived"] == pytest.approx(0.25)  # the small leaf, ready first
  assert report["backward"] > 0 and report["forward"] > 0
  assert row["error"] == pytest.approx(
      (row["derived"] - row["measured"]) / report["backward"])
  assert report["mean_abs_error"] == pytest.approx(abs(row["error"]))
  assert report["device"].startswith(jax.devices()[0].platform)
  with pytest.raises(profiling.ProfileError, match="3 times but params has 2"):
    profiling.validate_backward(profiling.Model(loss_fn, params, args),
                                (1.0, 1.0, 1.0))


def test_the_0_2_keywords_still_work_and_name_their_new_place(monkeypatch):
  """Each keyword the measuring functions took up to 0.2 lands in its group,
  with a DeprecationWarning that names the group; an unknown one is still a
  TypeError naming it."""
  runs = []

  def fake(mesh_, size_lists, strategy, **kw):
    runs.append((kw["compression"], kw["timing"]))
    return [2e-3, 3e-3]
  monkeypatch.setattr(bucket_cost, "_time_sparse_steps", fake)
  with pytest.warns(DeprecationWarning) as caught:
    profiling.measure_compress((10, 20), density=0.05, repeats=3, chain=2)
  assert runs[0] == (profiling.Compression("dgc", 0.05, 1.5),
                     profiling.Timing(repeats=3, warmup=2, chain=2))
  messages = sorted(str(w.message) for w in caught)
  assert len(messages) == 3
  assert "measure_compress(density=...) is deprecated: pass compression=" \
      "Compression(density=...)" in messages[1]
  with pytest.raises(TypeError, match="'bogus'"):
    profiling.measure_compress((10, 20), bogus=1)
  with pytest.warns(DeprecationWarning,
                    match=r"sweep=Sweep\(timing=Timing\(chain=\.\.\.\)\)"):
    groups = _measuring.upgrade_keywords(
        "profile", {"chain": 2},
        **{"sweep": profiling.Sweep(), "sweep.timing": profiling.Timing()})
  assert groups["sweep.timing"] == profiling.Timing(chain=2)
  assert groups["sweep"] == profiling.Sweep()


def test_validate_backward_takes_the_0_2_positional_form():
  """validate_backward(loss_fn, params, example_args, backward) warns,
  naming Model, and reports on the same leaves and derived times."""
  loss_fn, params, args = two_layers()
  with pytest.warns(DeprecationWarning, match=r"Model\(loss_fn, params"):
    report = profiling.validate_backward(
        loss_fn, params, args, (0.25, 0.75), num_prefixes=1,
        timing=profiling.Timing(repeats=1, warmup=0))
  (row,) = report["prefixes"]
  assert row["leaves"] == 1 and row["derived"] == pytest.approx(0.25)
  with pytest.raises(TypeError, match="give the rest by keyword"):
    profiling.validate_backward(profiling.Model(loss_fn, params, args),
                                (0.25, 0.75), [1, 0])


# --- the whole profile ------------------------------------------------------------

def test_profile_arguments_are_checked(mesh):
  with pytest.raises(profiling.ProfileError, match="two distinct"):
    profiling.profile(mesh, sweep=profiling.Sweep(sizes=(4096, 4096)))
  with pytest.raises(profiling.ProfileError, match="both loss_fn and params"):
    with pytest.warns(DeprecationWarning, match="model=Model"):
      profiling.profile(mesh, loss_fn=lambda p: 0.0)


def test_profile_without_model_and_progress(mesh):
  out = io.StringIO()
  costs = profiling.profile(
      mesh, sweep=profiling.Sweep((2**12, BIG_COLLECTIVE), (2**10, 2**16),
                                  FAST_TIMING._replace(chain=2)),
      progress=profiling.text_progress(out))
  assert costs.backward == () and costs.forward == 0.0
  assert costs.collectives["psum"].beta > 0
  assert 1 <= costs.contention <= 2 and 0 <= costs.overlap <= 1
  assert costs.provenance["overlap"]["model"] == "synthetic MLP"
  assert costs.provenance["devices"]["mesh"] == {"data": mesh.size}
  assert costs.bucket >= 0 and costs.provenance["bucket"]["units"] == 8
  assert set(costs.schemes) == {"zen", "spardl"}   # what 8 devices can run
  assert costs_lib.Costs.from_json(costs.to_json()) == costs
  lines = out.getvalue().splitlines()
  assert lines[0].startswith("[") and "0/" in lines[0]
  assert lines[-1].endswith("done") and "#" * 24 in lines[-1]


def test_equation_work_counts_flops():
  def eqn_of(fn, *args):
    (eqn,) = [e for e in jax.make_jaxpr(fn)(*args).jaxpr.eqns
              if e.primitive.name not in profiling.FREE_PRIMITIVES]
    return profiling.equation_work(eqn)
  a, b = jnp.ones((8, 32, 16)), jnp.ones((8, 16, 4))
  flops, nbytes = eqn_of(lambda a, b: jnp.einsum("bij,bjk->bik", a, b), a, b)
  assert flops == 2 * 8 * 32 * 4 * 16 and nbytes == 8 * 32 * 16 * 4
  x, w = jnp.ones((2, 3, 10, 10)), jnp.ones((5, 3, 3, 3))  # NCHW, OIHW
  flops, _ = eqn_of(lambda x, w: lax.conv(x, w, (1, 1), "VALID"), x, w)
  assert flops == 2 * (2 * 5 * 8 * 8) * 3 * (3 * 3)
  flops, nbytes = eqn_of(lambda x: jnp.sum(x), x)
  assert flops == 0 and nbytes == 2 * 3 * 10 * 10 * 4


def test_time_chained_threads_the_state_through_every_step():
  """Each step gets the previous step's state and the next input in
  rotation; the extra outputs (a loss) are dropped from the state."""
  from jaxfuse.planning import timing
  step = jax.jit(lambda a, b, x: (a + x, b * 2, jnp.sum(a)))
  inputs = [jnp.float32(1), jnp.float32(10), jnp.float32(100)]
  seconds, (a, b) = timing.time_chained(
      step, (jnp.float32(0), jnp.float32(1)), inputs, steps=7)
  assert float(a) == 1 + 10 + 100 + 1 + 10 + 100 + 1
  assert float(b) == 2.0 ** 7
  assert 0 < seconds < 10
  with pytest.raises(timing.ProfileError, match="steps=0"):
    timing.time_chained(step, (a, b), inputs, steps=0)
