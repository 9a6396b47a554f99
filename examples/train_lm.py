"""Data-parallel byte-level language model, dense vs. jaxfuse gradient sync.

The model of ``lm_model.py`` (a small decoder-only transformer) learns to
predict the bytes of the Python standard library's own ``.py`` files, so it
runs offline anywhere. Every mode trains the same model on the same data in
the same order; only the gradient synchronization differs:

  dense    jax.lax.pmean of the gradients, then AdamW (or SGD, --optimizer sgd)
  jaxfuse  the --optimizer recipe around jaxfuse.sparse_sync(plan), plan =
           --strategy; by default the README recipe: jaxfuse.onebit_adamw
           at density 0.05 on a `size` 64 MiB plan, dense (on a bfloat16
           wire) for the first 10 % of the steps, then 5 % at density
           6.25 % (docs/convergence.md); on GPUs over a slow network add
           --send-early --network-gbytes-s 1.5
  behind   as jaxfuse, with jaxfuse.plan(strategy="behind")

The jaxfuse modes train with one ``jaxfuse.make_train_step`` call (its
phases, ``--flush-every``'s steps and the flags' ``StepOptions``:
train_lm_step.py); the dense baseline's step is written by hand there.

On a CPU-only machine it runs on 8 simulated devices (--cpu-devices); on
GPUs it uses all of them (or --devices N):

  python examples/train_lm.py                            # tiny, jaxfuse, ~2 min
  python examples/train_lm.py --sync dense
  python examples/train_lm.py --sync behind --density 0.001
  python examples/train_lm.py --optimizer sgd --warmup-steps 20   # DGC
  python examples/train_lm.py --density 0.01 --dense-warmup 100
  python examples/train_lm.py --strategy layerwise --estimator gaussian
  python examples/train_lm.py --preset gpt2-small --dtype bfloat16  # on GPUs
  python examples/train_lm.py --steps 50 --json-out /tmp/run.json
  python examples/train_lm.py --strategy auto --costs costs.json
  python examples/train_lm.py --plan plan.json     # from `jaxfuse plan`
  python examples/train_lm.py \
      --xla-option xla_gpu_all_reduce_combine_threshold_bytes=0
  python examples/train_lm.py --grad-dtype bfloat16   # float32 residuals
  python examples/train_lm.py --checkpoint-dir ck --checkpoint-every 100
  python examples/train_lm.py --checkpoint-dir ck --resume --cpu-devices 4
  python examples/train_lm.py --coordinator host0:1234 --num-processes 2 \
      --process-id 0          # and 1 on the other host (SLURM: no flags)
  bash scripts/launch_local.sh 2      # 2 local processes, 4 CPU devices each

--resume on another device count redistributes the per-worker state
(jaxfuse.elastic); the global batch must divide over the new count. With
a plan of another layout (``--plan``, ``--strategy``, ``--estimator``,
...) it restores with the saved plan and carries the optimizer state over
(jaxfuse.relayout).

Tokens/s excludes step 1 (compilation); every step is timed to completion.

Run from the repository root with ``PYTHONPATH=.`` (or jaxfuse installed).
"""

from __future__ import annotations

import os
import sys


def _cpu_devices_env(argv) -> None:
  """Ask for simulated CPU devices; must happen before jax is imported.
  ``--cpu-devices N`` wins over an exported ``JAX_NUM_CPU_DEVICES``, which
  wins over the default 8."""
  n, given = "8", False
  for i, a in enumerate(argv):
    if a == "--cpu-devices" and i + 1 < len(argv):
      n, given = argv[i + 1], True
    elif a.startswith("--cpu-devices="):
      n, given = a.split("=", 1)[1], True
  if "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", ""):
    return  # the user chose a count the old way; leave it
  if given:
    os.environ["JAX_NUM_CPU_DEVICES"] = n
  n = os.environ.setdefault("JAX_NUM_CPU_DEVICES", n)
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             f" --xla_force_host_platform_device_count={n}")


if __name__ == "__main__":
  _cpu_devices_env(sys.argv[1:])

