"""The ``jaxfuse`` command: measure costs, make plans, look at them.

  jaxfuse profile [-o costs.json] [--model MODULE:FUNCTION] [--sizes ...]
  jaxfuse plan MODULE:FUNCTION [--density 0.01] [--strategy auto]
               [--costs costs.json] [-o plan.json]
  jaxfuse show plan.json [--costs costs.json] [--overlap ETA] [-o timeline.png]
  jaxfuse show plan.json --measured TRACE [--costs costs.json] [-o out.png]

MODULE:FUNCTION names a function taking no arguments that returns either the
parameter pytree, or a tuple ``(loss_fn, params, *example_args)``: a model
(``loss_fn(params, *example_args)`` is one worker's loss) and a sample batch.
MODULE is a module importable from the current directory (``mymodel``,
``pkg.models``) or a ``.py`` file path.

Bad arguments, files or model functions give a one-line message on stderr
and exit status 2 (``--debug`` shows the traceback instead). Also runs as
``python -m jaxfuse``. The file formats and the profiling method:
docs/cli.md.

Here: the parser, ``main``, ``profile`` and ``plan``; ``show`` and its tables
in ``cli_show``; arguments, model functions and files in ``cli_io``.
"""

from __future__ import annotations

import argparse
import inspect
import math
import os
import sys
from typing import Sequence

from jaxfuse import plans
from jaxfuse.planning.cli_io import Parser
from jaxfuse.planning.cli_io import UsageError
from jaxfuse.planning.cli_io import check_output
from jaxfuse.planning.cli_io import load_costs
from jaxfuse.planning.cli_io import load_model
from jaxfuse.planning.cli_io import ms
from jaxfuse.planning.cli_io import parse_size
from jaxfuse.planning.cli_io import positive_int
from jaxfuse.planning.cli_io import save
from jaxfuse.planning.cli_io import unit_float
from jaxfuse.planning.cli_show import bytes_line
from jaxfuse.planning.cli_show import host_mesh
from jaxfuse.planning.cli_show import cmd_show
from jaxfuse.planning.cli_show import measured_table
from jaxfuse.planning.cli_show import plan_table

# UsageError, parse_size, load_model, plan_table, measured_table and cmd_show
# are re-exported: cli was one module up to 0.2.
__all__ = ["EXIT_USAGE", "PLAN_OPTIONS", "UsageError", "build_parser",
           "cmd_plan", "cmd_profile", "cmd_show", "format_costs",
           "load_model", "main", "measured_table", "parse_size",
           "plan_table"]

EXIT_USAGE = 2


# --- profile ------------------------------------------------------------------

def format_costs(costs) -> str:
  """A few lines: the fitted lines, γ, η, forward and backward."""
  def line(c, unit):
    per = f"{c.beta * 1e9:.4g} ns/{unit}"
    if unit == "byte" and c.beta > 0:
      per += f" ({1 / c.beta / 1e9:.3g} GB/s)"
    return f"α = {c.alpha * 1e6:.3g} µs, β = {per}"
  lines = [f"  {name:9s} {line(c, 'byte')}"
           for name, c in costs.collectives.items()]
  lines.append(f"  compress  {line(costs.compress, 'element')}")
  # A costs file from before these were profiled reads them as 0: say so.
  if costs.bucket or "bucket" in costs.provenance:
    lines.append(f"  bucket    {costs.bucket * 1e6:.3g} µs per sparse bucket")
  else:
    lines.append("  bucket    not measured (taken as 0; `jaxfuse profile` "
                 "measures it)")
  lines += [f"  {name:9s} compute {line(c, 'slot')}"
            for name, c in costs.schemes.items()]
  from jaxfuse.planning.costs import SCHEMES  # pylint: disable=g-import-not-at-top
  unmeasured = [s for s in SCHEMES if s not in costs.schemes]
  if unmeasured:
    lines.append(f"  {', '.join(unmeasured)} compute not measured (taken "
                 "as 0 beyond their wire steps)")
  lines.append(f"  contention γ = {costs.contention:.3f}, overlap η = "
               f"{costs.overlap:.3f}")
  if costs.backward:
    lines.append(f"  forward {ms(costs.forward)}, backward "
                 f"{ms(sum(costs.backward))} over {len(costs.backward)} "
                 "leaves")
  else:
    lines.append("  no model: no forward/backward times (profile with "
                 "--model to plan with compute overlap)")
  return "\n".join(lines)


