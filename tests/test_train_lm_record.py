"""examples/train_lm.py's step record: a queued step's time starts when the
step before it ended, compile steps stay out of means and medians, and
each phase's median is its own steps'. Times are hand-chosen seconds."""

import pytest

from _harness import repo_modules


@pytest.fixture(scope="module")
def record_module():
  with repo_modules("examples", "train_lm_record") as module:
    yield module


def test_a_queued_step_is_timed_from_the_end_of_the_one_before(
    record_module):
  r = record_module.RunRecord(start=0)
  r.add_step(2.0, t0=0.0, done=5.0, phase=0)    # compiles: 5 s
  r.add_step(1.5, t0=1.0, done=5.5, phase=0)    # queued at 1, waits to 5
  r.add_step(1.0, t0=6.0, done=6.25, phase=0)   # dispatched after: 0.25
  assert r.step_times == [5.0, 0.5, 0.25]
  assert r.losses == [2.0, 1.5, 1.0] and r.last_done == 6.25


def test_log_entry_and_timing_leave_compile_steps_out(record_module):
  r = record_module.RunRecord(start=10)         # resumed at step 10
  done = 0.0
  for loss, seconds, phase in [(4.0, 9.0, 0), (3.0, 0.2, 0), (2.0, 0.4, 0),
                               (1.0, 7.0, 1), (0.5, 0.1, 1), (0.25, 0.3, 1),
                               (0.2, 0.2, 1)]:
    r.add_step(loss, t0=done, done=done + seconds, phase=phase)
    done += seconds
  r.compile_steps[:] = [10, 13]
  entry = r.log_entry(step=12, every=5, tokens_per_step=100)
  # Steps 10-12: step 10 compiled, so the time is the mean of 0.2 and 0.4.
  assert entry["step"] == 13 and entry["loss"] == 2.0
  assert entry["loss_avg"] == pytest.approx(3.0)
  assert entry["step_time_s"] == pytest.approx(0.3)
  assert entry["tokens_per_s"] == pytest.approx(100 / 0.3)
  later = r.log_entry(step=16, every=2, tokens_per_step=100)
  assert later["loss_avg"] == pytest.approx(0.225)        # steps 15, 16
  assert later["step_time_s"] == pytest.approx(0.25)
  assert [e["step"] for e in r.log] == [13, 17]
  t = r.timing(num_phases=2, tokens_per_step=100)
  kept = [0.2, 0.4, 0.1, 0.3, 0.2]
  assert t["mean_step_time_s"] == pytest.approx(sum(kept) / 5)
  assert t["median_step_time_s"] == pytest.approx(0.2)
  assert t["first_step_s"] == 9.0
  assert t["phase_steps"] == [
      {"phase": 0, "steps": 2, "median_step_s": pytest.approx(0.3)},
      {"phase": 1, "steps": 3, "median_step_s": pytest.approx(0.2)}]
  assert t["steady_step_time_s"] == pytest.approx(0.2)


def test_a_run_of_compile_steps_only_is_timed_by_them(record_module):
  r = record_module.RunRecord()
  r.add_step(1.0, t0=0.0, done=3.0, phase=0)
  r.compile_steps.append(0)
  entry = r.log_entry(step=0, every=50, tokens_per_step=10)
  assert entry["step_time_s"] == 3.0
  t = r.timing(num_phases=1, tokens_per_step=10)
  assert t["mean_step_time_s"] == 3.0 and t["phase_steps"] == []
  assert t["steady_step_time_s"] == 3.0


def test_flush_steps_count_in_the_run_but_in_no_phase(record_module):
  r = record_module.RunRecord()
  for seconds, phase in [(0.5, 0), (0.9, -1), (0.5, 0)]:
    r.add_step(1.0, t0=r.last_done or 0.0,
               done=(r.last_done or 0.0) + seconds, phase=phase)
  t = r.timing(num_phases=1, tokens_per_step=1)
  assert t["phase_steps"] == [{"phase": 0, "steps": 2,
                               "median_step_s": pytest.approx(0.5)}]
  assert t["mean_step_time_s"] == pytest.approx(1.9 / 3)
  assert r.as_dict()["phase_of_step"] == [0, -1, 0]
