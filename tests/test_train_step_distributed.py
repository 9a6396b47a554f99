"""make_train_step under jax.distributed: 2 processes of 4 CPU devices, one
8-worker mesh. Each process feeds its own rows as global arrays; both
check that they compiled the same collectives (at each phase's first
step) and end with bitwise the same params, which follow one process on
8 devices to float rounding. A host array where a global one is needed
is refused, naming ``jax.make_array_from_process_local_data``.

The file is also the worker: ``python tests/test_train_step_distributed.py
--process-id I --num-processes N --port P --out FILE``.
"""

import functools
import pathlib
import sys

import numpy as np
import pytest

STEPS = 3


def _problem():
  rng = np.random.default_rng(0)
  params = {"w1": rng.normal(size=(32, 64)).astype(np.float32) / 6,
            "w2": rng.normal(size=(64, 8)).astype(np.float32) / 8}
  batches = [(rng.normal(size=(32, 32)).astype(np.float32),
              rng.normal(size=(32, 8)).astype(np.float32))
             for _ in range(STEPS)]
  return params, batches


def _train(jax, jaxfuse, to_global):
  """STEPS steps (one dense, then the plan): the final params, numpy."""
  from _harness import mlp_loss  # pylint: disable=g-import-not-at-top
  params, batches = _problem()
  mesh = jaxfuse.make_mesh()
  plan = jaxfuse.plan(params, density=0.1,
                      settings=jaxfuse.Settings(min_sparse_size=64))
  phases = jaxfuse.density_warmup(plan, dense_steps=1, steps=0)
  opt = functools.partial(jaxfuse.sgd, learning_rate=0.05, momentum=0.9)
  state, step = jaxfuse.make_train_step(mlp_loss, params, opt, phases, mesh)
  refused = ""
  if jax.process_count() > 1:
    try:
      step(state, batches[0])
    except ValueError as e:
      refused = str(e)
  for batch in batches:
    state, _ = step(state, to_global(mesh, batch))
  # replicated: this process's first copy holds the whole array
  return jax.tree.map(lambda x: np.asarray(x.addressable_shards[0].data),
                      state.params), refused


def worker_main():
  sys.path.insert(0, str(pathlib.Path(__file__).parent))
  import jax  # pylint: disable=g-import-not-at-top
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  from _worker_args import join_job  # pylint: disable=g-import-not-at-top
  args = join_job()
  from jax.sharding import NamedSharding  # pylint: disable=g-import-not-at-top
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top
  import jaxfuse  # pylint: disable=g-import-not-at-top

  def to_global(mesh, batch):
    rows = 32 // jax.process_count()
    mine = slice(jax.process_index() * rows, (jax.process_index() + 1) * rows)
    return jax.tree.map(lambda x: jax.make_array_from_process_local_data(
        NamedSharding(mesh, P("data")), x[mine]), batch)

  params, refused = _train(jax, jaxfuse, to_global)
  np.savez(args.out, refused=np.array(refused), **params)


@pytest.mark.multiprocess
def test_two_processes_train_as_one(tmp_path):
  import jax  # pylint: disable=g-import-not-at-top
  import jaxfuse  # pylint: disable=g-import-not-at-top
  from test_distributed import _launch  # pylint: disable=g-import-not-at-top

  def command(pid, num_processes, port, out):
    return [sys.executable, __file__, "--process-id", str(pid),
            "--num-processes", str(num_processes), "--port", str(port),
            "--out", str(out)]

  outs = _launch(2, tmp_path, "builder", command)
  got = []
  for out in outs:
    with np.load(out) as z:
      got.append({k: z[k] for k in z.files})
  one, _ = _train(jax, jaxfuse, lambda mesh, batch: batch)
  params, _ = _problem()
  for name in ("w1", "w2"):
    assert got[0][name].tobytes() == got[1][name].tobytes()   # replicas
    np.testing.assert_allclose(got[0][name], one[name], rtol=1e-5,
                               atol=1e-6)
    assert not np.allclose(got[0][name], params[name])       # it trained
  refused = str(got[0]["refused"])
  assert "under jax.distributed" in refused
  assert "make_array_from_process_local_data" in refused


if __name__ == "__main__":
  worker_main()
