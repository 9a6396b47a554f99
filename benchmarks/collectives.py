"""Bytes on the wire per scheme, read from the compiled program, and the
simulator's step time for many workers.

Three parts (each optional):

  hlo      for K = 2…8 simulated CPU workers, gpt2-small's gradient shapes,
           densities 0.001 / 0.01 / 0.05 and each sparse scheme: compile the
           ``sparse_sync`` update and read every collective of the compiled
           HLO (all-gather, all-to-all, collective-permute, all-reduce,
           reduce-scatter) with its operand and result shapes; bytes a worker
           sends and receives follow from each op's semantics (below). The
           scheme's own ``steps`` prediction is printed beside it.
  overlap  how much the selected indices of K workers overlap on real
           example-LM gradients (tiny preset, different batches per worker,
           after a short SGD run): the union over workers as a share of
           Σ_k |I_k|, the quantity ZEN's pull moves (Zen(union)).
  simulate step time of gpt2-small from ``simulate`` for K up to 1024 with a
           measured costs file (socket transport), for dense, allgather,
           zen (lossless pull and the measured union) and spardl.

Per op and worker (x: operand bytes, y: result bytes, K: group size):
  all-gather        receives y − x, sends y − x (ring: forwards K−1 shards)
  all-to-all        sends and receives (K−1)/K·x
  collective-permute sends and receives x
  all-reduce        sends and receives 2(K−1)/K·x (ring)
  reduce-scatter    sends and receives (K−1)/K·x

  python benchmarks/collectives.py --parts hlo overlap simulate \
      --out benchmarks/results/collectives_cpu.json --plot docs/collectives.png
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import multiprocessing
import os
import pathlib
import re
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "benchmarks" / "tools"))
import dispatch  # pylint: disable=wrong-import-position

# Folded scripts, run as `python benchmarks/collectives.py NAME ARGS`
# (benchmarks/tools/NAME.py; the old script's flags).
SUBCOMMANDS = {
    "collective-order": ("whether several processes compiled the same "
                         "collectives in the same order"),
}

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=8")

SCHEMES = ("allgather", "zen", "spardl")
DTYPE_BYTES = {"f32": 4, "u32": 4, "s32": 4, "bf16": 2, "f16": 2, "u16": 2,
               "s16": 2, "u8": 1, "s8": 1, "pred": 1, "f64": 8, "s64": 8,
               "u64": 8}
OPS = ("all-gather", "all-to-all", "collective-permute", "all-reduce",
       "reduce-scatter")
_SHAPE = re.compile(r"\b(f32|u32|s32|bf16|f16|u16|s16|u8|s8|pred|f64|s64|u64)"
                    r"\[([\d,]*)\]")


def _bytes(types: str) -> int:
  """Bytes of every array shape written in an HLO type string."""
  total = 0
  for dtype, dims in _SHAPE.findall(types):
    total += DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",")
                                            if d)
  return total


def hlo_wire(hlo_text: str, num_workers: int) -> dict:
  """{op: count, "sent": bytes, "received": bytes} of one worker's program.

  Compiled HLO names its operands (``all-gather(%x)``), so each operand's
  shape is looked up where it is defined; an async ``-start`` op's result is
  the tuple (operands, outputs), so the outputs are its last element. Long
  tuples carry ``/*index=5*/`` comments, dropped first."""
  hlo_text = re.sub(r"/\*index=\d+\*/", "", hlo_text)
  types = {}
  for line in hlo_text.splitlines():
    m = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = (\([^=]*?\)|\S+) ", line)
    if m:
      types[m.group(1)] = m.group(2)
  out = {op: 0 for op in OPS}
  sent = received = 0
  k = num_workers
  for line in hlo_text.splitlines():
    m = re.search(r"= (\([^=]*?\)|\S+) (all-gather|all-to-all|"
                  r"collective-permute|all-reduce|reduce-scatter)(-start)?"
                  r"\(([^)]*)\)", line)
    if not m:
      continue
    result, op, start, operands = m.groups()
    x = sum(_bytes(types.get(name, ""))
            for name in re.findall(r"%([\w.\-]+)", operands))
    y = _bytes(result) - (x if start else 0)
    out[op] += 1
    if op == "all-gather":
      s = r = y - x
    elif op in ("all-to-all", "reduce-scatter"):
      s = r = (k - 1) * x / k
    elif op == "collective-permute":
      s = r = x
    else:
      s = r = 2 * (k - 1) * x / k
    sent += s
    received += r
  out.update(sent=int(sent), received=int(received))
  return out


def _gpt2_shapes():
  import jax  # pylint: disable=g-import-not-at-top
  import lm_model  # pylint: disable=g-import-not-at-top
  model = lm_model.build_model("gpt2-small")
  tokens = jax.ShapeDtypeStruct((1, model.cfg.seq_len), "int32")
  params = jax.eval_shape(lambda t: model.init(jax.random.PRNGKey(0), t),
                          tokens)["params"]
  return [jax.ShapeDtypeStruct(x.shape, x.dtype)
          for x in jax.tree.leaves(params)]


def measure_hlo(args: tuple) -> dict:
  """One (scheme, density, K): compile the update, read its collectives."""
  scheme, density, k, num_buckets = args
  import jax  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding  # pylint: disable=g-import-not-at-top
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top
  import jaxfuse  # pylint: disable=g-import-not-at-top
  from jaxfuse import collectives  # pylint: disable=g-import-not-at-top

  leaves = _gpt2_shapes()
  plan = jaxfuse.plan(leaves, density=density, strategy="aligned",
                      num_buckets=num_buckets, collective=scheme)
  mesh = jaxfuse.make_mesh(k)
  tx = jaxfuse.sparse_sync(plan)
  state = jax.eval_shape(lambda: jaxfuse.init_state(tx, leaves, mesh))
  specs = jaxfuse.state_specs(state)
  state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(
      x.shape, x.dtype, sharding=NamedSharding(mesh, s)), state, specs)
  grads = [jax.ShapeDtypeStruct((k,) + l.shape, l.dtype,
                                sharding=NamedSharding(mesh, P("data")))
           for l in leaves]
  update = jax.jit(jax.shard_map(
      lambda g, s: tx.update([x[0] for x in g], s), mesh=mesh,
      in_specs=(P("data"), specs), out_specs=(P(), specs)))
  t0 = time.perf_counter()
  hlo = update.lower(grads, state).compile().as_text()
  wire = hlo_wire(hlo, k)
  predicted = collectives.bucket_wire(
      jaxfuse.sync.bucket_steps.compile_plan(plan), k)
  sparse = [i for i, b in enumerate(plan.buckets) if b.collective != "psum"]
  slots = sum(l.capacity for l in plan.leaves if l.mode == "sparse")
  return dict(scheme=scheme, density=density, workers=k,
              compile_s=time.perf_counter() - t0, slots=slots,
              predicted_sent=sum(w.sent for w in predicted),
              predicted_received=sum(w.received for w in predicted),
              predicted_sparse_received=sum(predicted[i].received
                                            for i in sparse),
              dense_bytes=plan.dense_bytes(), **wire)


def run_hlo(schemes, densities, workers, num_buckets, jobs) -> list[dict]:
  configs = [(s, d, k, num_buckets) for s in schemes for d in densities
             for k in workers]
  ctx = multiprocessing.get_context("spawn")
  rows = []
  print(f"{'scheme':10} {'rho':>6} {'K':>3} {'sent MB':>9} {'recv MB':>9} "
        f"{'pred recv':>9} {'recv/slot pairs':>15} {'ops':>24}")
  with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=ctx) as pool:
    for r in pool.map(measure_hlo, configs):
      rows.append(r)
      ops = " ".join(f"{op.split('-')[-1][:6]}={r[op]}" for op in OPS if r[op])
      print(f"{r['scheme']:10} {r['density']:6.3f} {r['workers']:3d} "
            f"{r['sent'] / 1e6:9.2f} {r['received'] / 1e6:9.2f} "
            f"{r['predicted_received'] / 1e6:9.2f} "
            f"{r['received'] / (8 * r['slots']):15.2f} {ops:>24}",
            flush=True)
  return rows


def run_overlap(workers, densities, steps: int = 20) -> list[dict]:
  """Union of K workers' top-ρ index sets over Σ_k |I_k|, per density, on the
  tiny example LM (every leaf of ≥ 1024 elements), after ``steps`` SGD steps."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import lm_model  # pylint: disable=g-import-not-at-top
  from jaxfuse.plans import target_count  # pylint: disable=g-import-not-at-top
  model = lm_model.build_model("tiny", seq_len=64)
  train, _ = lm_model.load_corpus(cap_bytes=2**20)
  rng = np.random.default_rng(0)
  params = model.init(jax.random.PRNGKey(0),
                      lm_model.sample_batch(rng, train, 1, 64)[:, :-1])["params"]
  grad_fn = jax.jit(jax.grad(lm_model.make_loss(model)))
  for _ in range(steps):
    params = jax.tree.map(lambda p, g: p - 0.5 * g, params, grad_fn(
        params, lm_model.sample_batch(rng, train, 32, 64)))
  kmax = max(workers)
  grads = [[np.asarray(g).ravel() for g in jax.tree.leaves(grad_fn(
      params, lm_model.sample_batch(rng, train, 4, 64)))] for _ in range(kmax)]
  rows = []
  for density in densities:
    for k in workers:
      union = total = 0
      for leaf in range(len(grads[0])):
        n = grads[0][leaf].size
        if n < 1024:
          continue
        c = target_count(density, n)
        sets = [np.argpartition(-np.abs(grads[w][leaf]), c - 1)[:c]
                for w in range(k)]
        union += len(np.unique(np.concatenate(sets)))
        total += k * c
      rows.append(dict(density=density, workers=k, union=union, total=total,
                       union_share=union / total))
      print(f"overlap rho={density:<6} K={k}: union {union} of {total} "
            f"slots = {union / total:.3f}", flush=True)
  return rows


