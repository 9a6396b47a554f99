"""``jaxfuse show``: a plan's buckets, its simulated step and a measured one.

  jaxfuse show plan.json [--costs costs.json] [--overlap ETA] [-o timeline.png]
  jaxfuse show plan.json --measured TRACE [--costs costs.json] [-o out.png]

The tables (``plan_table``, ``measured_table``) and the command; its
arguments are declared with the others in ``cli.build_parser``.
"""

from __future__ import annotations

import os
from typing import Sequence

from jaxfuse.sync import bucket_steps
from jaxfuse import plans
from jaxfuse.planning.cli_io import UsageError
from jaxfuse.planning.cli_io import load_costs
from jaxfuse.planning.cli_io import load_plan
from jaxfuse.planning.cli_io import ms


def _table(rows: Sequence[Sequence[str]], right: Sequence[bool]) -> list[str]:
  widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
  return ["  ".join(cell.rjust(w) if r else cell.ljust(w)
                    for cell, w, r in zip(row, widths, right)).rstrip()
          for row in rows]


def _short(path: str, width: int = 28) -> str:
  return path if len(path) <= width else "…" + path[-(width - 1):]


def plan_table(plan, timeline=None) -> str:
  """One row per bucket (and totals); with a timeline, its times in ms."""
  from jaxfuse import plans  # pylint: disable=g-import-not-at-top
  wire = plans.bucket_payload_bytes(plan)
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
      kind = f"{b.collective}/{b.sparsify}"
      capacity = (b.capacity if b.sparsify == "behind" else
                  sum(plan.leaves[j].capacity for j in b.leaves))
      capacity = f"{capacity:,}"
    row = [f"b{i}", kind, str(len(b.leaves)), f"{elements:,}", capacity,
           f"{w:,}"]
    if timeline is not None:
      t = timeline.buckets[i]
      row += [f"{t.ready * 1e3:.3f}",
              f"{(t.comm_end - t.comm_start) * 1e3:.3f}",
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


_STEP_FIELDS = ("span", "compute_busy", "link_busy", "overlapped", "exposed",
                "compute_waited")


def measured_table(measured) -> str:
  """One row per measured step (and the sum over steps), times in ms:
  busy = |∪ kernels| per row, overlapped = |compute ∩ link|, hidden =
  overlapped / link busy, compute waited = the compute stream's idle time
  until a link kernel ended (``trace.link_kernels``)."""
  cell = lambda s: f"{s * 1e3:.3f}"
  rows = [["step", "span", "compute busy", "link busy", "overlapped",
           "exposed", "compute waited", "hidden"]]
  for s in measured.steps:
    rows.append(["all" if s.step_num is None else str(s.step_num)] +
                [cell(getattr(s, f)) for f in _STEP_FIELDS] +
                [f"{100 * s.hidden:.0f}%"])
  if len(measured.steps) > 1:
    rows.append(["sum"] + [cell(measured.total(f)) for f in _STEP_FIELDS] +
                [f"{100 * measured.hidden:.0f}%"])
  return "\n".join(_table(rows, [False] + [True] * 7))


def link_table(step) -> str:
  """One row per link kernel of ``step`` (``trace.link_kernels``), ms from
  the step's first kernel."""
  from jaxfuse.planning import trace  # pylint: disable=g-import-not-at-top
  cell = lambda s: f"{s * 1e3:.3f}"
  rows = [["link kernel", "start", "end", "took", "under compute",
           "compute waited"]]
  for i, k in enumerate(trace.link_kernels(step)):
    rows.append([f"{i}: {k.name.split('(')[0][:40]}", cell(k.start),
                 cell(k.end), cell(k.end - k.start), cell(k.under_compute),
                 cell(k.compute_waited)])
  return "\n".join(_table(rows, [False] + [True] * 5))


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
  which = "the step" if step.step_num is None else f"step {step.step_num}"
  print(f"link kernels of {which} (ms from its first kernel):")
  print(link_table(step))
  drawn = "" if step.step_num is None else f" (step {step.step_num} drawn)"
  line = (f"measured hidden {100 * measured.hidden:.0f}% of the link time "
          f"(NCCL kernels) behind compute kernels{drawn}")
  if timeline is not None:
    line += f"; simulated {100 * timeline.overlap_ratio:.0f}%"
    eta = trace_eta(measured.hidden, resimulate(1.0))
    line += (f"\nwith η = {eta:.2f} (this trace's share of what the ideal "
             f"schedule hides) the simulator predicts a step of "
             f"{ms(resimulate(eta).iteration)}")
  print(line)


def trace_eta(hidden_share: float, ideal) -> float:
  """``simulate``'s η from a trace's hidden share of the link time: what
  hid (share·G) over what the ideal schedule ``ideal`` hides, in [0, 1]."""
  from jaxfuse.planning import simulate  # pylint: disable=g-import-not-at-top
  eta = simulate.eta_from_hidden(hidden_share * ideal.communication, ideal)
  return 1.0 if eta is None else min(1.0, max(0.0, eta))


def host_mesh(num_workers: int | None, local: int | None):
  """``--local L``'s mesh (K/L hosts, L devices each), or None without
  it; raises ``UsageError`` unless K is known and a multiple of L."""
  if local is None:
    return None
  if not num_workers:
    raise UsageError(f"--local {local} splits K workers into hosts: give "
                     "--workers K (or --costs from a profile of K devices)")
  if num_workers % local:
    raise UsageError(f"--local {local}: {num_workers} workers do not split "
                     f"into hosts of {local} devices; give the devices per "
                     f"host, a divisor of {num_workers}")
  return num_workers // local, local


def bytes_line(plan, num_workers: int | None, mesh=None) -> str:
  """The plan's payload against dense and, for K > 1 workers, what one
  worker sends against a dense ring all-reduce
  (``collectives.bytes_sent``; ``"hier"`` buckets on ``mesh`` (H, L),
  ``host_mesh``'s, when given, else their host-axis steps on K)."""
  from jaxfuse import collectives  # pylint: disable=g-import-not-at-top
  wire, dense = plan.bytes_per_worker(), plan.dense_bytes()
  line = (f"wire bytes per worker {wire:,} of {dense:,} dense "
          f"({100 * wire / max(dense, 1):.2f}%)")
  if num_workers and num_workers > 1:
    sent, dense_sent = collectives.bytes_sent(
        bucket_steps.compile_plan(plan), num_workers, mesh)
    line += (f"; on {num_workers} workers"
             + (f" ({mesh[0]} hosts x {mesh[1]})" if mesh else "")
             + f" each sends {sent:,} B, "
             f"{100 * sent / max(dense_sent, 1):.2f}% of a dense "
             f"all-reduce's {dense_sent:,} B")
  return line


def _with_overlap(costs, plan, overlap: float | None):
  """(costs at the η to simulate, where that η came from): ``--overlap``,
  else the η the plan was made for (``provenance["overlap"]``: what
  ``jaxfuse plan`` predicted with), else the costs'."""
  planned = plan.provenance.get("overlap")
  if overlap is not None:
    return costs.replace(overlap=overlap), "--overlap"
  if plans.is_real(planned) and 0 <= planned <= 1:
    return costs.replace(overlap=float(planned)), "the plan's"
  return costs, "the costs'"


def cmd_show(args) -> int:
  from jaxfuse.planning import simulate  # pylint: disable=g-import-not-at-top
  plan = load_plan(args.plan)
  costs = load_costs(args.costs) if args.costs else None
  if args.output and costs is None and not args.measured:
    raise UsageError("show -o needs --costs costs.json (from `jaxfuse "
                     "profile`), or --measured TRACE (from jax.profiler."
                     "trace): the timeline comes from the cost model or a "
                     "profile.")
  if (args.step is not None or args.device is not None) and not args.measured:
    raise UsageError("--step and --device choose what --measured TRACE "
                     "shows; add --measured.")
  if args.overlap is not None and costs is None:
    raise UsageError("--overlap sets the η the step is simulated at: give "
                     "--costs COSTS.json too.")
  planned = plan.provenance.get("num_workers")   # the K it was made for
  workers = (args.num_workers or
             (planned if plans.is_int(planned) and planned >= 1 else None)
             or (costs and costs.workers))
  mesh = host_mesh(workers, args.local)
  measured = step = None
  if args.measured:
    measured, step = _read_measured(args)
  note = None
  timeline = None
  if costs is not None:
    costs, eta_from = _with_overlap(costs, plan, args.overlap)
    if not costs.backward:
      costs = costs.replace(backward=(0.0,) * len(plan.leaves))
      note = ("(the costs have no backward times, so compute is not "
              "modelled; profile with --model for the overlap)")
    try:
      timeline = simulate.simulate(plan, costs, workers)
    except ValueError as e:  # CostsError
      raise UsageError(f"{args.costs}: {e}") from e
  sparse = sum(l.mode == "sparse" for l in plan.leaves)
  prov = plan.provenance
  print(f"{args.plan}: {len(plan.leaves)} leaves ({sparse} sparse, "
        f"{len(plan.leaves) - sparse} dense), {len(plan.buckets)} buckets, "
        f"strategy {prov.get('strategy', '?')}, ready order from "
        f"{prov.get('ready_order', '?')}")
  print(plan_table(plan, timeline))
  print(bytes_line(plan, workers, mesh))
  if timeline is not None:
    t = timeline
    dense = costs.on_workers(workers).comm_time("psum", plan.dense_bytes())
    print(f"predicted step {ms(t.iteration)} = forward {ms(t.forward)} + "
          f"backward {ms(t.backward)} + compression {ms(t.compression)} + "
          f"exposed communication {ms(t.non_overlapped)}")
    print(f"communication {ms(t.communication)}, hidden {ms(t.hidden)} "
          f"({100 * t.overlap_ratio:.0f}% overlap; η = {costs.overlap:.2f}, "
          f"{eta_from}); "
          f"a dense all-reduce of every gradient: "
          f"{ms(dense)}")
    if note:
      print(note)
  if measured is not None:
    _show_measured(measured, step, timeline, lambda eta: simulate.simulate(
        plan, costs.replace(overlap=eta), workers))
  if args.output:
    from jaxfuse.planning import timeline_plot  # pylint: disable=g-import-not-at-top
    # no extension: a PNG, named so (matplotlib would add .png unsaid)
    output = args.output if os.path.splitext(args.output)[1] else (
        args.output + ".png")
    try:
      if measured is None:
        timeline_plot.plot_timeline(plan, timeline, output)
      else:
        timeline_plot.plot_measured(step, output, plan=plan,
                                    timeline=timeline,
                                    device=measured.device)
    except ImportError as e:
      raise UsageError(str(e)) from e
    except (OSError, ValueError) as e:
      raise UsageError(f"cannot write {output!r}: {e}") from e
    print(f"saved {output}")
  return 0
