"""Names of 0.1 that moved in 0.2, kept for one more release (0.3).

0.2 moved the offline modules into ``jaxfuse.planning``. The old names still
work, each use warning with the new place (``DeprecationWarning``):

  jaxfuse.costs, from jaxfuse import costs      module ``__getattr__``
  import jaxfuse.costs, from jaxfuse.costs import Costs
                                                 ``_MovedFinder`` (last on
                                                 ``sys.meta_path``)

and give the very module object of the new place. Removed in 0.4.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types
import warnings

# 0.1's jaxfuse.<name> -> where it lives since 0.2.
MOVED_MODULES = {
    name: f"jaxfuse.planning.{name}"
    for name in ("cli", "costs", "optimal", "ordering", "planner",
                 "profiling", "simulate", "strategies", "timeline_plot")
}
REMOVED_IN = "0.4"


def moved_module(name: str, stacklevel: int = 2) -> types.ModuleType:
  """The module 0.1 called ``jaxfuse.<name>``, with a DeprecationWarning."""
  new = MOVED_MODULES[name]
  package, _, module = new.rpartition(".")
  warnings.warn(
      f"jaxfuse.{name} moved to {new} in jaxfuse 0.2; import it from there "
      f"(from {package} import {module}). The old name will be removed in "
      f"{REMOVED_IN}.", DeprecationWarning, stacklevel=stacklevel + 1)
  return importlib.import_module(new)


class _MovedLoader(importlib.abc.Loader):
  """Loads ``jaxfuse.<name>`` as the module of its new place: the import
  system returns what ``sys.modules`` holds once ``exec_module`` ran."""

  def create_module(self, spec):
    return None

  def exec_module(self, module):
    name = module.__name__
    sys.modules[name] = moved_module(name.rpartition(".")[2])


class _MovedFinder(importlib.abc.MetaPathFinder):
  """Finds only the moved ``jaxfuse.<name>`` modules (nothing else)."""

  def find_spec(self, fullname, path=None, target=None):
    package, _, name = fullname.rpartition(".")
    if package != "jaxfuse" or name not in MOVED_MODULES:
      return None
    return importlib.util.spec_from_loader(fullname, _MovedLoader())


def install() -> None:
  """Put ``_MovedFinder`` last on ``sys.meta_path`` (once): only names no
  other finder knows reach it."""
  if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
    sys.meta_path.append(_MovedFinder())