def run_simulate(costs_path, densities, workers, union_share) -> list[dict]:
  import jax  # pylint: disable=g-import-not-at-top
  import jaxfuse  # pylint: disable=g-import-not-at-top
  from jaxfuse.planning import costs as costs_lib  # pylint: disable=g-import-not-at-top
  from jaxfuse.planning import simulate  # pylint: disable=g-import-not-at-top
  del jax
  costs = costs_lib.Costs.load(costs_path)
  leaves = _gpt2_shapes()
  rows = []
  variants = [("dense", 1.0, "allgather"), ]
  for d in densities:
    variants += [("allgather", d, "allgather"),
                 ("zen", d, "zen"),
                 ("spardl", d, "spardl")]
    if union_share:
      variants.append(("zen-union", d, jaxfuse.collectives.Zen(
          union=min(1.0, union_share.get(d, 1.0)))))
  for name, density, scheme in variants:
    plan = jaxfuse.plan(leaves, density=density, strategy="aligned",
                        collective=scheme, costs=costs)
    for k in workers:
      t = simulate.simulate(plan, costs, k)
      rows.append(dict(scheme=name, density=density, workers=k,
                       iteration=t.iteration, communication=t.communication))
  for density in densities:   # what the planner picks for K workers
    for k in workers:
      plan = jaxfuse.plan(leaves, density=density, strategy="auto",
                          costs=costs, num_workers=k)
      t = simulate.simulate(plan, costs, k)
      picked = sorted({b.collective for b in plan.buckets})
      rows.append(dict(scheme="auto", density=density, workers=k,
                       iteration=t.iteration, communication=t.communication,
                       collectives=picked,
                       winner=plan.provenance["auto"]["winner"]))
  variants += [("auto", d, None, {}) for d in densities]
  print(f"{'scheme':10} {'rho':>6} " + " ".join(f"{k:>8}" for k in workers))
  for name, density, _, _ in variants:
    its = [r["iteration"] for r in rows
           if r["scheme"] == name and r["density"] == density]
    print(f"{name:10} {density:6.3f} " +
          " ".join(f"{1e3 * t:8.1f}" for t in its))
  for r in rows:
    if r["scheme"] == "auto":
      print(f"auto at rho {r['density']:g}, K = {r['workers']}: "
            f"{'/'.join(r['collectives'])} ({r['winner']})")
  return rows


