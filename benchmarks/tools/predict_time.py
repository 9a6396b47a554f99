"""Predicted wall time of training runs on K real workers over given links.

Reads runs of ``benchmarks/convergence.py lm`` (or ``examples/train_lm.py
--json-out``): their validation curves, phases and plans. Each run's steps
are timed by ``jaxfuse.planning.predict`` under ``--costs`` (one
worker's compute as profiled, or ``--compute`` seconds; the link as
profiled, or each of ``--links`` Gbit/s at ``--latency`` s a message) on
the run's K workers (its devices, or its simulated workers). It prints,
per run and link, the predicted step of each phase, the predicted time to
the best dense run's final validation loss, the compute utilisation
(the steps' compute over the predicted wall time), and, where the run ran
on K real devices and the link is the profiled one, the measured figures
and the error. A ``jaxfuse.local_steps`` run (``train_lm --local-steps
H``) shows its inner and its sync step (``predict.local_steps_times``)::

  python benchmarks/convergence.py predict RUN.json [RUN.json ...] \\
      --costs COSTS.json [--links 0.1 1 10 25] [--early-overlap 0.77] \\
      [--compute 0.0485] [--out predicted.json] [--plot predicted.png]

Every time it writes is a prediction unless labelled measured.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))


def _runs(paths) -> list[dict]:
  runs = []
  for path in paths:
    data = json.loads(pathlib.Path(path).read_text())
    for run in data.get("runs", [data]):
      if not run.get("failed"):
        run = dict(run, source=str(path))
        run.setdefault("recipe", run["config"].get("optimizer", "?"))
        runs.append(run)
  return runs


def _params_and_loss(preset: str, seq_len: int):
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import lm_model  # pylint: disable=g-import-not-at-top
  model = lm_model.build_model(preset, seq_len)
  shapes = jax.eval_shape(lambda: model.init(
      jax.random.PRNGKey(0), jnp.zeros((1, seq_len), jnp.int32)))["params"]
  params = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), shapes)
  return params, lm_model.make_loss(model)


def _plan(run, cache: dict):
  """The run's plan: kept in its JSON, else made again from its flags (the
  runs before the JSON kept it), else (a dense run) a ``size`` plan of its
  model, whose buckets stand for the all-reduces."""
  import jax  # pylint: disable=g-import-not-at-top
  import jaxfuse  # pylint: disable=g-import-not-at-top
  if run.get("plan"):
    return jaxfuse.Plan.from_json(run["plan"])
  c = run["config"]
  key = (c["preset"], c["seq_len"], c.get("density"), c.get("strategy"),
         c.get("bucket_bytes"))
  if key not in cache:
    params, loss_fn = _params_and_loss(c["preset"], c["seq_len"])
    rows = c["batch_size"] // c["num_devices"]
    batch = jax.ShapeDtypeStruct((rows, c["seq_len"] + 1), np.int32)
    cache[key] = jaxfuse.plan(
        params, density=c.get("density") or 0.05,
        strategy=c.get("strategy") or "size",
        bucket_bytes=c.get("bucket_bytes") or 64 * 2**20,
        order=jaxfuse.planning.ordering.FromLoss(loss_fn, (batch,)))
  return cache[key]


def _phases(run, plan, k: int):
  """The run's phases as it ran them (its JSON's starts and densities)."""
  import jaxfuse  # pylint: disable=g-import-not-at-top
  ran = run["phases"]
  if run["config"].get("sync") == "dense":
    return (jaxfuse.Phase(0, None, jaxfuse.with_density(plan, 1.0)),)
  dense = ran[0]["stop"] if ran[0]["density"] == 1.0 else 0
  ramp = [p for p in ran[1 if dense else 0:-1]]
  return jaxfuse.density_warmup(
      plan, steps=[p["stop"] - p["start"] for p in ramp] or 0,
      densities=[p["density"] for p in ramp], dense_steps=dense,
      dense_wire=run["config"].get("dense_wire", "gradient"), workers=k)


def profiled_latency(costs) -> float:
  """Seconds a message of the profiled link: the all-gather line's α over
  its K₀ − 1 ring messages."""
  return costs.collectives["allgather"].alpha / (costs.workers - 1)


def reach_step(run, loss):
  """First evaluated step whose validation loss is <= ``loss`` (or None)."""
  for point in run["val_curve"]:
    if point["val_loss"] <= loss:
      return point["step"]
  return None


def _reach(run, wall, loss):
  """(``reach_step``, ``wall`` at it), or (None, None)."""
  step = reach_step(run, loss)
  return (None, None) if step is None else (step, float(wall[step - 1]))


def measured_wall(run) -> np.ndarray:
  """Cumulative seconds after each step: measured step times with each
  phase's compile step replaced by that phase's median (compilation is
  excluded, as in the prediction)."""
  times = np.asarray(run["step_times_s"], float)
  phases = np.asarray(run["phase_of_step"])
  for p in set(phases.tolist()):
    sel = phases == p
    steady = [t for i, t in enumerate(times) if sel[i]
              and i not in run["compile_steps"]] or list(times[sel])
    for i in run["compile_steps"]:
      if phases[i] == p:
        times[i] = float(np.median(steady))
  return np.cumsum(times)


def _measured_phase_ms(run) -> list[float]:
  times = np.asarray(run["step_times_s"], float)
  phase = np.asarray(run["phase_of_step"])
  out = []
  for p in sorted(set(phase.tolist()) - {-1}):
    steady = [t for i, t in enumerate(times) if phase[i] == p and
              i not in run["compile_steps"]]
    out.append(1e3 * float(np.median(steady)) if steady else float("nan"))
  return out


def predict(args) -> list[dict]:
  import warnings  # pylint: disable=g-import-not-at-top
  import jaxfuse  # pylint: disable=g-import-not-at-top
  from jaxfuse.planning import predict as predict_lib  # pylint: disable=g-import-not-at-top
  from jaxfuse.planning.costs import Costs  # pylint: disable=g-import-not-at-top
  costs = Costs.load(args.costs)
  if args.compute:
    costs = costs.with_compute(args.compute)
  latency = (args.latency if args.latency is not None else
             profiled_latency(costs))
  links = [("profiled", costs)] + [
      (f"{g:g} Gbit/s", costs.on_link(g / 8, latency)) for g in args.links]
  runs = _runs(args.runs)
  targets = {}   # per file: its best dense run's final loss
  for r in runs:
    if r["config"].get("sync") == "dense":
      targets[r["source"]] = min(r["final_val_loss"],
                                 targets.get(r["source"], np.inf))
  if len(targets) == 1:   # one dense run for several files of runs
    targets = dict.fromkeys((r["source"] for r in runs),
                            next(iter(targets.values())))
  rows, cache = [], {}
  for run in runs:
    c, target = run["config"], targets.get(run["source"])
    k = args.workers or c["num_devices"]
    simulated = bool(c.get("simulated_workers"))
    plan = _plan(run, cache)
    every = c.get("local_steps") or None   # jaxfuse.local_steps' H
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")   # the wire warnings: reported below
      phases = ((jaxfuse.Phase(0, None, plan),) if every else
                _phases(run, plan, k))
    eta = (args.early_overlap if args.early_overlap is not None and
           c.get("send_early") else costs.overlap)
    measured = None if simulated or args.workers else _measured_phase_ms(run)
    for name, link in links:
      link = link.replace(overlap=eta)
      if every:   # (inner step, sync step)
        per_phase = [1e3 * t for t in
                     predict_lib.local_steps_times(plan, link, k)]
      else:
        per_phase = [1e3 * t for t in
                     predict_lib.phase_step_times(phases, link, k)]
      wall = predict_lib.predicted_wall_time(phases, link, k, c["steps"],
                                             every)
      # compute over wall time: the runs' steps without their syncs
      compute = predict_lib.predicted_wall_time(
          phases, link, 1, c["steps"], every)[-1]
      row = {"run": run["recipe"], "source": run["source"], "workers": k,
             "simulated": simulated, "seed": c.get("seed"), "link": name,
             "overlap": eta, "predicted_phase_ms": per_phase,
             "predicted_total_s": float(wall[-1]),
             "local_steps": every,
             "utilisation": float(compute / wall[-1]),
             "final_val_loss": run["final_val_loss"],
             "curve": [[p["step"], float(wall[p["step"] - 1]), p["val_loss"]]
                       for p in run["val_curve"]]}
      if target is not None:
        row["target_loss"] = target
        row["reach_step"], row["predicted_reach_s"] = _reach(run, wall,
                                                             target)
      if measured and name == "profiled":
        row["measured_phase_ms"] = measured
        row["error"] = [p / m - 1 for p, m in zip(per_phase, measured)]
        if target is not None:
          row["measured_reach_s"] = _reach(run, measured_wall(run),
                                           target)[1]
      rows.append(row)
  return rows


def _print(rows) -> None:
  print(f"{'run':40} {'K':>3} {'link':>12} {'predicted ms/phase':>26} "
        f"{'measured':>20} {'reach s':>8} {'measured':>8} {'util':>5}")
  for r in rows:
    pred = " ".join(f"{t:.1f}" for t in r["predicted_phase_ms"])
    meas = " ".join(f"{t:.1f}" for t in r.get("measured_phase_ms", []))
    reach = r.get("predicted_reach_s")
    got = r.get("measured_reach_s")
    print(f"{r['run'][:40]:40} {r['workers']:3d} {r['link']:>12} "
          f"{pred:>26} {meas:>20} "
          f"{'-' if reach is None else f'{reach:.1f}':>8} "
          f"{'' if got is None else f'{got:.1f}':>8} "
          f"{r['utilisation']:5.2f}")


def _print_quality(rows) -> None:
  """Per run: its final loss, the step it reaches the best dense run's
  final loss, and that time over the dense run's on each link."""
  links = list(dict.fromkeys(r["link"] for r in rows))
  dense = {(r["source"], r["link"]): r["predicted_total_s"] for r in rows
           if r["run"].startswith("dense") and r.get("reach_step")}
  if len({s for s, _ in dense}) == 1:   # the one dense run for every file
    dense = {(r["source"], l): t for r in rows for (_, l), t in dense.items()}
  print(f"\n{'run':28} {'K':>3} {'seed':>4} {'val':>7} {'reach':>5} "
        + " ".join(f"{l:>12}" for l in links))
  runs = list(dict.fromkeys((r["run"], r["workers"], r["seed"], r["source"])
                            for r in rows))
  for run in runs:
    mine = {r["link"]: r for r in rows
            if (r["run"], r["workers"], r["seed"], r["source"]) == run}
    first = next(iter(mine.values()))
    base = {l: dense.get((run[3], l)) for l in links}
    cells = [("-" if mine[l].get("predicted_reach_s") is None or not base[l]
              else f"{mine[l]['predicted_reach_s'] / base[l]:.2f}x")
             for l in links]
    print(f"{run[0][:28]:28} {run[1]:3d} {run[2] or 0:4d} "
          f"{first['final_val_loss']:7.4f} {first.get('reach_step') or '-':>5} "
          + " ".join(f"{c:>12}" for c in cells))


