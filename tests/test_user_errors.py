"""Bad input from a user: an exception that names the argument, field or
leaf and the fix, raised before anything is written; never an internal
TypeError, an XLA trace or a silently wrong result."""

import dataclasses
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxfuse
from jaxfuse.planning.costs import Costs, LinearCost

from _harness import list_plan
from _harness import mesh_of
from _harness import NUM_WORKERS
from _harness import shard
from _harness import sharded_update

PARAMS = {"w": jnp.ones((64, 64)), "b": jnp.ones(64)}


@pytest.fixture(scope="module")
def plan():
  return jaxfuse.plan(PARAMS, density=0.05)


# --- jaxfuse.plan's arguments ------------------------------------------------

@pytest.mark.parametrize("kwargs,message", [
    (dict(density=True), "density=True must be a number in (0, 1]"),
    (dict(density="0.05"), "density='0.05' must be a number"),
    (dict(strategy="size", bucket_bytes="25M"),
     "bucket_bytes='25M' must be an int > 0"),
    (dict(strategy="size", bucket_bytes=2.5e7), "bucket_bytes=25000000.0"),
    (dict(settings=jaxfuse.Settings(headroom=float("inf"))),
     "settings.headroom=inf must be a finite number"),
    (dict(settings=jaxfuse.Settings(
        estimation=jaxfuse.Estimation(sample_fraction="x"))),
     "settings.estimation.sample_fraction='x' must be a number"),
    (dict(settings=jaxfuse.Settings(seed="abc")),
     "settings.seed='abc' must be an integer"),
    (dict(settings=jaxfuse.Settings(
        estimation=jaxfuse.Estimation(feedback="no"))),
     "settings.estimation.feedback='no' must be True or False"),
    (dict(settings=jaxfuse.Settings(min_sparse_size=2.5)),
     "settings.min_sparse_size=2.5 must be an int"),
    (dict(settings={"headroom": 2.0}), "give a jaxfuse.Settings"),
    (dict(num_workers=0), "num_workers=0 must be an int >= 1"),
    (dict(num_workers=True), "num_workers=True must be an int >= 1"),
    (dict(order=["a", "b"]), "order must list each of the 2"),
    (dict(order=[0, 0]), "order must list each of the 2"),
    (dict(order=jaxfuse.planning.ordering.FromLoss("f")),
     "loss_fn='f' must be a function"),
])
def test_plan_names_the_bad_argument(kwargs, message):
  with pytest.raises(jaxfuse.PlanError) as e:
    jaxfuse.plan(PARAMS, **kwargs)
  assert message in str(e.value)


def test_numpy_scalars_are_numbers_and_save_as_json(tmp_path):
  """A numpy density, bucket size or count is accepted as its value, and
  the plan that records it saves and loads."""
  made = jaxfuse.plan(PARAMS, density=np.float32(0.0625), strategy="size",
                      bucket_bytes=np.int64(4096), num_workers=np.int32(2))
  want = jaxfuse.plan(PARAMS, density=0.0625, strategy="size",
                      bucket_bytes=4096, num_workers=2)
  assert made.leaves == want.leaves and made.buckets == want.buckets
  made.save(tmp_path / "p.json")
  loaded = jaxfuse.Plan.load(tmp_path / "p.json")
  assert loaded.leaves == want.leaves and loaded.buckets == want.buckets
  assert jaxfuse.with_density(made, np.float64(0.5)).leaves[1].density == 0.5


def test_numpy_scalars_elsewhere_are_their_values(plan):
  """Numbers a user computes with numpy (np.int64 step counts, np.float32
  betas) mean what their Python values mean, wherever a number goes."""
  got = jaxfuse.density_warmup(plan, dense_steps=np.int64(10),
                               steps=np.int32(5),
                               densities=[np.float32(0.25)],
                               workers=np.int64(2))
  want = jaxfuse.density_warmup(plan, dense_steps=10, steps=5,
                                densities=[0.25], workers=2)
  assert [(p.start, p.stop, p.plan) for p in got] == [
      (p.start, p.stop, p.plan) for p in want]
  assert all(type(p.start) is int for p in got)   # pylint: disable=unidiomatic-typecheck
  assert (jaxfuse.xla_flags(np.float64(1.5), gpus_per_node=np.int64(4)) ==
          jaxfuse.xla_flags(1.5, gpus_per_node=4))
  with pytest.raises(ValueError, match="network_gbytes_s=inf must be"):
    jaxfuse.xla_flags(float("inf"))
  jaxfuse.send_early(lambda x: x, window=np.int64(2))
  jaxfuse.onebit_adamw(plan, 1e-3, b1=np.float32(0.9), clip_norm=np.float64(1))
  jaxfuse.sparse_sync(plan, momentum=np.float32(0.9))
  # a hand-made plan whose capacity and bucket ids are numpy integers
  leaf = dataclasses.replace(plan.leaves[0],
                             capacity=np.int64(plan.leaves[0].capacity))
  bucket = dataclasses.replace(plan.buckets[0], leaves=tuple(
      np.int32(i) for i in plan.buckets[0].leaves))
  made = dataclasses.replace(plan, leaves=(leaf,) + plan.leaves[1:],
                             buckets=(bucket,) + plan.buckets[1:])
  assert jaxfuse.Plan.from_json(made.to_json()) == plan
  # jaxfuse.plan keeps plain numbers whatever it is given
  def kw(num):
    return dict(density=num(0.05), num_buckets=num(2), num_workers=num(4),
                settings=jaxfuse.Settings(
                    min_sparse_size=num(64), estimation=jaxfuse.Estimation(
                        refresh=num(2), sample_fraction=num(0.5))),
                collective=jaxfuse.collectives.SparDL(teams=num(2)),
                costs=_costs())
  numpy = lambda v: np.int64(v) if isinstance(v, int) else np.float64(v)
  got = jaxfuse.plan(PARAMS, **kw(numpy))
  assert got == jaxfuse.plan(PARAMS, **kw(lambda v: v))
  (scheme,) = {b.scheme for b in got.buckets if b.collective == "spardl"}
  for fields in (dataclasses.asdict(got.settings.estimation),
                 dataclasses.asdict(scheme),
                 {k: v for k, v in dataclasses.asdict(got.settings).items()
                  if k != "estimation"}):
    assert all(type(v) in (int, float, bool, str)  # pylint: disable=unidiomatic-typecheck
               for v in fields.values()), fields
  assert jaxfuse.make_mesh(np.int64(1)).size == 1


