"""ZEN Balanced Parallelism (``collectives.zen``): conservation, replica
identity, equality with ``"allgather"``, overflow to the residual, wire bytes.
"""

import functools
import math

from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st
import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import jax.numpy as jnp
import numpy as np
import pytest

from jaxfuse import collectives
import jaxfuse
from jaxfuse import plans as plan_lib
from jaxfuse.collectives import zen as zen_lib
from jaxfuse.kernels import hash_partition as hp

from _harness import assert_replicas_identical
from _harness import fast_jit
from _harness import NUM_WORKERS, init, list_plan, mesh_of, shard, sync

SHAPES = [(64, 64)]               # the mesh tests: one unit, N = 4096
TWO_UNITS = [(64, 48), (1000,)]   # one bucket of two units, N = 4072


def _grads(k, shapes, seed, shared=0.0):
  """(k, *shape) gradients; ``shared`` > 0 adds a part common to all
  workers, so their selections overlap."""
  rng = np.random.default_rng(seed)
  out = []
  for s in shapes:
    common = rng.normal(size=(1,) + tuple(s))
    out.append((shared * common + rng.normal(size=(k,) + tuple(s))
                ).astype(np.float32))
  return out


def _check_conservation(plan, grads, old, synced, state, k, exact=False):
  """K·ĝ + Σ_k r_k' = Σ_k (g_k + r_k) per unit, in float64."""
  units, _ = plan_lib.units(plan)
  for u, unit in enumerate(units):
    g = np.concatenate([np.asarray(grads[j], np.float64).sum(0).ravel()
                        for j in unit.leaves])
    sent = np.concatenate([k * np.asarray(synced[j], np.float64).ravel()
                           for j in unit.leaves])
    new = np.asarray(jaxfuse.unit_residuals(plan, state)[u], np.float64).sum(0)
    want = g + np.asarray(old[u], np.float64).sum(0)
    if exact:
      np.testing.assert_array_equal(sent + new, want)
    else:
      np.testing.assert_allclose(sent + new, want, rtol=1e-5,
                                 atol=1e-5 * (1 + np.abs(want).max()))


def _run(plan, mesh, k, steps, seed, shared=0.0, shapes=SHAPES):
  """``steps`` syncs; conservation and replica identity checked each step.
  Returns [(synced, state)] per step."""
  state = init(plan, mesh)
  out = []
  for t in range(steps):
    grads = _grads(k, shapes, seed + t, shared)
    old = [np.asarray(r) for r in jaxfuse.unit_residuals(plan, state)]
    synced, state = sync(plan, mesh, grads, state, fast_compile=True)
    _check_conservation(plan, grads, old, synced, state, k)
    assert_replicas_identical(synced, k)
    out.append((synced, state))
  return out


# --- the transform on meshes of 3..8 workers ----------------------------------

@pytest.mark.parametrize("k", sorted({NUM_WORKERS, 3, 5, 6, 7}))
def test_conserves_identical_replicas_equals_allgather(k):
  """Ample tables (Zen(table=4)) and union 1 on overlapping selections:
  nothing overflows, so ĝ and the residuals equal allgather's bit for bit
  (same f32 sums in rank order, same /K)."""
  mesh = mesh_of(k)
  kw = dict(density=0.005, settings=jaxfuse.Settings(min_sparse_size=64),
            strategy="single", estimator="topk")
  plan = list_plan(SHAPES, **kw,
                   collective=jaxfuse.collectives.Zen(table=4.0))
  ours = _run(plan, mesh, k, 2, seed=k, shared=10.0)
  theirs = _run(list_plan(SHAPES, collective="allgather", **kw), mesh, k, 2,
                seed=k, shared=10.0)
  for (s1, st1), (s2, st2) in zip(ours, theirs):
    for a, b in zip(s1, s2):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(st1.residuals, st2.residuals):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert any(np.count_nonzero(np.asarray(a)) for a in s1)


