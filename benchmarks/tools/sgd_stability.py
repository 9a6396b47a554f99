"""Is ``jaxfuse.sgd`` stable at the learning rate that is best for dense
momentum SGD?

An ill-conditioned least squares, split over K simulated CPU workers, each
drawing minibatches of the same rows in the same order for every run::

  f(w) = ½·mean_i (a_iᵀw − b_i)²,  A = U·diag(s)·Vᵀ·√N,  s log-spaced 1 … 1/√κ

so the Hessian AᵀA/N has eigenvalues s² in [1/κ, 1] (L = 1) and dense
momentum SGD (momentum m) is stable for η < 2(1 + m)/L. Each run's learning
rate is a fraction of that limit; the table gives the full-data loss at
each horizon, or "diverged". Dense is ``optax.sgd`` on the workers' mean
gradient, the others ``jaxfuse.sgd`` on one ``single`` plan per density::

  python benchmarks/convergence.py sgd-stability --densities 0.1 0.01 --out sgd.json
  python benchmarks/convergence.py sgd-stability --residual-decays 1 0.9 0.8 --out d.json
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# pylint: disable=wrong-import-position


def problem(dim: int, condition: float, rows: int, seed: int):
  """(A, b, L): rows × dim, Hessian eigenvalues log-spaced in [1/κ, 1]."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(seed)
  u, _ = np.linalg.qr(rng.normal(size=(rows, dim)))
  v, _ = np.linalg.qr(rng.normal(size=(dim, dim)))
  s = np.logspace(0, -0.5 * np.log10(condition), dim)
  a = (u * s) @ v.T * np.sqrt(rows)
  b = a @ rng.normal(size=dim) + 0.01 * rng.normal(size=rows)
  return a.astype(np.float32), b.astype(np.float32), float(s[0] ** 2)


