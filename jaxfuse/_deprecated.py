"""Module paths that moved, kept for one more release, each use warning
with the new place (``DeprecationWarning``):

  jaxfuse.costs, from jaxfuse import costs      module ``__getattr__``
  import jaxfuse.costs, from jaxfuse.costs import Costs
                                                 ``_MovedFinder`` (last on
                                                 ``sys.meta_path``)

and give the very module object of the new place.

- 0.2 moved the offline modules into ``jaxfuse.planning`` (removed in 0.4).
- 0.3 grouped the step's modules into folders that show the pipeline:
  ``jaxfuse.optim`` (recipes, phases, clipping, delay, non-finite
  handling, send_early), ``jaxfuse.state`` (placement, checkpoints,
  relayout, elastic restarts), ``jaxfuse.sync`` (the bucket steps) and
  ``jaxfuse.plans`` (the plan, its checks, its JSON files) (removed in 0.5).
  ``jaxfuse.checkpoint``, ``jaxfuse.clipping``, ``jaxfuse.elastic`` and
  ``jaxfuse.grouped`` stay public attributes of ``jaxfuse``, without a
  warning; only their old import paths warn. ``jaxfuse.relayout`` is the
  function: its module's old path is not kept (importing it would rebind
  the package's attribute to the module).
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.util
import inspect
import sys
import types
from typing import Callable
import warnings

# old jaxfuse.<name> -> (where it lives now, the release that moved it,
# the release that removes the old name).
MOVED_MODULES = {
    **{name: (f"jaxfuse.planning.{name}", "0.2", "0.4")
       for name in ("cli", "costs", "optimal", "ordering", "planner",
                    "profiling", "simulate", "strategies", "timeline_plot")},
    **{name: (f"jaxfuse.{new}", "0.3", "0.5") for name, new in {
        "recipes": "optim.recipes", "phases": "optim.phases",
        "clipping": "optim.clipping", "delay": "optim.delay",
        "nonfinite": "optim.nonfinite", "overlap": "optim.overlap",
        "compile_options": "optim.compile_options",
        "placement": "state.placement", "checkpoint": "state.checkpoint",
        "elastic": "state.elastic",
        "bucket_sync": "sync.bucket_sync", "bucket_pass": "sync.bucket_pass",
        "grouped": "sync.grouped", "schedule": "sync.bucket_steps",
        "radix_select": "kernels.radix_select",
        "plan_checks": "plans.checks", "_jsonfile": "plans.jsonfile",
        # run by the step builder: the step wing imports no planning module
        "planning.agreement": "sync.agreement", "planning.hlo": "sync.hlo",
    }.items()},
}


def moved_module(name: str, stacklevel: int = 2) -> types.ModuleType:
  """The module once called ``jaxfuse.<name>``, with a DeprecationWarning.

  Args:
    name: the old module name under ``jaxfuse`` (a key of MOVED_MODULES).
    stacklevel: passed to ``warnings.warn`` (the caller's frame is 2).

  Returns:
    The module object at its new place.

  Raises:
    KeyError: ``name`` is not a moved module.
  """
  new, moved_in, removed_in = MOVED_MODULES[name]
  package, _, module = new.rpartition(".")
  warnings.warn(
      f"jaxfuse.{name} moved to {new} in jaxfuse {moved_in}; import it from "
      f"there (from {package} import {module}). The old name will be "
      f"removed in {removed_in}.", DeprecationWarning, stacklevel=stacklevel + 1)
  return importlib.import_module(new)


class _MovedLoader(importlib.abc.Loader):
  """Loads ``jaxfuse.<name>`` as the module of its new place: the import
  system returns what ``sys.modules`` holds once ``exec_module`` ran."""

  def create_module(self, spec):
    return None

  def exec_module(self, module):
    name = module.__name__
    sys.modules[name] = moved_module(name.removeprefix("jaxfuse."))


class _MovedFinder(importlib.abc.MetaPathFinder):
  """Finds only the moved ``jaxfuse.<name>`` modules (nothing else)."""

  def find_spec(self, fullname, path=None, target=None):
    if fullname.removeprefix("jaxfuse.") not in MOVED_MODULES:
      return None
    return importlib.util.spec_from_loader(fullname, _MovedLoader())


def install() -> None:
  """Put ``_MovedFinder`` last on ``sys.meta_path`` (once): only names no
  other finder knows reach it."""
  if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
    sys.meta_path.append(_MovedFinder())


def legacy_keywords(upgrade: Callable[[dict], dict]):
  """Decorator: a function keeps accepting its old keyword arguments.

  ``upgrade(kwargs)`` gets every keyword argument of a call and returns the
  new ones: it pops each old name, warns (``DeprecationWarning``, naming
  the new spelling and the release that removes the old one) and puts the
  value where it now goes. The decorated function's own signature holds
  only the new parameters; the wrapper's ``inspect.signature`` adds
  ``**legacy``, so that a tool which binds a call to the signature before
  making it (``optax.inject_hyperparams``) accepts the old keywords too:
  such a tool passes them back as one ``legacy=`` dict, which the wrapper
  unpacks before ``upgrade`` sees them.

  Args:
    upgrade: ``dict -> dict``, the call's keyword arguments old to new.

  Returns:
    A decorator; the wrapped function has the original's name and
    docstring (``functools.wraps``) and its signature plus ``**legacy``.

  Raises:
    Nothing itself; ``upgrade`` raises for a combination it refuses (an
    old and a new spelling of one thing together, say).
  """
  def decorate(fn):
    signature = inspect.signature(fn)
    params = list(signature.parameters.values())
    extends = (_LEGACY not in signature.parameters and not any(
        p.kind == inspect.Parameter.VAR_KEYWORD for p in params))

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
      if extends and isinstance(kwargs.get(_LEGACY), dict):
        kwargs.update(kwargs.pop(_LEGACY))
      return fn(*args, **upgrade(kwargs))
    if extends:
      wrapped.__signature__ = signature.replace(parameters=params + [
          inspect.Parameter(_LEGACY, inspect.Parameter.VAR_KEYWORD)])
    return wrapped
  return decorate


def legacy_positional(upgrade: Callable[[tuple, dict], tuple]):
  """Decorator: a function keeps accepting an old positional form.

  ``upgrade(args, kwargs)`` gets a call's positional and keyword arguments
  and returns the new ``(args, kwargs)``: for the old form it warns
  (``DeprecationWarning``, naming the new form and the release that
  removes the old one) and moves the values where they now go.

  Args:
    upgrade: ``(tuple, dict) -> (tuple, dict)``, the call's arguments old
      to new.

  Returns:
    A decorator; the wrapped function has the original's name, docstring
    and signature (``functools.wraps``).

  Raises:
    Nothing itself; ``upgrade`` raises (``TypeError``) for a call that is
    neither form.
  """
  def decorate(fn):
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
      args, kwargs = upgrade(args, kwargs)
      return fn(*args, **kwargs)
    return wrapped
  return decorate


# the name of the ``**`` parameter ``legacy_keywords`` shows in a signature
_LEGACY = "legacy"