def test_complex_leaves_are_refused_not_left_unaveraged():
  with pytest.raises(jaxfuse.PlanError, match=r"leaf \['c'\]: complex64 "
                     "parameters are not supported"):
    jaxfuse.plan(dict(PARAMS, c=jnp.ones(8, jnp.complex64)))


@pytest.mark.parametrize("recipe", sorted(jaxfuse.optim.recipes.RECIPES))
def test_a_recipe_refuses_integer_leaves_it_cannot_train(recipe):
  """An integer leaf's gradient is float0, which no recipe's arithmetic
  takes: refused when the optimizer is made, naming the leaf, not a
  float0 TypeError from inside the traced step."""
  made = jaxfuse.plan(dict(PARAMS, n=jnp.arange(3)), density=0.05)
  with pytest.raises(jaxfuse.PlanError, match=(
      rf"^{recipe}: leaves \[\"\['n'\] \(int32\)\"\] are not floating point")):
    jaxfuse.optim.recipes.RECIPES[recipe](made, 1e-3)
  jaxfuse.optim.recipes.RECIPES[recipe](jaxfuse.plan(PARAMS, density=0.05), 1e-3)


@pytest.mark.parametrize("make", [
    lambda plan, n: jaxfuse.sparse_sync(plan, momentum=n(0.9),
                                        residual_decay=n(0.8)),
    lambda plan, n: jaxfuse.demo(plan, n(1e-2), momentum=n(0.9),
                                 weight_decay=n(1e-4), clip_norm=n(1.0)),
    lambda plan, n: jaxfuse.onebit_adamw(plan, n(1e-3), b1=n(0.9),
                                         b2=n(0.99), eps=n(1e-8),
                                         clip_norm=n(1.0)),
], ids=["sparse_sync", "demo", "onebit_adamw"])
def test_numpy_hyperparameters_step_as_python_floats(make):
  """JAX takes numpy scalars as typed: bf16 · np.float32(0.9) is float32.
  Given as numpy numbers, the hyperparameters must still keep a bfloat16
  residual bfloat16 and give bitwise the steps Python floats give."""
  mesh = mesh_of(NUM_WORKERS)
  params = {"w": jnp.ones((64, 64), jnp.bfloat16),
            "b": jnp.ones(64, jnp.bfloat16)}
  made = jaxfuse.plan(params, density=0.05,
                      settings=jaxfuse.Settings(
                          min_sparse_size=64, residual_dtype="gradient"))
  rng = np.random.default_rng(0)
  grads = [{k: jnp.asarray(rng.normal(size=(NUM_WORKERS,) + v.shape),
                           jnp.bfloat16) for k, v in params.items()}
           for _ in range(2)]
  runs = []
  for number in (float, np.float32):
    tx = make(made, number)
    state = jaxfuse.init_state(tx, params, mesh)
    step = jax.jit(sharded_update(tx, mesh, jaxfuse.state_specs(state),
                                  with_params=True))
    out = []
    for g in grads:
      update, state = step(shard(mesh, g), state, params)
      out.append(update)
    runs.append((out, state))
  (want, want_state), (got, got_state) = runs
  assert (jax.tree.map(lambda x: x.dtype, got_state) ==
          jax.tree.map(lambda x: x.dtype, want_state))
  for a, b in zip(jax.tree.leaves((got, got_state)),
                  jax.tree.leaves((want, want_state))):
    np.testing.assert_array_equal(np.asarray(a, np.float32),
                                  np.asarray(b, np.float32))


def test_a_failing_loss_names_example_args():
  def loss_fn(params, x):
    return jnp.sum(params["w"] @ x)
  with pytest.raises(jaxfuse.PlanError, match=r"reading the backward order: "
                     r"jax\.grad\(loss_fn\).*dot_general.*Give example_args "
                     "as one worker's batch"):
    jaxfuse.plan(PARAMS,
                 order=jaxfuse.planning.ordering.FromLoss(
                     loss_fn, (jnp.ones((3, 3)),)))
  with pytest.raises(jaxfuse.PlanError, match="missing 1 required"):
    jaxfuse.plan(PARAMS,
                 order=jaxfuse.planning.ordering.FromLoss(loss_fn))   # example_args left out


# --- plan files ---------------------------------------------------------------

@pytest.mark.parametrize("edit,message", [
    (lambda j: j["leaves"][0].update(shape="64x32"),
     "leaf ['b']: shape=('6', '4', 'x', '3', '2') must be a list of integers"),
    (lambda j: j["leaves"][1].update(shape=[64, -64]),
     "leaf ['w']: shape=(64, -64)"),
    (lambda j: j["leaves"][1].update(dtype="float33"),
     "leaf ['w']: dtype='float33' is not a dtype name"),
    (lambda j: j["settings"].update(headroom="1.5"),
     "settings.headroom='1.5' must be a finite number >= 1"),
    (lambda j: j["settings"].update(min_sparse_size=-5),
     "settings.min_sparse_size=-5 must be an integer >= 1"),
    (lambda j: j["settings"].update(seed="x"),
     "settings.seed='x' must be an integer"),
])
def test_a_plan_file_with_a_wrong_field_is_named(plan, edit, message):
  body = json.loads(plan.to_json())
  edit(body)
  with pytest.raises(jaxfuse.PlanError) as e:
    jaxfuse.Plan.from_json(json.dumps(body))
  assert message in str(e.value)


def test_a_binary_file_is_not_a_plan(tmp_path):
  path = tmp_path / "plan.json"
  path.write_bytes(b"\xff\xfe\x00 not text")
  with pytest.raises(jaxfuse.PlanError, match=f"{path} is not a jaxfuse "
                     r"plan \(not UTF-8"):
    jaxfuse.Plan.load(path)


