"""Convergence against dense: loss against steps and against wall time.

Every run of one study trains on the same data, in the same order, from the
same seed, for the same number of steps; dense runs in the same call. Each
recipe and dense get the same learning-rate grid; the best value of each
(lowest final loss) is what the tables and plots compare.

  # the example LM (examples/train_lm.py), one run per process
  python benchmarks/convergence.py lm --preset tiny --steps 1000 \\
      --recipes dense,sync_adamw,local_adamw --lrs 1e-3,3e-3,1e-2 \\
      --out results/conv_tiny.json
  # SGD with momentum on a small MLP classifier (scikit-learn's digits)
  python benchmarks/convergence.py classifier --densities 0.1,0.01,0.001
  # the stiff least-squares problem: which learning rates diverge
  python benchmarks/convergence.py lsq
  # tables and a PNG from a results file (also written by each study)
  python benchmarks/convergence.py report results/conv_tiny.json

Recipes for ``lm``
(``name[+warm][+flushN][+delay[+predict]][+early][+net][+bf16wire]``
``[+bf16sparse][+intB][+packed][+hH][+dRHO]``):
``dense`` (AdamW after a pmean), every name of ``jaxfuse.RECIPES``,
``sparseloco`` and ``diloco`` (``jaxfuse.local_steps`` with AdamW inner
steps and that outer step, ``train_lm --local-steps H --outer``; DiLoCo
on a density-1 plan, a float32 mean), each with ``+hH``, its H;
``+dRHO`` sets the run's density; ``+int8``/``+int4``/``+int2`` quantize
the sparse values (``--sparse-wire``), ``+packed`` packs the indices;
``+warm`` adds DGC's density ramp (``--warm-steps`` per density),
``+flushN`` a density-1 step every N steps (``train_lm --flush-every``),
``+delay`` the recipe on the previous step's gradients
(``jaxfuse.delayed``, ``train_lm --delay``),
``+predict`` with it the gradient at the predicted parameters
(``delayed(..., predict=True)``, ``train_lm --predict``),
``+early`` the step under ``jaxfuse.send_early`` (``train_lm --send-early``),
``+net`` XLA told the network (``train_lm --network-gbytes-s``,
``jaxfuse.xla_flags``): its 3 GB/s, or half of it with ``+early`` (what
each ran fastest with; runs before 2026-11-30 gave 3 to both),
``+bf16wire`` the dense warm-up on a
bfloat16 wire (``train_lm --dense-wire bfloat16``), ``+bf16sparse`` the
sparse values on one (``--sparse-wire bfloat16``); ``onebit_adamw`` always gets a dense warm-up
of ``--dense-fraction`` of the steps. Every run states its plan and warm-up
to ``train_lm`` (the ``aligned`` plan, the dense warm-up on the gradient's
wire, DGC's ramp for ``+warm``) rather than take the example's defaults,
which are the README recipe's; ``--extra`` overrides them. Wall time:
each run's measured step times, compilation and evaluation excluded (each phase's first step counts
as that phase's median step); time to dense's quality: the wall time at the
first evaluation whose validation loss is at or below dense's final one.

Recipes for ``classifier`` and ``lsq`` (SGD, momentum 0.9): ``dense``,
``naive`` (``chain(sparse_sync, optax.sgd)``), ``sgd`` (``jaxfuse.sgd``)
and ``sgd_masked`` (with momentum factor masking), each ``sgd*`` also with
DGC's ramp (``--warm-steps`` per density). docs/convergence.md has the
figures.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks" / "tools"))
import dispatch  # pylint: disable=wrong-import-position
from predict_time import measured_wall  # pylint: disable=wrong-import-position
from predict_time import reach_step  # pylint: disable=wrong-import-position
from small_sgd import report_lsq  # pylint: disable=wrong-import-position
from small_sgd import run_classifier  # pylint: disable=wrong-import-position
from small_sgd import run_lsq  # pylint: disable=wrong-import-position

# Folded scripts, run as `python benchmarks/convergence.py NAME ARGS`
# (benchmarks/tools/NAME.py; the old script's flags).
SUBCOMMANDS = {
    "sgd-study": "stabilisers for jaxfuse.sgd at a dense-tuned rate",
    "sgd-stability": ("whether jaxfuse.sgd is stable at dense momentum SGD's "
                      "best rate"),
    "elastic": ("elastic restart on the example LM: train on K workers, "
                "resume on K'"),
    "predict-time": ("runs' predicted wall time on K real workers over "
                     "given links (jaxfuse.planning.predict)"),
    "regimes": ("which regime pays on a link: predicted steps of dense, the "
                "per-step recipe and jaxfuse.local_steps"),
}

HORIZONS = (250, 500, 1000)


def _csv(kind):
  return lambda text: [kind(x) for x in text.split(",") if x.strip()]


def _lrs_for(text):
  out = {}
  for item in filter(None, text.split(";")):
    name, _, values = item.partition("=")
    out[name.strip()] = _csv(float)(values)
  return out


# --- the example LM ------------------------------------------------------------

# the local-steps arms: train_lm --local-steps H --outer NAME
LOCAL_STEPS = ("sparseloco", "diloco")


def lm_command(recipe: str, lr: float, args) -> list[str]:
  name, _, extra = recipe.partition("+")
  cmd = [sys.executable, str(ROOT / "examples" / "train_lm.py"),
         "--preset", args.preset, "--steps", str(args.steps), "--lr", str(lr),
         "--seed", str(args.seed), "--eval-every", str(args.eval_every),
         "--eval-batches", str(args.eval_batches), "--log-every", "50",
         "--density", str(args.density), "--estimator", args.estimator,
         "--corpus-mb", f"{args.corpus_mb:g}"]
  if args.devices:
    cmd += ["--devices", str(args.devices)]
  if args.cpu_devices:
    cmd += ["--cpu-devices", str(args.cpu_devices)]
  if name in LOCAL_STEPS:   # train_lm --local-steps (AdamW inner steps)
    cmd += ["--outer", name] + (["--density", "1"] if name == "diloco"
                                else [])
  else:
    cmd += ["--optimizer", "local_adamw" if name == "dense" else name]
  if name == "dense":
    cmd += ["--sync", "dense"]
  warm = 0  # explicit: train_lm's defaults differ per optimizer
  parts = [part for part in extra.split("+") if part]
  for part in parts:
    if part == "warm":
      warm = args.warm_steps
    elif part.startswith("flush"):
      cmd += ["--flush-every", part[len("flush"):] or "50"]
    elif part in ("zen", "spardl"):
      cmd += ["--collective", part]
    elif part == "delay":
      cmd += ["--delay"]
    elif part == "predict":
      cmd += ["--predict"]
    elif part == "early":
      cmd += ["--send-early"]
    elif part == "net":   # what each measured fastest with (xla_flags doc)
      cmd += ["--network-gbytes-s", "1.5" if "early" in parts else "3"]
    elif part == "bf16wire":
      cmd += ["--dense-wire", "bfloat16"]
    elif part == "bf16sparse":
      cmd += ["--sparse-wire", "bfloat16"]
    elif part in ("int8", "int4", "int2"):
      cmd += ["--sparse-wire", part]
    elif part == "packed":
      cmd += ["--packed-indices"]
    elif part.startswith("h") and part[1:].isdigit():
      cmd += ["--local-steps", part[1:]]
    elif part.startswith("d") and _is_number(part[1:]):
      cmd += ["--density", part[1:]]
    else:
      raise SystemExit(f"recipe {recipe!r}: suffixes are +warm, +flushN, "
                       "+zen, +spardl, +delay, +predict, +early, +net, "
                       "+bf16wire, +bf16sparse, +int8/+int4/+int2 "
                       "(--sparse-wire), +packed (--packed-indices), +hH "
                       "(--local-steps), +dRHO (--density)")
  if name in LOCAL_STEPS and "--local-steps" not in cmd:
    raise SystemExit(f"recipe {recipe!r}: {name} needs its H, e.g. "
                     f"{name}+h30")
  if "bf16wire" not in parts:
    cmd += ["--dense-wire", "gradient"]
  cmd += ["--strategy", "aligned", "--warmup-densities", "dgc"]
  cmd += ["--warmup-steps", str(warm), "--dense-warmup",
          str(max(1, int(args.dense_fraction * args.steps))
              if name == "onebit_adamw" else 0)]
  return cmd + list(args.extra)


def _is_number(text: str) -> bool:
  try:
    float(text)
  except ValueError:
    return False
  return True


def lm_jobs(recipes, lrs, lrs_for) -> list[tuple[str, float]]:
  """(recipe, lr) runs: a recipe's grid is lrs_for[recipe], else
  lrs_for[its name before the first +], else lrs."""
  bases = {r.partition("+")[0] for r in recipes}
  for key in lrs_for:   # a key that matches nothing would run lrs
    if key not in recipes and key not in bases:
      raise SystemExit(f"--lrs-for {key!r}: not one of --recipes "
                       f"({', '.join(recipes)}) nor their names")
  return [(r, lr) for r in recipes
          for lr in lrs_for.get(r, lrs_for.get(r.partition("+")[0], lrs))]


def run_lm(args) -> dict:
  import jaxfuse  # pylint: disable=g-import-not-at-top
  names = ("dense", *sorted(jaxfuse.RECIPES), *LOCAL_STEPS)
  for recipe in args.recipes:   # each checked before any run starts
    if recipe.partition("+")[0] not in names:
      raise SystemExit(f"recipe {recipe!r}: its name is one of "
                       f"{', '.join(names)}, then +suffixes")
    lm_command(recipe, 0.0, args)
  jobs = lm_jobs(args.recipes, args.lrs, args.lrs_for)
  env = dict(os.environ, PYTHONPATH=str(ROOT))
  out_dir = pathlib.Path(tempfile.mkdtemp(prefix="jaxfuse_conv_"))

  def one(job):
    recipe, lr = job
    out = out_dir / f"{recipe}_{lr:g}.json"
    cmd = lm_command(recipe, lr, args) + ["--json-out", str(out)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                          timeout=args.timeout, check=False)
    took = time.perf_counter() - t0
    if proc.returncode or not out.exists():
      print(f"FAILED {recipe} lr={lr:g} ({took:.0f} s):\n{proc.stdout[-2000:]}"
            f"\n{proc.stderr[-3000:]}", flush=True)
      return {"recipe": recipe, "lr": lr, "failed": True,
              "stderr": proc.stderr[-3000:]}
    result = json.loads(out.read_text())
    print(f"{recipe:>22s} lr={lr:<8g} val {result['final_val_loss']:.4f}  "
          f"{1e3 * result['median_step_time_s']:.1f} ms/step  "
          f"({took:.0f} s)", flush=True)
    return {"recipe": recipe, "lr": lr, "command": " ".join(cmd[1:]),
            **{k: result[k] for k in (
                "losses", "step_times_s", "phase_of_step", "compile_steps",
                "phases", "val_curve", "final_val_loss", "final_train_loss",
                "median_step_time_s", "wire_bytes", "dense_bytes",
                "replicas_identical", "config", "stats", "plan")}}

  data = {"study": "lm", "preset": args.preset, "steps": args.steps,
          "density": args.density, "runs": []}
  with concurrent.futures.ThreadPoolExecutor(args.parallel) as pool:
    for run in pool.map(one, jobs):
      data["runs"].append(run)
      if args.out:  # partial results survive a time limit
        pathlib.Path(args.out).write_text(json.dumps(data))
  return data


# --- report ---------------------------------------------------------------------

def _label(run, density) -> str:
  """A run's recipe, with ``@ρ`` where it trained at another density than
  the file's (results merged from several calls)."""
  rho = run.get("config", {}).get("density", density)
  return run["recipe"] + ("" if rho == density else f"@{rho:g}")


