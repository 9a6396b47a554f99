"""The ``jaxfuse`` command: measure costs, make plans, look at them.

  jaxfuse profile [-o costs.json] [--model MODULE:FUNCTION] [--sizes ...]
  jaxfuse plan MODULE:FUNCTION [--density 0.01] [--strategy auto]
               [--costs costs.json] [-o plan.json]
  jaxfuse show plan.json [--costs costs.json] [-o timeline.png]
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
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import math
import os
import re
import sys
from typing import Any, Sequence

EXIT_USAGE = 2
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmg]?)(i?b?)\s*$", re.IGNORECASE)


class UsageError(Exception):
  """A problem with the user's input: printed as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
  """argparse, but errors are one line (and raise, so ``main`` decides)."""

  def error(self, message):
    raise UsageError(f"{self.prog}: error: {message} (see {self.prog} "
                     "--help)")


# --- argument helpers ------------------------------------------------------------

def parse_size(text: str) -> int:
  """'4096', '64K', '1M', '2MiB', '1.5G' -> bytes or elements (powers of 2)."""
  m = _SIZE.match(str(text))
  if not m:
    raise argparse.ArgumentTypeError(
        f"{text!r} is not a size; write e.g. 4096, 64K, 1M or 2MiB")
  scale = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30}[m.group(2).lower()]
  value = float(m.group(1)) * scale
  if value < 1 or value != int(value):
    raise argparse.ArgumentTypeError(f"{text!r} must be a whole number >= 1")
  return int(value)


def _positive_int(text: str) -> int:
  try:
    value = int(text)
  except ValueError:
    value = 0
  if value < 1:
    raise argparse.ArgumentTypeError(f"{text!r} must be an integer >= 1")
  return value


def _unit_float(text: str, low_open: bool = True) -> float:
  try:
    value = float(text)
  except ValueError:
    value = math.nan
  if not (0 < value <= 1 if low_open else 0 <= value <= 1):
    raise argparse.ArgumentTypeError(
        f"{text!r} must be a number in {'(' if low_open else '['}0, 1]")
  return value


def load_model(spec: str) -> tuple[Any, Any, tuple]:
  """MODULE:FUNCTION -> (loss_fn or None, params, example_args)."""
  module_name, sep, func_name = spec.rpartition(":")
  if not sep or not module_name or not func_name:
    raise UsageError(f"{spec!r} is not MODULE:FUNCTION (e.g. mymodel:make, "
                     "or path/to/model.py:make).")
  if module_name.endswith(".py") or os.sep in module_name:
    if not os.path.isfile(module_name):
      raise UsageError(f"{spec}: no such file {module_name!r}.")
    name = "_jaxfuse_model_" + re.sub(r"\W", "_", os.path.basename(
        module_name)[:-3])
    loader = importlib.util.spec_from_file_location(name, module_name)
    module = importlib.util.module_from_spec(loader)
    sys.modules[name] = module
    try:
      loader.loader.exec_module(module)
    except Exception as e:  # the user's code: report it in one line
      raise UsageError(f"{spec}: importing {module_name} raised "
                       f"{type(e).__name__}: {e}") from e
  else:
    if os.getcwd() not in sys.path and "" not in sys.path:
      sys.path.insert(0, os.getcwd())
    try:
      module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
      raise UsageError(f"{spec}: cannot import module {module_name!r} ({e}); "
                       "run from the directory that holds it, or give the "
                       ".py file's path.") from e
    except Exception as e:
      raise UsageError(f"{spec}: importing {module_name!r} raised "
                       f"{type(e).__name__}: {e}") from e
  func = getattr(module, func_name, None)
  if func is None:
    raise UsageError(f"{spec}: module {module_name!r} has no attribute "
                     f"{func_name!r}.")
  if not callable(func):
    raise UsageError(f"{spec}: {func_name!r} is a {type(func).__name__}, not "
                     "a function.")
  try:
    out = func()
  except Exception as e:
    raise UsageError(f"{spec}() raised {type(e).__name__}: {e}") from e
  if isinstance(out, tuple) and len(out) >= 2 and callable(out[0]):
    loss_fn, params, *args = out
  else:
    loss_fn, params, args = None, out, ()
  import jax  # pylint: disable=g-import-not-at-top
  if not jax.tree.leaves(params):
    raise UsageError(f"{spec}() returned no arrays; return the params pytree "
                     "or (loss_fn, params, *example_args).")
  return loss_fn, params, tuple(args)


