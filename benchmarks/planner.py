"""The planner: its run time, and its predictions against measured steps.

  timing   planner run time of every cost strategy for synthetic models of
           50 / 161 / 314 / 1000 leaves (CPU is fine)
  measure  on the GPUs: plans for the example LM (``size`` at several bucket
           sizes, ``auto``, the other cost strategies), each predicted by the
           simulator from a costs file and measured with
           ``examples/train_lm.py --plan`` (one process per plan), plus dense
  overlap  on the GPUs: XLA's overlap of the dense all-reduce with the
           backward pass, η = (T_bwd + T_comm − T_both) / T_comm, under
           several XLA flag sets (one process each)
  eta      simulated from a costs file: what ``auto`` gains over the best
           ``size`` rule as the overlap η grows (CPU)

Prints a table and writes JSON::

  python benchmarks/planner.py timing --out planner_timing.json
  jaxfuse profile --model examples/lm_model.py:gpt2_small -o costs.json
  python benchmarks/planner.py measure --costs costs.json --transport socket
  python benchmarks/planner.py overlap --transport socket
  python benchmarks/planner.py eta --costs costs.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks" / "tools"))
import dispatch  # pylint: disable=wrong-import-position

# Folded scripts, run as `python benchmarks/planner.py NAME ARGS`
# (benchmarks/tools/NAME.py; the old script's flags).
SUBCOMMANDS = {
    "predict-overlap": ("the simulator's predictions against the steps "
                        "`overhead.py overlap` measured"),
    "tail-plans": ("size plans with a small last bucket (for `gpu.sh "
                   "overlap`, MODE=plans)"),
    "window-model": "send_early timeline models against measured steps",
    "pack-trace": ("a jax.profiler trace rewritten as xz, the form results/ "
                   "stores"),
}

from lm_throughput import TRANSPORTS  # pylint: disable=wrong-import-position
from lm_throughput import transport_env  # pylint: disable=wrong-import-position

# XLA flag sets of the overlap study.
FLAG_SETS = {
    "default": "",
    "lhs": "--xla_gpu_enable_latency_hiding_scheduler=true",
    "lhs+nocombine": ("--xla_gpu_enable_latency_hiding_scheduler=true "
                      "--xla_gpu_all_reduce_combine_threshold_bytes=0 "
                      "--xla_gpu_all_gather_combine_threshold_bytes=0"),
    # Command buffers off (jaxfuse.xla_options() on GPU); `measure` runs
    # train_lm.py, which already applies it unless --xla-defaults.
    "nocmdbuf": "--xla_gpu_enable_command_buffer=",
    "lhs+nocombine+nocmdbuf": ("--xla_gpu_enable_latency_hiding_scheduler=true "
                               "--xla_gpu_all_reduce_combine_threshold_bytes=0 "
                               "--xla_gpu_all_gather_combine_threshold_bytes=0 "
                               "--xla_gpu_enable_command_buffer="),
}
SIZES_MB = (1, 4, 16, 64)


def _synthetic(num_leaves: int, seed: int = 0):
  """A transformer-like model of ``num_leaves`` leaves and costs for it."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jaxfuse.planning import costs as costs_lib  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(seed)
  shapes = [(768, 768 * int(rng.integers(1, 5))) if i % 3 == 0 else (768,)
            for i in range(num_leaves)]
  params = [jax.ShapeDtypeStruct(s, "float32") for s in shapes]
  sizes = np.array([np.prod(s) for s in shapes], float)
  costs = costs_lib.Costs(
      collectives={"allgather": costs_lib.LinearCost(1e-4, 3e-10),
                   "psum": costs_lib.LinearCost(1e-4, 5e-10)},
      compress=costs_lib.LinearCost(3e-5, 2e-11),
      backward=tuple(float(t) for t in 2e-11 * sizes * 1e3 + 1e-5),
      contention=1.3, overlap=0.25, forward=0.02)
  return params, costs


