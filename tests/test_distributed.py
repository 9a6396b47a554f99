"""Multi-process (jax.distributed) runs give the single-process results.

Launches tests/_distributed_worker.py twice:
  * reference: 1 process with 8 CPU devices;
  * distributed: 2 processes x 4 CPU devices on localhost, jax.distributed
    with gloo collectives, the same global 8-worker mesh and global batch;
and compares the synchronized gradients, params and per-worker sync state
after each of the worker's training steps; and the hierarchical "hier"
collective on 2 hosts × 4 devices (host = process) against flat "allgather".

Exactness: the worker trains two variants of the model (see its docstring).
In "exact" the dense-leaf gradients are quantized so that their all-reduce is
exact in any summation order, and the 2-process run must then match the
1-process run bit for bit. In "float" they are plain float32: XLA's in-process
CPU all-reduce adds the 8 workers in rank order while gloo's all-reduce adds
them in another order, so the psum buckets (and everything after step 0) may
differ by a few ulps; there only the sparse all_gather path of step 0 is
required to be bitwise equal, the rest to tight tolerances.
"""

from __future__ import annotations

import pathlib
import re
import shlex
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from _harness import cpu_env

REPO = pathlib.Path(__file__).resolve().parent.parent
WORKER = pathlib.Path(__file__).resolve().parent / "_distributed_worker.py"
NUM_DEVICES = 8
NUM_PROCESSES = 2
TIMEOUT_S = 300
FAILURE_GRACE_S = 10
# what the coordinator prints (then it crashes) when its port is taken
PORT_TAKEN = "Failed to add port to server"
STEPS = 3
HIER_STEPS = 2
LEAVES = ("w1", "b1", "w2", "b2")


def _free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("", 0))  # the coordinator binds every interface
    return s.getsockname()[1]


def _worker_command(pid, num_processes, port, out):
  return [sys.executable, str(WORKER), "--process-id", str(pid),
          "--num-processes", str(num_processes), "--port", str(port),
          "--out", str(out)]


def _launch(num_processes: int, workdir: pathlib.Path, tag: str,
            command=_worker_command):
  """Runs ``command(pid, num_processes, port, out)`` (default: the worker)
  as `num_processes` processes; returns their out files.

  The free port is found before the coordinator binds it, so another program
  may take it in between: only that failure is retried, once, on a new port.
  """
  for attempt in range(2):
    failure = _try_launch(num_processes, workdir, f"{tag}{attempt or ''}",
                          command)
    if isinstance(failure, list):
      return failure
    if not (num_processes > 1 and PORT_TAKEN in failure):
      break
  pytest.fail(failure, pytrace=False)