def _load(cls, path: str, what: str):
  """``cls.load(path)`` with one-line errors (PlanError and CostsError are
  ValueErrors)."""
  try:
    return cls.load(path)
  except OSError as e:
    raise UsageError(f"cannot read {what} {path!r}: {e.strerror or e}.") from e
  except (ValueError, TypeError) as e:
    raise UsageError(f"{path}: {e}") from e


def _load_plan(path: str):
  from jaxfuse import plans  # pylint: disable=g-import-not-at-top
  return _load(plans.Plan, path, "plan")


def _load_costs(path: str):
  from jaxfuse.planning import costs  # pylint: disable=g-import-not-at-top
  return _load(costs.Costs, path, "costs")


def _save(obj, path: str, what: str) -> None:
  try:
    obj.save(path)
  except OSError as e:
    raise UsageError(f"cannot write {what} {path!r}: {e.strerror or e}.") from e


def _ms(seconds: float) -> str:
  return f"{seconds * 1e3:.3f} ms"


# --- profile ------------------------------------------------------------------------

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
  lines.append(f"  contention γ = {costs.contention:.3f}, overlap η = "
               f"{costs.overlap:.3f}")
  if costs.backward:
    lines.append(f"  forward {_ms(costs.forward)}, backward "
                 f"{_ms(sum(costs.backward))} over {len(costs.backward)} "
                 "leaves")
  else:
    lines.append("  no model: no forward/backward times (profile with "
                 "--model to plan with compute overlap)")
  return "\n".join(lines)


def cmd_profile(args) -> int:
  import jax  # pylint: disable=g-import-not-at-top
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
  try:
    mesh = _compat.make_mesh(args.devices)
  except ValueError as e:
    raise UsageError(f"--devices: {e}") from e
  dev = jax.devices()[0]
  print(f"profiling on {mesh.devices.size} x {dev.platform} "
        f"({dev.device_kind})", file=sys.stderr)
  try:
    costs = profiling.profile(
        mesh, loss_fn=loss_fn, params=params, example_args=example_args,
        sizes=args.sizes, compress_sizes=args.compress_sizes,
        repeats=args.repeats, warmup=args.warmup, chain=args.chain,
        estimator=args.estimator, density=args.density,
        progress=None if args.quiet else profiling.text_progress())
  except profiling.ProfileError as e:
    raise UsageError(str(e)) from e
  _save(costs, args.output, "costs")
  print(f"saved {args.output}\n{format_costs(costs)}")
  return 0


# --- plan -----------------------------------------------------------------------------

PLAN_OPTIONS = ("density", "strategy", "estimator", "num_buckets",
                "bucket_bytes", "headroom", "min_sparse_size", "collective",
                "num_workers")


def _strategies() -> tuple[str, ...]:
  from jaxfuse.planning import planner  # pylint: disable=g-import-not-at-top
  return tuple(planner.STRATEGIES) + tuple(getattr(planner, "COST_STRATEGIES",
                                                   ()))


