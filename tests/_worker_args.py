"""The command line of the small jax.distributed test workers
(tests/_costs_worker.py, tests/_agreement_worker.py): parse it and join
the job (one process: no jax.distributed)."""

import argparse

import jax


def join_job():
  """--process-id I --num-processes N --port P --out FILE, parsed; with
  N > 1, jax.distributed initialized on localhost:P."""
  p = argparse.ArgumentParser()
  p.add_argument("--process-id", type=int, required=True)
  p.add_argument("--num-processes", type=int, required=True)
  p.add_argument("--port", type=int, required=True)
  p.add_argument("--out", required=True)
  args = p.parse_args()
  if args.num_processes > 1:
    jax.distributed.initialize(f"localhost:{args.port}", args.num_processes,
                               args.process_id)
  return args
