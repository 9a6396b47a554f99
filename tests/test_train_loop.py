"""examples/train_lm.py's training loop with steps queued ahead
(``--pipeline on``) against one that waits for every step: the same losses,
logs, phases and final validation loss, bitwise, with steps actually
queued. One CPU device, so no CPU collective waits across queued steps."""

import json
import pathlib
import subprocess
import sys

import pytest

from _harness import cpu_env
from jaxfuse.planning import trace

EXAMPLE = pathlib.Path(__file__).parents[1] / "examples" / "train_lm.py"
ARGS = ["--preset", "tiny", "--steps", "14", "--cpu-devices", "1",
        "--eval-batches", "1", "--eval-every", "7", "--batch-size", "4",
        "--seq-len", "32", "--log-every", "5", "--corpus-mb", "1",
        "--density", "0.05", "--dense-warmup", "3", "--warmup-steps", "2",
        "--flush-every", "6"]


def _run(tmp_path, compile_cache, pipeline, *extra):
  out = tmp_path / f"{pipeline}.json"
  r = subprocess.run([sys.executable, str(EXAMPLE), *ARGS, "--pipeline",
                      pipeline, "--json-out", str(out), *extra],
                     capture_output=True, text=True,
                     env=cpu_env(1, compile_cache), timeout=300)
  assert r.returncode == 0, r.stderr[-3000:]
  return json.loads(out.read_text())


@pytest.mark.example
def test_queued_steps_train_bitwise_alike(tmp_path, compile_cache):
  """... and a run that traces two of its steps (``--trace-dir``) trains
  alike too, its trace marking those two steps and no other."""
  on = _run(tmp_path, compile_cache, "on")
  off = _run(tmp_path, compile_cache, "off", "--trace-dir",
             str(tmp_path / "trace"), "--trace-steps", "10:12")
  assert off["traced_steps"] == [10, 12] and on["traced_steps"] is None
  events = trace.load_events(trace.find_trace_file(tmp_path / "trace"))
  marked = sorted(int(e["args"]["step_num"]) for e in events
                  if e.get("name") == "train" and e.get("ph") == "X")
  assert marked == [10, 11]
  assert on["pipeline"] and not off["pipeline"]
  # Steps 0, 4, 6, 9, 13 log or evaluate: the others are queued.
  assert on["queued_steps"] >= 6 and off["queued_steps"] == 0
  assert len(on["losses"]) == len(off["losses"]) == 14
  assert on["losses"] == off["losses"]
  assert on["phase_of_step"] == off["phase_of_step"]
  assert -1 in on["phase_of_step"]                  # a flush step ran
  assert len(set(on["phase_of_step"])) >= 3         # and the phases
  assert [e["step"] for e in on["log"]] == [e["step"] for e in off["log"]]
  assert on["val_curve"] == off["val_curve"]
  assert on["final_val_loss"] == off["final_val_loss"]
  assert len(on["step_times_s"]) == 14
  assert all(t > 0 for t in on["step_times_s"])
  # Handing a step over is quick, except where the call compiles it.
  hand = on["dispatch_times_s"]
  assert len(hand) == 14 and min(hand) > 0
  compiling = [hand[i] for i in on["compile_steps"]]
  assert min(compiling) > max(d for i, d in enumerate(hand)
                              if i not in on["compile_steps"])


@pytest.mark.example
def test_simulated_workers_train_as_the_devices_do(tmp_path, compile_cache):
  """--simulated-workers 4 on one CPU device trains what 4 CPU devices
  train: the same plan and phases, the bytes each worker sent, and the
  losses to rounding (the dense phase's pmean sums in another order)."""
  runs = {}
  for name, devices, extra in (("sim", 1, ["--simulated-workers", "4"]),
                               ("dev", 4, [])):
    out = tmp_path / f"{name}.json"
    r = subprocess.run(
        [sys.executable, str(EXAMPLE), *ARGS[:ARGS.index("--flush-every")],
         "--steps", "8", "--batch-size", "8", "--cpu-devices", str(devices),
         "--pipeline", "off", "--json-out", str(out), *extra],
        capture_output=True, text=True, env=cpu_env(devices, compile_cache),
        timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    runs[name] = json.loads(out.read_text())
  sim, dev = runs["sim"], runs["dev"]
  assert sim["config"]["num_devices"] == dev["config"]["num_devices"] == 4
  assert sim["plan"] == dev["plan"] and sim["phases"] == dev["phases"]
  assert sim["stats"]["wire_bytes"] == dev["stats"]["wire_bytes"]
  # the dense phase (3 steps) to float32 rounding; after it a rounding
  # apart may pick another slot or two, so the sparse steps only nearly
  assert sim["losses"][:4] == pytest.approx(dev["losses"][:4], rel=1e-5)
  assert sim["losses"] == pytest.approx(dev["losses"], rel=1e-3)
  assert sim["final_val_loss"] == pytest.approx(dev["final_val_loss"],
                                                rel=1e-3)
  assert sim["replicas_identical"] and dev["replicas_identical"]
