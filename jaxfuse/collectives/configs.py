"""A bucket's scheme object, configured, from what a plan stores.

Each scheme owns its configuration (``AllGather(packed_indices)``,
``Zen(table, union)``, ``SparDL(teams, block)``, ``Hier(inner)``): the
transform hands a bucket to its configured scheme, which plans nothing.
A plan (format 1, as jaxfuse 0.2 wrote it) stores the knobs in its
``Settings`` (``zen_table``, ``zen_union``, ``spardl_teams``,
``spardl_block``, ``hier_inner``, ``packed_indices``); ``configured``
reads them, ``settings_fields`` writes a scheme object's back.
"""

from __future__ import annotations

from jaxfuse import plans
from jaxfuse.collectives.allgather import AllGather
from jaxfuse.collectives.hier import Hier
from jaxfuse.collectives.psum import Psum
from jaxfuse.collectives.spardl import SparDL
from jaxfuse.collectives.zen import Zen

SCHEME_TYPES = {t.name: t for t in (AllGather, Zen, SparDL, Hier, Psum)}


def configured(name: str, settings: plans.Settings):
  """The scheme called ``name`` with the configuration ``settings`` store.

  Args:
    name: one of ``plans.COLLECTIVES``.
    settings: a plan's ``Settings``.

  Returns:
    The scheme object (``AllGather``, ``Zen``, ``SparDL``, ``Hier`` or
    ``Psum``).

  Raises:
    PlanError: for an unknown name, naming the ones there are.
  """
  if name == "allgather":
    return AllGather(packed_indices=settings.packed_indices)
  if name == "zen":
    return Zen(table=settings.zen_table, union=settings.zen_union)
  if name == "spardl":
    return SparDL(teams=settings.spardl_teams, block=settings.spardl_block)
  if name == "hier":
    inner = configured(settings.hier_inner, settings)
    return Hier(inner=inner)
  if name == "psum":
    return Psum()
  raise plans.PlanError(f"collective {name!r} is not available; use one of "
                        f"{tuple(SCHEME_TYPES)}.")


def settings_fields(scheme) -> dict:
  """The ``Settings`` fields that store ``scheme``'s configuration (the
  inverse of ``configured``): e.g. ``Zen(table=3.0)`` gives
  ``{"zen_table": 3.0, "zen_union": 1.0}``.

  Args:
    scheme: a scheme configuration (``AllGather``, ``Zen``, ``SparDL``,
      ``Hier``, ``Psum``).

  Returns:
    {field: value}; empty for a scheme with nothing to configure.

  Raises:
    Nothing.
  """
  if isinstance(scheme, AllGather):
    return {"packed_indices": scheme.packed_indices}
  if isinstance(scheme, Zen):
    return {"zen_table": scheme.table, "zen_union": scheme.union}
  if isinstance(scheme, SparDL):
    return {"spardl_teams": scheme.teams, "spardl_block": scheme.block}
  if isinstance(scheme, Hier):
    return dict(settings_fields(scheme.inner), hier_inner=scheme.inner.name)
  return {}