def cmd_profile(args) -> int:
  import jax  # pylint: disable=g-import-not-at-top
  check_output(args.output, "costs")   # before minutes of measuring
  if args.cpu_devices:
    try:
      jax.config.update("jax_num_cpu_devices", args.cpu_devices)
    except Exception as e:  # the backend is already up
      raise UsageError(f"--cpu-devices: {e}; set JAX_NUM_CPU_DEVICES="
                       f"{args.cpu_devices} in the environment instead.") from e
  from jaxfuse import _compat  # pylint: disable=g-import-not-at-top
  from jaxfuse.planning import profiling  # pylint: disable=g-import-not-at-top
  for flag, sweep in (("--sizes", args.sizes),
                      ("--compress-sizes", args.compress_sizes)):
    if sweep is not None and len(set(sweep)) < 2:
      raise UsageError(f"{flag} needs at least two distinct sizes (one size "
                       "cannot separate latency α from cost per unit β).")
  loss_fn = params = None
  example_args = ()
  if args.model:
    loss_fn, params, example_args = load_model(args.model)
    if loss_fn is None:
      raise UsageError(f"--model {args.model}: the function returned only "
                       "params; profiling needs (loss_fn, params, "
                       "*example_args) to time the backward pass.")
    _check_loss(args.model, loss_fn, params, example_args)
  kw = dict(model=(None if loss_fn is None else
                   profiling.Model(loss_fn, params, example_args)),
            sweep=profiling.Sweep(args.sizes, args.compress_sizes,
                                  profiling.Timing(args.repeats, args.warmup,
                                                   args.chain)),
            compression=profiling.Compression(args.estimator, args.density),
            progress=None if args.quiet else profiling.text_progress())
  dev = jax.devices()[0]
  if args.link:   # one device's compute, the network given
    from jaxfuse.planning import predict  # pylint: disable=g-import-not-at-top
    print(f"profiling the compute on one {dev.platform} ({dev.device_kind});"
          f" the link: {args.link[0]:g} GB/s, {args.link[1]:g} s a message",
          file=sys.stderr)
    measure = lambda: predict.profile_on_link(*args.link, **kw)
  else:
    try:
      mesh = _compat.make_mesh(args.devices)
    except ValueError as e:
      raise UsageError(f"--devices: {e}") from e
    if mesh.devices.size < 2:
      raise UsageError(
          "profiling needs at least 2 devices: on one, the collectives move "
          "nothing and there is no communication to measure. Give --devices "
          "2 or more, or the network as --link GB/S,LATENCY_S" + (
              "" if jax.device_count() > 1 else
              " (this machine shows one device; on a CPU, simulate more "
              "with --cpu-devices 8)") + ".")
    print(f"profiling on {mesh.devices.size} x {dev.platform} "
          f"({dev.device_kind})", file=sys.stderr)
    measure = lambda: profiling.profile(mesh, **kw)
  try:
    costs = measure()
  except profiling.ProfileError as e:
    raise UsageError(str(e)) from e
  except Exception as e:  # pylint: disable=broad-except
    if not isinstance(e, MemoryError) and "RESOURCE_EXHAUSTED" not in str(e):
      raise
    raise UsageError(
        f"out of memory while profiling ({type(e).__name__}: "
        f"{str(e).splitlines()[0] if str(e) else 'no details'}); give "
        "smaller --sizes (bytes per worker) and --compress-sizes "
        "(elements), e.g. --sizes 4K 64K 1M --compress-sizes 4K 64K.") from e
  save(costs, args.output, "costs")
  print(f"saved {args.output}\n{format_costs(costs)}")
  return 0


def parse_link(text: str) -> tuple[float, float]:
  """``--link GB/S,LATENCY_S`` -> (GB/s, seconds a message).

  Args:
    text: the flag's value, e.g. ``"1.25,3e-4"``.

  Returns:
    (bandwidth in GB/s, latency in seconds).

  Raises:
    argparse.ArgumentTypeError: not two numbers, a bandwidth <= 0, a
      latency < 0, or either not finite.
  """
  try:
    gbytes, latency = (float(x) for x in text.split(","))
  except ValueError:
    raise argparse.ArgumentTypeError(
        f"{text!r}: give GB/S,LATENCY_S, e.g. 1.25,3e-4 for 10 Gbit/s and "
        "3e-4 s a message") from None
  if not (gbytes > 0 and latency >= 0 and math.isfinite(gbytes + latency)):
    raise argparse.ArgumentTypeError(
        f"{text!r}: the bandwidth must be > 0 GB/s and the latency >= 0 s")
  return gbytes, latency