def test_both_pull_encodings_are_covered_by_the_mesh_tests():
  units, _ = plan_lib.units(list_plan(SHAPES, density=0.005, strategy="single",
                                      estimator="topk", collective="zen",
                                      settings=jaxfuse.Settings(
                                          min_sparse_size=64)))
  kinds = {zen_lib.layout(units, k, plan_lib.Settings()).bitmap
           for k in (3, 5, 6, 7, 8)}
  assert kinds == {True, False}


def test_pull_overflow_goes_to_the_residual(mesh):
  """Zen(union=0.05): K·U < C, fewer pulled entries than one worker selects,
  so some must wait in a residual; conservation still holds."""
  k = NUM_WORKERS
  plan = list_plan(TWO_UNITS, density=0.05,
                   strategy="single", estimator="topk",
                   settings=jaxfuse.Settings(min_sparse_size=64),
                   collective=jaxfuse.collectives.Zen(table=1.0, union=0.05))
  units, _ = plan_lib.units(plan)
  c = sum(u.capacity for u in units)
  cap = math.ceil(0.05 * c)
  assert k * cap < c
  for synced, _ in _run(plan, mesh, k, 2, seed=11, shapes=TWO_UNITS):
    assert sum(np.count_nonzero(np.asarray(x)) for x in synced) <= k * cap


# --- adversarial index sets, straight through Zen.sync -------------------------

N, C = 2048, 16


@functools.lru_cache(maxsize=None)
def _direct(k, sizes, caps, table, union):
  """Zen.sync over k workers on (values, indices) per unit: -> (means, kept)
  with kept (k, n) per unit."""
  mesh = mesh_of(k)
  units = [plan_lib.Unit((i,), n, c, c / n, "topk", "float32")
           for i, (n, c) in enumerate(zip(sizes, caps))]
  settings, zen = plan_lib.Settings(), collectives.Zen(table=table, union=union)

  def f(*xs):
    parts = [(xs[2 * i][0], xs[2 * i + 1][0]) for i in range(len(units))]
    out = zen.sync(parts, units, "data", settings)
    return out.means, [x[None] for x in out.kept]
  return mesh, fast_jit(jax.shard_map(f, mesh=mesh, in_specs=P("data"),
                                      out_specs=(P(), P("data"))))


def _run_direct(k, table, union, parts):
  """parts: [(values (k, c) float32, indices (k, c) int32)] per unit ->
  (means, kept, sent) per unit, float64; replicas of ĝ checked identical."""
  sizes = tuple(n for n, _, _ in parts)
  mesh, f = _direct(k, sizes, tuple(v.shape[1] for _, v, _ in parts), table,
                    union)
  args = [shard(mesh, x) for _, v, i in parts for x in (v, i)]
  means, kept = f(*args)
  assert_replicas_identical(means, k)
  return [(np.asarray(m, np.float64), np.asarray(r, np.float64),
           _sent(n, v, i)) for m, r, (n, v, i) in zip(means, kept, parts)]


def _sent(n, values, indices):
  """Per worker, its slots as a dense (n,) float64 vector."""
  dense = np.zeros((values.shape[0], n))
  for r in range(values.shape[0]):
    ok = indices[r] < n
    dense[r, indices[r][ok]] += values[r][ok]
  return dense


def _one_partition(count):
  """The first ``count`` indices i of [0, N) with h0(i) = h0(0)."""
  cand = np.arange(N, dtype=np.int32)
  part = np.asarray(hp.partition_of(cand, NUM_WORKERS))
  same = cand[part == part[0]]
  assert same.size >= count and same[0] == 0
  return same[:count], int(part[0])


def _int_values(shape, seed, signs=True):
  rng = np.random.default_rng(seed)
  v = rng.integers(1, 10, shape)
  return (v * (rng.choice([-1, 1], shape) if signs else 1)).astype(np.float32)


def _exact_run(table, union, values, indices):
  """ĝ, kept, sent; conservation exact (integer values, K a power of two)."""
  k = NUM_WORKERS
  assert k & (k - 1) == 0
  [(mean, kept, sent)] = _run_direct(k, table, union,
                                     [(N, values, indices.astype(np.int32))])
  np.testing.assert_array_equal(k * mean + kept.sum(0), sent.sum(0))
  return mean, kept, sent