class _NotJson:
  pass


def _costs():
  return Costs({"allgather": LinearCost(1e-4, 1e-9),
                "psum": LinearCost(1e-4, 2e-9)}, LinearCost(1e-5, 1e-8),
               (1e-3, 1e-3), overlap=0.5, forward=2e-3)


@pytest.mark.parametrize("kind", ["plan", "costs"])
def test_a_failed_save_keeps_the_old_file(tmp_path, plan, kind):
  """The file saved before is kept whole, byte for byte, and no temporary
  file is left beside it."""
  good = plan if kind == "plan" else _costs()
  path = tmp_path / f"{kind}.json"
  good.save(path)
  before = path.read_bytes()
  bad = dataclasses.replace(good, provenance={"x": _NotJson()})
  with pytest.raises(TypeError, match="_NotJson"):
    bad.save(path)
  assert path.read_bytes() == before
  assert os.listdir(tmp_path) == [path.name]
  type(good).load(path)   # still readable


# --- the wrong object where a plan, optimizer or mesh goes --------------------

@pytest.mark.parametrize("call,where", [
    (lambda: jaxfuse.sgd(None, 0.1), "sgd"),
    (lambda: jaxfuse.onebit_adamw(PARAMS, 1e-3), "onebit_adamw"),
    (lambda: jaxfuse.local_adamw(PARAMS, 1e-3), "local_adamw"),
    (lambda: jaxfuse.sync_adamw(PARAMS, 1e-3), "sync_adamw"),
    (lambda: jaxfuse.sparse_sync(PARAMS), "sparse_sync"),
    (lambda: jaxfuse.with_density(PARAMS, 0.1), "with_density"),
    (lambda: jaxfuse.density_warmup(PARAMS, steps=1), "density_warmup"),
])
def test_a_recipe_or_helper_given_no_plan_says_so(call, where):
  with pytest.raises(TypeError, match=f"^{where} expects a jaxfuse.Plan, got "
                     r"\w+; make one with jaxfuse.plan\(params\)"):
    call()


def test_init_state_names_what_it_was_given(plan):
  mesh = mesh_of(1)
  with pytest.raises(TypeError, match="init_state expects an optax "
                     "transform.*got Plan"):
    jaxfuse.init_state(plan, PARAMS, mesh)
  with pytest.raises(TypeError, match="init_state expects the "
                     "jax.sharding.Mesh.*got NoneType"):
    jaxfuse.init_state(jaxfuse.sgd(plan, 0.1), PARAMS, None)


@pytest.mark.parametrize("recipe", sorted(jaxfuse.RECIPES))
def test_every_recipe_names_the_leaves_that_differ_from_its_plan(plan,
                                                                 recipe):
  # A renamed leaf of the same shape (which onebit_adamw's grouping read
  # as another leaf of the wrong shape) and an extra leaf.
  opt = jaxfuse.RECIPES[recipe](plan, 1e-3)
  for params, only in [({"W": PARAMS["w"], "b": PARAMS["b"]},
                        r"in the plan only \[\"\['w'\]\"\], in the "
                        r"parameters only \[\"\['W'\]\"\]"),
                       (dict(PARAMS, c=jnp.ones(3)),
                        r"in the plan only \[\], in the parameters only "
                        r"\[\"\['c'\]\"\]")]:
    with pytest.raises(jaxfuse.PlanError, match="plan and parameters have "
                       "different leaves: " + only):
      jaxfuse.init_state(opt, params, mesh_of(1))


@pytest.mark.parametrize("made,used", [
    ("onebit_adamw", "sgd"), ("sgd", "onebit_adamw"),
    ("sync_adamw", "local_adamw"), ("sgd", "sgd+clip")])
def test_a_state_of_another_recipe_is_named(plan, made, used):
  # optax's chain would say only "The number of updates and states has to
  # be the same in chain!" (or nothing, where the lengths agree).
  mesh = mesh_of(1)
  make = lambda name: (jaxfuse.sgd(plan, 0.1, clip_norm=1.0)
                       if name == "sgd+clip"
                       else jaxfuse.RECIPES[name](plan, 1e-3))
  state = jaxfuse.init_state(make(made), PARAMS, mesh)
  name = used.split("+")[0]
  step = jax.jit(sharded_update(make(used), mesh,
                                jaxfuse.state_specs(state), with_params=True))
  grads = {k: jnp.ones((1,) + v.shape) for k, v in PARAMS.items()}
  with pytest.raises(jaxfuse.SyncError, match=(
      f"^{name}: the optimizer state is not one this optimizer made \\(it "
      r"is tuple\((\w+, )*\w+\); " + name + r"'s is tuple\(.*init_state\("
      + name)):
    step(shard(mesh, grads), state, PARAMS)
  same = jaxfuse.init_state(make(used), PARAMS, mesh)
  _, after = jax.jit(sharded_update(
      make(used), mesh, jaxfuse.state_specs(same), with_params=True))(
          shard(mesh, grads), same, PARAMS)
  assert jax.tree.structure(after) == jax.tree.structure(same)


def test_summarize_and_unit_residuals_check_the_plan(plan):
  mesh = mesh_of(1)
  state = jaxfuse.init_state(jaxfuse.sparse_sync(plan), PARAMS, mesh)
  stats = jaxfuse.sync_stats(state)
  other = jaxfuse.plan(dict(PARAMS, c=jnp.ones((32, 32))), density=0.05)
  with pytest.raises(ValueError, match="summarize: the stats have 2 leaves, "
                     "the plan 3: pass the plan of the phase"):
    jaxfuse.summarize(stats, other)
  with pytest.raises(TypeError, match="^summarize expects a jaxfuse.Plan"):
    jaxfuse.summarize(stats, PARAMS)
  wider = jaxfuse.plan({"w": jnp.ones((64, 128)), "b": jnp.ones(64)},
                       density=0.05)
  with pytest.raises(jaxfuse.SyncError, match=r"unit_residuals: the state's "
                     r"groups are \[\(1, 4096\)\] \(units × elements\), the "
                     r"plan's \[\(1, 8192\)\]"):
    jaxfuse.unit_residuals(wider, state)
  rows = jaxfuse.unit_residuals(plan, state)
  assert [r.shape for r in rows] == [(1, 4096)]