def cmd_timing(args) -> list[dict]:
  import jaxfuse  # pylint: disable=g-import-not-at-top
  rows = []
  print(f"{'leaves':>7} " + " ".join(f"{s:>9}" for s in
                                     jaxfuse.COST_STRATEGIES) + "   (s)")
  for n in args.leaves:
    params, costs = _synthetic(n)
    row = {"leaves": n}
    for strategy in jaxfuse.COST_STRATEGIES:
      jaxfuse.plan(params, strategy=strategy, costs=costs)   # warm caches
      t0 = time.perf_counter()
      plan = jaxfuse.plan(params, strategy=strategy, costs=costs)
      row[strategy] = time.perf_counter() - t0
      row[strategy + "_predicted_s"] = plan.provenance["predicted_iteration"]
    rows.append(row)
    print(f"{n:>7} " + " ".join(f"{row[s]:9.3f}" for s in
                                jaxfuse.COST_STRATEGIES), flush=True)
  return rows


def _env(transport: str, xla_flags: str = "") -> dict:
  env = transport_env(transport)
  if xla_flags:
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + xla_flags).strip()
  return env


def _train(args, extra, env) -> dict:
  with tempfile.TemporaryDirectory() as tmp:
    out = pathlib.Path(tmp) / "run.json"
    cmd = [sys.executable, str(ROOT / "examples" / "train_lm.py"),
           "--preset", args.preset, "--steps", str(args.steps),
           "--eval-batches", "0", "--log-every", "1000",
           "--json-out", str(out), *args.train_args.split(), *extra]
    print("==", " ".join(cmd[1:]), flush=True)
    try:
      proc = subprocess.run(cmd, env=env, check=False, capture_output=True,
                            text=True, timeout=args.run_timeout)
    except subprocess.TimeoutExpired:
      print(f"   timed out after {args.run_timeout} s", flush=True)
      return {"error": "timeout"}
    if proc.returncode or not out.exists():
      print(proc.stdout[-2000:], proc.stderr[-3000:], flush=True)
      return {"error": proc.returncode}
    return json.loads(out.read_text())


def _configs(args) -> list[tuple[str, str | None, dict]]:
  """(name, strategy, plan options) of every plan ``measure`` runs."""
  configs = [] if args.no_dense else [("dense", None, dict(density=1.0))]
  for density in args.densities:
    tag = f" @{density:g}" if len(args.densities) > 1 else ""
    for scheme in args.collectives:
      name = "" if scheme == "allgather" else f"{scheme} "
      for mb in args.sizes_mb:
        configs.append((f"{name}size {mb} MiB{tag}", "size",
                        dict(bucket_bytes=mb * 2**20, density=density,
                             collective=scheme)))
        configs += [(f"{name}size {mb} MiB, last {last} MiB{tag}", "size",
                     dict(bucket_bytes=mb * 2**20, density=density,
                          collective=scheme, last_bucket_bytes=last * 2**20))
                    for last in args.last_mb]
    configs += [(s + tag, s, dict(density=density)) for s in args.strategies]
  return configs


def _planning_inputs(args):
  """(costs, the model's parameter shapes, its loss_fn, example tokens),
  with JAX on the CPU: this process only plans and simulates, and holds no
  GPU memory that the training runs it starts need."""
  import jax  # pylint: disable=g-import-not-at-top
  jax.config.update("jax_platforms", "cpu")
  from jaxfuse.planning import costs as costs_lib  # pylint: disable=g-import-not-at-top
  sys.path.insert(0, str(ROOT / "examples"))
  import lm_model  # pylint: disable=g-import-not-at-top
  loss_fn, params, tokens = getattr(lm_model, args.model)()
  params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                        params)
  return costs_lib.Costs.load(args.costs), params, loss_fn, tokens


def _overlap_arg(text: str):
  """--overlap: 'measured', or η as a float in [0, 1]."""
  if text == "measured":
    return text
  try:
    eta = float(text)
  except ValueError:
    eta = -1.0
  if not 0.0 <= eta <= 1.0:
    raise argparse.ArgumentTypeError(f"{text!r}: a number in [0, 1] or "
                                     "'measured'")
  return eta


def _predict(row: dict, predicted, eta: float) -> None:
  """Set ``row``'s simulated figures (at overlap ``eta``) and its error."""
  row.update(predicted_s=predicted.iteration,
             predicted_compute_s=predicted.compute_end,
             predicted_communication_s=predicted.communication,
             predicted_overlap=predicted.overlap_ratio, predicted_eta=eta)
  if row.get("measured_s"):
    row["prediction_error"] = row["predicted_s"] / row["measured_s"] - 1


