"""Whether several processes compiled the same collectives in the same order.

NCCL needs every rank to issue the collectives of a communicator in one
order; under ``jax.distributed`` each process compiles its own program, so
schedules that differ between processes hang the step. Given one XLA dump
directory per process (``XLA_FLAGS=--xla_dump_to=DIR``), this lists the
collectives of each scheduled module (``hlo.collective_list``: opcode,
result shape, peers, in the entry's order with each loop's or call's
collectives where it runs), pairs the modules by name and compile order
(``--module``: only file names matching a regex) and prints, per module,
whether every process has the same list and where the first difference
is: after the fact, for every program of a run that hung.
``jaxfuse.check_same_collectives(compiled)`` makes the same comparison
inside a training script, before the step runs.

  python benchmarks/collectives.py collective-order DUMP_0 DUMP_1 ... [--module RE]
"""
import argparse
import pathlib
import re
import sys

from jaxfuse.sync.agreement import first_difference
from jaxfuse.sync import hlo

collectives = hlo.collective_list   # 'opcode shape groups', in order


def scheduled_modules(directory: pathlib.Path, pattern: str | None = None
                      ) -> dict[str, list[str]]:
  """Module name -> collectives, for each after-optimizations module of
  ``directory`` that has any (and whose file name matches ``pattern``).
  The name leaves out XLA's module number, which can differ between
  processes; the n-th module of one name (in compile order) is
  'NAME#n'."""
  found, seen = {}, {}
  files = directory.glob("module_*after_optimizations.txt")
  for f in sorted(files, key=lambda f: int(f.name.split(".")[0][7:])):
    if pattern and not re.search(pattern, f.name):
      continue
    listed = collectives(f.read_text(errors="replace"))
    if listed:
      name = f.name.split(".", 1)[1].replace("_after_optimizations.txt", "")
      n = seen[name] = seen.get(name, -1) + 1
      found[f"{name}#{n}"] = listed
  return found


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("dumps", nargs="+", type=pathlib.Path)
  parser.add_argument("--module", help="regex on the dump's file names")
  parser.add_argument("--lists-out", type=pathlib.Path,
                      help="write each list to DIR/<dump>/<module>_<n>")
  args = parser.parse_args(argv)
  per_process = [scheduled_modules(d, args.module) for d in args.dumps]
  names = sorted(set().union(*per_process))
  same = bool(names)
  if not names:
    print("no module with collectives in", *map(str, args.dumps))
  for name in names:
    lists = [found.get(name) for found in per_process]
    if args.lists_out:
      for d, listed in zip(args.dumps, lists):
        if listed is not None:
          out = args.lists_out / d.name / name.replace("#", "_")
          out.parent.mkdir(parents=True, exist_ok=True)
          out.write_text("".join(c + "\n" for c in listed))
    missing = [str(d) for d, x in zip(args.dumps, lists) if x is None]
    if missing:
      same = False
      print(f"{name}: not compiled by {', '.join(missing)}")
      continue
    first = lists[0]
    differs = [(d, other, first_difference(first, other))
               for d, other in zip(args.dumps[1:], lists[1:])]
    differs = [x for x in differs if x[2] is not None]
    if not differs:
      print(f"{name}: the same {len(first)} collectives in the same order "
            f"in all {len(lists)} processes")
      continue
    same = False
    for d, other, at in differs:
      print(f"{name}: {d} differs from {args.dumps[0]} at collective {at}:")
      for i in range(max(0, at - 2), min(at + 3, max(len(first), len(other)))):
        a = first[i] if i < len(first) else "-"
        b = other[i] if i < len(other) else "-"
        mark = "  " if a == b else "!="
        print(f"  {i:4d} {mark} {a[:100]}\n          {b[:100]}")
  return 0 if same else 1

