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

Restoring onto a different number of workers K' (``like`` made on the new
mesh) redistributes every per-worker leaf so that the owed update
(1/K)·Σ_k r_k is kept (``jaxfuse.elastic``); the saved arrays pass through
host memory once, then are placed with ``like``'s shardings.

Orbax writes each step into a temporary directory and renames it when
complete, so a save that dies half-way leaves the previous checkpoint
intact and loadable. A checkpoint of jaxfuse 0.1 (one residual per unit)
is regrouped into today's per-group arrays on restore, and so is an
``onebit_adamw`` first moment saved leaf by leaf (jaxfuse 0.2); an earlier
controller state, which kept no k, gets the saved plan's k where it had
set a threshold. Resuming
with a plan of another layout (other units, buckets, leaves or settings:
its state would not fit) raises
``CheckpointError``; a plan that differs only in densities and capacities
(a warm-up phase) is accepted.
"""

from __future__ import annotations

import json
import os
from typing import Any, NamedTuple

import jax

import numpy as np

from jaxfuse.state import elastic
from jaxfuse.sync import grouped
from jaxfuse.state import placement
from jaxfuse import plans
from jaxfuse.optim import recipes
from jaxfuse.sync import bucket_steps
from jaxfuse import sparsify
from jaxfuse import transform

STATE, PLAN, EXTRA = "state", "plan", "extra"
WORKERS = "__jaxfuse_workers__"  # in the extra item: K of the saved state
LAYOUT = "__jaxfuse_state_layout__"  # and how sparse_sync's state is laid out
# 1 (jaxfuse 0.1, no LAYOUT key): one residual (and velocity) per unit;
# 2: one (K, G, n) array per state group (plans.state_groups);
# 3: also onebit_adamw's m as jaxfuse.grouped keeps it (1 and 2: in the
# params' shapes); 4: also the k each unit's controller was tuned for
# (sparsify.Control.target; 1-3 kept none).
STATE_LAYOUT = 4


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
  ``manager.wait_until_finished()`` before exiting).

  Args:
    directory: where the checkpoints live (made if missing).
    max_to_keep: how many steps to keep; None: all.
    save_async: return from ``save`` before the arrays are written.

  Returns:
    An ``orbax.checkpoint.CheckpointManager``.

  Raises:
    CheckpointError: orbax-checkpoint is not installed, or
      ``directory`` is a file.
  """
  ocp = _ocp()
  if os.path.exists(directory) and not os.path.isdir(directory):
    raise CheckpointError(f"{os.fspath(directory)} is a file, not a "
                          "folder: give checkpoint.manager a folder (made "
                          "if missing).")
  options = ocp.CheckpointManagerOptions(
      max_to_keep=max_to_keep, enable_async_checkpointing=save_async,
      create=True)
  return ocp.CheckpointManager(os.fspath(os.path.abspath(directory)),
                               options=options,
                               item_names=(STATE, PLAN, EXTRA))


def save(mngr, step: int, state: Any, plan: plans.Plan | None,
         extra: dict | None = None) -> None:
  """Write ``state`` (a pytree of arrays, sharded as it lives), ``plan``
  and ``extra`` (JSON: e.g. the data loader's position) as checkpoint
  ``step``; a step already saved raises ``CheckpointError``.

  Args:
    mngr: the ``manager``.
    step: the step, an int >= 0.
    state: the train state to save.
    plan: the plan the state was made with (saved beside it); None: none.
    extra: JSON values to save with it (e.g. the data position).

  Returns:
    None.

  Raises:
    CheckpointError: a bad step or one already saved, no arrays in
      ``state``, or ``extra`` not a dict of JSON values (or using a key of
      jaxfuse's own).
  """
  ocp = _ocp()
  if not plans.is_int(step) or step < 0:
    raise CheckpointError(f"step={step!r} must be an int >= 0.")
  step = int(step)
  if step in mngr.all_steps():
    raise CheckpointError(f"step {step} is already saved in "
                          f"{mngr.directory}; resume from it or pick a new "
                          "step.")
  if state is None or not jax.tree.leaves(state):
    raise CheckpointError("state has no arrays to save; pass the train "
                          "state (e.g. (params, opt_state)).")
  if plan is not None:
    plans.require_plan(plan, "checkpoint.save")
    part = transform.layout_mismatch(state, plan)
    if part:
      raise CheckpointError(
          f"checkpoint.save: the state was made for a plan whose {part} "
          "differ from `plan`'s; save it with the plan it was made with "
          "(restoring checks the state against it). Nothing was written.")
  plan_json = json.loads(plan.to_json()) if plan is not None else {}
  if extra is not None and not isinstance(extra, dict):
    raise CheckpointError(f"extra must be a dict of JSON values, got "
                          f"{type(extra).__name__}.")
  extra = dict(extra or {})
  for key, value in extra.items():
    try:
      json.dumps(value)
    except (TypeError, ValueError) as e:
      raise CheckpointError(
          f"extra[{key!r}]={value!r} is not JSON ({e}); convert it first, "
          "e.g. int(x) for a numpy integer. Nothing was written.") from None
  for key in (WORKERS, LAYOUT):
    if key in extra:
      raise CheckpointError(f"extra: the key {key!r} is jaxfuse's own; "
                            "use another name.")
  workers = _num_workers(state)
  if workers is not None:
    extra[WORKERS] = workers
  if _has_sync_state(state):
    extra[LAYOUT] = STATE_LAYOUT
  mngr.save(step, args=ocp.args.Composite(
      **{STATE: ocp.args.StandardSave(state),
         PLAN: ocp.args.JsonSave(plan_json),
         EXTRA: ocp.args.JsonSave(extra)}), force=True)