def _predict_from_one_worker(rows, plans, densities, costs) -> None:
  """Each measured plan predicted from its density's one-GPU step T₁ of the
  ``size`` plan, with η fitted on that plan:
  T₁ + ΔC + G − η·H (``simulate.step_from_one_worker``; ΔC the plan's
  simulated compute over the ``size`` plan's, G and H its communication
  and what the ideal schedule hides of it). Sets ``predicted_t1_s``."""
  from jaxfuse.planning import simulate  # pylint: disable=g-import-not-at-top
  ideal_costs = costs.replace(overlap=1.0)
  fits = {}
  for row, plan, density in zip(rows, plans, densities):
    if (row["plan"].startswith("size") and
        row.get("measured_overlap") is not None):
      fits.setdefault(density, (row["measured_one_worker_s"], min(
          max(row["measured_overlap"], 0.0), 1.0),
                                simulate.simulate(plan, ideal_costs)))
  if not fits:
    return
  print("with T₁ as the compute and η fitted per density:", flush=True)
  for row, plan, density in zip(rows, plans, densities):
    if density not in fits or not row["measured_s"]:
      continue
    t1, eta, anchor = fits[density]
    row["predicted_t1_s"] = simulate.step_from_one_worker(
        t1, eta, simulate.simulate(plan, ideal_costs), anchor)
    print(f"   {row['plan']:26} predicted {1e3 * row['predicted_t1_s']:7.1f}"
          f" ms  measured {1e3 * row['measured_s']:7.1f} ms  error "
          f"{100 * (row['predicted_t1_s'] / row['measured_s'] - 1):+5.1f} %"
          f"  (η {eta:.2f})", flush=True)


