"""Plans: strategies, backward-ready order, JSON, and every bad input."""

import dataclasses
import inspect
import json
import math
import pathlib

from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
import jax
from jax.sharding import PartitionSpec as P
import jax.numpy as jnp
import numpy as np
import pytest

import jaxfuse
from jaxfuse import collectives
from jaxfuse import plans as plan_lib
from jaxfuse.sync import bucket_steps

from _harness import gathered_words, init, list_plan, shard, sharded_update
from _harness import sync
from _harness import NUM_WORKERS as K


# --- strategies ----------------------------------------------------------------

@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(1, 5000), min_size=1, max_size=30),
       strategy=st.sampled_from(jaxfuse.STRATEGIES),
       num_buckets=st.integers(1, 8), bucket_bytes=st.integers(100, 40000),
       density=st.sampled_from([0.001, 0.01, 0.2, 1.0]))
def test_every_strategy_gives_a_valid_plan(sizes, strategy, num_buckets,
                                           bucket_bytes, density):
  rng = np.random.default_rng(len(sizes))
  order = [int(i) for i in rng.permutation(len(sizes))]
  plan = list_plan([(s,) for s in sizes], strategy=strategy, density=density,
                   num_buckets=num_buckets, bucket_bytes=bucket_bytes,
                   settings=jaxfuse.Settings(min_sparse_size=100),
                   order=order)
  # every leaf exactly once, and the backward-ready order kept
  assert list(plan.ready_order) != [] and sorted(plan.ready_order) == list(
      range(len(sizes)))
  pos = {leaf: i for i, leaf in enumerate(order)}
  buckets = [[pos[j] for j in b.leaves] for b in plan.buckets]
  assert all(b == sorted(b) for b in buckets)
  for leaf in plan.leaves:
    sparse = density < 1 and leaf.size >= 100
    assert leaf.mode == ("sparse" if sparse else "dense")
    if sparse:
      assert leaf.capacity == max(1, min(leaf.size, math.ceil(
          density * leaf.size * 1.5)))
  for b in plan.buckets:
    mode = {plan.leaves[j].mode for j in b.leaves}
    assert len(mode) == 1
    assert b.collective == ("allgather" if mode == {"sparse"} else "psum")
    assert b.sparsify == ("behind" if strategy == "behind" and
                          b.collective == "allgather" else "ahead")
  _assert_groups(plan, order, _rule_groups(strategy, order, sizes,
                                           num_buckets, bucket_bytes))


def _rule_groups(strategy, order, sizes, num_buckets, bucket_bytes):
  """Oracle: the group id of each ready position under the strategy's rule
  (float32 leaves of ``sizes`` elements)."""
  if strategy == "layerwise":
    return list(range(len(order)))
  if strategy == "single":
    return [0] * len(order)
  if strategy == "aligned":
    per = math.ceil(len(sizes) / num_buckets)
    return [p // per for p in range(len(order))]
  group, gid, filled = [], 0, 0
  for i in order:
    group.append(gid)
    filled += 4 * sizes[i]
    if filled >= bucket_bytes:
      gid, filled = gid + 1, 0
  return group


def _assert_groups(plan, order, group):
  """Each bucket lies in one group, each group is one sparse and one dense
  bucket at most, issued in ready order, and every leaf is in its group's
  bucket of its mode."""
  pos = {leaf: i for i, leaf in enumerate(order)}
  seen = set()
  for b in plan.buckets:
    gids = {group[pos[j]] for j in b.leaves}
    assert len(gids) == 1
    key = (gids.pop(), b.collective)
    assert key not in seen
    seen.add(key)
  bucket_groups = [group[pos[b.leaves[0]]] for b in plan.buckets]
  assert bucket_groups == sorted(bucket_groups)  # issued in ready order
  for p, i in enumerate(order):
    assert (group[p], "allgather" if plan.leaves[i].mode == "sparse"
            else "psum") in seen


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(1, 5000), min_size=1, max_size=30),
       strategy=st.sampled_from(jaxfuse.STRATEGIES),
       num_buckets=st.integers(1, 8), bucket_bytes=st.integers(100, 40000),
       last=st.integers(1, 40000))