def _num_workers(tree) -> int | None:
  """K: the leading axis of the per-worker leaves (None if there are none)."""
  sizes = {x.shape[0] for x, m in zip(
      jax.tree.leaves(tree), jax.tree.leaves(transform.per_worker_mask(tree)))
           if m}
  if len(sizes) > 1:
    raise CheckpointError(f"per-worker leaves with different worker counts "
                          f"{sorted(sizes)}; one state holds one mesh's.")
  return sizes.pop() if sizes else None


def _is_array(x) -> bool:
  """An array or its ``ShapeDtypeStruct`` (not a Python number, such as
  flax ``TrainState.create``'s ``step=0``)."""
  return hasattr(x, "shape") and hasattr(x, "dtype")


def abstract(tree: Any) -> Any:
  """``ShapeDtypeStruct``s with the shardings of ``tree``'s arrays: the
  target ``restore`` fills (from real arrays or ``jax.eval_shape``).
  Python numbers stay as they are (orbax restores them as such).

  Args:
    tree: a train state of real arrays, or of ``ShapeDtypeStruct``s.

  Returns:
    The same structure of ``ShapeDtypeStruct``s (with shardings).

  Raises:
    Nothing of its own.
  """
  def spec(x):
    if not _is_array(x):
      return x
    sharding = getattr(x, "sharding", None)
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
  return jax.tree.map(spec, tree)


def restore(mngr, like: Any, plan: plans.Plan | None,
            step: int | None = None) -> tuple[int, Any]:
  """(step, state): checkpoint ``step`` (default the latest) restored into
  the structure, shapes, dtypes and shardings of ``like`` (a freshly
  initialized state, or ``abstract(...)`` of one), after checking that the
  saved plan has ``plan``'s layout. Saved on another number of workers:
  per-worker leaves are redistributed (``jaxfuse.elastic``).

  Args:
    mngr: the ``manager``.
    like: the target state (real or ``abstract``).
    plan: the plan the step will run with; None: not checked.
    step: the checkpoint; None: the latest.

  Returns:
    (the step restored, the state).

  Raises:
    CheckpointError: no such checkpoint, a saved plan of another layout
      than ``plan``'s, or a state that does not fit ``like`` (naming the
      leaf).
  """
  ocp = _ocp()
  step = _resolve(mngr, step)
  saved = _json_item(mngr, step, PLAN)
  _check_plan(saved, plan, step)
  part = plan is not None and transform.layout_mismatch(like, plan)
  if part:
    raise CheckpointError(
        f"`like` was made for a plan whose {part} differ from `plan`'s: "
        "build it with the plan you restore with (jaxfuse.init_state("
        "make_opt(plan), ...)); to train on with another plan, carry the "
        "restored state over with jaxfuse.relayout.")
  extra = _json_item(mngr, step, EXTRA) or {}
  saved_k = extra.get(WORKERS)
  layout = extra.get(LAYOUT, 1)
  if plan is None and layout < STATE_LAYOUT and _has_onebit(like):
    raise CheckpointError(
        f"checkpoint {step} keeps onebit_adamw's first moment leaf by leaf "
        "(jaxfuse 0.2) and was saved without a plan, which regrouping it "
        "needs: restore it with jaxfuse 0.2 and save it again with its plan "
        "(checkpoint.save(..., plan)).")
  per_unit = plan is not None and _has_sync_state(like) and layout < 2
  leafwise = plan is not None and _has_onebit(like) and layout < 3
  untargeted = _has_sync_state(like) and layout < 4
  saved_like = _per_unit(like, plan) if per_unit else like
  saved_like = _leafwise_moments(saved_like) if leafwise else saved_like
  saved_like = _untargeted(saved_like) if untargeted else saved_like
  targets = (_unit_targets(plans.Plan.from_json(json.dumps(saved)))
             if untargeted and plan is not None else None)
  new_k = _num_workers(like)
  elastic_k = saved_k is not None and new_k is not None and saved_k != new_k
  target = _on_host(saved_like, saved_k) if elastic_k else abstract(
      saved_like)
  try:
    out = mngr.restore(step, args=ocp.args.Composite(
        **{STATE: ocp.args.StandardRestore(target)}))[STATE]
  except (ValueError, KeyError, TypeError) as e:
    raise CheckpointError(
        f"checkpoint {step} does not fit this train state ({_short(e)}); "
        "restore with the same model and optimizer it was saved with, and "
        "give `like` the whole state that was saved.") from None
  if elastic_k:
    host = elastic.resize_tree(jax.tree.map(np.asarray, out),
                               transform.per_worker_mask(saved_like), new_k)
    host = _grouped(host, plan, np.stack) if per_unit else host
    host = _grouped_moments(host, plan) if leafwise else host
    host = _targeted(host, targets) if untargeted else host
    out = jax.tree.map(_place, jax.tree.map(np.asarray, host), abstract(like))
  elif per_unit or leafwise or untargeted:
    out = _grouped(out, plan, jax.numpy.stack) if per_unit else out
    out = _grouped_moments(out, plan) if leafwise else out
    out = _targeted(out, targets) if untargeted else out
    out = jax.tree.map(lambda x, l: jax.device_put(x, l.sharding)
                       if _is_array(l) else x, out, abstract(like))
  return step, out