def test_a_state_of_another_layout_with_the_same_shapes_is_refused():
  # Two leaves of one shape in one bucket: plans with the two ready orders
  # have states of the same shapes whose residual rows belong to the
  # other leaf.
  params = {"a": jnp.ones((64, 64)), "b": jnp.ones((64, 64))}
  first, second = (jaxfuse.plan(params, density=0.05, strategy="single",
                                order=order) for order in ([0, 1], [1, 0]))
  mesh = mesh_of(2)
  state = jaxfuse.init_state(jaxfuse.sparse_sync(first), params, mesh)
  other = jaxfuse.init_state(jaxfuse.sparse_sync(second), params, mesh)
  shapes = lambda s: [x.shape for x in jax.tree.leaves(s)]
  assert shapes(state) == shapes(other) and state.layout != other.layout
  grads = shard(mesh, jax.tree.map(lambda x: jnp.stack([x, 2 * x]), params))

  def step(plan):
    tx = jaxfuse.sparse_sync(plan)
    return jax.jit(sharded_update(tx, mesh, jaxfuse.state_specs(state)))

  with pytest.raises(jaxfuse.SyncError, match=r"sparse_sync state was made "
                     r"for a plan of another layout \(its selection units "
                     r"differ from this plan's\): its rows hold other leaves "
                     r"here. Carry it to this plan with jaxfuse.relayout"):
    step(second)(grads, state)
  with pytest.raises(jaxfuse.SyncError, match="unit_residuals: the state "
                     "was made for a plan of another layout"):
    jaxfuse.unit_residuals(second, state)
  # a warm-up phase's plan (another density) shares the layout and the state
  assert len(jaxfuse.unit_residuals(jaxfuse.with_density(first, 0.2),
                                    state)) == 2
  _, after = step(jaxfuse.with_density(first, 0.2))(grads, state)
  assert after.layout == state.layout
  assert np.asarray(after.step).tolist() == [1, 1]


def test_the_layout_is_no_array_and_keeps_the_key_paths():
  # A checkpoint holds the arrays under the key paths of the fields: the
  # same as a plain NamedTuple's, so checkpoints saved before the layout
  # was carried restore, and no array is added.
  import typing  # pylint: disable=g-import-not-at-top
  fields = jaxfuse.SparseSyncState._fields[:-1]
  plain = typing.NamedTuple("Plain", [(f, typing.Any) for f in fields])
  plan = jaxfuse.plan(PARAMS, density=0.05)
  state = jaxfuse.init_state(jaxfuse.sparse_sync(plan, momentum=0.9), PARAMS,
                             mesh_of(1))
  assert state.layout and all(isinstance(h, str) for h in state.layout)
  as_plain = plain(*(getattr(state, f) for f in fields))
  keys = lambda t: [jax.tree_util.keystr(k) for k, _ in
                    jax.tree_util.tree_flatten_with_path(t)[0]]
  assert keys(state) == keys(as_plain)
  assert len(jax.tree.leaves(state)) == len(jax.tree.leaves(as_plain))
  back = jax.tree.unflatten(jax.tree.structure(state),
                            jax.tree.leaves(as_plain))
  assert back.layout == state.layout


def test_send_early_needs_a_function():
  with pytest.raises(TypeError, match="send_early wraps the per-worker step "
                     "function; got int"):
    jaxfuse.send_early(3)


# --- phases -------------------------------------------------------------------

def test_density_warmup_densities(plan):
  with pytest.raises(jaxfuse.PlanError, match=r"densities=0\.25 must be a "
                     "list of densities"):
    jaxfuse.density_warmup(plan, steps=10, densities=0.25)
  with pytest.raises(jaxfuse.PlanError, match=r"densities \[0\.01, 'x'\] "
                     r"must each be in \(0\.05, 1\]: a warm-up sends more"):
    jaxfuse.density_warmup(plan, steps=10, densities=(0.25, 0.01, "x"))
  with pytest.raises(ValueError, match="phase_index: no phase trains step "
                     "3: the last of 0 phases must have stop=None"):
    jaxfuse.phase_index([], 3)
  phases = jaxfuse.density_warmup(plan, steps=10)
  for bad in (-1, 2.0, "3"):
    with pytest.raises(ValueError, match=f"phase_index: step={bad!r} must "
                       "be an integer >= 0"):
      jaxfuse.phase_index(phases, bad)
  assert jaxfuse.phase_index(phases, np.int64(10)) == 1
  assert jaxfuse.phase_index(phases, jnp.int32(10)) == 1   # a TrainState.step


# --- local_params ---------------------------------------------------------------

def test_local_params_outside_shard_map_or_on_another_axis():
  with pytest.raises(jaxfuse.SyncError, match="local_params: 'data' is not "
                     "an axis of the enclosing jax.shard_map"):
    jaxfuse.local_params(PARAMS)
  mesh = mesh_of(1)
  params = jax.device_put(PARAMS, NamedSharding(mesh, P()))

  def step(axis):
    def local(params):
      grads = jax.grad(lambda q: jnp.sum(q["w"]))(
          jaxfuse.local_params(params, axis))
      return jax.lax.psum(grads["w"], "data")
    return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(),),
                                 out_specs=P()))
  with pytest.raises(jaxfuse.SyncError, match="local_params: 'batch' is "
                     "not an axis"):
    step("batch")(params)
  # a list of axes is taken as the tuple: each worker's gradient, summed
  summed = step(["data"])(params)
  np.testing.assert_array_equal(np.asarray(summed),
                                np.full((64, 64), mesh.size, np.float32))


# --- checkpoints ---------------------------------------------------------------