def test_last_bucket_bytes_cuts_only_the_last_group(sizes, strategy,
                                                    num_buckets, bucket_bytes,
                                                    last):
  """The rule's last group, where it has two leaves or more and more than
  ``last`` bytes, becomes two: its longest run of trailing leaves within
  ``last`` bytes (at least one leaf, never all), and the rest. Every other
  group is the rule's."""
  rng = np.random.default_rng(len(sizes))
  order = [int(i) for i in rng.permutation(len(sizes))]
  plan = list_plan([(s,) for s in sizes], strategy=strategy, density=0.01,
                   num_buckets=num_buckets, bucket_bytes=bucket_bytes,
                   last_bucket_bytes=last,
                   settings=jaxfuse.Settings(min_sparse_size=100),
                   order=order)
  group = _rule_groups(strategy, order, sizes, num_buckets, bucket_bytes)
  members = [p for p, g in enumerate(group) if g == group[-1]]
  nbytes = [4 * sizes[order[p]] for p in members]
  if len(members) > 1 and sum(nbytes) > last:
    tail = max([t for t in range(1, len(members))
                if sum(nbytes[-t:]) <= last], default=1)
    group = group[:-tail] + [group[-1] + 1] * tail
  _assert_groups(plan, order, group)
  assert plan.provenance["parameters"]["last_bucket_bytes"] == last


def test_last_bucket_bytes_by_hand():
  """Leaves of 40, 8, 16, 12 bytes in ready order, one group: at most 30
  bytes last takes the 16 and the 12 (28); at most 10 only the 12; at
  most 200 (the whole group fits) cuts nothing."""
  def groups(last):
    plan = list_plan([(10,), (2,), (4,), (3,)], strategy="single",
                     density=1.0, last_bucket_bytes=last,
                     order=[0, 1, 2, 3])
    return [list(b.leaves) for b in plan.buckets]
  assert groups(30) == groups(np.int64(30)) == [[0, 1], [2, 3]]
  assert groups(10) == [[0, 1, 2], [3]]
  assert groups(200) == [[0, 1, 2, 3]]


# --- backward-ready order --------------------------------------------------------

def _three_layer_loss(params, x):
  h = jnp.tanh(x @ params["b_in"])
  h = jnp.tanh(h @ params["c_mid"])
  return jnp.sum(h @ params["a_out"])


def _three_layer_params():
  return {"a_out": jnp.ones((16, 2)), "b_in": jnp.ones((4, 16)),
          "c_mid": jnp.ones((16, 16))}


@pytest.mark.parametrize("jit_loss", [False, True])
def test_ready_order_follows_the_backward_pass(jit_loss):
  loss = jax.jit(_three_layer_loss) if jit_loss else _three_layer_loss
  params = _three_layer_params()
  plan = jaxfuse.plan(params, strategy="layerwise",
                      settings=jaxfuse.Settings(min_sparse_size=1),
                      order=jaxfuse.planning.ordering.FromLoss(
                          loss, (jnp.ones((3, 4)),)))
  names = [plan.leaves[i].path for i in plan.ready_order]
  assert names == ["['a_out']", "['c_mid']", "['b_in']"]
  assert plan.provenance["ready_order"] == "jaxpr"
  # without a loss: reverse pytree order, and the plan says so
  plan = jaxfuse.plan(params, strategy="layerwise",
                      settings=jaxfuse.Settings(min_sparse_size=1))
  assert [plan.leaves[i].path for i in plan.ready_order] == [
      "['c_mid']", "['b_in']", "['a_out']"]
  assert plan.provenance["ready_order"] == "reverse_pytree"


def test_plan_records_the_backward_order_that_buckets_hide():
  """``single`` lists its sparse bucket first, so its ready_order is not
  the backward's; the plan keeps the backward's (what ``simulate`` uses)."""
  params = _three_layer_params()
  plan = jaxfuse.plan(params, strategy="single",
                      settings=jaxfuse.Settings(min_sparse_size=200),
                      order=jaxfuse.planning.ordering.FromLoss(
                          _three_layer_loss, (jnp.ones((3, 4)),)))
  names = lambda ids: [plan.leaves[i].path for i in ids]
  assert names(plan.ready_order) == ["['c_mid']", "['a_out']", "['b_in']"]
  assert names(plan.provenance["backward_order"]) == [
      "['a_out']", "['c_mid']", "['b_in']"]


# --- JSON ------------------------------------------------------------------------

def test_json_round_trip(tmp_path):
  params = {"w": jnp.ones((64, 64)), "b": jnp.ones(3, jnp.bfloat16),
            "e": jnp.ones((100, 20), jnp.bfloat16)}
  for strategy in jaxfuse.STRATEGIES:
    plan = jaxfuse.plan(params, strategy=strategy, density=0.05,
                        estimator="sidco", settings=jaxfuse.Settings(
                            min_sparse_size=10,
                            estimation=jaxfuse.Estimation(refresh=3)))
    path = tmp_path / f"{strategy}.json"
    plan.save(path)
    loaded = jaxfuse.Plan.load(path)
    assert loaded == plan
    assert json.loads(path.read_text())["format"] == "jaxfuse.plan"
    loaded.validate(params)


