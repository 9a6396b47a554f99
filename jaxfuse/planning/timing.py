"""How the profiler times a program, and reports its progress.

Every time is the median of ``repeats`` runs after ``warmup`` runs (the
first compiles), each run waited for with ``block_until_ready``; the calls of
one measurement are timed round-robin (``time_calls``). Every program is
compiled with ``jaxfuse.xla_options()`` (``jit``), as a train step should
be, so the costs describe the step that will run.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Callable, Sequence

import jax

from jaxfuse.optim import compile_options

Progress = Callable[[int, int, str], None]  # (done, total, what is next)


class ProfileError(ValueError):
  """Arguments the profiler cannot measure with."""


def jit(fn):
  """``jax.jit`` with the train step's options (``jaxfuse.xla_options``)."""
  return jax.jit(fn, compiler_options=compile_options.xla_options() or None)


def time_calls(calls: Sequence[tuple], *, warmup: int = 2,
               repeats: int = 5) -> list[float]:
  """Median wall time (seconds) of each ``(fn, *args)`` in ``calls``.

  Each is called ``warmup`` times first (at least once: compilation is never
  timed); then the calls are timed round-robin, ``repeats`` rounds, so a
  machine that gets busier or quieter meanwhile shifts them all alike (the
  differences we take stay meaningful).
  """
  if repeats < 1 or warmup < 0:
    raise ProfileError(f"repeats={repeats} must be >= 1 and warmup={warmup} "
                       ">= 0.")
  for fn, *args in calls:
    for _ in range(max(1, warmup)):
      jax.block_until_ready(fn(*args))
  times = [[] for _ in calls]
  for _ in range(repeats):
    for out, (fn, *args) in zip(times, calls):
      t0 = time.perf_counter()
      jax.block_until_ready(fn(*args))
      out.append(time.perf_counter() - t0)
  return [statistics.median(t) for t in times]


def time_call(fn: Callable, *args, warmup: int = 2, repeats: int = 5) -> float:
  """Median wall time of ``fn(*args)`` in seconds, after ``warmup`` calls."""
  return time_calls([(fn, *args)], warmup=warmup, repeats=repeats)[0]


def time_chained(step: Callable, state: tuple, inputs: Sequence, *,
                 steps: int, wait_each: bool | None = None
                 ) -> tuple[float, tuple]:
  """(seconds per step, final state) of ``steps`` calls
  ``state = step(*state, inputs[i % len(inputs)])[:len(state)]`` dispatched
  back to back with one wait at the end: the host runs ahead, as in a
  training loop that does not read every step's loss, so its time between
  steps hides behind the device's. XLA's CPU collectives deadlock when far
  ahead: ``wait_each`` (default: on a CPU with several devices) waits for
  every step."""
  if steps < 1 or not inputs:
    raise ProfileError(f"steps={steps} must be >= 1, with inputs.")
  wait = (jax.default_backend() == "cpu" and jax.device_count() > 1
          if wait_each is None else wait_each)
  state = tuple(state)
  t0 = time.perf_counter()
  for i in range(steps):
    state = tuple(step(*state, inputs[i % len(inputs)])[:len(state)])
    if wait:
      jax.block_until_ready(state)
  jax.block_until_ready(state)
  return (time.perf_counter() - t0) / steps, state


def text_progress(stream=None, width: int = 24) -> Progress:
  """A plain-text progress bar: ``[#####-----] 5/10 psum 256 KiB``."""
  stream = sys.stderr if stream is None else stream
  tty = getattr(stream, "isatty", lambda: False)()

  def show(done: int, total: int, what: str) -> None:
    filled = int(width * done / max(total, 1))
    line = f"[{'#' * filled}{'-' * (width - filled)}] {done}/{total} {what}"
    if tty:
      stream.write("\r" + line.ljust(79) + ("\n" if done == total else ""))
    else:
      stream.write(line + "\n")
    stream.flush()
  return show


def human_bytes(n: float) -> str:
  for unit in ("B", "KiB", "MiB", "GiB"):
    if abs(n) < 1024 or unit == "GiB":
      return f"{n:.0f} {unit}" if unit == "B" else f"{n:.4g} {unit}"
    n /= 1024
  return f"{n} GiB"
