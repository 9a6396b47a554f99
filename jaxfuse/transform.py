"""``sparse_sync``: the Optax transform, its per-worker state and helpers.

Applied inside ``jax.shard_map`` over the data axis to each worker's *local*
gradients; returns the worker-averaged gradients, identical on every worker.

Per-worker state (residuals, thresholds, stats) has a leading axis of size 1
inside ``shard_map``; globally that axis has size K, sharded over the data
axis. ``init_state`` builds it that way and ``state_specs`` gives the
``PartitionSpec``s to pass through ``shard_map`` and ``jax.jit``.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from jaxfuse import _compat
from jaxfuse import collectives
from jaxfuse import fusion
from jaxfuse import plans as plan_lib
from jaxfuse import sparsify


class SyncStats(NamedTuple):
  """What the last step did, per worker (leading axis) and per leaf.

  selected: elements sent (dense leaves: all of them).
  candidates: elements with |acc| ≥ τ (above capacity they stay in the residual).
  overflow: candidates − selected, what capacity held back.
  threshold: τ used (a "behind" bucket's one τ for each of its leaves).
  missing: the leaf had a non-zero gradient and sent nothing (SAFusion's
    tensor missing).
  nonfinite: the leaf's gradient had a NaN or Inf (its residual was kept).
  wire_bytes: bytes this worker put into collectives.
  """
  selected: jax.Array
  candidates: jax.Array
  overflow: jax.Array
  threshold: jax.Array
  missing: jax.Array
  nonfinite: jax.Array
  wire_bytes: jax.Array


class SparseSyncState(NamedTuple):
  step: jax.Array                   # (1,) int32
  residuals: tuple[jax.Array, ...]  # per unit, (1, size)
  control: sparsify.Control         # per unit, (1, max(U, 1))
  stats: SyncStats                  # per leaf, (1, L)


class SyncError(ValueError):
  """``sparse_sync`` used in a way that cannot work."""


def _empty_stats(num_leaves: int) -> SyncStats:
  zi = jnp.zeros((1, num_leaves), jnp.int32)
  zb = jnp.zeros((1, num_leaves), bool)
  return SyncStats(zi, zi, zi, jnp.zeros((1, num_leaves), jnp.float32), zb,
                   zb, jnp.zeros((1,), jnp.float32))


def sparse_sync(plan: plan_lib.Plan,
                axis_name: str = "data") -> optax.GradientTransformationExtraArgs:
  """Sparsify-ahead, fused gradient synchronization (chain it first).

  Args:
    plan: from ``jaxfuse.plan(params, ...)`` or ``Plan.load(path)``.
    axis_name: the ``shard_map`` mesh axis the workers are laid along.

  Returns:
    A transform whose ``update`` must run inside ``jax.shard_map`` over
    ``axis_name`` on per-worker gradients (differentiate with respect to
    ``jaxfuse.local_params(params)``); the updates it returns are the worker
    mean ``(1/K)·Σ_k sent_k``, the same on every worker.
  """
  if not isinstance(plan, plan_lib.Plan):
    raise TypeError(f"sparse_sync expects a jaxfuse.Plan, got "
                    f"{type(plan).__name__}; make one with jaxfuse.plan(params).")
  all_units, bucket_units = fusion.units(plan)
  settings = plan.settings
  num_leaves = len(plan.leaves)
  wire_bytes = plan.bytes_per_worker()

  def init_fn(params):
    plan.validate(params)
    return SparseSyncState(
        step=jnp.zeros((1,), jnp.int32),
        residuals=tuple(jnp.zeros((1, u.size), u.dtype) for u in all_units),
        # At least one entry: an all-dense plan would otherwise carry
        # zero-size arrays, which XLA's GPU compiler (JAX 0.11.2) crashes on.
        control=jax.tree.map(lambda x: x[None], sparsify.initial_control(
            max(1, len(all_units)))),
        stats=_empty_stats(num_leaves))

  def update_fn(updates, state, params=None, **extra_args):
    del params, extra_args
    num_workers = _compat.axis_size(axis_name)
    if num_workers is None:
      raise SyncError(
          f"sparse_sync.update needs the mesh axis {axis_name!r}: call it "
          f"inside jax.shard_map(..., mesh=mesh) over a mesh with axis "
          f"{axis_name!r} (see README, quickstart), or pass "
          "sparse_sync(plan, axis_name=...) with your axis name.")
    flat = _check_grads(plan, updates, axis_name)
    _check_state(state, all_units, num_leaves)
    step = state.step[0]
    ctrl = jax.tree.map(lambda x: x[0], state.control)

    synced = [None] * num_leaves
    residuals = list(state.residuals)
    new_ctrl = [None] * len(all_units)
    per_leaf = {name: [None] * num_leaves for name in
                ("selected", "candidates", "threshold", "nonfinite")}

    for bucket, unit_ids in zip(plan.buckets, bucket_units):
      if bucket.collective == "psum":
        # Non-float leaves have no gradient to average (float0 or ints).
        ids = [j for j in bucket.leaves if _compat.is_float_dtype(flat[j].dtype)]
        for j in bucket.leaves:
          synced[j] = flat[j]
        for j, out in zip(ids, collectives.psum_sync([flat[j] for j in ids],
                                                     axis_name)):
          synced[j] = out
        for j in bucket.leaves:
          per_leaf["selected"][j] = jnp.int32(plan.leaves[j].size)
          per_leaf["candidates"][j] = jnp.int32(plan.leaves[j].size)
          per_leaf["threshold"][j] = jnp.float32(0)
          per_leaf["nonfinite"][j] = (~jnp.all(jnp.isfinite(flat[j])) if j in ids
                                      else jnp.bool_(False))
        continue
      grads = {u: jnp.concatenate([flat[j].reshape(-1).astype(
          all_units[u].dtype) for j in all_units[u].leaves]) for u in unit_ids}
      results = _sparsify_units(
          [all_units[u] for u in unit_ids], unit_ids, grads, residuals, ctrl,
          step, settings)
      parts = []
      for u in unit_ids:
        res = results[u]
        parts.append((res.values, res.indices))
        residuals[u] = res.residual[None]
        new_ctrl[u] = res.control
        _unit_stats(plan, all_units[u], res, grads[u], per_leaf)
      for u, dense in zip(unit_ids, collectives.allgather_sync(
          parts, [all_units[i] for i in unit_ids], axis_name)):
        unit = all_units[u]
        for j, start in zip(unit.leaves, fusion.leaf_offsets(plan, unit)):
          leaf = plan.leaves[j]
          synced[j] = dense[start:start + leaf.size].reshape(
              leaf.shape).astype(flat[j].dtype)

    stats = _finish_stats(plan, flat, per_leaf, wire_bytes)
    control = (jax.tree.map(lambda *xs: jnp.stack(xs)[None], *new_ctrl)
               if new_ctrl else state.control)
    new_state = SparseSyncState(state.step + 1, tuple(residuals), control,
                                stats)
    return jax.tree.unflatten(jax.tree.structure(updates), synced), new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _sparsify_units(units, unit_ids, grads, residuals, ctrl, step,
                    settings) -> dict:
  """``sparsify_unit`` for each unit; units of one shape run as one ``vmap``.

  Transformer layers repeat the same shapes, so this keeps the program (and
  its compile time and kernel count) about the size of one layer's.
  """
  groups = {}
  for unit, u in zip(units, unit_ids):
    sig = (unit.size, unit.capacity, unit.density, unit.estimator, unit.dtype)
    groups.setdefault(sig, []).append((unit, u))
  results = {}
  for members in groups.values():
    unit = members[0][0]
    ids = [u for _, u in members]
    fn = functools.partial(sparsify.sparsify_unit, capacity=unit.capacity,
                           density=unit.density, estimator=unit.estimator,
                           settings=settings)
    keys = [sparsify.salt(settings.seed, step, u) for u in ids]
    if len(ids) == 1:
      results[ids[0]] = fn(grads[ids[0]], residuals[ids[0]][0],
                           jax.tree.map(lambda x: x[ids[0]], ctrl), step,
                           keys[0])
      continue
    out = jax.vmap(fn, in_axes=(0, 0, 0, None, 0))(
        jnp.stack([grads[u] for u in ids]),
        jnp.stack([residuals[u][0] for u in ids]),
        jax.tree.map(lambda x: x[jnp.array(ids)], ctrl), step,
        jnp.stack(keys))
    for i, u in enumerate(ids):
      results[u] = jax.tree.map(lambda x, i=i: x[i], out)
  return results


def _unit_stats(plan, unit, res, grad, per_leaf):
  """Per-leaf selected / candidate counts of one unit."""
  if len(unit.leaves) == 1:
    j = unit.leaves[0]
    per_leaf["selected"][j] = jnp.sum(res.indices < unit.size, dtype=jnp.int32)
    per_leaf["candidates"][j] = res.count
    per_leaf["threshold"][j] = res.tau
    per_leaf["nonfinite"][j] = res.nonfinite
    return
  valid = res.indices < unit.size
  candidate = (jnp.abs(res.acc) >= res.tau) & (res.acc != 0)
  for j, start in zip(unit.leaves, fusion.leaf_offsets(plan, unit)):
    end = start + plan.leaves[j].size
    inside = valid & (res.indices >= start) & (res.indices < end)
    per_leaf["selected"][j] = jnp.sum(inside, dtype=jnp.int32)
    per_leaf["candidates"][j] = jnp.sum(candidate[start:end], dtype=jnp.int32)
    per_leaf["threshold"][j] = res.tau
    per_leaf["nonfinite"][j] = ~jnp.all(jnp.isfinite(grad[start:end]))


def _finish_stats(plan, flat, per_leaf, wire_bytes) -> SyncStats:
  stack = lambda name, dtype: jnp.stack(
      [jnp.asarray(x, dtype) for x in per_leaf[name]])[None]
  selected = stack("selected", jnp.int32)
  candidates = stack("candidates", jnp.int32)
  nonzero = jnp.stack([jnp.any(g != 0) if _compat.is_float_dtype(g.dtype)
                       else jnp.bool_(False) for g in flat])[None]
  return SyncStats(
      selected=selected,
      candidates=candidates,
      overflow=jnp.maximum(candidates - selected, 0),
      threshold=stack("threshold", jnp.float32),
      missing=nonzero & (selected == 0),
      nonfinite=stack("nonfinite", bool),
      wire_bytes=jnp.full((1,), wire_bytes, jnp.float32))


def _check_grads(plan, updates, axis_name) -> list[jax.Array]:
  """Flat gradients in pytree order, with errors that name the leaf."""
  flat = jax.tree_util.tree_flatten_with_path(updates)[0]
  paths = [jax.tree_util.keystr(p) for p, _ in flat]
  if paths != [l.path for l in plan.leaves]:
    planned = {l.path for l in plan.leaves}
    raise plan_lib.PlanError(
        "gradients and plan have different leaves: in the gradients only "
        f"{[p for p in paths if p not in planned][:5]}, in the plan only "
        f"{[l.path for l in plan.leaves if l.path not in set(paths)][:5]}. "
        "Make the plan from the parameters you differentiate.")
  vma_on = axis_name in _compat.varying_axes(lax.axis_index(axis_name))
  out = []
  for (_, g), leaf in zip(flat, plan.leaves):
    float0_ok = (g.dtype == jax.dtypes.float0 and
                 not _compat.is_float_dtype(leaf.dtype))
    if tuple(g.shape) != leaf.shape or (str(g.dtype) != leaf.dtype and
                                        not float0_ok):
      raise plan_lib.PlanError(
          f"gradient {leaf.path}: got {g.dtype}{list(g.shape)}, plan says "
          f"{leaf.dtype}{list(leaf.shape)}. Make a new plan for this model.")
    if (vma_on and _compat.is_float_dtype(g.dtype) and
        axis_name not in _compat.varying_axes(g)):
      raise SyncError(
          f"gradient {leaf.path} is already the same on every worker: JAX "
          f"summed it over {axis_name!r} when differentiating replicated "
          "parameters. Differentiate with respect to "
          f"jaxfuse.local_params(params, {axis_name!r}) to get each "
          "worker's own gradient.")
    out.append(g)
  return out


def _check_state(state, all_units, num_leaves) -> None:
  if not isinstance(state, SparseSyncState):
    raise SyncError(f"expected a SparseSyncState, got {type(state).__name__}; "
                    "create the state with jaxfuse.init_state(...).")
  if state.step.shape != (1,) or len(state.residuals) != len(all_units):
    raise SyncError(
        f"sparse_sync state has step shape {tuple(state.step.shape)} inside "
        "shard_map; expected (1,). Pass the state with "
        "jaxfuse.state_specs(state) as its in_specs/out_specs.")


# --- helpers for users --------------------------------------------------------

def local_params(params, axis_name: str = "data"):
  """Mark replicated params as per-worker so ``jax.grad`` gives local grads.

  Inside ``shard_map`` the gradient of a replicated input is summed over the
  axis by JAX itself; differentiating this view instead keeps each worker's
  own gradient for ``sparse_sync`` to sparsify. No data moves.
  """
  return _compat.to_varying(params, axis_name)


def _is_sync_state(x) -> bool:
  return isinstance(x, SparseSyncState)


def state_specs(opt_state, axis_name: str = "data"):
  """``PartitionSpec`` tree for an optimizer state holding ``sparse_sync``.

  ``sparse_sync``'s per-worker leaves get ``P(axis_name)``; everything else
  (Adam moments, counts, …) is replicated, ``P()``. Works on real or
  abstract (``jax.eval_shape``) states.
  """
  def spec(x):
    if _is_sync_state(x):
      return jax.tree.map(lambda _: P(axis_name), x)
    return P()
  return jax.tree.map(spec, opt_state, is_leaf=_is_sync_state)


def init_state(optimizer: optax.GradientTransformation, params,
               mesh: jax.sharding.Mesh, axis_name: str = "data"):
  """``optimizer.init(params)`` with per-worker leaves sharded over the axis."""
  if axis_name not in mesh.axis_names:
    raise SyncError(f"mesh has axes {mesh.axis_names}, not {axis_name!r}; "
                    "make the mesh with jaxfuse.make_mesh() or pass axis_name.")
  specs = state_specs(jax.eval_shape(optimizer.init, params), axis_name)
  init = jax.shard_map(optimizer.init, mesh=mesh, in_specs=(P(),),
                       out_specs=specs)
  return jax.jit(init)(params)


def sync_stats(opt_state) -> SyncStats:
  """The ``SyncStats`` inside an optimizer state (first ``sparse_sync``)."""
  for x in jax.tree.leaves(opt_state, is_leaf=_is_sync_state):
    if _is_sync_state(x):
      return x.stats
  raise SyncError("no sparse_sync state in this optimizer state.")


def summarize(stats: SyncStats, plan: plan_lib.Plan) -> dict[str, Any]:
  """Plain Python numbers for logging: means over workers."""
  sparse = np.array([l.mode == "sparse" for l in plan.leaves])
  sizes = np.array([l.size for l in plan.leaves], np.float64)
  selected = np.asarray(stats.selected, np.float64)
  out = {
      "wire_bytes": int(np.asarray(stats.wire_bytes).max()),
      "missing_leaves": float(np.asarray(stats.missing).sum(-1).mean()),
      "overflow": float(np.asarray(stats.overflow).sum(-1).mean()),
      "nonfinite_leaves": int(np.asarray(stats.nonfinite).any(0).sum()),
  }
  if sparse.any():
    out["density"] = float(selected[:, sparse].sum(-1).mean() /
                           sizes[sparse].sum())
  return out