@hsettings(max_examples=5, deadline=None)
@given(sizes=st.sampled_from([(300,), (777, 64)]),
       density=st.sampled_from([0.02, 0.3]),
       k=st.sampled_from([2, 3, 8]),
       table=st.sampled_from([1.0, 2.0]),
       union=st.sampled_from([0.1, 1.0]),
       seed=st.integers(0, 2**16))
def test_conservation_property(sizes, density, k, table, union, seed):
  """K·ĝ + Σ_k kept_k = Σ_k sent_k per unit, for random distinct index sets
  (some slots empty, index 0 often taken) and float values."""
  k = min(k, len(jax.devices()))
  rng = np.random.default_rng(seed)
  parts = []
  for n in sizes:
    c = max(2, math.ceil(density * n))
    zero = rng.random(k) < 0.5                          # index 0 taken
    idx = np.stack([np.concatenate([[0], rng.choice(np.arange(1, n), c - 1,
                                                    replace=False)])
                    if z else rng.choice(n, c, replace=False) for z in zero])
    idx[rng.random((k, c)) < 0.2] = n                   # empty slots
    parts.append((n, rng.normal(size=(k, c)).astype(np.float32),
                  idx.astype(np.int32)))
  for mean, kept, sent in _run_direct(k, table, union, parts):
    want = sent.sum(0)
    np.testing.assert_allclose(k * mean + kept.sum(0), want, rtol=1e-5,
                               atol=1e-6 * (1 + np.abs(want).max()))
    assert not mean[want == 0].any()       # nothing appears from nowhere


def test_one_partition_index_zero_tiny_tables_nothing_lost():
  """Every index in partition h0(0) (index 0 included, one zero value), the
  workers' sets disjoint; r1 + r2 = 5 < C and U = 1, so both stages
  overflow: the overflowed entries are in the kept, nothing lost."""
  k = NUM_WORKERS
  if k < 2:
    pytest.skip("needs 2 workers (a second one's values)")
  assert k & (k - 1) == 0
  same, p0 = _one_partition(k * C)
  indices = same.reshape(k, C).astype(np.int32)
  values = _int_values((k, C), 0)
  values[1, 3] = 0.0                                 # a zero value is sent
  mean, kept, sent = _exact_run(1.0, 1 / C, values, indices)
  r1 = math.ceil(C / k)
  stored_max = r1 + math.ceil(r1 / 4)
  assert np.count_nonzero(mean) <= 1                 # U = 1
  assert sent[0, 0] != 0 and NUM_WORKERS * mean[0] + kept[:, 0].sum() == \
      sent[0, 0]
  for w in range(k):
    # Sender's overflow: at least C − (r1 + r2) of its own slots, as sent.
    own = np.isin(np.arange(N), indices[w]) & (kept[w] != 0)
    assert own.sum() >= C - stored_max - (w == 1)
    np.testing.assert_array_equal(kept[w][own], sent[w][own])
    if w != p0:                       # only the reducer keeps others' slots
      assert np.count_nonzero(kept[w][~np.isin(np.arange(N), indices[w])]) == 0
  # The reducer p0 keeps the union's overflow: ≥ K stored entries − U.
  others = ~np.isin(np.arange(N), indices[p0])
  assert np.count_nonzero(kept[p0][others]) >= k - 3


def test_one_partition_shared_sets_ample_tables_are_lossless():
  """All workers send the same 4 indices of one partition (index 0 first):
  ample tables, P = ⌈4/K + 4·√(4/K)⌉ ≥ 4 wire slots and U = 4, so nothing
  is kept and K·ĝ is the exact sum."""
  k = NUM_WORKERS
  same, _ = _one_partition(4)
  indices = np.tile(same, (k, 1)).astype(np.int32)
  mean, kept, sent = _exact_run(16.0, 1.0, _int_values((k, 4), 1), indices)
  assert not kept.any()
  np.testing.assert_array_equal(k * mean, sent.sum(0))


