"""examples/nnx_classifier.py (flax NNX with BatchNorm, make_train_step,
8 CPU workers): a run stopped inside the warm-up and resumed from its
checkpoint trains bitwise as the run that never stopped, BatchNorm
statistics included (the held-out accuracy reads them); the recipe and
its dense baseline both learn."""

import json
import pathlib
import subprocess
import sys

import pytest

from _harness import cpu_env

EXAMPLE = pathlib.Path(__file__).parents[1] / "examples" / "nnx_classifier.py"
# phases: dense 0-6, 25 % 6-10, 6.25 % 10-14, the plan from 14
ARGS = ["--steps", "18", "--dense-steps", "6", "--ramp-steps", "4",
        "--rows", "8"]


def _run(tmp_path, compile_cache, name, *extra):
  out = tmp_path / f"{name}.json"
  r = subprocess.run([sys.executable, str(EXAMPLE), *ARGS, "--json-out",
                      str(out), *extra], capture_output=True, text=True,
                     env=cpu_env(8, compile_cache), timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  return json.loads(out.read_text()), r.stdout


@pytest.mark.example
def test_resume_inside_the_warm_up_and_the_dense_baseline(tmp_path,
                                                          compile_cache):
  ckpt = str(tmp_path / "ckpt")
  straight, _ = _run(tmp_path, compile_cache, "straight")
  first, _ = _run(tmp_path, compile_cache, "first", "--ckpt", ckpt,
                  "--stop-after", "8", "--no-baseline")
  rest, log = _run(tmp_path, compile_cache, "rest", "--ckpt", ckpt,
                   "--no-baseline")
  assert first["stopped"] and len(first["losses"]) == 8
  assert "resumed at step 8 (phase 1)" in log      # inside the 25 % phase
  assert len(rest["losses"]) == 10
  assert first["losses"] + rest["losses"] == straight["losses"]   # bitwise
  assert rest["accuracy"] == straight["accuracy"]
  assert "baseline_accuracy" not in rest
  # both learn: chance is 0.1
  assert straight["accuracy"] > 0.5 and straight["baseline_accuracy"] > 0.5
  assert straight["losses"][-1] < 0.7 * straight["losses"][0]
  assert (straight["baseline_losses"][-1] <
          0.7 * straight["baseline_losses"][0])