def run(opt, data, mesh, args, *, dense: bool, horizons) -> dict:
  """Train from zero; the full-data loss at each horizon (inf: diverged).

  ``data`` is the problem's (a, b); ``args`` gives ``steps``, ``batch``
  (rows per worker) and ``seed``."""
  a, b = data
  steps, batch, seed = args.steps, args.batch, args.seed
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding  # pylint: disable=g-import-not-at-top
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top
  import jaxfuse  # pylint: disable=g-import-not-at-top

  k = mesh.devices.size
  params = jax.device_put({"w": jnp.zeros((a.shape[1],), jnp.float32)},
                          NamedSharding(mesh, P()))
  if dense:
    state, specs = opt.init(params), P()
  else:
    state = jaxfuse.init_state(opt, params, mesh)
    specs = jaxfuse.state_specs(state)

  def loss_fn(p, ai, bi):
    r = ai @ p["w"] - bi
    return 0.5 * jnp.mean(r * r)

  def local(p, state, ai, bi):
    g = jax.grad(loss_fn)(jaxfuse.local_params(p), ai, bi)
    if dense:
      g = jax.lax.pmean(g, "data")
    updates, state = opt.update(g, state, p)
    return optax.apply_updates(p, updates), state

  step = jax.jit(jax.shard_map(local, mesh=mesh,
                               in_specs=(P(), specs, P("data"), P("data")),
                               out_specs=(P(), specs)))
  full = jax.jit(lambda p: loss_fn(p, a, b))
  rng = np.random.default_rng(seed)
  rows = NamedSharding(mesh, P("data"))
  out = {}
  for t in range(1, steps + 1):
    idx = rng.integers(0, a.shape[0], size=k * batch)
    params, state = step(params, state, jax.device_put(a[idx], rows),
                         jax.device_put(b[idx], rows))
    jax.block_until_ready(params)
    if t in horizons:
      loss = float(full(params))
      out[t] = loss if np.isfinite(loss) and loss < 1e6 else float("inf")
      if out[t] == float("inf"):
        out.update({h: float("inf") for h in horizons if h > t})
        break
  return out


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--workers", type=int, default=8)
  p.add_argument("--dim", type=int, default=2048)
  p.add_argument("--condition", type=float, default=1e4)
  p.add_argument("--batch", type=int, default=64, help="rows per worker")
  p.add_argument("--momentum", type=float, default=0.9)
  p.add_argument("--steps", type=int, default=400)
  p.add_argument("--densities", type=float, nargs="+", default=[0.1, 0.01])
  p.add_argument("--fractions", type=float, nargs="+",
                 default=[1 / 10, 1 / 20, 1 / 40, 1 / 80, 1 / 160],
                 help="learning rates as fractions of 2(1+m)/L")
  p.add_argument("--residual-decays", type=float, nargs="+", default=[1.0],
                 help="jaxfuse.sgd residual_decay values to run (1: full "
                 "error feedback)")
  p.add_argument("--nesterov", action="store_true",
                 help="Nesterov momentum, for jaxfuse.sgd and for a second "
                 "dense run (the first dense run stays heavy ball)")
  p.add_argument("--no-mask", action="store_true",
                 help="leave out the mask_momentum=True runs")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out")
  args = p.parse_args(argv)
  os.environ.setdefault("JAX_NUM_CPU_DEVICES", str(args.workers))
  import jax  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  import jaxfuse  # pylint: disable=g-import-not-at-top

  mesh = jaxfuse.make_mesh(args.workers)
  a, b, lipschitz = problem(args.dim, args.condition,
                            args.workers * args.batch * 4, args.seed)
  limit = 2 * (1 + args.momentum) / lipschitz
  horizons = sorted({args.steps // 4, args.steps // 2, args.steps})
  nest = " nesterov" if args.nesterov else ""
  runs = [("dense", None, False, 1.0, False)] + (
      [("dense nesterov", None, False, 1.0, True)] if args.nesterov else []
  ) + [
      (f"jaxfuse.sgd ρ={d:g}" + nest + (" mask" if mask else "") +
       (f" decay {decay:g}" if decay != 1 else ""), d, mask, decay,
       args.nesterov)
      for d in args.densities for decay in args.residual_decays
      for mask in ((False,) if args.no_mask else (False, True))]
  result = {"args": vars(args), "limit": limit, "horizons": horizons,
            "device": jax.devices()[0].device_kind, "jax": jax.__version__,
            "date": time.strftime("%Y-%m-%d"), "runs": []}
  print(f"{args.workers} workers, d={args.dim}, κ={args.condition:g}, "
        f"m={args.momentum}, limit 2(1+m)/L = {limit:.3g}; full-data loss at "
        f"steps {horizons}")
  for name, density, mask, decay, nesterov in runs:
    for frac in args.fractions:
      lr = frac * limit
      if density is None:
        opt = optax.sgd(lr, args.momentum, nesterov=nesterov)
      else:
        plan = jaxfuse.plan({"w": jax.ShapeDtypeStruct((args.dim,), "float32")},
                            density=density, strategy="single",
                            settings=jaxfuse.Settings(seed=0))
        opt = jaxfuse.sgd(plan, lr, momentum=args.momentum,
                          sgd_options=jaxfuse.SGDOptions(
                              nesterov=nesterov, mask_momentum=mask,
                              residual_decay=decay))
      losses = run(opt, (a, b), mesh, args, dense=density is None,
                   horizons=set(horizons))
      result["runs"].append({"name": name, "density": density, "mask": mask,
                             "residual_decay": decay, "nesterov": nesterov,
                             "fraction": frac, "lr": lr,
                             "loss": {str(h): losses.get(h) for h in horizons}})
      cells = " ".join(f"{losses[h]:9.4g}" if losses[h] != float("inf")
                       else " diverged" for h in horizons)
      print(f"{name:26s} η = limit/{1 / frac:<5.0f} {cells}", flush=True)
      if args.out:
        pathlib.Path(args.out).write_text(json.dumps(result, indent=1))
  return result