def test_pull_overflow_sends_the_largest_sums():
  """The same 4 indices of one partition from every worker, all on the
  wire, U = 2: the 2 largest |Σ_k v_k| are pulled, the other 2 kept by the
  reducer alone."""
  k = NUM_WORKERS
  same, p0 = _one_partition(4)
  indices = np.tile(same, (k, 1)).astype(np.int32)
  values = _int_values((k, 4), 4, signs=False)
  values[:, 1] = 9.0                   # the largest sums, at every rank
  values[:, 2] = -9.0
  mean, kept, sent = _exact_run(16.0, 0.5, values, indices)
  total = sent.sum(0)
  np.testing.assert_array_equal(np.flatnonzero(mean), np.sort(same[1:3]))
  np.testing.assert_array_equal(k * mean[same[1:3]], total[same[1:3]])
  np.testing.assert_array_equal(kept[p0], np.where(mean == 0, total, 0))
  assert not np.delete(kept, p0, axis=0).any()


def test_non_finite_shows_on_every_worker_and_is_never_kept():
  """Worker 1 sends NaN (as sparsify does on a non-finite step) into tiny
  tables: ĝ is NaN on every worker, no kept entry is non-finite."""
  k = NUM_WORKERS
  if k < 2:
    pytest.skip("needs 2 workers (a second one's values)")
  same, _ = _one_partition(k * C)
  indices = same.reshape(k, C).astype(np.int32)
  values = _int_values((k, C), 5)
  values[1] = np.nan
  [(mean, kept, _)] = _run_direct(k, 1.0, 1 / C,
                                  [(N, values, indices)])
  assert np.isnan(mean).all()
  assert np.isfinite(kept).all() and kept[0].any()


def test_random_sets_tiny_tables_overflow_into_kept():
  """r1 + r2 = 3 slots per row, U = 1 per partition: at most K entries are
  pulled; every other index sent is waiting in some worker's kept."""
  k = NUM_WORKERS
  rng = np.random.default_rng(2)
  indices = np.stack([rng.choice(N, C, replace=False) for _ in range(k)])
  indices[:, -2:] = N                               # empty slots
  indices[0, 0] = 0
  values = _int_values((k, C), 3, signs=False)      # sums cannot cancel
  mean, kept, sent = _exact_run(1.0, 1 / C, values, indices)
  assert np.count_nonzero(mean) <= k                # U = 1 per partition
  distinct = np.unique(indices[indices < N]).size
  waiting = np.count_nonzero(kept.sum(0))
  assert waiting >= distinct - k
  assert np.count_nonzero(mean) + waiting >= distinct


# --- check, steps, host helpers ----------------------------------------------------

def test_check_names_the_bucket():
  z = collectives.get("zen")
  z.check("bucket 3", hp.MAX_PARTITIONS, plan_lib.Settings())
  z.check_axes("bucket 3", ("host", "local"), plan_lib.Settings())
  with pytest.raises(collectives.SchemeError, match="bucket 3.*allgather"):
    z.check("bucket 3", hp.MAX_PARTITIONS + 1, plan_lib.Settings())


def _class_max(n, k, seed=0):
  part = np.asarray(hp.partition_of(np.arange(n, dtype=np.int32), k,
                                    seed=seed))
  return int(np.bincount(part, minlength=k).max())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("union", [0.02, 0.2, 1.0])
def test_steps_bytes_and_bitmap_rule(dtype, union):
  n, c, k = 6000, 60, 4
  unit = plan_lib.Unit((0,), n, c, 0.01, "topk", dtype)
  s, z = plan_lib.Settings(), collectives.Zen(union=union)
  push, pull = z.steps([unit], k, s)
  b = _class_max(n, k)
  r1 = math.ceil(2.0 * c / k)
  slots = min(r1 + math.ceil(r1 / 4), c, b,
              math.ceil(c / k + 4 * math.sqrt(c / k)))   # P per partition
  size = np.dtype(jnp.dtype(dtype)).itemsize
  assert push == collectives.Step(
      "alltoall", k * (4 * math.ceil(slots * size / 4) + 4 * slots))
  u = min(math.ceil(union * c), b)
  values = 4 * math.ceil(u * size / 4)
  coo, bitmap = values + 4 * u, values + 4 * math.ceil(b / 32)
  flag = 4                                      # the non-finite flag word
  assert pull == collectives.Step("allgather", min(coo, bitmap) + flag)
  assert (bitmap < coo) == (u > b / 32)       # union density above 1/32


