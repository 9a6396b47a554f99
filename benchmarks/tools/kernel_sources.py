"""Which source lines a compiled step's kernels come from.

XLA keeps, for every instruction of an optimized module, the Python stack
that traced it (the ``FileNames``, ``FunctionNames``, ``FileLocations`` and
``StackFrames`` tables of ``compiled.as_text()``, referenced by each
instruction's ``stack_frame_id``). This maps each kernel-launching
instruction (fusions, custom calls such as Pallas kernels, collectives,
sorts, scatters, copies: anything but parameters, constants, tuples and
bitcasts) to the innermost frame in a chosen package, and counts them per
source line::

  python benchmarks/overhead.py --preset gpt2-small --estimators dgc \\
      --strategy single --steps 60 --hlo-dir hlo --out overhead.json
  python benchmarks/kernels.py kernel-sources hlo/dense_None.hlo.txt \\
      hlo/jaxfuse_dgc.hlo.txt --overhead overhead.json --row dgc

prints, per source line of ``jaxfuse/``, the kernels of the second program
over the first (instructions of all computations, so a kernel inside a loop
counts once) and, with ``--overhead`` (a GPU run with ``--profile-steps``),
their launches and GPU time per step from the profile: a GPU kernel is
named after its instruction, ``.`` written as ``_``. A frame outside the
package (the model, optax) is grouped under its file and function.
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib
import re
from typing import NamedTuple

from jaxfuse.sync import hlo

NOT_KERNELS = frozenset({
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast",
    "after-all", "partition-id", "replica-id", "opt-barrier",
})
_TABLES = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")


class Frame(NamedTuple):
  file: str
  function: str
  line: int


def _table(text: str, name: str) -> list[str]:
  m = re.search(rf"^{name}\n((?:\d+ .*\n)*)", text, re.M)
  return m.group(1).splitlines() if m else []


def stack_frames(text: str) -> dict[int, list[Frame]]:
  """stack_frame_id -> its frames, innermost first."""
  files = {int(i): s.strip('"') for i, s in
           (l.split(" ", 1) for l in _table(text, "FileNames"))}
  funcs = {int(i): s.strip('"') for i, s in
           (l.split(" ", 1) for l in _table(text, "FunctionNames"))}
  fields = lambda l: {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", l)}
  locs = {int(l.split(" ", 1)[0]): fields(l)
          for l in _table(text, "FileLocations")}
  # A frame's parent_frame_id is its parent's id + 1 (1: no parent).
  parent, location = {}, {}
  for l in _table(text, "StackFrames"):
    f = fields(l)
    fid = int(l.split(" ", 1)[0])
    parent[fid], location[fid] = f.get("parent_frame_id", 1) - 1, f[
        "file_location_id"]
  out = {}
  for fid in location:
    chain, at, seen = [], fid, set()
    while at in location and at not in seen:
      seen.add(at)
      loc = locs[location[at]]
      chain.append(Frame(files[loc["file_name_id"]],
                         funcs[loc["function_name_id"]], loc.get("line", 0)))
      at = parent[at]
    out[fid] = chain
  return out


def source_of(frames: list[Frame], package: str) -> str:
  """The innermost frame in ``package`` as "path:line (function)", else the
  innermost frame's "file (function)"; "?" without a stack."""
  for f in frames:
    parts = pathlib.PurePath(f.file).parts
    if package in parts[:-1]:
      rel = "/".join(parts[len(parts) - 1 - parts[::-1].index(package):])
      return f"{rel}:{f.line} ({f.function.split('.')[0]})"
  if frames:
    return f"{pathlib.PurePath(frames[0].file).name} ({frames[0].function})"
  return "?"


def kernel_sources(text: str, package: str = "jaxfuse") -> dict[str, str]:
  """Kernel-launching instruction name -> its source (``source_of``), for
  every computation of the module."""
  frames = stack_frames(text)
  out = {}
  for computation in hlo.computations(text):
    for inst in computation.instructions:
      if inst.opcode in NOT_KERNELS:
        continue
      s = re.search(r"stack_frame_id=(\d+)", inst.attributes)
      out[inst.name] = source_of(
          frames.get(int(s.group(1)), []) if s else [], package)
  return out


