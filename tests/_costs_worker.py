"""Worker for tests/test_distributed.py: ``profiling.same_on_every_process``
under jax.distributed. Process I builds costs of its own (α = I + 1 µs,
its own provenance) and writes what the call returns as JSON to OUT.

  python tests/_costs_worker.py --process-id I --num-processes N \
      --port P --out FILE
"""

import pathlib

from jaxfuse.planning import profiling
from jaxfuse.planning.costs import Costs
from jaxfuse.planning.costs import LinearCost

from _worker_args import join_job


def main():
  args = join_job()
  me = args.process_id
  line = LinearCost((me + 1) * 1e-6, (me + 1) * 1e-9)
  costs = Costs({"allgather": line, "psum": line}, line, (1e-3 * (me + 1),),
                bucket=1e-4 * (me + 1), provenance={"process": me,
                                                    "note": "ü" * (me + 1)})
  pathlib.Path(args.out).write_text(
      profiling.same_on_every_process(costs).to_json())


if __name__ == "__main__":
  main()