def _best(runs, recipe, key, density=None):
  ok = [r for r in runs if _label(r, density) == recipe and not r.get("failed")
        and r[key] is not None and r[key] == r[key]]
  return min(ok, key=lambda r: r[key]) if ok else None


def _val_at(run, step):
  for point in run["val_curve"]:
    if point["step"] == step:
      return point["val_loss"]
  return None


def report_lm(data, plot_path=None):
  import numpy as np  # pylint: disable=g-import-not-at-top
  runs = data["runs"]
  recipes = list(dict.fromkeys(_label(r, data["density"]) for r in runs))
  best = {r: _best(runs, r, "final_val_loss", data["density"])
          for r in recipes}
  # the baseline: "dense", else the first dense variant (e.g. dense+net)
  dense = best.get("dense") or next(
      (best[r] for r in recipes if r.split("+")[0] == "dense"), None)
  horizons = [h for h in HORIZONS if h <= data["steps"]]
  head = (f"{'recipe':>22s} {'best lr':>8s} " +
          " ".join(f"{'val@' + str(h):>9s}" for h in horizons) +
          f" {'vs dense':>9s} {'ms/step':>8s} {'steps to dense':>15s}"
          f" {'time to dense':>14s}")
  lines = [head]
  for recipe, run in best.items():
    if run is None:
      lines.append(f"{recipe:>22s}   (every run failed)")
      continue
    vals = [_val_at(run, h) for h in horizons]
    gap = (run["final_val_loss"] / dense["final_val_loss"] - 1
           if dense else float("nan"))
    reach = reach_step(run, dense["final_val_loss"]) if dense else None
    seconds = None if reach is None else measured_wall(run)[reach - 1]
    when = "never" if reach is None else (
        f"{seconds:.0f} s {seconds / measured_wall(dense)[-1]:.2f}x")
    lines.append(
        f"{recipe:>22s} {run['lr']:8g} " +
        " ".join(f"{v:9.4f}" if v is not None else f"{'-':>9s}" for v in vals)
        + f" {100 * gap:+8.1f}% {1e3 * run['median_step_time_s']:8.1f} "
        f"{reach if reach is not None else 'never':>15} {when:>14s}")
  grid = ["", "every run (final validation loss):"]
  for r in runs:
    grid.append(f"  {_label(r, data['density']):>22s} lr={r['lr']:<8g} " + (
        "FAILED" if r.get("failed") else f"{r['final_val_loss']:.4f}"))
  text = "\n".join(lines + grid)
  if plot_path:
    import matplotlib  # pylint: disable=g-import-not-at-top
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for recipe, run in best.items():
      if run is None:
        continue
      losses = np.asarray(run["losses"])
      smooth = np.convolve(losses, np.ones(20) / 20, mode="valid")
      steps = np.arange(len(smooth)) + 20
      label = f"{recipe} (lr {run['lr']:g})"
      axes[0].plot(steps, smooth, label=label)
      axes[1].plot(measured_wall(run)[19:], smooth, label=label)
    axes[0].set_xlabel("step")
    axes[1].set_xlabel("wall time, s (measured step times)")
    for ax in axes:
      ax.set_ylabel("training loss (20-step mean)")
      ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{data['preset']}, {data['runs'][0]['config']['num_devices']}"
                 f" x {data['runs'][0]['config']['device_kind']}, density "
                 f"{data['density']} (a label's @ρ: density ρ), "
                 f"{data['steps']} steps")
    fig.tight_layout()
    fig.savefig(plot_path, dpi=110)
  return text


