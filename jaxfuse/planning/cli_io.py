"""The ``jaxfuse`` command's input and output: argument types, model
functions (MODULE:FUNCTION), plan and costs files. Every problem with them
is a ``UsageError``: one line on stderr, exit status 2 (``cli.main``).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import math
import os
import re
import sys
from typing import Any

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmg]?)(i?b?)\s*$", re.IGNORECASE)


class UsageError(Exception):
  """A problem with the user's input: printed as one line, exit status 2."""


class Parser(argparse.ArgumentParser):
  """argparse, but errors are one line (and raise, so ``main`` decides)."""

  def error(self, message):
    raise UsageError(f"{self.prog}: error: {message} (see {self.prog} "
                     "--help)")


# --- argument helpers ---------------------------------------------------------

def parse_size(text: str) -> int:
  """'4096', '64K', '1M', '2MiB', '1.5G' -> bytes or elements (powers of 2)."""
  m = _SIZE.match(str(text))
  if not m:
    raise argparse.ArgumentTypeError(
        f"{text!r} is not a size; write e.g. 4096, 64K, 1M or 2MiB")
  scale = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30}[m.group(2).lower()]
  value = float(m.group(1)) * scale
  if value < 1 or value != int(value):
    raise argparse.ArgumentTypeError(f"{text!r} must be a whole number >= 1")
  return int(value)


def positive_int(text: str) -> int:
  try:
    value = int(text)
  except ValueError:
    value = 0
  if value < 1:
    raise argparse.ArgumentTypeError(f"{text!r} must be an integer >= 1")
  return value


def unit_float(text: str, low_open: bool = True) -> float:
  try:
    value = float(text)
  except ValueError:
    value = math.nan
  if not (0 < value <= 1 if low_open else 0 <= value <= 1):
    raise argparse.ArgumentTypeError(
        f"{text!r} must be a number in {'(' if low_open else '['}0, 1]")
  return value


def load_model(spec: str) -> tuple[Any, Any, tuple]:
  """MODULE:FUNCTION -> (loss_fn or None, params, example_args)."""
  module_name, sep, func_name = spec.rpartition(":")
  if not sep or not module_name or not func_name:
    raise UsageError(f"{spec!r} is not MODULE:FUNCTION (e.g. mymodel:make, "
                     "or path/to/model.py:make).")
  if module_name.endswith(".py") or os.sep in module_name:
    if not os.path.isfile(module_name):
      raise UsageError(f"{spec}: no such file {module_name!r}.")
    name = "_jaxfuse_model_" + re.sub(r"\W", "_", os.path.basename(
        module_name)[:-3])
    loader = importlib.util.spec_from_file_location(name, module_name)
    module = importlib.util.module_from_spec(loader)
    sys.modules[name] = module
    try:
      loader.loader.exec_module(module)
    except Exception as e:  # the user's code: report it in one line
      raise UsageError(f"{spec}: importing {module_name} raised "
                       f"{type(e).__name__}: {e}") from e
  else:
    if os.getcwd() not in sys.path and "" not in sys.path:
      sys.path.insert(0, os.getcwd())
    try:
      module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
      raise UsageError(f"{spec}: cannot import module {module_name!r} ({e}); "
                       "run from the directory that holds it, or give the "
                       ".py file's path.") from e
    except Exception as e:
      raise UsageError(f"{spec}: importing {module_name!r} raised "
                       f"{type(e).__name__}: {e}") from e
  func = getattr(module, func_name, None)
  if func is None:
    raise UsageError(f"{spec}: module {module_name!r} has no attribute "
                     f"{func_name!r}.")
  if not callable(func):
    raise UsageError(f"{spec}: {func_name!r} is a {type(func).__name__}, not "
                     "a function.")
  try:
    out = func()
  except Exception as e:
    raise UsageError(f"{spec}() raised {type(e).__name__}: {e}") from e
  if isinstance(out, tuple) and len(out) >= 2 and callable(out[0]):
    loss_fn, params, *args = out
  else:
    loss_fn, params, args = None, out, ()
  import jax  # pylint: disable=g-import-not-at-top
  if not jax.tree.leaves(params):
    raise UsageError(f"{spec}() returned no arrays; return the params pytree "
                     "or (loss_fn, params, *example_args).")
  return loss_fn, params, tuple(args)


def load_file(cls, path: str, what: str):
  """``cls.load(path)`` with one-line errors (PlanError and CostsError are
  ValueErrors)."""
  try:
    return cls.load(path)
  except OSError as e:
    raise UsageError(f"cannot read {what} {path!r}: {e.strerror or e}.") from e
  except (ValueError, TypeError) as e:
    raise UsageError(f"{path}: {e}") from e


def load_plan(path: str):
  """The ``Plan`` saved at ``path``."""
  from jaxfuse import plans  # pylint: disable=g-import-not-at-top
  return load_file(plans.Plan, path, "plan")


def load_costs(path: str):
  """The ``Costs`` saved at ``path``."""
  from jaxfuse.planning import costs  # pylint: disable=g-import-not-at-top
  return load_file(costs.Costs, path, "costs")


def check_output(path: str, what: str) -> None:
  """Refuse an output path that cannot take the ``what`` file (a JSON
  file), before any work: a missing folder, something that is not a
  regular file, a Python source (the model's own, say)."""
  from jaxfuse.plans import jsonfile as _jsonfile  # pylint: disable=g-import-not-at-top
  try:
    real = _jsonfile.writable_target(path)   # what save() checks, now
  except OSError as e:
    raise UsageError(f"-o {path}: {e}.") from e
  if real.endswith(".py"):
    raise UsageError(f"-o {path} is Python source, which the {what} would "
                     f"overwrite; give a .json name (e.g. {what}.json).")


def save(obj, path: str, what: str) -> None:
  """``obj.save(path)`` with a one-line error."""
  try:
    obj.save(path)
  except OSError as e:
    raise UsageError(f"cannot write {what} {path!r}: {e.strerror or e}.") from e


def ms(seconds: float) -> str:
  """Seconds as milliseconds, three decimals, with the unit."""
  return f"{seconds * 1e3:.3f} ms"
