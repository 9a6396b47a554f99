"""The measured timeline: what a real GPU profile says about overlap.

The counterpart of ``simulate`` (the timeline the cost model predicts),
read from the trace ``jax.profiler`` records::

  with jax.profiler.trace(log_dir, create_perfetto_trace=True):
    for i in range(3):
      with jax.profiler.StepTraceAnnotation("train", step_num=i):
        state = jax.block_until_ready(step(state, batch))

JAX writes ``<log_dir>/plugins/profile/<run>/perfetto_trace.json.gz`` (and
always ``<host>.trace.json.gz``, the same Chrome trace-event JSON with a
``metadata`` field). ``read_trace`` takes that file (``.json``,
``.json.gz``, or ``.json.xz`` as this repository stores its traces) or any
directory above it (the newest such file under it).

What is read. Every process named ``/device:GPU:N`` is a GPU; its threads
named ``Stream #…`` are its CUDA streams (the derived rows "XLA Ops",
"Steps", … repeat the same work and are skipped). Each complete event
(``"ph": "X"``, ``ts``/``dur`` in µs) on a stream is a kernel (or a copy):
*link* when its name contains "nccl" (any case; NCCL's kernels), *compute*
otherwise. One GPU is read (``device``; default the lowest ordinal): in a
data-parallel step every GPU does the same work.

Steps. A *step marker* is a host event whose arguments have a
``step_num``, as ``jax.profiler.StepTraceAnnotation(name, step_num=i)``
writes (``step_name`` keeps only markers of that name). A kernel belongs to
the marker whose host interval holds its start; kernels outside every
marker (warm-up, compilation) are left out. So the caller must block on
each step's result inside its annotation. Without markers the whole trace
is one step. A step's times are in seconds from its first kernel.

Summaries per step, with C and L the union of its compute and link
kernels' intervals (streams may run at once, so unions, not sums)::

  compute_busy = |C|,  link_busy = |L|,  overlapped = |C ∩ L|
  exposed = |L \\ C| = link_busy − overlapped
  hidden = overlapped / link_busy      (1 when there is no link time)
  span = last kernel end − first kernel start

Per link kernel (``link_kernels``): its time under compute, and how long
the compute stream stood idle until it ended (``compute_waited``: the
backward waiting for that collective's result, as a ``send_early`` fence
or XLA's placement of the collective's end makes it);
``MeasuredStep.compute_waited`` sums them.

An NCCL kernel is busy from its launch until every peer has joined, so
link time includes waiting for the slowest GPU. Over several steps the
figures add up (``MeasuredTrace.hidden = Σ overlapped / Σ link_busy``).

CPU traces hold no device events (XLA:CPU runs on host threads, and its
collectives are not NCCL): ``read_trace`` raises ``TraceError`` for them.
Only json, gzip, lzma and the standard library are used here.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import lzma
import os
import pathlib
import re
from typing import NamedTuple

COMPUTE, LINK = "compute", "link"
PERFETTO_FILE = "perfetto_trace.json.gz"
HOST_TRACE_GLOB = "*.trace.json.gz"
_GPU = re.compile(r"/device:GPU:(\d+)")
_STREAM = "Stream #"
_HOW_TO_RECORD = ("record one with jax.profiler.trace(log_dir, "
                  "create_perfetto_trace=True) and pass log_dir or the "
                  "perfetto_trace.json.gz in it")


class TraceError(ValueError):
  """A trace that cannot be read or holds no GPU kernels; says what to do."""


Interval = tuple[float, float]
Kernel = tuple[str, float, float, str]   # (row, start_s, end_s, name)


@dataclasses.dataclass(frozen=True)
class MeasuredStep:
  """One step on one GPU (module docstring for the maths).

  kernels: (row "compute"/"link", start_s, end_s, name), seconds from the
    step's first kernel, sorted by start.
  overlaps: the intervals of C ∩ L, same clock.
  step_num: the marker's ``step_num`` (None for a trace without markers).
  origin: the first kernel's start, seconds on the trace's clock.
  wall: the host marker's duration (None without markers).
  """
  kernels: tuple[Kernel, ...]
  overlaps: tuple[Interval, ...]
  compute_busy: float
  link_busy: float
  overlapped: float
  span: float
  step_num: int | None = None
  origin: float = 0.0
  wall: float | None = None

  @property
  def exposed(self) -> float:
    """Link time with no compute beside it: |L \\ C|."""
    return self.link_busy - self.overlapped

  @property
  def hidden(self) -> float:
    """|C ∩ L| / |L| (1 when there is no link time, like Timeline)."""
    return self.overlapped / self.link_busy if self.link_busy > 0 else 1.0

  @property
  def compute_waited(self) -> float:
    """Σ over link kernels of the compute stream's idle time until each
    ended (``link_kernels``)."""
    return sum(k.compute_waited for k in link_kernels(self))

  def to_dict(self) -> dict:
    out = dataclasses.asdict(self)
    out["kernels"] = [list(k) for k in self.kernels]
    out["overlaps"] = [list(o) for o in self.overlaps]
    out.update(exposed=self.exposed, hidden=self.hidden,
               compute_waited=self.compute_waited)
    return out


@dataclasses.dataclass(frozen=True)
class MeasuredTrace:
  """What ``read_trace`` returns: the steps of one GPU of one trace file.

  steps: in time order. devices: every GPU in the file ("/device:GPU:N").
  markers: the step markers' name(s), empty when the trace had none.
  """
  path: str
  device: str
  devices: tuple[str, ...]
  steps: tuple[MeasuredStep, ...]
  markers: tuple[str, ...] = ()

  def total(self, field: str) -> float:
    """Σ over steps of ``field`` (compute_busy, link_busy, overlapped, …)."""
    return sum(getattr(s, field) for s in self.steps)

  @property
  def hidden(self) -> float:
    """Σ overlapped / Σ link_busy over the steps (1 with no link time)."""
    link = self.total("link_busy")
    return self.total("overlapped") / link if link > 0 else 1.0

  def step(self, step_num: int | None = None) -> MeasuredStep:
    """The step with marker ``step_num``; by default the typical one: the
    step of median span (the lower median for an even count)."""
    if step_num is None:
      spans = sorted(s.span for s in self.steps)
      median = spans[(len(spans) - 1) // 2]
      return next(s for s in self.steps if s.span == median)
    for s in self.steps:
      if s.step_num == step_num:
        return s
    have = [s.step_num for s in self.steps]
    raise TraceError(f"{self.path}: no step {step_num} on {self.device}; "
                     f"its steps are {have}.")

  def to_dict(self) -> dict:
    return {"path": self.path, "device": self.device,
            "devices": list(self.devices), "markers": list(self.markers),
            "hidden": self.hidden,
            **{f: self.total(f) for f in ("compute_busy", "link_busy",
                                          "overlapped", "exposed",
                                          "compute_waited", "span")},
            "steps": [s.to_dict() for s in self.steps]}


# --- interval arithmetic ------------------------------------------------------

def union(intervals) -> list[Interval]:
  """The disjoint, sorted intervals covering the same time as ``intervals``."""
  merged = []
  for start, end in sorted(intervals):
    if end <= start:
      continue
    if merged and start <= merged[-1][1]:
      merged[-1] = (merged[-1][0], max(merged[-1][1], end))
    else:
      merged.append((start, end))
  return merged


def intersection(a, b) -> list[Interval]:
  """(∪a) ∩ (∪b) as disjoint, sorted intervals."""
  a, b, out, i, j = union(a), union(b), [], 0, 0
  while i < len(a) and j < len(b):
    start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
    if start < end:
      out.append((start, end))
    if a[i][1] < b[j][1]:
      i += 1
    else:
      j += 1
  return out


def length(intervals) -> float:
  """|∪ intervals|: the time they cover."""
  return sum(end - start for start, end in union(intervals))


def measure(kernels, *, step_num=None, wall=None) -> MeasuredStep:
  """A ``MeasuredStep`` from (row, start_s, end_s, name) on one clock:
  shifted so that the first kernel starts at 0, and summarized."""
  kernels = sorted(kernels, key=lambda k: (k[1], k[2]))
  t0 = kernels[0][1] if kernels else 0.0
  kernels = tuple((row, start - t0, end - t0, name)
                  for row, start, end, name in kernels)
  compute = [(s, e) for row, s, e, _ in kernels if row == COMPUTE]
  link = [(s, e) for row, s, e, _ in kernels if row == LINK]
  overlaps = intersection(compute, link)
  span = max((e for _, _, e, _ in kernels), default=0.0)
  return MeasuredStep(kernels, tuple(overlaps), length(compute), length(link),
                      length(overlaps), span, step_num, t0, wall)


class LinkKernel(NamedTuple):
  """One link (NCCL) kernel of a step, seconds from its first kernel.

  under_compute: |kernel ∩ C|, the part of it compute kernels ran beside.
  compute_waited: how long the compute stream stood idle until this
    kernel ended: the gap in C that closes within ``WAIT_SLACK_S`` after
    the kernel's end, from the later of the gap's start and the kernel's
    (the backward waiting for this collective's result).
  """
  name: str
  start: float
  end: float
  under_compute: float
  compute_waited: float


WAIT_SLACK_S = 50e-6   # compute resuming this soon after a link kernel ends
                       # resumed because it ended (a launch's latency)


def link_kernels(step: MeasuredStep) -> list[LinkKernel]:
  """The link kernels of ``step`` in start order (``LinkKernel``)."""
  compute = union([(a, b) for row, a, b, _ in step.kernels if row == COMPUTE])
  gaps = [(compute[i][1], compute[i + 1][0]) for i in range(len(compute) - 1)]
  out = []
  for row, a, b, name in step.kernels:
    if row != LINK:
      continue
    waited = max((g1 - max(g0, a) for g0, g1 in gaps
                  if b <= g1 <= b + WAIT_SLACK_S and g1 > a), default=0.0)
    out.append(LinkKernel(name, a, b, length(intersection([(a, b)], compute)),
                          waited))
  return out


def compute_kernels(step: MeasuredStep) -> list[tuple[str, float, bool]]:
  """Each compute kernel of ``step`` as (name, duration_s, beside_link):
  beside_link when more than half of it ran while a link kernel did
  (NCCL's kernels hold SMs: a kernel that fills every SM with blocks it
  keeps then runs a second wave)."""
  link = union([(a, b) for row, a, b, _ in step.kernels if row == LINK])
  return [(name, b - a, 2 * length(intersection([(a, b)], link)) > b - a)
          for row, a, b, name in step.kernels if row == COMPUTE]


# --- reading the file ---------------------------------------------------------

def find_trace_file(path: str | os.PathLike) -> pathlib.Path:
  """``path`` itself if a file; for a directory, the newest
  perfetto_trace.json.gz under it (else the newest *.trace.json.gz)."""
  p = pathlib.Path(path)
  if p.is_file():
    return p
  if not p.is_dir():
    raise TraceError(f"{p}: no such file or directory; {_HOW_TO_RECORD}.")
  for pattern in (PERFETTO_FILE, HOST_TRACE_GLOB):
    found = [f for f in p.rglob(pattern) if f.is_file()]
    if found:
      return max(found, key=lambda f: f.stat().st_mtime)
  raise TraceError(f"{p}: no {PERFETTO_FILE} (nor *.trace.json.gz) under "
                   f"this directory; {_HOW_TO_RECORD}.")


def load_events(path: str | os.PathLike) -> list[dict]:
  """The trace events of a Chrome trace-event JSON file, plain, gzipped
  or xz-compressed (object form ``{"traceEvents": [...]}`` or a bare
  list)."""
  path = pathlib.Path(path)
  try:
    raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b":
      raw = gzip.decompress(raw)
    elif raw[:6] == b"\xfd7zXZ\x00":
      raw = lzma.decompress(raw)
    body = json.loads(raw)
  except OSError as e:
    raise TraceError(f"{path}: cannot read it ({e.strerror or e}).") from e
  # a bad archive, JSON or UTF-8
  except (ValueError, EOFError, lzma.LZMAError) as e:
    raise TraceError(f"{path}: not a JSON trace ({e}); pass the "
                     f"{PERFETTO_FILE} that jax.profiler.trace wrote.") from e
  events = body.get("traceEvents") if isinstance(body, dict) else body
  if not isinstance(events, list):
    raise TraceError(f"{path}: no 'traceEvents' list, so not a Chrome/"
                     f"Perfetto JSON trace; {_HOW_TO_RECORD}.")
  return [e for e in events if isinstance(e, dict)]


def _names(events) -> tuple[dict, dict]:
  """{pid: process name}, {(pid, tid): thread name} from metadata events."""
  processes, threads = {}, {}
  for e in events:
    if e.get("ph") != "M":
      continue
    name = str((e.get("args") or {}).get("name", ""))
    if e.get("name") == "process_name":
      processes[e.get("pid")] = name
    elif e.get("name") == "thread_name":
      threads[(e.get("pid"), e.get("tid"))] = name
  return processes, threads


def _interval(e) -> Interval | None:
  """(start_s, end_s) of a complete event, None for anything else."""
  if e.get("ph") != "X":
    return None
  try:
    start, dur = float(e["ts"]) * 1e-6, float(e.get("dur", 0.0)) * 1e-6
  except (KeyError, TypeError, ValueError):
    return None
  return start, start + dur


def _gpus(processes, file) -> dict[int, tuple[object, str]]:
  """{ordinal: (pid, "/device:GPU:N")} of the trace's GPU processes."""
  gpus = {}
  for pid, name in processes.items():
    m = _GPU.search(name)
    if m:
      gpus.setdefault(int(m.group(1)), (pid, m.group(0)))
  if not gpus:
    found = ", ".join(sorted(set(processes.values()))) or "none"
    raise TraceError(
        f"{file}: no GPU device events (processes in the trace: {found}). "
        "A CPU trace has none: XLA:CPU runs on host threads. Profile the "
        "step on GPUs (a CUDA jaxlib with CUPTI) to see its kernels.")
  return gpus


def _stream_kernels(events, threads, pid) -> list[Kernel]:
  """(row, start_s, end_s, name) of the complete events on process
  ``pid``'s "Stream #…" threads; NCCL's are the link's."""
  kernels = []
  for e in events:
    span = _interval(e) if e.get("pid") == pid else None
    if span is not None and threads.get((pid, e.get("tid")), "").startswith(
        _STREAM):
      name = str(e.get("name", ""))
      kernels.append((LINK if "nccl" in name.lower() else COMPUTE, *span,
                      name))
  return kernels


def _step_markers(events, device_pids, step_name) -> list[tuple[Interval,
                                                                 dict]]:
  """((start_s, end_s), event) of each host event with a ``step_num``
  argument (named ``step_name`` if given), by start."""
  markers = []
  for e in events:
    if (e.get("pid") in device_pids or "step_num" not in (e.get("args") or {})
        or step_name is not None and e.get("name") != step_name):
      continue
    span = _interval(e)
    if span is not None:
      markers.append((span, e))
  return sorted(markers, key=lambda m: m[0])


def _step_num(event) -> int | None:
  try:
    return int(event["args"]["step_num"])
  except (KeyError, TypeError, ValueError):
    return None


def read_trace(path: str | os.PathLike, *, device: int | None = None,
               step_name: str | None = None) -> MeasuredTrace:
  """The measured steps of GPU ``device`` (default the lowest ordinal) in
  the trace at ``path`` (a file, or a directory searched by
  ``find_trace_file``), cut by the step markers named ``step_name`` (any
  name by default). Raises ``TraceError`` with the fix when there is
  nothing to read."""
  file = find_trace_file(path)
  events = load_events(file)
  processes, threads = _names(events)
  gpus = _gpus(processes, file)
  ordinal = min(gpus) if device is None else device
  if ordinal not in gpus:
    raise TraceError(f"{file}: no /device:GPU:{ordinal}; the trace has "
                     f"{', '.join(gpus[g][1] for g in sorted(gpus))}.")
  pid, device_name = gpus[ordinal]
  kernels = _stream_kernels(events, threads, pid)
  if not kernels:
    raise TraceError(
        f"{file}: {device_name} has no kernel events on its streams (no "
        f"'{_STREAM}…' rows with events). Was CUPTI available when it was "
        "recorded? Run the step inside the jax.profiler.trace block.")

  markers = _step_markers(events, {p for p, _ in gpus.values()}, step_name)
  if not markers and step_name is not None:
    raise TraceError(f"{file}: no step markers named {step_name!r}; wrap "
                     f"each step in jax.profiler.StepTraceAnnotation("
                     f"{step_name!r}, step_num=i), or name none to read the "
                     "whole trace as one step.")
  if not markers:
    steps = (measure(kernels),)
  else:
    groups = [[] for _ in markers]
    for k in kernels:  # the first marker whose host interval holds its start
      i = next((i for i, ((start, end), _) in enumerate(markers)
                if start <= k[1] < end), None)
      if i is not None:
        groups[i].append(k)
    steps = tuple(measure(g, step_num=_step_num(e), wall=end - start)
                  for g, ((start, end), e) in zip(groups, markers) if g)
    if not steps:
      raise TraceError(
          f"{file}: none of the {len(markers)} step markers holds a kernel of "
          f"{device_name}; block on each step's result inside its "
          "StepTraceAnnotation (jax.block_until_ready) so its kernels run "
          "within it.")
  names = tuple(sorted({str(e.get("name")) for _, e in markers}))
  return MeasuredTrace(str(file), device_name,
                       tuple(gpus[g][1] for g in sorted(gpus)), steps, names)
