"""Stabilisers for ``jaxfuse.sgd`` at a dense-tuned rate: a standalone study.

The same problem, rows and row order as ``benchmarks/convergence.py sgd-stability``
(its ``problem``; worker k gets rows k·B … (k+1)·B − 1 of each step's draw),
simulated on one device with the K workers as a vmapped leading axis and
exact per-worker top-k (k = ⌈ρ·n⌉) in place of jaxfuse's threshold
estimator. Every method keeps the parameters identical on all workers: w
moves only by the worker mean of what was sent (plus, for the oracles,
what is stated).

  python benchmarks/convergence.py sgd-study --methods dense ef ef:d=0.8 --rhos 0.01
  python benchmarks/convergence.py sgd-study --list

Method spec: ``name[:key=value,...]``; see ``METHODS``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import jax.numpy as jnp  # pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np  # pylint: disable=g-import-not-at-top,wrong-import-position

from benchmarks.tools.sgd_stability import problem  # pylint: disable=wrong-import-position

METHODS = {
    "dense": "optax.sgd on the worker mean gradient (heavy ball)",
    "ef": "jaxfuse.sgd's rule: u'=m·u+g, acc=d·r+u', top-k, r'=acc−sent; "
          "opts d (residual decay), mask (0/1), nesterov (0/1)",
    "capu": "ef, then r' scaled so ‖r'‖ ≤ c·‖u'‖ (cut part dropped); opt c",
    "capg": "ef, then r' scaled so ‖r'‖ ≤ c·‖g‖ (cut part dropped); opt c",
    "clipc": "ef, then each |r'_i| ≤ c·rms(u') (cut dropped); opt c",
    "autod": "ef with d(t) = 1 while ‖r‖ ≤ c·‖u'‖, else (c·‖u'‖/‖r‖)^p "
             "(a growth-triggered decay); opts c, p",
    "automask": "ef with momentum factor masking only on the workers whose "
                "residual has grown: u'=0 where sent while ‖r'‖ > c·‖u'‖; opt c",
    "gclip": "DGC local gradient clipping: g scaled so ‖g‖ ≤ c·‖ḡ‖ "
             "(ḡ: an EMA of the worker's own ‖g‖); opt c",
    "local": "ef with the gradient taken at the worker's local model "
             "w − a·η·r (Qsparse-local-SGD's local iterate; a = 1 makes "
             "the worker mean of local models dense's heavy ball to first "
             "order); opts a, d, mask",
    "local_hvp": "(local:hvp=1) oracle: the correction a·η·H·r_k with the exact "
                 "full-data H instead of the worker's minibatch",
    "dense1": "heavy ball on one worker's rows only (batch B): noise check",
    "local_hvpb": "(local:hvpb=N) the correction a·η·H_s·r_k from N fresh rows",
    "local_cema": "(local:cema=β) the correction from the gradient's own rows, "
                  "EMA-smoothed over steps",
    "split": "ef with momentum only on what was sent: u' = m·u + g is "
             "accumulated, but the residual gets g and the velocity holds "
             "only the sent part (momentum after the sync, per worker); opt d",
    "track": "oracle: w moves toward dense's own trajectory x_t by the k "
             "largest |x_t − w| coordinates each step (global, k = ⌈ρ·n⌉·K "
             "unless kg is given); opt kg",
    "gtop": "oracle: global top-k of the exact dense velocity with error "
            "feedback (one server with the full minibatch), gradient at w; "
            "opts kg, virt (1: gradient at the virtual iterate w − η·r)",
}


def parse(spec):
  name, _, rest = spec.partition(":")
  opts = {}
  for kv in filter(None, rest.split(",")):
    k, v = kv.split("=")
    opts[k] = float(v)
  return name, opts


def topk_mask(x, k):
  """Boolean mask of the k largest |x| along the last axis."""
  def one(v):
    _, i = jax.lax.top_k(jnp.abs(v), k)
    return jnp.zeros(v.shape, bool).at[i].set(True)
  return one(x) if x.ndim == 1 else jax.vmap(one)(x)


def norm(x):
  return jnp.sqrt(jnp.sum(x * x, axis=-1, keepdims=True))


def simulate(name, opts, data, rates, dense_traj=None):
  """Full-data loss after every step (T,), float32.

  ``data`` is (a, b, idx): the problem and each step's rows per worker
  (T, K, B); ``rates`` is (lr, m, rho): the learning rate, the momentum
  and the density."""
  a, b, idx = data
  lr, m, rho = rates
  a = jnp.asarray(a)
  b = jnp.asarray(b)
  steps, workers, batch = idx.shape
  n = a.shape[1]
  k = max(1, math.ceil(rho * n))
  d = opts.get("d", 1.0)
  mask = bool(opts.get("mask", 0))
  nest = bool(opts.get("nesterov", 0))
  c = opts.get("c", 1.0)

  def full_loss(w):
    r = a @ w - b
    return 0.5 * jnp.mean(r * r)

  def local_grads(w_k, rows):   # w_k (K, n) or (n,), rows (K, B)
    ak, bk = a[rows], b[rows]   # (K, B, n), (K, B)
    wk = jnp.broadcast_to(w_k, (workers, n))
    res = jnp.einsum("kbn,kn->kb", ak, wk) - bk
    return jnp.einsum("kbn,kb->kn", ak, res) / batch

  zeros_k = jnp.zeros((workers, n), jnp.float32)
  w0 = jnp.zeros((n,), jnp.float32)

  if name == "dense":
    def step(carry, rows):
      w, v = carry
      g = local_grads(w, rows).mean(0)
      v = m * v + g
      w = w - lr * v
      return (w, v), (full_loss(w), w)
    (_, _), (loss, traj) = jax.lax.scan(step, (w0, w0), idx)
    return loss, traj

  if name == "dense1":   # one worker's rows only (batch B): noise check
    def step(carry, rows):
      w, v = carry
      g = local_grads(w, rows)[0]
      v = m * v + g
      w = w - lr * v
      return (w, v), full_loss(w)
    _, loss = jax.lax.scan(step, (w0, w0), idx)
    return loss, None

  if name == "track":
    kg = int(opts.get("kg", k * workers))
    def step(w, x):
      gap = x - w
      sel = topk_mask(gap, kg)
      w = w + jnp.where(sel, gap, 0)
      return w, full_loss(w)
    _, loss = jax.lax.scan(step, w0, dense_traj)
    return loss, None

  if name == "gtop":
    kg = int(opts.get("kg", k))
    virt = bool(opts.get("virt", 0))
    def step(carry, rows):
      w, u, r = carry
      at = w - lr * r if virt else w
      g = local_grads(at, rows).mean(0)
      u = m * u + g
      acc = r + u
      sel = topk_mask(acc, kg)
      sent = jnp.where(sel, acc, 0)
      r = acc - sent
      w = w - lr * sent
      return (w, u, r), (full_loss(w), full_loss(w - lr * r))
    _, (loss, vloss) = jax.lax.scan(step, (w0, w0, w0), idx)
    return loss, vloss

  gscale_ema = opts.get("ema", 0.9)

  def step(carry, rows):
    w, u, r, gbar, t, chat = carry
    if name == "local" and not (opts.get("hvp", 0) or opts.get("hvpb", 0)
                                or "cema" in opts):
      at = w[None] - opts.get("a", 1.0) * lr * r
    else:
      at = w
    g = local_grads(at, rows)
    if name == "local" and opts.get("hvpb", 0):
      # The correction from hb fresh rows per worker (its own sample,
      # independent of the gradient's rows): (1/hb)·A_sᵀA_s·r_k.
      hb = int(opts["hvpb"])
      key = jax.random.fold_in(jax.random.PRNGKey(1), t)
      srows = jax.random.randint(key, (workers, hb), 0, a.shape[0])
      asub = a[srows]
      hr = jnp.einsum("kbn,kb->kn", asub,
                      jnp.einsum("kbn,kn->kb", asub, r)) / hb
      g = g - opts.get("a", 1.0) * lr * hr
    elif name == "local" and "cema" in opts:
      # The correction from the gradient's own rows, H_k·r_k, smoothed over
      # steps: ĉ ← β·ĉ + (1 − β)·H_k·r_k (r_k moves slowly), g − a·η·ĉ.
      ak = a[rows]
      hr = jnp.einsum("kbn,kb->kn", ak, jnp.einsum("kbn,kn->kb", ak, r)) / batch
      beta = opts["cema"]
      chat = beta * chat + (1 - beta) * hr
      g = g - opts.get("a", 1.0) * lr * chat
    elif name == "local" and opts.get("hvp", 0):
      # Oracle correction: the exact full-data Hessian times r_k, so the
      # worker mean is g(w) − a·η·H·r̄ (dense's gradient at the virtual
      # iterate, for a quadratic) with only the minibatch noise at w.
      hr = (r @ a.T) @ a / a.shape[0]
      g = g - opts.get("a", 1.0) * lr * hr
    if name == "gclip":
      gn = norm(g)
      gbar_new = jnp.where(t == 0, gn, gscale_ema * gbar + (1 - gscale_ema) * gn)
      g = g * jnp.minimum(1.0, c * gbar_new / (gn + 1e-30))
      gbar = gbar_new
    if name == "split":
      # The residual accumulates raw gradients; momentum acts per worker on
      # what was sent (velocity of the sent stream).
      acc = d * r + g
      sel = topk_mask(acc, k)
      sent = jnp.where(sel, acc, 0)
      r = acc - sent
      u = m * u + sent
      out = u.mean(0)
      w = w - lr * out
      return (w, u, r, gbar, t + 1, chat), (full_loss(w), full_loss(w - lr * r.mean(0)))
    if nest:
      u = m * (u + g)
      stream = g + u
    else:
      u = m * u + g
      stream = u
    dd = d
    if name == "autod":
      rn, un = norm(r), norm(u)
      p = opts.get("p", 1.0)
      dd = jnp.where(rn <= c * un, 1.0, (c * un / (rn + 1e-30)) ** p)
    acc = dd * r + stream
    sel = topk_mask(acc, k)
    sent = jnp.where(sel, acc, 0)
    r = acc - sent
    if name == "capu":
      r = r * jnp.minimum(1.0, c * norm(u) / (norm(r) + 1e-30))
    elif name == "capg":
      r = r * jnp.minimum(1.0, c * norm(g) / (norm(r) + 1e-30))
    elif name == "clipc":
      cap = c * jnp.sqrt(jnp.mean(u * u, axis=-1, keepdims=True))
      r = jnp.clip(r, -cap, cap)
    if mask:
      u = jnp.where(sel, 0, u)
    elif name == "automask":
      u = jnp.where(sel & (norm(r) > c * norm(u)), 0, u)
    out = sent.mean(0)
    w = w - lr * out
    return (w, u, r, gbar, t + 1, chat), (full_loss(w), full_loss(w - lr * r.mean(0)))

  init = (w0, zeros_k, zeros_k, jnp.zeros((workers, 1)), jnp.int32(0), zeros_k)
  _, (loss, vloss) = jax.lax.scan(step, init, idx)
  return loss, vloss


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--workers", type=int, default=8)
  p.add_argument("--dim", type=int, default=2048)
  p.add_argument("--condition", type=float, default=1e4)
  p.add_argument("--batch", type=int, default=64)
  p.add_argument("--momentum", type=float, default=0.9)
  p.add_argument("--steps", type=int, default=400)
  p.add_argument("--rhos", type=float, nargs="+", default=[0.01])
  p.add_argument("--fractions", type=float, nargs="+", default=[1 / 20])
  p.add_argument("--methods", nargs="+", default=["dense", "ef"])
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--virtual", action="store_true",
                 help="also print the loss at the virtual iterate w − η·r̄")
  p.add_argument("--list", action="store_true")
  p.add_argument("--out")
  args = p.parse_args(argv)
  if args.list:
    for k_, v in METHODS.items():
      print(f"{k_:7s} {v}")
    return None
  a, b, lip = problem(args.dim, args.condition,
                      args.workers * args.batch * 4, args.seed)
  rng = np.random.default_rng(args.seed)
  idx = np.stack([rng.integers(0, a.shape[0], size=args.workers * args.batch)
                  .reshape(args.workers, args.batch)
                  for _ in range(args.steps)])
  limit = 2 * (1 + args.momentum) / lip
  horizons = sorted({args.steps // 4, args.steps // 2, args.steps})
  print(f"K={args.workers} n={args.dim} κ={args.condition:g} "
        f"m={args.momentum}; loss at {horizons}")
  results = []
  for frac in args.fractions:
    lr = frac * limit
    dense_loss, dense_traj = simulate("dense", {}, (a, b, idx),
                                      (lr, args.momentum, 1.0))
    for spec in args.methods:
      name, opts = parse(spec)
      for rho in ([1.0] if name == "dense" else args.rhos):
        t0 = time.time()
        if name == "dense":
          loss, vloss = dense_loss, None
        else:
          loss, vloss = simulate(name, opts, (a, b, idx),
                                 (lr, args.momentum, rho), dense_traj)
        loss = np.asarray(loss, np.float64)
        bad = ~np.isfinite(loss) | (loss > 1e6)
        first_bad = int(np.argmax(bad)) + 1 if bad.any() else None
        cells = {h: (float("inf") if first_bad and h >= first_bad
                     else float(loss[h - 1])) for h in horizons}
        ratio = cells[horizons[-1]] / float(dense_loss[args.steps - 1])
        row = {"method": spec, "rho": rho, "fraction": frac,
               "loss": {str(h): v for h, v in cells.items()},
               "ratio_to_dense": ratio, "diverged": first_bad is not None,
               "max_loss": float(np.nanmax(np.where(bad, np.inf, loss)))}
        txt = " ".join(f"{v:9.4g}" if math.isfinite(v) else " diverged"
                       for v in cells.values())
        extra = ""
        if args.virtual and vloss is not None:
          vl = np.asarray(vloss, np.float64)
          row["virtual_loss"] = {str(h): float(vl[h - 1]) for h in horizons}
          extra = " | virtual " + " ".join(f"{vl[h - 1]:9.4g}"
                                           for h in horizons)
        results.append(row)
        print(f"{spec:22s} ρ={rho:<5g} η=lim/{1 / frac:<3.0f} {txt}  "
              f"x{ratio:6.3g}  max {row['max_loss']:8.3g} "
              f"({time.time() - t0:4.1f}s){extra}", flush=True)
  if args.out:
    pathlib.Path(args.out).write_text(json.dumps(
        {"args": vars(args), "limit": limit, "results": results}, indent=1))
  return results

