"""Time the Pallas selection kernel against the XLA paths.

For each n × density: acc ~ N(0, 1) (float32 unless --dtype), τ the
(1 − density) quantile of |acc|, capacity = ⌈1.5 · density · n⌉, offset n/3.

  pallas   jaxfuse.kernels.selection.select_pallas (both passes)
  count    its pass 1 and glue only (the count output alone: XLA drops pass 2)
  ref      jaxfuse.kernels.reference.select (cumsum + scatter in XLA)
  nonzero  |acc| ≥ τ then jnp.nonzero(size=capacity) and a gather (a
           plain-XLA compaction)
  top_k    jax.lax.top_k(|acc|, capacity)
  read     jnp.sum(jnp.abs(acc)): one plain read of acc, the bandwidth floor
  kth      jaxfuse.kernels.threshold.kth_largest_magnitude, k = ⌈ρ·n⌉ (exact
           k-th largest |acc|: a two-sided sample bracket, the band kernel, a
           sort of the band)
  kth_ref  its reference, lax.top_k(|acc|, k)[0][k − 1] (not in the default
           --methods; add kth,kth_ref to time them)

Each is jitted, warmed up, then timed ``--repeats`` times with
block_until_ready; the median is reported. ``pallas`` is also checked equal
to ``ref`` (values, indices, count). ``--sweep`` adds block × tile × num_warps
at the largest n and ``--sweep-density``.
``--batch B`` times the k-th magnitude under ``vmap`` over B rows of each
size instead (the ``"topk"`` estimator's same-shape units). Times are
reported both as the median single call (Python dispatch included) and as
the mean of back-to-back calls (close to device time); the ratios use the
latter.

  python benchmarks/kernels.py --out results.json
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks" / "tools"))
import dispatch  # pylint: disable=wrong-import-position

# Folded scripts, run as `python benchmarks/kernels.py NAME ARGS`
# (benchmarks/tools/NAME.py; the old script's flags).
SUBCOMMANDS = {
    "kernel-slowdown": ("which kernels run slower beside NCCL's: a K-GPU step "
                        "against one GPU"),
    "kernel-sources": "which source lines a compiled step's kernels come from",
}

import jax  # pylint: disable=wrong-import-position
import jax.numpy as jnp  # pylint: disable=wrong-import-position
import numpy as np  # pylint: disable=wrong-import-position

from jaxfuse.kernels import reference  # pylint: disable=wrong-import-position
from jaxfuse.plans import capacity_for, target_count  # pylint: disable=wrong-import-position
from jaxfuse.kernels.selection import select_pallas  # pylint: disable=wrong-import-position
from jaxfuse.kernels.threshold import kth_largest_magnitude  # pylint: disable=wrong-import-position
from jaxfuse.kernels.threshold import kth_largest_magnitude_reference  # pylint: disable=wrong-import-position


# (block, tile, stage, num_warps); None: select_pallas's default. The GPU
# test (tests/test_kernels_select.py, GPU_CONFIGS) checks each of these.
SWEEP = ((None, None, None, None), (4096, 4096, None, None),
         (8192, 1024, None, None), (8192, 8192, None, 8),
         (8192, 2048, 1024, None), (16384, 2048, None, 8),
         (16384, 4096, None, None), (32768, 4096, None, 8),
         (8192, 512, None, None), (4096, 1024, None, 8),
         (8192, 8192, None, 16), (16384, 16384, None, 16),
         (8192, 8192, 256, 8), (8192, 8192, 1024, 8))


def _time(fn, args, repeats):
  """(median of single calls, mean over back-to-back batches) in seconds.

  A single call includes Python dispatch; a batch of ``repeats`` calls with
  one block_until_ready at the end overlaps dispatch with the GPU, so its
  mean is close to device time.
  """
  out = jax.block_until_ready(fn(*args))        # compile + warm-up
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  batches = []
  for _ in range(3):
    t0 = time.perf_counter()
    for _ in range(repeats):
      res = fn(*args)
    jax.block_until_ready(res)
    batches.append((time.perf_counter() - t0) / repeats)
  return statistics.median(times), min(batches), out


def _nonzero_select(acc, tau, capacity):
  n = acc.shape[0]
  idx = jnp.nonzero(jnp.abs(acc) >= tau, size=capacity, fill_value=n)[0]
  return acc.at[idx].get(mode="fill", fill_value=0), idx


def _same(a, b):
  return all(np.array_equal(np.asarray(x).reshape(-1).view(np.uint8),
                            np.asarray(y).reshape(-1).view(np.uint8)) for x, y in zip(a, b))


def bench_one(case, methods, repeats, interpret=False, expect=None, **kw):
  """Times of ``methods`` on ``case`` = (acc, tau, capacity, offset), and
  whether the Pallas selection matches ``expect`` (or the reference's)."""
  acc, tau, capacity, offset = case
  k = max(1, round(capacity / 1.5))
  fns = {
      "kth": jax.jit(lambda a, t, o: kth_largest_magnitude(
          a, k, interpret=interpret)),
      "kth_ref": jax.jit(lambda a, t, o: kth_largest_magnitude_reference(
          a, k)),
      "pallas": jax.jit(lambda a, t, o: select_pallas(
          a, t, capacity, o, interpret=interpret, **kw)),
      "count": jax.jit(lambda a, t, o: select_pallas(
          a, t, capacity, o, interpret=interpret, **kw)[2]),
      "ref": jax.jit(lambda a, t, o: reference.select(a, t, capacity, o)),
      "nonzero": jax.jit(lambda a, t, o: _nonzero_select(a, t, capacity)),
      "top_k": jax.jit(lambda a, t, o: jax.lax.top_k(jnp.abs(a), capacity)),
      "read": jax.jit(lambda a, t, o: jnp.sum(jnp.abs(a))),
  }
  row, outs = {}, {}
  for name in methods:
    try:
      single, batched, outs[name] = _time(fns[name], (acc, tau, offset),
                                          repeats)
      row[name + "_ms"] = single * 1e3
      row[name + "_batched_ms"] = batched * 1e3
    except Exception as e:  # pylint: disable=broad-except
      row[name + "_ms"] = None
      row[name + "_error"] = f"{type(e).__name__}: {str(e)[:300]}"
  expect = outs.get("ref", expect)
  if "kth" in outs and "kth_ref" in outs:
    row["kth_match"] = _same([outs["kth"]], [outs["kth_ref"]])
  if "pallas" in outs and expect is not None:
    row["match"] = _same(outs["pallas"], expect)
    row["count"] = int(expect[2])
  return row


def bench_batched(sizes, densities, batch, repeats, interpret):
  """kth against its reference, both under vmap over ``batch`` rows."""
  rows = []
  print(f"{'batch':>5} {'n':>11} {'dens':>6} | kth ms  kth_ref ms  ratio | "
        "match")
  for n in sizes:
    acc = jax.random.normal(jax.random.PRNGKey(n), (batch, n), jnp.float32)
    for d in densities:
      k = target_count(d, n)
      fast = jax.jit(jax.vmap(lambda a: kth_largest_magnitude(
          a, k, interpret=interpret)))
      ref = jax.jit(jax.vmap(lambda a: kth_largest_magnitude_reference(a, k)))
      _, t_fast, out_fast = _time(fast, (acc,), repeats)
      _, t_ref, out_ref = _time(ref, (acc,), repeats)
      row = {"batch": batch, "n": n, "density": d, "k": k,
             "kth_batched_ms": t_fast * 1e3, "kth_ref_batched_ms": t_ref * 1e3,
             "match": _same([out_fast], [out_ref])}
      rows.append(row)
      print(f"{batch:>5} {n:>11} {d:>6} | {t_fast * 1e3:6.3f} "
            f"{t_ref * 1e3:11.3f} {t_ref / t_fast:6.2f} | {row['match']}",
            flush=True)
    del acc
  return rows


def main(argv=None):
  p = argparse.ArgumentParser(
      description=__doc__, epilog=dispatch.epilog(SUBCOMMANDS),
      formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--sizes", default="1000000,16000000,100000000")
  p.add_argument("--densities", default="0.001,0.01,0.05")
  p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  p.add_argument("--methods", default="pallas,count,ref,nonzero,top_k,read")
  p.add_argument("--repeats", type=int, default=15)
  p.add_argument("--block", type=int, default=None)
  p.add_argument("--tile", type=int, default=None)
  p.add_argument("--stage", type=int, default=None)
  p.add_argument("--num-warps", type=int, default=None)
  p.add_argument("--sweep", action="store_true",
                 help="configuration sweep (SWEEP) at the largest n")
  p.add_argument("--sweep-density", type=float, default=0.01)
  p.add_argument("--sweep-configs", default=None,
                 help="comma list of SWEEP entries to run (default all)")
  p.add_argument("--batch", type=int, default=None,
                 help="time kth under vmap over this many rows instead")
  p.add_argument("--interpret", action="store_true",
                 help="Pallas interpreter (to try the script on CPU)")
  p.add_argument("--out", default=None, help="JSON file to write")
  args = p.parse_args(argv)

  sizes = [int(float(s)) for s in args.sizes.split(",")]
  densities = [float(d) for d in args.densities.split(",")]
  methods = args.methods.split(",")
  dtype = jnp.dtype(args.dtype)
  dev = jax.devices()[0]
  meta = {"jax": jax.__version__, "backend": jax.default_backend(),
          "device": getattr(dev, "device_kind", str(dev)), "dtype": args.dtype,
          "repeats": args.repeats, "block": args.block, "tile": args.tile,
          "stage": args.stage,
          "num_warps": args.num_warps}
  print(json.dumps(meta))
  kw = {"block": args.block, "tile": args.tile, "stage": args.stage,
        "num_warps": args.num_warps}
  if args.batch:
    rows = bench_batched(sizes, densities, args.batch, args.repeats,
                         args.interpret)
    if args.out:
      pathlib.Path(args.out).write_text(json.dumps(
          {"meta": {**meta, "batch": args.batch}, "rows": rows}, indent=1))
    return
  rows, sweep = [], []
  cols = ("pallas", "count", "ref", "nonzero", "top_k", "read")
  hdr = (f"{'n':>11} {'dens':>6} {'cap':>9} {'count':>9} | single-call median "
         f"ms: " + " ".join(f"{c:>7}" for c in cols) + " | batched ms: " +
         " ".join(f"{c:>7}" for c in cols) +
         " | p/read ref/p nz/p topk/p (batched) | match")
  print(hdr)
  for n in sizes:
    acc = jax.random.normal(jax.random.PRNGKey(n), (n,), jnp.float32)
    acc = jax.block_until_ready(acc.astype(dtype))
    mags = jnp.abs(acc.astype(jnp.float32))
    qs = np.asarray(jnp.quantile(mags, jnp.asarray([1 - d for d in densities])))
    del mags
    offset = jnp.int32(n // 3)
    for d, q in zip(densities, qs):
      capacity = capacity_for(d, n, 1.5)
      tau = jnp.float32(q)
      row = {"n": n, "density": d, "capacity": capacity, "tau": float(q)}
      row.update(bench_one((acc, tau, capacity, offset), methods,
                           args.repeats, args.interpret, **kw))
      get = lambda k: row.get(k + "_batched_ms")
      ratio = lambda a, b: (get(a) / get(b)) if get(a) and get(b) else None
      row["pallas_over_read"] = ratio("pallas", "read")
      row["ref_over_pallas"] = ratio("ref", "pallas")
      row["topk_over_pallas"] = ratio("top_k", "pallas")
      row["nonzero_over_pallas"] = ratio("nonzero", "pallas")
      row["read_gbps"] = (n * dtype.itemsize / get("read") / 1e6
                          if get("read") else None)
      rows.append(row)
      f = lambda v, w=7, p=3: (f"{v:>{w}.{p}f}" if isinstance(v, float)
                               else f"{'-':>{w}}")
      print(f"{n:>11} {d:>6} {capacity:>9} {row.get('count', -1):>9} | "
            + " " * 22 + " ".join(f(row.get(c + "_ms")) for c in cols)
            + " | " + " " * 11
            + " ".join(f(row.get(c + "_batched_ms")) for c in cols)
            + f" | {f(row['pallas_over_read'], 6, 2)} "
            f"{f(row['ref_over_pallas'], 5, 1)} "
            f"{f(row['nonzero_over_pallas'], 5, 1)} "
            f"{f(row['topk_over_pallas'], 6, 1)} "
            f"{' ' * 10}| {row.get('match')}", flush=True)
      if row.get("kth_batched_ms") and row.get("read_batched_ms"):
        print(f"    exact k-th |acc|: kth {row['kth_batched_ms']:.3f} ms "
              f"(= {row['kth_batched_ms'] / row['read_batched_ms']:.2f} x "
              f"read), kth_ref {row.get('kth_ref_batched_ms') or 0:.3f} ms, "
              f"match {row.get('kth_match')}",
              flush=True)
      for k in [k for k in row if k.endswith("_error")]:
        print(f"    {k}: {row[k]}", flush=True)
    if args.sweep and n == max(sizes):
      d = args.sweep_density
      q = float(jnp.quantile(jnp.abs(acc.astype(jnp.float32)), 1 - d))
      capacity = capacity_for(d, n, 1.5)
      expect = jax.jit(lambda a, t, o: reference.select(a, t, capacity, o))(
          acc, jnp.float32(q), offset)
      configs = SWEEP if args.sweep_configs is None else [
          SWEEP[int(i)] for i in args.sweep_configs.split(",")]
      for block, tile, stage, nw in configs:
        r = bench_one((acc, jnp.float32(q), capacity, offset),
                      ["pallas", "count"], args.repeats, args.interpret,
                      expect=expect, block=block, tile=tile, stage=stage,
                      num_warps=nw)
        r.update(n=n, density=d, block=block, tile=tile, stage=stage,
                 num_warps=nw)
        sweep.append(r)
        g = lambda k: f"{r[k]:.3f}" if r.get(k) is not None else "-"
        print(f"  sweep block={block} tile={tile} stage={stage} warps={nw}: "
              f"pallas "
              f"{g('pallas_ms')} ms (batched {g('pallas_batched_ms')}), count "
              f"{g('count_ms')} (batched {g('count_batched_ms')}) match "
              f"{r.get('match')} {r.get('pallas_error', '')}", flush=True)
    del acc
  if args.out:
    pathlib.Path(args.out).write_text(json.dumps(
        {"meta": meta, "rows": rows, "sweep": sweep}, indent=1))


if __name__ == "__main__":
  dispatch.run(main, SUBCOMMANDS)
