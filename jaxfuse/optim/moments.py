"""``onebit_adamw``'s moments: its state, and m and v̂ read back from it.

``OnebitState`` keeps m as the all-gather decode writes it
(``jaxfuse.grouped``) and ν replicated; ``first_moment`` and
``second_moment`` give them in the params' shapes, on the host for v̂.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import numpy as np

from jaxfuse import plans
from jaxfuse import transform
from jaxfuse.optim import recipe_checks
from jaxfuse.sync import bucket_steps
from jaxfuse.sync import grouped


class OnebitState(NamedTuple):
  """``onebit_adamw``'s state."""
  count: jax.Array     # steps taken, int32 (replicated)
  nu_count: jax.Array  # steps that updated nu (the dense phase)
  mu: grouped.Grouped  # replicated first moment (``first_moment``)
  nu: Any              # replicated second moment (frozen in sparse phases)
  sync: transform.SparseSyncState
  clip: Any = ()       # per-worker bucket norms (clip_norm set), every phase


def second_moment(state: Any, b2: float = 0.999) -> list:
  """``onebit_adamw``'s bias-corrected second moment, v̂ = ν / (1 −
  b2^nu_count), as host arrays (float64), from the one ``OnebitState``
  anywhere inside an optimizer state. ν is replicated (the dense phase
  updates it from the synced gradient), so every worker and host reads the
  same values. Raises ``SyncError`` when ``state`` holds no such state.

  Args:
    state: an optimizer state holding one ``OnebitState``.
    b2: the β₂ the optimizer was made with, in [0, 1).

  Returns:
    v̂ per leaf, a list of float64 numpy arrays in leaf order.

  Raises:
    SyncError: ``state`` holds no ``OnebitState`` (or more than one), or
      ``b2`` is out of range.
  """
  recipe_checks.check_betas("second_moment", b2=b2)
  one = onebit_state(state, "second_moment")
  count = int(jax.device_get(one.nu_count))
  scale = 1.0 / (1.0 - b2 ** max(count, 1))
  return [np.asarray(jax.device_get(v), np.float64) * scale
          for v in jax.tree.leaves(one.nu)]


def second_moment_change(before: list, now: list) -> float:
  """How much the second moment moved (``second_moment`` of two states)::

    change = ‖v̂_now − v̂_before‖₁ / ‖v̂_now‖₁

  A run may end its dense phase once the change over N steps falls below a
  tolerance: the settling that 0/1 Adam's variance freezing relies on.

  Args:
    before: ``second_moment`` of the earlier state.
    now: ``second_moment`` of the later state (the same leaves).

  Returns:
    The change, a float (inf when ``now`` is all zero).

  Raises:
    ValueError: the two lists' arrays have different shapes (numpy's).
  """
  moved = sum(np.abs(a - b).sum() for a, b in zip(before, now))
  size = sum(np.abs(b).sum() for b in now)
  return float(moved / size) if size > 0 else float("inf")


def first_moment(state: Any, plan: plans.Plan) -> Any:
  """``onebit_adamw``'s first moment m in the params' shapes (float32),
  from the one ``OnebitState`` anywhere inside an optimizer state and the
  plan it was made with. The state keeps m as the all-gather decode
  writes it (``jaxfuse.grouped``). Raises ``SyncError`` when ``state``
  holds no such state, ``PlanError`` for another plan's state.

  Args:
    state: an optimizer state holding one ``OnebitState``.
    plan: the plan the state was made with.

  Returns:
    m, a pytree of float32 arrays in the params' structure and shapes.

  Raises:
    SyncError: ``state`` holds no ``OnebitState``, or more than one.
    PlanError: the state was made for another plan's layout.
  """
  one = onebit_state(state, "first_moment")
  part = transform.layout_mismatch(one.sync, plan)
  if part:
    raise plans.PlanError(
        f"first_moment: the state was made for a plan whose {part} differ "
        "from this plan's; pass the plan the state was made for.")
  lay = grouped.layout(bucket_steps.compile_plan(plan))
  return grouped.ungroup(lay, one.mu, jax.tree.structure(one.nu))


def onebit_state(state: Any, where: str) -> OnebitState:
  """The one ``OnebitState`` anywhere inside an optimizer state.

  Args:
    state: an optimizer state.
    where: the caller's name, for the message.

  Returns:
    That ``OnebitState``.

  Raises:
    SyncError: ``state`` holds none, or more than one.
  """
  ones = [x for x in jax.tree.leaves(
      state, is_leaf=lambda x: isinstance(x, OnebitState))
          if isinstance(x, OnebitState)]
  if len(ones) != 1:
    raise transform.SyncError(
        f"{where}: the state holds {len(ones)} onebit_adamw states; "
        "pass the optimizer state of a run with one onebit_adamw.")
  return ones[0]


def check_moment(lay: grouped.Layout, mu: grouped.Grouped) -> None:
  """Check that a state's first moment ``mu`` fits the layout ``lay``.

  Args:
    lay: the plan's ``grouped.layout``.
    mu: ``OnebitState.mu``.

  Returns:
    None.

  Raises:
    SyncError: ``mu`` does not fit (another plan's, or an old layout's).
  """
  try:
    grouped.check(lay, mu)
  except plans.PlanError as e:
    raise transform.SyncError(
        f"onebit_adamw: the state's first moment does not fit this plan "
        f"({e}) Create the state with this optimizer "
        "(jaxfuse.init_state), or restore it with jaxfuse.checkpoint, "
        "which converts checkpoints of earlier versions.") from None