def test_summary_names_each_buckets_scheme_and_settings():
  # a hand-made plan: the text is written out here, not by the code
  params = {"a": jnp.zeros((300, 200)), "b": jnp.zeros(1000),
            "c": jnp.zeros((64, 64))}
  plan = jaxfuse.plan(params, density=0.05, num_buckets=3,
                      collective=collectives.Zen(table=3.0))
  assert plan.summary().splitlines()[2:] == [
      "  bucket 0: Zen(table=3.0, union=1.0), ahead, 1 leaf (ρ 0.05, dgc): "
      "['c']",
      "  bucket 1: psum, 1 leaf: ['b']",
      "  bucket 2: Zen(table=3.0, union=1.0), ahead, 1 leaf (ρ 0.05, dgc): "
      "['a']"]
  behind = jaxfuse.plan(params, density=0.05, strategy="behind",
                        collective=collectives.Hier(inner="zen"))
  lines = behind.summary().splitlines()
  assert lines[0] == ("jaxfuse plan: 3 leaves, 2 buckets, "
                      "strategy=behind")
  # capacity ⌈ρ·n·headroom⌉ over both leaves: ⌈0.05·(4096 + 60000)·1.5⌉
  assert lines[2] == (
      "  bucket 0: Hier(inner=Zen(table=2.0, union=1.0)), behind (ρ 0.05, "
      "dgc, capacity 4,808), 2 leaves: ['c'], ['a']")
  # per worker: ⌈0.05·60000·1.5⌉ + ⌈0.05·4096·1.5⌉ = 4500 + 308 slots of
  # 8 bytes, and 'b' whole (4000 bytes): 42,464 over 65,096 parameters
  gather = jaxfuse.plan(params, density=0.05, num_buckets=3,
                        collective="allgather")
  assert gather.summary().splitlines()[1] == (
      "  dense bytes 260,384; wire bytes per worker 42,464 (0.6523 per "
      "parameter)")
  # a bucket kept without its scheme reads as the scheme's defaults
  bare = dataclasses.replace(plan, buckets=tuple(
      dataclasses.replace(b, scheme=None) for b in plan.buckets))
  assert "bucket 0: Zen(table=2.0, union=1.0), ahead" in bare.summary()


def _plan_json():
  return json.loads(list_plan(
      [(100, 10), (5,)], density=0.1,
      settings=jaxfuse.Settings(min_sparse_size=10)).to_json())


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.update(version=99), "newer than this jaxfuse"),
    (lambda d: d.update(version="one"), "'version'"),
    (lambda d: d.update(format="other"), "not a jaxfuse plan"),
    (lambda d: d["leaves"][0].update(mode="half"), "mode='half'"),
    (lambda d: d["leaves"][0].update(estimator="magic"), "estimator='magic'"),
    (lambda d: d["leaves"][0].update(capacity=0), "capacity=0"),
    (lambda d: d["leaves"][0].update(density=0), "density=0"),
    (lambda d: d["leaves"][0].update(density=1.5), "density=1.5"),
    (lambda d: d["leaves"][0].update(shape=[0, 3]), "zero elements"),
    (lambda d: d["buckets"][0].update(collective="bcast"), "collective='bcast'"),
    (lambda d: d["buckets"][0].update(sparsify="sideways"), "sparsify="),
    (lambda d: d["buckets"][0].update(leaves=[]), "has no leaves"),
    (lambda d: d["buckets"].pop(), "exactly one bucket"),
    (lambda d: d["leaves"][0].pop("shape"), "corrupted"),
    (lambda d: d["settings"].update(headroom=0.5), "headroom"),
])
def test_bad_plan_json(mutate, message):
  body = _plan_json()
  mutate(body)
  with pytest.raises(jaxfuse.PlanError, match=message):
    jaxfuse.Plan.from_json(json.dumps(body))


def test_corrupted_json_file(tmp_path):
  path = tmp_path / "plan.json"
  path.write_text(list_plan([(100,)]).to_json()[:-20])
  with pytest.raises(jaxfuse.PlanError, match="not valid JSON"):
    jaxfuse.Plan.load(path)


# --- bad input to plan() and init() ------------------------------------------------

