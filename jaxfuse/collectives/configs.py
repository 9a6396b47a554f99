"""A bucket's scheme object, configured, from what a plan stores.

Each scheme owns its configuration (``AllGather(packed_indices)``,
``Zen(table, union)``, ``SparDL(teams, block)``, ``Hier(inner)``) and a
plan keeps it with each bucket (``BucketPlan.scheme``): the transform
hands a bucket to its configured scheme, which plans nothing.
``of_bucket`` gives a bucket's scheme, ``of_json`` reads one from a plan
file (format 2), and ``configured`` from the knobs a format-1 plan (as
jaxfuse 0.2 wrote it) kept in its settings.
"""

from __future__ import annotations

from typing import Mapping

from jaxfuse import plans
from jaxfuse.collectives.allgather import AllGather
from jaxfuse.collectives.hier import Hier
from jaxfuse.collectives.psum import Psum
from jaxfuse.collectives.spardl import SparDL
from jaxfuse.collectives.zen import Zen

SCHEME_TYPES = {t.name: t for t in (AllGather, Zen, SparDL, Hier, Psum)}
plans.register_schemes(SCHEME_TYPES)


def _unknown(name) -> plans.PlanError:
  return plans.PlanError(f"collective {name!r} is not available; use one of "
                         f"{tuple(SCHEME_TYPES)}.")


def of_bucket(bucket: plans.BucketPlan):
  """The scheme that moves ``bucket``: its ``scheme``, or the defaults of
  its ``collective`` where it keeps none.

  Args:
    bucket: a ``plans.BucketPlan``.

  Returns:
    The scheme object (``AllGather``, ``Zen``, ``SparDL``, ``Hier`` or
    ``Psum``).

  Raises:
    PlanError: for an unknown collective name, naming the ones there are.
  """
  if bucket.scheme is not None:
    return bucket.scheme
  if bucket.collective not in SCHEME_TYPES:
    raise _unknown(bucket.collective)
  return SCHEME_TYPES[bucket.collective]()


def of_json(fields: Mapping):
  """The scheme object of ``plans.scheme_json``'s fields.

  Args:
    fields: ``{"name": ..., <the scheme's fields>}`` (``Hier``'s ``inner``
      nested the same way).

  Returns:
    The scheme object.

  Raises:
    PlanError: an unknown scheme name, or a field the scheme does not
      have (naming the scheme and its fields).
  """
  return plans.scheme_of_json(fields)


def configured(name: str, knobs: Mapping):
  """The scheme called ``name`` with the configuration a format-1 plan's
  settings stored (0.2's ``zen_table``, ``zen_union``, ``spardl_teams``,
  ``spardl_block``, ``hier_inner``, ``packed_indices``).

  Args:
    name: one of ``plans.COLLECTIVES``.
    knobs: those settings fields (a missing one: 0.2's default, which is
      the scheme's own).

  Returns:
    The scheme object.

  Raises:
    PlanError: for an unknown name, naming the ones there are.
  """
  return plans.v1_scheme(name, knobs)
