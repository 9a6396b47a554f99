"""What examples/train_lm.py measures while it trains: each step's loss,
time and phase, the logged entries, and the run's timing summary.

Plain data and arithmetic, no JAX. Step s is entry s − start of each list
(start > 0 when resumed). A step's time runs from its dispatch, or from
the end of the step queued before it if that ended later, to the moment
its loss is read: t_s = done_s − max(t0_s, done_{s−1}). A step that
compiled its program is left out of every mean and median unless nothing
else is left.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass
class RunRecord:
  """The per-step record of one run (appended to as steps finish)."""
  start: int = 0
  losses: list = dataclasses.field(default_factory=list)
  step_times: list = dataclasses.field(default_factory=list)
  phase_of_step: list = dataclasses.field(default_factory=list)  # -1: flush
  compile_steps: list = dataclasses.field(default_factory=list)
  dispatch_times: list = dataclasses.field(default_factory=list)
  log: list = dataclasses.field(default_factory=list)
  val_curve: list = dataclasses.field(default_factory=list)
  last_done: float | None = None   # when the last finished step ended
  queued_steps: int = 0   # steps queued before the one before them was read

  def add_step(self, loss: float, t0: float, done: float, phase: int):
    """Step ``start + len(losses)``: dispatched at t0, its loss read at
    ``done`` (perf_counter seconds)."""
    self.step_times.append(done - max(t0, self.last_done or t0))
    self.last_done = done
    self.losses.append(loss)
    self.phase_of_step.append(phase)

  def _timed(self, steps) -> list:
    """The times of ``steps`` (absolute step numbers, recorded ones) that
    did not compile; all of them if every one compiled."""
    times = [self.step_times[i - self.start] for i in steps]
    kept = [self.step_times[i - self.start] for i in steps
            if i not in self.compile_steps]
    return kept or times

  def log_entry(self, step: int, every: int, tokens_per_step: int) -> dict:
    """The log entry of ``step``: its loss, and the mean loss and step time
    since the last log (at most ``every`` steps back)."""
    since = max(self.start, step + 1 - every)
    mean_time = float(np.mean(self._timed(range(since, step + 1))))
    entry = {"step": step + 1, "loss": self.losses[step - self.start],
             "loss_avg": float(np.mean(self.losses[since - self.start:
                                                   step + 1 - self.start])),
             "step_time_s": mean_time,
             "tokens_per_s": tokens_per_step / mean_time}
    self.log.append(entry)
    return entry

  def timing(self, num_phases: int, tokens_per_step: int) -> dict:
    """The run's step-time figures. Per phase, the median of its steps
    (its compile step and flushes left out); the last phase's is the
    steady state (what throughput means)."""
    every = range(self.start, self.start + len(self.step_times))
    timed = self._timed(every)
    mean_step = float(np.mean(timed))
    phase_steps = []
    for phase in range(num_phases):
      own = [t for j, (t, ph) in enumerate(
          zip(self.step_times, self.phase_of_step), self.start)
             if ph == phase and j not in self.compile_steps]
      if own:
        phase_steps.append({"phase": phase, "steps": len(own),
                            "median_step_s": float(np.median(own))})
    return {
        "first_step_s": self.step_times[0], "mean_step_time_s": mean_step,
        "median_step_time_s": float(np.median(timed)),
        "phase_steps": phase_steps,
        "steady_step_time_s": (phase_steps[-1]["median_step_s"]
                               if phase_steps else float(np.median(timed))),
        "tokens_per_s": tokens_per_step / mean_step,
    }

  def as_dict(self) -> dict:
    """The lists for the run's JSON."""
    return {"start_step": self.start, "log": self.log,
            "losses": self.losses, "step_times_s": self.step_times,
            "dispatch_times_s": self.dispatch_times,
            "phase_of_step": self.phase_of_step,
            "compile_steps": self.compile_steps,
            "val_curve": self.val_curve, "queued_steps": self.queued_steps}


def log_line(entry: dict, compiling: bool) -> str:
  """A step's log line from its ``log_entry``."""
  return (f"step {entry['step']:5d}  loss {entry['loss']:.4f} "
          f"(avg {entry['loss_avg']:.4f})  "
          f"{entry['tokens_per_s']:9,.0f} tok/s  "
          f"{1e3 * entry['step_time_s']:7.1f} ms/step"
          + (" (compile)" if compiling else ""))


def stats_line(stats: dict) -> str:
  """The sync's figures for a log line (``jaxfuse.summarize``'s keys)."""
  return (f"  density {stats.get('density', 1.0):.4f}  fill "
          f"{stats.get('slot_fill', 1.0):.2f}  missing "
          f"{stats['missing_leaves']:g}  overflow {stats['overflow']:g}"
          f"  sent {stats['wire_bytes']:,} B")