def plot(result, path):
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
  hlo = result.get("hlo", [])
  for scheme in SCHEMES:
    for density in sorted({r["density"] for r in hlo}):
      pts = sorted((r["workers"], r["received"] / (8 * r["slots"]))
                   for r in hlo if r["scheme"] == scheme and
                   r["density"] == density)
      if pts:
        axes[0].plot(*zip(*pts), marker="o",
                     label=f"{scheme} ρ={density}")
  axes[0].set_xlabel("workers K (simulated CPU devices)")
  axes[0].set_ylabel("received per worker / (C pairs)")
  axes[0].set_title("bytes from the compiled HLO, gpt2-small")
  axes[0].legend(fontsize=7)
  sim = result.get("simulate", [])
  for name in sorted({r["scheme"] for r in sim}):
    for density in sorted({r["density"] for r in sim if r["scheme"] == name}):
      pts = sorted((r["workers"], 1e3 * r["iteration"]) for r in sim
                   if r["scheme"] == name and r["density"] == density)
      if name == "dense" or density == 0.01:
        axes[1].plot(*zip(*pts), marker=".",
                     label=f"{name}" + ("" if name == "dense" else
                                        f" ρ={density}"))
  axes[1].set_xscale("log", base=2)
  axes[1].set_yscale("log")
  axes[1].set_xlabel("workers K")
  axes[1].set_ylabel("simulated step (ms)")
  axes[1].set_title("simulate, socket costs (2xH200 profile)")
  axes[1].legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def main(argv=None):
  p = argparse.ArgumentParser(
      description=__doc__.splitlines()[0],
      epilog=dispatch.epilog(SUBCOMMANDS),
      formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--parts", nargs="+", default=["hlo", "overlap", "simulate"],
                 choices=["hlo", "overlap", "simulate"])
  p.add_argument("--schemes", nargs="+", default=list(SCHEMES))
  p.add_argument("--densities", nargs="+", type=float,
                 default=[0.001, 0.01, 0.05])
  p.add_argument("--workers", nargs="+", type=int,
                 default=list(range(2, 9)))
  p.add_argument("--sim-workers", nargs="+", type=int,
                 default=[2 ** i for i in range(1, 11)])
  p.add_argument("--num-buckets", type=int, default=4)
  p.add_argument("--jobs", type=int, default=os.cpu_count())
  p.add_argument("--costs", default=str(
      ROOT / "benchmarks/results/costs_gpt2-small_2xH200_socket.json"))
  p.add_argument("--out", help="JSON file to write")
  p.add_argument("--plot", help="PNG to draw")
  args = p.parse_args(argv)
  import jax  # pylint: disable=g-import-not-at-top
  result = {"meta": {"jax": jax.__version__, "date": time.strftime("%Y-%m-%d"),
                     "cpu_count": os.cpu_count(), "args": vars(args)}}
  if "hlo" in args.parts:
    result["hlo"] = run_hlo(args.schemes, args.densities, args.workers,
                            args.num_buckets, args.jobs)
  union_share = {}
  if "overlap" in args.parts:
    result["overlap"] = run_overlap(args.workers, args.densities)
    # Zen(union) = U/C per partition ≈ the union's share of K·C, with 25 %
    # headroom, at the largest K measured.
    union_share = {r["density"]: 1.25 * r["union_share"]
                   for r in result["overlap"] if r["workers"] ==
                   max(args.workers)}
  if "simulate" in args.parts:
    result["simulate"] = run_simulate(args.costs, args.densities,
                                      args.sim_workers, union_share)
  if args.out:
    pathlib.Path(args.out).write_text(json.dumps(result, indent=1))
  if args.plot:
    plot(result, args.plot)


if __name__ == "__main__":
  dispatch.run(main, SUBCOMMANDS)