def _check_loss(spec: str, loss_fn, params, example_args) -> None:
  """Trace the model's loss and gradient (no compiling, no running), so a
  loss that fails is one line before minutes of measuring."""
  import jax  # pylint: disable=g-import-not-at-top
  from jaxfuse.planning import ordering  # pylint: disable=g-import-not-at-top
  try:
    ordering.check_scalar_loss(loss_fn, params, *example_args)
  except ordering.LossOutputError as e:
    raise UsageError(f"--model {spec}: {e}") from e
  except Exception:  # pylint: disable=broad-except
    pass   # the loss itself fails: reported below, with its arguments
  try:
    jax.eval_shape(jax.value_and_grad(loss_fn), params, *example_args)
  except Exception as e:  # the user's code: report it in one line
    raise UsageError(f"--model {spec}: jax.value_and_grad(loss_fn)(params, "
                     f"*example_args) raised {type(e).__name__}: {e}; fix "
                     "the loss, or return the example batch it takes.") from e


# --- plan ---------------------------------------------------------------------

PLAN_OPTIONS = ("density", "strategy", "estimator", "num_buckets",
                "bucket_bytes", "last_bucket_bytes", "headroom",
                "min_sparse_size", "collective", "sparse_wire",
                "packed_indices", "num_workers")
# The options of PLAN_OPTIONS that jaxfuse.plan takes in settings=Settings().
PLAN_SETTINGS = ("headroom", "min_sparse_size", "sparse_wire")


def _strategies() -> tuple[str, ...]:
  from jaxfuse.planning import planner  # pylint: disable=g-import-not-at-top
  return tuple(planner.STRATEGIES) + tuple(getattr(planner, "COST_STRATEGIES",
                                                   ()))


def _check_strategy(args, strategy: str | None) -> None:
  """The strategy's needs in the CLI's words (``jaxfuse.plan`` names its
  Python arguments)."""
  from jaxfuse.planning import planner  # pylint: disable=g-import-not-at-top
  rules = ", ".join(planner.STRATEGIES)
  if strategy not in planner.COST_STRATEGIES:
    return
  if not args.costs:
    raise UsageError(f"--strategy {strategy} chooses the buckets from "
                     "measured costs: give --costs COSTS.json (from "
                     "`jaxfuse profile --model MODULE:FUNCTION`), or "
                     f"another --strategy: {rules}.")
  if args.last_bucket_bytes is not None:
    which = (f"--strategy {strategy}" if args.strategy else
             f"--strategy {strategy} (the default with --costs)")
    raise UsageError(f"--last-bucket-bytes cuts a rule strategy's last "
                     f"group, but {which} chooses its groups from the "
                     "costs; leave --last-bucket-bytes out, or give "
                     f"--strategy one of {rules}.")