def _short(error: Exception, limit: int = 400) -> str:
  """orbax's message on one line, without its advice for its own API
  (``partial_restore``), cut at ``limit`` characters."""
  text = " ".join(str(error).split())
  text = text.split(" If this mismatch is intentional", 1)[0]
  return text if len(text) <= limit else text[:limit] + " …"


def _has_sync_state(tree) -> bool:
  return transform.holds(tree, transform.is_sync_state)


def _is_onebit(x) -> bool:
  return isinstance(x, recipes.OnebitState)


def _has_onebit(tree) -> bool:
  return transform.holds(tree, _is_onebit)


def _leafwise_moments(tree):
  """``tree`` with each ``OnebitState``'s m in the params' shapes, as
  jaxfuse 0.2 kept it (shapes and shardings: those of ν, which has
  them; both are replicated float32)."""
  return jax.tree.map(
      lambda x: x._replace(mu=abstract(x.nu)) if _is_onebit(x) else x, tree,
      is_leaf=_is_onebit)


def _grouped_moments(tree, plan):
  """Inverse of ``_leafwise_moments`` on arrays (``grouped.group``)."""
  lay = grouped.layout(bucket_steps.compile_plan(plan))
  return jax.tree.map(
      lambda x: x._replace(mu=grouped.group(lay, x.mu)) if _is_onebit(x)
      else x, tree, is_leaf=_is_onebit)


class _UntargetedControl(NamedTuple):
  """``sparsify.Control`` as state layouts 1-3 kept it (no ``target``)."""
  threshold: Any
  log_scale: Any
  log_step: Any
  flag: Any


def _untargeted(tree):
  """``tree`` with each ``SparseSyncState``'s control without ``target``
  (shapes only)."""
  return jax.tree.map(
      lambda x: x._replace(control=_UntargetedControl(
          *x.control[:len(_UntargetedControl._fields)]))
      if transform.is_sync_state(x) else x, tree,
      is_leaf=transform.is_sync_state)


def _unit_targets(plan) -> np.ndarray:
  """Per unit of ``plan``, the k its controller tracks (one 0 column for
  a plan of no units, as ``sparse_sync``'s state keeps)."""
  units = bucket_steps.compile_plan(plan).units
  return np.asarray([plans.target_count(u.density, u.size)
                     for u in units] or [0], np.int32)


def _targeted(tree, targets):
  """Inverse of ``_untargeted`` on arrays: ``target`` is the saved plan's
  k (``targets``) where the unit's controller had set a threshold (as a
  step of today's would have recorded it), else 0 (none yet: the next
  step estimates afresh)."""
  def fill(control):
    threshold = control.threshold   # host, or sharded over the processes
    xp = np if isinstance(threshold, np.ndarray) else jax.numpy
    k = np.zeros(threshold.shape[-1], np.int32) if targets is None else targets
    return sparsify.Control(*control, xp.where(threshold > 0, k, 0).astype(
        np.int32))
  return jax.tree.map(
      lambda x: x._replace(control=fill(x.control))
      if transform.is_sync_state(x) else x, tree,
      is_leaf=transform.is_sync_state)