def cmd_plan(args) -> int:
  import jaxfuse  # pylint: disable=g-import-not-at-top
  from jaxfuse.planning import simulate  # pylint: disable=g-import-not-at-top
  kwargs = {k: getattr(args, k) for k in PLAN_OPTIONS
            if getattr(args, k) is not None}
  costs = None
  if args.overlap is not None and not args.costs:
    raise UsageError("--overlap replaces the costs' η: give --costs "
                     "COSTS.json too.")
  if args.costs:
    if "costs" not in inspect.signature(jaxfuse.plan).parameters:
      raise UsageError("--costs: this jaxfuse's plan() takes no costs yet; "
                       "update jaxfuse or leave --costs out.")
    costs = _load_costs(args.costs)
    if args.overlap is not None:
      costs = costs.replace(overlap=args.overlap)
    kwargs["costs"] = costs
    if "strategy" not in kwargs and "auto" in _strategies():
      kwargs["strategy"] = "auto"
  loss_fn, params, example_args = load_model(args.model)
  if loss_fn is not None:
    kwargs.update(loss_fn=loss_fn, example_args=example_args)
  try:
    plan = jaxfuse.plan(params, **kwargs)
  except (ValueError, TypeError) as e:  # PlanError, CostsError
    raise UsageError(f"plan: {e}") from e
  _save(plan, args.output, "plan")
  sparse = sum(l.mode == "sparse" for l in plan.leaves)
  wire, dense = plan.bytes_per_worker(), plan.dense_bytes()
  print(f"saved {args.output}: {len(plan.leaves)} leaves ({sparse} sparse), "
        f"{len(plan.buckets)} buckets, strategy "
        f"{plan.provenance.get('strategy')}, ready order from "
        f"{plan.provenance.get('ready_order')}")
  print(f"  wire bytes per worker {wire:,} of {dense:,} dense "
        f"({100 * wire / max(dense, 1):.2f}%)")
  if costs is not None and len(costs.backward) == len(plan.leaves):
    t = simulate.simulate(plan, costs)
    winner = plan.provenance.get("auto", {}).get("winner")
    print(f"  predicted step {_ms(t.iteration)}, communication "
          f"{_ms(t.communication)} ({100 * t.overlap_ratio:.0f}% hidden)" +
          (f"; auto chose {winner}" if winner else ""))
  print(f"  see it with: jaxfuse show {args.output}" +
        (f" --costs {args.costs}" if args.costs else ""))
  return 0


# --- show -------------------------------------------------------------------------------

def _table(rows: Sequence[Sequence[str]], right: Sequence[bool]) -> list[str]:
  widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
  return ["  ".join(cell.rjust(w) if r else cell.ljust(w)
                    for cell, w, r in zip(row, widths, right)).rstrip()
          for row in rows]


def _short(path: str, width: int = 28) -> str:
  return path if len(path) <= width else "…" + path[-(width - 1):]


def plan_table(plan, timeline=None) -> str:
  """One row per bucket (and totals); with a timeline, its times in ms."""
  from jaxfuse import plans as plan_lib  # pylint: disable=g-import-not-at-top
  wire = plan_lib.bucket_payload_bytes(plan)
  header = ["bucket", "collective", "leaves", "elements", "capacity",
            "wire bytes"]
  if timeline is not None:
    header += ["ready ms", "comm ms", "comm start", "comm end"]
  header += ["first … last leaf (ready order)"]
  rows = [header]
  for i, (b, w) in enumerate(zip(plan.buckets, wire)):
    elements = sum(plan.leaves[j].size for j in b.leaves)
    if b.collective == "psum":
      kind, capacity = "psum", "dense"
    else:
      kind = f"allgather/{b.sparsify}"
      capacity = (b.capacity if b.sparsify == "behind" else
                  sum(plan.leaves[j].capacity for j in b.leaves))
      capacity = f"{capacity:,}"
    row = [f"b{i}", kind, str(len(b.leaves)), f"{elements:,}", capacity,
           f"{w:,}"]
    if timeline is not None:
      t = timeline.buckets[i]
      row += [f"{t.ready * 1e3:.3f}", f"{(t.comm_end - t.comm_start) * 1e3:.3f}",
              f"{t.comm_start * 1e3:.3f}", f"{t.comm_end * 1e3:.3f}"]
    first, last = plan.leaves[b.leaves[0]].path, plan.leaves[b.leaves[-1]].path
    row.append(_short(first) + ("" if len(b.leaves) == 1 else
                                f" … {_short(last)}"))
    rows.append(row)
  total = ["total", "", str(len(plan.leaves)),
           f"{sum(l.size for l in plan.leaves):,}",
           f"{sum(l.capacity for l in plan.leaves if l.mode == 'sparse'):,}",
           f"{sum(wire):,}"]
  if timeline is not None:
    total += ["", f"{timeline.communication * 1e3:.3f}", "", ""]
  rows.append(total + [""])
  right = [False, False] + [True] * (len(header) - 3) + [False]
  return "\n".join(_table(rows, right))


