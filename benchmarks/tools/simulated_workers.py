"""K workers simulated on one device against K times one worker's step.

For a preset of ``examples/lm_model.py`` this times the README recipe's
step (``onebit_adamw`` on a ``size`` plan at ``--density``, in its sparse
phase; and its dense phase, ``with_density(plan, 1)``) built by
``jaxfuse.make_train_step`` on ``jaxfuse.simulated_mesh(K)`` for each K of
``--workers``, with ``--batch-per-worker`` rows per worker, and the same
step on one real worker (``make_mesh(1)``, T₁). It prints::

  phase  K  step ms  K x T1 ms  ratio  peak GiB

ratio = step / (K·T₁): at most 1 means simulating K workers costs no more
than running them one after another. peak GiB is the device's peak so far
in this process (K rises row by row, so it is the largest K's). A K whose step does not fit the
device's memory is reported as such, and larger ones are not tried::

  python benchmarks/overhead.py simulated-workers --preset gpt2-small \\
      --workers 2 4 8 16 --out simulated.json
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxfuse
import lm_model


def _step_ms(step, state, batch, steps: int, warmup: int) -> float:
  """Median seconds per step (each waited for), in ms, after ``warmup``."""
  times = []
  for i in range(warmup + steps):
    t0 = time.perf_counter()
    state, loss = step(state, batch)
    jax.block_until_ready(loss)
    if i >= warmup:
      times.append(time.perf_counter() - t0)
  return 1e3 * statistics.median(times)


def _peak_gib() -> float:
  stats = jax.devices()[0].memory_stats() or {}
  return stats.get("peak_bytes_in_use", float("nan")) / 2**30


def _time(setup, mesh, plan, args) -> dict:
  """One row: the step on ``mesh`` (real or simulated) with ``plan``."""
  params, loss_fn, rows = setup
  k = mesh.size
  opt = functools.partial(jaxfuse.onebit_adamw, learning_rate=1e-4)
  # one dense step first (the recipe's warm-up), then the phase timed
  dense = jaxfuse.with_density(plan, 1.0)
  phases = (jaxfuse.Phase(0, 1, dense), jaxfuse.Phase(1, None, plan))
  state, step = jaxfuse.make_train_step(loss_fn, params, opt, phases, mesh)
  batch = rows[:k * args.batch_per_worker]
  t0 = time.perf_counter()
  ms = _step_ms(step, state, batch, args.steps, args.warmup)
  return {"workers": k, "step_ms": ms, "peak_gib": _peak_gib(),
          "wall_s": time.perf_counter() - t0}


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--preset", default="tiny", choices=sorted(lm_model.PRESETS))
  p.add_argument("--workers", type=int, nargs="+", default=[2, 4, 8])
  p.add_argument("--batch-per-worker", type=int, default=8)
  p.add_argument("--density", type=float, default=0.05)
  p.add_argument("--phases", nargs="+", default=["sparse", "dense"],
                 choices=["sparse", "dense"])
  p.add_argument("--steps", type=int, default=10)
  p.add_argument("--warmup", type=int, default=3,
                 help="untimed steps first (at least 2: the dense step and "
                 "the first of the phase, which compile)")
  p.add_argument("--out", help="JSON file to write")
  args = p.parse_args(argv)
  if args.warmup < 2:
    p.error(f"--warmup {args.warmup}: give at least 2 (the dense step and "
            "the phase's first compile)")
  model = lm_model.build_model(args.preset)
  seq_len = model.cfg.seq_len
  train, _ = lm_model.load_corpus(2**20)
  most = max(args.workers) * args.batch_per_worker
  rows = jnp.asarray(lm_model.sample_batch(np.random.default_rng(0), train,
                                           most, seq_len))
  params = model.init(jax.random.PRNGKey(0),
                      jnp.zeros((1, seq_len), jnp.int32))["params"]
  loss_fn = lm_model.make_loss(model)
  sparse = jaxfuse.plan(params, density=args.density, strategy="size",
                        bucket_bytes=64 * 2**20, num_workers=1)
  plans = {"sparse": sparse, "dense": jaxfuse.with_density(sparse, 1.0)}
  setup = (params, loss_fn, rows)
  out = []
  print(f"{'phase':6} {'K':>3} {'step ms':>9} {'K x T1 ms':>10} "
        f"{'ratio':>6} {'peak GiB':>8}")
  for phase in args.phases:
    one = _time(setup, jaxfuse.make_mesh(1), plans[phase], args)
    one.update(phase=phase, simulated=False)
    out.append(one)
    print(f"{phase:6} {1:3d} {one['step_ms']:9.2f} {'':>10} {'':>6} "
          f"{one['peak_gib']:8.2f}")
    for k in args.workers:
      try:
        row = _time(setup, jaxfuse.simulated_mesh(k), plans[phase], args)
      except Exception as e:  # pylint: disable=broad-except
        if "RESOURCE_EXHAUSTED" not in str(e) and "memory" not in str(e):
          raise
        out.append({"phase": phase, "workers": k, "simulated": True,
                    "fits": False})
        print(f"{phase:6} {k:3d} does not fit")
        break
      ratio = row["step_ms"] / (k * one["step_ms"])
      row.update(phase=phase, simulated=True, fits=True, ratio=ratio)
      out.append(row)
      print(f"{phase:6} {k:3d} {row['step_ms']:9.2f} "
            f"{k * one['step_ms']:10.2f} {ratio:6.3f} {row['peak_gib']:8.2f}")
  if args.out:
    meta = {"jax": jax.__version__, "backend": jax.default_backend(),
            "device": getattr(jax.devices()[0], "device_kind", "cpu"),
            "date": time.strftime("%Y-%m-%d"), "args": vars(args)}
    pathlib.Path(args.out).write_text(json.dumps(
        {"meta": meta, "rows": out}, indent=1))
  return 0
