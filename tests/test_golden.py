"""Golden outputs: three training steps of every recipe, scheme, estimator
and wire option, bit for bit as jaxfuse 0.2 computed them.

Each case trains a small model (two sparse float32 leaves, one of 1024
elements, a sparse bfloat16 leaf and two small dense leaves) on the 8 test
workers under ``jax.shard_map``, the README's loop (``init_state``,
``state_specs``, ``local_params``, ``opt.update``), and compares the params,
every optimizer-state leaf and each step's ``jaxfuse.sync_stats`` with
``tests/data/golden/<case>.npz``: the same dtype and the same bits.

A refactor must not change what a step computes; where a knob moves, change
only ``_plan`` / ``_opt`` below (how a case is built), never the data.
Re-record deliberately, and only for a change of results that is meant:
``python tests/record_golden.py``.

Only public top-level names (``jaxfuse.X``, ``jaxfuse.collectives.X``) are
used here, so module moves inside the library leave this file alone.
"""

import hashlib
import json
import os
import pathlib
import shutil

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxfuse

DATA = pathlib.Path(__file__).resolve().parent / "data"
GOLDEN = DATA / "golden"
CHECKPOINT = DATA / "checkpoint_0.2"
RECORD = os.environ.get("JAXFUSE_RECORD_GOLDEN") == "1"
K = 8
STEPS = 3
PER_WORKER_BATCH = 4
FLAT = "data"
HIER = ("host", "local")
FULL = 2048   # arrays stored in full up to this many elements


def _environment() -> dict:
  """What the bits depend on besides jaxfuse: recorded with the data; the
  test runs only where it is the same (another JAX or XLA flags may round
  differently, which says nothing about jaxfuse)."""
  flags = sorted(f for f in os.environ.get("XLA_FLAGS", "").split()
                 if "cpu" in f or "backend_optimization" in f)
  return {"jax": jax.__version__, "platform": jax.devices()[0].platform,
          "devices": len(jax.devices()), "xla_flags": flags,
          "x64": bool(jax.config.jax_enable_x64)}


def _params():
  rng = np.random.RandomState(0)
  normal = lambda *shape: (0.3 * rng.standard_normal(shape)).astype(
      np.float32)
  return {
      "w1": normal(32, 32),                                  # sparse, 1024
      "b1": normal(32),                                      # dense
      "w2": normal(32, 16),                                  # sparse, 512
      "b2": normal(16),                                      # dense
      "w3": jnp.asarray(normal(16, 16), jnp.bfloat16),       # sparse, bf16
  }


def _loss(p, batch):
  x, y = batch
  h = jnp.tanh(x @ p["w1"] + p["b1"])
  h = jnp.tanh(h @ p["w2"] + p["b2"])
  out = h @ p["w3"].astype(jnp.float32)
  return jnp.mean((out - y) ** 2)


def _batches():
  rng = np.random.RandomState(1)
  n = K * PER_WORKER_BATCH
  return [(rng.standard_normal((n, 32)).astype(np.float32),
           rng.standard_normal((n, 16)).astype(np.float32))
          for _ in range(STEPS)]


# --- the cases -------------------------------------------------------------
# name -> (recipe, plan knobs, mesh, dense steps, dense wire)
_BASE = dict(density=0.1, strategy="size", bucket_bytes=3000,
             settings=jaxfuse.Settings(min_sparse_size=256))
