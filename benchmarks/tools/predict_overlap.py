"""How well the simulator predicts the steps ``overhead.py overlap`` measured.

Reads the JSON files of ``overhead.py overlap`` calls (as ``gpu.sh overlap``
with MODE=plans writes them, one call per density): the plain step's file gives
the one-GPU step T₁ of the ``size`` plan and the collectives alone G; each
``send_early`` variant gives its plan and its measured step T_K. Every plan
is simulated with COSTS at η = 1; η is fitted on the ``size`` plan::

  η = (T₁ + G_sim − T_K) / H_sim

and each plan predicted as T₁ + ΔC + G_sim − η·H_sim
(``simulate.step_from_one_worker``; ΔC its simulated compute over the
``size`` plan's), for the steps waited for and pipelined alike.
``--anchor-link`` first scales the costs' collectives by G / G_sim of the
``size`` plan (``Costs.link_scaled``): the link of the machine that ran,
where COSTS were profiled on another. ``--bucket-cost`` sets
``Costs.bucket`` (seconds per sparse bucket). ``--eta W,P`` uses η = W
(waited for) and P (pipelined), e.g. fitted on another call or density,
instead of fitting: the ``size`` plan is then predicted too, a check of
the model where the link's share of the step differs (2 GPUs at ρ = 0.15
carry what 4 GPUs do at 0.05).

A variant's plan is the file it ran (``plan_file``), else the plan
``overlap.py`` saved beside its JSON (``<out>.plan.json``), else the
``size`` plan rebuilt on this machine as ``overlap.py`` builds it.

Prints a table per density and writes JSON (``--out``)::

  python benchmarks/planner.py predict-overlap --costs \\
      benchmarks/results/planner_early_2xH200_socket_2026-11-29/costs_early.json \\
      --bucket-cost 0.00013 --anchor-link \\
      benchmarks/results/overlap_2026-11-30/run34_*.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks" / "tools"))

# pylint: disable=wrong-import-position
import jax

import jaxfuse
from jaxfuse.planning import costs as costs_lib
from jaxfuse.planning import simulate

TIE = 0.03   # plans predicted closer than this are a tie, whatever the order


def _plan(path: pathlib.Path, result: dict) -> jaxfuse.Plan:
  """The plan a variant ran (module docstring)."""
  if result.get("plan_file"):
    file = ROOT / result["plan_file"]
    if not file.exists():
      raise SystemExit(f"{path}: its plan {result['plan_file']} is not in "
                       "this checkout; copy it there (the path is relative "
                       "to the repository root).")
    return jaxfuse.Plan.load(file)
  saved = path.with_name(path.stem + ".plan.json")
  if saved.exists():
    return jaxfuse.Plan.load(saved)
  import overlap  # pylint: disable=g-import-not-at-top
  args = overlap.parse_args([])
  for name in ("preset", "strategy", "bucket_mb", "density"):
    setattr(args, name, result[name])
  for name in ("dtype", "estimator", "headroom"):   # an older result may
    if result.get(name) is not None:                # lack these: defaults
      setattr(args, name, result[name])
  return overlap.build(args, jax.devices()[:1])[-1]


def read_calls(paths) -> dict[float, dict]:
  """Per density: T₁, G (waited, pipelined) and the send_early variants."""
  calls = {}
  for path in map(pathlib.Path, paths):
    if path.name.endswith(".plan.json"):   # a plan saved beside a result
      continue
    result = json.loads(path.read_text())
    call = calls.setdefault(result["density"], {"variants": []})
    if "one_gpu_step_s" in result:
      call.update(t1=(result["one_gpu_step_s"],
                      result["one_gpu_step_pipelined_s"]),
                  g=result.get("comm_s"))
    if not result.get("send_early"):
      continue
    plan = _plan(path, result)
    for name, v in result["variants"].items():
      if v.get("step_s"):
        call["variants"].append({
            "name": name, "plan": plan, "buckets": len(plan.buckets),
            "is_size": not result.get("plan_file") and
                       result["strategy"] == "size",
            "measured": (v["step_s"], v["step_pipelined_s"])})
  return calls


def predict(call: dict, costs, eta=None) -> list[dict]:
  """Each variant's predicted steps (waited, pipelined) and errors; η
  fitted on the ``size`` plan, or ``eta`` = (waited, pipelined) given."""
  anchor = next(v for v in call["variants"] if v["is_size"])
  base = simulate.simulate(anchor["plan"], costs)
  rows = []
  for v in call["variants"]:
    ideal = simulate.simulate(v["plan"], costs)
    row = {"plan": v["name"], "buckets": v["buckets"],
           "measured_s": list(v["measured"]), "predicted_s": [],
           "error": [], "eta": []}
    for which, (t1, t_size, t_k) in enumerate(zip(
        call["t1"], anchor["measured"], v["measured"])):
      fit = eta[which] if eta is not None else simulate.eta_from_hidden(
          t1 + base.communication - t_size, base)
      if fit is None:
        raise SystemExit("the size plan's simulated schedule hides no "
                         "communication: no η to fit (check --costs).")
      p = simulate.step_from_one_worker(t1, fit, ideal, base)
      row["predicted_s"].append(p)
      row["error"].append(p / t_k - 1)
      row["eta"].append(fit)
    rows.append(row)
  return rows


def swapped(rows, which: int) -> list[tuple[str, str, float]]:
  """Pairs the prediction orders against the measurement, with the
  predicted gap (a share of the faster prediction); ``which``: 0 waited
  for, 1 pipelined."""
  out = []
  for a, b in itertools.combinations(rows, 2):
    measured = a["measured_s"][which] - b["measured_s"][which]
    predicted = a["predicted_s"][which] - b["predicted_s"][which]
    if measured * predicted < 0:
      gap = abs(predicted) / min(a["predicted_s"][which],
                                 b["predicted_s"][which])
      out.append((a["plan"], b["plan"], gap))
  return out


def _eta_pair(text: str) -> tuple[float, float]:
  """``--eta``'s "W,P" as two floats in (0, 1]."""
  try:
    pair = tuple(float(x) for x in text.split(","))
  except ValueError:
    pair = ()
  if len(pair) != 2 or not all(0 < x <= 1 for x in pair):
    raise argparse.ArgumentTypeError(
        f"{text!r}: give η waited for and pipelined as W,P, each in (0, 1] "
        "(e.g. 0.77,0.84)")
  return pair


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("results", nargs="+", help="overlap.py JSON files")
  p.add_argument("--costs", required=True, help="a jaxfuse profile's costs")
  p.add_argument("--bucket-cost", type=float,
                 help="seconds of compute per sparse bucket (Costs.bucket)")
  p.add_argument("--anchor-link", action="store_true",
                 help="scale the collectives so that the size plan's "
                      "simulated G is the measured one")
  p.add_argument("--eta", type=_eta_pair, metavar="W,P",
                 help="η waited for and pipelined (each in (0, 1]) instead "
                      "of fitting it on the size plan")
  p.add_argument("--out")
  args = p.parse_args(argv)
  costs = costs_lib.Costs.load(args.costs).replace(overlap=1.0)
  if args.bucket_cost is not None:
    costs = costs.replace(bucket=args.bucket_cost)
  report = {"costs": args.costs, "bucket_cost_s": costs.bucket,
            "anchor_link": args.anchor_link, "eta": args.eta,
            "densities": {}}
  for density, call in sorted(read_calls(args.results).items()):
    if "t1" not in call or not any(v["is_size"] for v in call["variants"]):
      print(f"ρ {density}: needs the plain step's file (T₁, G) and the size "
            "plan's send_early step; skipped")
      continue
    used = costs
    if args.anchor_link:
      size_plan = next(v["plan"] for v in call["variants"] if v["is_size"])
      g_sim = simulate.simulate(size_plan, costs).communication
      used = costs.link_scaled(call["g"] / g_sim)
    rows = predict(call, used, args.eta)
    print(f"ρ {density}: T₁ {1e3 * call['t1'][0]:.1f} ms (pipelined "
          f"{1e3 * call['t1'][1]:.1f}), G {1e3 * call['g']:.1f} ms; "
          f"η {rows[0]['eta'][0]:.2f} ({rows[0]['eta'][1]:.2f})")
    print(f"  {'plan':32s} {'buckets':>7s} {'measured':>16s} "
          f"{'predicted':>16s} {'error':>15s}")
    for r in rows:
      m, q, e = r["measured_s"], r["predicted_s"], r["error"]
      print(f"  {r['plan']:32s} {r['buckets']:7d} {1e3 * m[0]:7.1f} "
            f"({1e3 * m[1]:5.1f}) {1e3 * q[0]:7.1f} ({1e3 * q[1]:5.1f}) "
            f"{100 * e[0]:+6.1f} ({100 * e[1]:+5.1f}) %")
    entry = {"t1_s": list(call["t1"]), "g_s": call["g"], "rows": rows}
    for which, label in ((0, "waited for"), (1, "pipelined")):
      pairs = swapped(rows, which)
      entry[f"swapped_{label.split()[0]}"] = pairs
      print(f"  ranking, {label}: " + (
          "as measured" if not pairs else "; ".join(
              f"{a} vs {b} swapped (predicted {100 * g:.1f} % apart"
              f"{', a tie' if g < TIE else ''})" for a, b, g in pairs)))
    report["densities"][str(density)] = entry
  if args.out:
    pathlib.Path(args.out).write_text(json.dumps(report, indent=1))