def cmd_measure(args) -> list[dict]:
  if args.overlap == "measured" and not (args.one_worker and args.sizes_mb):
    raise SystemExit("--overlap measured needs --one-worker and a size plan "
                     "(--sizes-mb), whose step gives the η.")
  costs, params, loss_fn, tokens = _planning_inputs(args)
  import jaxfuse  # pylint: disable=g-import-not-at-top
  from jaxfuse.planning import simulate  # pylint: disable=g-import-not-at-top
  base = dict(order=jaxfuse.planning.ordering.FromLoss(loss_fn, (tokens,)),
              costs=costs)
  rows = []
  if args.flags_via == "env":     # process-wide, every program of the run
    env, flag_args = _env(args.transport, FLAG_SETS[args.flags]), []
  else:                           # the train step's jit only
    env = _env(args.transport)
    flag_args = [a for f in FLAG_SETS[args.flags].split()
                 for a in ("--xla-option", f.removeprefix("--"))]
  if isinstance(args.overlap, float):
    costs = base["costs"] = costs.replace(overlap=args.overlap)
  plans, densities, eta_measured = [], [], {}   # η measured per density
  with tempfile.TemporaryDirectory() as tmp:
    for name, strategy, options in _configs(args):
      plan = jaxfuse.plan(params, **{**base, **options,
                                     "strategy": strategy or "single"})
      plans.append(plan)
      densities.append(options["density"])
      predicted = simulate.simulate(plan, costs)
      if strategy is None:
        extra = ["--sync", "dense"]
      else:
        path = pathlib.Path(tmp) / "plan.json"
        plan.save(path)
        extra = ["--plan", str(path)]
      run = _train(args, extra + flag_args, env)
      row = {"plan": name, "buckets": len(plan.buckets),
             "collectives": sorted({b.collective for b in plan.buckets}),
             "wire_bytes": plan.bytes_per_worker(),
             "measured_s": run.get("steady_step_time_s"),
             "measured_mean_s": run.get("mean_step_time_s"),
             "phase_steps": run.get("phase_steps"),
             "error": run.get("error"),
             "winner": plan.provenance.get("auto", {}).get("winner")}
      _predict(row, predicted, costs.overlap)
      if "config" in run:          # where the run trained (this process plans)
        row["devices"] = (f"{run['config']['num_devices']} x "
                          f"{run['config'].get('device_kind', '?')}")
      line = (f"   {name:26} {row['buckets']:3d} buckets  "
              f"{row['wire_bytes'] / 2**20:8.2f} MiB  predicted "
              f"{1e3 * row['predicted_s']:7.1f} ms  measured "
              + (f"{1e3 * row['measured_s']:7.1f} ms  error "
                 f"{100 * row['prediction_error']:+5.1f} %"
                 if row["measured_s"] else "failed"))
      if (args.one_worker and row["measured_s"] and strategy in
          (None, "size") and "last_bucket_bytes" not in options and
          set(row["collectives"]) <= {"psum", "allgather"}):
        # The same per-worker work on one device: no communication, so the
        # measured overlap is η = (T₁ + G − T_K) / H, G the simulated link
        # time and H what the ideal schedule hides of it (simulate's η; a
        # schemes' plans for K workers do not run on one).
        per_worker = run["config"]["batch_size"] // run["config"]["num_devices"]
        alone = _train(args, extra + flag_args + [
            "--devices", "1", "--batch-size", str(per_worker)], env)
        row["measured_one_worker_s"] = t1 = alone.get("steady_step_time_s")
        ideal = simulate.simulate(plan, costs.replace(overlap=1.0))
        eta = (simulate.eta_from_hidden(
            t1 + ideal.communication - row["measured_s"], ideal)
               if t1 else None)
        if eta is not None:
          row["measured_overlap"] = eta
          line += f"  one worker {1e3 * t1:.1f} ms  η {eta:.2f}"
      rows.append(row)
      print(line, flush=True)
      density = options["density"]
      if (args.overlap == "measured" and strategy == "size" and
          row.get("measured_overlap") is not None and
          density not in eta_measured):
        # Plan and predict the rest of this density, and re-predict what
        # ran at it, with the η this step measured (the overlap of the
        # step as it is compiled, e.g. under --send-early).
        eta = min(max(row["measured_overlap"], 0.0), 1.0)
        costs = base["costs"] = costs.replace(overlap=eta)
        eta_measured[density] = eta
        print(f"   planning and predicting with the measured η = {eta:.2f}",
              flush=True)
  if eta_measured:
    print("re-predicted at the measured η ("
          + ", ".join(f"{e:.2f} at {d:g}" for d, e in eta_measured.items())
          + "):", flush=True)
    for row, plan, density in zip(rows, plans, densities):
      eta = eta_measured.get(density, costs.overlap)
      _predict(row, simulate.simulate(plan, costs.replace(overlap=eta)), eta)
      if row["measured_s"]:
        print(f"   {row['plan']:26} predicted {1e3 * row['predicted_s']:7.1f}"
              f" ms  measured {1e3 * row['measured_s']:7.1f} ms  error "
              f"{100 * row['prediction_error']:+5.1f} %", flush=True)
  _predict_from_one_worker(rows, plans, densities, costs)
  dense = next((r for r in rows if r["plan"] == "dense" and r["measured_s"]),
               None)
  for r in rows:
    if dense and r["measured_s"]:
      r["vs_dense"] = dense["measured_s"] / r["measured_s"]
  for density in args.densities:
    tag = f" @{density:g}" if len(args.densities) > 1 else ""
    sized = [r for r in rows if r["plan"].startswith("size")
             and r["plan"].endswith(tag) and r["measured_s"]]
    auto = next((r for r in rows if r["plan"] == "auto" + tag
                 and r["measured_s"]), None)
    if not (sized and auto):
      continue
    best = min(sized, key=lambda r: r["measured_s"])
    print(f"auto{tag} {1e3 * auto['measured_s']:.1f} ms vs best fixed rule "
          f"({best['plan']}) {1e3 * best['measured_s']:.1f} ms: "
          f"{100 * (1 - auto['measured_s'] / best['measured_s']):+.1f} %"
          + (f"; vs dense {auto['vs_dense']:.2f}x" if dense else ""))
    # No grouping of the same sparse leaves beats its compute stream (forward
    # + backward + compression): the most any plan can gain on the best rule.
    bound = auto["predicted_compute_s"]
    print(f"compute-stream bound (simulated) {1e3 * bound:.1f} ms: regrouping "
          f"can gain at most "
          f"{100 * (1 - bound / best['measured_s']):.1f} % on the best rule")
  return rows