def _per_unit(tree, plan):
  """``tree`` with each ``SparseSyncState``'s residuals and velocity as
  jaxfuse 0.1 kept them: one (K, n) array per unit (shapes only)."""
  group_of_unit = bucket_steps.compile_plan(plan).group_of_unit

  def unit_like(a):           # a row of a group's (K, G, n) array
    return jax.ShapeDtypeStruct(
        (a.shape[0],) + tuple(a.shape[2:]), a.dtype,
        sharding=placement.on_worker_axis(getattr(a, "sharding", None)))

  split = lambda arrays: tuple(unit_like(arrays[g]) for g in group_of_unit)

  return jax.tree.map(
      lambda x: x._replace(residuals=split(x.residuals),
                           velocity=split(x.velocity) if x.velocity else ())
      if transform.is_sync_state(x) else x, tree,
      is_leaf=transform.is_sync_state)


def _grouped(tree, plan, stack):
  """Inverse of ``_per_unit`` on arrays: per-unit (K, n) arrays stacked
  into one (K, G, n) array per state group."""
  groups = bucket_steps.compile_plan(plan).groups
  join = lambda arrays: tuple(stack([arrays[u] for u in ids], axis=1)
                              for ids in groups) if arrays else ()
  return jax.tree.map(
      lambda x: x._replace(residuals=join(x.residuals),
                           velocity=join(x.velocity))
      if transform.is_sync_state(x) else x, tree,
      is_leaf=transform.is_sync_state)


def _on_host(like, saved_k):
  """Restore target: ``like`` with per-worker leaves of ``saved_k`` rows,
  every array whole on one CPU device (then redistributed and placed)."""
  try:
    cpus = jax.local_devices(backend="cpu")
  except RuntimeError:  # no CPU backend (JAX_PLATFORMS without cpu)
    cpus = []
  device = jax.sharding.SingleDeviceSharding(
      cpus[0] if cpus else jax.local_devices()[0])
  return jax.tree.map(
      lambda x, m: jax.ShapeDtypeStruct(
          ((saved_k,) + tuple(x.shape[1:])) if m else x.shape, x.dtype,
          sharding=device) if _is_array(x) else x,
      like, transform.per_worker_mask(like))


def _place(host: np.ndarray, like: jax.ShapeDtypeStruct) -> jax.Array:
  """A host array placed with ``like``'s sharding (each process fills its
  own devices: works across processes); a Python number as one."""
  if not _is_array(like):
    return type(like)(host.item())
  if like.sharding is None:
    return jax.numpy.asarray(host)
  return jax.make_array_from_callback(host.shape, like.sharding,
                                      lambda index: host[index])


def _check_plan(saved: dict, plan: plans.Plan | None, step: int) -> None:
  if plan is None or not saved:
    if bool(plan is None) != bool(not saved):
      raise CheckpointError(
          f"checkpoint {step} was saved {'with' if saved else 'without'} a "
          f"plan and is restored {'with' if plan is not None else 'without'}"
          " one; use the same setup.")
    return
  try:
    old = plans.Plan.from_json(json.dumps(saved))
  except plans.PlanError as e:
    raise CheckpointError(f"checkpoint {step}: its plan does not load "
                          f"({e}).") from None
  part = bucket_steps.layout_difference(old, plan)
  if part:
    raise CheckpointError(
        f"checkpoint {step} was saved with a plan whose {part} differ from "
        "this plan's, so its per-worker state does not fit; restore with the "
        "saved plan (jaxfuse.checkpoint.saved_plan(manager)), then carry the "
        "state to this plan with jaxfuse.relayout(state, saved, plan).")


def saved_extra(mngr, step: int | None = None) -> dict:
  """The ``extra`` JSON saved with checkpoint ``step`` (default latest).

  Args:
    mngr: the ``manager``.
    step: the checkpoint; None: the latest.

  Returns:
    The dict given to ``save`` as ``extra`` (empty if none).

  Raises:
    CheckpointError: no such checkpoint, or it cannot be read.
  """
  extra = dict(_json_item(mngr, _resolve(mngr, step), EXTRA) or {})
  extra.pop(WORKERS, None)
  extra.pop(LAYOUT, None)
  return extra


def saved_workers(mngr, step: int | None = None) -> int | None:
  """K, the workers the per-worker state of checkpoint ``step`` (default
  the latest) was saved on (None: no per-worker state).

  Args:
    mngr: the ``manager``.
    step: the checkpoint; None: the latest.

  Returns:
    K, or None.

  Raises:
    CheckpointError: no such checkpoint, or it cannot be read.
  """
  return (_json_item(mngr, _resolve(mngr, step), EXTRA) or {}).get(WORKERS)


def saved_plan(mngr, step: int | None = None) -> plans.Plan | None:
  """The plan saved with checkpoint ``step`` (default the latest).

  Args:
    mngr: the ``manager``.
    step: the checkpoint; None: the latest.

  Returns:
    The ``Plan``, or None when saved without one.

  Raises:
    CheckpointError: no such checkpoint, or it cannot be read.
  """
  saved = _json_item(mngr, _resolve(mngr, step), PLAN)
  return plans.Plan.from_json(json.dumps(saved)) if saved else None


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
