"""``convergence.py classifier`` and ``lsq``: small problems trained in one
process on simulated CPU workers with SGD(momentum), dense against
``sparse_sync`` + optax.sgd and ``jaxfuse.sgd`` (with and without DGC's
momentum masking and density ramp). A module of ``convergence.py``, not an
entry point.
"""

from __future__ import annotations

import os
from typing import NamedTuple


def _small_setup(num_workers: int):
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             f" --xla_force_host_platform_device_count="
                             f"{num_workers}")
  os.environ.setdefault("JAX_NUM_CPU_DEVICES", str(num_workers))


def digits_problem(seed: int = 0, hidden: int = 256):
  """An MLP 64 → hidden → 10 on scikit-learn's digits (1,797 images,
  shipped with the package): (params, loss_fn, train (x, y), test (x, y))."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from sklearn.datasets import load_digits  # pylint: disable=g-import-not-at-top
  x, y = load_digits(return_X_y=True)
  x = (x / 16.0).astype(np.float32)
  order = np.random.default_rng(seed).permutation(len(x))
  x, y = x[order], y[order].astype(np.int32)
  split = 1536
  k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
  params = {"w1": jax.random.normal(k1, (64, hidden)) * (2 / 64) ** 0.5,
            "b1": jnp.zeros(hidden),
            "w2": jax.random.normal(k2, (hidden, 10)) * (1 / hidden) ** 0.5,
            "b2": jnp.zeros(10)}

  def loss_fn(p, batch):
    xb, yb = batch
    h = jax.nn.relu(xb @ p["w1"] + p["b1"])
    logits = h @ p["w2"] + p["b2"]
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits),
                                         yb[:, None], 1))
  return params, loss_fn, (x[:split], y[:split]), (x[split:], y[split:])


def lsq_problem(d: int = 2048, rows: int = 4096, cond: float = 1e3,
                seed: int = 0):
  """min ½·mean((A·x − b)²) with singular values of A spread over
  [1, √cond] (Hessian condition number ``cond``): stiff and convex."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(seed)
  q1, _ = np.linalg.qr(rng.standard_normal((rows, d)))
  q2, _ = np.linalg.qr(rng.standard_normal((d, d)))
  s = np.sqrt(np.geomspace(1.0, cond, d))
  a = (q1 * s) @ q2.T * np.sqrt(rows)
  x_star = rng.standard_normal(d)
  b = a @ x_star
  params = {"x": jnp.zeros((d // 64, 64), jnp.float32)}

  def loss_fn(p, batch):
    ab, bb = batch
    r = ab @ p["x"].reshape(-1) - bb
    return 0.5 * jnp.mean(r * r)
  return params, loss_fn, (a.astype(np.float32), b.astype(np.float32)), None


class SmallRun(NamedTuple):
  """How ``train_small`` trains: ``steps`` on ``workers`` workers, ``batch``
  rows a step (None: all), SGD with ``momentum``, a loss logged every
  ``log_every`` steps; ``residual_decay`` and ``nesterov`` for jaxfuse.sgd."""
  steps: int
  workers: int
  batch: int | None
  seed: int = 0
  momentum: float = 0.9
  log_every: int = 10
  residual_decay: float = 1.0
  nesterov: bool = False


def train_small(problem, recipe: str, density: float, lr: float,
                run: SmallRun, warm_steps: int = 0):
  """Train a small problem with SGD(momentum): dense (pmean first, then
  optax.sgd), ``naive`` (sparse_sync, then optax.sgd), ``sgd`` (jaxfuse.sgd,
  with DGC's density ramp of ``warm_steps`` per density) or ``sgd_masked``
  (the same with DGC's momentum factor masking).
  Returns losses every ``run.log_every`` steps and the final test loss."""
  steps, num_workers, batch, seed, momentum, log_every, residual_decay, \
      nesterov = run
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding  # pylint: disable=g-import-not-at-top
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top
  import jaxfuse  # pylint: disable=g-import-not-at-top
  params, loss_fn, (x, y), test = problem
  mesh = jaxfuse.make_mesh(num_workers)
  params = jax.device_put(params, NamedSharding(mesh, P()))
  plan = jaxfuse.plan(params, density=density,
                      strategy="aligned", estimator="topk",
                      settings=jaxfuse.Settings(
                          min_sparse_size=1024, seed=seed))

  def optimizer(p):
    if recipe == "dense":
      return optax.sgd(lr, momentum=momentum)
    if recipe == "naive":
      return optax.chain(jaxfuse.sparse_sync(p), optax.sgd(lr, momentum))
    return jaxfuse.sgd(p, lr, momentum, sgd_options=jaxfuse.SGDOptions(
        mask_momentum=recipe == "sgd_masked", residual_decay=residual_decay,
        nesterov=nesterov))

  phases = (jaxfuse.density_warmup(plan, steps=warm_steps)
            if recipe.startswith("sgd") else (jaxfuse.Phase(0, None, plan),))
  opt_state = jaxfuse.init_state(optimizer(phases[0].plan), params, mesh)
  specs = jaxfuse.state_specs(opt_state)

  def make_step(opt):
    def local(p, s, b):
      loss, g = jax.value_and_grad(loss_fn)(jaxfuse.local_params(p), b)
      if recipe == "dense":
        g = jax.lax.pmean(g, "data")
      u, s = opt.update(g, s, p)
      return optax.apply_updates(p, u), s, jax.lax.pmean(loss, "data")
    return jax.jit(jax.shard_map(local, mesh=mesh,
                                 in_specs=(P(), specs, P("data")),
                                 out_specs=(P(), specs, P())))

  rng = np.random.default_rng(seed)
  put = lambda b: jax.device_put(b, NamedSharding(mesh, P("data")))
  full = put((x, y))
  losses, phase_id, step_fn = [], -1, None
  for t in range(steps):
    if jaxfuse.phase_index(phases, t) != phase_id:
      phase_id = jaxfuse.phase_index(phases, t)
      step_fn = make_step(optimizer(phases[phase_id].plan))
    if batch:
      idx = rng.choice(len(x), batch, replace=False)
      data = put((x[idx], y[idx]))
    else:
      data = full
    params, opt_state, loss = step_fn(params, opt_state, data)
    loss = float(loss)  # blocks: CPU collectives deadlock when piled up
    if t % log_every == 0 or t == steps - 1:
      losses.append((t + 1, loss))
    if not np.isfinite(loss) or loss > 1e12:
      losses.append((t + 1, float("inf")))
      break
  full_loss = jax.jit(loss_fn)(jax.device_get(params), (x, y))
  test_loss = (float(jax.jit(loss_fn)(jax.device_get(params), test))
               if test is not None else None)
  return {"recipe": recipe, "density": density, "lr": lr, "steps": steps,
          "warm_steps": warm_steps, "losses": losses,
          "final_train_loss": float(full_loss), "test_loss": test_loss}


def run_classifier(args) -> dict:
  _small_setup(args.workers)
  problem = digits_problem(args.seed)
  dense = SmallRun(args.steps, args.workers, args.batch, seed=args.seed)
  sparse = dense._replace(residual_decay=args.residual_decay,
                          nesterov=args.nesterov)
  runs = [train_small(problem, "dense", 1.0, lr, dense) for lr in args.lrs]
  for density in args.densities:
    for lr in args.lrs:
      for recipe, warm in (("naive", 0), ("sgd", 0), ("sgd", args.warm_steps),
                           ("sgd_masked", 0),
                           ("sgd_masked", args.warm_steps)):
        runs.append(train_small(problem, recipe, density, lr, sparse,
                                warm_steps=warm))
        print(f"density {density:<6g} lr {lr:<6g} {recipe:>10s} warm {warm}: "
              f"final train "
              f"loss {runs[-1]['final_train_loss']:.4f}", flush=True)
  return {"study": "classifier", "workers": args.workers, "batch": args.batch,
          "steps": args.steps, "residual_decay": args.residual_decay,
          "nesterov": args.nesterov, "runs": runs}


def run_lsq(args) -> dict:
  """Learning-rate sweep on the stiff problem: per density and recipe, the
  largest rate of the grid whose run did not diverge (``_diverged``) and
  the final loss of every run."""
  _small_setup(args.workers)
  problem = lsq_problem(cond=args.cond, seed=args.seed)
  runs = []
  run = SmallRun(args.steps, args.workers, None, seed=args.seed)
  for lr in args.lrs:
    runs.append(train_small(problem, "dense", 1.0, lr, run))
    for density in args.densities:
      for recipe, warm in (("naive", 0), ("sgd", 0), ("sgd_masked", 0),
                           ("sgd_masked", args.warm_steps)):
        runs.append(train_small(problem, recipe, density, lr, run,
                                warm_steps=warm))
        print(f"lr {lr:<8g} density {density:<6g} {recipe:>10s} warm {warm}:"
              f" loss {runs[-1]['final_train_loss']:.3e}", flush=True)
  return {"study": "lsq", "workers": args.workers, "steps": args.steps,
          "cond": args.cond, "runs": runs}


def _diverged(run):
  """Non-finite, or ending above twice its lowest loss (the problem is
  deterministic: a rising loss is an unstable iteration)."""
  losses = [loss for _, loss in run["losses"]]
  return not losses[-1] == losses[-1] or losses[-1] > 2 * min(losses)


def report_lsq(data):
  """Largest stable learning rate per (recipe, density, warm-up)."""
  keys = sorted({(r["recipe"], r["density"], r["warm_steps"])
                 for r in data["runs"]}, key=lambda k: (k[0] != "dense", k))
  lines = [f"{'recipe':>10s} {'density':>8s} {'warm':>5s} {'max stable lr':>14s}"
           f" {'loss there':>11s}   (cond {data['cond']:g}, "
           f"{data['steps']} steps, {data['workers']} workers)"]
  for key in keys:
    runs = sorted((r for r in data["runs"]
                   if (r["recipe"], r["density"], r["warm_steps"]) == key),
                  key=lambda r: r["lr"])
    stable = [r for r in runs if not _diverged(r)]
    top = stable[-1] if stable else None
    lines.append(f"{key[0]:>10s} {key[1]:8g} {key[2]:5d} " + (
        f"{top['lr']:14g} {top['final_train_loss']:11.3e}" if top
        else f"{'none':>14s}"))
  return "\n".join(lines)