# pylint: disable=g-import-not-at-top,wrong-import-position
import contextlib
import dataclasses
import functools
import hashlib
import json
import math
import pathlib
import time
from typing import NamedTuple
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxfuse
from jaxfuse.state.simulated import is_simulated
from jaxfuse.state.simulated import worker_map
from jaxfuse.sync import agreement
from jaxfuse.planning.costs import CostsError
from lm_model import build_model
from lm_model import load_corpus
from lm_model import make_loss
from lm_model import PRESETS
from lm_model import sample_starts
from lm_model import windows
from train_lm_args import AXIS
from train_lm_args import ONEBIT_WARMUP_DENSITIES
from train_lm_args import parse_args
from train_lm_args import parse_xla_options
from train_lm_args import plan_options
from train_lm_args import resolve_warmup_steps
from train_lm_args import trace_dir
from train_lm_args import trace_steps
from train_lm_args import warmup_line
from train_lm_args import warmup_phases
from train_lm_record import log_line
from train_lm_record import RunRecord
from train_lm_record import stats_line
from train_lm_rules import make_optimizer
from train_lm_step import cast_params
from train_lm_step import DenseStep
from train_lm_step import make_train_step  # benchmarks/overhead.py's
from train_lm_step import step_options
from train_lm_step import with_flushes


def init_distributed(args) -> None:
  """``jax.distributed`` when there are several processes: from the flags,
  or from an environment JAX detects itself (SLURM, Open MPI)."""
  flags = (args.coordinator, args.num_processes, args.process_id)
  env = os.environ
  detected = (int(env.get("SLURM_NTASKS", "1")) > 1 and "SLURM_JOB_ID" in env
              or int(env.get("OMPI_COMM_WORLD_SIZE", "1")) > 1)
  if all(f is None for f in flags) and not detected:
    return
  if any(f is None for f in flags) and not all(f is None for f in flags):
    raise SystemExit("--coordinator, --num-processes and --process-id go "
                     "together (or none of them under SLURM or Open MPI)")
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=args.coordinator,
                             num_processes=args.num_processes,
                             process_id=args.process_id)


def sent_line(plan, k: int, dense_bytes: int, every: int = 1) -> str:
  """What each worker sends per step on K workers (its buckets' schemes;
  ``--local-steps``: a sync's bytes over its ``every`` steps), against a
  ring all-reduce of the dense gradients (2(K−1)/K of them;
  ``jaxfuse.collectives.bytes_sent``)."""
  if k < 2:
    return ""
  if plan is None:
    sent = dense = jaxfuse.collectives.all_reduce_sent(dense_bytes, k)
  else:
    sent, dense = jaxfuse.collectives.bytes_sent(
        jaxfuse.sync.bucket_steps.compile_plan(plan), k)
    sent /= every
  return (f"; on {k} workers each sends {sent:,.0f} B = "
          f"{sent / dense:.4f} x a dense all-reduce's ({dense:,} B)")


def replicated(tree, mesh):
  """Host values (the same in every process) placed on every device (on a
  simulated mesh: on its one device)."""
  if is_simulated(mesh):
    return jax.device_put(tree, mesh.device)
  sharding = NamedSharding(mesh, P())
  return jax.tree.map(lambda x: jax.make_array_from_callback(
      np.shape(x), sharding, lambda i, x=np.asarray(x): x[i]), tree)


def global_values(tree):
  """numpy copies of (possibly multi-process) arrays, whole."""
  if jax.process_count() == 1:
    return tree
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  return multihost_utils.process_allgather(tree, tiled=True)


def replicas_identical_everywhere(params) -> bool:
  """Whether every device of every process holds the same bits of each
  replicated leaf (the processes compare a hash of their own copies)."""
  local = all(
      all(np.array_equal(np.asarray(s.data), np.asarray(x.addressable_shards[0]
                                                          .data))
          for s in x.addressable_shards) for x in jax.tree.leaves(params))
  if jax.process_count() == 1:
    return local
  digest = hashlib.sha256()     # leaf by leaf: no copy of all the params
  for x in jax.tree.leaves(params):
    digest.update(np.ascontiguousarray(x.addressable_shards[0].data).tobytes())
  # Every process's flag in what is compared: all return the same answer.
  return agreement.equal_on_every_process(
      digest.digest() + bytes([local])) and local


def scalar(x) -> float:
  """A replicated scalar as a float (this process's copy)."""
  return float(np.asarray(x.addressable_data(0)))


