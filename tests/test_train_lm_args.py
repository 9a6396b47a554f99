"""examples/train_lm.py's ``--send-early-window`` (checked where it is
parsed, and handed to ``jaxfuse.send_early`` as its window) and
``--trace-steps`` (checked, and resolved against the run's steps)."""

import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from _harness import repo_modules


@pytest.fixture(scope="module")
def example():
  with repo_modules("examples", "train_lm", "train_lm_args") as modules:
    yield modules


@pytest.mark.parametrize("argv, message", [
    (["--send-early-window", "2"], "give --send-early too"),
    (["--send-early-window", "1"], "give --send-early too"),
    (["--send-early", "--send-early-window", "-1"],
     "--send-early-window -1: give a number of points >= 1, or 0"),
    (["--trace-steps", "3:5"], "give --trace-dir too"),
    (["--trace-dir", "t", "--trace-steps", "5:5"],
     "'5:5': give the first step and the step after the last, like 300:305"),
    (["--trace-dir", "t", "--trace-steps", "7"], "like 300:305"),
])
def test_bad_windows_stop_with_the_fix(example, capsys, argv, message):
  _, args_lib = example
  with pytest.raises(SystemExit):
    args_lib.parse_args(argv)
  assert message in capsys.readouterr().err


def test_the_window_reaches_send_early(example, monkeypatch):
  train_lm, args_lib = example
  assert args_lib.parse_args(["--send-early"]).send_early_window == 2
  assert args_lib.parse_args(
      ["--send-early", "--send-early-window", "1"]).send_early_window == 1
  seen = []

  def recording(step, *, window):
    seen.append(window)
    return step

  monkeypatch.setattr(train_lm.jaxfuse, "send_early", recording)
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), (train_lm.AXIS,))
  for window in (1, 2, 0):
    train_lm.make_train_step(lambda p, b: 0.0, optax.sgd(0.1), mesh, P(),
                             "jaxfuse", send_early=True, window=window)
  train_lm.make_train_step(lambda p, b: 0.0, optax.sgd(0.1), mesh, P(),
                           "jaxfuse", send_early=False, window=2)
  assert seen == [1, 2, None]


def test_trace_steps_default_to_the_last_five_within_the_run(example):
  train_lm, args_lib = example
  parse = lambda *a: args_lib.parse_args(list(a))
  assert train_lm.trace_steps(parse(), 0, 100) == range(0)
  assert train_lm.trace_steps(parse("--trace-dir", "t"), 0, 100) == range(
      95, 100)
  assert train_lm.trace_steps(parse("--trace-dir", "t"), 98, 100) == range(
      98, 100)                                   # resumed near the end
  assert train_lm.trace_steps(
      parse("--trace-dir", "t", "--trace-steps", "300:305"), 0, 1000) == (
          range(300, 305))
  with pytest.raises(SystemExit, match=r"--trace-steps 300:305: give steps "
                     r"within this run's 0:200"):
    train_lm.trace_steps(
        parse("--trace-dir", "t", "--trace-steps", "300:305"), 0, 200)
