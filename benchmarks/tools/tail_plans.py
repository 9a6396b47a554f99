"""``size`` plans with a small last bucket, for ``gpu.sh overlap`` (MODE=plans).

Under ``jaxfuse.send_early`` the last sparse bucket (in backward-ready
order) is the one whose all-gather no backward can hide: its gradients are
complete only when the backward ends. With gpt2-small's ``size`` 64 MiB
plan that bucket holds the first two blocks and the embeddings (12.8 M
parameters). This writes the ``size`` plan with that last group cut in
two by ``jaxfuse.plan(..., last_bucket_bytes=--last-mib MiB)``, at each
density, prints the sparse buckets' sizes and, with ``--costs``, each
plan's simulated step next to the ``size`` plan's::

  python benchmarks/planner.py tail-plans --densities 0.05 0.01 --last-mib 16 \\
      --costs benchmarks/results/planner_early_2xH200_socket_2026-11-28/costs_early.json \\
      --overlap 0.84 --out-dir plans
  P=plans; MODE=plans DENSITIES=0.05 PLANS="$P/tail16MiB_rho0.05.json" \\
      bash benchmarks/gpu.sh overlap
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
import jax.numpy as jnp  # pylint: disable=wrong-import-position
import numpy as np  # pylint: disable=wrong-import-position

import jaxfuse  # pylint: disable=wrong-import-position
from jaxfuse.planning import costs as costs_lib  # pylint: disable=wrong-import-position
from jaxfuse.planning import simulate  # pylint: disable=wrong-import-position
from lm_model import build_model  # pylint: disable=wrong-import-position
from lm_model import make_loss  # pylint: disable=wrong-import-position


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--densities", type=float, nargs="+", default=[0.05, 0.01])
  p.add_argument("--last-mib", type=float, default=16.0,
                 help="most dense MiB of the last group's final part")
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
    kw = dict(density=d, strategy="size", settings=jaxfuse.Settings(seed=0),
              bucket_bytes=int(args.bucket_mb * 2**20),
              order=jaxfuse.planning.ordering.FromLoss(make_loss(model),
                                                       (tokens,)))
    size = jaxfuse.plan(params, **kw)
    tail = jaxfuse.plan(params, last_bucket_bytes=int(args.last_mib * 2**20),
                        **kw)
    name = f"tail{args.last_mib:g}MiB_rho{d:g}.json"
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