@pytest.mark.parametrize("kwargs, message", [
    (dict(density=0.0), "density=0.0"),
    (dict(density=1.2), "density=1.2"),
    (dict(strategy="greedy"), "strategy='greedy'"),
    (dict(estimator="oracle"), "estimator='oracle'"),
    (dict(num_buckets=0), "num_buckets=0"),
    (dict(settings=jaxfuse.Settings(headroom=0.9)), "headroom=0.9"),
    (dict(settings=jaxfuse.Settings(headroom=float("nan"))), "headroom=nan"),
    (dict(settings=jaxfuse.Settings(headroom=True)), "headroom=True"),
    (dict(last_bucket_bytes=0), "last_bucket_bytes=0"),
    (dict(last_bucket_bytes=2.5), "last_bucket_bytes=2.5"),
    (dict(last_bucket_bytes=True), "last_bucket_bytes=True"),
    (dict(last_bucket_bytes=64, strategy="cupcake", costs=None),
     "strategy='cupcake' chooses its groups"),
])
def test_bad_plan_arguments(kwargs, message):
  with pytest.raises(jaxfuse.PlanError, match=message):
    list_plan([(100,)], **kwargs)


def test_plan_headroom_default_is_the_settings_default():
  """plan()'s default and its error's "by default" figure are Settings'."""
  default = inspect.signature(jaxfuse.plan).parameters["settings"].default
  assert default.headroom == plan_lib.Settings().headroom == 1.5
  with pytest.raises(jaxfuse.PlanError, match=r"1\.5 by default"):
    list_plan([(100,)],
              settings=jaxfuse.Settings(headroom=0.5))


def test_zero_size_leaf_is_rejected():
  with pytest.raises(jaxfuse.PlanError, match=r"leaf \['empty'\].*zero"):
    jaxfuse.plan({"w": jnp.ones(3), "empty": jnp.ones((0, 4))})


def test_init_names_the_mismatched_leaf():
  params = {"w": jnp.ones((32, 32)), "b": jnp.ones(32)}
  tx = jaxfuse.sparse_sync(jaxfuse.plan(params))
  with pytest.raises(jaxfuse.PlanError, match=r"\['w'\].*float32\[32, 32\]"):
    tx.init({"w": jnp.ones((32, 31)), "b": jnp.ones(32)})
  with pytest.raises(jaxfuse.PlanError, match=r"\['b'\].*bfloat16"):
    tx.init({"w": jnp.ones((32, 32)), "b": jnp.ones(32, jnp.bfloat16)})
  with pytest.raises(jaxfuse.PlanError, match=r"\['extra'\]"):
    tx.init({"w": jnp.ones((32, 32)), "b": jnp.ones(32), "extra": jnp.ones(2)})
  with pytest.raises(TypeError, match="jaxfuse.Plan"):
    jaxfuse.sparse_sync({"density": 0.1})


# --- bad use of the update ---------------------------------------------------------

def test_update_outside_shard_map_is_a_clear_error():
  params = {"w": jnp.ones((64, 64))}
  tx = jaxfuse.sparse_sync(jaxfuse.plan(params))
  with pytest.raises(jaxfuse.SyncError, match="inside jax.shard_map"):
    tx.update(params, tx.init(params))


def test_unbound_axis_name_is_a_clear_error(mesh):
  plan = list_plan([(64, 64)])
  tx = jaxfuse.sparse_sync(plan, axis_name="batch")
  state = init(plan, mesh)
  specs = jaxfuse.state_specs(state)
  f = sharded_update(tx, mesh, specs)
  with pytest.raises(jaxfuse.SyncError, match="'batch'"):
    jax.jit(f)(shard(mesh, [jnp.ones((K, 64, 64))]), state)


def test_replicated_gradients_are_a_clear_error(mesh):
  """Differentiating replicated params sums over workers: say what to do."""
  params = {"w": jnp.ones((64, 64))}
  plan = jaxfuse.plan(params)
  tx = jaxfuse.sparse_sync(plan)
  state = jaxfuse.init_state(tx, params, mesh)
  specs = jaxfuse.state_specs(state)

  def local(params, state, x):
    grads = jax.grad(lambda p: jnp.sum(x @ p["w"]))(params)
    return tx.update(grads, state)

  f = jax.shard_map(local, mesh=mesh, in_specs=(P(), specs, P("data")),
                    out_specs=(P(), specs))
  with pytest.raises(jaxfuse.SyncError, match="local_params"):
    jax.jit(f)(params, state, shard(mesh, jnp.ones((K, 64))))