def cmd_plan(args) -> int:
  import jaxfuse  # pylint: disable=g-import-not-at-top
  from jaxfuse.planning import simulate  # pylint: disable=g-import-not-at-top
  kwargs = {k: getattr(args, k) for k in PLAN_OPTIONS
            if getattr(args, k) is not None}
  if kwargs.pop("packed_indices", False):   # the scheme's own knob
    name = kwargs.get("collective", "allgather")
    packed = jaxfuse.collectives.AllGather(packed_indices=True)
    if name in ("allgather", "hier"):   # ZEN and SparDL keep int32
      kwargs["collective"] = (packed if name == "allgather" else
                              jaxfuse.collectives.Hier(inner=packed))
  settings = {k: kwargs.pop(k) for k in PLAN_SETTINGS if k in kwargs}
  if settings:
    kwargs["settings"] = jaxfuse.Settings(**settings)
  costs = None
  check_output(args.output, "plan")
  if args.overlap is not None and not args.costs:
    raise UsageError("--overlap replaces the costs' η: give --costs "
                     "COSTS.json too.")
  if args.costs and (os.path.realpath(args.costs) ==
                     os.path.realpath(args.output)):
    raise UsageError(f"-o {args.output} is the --costs file; the plan "
                     "would overwrite the costs. Give -o another name "
                     "(e.g. plan.json).")
  if args.costs:
    if "costs" not in inspect.signature(jaxfuse.plan).parameters:
      raise UsageError("--costs: this jaxfuse's plan() takes no costs yet; "
                       "update jaxfuse or leave --costs out.")
    costs = load_costs(args.costs)
    if args.overlap is not None:
      costs = costs.replace(overlap=args.overlap)
    kwargs["costs"] = costs
    if "strategy" not in kwargs and "auto" in _strategies():
      kwargs["strategy"] = "auto"
  _check_strategy(args, kwargs.get("strategy"))
  workers = args.num_workers or (costs and costs.workers)
  mesh = host_mesh(workers, args.local)   # refused before planning
  loss_fn, params, example_args = load_model(args.model)
  if loss_fn is not None:
    kwargs["order"] = jaxfuse.planning.ordering.FromLoss(
        loss_fn, tuple(example_args))
  try:
    plan = jaxfuse.plan(params, **kwargs)
  except (ValueError, TypeError) as e:  # PlanError, CostsError
    raise UsageError(f"plan: {e}") from e
  save(plan, args.output, "plan")
  sparse = sum(l.mode == "sparse" for l in plan.leaves)
  print(f"saved {args.output}: {len(plan.leaves)} leaves ({sparse} sparse), "
        f"{len(plan.buckets)} buckets, strategy "
        f"{plan.provenance.get('strategy')}, ready order from "
        f"{plan.provenance.get('ready_order')}")
  print("  " + bytes_line(plan, workers, mesh))
  if costs is not None and len(costs.backward) == len(plan.leaves):
    t = simulate.simulate(plan, costs, workers)   # on the K planned for
    winner = plan.provenance.get("auto", {}).get("winner")
    print(f"  predicted step {ms(t.iteration)}, communication "
          f"{ms(t.communication)} ({100 * t.overlap_ratio:.0f}% hidden)" +
          (f"; auto chose {winner}" if winner else ""))
  print(f"  see it with: jaxfuse show {args.output}" +
        (f" --costs {args.costs}" if args.costs else ""))
  return 0

# --- the parser ---------------------------------------------------------------

def _plan_default(name: str) -> str:
  """' (default: X)' for ``jaxfuse.plan``'s argument ``name`` (or its
  ``settings``' field ``name``)."""
  from jaxfuse.planning import planner  # pylint: disable=g-import-not-at-top
  parameters = inspect.signature(planner.plan).parameters
  value = (parameters[name].default if name in parameters else
           getattr(parameters["settings"].default, name))
  if name.endswith("bytes"):
    value = f"{value // 2**20}M"
  return f" (default: {value})"