CASES = {
    "sgd": ("sgd", {}, FLAT, 0, None),
    "local_adamw": ("local_adamw", {}, FLAT, 0, None),
    "sync_adamw": ("sync_adamw", {}, FLAT, 0, None),
    "onebit_adamw": ("onebit_adamw", {}, FLAT, 1, "gradient"),
    "demo": ("demo", {}, FLAT, 0, None),
    "zen": ("sgd", dict(collective=jaxfuse.collectives.Zen(
        table=1.0, union=0.25)), FLAT, 0, None),
    "spardl": ("sgd", dict(collective=jaxfuse.collectives.SparDL(
        teams=2, block=1.5)), FLAT, 0, None),
    "hier": ("sgd", dict(collective="hier"), HIER, 0, None),
    "hier_spardl": ("sgd", dict(collective=jaxfuse.collectives.Hier(
        inner="spardl")), HIER, 0, None),
    "psum": ("sgd", dict(density=1.0), FLAT, 0, None),
    "behind": ("sgd", dict(strategy="behind"), FLAT, 0, None),
    "topk": ("sgd", dict(estimator="topk"), FLAT, 0, None),
    "gaussian": ("sgd", dict(estimator="gaussian"), FLAT, 0, None),
    "redsync": ("sgd", dict(estimator="redsync"), FLAT, 0, None),
    "sidco": ("sgd", dict(estimator="sidco"), FLAT, 0, None),
    "full_wire_bfloat16": ("onebit_adamw", {}, FLAT, 1, "bfloat16"),
    "sparse_wire_bfloat16": ("sgd", dict(settings=jaxfuse.Settings(
        min_sparse_size=256, sparse_wire="bfloat16")), FLAT, 0, None),
    "packed_indices": ("sgd", dict(collective=jaxfuse.collectives.AllGather(
        packed_indices=True)), FLAT, 0, None),
}
# (dgc is every other case's estimator, allgather their scheme)


def _plan(params, knobs: dict):
  """The case's plan: the one construction call a refactor may change."""
  return jaxfuse.plan(params, **dict(_BASE, **knobs),
                      order=jaxfuse.planning.ordering.FromLoss(
                          _loss, (_batches()[0],)))


def _opt(recipe: str, plan, axis_name):
  make = {"sgd": lambda p: jaxfuse.sgd(p, 0.1, 0.9, axis_name=axis_name),
          "local_adamw": lambda p: jaxfuse.local_adamw(
              p, 1e-2, axis_name=axis_name),
          "sync_adamw": lambda p: jaxfuse.sync_adamw(
              p, 1e-2, axis_name=axis_name),
          "onebit_adamw": lambda p: jaxfuse.onebit_adamw(
              p, 1e-2, axis_name=axis_name),
          "demo": lambda p: jaxfuse.demo(p, 1e-2, axis_name=axis_name)}
  return make[recipe](plan)


def _mesh(axis_name):
  if axis_name == HIER:
    return jaxfuse.make_mesh(K, local=4)
  return jaxfuse.make_mesh(K)


def _phases(plan, dense_steps: int, dense_wire):
  if not dense_steps:
    return (jaxfuse.Phase(0, None, plan),)
  return jaxfuse.density_warmup(plan, steps=0, dense_steps=dense_steps,
                                dense_wire=dense_wire)


def _step(opt, mesh, specs, axis_name):
  def local(params, opt_state, batch):
    grads = jax.grad(_loss)(jaxfuse.local_params(params, axis_name), batch)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state
  return jax.jit(jax.shard_map(local, mesh=mesh,
                               in_specs=(P(), specs, P(axis_name)),
                               out_specs=(P(), specs)))


def run_case(name: str):
  """(plan, final params, final optimizer state, per-step stats)."""
  recipe, knobs, axis_name, dense_steps, dense_wire = CASES[name]
  mesh = _mesh(axis_name)
  params = _params()
  plan = _plan(params, knobs)
  phases = _phases(plan, dense_steps, dense_wire)
  params = jax.device_put(params, NamedSharding(mesh, P()))
  state = jaxfuse.init_state(_opt(recipe, plan, axis_name), params, mesh,
                             axis_name)
  specs = jaxfuse.state_specs(state, axis_name)
  batches = [jax.device_put(b, NamedSharding(mesh, P(axis_name)))
             for b in _batches()]
  stats = []
  for phase in phases:
    if phase.start >= STEPS:
      break
    step = _step(_opt(recipe, phase.plan, axis_name), mesh, specs,
                 axis_name)
    for t in range(phase.start, min(phase.stop or STEPS, STEPS)):
      params, state = step(params, state, batches[t])
      stats.append(jaxfuse.sync_stats(state))
  return plan, params, state, stats