@pytest.mark.parametrize("step,extra,message", [
    ("5", {}, "step='5' must be an int >= 0"),
    (-1, {}, "step=-1 must be an int >= 0"),
    (True, {}, "step=True must be an int >= 0"),
    (3, {"pos": np.int64(3)}, "is not JSON (Object of type int64"),
    (3, [1, 2], "extra must be a dict of JSON values, got list"),
])
def test_checkpoint_save_refuses_before_writing(tmp_path, plan, step, extra,
                                                message):
  pytest.importorskip("orbax.checkpoint")
  from jaxfuse.state import checkpoint  # pylint: disable=g-import-not-at-top
  mngr = checkpoint.manager(tmp_path / "run")
  with pytest.raises(checkpoint.CheckpointError) as e:
    checkpoint.save(mngr, step, {"w": jnp.ones(4)}, plan, extra=extra)
  assert message in str(e.value)
  if isinstance(extra, dict) and extra:
    assert "extra['pos']=" in str(e.value) and "int(x)" in str(e.value)
  assert list(mngr.all_steps()) == []
  assert os.listdir(tmp_path / "run") == []
  with pytest.raises(checkpoint.CheckpointError, match="state has no arrays"):
    checkpoint.save(mngr, 3, None, plan)
  checkpoint.save(mngr, 3, {"w": jnp.ones(4)}, plan, extra={"pos": 3})
  mngr.wait_until_finished()
  assert list(mngr.all_steps()) == [3]
  assert checkpoint.saved_extra(mngr) == {"pos": 3}


def test_checkpoint_files_and_trees_that_do_not_fit(tmp_path, plan):
  """A file given as the checkpoint folder; a restore target missing part
  of the saved tree (orbax's message shortened, without its advice for
  an argument jaxfuse does not take); a float32 checkpoint restored with
  a bfloat16 plan names the leaf and both dtypes."""
  pytest.importorskip("orbax.checkpoint")
  from jaxfuse.state import checkpoint  # pylint: disable=g-import-not-at-top
  (tmp_path / "afile").write_text("x")
  with pytest.raises(checkpoint.CheckpointError, match="afile is a file, "
                     "not a folder"):
    checkpoint.manager(tmp_path / "afile")
  mngr = checkpoint.manager(tmp_path / "run")
  checkpoint.save(mngr, 1, {"params": PARAMS, "more": {"w": jnp.ones(8)}},
                  plan)
  mngr.wait_until_finished()
  with pytest.raises(checkpoint.CheckpointError) as e:
    checkpoint.restore(mngr, {"params": PARAMS}, plan)
  assert "does not fit this train state" in str(e.value)
  assert "give `like` the whole state" in str(e.value)
  assert "partial_restore" not in str(e.value) and len(str(e.value)) < 800
  half = jaxfuse.plan(jax.tree.map(lambda x: x.astype(jnp.bfloat16), PARAMS),
                      density=0.05)
  with pytest.raises(checkpoint.CheckpointError,
                     match=r"leaves \(\['b'\]: float32 \[64\] dense, against "
                     r"bfloat16 \[64\] dense\)"):
    checkpoint.restore(mngr, {"params": PARAMS, "more": {"w": jnp.ones(8)}},
                       half)


def test_a_plan_saved_into_a_missing_folder_names_it(tmp_path, plan):
  with pytest.raises(FileNotFoundError, match="the folder .*nowhere does "
                     "not exist"):
    plan.save(tmp_path / "nowhere" / "plan.json")
  assert not (tmp_path / "nowhere").exists()


@pytest.mark.parametrize("tree,message", [
    ({"w": jnp.ones((64, 64)), "name": "mlp"},
     r"leaf \['name'\]: a str, not a numeric array"),
    (dataclasses.make_dataclass("Model", ["w"])(jnp.ones((64, 64))),
     r"params: a Model, not a numeric array.*register_dataclass"),
    ({"w": jnp.ones((64, 64)), "dtype": "bfloat16"},
     r"leaf \['dtype'\]: a str, not a numeric array"),
    ({"w": jnp.ones((64, 64)), "t": jnp.float32},
     r"leaf \['t'\]: the type float32, not a numeric array"),
    ({"w": jnp.ones((64, 64)), "s": np.array(["a", "b"])},
     r"leaf \['s'\]: an array of <U1, not a numeric array"),
    ({"w": jnp.ones((64, 64)), "key": jax.random.key(0)},
     r"leaf \['key'\]: holds key<fry> values \(PRNG keys\)"),
])
def test_a_leaf_that_is_no_parameter_is_named(tree, message):
  with pytest.raises(jaxfuse.PlanError, match=message):
    jaxfuse.plan(tree, density=0.05)


@pytest.mark.parametrize("kwargs,message", [
    (dict(learning_rate="0.05"), "learning_rate='0.05' must be a number"),
    (dict(learning_rate=0.05, weight_decay="1e-4"),
     "weight_decay='1e-4' must be a number"),
    (dict(learning_rate=True), "learning_rate=True must be a number"),
    # optax reads a None rate as "no scaling": the update would ascend
    (dict(learning_rate=None), "learning_rate=None must be a number"),
    (dict(learning_rate=0.05, weight_decay=None),
     "weight_decay=None must be a number"),
])
@pytest.mark.parametrize("recipe", ["sgd", "onebit_adamw"])
def test_recipe_numbers_are_numbers(plan, recipe, kwargs, message):
  with pytest.raises(jaxfuse.SyncError, match=f"{recipe}: {message}"):
    jaxfuse.RECIPES[recipe](plan, **kwargs)


@pytest.mark.parametrize("recipe,kwargs,interval", [
    ("sgd", dict(momentum=1.0), "[0, 1)"),
    ("sgd", dict(momentum=-0.1), "[0, 1)"),
    ("sgd", dict(residual_decay=0.0), "(0, 1]"),
    ("demo", dict(momentum=1.5), "(0, 1]"),   # its residual decay
    ("onebit_adamw", dict(b1=1.0), "[0, 1)"),
    ("local_adamw", dict(b1=1.0), "[0, 1)"),   # m would stay 0: 0/0
    ("sync_adamw", dict(b2=1.5), "[0, 1)"),    # √ of a negative v
])
def test_recipe_rates_outside_their_range_name_the_recipe(plan, recipe,
                                                          kwargs, interval):
  (name, value), = kwargs.items()
  with pytest.raises(jaxfuse.SyncError, match=(
      f"^{recipe}: {name}={value!r} must be in {re.escape(interval)}")):
    jaxfuse.RECIPES[recipe](plan, 0.1, **kwargs)