def measured_table(measured) -> str:
  """One row per measured step (and the sum over steps), times in ms:
  busy = |∪ kernels| per row, overlapped = |compute ∩ link|, hidden =
  overlapped / link busy."""
  ms = lambda s: f"{s * 1e3:.3f}"
  rows = [["step", "span ms", "compute busy", "link busy", "overlapped",
           "exposed", "hidden"]]
  for s in measured.steps:
    rows.append(["all" if s.step_num is None else str(s.step_num),
                 ms(s.span), ms(s.compute_busy), ms(s.link_busy),
                 ms(s.overlapped), ms(s.exposed), f"{100 * s.hidden:.0f}%"])
  if len(measured.steps) > 1:
    rows.append(["sum"] + [ms(measured.total(f)) for f in (
        "span", "compute_busy", "link_busy", "overlapped", "exposed")] +
                [f"{100 * measured.hidden:.0f}%"])
  return "\n".join(_table(rows, [False] + [True] * 6))


def _read_measured(args):
  from jaxfuse.planning import trace  # pylint: disable=g-import-not-at-top
  try:
    measured = trace.read_trace(args.measured, device=args.device)
    return measured, measured.step(args.step)
  except trace.TraceError as e:
    raise UsageError(f"--measured: {e}") from e


def _show_measured(measured, step, timeline, resimulate=None) -> None:
  steps = "one step (no step markers)" if not measured.markers else (
      f"{len(measured.steps)} steps marked {', '.join(measured.markers)!r}")
  print(f"measured {measured.path}: {measured.device}, {steps}")
  print(measured_table(measured))
  drawn = "" if step.step_num is None else f" (step {step.step_num} drawn)"
  line = (f"measured hidden {100 * measured.hidden:.0f}% of the link time "
          f"(NCCL kernels) behind compute kernels{drawn}")
  if timeline is not None:
    line += f"; simulated {100 * timeline.overlap_ratio:.0f}%"
    line += (f"\nwith η = {measured.hidden:.2f} (this trace's) the simulator "
             f"predicts a step of {_ms(resimulate(measured.hidden))}")
  print(line)


def cmd_show(args) -> int:
  from jaxfuse.planning import simulate  # pylint: disable=g-import-not-at-top
  plan = _load_plan(args.plan)
  costs = _load_costs(args.costs) if args.costs else None
  if args.output and costs is None and not args.measured:
    raise UsageError("show -o needs --costs costs.json (from `jaxfuse "
                     "profile`), or --measured TRACE (from jax.profiler."
                     "trace): the timeline comes from the cost model or a "
                     "profile.")
  if (args.step is not None or args.device is not None) and not args.measured:
    raise UsageError("--step and --device choose what --measured TRACE "
                     "shows; add --measured.")
  measured = step = None
  if args.measured:
    measured, step = _read_measured(args)
  note = None
  timeline = None
  if costs is not None:
    if not costs.backward:
      costs = costs.replace(backward=(0.0,) * len(plan.leaves))
      note = ("(the costs have no backward times, so compute is not "
              "modelled; profile with --model for the overlap)")
    try:
      timeline = simulate.simulate(plan, costs)
    except ValueError as e:  # CostsError
      raise UsageError(f"{args.costs}: {e}") from e
  sparse = sum(l.mode == "sparse" for l in plan.leaves)
  prov = plan.provenance
  print(f"{args.plan}: {len(plan.leaves)} leaves ({sparse} sparse, "
        f"{len(plan.leaves) - sparse} dense), {len(plan.buckets)} buckets, "
        f"strategy {prov.get('strategy', '?')}, ready order from "
        f"{prov.get('ready_order', '?')}")
  print(plan_table(plan, timeline))
  wire, dense = plan.bytes_per_worker(), plan.dense_bytes()
  print(f"wire bytes per worker {wire:,} of {dense:,} dense "
        f"({100 * wire / max(dense, 1):.2f}%)")
  if timeline is not None:
    t = timeline
    print(f"predicted step {_ms(t.iteration)} = forward {_ms(t.forward)} + "
          f"backward {_ms(t.backward)} + compression {_ms(t.compression)} + "
          f"exposed communication {_ms(t.non_overlapped)}")
    print(f"communication {_ms(t.communication)}, hidden {_ms(t.hidden)} "
          f"({100 * t.overlap_ratio:.0f}% overlap; η = {costs.overlap:.2f}); "
          f"a dense all-reduce of every gradient: "
          f"{_ms(costs.comm_time('psum', dense))}")
    if note:
      print(note)
  if measured is not None:
    _show_measured(measured, step, timeline, lambda eta: simulate.simulate(
        plan, costs.replace(overlap=eta)).iteration)
  if args.output:
    from jaxfuse.planning import timeline_plot  # pylint: disable=g-import-not-at-top
    try:
      if measured is None:
        timeline_plot.plot_timeline(plan, timeline, args.output)
      else:
        timeline_plot.plot_measured(step, args.output, plan=plan,
                                    timeline=timeline,
                                    device=measured.device)
    except ImportError as e:
      raise UsageError(str(e)) from e
    except (OSError, ValueError) as e:
      raise UsageError(f"cannot write {args.output!r}: {e}") from e
    print(f"saved {args.output}")
  return 0


