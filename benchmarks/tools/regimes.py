"""Which regime pays on a link: predicted step times of dense, the per-step
recipe and ``jaxfuse.local_steps`` for the example LM on K workers.

For each K and link (Gbit/s, at the profiled latency) it prints the
predicted seconds a step of the dense step (η: the costs'), of the
per-step recipe's sparse phase (ρ 0.05, ``size`` 64 MiB, planned for K, η
``--early-overlap``) and, per local-steps setting ``RHO:H[:WIRE]``
(``WIRE``: ``int8``/``int4``/``int2``, ``+packed`` for packed indices),
the mean step of an H-block (``predict.local_steps_times``), its compute
utilisation and its bytes per parameter per step::

  python benchmarks/convergence.py regimes --costs COSTS.json \\
      --workers 8 16 --links 0.1 1 10 --local 0.01:30 0.01:30:int2+packed

Every time it prints is a prediction (costs named in the JSON), not a
measurement.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import warnings

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "benchmarks" / "tools"))


def _setting(text: str):
  """"0.01:30:int2+packed" -> (0.01, 30, "int2", True)."""
  parts = text.split(":")
  try:
    rho, every = float(parts[0]), int(parts[1])
  except (ValueError, IndexError):
    raise argparse.ArgumentTypeError(
        f"{text!r}: give RHO:H[:WIRE], e.g. 0.01:30 or 0.01:30:int2+packed"
    ) from None
  wire = parts[2].split("+") if len(parts) > 2 else []
  packed = "packed" in wire
  wire = [w for w in wire if w != "packed"]
  if not 0 < rho <= 1 or every < 1 or wire not in ([], ["int8"], ["int4"],
                                                  ["int2"]):
    raise argparse.ArgumentTypeError(
        f"{text!r}: RHO in (0, 1], H >= 1, WIRE one of int8, int4, int2 "
        "(with +packed)")
  return rho, every, (wire or ["gradient"])[0], packed


def table(args) -> list[dict]:
  import jax  # pylint: disable=g-import-not-at-top
  import jaxfuse  # pylint: disable=g-import-not-at-top
  from jaxfuse.planning import predict  # pylint: disable=g-import-not-at-top
  from jaxfuse.planning.costs import Costs  # pylint: disable=g-import-not-at-top
  import predict_time  # pylint: disable=g-import-not-at-top
  costs = Costs.load(args.costs)
  latency = predict_time.profiled_latency(costs)
  params, loss_fn = predict_time._params_and_loss(args.preset, args.seq_len)  # pylint: disable=protected-access
  batch = jax.ShapeDtypeStruct((args.rows, args.seq_len + 1), np.int32)
  order = jaxfuse.planning.ordering.FromLoss(loss_fn, (batch,))
  size = sum(x.size for x in jax.tree.leaves(params))
  plan = lambda k, rho, wire="gradient", packed=False: jaxfuse.plan(
      params, density=rho, strategy="size", bucket_bytes=64 * 2**20,
      order=order, num_workers=k, settings=jaxfuse.Settings(
          sparse_wire=wire), **({"collective": jaxfuse.collectives.AllGather(
              packed_indices=True)} if packed else {}))
  rows = []
  for k in args.workers:
    recipe = plan(k, 0.05)
    dense = jaxfuse.with_density(recipe, 1.0)
    local = {s: plan(k, s[0], s[2], s[3]) for s in args.local}
    for gbit in args.links:
      link = costs.on_link(gbit / 8, latency)
      one = lambda p, eta: predict.phase_step_times(
          (jaxfuse.Phase(0, None, p),), link.replace(overlap=eta), k)[0]
      row = {"workers": k, "gbit_s": gbit, "dense_s": one(dense, costs.overlap),
             "recipe_s": one(recipe, args.early_overlap),
             "recipe_bytes_per_param": recipe.bytes_per_worker() / size,
             "local": []}
      for s, p in local.items():
        inner, _ = predict.local_steps_times(p, link, k)
        mean = predict.predicted_wall_time(
            (jaxfuse.Phase(0, None, p),), link, k, s[1], every=s[1])[-1] / s[1]
        row["local"].append({
            "density": s[0], "every": s[1], "wire": s[2], "packed": s[3],
            "step_s": mean, "utilisation": inner / mean,
            "bytes_per_param_per_step": p.bytes_per_worker() / size / s[1]})
      rows.append(row)
  return rows


def _print(rows) -> None:
  for r in rows:
    print(f"K={r['workers']:3d} {r['gbit_s']:6g} Gbit/s  dense "
          f"{1e3 * r['dense_s']:9.1f} ms  per-step recipe "
          f"{1e3 * r['recipe_s']:9.1f} ms ({r['recipe_bytes_per_param']:.3f}"
          " B/param)")
    for l in r["local"]:
      wire = l["wire"] + ("+packed" if l["packed"] else "")
      print(f"    local ρ {l['density']:g} H {l['every']:4d} {wire:15s} "
            f"{1e3 * l['step_s']:9.1f} ms  utilisation "
            f"{l['utilisation']:.2f}  {l['bytes_per_param_per_step']:.5f} "
            "B/param/step")


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawTextHelpFormatter,
                              epilog=__doc__.split("\n\n", 1)[1])
  p.add_argument("--costs", required=True, help="costs JSON (jaxfuse "
                 "profile) of the model")
  p.add_argument("--preset", default="gpt2-small")
  p.add_argument("--seq-len", type=int, default=1024)
  p.add_argument("--rows", type=int, default=8,
                 help="one worker's batch rows (the costs' compute)")
  p.add_argument("--workers", type=int, nargs="+", default=[8, 16])
  p.add_argument("--links", type=float, nargs="+", default=[0.1, 1, 10, 25],
                 help="links in Gbit/s")
  p.add_argument("--early-overlap", type=float, default=0.77,
                 help="η of the per-step recipe under send_early")
  p.add_argument("--local", type=_setting, nargs="*",
                 default=[_setting("0.01:30"), _setting("0.01:30:int2+packed")],
                 help="local-steps settings RHO:H[:WIRE]")
  p.add_argument("--out", help="JSON to write")
  args = p.parse_args(argv)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    rows = table(args)
  _print(rows)
  if args.out:
    pathlib.Path(args.out).write_text(json.dumps(
        {"meta": {"costs": args.costs, "preset": args.preset,
                  "rows": args.rows, "early_overlap": args.early_overlap,
                  "predicted": True}, "rows": rows}, indent=1))
  return 0