def test_wrappers_and_agreement_name_what_they_were_given(plan):
  for wrap in (lambda x: jaxfuse.apply_if_finite(x, 3), jaxfuse.delayed):
    with pytest.raises(TypeError, match="expects an optax transform.*got "
                       "Plan"):
      wrap(plan)
  twice = jaxfuse.delayed(jaxfuse.delayed(jaxfuse.sgd(plan, 0.1)))
  with pytest.raises(jaxfuse.SyncError, match=r"delayed\(delayed\(\.\.\.\)\)"
                     ": the gradients would be two steps old"):
    twice.init(PARAMS)
  from jaxfuse.sync import agreement  # pylint: disable=g-import-not-at-top
  with pytest.raises(TypeError, match=r"expects the compiled step, "
                     r"jax.jit\(f\).lower\(\*args\).compile\(\)"):
    agreement.check_same_collectives(jax.jit(lambda x: x))


def test_state_specs_checks_the_axis_and_what_runs_before_the_sync(plan):
  import optax  # pylint: disable=g-import-not-at-top
  mesh = mesh_of(NUM_WORKERS)
  params = jax.device_put(PARAMS, NamedSharding(mesh, P()))
  state = jaxfuse.init_state(jaxfuse.sgd(plan, 0.1), params, mesh)
  with pytest.raises(jaxfuse.SyncError, match=r"axis_name='batch', but this "
                     r"state lives on a mesh with axes \('data',\)"):
    jaxfuse.state_specs(state, "batch")
  # Adam's moments of each worker's own gradient, before the sync
  bare = optax.chain(optax.scale_by_adam(), jaxfuse.sparse_sync(plan),
                     optax.scale(-1e-3))
  with pytest.raises(jaxfuse.SyncError, match=r"before jaxfuse.sparse_sync "
                     r"keeps per-parameter state \(ScaleByAdamState\).*"
                     r"jaxfuse.per_worker"):
    jaxfuse.init_state(bare, params, mesh)
  wrapped = optax.chain(jaxfuse.per_worker(optax.scale_by_adam()),
                        jaxfuse.sparse_sync(plan), optax.scale(-1e-3))
  stateless = optax.chain(optax.clip(1.0), jaxfuse.sparse_sync(plan),
                          optax.adam(1e-3))
  for opt in (wrapped, stateless, *(make(plan, 1e-3) for make in
                                    jaxfuse.RECIPES.values())):
    jaxfuse.state_specs(jaxfuse.init_state(opt, params, mesh))


def test_summarize_with_another_phases_plan_is_refused(plan):
  """Stats of a dense step read with the sparse plan would give a share of
  the slots above 1."""
  dense = jaxfuse.with_density(plan, 1.0)
  mesh = mesh_of(1)
  params = jax.device_put(PARAMS, NamedSharding(mesh, P()))
  tx = jaxfuse.sparse_sync(dense)
  state = jaxfuse.init_state(tx, params, mesh)
  specs = jaxfuse.state_specs(state)
  update = sharded_update(tx, mesh, specs)
  grads = jax.tree.map(lambda x: np.ones((1,) + x.shape, np.float32), PARAMS)
  _, state = update(shard(mesh, grads), state)
  stats = jaxfuse.sync_stats(state)
  assert jaxfuse.summarize(stats, dense)["slot_fill"] == 1.0   # every slot
  with pytest.raises(ValueError, match=r"leaf \['w'\] selected 4096 "
                     r"elements, more than the 308 slots"):
    jaxfuse.summarize(stats, plan)


def test_state_specs_refuses_axes_partly_off_the_mesh(mesh):
  params = {"w": jnp.zeros((64, 64)), "b": jnp.zeros((64,))}
  plan = jaxfuse.plan(params, density=0.05)
  state = jaxfuse.init_state(jaxfuse.sgd(plan, 0.1), params, mesh)
  assert mesh.axis_names == ("data",)
  # ("data", "batch"): "data" is there, "batch" is not.
  with pytest.raises(jaxfuse.SyncError, match=r"axis_name=\('data', "
                     r"'batch'\), but this state lives on a mesh with axes "
                     r"\('data',\)"):
    jaxfuse.state_specs(state, ("data", "batch"))
  specs = jaxfuse.state_specs(state, ("data",))
  assert P(("data",)) in jax.tree.leaves(
      specs, is_leaf=lambda x: isinstance(x, P))


@pytest.mark.parametrize("made_with,stepped_with,have,need", [
    (0.9, 0.0, 1, 0), (0.0, 0.9, 0, 1)])
def test_a_state_of_another_momentum_is_refused(mesh, made_with,
                                                stepped_with, have, need):
  plan = list_plan([(64, 64)], density=0.05,
                   settings=jaxfuse.Settings(min_sparse_size=64))
  params = [np.zeros((64, 64), np.float32)]
  state = jaxfuse.init_state(jaxfuse.sparse_sync(plan, momentum=made_with),
                             params, mesh)
  assert len(state.velocity) == have
  tx = jaxfuse.sparse_sync(plan, momentum=stepped_with)
  step = sharded_update(tx, mesh, jaxfuse.state_specs(state))
  grads = shard(mesh, [np.ones((NUM_WORKERS, 64, 64), np.float32)])
  with pytest.raises(jaxfuse.SyncError,
                     match=f"has {have} velocity buffers; this transform "
                     rf"\(momentum={stepped_with}\) needs {need}"):
    jax.eval_shape(step, grads, state)