def _plot(rows, path) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.ticker  # pylint: disable=g-import-not-at-top
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  links = list(dict.fromkeys(r["link"] for r in rows))
  fig, axes = plt.subplots(1, len(links), figsize=(4.2 * len(links), 3.8),
                           squeeze=False)
  for ax, link in zip(axes[0], links):
    for r in (r for r in rows if r["link"] == link):
      _, wall, loss = zip(*r["curve"])
      ax.plot(wall, loss, label=f"{r['run'].split('+')[0]} K={r['workers']}"
              + (f" seed {r['seed']}" if r.get("seed") else ""))
    ax.set_title(f"{link} (predicted)")
    ax.set_xlabel("predicted wall time, s")
    ax.set_xscale("log")
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
  axes[0][0].set_ylabel("validation loss")
  axes[0][0].legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawTextHelpFormatter,
                              epilog=__doc__.split("\n\n", 1)[1])
  p.add_argument("runs", nargs="+", help="run JSONs")
  p.add_argument("--costs", required=True, help="costs JSON (jaxfuse "
                 "profile) of the runs' model")
  p.add_argument("--links", type=float, nargs="*", default=[],
                 help="links to predict for, in Gbit/s")
  p.add_argument("--latency", type=float,
                 help="seconds per message on --links (default: the "
                 "profiled all-gather's)")
  p.add_argument("--compute", type=float,
                 help="one worker's dense step, seconds (default: the "
                 "profile's forward + backward)")
  p.add_argument("--workers", type=int,
                 help="predict every run on this K instead of its own")
  p.add_argument("--early-overlap", type=float,
                 help="the overlap eta of runs under send_early (default: "
                 "the costs')")
  p.add_argument("--out", help="JSON to write")
  p.add_argument("--plot", help="PNG: validation loss against predicted "
                 "wall time, one panel per link")
  args = p.parse_args(argv)
  rows = predict(args)
  _print(rows)
  _print_quality(rows)
  meta = {"costs": args.costs, "links_gbit_s": args.links,
          "early_overlap": args.early_overlap, "compute_s": args.compute,
          "latency_s": args.latency, "predicted": True}
  if args.out:
    pathlib.Path(args.out).write_text(json.dumps({"meta": meta,
                                                  "rows": rows}))
  if args.plot:
    _plot(rows, args.plot)
  return 0