def cmd_eta(args) -> list[dict]:
  """What ``auto`` gains over the best ``size`` rule as the overlap η grows:
  the profiled costs with η replaced, every plan simulated (CPU only)."""
  profiled, params, loss_fn, tokens = _planning_inputs(args)
  import jaxfuse  # pylint: disable=g-import-not-at-top
  from jaxfuse.planning import simulate  # pylint: disable=g-import-not-at-top
  rows = []
  print(f"{'rho':>6} {'eta':>5} {'best size rule':>22} {'auto':>8} "
        f"{'gain':>7} {'dense':>8}")
  for density in args.densities:
    for eta in args.etas:
      costs = dataclasses.replace(profiled, overlap=eta)
      base = dict(density=density, costs=costs,
                  order=jaxfuse.planning.ordering.FromLoss(loss_fn,
                                                           (tokens,)))
      sized = {mb: simulate.simulate(jaxfuse.plan(
          params, strategy="size", bucket_bytes=mb * 2**20, **base),
                                     costs).iteration
               for mb in args.sizes_mb}
      best = min(sized, key=sized.get)
      auto = jaxfuse.plan(params, strategy="auto", **base)
      t_auto = simulate.simulate(auto, costs).iteration
      t_dense = simulate.simulate(jaxfuse.plan(
          params, strategy="single", **{**base, "density": 1.0}),
                                  costs).iteration
      rows.append({"density": density, "overlap": eta, "size_rules_s":
                   {str(k): v for k, v in sized.items()}, "best_rule_mb": best,
                   "auto_s": t_auto, "dense_s": t_dense,
                   "auto_winner": auto.provenance["auto"]["winner"]})
      print(f"{density:6g} {eta:5.2f} {f'{1e3 * sized[best]:.1f} ms ({best} MiB)':>22} "
            f"{1e3 * t_auto:6.1f}ms {100 * (1 - t_auto / sized[best]):6.1f}% "
            f"{1e3 * t_dense:6.1f}ms", flush=True)
  return rows


_OVERLAP_WORKER = """
import json, sys
sys.path.insert(0, {examples!r})
import jaxfuse, lm_model
from jaxfuse.planning import profiling
loss_fn, params, tokens = lm_model.{model}()
eta, raw = profiling.measure_overlap(jaxfuse.make_mesh(), loss_fn, params,
                                     (tokens,),
                                     timing=profiling.Timing(repeats=10))
print("RESULT", json.dumps({{"overlap": eta, **raw}}))
"""


def cmd_overlap(args) -> list[dict]:
  rows = []
  for name in args.flag_sets:
    code = _OVERLAP_WORKER.format(examples=str(ROOT / "examples"),
                                  model=args.model)
    proc = subprocess.run([sys.executable, "-c", code], check=False,
                          capture_output=True, text=True,
                          env=_env(args.transport, FLAG_SETS[name]))
    line = next((l for l in proc.stdout.splitlines()
                 if l.startswith("RESULT ")), None)
    if line is None:
      print(f"{name}: failed\n{proc.stderr[-3000:]}", flush=True)
      rows.append({"flags": name, "error": proc.returncode})
      continue
    row = {"flags": name, "xla_flags": FLAG_SETS[name],
           **json.loads(line[len("RESULT "):])}
    rows.append(row)
    print(f"{name:14} backward {1e3 * row['backward']:7.1f} ms  all-reduce "
          f"{1e3 * row['comm']:7.1f} ms  both {1e3 * row['both']:7.1f} ms  "
          f"overlap η = {row['overlap']:.2f}", flush=True)
  return rows