@pytest.mark.parametrize("case", ["replicated", "pmean", "two_syncs"])
def test_a_gradient_already_averaged_names_the_three_causes(plan, case):
  # Each worker must hand opt.update its own gradient. Here it does not:
  # JAX summed the gradient of replicated parameters, the step averaged it,
  # or a second sparse_sync in the chain gets the first one's mean.
  if NUM_WORKERS < 2:
    pytest.skip("one device: every gradient is the same on every worker")
  mesh = mesh_of(NUM_WORKERS)
  opt = (optax.chain(jaxfuse.sparse_sync(plan), jaxfuse.sparse_sync(plan))
         if case == "two_syncs" else jaxfuse.sparse_sync(plan))
  state = jaxfuse.init_state(opt, PARAMS, mesh)
  specs = jaxfuse.state_specs(state)

  def local(params, state, x):
    loss = lambda p: jnp.sum((x @ p["w"] + p["b"]) ** 2)
    mine = params if case == "replicated" else jaxfuse.local_params(params)
    grads = jax.grad(loss)(mine)
    if case == "pmean":
      grads = jax.lax.pmean(grads, "data")
    return opt.update(grads, state, params)

  step = jax.jit(jax.shard_map(local, mesh=mesh,
                               in_specs=(P(), specs, P("data")),
                               out_specs=(P(), specs)))
  x = shard(mesh, np.ones((NUM_WORKERS, 64), np.float32))
  with pytest.raises(jaxfuse.SyncError, match=(
      r"(?s)^gradient \['b'\] is already the same on every worker.*"
      r"jaxfuse.local_params\(params, 'data'\).*jax.lax.pmean/psum.*"
      "an earlier sparse_sync or recipe in the same chain synced it")):
    step(PARAMS, state, x)


def _one_step(mesh, opt, state_spec):
  """A recipe's step on ``mesh`` with ``state_spec`` for its state."""
  def local(p, s, x):
    g = jax.grad(lambda p: jnp.sum((x @ p["w"] + p["b"]) ** 2))(
        jaxfuse.local_params(p))
    u, s = opt.update(g, s, p)
    return optax.apply_updates(p, u), s
  return jax.jit(jax.shard_map(local, mesh=mesh,
                               in_specs=(P(), state_spec, P("data")),
                               out_specs=(P(), state_spec)))


@pytest.mark.parametrize("recipe", ["sgd", "onebit_adamw"])
def test_a_state_from_opt_init_names_init_state_and_state_specs(recipe):
  """opt.init(params) with P() for the state used to stop with JAX's
  'out_specs ... could not infer replication', 8 times over; now the
  recipe names both fixes when the step is traced. A P() given to the
  whole K-worker state on a mesh that reshards (axis type Auto) comes
  into each worker with leading axis K: named too."""
  params = {"w": jnp.ones((64, 32)), "b": jnp.zeros((32,))}
  plan = jaxfuse.plan(params, density=0.1,
                      settings=jaxfuse.Settings(min_sparse_size=64))
  opt = jaxfuse.RECIPES[recipe](plan, 0.1)
  mesh = jaxfuse.make_mesh(NUM_WORKERS)
  params = jax.device_put(params, NamedSharding(mesh, P()))
  x = jax.device_put(jnp.ones((NUM_WORKERS * 4, 64)),
                     NamedSharding(mesh, P("data")))
  with pytest.raises(jaxfuse.SyncError,
                     match=r"optimizer\.init\(params\) instead of "
                     r"jaxfuse\.init_state.*jaxfuse\.state_specs\(state\)"):
    _one_step(mesh, opt, P())(params, opt.init(params), x)
  auto = jax.sharding.Mesh(jax.devices()[:NUM_WORKERS], ("data",))
  state = jaxfuse.init_state(opt, params, auto)
  with pytest.raises(jaxfuse.SyncError,
                     match=rf"shape \({NUM_WORKERS}, ?.*not a leading axis "
                     r"of 1.*P\(\) where jaxfuse\.state_specs\(state\) "
                     r"gives P\('data'\)"):
    _one_step(auto, opt, P())(params, state, x)
  good = _one_step(mesh, opt, jaxfuse.state_specs(state))
  new_params, _ = good(params, jaxfuse.init_state(opt, params, mesh), x)
  assert jax.tree.structure(new_params) == jax.tree.structure(params)


def test_onebit_adamw_without_a_dense_step_warns(monkeypatch):
  """onebit_adamw's sparse steps before any dense step leave v = 0 and
  the update zero: the run trains nothing, and the step builder says so
  (once) when such a phase starts. After a dense phase nothing is said."""
  params = {"w": jnp.ones((64, 32)), "b": jnp.zeros((32,))}
  plan = jaxfuse.plan(params, density=0.1,
                      settings=jaxfuse.Settings(min_sparse_size=64))
  assert any(l.mode == "sparse" for l in plan.leaves)
  mesh = jaxfuse.make_mesh(NUM_WORKERS)
  x = jnp.arange(NUM_WORKERS * 4 * 64.0).reshape(-1, 64) / 1e4
  loss_fn = lambda p, x: jnp.sum((x @ p["w"] + p["b"]) ** 2)
  opt = ("onebit_adamw", {"learning_rate": 0.1, "weight_decay": 0.0})
  monkeypatch.setattr(jaxfuse.optim.recipe_checks, "_warned", [])
  state, step = jaxfuse.make_train_step(loss_fn, params, opt, plan, mesh)
  with pytest.warns(UserWarning, match="before any dense step.*trains "
                    "nothing.*dense_steps="):
    moved, _ = step(state, x)
  np.testing.assert_array_equal(moved.params["w"], params["w"])  # untrained
  monkeypatch.setattr(jaxfuse.optim.recipe_checks, "_warned", [])
  phases = jaxfuse.density_warmup(plan, dense_steps=1, steps=1)
  state, step = jaxfuse.make_train_step(loss_fn, params, opt, phases, mesh)
  import warnings as warnings_lib
  with warnings_lib.catch_warnings():
    warnings_lib.simplefilter("error")
    for _ in range(3):   # dense, then the ramp, then the plan
      state, _ = step(state, x)
  assert not np.array_equal(state.params["w"], params["w"])


