"""Throughput of examples/train_lm.py: dense vs jaxfuse, per NCCL transport.

Each (transport, sync) pair runs in its own process, since NCCL reads its
environment once. Prints a table and writes JSON::

  python benchmarks/overhead.py lm-throughput --preset gpt2-small --steps 40 \
      --transports nvlink socket --syncs dense jaxfuse --out lm.json

Transports: ``nvlink`` (NCCL's defaults) and ``socket`` (NCCL over TCP on
loopback: P2P, SHM and IB off, ≈ a 30 Gbps commodity network).
NVLink multicast stays off (NCCL_NVLS_ENABLE=0) everywhere.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[2]
TRANSPORTS = {
    "nvlink": {},
    "socket": {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1",
               "NCCL_IB_DISABLE": "1", "NCCL_NET": "Socket",
               "NCCL_SOCKET_IFNAME": "lo"},
}


def transport_env(transport: str) -> dict:
  """This process's environment for a child on ``transport``, with the
  repository first on PYTHONPATH and NVLink multicast off."""
  env = dict(os.environ, NCCL_NVLS_ENABLE="0", PYTHONUNBUFFERED="1",
             **TRANSPORTS[transport])
  env["PYTHONPATH"] = os.pathsep.join(
      [str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
  return env


def run_one(transport: str, sync: str, args, extra) -> dict:
  env = transport_env(transport)
  with tempfile.TemporaryDirectory() as tmp:
    out = pathlib.Path(tmp) / "run.json"
    cmd = [sys.executable, str(ROOT / "examples" / "train_lm.py"),
           "--sync", sync, "--preset", args.preset, "--steps", str(args.steps),
           "--density", str(args.density), "--json-out", str(out), *extra]
    print(f"== {transport} / {sync}: {' '.join(cmd[1:])}", flush=True)
    proc = subprocess.run(cmd, env=env, check=False)
    if proc.returncode != 0 or not out.exists():
      return {"transport": transport, "sync": sync, "error": proc.returncode}
    result = json.loads(out.read_text())
  return {"transport": transport, "sync": sync, **result}


def main(argv=None) -> list[dict]:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--preset", default="tiny")
  p.add_argument("--steps", type=int, default=40)
  p.add_argument("--density", type=float, default=0.01)
  p.add_argument("--transports", nargs="+", default=["nvlink", "socket"],
                 choices=sorted(TRANSPORTS))
  p.add_argument("--syncs", nargs="+", default=["dense", "jaxfuse"])
  p.add_argument("--out", default="lm_throughput.json")
  args, extra = p.parse_known_args(argv)
  rows = [run_one(t, s, args, extra) for t in args.transports
          for s in args.syncs]
  # Throughput is the last phase's (the recipe's steady state: onebit_adamw
  # trains its first steps dense), the median of its steps.
  print(f"\n{'transport':10} {'sync':8} {'step ms':>9} {'tokens/s':>11} "
        f"{'vs dense':>9} {'final loss':>10}")
  for r in rows:
    if "error" in r:
      print(f"{r['transport']:10} {r['sync']:8} failed (exit {r['error']})")
      continue
    tokens = r["config"]["batch_size"] * r["config"]["seq_len"]
    r["steady_tokens_per_s"] = tokens / r["steady_step_time_s"]
    dense = next((d for d in rows if d["transport"] == r["transport"] and
                  d["sync"] == "dense" and "error" not in d), None)
    speedup = (dense["steady_step_time_s"] / r["steady_step_time_s"]
               if dense else float("nan"))
    r["vs_dense"] = speedup
    print(f"{r['transport']:10} {r['sync']:8} "
          f"{1e3 * r['steady_step_time_s']:9.1f} "
          f"{r['steady_tokens_per_s']:11.0f} {speedup:9.2f} "
          f"{r.get('final_train_loss', float('nan')):10.3f}")
  pathlib.Path(args.out).write_text(json.dumps(rows, indent=1))
  return rows