def _flat(prefix: str, tree) -> dict:
  return {prefix + jax.tree_util.keystr(path): np.asarray(x)
          for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def outputs(params, state, stats) -> dict:
  """name -> array: params, every state leaf, each step's stats fields."""
  out = dict(_flat("params", params))
  out.update(_flat("state", state))
  for t, s in enumerate(stats):
    out.update({f"stats{t}.{field}": np.asarray(v)
                for field, v in s._asdict().items()})
  return out


def _bits(x: np.ndarray) -> np.ndarray:
  """The array's bytes as unsigned ints of its item size (NaNs compare)."""
  x = np.ascontiguousarray(x)
  if x.dtype == bool:
    return x.view(np.uint8)
  return x.view(f"u{x.dtype.itemsize}")


def _digest(bits: np.ndarray) -> str:
  return hashlib.sha256(np.ascontiguousarray(bits).tobytes()).hexdigest()


def save(path: pathlib.Path, arrays: dict) -> None:
  """Arrays of up to ``FULL`` elements in full; larger ones (the 8 workers'
  residuals and moments) as the SHA-256 of their bits, which keeps the
  data small and the comparison exact."""
  full = {k: v for k, v in arrays.items() if v.size <= FULL}
  meta = json.dumps({
      "environment": _environment(),
      "dtypes": {k: str(v.dtype) for k, v in arrays.items()},
      "shapes": {k: list(v.shape) for k, v in arrays.items()},
      "index": {k: f"a{i}" for i, k in enumerate(full)},
      "sha256": {k: _digest(_bits(v)) for k, v in arrays.items()
                 if k not in full}})
  np.savez_compressed(path, __meta__=np.array(meta), **{
      f"a{i}": _bits(v) for i, v in enumerate(full.values())})


def load(path: pathlib.Path) -> tuple[dict, dict]:
  """(environment, name -> (dtype name, shape, bits or their SHA-256))."""
  with np.load(path, allow_pickle=False) as f:
    meta = json.loads(str(f["__meta__"]))
    bits = {k: f[a] for k, a in meta["index"].items()}
  bits.update(meta["sha256"])
  return meta["environment"], {
      k: (meta["dtypes"][k], tuple(meta["shapes"][k]), bits[k])
      for k in meta["dtypes"]}


def _same_bits(x: np.ndarray, bits) -> bool:
  if isinstance(bits, str):
    return _digest(_bits(x)) == bits
  return np.array_equal(_bits(x), bits)


def skip_unless_recorded_here(path: pathlib.Path) -> None:
  """Skips the test where ``path`` was recorded in another environment
  (``_environment``): called before the case runs, so that a case whose
  bits cannot be compared here is not computed only to be skipped."""
  env = load(path)[0]
  if env != _environment() and not RECORD:
    pytest.skip(f"{path.name} was recorded under {env}; here "
                f"{_environment()}: bits may differ for reasons not "
                "jaxfuse's (record again there to compare)")


def assert_bitwise(got: dict, path: pathlib.Path, what: str) -> None:
  skip_unless_recorded_here(path)
  _, want = load(path)
  assert sorted(got) == sorted(want), (
      f"{what}: the arrays differ in name: only now "
      f"{sorted(set(got) - set(want))}, only recorded "
      f"{sorted(set(want) - set(got))}")
  bad = []
  for k, (dtype, shape, bits) in want.items():
    x = got[k]
    if str(x.dtype) != dtype or tuple(x.shape) != shape:
      bad.append(f"{k}: {x.dtype}{list(x.shape)}, recorded "
                 f"{dtype}{list(shape)}")
    elif isinstance(bits, str) and not _same_bits(x, bits):
      bad.append(f"{k}: its bits' SHA-256 differs from the recorded one")
    elif not _same_bits(x, bits):
      diff = int(np.sum(_bits(x) != bits))
      bad.append(f"{k}: {diff} of {x.size} elements differ in their bits")
  assert not bad, f"{what}: not bitwise as recorded:\n  " + "\n  ".join(bad)


@pytest.mark.parametrize("name", list(CASES))
def test_three_steps_are_bitwise_as_recorded(name):
  path = GOLDEN / f"{name}.npz"
  if not RECORD:
    skip_unless_recorded_here(path)
  _, params, state, stats = run_case(name)
  got = outputs(params, state, stats)
  if RECORD:
    GOLDEN.mkdir(parents=True, exist_ok=True)
    save(path, got)
  assert_bitwise(got, path, f"case {name!r}")


def test_recorded_cases_vary():
  """The golden data itself is no constant: every two cases differ in some
  recorded array (each knob changed what a step computes or counts), and
  the steps moved every case's params."""
  recorded = {name: load(GOLDEN / f"{name}.npz")[1] for name in CASES}
  start = outputs(_params(), (), [])
  for name, arrays in recorded.items():
    moved = [k for k, x in start.items() if not _same_bits(x, arrays[k][2])]
    assert moved, f"case {name!r}: the params did not move"
  names = list(recorded)
  for i, a in enumerate(names):
    for b in names[i + 1:]:
      assert any(k not in recorded[b] or not _equal(v[2], recorded[b][k][2])
                 for k, v in recorded[a].items()), (a, b)


def _equal(x, y) -> bool:
  if isinstance(x, str) or isinstance(y, str):
    return isinstance(x, str) and isinstance(y, str) and x == y
  return x.shape == y.shape and np.array_equal(x, y)


# --- a 0.2 checkpoint ----------------------------------------------------

CHECKPOINT_CASE = "onebit_adamw"


def test_a_0_2_checkpoint_restores_bitwise(tmp_path):
  """``checkpoint_0.2/``: onebit_adamw's train state after the case's three
  steps, saved by jaxfuse 0.2 with its plan. Restored with this code into
  a fresh state of the same plan, every leaf has its recorded bits."""
  pytest.importorskip("orbax.checkpoint")
  plan, params, state, _ = run_case(CHECKPOINT_CASE)
  if RECORD:
    shutil.rmtree(CHECKPOINT, ignore_errors=True)
    CHECKPOINT.mkdir(parents=True)
    mngr = jaxfuse.checkpoint.manager(CHECKPOINT / "ckpt", max_to_keep=None)
    jaxfuse.checkpoint.save(mngr, STEPS, (params, state), plan,
                            extra={"case": CHECKPOINT_CASE})
    mngr.wait_until_finished()
    mngr.close()
    save(CHECKPOINT / "arrays.npz", outputs(params, state, []))
  shutil.copytree(CHECKPOINT / "ckpt", tmp_path / "ckpt")
  mesh = _mesh(FLAT)
  fresh = jax.device_put(_params(), NamedSharding(mesh, P()))
  like = (fresh, jaxfuse.init_state(_opt("onebit_adamw", plan, FLAT), fresh,
                                   mesh))
  mngr = jaxfuse.checkpoint.manager(tmp_path / "ckpt", max_to_keep=None)
  step, (got_params, got_state) = jaxfuse.checkpoint.restore(mngr, like, plan)
  assert step == STEPS
  assert jaxfuse.checkpoint.saved_extra(mngr, STEPS)["case"] == CHECKPOINT_CASE
  assert jaxfuse.checkpoint.saved_plan(mngr, STEPS).leaves == plan.leaves
  mngr.close()
  assert_bitwise(outputs(got_params, got_state, []), CHECKPOINT /
                 "arrays.npz", "checkpoint_0.2")
