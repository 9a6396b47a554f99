"""Worker for tests/test_distributed.py: ``profiling.same_on_every_process``
under jax.distributed. Process I builds costs of its own (α = I + 1 µs,
its own provenance) and writes what the call returns as JSON to OUT.

  python tests/_costs_worker.py --process-id I --num-processes N \
      --port P --out FILE
"""

import argparse
import pathlib

import jax

from jaxfuse.planning import profiling
from jaxfuse.planning.costs import Costs
from jaxfuse.planning.costs import LinearCost


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--process-id", type=int, required=True)
  p.add_argument("--num-processes", type=int, required=True)
  p.add_argument("--port", type=int, required=True)
  p.add_argument("--out", required=True)
  args = p.parse_args()
  if args.num_processes > 1:
    jax.distributed.initialize(f"localhost:{args.port}", args.num_processes,
                               args.process_id)
  me = args.process_id
  line = LinearCost((me + 1) * 1e-6, (me + 1) * 1e-9)
  costs = Costs({"allgather": line, "psum": line}, line, (1e-3 * (me + 1),),
                bucket=1e-4 * (me + 1), provenance={"process": me,
                                                    "note": "ü" * (me + 1)})
  pathlib.Path(args.out).write_text(
      profiling.same_on_every_process(costs).to_json())


if __name__ == "__main__":
  main()