def _try_launch(num_processes: int, workdir: pathlib.Path, tag: str,
                command):
  """The out files, or the failure report as a string."""
  port = _free_port() if num_processes > 1 else 0
  env = cpu_env(NUM_DEVICES // num_processes)
  procs, outs, logs = [], [], []
  for pid in range(num_processes):
    out = workdir / f"{tag}_p{pid}.npz"
    log = workdir / f"{tag}_p{pid}.log"
    cmd = command(pid, num_processes, port, out)
    with open(log, "wb") as f:
      procs.append(subprocess.Popen(cmd, env=env, cwd=REPO, stdout=f,
                                    stderr=subprocess.STDOUT))
    outs.append(out)
    logs.append(log)

  # Wait for all; once one has failed, the others would only hang in a
  # collective or barrier, so give them a few seconds to report, then stop them.
  deadline = time.monotonic() + TIMEOUT_S
  timed_out = False
  while True:
    codes = [p.poll() for p in procs]  # poll every one: sets returncode
    if None not in codes:
      break
    now = time.monotonic()
    if any(c not in (None, 0) for c in codes):
      deadline = min(deadline, now + FAILURE_GRACE_S)
    elif now > deadline:
      timed_out = True
    if now > deadline:
      break
    time.sleep(0.2)
  for p in procs:
    if p.poll() is None:
      p.kill()
      p.wait()

  failed = [pid for pid, p in enumerate(procs) if p.returncode != 0]
  if failed:
    report = []
    for pid, (p, log) in enumerate(zip(procs, logs)):
      text = log.read_text(errors="replace")
      report.append(f"--- {tag} process {pid}: rc={p.returncode}\n"
                    f"$ {shlex.join(p.args)}\n{text[-4000:]}")
    why = f"timed out after {TIMEOUT_S}s" if timed_out else "failed"
    return (f"{tag} run {why} (processes {failed} of {num_processes})\n"
            + "\n".join(report))
  return outs


def _load(path) -> dict[str, np.ndarray]:
  with np.load(path) as z:
    return {k: z[k] for k in z.files}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("distributed")
  t0 = time.monotonic()
  (ref,) = _launch(1, workdir, "single")
  t1 = time.monotonic()
  dist = _launch(NUM_PROCESSES, workdir, "multi")
  t2 = time.monotonic()
  print(f"\nsingle-process run {t1 - t0:.1f}s, "
        f"{NUM_PROCESSES}-process run {t2 - t1:.1f}s")
  return _load(ref), [_load(p) for p in dist]


def _keys(data, prefix, kind=None, leaves=LEAVES):
  out = []
  for k in sorted(data):
    parts = k.split("/")
    if parts[0] != prefix or (kind is not None and parts[1] != kind):
      continue
    if parts[1] in ("synced", "dense", "local", "params") and (
        parts[-1] not in leaves):
      continue
    out.append(k)
  assert out, (prefix, kind)
  return out


def _sparse_leaves(data):
  return [p.strip("[]'\"") for p, s in
          zip(data["leaf_paths"], data["leaf_sparse"]) if s]


def test_every_process_wrote_the_same_global_values(runs):
  ref, dist = runs
  assert set(dist[0]) == set(ref)
  for other in dist[1:]:
    assert set(other) == set(dist[0])
    for k in dist[0]:
      np.testing.assert_array_equal(other[k], dist[0][k], err_msg=k)


def test_relayout_of_global_arrays_moves_every_residual(runs):
  # relayout on arrays spread over processes: the same arrays as on one
  # process, and each worker's residuals are the same numbers, regrouped.
  ref, dist = runs
  moved = _keys(ref, "relayout")
  for k in moved:
    np.testing.assert_array_equal(dist[0][k], ref[k], err_msg=k)
  old = [ref[k] for k in _keys(ref, "exact", "residual")]
  new = [ref[k] for k in moved]
  per_worker = lambda arrays: np.sort(np.concatenate(
      [a.reshape(a.shape[0], -1) for a in arrays], axis=1), axis=1)
  assert np.abs(old[0]).max() > 0
  np.testing.assert_array_equal(per_worker(new), per_worker(old))


def test_plan_uses_both_allgather_and_psum_buckets(runs):
  ref, dist = runs
  assert set(ref["bucket_collectives"]) == {"allgather", "psum"}
  assert _sparse_leaves(ref) == ["w1", "w2"]
  np.testing.assert_array_equal(dist[0]["bucket_collectives"],
                                ref["bucket_collectives"])


def test_exact_variant_is_bitwise_equal(runs):
  """Order-independent dense sums: the whole trajectory matches exactly."""
  ref, (dist, *_) = runs
  sparse = _sparse_leaves(ref)
  dense = [l for l in LEAVES if l not in sparse]
  checked = 0
  for k in _keys(ref, "exact"):
    parts = k.split("/")
    if parts[1] == "loss":
      # pmean of float losses: summation order differs, reporting only.
      np.testing.assert_allclose(dist[k], ref[k], rtol=1e-6, err_msg=k)
      continue
    if parts[1] == "dense" and parts[-1] in sparse:
      # pmean of un-quantized gradients: a reference only, not synchronized
      # by jaxfuse; order-dependent in the last bit.
      np.testing.assert_allclose(dist[k], ref[k], rtol=1e-5, atol=1e-7,
                                 err_msg=k)
      continue
    np.testing.assert_array_equal(dist[k], ref[k], err_msg=k)
    checked += 1
  # synced + params + local per step and leaf, dense refs of the dense
  # leaves, residuals and stats are all among the bitwise-checked ones.
  assert checked >= STEPS * 3 * len(LEAVES) + STEPS * len(dense)
  assert (dist["exact/step"] == STEPS).all()


def test_float_variant_matches_to_rounding(runs):
  ref, (dist, *_) = runs
  sparse = _sparse_leaves(ref)
  for k in _keys(ref, "float"):
    if ref[k].dtype.kind in "biu":  # step, selected, candidates, missing, ...
      np.testing.assert_array_equal(dist[k], ref[k], err_msg=k)
    else:
      np.testing.assert_allclose(dist[k], ref[k], rtol=1e-5, atol=1e-7,
                                 err_msg=k)
  # Step 0: identical inputs and the sparse path has no summation-order
  # freedom (all_gather, then decode adds workers in rank order).
  for leaf in sparse:
    for kind in ("local", "synced", "params"):
      k = f"float/{kind}/0/{leaf}"
      np.testing.assert_array_equal(dist[k], ref[k], err_msg=k)


@pytest.mark.parametrize("variant", ["exact", "float"])
def test_sparsification_really_happened(runs, variant):
  """The synchronized gradient is not just the dense mean, so the test bites."""
  ref, (dist, *_) = runs
  sparse = _sparse_leaves(ref)
  capacity = dict(zip([p.strip("[]'\"") for p in ref["leaf_paths"]],
                      ref["leaf_capacity"]))
  for data in (ref, dist):
    for i in range(STEPS):
      for leaf in LEAVES:
        local = data[f"{variant}/local/{i}/{leaf}"]
        synced = data[f"{variant}/synced/{i}/{leaf}"]
        dense = data[f"{variant}/dense/{i}/{leaf}"]
        # Workers really have different gradients.
        assert not np.allclose(local[0], local[1]), (variant, i, leaf)
        if leaf in sparse:
          nonzero = np.count_nonzero(synced)
          assert 0 < nonzero <= NUM_DEVICES * capacity[leaf] < synced.size
          dropped = (synced == 0) & (dense != 0)
          assert dropped.mean() > 0.5, (variant, i, leaf, dropped.mean())
          assert np.abs(synced - dense).max() > 1e-3 * np.abs(dense).max()
        else:
          np.testing.assert_allclose(synced, dense, rtol=1e-6, atol=1e-8)
          if variant == "exact":
            np.testing.assert_array_equal(synced, dense)
    sel = data[f"{variant}/stats/selected"]  # (workers, leaves)
    assert sel.shape == (NUM_DEVICES, len(LEAVES))
    paths = [p.strip("[]'\"") for p in data["leaf_paths"]]
    for leaf in LEAVES:
      j = paths.index(leaf)
      if leaf in sparse:
        assert (sel[:, j] > 0).all() and (sel[:, j] <= capacity[leaf]).all()
      else:
        assert (sel[:, j] == capacity[leaf]).all()


def test_hier_equals_flat_bitwise(runs):
  """2 × 4 ``("host", "local")`` mesh, one host row per process: the
  ``"hier"`` buckets (dense reduce-scatter in a process, sparse all_gather
  across the two over gloo) give the flat ``"allgather"`` result bit for bit
  (every gradient quantized, nothing dropped), in both runs; and the
  2-process run gives the 1-process one."""
  ref, (dist, *_) = runs
  sparse = _sparse_leaves(ref)
  for data in (ref, dist):
    assert "hier" in set(data["hier/collectives"])
    assert "allgather" in set(data["hierflat/collectives"])
    for i in range(HIER_STEPS):
      for leaf in LEAVES:
        k = f"hier/synced/{i}/{leaf}"
        np.testing.assert_array_equal(data[k], data["hierflat" + k[4:]],
                                      err_msg=k)
    res = [k for k in data if k.startswith("hier/residual/")]
    assert res
    for k in res:
      np.testing.assert_array_equal(data[k], data["hierflat" + k[4:]],
                                    err_msg=k)
    # Sparse for real: the sparse leaves held something back.
    assert sum(np.count_nonzero(data[k]) for k in res) > 0
    assert all(np.count_nonzero(data[f"hier/synced/0/{l}"]) for l in sparse)
  hier = [k for k in ref if k.startswith("hier")]
  assert len(hier) >= 2 * HIER_STEPS * len(LEAVES)
  for k in hier:
    np.testing.assert_array_equal(dist[k], ref[k], err_msg=k)


# --- the example end to end: 2 processes, checkpoint, resume ------------------

EXAMPLE = REPO / "examples" / "train_lm.py"


def _example(workdir, tag, *flags):
  """examples/train_lm.py as 2 processes x 4 CPU devices; process 0's JSON."""
  def command(pid, num_processes, port, out):
    return [sys.executable, str(EXAMPLE), "--cpu-devices", "4",
            "--coordinator", f"localhost:{port}", "--num-processes",
            str(num_processes), "--process-id", str(pid), "--json-out",
            str(out), "--steps", "6", "--seq-len", "32", "--batch-size", "16",
            "--corpus-mb", "0.25", "--eval-batches", "1", "--log-every", "1",
            "--optimizer", "local_adamw", "--checkpoint-dir",
            str(workdir / "ck"), *flags]
  outs = _launch(NUM_PROCESSES, workdir, tag, command)
  import json  # pylint: disable=g-import-not-at-top
  return json.loads(outs[0].read_text())


@pytest.mark.example
@pytest.mark.multiprocess
def test_example_under_jax_distributed_resumes_bitwise(tmp_path):
  """The example on 2 processes (each loading its own rows) saves at 3 and
  6; resumed from 3 in new processes it gives the same losses, bit for bit,
  and the per-worker state it restored was written by both processes."""
  straight = _example(tmp_path, "straight", "--checkpoint-every", "3")
  assert straight["config"]["num_devices"] == NUM_DEVICES
  assert straight["replicas_identical"]
  import shutil  # pylint: disable=g-import-not-at-top
  shutil.rmtree(tmp_path / "ck" / "6")   # as if killed before the last save
  resumed = _example(tmp_path, "resumed", "--resume")
  assert resumed["start_step"] == 3
  assert resumed["losses"] == straight["losses"][3:]
  assert resumed["final_val_loss"] == straight["final_val_loss"]
  assert resumed["losses"][-1] < straight["losses"][0]


# --- profiled costs: one set for every process -----------------------------------

@pytest.mark.multiprocess
def test_profiled_costs_are_process_0s_on_every_process(tmp_path):
  """Each process fits its own costs (its own clock); planning from them
  could compile different programs per process. ``same_on_every_process``
  (what ``profile`` returns) hands every process process 0's, whole
  (non-ASCII provenance included)."""
  worker = pathlib.Path(__file__).resolve().parent / "_costs_worker.py"

  def command(pid, num_processes, port, out):
    return [sys.executable, str(worker), "--process-id", str(pid),
            "--num-processes", str(num_processes), "--port", str(port),
            "--out", str(out)]
  outs = _launch(NUM_PROCESSES, tmp_path, "costs", command)
  from jaxfuse.planning.costs import Costs  # pylint: disable=g-import-not-at-top
  got = [Costs.from_json(o.read_text()) for o in outs]
  assert got[0] == got[1]
  assert got[1].provenance == {"process": 0, "note": "ü"}
  assert got[1].collectives["psum"].alpha == 1e-6
  assert got[1].bucket == 1e-4 and got[1].backward == (1e-3,)


# --- the processes' compiled collectives agree, or an error says where ------

@pytest.mark.multiprocess
def test_processes_that_compiled_different_collectives_get_an_error(tmp_path):
  """Run as they are, programs whose collectives differ between processes
  wait for each other for ever. ``check_same_collectives`` passes the
  same program on both processes and, when process 1 compiled an extra
  psum, raises on both, naming the first collective that differs."""
  worker = pathlib.Path(__file__).resolve().parent / "_agreement_worker.py"

  def command(pid, num_processes, port, out):
    return [sys.executable, str(worker), "--process-id", str(pid),
            "--num-processes", str(num_processes), "--port", str(port),
            "--out", str(out)]
  import json  # pylint: disable=g-import-not-at-top
  import re  # pylint: disable=g-import-not-at-top
  got = [json.loads(o.read_text())
         for o in _launch(NUM_PROCESSES, tmp_path, "agree", command)]
  same = got[0]["same"]
  assert got[1]["same"] == same
  assert [c.split(" ")[0] for c in same] == ["all-gather", "all-reduce"]
  assert got[0]["error"] == got[1]["error"]
  m = re.search(r"for the test's program: process 1 differs from process 0 "
                r"at collective (\d+)", got[0]["error"] or "")
  assert m and int(m.group(1)) >= 1      # the all-gather agrees
  assert "wait for ever" in got[0]["error"]


# --- a process that dies: the launcher names it and stops the others ---------

_DYING_WORKER = '''
import argparse, os, pathlib, signal, time
p = argparse.ArgumentParser()
for flag in ("--cpu-devices", "--coordinator", "--checkpoint-dir"):
  p.add_argument(flag)
p.add_argument("--num-processes", type=int)
p.add_argument("--process-id", type=int)
a = p.parse_args()
os.environ["JAX_NUM_CPU_DEVICES"] = a.cpu_devices
import jax, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(a.coordinator, a.num_processes, a.process_id)
mesh = jax.make_mesh((jax.device_count(),), ("data",))
x = jax.make_array_from_process_local_data(
    NamedSharding(mesh, P("data")), np.ones((jax.local_device_count(),)))
total = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, "data"), mesh=mesh,
                              in_specs=P("data"), out_specs=P()))
for step in range(100000):
  y = np.asarray(jax.device_get(total(x).addressable_shards[0].data))
  if step == 3 and a.process_id == 0:
    pathlib.Path(a.checkpoint_dir, "3").mkdir(parents=True)
  if step == 5:
    print(f"ready {a.process_id}", flush=True)
    if a.process_id == 1:
      time.sleep(1)
      os.kill(os.getpid(), signal.SIGKILL)
'''


@pytest.mark.multiprocess
def test_the_launcher_names_a_dead_process_and_stops_the_others(tmp_path):
  """scripts/launch_local.sh on 2 processes whose collectives run in a
  loop; process 1 kills itself (SIGKILL). The launcher names process 1
  and its signal, stops process 0 (which would otherwise wait in its next
  psum until gloo gives up, about 80 s, with 'Is there a distributed
  collective mismatch in your code?'), names the newest checkpoint step
  directory (not orbax's unfinished tmp one) and the command that resumes
  from it, and exits non-zero."""
  worker = tmp_path / "dying.py"
  worker.write_text(_DYING_WORKER)
  ck = tmp_path / "ck"
  (ck / "1").mkdir(parents=True)
  (ck / "9.orbax-checkpoint-tmp-0").mkdir()
  env = cpu_env(NUM_DEVICES // NUM_PROCESSES)
  env.update(LAUNCH_PYTHON=sys.executable, TRAIN_SCRIPT=str(worker),
             LOGDIR=str(tmp_path / "logs"))
  start = time.monotonic()
  r = subprocess.run(["bash", str(REPO / "scripts" / "launch_local.sh"),
                      str(NUM_PROCESSES), "--checkpoint-dir", str(ck)],
                     env=env, cwd=REPO, capture_output=True, text=True,
                     timeout=TIMEOUT_S)
  took = time.monotonic() - start
  logs = "".join((tmp_path / "logs" / f"process_{i}.log").read_text()
                 for i in range(NUM_PROCESSES))
  assert "ready 0" in logs and "ready 1" in logs, (r.stderr, logs)
  assert r.returncode == 128 + 9, r.stderr
  assert re.search(r"process 1 \(pid \d+\) was killed by signal 9 \(KILL\); "
                   r"stopping the other 1", r.stderr), r.stderr
  assert f"newest checkpoint: {ck}/3; resume with: bash " in r.stderr
  assert r.stderr.rstrip().endswith(f"logs in {tmp_path / 'logs'}")
  assert "--checkpoint-dir " + str(ck) + " --resume" in r.stderr
  assert "collective mismatch' error" in r.stderr   # the launcher's words
  assert "Is there a distributed collective mismatch" not in logs
  assert took < 60, took
