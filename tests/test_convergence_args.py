"""``benchmarks/convergence.py lm``: which learning rates each recipe runs.
A ``--lrs-for`` key names a whole ``--recipes`` entry or its name before
the first ``+``; a key that names neither is refused before any run,
instead of silently running the default grid."""

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
