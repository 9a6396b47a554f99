"""Checkpoint and resume a training state with orbax-checkpoint, per worker.

A checkpoint holds one step's train state (any pytree: params, the
optimizer state with ``sparse_sync``'s residuals, thresholds, controller,
velocity and stats, a recipe's per-worker moments, …) and the plan it was
made with. Arrays are written as they live: per-worker leaves stay sharded
``P(axis)`` (each process writes its own shards; nothing is gathered to
one host), replicated leaves once. Restoring onto the same mesh gives the
same arrays bit for bit, so N steps, save, restore in a fresh process and M
more equal N + M steps straight through (tests/test_checkpoint.py).

  manager = jaxfuse.checkpoint.manager(directory)
  jaxfuse.checkpoint.save(manager, step, {"params": p, "opt": s}, plan)
  like = {"params": p0, "opt": jaxfuse.init_state(opt, p0, mesh)}
  step, state = jaxfuse.checkpoint.restore(manager, like, plan)

Orbax writes each step into a temporary directory and renames it when
complete, so a save that dies half-way leaves the previous checkpoint
intact and loadable. Resuming with a plan of another layout (other units,
buckets, leaves or settings: its state would not fit) raises
``CheckpointError``; a plan that differs only in densities and capacities
(a warm-up phase) is accepted.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax

from jaxfuse import phases
from jaxfuse import plans as plan_lib

STATE, PLAN, EXTRA = "state", "plan", "extra"


class CheckpointError(ValueError):
  """A checkpoint that cannot be restored here (says why and what to do)."""


def _ocp():
  try:
    import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise CheckpointError("jaxfuse.checkpoint needs orbax-checkpoint: pip "
                          "install 'jaxfuse[checkpoint]'.") from e
  return ocp


def manager(directory: str | os.PathLike, *, max_to_keep: int | None = 3,
            save_async: bool = False):
  """An ``orbax.checkpoint.CheckpointManager`` for jaxfuse train states in
  ``directory`` (made if missing), keeping the last ``max_to_keep`` steps.
  ``save_async``: return from ``save`` while the arrays are written (call
  ``manager.wait_until_finished()`` before exiting)."""
  ocp = _ocp()
  options = ocp.CheckpointManagerOptions(
      max_to_keep=max_to_keep, enable_async_checkpointing=save_async,
      create=True)
  return ocp.CheckpointManager(os.fspath(os.path.abspath(directory)),
                               options=options,
                               item_names=(STATE, PLAN, EXTRA))


def save(mngr, step: int, state: Any, plan: plan_lib.Plan | None,
         extra: dict | None = None) -> None:
  """Write ``state`` (a pytree of arrays, sharded as it lives), ``plan``
  and ``extra`` (JSON: e.g. the data loader's position) as checkpoint
  ``step``; a step already saved raises ``CheckpointError``."""
  ocp = _ocp()
  if step in mngr.all_steps():
    raise CheckpointError(f"step {step} is already saved in "
                          f"{mngr.directory}; resume from it or pick a new "
                          "step.")
  plan_json = json.loads(plan.to_json()) if plan is not None else {}
  mngr.save(step, args=ocp.args.Composite(
      **{STATE: ocp.args.StandardSave(state),
         PLAN: ocp.args.JsonSave(plan_json),
         EXTRA: ocp.args.JsonSave(dict(extra or {}))}), force=True)


def abstract(tree: Any) -> Any:
  """``ShapeDtypeStruct``s with the shardings of ``tree``'s arrays: the
  target ``restore`` fills (from real arrays or ``jax.eval_shape``)."""
  def spec(x):
    sharding = getattr(x, "sharding", None)
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
  return jax.tree.map(spec, tree)


def restore(mngr, like: Any, plan: plan_lib.Plan | None,
            step: int | None = None) -> tuple[int, Any]:
  """(step, state): checkpoint ``step`` (default the latest) restored into
  the structure, shapes, dtypes and shardings of ``like`` (a freshly
  initialized state, or ``abstract(...)`` of one), after checking that the
  saved plan has ``plan``'s layout."""
  ocp = _ocp()
  step = _resolve(mngr, step)
  saved = _json_item(mngr, step, PLAN)
  _check_plan(saved, plan, step)
  try:
    out = mngr.restore(step, args=ocp.args.Composite(
        **{STATE: ocp.args.StandardRestore(abstract(like))}))[STATE]
  except (ValueError, KeyError, TypeError) as e:
    raise CheckpointError(
        f"checkpoint {step} does not fit this train state ({e}); restore "
        "with the same model, optimizer and worker count it was saved "
        "with.") from None
  return step, out


def _check_plan(saved: dict, plan: plan_lib.Plan | None, step: int) -> None:
  if plan is None or not saved:
    if bool(plan is None) != bool(not saved):
      raise CheckpointError(
          f"checkpoint {step} was saved {'with' if saved else 'without'} a "
          f"plan and is restored {'with' if plan is not None else 'without'}"
          " one; use the same setup.")
    return
  try:
    old = plan_lib.Plan.from_json(json.dumps(saved))
  except plan_lib.PlanError as e:
    raise CheckpointError(f"checkpoint {step}: its plan does not load "
                          f"({e}).") from None
  part = phases.layout_difference(old, plan)
  if part:
    raise CheckpointError(
        f"checkpoint {step} was saved with a plan whose {part} differ from "
        "this plan's, so its per-worker state does not fit; resume with the "
        "saved plan (it is in the checkpoint: jaxfuse.checkpoint.saved_plan"
        "(manager)) or start a new run.")


def saved_extra(mngr, step: int | None = None) -> dict:
  """The ``extra`` JSON saved with checkpoint ``step`` (default latest)."""
  return dict(_json_item(mngr, _resolve(mngr, step), EXTRA) or {})


def saved_plan(mngr, step: int | None = None) -> plan_lib.Plan | None:
  """The plan saved with checkpoint ``step`` (default the latest)."""
  saved = _json_item(mngr, _resolve(mngr, step), PLAN)
  return plan_lib.Plan.from_json(json.dumps(saved)) if saved else None


def _resolve(mngr, step: int | None) -> int:
  """``step``, or the latest saved one; ``CheckpointError`` if not saved."""
  steps = mngr.all_steps()
  if not steps:
    raise CheckpointError(f"no checkpoint in {mngr.directory}; start "
                          "without resuming, or point to the run's "
                          "checkpoint directory.")
  step = max(steps) if step is None else step
  if step not in steps:
    raise CheckpointError(f"no step {step} in {mngr.directory}; saved steps "
                          f"are {sorted(steps)}.")
  return step


def _json_item(mngr, step: int, name: str):
  """One JSON item of checkpoint ``step``; ``CheckpointError`` if the step
  cannot be read (corrupt, or not a jaxfuse checkpoint)."""
  ocp = _ocp()
  try:
    return mngr.restore(step, args=ocp.args.Composite(
        **{name: ocp.args.JsonRestore()}))[name]
  except Exception as e:  # corrupt or foreign directory
    raise CheckpointError(f"checkpoint {step} in {mngr.directory} cannot be "
                          f"read ({type(e).__name__}: {e}); it is corrupt or "
                          "not a jaxfuse checkpoint.") from None
