"""Worker for tests/test_distributed.py: ``check_same_collectives`` under
jax.distributed. Each process compiles (never runs) two programs over the
8-device mesh: one the same in every process (an all-gather, then a psum),
then one where process 1 adds a psum; it writes the first check's list and
the second's error as JSON to OUT.

  python tests/_agreement_worker.py --process-id I --num-processes N \
      --port P --out FILE
"""

import json
import pathlib

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxfuse

from _worker_args import join_job


def compiled(mesh, extra_psum: bool):
  def body(x):
    total = jax.lax.psum(jnp.sum(jax.lax.all_gather(x, "data", tiled=True)),
                         "data")
    if extra_psum:
      total += jax.lax.psum(jnp.sum(x * x), "data")
    return total
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"),
                            out_specs=P()))
  x = jax.ShapeDtypeStruct((16,), jnp.float32,
                           sharding=NamedSharding(mesh, P("data")))
  return f.lower(x).compile()


def main():
  args = join_job()
  mesh = jaxfuse.make_mesh(len(jax.devices()))
  same = jaxfuse.check_same_collectives(compiled(mesh, False))
  try:
    jaxfuse.check_same_collectives(compiled(mesh, args.process_id == 1),
                                   what="the test's program")
    error = None
  except jaxfuse.CollectivesDifferError as e:
    error = str(e)
  pathlib.Path(args.out).write_text(json.dumps({"same": same,
                                                "error": error}))


if __name__ == "__main__":
  main()
