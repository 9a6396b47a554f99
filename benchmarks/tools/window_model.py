"""``send_early`` timeline models, against measured steps.

``jaxfuse.planning.simulate`` calibrates how much communication hides with
one number, η. Under ``jaxfuse.send_early(step, window=w)`` the mechanism
is known instead: the link runs the buckets in plan order as soon as each
is compressed (ideal WFBP), and at the fence of the first bucket of each
point p of the backward the compute stream waits until every collective
of the points ≤ p − w has ended. With t the compute stream's clock::

  t += backward up to bucket i's last leaf (+ its compression)
  comm_i = [max(t, end_{i−1}), that + d_i)
  if i opens point p:  t = max(t, max{end_j : point_j ≤ p − w})
  step = max(t + the rest of the backward, end_last)

Points come from ``send_early``'s rule (``overlap.points_of_work``) with
backward time standing in for matrix-product work. This prints, per plan
of a ``benchmarks/planner.py measure`` result, the measured step, this
model::

  python benchmarks/planner.py window-model \\
      --costs benchmarks/results/planner_early_4xH200_socket_2026-11-28/costs_early.json \\
      --measure benchmarks/results/planner_early_4xH200_socket_2026-11-28/measure_early.json

and the simulator itself (``jaxfuse.planning.simulate``: XLA keeps a share
η of what the ideal WFBP schedule hides, H)::

  step = (1 − η)·T_none + η·T_ideal = compute + G − η·H

against the cap model the simulator had before, which let the link be busy
for at most η·G before the compute ends whatever the plan (so plans that
could all hide more than that tie)::

  step = max(T_ideal, compute + (1 − η)·G)

The cap model's η is the one the measure run used, (T₁ + G − T_K) / G on
its ``size`` plan; the share model's is fitted per density on the same
step, (T₁ + G − T_K) / H. "share, T₁" also takes the compute from T₁
instead of the profile. A plan that the planner now builds differently
from the one measured (a cost strategy) is skipped.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

import jax  # pylint: disable=wrong-import-position

jax.config.update("jax_platforms", "cpu")

import jaxfuse  # pylint: disable=wrong-import-position
from jaxfuse import collectives  # pylint: disable=wrong-import-position
from jaxfuse.optim import overlap  # pylint: disable=wrong-import-position
from jaxfuse.sync import bucket_steps  # pylint: disable=wrong-import-position
from jaxfuse.planning import costs as costs_lib  # pylint: disable=wrong-import-position
from jaxfuse.planning import ordering  # pylint: disable=wrong-import-position
from jaxfuse.planning import simulate  # pylint: disable=wrong-import-position
import lm_model  # pylint: disable=wrong-import-position


def window_step(plan, costs, window: int = 1) -> float:
  """The step time under ``send_early(step, window)`` (module doc)."""
  sched = bucket_steps.compile_plan(plan)
  compress = simulate.compression_times(plan, costs, sched=sched)
  order = simulate.backward_order(plan)
  position = {leaf: p for p, leaf in enumerate(order)}
  durations = [costs.steps_time(s, costs.workers)
               for s in collectives.bucket_steps(sched, costs.workers)]
  done = [0.0]
  for leaf in order:
    done.append(done[-1] + costs.backward[leaf])
  last = [max(position[j] for j in b.leaves) for b in sched.buckets]
  ready_order = sorted(range(len(last)), key=lambda i: (last[i], i))
  point = dict(zip(ready_order, overlap.points_of_work(
      [done[last[i] + 1] for i in ready_order],
      kinds=[sched.buckets[i].kind for i in ready_order])))
  t, made, free, end, opened = costs.forward, 0, costs.forward, {}, set()
  for i in ready_order:
    t += done[last[i] + 1] - done[made]
    made = last[i] + 1
    if sched.buckets[i].kind != bucket_steps.PSUM:
      t += compress[i]
    end[i] = free = max(t, free) + durations[i]
    if point[i] not in opened:
      opened.add(point[i])
      held = [end[j] for j in end if point[j] <= point[i] - window]
      t = max([t, *held])
  return max(t + done[-1] - done[made], free)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--costs", required=True)
  p.add_argument("--measure", required=True,
                 help="a benchmarks/planner.py measure JSON")
  p.add_argument("--model", default="gpt2_small")
  p.add_argument("--window", type=int, default=1)
  p.add_argument("--out")
  a = p.parse_args(argv)
  measured = json.loads(pathlib.Path(a.measure).read_text())
  profiled = costs_lib.Costs.load(a.costs)
  loss_fn, params, tokens = getattr(lm_model, a.model)()
  order = ordering.ready_order(loss_fn, params, tokens)
  rows, share = [], {}
  print(f"{'plan':22s} {'measured':>9s} {'cap model':>16s} {'window model':>16s}"
        f" {'share model':>16s} {'share, T₁':>16s}")
  for row in measured["rows"]:
    name = row["plan"]
    strategy = name.split()[0]
    if (strategy not in jaxfuse.STRATEGIES + jaxfuse.COST_STRATEGIES
        or not row.get("measured_s")):
      continue
    density = float(name.split("@")[1]) if "@" in name else (
        measured["meta"]["args"]["densities"][0])
    costs = profiled.replace(overlap=row["predicted_eta"])
    options = dict(bucket_bytes=int(name.split()[1]) * 2**20) if (
        strategy == "size") else {}
    plan = jaxfuse.plan(params, density=density, strategy=strategy,
                        costs=costs, **options,
                        order=order)
    if len(plan.buckets) != row["buckets"]:
      print(f"{name:22s} skipped: planned now with {len(plan.buckets)} "
            f"buckets, measured with {row['buckets']}")
      continue
    got = row["measured_s"]
    ideal = simulate.simulate(plan, costs.replace(overlap=1.0))
    cap = max(ideal.iteration,
              ideal.compute_end + (1 - costs.overlap) * ideal.communication)
    win = window_step(plan, costs, a.window)
    if strategy == "size" and row.get("measured_one_worker_s"):
      t1 = row["measured_one_worker_s"]    # fits η for this density
      eta = simulate.eta_from_hidden(t1 + ideal.communication - got, ideal)
      if eta is not None:
        share[density] = (t1, min(1.0, max(0.0, eta)))
    t1, eta = share.get(density, (None, None))
    shared = (None if eta is None else
              simulate.simulate(plan, costs.replace(overlap=eta)).iteration)
    shared_t1 = None if eta is None else simulate.step_at(t1, eta, ideal)
    rows.append(dict(plan=name, measured_s=got, cap_model_s=cap,
                     cap_eta=costs.overlap, window_model_s=win,
                     share_model_s=shared, share_t1_model_s=shared_t1,
                     share_eta=eta))
    fmt = lambda x: (f"{1e3 * x:7.1f}ms ({x / got - 1:+6.1%})" if x
                     else f"{'-':>16s}")
    print(f"{name:22s} {1e3 * got:7.1f}ms {fmt(cap)} {fmt(win)} "
          f"{fmt(shared)} {fmt(shared_t1)}", flush=True)
  if a.out:
    pathlib.Path(a.out).write_text(json.dumps(dict(
        costs=a.costs, measure=a.measure, window=a.window, rows=rows),
                                              indent=1))

