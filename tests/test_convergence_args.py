"""``benchmarks/convergence.py lm``: which learning rates each recipe runs.
A ``--lrs-for`` key names a whole ``--recipes`` entry or its name before
the first ``+``; a key that names neither is refused before any run,
instead of silently running the default grid."""

import argparse

import pytest

from _harness import repo_modules


@pytest.fixture(scope="module")
def conv():
  with repo_modules("benchmarks", "convergence") as module:
    yield module


def test_a_whole_entry_key_beats_its_name_and_others_keep_the_grid(conv):
  jobs = conv.lm_jobs(
      ["dense", "onebit_adamw+warm", "onebit_adamw+warm+early"], [3e-4],
      {"onebit_adamw": [1e-4, 2e-4], "onebit_adamw+warm+early": [5e-5]})
  assert jobs == [("dense", 3e-4), ("onebit_adamw+warm", 1e-4),
                  ("onebit_adamw+warm", 2e-4),
                  ("onebit_adamw+warm+early", 5e-5)]


def test_a_key_that_names_no_recipe_is_refused(conv):
  with pytest.raises(SystemExit, match=r"--lrs-for 'onebit_adamw\+wram'"):
    conv.lm_jobs(["dense", "onebit_adamw+warm"], [3e-4],
                 {"onebit_adamw+wram": [1e-4]})


def _lm_args(*argv):
  """``convergence.py lm``'s arguments that ``lm_command`` reads."""
  return argparse.Namespace(
      preset="tiny", steps=600, seed=0, eval_every=50, eval_batches=8,
      density=0.05, estimator="dgc", corpus_mb=32.0, devices=None,
      cpu_devices=8, warm_steps=50, dense_fraction=0.1, extra=list(argv))


def test_a_local_steps_arm_runs_the_demo_with_its_h_outer_and_density(conv):
  """sparseloco+h30+d0.01: --local-steps 30 --outer sparseloco, density
  0.01 (the last --density wins), no --optimizer (local_steps' own AdamW);
  +int2+packed: 2-bit values and packed indices;
  diloco+h15: on a density-1 plan; an arm without its H is refused."""
  cmd = conv.lm_command("sparseloco+h30+d0.01", 3e-3, _lm_args())
  assert "--optimizer" not in cmd
  assert cmd[cmd.index("--outer") + 1] == "sparseloco"
  assert cmd[cmd.index("--local-steps") + 1] == "30"
  assert cmd[len(cmd) - 1 - cmd[::-1].index("--density") + 1] == "0.01"
  cmd = conv.lm_command("sparseloco+h30+int2+packed", 3e-3, _lm_args())
  assert cmd[cmd.index("--sparse-wire") + 1] == "int2"
  assert "--packed-indices" in cmd
  cmd = conv.lm_command("diloco+h15", 3e-3, _lm_args())
  assert cmd[cmd.index("--outer") + 1] == "diloco"
  assert cmd[len(cmd) - 1 - cmd[::-1].index("--density") + 1] == "1"
  with pytest.raises(SystemExit, match=r"needs its H, e.g. diloco\+h30"):
    conv.lm_command("diloco", 3e-3, _lm_args())


@pytest.mark.parametrize("bad", ["0.01", "2:30", "0.01:0", "0.01:30:int3",
                                 "a:b"])
def test_regimes_reads_its_local_settings_and_refuses_others(conv, bad):
  """``convergence.py regimes --local RHO:H[:WIRE]``."""
  import regimes  # pylint: disable=g-import-not-at-top
  assert conv.SUBCOMMANDS["regimes"]
  assert regimes._setting("0.01:30:int2+packed") == (0.01, 30, "int2", True)
  assert regimes._setting("0.05:15") == (0.05, 15, "gradient", False)
  with pytest.raises(argparse.ArgumentTypeError, match="RHO"):
    regimes._setting(bad)
