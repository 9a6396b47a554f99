"""``benchmarks/``: six tools a user runs, each with a ``--help`` that lists
its subcommands, and a folded script run through its home tool."""

import gzip
import lzma
import re
import subprocess
import sys

import pytest

from _harness import cpu_env
from _harness import REPO

# Each tool and the subcommands it runs (the scripts folded into it).
TOOLS = {
    "convergence.py": ("sgd-study", "sgd-stability", "elastic",
                       "predict-time", "regimes"),
    "overhead.py": ("compile-time", "lm-throughput", "program-size",
                    "overlap", "simulated-workers"),
    "collectives.py": ("collective-order",),
    "planner.py": ("predict-overlap", "tail-plans", "window-model",
                   "pack-trace"),
    "kernels.py": ("kernel-slowdown", "kernel-sources"),
    "gpu.sh": ("convergence", "overlap", "scaling", "checks"),
}


def _run(*args):
  return subprocess.run(list(args), cwd=REPO, env=cpu_env(1),
                        capture_output=True, text=True, timeout=300,
                        check=False)


def test_benchmarks_has_exactly_the_six_entry_points():
  found = set()
  for path in (REPO / "benchmarks").rglob("*"):
    if "results" in path.relative_to(REPO / "benchmarks").parts:
      continue
    if path.suffix == ".sh" or (
        path.suffix == ".py" and re.search(
            r"^if __name__ == .__main__.:", path.read_text(), re.M)):
      found.add(str(path.relative_to(REPO / "benchmarks")))
  assert found == set(TOOLS)


@pytest.mark.parametrize("tool", sorted(TOOLS))
def test_help_exits_0_and_lists_the_subcommands(tool):
  runner = "bash" if tool.endswith(".sh") else sys.executable
  done = _run(runner, f"benchmarks/{tool}", "--help")
  assert done.returncode == 0, done.stderr
  for sub in TOOLS[tool]:
    assert re.search(rf"^\s+{re.escape(sub)}\s", done.stdout, re.M), (
        f"{tool} --help does not list {sub}:\n{done.stdout}")


def test_gpu_runner_refuses_an_unknown_suite_naming_the_suites():
  done = _run("bash", "benchmarks/gpu.sh", "nvlink")
  assert done.returncode == 2
  assert "convergence overlap scaling checks" in done.stderr


def test_a_subcommand_runs_the_folded_script_with_its_own_flags(tmp_path):
  trace = b'{"traceEvents": [{"name": "all-gather", "dur": 7}]}'
  (tmp_path / "t.json.gz").write_bytes(gzip.compress(trace))
  done = _run(sys.executable, "benchmarks/planner.py", "pack-trace",
              str(tmp_path / "t.json.gz"), str(tmp_path / "t.json.xz"))
  assert done.returncode == 0, done.stderr
  assert lzma.decompress((tmp_path / "t.json.xz").read_bytes()) == trace
  usage = _run(sys.executable, "benchmarks/planner.py", "pack-trace", "-h")
  assert usage.stdout.startswith("usage: planner.py pack-trace ")
