"""Whether several processes compiled the same collectives in the same order.

NCCL needs every rank to issue the collectives of a communicator in one
order; under ``jax.distributed`` each process compiles its own program, so
schedules that differ between processes hang the step. Given one XLA dump
directory per process (``XLA_FLAGS=--xla_dump_to=DIR``), this takes each
process's scheduled module with the most collectives (by default; or the
one whose file name matches ``--module``), lists its collectives in
program order (opcode, result shape, replica groups) and prints where the
processes' lists first differ.

  python benchmarks/collective_order.py DUMP_0 DUMP_1 ... [--module RE]
"""
import argparse
import pathlib
import re
import sys

COLLECTIVE = re.compile(
    r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.+?)\s+"
    r"((?:all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute"
    r"|collective-broadcast|ragged-all-to-all)(?:-start)?|async-start)\(")
GROUPS = re.compile(r"replica_groups=(\{[^}]*\}\}|\[[^\]]*\][^,\s]*)")


def collectives(text: str) -> list[str]:
  """The module's collective starts in program order, as 'op shape groups'."""
  found = []
  for line in text.splitlines():
    m = COLLECTIVE.match(line)
    if m:
      groups = GROUPS.search(line)
      found.append(f"{m.group(2)} {m.group(1)}"
                   + (f" {groups.group(1)}" if groups else ""))
  return found


def scheduled_module(directory: pathlib.Path, pattern: str | None):
  """The after-optimizations module of ``directory`` matching ``pattern``
  with the most collectives: (file, its collectives)."""
  best = (None, [])
  for f in sorted(directory.glob("*after_optimizations.txt")):
    if pattern and not re.search(pattern, f.name):
      continue
    found = collectives(f.read_text(errors="replace"))
    if len(found) > len(best[1]):
      best = (f, found)
  return best


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("dumps", nargs="+", type=pathlib.Path)
  parser.add_argument("--module", help="regex on the dump's file names")
  parser.add_argument("--lists-out", type=pathlib.Path,
                      help="write each process's list to DIR/<dump>.txt")
  args = parser.parse_args(argv)
  lists = []
  for d in args.dumps:
    f, found = scheduled_module(d, args.module)
    print(f"{d}: {f.name if f else 'no module'}, {len(found)} collectives")
    lists.append(found)
    if args.lists_out:
      args.lists_out.mkdir(parents=True, exist_ok=True)
      (args.lists_out / f"{d.name}.txt").write_text(
          f"{f}\n" + "".join(c + "\n" for c in found))
  first = lists[0]
  same = True
  for d, other in zip(args.dumps[1:], lists[1:]):
    at = next((i for i, (a, b) in enumerate(zip(first, other)) if a != b),
              None if len(first) == len(other) else min(len(first), len(other)))
    if at is None:
      print(f"{d}: the same {len(other)} collectives in the same order")
      continue
    same = False
    print(f"{d}: differs from {args.dumps[0]} at collective {at}:")
    for i in range(max(0, at - 2), min(at + 3, max(len(first), len(other)))):
      a = first[i] if i < len(first) else "-"
      b = other[i] if i < len(other) else "-"
      print(f"  {i:4d} {'  ' if a == b else '!='} {a[:90]}\n"
            f"       {'  ' if a == b else '  '} {b[:90]}")
  return 0 if same else 1


if __name__ == "__main__":
  sys.exit(main())