def test_gradient_tree_mismatch_names_the_leaf(mesh):
  plan = list_plan([(64, 64), (10,)])
  state = init(plan, mesh)
  tx = jaxfuse.sparse_sync(plan)
  specs = jaxfuse.state_specs(state)
  f = sharded_update(tx, mesh, specs, lambda g: [g[0][0], g[1][0, :5]])
  with pytest.raises(jaxfuse.PlanError, match=r"gradient \[1\].*float32\[5\]"):
    jax.jit(f)(shard(mesh, [jnp.ones((K, 64, 64)), jnp.ones((K, 10))]), state)


def test_state_passed_replicated_is_a_clear_error(mesh):
  plan = list_plan([(64, 64)])
  state = jax.tree.map(lambda x: jnp.concatenate([x] * 2), init(plan, mesh))
  tx = jaxfuse.sparse_sync(plan)
  specs = jaxfuse.state_specs(state)
  f = sharded_update(tx, mesh, specs)
  with pytest.raises(jaxfuse.SyncError, match="state_specs"):
    jax.jit(f)(shard(mesh, [jnp.ones((K, 64, 64))]), state)


def test_wire_bytes_match_the_buffers(mesh):
  plan = list_plan([(1000,), (3000,), (10,)], density=0.01, strategy="single",
                   settings=jaxfuse.Settings(min_sparse_size=100))
  units, _ = plan_lib.units(plan)
  payload = sum(8 * u.capacity for u in units)
  assert plan.bytes_per_worker() == payload + 4 * 10
  _, state = sync(plan, mesh, [jnp.ones((K, 1000)), jnp.ones((K, 3000)),
                               jnp.ones((K, 10))], init(plan, mesh))
  # Sent per worker: ring all_gather passes on K-1 payloads; ring all-reduce
  # of the 40 dense bytes sends 2(K-1)/K of them.
  expect = (K - 1) * payload + math.ceil(2 * (K - 1) * 40 / K)
  np.testing.assert_array_equal(np.asarray(state.stats.wire_bytes), expect)