def build_parser() -> argparse.ArgumentParser:
  from jaxfuse.version import __version__  # pylint: disable=g-import-not-at-top
  fmt = argparse.RawDescriptionHelpFormatter
  p = Parser(prog="jaxfuse", formatter_class=fmt, description=(
      "Sparse, fused gradient synchronization for JAX: measure the costs of "
      "this machine, make a plan for a model, and look at it.\n\n"
      "  jaxfuse profile -o costs.json --model mymodel:make\n"
      "  jaxfuse plan mymodel:make --costs costs.json -o plan.json\n"
      "  jaxfuse show plan.json --costs costs.json -o timeline.png\n"
      "  jaxfuse show plan.json --measured LOG_DIR --costs costs.json -o "
      "both.png\n\n"
      "MODULE:FUNCTION: a function of no arguments returning the params, or "
      "(loss_fn, params, *example_args). Details: docs/cli.md."))
  p.add_argument("--version", action="version",
                 version=f"jaxfuse {__version__}")
  p.add_argument("--debug", action="store_true",
                 help="show Python tracebacks instead of one-line errors")
  sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)

  pr = sub.add_parser(
      "profile", formatter_class=fmt,
      help="measure the cost model on the current devices",
      description=(
          "Measure the cost model on the current devices and save it as "
          "JSON: collective times α + β·bytes (all_gather, psum, all_to_all, "
          "ppermute) over the "
          "mesh's data axis, compression time α + β·elements, the "
          "contention γ of two simultaneous collectives, and the overlap η "
          "XLA achieves between backward compute and communication. With "
          "--model also the forward time and per-leaf backward times (the "
          "program's costs, scaled to one measured backward pass)."))
  pr.add_argument("-o", "--output", default="costs.json",
                  help="where to write the costs (default: %(default)s)")
  pr.add_argument("--link", type=parse_link, metavar="GB/S,LATENCY_S",
                  help="the network, given: measure only this device's "
                  "compute (one device is enough) and take the collectives "
                  "as the ring on a link of GB/S (G Gbit/s: G/8) and "
                  "LATENCY_S seconds a message; the overlap eta is 0")
  pr.add_argument("--model", metavar="MODULE:FUNCTION",
                  help="function returning (loss_fn, params, *example_args): "
                  "measure forward, per-leaf backward and η on it")
  pr.add_argument("--sizes", nargs="+", type=parse_size, metavar="SIZE",
                  help="collective sizes in bytes per worker, e.g. 4K 64K 1M "
                  "(default: 4K..2M on CPU, 4K..64M elsewhere)")
  pr.add_argument("--compress-sizes", nargs="+", type=parse_size,
                  metavar="SIZE", help="compression sizes in elements "
                  "(default: 4K..256K on CPU, 4K..16M elsewhere)")
  pr.add_argument("--repeats", type=positive_int, default=5,
                  help="timed runs per point; the median is kept "
                  "(default: %(default)s)")
  pr.add_argument("--warmup", type=positive_int, default=2,
                  help="untimed runs first, compilation included "
                  "(default: %(default)s)")
  pr.add_argument("--chain", type=positive_int, default=4,
                  help="dependent collectives per timed run, so dispatch is "
                  "not counted as latency (default: %(default)s)")
  pr.add_argument("--estimator", default="dgc",
                  help="threshold estimator timed for compression "
                  "(default: %(default)s)")
  pr.add_argument("--density", type=unit_float, default=0.01,
                  help="density of the timed compression (default: "
                  "%(default)s)")
  pr.add_argument("--devices", type=positive_int,
                  help="mesh size (default: every device)")
  pr.add_argument("--cpu-devices", type=positive_int,
                  help="simulate this many CPU devices (like "
                  "JAX_NUM_CPU_DEVICES)")
  pr.add_argument("-q", "--quiet", action="store_true",
                  help="no progress bar")
  pr.set_defaults(run=cmd_profile)

  pl = sub.add_parser(
      "plan", formatter_class=fmt, help="make a plan for a model",
      description=(
          "Make a plan (which leaves go sparse, their capacities, the "
          "buckets and their collectives) for the model MODULE:FUNCTION and "
          "save it as JSON. If FUNCTION returns (loss_fn, params, "
          "*example_args), the buckets follow the backward-ready order read "
          "from the gradient's program. Options left out take "
          "jaxfuse.plan()'s defaults; with --costs the strategy defaults to "
          "auto."))
  pl.add_argument("model", metavar="MODULE:FUNCTION",
                  help="function returning params, or (loss_fn, params, "
                  "*example_args)")
  pl.add_argument("-o", "--output", default="plan.json",
                  help="where to write the plan (default: %(default)s)")
  pl.add_argument("--costs", metavar="COSTS.json",
                  help="costs from `jaxfuse profile --model` for this model "
                  "(needed by the cost-model strategies)")
  pl.add_argument("--overlap", metavar="ETA",
                  type=lambda t: unit_float(t, low_open=False),
                  help="plan for this overlap η in [0, 1] instead of the "
                  "costs' (profiled on the plain step): the share of what "
                  "the ideal schedule would hide that your step hides, e.g. "
                  "under send_early (`jaxfuse show --measured TRACE`)")
  pl.add_argument("--density", type=unit_float,
                  help="share of each sparse leaf sent per step, in (0, 1]"
                  + _plan_default("density"))
  pl.add_argument("--strategy", help="how to cut the leaves into buckets: "
                  + ", ".join(_strategies()) + " (default: auto with "
                  "--costs, else aligned; single for --workers 1)")
  pl.add_argument("--estimator", help="threshold estimator: topk, dgc, "
                  "gaussian, redsync, sidco" + _plan_default("estimator"))
  pl.add_argument("--num-buckets", type=positive_int,
                  help="buckets of the aligned strategy"
                  + _plan_default("num_buckets"))
  pl.add_argument("--bucket-bytes", type=parse_size,
                  help="dense bytes per bucket of the size strategy, e.g. "
                  "25M" + _plan_default("bucket_bytes"))
  pl.add_argument("--last-bucket-bytes", type=parse_size,
                  help="cut a rule strategy's last group so that its final "
                  "part holds at most this many bytes, e.g. 16M (under "
                  "send_early on a slow network, what the step waits for "
                  "at its end)")
  pl.add_argument("--headroom", type=float,
                  help="capacity over target count, >= 1"
                  + _plan_default("headroom"))
  pl.add_argument("--min-sparse-size", type=positive_int,
                  help="leaves with fewer elements go dense"
                  + _plan_default("min_sparse_size"))
  pl.add_argument("--collective",
                  help="sparse buckets' scheme: allgather, zen, spardl, hier "
                  "(default: allgather), or given K workers the lossless "
                  "one that sends the fewest bytes per bucket on K; with "
                  "--costs, auto picks one per bucket")
  pl.add_argument("--sparse-wire", choices=plans.SPARSE_WIRES,
                  help="the sparse values' wire dtype: bfloat16 sends float32 "
                  "slots in 6 bytes instead of 8 (default: the gradient's)")
  pl.add_argument("--packed-indices", action="store_true", default=None,
                  help="allgather buckets send each index in "
                  "ceil(log2(n+1)) bits instead of 32 (lossless)")
  pl.add_argument("--workers", dest="num_workers", type=positive_int,
                  help="K to plan for (default: the costs' device count)")
  pl.add_argument("--local", type=positive_int, metavar="L",
                  help="devices per host: count a hier bucket's bytes sent "
                  "on the (K/L, L) mesh of jaxfuse.make_mesh(local=L)")
  pl.set_defaults(run=cmd_plan)

  sh = sub.add_parser(
      "show", formatter_class=fmt, help="summarize a plan (and draw it)",
      description=(
          "Print a plan's buckets (collective, leaves, elements, capacity, "
          "wire bytes). With --costs also the simulated step: when each "
          "bucket is ready and communicated, the predicted step time and "
          "how much communication is hidden; with -o a Gantt chart of it "
          "(needs matplotlib). With --measured, the same from a GPU profile "
          "(jax.profiler.trace(LOG_DIR, create_perfetto_trace=True), each "
          "step in a jax.profiler.StepTraceAnnotation and blocked on): per "
          "step the compute and NCCL kernels' busy time, their overlap and "
          "the share of link time hidden; with -o its chart, below the "
          "simulated one when --costs is given."))
  sh.add_argument("plan", metavar="PLAN.json", help="a plan file")
  sh.add_argument("--costs", metavar="COSTS.json",
                  help="costs from `jaxfuse profile` to simulate the step")
  sh.add_argument("-o", "--output", metavar="TIMELINE.png",
                  help="draw the simulated and/or measured timeline here "
                  "(png, svg, pdf)")
  sh.add_argument("--measured", metavar="TRACE",
                  help="a jax.profiler trace: its perfetto_trace.json.gz "
                  "(or .json, .json.xz), or a directory holding one (the "
                  "newest)")
  sh.add_argument("--overlap", metavar="ETA",
                  type=lambda t: unit_float(t, low_open=False),
                  help="with --costs: simulate at this overlap η in [0, 1] "
                  "(default: the η the plan was made for, `jaxfuse plan "
                  "--overlap` or its costs', else the --costs file's)")
  sh.add_argument("--workers", dest="num_workers", type=positive_int,
                  metavar="K", help="predict the step on K workers and "
                  "give what a worker sends against a dense all-reduce "
                  "(default: the K the plan was made for, else the costs' "
                  "device count)")
  sh.add_argument("--local", type=positive_int, metavar="L",
                  help="devices per host: count a hier bucket's bytes sent "
                  "on the (K/L, L) mesh of jaxfuse.make_mesh(local=L)")
  sh.add_argument("--step", type=int, metavar="N",
                  help="with --measured: draw the step with step_num N "
                  "(default: the step of median span)")
  sh.add_argument("--device", type=int, metavar="N",
                  help="with --measured: read /device:GPU:N (default: the "
                  "lowest)")
  sh.set_defaults(run=cmd_show)
  return p


def main(argv: Sequence[str] | None = None) -> int:
  """Run the command; returns the exit status (0, or 2 for bad input)."""
  argv = list(sys.argv[1:] if argv is None else argv)
  debug = "--debug" in argv   # before or after the command
  argv = (["--debug"] if debug else []) + [a for a in argv if a != "--debug"]
  try:
    args = build_parser().parse_args(argv)
    return args.run(args)
  except UsageError as e:
    if debug:
      raise
    message = " ".join(str(e).split())  # one line
    if not message.startswith("jaxfuse"):
      message = f"jaxfuse: error: {message}"
    print(message, file=sys.stderr)
    return EXIT_USAGE
  except KeyboardInterrupt:
    print("jaxfuse: interrupted", file=sys.stderr)
    return 130
  except BrokenPipeError:   # `jaxfuse show ... | head`: the reader left
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 1


if __name__ == "__main__":
  sys.exit(main())