def main(argv=None):
  p = argparse.ArgumentParser(
      description=__doc__, epilog=dispatch.epilog(SUBCOMMANDS),
      formatter_class=argparse.RawDescriptionHelpFormatter)
  sub = p.add_subparsers(dest="command", required=True)
  t = sub.add_parser("timing", help="planner run time")
  t.add_argument("--leaves", type=int, nargs="+", default=[50, 161, 314, 1000])
  for name in ("measure", "overlap"):
    m = sub.add_parser(name)
    m.add_argument("--transport", default="socket", choices=sorted(TRANSPORTS))
    m.add_argument("--model", default="gpt2_small",
                   help="function of examples/lm_model.py")
  m = sub.choices["measure"]
  m.add_argument("--costs", required=True)
  m.add_argument("--preset", default="gpt2-small")
  m.add_argument("--steps", type=int, default=20)
  m.add_argument("--densities", type=float, nargs="+", default=[0.01])
  m.add_argument("--sizes-mb", type=int, nargs="+", default=list(SIZES_MB))
  m.add_argument("--last-mb", type=int, nargs="*", default=[],
                 help="also each size plan with its last group cut to this "
                 "many MiB (jaxfuse.plan's last_bucket_bytes)")
  m.add_argument("--collectives", nargs="+", default=["allgather"],
                 help="sparse schemes of the size plans (allgather zen "
                 "spardl); auto picks its own")
  m.add_argument("--train-args", default="--dense-warmup 1 --warmup-steps 0",
                 help="more train_lm.py arguments; the default times "
                 "onebit_adamw's sparse phase after one dense step (the "
                 "measured step is the last phase's median)")
  m.add_argument("--no-dense", action="store_true",
                 help="leave out the dense run (measured in another call)")
  m.add_argument("--one-worker", action="store_true",
                 help="also run dense and allgather plans on one device "
                 "(same per-worker batch) for the measured overlap η")
  m.add_argument("--strategies", nargs="*", default=["auto"])
  m.add_argument("--overlap", type=_overlap_arg, default=None,
                 metavar="ETA|measured",
                 help="plan and predict with this overlap η instead of the "
                 "costs file's; 'measured': the η the first size plan's "
                 "step measured (needs --one-worker), for the plans after "
                 "it and the predictions of all (the overlap of the step as "
                 "compiled, e.g. with --train-args '--send-early')")
  m.add_argument("--flags", default="default", choices=sorted(FLAG_SETS))
  m.add_argument("--flags-via", default="env", choices=("env", "jit"),
                 help="apply --flags through XLA_FLAGS (every program) or "
                 "train_lm.py --xla-option (the train step's jit only)")
  m.add_argument("--run-timeout", type=float, default=420,
                 help="seconds per training run before it counts as failed")
  e = sub.add_parser("eta", help="auto vs the best size rule as η grows "
                     "(simulated, CPU)")
  e.add_argument("--costs", required=True)
  e.add_argument("--model", default="gpt2_small")
  e.add_argument("--densities", type=float, nargs="+", default=[0.05, 0.01])
  e.add_argument("--etas", type=float, nargs="+",
                 default=[0.0, 0.1, 0.25, 0.5, 0.75, 1.0])
  e.add_argument("--sizes-mb", type=int, nargs="+",
                 default=[1, 4, 16, 64, 128])
  sub.choices["overlap"].add_argument("--flag-sets", nargs="+",
                                      default=list(FLAG_SETS),
                                      choices=sorted(FLAG_SETS))
  p.add_argument("--out", default=None, help="JSON file to write")
  args = p.parse_args(argv)
  rows = {"timing": cmd_timing, "measure": cmd_measure, "eta": cmd_eta,
          "overlap": cmd_overlap}[args.command](args)
  if args.out:
    import jax  # pylint: disable=g-import-not-at-top
    dev = jax.devices()[0]
    meta = {"command": args.command, "jax": jax.__version__,
            "device": getattr(dev, "device_kind", str(dev)),
            "devices": jax.device_count(), "date": time.strftime("%Y-%m-%d"),
            "args": {k: v for k, v in vars(args).items()}}
    if args.command == "eta":      # simulated from a profile
      meta["device"] = "simulated"
    if args.command == "measure":  # planned on the CPU, trained elsewhere
      meta["device"] = next((r["devices"] for r in rows if "devices" in r),
                            None)
      meta.pop("devices")
    pathlib.Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows},
                                                 indent=1))


if __name__ == "__main__":
  dispatch.run(main, SUBCOMMANDS)
