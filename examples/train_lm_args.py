"""The command line of ``train_lm.py`` (its options, their checks, and
what they resolve to: the update rule, the plan's options, the warm-up
phases, the traced steps and their folder).

Imported after ``train_lm`` has set up the simulated CPU devices: it
imports JAX.
"""

from __future__ import annotations

import argparse
import inspect
import os

import jax

import jaxfuse
from lm_model import PRESETS

AXIS = "data"   # the mesh axis of the workers

DESCRIPTION = ("Data-parallel byte-level language model, dense vs. jaxfuse "
               "gradient sync.")
# --send-early-window's default: jaxfuse.send_early's own.
SEND_EARLY_WINDOW = inspect.signature(
    jaxfuse.send_early).parameters["window"].default
# jaxfuse.plan's slots per sparse leaf over ⌈ρ·n⌉, read where it is defined.
PLAN_HEADROOM = jaxfuse.Settings().headroom
# The README recipe's defaults where they are not jaxfuse's own.
ONEBIT_WARMUP_DENSITIES = (0.0625,)   # those above the plan's density
SIZE_BUCKET_BYTES = 64 * 2**20        # --strategy size


def parse_xla_options(items) -> dict:
  """["name=value", ...] -> XLA compile options (ints, floats, true/false),
  checked by compiling a trivial function with them."""
  options = {}
  for item in items or ():
    name, sep, value = item.partition("=")
    if not sep or not name:
      raise SystemExit(f"--xla-option {item!r}: use NAME=VALUE, e.g. "
                       "xla_gpu_all_reduce_combine_threshold_bytes=0")
    low = value.lower()
    if low in ("true", "false"):
      options[name] = low == "true"
    else:
      try:
        options[name] = int(value)
      except ValueError:
        try:
          options[name] = float(value)
        except ValueError:
          options[name] = value
  if options:
    try:
      jax.jit(lambda: 0, compiler_options=options).lower().compile()
    except Exception as e:  # pylint: disable=broad-except
      raise SystemExit(f"--xla-option: XLA rejects {options}: "
                       f"{str(e).splitlines()[0]}") from None
  return options


def _densities(text):
  """"0.25,0.0625" -> [0.25, 0.0625]; "dgc" -> "dgc" (DGC's ramp)."""
  if text.strip().lower() == "dgc":
    return "dgc"
  try:
    densities = [float(x) for x in text.split(",") if x.strip()]
  except ValueError:
    densities = []
  if not densities:
    raise argparse.ArgumentTypeError(
        f"{text!r}: give densities like 0.25,0.0625")
  return densities


def _step_range(text):
  """"300:305" -> (300, 305)."""
  first, sep, stop = text.partition(":")
  try:
    first, stop = int(first), int(stop)
  except ValueError:
    first = stop = -1
  if not sep or first < 0 or stop <= first:
    raise argparse.ArgumentTypeError(
        f"{text!r}: give the first step and the step after the last, like "
        "300:305")
  return first, stop


def _counts(text):
  """"50" -> 50 (steps at every warm-up density); "50,50,150" -> one
  count per --warmup-densities entry."""
  try:
    counts = [int(x) for x in text.split(",") if x.strip()]
  except ValueError:
    counts = []
  if not counts or min(counts) < 0:
    raise argparse.ArgumentTypeError(
        f"{text!r}: give a step count like 50, or one per warm-up density "
        "like 50,50,150")
  return counts[0] if len(counts) == 1 and "," not in text else counts


def add_wire_args(p, sparse_wire_default="gradient"):
  """``--sparse-wire`` and ``--packed-indices`` (``Settings.sparse_wire``,
  ``AllGather(packed_indices)``), shared with the benchmark scripts."""
  p.add_argument("--sparse-wire", choices=jaxfuse.plans.SPARSE_WIRES,
                 default=sparse_wire_default,
                 help="the sparse values' wire dtype (indices: "
                 "--packed-indices): "
                 "bfloat16 cuts float32 slots from 8 to 6 bytes, each "
                 "worker's rounding kept in its residual "
                 "(Settings.sparse_wire; default: %s)" % (
                     "the gradient's, or a --plan's own"
                     if sparse_wire_default is None else sparse_wire_default))
  p.add_argument("--packed-indices", action="store_true",
                 help="allgather buckets send each index in "
                 "ceil(log2(n+1)) bits instead of 32, losslessly "
                 "(jaxfuse.collectives.AllGather(packed_indices=True))")


