"""Worker for tests/test_checkpoint.py: train, save, resume in a fresh process.

  python tests/_checkpoint_worker.py --dir D --start S --stop T --out F.npz
      [--resume] [--save-at N] [--density R]

8 simulated CPU workers, a two-layer MLP, onebit_adamw (per-worker moments,
residuals, thresholds, stats) after a dense phase of 2 steps; each worker's
batch at step s is drawn from fold_in(key, s), so any run over the same
steps sees the same data. Trains steps [S, T), saving at step N if given
(``--resume``: first restores the latest checkpoint, which must be step S),
then writes every leaf of the final params and optimizer state to F.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=8")

import jax  # pylint: disable=wrong-import-position
from jax.sharding import NamedSharding  # pylint: disable=wrong-import-position
from jax.sharding import PartitionSpec as P  # pylint: disable=wrong-import-position
import jax.numpy as jnp  # pylint: disable=wrong-import-position
import numpy as np  # pylint: disable=wrong-import-position

import jaxfuse  # pylint: disable=wrong-import-position
from jaxfuse.state import checkpoint  # pylint: disable=wrong-import-position

K, DIN, HIDDEN, DOUT, ROWS = 8, 32, 64, 8, 16
DENSE_STEPS = 2


def params0():
  k1, k2 = jax.random.split(jax.random.PRNGKey(0))
  return {"w1": jax.random.normal(k1, (DIN, HIDDEN)) / DIN ** 0.5,
          "b1": jnp.zeros((HIDDEN,)),
          "w2": jax.random.normal(k2, (HIDDEN, DOUT)) / HIDDEN ** 0.5}


def loss(params, x, y):
  h = jnp.tanh(x @ params["w1"] + params["b1"])
  return jnp.mean((h @ params["w2"] - y) ** 2)


def batch(step):
  key = jax.random.fold_in(jax.random.PRNGKey(1), step)
  kx, ky = jax.random.split(key)
  return (jax.random.normal(kx, (K * ROWS, DIN)),
          jax.random.normal(ky, (K * ROWS, DOUT)))


def main(argv=None):
  p = argparse.ArgumentParser()
  p.add_argument("--dir", required=True)
  p.add_argument("--start", type=int, default=0)
  p.add_argument("--stop", type=int, required=True)
  p.add_argument("--save-at", type=int)
  p.add_argument("--resume", action="store_true")
  p.add_argument("--density", type=float, default=0.1)
  p.add_argument("--out", required=True)
  args = p.parse_args(argv)

  mesh = jaxfuse.make_mesh(K)
  params = params0()
  plan = jaxfuse.plan(params, density=args.density,
                      settings=jaxfuse.Settings(min_sparse_size=256))
  phases = jaxfuse.density_warmup(plan, steps=0, dense_steps=DENSE_STEPS)
  opts = [jaxfuse.onebit_adamw(ph.plan, 1e-2) for ph in phases]
  rep = NamedSharding(mesh, P())
  params = jax.device_put(params, rep)
  opt_state = jaxfuse.init_state(opts[0], params, mesh)
  specs = jaxfuse.state_specs(opt_state)

  def make_step(opt):
    def local(params, s, x, y):
      g = jax.grad(loss)(jaxfuse.local_params(params), x, y)
      u, s = opt.update(g, s, params)
      return jax.tree.map(lambda a, b: a + b, params, u), s
    return jax.jit(jax.shard_map(local, mesh=mesh,
                                 in_specs=(P(), specs, P("data"), P("data")),
                                 out_specs=(P(), specs)))

  steps_fn = [make_step(o) for o in opts]
  mngr = checkpoint.manager(args.dir)
  if args.resume:
    like = {"params": params, "opt": opt_state}
    step, state = checkpoint.restore(mngr, like, plan)
    if step != args.start:
      raise SystemExit(f"restored step {step}, expected {args.start}")
    params, opt_state = state["params"], state["opt"]
  data = NamedSharding(mesh, P("data"))
  for step in range(args.start, args.stop):
    x, y = jax.device_put(batch(step), data)
    fn = steps_fn[jaxfuse.phase_index(phases, step)]
    params, opt_state = jax.block_until_ready(fn(params, opt_state, x, y))
    if args.save_at is not None and step + 1 == args.save_at:
      checkpoint.save(mngr, step + 1, {"params": params, "opt": opt_state},
                      plan)
  mngr.wait_until_finished()
  flat = jax.tree_util.tree_flatten_with_path(
      {"params": params, "opt": opt_state})[0]
  np.savez(args.out, **{jax.tree_util.keystr(k): np.asarray(v)
                        for k, v in flat})
  return 0


if __name__ == "__main__":
  sys.exit(main())
