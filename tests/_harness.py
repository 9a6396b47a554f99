"""Shared test helpers: run sparse_sync on given per-worker gradients."""

import contextlib
import functools
import importlib
import math
import os
import pathlib
import subprocess
import sys

import jax
from jax import export
from jax.extend import core as jex
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import jax.numpy as jnp
import numpy as np
import pytest

import jaxfuse

# Workers of the test mesh: 8 simulated CPU devices, or every GPU on a GPU run.
NUM_WORKERS = int(os.environ.get("JAXFUSE_TEST_WORKERS") or (
    len(jax.devices()) if os.environ.get("JAXFUSE_TEST_GPU") == "1" else 8))


REPO = pathlib.Path(__file__).resolve().parents[1]

# XLA's classic CPU emitters, which conftest turns on where XLA has them
_CLASSIC_FLAG = "--xla_cpu_use_fusion_emitters=false"
CLASSIC_EMITTERS = _CLASSIC_FLAG in os.environ.get("XLA_FLAGS", "").split()


def run_under_fusion_emitters(request) -> None:
  """Run the calling test again in a child pytest with XLA's default
  (fusion) CPU emitters, and fail where it fails: for a test that compares
  two programs bit for bit whose last bits the classic emitters round
  differently."""
  flags = os.environ["XLA_FLAGS"].replace(
      _CLASSIC_FLAG, "--xla_cpu_use_fusion_emitters=true")
  child = subprocess.run(
      [sys.executable, "-m", "pytest", "-p", "no:cacheprovider",
       request.node.nodeid], cwd=REPO, env=dict(os.environ, XLA_FLAGS=flags),
      capture_output=True, text=True, timeout=600, check=False)
  assert child.returncode == 0 and " passed" in child.stdout, (
      child.stdout[-5000:] + child.stderr[-2000:])


def all_eqns(jaxpr):
  """Every equation of ``jaxpr`` and of the jaxprs in its equations'
  parameters (shard_map's body, cond's branches, ...), each before its
  own sub-jaxprs', in program order."""
  for eqn in jaxpr.eqns:
    yield eqn
    for sub in jex.jaxprs_in_params(eqn.params):
      yield from all_eqns(sub)


@contextlib.contextmanager
def repo_modules(folder: str, *names: str):
  """The modules ``names`` of the repository's ``folder`` (e.g. "examples",
  "benchmarks") imported, with that folder on ``sys.path`` while the block
  runs: one module for one name, else a tuple."""
  path = str(REPO / folder)
  sys.path.insert(0, path)
  try:
    modules = tuple(importlib.import_module(n) for n in names)
    yield modules[0] if len(modules) == 1 else modules
  finally:
    sys.path.remove(path)


def doc_snippet(doc: str, heading: str) -> str:
  """The first ```python block after ``heading`` in the repository's
  ``doc`` (e.g. "docs/choosing.md")."""
  import re  # pylint: disable=g-import-not-at-top
  section = (REPO / doc).read_text().split(heading, 1)[1]
  return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def mlp_loss(p, batch):
  """A two-layer model's squared error: p = {"w1", "w2"}, batch = (x, y)."""
  x, y = batch
  return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] - y) ** 2)


def mlp_problem(steps: int, workers: int, rows: int = 4, seed: int = 0):
  """``mlp_loss``'s params (32 → 64 → 8) and ``steps`` batches of ``rows``
  rows a worker, from numpy's generator at ``seed``."""
  rng = np.random.default_rng(seed)
  params = {"w1": rng.normal(size=(32, 64)).astype(np.float32) / 6,
            "w2": rng.normal(size=(64, 8)).astype(np.float32) / 8}
  batches = [(rng.normal(size=(rows * workers, 32)).astype(np.float32),
              rng.normal(size=(rows * workers, 8)).astype(np.float32))
             for _ in range(steps)]
  return params, batches


def quickstart_step(opt, mesh, specs, loss=mlp_loss):
  """The README's step, jitted: (params, opt_state, batch) -> (params,
  opt_state), the whole tree differentiated on each worker and stepped."""
  import optax  # pylint: disable=g-import-not-at-top

  def local(params, opt_state, batch):
    grads = jax.grad(loss)(jaxfuse.local_params(params), batch)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  return jax.jit(jax.shard_map(local, mesh=mesh,
                               in_specs=(P(), specs, P("data")),
                               out_specs=(P(), specs)))