def parse_args(argv):
  p = argparse.ArgumentParser(description=DESCRIPTION)
  p.add_argument("--sync", choices=("dense", "jaxfuse", "behind"),
                 default="jaxfuse")
  p.add_argument("--density", type=float, default=0.05,
                 help="fraction of each gradient sent (after the warm-up); "
                 "0.05 with onebit_adamw reached dense's validation loss on "
                 "gpt2-small, 0.01 was 3-13 %% behind (docs/convergence.md)")
  p.add_argument("--optimizer", choices=sorted(jaxfuse.RECIPES),
                 default="onebit_adamw",
                 help="the update rule (jaxfuse.RECIPES; docs/convergence.md)"
                 "; with --sync dense its dense twin (AdamW, or SGD with "
                 "momentum for sgd)")
  p.add_argument("--local-steps", type=int, default=0, metavar="H",
                 help="the local-steps regime (jaxfuse.local_steps): H "
                 "inner AdamW steps per worker between syncs of the "
                 "pseudo-gradient, at --density (1: a dense mean)")
  p.add_argument("--outer", choices=("sparseloco", "diloco"),
                 default="sparseloco",
                 help="--local-steps' outer step: SparseLoCo's (sgd 1.0, "
                 "error feedback decay 0.95) or DiLoCo's (Nesterov 0.7, "
                 "momentum 0.9)")
  p.add_argument("--outer-lr", type=float,
                 help="--outer's learning rate (default: its own)")
  p.add_argument("--momentum", type=float,
                 help="momentum of sgd (default 0.9) and demo (0.999)")
  p.add_argument("--warmup-steps", type=_counts,
                 help="steps at each warm-up density (--warmup-densities); "
                 "default 5%% of the steps for onebit_adamw, else 0; or one "
                 "count per --warmup-densities entry, e.g. 50,50,150. A "
                 "density whose all-gather moves at least the dense step's "
                 "bytes on this mesh runs dense (on --dense-wire) instead")
  p.add_argument("--warmup-densities", type=_densities,
                 help="comma-separated warm-up densities, each above the "
                 "plan's, or dgc for DGC's ramp (25%%, 6.25%%, 1.56%%, "
                 "0.4%%: those above the plan's density); default 0.0625 "
                 "for onebit_adamw (the README recipe; none when the plan "
                 "is as dense), else dgc")
  p.add_argument("--dense-wire", default="bfloat16",
                 choices=["gradient", "bfloat16"],
                 help="the dense warm-up's wire dtype: bfloat16 (default) "
                 "halves its bytes, each worker's rounding kept in its "
                 "residual; gradient: the gradient's own dtype")
  add_wire_args(p, sparse_wire_default=None)
  p.add_argument("--dense-settle", type=float,
                 help="end onebit_adamw's dense warm-up early, once its "
                 "second moment moves less than this (relative L1, e.g. "
                 "0.05) over --dense-settle-every steps "
                 "(jaxfuse.second_moment_change); --dense-warmup is then "
                 "the longest it may last")
  p.add_argument("--dense-settle-every", type=int, default=25,
                 help="steps between --dense-settle's checks")
  p.add_argument("--dense-warmup", type=int,
                 help="dense steps first (onebit_adamw needs them; default "
                 "10%% of the steps for it, else 0)")
  p.add_argument("--apply-if-finite", type=int, metavar="N",
                 help="skip a step whose update has a NaN or Inf, on every "
                 "worker (jaxfuse.apply_if_finite; optax's with --sync "
                 "dense), applying it anyway after N skips in a row")
  p.add_argument("--delay", action="store_true",
                 help="apply the recipe to the previous step's gradients "
                 "(jaxfuse.delayed): its communication can then overlap the "
                 "whole step; pair with XLA_FLAGS from jaxfuse.xla_flags")
  p.add_argument("--predict", action="store_true",
                 help="with --delay: take each gradient at the predicted "
                 "parameters θ + (the last update), where it will be applied "
                 "(jaxfuse.delayed(..., predict=True)); the logged training "
                 "loss is then the predicted parameters'")
  p.add_argument("--send-early", action="store_true",
                 help="compute each bucket's wire as soon as the backward "
                 "has made it and send it while the backward goes on "
                 "(jaxfuse.send_early; the same results); on GPUs pair "
                 "with --network-gbytes-s")
  p.add_argument("--send-early-window", type=int,
                 help="with --send-early: each bucket's collective ends "
                 "within the backward of this many points after it "
                 f"(jaxfuse.send_early's window, default "
                 f"{SEND_EARLY_WINDOW}; 0: unbounded)")
  p.add_argument("--network-gbytes-s", type=float,
                 help="the GB/s XLA's GPU scheduler plans collectives with: "
                 "appends jaxfuse.xla_flags(...) to XLA_FLAGS. Give about "
                 "half the link's speed (1.5 for NCCL over 25-30 Gbit/s "
                 "Ethernet, which moves about 3 GB/s)")
  p.add_argument("--flush-every", type=int, default=0,
                 help="every N-th step sends everything (a density-1 step: "
                 "one dense all-reduce pays every residual back)")
  p.add_argument("--eval-every", type=int, default=0,
                 help="validation loss every N steps too (0: at the end)")
  p.add_argument("--strategy", default="size",
                 choices=[s for s in (jaxfuse.STRATEGIES +
                                      jaxfuse.COST_STRATEGIES)
                          if s != "behind"],
                 help="plan strategy for --sync jaxfuse (default size, the "
                 "README recipe's; the cost-model ones need --costs)")
  p.add_argument("--costs", help="costs JSON from `jaxfuse profile`")
  p.add_argument("--collective", choices=["allgather", "zen", "spardl"],
                 help="the sparse buckets' scheme (jaxfuse.collectives); "
                 "default: per bucket, the lossless one that sends the "
                 "fewest bytes on the run's K workers (jaxfuse.plan(..., "
                 "num_workers=K): the all-gather on few workers, ZEN as K "
                 "grows)")
  p.add_argument("--spardl-block", type=float, default=2.0,
                 help="spardl: slots per block over the balanced share C/K")
  p.add_argument("--num-buckets", type=int, default=4,
                 help="buckets for --strategy aligned/safusion")
  p.add_argument("--bucket-bytes", type=int,
                 help="dense bytes per bucket for --strategy size (default "
                 f"{SIZE_BUCKET_BYTES // 2**20} MiB) and behind (default "
                 "jaxfuse.plan's)")
  p.add_argument("--plan", help="a plan JSON (`jaxfuse plan`) to use instead "
                 "of making one; implies --sync jaxfuse")
  p.add_argument("--estimator", default="dgc", choices=jaxfuse.plans.ESTIMATORS)
  p.add_argument("--headroom", type=float, default=PLAN_HEADROOM,
                 help="slots per sparse leaf ⌈ρ·n·headroom⌉ (sampled "
                 "estimators; the sparse wire's bytes scale with it; "
                 f"default {PLAN_HEADROOM:g}, jaxfuse.plan's)")
  p.add_argument("--kernels", default="auto", choices=jaxfuse.kernels.BACKENDS,
                 help="selection kernels: Pallas on GPU (auto), or force one")
  p.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
  p.add_argument("--steps", type=int, help="default: the preset's")
  p.add_argument("--batch-size", type=int,
                 help="global batch; default: the preset's")
  p.add_argument("--seq-len", type=int, help="default: the preset's")
  p.add_argument("--lr", type=float, help="peak learning rate")
  p.add_argument("--weight-decay", type=float, default=0.01)
  p.add_argument("--b2", type=float,
                 help="Adam's beta2, of the AdamW family and of --sync "
                 "dense's AdamW (default: 0.999)")
  p.add_argument("--freeze-v-at", type=int, metavar="N",
                 help="--sync dense with an AdamW twin: Adam's second moment "
                 "stops updating after N steps (1-bit Adam's frozen v, "
                 "without any compression): the recipe's dense phase alone")
  p.add_argument("--clip", type=float, default=1.0,
                 help="global-norm clip (0: off): of the mean gradient for "
                 "--sync dense; the recipes' clip_norm otherwise (each "
                 "worker's gradient per bucket at its share of clip x "
                 "sqrt(workers), jaxfuse.clipping; onebit_adamw's dense "
                 "phase clips the mean)")
  p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                 help="compute dtype (parameters stay float32)")
  p.add_argument("--grad-dtype", choices=("float32", "bfloat16"),
                 default="float32",
                 help="gradient dtype: bfloat16 differentiates a bfloat16 "
                 "copy of the float32 parameters, so the sync (dense or "
                 "sparse) moves bfloat16")
  p.add_argument("--residual-dtype", choices=jaxfuse.plans.RESIDUAL_DTYPES,
                 default="float32",
                 help="jaxfuse residuals of bfloat16 gradients: float32, or "
                 "the gradient's dtype (Settings.residual_dtype)")
  p.add_argument("--devices", type=int, help="default: all")
  p.add_argument("--simulated-workers", type=int, default=0, metavar="K",
                 help="K data-parallel workers simulated on one device "
                 "(jaxfuse.simulated_mesh): the same steps as K devices, "
                 "run one after another; the batch splits over the K")
  p.add_argument("--cpu-devices", type=int, default=8,
                 help="simulated CPU devices; read before jax is imported, "
                 "so only when run as a script")
  p.add_argument("--pipeline", choices=("auto", "on", "off"),
                 default="auto",
                 help="queue each step before reading the last one's loss "
                 "(not after a step that logs, evaluates, saves or checks "
                 "--dense-settle), so the host's time between steps hides "
                 "behind the GPU's; the same results. auto: on GPUs only "
                 "(XLA's CPU collectives can deadlock with steps queued)")
  p.add_argument("--log-every", type=int, default=25)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--eval-batches", type=int, default=8)
  p.add_argument("--corpus-mb", type=float, default=8.0)
  p.add_argument("--xla-option", action="append", metavar="NAME=VALUE",
                 help="XLA compile option for the train step (repeatable), "
                 "e.g. xla_gpu_all_reduce_combine_threshold_bytes=0 "
                 "(docs/benchmarks.md: the overlap study); added to "
                 "jaxfuse.xla_options()")
  p.add_argument("--xla-defaults", action="store_true",
                 help="compile the train step without jaxfuse.xla_options() "
                 "(on GPU: keep XLA's command buffers)")
  p.add_argument("--checkpoint-dir",
                 help="save the train state here (jaxfuse.checkpoint, orbax)")
  p.add_argument("--checkpoint-every", type=int, default=0,
                 help="save every N steps (0: at the end only)")
  p.add_argument("--resume", action="store_true",
                 help="continue from the latest checkpoint in "
                 "--checkpoint-dir (same flags as the run that saved it)")
  p.add_argument("--trace-dir",
                 help="record a jax.profiler trace of --trace-steps here "
                 "(perfetto_trace.json.gz; `jaxfuse show PLAN --measured "
                 "DIR` reads it). Traced steps are waited for one by one")
  p.add_argument("--trace-steps", type=_step_range, metavar="A:B",
                 help="with --trace-dir: trace steps A to B-1 (default: "
                 "the last five; keep a phase's first step, which "
                 "compiles, out)")
  p.add_argument("--json-out", help="results JSON (written by process 0)")
  p.add_argument("--coordinator", metavar="HOST:PORT",
                 help="jax.distributed: process 0's address (with "
                 "--num-processes and --process-id; SLURM and Open MPI need "
                 "none of the three)")
  p.add_argument("--num-processes", type=int)
  p.add_argument("--process-id", type=int)
  args = p.parse_args(argv)
  _check_numbers(p, args)
  if args.local_steps < 0 or args.local_steps and (
      args.sync != "jaxfuse" or args.delay or args.flush_every or
      args.optimizer != p.get_default("optimizer")):
    p.error(f"--local-steps {args.local_steps}: give H >= 1 inner steps, "
            "with the jaxfuse --sync, its own AdamW inner steps (no "
            "--optimizer) and without --delay or --flush-every")
  if args.local_steps:   # the run's JSON and log name it
    args.optimizer = "local_steps"
  if args.optimizer == "onebit_adamw" and args.sync != "dense" and (
      args.dense_warmup == 0):
    p.error("--optimizer onebit_adamw freezes Adam's second moment after a "
            "dense warm-up: give --dense-warmup N (the README recipe: 10% "
            "of the steps)")
  adam = args.optimizer not in ("sgd", "demo")
  if args.b2 is not None and not (adam and 0 <= args.b2 < 1):
    p.error(f"--b2 {args.b2:g}: Adam's beta2, in [0, 1), of the AdamW "
            f"family (not --optimizer {args.optimizer})")
  if args.freeze_v_at is not None and not (
      args.sync == "dense" and adam and args.freeze_v_at >= 1):
    p.error(f"--freeze-v-at {args.freeze_v_at}: give N >= 1 with --sync "
            "dense and an AdamW optimizer (onebit_adamw's sparse phases "
            "freeze v themselves)")
  if args.momentum is not None and args.optimizer not in ("sgd", "demo"):
    p.error(f"--momentum is sgd's and demo's; --optimizer "
            f"{args.optimizer} has none (its betas are fixed)")
  if args.outer_lr is not None and not (args.local_steps and
                                        args.outer_lr > 0):
    p.error("--outer-lr is --local-steps' outer learning rate: give "
            "--local-steps H and a rate > 0")
  if args.plan and args.sync != "jaxfuse":
    p.error(f"--plan is a jaxfuse plan; --sync {args.sync} makes none "
            "(leave --sync out, or leave --plan out)")
  for flag, path in (("--plan", args.plan), ("--costs", args.costs)):
    if path and not os.path.isfile(path):
      p.error(f"{flag} {path}: no such file")
  if args.json_out and not os.path.isdir(
      os.path.dirname(os.path.abspath(args.json_out))):
    p.error(f"--json-out {args.json_out}: its folder does not exist (make "
            "it first: the results are written at the end of the run)")
  if args.checkpoint_dir and os.path.isfile(args.checkpoint_dir):
    p.error(f"--checkpoint-dir {args.checkpoint_dir} is a file; give a "
            "folder (made if missing)")
  if args.apply_if_finite is not None and args.apply_if_finite < 0:
    p.error(f"--apply-if-finite {args.apply_if_finite}: give the number of "
            "skips in a row (>= 0) after which a step is applied anyway")
  if args.delay and args.sync == "dense":
    p.error("--delay delays a jaxfuse recipe; --sync dense has none")
  if args.predict and not args.delay:
    p.error("--predict predicts where a delayed gradient lands: add --delay")
  if args.dense_settle is not None:
    if not (args.optimizer == "onebit_adamw" and args.sync != "dense"):
      p.error("--dense-settle ends onebit_adamw's dense warm-up; give "
              "--optimizer onebit_adamw (and a jaxfuse --sync)")
    if not args.dense_settle > 0 or args.dense_settle_every < 1:
      p.error("--dense-settle needs a tolerance > 0 and "
              "--dense-settle-every >= 1")
    if args.checkpoint_dir:
      p.error("--dense-settle with --checkpoint-dir: a resumed run could "
              "not know where the dense phase ended; give a fixed "
              "--dense-warmup instead")
  if isinstance(args.warmup_steps, list) and (
      not isinstance(args.warmup_densities, list) or
      len(args.warmup_densities) != len(args.warmup_steps)):
    p.error(f"--warmup-steps {','.join(map(str, args.warmup_steps))}: one "
            "count per --warmup-densities entry; give as many densities as "
            "a list (e.g. --warmup-densities 0.25,0.0625: the default and "
            "dgc have as many as lie above the plan's density)")
  if not args.headroom >= 1:
    p.error(f"--headroom {args.headroom:g}: give a number >= 1 (slots per "
            f"sparse leaf over the ⌈ρ·n⌉ it selects; {PLAN_HEADROOM:g} by "
            "default)")
  if args.send_early_window is not None and args.send_early_window < 0:
    p.error(f"--send-early-window {args.send_early_window}: give a number "
            "of points >= 1, or 0 for no bound")
  if args.send_early_window is not None and not args.send_early:
    p.error("--send-early-window sets --send-early's window; give "
            "--send-early too")
  if args.send_early_window is None:
    args.send_early_window = SEND_EARLY_WINDOW
  if (args.bucket_bytes is None and args.strategy == "size" and
      args.sync == "jaxfuse" and not args.plan):
    args.bucket_bytes = SIZE_BUCKET_BYTES
  if args.trace_steps is not None and not args.trace_dir:
    p.error("--trace-steps picks the steps --trace-dir records; give "
            "--trace-dir too")
  if args.network_gbytes_s is not None and not args.network_gbytes_s > 0:
    p.error(f"--network-gbytes-s {args.network_gbytes_s:g}: give the "
            "network's bandwidth in GB/s, a number > 0")
  return args


