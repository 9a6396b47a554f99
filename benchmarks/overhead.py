"""jaxfuse's cost over dense on one device: step time, compile time, bytes.

With one worker nothing is averaged and no network is involved, so what a
``sparse_sync`` step costs over a dense one is the sparsification alone.
For a preset of ``examples/lm_model.py`` this builds the train
step of ``examples/train_lm.py`` with the README's default recipe
(``onebit_adamw``, in its sparse phase) and with dense
AdamW (``pmean`` + ``optax.adamw``), both with ``jaxfuse.xla_options()``,
and prints::

  sync  estimator  step ms  over dense  compile s  x dense  step GB  kernels
  kernel ms  idle ms  pipelined

* step ms: mean of the timed steps, each waited for (as ``train_lm``
  does); "over dense" is against the dense step measured in this run.
* compile s: ``jit(...).lower(...).compile()`` of the whole step.
* step GB: the compiled step's "bytes accessed" (XLA's cost analysis;
  a Pallas kernel counts its operands and outputs once).
* kernels, kernel ms, idle ms: GPU kernels per step, their summed time,
  and the GPU's idle time inside steps, from a ``jax.profiler`` trace
  (``--profile-steps``; GPU only).
* pipelined: ms per step with the steps dispatched back to back and one
  wait at the end (the host's own time per step hides behind the GPU's).

``--apply-if-finite N`` adds, per estimator, a row with the recipe inside
``jaxfuse.apply_if_finite`` (``--strategy size --bucket-mb 64 --clip 1.0``:
the README recipe's plan and clip). ``--top N`` also prints, per row, the
N kernels after which the GPU waits longest (host-bound launches, a host
sync, or the gap between two waited-for steps). Every row runs in this one process, dense included, so the rows
compare::

  python benchmarks/overhead.py --preset gpt2-small --estimators dgc topk \\
      --out overhead.json
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "benchmarks" / "tools"))
import dispatch  # pylint: disable=wrong-import-position

# Folded scripts, run as `python benchmarks/overhead.py NAME ARGS`
# (benchmarks/tools/NAME.py; the old script's flags).
SUBCOMMANDS = {
    "compile-time": ("compile time of the sparse step against its plan's "
                     "buckets"),
    "lm-throughput": ("examples/train_lm.py throughput: dense vs jaxfuse per "
                      "NCCL transport"),
    "program-size": "size of the compiled update: fusions, compile time, step",
    "overlap": ("whether the sparse step hides its communication behind the "
                "backward pass"),
    "simulated-workers": ("K workers simulated on one device against K "
                          "times one worker's step"),
}

import jax  # pylint: disable=wrong-import-position
import jax.numpy as jnp  # pylint: disable=wrong-import-position
import numpy as np  # pylint: disable=wrong-import-position
import optax  # pylint: disable=wrong-import-position
from jax.sharding import NamedSharding  # pylint: disable=wrong-import-position
from jax.sharding import PartitionSpec as P  # pylint: disable=wrong-import-position

import jaxfuse  # pylint: disable=wrong-import-position
from jaxfuse.sync import bucket_pass  # pylint: disable=wrong-import-position
from jaxfuse.kernels import radix_select  # pylint: disable=wrong-import-position
from jaxfuse.kernels import fused_pass  # pylint: disable=wrong-import-position
from jaxfuse.planning import timing  # pylint: disable=wrong-import-position
import lm_model  # pylint: disable=wrong-import-position
from train_lm import make_train_step  # pylint: disable=wrong-import-position
from train_lm_args import add_wire_args  # pylint: disable=wrong-import-position

AXIS = "data"


def gpu_kernels(trace_dir: str, steps: int, timeline: str | None = None
                ) -> dict:
  """Kernels per step from a profiler trace: count, summed time, by name,
  and the GPU's idle time inside steps (gaps between kernels under 5 ms;
  the gaps between steps, where the host waits for each step, excluded)
  with the kernels that precede the largest gaps."""
  from jax.profiler import ProfileData  # pylint: disable=g-import-not-at-top
  files = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"),
                    recursive=True)
  if not files:
    return {}
  by_name = collections.Counter()
  launches = collections.Counter()
  events = []
  for plane in ProfileData.from_file(files[0]).planes:
    if not plane.name.startswith("/device:GPU:0"):
      continue
    for line in plane.lines:
      if not line.name.startswith("Stream"):   # "Stream #14(Compute)"
        continue
      for event in line.events:
        by_name[event.name] += event.duration_ns
        launches[event.name] += 1
        events.append((event.start_ns, event.duration_ns, event.name))
  events.sort()
  if timeline:
    t0 = events[0][0] if events else 0
    pathlib.Path(timeline).write_text(json.dumps(
        [((a - t0) / 1e3, d / 1e3, n) for a, d, n in events]))
  gaps = collections.Counter()
  idle = 0.0
  for (s0, d0, n0), (s1, _, _) in zip(events, events[1:]):
    gap = s1 - (s0 + d0)
    if 0 < gap < 5e6:
      idle += gap
      gaps[n0] += gap
  return {"kernels_per_step": len(events) / steps,
          "kernel_ms_per_step": sum(by_name.values()) / steps / 1e6,
          "idle_ms_per_step": idle / steps / 1e6,
          "idle_after_us": {k: v / steps / 1e3
                            for k, v in gaps.most_common(15)},
          "by_name_us": {k: v / steps / 1e3 for k, v in by_name.items()},
          "by_name_launches": {k: v / steps for k, v in launches.items()}}


def run(sync, estimator, args, setup, finite: bool = False) -> dict:
  """Compile and time one train step; ``sync`` "dense" or "jaxfuse";
  ``setup`` (params, loss_fn, batches, local_batch, mesh, options): the
  model, its batches, the mesh and the compiler options; ``finite``: the
  recipe inside ``jaxfuse.apply_if_finite``."""
  params, loss_fn, batches, local_batch, mesh, options = setup
  lr = 1e-4
  decay_mask = jax.tree.map(lambda x: x.ndim >= 2, params)
  state_params = jax.tree.map(jnp.copy, params)
  if sync == "dense":
    opt = optax.adamw(lr, weight_decay=0.01, mask=decay_mask)
    opt_state = jax.device_put(opt.init(state_params),
                               NamedSharding(mesh, P()))
    specs, plan = P(), None
  else:
    sizing = ({"bucket_bytes": int(args.bucket_mb * 2**20)}
              if args.bucket_mb else {})
    plan = jaxfuse.plan(params, density=args.density, estimator=estimator,
                        strategy=args.strategy, **sizing,
                        settings=jaxfuse.Settings(
                            sparse_wire=args.sparse_wire),
                        collective=jaxfuse.collectives.AllGather(
                            packed_indices=args.packed_indices),
                        order=jaxfuse.planning.ordering.FromLoss(
                            loss_fn, (local_batch,)))
    # The sparse phase from the start: with no dense step before it the
    # recipe's update is zero (v = 0), but every step does its full work.
    opt = jaxfuse.onebit_adamw(plan, lr, weight_decay=0.01,
                               options=jaxfuse.RecipeOptions(
                                   clip_norm=args.clip or None,
                                   mask=decay_mask))
    if finite:
      opt = jaxfuse.apply_if_finite(opt, args.apply_if_finite)
    opt_state = jaxfuse.init_state(opt, params, mesh)
    specs = jaxfuse.state_specs(opt_state)
  step = make_train_step(loss_fn, opt, mesh, specs, sync, options)
  t0 = time.perf_counter()
  lowered = step.lower(state_params, opt_state, batches[0])
  compiled = lowered.compile()
  compile_s = time.perf_counter() - t0
  if args.hlo_dir:
    pathlib.Path(args.hlo_dir).mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.hlo_dir, f"{sync}_{estimator}.hlo.txt").write_text(
        compiled.as_text())
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  out = {"sync": sync + ("+finite" if finite else ""),
         "estimator": estimator if plan else None,
         "compile_s": compile_s,
         "step_bytes": float((cost or {}).get("bytes accessed", float("nan"))),
         "hlo_fusions": compiled.as_text().count(" fusion(")}
  state = (state_params, opt_state)
  times = []
  for i in range(args.warmup + args.steps):
    t0 = time.perf_counter()
    p, s, loss = compiled(*state, batches[i % len(batches)])
    jax.block_until_ready(loss)
    if i >= args.warmup:
      times.append(time.perf_counter() - t0)
    state = (p, s)
  out["step_ms"] = 1e3 * statistics.fmean(times)
  # Dispatched back to back, one wait at the end: the host runs ahead.
  pipelined, state = timing.time_chained(
      compiled, state, batches, steps=args.steps,
      wait_each=jax.default_backend() == "cpu" and args.devices > 1)
  out["pipelined_step_ms"] = 1e3 * pipelined
  out["step_ms_median"] = 1e3 * statistics.median(times)
  out["step_ms_min"] = 1e3 * min(times)
  out["loss"] = float(loss)
  if args.profile_steps and jax.default_backend() == "gpu":
    with tempfile.TemporaryDirectory() as tmp:
      with jax.profiler.trace(tmp):
        for i in range(args.profile_steps):
          p, s, loss = compiled(*state, batches[i % len(batches)])
          jax.block_until_ready(loss)
          state = (p, s)
      out.update(gpu_kernels(tmp, args.profile_steps, args.timeline and (
          f"{args.timeline}_{sync}_{estimator}.json")))
  if plan is not None:
    stats = jaxfuse.summarize(jaxfuse.sync_stats(state[1]), plan)
    out["density"] = stats.get("density")
    out["overflow"] = stats["overflow"]
    out["missing_leaves"] = stats["missing_leaves"]
  return out


def main(argv=None) -> list[dict]:
  p = argparse.ArgumentParser(
      description=__doc__.splitlines()[0],
      epilog=dispatch.epilog(SUBCOMMANDS),
      formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--preset", default="tiny", choices=sorted(lm_model.PRESETS))
  p.add_argument("--density", type=float, default=0.01)
  p.add_argument("--estimators", nargs="+", default=["dgc", "topk"])
  p.add_argument("--strategy", default="aligned")
  p.add_argument("--bucket-mb", type=float,
                 help="bucket size for --strategy size (jaxfuse.plan's "
                 "default otherwise; the README recipe: 64)")
  p.add_argument("--clip", type=float, default=0.0,
                 help="the recipe's clip_norm (0: off; the example's 1.0)")
  p.add_argument("--apply-if-finite", type=int, metavar="N",
                 help="also each estimator's row with the recipe inside "
                 "jaxfuse.apply_if_finite(..., N)")
  p.add_argument("--batch-per-device", type=int,
                 help="default: the preset's (tiny: 32 for all devices)")
  p.add_argument("--devices", type=int, default=1)
  add_wire_args(p)
  p.add_argument("--steps", type=int, default=30)
  p.add_argument("--warmup", type=int, default=5)
  p.add_argument("--profile-steps", type=int, default=5)
  p.add_argument("--kernels", default="auto", choices=jaxfuse.kernels.BACKENDS)
  p.add_argument("--xla-defaults", action="store_true",
                 help="compile without jaxfuse.xla_options()")
  p.add_argument("--top", type=int, default=0)
  p.add_argument("--rows-per-chunk", type=int,
                 default=bucket_pass.ROWS_PER_CHUNK,
                 help="rows of a state group's streams stacked together for "
                 "the fused pass (jaxfuse.sync.bucket_pass.ROWS_PER_CHUNK; 1: "
                 "each row read where it is, 0: the whole group)")
  p.add_argument("--radix", default=radix_select.DEFAULT_GPU_METHOD,
                 choices=radix_select.GPU_METHODS,
                 help="how the k-th largests are found where the Pallas "
                 "kernels run (jaxfuse.kernels.radix_select.DEFAULT_GPU_METHOD): "
                 "radix, XLA reductions; pallas, one kernel; auto, the "
                 "kernel for short rows")
  p.add_argument("--scan-blocks", type=int,
                 default=fused_pass.SCAN_IN_PASS2_BLOCKS,
                 help="units of at most this many blocks run the fused "
                 "pass's scan inside pass 2, one kernel fewer per state "
                 "group (jaxfuse.kernels.fused_pass.SCAN_IN_PASS2_BLOCKS; "
                 "0: never)")
  p.add_argument("--pass-per", default=("bucket" if
                                         bucket_pass.ONE_PASS_PER_BUCKET
                                         else "batch"),
                 choices=["bucket", "batch"],
                 help="the fused pass's kernels: one per pass for the "
                 "bucket's batches or per batch "
                 "(jaxfuse.sync.bucket_pass.ONE_PASS_PER_BUCKET)")
  p.add_argument("--topk-sample", type=int,
                 default=jaxfuse.sparsify.TOPK_SAMPLE,
                 help="topk's bracket sample per unit "
                 "(jaxfuse.sparsify.TOPK_SAMPLE)")
  p.add_argument("--hlo-dir", help="also write each step's compiled HLO "
                 "here (benchmarks/kernels.py kernel-sources attributes its "
                 "kernels to source lines)")
  p.add_argument("--timeline", help="path prefix for the profiled kernels")
  p.add_argument("--out", help="JSON file to write")
  args = p.parse_args(argv)
  jaxfuse.kernels.set_backend(args.kernels)
  bucket_pass.ROWS_PER_CHUNK = args.rows_per_chunk
  jaxfuse.sparsify.TOPK_SAMPLE = args.topk_sample
  radix_select.DEFAULT_GPU_METHOD = args.radix
  fused_pass.SCAN_IN_PASS2_BLOCKS = args.scan_blocks
  bucket_pass.ONE_PASS_PER_BUCKET = args.pass_per == "bucket"
  mesh = jaxfuse.make_mesh(args.devices, AXIS)
  preset = lm_model.PRESETS[args.preset]
  model = lm_model.build_model(args.preset)
  seq_len = model.cfg.seq_len
  per_device = args.batch_per_device or preset.get(
      "batch_per_device", preset.get("batch", 32) // args.devices)
  batch = per_device * args.devices
  train, _ = lm_model.load_corpus(2**20)
  rng = np.random.default_rng(0)
  sharding = NamedSharding(mesh, P(AXIS))
  batches = [jax.device_put(lm_model.sample_batch(rng, train, batch, seq_len),
                            sharding) for _ in range(4)]
  params = model.init(jax.random.PRNGKey(0),
                      jnp.zeros((1, seq_len), jnp.int32))["params"]
  params = jax.device_put(params, NamedSharding(mesh, P()))
  loss_fn = lm_model.make_loss(model)
  local_batch = np.asarray(batches[0])[:per_device]
  options = {} if args.xla_defaults else jaxfuse.xla_options()
  setup = (params, loss_fn, batches, local_batch, mesh, options)
  rows = [run("dense", None, args, setup)]
  for e in args.estimators:
    rows.append(run("jaxfuse", e, args, setup))
    if args.apply_if_finite is not None:
      rows.append(run("jaxfuse", e, args, setup, finite=True))
  dense = rows[0]
  print(f"\n{'sync':15} {'estimator':9} {'step ms':>8} {'over dense':>11} "
        f"{'compile s':>9} {'x dense':>7} {'step GB':>8} {'kernels':>8} "
        f"{'kernel ms':>9} {'idle ms':>7} {'pipelined':>9}")
  for r in rows:
    over = r["step_ms"] - dense["step_ms"]
    r["overhead_ms"] = over
    r["compile_vs_dense"] = r["compile_s"] / dense["compile_s"]
    print(f"{r['sync']:15} {r['estimator'] or '-':9} {r['step_ms']:8.2f} "
          f"{over:+7.2f} ms {r['compile_s']:9.1f} "
          f"{r['compile_vs_dense']:7.2f} {r['step_bytes'] / 1e9:8.2f} "
          f"{r.get('kernels_per_step', float('nan')):8.0f} "
          f"{r.get('kernel_ms_per_step', float('nan')):9.2f} "
          f"{r.get('idle_ms_per_step', float('nan')):7.2f} "
          f"{r['pipelined_step_ms']:9.2f}")
  if args.top:
    for r in rows:
      if "idle_after_us" in r:
        print(f"\n{r['sync']} {r['estimator'] or ''}: GPU idle after "
              "(us per step)")
        for name, us in list(r["idle_after_us"].items())[:args.top]:
          print(f"  {us:9.1f}  {name[:90]}")
  if args.out:
    meta = {"jax": jax.__version__, "backend": jax.default_backend(),
            "device": getattr(jax.devices()[0], "device_kind", "cpu"),
            "devices": args.devices, "date": time.strftime("%Y-%m-%d"),
            "args": vars(args), "xla_options": options}
    pathlib.Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows},
                                                 indent=1))
  return rows


if __name__ == "__main__":
  dispatch.run(main, SUBCOMMANDS)
