"""A ``jax.profiler`` trace (JAX's gzip) rewritten as xz, the form
``benchmarks/results/`` stores (about 30 % smaller; ``jaxfuse show
--measured`` and ``planning.trace.read_trace`` read both)::

  python benchmarks/planner.py pack-trace .../perfetto_trace.json.gz trace_x.json.xz

Standard library only, so the GPU scripts can call it anywhere.
"""

import argparse
import gzip
import lzma
import pathlib


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("src", type=pathlib.Path, help="a .json.gz trace")
  p.add_argument("dst", type=pathlib.Path, help="the .json.xz to write")
  args = p.parse_args(argv)
  with gzip.open(args.src) as src:
    args.dst.write_bytes(lzma.compress(src.read(), preset=9))