def _check_numbers(p, args) -> None:
  """``p.error`` for counts and sizes out of range (0 would otherwise read
  as "the preset's", a negative step count fail deep inside)."""
  positive = (("--steps", args.steps), ("--batch-size", args.batch_size),
              ("--seq-len", args.seq_len), ("--lr", args.lr),
              ("--bucket-bytes", args.bucket_bytes),
              ("--log-every", args.log_every))
  for flag, value in positive:
    if value is not None and not value > 0:
      p.error(f"{flag} {value:g}: give a number > 0" + (
          " (leave it out for the preset's)" if flag in (
              "--steps", "--batch-size", "--seq-len", "--lr") else ""))
  for flag, value in (("--eval-every", args.eval_every),
                      ("--eval-batches", args.eval_batches),
                      ("--checkpoint-every", args.checkpoint_every),
                      ("--dense-warmup", args.dense_warmup)):
    if value is not None and value < 0:
      p.error(f"{flag} {value}: give a number >= 0")
  if not args.corpus_mb >= 0.1:
    p.error(f"--corpus-mb {args.corpus_mb:g}: give at least 0.1 (MB of the "
            "standard library's source to train and validate on)")
  if args.simulated_workers < 0:
    p.error(f"--simulated-workers {args.simulated_workers}: give K >= 1 "
            "(or leave it out for real devices)")
  if args.simulated_workers and (args.devices or args.coordinator or
                                 args.num_processes):
    p.error("--simulated-workers runs every worker on one device of one "
            "process; leave out --devices, --coordinator and "
            "--num-processes")
  if not 0 < args.density <= 1:
    p.error(f"--density {args.density:g}: give a share of each sparse "
            "leaf in (0, 1]")