def make_eval_step(loss_fn, mesh):
  def local(params, batch):
    return jax.lax.pmean(loss_fn(params, batch), AXIS)
  return jax.jit(worker_map(local, mesh, (P(), P(AXIS)), P()))


class SyncSetup(NamedTuple):
  """How the gradients are synchronized: the plan (None: dense ``pmean``),
  its phases, and the optimizer state and its partition specs."""
  plan: object
  phases: tuple
  opt_state: object
  opt_specs: object


def _packing(bucket):
  """``bucket`` with its all-gather sending packed indices
  (``--packed-indices`` over a saved plan; alone or under hier)."""
  gather = jaxfuse.collectives.AllGather(packed_indices=True)
  if bucket.collective == "allgather":
    return dataclasses.replace(bucket, scheme=gather)
  if bucket.collective == "hier" and getattr(
      bucket.scheme, "inner", gather).name == "allgather":
    return dataclasses.replace(bucket,
                               scheme=jaxfuse.collectives.Hier(inner=gather))
  return bucket


def _costs_more_than_dense(plan, dense_wire: str, k: int) -> bool:
  """Whether ``plan``'s sparse steps receive more bytes per worker on K
  workers than a dense step on ``dense_wire`` (``wire_warnings``)."""
  if k < 2 or not jaxfuse.optim.phases.has_sparse_units(plan):
    return False
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    return bool(jaxfuse.optim.phases.wire_warnings(
        (jaxfuse.Phase(0, None, plan),), k, dense_wire))


def setup_sync(args, steps, params, loss_fn, example_batch, mesh, make_opt,
               grad_dtype, say) -> SyncSetup:
  """The plan (``--plan`` or ``jaxfuse.plan`` from ``example_batch``, one
  worker's shard), the warm-up phases and the state on ``mesh``."""
  k = mesh.devices.size
  if args.sync == "dense":
    return SyncSetup(None, (jaxfuse.Phase(0, None, None),),
                     replicated(make_opt(None).init(params), mesh), P())
  make_plan = lambda: jaxfuse.plan(
      cast_params(params, grad_dtype),
      order=jaxfuse.planning.ordering.FromLoss(loss_fn, (example_batch,)),
      **plan_options(args, k))
  plan = jaxfuse.Plan.load(args.plan) if args.plan else make_plan()
  if not (args.plan or args.sparse_wire or args.local_steps) and (
      _costs_more_than_dense(plan, args.dense_wire, k)):
    # the recipe on many workers: float32 values would move more bytes
    # than a dense step; bfloat16 ones (8 -> 6 bytes a slot) may not
    args.sparse_wire = "bfloat16"
    say(f"on {k} workers the sparse steps would move more bytes than a "
        f"dense step on a {args.dense_wire!r} wire: sending the sparse "
        "values in bfloat16 (--sparse-wire to choose)")
    plan = make_plan()
  if args.plan and (args.sparse_wire or args.packed_indices):
    # the wire is not part of the layout
    plan = dataclasses.replace(plan, settings=dataclasses.replace(
        plan.settings,
        sparse_wire=args.sparse_wire or plan.settings.sparse_wire),
        buckets=tuple(_packing(b) if args.packed_indices else b
                      for b in plan.buckets))
  if args.plan:   # the plan's, not the flags', in the log and the JSON
    args.density = jaxfuse.optim.phases.final_density(plan)
    args.estimator = next((l.estimator for l in plan.leaves
                           if l.mode == "sparse"), args.estimator)
  say(plan.summary())
  if args.warmup_densities is None and args.optimizer != "onebit_adamw":
    args.warmup_densities = "dgc"
  elif args.warmup_densities is None:   # resolved here: the run's JSON says
    final = jaxfuse.optim.phases.final_density(plan)
    args.warmup_densities = ([d for d in ONEBIT_WARMUP_DENSITIES
                              if d > final] if args.warmup_steps else [])
  phases = warmup_phases(args, plan, args.dense_warmup, k)
  if len(phases) > 1:
    say(warmup_line(args, phases, steps, k))
  opt_state = jaxfuse.init_state(make_opt(phases[0].plan),
                                 cast_params(params, grad_dtype), mesh, AXIS)
  return SyncSetup(plan, phases, opt_state,
                   jaxfuse.state_specs(opt_state, AXIS))