@pytest.mark.parametrize("union,dtype", [(0.02, "float32"),
                                         (1.0, "bfloat16")])
def test_steps_bytes_are_the_buffers_sent(mesh, union, dtype):
  """The all_to_all and all_gather operands of the traced sync are as many
  bytes as ``steps`` says (COO at union 0.02, the bitmap at 1 on 8 workers)."""
  k = NUM_WORKERS
  units = [plan_lib.Unit((0,), 900, 10, 0.01, "topk", dtype),
           plan_lib.Unit((1,), 3000, 31, 0.01, "topk", "float32")]
  s, z = plan_lib.Settings(), collectives.Zen(union=union)
  u = min(math.ceil(union * 41), _class_max(3900, k))
  assert zen_lib.layout(units, k, s, z).bitmap == (
      math.ceil(_class_max(3900, k) / 32) < u)

  def f(*xs):
    parts = [(xs[0][0], xs[1][0]), (xs[2][0], xs[3][0])]
    return z.sync(parts, units, "data", s).means
  on = NamedSharding(mesh, P("data"))
  args = [jax.ShapeDtypeStruct((k, c), t, sharding=on)
          for c, t in ((10, dtype), (10, jnp.int32), (31, jnp.float32),
                       (31, jnp.int32))]
  jaxpr = jax.make_jaxpr(jax.shard_map(f, mesh=mesh, in_specs=P("data"),
                                       out_specs=P()))(*args)
  sent = {}

  def walk(jx):
    for e in jx.eqns:
      if e.primitive.name in ("all_to_all", "all_gather",
                              "all_gather_invariant"):
        a = e.invars[0].aval
        sent[e.primitive.name.split("_inv")[0]] = a.size * a.dtype.itemsize
      for v in e.params.values():
        for sub in (v if isinstance(v, (list, tuple)) else [v]):
          if hasattr(sub, "eqns") or hasattr(sub, "jaxpr"):
            walk(getattr(sub, "jaxpr", sub))
  walk(jaxpr.jaxpr)
  steps = z.steps(units, k, s)
  assert sent == {"all_to_all": steps[0].nbytes,
                  "all_gather": steps[1].nbytes}


def test_host_h0_and_union_sizes():
  idx = np.arange(5000)
  for k in (3, 8):
    part = np.asarray(hp.partition_of(idx.astype(np.int32), k, seed=7))
    np.testing.assert_array_equal(hp.partition_of_host(idx, k, seed=7), part)
    assert zen_lib.partition_sizes(5000, k, 7) == tuple(
        np.bincount(part, minlength=k))
  a = np.array([0, 5, 9, 5000, 77])                 # 5000: out of range
  part = np.asarray(hp.partition_of(np.array([0, 5, 9, 77, 123]), 4))
  same = zen_lib.union_sizes([a, a, a], 4, 5000)
  np.testing.assert_array_equal(same, np.bincount(part[:4], minlength=4))
  grown = zen_lib.union_sizes([a, np.array([123, 9])], 4, 5000)
  np.testing.assert_array_equal(grown, np.bincount(part, minlength=4))


def test_bitmap_ranks_count_the_class_before_each_index():
  """rank(i) = |{i' < i : h0(i') = h0(i)}|, by a plain counting loop."""
  for n, k in ((1000, 3), (77, 8)):
    part, rank = jax.jit(lambda n=n, k=k: zen_lib._ranks(n, k, 5))()
    h = np.asarray(hp.partition_of(np.arange(n, dtype=np.int32), k, seed=5))
    want, seen = [], [0] * k
    for p in h:
      want.append(seen[p])
      seen[p] += 1
    np.testing.assert_array_equal(np.asarray(part), h)
    np.testing.assert_array_equal(np.asarray(rank), want)