def kernels_called(text: str) -> set[str]:
  """Instructions that run as kernels: those of the entry computation and
  of the computations it runs (loop bodies and conditions, branches,
  calls), not the insides of fusions (one kernel each) or reducers."""
  comps = {c.name: c for c in hlo.computations(text)}
  follow = {"while": ("condition", "body"), "call": ("to_apply",),
            "conditional": ("branch_computations", "true_computation",
                            "false_computation")}
  todo = [c.name for c in comps.values() if c.entry]
  called, out = set(todo), set()
  while todo:
    for inst in comps[todo.pop()].instructions:
      if inst.opcode in NOT_KERNELS:
        continue
      out.add(inst.name)
      for name in hlo.called_names(inst, follow.get(inst.opcode, ())):
        if name in comps and name not in called:
          called.add(name)
          todo.append(name)
  return out


def count_by_source(text: str, package: str = "jaxfuse"
                    ) -> collections.Counter:
  """Kernels (``kernels_called``) per source line."""
  sources = kernel_sources(text, package)
  return collections.Counter(sources[k] for k in kernels_called(text)
                             if k in sources)


def profile_by_source(text: str, launches: dict[str, float],
                      micros: dict[str, float], package: str = "jaxfuse"
                      ) -> dict[str, tuple[float, float]]:
  """Profiled GPU kernels per source line: (launches, µs) per step, from
  per-kernel-name counts and times (``overhead.gpu_kernels``). A Pallas
  kernel is named after its ``pallas_call`` (``jaxfuse_sparsify_pass1__3``:
  under "jaxfuse/ Pallas jaxfuse_sparsify_pass1"); other kernels named
  after no instruction (cuBLAS, memsets) go under their own name."""
  sources = {k.replace(".", "_"): s
             for k, s in kernel_sources(text, package).items()}
  out = collections.defaultdict(lambda: [0.0, 0.0])
  for name, us in micros.items():
    key = sources.get(name, name)
    if name not in sources and name.startswith(package + "_"):
      key = f"{package}/ Pallas " + re.sub(r"__\d+$", "", name)
    row = out[key]
    row[0] += launches.get(name, 0.0)
    row[1] += us
  return {k: (v[0], v[1]) for k, v in out.items()}


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("baseline", help="HLO text of the baseline (dense) step")
  p.add_argument("program", help="HLO text of the step to attribute")
  p.add_argument("--package", default="jaxfuse",
                 help="attribute to the innermost frame in this package")
  p.add_argument("--overhead", help="overhead.py JSON of the same run")
  p.add_argument("--row", help="its row's estimator (default: the first "
                 "jaxfuse row)")
  p.add_argument("--top", type=int, default=40, help="rows to print")
  p.add_argument("--out", help="JSON file to write")
  args = p.parse_args(argv)
  base = pathlib.Path(args.baseline).read_text()
  prog = pathlib.Path(args.program).read_text()
  before = count_by_source(base, args.package)
  after = count_by_source(prog, args.package)
  delta = {k: after[k] - before[k] for k in set(before) | set(after)
           if after[k] != before[k]}
  print(f"kernels in the program: {sum(after.values())}, baseline "
        f"{sum(before.values())}, over it {sum(delta.values()):+d}")
  print(f"\n{'over':>5}  source")
  for k, v in sorted(delta.items(), key=lambda kv: -abs(kv[1]))[:args.top]:
    print(f"{v:+5d}  {k}")
  result = {"baseline": dict(before), "program": dict(after),
            "delta": delta}
  if args.overhead:
    rows = json.loads(pathlib.Path(args.overhead).read_text())["rows"]
    row = next(r for r in rows if r["sync"] != "dense" and (
        args.row is None or r["estimator"] == args.row))
    if "by_name_us" not in row:
      raise SystemExit(f"{args.overhead}: no profile in that row (run "
                       "overhead.py on a GPU with --profile-steps).")
    prof = profile_by_source(prog, row.get("by_name_launches", {}),
                             row["by_name_us"], args.package)
    ours = {k: v for k, v in prof.items()
            if k.startswith(args.package + "/")}
    print(f"\nGPU per step in {args.package}/: "
          f"{sum(v[0] for v in ours.values()):.0f} launches, "
          f"{sum(v[1] for v in ours.values()):.1f} us")
    print(f"{'launches':>8} {'us':>8}  source")
    for k, (n, us) in sorted(ours.items(), key=lambda kv: -kv[1][1])[
        :args.top]:
      print(f"{n:8.0f} {us:8.1f}  {k}")
    result["profile"] = {k: {"launches": n, "us": us}
                         for k, (n, us) in prof.items()}
  if args.out:
    pathlib.Path(args.out).write_text(json.dumps(result, indent=1))
  return result