def cpu_env(num_devices: int = 8,
            compile_cache: str | os.PathLike | None = None) -> dict[str, str]:
  """Environment of a child process on ``num_devices`` CPU devices (the
  reference path, no accelerator memory) whatever this test run uses, with
  the repository first on its path.

  ``compile_cache``: a directory for JAX's persistent compilation cache, every
  executable written to it: child processes that compile the same programs
  (a run and its resumed twin) compile each once. Give each test run its own
  (the ``compile_cache`` fixture) so every run still compiles everything."""
  env = dict(os.environ)
  flags = [f for f in env.pop("XLA_FLAGS", "").split()
           if "xla_force_host_platform_device_count" not in f]
  for var in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES",
              "JAX_PROCESS_ID", "JAX_LOCAL_DEVICE_IDS", "CUDA_VISIBLE_DEVICES",
              "JAXFUSE_KERNELS", "JAXFUSE_TEST_GPU", "JAXFUSE_TEST_WORKERS"):
    env.pop(var, None)
  env.update(
      JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES=str(num_devices),
      XLA_FLAGS=" ".join(flags + [
          f"--xla_force_host_platform_device_count={num_devices}"]),
      PYTHONPATH=os.pathsep.join([str(REPO)] + [
          p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]))
  if compile_cache is not None:
    env.update(JAX_COMPILATION_CACHE_DIR=str(compile_cache),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
  return env


@functools.lru_cache(maxsize=None)
def _flat_normal(size: int):
  return jax.jit(lambda key: jax.random.normal(key, (size,)))


def random_normal(key, shape) -> np.ndarray:
  """``jax.random.normal(key, shape)`` (float32) bit for bit, as numpy,
  compiled once per power-of-two size rather than once per shape (each
  compile of the generator costs ~0.5 s on CPU): with partitionable
  threefry an element's bits depend only on the key and its flat index."""
  shape = tuple(shape)
  if not jax.config.jax_threefry_partitionable:
    return np.asarray(jax.random.normal(key, shape))
  n = math.prod(shape)
  size = max(1024, 1 << max(n - 1, 0).bit_length())
  return np.asarray(_flat_normal(size)(key))[:n].reshape(shape)


def mesh_of(k: int, **kwargs):
  """``jaxfuse.make_mesh(k, ...)``; skips the test where fewer than k
  devices exist (a GPU run on 1 or 2 GPUs: the CPU suite runs it on 8)."""
  import pytest  # pylint: disable=g-import-not-at-top
  if k > len(jax.devices()):
    pytest.skip(f"needs {k} devices; {len(jax.devices())} here")
  return jaxfuse.make_mesh(k, **kwargs)


def shard(mesh, tree):
  """Place (K, ...) arrays with their leading axis over the workers."""
  return jax.device_put(tree, NamedSharding(mesh, P("data")))


# XLA options for programs compiled once and run once or twice (a property
# test's many one-off steps), CPU only: the legacy fusion emitters and LLVM
# at -O0 compile such a step about 3x faster (2.2 -> 0.7 s for three sparse
# leaves on 8 CPU devices). The HLO and XLA's HLO passes are the same; only
# the machine code is less optimized.
_FAST_COMPILE = {"xla_cpu_use_fusion_emitters": False,
                 "xla_backend_optimization_level": 0}


@functools.cache
def fast_compile_options() -> tuple[tuple[str, object], ...]:
  """``_FAST_COMPILE`` as a hashable tuple on CPU, where this XLA knows them
  (a trivial program tried once); else () (the default compile)."""
  if jax.devices()[0].platform != "cpu":
    return ()
  try:
    jax.jit(lambda x: x + 1, compiler_options=_FAST_COMPILE).lower(
        np.float32(0)).compile()
  except Exception:  # pylint: disable=broad-except  # an unknown option
    return ()
  return tuple(sorted(_FAST_COMPILE.items()))


# XLA options for a step run many times (a controller's tens of steps):
# LLVM's default optimizations, not the suite's -O0 (conftest, for programs
# run once or twice). The HLO and XLA's HLO passes are the same, and the
# arithmetic (IEEE, no fast math); only the machine code is faster.
_FAST_RUN = {"xla_backend_optimization_level": 2}


def fast_run_options() -> tuple[tuple[str, object], ...]:
  """``_FAST_RUN`` as a hashable tuple on CPU; else () (the default)."""
  if jax.devices()[0].platform != "cpu":
    return ()
  return tuple(sorted(_FAST_RUN.items()))


def fast_jit(fn):
  """``jax.jit(fn)`` compiled with ``fast_compile_options()`` (for programs
  run once or twice; the default compile off CPU)."""
  return jax.jit(fn, compiler_options=dict(fast_compile_options()) or None)


@functools.lru_cache(maxsize=None)
def _sync_fn(plan_json, mesh, options=()):
  plan = jaxfuse.Plan.from_json(plan_json)
  tx = jaxfuse.sparse_sync(plan)
  params = jax.tree.unflatten(
      jax.tree.structure([0] * len(plan.leaves)),
      [jax.ShapeDtypeStruct(l.shape, l.dtype) for l in plan.leaves])
  specs = jaxfuse.state_specs(jax.eval_shape(tx.init, params))
  return jax.jit(sharded_update(tx, mesh, specs),
                 compiler_options=dict(options) or None)


def sharded_update(tx, mesh, specs, local_grads=None, with_params=False):
  """``tx.update`` under ``shard_map``: (K, ...) grads in, (synced, state) out.

  ``local_grads`` maps the worker's (1, ...) blocks to its gradients
  (default: drop the leading axis of each). ``with_params``: a third
  argument, the replicated params, passed on to ``tx.update``.
  """
  local_grads = local_grads or (lambda g: jax.tree.map(lambda x: x[0], g))
  if with_params:
    return jax.shard_map(lambda g, s, p: tx.update(local_grads(g), s, p),
                         mesh=mesh, in_specs=(P("data"), specs, P()),
                         out_specs=(P(), specs))
  return jax.shard_map(lambda g, s: tx.update(local_grads(g), s), mesh=mesh,
                       in_specs=(P("data"), specs), out_specs=(P(), specs))


def init(plan, mesh):
  """Sharded sparse_sync state for a plan whose leaves are a flat list."""
  params = [np.zeros(l.shape, jnp.dtype(l.dtype)) for l in plan.leaves]
  return jaxfuse.init_state(jaxfuse.sparse_sync(plan), params, mesh)


def sync(plan, mesh, grads, state, *, fast_compile: bool = False,
         fast_run: bool = False):
  """grads: list of (K, *shape) arrays, one per plan leaf -> (synced, state).

  The step is compiled once per plan and mesh; ``fast_compile``: with
  ``fast_compile_options()`` (for plans that run only a step or two);
  ``fast_run``: with ``fast_run_options()`` (for plans run many steps).
  """
  assert not (fast_compile and fast_run), "one of fast_compile, fast_run"
  options = (fast_compile_options() if fast_compile else
             fast_run_options() if fast_run else ())
  return _sync_fn(plan.to_json(), mesh, options)(shard(mesh, list(grads)),
                                                  state)


def gathered_words(plan, mesh, axis_name="data") -> list[int]:
  """Per uint32 ``all_gather`` of the lowered sync step of ``plan`` (a
  flat list of leaves) over the mesh axes ``axis_name``, the words each
  member contributes (its operand), sorted."""
  import re  # pylint: disable=g-import-not-at-top
  tx = jaxfuse.sparse_sync(plan, axis_name=axis_name)
  params = [np.zeros(l.shape, jnp.dtype(l.dtype)) for l in plan.leaves]
  state = jaxfuse.init_state(tx, params, mesh, axis_name)
  specs = jaxfuse.state_specs(state, axis_name)
  grads = [np.zeros((mesh.size,) + tuple(l.shape), jnp.dtype(l.dtype))
           for l in plan.leaves]
  step = jax.shard_map(lambda g, s: tx.update([x[0] for x in g], s),
                       mesh=mesh, in_specs=(P(axis_name), specs),
                       out_specs=(P(), specs))
  text = jax.jit(step).lower(jax.device_put(grads, NamedSharding(
      mesh, P(axis_name))), state).as_text()
  out = []
  for line in text.splitlines():
    operand = line.rsplit(" : ", 1)[-1].split("->")[0]   # (tensor<…>)
    dims = re.findall(r"tensor<([0-9x]+)xui32>", operand)
    if "all_gather" in line and dims:
      out.append(math.prod(int(d) for d in dims[0].split("x")))
  return sorted(out)


def list_plan(shapes, dtype="float32", **kwargs):
  """A plan for params given as a flat list of shapes."""
  params = [jax.ShapeDtypeStruct(s, dtype) for s in shapes]
  return jaxfuse.plan(params, **kwargs)


def per_device(x):
  """The distinct buffers of an array, one per device, as numpy."""
  return [np.asarray(s.data) for s in x.addressable_shards]


def assert_replicas_identical(arrays, num_devices: int | None = None):
  """Each array's buffer is bitwise the same on every device (and, given
  ``num_devices``, there are that many copies)."""
  for x in arrays:
    copies = per_device(x)
    if num_devices is not None:
      assert len(copies) == num_devices
    for c in copies[1:]:
      np.testing.assert_array_equal(c, copies[0])


def cuda_lowering_context():
  """Where this JAX lowers Pallas for CUDA only for a known GPU (0.12 on):
  an abstract H100 to lower for, no GPU needed; else nothing."""
  if not hasattr(jax.sharding, "AbstractDevice"):
    return contextlib.nullcontext()
  try:
    dev = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3",
                                      num_cores=132, platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",),
                                     (jax.sharding.AxisType.Explicit,),
                                     abstract_device=dev)
  except TypeError:
    return contextlib.nullcontext()
  return jax.sharding.use_abstract_mesh(mesh)