def main(argv=None) -> dict:
  args = parse_args(sys.argv[1:] if argv is None else argv)
  if args.network_gbytes_s:   # before JAX starts its GPU backend
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " +
                               jaxfuse.xla_flags(args.network_gbytes_s))
  init_distributed(args)
  say = print if jax.process_index() == 0 else lambda *a, **k: None
  xla_options = {**({} if args.xla_defaults else jaxfuse.xla_options()),
                 **parse_xla_options(args.xla_option)}
  t_start = time.perf_counter()
  preset = PRESETS[args.preset]
  jaxfuse.kernels.set_backend(args.kernels)
  if args.kernels == "pallas" and jax.default_backend() != "gpu":
    raise SystemExit("--kernels pallas compiles the Pallas kernels for a GPU;"
                     f" on {jax.default_backend()} use --kernels auto (the "
                     "XLA reference there)")
  mesh = (jaxfuse.simulated_mesh(args.simulated_workers, AXIS)
          if args.simulated_workers else jaxfuse.make_mesh(args.devices, AXIS))
  k = mesh.devices.size
  steps = args.steps or preset["steps"]
  onebit = args.optimizer == "onebit_adamw"
  resolve_warmup_steps(args, steps)
  if onebit and args.sync != "dense" and args.dense_warmup < 20:
    say(f"warning: a dense warm-up of {args.dense_warmup} step(s). "
        "onebit_adamw freezes Adam's second moment v after it, and a "
        "coordinate whose gradient was zero in every dense step keeps "
        "v = 0 and later steps by m / eps; the loss can blow up. The README "
        "recipe warms up 10 % of the steps, 1-bit Adam 15-25 % "
        "(--dense-warmup, --steps).")
  batch_size = (args.batch_size or preset.get("batch")
                or preset["batch_per_device"] * k)
  if batch_size % k:
    raise SystemExit(f"--batch-size {batch_size} must divide over {k} "
                     "devices: pick a batch size that is a multiple of the "
                     "device count (or, resuming, a device count that "
                     "divides the batch)")
  model = build_model(args.preset, args.seq_len, args.dtype)
  seq_len = model.cfg.seq_len
  lr = args.lr or preset["lr"]
  train, val = load_corpus(int(args.corpus_mb * 2**20))
  say(f"{k} x {jax.devices()[0].platform} "
      f"{'workers simulated on one device' if is_simulated(mesh) else 'devices'}"
      f" in {jax.process_count()} process(es); corpus {train.size:,} "
      f"train / {val.size:,} val bytes; preset {args.preset} "
      f"{model.cfg}; batch {batch_size} x {seq_len}; {steps} steps")

  data_sharding = (None if is_simulated(mesh) else
                   NamedSharding(mesh, P(AXIS)))
  rng = np.random.default_rng(args.seed)
  grad_dtype = None if args.grad_dtype == "float32" else args.grad_dtype

  def put(starts, data):
    """A global batch: every process draws the same window starts and reads
    only the rows of its own devices (simulated workers: all of them)."""
    if is_simulated(mesh):
      return jax.device_put(windows(data, starts, seq_len), mesh.device)
    return jax.make_array_from_callback(
        (batch_size, seq_len + 1), data_sharding,
        lambda index: windows(data, starts[index[0]], seq_len))

  draw = lambda rng, data: put(sample_starts(rng, data, batch_size, seq_len),
                               data)
  first_starts = sample_starts(rng, train, batch_size, seq_len)
  first_batch = put(first_starts, train)
  params = model.init(jax.random.PRNGKey(args.seed),
                      jnp.zeros((1, seq_len), jnp.int32))
  params = replicated(params["params"], mesh)
  loss_fn = make_loss(model)
  num_params = sum(x.size for x in jax.tree.leaves(params))
  dense_bytes = sum(x.nbytes for x in jax.tree.leaves(params))

  schedule = optax.warmup_cosine_decay_schedule(
      0.0, lr, min(preset["warmup"], max(1, steps // 10)), max(steps, 2),
      end_value=lr / 10)
  decay_mask = jax.tree.map(lambda x: x.ndim >= 2, params)
  make_opt = functools.partial(make_optimizer, args, schedule, decay_mask)
  if args.plan:
    args.sync = "jaxfuse"
  plan, phases, opt_state, opt_specs = setup_sync(
      args, steps, params, loss_fn,
      windows(train, first_starts[:batch_size // k], seq_len), mesh,
      make_opt, grad_dtype, say)
  # the payload a worker sends per step (dense: every gradient;
  # --local-steps: a sync's over its H steps)
  every = args.local_steps or 1
  wire_bytes = plan.bytes_per_worker() / every if plan else dense_bytes
  flush_plan = None if plan is None else jaxfuse.with_density(plan, 1.0)
  if plan is None:
    train_step = DenseStep(loss_fn, make_opt(None), mesh, xla_options)
    state = jaxfuse.TrainState(params, opt_state, None, 0)
  else:
    # one call: the step of each phase (and of --flush-every's density-1
    # steps), compiled when first run; the state (at --grad-dtype)
    state, train_step = jaxfuse.make_train_step(
        loss_fn, params, make_opt,
        with_flushes(phases, flush_plan, args.flush_every, steps), mesh,
        step_options(args, grad_dtype, xla_options))
  start, mngr = 0, None
  if args.checkpoint_dir:
    mngr = jaxfuse.checkpoint.manager(args.checkpoint_dir)
  elif args.resume:
    raise SystemExit("--resume needs --checkpoint-dir")
  if args.resume and not mngr.all_steps():
    say(f"--resume: no checkpoint in {args.checkpoint_dir} yet; starting at "
        "step 0")
  if args.resume and mngr.all_steps():
    if mngr.latest_step() >= steps:
      raise SystemExit(f"--resume: {args.checkpoint_dir} holds step "
                       f"{mngr.latest_step()}, at or past --steps {steps}: "
                       "nothing left to train (raise --steps to go on)")
    # a plan of another layout (--plan, --strategy, ...): restore with the
    # saved plan, then carry the optimizer state over to this one
    saved = jaxfuse.checkpoint.saved_plan(mngr)
    carry = bool(plan and saved and
                 jaxfuse.sync.bucket_steps.layout_difference(saved, plan))
    try:
      like = (jaxfuse.init_state(make_opt(saved),
                                 cast_params(params, grad_dtype), mesh, AXIS)
              if carry else state.opt_state)
      start, saved_tree = jaxfuse.checkpoint.restore(
          mngr, {"params": state.params, "opt": like},
          saved if carry else plan)
      if carry:
        saved_tree["opt"] = jaxfuse.relayout(saved_tree["opt"], saved, plan)
        say("--resume: the saved plan's layout differs from this run's; "
            "the optimizer state was carried over (jaxfuse.relayout)")
    except (jaxfuse.checkpoint.CheckpointError, jaxfuse.PlanError) as e:
      raise SystemExit(f"train_lm.py: error: --resume: {e} Resume with the "
                       "flags of the run that saved it, or give a new "
                       "--checkpoint-dir.") from None
    start = int(start)
    state = jaxfuse.TrainState(saved_tree["params"], saved_tree["opt"], None,
                               start)
    rng.bit_generator.state = jaxfuse.checkpoint.saved_extra(mngr)["rng"]
    first_batch = draw(rng, train)
    say(f"resumed from step {start} of {args.checkpoint_dir} (saved on "
        f"{jaxfuse.checkpoint.saved_workers(mngr, start) or '?'} workers, "
        f"now {k})")
  say(f"{num_params:,} params; wire bytes per worker per step "
      f"{wire_bytes:,.0f} B = {wire_bytes / dense_bytes:.4f} x dense "
      f"({dense_bytes:,} B){sent_line(plan, k, dense_bytes, every)}; "
      f"optimizer {args.optimizer}")

  eval_step = make_eval_step(loss_fn, mesh)
  eval_rng = np.random.default_rng(args.seed + 10_000)
  eval_batches = [draw(eval_rng, val) for _ in range(args.eval_batches)]
  evaluate = lambda p: float(np.mean([scalar(eval_step(p, b))
                                      for b in eval_batches]))

  tokens_per_step = batch_size * seq_len
  record, stats = RunRecord(start), {}
  batch = first_batch
  settle_prev = None  # --dense-settle: the last second moment looked at
  # --pipeline: step t+1 is queued before step t's loss is read, except
  # after a step whose bookkeeping reads params or state (log, evaluation,
  # checkpoint, --dense-settle), so the host's work hides behind the GPU's.
  pipeline = (args.pipeline == "on" or (args.pipeline == "auto" and
                                        jax.devices()[0].platform == "gpu"))

  # What a step's bookkeeping does (``finish``); each reads params or state.
  logs = lambda step: ((step + 1) % args.log_every == 0 or step == start
                       or step + 1 == steps)
  evaluates = lambda step: bool(args.eval_every and step + 1 < steps and
                                (step + 1) % args.eval_every == 0)
  saves = lambda step: mngr is not None and (step + 1 == steps or bool(
      args.checkpoint_every and (step + 1) % args.checkpoint_every == 0))
  settles = lambda step, phase: bool(
      args.dense_settle and phase == 0 and phases[0].stop
      and (step + 1) % args.dense_settle_every == 0)

  def finish(step, loss, t0, phase, rng_state) -> bool:
    """Wait for step's loss and do its bookkeeping; False: stop here."""
    nonlocal settle_prev, phases, train_step
    loss = scalar(jax.block_until_ready(loss))
    record.add_step(loss, t0, time.perf_counter(), phase)
    if settles(step, phase):
      settle_now = jaxfuse.second_moment(state.opt_state)
      if settle_prev is not None and step + 1 < phases[0].stop:
        change = jaxfuse.second_moment_change(settle_prev, settle_now)
        say(f"step {step + 1}: the second moment moved {change:.3g} in "
            f"{args.dense_settle_every} steps (--dense-settle "
            f"{args.dense_settle:g})")
        if change < args.dense_settle:   # replicated: every host agrees
          phases = warmup_phases(args, plan, step + 1, k)
          train_step = train_step.with_phases(with_flushes(
              phases, flush_plan, args.flush_every, steps))
          say(f"dense phase ends at step {phases[0].stop}")
      settle_prev = settle_now
    if saves(step):
      jaxfuse.checkpoint.save(mngr, step + 1, {"params": state.params,
                                               "opt": state.opt_state},
                              plan, {"rng": rng_state})
      say(f"checkpoint saved at step {step + 1}", flush=True)
    if logs(step):
      entry = record.log_entry(step, args.log_every, tokens_per_step)
      line = log_line(entry, compiling=step == start)
      if plan is not None:   # the plan that made the logged step's stats
        made_by = phases[phase].plan if phase >= 0 else flush_plan
        stats.update(jaxfuse.summarize(global_values(
            jaxfuse.sync_stats(state.opt_state)), made_by))
        entry["stats"] = dict(stats)
        line += stats_line(stats)
      say(line, flush=True)
    if evaluates(step):
      record.val_curve.append({"step": step + 1,
                               "val_loss": evaluate(state.params)})
      say(f"step {step + 1:5d}  validation loss "
          f"{record.val_curve[-1]['val_loss']:.4f}", flush=True)
    if not math.isfinite(loss):
      say(f"loss is {loss} at step {step + 1}; stopping")
      return False
    return True

  queued = None      # the step dispatched whose loss is not read yet
  called = []        # the step functions called (compiled) so far
  traced = trace_steps(args, start, steps)   # --trace-dir's steps, or ()
  tracing = False
  for step in range(start, steps):
    # the program this step runs (its phase's, or a flush step's)
    step_fn = train_step.compiled(jaxfuse.phase_index(train_step.phases,
                                                      step))
    flushes = plan is not None and args.flush_every and (
        (step + 1) % args.flush_every == 0)
    phase_id = -1 if flushes else jaxfuse.phase_index(phases, step)
    compiles = not any(f is step_fn for f in called)
    if compiles:                                 # this call compiles it
      called.append(step_fn)
      record.compile_steps.append(step)
    starts_trace = bool(traced) and step == traced.start
    # Read the queued step before compiling, and before a trace (which
    # holds its own steps only).
    if (compiles or starts_trace) and queued is not None:
      previous, queued = queued, None
      if not finish(*previous):
        break
    if starts_trace:
      quiet = jax.profiler.ProfileOptions()
      quiet.python_tracer_level = 0     # kernels and step markers only
      jax.profiler.start_trace(trace_dir(args), create_perfetto_trace=True,
                               profiler_options=quiet)
      tracing = True
    t0 = time.perf_counter()
    # (under jax.distributed a step first checks, as it compiles, that
    # every process runs the same collectives)
    with (jax.profiler.StepTraceAnnotation("train", step_num=step)
          if tracing else contextlib.nullcontext()):
      state, loss = train_step(state, batch)
      record.dispatch_times.append(time.perf_counter() - t0)
      if tracing:     # each traced step's kernels inside its marker
        jax.block_until_ready((state.params, state.opt_state, loss))
    this = (step, loss, t0, phase_id,
            rng.bit_generator.state)   # before the next batch: resume point
    if step + 1 < steps:  # the next batch, drawn while the GPU works
      batch = draw(rng, train)
    if queued is not None:
      record.queued_steps += 1
      if not finish(*queued):
        queued = None
        break
    queued = this
    if not pipeline or tracing or logs(step) or evaluates(step) or (
        saves(step) or settles(step, this[3])):
      queued = None
      if not finish(*this):
        break
    if tracing and step + 1 == traced.stop:
      jax.profiler.stop_trace()
      tracing = False
      say(f"traced steps {traced.start}-{traced.stop - 1} into "
          f"{trace_dir(args)}", flush=True)
  if tracing:                               # stopped early (non-finite loss)
    jax.profiler.stop_trace()
  if queued is not None:
    finish(*queued)

  val_loss = evaluate(state.params) if eval_batches else float("nan")
  record.val_curve.append({"step": start + len(record.losses),
                           "val_loss": val_loss})

  # Replica consistency: every device holds its own copy of the params.
  replicas_identical = replicas_identical_everywhere(state.params)
  say("parameters bitwise identical on all "
      f"{1 if is_simulated(mesh) else jax.device_count()} devices: "
      f"{replicas_identical}")

  timing = record.timing(len(phases), tokens_per_step)
  losses = record.losses
  result = {
      "config": {**vars(args), "steps": steps, "batch_size": batch_size,
                 "seq_len": seq_len, "lr": lr, "num_devices": k,
                 "platform": jax.devices()[0].platform,
                 "device_kind": jax.devices()[0].device_kind,
                 "model": dataclasses.asdict(model.cfg),
                 "num_params": num_params, "compiler_options": xla_options},
      **record.as_dict(),  # start_step > 0 when resumed: losses from there
      "phases": [{"start": p.start, "stop": p.stop, "density": (
          p.plan.provenance.get("phase_density", args.density)
          if p.plan is not None else 1.0)} for p in phases],
      "pipeline": pipeline,
      "traced_steps": [traced.start, traced.stop] if traced else None,
      **timing,
      "final_train_loss": losses[-1],
      "final_val_loss": val_loss if eval_batches else None,
      "wire_bytes": wire_bytes, "dense_bytes": dense_bytes,
      "wire_ratio": wire_bytes / dense_bytes, "stats": stats,
      "plan_summary": plan.summary() if plan is not None else None,
      "plan_provenance": dict(plan.provenance) if plan is not None else None,
      "plan": plan.to_json() if plan is not None else None,
      "wall_time_s": time.perf_counter() - t_start,
      "replicas_identical": replicas_identical,
  }
  say(f"final validation loss {val_loss:.4f} ({args.eval_batches} batches)")
  say(f"summary: sync={args.sync}"
      + (f" strategy={plan.provenance['strategy']} density={args.density}"
           f" estimator={args.estimator}" if plan is not None else "")
      + f"  loss {losses[0]:.3f} -> {losses[-1]:.3f}  val {val_loss:.3f}  "
      f"{result['tokens_per_s']:,.0f} tok/s  "
      f"{1e3 * timing['mean_step_time_s']:.1f} ms/step "
      f"(first step {timing['first_step_s']:.1f} s)  wire/dense "
      f"{result['wire_ratio']:.4f}  wall {result['wall_time_s']:.0f} s")
  if args.json_out and jax.process_index() == 0:
    pathlib.Path(args.json_out).write_text(json.dumps(result, indent=1))
  return result


if __name__ == "__main__":
  try:
    main()
  except (jaxfuse.PlanError, jaxfuse.SyncError,
          jaxfuse.checkpoint.CheckpointError,
          CostsError) as e:
    # what the library refused, as one line (argparse's errors' style)
    raise SystemExit(f"train_lm.py: error: {e}") from None
