"""How long the sparse step takes to compile, against its plan's buckets.

For each plan (a saved plan file, or ``size:MB`` / ``layerwise`` planned here
for the example LM at --density) and each kernel backend (``pallas``: the
Triton kernels; ``reference``: their jnp twins, plain XLA), the README
recipe's sparse step (``onebit_adamw`` under ``jaxfuse.send_early``, with
``jaxfuse.xla_flags``' network flags when given in XLA_FLAGS) is traced,
lowered and compiled on all GPUs, and its Pallas calls counted in the
lowered module (each one a Triton kernel that XLA compiles; "distinct" is
the number of different kernel bodies). Prints::

  plan  buckets  kernels  pallas calls  distinct  lower s  compile s

and writes JSON (--out). No plan starts after --budget-s seconds.

  python benchmarks/overhead.py compile-time --plans size:64 layerwise p.json \\
      --kernels pallas reference --out compile.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks" / "tools"))
sys.path.insert(0, str(ROOT / "examples"))

# pylint: disable=wrong-import-position
import jax

from jaxfuse import kernels
import overlap

_TRITON_TARGET = "@__gpu$xla.gpu.triton"


def pallas_calls(text: str) -> tuple[int, int]:
  """(calls, distinct kernel bodies) of the Triton custom calls in a
  lowered module's text."""
  configs = [line[line.find("backend_config"):]
             for line in text.splitlines() if _TRITON_TARGET in line]
  return len(configs), len({hashlib.sha1(c.encode()).hexdigest()
                            for c in configs})


def plan_args(spec: str, density: float, preset: str) -> argparse.Namespace:
  """``overlap.build``'s arguments for one ``--plans`` entry: "size:MiB",
  a strategy or a saved plan's file; the rest (dtype, estimator,
  headroom) ``overlap.py``'s defaults."""
  args = overlap.parse_args(["--preset", preset, "--density", str(density)])
  if spec.startswith("size:"):
    args.bucket_mb = float(spec[5:])
  elif spec in ("layerwise", "single", "aligned"):
    args.strategy = spec
  else:
    args.plan = spec
  return args


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--preset", default="gpt2-small",
                 choices=sorted(overlap.PRESETS))
  p.add_argument("--density", type=float, default=0.05)
  p.add_argument("--plans", nargs="+", default=["size:64", "layerwise"])
  p.add_argument("--kernels", nargs="+", default=["pallas", "reference"],
                 choices=["pallas", "reference"])
  p.add_argument("--plain", action="store_true",
                 help="the plain step instead of send_early's")
  p.add_argument("--budget-s", type=float, default=480)
  p.add_argument("--out")
  args = p.parse_args(argv)
  devices = jax.devices()
  rows, t0 = [], time.perf_counter()
  print(f"{'plan':44} {'buckets':>7} {'kernels':>9} {'pallas calls':>12} "
        f"{'distinct':>8} {'lower s':>7} {'compile s':>9}", flush=True)
  for spec in args.plans:
    mesh, params, loss_fn, batch, plan = overlap.build(
        plan_args(spec, args.density, args.preset), devices)
    for backend in args.kernels:
      if time.perf_counter() - t0 > args.budget_s:
        print(f"{spec} {backend}: skipped, past --budget-s", flush=True)
        continue
      kernels.set_backend(backend)
      step, state = overlap.sparse_step(
          mesh, plan, loss_fn, params, {},
          overlap.StepForm(early=not args.plain))
      a = time.perf_counter()
      lowered = step.lower(params, state, batch)
      b = time.perf_counter()
      lowered.compile()
      c = time.perf_counter()
      calls, distinct = pallas_calls(lowered.as_text())
      row = dict(plan=spec, buckets=len(plan.buckets), kernels=backend,
                 pallas_calls=calls, distinct=distinct, lower_s=b - a,
                 compile_s=c - b, early=not args.plain)
      rows.append(row)
      print(f"{pathlib.Path(spec).name:44} {row['buckets']:7d} {backend:>9} "
            f"{calls:12d} {distinct:8d} {b - a:7.1f} {c - b:9.1f}",
            flush=True)
      jax.clear_caches()
  if args.out:
    pathlib.Path(args.out).write_text(json.dumps(
        dict(devices=[d.device_kind for d in devices], jax=jax.__version__,
             density=args.density, preset=args.preset, rows=rows),
        indent=1))