def triton_kernels_for_cuda(jitted, *specs) -> int:
  """How many Triton kernels ``jitted`` lowers to for CUDA at ``specs``
  (``jax.export``, for an abstract H100 where this JAX has them and
  nothing is sharded over a mesh of this host's devices, which a
  ``shard_map`` inside must match; no GPU needed where this JAX lowers
  for CUDA without one, else the test is skipped)."""
  sharded = any(isinstance(getattr(s, "sharding", None),
                           jax.sharding.NamedSharding) for s in specs)
  try:
    with contextlib.nullcontext() if sharded else cuda_lowering_context():
      exported = export.export(jitted, platforms=["cuda"], disabled_checks=[
          export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(
              *specs)
  except RuntimeError as e:
    if "GPU" not in str(e):
      raise
    pytest.skip(f"this JAX cannot lower for CUDA without a GPU: {e}")
  return exported.mlir_module().count("xla.gpu.triton")


# Non-negative magnitudes of several kinds, (rng, shape) -> float64 array:
# the radix selects' test rows.
MAGNITUDES = {
    "normal": lambda rng, shape: np.abs(rng.normal(size=shape)),
    "heavy": lambda rng, shape: np.abs(rng.standard_t(1, size=shape)) * 1e30,
    "ties": lambda rng, shape: np.round(np.abs(rng.normal(size=shape)) * 3),
    "tiny": lambda rng, shape: np.abs(rng.normal(size=shape)) * 1e-40,
}


def magnitude_rows(rng, kind, widths, zeros, rank, nan=False):
  """Two float32 rows of ``MAGNITUDES[kind]`` per width, a share ``zeros``
  of them 0, in rows longer than 3 two infinities (and, with ``nan``, a
  NaN); and each width's rank ``rank(w)``. Returns (rows, ranks)."""
  rows, ranks = [], []
  for w in widths:
    a = MAGNITUDES[kind](rng, (2, w)).astype(np.float32)
    a[rng.random((2, w)) < zeros] = 0
    if w > 3:
      a[1, :2] = np.inf
      if nan:
        a[0, w - 1] = np.nan      # the largest, as in lax.top_k
    rows.append(a)
    ranks.append(rank(w))
  return rows, ranks


@contextlib.contextmanager
def pass1_segments():
  """Records each traced fused pass 1 (one Pallas call per bucket): per
  call, per segment (a batch of rows), its operands' shapes (τs, the
  streams, r). JAX's caches are cleared first, so every step traces."""
  from jaxfuse.kernels import segments  # pylint: disable=g-import-not-at-top
  seen = []
  real = segments.segmented_call

  def record(segs, **kw):
    if kw.get("name") == "jaxfuse_sparsify_pass1":
      seen.append([[tuple(x.shape) for x in s.inputs] for s in segs])
    return real(segs, **kw)

  jax.clear_caches()
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(segments, "segmented_call", record)
    yield seen
