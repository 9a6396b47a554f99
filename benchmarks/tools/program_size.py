"""Size of the compiled ``sparse_sync`` update: fusions, compile time, step.

On a GPU every fusion of the entry computation is at least one kernel
launch, so for models with many leaves the count, more than the bytes,
sets jaxfuse's fixed cost per step. This compiles the update alone (inside
``shard_map`` over K workers, random gradients) for a model of
``examples/lm_model.py`` and prints::

  model  leaves  sparse units  fusions  other ops  compile s  step ms

The counts come from the compiled HLO of the current backend. CPU counts are
a proxy for GPU ones: XLA's GPU fusion differs, and on a GPU it also fuses
some of the slices and bitcasts into their consumers.

  python benchmarks/overhead.py program-size --models tiny gpt2_small --out size.json
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))
# Simulated CPU workers (ignored by the GPU platform), set before JAX starts.
os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=8")

import jax  # pylint: disable=wrong-import-position
from jax.sharding import NamedSharding  # pylint: disable=wrong-import-position
from jax.sharding import PartitionSpec as P  # pylint: disable=wrong-import-position

import jaxfuse  # pylint: disable=wrong-import-position
from jaxfuse import plans as plan_lib  # pylint: disable=wrong-import-position
import lm_model  # pylint: disable=wrong-import-position


def entry_ops(hlo_text: str) -> tuple[int, int]:
  """(fusions, other non-trivial ops) in the ENTRY computation."""
  entry = hlo_text[hlo_text.index("ENTRY"):]
  entry = entry[:entry.index("\n}\n")]
  lines = entry.splitlines()[1:]
  fusions = sum(1 for l in lines if " fusion(" in l)
  trivial = ("parameter", "constant", "bitcast", "get-tuple-element", "tuple")
  other = 0
  for l in lines:
    m = re.search(r"= \S+ ([\w-]+)\(", l)
    if m and m.group(1) != "fusion" and m.group(1) not in trivial:
      other += 1
  return fusions, other


def measure(model: str, workers: int, density: float, strategy: str,
            steps: int) -> dict:
  _, params, _ = getattr(lm_model, model)()
  leaves = jax.tree.leaves(params)
  plan = jaxfuse.plan(leaves, density=density, strategy=strategy)
  mesh = jaxfuse.make_mesh(workers)
  tx = jaxfuse.sparse_sync(plan)
  state = jaxfuse.init_state(tx, leaves, mesh)
  specs = jaxfuse.state_specs(state)
  update = jax.jit(jax.shard_map(
      lambda g, s: tx.update([x[0] for x in g], s), mesh=mesh,
      in_specs=(P("data"), specs), out_specs=(P(), specs)))
  sharding = NamedSharding(mesh, P("data"))
  grads = [jax.device_put(jax.random.normal(jax.random.PRNGKey(i),
                                            (workers,) + l.shape, l.dtype),
                          sharding) for i, l in enumerate(leaves)]
  t0 = time.perf_counter()
  compiled = update.lower(grads, state).compile()
  compile_s = time.perf_counter() - t0
  fusions, other = entry_ops(compiled.as_text())
  out = jax.block_until_ready(compiled(grads, state))
  times = []
  for _ in range(steps):
    t0 = time.perf_counter()
    out = jax.block_until_ready(compiled(grads, out[1]))
    times.append(time.perf_counter() - t0)
  return {"model": model, "leaves": len(leaves),
          "sparse_units": len(plan_lib.units(plan)[0]),
          "buckets": len(plan.buckets), "fusions": fusions,
          "other_ops": other, "compile_s": compile_s,
          "step_ms": 1e3 * statistics.median(times),
          "backend": jax.default_backend(), "workers": workers,
          "density": density, "strategy": strategy}


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--models", nargs="+", default=["tiny", "gpt2_small"])
  p.add_argument("--workers", type=int, default=2)
  p.add_argument("--density", type=float, default=0.01)
  p.add_argument("--strategy", default="aligned")
  p.add_argument("--steps", type=int, default=10)
  p.add_argument("--out", help="JSON file to write")
  args = p.parse_args(argv)
  rows = []
  print(f"{'model':12} {'leaves':>6} {'units':>6} {'fusions':>8} "
        f"{'other':>6} {'compile s':>9} {'step ms':>9}")
  for model in args.models:
    r = measure(model, args.workers, args.density, args.strategy, args.steps)
    rows.append(r)
    print(f"{model:12} {r['leaves']:6d} {r['sparse_units']:6d} "
          f"{r['fusions']:8d} {r['other_ops']:6d} {r['compile_s']:9.1f} "
          f"{r['step_ms']:9.1f}", flush=True)
  if args.out:
    meta = {"jax": jax.__version__, "backend": jax.default_backend(),
            "device": getattr(jax.devices()[0], "device_kind", "cpu"),
            "date": time.strftime("%Y-%m-%d"), "args": vars(args)}
    pathlib.Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows},
                                                 indent=1))