def resolve_warmup_steps(args, steps: int) -> None:
  """``--dense-warmup`` and ``--warmup-steps`` left out: the README
  recipe's for onebit_adamw (10 % of the steps dense, then 5 % at each
  warm-up density), none for the other optimizers. A ``--dense-warmup``
  as long as the run is refused: no step would be sparse."""
  onebit = args.optimizer == "onebit_adamw"
  given = args.dense_warmup is not None
  if not given:
    args.dense_warmup = max(1, steps // 10) if onebit else 0
  if args.warmup_steps is None:
    args.warmup_steps = steps // 20 if onebit else 0
  if given and args.sync != "dense" and args.dense_warmup >= steps:
    raise SystemExit(f"--dense-warmup {args.dense_warmup} covers all {steps} "
                     "steps, so no step would be sparse: give fewer dense "
                     "steps, or --sync dense for dense training")


def scheme_of(args):
  """``--collective`` with its options as a scheme object
  (``--packed-indices`` for an all-gather, alone or under hier;
  ``--spardl-block`` for SparDL); under ``--strategy auto``, which may
  pick any scheme per bucket, a tuple that configures those too."""
  if args.collective is None and args.strategy != "auto" and not (
      args.packed_indices):
    return None    # jaxfuse.plan's pick for K (plan_options' num_workers)
  gather = jaxfuse.collectives.AllGather(packed_indices=args.packed_indices)
  spardl = jaxfuse.collectives.SparDL(block=args.spardl_block)
  scheme = {"allgather": gather, "zen": jaxfuse.collectives.Zen(),
            "spardl": spardl, "hier": jaxfuse.collectives.Hier(inner=gather),
            None: gather}[args.collective]
  if args.strategy != "auto":
    return scheme
  return (scheme,) + tuple(s for s in (gather, spardl) if s.name != scheme.name)


def plan_options(args, num_workers: int | None = None) -> dict:
  """``jaxfuse.plan``'s keyword arguments from the command line, for
  ``num_workers`` = K workers (None: not said)."""
  options = dict(
      density=args.density,
      strategy="behind" if args.sync == "behind" else args.strategy,
      estimator=args.estimator, collective=scheme_of(args),
      settings=jaxfuse.Settings(
          headroom=args.headroom, seed=args.seed,
          residual_dtype=args.residual_dtype,
          sparse_wire=args.sparse_wire or "gradient"),
      num_buckets=args.num_buckets, costs=args.costs)
  if num_workers is not None and (options["collective"] is None or
                                  args.costs is not None):
    options["num_workers"] = num_workers
  if args.bucket_bytes:
    options["bucket_bytes"] = args.bucket_bytes
  return options


def warmup_phases(args, plan, dense_steps: int, k: int) -> tuple:
  """The run's phases: ``dense_steps`` dense, then the warm-up densities
  (``"dgc"``: ``density_warmup``'s default, DGC's ramp)."""
  densities = args.warmup_densities
  return jaxfuse.density_warmup(
      plan, steps=args.warmup_steps,
      densities=None if densities == "dgc" else densities,
      dense_steps=dense_steps, dense_wire=args.dense_wire, workers=k)


def warmup_line(args, phases, steps: int, k: int) -> str:
  """'warm-up: steps 0-30 density 1, ...', naming a warm-up density that
  runs dense on K workers (``density_warmup``'s ``workers``)."""
  ran = [p.plan.provenance.get("phase_density", args.density)
         for p in phases]
  line = "warm-up: " + ", ".join(f"steps {p.start}-{p.stop or steps} "
                                 f"density {d:g}" for p, d in zip(phases, ran))
  asked = args.warmup_densities
  dense = ([] if asked == "dgc" or not args.warmup_steps else
           [d for d in asked if not any(abs(d - r) < 1e-12 for r in ran)])
  if dense:
    line += (f" (density {', '.join(f'{d:g}' for d in dense)} runs dense "
             f"on {k} workers: its all-gather would receive at least a "
             "dense step's bytes)")
  return line


def trace_steps(args, start: int, steps: int) -> range:
  """The steps ``--trace-dir`` records: ``--trace-steps A:B`` (A to B-1),
  by default the last five; empty without ``--trace-dir``."""
  if not args.trace_dir:
    return range(0)
  first, stop = args.trace_steps or (max(start, steps - 5), steps)
  if not start <= first < stop <= steps:
    raise SystemExit(f"--trace-steps {first}:{stop}: give steps within "
                     f"this run's {start}:{steps} (A:B traces steps A to "
                     "B-1)")
  return range(first, stop)


def trace_dir(args) -> str:
  """``--trace-dir``, one folder per process where there are several."""
  return (args.trace_dir if jax.process_count() == 1 else
          os.path.join(args.trace_dir, f"process_{jax.process_index()}"))
