"""``size`` plans with a small last bucket, for ``overlap_gpu.sh MODE=plans``.

Under ``jaxfuse.send_early`` the last sparse bucket (in backward-ready
order) is the one whose all-gather no backward can hide: its gradients are
complete only when the backward ends. With gpt2-small's ``size`` 64 MiB
plan that bucket holds the first two blocks and the embeddings (12.8 M
parameters). This writes the ``size`` plan with that last group cut in
two, the final part holding at most ``--tail-m`` million parameters (whole
leaves, from the end of the ready order), at each density, prints the
sparse buckets' sizes and, with ``--costs``, each plan's simulated step
next to the ``size`` plan's::

  python benchmarks/tail_plans.py --densities 0.05 0.01 --tail-m 4 \\
      --costs benchmarks/results/planner_early_2xH200_socket_2026-11-28/costs_early.json \\
      --overlap 0.84 --out-dir plans
  P=plans; MODE=plans DENSITIES=0.05 PLANS="$P/tail4M_rho0.05.json" \\
      bash benchmarks/overlap_gpu.sh
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

import jax  # pylint: disable=wrong-import-position
import jax.numpy as jnp  # pylint: disable=wrong-import-position
import numpy as np  # pylint: disable=wrong-import-position

import jaxfuse  # pylint: disable=wrong-import-position
from jaxfuse import plans as plan_lib  # pylint: disable=wrong-import-position
from jaxfuse.planning import costs as costs_lib  # pylint: disable=wrong-import-position
from jaxfuse.planning import optimal  # pylint: disable=wrong-import-position
from jaxfuse.planning import simulate  # pylint: disable=wrong-import-position
from lm_model import build_model  # pylint: disable=wrong-import-position
from lm_model import make_loss  # pylint: disable=wrong-import-position


def split_tail(plan: plan_lib.Plan, tail: int) -> plan_lib.Plan:
  """``plan`` with its last group (a contiguous run of the ready order: its
  sparse and dense bucket) cut so that the final part holds at most
  ``tail`` elements (whole leaves; at least one)."""
  if plan.provenance.get("strategy") != "size":
    raise ValueError("split_tail takes a `size` plan (its groups are "
                     "rebuilt as allgather/psum buckets), got strategy "
                     f"{plan.provenance.get('strategy')!r}")
  order = plan.provenance["backward_order"]
  position = {leaf: i for i, leaf in enumerate(order)}
  spans = sorted((min(position[i] for i in b.leaves),
                  max(position[i] for i in b.leaves)) for b in plan.buckets)
  runs = []                     # overlapping spans: one group's buckets
  for first, last in spans:
    if runs and first <= runs[-1][1]:
      runs[-1][1] = max(runs[-1][1], last)
    else:
      runs.append([first, last])
  groups = [order[a:b + 1] for a, b in runs]
  if len(groups[-1]) < 2:
    raise ValueError("the last group is one leaf: nothing to cut")
  last, held, cut = groups[-1], 0, len(groups[-1]) - 1
  for j in range(len(last) - 1, 0, -1):
    if held + plan.leaves[last[j]].size > tail:
      break
    held += plan.leaves[last[j]].size
    cut = j
  return optimal.plan_from_groups(
      plan, groups[:-1] + [last[:cut], last[cut:]], strategy="size",
      provenance={"tail_elements": int(tail)})


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--densities", type=float, nargs="+", default=[0.05, 0.01])
  p.add_argument("--tail-m", type=float, default=4.0,
                 help="most parameters (millions) of the last bucket")
  p.add_argument("--bucket-mb", type=float, default=64)
  p.add_argument("--costs", help="a costs file to simulate the plans with")
  p.add_argument("--overlap", type=float,
                 help="simulate at this overlap share η instead of the "
                 "costs' (e.g. what a send_early step measured)")
  p.add_argument("--out-dir", required=True)
  args = p.parse_args(argv)
  model = build_model("gpt2-small", None, "float32")
  seq = model.cfg.seq_len
  params = jax.eval_shape(lambda: model.init(
      jax.random.PRNGKey(0), jnp.zeros((1, seq), jnp.int32))["params"])
  tokens = np.zeros((1, seq + 1), np.int32)
  costs = costs_lib.Costs.load(args.costs) if args.costs else None
  if costs is not None and args.overlap is not None:
    costs = costs.replace(overlap=args.overlap)
  out = pathlib.Path(args.out_dir)
  out.mkdir(parents=True, exist_ok=True)
  rows = []
  for d in args.densities:
    size = jaxfuse.plan(params, density=d, strategy="size", seed=0,
                        bucket_bytes=int(args.bucket_mb * 2**20),
                        loss_fn=make_loss(model), example_args=(tokens,))
    tail = split_tail(size, int(args.tail_m * 1e6))
    name = f"tail{args.tail_m:g}M_rho{d:g}.json"
    tail.save(out / name)
    for label, plan in (("size", size), (name, tail)):
      sparse = [sum(plan.leaves[i].size for i in b.leaves)
                for b in plan.buckets if b.collective != "psum"]
      row = {"density": d, "plan": label, "sparse_buckets": sparse}
      if costs is not None:
        row["simulated_s"] = simulate.simulate(plan, costs).iteration
      rows.append(row)
      print(f"rho {d:<5g} {label:22s} sparse buckets (M) "
            f"{[round(s / 1e6, 1) for s in sparse]}" +
            (f"  simulated {1e3 * row['simulated_s']:.1f} ms"
             if costs is not None else ""))
  (out / "tail_plans.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
  main()
