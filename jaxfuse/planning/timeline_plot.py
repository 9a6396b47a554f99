"""A Gantt chart of one simulated step (``jaxfuse show plan.json -o x.png``),
and of one measured step (``--measured TRACE``, from ``planning.trace``).

Two rows, time in ms from the start of the forward pass:

  compute  forward, then each leaf's backward (coloured by its bucket) and,
           after each sparse bucket's last leaf, its compression (hatched)
  link     each bucket's collective (its bucket's colour; psum hatched),
           and the pause the overlap budget η forces, if any

Measured, the same two rows from the step's first kernel: its compute
kernels, its NCCL kernels (all-reduces hatched), and the overlapped time
shaded. ``plot_measured`` puts the simulated chart above the measured one
on a shared time axis.

matplotlib is imported only here and only when drawing (``pip install
matplotlib``); no pyplot, so no GUI backend or global state is touched.
"""

from __future__ import annotations

import os
import re

from jaxfuse import plans
from jaxfuse.planning import simulate

MS = 1e3
_FORWARD = "#9e9e9e"
_COMPRESS = "#37474f"
_PAUSE = "#eeeeee"


def _matplotlib():
  try:
    from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top
    from matplotlib.patches import Patch  # pylint: disable=g-import-not-at-top
    from matplotlib import colormaps  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ImportError("drawing the timeline needs matplotlib; install it with "
                      "`pip install matplotlib`.") from e
  return Figure, Patch, colormaps


def save_figure(fig, path: str | os.PathLike) -> None:
  """``fig.savefig(path)`` whole or not at all (``_jsonfile.save_with``:
  a temporary file beside it, renamed over it), in the format of its
  suffix; without one a PNG at ``path`` + ".png", as matplotlib names it."""
  from jaxfuse.plans import jsonfile as _jsonfile  # pylint: disable=g-import-not-at-top
  path = os.fspath(path)
  fmt = os.path.splitext(path)[1][1:].lower()
  if not fmt:
    path, fmt = path + ".png", "png"
  _jsonfile.save_with(path, lambda f: fig.savefig(f, format=fmt, dpi=120))


ROWS = {"link": 0, "compute": 1}
_HEIGHT = 0.6


def _palette():
  """Bucket colours: tab10 without its grey (7)."""
  cmap = _matplotlib()[2]["tab10"]
  return [cmap(i) for i in (0, 1, 2, 3, 4, 5, 6, 8, 9)]


def _bar(ax, row, start, end, **kw):
  """One box on ``row`` ("compute" or "link") from ``start`` to ``end`` s."""
  if end > start:
    ax.broken_barh([(start * MS, (end - start) * MS)],
                   (ROWS[row] - _HEIGHT / 2, _HEIGHT), **kw)


def _label(ax, row, start, end, text, span_ms):
  """``text`` inside the box, if the box is over 4% of the span wide."""
  if (end - start) * MS > 0.04 * span_ms:
    ax.text((start + end) / 2 * MS, ROWS[row], text, ha="center",
            va="center", fontsize=8)


def _frame(ax, span_ms, handles, title):
  """The two rows' axis, time in ms over [0, 1.01 span], legend below."""
  ax.set_yticks([ROWS["link"], ROWS["compute"]], ["link", "compute"])
  ax.set_ylim(-0.6, 1.6)
  ax.set_xlim(0, span_ms * 1.01)
  ax.set_xlabel("time (ms)")
  ax.grid(axis="x", alpha=0.3)
  ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.32),
            ncol=len(handles), fontsize=8, frameon=False)
  ax.set_title(title, fontsize=10)


def draw_timeline(ax, plan: plans.Plan, timeline: simulate.Timeline,
                  *, span_ms: float | None = None, title: str | None = None):
  """Draw the simulated ``timeline`` of ``plan`` on the axes ``ax``
  (x from 0 to ``span_ms``, default the step's)."""
  Patch = _matplotlib()[1]
  palette = _palette()
  colour = lambda b: palette[b % len(palette)]
  span = span_ms or max(timeline.iteration, 1e-12) * MS
  bar = lambda *a, **kw: _bar(ax, *a, **kw)
  label = lambda *a: _label(ax, *a, span)

  bar("compute", 0.0, timeline.forward, facecolor=_FORWARD)
  label("compute", 0.0, timeline.forward, "forward")
  for b, (bucket, times) in enumerate(zip(plan.buckets, timeline.buckets)):
    for j in bucket.leaves:
      start, end = timeline.leaves[j]
      bar("compute", start, end, facecolor=colour(b), edgecolor="white",
          linewidth=0.3)
    if bucket.collective == "allgather":
      bar("compute", times.compress_start, times.compress_end,
          facecolor=_COMPRESS, hatch="///", edgecolor="white", linewidth=0)
    pieces = [(times.comm_start, times.comm_end)]
    pause = timeline.pause
    if pause and times.comm_start < pause[1] and times.comm_end > pause[0]:
      pieces = [(times.comm_start, max(times.comm_start, pause[0])),
                (pause[1], times.comm_end)]
    for start, end in pieces:
      bar("link", start, end, facecolor=colour(b), edgecolor="black",
          linewidth=0.4, hatch="//" if bucket.collective == "psum" else None)
    label("link", *max(pieces, key=lambda p: p[1] - p[0]), f"b{b}")
  if timeline.pause:
    bar("link", *timeline.pause, facecolor=_PAUSE, edgecolor="#9e9e9e",
        hatch="xx", linewidth=0.4)

  handles = [Patch(facecolor=_FORWARD, label="forward"),
             Patch(facecolor=colour(0), label="backward (bucket colour)"),
             Patch(facecolor=_COMPRESS, hatch="///", edgecolor="white",
                   label="compression"),
             Patch(facecolor="white", edgecolor="black", label="allgather"),
             Patch(facecolor="white", edgecolor="black", hatch="//",
                   label="psum")]
  if timeline.pause:
    handles.append(Patch(facecolor=_PAUSE, edgecolor="#9e9e9e", hatch="xx",
                         label="link paused (overlap η)"))
  strategy = plan.provenance.get("strategy", "?")
  _frame(ax, span, handles, title or (
      f"jaxfuse plan ({strategy}, {len(plan.buckets)} buckets): step "
      f"{timeline.iteration * MS:.3g} ms, communication "
      f"{timeline.communication * MS:.3g} ms, "
      f"{100 * timeline.overlap_ratio:.0f}% hidden"))


