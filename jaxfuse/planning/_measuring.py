"""What a measurement is given: the model, how it is timed, what it compresses.

``profiling`` re-exports these (``profiling.Model``, ``profiling.Timing``,
``profiling.Compression``, ``profiling.Sweep``); the measuring functions
take them instead of one keyword per field. ``legacy_groups`` (for
``jaxfuse._deprecated.legacy_keywords``) maps the keywords those functions
took up to 0.2 onto them, with a ``DeprecationWarning`` (removed in 0.4).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, NamedTuple, Sequence
import warnings


class Model(NamedTuple):
  """One worker's loss on a sample batch: ``loss_fn(params, *example_args)``.

  The same triple ``synthetic_model`` returns, so either unpacks as
  ``loss_fn, params, example_args = model``.
  """
  loss_fn: Callable
  params: Any
  example_args: Sequence = ()


class Timing(NamedTuple):
  """How each time is taken: the median of ``repeats`` runs after ``warmup``
  runs (the first compiles); a collective is timed as a chain of ``chain``
  dependent ones in one program (time / chain), so one dispatch is not
  counted as latency, and compression as ``chain`` against 2·``chain``
  units."""
  repeats: int = 5
  warmup: int = 2
  chain: int = 4

  def calls(self) -> dict[str, int]:
    """``repeats`` and ``warmup`` as ``time_call``'s keywords.

    Returns:
      {"repeats": ..., "warmup": ...}.
    """
    return {"repeats": self.repeats, "warmup": self.warmup}


class Compression(NamedTuple):
  """The sparse step a plan would run: its estimator, density and headroom
  (as ``jaxfuse.plan`` takes them)."""
  estimator: str = "dgc"
  density: float = 0.01
  headroom: float = 1.5


class Sweep(NamedTuple):
  """The sizes ``profile`` measures at, and how each is timed.

  sizes: bytes per worker of the collectives (default ``default_sizes()``).
  compress_sizes: elements of the compression units (default
    ``default_compress_sizes()``).
  timing: a ``Timing``.
  """
  sizes: Sequence[int] | None = None
  compress_sizes: Sequence[int] | None = None
  timing: Timing = Timing()


# The keywords taken up to 0.2, by the group that holds them now.
_GROUPS = {"repeats": Timing, "warmup": Timing, "chain": Timing,
           "estimator": Compression, "density": Compression,
           "headroom": Compression, "sizes": Sweep,
           "compress_sizes": Sweep}


def upgrade_keywords(where: str, old: Mapping[str, Any], *,
                     stacklevel: int = 3,
                     **groups: NamedTuple) -> dict[str, NamedTuple]:
  """``groups`` (keyword -> the ``Timing``, ``Compression`` or ``Sweep``
  given) with the 0.2 keywords of ``old`` folded in, one
  ``DeprecationWarning`` per keyword naming its new place.

  Args:
    where: the function called, for the messages (e.g. "profile").
    old: the keywords it was called with beyond its own parameters.
    stacklevel: the warnings' (``warnings.warn``'s), 3: this function's
      caller's caller.
    **groups: the grouped parameters the function was given, by name; a
      dotted name ("sweep.timing") is a group inside another.

  Returns:
    ``groups`` with each old keyword's value set in its group.

  Raises:
    TypeError: for a keyword that is neither one of the function's nor a
      0.2 keyword it took.
  """
  by_type = {type(v): k for k, v in groups.items()}
  for key, value in old.items():
    kind = _GROUPS.get(key)
    if kind not in by_type:
      raise TypeError(f"{where}() got an unexpected keyword argument "
                      f"{key!r}.")
    name = by_type[kind]
    outer, _, inner = name.partition(".")   # "sweep.timing": a nested one
    new = f"{kind.__name__}({key}=...)"
    if inner:
      new = f"{type(groups[outer]).__name__}({inner}={new})"
    warnings.warn(
        f"{where}({key}=...) is deprecated: pass {outer}={new} "
        f"(jaxfuse.planning.profiling.{kind.__name__}); the keyword goes in "
        "0.4.", DeprecationWarning, stacklevel=stacklevel)
    groups[name] = groups[name]._replace(**{key: value})
  return groups


def legacy_groups(where: str, frames: int = 0,
                  **groups: NamedTuple) -> Callable[[dict], dict]:
  """The upgrade of a measuring function for
  ``jaxfuse._deprecated.legacy_keywords``: its 0.2 keywords (those of
  ``_GROUPS`` whose group it takes) folded into its groups by
  ``upgrade_keywords``.

  Args:
    where: the function, for the messages (e.g. "profile").
    frames: the wrappers between ``legacy_keywords``' and the caller
      (another ``legacy_keywords`` stacked on top: 1), so that each
      warning names the caller's line.
    **groups: the group parameters by name and their defaults; a dotted
      name ("sweep.timing") is a group inside another (its default is
      taken from the outer one).

  Returns:
    ``kwargs -> kwargs``; any other keyword passes through (the function's
    own ``TypeError`` names an unknown one).

  Raises:
    Nothing itself.
  """
  kinds = {type(v) for v in groups.values()}

  def run(kwargs: dict) -> dict:
    old = {k: kwargs.pop(k) for k in list(kwargs)
           if k not in groups and _GROUPS.get(k) in kinds}
    if not old:
      return kwargs
    given = {k: kwargs.get(k, v) for k, v in groups.items() if "." not in k}
    for name in groups:
      outer, _, inner = name.partition(".")
      if inner:
        given[name] = getattr(given[outer], inner)
    new = upgrade_keywords(where, old, stacklevel=4 + frames, **given)
    for name in groups:
      outer, _, inner = name.partition(".")
      if inner:
        new[outer] = new[outer]._replace(**{inner: new.pop(name)})
    kwargs.update(new)
    return kwargs
  return run
