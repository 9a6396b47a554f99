"""Elastic restart on the example LM: train on K workers, resume on K'.

Each case trains ``--steps`` steps straight on K simulated CPU devices,
saving at ``--steps // 2``, and resumes that checkpoint on K' devices
(``examples/train_lm.py --resume --cpu-devices K'``: the per-worker state
redistributed by ``jaxfuse.elastic``). The global batch, the data and its
order are the same, so the resumed run should follow the straight one; a
lost residual or a bad merge would show as a loss spike right after the
restart. Prints the losses around the restart and the final validation
loss, and writes JSON:

  python benchmarks/convergence.py elastic --steps 300 --out benchmarks/results/elastic.json
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[2]


def train(args, devices: int, ckpt: pathlib.Path, *extra) -> dict:
  out = ckpt.with_name(ckpt.name + ".json")
  cmd = [sys.executable, str(ROOT / "examples" / "train_lm.py"),
         "--cpu-devices", str(devices), "--steps", str(args.steps),
         "--optimizer", args.optimizer, "--density", str(args.density),
         "--eval-batches", "8", "--log-every", "50", "--checkpoint-dir",
         str(ckpt), "--json-out", str(out), *extra]
  env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)
  env.pop("JAX_NUM_CPU_DEVICES", None)
  subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
  return json.loads(out.read_text())


def window(losses, start, width):
  part = losses[start:start + width]
  return sum(part) / len(part)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--steps", type=int, default=300)
  p.add_argument("--optimizer", default="onebit_adamw")
  p.add_argument("--density", type=float, default=0.05)
  p.add_argument("--cases", default="8:4,8:2,4:8",
                 help="K:K' pairs, comma-separated")
  p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" /
                                      "elastic.json"))
  args = p.parse_args(argv)
  half = args.steps // 2
  rows, straight = [], {}
  with tempfile.TemporaryDirectory() as tmp:
    for case in args.cases.split(","):
      k, k_new = (int(x) for x in case.split(":"))
      ck = pathlib.Path(tmp) / f"ck{k}"
      if k not in straight:
        straight[k] = train(args, k, ck, "--checkpoint-every", str(half))
      work = pathlib.Path(tmp) / f"ck{k}_{k_new}"
      shutil.copytree(ck, work)
      shutil.rmtree(work / str(args.steps))   # resume from the half-way save
      resumed = train(args, k_new, work, "--resume")
      a, b = straight[k]["losses"], resumed["losses"]
      assert resumed["start_step"] == half, resumed["start_step"]
      rows.append({
          "from": k, "to": k_new, "restart_step": half,
          "straight_next10": window(a, half, 10),
          "resumed_next10": window(b, 0, 10),
          "straight_before10": window(a, half - 10, 10),
          "max_jump": max(y - x for x, y in zip(a[half:half + 10], b[:10])),
          "straight_val": straight[k]["final_val_loss"],
          "resumed_val": resumed["final_val_loss"],
          "resumed_losses": b, "straight_losses": a[half:]})
  print(f"{'K→K′':>6} {'loss 10 before':>15} {'10 after: straight':>19} "
        f"{'resumed':>8} {'max jump':>9} {'final val straight':>19} "
        f"{'resumed':>8}")
  for r in rows:
    print(f"{r['from']:>3}→{r['to']:<2} {r['straight_before10']:15.4f} "
          f"{r['straight_next10']:19.4f} {r['resumed_next10']:8.4f} "
          f"{r['max_jump']:9.4f} {r['straight_val']:19.4f} "
          f"{r['resumed_val']:8.4f}")
  pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
  pathlib.Path(args.out).write_text(json.dumps(
      {"config": vars(args), "rows": rows}, indent=1))