def plot_timeline(plan: plans.Plan, timeline: simulate.Timeline,
                  path: str | os.PathLike | None = None, *,
                  title: str | None = None):
  """Draw ``timeline`` (from
  ``jaxfuse.planning.simulate.simulate(plan, costs)``).

  Saves to ``path`` (format from its suffix, e.g. ``.png``, ``.svg``) when
  given; returns the matplotlib ``Figure``.
  """
  Figure = _matplotlib()[0]
  fig = Figure(figsize=(11, 3.2), layout="constrained")
  draw_timeline(fig.subplots(), plan, timeline, title=title)
  if path is not None:
    save_figure(fig, path)
  return fig


_OVERLAP = "#c8e6c9"
_NCCL_NAME = re.compile(r"(allreduce|allgather|reducescatter|sendrecv|"
                        r"broadcast|reduce|alltoall)", re.IGNORECASE)


def _collective(name: str) -> str:
  """'ncclDevKernel_AllGather_RING_LL(...)' -> 'AllGather' (else 'nccl')."""
  m = _NCCL_NAME.search(name)
  return m.group(1) if m else "nccl"


def draw_measured(ax, step, *, span_ms: float | None = None,
                  title: str | None = None, device: str = "GPU"):
  """Draw a measured step (``jaxfuse.planning.trace.MeasuredStep``) on
  ``ax`` like ``draw_timeline``: compute kernels on one row, NCCL kernels
  (all-reduces hatched, like psum) on the link row, and the overlapped time
  C ∩ L shaded across both."""
  Patch = _matplotlib()[1]
  palette = _palette()
  span = span_ms or max(step.span, 1e-12) * MS
  for start, end in step.overlaps:
    ax.axvspan(start * MS, end * MS, color=_OVERLAP, zorder=0, linewidth=0)
  for row, start, end, name in step.kernels:
    if row == "compute":
      _bar(ax, row, start, end, facecolor=palette[0], edgecolor="white",
           linewidth=0.3)
    else:
      kind = _collective(name)
      _bar(ax, row, start, end, facecolor=palette[1], edgecolor="black",
           linewidth=0.4,
           hatch="//" if kind.lower() == "allreduce" else None)
      _label(ax, row, start, end, kind, span)
  handles = [Patch(facecolor=palette[0], label="compute kernels"),
             Patch(facecolor=palette[1], edgecolor="black",
                   label="NCCL kernels"),
             Patch(facecolor=palette[1], edgecolor="black", hatch="//",
                   label="NCCL all-reduce"),
             Patch(facecolor=_OVERLAP, label="overlapped (compute ∩ link)")]
  which = "" if step.step_num is None else f" step {step.step_num}"
  _frame(ax, span, handles, title or (
      f"measured on {device}{which}: span {step.span * MS:.3g} ms, link "
      f"busy {step.link_busy * MS:.3g} ms, {100 * step.hidden:.0f}% hidden "
      f"(overlapped {step.overlapped * MS:.3g} ms)"))


def plot_measured(step, path: str | os.PathLike | None = None, *,
                  plan: plans.Plan | None = None,
                  timeline: simulate.Timeline | None = None,
                  device: str = "GPU", title: str | None = None):
  """Draw a measured step; with ``plan`` and ``timeline`` (its simulation)
  the simulated chart above it on a shared time axis.

  Saves to ``path`` when given; returns the matplotlib ``Figure``.
  """
  Figure = _matplotlib()[0]
  if timeline is None:
    fig = Figure(figsize=(11, 3.2), layout="constrained")
    draw_measured(fig.subplots(), step, device=device, title=title)
  else:
    fig = Figure(figsize=(11, 6.2), layout="constrained")
    top, bottom = fig.subplots(2, 1, sharex=True)
    span = max(timeline.iteration, step.span, 1e-12) * MS
    draw_timeline(top, plan, timeline, span_ms=span)
    draw_measured(bottom, step, span_ms=span, device=device, title=title)
    top.tick_params(labelbottom=True)
  if path is not None:
    save_figure(fig, path)
  return fig
