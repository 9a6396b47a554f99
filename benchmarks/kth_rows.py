"""The k-th largest of a bucket's rows: a sort per group against radix select.

A ``sparse_sync`` step needs, per unit, the k-th largest magnitude of a
row: DGC's sample (s = 1 % of n), and for ``"topk"`` its bracket sample
(2^16) and its staged slots (C). This times, for the row shapes of one
gpt2-small bucket at density 0.01 (``aligned``, 4 buckets; rows grouped by
shape as the state groups are)::

  sort     lax.top_k per group (what the CPU path still does)
  xla      ``radix_select.radix_rows``, all rows in one call (8 reductions)
  pallas   ``kernels.radix.radix_rows_pallas``: the same 8 rounds in one
           kernel, a program per row, each over its own length

(An earlier Pallas kernel with a program per row and a bit per round, 31
rounds, measured 1.9–3.4× slower than ``xla`` on an H100.)

  python benchmarks/kth_rows.py --out kth_rows.json
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax  # pylint: disable=wrong-import-position
from jax import lax  # pylint: disable=wrong-import-position
import jax.numpy as jnp  # pylint: disable=wrong-import-position
import numpy as np  # pylint: disable=wrong-import-position

from jaxfuse import _compat  # pylint: disable=wrong-import-position
from jaxfuse import radix_select  # pylint: disable=wrong-import-position
from jaxfuse.kernels import radix  # pylint: disable=wrong-import-position
# benchmarks/kernels.py's timer: (median waited call, back-to-back mean).
from kernels import _time  # pylint: disable=wrong-import-position

# (rows, s, k) per group of the second gpt2-small bucket (22 units).
BUCKETS = {
    "dgc sample": [(12, 5899, 59), (5, 23593, 236), (2, 256, 3),
                   (3, 256, 3)],
    "topk bracket": [(12, 65536, 755), (5, 65536, 757), (2, 3072, 31),
                     (3, 3072, 31)],
    "topk slots": [(12, 9920, 5899), (5, 32161, 23593), (2, 1103, 31),
                   (3, 1103, 31)],
}


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--repeats", type=int, default=50)
  p.add_argument("--methods", nargs="+", choices=["sort", "xla", "pallas"],
                 default=["sort", "xla"] + (
                     ["pallas"] if _compat.pallas_triton() else []),
                 help="default: all three (pallas where this JAX has "
                 "Pallas's Triton backend)")
  p.add_argument("--out", help="JSON file to write")
  args = p.parse_args(argv)
  rng = np.random.default_rng(0)
  results = []
  print(f"{'rows':14} {'method':7} {'waited us':>10} {'pipelined us':>13}")
  for name, groups in BUCKETS.items():
    rows = [jnp.asarray(np.abs(rng.standard_t(3, size=(r, s))), jnp.float32)
            for r, s, _ in groups]
    ranks = [k for _, _, k in groups]
    sort = jax.jit(lambda rs: [lax.top_k(a, k)[0][:, k - 1]
                               for a, k in zip(rs, ranks)])

    def rows_to(fn, lengths=False):
      def run(rs):
        width = max(a.shape[1] for a in rs)
        bits = jnp.concatenate([jnp.pad(
            lax.bitcast_convert_type(a, jnp.int32),
            ((0, 0), (0, width - a.shape[1]))) for a in rs])
        k = jnp.asarray(np.repeat(ranks, [a.shape[0] for a in rs]),
                        jnp.int32)
        if lengths:
          return fn(bits, k, tuple(a.shape[1] for a in rs
                                   for _ in range(a.shape[0])))
        return fn(bits, k)
      return jax.jit(run)

    methods = {"sort": sort, "xla": rows_to(radix_select.radix_rows),
               "pallas": rows_to(functools.partial(
                   radix.radix_rows_pallas,
                   interpret=jax.default_backend() != "gpu"), lengths=True)}
    want = np.concatenate([np.asarray(x) for x in sort(rows)])
    for method in args.methods:
      fn = methods[method]
      got = fn(rows)
      got = (np.concatenate([np.asarray(x) for x in got]) if method == "sort"
             else np.asarray(got).view(np.float32))
      assert (got == want).all(), (name, method)
      waited, pipelined, _ = _time(fn, (rows,), args.repeats)
      print(f"{name:14} {method:7} {waited * 1e6:10.1f} "
            f"{pipelined * 1e6:13.1f}")
      results.append({"rows": name, "method": method, "groups": groups,
                      "waited_us": waited * 1e6,
                      "pipelined_us": pipelined * 1e6})
  if args.out:
    meta = {"jax": jax.__version__, "backend": jax.default_backend(),
            "device": getattr(jax.devices()[0], "device_kind", "cpu"),
            "date": time.strftime("%Y-%m-%d")}
    pathlib.Path(args.out).write_text(json.dumps(
        {"meta": meta, "results": results}, indent=1))


if __name__ == "__main__":
  main()
