"""``sparse_sync``: the Optax transform, its per-worker state and helpers.

Applied inside ``jax.shard_map`` over the data axis to each worker's *local*
gradients; returns the worker-averaged gradients, identical on every worker.

Per-worker state (residuals, thresholds, stats) has a leading axis of size 1
inside ``shard_map``; globally that axis has size K, sharded over the data
axis. ``init_state`` builds it that way and ``state_specs`` gives the
``PartitionSpec``s to pass through ``shard_map`` and ``jax.jit``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from jaxfuse import _compat
from jaxfuse import bucket_pass
from jaxfuse import collectives
from jaxfuse import plans as plan_lib
from jaxfuse import sparsify
from jaxfuse import stats as stats_lib
from jaxfuse.stats import SyncStats


class SparseSyncState(NamedTuple):
  """Per-worker state. ``residuals`` and ``velocity`` hold one (1, G, size)
  array per state group (``plans.state_groups``: a bucket's units of one
  size and dtype); ``unit_residuals`` gives them per unit."""
  step: jax.Array                   # (1,) int32
  residuals: tuple[jax.Array, ...]  # per state group, (1, G, size)
  control: sparsify.Control         # per unit, (1, max(U, 1))
  stats: SyncStats                  # per leaf, (1, L)
  velocity: tuple[jax.Array, ...] = ()  # as residuals; momentum > 0


class SyncError(ValueError):
  """``sparse_sync`` used in a way that cannot work."""


def sparse_sync(plan: plan_lib.Plan, axis_name: str | tuple = "data", *,
                momentum: float = 0.0, nesterov: bool = False,
                mask_momentum: bool = True,
                residual_decay: float = 1.0
                ) -> optax.GradientTransformationExtraArgs:
  """Sparsify-ahead, fused gradient synchronization with error feedback.

  Per worker k and selection unit, with x_k the stream it is fed (the local
  gradient, or a local update such as Adam's)::

    acc_k = x_k + d·r_k          (d = residual_decay; 1: error feedback)
    sent_k = top(acc_k)          (capacity slots, threshold τ)
    r_k' = acc_k − sent_k + kept_k
    out = (1/K)·Σ_k sent_k − (1/K)·Σ_k kept_k   (identical on every worker)

  kept_k: what the bucket's collective could not move this step and handed
  back to worker k (0 for ``"allgather"``; ZEN's overflow, SparDL's merge
  drops, the host shard of ``"hier"``: ``jaxfuse.collectives``), so what
  the workers owe is exact: K·out + Σ_k r_k' = Σ_k acc_k.

  With ``momentum`` m > 0 (DGC's momentum correction, Lin et al. 2018 §3.2)
  each worker keeps a velocity u and the residual r accumulates it::

    u' = m·u + x                 (Nesterov: u' = m·(u + x), and x + u' is added)
    acc = r + u' ;  r' = acc − sent ;  u'' = u' with the sent slots zeroed

  (``mask_momentum``: momentum factor masking). What the workers owe is
  conserved: Σ_k (sent_k + r_k') = Σ_k (r_k + u_k') for every unit and step.
  ``residual_decay`` d < 1 makes r a decaying momentum buffer (DeMo).

  A bucket whose units all have density 1 (``jaxfuse.with_density(plan,
  1.0)``, a dense warm-up phase) sends every element with one ``pmean``:
  ``out = (1/K)·Σ_k acc_k`` exactly, residual zero.

  Low-precision gradients (``plan.settings.residual_dtype = "float32"``,
  the default): acc, r and u are float32; sent_k is rounded to the
  gradient's dtype for the wire and r' keeps the rounding, acc − sent_k
  (a density-1 bucket's residual is then that rounding, not zero).

  Args:
    plan: from ``jaxfuse.plan(params, ...)`` or ``Plan.load(path)``.
    axis_name: the ``shard_map`` mesh axis the workers are laid along, or
      a tuple of axes (the workers are all their devices, K = the product;
      ``"hier"`` buckets need the pair ``("host", "local")`` of
      ``jaxfuse.make_mesh(local=L)``).
    momentum: m in [0, 1); 0 is plain error feedback.
    nesterov: Nesterov momentum (DGC's appendix form).
    mask_momentum: zero the velocity where it was sent (DGC's masking).
    residual_decay: d in (0, 1].

  Returns:
    A transform whose ``update`` must run inside ``jax.shard_map`` over
    ``axis_name`` on per-worker gradients (differentiate with respect to
    ``jaxfuse.local_params(params)``); the updates it returns are the worker
    mean ``(1/K)·Σ_k sent_k``, the same on every worker.
  """
  if not isinstance(plan, plan_lib.Plan):
    raise TypeError(f"sparse_sync expects a jaxfuse.Plan, got "
                    f"{type(plan).__name__}; make one with jaxfuse.plan(params).")
  _check_unit_interval("momentum", momentum, closed_low=True)
  _check_unit_interval("residual_decay", residual_decay, closed_high=True)
  if not isinstance(nesterov, bool) or not isinstance(mask_momentum, bool):
    raise SyncError(f"sparse_sync: nesterov={nesterov!r} and mask_momentum="
                    f"{mask_momentum!r} must be True or False.")
  if nesterov and momentum == 0:
    raise SyncError("sparse_sync: nesterov=True needs momentum > 0.")
  if isinstance(axis_name, list):
    axis_name = tuple(axis_name)
  all_units, bucket_units = plan_lib.units(plan)
  groups = plan_lib.state_groups(plan)
  group_of_unit = [g for g, _ in plan_lib.unit_rows(plan)]
  bucket_groups = [sorted({group_of_unit[u] for u in ids})
                   for ids in bucket_units]
  settings = plan.settings
  num_leaves = len(plan.leaves)
  group_dtypes = [plan_lib.state_dtype(all_units[ids[0]], settings)
                  for ids in groups]
  zeros = lambda: tuple(jnp.zeros((1, len(ids), all_units[ids[0]].size),
                                  group_dtypes[g])
                        for g, ids in enumerate(groups))

  def init_fn(params):
    plan.validate(params)
    return SparseSyncState(
        step=jnp.zeros((1,), jnp.int32),
        residuals=zeros(),
        # At least one entry: an all-dense plan would otherwise carry
        # zero-size arrays, which XLA's GPU compiler (JAX 0.11.2) crashes on.
        control=jax.tree.map(lambda x: x[None], sparsify.initial_control(
            max(1, len(all_units)))),
        stats=stats_lib.empty_stats(num_leaves),
        velocity=zeros() if momentum else ())

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
    _check_state(state, groups, all_units, momentum)
    for i, b in enumerate(plan.buckets):
      scheme = collectives.get(b.collective)
      scheme.check(f"bucket {i}", num_workers, settings)
      scheme.check_axes(f"bucket {i}", axis_name, settings)
    sizes = (tuple(_compat.axis_size(a) for a in axis_name)
             if isinstance(axis_name, tuple) else None)
    wire_bytes = sum(w.sent for w in collectives.bucket_wire(
        plan, num_workers, sizes))
    step = state.step[0]
    ctrl = jax.tree.map(lambda x: x[0], state.control)

    synced = [None] * num_leaves
    residuals = [r[0] for r in state.residuals]
    velocity = [v[0] for v in state.velocity]
    ctrl_chunks = []   # (unit ids, Control of (G,) arrays)
    stat_chunks = []   # (leaf ids, {stat: (G,) array})

    for bucket, unit_ids, gids in zip(plan.buckets, bucket_units,
                                      bucket_groups):
      if bucket.collective == "psum":
        # Non-float leaves have no gradient to average (float0 or ints).
        ids = [j for j in bucket.leaves if _compat.is_float_dtype(flat[j].dtype)]
        for j in bucket.leaves:
          synced[j] = flat[j]
        for j, out in zip(ids, collectives.psum.mean([flat[j] for j in ids],
                                                     axis_name)):
          synced[j] = out
        stat_chunks.extend(stats_lib.dense_stats(plan, bucket.leaves, flat))
        continue
      # Per state group: its rows' streams x (G, n), what they accumulate
      # and the (decayed) residuals.
      grads, moved, decayed = {}, {}, {}
      for g in gids:
        x = jnp.stack([_unit_stream(all_units[u], flat, group_dtypes[g])
                       for u in groups[g]])
        grads[g], moved[g] = _accumulate(x, velocity[g] if momentum else None,
                                         momentum, nesterov)
        decayed[g] = (residuals[g] * residual_decay if residual_decay != 1
                      else residuals[g])
      if all(plan_lib.is_full(all_units[u]) for u in unit_ids):
        dense, finite, roundings = _full_sync(
            plan, [all_units[u] for g in gids for u in groups[g]],
            [grads[g][i] + decayed[g][i] for g in gids
             for i in range(len(groups[g]))], stat_chunks, axis_name)
        # Their thresholds are not used; kept as they were.
        ctrl_chunks.append((list(unit_ids), jax.tree.map(
            lambda x: bucket_pass.take(x, unit_ids), ctrl)))
        rows = 0
        for g in gids:
          n = len(groups[g])
          ok = jnp.stack(finite[rows:rows + n])[:, None]
          residuals[g] = jnp.where(ok, jnp.stack(roundings[rows:rows + n]),
                                   residuals[g])
          if momentum:
            kept = jnp.zeros_like(moved[g]) if mask_momentum else moved[g]
            velocity[g] = jnp.where(ok, kept, velocity[g])
          rows += n
        order = [u for g in gids for u in groups[g]]
      else:
        parts = {}
        new_res = {g: [] for g in gids}
        new_vel = {g: [] for g in gids}
        for batch, out, stacked in bucket_pass.sparsify_groups(
            all_units, groups, gids, grads, decayed, ctrl, step, settings):
          g, rows, ids = batch.group, batch.rows, batch.units
          values, residual = jax.vmap(_to_wire, in_axes=(0, 0, 0, 0, None))(
              out.values, out.indices, out.residual, out.nonfinite,
              batch.unit.dtype)
          for i, u in enumerate(ids):
            parts[u] = (values[i], out.indices[i])
          # A non-finite step keeps the residual sparsify was given: the
          # decayed one, so restore the old where it was decayed.
          bad = out.nonfinite[:, None]
          if residual_decay != 1:
            residual = jnp.where(bad, bucket_pass.rows_of(residuals[g], rows),
                                 residual)
          new_res[g].append((rows, residual))
          if momentum:
            m = bucket_pass.rows_of(moved[g], rows)
            kept = (jax.vmap(lambda v, i: v.at[i].set(0, mode="drop"))(
                m, out.indices) if mask_momentum else m)
            new_vel[g].append((rows, jnp.where(
                bad, bucket_pass.rows_of(velocity[g], rows), kept)))
          ctrl_chunks.append((ids, out.control))
          stat_chunks.extend(stats_lib.sparse_stats(
              plan, [all_units[u] for u in ids], out, stacked))
        for g in gids:
          residuals[g] = _set_rows(residuals[g], new_res[g])
          if momentum:
            velocity[g] = _set_rows(velocity[g], new_vel[g])
        order = list(unit_ids)   # the bucket's layout: its ready order
        dense, kept = collectives.get(bucket.collective).sync(
            [parts[u] for u in order], [all_units[u] for u in order],
            axis_name, settings)
        for g in gids:  # dropped on the way: owed still
          back = [kept[order.index(u)] for u in groups[g]]
          if any(b is not None for b in back):
            residuals[g] = residuals[g] + jnp.stack([
                jnp.zeros_like(residuals[g][0]) if b is None else
                b.astype(residuals[g].dtype) for b in back])
      for u, unit_dense in zip(order, dense):
        unit = all_units[u]
        for j, start in zip(unit.leaves, plan_lib.leaf_offsets(plan, unit)):
          leaf = plan.leaves[j]
          synced[j] = unit_dense[start:start + leaf.size].reshape(
              leaf.shape).astype(flat[j].dtype)

    stats = stats_lib.finish_stats(stats_lib.in_order(stat_chunks), wire_bytes)
    control = (jax.tree.map(lambda x: x[None], stats_lib.in_order(ctrl_chunks))
               if ctrl_chunks else state.control)
    new_state = SparseSyncState(state.step + 1,
                                tuple(r[None] for r in residuals), control,
                                stats, tuple(v[None] for v in velocity))
    return jax.tree.unflatten(jax.tree.structure(updates), synced), new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _check_unit_interval(name, x, closed_low=False, closed_high=False):
  ok = isinstance(x, (int, float)) and not isinstance(x, bool) and (
      (0 <= x if closed_low else 0 < x) and (x <= 1 if closed_high else x < 1))
  if not ok:
    interval = (("[" if closed_low else "(") + "0, 1" +
                ("]" if closed_high else ")"))
    raise SyncError(f"sparse_sync: {name}={x!r} must be a number in "
                    f"{interval}.")


def _accumulate(x, u, momentum, nesterov):
  """(what the residual accumulates, new velocity) of DGC's momentum
  correction: u' = m·u + x, adds u' (Nesterov: u' = m·(u + x), adds x + u').
  Without momentum, x itself and no velocity."""
  if not momentum:
    return x, None
  if nesterov:
    u = momentum * (u + x)
    return x + u, u
  u = momentum * u + x
  return u, u


def _round_to(x, wire_dtype):
  """(x rounded to ``wire_dtype`` but still in x's dtype, the same in
  ``wire_dtype``). ``lax.reduce_precision`` rounds explicitly: XLA may drop
  a convert round trip (``xla_allow_excess_precision``, on by default on
  GPU), which would lose the rounding we keep."""
  if x.dtype == jnp.dtype(wire_dtype):
    return x, x
  info = jnp.finfo(wire_dtype)
  rounded = lax.reduce_precision(x, exponent_bits=info.nexp,
                                 mantissa_bits=info.nmant)
  return rounded, rounded.astype(wire_dtype)


def _to_wire(values, indices, residual, nonfinite, wire_dtype):
  """Selected values in the wire dtype, and the residual that keeps their
  rounding: r' = acc − wire(v) at the sent slots (exact in float32 for a
  bfloat16 wire), so nothing sent is lost to the cast."""
  if values.dtype == jnp.dtype(wire_dtype):
    return values, residual
  rounded, wire = _round_to(values, wire_dtype)
  rounding = jnp.where(nonfinite, 0, values - rounded)
  return wire, residual.at[indices].add(rounding, mode="drop")


def _full_sync(plan, units, accs, stat_chunks, axis_name):
  """Density-1 units: every element sent, one ``pmean`` for the bucket.

  Returns the dense means per unit, per unit whether acc was finite, and
  the new residual: zero, or acc's rounding to the wire dtype (the unit's
  dtype) where the residual is kept wider; appends the units' per-leaf
  stats chunks (everything selected)."""
  wires, roundings = [], []
  for unit, acc in zip(units, accs):
    rounded, wire = _round_to(acc, unit.dtype)
    wires.append(wire)
    roundings.append(acc - rounded)   # zero where the wire is acc's dtype
  means = collectives.psum.mean(wires, axis_name)
  per_leaf = {}
  for unit, acc in zip(units, accs):
    for j, start in zip(unit.leaves, plan_lib.leaf_offsets(plan, unit)):
      per_leaf[j] = acc[start:start + plan.leaves[j].size]
  stat_chunks.extend(stats_lib.dense_stats(plan, list(per_leaf), per_leaf))
  return means, [jnp.all(jnp.isfinite(acc)) for acc in accs], roundings


def _unit_stream(unit, flat, dtype):
  """A unit's flat stream: its leaves' gradients concatenated, in ``dtype``."""
  return jnp.concatenate([flat[j].reshape(-1).astype(dtype)
                          for j in unit.leaves])


def _set_rows(x, pieces):
  """x with rows replaced by [(rows, values)] (no copy if one piece covers
  every row in order)."""
  if len(pieces) == 1 and list(pieces[0][0]) == list(range(x.shape[0])):
    return pieces[0][1]
  for rows, values in pieces:
    x = x.at[np.asarray(rows)].set(values)
  return x


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
  names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
  vma_on = set(names) <= _compat.varying_axes(lax.axis_index(axis_name))
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
        not set(names) <= _compat.varying_axes(g)):
      raise SyncError(
          f"gradient {leaf.path} is already the same on every worker: JAX "
          f"summed it over {axis_name!r} when differentiating replicated "
          "parameters. Differentiate with respect to "
          f"jaxfuse.local_params(params, {axis_name!r}) to get each "
          "worker's own gradient.")
    out.append(g)
  return out


def _check_state(state, groups, all_units, momentum) -> None:
  if not isinstance(state, SparseSyncState):
    raise SyncError(f"expected a SparseSyncState, got {type(state).__name__}; "
                    "create the state with jaxfuse.init_state(...).")
  shapes = [(len(ids), all_units[ids[0]].size) for ids in groups]
  if state.step.shape != (1,) or len(state.residuals) != len(groups):
    raise SyncError(
        f"sparse_sync state has step shape {tuple(state.step.shape)} and "
        f"{len(state.residuals)} residual groups inside shard_map; expected "
        f"(1,) and {len(groups)}. Pass the state with "
        "jaxfuse.state_specs(state) as its in_specs/out_specs, and create it "
        "with this plan (jaxfuse.init_state).")
  for g, (r, shape) in enumerate(zip(state.residuals, shapes)):
    if tuple(r.shape[1:]) != shape:
      raise SyncError(
          f"sparse_sync state: residual group {g} has shape "
          f"{tuple(r.shape[1:])}, this plan needs {shape}. The state was "
          "made for another plan or by jaxfuse 0.1 (per-unit "
          "residuals); create it with jaxfuse.init_state for this plan.")
  if len(state.velocity) != (len(groups) if momentum else 0):
    raise SyncError(
        f"sparse_sync state has {len(state.velocity)} velocity buffers; this "
        f"transform (momentum={momentum}) needs "
        f"{len(groups) if momentum else 0}. Create the state with the "
        "same transform (jaxfuse.init_state(optimizer, ...)).")


def unit_residuals(plan: plan_lib.Plan, state: SparseSyncState,
                   velocity: bool = False) -> list[jax.Array]:
  """The residual (or velocity) of each selection unit, in
  ``plans.units`` order: views of the state's per-group arrays, each with
  the state's leading worker axis (K outside ``shard_map``)."""
  arrays = state.velocity if velocity else state.residuals
  return [arrays[g][:, i] for g, i in plan_lib.unit_rows(plan)]


# --- helpers for users --------------------------------------------------------

def local_params(params, axis_name: str | tuple = "data"):
  """Mark replicated params as per-worker so ``jax.grad`` gives local grads.

  ``axis_name``: the workers' mesh axis, or a tuple of axes (all of them).

  Inside ``shard_map`` the gradient of a replicated input is summed over the
  axis by JAX itself; differentiating this view instead keeps each worker's
  own gradient for ``sparse_sync`` to sparsify. No data moves.
  """
  return _compat.to_varying(params, axis_name)


class PerWorkerState(NamedTuple):
  """State of a transform wrapped by ``per_worker``: each leaf has a leading
  worker axis (size 1 inside ``shard_map``, K outside, sharded)."""
  inner: Any


def per_worker(inner: optax.GradientTransformation, *,
               float32_state: bool = True
               ) -> optax.GradientTransformationExtraArgs:
  """Run ``inner`` on each worker's own values, with per-worker state.

  Chained before ``sparse_sync``, ``inner`` sees the local gradient and its
  state (e.g. Adam's moments of the local gradients) differs per worker;
  ``init_state`` and ``state_specs`` shard it over the data axis like the
  residuals. Stateless transforms need no wrapper.

  ``float32_state``: low-precision (bfloat16, float16) leaves go through
  ``inner`` in float32, so its state is float32 (as ``sparse_sync``'s
  residual is); its outputs come back in the updates' dtype.
  """
  inner = optax.with_extra_args_support(inner)
  wide = _at_least_float32 if float32_state else (lambda tree: tree)

  def init_fn(params):
    return PerWorkerState(jax.tree.map(lambda x: x[None],
                                       inner.init(wide(params))))

  def update_fn(updates, state, params=None, **extra_args):
    if not isinstance(state, PerWorkerState):
      raise SyncError(f"per_worker expects its PerWorkerState, got "
                      f"{type(state).__name__}; create the state with "
                      "jaxfuse.init_state(optimizer, ...).")
    local = jax.tree.map(lambda x: x[0], state.inner)
    out, local = inner.update(wide(updates), local,
                              None if params is None else wide(params),
                              **extra_args)
    out = jax.tree.map(lambda o, u: o.astype(u.dtype), out, updates)
    return out, PerWorkerState(jax.tree.map(lambda x: x[None], local))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _at_least_float32(tree):
  """Floating leaves below float32 as float32; the rest as they are."""
  def widen(x):
    dtype = jnp.result_type(x)
    if _compat.is_float_dtype(dtype):
      return jnp.asarray(x, jnp.promote_types(dtype, jnp.float32))
    return x
  return jax.tree.map(widen, tree)


def _is_sync_state(x) -> bool:
  return isinstance(x, SparseSyncState)


def _is_worker_state(x) -> bool:
  return isinstance(x, (SparseSyncState, PerWorkerState))


def per_worker_mask(tree):
  """The same structure as ``tree`` (any pytree holding optimizer states),
  True at the leaves of ``sparse_sync``'s and ``per_worker``'s states (a
  leading worker axis), False elsewhere."""
  def mark(x):
    if _is_worker_state(x):
      return jax.tree.map(lambda _: True, x)
    return False
  return jax.tree.map(mark, tree, is_leaf=_is_worker_state)


def state_specs(opt_state, axis_name: str | tuple = "data"):
  """``PartitionSpec`` tree for an optimizer state holding ``sparse_sync``.

  The leaves of ``sparse_sync``'s and ``per_worker``'s states get
  ``P(axis_name)`` (a tuple of axes: the leading axis over all of them,
  host-major); everything else (Adam moments after the sync, counts,
  …) is replicated, ``P()``. Works on real or abstract (``jax.eval_shape``)
  states.
  """
  def spec(x):
    if _is_worker_state(x):
      return jax.tree.map(lambda _: P(axis_name), x)
    return P()
  return jax.tree.map(spec, opt_state, is_leaf=_is_worker_state)


def init_state(optimizer: optax.GradientTransformation, params,
               mesh: jax.sharding.Mesh, axis_name: str | tuple = "data"):
  """``optimizer.init(params)`` with per-worker leaves sharded over the axis
  (or the tuple of axes)."""
  if isinstance(axis_name, list):
    axis_name = tuple(axis_name)
  names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
  if not set(names) <= set(mesh.axis_names):
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