def test_a_loss_returning_a_tuple_names_both_fixes_not_example_args():
  """An NNX-style loss returning (loss, state) used to fail in jax.grad
  with a hint to fix example_args; the planner now names what the loss
  returned and how to pass the scalar loss. A per-example loss too."""
  def nnx_style(params, x):
    return jnp.sum(params["w"] @ x), {"count": jnp.ones(())}
  x = jnp.ones((64, 3))
  with pytest.raises(jaxfuse.PlanError) as e:
    jaxfuse.plan(PARAMS,
                 order=jaxfuse.planning.ordering.FromLoss(nnx_style, (x,)))
  assert re.search(r"returned a tuple of 2 parts.*scalar loss.*"
                   r"lambda params, \*args: f\(params, \*args\)\[0\]",
                   str(e.value))
  assert "example_args" not in str(e.value)
  per_example = lambda params, x: jnp.sum(params["w"] @ x, axis=0)
  with pytest.raises(jaxfuse.PlanError, match=r"array of shape \(3,\).*mean "
                     "of per-example losses"):
    jaxfuse.plan(PARAMS,
                 order=jaxfuse.planning.ordering.FromLoss(per_example, (x,)))
  scalar = lambda params, x: nnx_style(params, x)[0]
  assert jaxfuse.plan(PARAMS,
                      order=jaxfuse.planning.ordering.FromLoss(scalar, (x,))).provenance[
      "ready_order"] == "jaxpr"


def test_the_cli_names_a_tuple_loss_without_an_example_args_hint(
    tmp_path, monkeypatch, capsys):
  from jaxfuse.planning import cli
  (tmp_path / "nnxmodel.py").write_text(
      "import jax.numpy as jnp\n"
      "def make():\n"
      "  params = {'w': jnp.ones((64, 32)), 'b': jnp.zeros((64,))}\n"
      "  def loss(p, x):\n"
      "    return jnp.sum(p['w'] @ x + p['b'][:, None]), {'n': 1}\n"
      "  return loss, params, jnp.ones((32, 2))\n")
  monkeypatch.chdir(tmp_path)
  assert cli.main(["plan", "nnxmodel:make", "--strategy", "single", "-o",
                   "p.json"]) == cli.EXIT_USAGE
  err = capsys.readouterr().err
  assert "returned a tuple of 2 parts" in err and "[0]" in err
  assert "example_args" not in err and not (tmp_path / "p.json").exists()


@pytest.mark.parametrize("recipe,old,new", [
    ("sgd", dict(nesterov=True, residual_decay=0.8, clip_norm=1.0,
                 mask=lambda p: {"w": True, "b": False}),
     dict(sgd_options=jaxfuse.SGDOptions(nesterov=True, residual_decay=0.8),
          options=jaxfuse.RecipeOptions(
              clip_norm=1.0, mask=lambda p: {"w": True, "b": False}))),
    ("onebit_adamw", dict(b1=0.8, b2=0.99, clip_norm=0.5),
     dict(betas=(0.8, 0.99), options=jaxfuse.RecipeOptions(clip_norm=0.5))),
    ("local_adamw", dict(b2=0.9, axis_name="data"),
     dict(betas=(0.9, 0.9), options=jaxfuse.RecipeOptions())),
    ("demo", dict(clip_norm=2.0), dict(options=jaxfuse.RecipeOptions(
        clip_norm=2.0))),
])
def test_recipes_old_keywords_warn_and_step_bitwise_alike(recipe, old, new):
  """0.2's keywords (b1/b2, nesterov, residual_decay, clip_norm, mask,
  axis_name) still work until 0.4, with a DeprecationWarning naming the
  new spelling (betas=, sgd_options=, options=), and the step they make
  is bitwise the new spelling's."""
  params = {"w": jnp.ones((64, 32)), "b": jnp.zeros((32,))}
  plan = jaxfuse.plan(params, density=0.1,
                      settings=jaxfuse.Settings(min_sparse_size=64))
  if recipe == "onebit_adamw":
    plan = jaxfuse.with_density(plan, 1.0)
  make = jaxfuse.RECIPES[recipe]
  with pytest.warns(DeprecationWarning, match=r"is now (betas=|sgd_options="
                    r"|options=jaxfuse\.RecipeOptions)"):
    old_opt = make(plan, 0.1, **old)
  import warnings as warnings_lib
  with warnings_lib.catch_warnings():
    warnings_lib.simplefilter("error", DeprecationWarning)
    new_opt = make(plan, 0.1, **new)
  mesh = jaxfuse.make_mesh(NUM_WORKERS)
  params = jax.device_put(params, NamedSharding(mesh, P()))
  x = jax.device_put(jnp.arange(NUM_WORKERS * 4 * 64.0).reshape(-1, 64)
                     / 1e3, NamedSharding(mesh, P("data")))
  outs = []
  for opt in (old_opt, new_opt):
    state = jaxfuse.init_state(opt, params, mesh)
    step = _one_step(mesh, opt, jaxfuse.state_specs(state))
    p, s = step(params, state, x)
    outs.append(step(p, s, x))
  for a, b in zip(jax.tree.leaves(outs[0]), jax.tree.leaves(outs[1]),
                  strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert not np.array_equal(np.asarray(outs[1][0]["w"]), params["w"])


def test_recipes_name_the_new_spelling_of_a_bad_argument(plan):
  with pytest.raises(jaxfuse.SyncError, match=r"betas=0\.9 is one number; "
                     r"pass betas=\(b1, b2\)"):
    jaxfuse.onebit_adamw(plan, 1e-3, 0.9, 0.999)   # 0.2's positional b1, b2
  with pytest.raises(jaxfuse.SyncError, match=r"betas=\(0\.9,\) must be"):
    jaxfuse.local_adamw(plan, 1e-3, betas=(0.9,))
  with pytest.raises(jaxfuse.SyncError, match="options=.*jaxfuse.RecipeOpt"):
    jaxfuse.demo(plan, 1e-3, options={"clip_norm": 1.0})
  with pytest.raises(jaxfuse.SyncError, match="sgd_options=.*SGDOptions"):
    jaxfuse.sgd(plan, 1e-3, sgd_options=jaxfuse.RecipeOptions())
  with pytest.raises(TypeError, match="unexpected keyword argument 'nesterov'"):
    jaxfuse.onebit_adamw(plan, 1e-3, nesterov=True)
  with pytest.raises(jaxfuse.SyncError, match="clip_norm"):
    jaxfuse.sgd(plan, 1e-3, options=jaxfuse.RecipeOptions(clip_norm=-1.0))
