"""Eight simulated CPU devices, configured before JAX starts.

GPU run (every test on the GPUs, kernels compiled):

  JAX_PLATFORMS=cuda,cpu JAXFUSE_TEST_GPU=1 JAXFUSE_KERNELS=pallas pytest

There the workers are the GPUs (``JAXFUSE_TEST_WORKERS`` overrides the count
anywhere, e.g. 2 to try a GPU-sized mesh on CPU).
"""

import atexit
import os
import shutil
import subprocess
import sys
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if os.environ.get("JAXFUSE_TEST_GPU") == "1":   # memory as the tests need it
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=8")
# CPU programs compiled without LLVM's optimizations: the tests' programs
# are small and compile-bound (a subset on 2 cores: 3 min 33 s -> 2 min
# 53 s); the results keep IEEE semantics (no fast math either way). Child
# processes (``_harness.cpu_env``) inherit it. Not on the GPU run, whose
# kernels are compiled for real.
if (os.environ["JAX_PLATFORMS"] == "cpu" and
    "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", "")):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_backend_optimization_level=0")
# ... and with XLA's classic CPU emitters where this XLA still has them
# (JAX 0.10; the first interpreter's part of the suite on 2 cores: 14 min
# 15 s -> 8 min 57 s, most of it compiling). An XLA that does not know a
# flag aborts the process, so a child process tries it first (~2 s).
# ``_harness.CLASSIC_EMITTERS`` says where it is on.
_CLASSIC = "--xla_cpu_use_fusion_emitters=false"


def _xla_accepts(flag: str) -> bool:
  import resource  # pylint: disable=g-import-not-at-top
  probe = subprocess.run(   # an abort writes no core file
      [sys.executable, "-c", "import jax; jax.devices('cpu')"],
      env={**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": flag},
      capture_output=True, timeout=300, check=False,
      preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_CORE, (0, 0)))
  return probe.returncode == 0


if (os.environ["JAX_PLATFORMS"] == "cpu" and
    "xla_cpu_use_fusion_emitters" not in os.environ.get("XLA_FLAGS", "") and
    _xla_accepts(_CLASSIC)):
  os.environ["XLA_FLAGS"] += " " + _CLASSIC

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import pytest  # pylint: disable=g-import-not-at-top,wrong-import-position

import jaxfuse  # pylint: disable=g-import-not-at-top,wrong-import-position

from _harness import NUM_WORKERS  # pylint: disable=g-import-not-at-top,wrong-import-position

# A persistent compilation cache for this test process alone, new each run
# and removed at its end: every program is still compiled once per run, but
# one that a later module compiles again (after ``_drop_compiled_programs``,
# or a new function with the same program) is loaded instead (the whole
# suite on a 2-core machine: 24 min 3 s -> 20 min 14 s). Set in JAX's
# config, not the environment, so child processes keep theirs
# (``_harness.cpu_env``); a cache the caller chose (JAX_COMPILATION_CACHE_DIR)
# is left alone.
_CACHE = None
if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
  _CACHE = tempfile.mkdtemp(prefix="jaxfuse-tests-xla-cache-")
  atexit.register(shutil.rmtree, _CACHE, True)
  jax.config.update("jax_compilation_cache_dir", _CACHE)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_configure(config):
  config.addinivalue_line(
      "markers", "example: runs examples/train_lm.py or the CLI end to end in "
      "subprocesses (scripts/test.sh runs each on one interpreter only)")
  config.addinivalue_line(
      "markers", "multiprocess: several processes under jax.distributed")
  config.addinivalue_line(
      "markers", "second: an example test scripts/test.sh runs on the second "
      "interpreter (Python 3.12) when there is one, to balance the two runs")


@pytest.fixture(scope="module", autouse=True)
def _drop_compiled_programs():
  """After each test module, JAX's compiled programs are dropped. Each
  XLA:CPU program holds about 18 memory mappings; the whole suite in one
  process compiles thousands, and at the kernel's vm.max_map_count (65530
  on the CI machine) the next compile aborts the interpreter."""
  yield
  jax.clear_caches()


@pytest.fixture(scope="session")
def compile_cache(tmp_path_factory):
  """A persistent compilation cache for this run's child processes (see
  ``_harness.cpu_env``): new each run, so each program is still compiled once
  per run; a resumed run loads what its straight twin compiled. It is this
  process's own cache (above) where there is one, so a child also loads
  what a test in this process compiled (e.g. ``jaxfuse profile``'s sparse
  steps), and the reverse."""
  if _CACHE is not None:
    return _CACHE
  return tmp_path_factory.mktemp("jax_compile_cache")


@pytest.fixture(scope="session")
def mesh():
  assert len(jax.devices()) >= NUM_WORKERS, jax.devices()
  return jaxfuse.make_mesh(NUM_WORKERS)


@pytest.fixture(scope="session")
def lm_gradients():
  """Real gradients: the example LM's largest leaf, 8 workers, 6 steps.

  Each step is a different batch per worker, taken along a short SGD run so
  the gradients are those of a model that is learning, not only at init.
  """
  import pathlib  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "examples"))
  import lm_model  # pylint: disable=g-import-not-at-top
  model = lm_model.build_model("tiny", seq_len=64)
  train, _ = lm_model.load_corpus(cap_bytes=2**20)
  rng = np.random.default_rng(0)
  params = model.init(jax.random.PRNGKey(0),
                      lm_model.sample_batch(rng, train, 1, 64)[:, :-1])["params"]
  grad = jax.grad(lm_model.make_loss(model))
  grad_fn = jax.jit(grad)
  leaves = jax.tree.leaves(params)
  big = max(range(len(leaves)), key=lambda i: leaves[i].size)
  # every worker's gradient on its own batch, in one call
  worker_grads = jax.jit(jax.vmap(
      lambda p, b: jax.tree.leaves(grad(p, b))[big].reshape(-1),
      in_axes=(None, 0)))
  out = []
  for _ in range(6):
    out.append(worker_grads(params, np.stack([lm_model.sample_batch(
        rng, train, 4, 64) for _ in range(NUM_WORKERS)])))
    params = jax.tree.map(lambda p, g: p - 0.5 * g, params,
                          grad_fn(params, lm_model.sample_batch(rng, train, 32,
                                                                64)))
  return out
