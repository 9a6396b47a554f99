"""Which kernels run slower beside NCCL's: a K-GPU step against one GPU.

Reads two ``jax.profiler`` traces of the same model's step (``overlap.py
--trace-dir`` writes both: the one-GPU step T₁ and a K-GPU variant). Each
compute kernel's name is reduced to its family (XLA's fusion numbers
dropped: ``loop_add_fusion_23`` → ``loop_add_fusion``; cuBLAS's names kept:
they give the layout, the tile and whether K is split into segments,
``segment_k_on``). Per family and per step, averaged over the
traced steps:

  n₁, t₁              calls and mean time per call on one GPU
  n_apart, t_apart    the same on K GPUs, kernels apart from the link
  n_beside, t_beside  kernels that ran mostly beside an NCCL kernel
                      (``trace.compute_kernels``)
  lost = n_beside · (t_beside − t₁)    time the calls beside NCCL lose

The two programs are compiled apart: XLA may pick another cuBLAS kernel
for a product, or fuse differently, so ``lost`` is given only for a
family with as many calls in both (n₁ = n_apart + n_beside); a family's
mean over other calls is not comparable. Prints the families that lose
most and the compute time per step of both traces; writes JSON
(--out)::

  python benchmarks/kernels.py kernel-slowdown \\
      benchmarks/results/overlap_2026-11-30/run37_trace_default_one_gpu.json.xz \\
      benchmarks/results/overlap_2026-11-30/run37_trace_early_tail4M.json.xz
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

# pylint: disable=wrong-import-position
from jaxfuse.planning import trace as trace_lib

_FIELDS = ("n_apart", "s_apart", "n_beside", "s_beside")
_NUMBERED = re.compile(r"([._]\d+)+$")
_CUBLAS = re.compile(r"sm\d+_xmma_gemm_(\w+?)_(nn|nt|tn|tt)_n_tilesize"
                     r"(\d+x\d+x\d+)_.*segment_k_(on|off)")


def family(name: str) -> str:
  """A kernel's name without XLA's instruction numbers."""
  return _NUMBERED.sub("", name)


def short(name: str) -> str:
  """A cuBLAS kernel's name cut to what tells products apart: layout,
  tile, element types and whether K is split into segments."""
  m = _CUBLAS.match(name)
  if not m:
    return name
  types, layout, tile, split = m.groups()
  return f"cuBLAS {layout} {tile} {types} segment_k_{split}"


def per_family(steps) -> dict[str, dict[str, float]]:
  """Per family: calls and seconds per step, apart from and beside the
  link (``n_apart``, ``s_apart``, ``n_beside``, ``s_beside``)."""
  out: dict[str, dict[str, float]] = {}
  for step in steps:
    for name, seconds, beside in trace_lib.compute_kernels(step):
      where = "beside" if beside else "apart"
      row = out.setdefault(family(name), dict.fromkeys(_FIELDS, 0.0))
      row[f"n_{where}"] += 1 / len(steps)
      row[f"s_{where}"] += seconds / len(steps)
  return out


def _mean(total, calls):
  return total / calls if calls else None


def slowdown(one_gpu_steps, k_gpu_steps) -> list[dict]:
  """One row per family of either trace (formulas in the module
  docstring), the largest ``lost`` first; ``lost`` is None where the
  family has no call beside the link or not as many calls in both."""
  one, many = per_family(one_gpu_steps), per_family(k_gpu_steps)
  rows = []
  for name in sorted(set(one) | set(many)):
    a = one.get(name, dict.fromkeys(_FIELDS, 0.0))
    b = many.get(name, dict.fromkeys(_FIELDS, 0.0))
    n1 = a["n_apart"] + a["n_beside"]     # one GPU: no link, all apart
    t1 = _mean(a["s_apart"] + a["s_beside"], n1)
    t_beside = _mean(b["s_beside"], b["n_beside"])
    same_calls = abs(n1 - b["n_apart"] - b["n_beside"]) < 0.05
    rows.append({
        "family": name, "n1": n1, "t1": t1,
        "n_apart": b["n_apart"], "t_apart": _mean(b["s_apart"], b["n_apart"]),
        "n_beside": b["n_beside"], "t_beside": t_beside,
        "lost": (b["n_beside"] * (t_beside - t1) if same_calls
                 and t1 is not None and t_beside is not None else None)})
  rows.sort(key=lambda r: -(r["lost"] or 0.0))
  return rows


def _cell(n, t):
  return f"{n:6.1f} {'-':>7s}" if t is None else f"{n:6.1f} {1e6 * t:7.1f}"


def table(rows, top: int) -> str:
  head = (f"{'family':60s} {'one GPU':>14s} {'apart':>14s} {'beside':>14s}"
          f" {'lost':>8s}\n{'':60s}" + "   calls    µs" * 3 + "       ms")
  lines = [head]
  for r in rows[:top]:
    lost = "-" if r["lost"] is None else f"{1e3 * r['lost']:.2f}"
    lines.append(f"{short(r['family'])[:60]:60s} {_cell(r['n1'], r['t1'])} "
                 f"{_cell(r['n_apart'], r['t_apart'])} "
                 f"{_cell(r['n_beside'], r['t_beside'])} {lost:>8s}")
  return "\n".join(lines)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("one_gpu", help="the one-GPU step's trace (file or dir)")
  p.add_argument("k_gpu", help="the K-GPU step's trace (file or dir)")
  p.add_argument("--top", type=int, default=12,
                 help="families printed (default 12)")
  p.add_argument("--out", help="JSON of every family")
  args = p.parse_args(argv)
  try:
    one, many = (trace_lib.read_trace(f) for f in (args.one_gpu, args.k_gpu))
  except trace_lib.TraceError as e:
    sys.exit(str(e))
  rows = slowdown(one.steps, many.steps)
  print(table(rows, args.top))
  busy = [t.total("compute_busy") / len(t.steps) for t in (one, many)]
  lost = sum(r["lost"] for r in rows if r["lost"] is not None)
  print(f"compute busy per step: one GPU {1e3 * busy[0]:.2f} ms, K GPUs "
        f"{1e3 * busy[1]:.2f} ms; lost beside NCCL, summed over the families "
        f"with as many calls in both {1e3 * lost:.2f} ms")
  if args.out:
    pathlib.Path(args.out).write_text(json.dumps(
        {"one_gpu": one.path, "k_gpu": many.path, "compute_busy_s": busy,
         "families": rows}, indent=1))

