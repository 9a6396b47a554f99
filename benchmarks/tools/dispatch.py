"""Subcommands of the benchmark tools.

Each folded script lives here as ``benchmarks/tools/NAME.py`` with a
``main(argv)`` and no ``__main__`` block; its home tool runs it as
``python benchmarks/HOME.py NAME-WITH-DASHES ARGS`` (the old script's flags,
unchanged). Any other first argument goes to the home tool's own ``main``.
"""

from __future__ import annotations

import importlib
import pathlib
import sys
from typing import Callable, Mapping, Sequence

TOOLS = pathlib.Path(__file__).resolve().parent


def epilog(subcommands: Mapping[str, str]) -> str:
  """The ``--help`` text listing a home tool's subcommands: name -> summary."""
  width = max(map(len, subcommands))
  lines = [f"  {name:<{width}}  {what}" for name, what in subcommands.items()]
  return ("subcommands (each takes its own --help):\n" + "\n".join(lines))


def run(main: Callable, subcommands: Mapping[str, str],
        argv: Sequence[str] | None = None) -> None:
  """Runs the subcommand ``argv[0]`` names, else the home tool's ``main``;
  exits with the integer either returns (0 for anything else)."""
  argv = list(sys.argv[1:] if argv is None else argv)
  if argv and argv[0] in subcommands:
    sys.path.insert(0, str(TOOLS))
    module = importlib.import_module(argv[0].replace("-", "_"))
    sys.argv[0] = f"{sys.argv[0]} {argv[0]}"   # argparse's usage line
    result = module.main(argv[1:])
  else:
    result = main(argv)
  sys.exit(result if type(result) is int else 0)  # pylint: disable=unidiomatic-typecheck
