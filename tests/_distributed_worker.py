"""Worker for tests/test_distributed.py: a few sparse_sync training steps.

  python tests/_distributed_worker.py --process-id I --num-processes N \
      --port P --out FILE

N = 1: one process with 8 CPU devices, no ``jax.distributed``.
N > 1: process I of N on localhost (coordinator on port P); the launcher sets
``JAX_NUM_CPU_DEVICES`` so that the N processes together have 8 CPU devices;
cross-process collectives go through gloo.

Either way the global mesh is the same 8 workers along "data", worker k gets
rows [8k, 8k + 8) of the same global batch (with its own targets, so local
gradients differ), and the plan is the same: w1 and w2 (1536 elements, at
least min_sparse_size=1024) are sparse and go through all_gather buckets,
b1 and b2 are dense and go through psum buckets.

Two variants of the model are trained, ``STEPS`` steps each:

  float  plain float32 gradients.
  exact  the same model, but the gradients of the *dense* leaves (b1, b2) are
         rounded to multiples of 2**-QUANT_BITS in the backward pass, so their
         8-worker sum is exact in float32 whatever order the all-reduce adds
         in. Sparse leaves keep full-precision gradients.

Why two: XLA's in-process CPU all-reduce and gloo's all-reduce add the 8
workers' values in different orders, so a float ``psum`` can differ in the
last bit between the 1-process and 2-process runs (and then everything
downstream differs by a few ulps). The sparse all_gather path has no such
freedom (decode adds workers in rank order), so with order-independent dense
sums the two runs must agree bit for bit.

Hierarchical path (``HIER_STEPS`` steps of ``sparse_sync`` alone, no SGD):
the same model with *every* gradient quantized, planned at density 0.5
(c_s = S: a host's shards go whole, nothing dropped), run as ``"hier"`` on the
2 × 4 mesh ``make_mesh(local=4)`` (N = 2: one host row per process) and as
``"allgather"`` on the flat mesh; all sums are exact, so both must agree bit
for bit, and with the 1-process run. Written as hier/... and hierflat/...:
  synced/S/LEAF, residual/U.

Every process writes FILE (.npz) with the full global values, per variant V:
  V/synced/S/LEAF   output of sparse_sync alone at step S (before SGD)
  V/dense/S/LEAF    pmean of the local gradients (the dense reference)
  V/local/S/LEAF    each worker's local gradient, stacked (8, ...)
  V/params/S/LEAF   params after step S
  V/loss/S          pmean of the local losses
  V/residual/U, V/stats/FIELD, V/step   per-worker sync state after the end
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import traceback

NUM_WORKERS = 8
ROWS_PER_WORKER = 8
DIN, HIDDEN, DOUT = 16, 96, 16
STEPS = 3
LR = 0.1
QUANT_BITS = 12
VARIANTS = ("float", "exact")
HIER_STEPS = 2
LOCAL = 4  # devices per host row of the hierarchical mesh
BARRIER_MS = 240_000


def _args():
  p = argparse.ArgumentParser()
  p.add_argument("--process-id", type=int, required=True)
  p.add_argument("--num-processes", type=int, required=True)
  p.add_argument("--port", type=int, default=0)
  p.add_argument("--out", required=True)
  return p.parse_args()


def main():
  args = _args()
  n, pid = args.num_processes, args.process_id
  if NUM_WORKERS % n:
    sys.exit(f"--num-processes={n} must divide {NUM_WORKERS}")
  # Must be set before jax is imported; the launcher normally sets them.
  os.environ.setdefault("JAX_NUM_CPU_DEVICES", str(NUM_WORKERS // n))
  os.environ.setdefault("JAX_PLATFORMS", "cpu")

  import jax  # pylint: disable=g-import-not-at-top
  if n > 1:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"localhost:{args.port}",
                               num_processes=n, process_id=pid,
                               initialization_timeout=120,
                               shutdown_timeout_seconds=60)

  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding  # pylint: disable=g-import-not-at-top
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top

  import jaxfuse  # pylint: disable=g-import-not-at-top

  assert jax.process_count() == n, (jax.process_count(), n)
  assert jax.process_index() == pid, (jax.process_index(), pid)
  assert jax.device_count() == NUM_WORKERS, jax.devices()
  assert jax.local_device_count() == NUM_WORKERS // n, jax.local_devices()

  mesh = jaxfuse.make_mesh()  # all global devices
  assert mesh.devices.size == NUM_WORKERS

  # --- deterministic model and data (numpy, identical in every process) -----
  rng = np.random.RandomState(0)
  params_np = {
      "w1": (rng.randn(DIN, HIDDEN) / np.sqrt(DIN)).astype(np.float32),
      "b1": (0.1 * rng.randn(HIDDEN)).astype(np.float32),
      "w2": (rng.randn(HIDDEN, DOUT) / np.sqrt(HIDDEN)).astype(np.float32),
      "b2": (0.1 * rng.randn(DOUT)).astype(np.float32),
  }
  rows = NUM_WORKERS * ROWS_PER_WORKER
  x_np = rng.randn(rows, DIN).astype(np.float32)
  # Each worker's targets come from its own random map.
  y_np = np.concatenate([
      np.tanh(x_np[k * ROWS_PER_WORKER:(k + 1) * ROWS_PER_WORKER]
              @ rng.randn(DIN, DOUT)).astype(np.float32)
      for k in range(NUM_WORKERS)])

  def global_array(value, spec):
    """A global jax.Array made from each process's addressable pieces."""
    return jax.make_array_from_callback(
        value.shape, NamedSharding(mesh, spec), lambda idx: value[idx])

  x = global_array(x_np, P("data"))
  y = global_array(y_np, P("data"))

  @jax.custom_vjp
  def quantize_grad(b):
    return b

  def _qfwd(b):
    return b, None

  def _qbwd(_, ct):
    scale = float(2 ** QUANT_BITS)
    return (jnp.round(ct * scale) / scale,)

  quantize_grad.defvjp(_qfwd, _qbwd)

  def make_loss(quantized, weights=False):
    q = quantize_grad if quantized else (lambda b: b)
    qw = q if weights else (lambda w: w)

    def loss_fn(p, x, y):
      h = jnp.tanh(x @ qw(p["w1"]) + q(p["b1"]))
      return jnp.mean((h @ qw(p["w2"]) + q(p["b2"]) - y) ** 2)
    return loss_fn

  plan = jaxfuse.plan(params_np, density=0.05, strategy="aligned",
                      num_buckets=2)

  def fetch(a):
    """Global value of a jax.Array as numpy, in every process."""
    if a.is_fully_replicated:
      # Replica consistency: every addressable copy must be bitwise equal.
      copies = [np.asarray(s.data) for s in a.addressable_shards]
      for c in copies[1:]:
        if not np.array_equal(c, copies[0], equal_nan=True):
          raise AssertionError("replicated output differs between devices")
      return copies[0]
    if a.is_fully_addressable:
      return np.asarray(a)
    return np.asarray(multihost_utils.process_allgather(a, tiled=True))

  def barrier(name):
    """All processes meet here (coordination service, not a gloo collective).

    gloo gives a peer only 30 s to join a collective; on a small, loaded
    machine one process may finish compiling much later than the other, so
    each program is compiled ahead and the processes start it together.
    """
    if n > 1:
      from jax._src import distributed  # pylint: disable=g-import-not-at-top
      distributed.global_state.client.wait_at_barrier(name, BARRIER_MS)

  out = {}
  for variant in VARIANTS:
    loss_fn = make_loss(variant == "exact")
    sync = jaxfuse.sparse_sync(plan)
    opt = optax.chain(sync, optax.sgd(LR))
    params = jax.tree.map(lambda v: global_array(v, P()), params_np)
    state = jaxfuse.init_state(opt, params, mesh)
    specs = jaxfuse.state_specs(state)

    @jax.jit
    def step(p, s, x, y, loss_fn=loss_fn, opt=opt, sync=sync, specs=specs):
      def local(p, s, x, y):
        l, g = jax.value_and_grad(loss_fn)(jaxfuse.local_params(p), x, y)
        u, s_new = opt.update(g, s, p)
        # sparse_sync alone on the same inputs: the synchronized gradient
        # the chain fed to SGD (a pure function, so the same value).
        synced, _ = sync.update(g, s[0], p)
        dense = jax.lax.pmean(g, "data")
        per_worker = jax.tree.map(lambda a: a[None], g)
        return (optax.apply_updates(p, u), s_new, synced, dense, per_worker,
                jax.lax.pmean(l, "data"))
      return jax.shard_map(
          local, mesh=mesh, in_specs=(P(), specs, P("data"), P("data")),
          out_specs=(P(), specs, P(), P(), P("data"), P()))(p, s, x, y)

    step = step.lower(params, state, x, y).compile()
    barrier(f"{variant}/compiled")
    for i in range(STEPS):
      params, state, synced, dense, per_worker, loss = step(
          params, state, x, y)
      for name in params_np:
        out[f"{variant}/synced/{i}/{name}"] = fetch(synced[name])
        out[f"{variant}/dense/{i}/{name}"] = fetch(dense[name])
        out[f"{variant}/local/{i}/{name}"] = fetch(per_worker[name])
        out[f"{variant}/params/{i}/{name}"] = fetch(params[name])
      out[f"{variant}/loss/{i}"] = fetch(loss)

    sync_state = state[0]
    for u, r in enumerate(sync_state.residuals):
      out[f"{variant}/residual/{u}"] = fetch(r)
    for field, v in sync_state.stats._asdict().items():
      out[f"{variant}/stats/{field}"] = fetch(v)
    out[f"{variant}/step"] = fetch(sync_state.step)

  # --- the last state carried to a one-bucket plan (global arrays) ---------
  moved = jaxfuse.relayout(sync_state, plan, jaxfuse.plan(
      params_np, density=0.05, strategy="single"))
  for g, r in enumerate(moved.residuals):
    assert r.sharding.spec[0] == "data", r.sharding
    out[f"relayout/residual/{g}"] = fetch(r)

  # --- hierarchical (host = process) against flat, sparse_sync alone -------
  hmesh = jaxfuse.make_mesh(local=LOCAL)
  assert hmesh.axis_names == ("host", "local")
  if n > 1:  # one host row per process
    assert [{d.process_index for d in row} for row in hmesh.devices] == [
        {i} for i in range(n)]
  loss_fn = make_loss(True, weights=True)
  flat_plan = jaxfuse.plan(params_np, density=0.5, strategy="aligned",
                           num_buckets=2, estimator="topk")
  for variant, m, axis, collective in (
      ("hier", hmesh, ("host", "local"), "hier"),
      ("hierflat", mesh, "data", "allgather")):
    p_plan = dataclasses.replace(flat_plan, buckets=tuple(
        dataclasses.replace(b, collective=collective, scheme=None)
        if b.collective != "psum" else b for b in flat_plan.buckets))
    sync = jaxfuse.sparse_sync(p_plan, axis_name=axis)
    put = lambda v, spec, m=m: jax.make_array_from_callback(
        v.shape, NamedSharding(m, spec), lambda idx, v=v: v[idx])
    params = jax.tree.map(lambda v, put=put: put(v, P()), params_np)
    state = jaxfuse.init_state(sync, params, m, axis)
    specs = jaxfuse.state_specs(state, axis)

    def local(p, s, x, y, sync=sync, axis=axis):
      g = jax.grad(loss_fn)(jaxfuse.local_params(p, axis), x, y)
      return sync.update(g, s, p)
    step = jax.jit(jax.shard_map(
        local, mesh=m, in_specs=(P(), specs, P(axis), P(axis)),
        out_specs=(P(), specs)))
    data = (put(x_np, P(axis)), put(y_np, P(axis)))
    step = step.lower(params, state, *data).compile()
    barrier(f"{variant}/compiled")
    for i in range(HIER_STEPS):
      synced, state = step(params, state, *data)
      for name in params_np:
        out[f"{variant}/synced/{i}/{name}"] = fetch(synced[name])
    for u, r in enumerate(state.residuals):
      out[f"{variant}/residual/{u}"] = fetch(r)
    out[f"{variant}/collectives"] = np.array([b.collective
                                               for b in p_plan.buckets])

  out["leaf_paths"] = np.array([l.path for l in plan.leaves])
  out["leaf_sparse"] = np.array([l.mode == "sparse" for l in plan.leaves])
  out["leaf_capacity"] = np.array([l.capacity for l in plan.leaves])
  out["num_buckets"] = np.array(len(plan.buckets))
  out["bucket_collectives"] = np.array([b.collective for b in plan.buckets])

  np.savez(args.out, **out)
  barrier("written")
  if n > 1:
    jax.distributed.shutdown()
  print(f"process {pid}/{n}: wrote {len(out)} arrays to {args.out}",
        flush=True)


if __name__ == "__main__":
  try:
    main()
  except BaseException:  # pylint: disable=broad-except
    # Exit at once: a normal exit would run jax.distributed's atexit
    # shutdown, which waits for the other processes (up to its timeout) while
    # they wait for this one in a collective or barrier.
    traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)  # pylint: disable=protected-access