def report_small(data):
  """Classifier: per density and recipe, the run at dense's tuned rate."""
  runs = data["runs"]
  dense = min((r for r in runs if r["recipe"] == "dense"),
              key=lambda r: r["final_train_loss"])
  lines = [f"dense tuned lr {dense['lr']:g}: final train loss "
           f"{dense['final_train_loss']:.4f}, test {dense['test_loss']:.4f} "
           f"({data['steps']} steps, {data['workers']} workers, batch "
           f"{data['batch']})",
           f"{'recipe':>10s} {'density':>8s} {'warm':>5s} {'train':>8s} "
           f"{'vs dense':>9s} {'test':>8s}   (at lr {dense['lr']:g}; best "
           "lr of the grid in brackets)"]
  keys = sorted({(r["recipe"], r["density"], r["warm_steps"]) for r in runs
                 if r["recipe"] != "dense"}, key=lambda k: (-k[1], k))
  for key in keys:
    mine = [r for r in runs
            if (r["recipe"], r["density"], r["warm_steps"]) == key]
    at = [r for r in mine if r["lr"] == dense["lr"]][0]
    best = min(mine, key=lambda r: r["final_train_loss"])
    lines.append(
        f"{key[0]:>10s} {key[1]:8g} {key[2]:5d} {at['final_train_loss']:8.4f} "
        f"{100 * (at['final_train_loss'] / dense['final_train_loss'] - 1):+8.1f}%"
        f" {at['test_loss']:8.4f}   [{best['lr']:g}: "
        f"{best['final_train_loss']:.4f}]")
  return "\n".join(lines)


