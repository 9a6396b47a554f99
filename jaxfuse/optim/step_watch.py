"""What the step builder watches on the host, at no cost to the step.

Two things a first run gets wrong silently are reported here, outside the
compiled step:

- a non-finite loss: each step's loss is read once its step has finished
  (``jax.Array.is_ready``), never waiting for it while newer steps are
  queued, so the devices stay busy;
- ``onebit_adamw``'s sparse steps before any dense step (its second
  moment is still 0, so every update is zero): checked when a phase with
  sparse buckets starts.

Neither check lives inside the step: a host callback there, even under a
``lax.cond``, makes a GPU wait for the host at every step.
"""

from __future__ import annotations

import collections
import math
from typing import Any
import warnings

import jax
import numpy as np

from jaxfuse import plans
from jaxfuse.optim import recipe_checks
from jaxfuse.optim import recipes
from jaxfuse.sync import bucket_steps

NONFINITE_LOSS = (
    "make_train_step: the loss of step {step} is {value}: the loss or the "
    "learning rate has diverged. Lower the learning rate (or the momentum), "
    "clip (options=jaxfuse.RecipeOptions(clip_norm=...)), or skip such "
    "steps with jaxfuse.apply_if_finite(optimizer, max_consecutive_errors); "
    "jaxfuse.summarize(jaxfuse.sync_stats(state.opt_state), plan) names the "
    "leaves whose gradient was not finite.")


class LossWatch:
  """Warns once when a step's loss is NaN or Inf, read only once ready.

  Losses wait in a queue until their step has finished; past ``depth``
  queued steps the oldest is read anyway (the devices finished it long
  ago, since ``depth`` newer steps were dispatched after it).
  """

  def __init__(self, depth: int = 2):
    self._pending = collections.deque()
    self._depth = depth
    self.warned = False

  def add(self, step: int, loss: Any) -> None:
    """Queues ``loss`` (a scalar array) of ``step`` and reads what is ready.

    Args:
      step: the step number the loss belongs to.
      loss: the step's loss, a replicated scalar ``jax.Array``.

    Returns:
      None; warns (``UserWarning``, once) on a non-finite loss.

    Raises:
      Nothing.
    """
    if self.warned:
      return
    self._pending.append((step, loss))
    while self._pending and (len(self._pending) > self._depth or
                             _ready(self._pending[0][1])):
      at, value = self._pending.popleft()
      value = float(np.asarray(jax.device_get(_first_shard(value))))
      if not math.isfinite(value):
        self.warned = True
        self._pending.clear()
        warnings.warn(NONFINITE_LOSS.format(step=at, value=value),
                      UserWarning, stacklevel=3)


def _ready(x) -> bool:
  return not isinstance(x, jax.Array) or x.is_ready()


def _first_shard(x):
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    return x.addressable_data(0)
  return x


def has_sparse_buckets(plan: plans.Plan) -> bool:
  """Whether any bucket of ``plan`` syncs sparse (not a dense phase).

  Args:
    plan: a ``jaxfuse.Plan``.

  Returns:
    True when a step on ``plan`` sends sparse buckets.

  Raises:
    PlanError: ``plan`` is not a plan.
  """
  return any(b.kind == bucket_steps.SPARSE
             for b in bucket_steps.compile_plan(plan).buckets)


def check_dense_before_sparse(opt_state: Any, plan: plans.Plan) -> None:
  """Warns once when a sparse phase starts with a ``onebit_adamw`` state
  that has had no dense step (its second moment is 0: nothing trains).

  Args:
    opt_state: the optimizer state the phase starts from.
    plan: the phase's plan.

  Returns:
    None; warns (``UserWarning``, once a process) as
    ``recipe_checks.NO_DENSE_STEP`` says.

  Raises:
    Nothing.
  """
  if not has_sparse_buckets(plan):
    return
  onebit = [s for s in jax.tree.leaves(
      opt_state, is_leaf=lambda x: isinstance(x, recipes.OnebitState))
            if isinstance(s, recipes.OnebitState)]
  for state in onebit:
    count = np.asarray(jax.device_get(_first_shard(state.nu_count)))
    if int(count.reshape(-1)[0]) == 0:
      recipe_checks.warn_if_no_dense_step(count.reshape(-1)[0])
      return