def test_packed_indices_send_the_same_in_fewer_bytes(mesh):
  """``packed_indices``: the 1000- and 3000-element leaves' indices in 10
  and 12 bits; ĝ and the residuals bitwise as with int32 indices, on
  c + ⌈c·b/32⌉ words a unit."""
  shapes = [(1000,), (3000,), (10,)]
  plain, packed = (list_plan(shapes, density=0.01, strategy="single",
                             settings=jaxfuse.Settings(min_sparse_size=100),
                             collective=jaxfuse.collectives.AllGather(
                                 packed_indices=p))
                   for p in (False, True))
  units, _ = plan_lib.units(packed)
  bits = {1000: 10, 3000: 12}
  payload = sum(4 * (u.capacity + -(-u.capacity * bits[u.size] // 32))
                for u in units)
  assert packed.bytes_per_worker() == payload + 4 * 10
  assert plain.bytes_per_worker() == sum(8 * u.capacity for u in units) + 40
  assert gathered_words(packed, mesh) == [payload // 4]   # one bucket
  rng = np.random.default_rng(0)
  states = [init(plain, mesh), init(packed, mesh)]
  for _ in range(2):
    grads = [jnp.asarray(rng.normal(size=(K,) + s), jnp.float32)
             for s in shapes]
    (a, states[0]), (b, states[1]) = (sync(p, mesh, grads, st) for p, st in
                                      zip((plain, packed), states))
    for x, y in zip(a + list(jaxfuse.unit_residuals(plain, states[0])),
                    b + list(jaxfuse.unit_residuals(packed, states[1]))):
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  expect = (K - 1) * payload + math.ceil(2 * (K - 1) * 40 / K)
  np.testing.assert_array_equal(np.asarray(states[1].stats.wire_bytes),
                                expect)


@pytest.mark.parametrize("scheme", [
    collectives.Zen(), collectives.SparDL(),
    collectives.Hier(inner=collectives.Zen()),
    collectives.Hier(inner=collectives.SparDL())], ids=repr)
def test_packed_indices_leave_other_schemes_int32(scheme):
  """ZEN and SparDL (alone or over hier's hosts) move int32 indices: only
  ``AllGather(packed_indices=True)`` (alone or as hier's inner) packs
  them; the per-worker payload is the unpacked all-gather's."""
  def made(collective):
    return list_plan([(1000,), (3000,)], density=0.01, strategy="single",
                     settings=jaxfuse.Settings(min_sparse_size=100),
                     collective=collective)
  plain = made(collectives.AllGather())
  other = made(scheme)
  assert other.bytes_per_worker() == plain.bytes_per_worker()
  assert {u.index_bits for u in bucket_steps.compile_plan(
      other).wire_units} == {32}
  for packing in (collectives.AllGather(packed_indices=True),
                  collectives.Hier(inner=collectives.AllGather(
                      packed_indices=True))):
    assert {u.index_bits for u in bucket_steps.compile_plan(
        made(packing)).wire_units} == {10, 12}


def test_integer_leaves_are_dense_and_pass_through(mesh):
  """float0 gradients of integer leaves (jax.grad(..., allow_int=True))."""
  params = {"w": jnp.ones((64, 64)), "n": jnp.arange(3)}
  plan = jaxfuse.plan(params,
                      settings=jaxfuse.Settings(min_sparse_size=1))
  assert [l.mode for l in plan.leaves] == ["dense", "sparse"]
  tx = jaxfuse.sparse_sync(plan)
  state = jaxfuse.init_state(tx, params, mesh)
  specs = jaxfuse.state_specs(state)

  def local(params, state, x):
    grads = jax.grad(lambda p: jnp.sum(x @ p["w"]) + 0.0 * p["n"].sum(),
                     allow_int=True)(jaxfuse.local_params(params))
    updates, state = tx.update(grads, state)
    passed.append((updates["n"].dtype, updates["n"].shape))
    return updates["w"], state

  passed = []
  f = jax.shard_map(local, mesh=mesh, in_specs=(P(), specs, P("data")),
                    out_specs=(P(), specs))
  x = jnp.arange(K * 64, dtype=jnp.float32).reshape(K, 1, 64)
  w, state = jax.jit(f)(params, state, shard(mesh, x))
  assert passed == [(jax.dtypes.float0, (3,))]   # n's float0 gradient as is
  assert not np.asarray(state.stats.missing).any()
  # w's gradient on worker k is x_k down the rows (g_k[i, j] = x_k[i]): what
  # the workers sent (K·w) and kept (their residuals) is all of it
  selected = np.asarray(state.stats.selected)[:, 1]
  assert 0 < np.count_nonzero(np.asarray(w)) <= selected.sum()
  (kept,) = jaxfuse.unit_residuals(plan, state)
  grads = np.repeat(np.asarray(x).reshape(K, 64, 1), 64, axis=2)
  np.testing.assert_allclose(K * np.asarray(w, np.float64).ravel() +
                             np.asarray(kept, np.float64).sum(0),
                             grads.reshape(K, -1).sum(0), rtol=1e-6)


# --- each scheme owns its configuration --------------------------------------

_SCHEME_PARAMS = {"w": jax.ShapeDtypeStruct((64, 64), jnp.float32),
                  "b": jax.ShapeDtypeStruct((8,), jnp.float32)}


@pytest.mark.parametrize("scheme,old", [
    (collectives.Zen(table=3.0, union=0.5),
     dict(collective="zen", zen_table=3.0, zen_union=0.5)),
    (collectives.SparDL(teams=2, block=1.5),
     dict(collective="spardl", spardl_teams=2, spardl_block=1.5)),
    (collectives.Hier(inner=collectives.Zen(table=1.5)),
     dict(collective="hier", hier_inner="zen", zen_table=1.5)),
    (collectives.Hier(inner=collectives.AllGather(packed_indices=True)),
     dict(collective="hier", packed_indices=True)),
    (collectives.AllGather(packed_indices=True),
     dict(packed_indices=True)),
])
def test_a_scheme_object_plans_as_0_2s_keywords(scheme, old):
  """``collective=`` takes a configured scheme; 0.2's keywords still make
  the same plan, each warning with its new spelling; the plan's buckets
  run that very configuration."""
  new = jaxfuse.plan(_SCHEME_PARAMS, density=0.05, collective=scheme)
  with pytest.warns(DeprecationWarning,
                    match=r"jaxfuse.plan\(\w+=\.\.\.\) is deprecated.*"
                    r"collective=jaxfuse.collectives.\w+\("):
    was = jaxfuse.plan(_SCHEME_PARAMS, density=0.05, **old)
  assert new == was
  (sparse,) = [b for b in bucket_steps.compile_plan(new).buckets
               if b.kind == bucket_steps.SPARSE]
  assert sparse.scheme == scheme
  assert new.buckets[sparse.index].collective == scheme.name


def test_a_scheme_name_gives_its_defaults_and_bad_ones_are_named():
  plan = jaxfuse.plan(_SCHEME_PARAMS, density=0.05, collective="spardl")
  (sparse,) = [b for b in plan.buckets if b.collective != "psum"]
  assert sparse.scheme == collectives.of_bucket(sparse) == (
      collectives.SparDL())
  assert collectives.Hier(inner="spardl").inner == collectives.SparDL()
  with pytest.raises(jaxfuse.PlanError, match=r"Hier\(inner='psum'\).*one "
                     r"of \('allgather', 'zen', 'spardl'\)"):
    collectives.Hier(inner="psum")
  with pytest.raises(jaxfuse.PlanError, match=r"collective=Zen\(.*leave "
                     r"\['zen_table'\] out"):
    jaxfuse.plan(_SCHEME_PARAMS, collective=collectives.Zen(),
                 zen_table=2.0)
  with pytest.raises(jaxfuse.PlanError, match=r"collective=Psum\(\).*"
                     r"AllGather, Zen, SparDL, Hier"):
    jaxfuse.plan(_SCHEME_PARAMS, collective=collectives.Psum())
  with pytest.raises(TypeError, match="zen_tabel"):
    jaxfuse.plan(_SCHEME_PARAMS, zen_tabel=2.0)


# --- plan files: format 2, and 0.2's format 1 converted ---------------------

_V1_PLAN = (pathlib.Path(__file__).parent / "data" / "checkpoint_0.2" / "ckpt"
            / "3" / "plan" / "metadata")


def _v1_body(**settings):
  """A format-1 plan body as jaxfuse 0.2 wrote it: two sparse leaves in a
  ``"zen"``, a ``"hier"`` and an ``"allgather"`` bucket, a dense one in
  ``"psum"``; ``settings`` over 0.2's defaults."""
  defaults = {"headroom": 1.5, "min_sparse_size": 10, "refresh": 1,
              "feedback": True, "sample_fraction": 0.01, "sidco_stages": 2,
              "seed": 0, "zen_table": 2.0, "zen_union": 1.0,
              "spardl_teams": 1, "hier_inner": "allgather",
              "spardl_block": 2.0, "residual_dtype": "float32",
              "full_wire": "gradient", "sparse_wire": "gradient",
              "packed_indices": False}
  leaf = lambda p, n: {"path": p, "shape": [n], "dtype": "float32",
                       "mode": "sparse", "density": 0.1,
                       "capacity": n // 10, "estimator": "dgc"}
  bucket = lambda ids, c: {"leaves": ids, "collective": c,
                           "sparsify": "ahead", "capacity": 0,
                           "estimator": None, "density": 1.0}
  return {"format": "jaxfuse.plan", "version": 1,
          "settings": dict(defaults, **settings),
          "provenance": {"strategy": "layerwise"},
          "leaves": [leaf("[0]", 100), leaf("[1]", 200), leaf("[2]", 300),
                     dict(leaf("[3]", 5), mode="dense", density=1.0,
                          capacity=5, estimator=None)],
          "buckets": [bucket([0], "zen"), bucket([1], "hier"),
                      bucket([2], "allgather"), bucket([3], "psum")]}


def test_a_format_1_plan_moves_the_scheme_knobs_into_its_buckets():
  body = _v1_body(zen_table=3.0, zen_union=0.5, spardl_teams=2,
                  spardl_block=1.5, hier_inner="spardl", packed_indices=True,
                  refresh=3, feedback=False, sample_fraction=0.05,
                  sidco_stages=4, seed=7, headroom=2.0)
  plan = jaxfuse.Plan.from_json(json.dumps(body))
  assert [b.scheme for b in plan.buckets] == [
      collectives.Zen(table=3.0, union=0.5),
      collectives.Hier(inner=collectives.SparDL(teams=2, block=1.5)),
      collectives.AllGather(packed_indices=True), None]
  assert plan.settings == jaxfuse.Settings(
      headroom=2.0, min_sparse_size=10, seed=7,
      estimation=jaxfuse.Estimation(refresh=3, feedback=False,
                                    sample_fraction=0.05, sidco_stages=4))
  again = json.loads(plan.to_json())
  assert again["version"] == 2
  assert again["buckets"][1]["scheme"] == {
      "name": "hier", "inner": {"name": "spardl", "teams": 2, "block": 1.5}}
  assert again["settings"]["estimation"] == {
      "refresh": 3, "feedback": False, "sample_fraction": 0.05,
      "sidco_stages": 4}
  assert "zen_table" not in again["settings"]
  assert jaxfuse.Plan.from_json(plan.to_json()) == plan


def test_a_plan_file_jaxfuse_0_2_wrote_loads_as_the_same_plan():
  """The plan of tests/data/checkpoint_0.2 (format 1, 0.2's defaults) is
  the plan this jaxfuse makes for the same arguments: its all-gather bucket
  with the default ``AllGather()``, and its state layout the same."""
  text = _V1_PLAN.read_text()
  assert json.loads(text)["version"] == 1
  old = jaxfuse.Plan.from_json(text)
  assert [b.scheme for b in old.buckets] == [collectives.AllGather(), None]
  assert old.settings == jaxfuse.Settings(min_sparse_size=256)
  made = plan_lib.Plan(old.leaves, tuple(
      dataclasses.replace(b, scheme=None) for b in old.buckets),
                       old.settings, old.provenance)
  assert bucket_steps.layout_digest(made) == bucket_steps.layout_digest(old)
  assert jaxfuse.Plan.from_json(old.to_json()) == old


@pytest.mark.parametrize("scheme", [
    collectives.AllGather(packed_indices=True), collectives.Zen(table=1.5),
    collectives.SparDL(teams=2, block=3.0),
    collectives.Hier(inner=collectives.Zen(union=0.25))], ids=repr)
def test_format_2_round_trip_keeps_each_buckets_scheme(tmp_path, scheme):
  plan = jaxfuse.plan(_SCHEME_PARAMS, density=0.05, collective=scheme,
                      settings=jaxfuse.Settings(
                          estimation=jaxfuse.Estimation(sidco_stages=3)))
  plan.save(tmp_path / "p.json")
  loaded = jaxfuse.Plan.load(tmp_path / "p.json")
  assert loaded == plan
  assert [b.scheme for b in loaded.buckets if b.collective != "psum"] == [
      scheme]
  assert loaded.settings.estimation.sidco_stages == 3


def test_a_bucket_scheme_with_an_unknown_field_is_named():
  body = json.loads(list_plan([(100, 10)], density=0.1,
                              settings=jaxfuse.Settings(
                                  min_sparse_size=10)).to_json())
  body["buckets"][0]["scheme"]["table"] = 2.0
  with pytest.raises(jaxfuse.PlanError,
                     match=r"scheme 'allgather' has no field\(s\) \['table'\]"):
    jaxfuse.Plan.from_json(json.dumps(body))
  body["buckets"][0]["scheme"] = {"name": "zen", "table": 2.0, "union": 1.0}
  with pytest.raises(jaxfuse.PlanError,
                     match=r"bucket 0: scheme=Zen\(.*is not a 'allgather'"):
    jaxfuse.Plan.from_json(json.dumps(body))


def test_0_2s_settings_and_order_keywords_plan_as_the_new_spelling():
  """0.2's ``headroom=`` … ``sidco_stages=``, ``ready_order=`` and
  ``loss_fn=``/``example_args=`` still make the same plan, each warning
  with its new spelling; with ``settings=`` as well they are refused."""
  params = _three_layer_params()
  new = jaxfuse.plan(params, strategy="layerwise", settings=jaxfuse.Settings(
      headroom=2.0, min_sparse_size=1, seed=3,
      estimation=jaxfuse.Estimation(refresh=3, sample_fraction=0.05)),
                     order=jaxfuse.planning.ordering.FromLoss(
                         _three_layer_loss, (jnp.ones((3, 4)),)))
  with pytest.warns(DeprecationWarning) as caught:
    was = jaxfuse.plan(params, strategy="layerwise", headroom=2.0,
                       min_sparse_size=1, seed=3, refresh=3,
                       sample_fraction=0.05, loss_fn=_three_layer_loss,
                       example_args=(jnp.ones((3, 4)),))
  assert was == new
  said = " ".join(str(w.message) for w in caught)
  assert ("settings=jaxfuse.Settings(headroom=2.0, min_sparse_size=1, "
          "seed=3, estimation=jaxfuse.Estimation(refresh=3, "
          "sample_fraction=0.05))") in said
  assert "order=jaxfuse.planning.ordering.FromLoss(" in said
  assert "removed in 0.4" in said
  with pytest.warns(DeprecationWarning, match=r"order=\[leaf ids\]"):
    given = jaxfuse.plan(params, ready_order=[2, 1, 0])
  assert given == jaxfuse.plan(params, order=[2, 1, 0])
  with pytest.raises(jaxfuse.PlanError, match=r"settings= and 0.2's "
                     r"\['headroom'\] given together"):
    jaxfuse.plan(params, headroom=2.0, settings=jaxfuse.Settings())