def main(argv=None):
  p = argparse.ArgumentParser(
      description=__doc__.split("\n")[0],
      epilog=dispatch.epilog(SUBCOMMANDS),
      formatter_class=argparse.RawDescriptionHelpFormatter)
  sub = p.add_subparsers(dest="study", required=True)
  lm = sub.add_parser("lm")
  lm.add_argument("--preset", default="tiny")
  lm.add_argument("--steps", type=int, default=1000)
  lm.add_argument("--recipes", type=_csv(str),
                  default=["dense", "sync_adamw", "local_adamw"])
  lm.add_argument("--lrs", type=_csv(float), default=[1e-3, 3e-3, 1e-2])
  lm.add_argument("--lrs-for", type=_lrs_for, default={},
                  help="per-recipe grids, e.g. demo=1e-4,3e-4,1e-3;sgd=0.1,0.3,1 "
                  "(a key is a whole --recipes entry or its name before "
                  "the first +)")
  lm.add_argument("--density", type=float, default=0.01)
  lm.add_argument("--estimator", default="dgc")
  lm.add_argument("--corpus-mb", type=float, default=32,
                  help="corpus to read (train_lm --corpus-mb; 32 takes the "
                  "whole standard library, about 30 MiB, more than a "
                  "1000-step gpt2-small run reads, so no epoch repeats)")
  lm.add_argument("--warm-steps", type=int, default=50)
  lm.add_argument("--dense-fraction", type=float, default=0.25)
  lm.add_argument("--eval-every", type=int, default=250)
  lm.add_argument("--eval-batches", type=int, default=8)
  lm.add_argument("--devices", type=int)
  lm.add_argument("--cpu-devices", type=int)
  lm.add_argument("--parallel", type=int, default=1)
  lm.add_argument("--timeout", type=int, default=3600)
  lm.add_argument("--seed", type=int, default=0)
  lm.add_argument("--extra", type=lambda t: t.split(), default=[],
                  help="more train_lm arguments, space-separated")
  for name, steps, lrs in (("classifier", 600, [0.03, 0.1, 0.3]),
                           ("lsq", 300, [2e-3 / 2**i for i in range(12)])):
    q = sub.add_parser(name)
    q.add_argument("--workers", type=int, default=8)
    q.add_argument("--steps", type=int, default=steps)
    q.add_argument("--lrs", type=_csv(float), default=lrs)
    q.add_argument("--densities", type=_csv(float),
                   default=[0.1, 0.01, 0.001] if name == "classifier"
                   else [0.3, 0.1, 0.03, 0.01])
    q.add_argument("--warm-steps", type=int, default=20)
    q.add_argument("--seed", type=int, default=0)
    if name == "classifier":
      q.add_argument("--batch", type=int, default=256)
      q.add_argument("--residual-decay", type=float, default=1.0,
                     help="jaxfuse.sgd's residual_decay (1: full error "
                     "feedback)")
      q.add_argument("--nesterov", action="store_true",
                     help="jaxfuse.sgd with nesterov=True (dense stays "
                     "heavy ball)")
    else:
      q.add_argument("--cond", type=float, default=1e3)
  rep = sub.add_parser("report")
  rep.add_argument("json")
  for q in sub.choices.values():
    q.add_argument("--out", help="results JSON")
    q.add_argument("--plot", help="PNG (lm)")
  args = p.parse_args(argv)
  if args.study == "report":
    data = json.loads(pathlib.Path(args.json).read_text())
  else:
    data = {"lm": run_lm, "classifier": run_classifier,
            "lsq": run_lsq}[args.study](args)
    data["date"] = time.strftime("%Y-%m-%d")
    data["command"] = " ".join(sys.argv)
    if args.out:
      pathlib.Path(args.out).write_text(json.dumps(data))
  report = {"lm": lambda d: report_lm(d, args.plot), "lsq": report_lsq,
            "classifier": report_small}[data["study"]]
  print(report(data))


if __name__ == "__main__":
  dispatch.run(main, SUBCOMMANDS)
