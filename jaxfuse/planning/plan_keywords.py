"""jaxfuse 0.2's keywords of ``jaxfuse.plan``, kept for one release (removed
in 0.4): each warns (``DeprecationWarning``) with its new spelling and is
turned into it (``upgrade``, for ``_deprecated.legacy_keywords``).

  headroom, min_sparse_size, seed,     settings=jaxfuse.Settings(...)
  residual_dtype, sparse_wire
  refresh, feedback, sample_fraction,  settings=jaxfuse.Settings(
  sidco_stages                           estimation=jaxfuse.Estimation(...))
  zen_table, zen_union, spardl_teams,  collective=jaxfuse.collectives.Zen(
  spardl_block, hier_inner,              table, union), SparDL(teams,
  packed_indices                         block), Hier(inner),
                                         AllGather(packed_indices)
  ready_order                          order=[leaf ids]
  loss_fn, example_args                order=ordering.FromLoss(loss_fn,
                                         example_args)
"""

from __future__ import annotations

from typing import NamedTuple
import warnings

from jaxfuse import plans
from jaxfuse.collectives import configs
from jaxfuse.planning import ordering

OLD_SETTINGS = ("headroom", "min_sparse_size", "seed", "residual_dtype",
                "sparse_wire")
OLD_ESTIMATION = ("refresh", "feedback", "sample_fraction", "sidco_stages")
# The scheme and field that take each of 0.2's scheme keywords now.
OLD_SCHEME_KEYWORDS = {
    "zen_table": ("Zen", "table"), "zen_union": ("Zen", "union"),
    "spardl_teams": ("SparDL", "teams"), "spardl_block": ("SparDL", "block"),
    "hier_inner": ("Hier", "inner"),
    "packed_indices": ("AllGather", "packed_indices"),
}
REMOVED_IN = "0.4"


class Schemes(NamedTuple):
  """0.2's scheme keywords with a scheme's name: the scheme ``name`` of
  every sparse bucket, and every scheme as those keywords configure it
  (``by_name``; ``"auto"`` picks among them)."""
  name: str
  by_name: dict


def _warn(old: str, new: str) -> None:
  warnings.warn(f"jaxfuse.plan({old}) is deprecated (removed in "
                f"{REMOVED_IN}): pass {new}.", DeprecationWarning,
                stacklevel=5)  # the caller of jaxfuse.plan


def upgrade(kwargs: dict) -> dict:
  """A call's keyword arguments with 0.2's names turned into the new ones.

  Args:
    kwargs: every keyword argument of a ``jaxfuse.plan`` call.

  Returns:
    The keyword arguments ``plan`` takes now (``settings``, ``collective``,
    ``order``), each old one warned about once.

  Raises:
    PlanError: an old and a new spelling of one thing given together.
  """
  kw = dict(kwargs)
  _upgrade_settings(kw)
  _upgrade_scheme(kw)
  _upgrade_order(kw)
  return kw


def _refuse_both(old: list, new: str) -> None:
  raise plans.PlanError(
      f"jaxfuse.plan: {new}= and 0.2's {sorted(old)} given together; give "
      f"only {new}= (the old keywords are deprecated).")


def _upgrade_settings(kw: dict) -> None:
  general = {k: kw.pop(k) for k in OLD_SETTINGS if k in kw}
  estimation = {k: kw.pop(k) for k in OLD_ESTIMATION if k in kw}
  if not (general or estimation):
    return
  if "settings" in kw:
    _refuse_both([*general, *estimation], "settings")
  parts = [f"{k}={v!r}" for k, v in general.items()]
  if estimation:
    parts.append("estimation=jaxfuse.Estimation(" + ", ".join(
        f"{k}={v!r}" for k, v in estimation.items()) + ")")
  _warn(", ".join(f"{k}=..." for k in [*general, *estimation]),
        f"settings=jaxfuse.Settings({', '.join(parts)})")
  kw["settings"] = plans.Settings(
      **general, estimation=plans.Estimation(**estimation))


def _upgrade_scheme(kw: dict) -> None:
  old = {k: kw.pop(k) for k in OLD_SCHEME_KEYWORDS if k in kw}
  if not old:
    return
  collective = kw.get("collective", "allgather")
  if not isinstance(collective, str):
    raise plans.PlanError(
        f"plan: collective={collective!r} configures its scheme; leave "
        f"{sorted(old)} out (0.2's keywords), or give the scheme's name.")
  for key, value in old.items():
    scheme, field = OLD_SCHEME_KEYWORDS[key]
    _warn(f"{key}=...", f"collective=jaxfuse.collectives.{scheme}("
          f"{field}={value!r}) (hier over a scheme: Hier(inner=Zen(...)), "
          "packed indices under hier: Hier(inner=AllGather("
          "packed_indices=True)))")
  kw["collective"] = Schemes(collective, {
      name: configs.configured(name, old) for name in plans.SPARSE_COLLECTIVES})


def _upgrade_order(kw: dict) -> None:
  if "ready_order" in kw:
    given = kw.pop("ready_order")
    if given is not None:
      if "order" in kw:
        _refuse_both(["ready_order"], "order")
      _warn("ready_order=...", "order=[leaf ids] (the same list)")
      kw["order"] = given
  if "loss_fn" in kw or "example_args" in kw:
    loss_fn, args = kw.pop("loss_fn", None), kw.pop("example_args", ())
    _warn("loss_fn=..., example_args=...",
          "order=jaxfuse.planning.ordering.FromLoss(loss_fn, example_args)")
    if loss_fn is not None and kw.get("order") is None:
      kw["order"] = ordering.FromLoss(loss_fn, tuple(args))