# --- the parser ------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
  from jaxfuse.version import __version__  # pylint: disable=g-import-not-at-top
  fmt = argparse.RawDescriptionHelpFormatter
  p = _Parser(prog="jaxfuse", formatter_class=fmt, description=(
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
          "JSON: collective times α + β·bytes (all_gather, psum) over the "
          "mesh's data axis, compression time α + β·elements, the "
          "contention γ of two simultaneous collectives, and the overlap η "
          "XLA achieves between backward compute and communication. With "
          "--model also the forward time and per-leaf backward times (the "
          "program's costs, scaled to one measured backward pass)."))
  pr.add_argument("-o", "--output", default="costs.json",
                  help="where to write the costs (default: %(default)s)")
  pr.add_argument("--model", metavar="MODULE:FUNCTION",
                  help="function returning (loss_fn, params, *example_args): "
                  "measure forward, per-leaf backward and η on it")
  pr.add_argument("--sizes", nargs="+", type=parse_size, metavar="SIZE",
                  help="collective sizes in bytes per worker, e.g. 4K 64K 1M "
                  "(default: 4K..2M on CPU, 4K..64M elsewhere)")
  pr.add_argument("--compress-sizes", nargs="+", type=parse_size,
                  metavar="SIZE", help="compression sizes in elements "
                  "(default: 4K..256K on CPU, 4K..16M elsewhere)")
  pr.add_argument("--repeats", type=_positive_int, default=5,
                  help="timed runs per point; the median is kept "
                  "(default: %(default)s)")
  pr.add_argument("--warmup", type=_positive_int, default=2,
                  help="untimed runs first, compilation included "
                  "(default: %(default)s)")
  pr.add_argument("--chain", type=_positive_int, default=4,
                  help="dependent collectives per timed run, so dispatch is "
                  "not counted as latency (default: %(default)s)")
  pr.add_argument("--estimator", default="dgc",
                  help="threshold estimator timed for compression "
                  "(default: %(default)s)")
  pr.add_argument("--density", type=_unit_float, default=0.01,
                  help="density of the timed compression (default: "
                  "%(default)s)")
  pr.add_argument("--devices", type=_positive_int,
                  help="mesh size (default: every device)")
  pr.add_argument("--cpu-devices", type=_positive_int,
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
                  type=lambda t: _unit_float(t, low_open=False),
                  help="plan for this overlap η in [0, 1] instead of the "
                  "costs' (profiled on the plain step): the share of link "
                  "time hidden behind compute that `jaxfuse show --measured "
                  "TRACE` reports for your step, e.g. under send_early")
  pl.add_argument("--density", type=_unit_float,
                  help="share of each sparse leaf sent per step, in (0, 1]")
  pl.add_argument("--strategy", help="how to cut the leaves into buckets: "
                  + ", ".join(_strategies()))
  pl.add_argument("--estimator", help="threshold estimator: topk, dgc, "
                  "gaussian, redsync, sidco")
  pl.add_argument("--num-buckets", type=_positive_int,
                  help="buckets of the aligned strategy")
  pl.add_argument("--bucket-bytes", type=parse_size,
                  help="dense bytes per bucket of the size strategy, e.g. 25M")
  pl.add_argument("--headroom", type=float,
                  help="capacity over target count, >= 1")
  pl.add_argument("--min-sparse-size", type=_positive_int,
                  help="leaves with fewer elements go dense")
  pl.add_argument("--collective",
                  help="sparse buckets' scheme: allgather, zen, spardl, hier "
                  "(with --costs, auto picks one per bucket)")
  pl.add_argument("--workers", dest="num_workers", type=_positive_int,
                  help="K to plan for (default: the costs' device count)")
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
                  "(or .json), or a directory holding one (the newest)")
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
  debug = "--debug" in argv
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


if __name__ == "__main__":
  sys.exit(main())
