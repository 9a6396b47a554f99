"""``sparse_sync``: the Optax transform, its per-worker state and helpers.

Applied inside ``jax.shard_map`` over the data axis to each worker's *local*
gradients; returns the worker-averaged gradients, identical on every worker.

Per-worker state (residuals, thresholds, stats) has a leading axis of size 1
inside ``shard_map``; globally that axis has size K, sharded over the data
axis. ``jaxfuse.state.placement.init_state`` builds it that way and
``state_specs`` gives the ``PartitionSpec``s to pass through ``shard_map``
and ``jax.jit``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import optax

from jaxfuse import _compat
from jaxfuse.sync import bucket_sync
from jaxfuse import collectives
from jaxfuse.sync import grouped
from jaxfuse import kernels
from jaxfuse import plans
from jaxfuse.sync import bucket_steps
from jaxfuse import sparsify
from jaxfuse.stats import empty_stats
from jaxfuse.stats import finish_stats
from jaxfuse.stats import in_order
from jaxfuse.stats import SyncStats


class SparseSyncState(NamedTuple):
  """Per-worker state. ``residuals`` and ``velocity`` hold one (1, G, size)
  array per state group (``plans.state_groups``: a bucket's units of one
  size and dtype); ``unit_residuals`` gives them per unit.

  ``layout`` is the plan's ``bucket_steps.layout_digest``: no array, it lives
  in the pytree structure (auxiliary data, like a dict's keys), so a
  step sees it at trace time and refuses a state made for a plan of
  another layout, and a checkpoint holds the same arrays as without it.
  """
  step: jax.Array                   # (1,) int32
  residuals: tuple[jax.Array, ...]  # per state group, (1, G, size)
  control: sparsify.Control         # per unit, (1, max(U, 1))
  stats: SyncStats                  # per leaf, (1, L)
  velocity: tuple[jax.Array, ...] = ()  # as residuals; momentum > 0
  layout: tuple[str, ...] = ()      # static; () for a state of unknown plan


_ARRAY_FIELDS = SparseSyncState._fields[:-1]


def _children_with_keys(state: SparseSyncState):
  return ([(jax.tree_util.GetAttrKey(f), getattr(state, f))
           for f in _ARRAY_FIELDS], state.layout)


def _from_children(layout, children) -> SparseSyncState:
  return SparseSyncState(*children, layout=layout)


# The array fields keep the keys a plain NamedTuple's have (checkpoints
# and key paths are unchanged); ``layout`` goes into the tree structure.
jax.tree_util.register_pytree_with_keys(
    SparseSyncState, _children_with_keys, _from_children,
    lambda state: (tuple(state[:-1]), state.layout))


class SyncError(ValueError):
  """``sparse_sync`` used in a way that cannot work."""


def sparse_sync(plan: plans.Plan, axis_name: str | tuple = "data", *,
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
  (a density-1 bucket's residual is then that rounding, not zero). So
  does ``plan.settings.sparse_wire = "bfloat16"`` for float32 gradients,
  and a scheme that sums on the wire's dtype keeps the sums' rounding in
  kept: K·out + Σ_k r_k' = Σ_k acc_k holds to float32 rounding.

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
    mean ``(1/K)·Σ_k sent_k``, the same on every worker: a gradient,
    not an update (chain an optimizer after it, or use a recipe).
    ``update(updates, state, params, blend=(m, β))`` syncs the stream
    x = β·m + (1 − β)·updates instead (1-bit Adam's local momentum; m a
    tree like the updates, or a ``jaxfuse.grouped.Grouped`` of
    ``grouped.layout(plan)``, float32 like the updates; β a number,
    compiled in): bit for bit what passing x, formed by XLA from the same
    arrays, syncs. On the Pallas backend the fused pass forms x as it
    reads m and the gradient, which saves writing x out and reading it
    back: for every state group whose m comes as a ``Grouped``'s rows
    (read where they are), and for groups of matrices and vectors when m
    comes leaf by leaf (``bucket_steps.blendable``).

  Raises:
    PlanError: ``plan`` is not a ``jaxfuse.Plan``.
    SyncError: ``momentum`` or ``residual_decay`` out of range,
      ``nesterov`` or ``mask_momentum`` not a bool, or ``nesterov`` without
      momentum; at ``update``, a state, blend or gradient that does not fit
      the plan (each message names the leaf or field and the fix).
  """
  plans.require_plan(plan, "sparse_sync")
  check_rate("sparse_sync", "momentum", momentum, "[0, 1)")
  check_rate("sparse_sync", "residual_decay", residual_decay, "(0, 1]")
  momentum, residual_decay = float(momentum), float(residual_decay)
  if not isinstance(nesterov, bool) or not isinstance(mask_momentum, bool):
    raise SyncError(f"sparse_sync: nesterov={nesterov!r} and mask_momentum="
                    f"{mask_momentum!r} must be True or False.")
  if nesterov and momentum == 0:
    raise SyncError("sparse_sync: nesterov=True needs momentum > 0.")
  axis_name, _ = axis_names(axis_name)
  sched = bucket_steps.compile_plan(plan)
  digest = bucket_steps.layout_digest(plan, sched)
  lay = grouped.layout(sched)   # of a Grouped blend's m
  groups, group_dtypes = sched.groups, sched.group_dtypes
  all_units = sched.units
  settings = plan.settings
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
        stats=empty_stats(sched.num_leaves),
        velocity=zeros() if momentum else (),
        layout=digest)

  def update_fn(updates, state, params=None, *, blend=None, **extra_args):
    del params, extra_args
    num_workers = _compat.axis_size(axis_name)
    if num_workers is None:
      raise SyncError(
          f"sparse_sync.update needs the mesh axis {axis_name!r}: call it "
          f"inside jax.shard_map(..., mesh=mesh) over a mesh with axis "
          f"{axis_name!r} (see README, quickstart), or inside "
          "jaxfuse.vmap_workers for workers on one device, or pass "
          "sparse_sync(plan, axis_name=...) with your axis name.")
    flat = _check_grads(plan, updates, axis_name)
    parts, m_rows = None, {}
    if blend is not None:
      parts, m_rows = _check_blend(plan, lay, updates, flat, blend)
      flat = kernels.formed(parts)   # what a dense bucket reads
    _check_state(state, groups, all_units, momentum, digest)
    for b in sched.buckets:
      b.scheme.check(f"bucket {b.index}", num_workers, settings)
      b.scheme.check_axes(f"bucket {b.index}", axis_name, settings)
    sizes = (tuple(_compat.axis_size(a) for a in axis_name)
             if isinstance(axis_name, tuple) else None)
    wire_bytes = sum(w.sent for w in collectives.bucket_wire(
        sched, num_workers, sizes))
    rule = bucket_sync.Rule(momentum, nesterov, mask_momentum, residual_decay)
    step = state.step[0]
    ctrl = jax.tree.map(lambda x: x[0], state.control)

    synced = [None] * sched.num_leaves
    residuals = [r[0] for r in state.residuals]
    velocity = [v[0] for v in state.velocity]
    ctrl_chunks = []   # (unit ids, Control of (G,) arrays)
    stat_chunks = []   # (leaf ids, {stat: (G,) array})
    inputs = bucket_sync.Inputs(flat, parts, m_rows)
    carry = bucket_sync.Carry(residuals, velocity, ctrl, step)

    for b in sched.buckets:   # the plan's (backward-ready) order
      out = bucket_sync.sync_bucket(b, inputs, carry, axis_name, rule)
      for j, x in out.leaves.items():
        synced[j] = x
      for g, r in out.residuals.items():
        residuals[g] = r
      for g, v in out.velocity.items():
        velocity[g] = v
      ctrl_chunks.extend(out.control)
      stat_chunks.extend(out.stats)

    stats = finish_stats(in_order(stat_chunks), wire_bytes)
    control = (jax.tree.map(lambda x: x[None], in_order(ctrl_chunks))
               if ctrl_chunks else state.control)
    new_state = SparseSyncState(state.step + 1,
                                tuple(r[None] for r in residuals), control,
                                stats, tuple(v[None] for v in velocity),
                                digest)
    return jax.tree.unflatten(jax.tree.structure(updates), synced), new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def check_rate(where: str, name: str, x, interval: str,
               traced_ok: bool = False) -> None:
  """A decay rate ``x`` in ``interval``, "[0, 1)" or "(0, 1]", or a
  SyncError naming ``where`` and ``name``. An array or traced value
  (``optax.inject_hyperparams``) is left unchecked when ``traced_ok``, and
  refused otherwise (it would have to shape the program)."""
  if interval not in ("[0, 1)", "(0, 1]"):
    raise ValueError(f"interval={interval!r}: '[0, 1)' or '(0, 1]'.")
  if _compat.is_tracer(x) or isinstance(x, (np.ndarray, jax.Array)):
    if traced_ok:
      return
    if _compat.is_tracer(x):
      raise SyncError(
          f"{where}: {name} is a traced value; it must be a Python number "
          "known when the step is traced (it shapes the state or the "
          "program). With optax.inject_hyperparams, name it in static_args.")
  ok = plans.is_real(x) and (0 <= x < 1 if interval == "[0, 1)"
                                else 0 < x <= 1)
  if not ok:
    raise SyncError(f"{where}: {name}={x!r} must be in {interval}.")


def _check_grads(plan, updates, axis_name) -> list[jax.Array]:
  """Flat gradients in pytree order, with errors that name the leaf."""
  flat = jax.tree_util.tree_flatten_with_path(updates)[0]
  paths = [jax.tree_util.keystr(p) for p, _ in flat]
  if paths != [l.path for l in plan.leaves]:
    planned = {l.path for l in plan.leaves}
    raise plans.PlanError(
        "gradients and plan have different leaves: in the gradients only "
        f"{[p for p in paths if p not in planned][:5]}, in the plan only "
        f"{[l.path for l in plan.leaves if l.path not in set(paths)][:5]}. "
        "Make the plan from the parameters you differentiate.")
  _, names = axis_names(axis_name)
  vma_on = set(names) <= _compat.varying_axes(lax.axis_index(axis_name))
  out = []
  for (_, g), leaf in zip(flat, plan.leaves):
    float0_ok = (g.dtype == jax.dtypes.float0 and
                 not _compat.is_float_dtype(leaf.dtype))
    if tuple(g.shape) != leaf.shape or (str(g.dtype) != leaf.dtype and
                                        not float0_ok):
      raise plans.PlanError(
          f"gradient {leaf.path}: got {g.dtype}{list(g.shape)}, plan says "
          f"{leaf.dtype}{list(leaf.shape)}. Make a new plan for this model.")
    if (vma_on and _compat.is_float_dtype(g.dtype) and
        not set(names) <= _compat.varying_axes(g)):
      raise SyncError(
          f"gradient {leaf.path} is already the same on every worker, so "
          "there is nothing left to sync. Either JAX summed it over "
          f"{axis_name!r} when differentiating replicated parameters "
          "(differentiate with respect to "
          f"jaxfuse.local_params(params, {axis_name!r}) to get each "
          "worker's own gradient), or the step averaged it itself "
          "(jax.lax.pmean/psum of the gradients): pass each worker's own "
          "gradient to opt.update, which averages it; or an earlier "
          "sparse_sync or recipe in the same chain synced it (one per "
          "optimizer).")
    out.append(g)
  return out


def _check_blend(plan, lay, updates, flat, blend
                 ) -> tuple[kernels.Blend, dict]:
  """``blend`` = (m, β) checked: the leaves' stream as a ``kernels.Blend``
  of m's flat leaves and the gradients', and {state group: its (G, n) rows
  of m} for a ``Grouped`` m."""
  where = "sparse_sync.update(..., blend=(m, beta))"
  if not (isinstance(blend, tuple) and len(blend) == 2):
    raise SyncError(f"{where}: blend must be a pair (m, beta), got "
                    f"{type(blend).__name__}.")
  m, beta = blend
  try:
    beta = float(beta)   # a Python or NumPy number; it is compiled in
  except (TypeError, jax.errors.ConcretizationTypeError):
    raise SyncError(f"{where}: beta must be a number known when tracing "
                    f"(it is compiled into the kernels), got {beta!r}."
                    ) from None
  if not 0 <= beta < 1 or isinstance(blend[1], bool):
    raise SyncError(f"{where}: beta={blend[1]!r} must be in [0, 1).")
  m_rows = {}
  if isinstance(m, grouped.Grouped):
    try:
      grouped.check(lay, m)
    except plans.PlanError as e:
      raise SyncError(f"{where}: m is a Grouped tree of another plan: {e}"
                      ) from None
    m_rows = dict(zip(lay.group_ids, m.rows))
    m = grouped.ungroup(lay, m, jax.tree.structure(updates))
  m_flat = jax.tree_util.tree_flatten_with_path(m)[0]
  m_paths = [jax.tree_util.keystr(p) for p, _ in m_flat]
  if (jax.tree.structure(m) != jax.tree.structure(updates)
      or m_paths != [l.path for l in plan.leaves]):
    first = next((f"{a} against {b}" for a, b in zip(
        m_paths, [l.path for l in plan.leaves]) if a != b),
                 f"{len(m_paths)} leaves against {len(plan.leaves)}")
    raise SyncError(f"{where}: m must be a tree like the updates; they "
                    f"differ at {first}.")
  for (_, x), g, leaf in zip(m_flat, flat, plan.leaves):
    dtype, shape = getattr(x, "dtype", None), tuple(getattr(x, "shape", ()))
    if shape != leaf.shape or dtype != jnp.float32:
      raise SyncError(
          f"{where}: m{leaf.path} is {dtype}{list(shape)}; it must be "
          f"float32{list(leaf.shape)}, like its gradient.")
    if g.dtype != jnp.float32:
      raise SyncError(
          f"{where}: the gradient {leaf.path} is {g.dtype}; blend takes "
          "float32 gradients. Form the stream yourself, beta * m + "
          "(1 - beta) * updates, and pass it as the updates.")
  return kernels.Blend([x for _, x in m_flat], list(flat), beta), m_rows


def _check_state(state, groups, all_units, momentum, digest) -> None:
  if not isinstance(state, SparseSyncState):
    raise SyncError(f"expected a SparseSyncState, got {type(state).__name__}; "
                    "create the state with jaxfuse.init_state(...).")
  part = state.layout and bucket_steps.digest_difference(state.layout, digest)
  if part:
    raise SyncError(
        f"sparse_sync state was made for a plan of another layout (its "
        f"{part} differ from this plan's)"
        f"{'' if part == 'settings' else ': its rows hold other leaves here'}"
        ". Carry it to this plan with jaxfuse.relayout(state, its_plan, "
        "plan) and step it with this plan's transform, or make a new one "
        "with jaxfuse.init_state; a warm-up phase changes only densities "
        "(jaxfuse.with_density).")
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


def unit_residuals(plan: plans.Plan, state: SparseSyncState,
                   velocity: bool = False) -> list[jax.Array]:
  """The residual (or velocity) of each selection unit, in
  ``plans.units`` order: views of the state's per-group arrays, each with
  the state's leading worker axis (K outside ``shard_map``).

  Args:
    plan: the plan the state was made for.
    state: a ``SparseSyncState`` (``sparse_sync``'s).
    velocity: return the momentum velocity instead of the residual.

  Returns:
    One array per selection unit, shape (workers, unit elements).

  Raises:
    PlanError: ``plan`` is not a ``jaxfuse.Plan``.
    SyncError: the state was made for a plan of other groups or layout.
  """
  plans.require_plan(plan, "unit_residuals")
  arrays = state.velocity if velocity else state.residuals
  all_units, per_bucket = plans.units(plan)
  want = [(len(g), all_units[g[0]].size)
          for g in plans.group_units(all_units, per_bucket)]
  have = [tuple(a.shape[-2:]) for a in arrays]
  if want != have:
    raise SyncError(f"unit_residuals: the state's groups are {have} (units "
                    f"× elements), the plan's {want}: pass the plan the "
                    "state was made for.")
  part = layout_mismatch(state, plan)
  if part:
    raise SyncError(f"unit_residuals: the state was made for a plan of "
                    f"another layout (its {part} differ): pass the plan the "
                    "state was made for.")
  return [arrays[g][:, i] for g, i in plans.unit_rows(plan)]


# --- helpers for users --------------------------------------------------------

def axis_names(axis_name):
  """``axis_name`` (a list taken as the tuple) and its names, a tuple."""
  if isinstance(axis_name, list):
    axis_name = tuple(axis_name)
  return axis_name, (axis_name if isinstance(axis_name, tuple)
                     else (axis_name,))


def local_params(params, axis_name: str | tuple = "data"):
  """Mark replicated params as per-worker so ``jax.grad`` gives local grads.

  Inside ``shard_map`` the gradient of a replicated input is summed over the
  axis by JAX itself; differentiating this view instead keeps each worker's
  own gradient for ``sparse_sync`` to sparsify. No data moves. Over a
  named ``jax.vmap`` axis (``jaxfuse.vmap_workers``) the gradient is each
  worker's own already: there it returns ``params`` unchanged.

  Args:
    params: the replicated parameters (any pytree), inside ``shard_map``.
    axis_name: the workers' mesh axis, or a tuple of axes (all of them).

  Returns:
    ``params``, varying over ``axis_name`` (the same values).

  Raises:
    SyncError: a name that is not an axis of the enclosing ``shard_map``
      (or a call outside one).
  """
  axis_name, names = axis_names(axis_name)
  for name in names:
    if not isinstance(name, str) or _compat.axis_size(name) is None:
      raise SyncError(
          f"local_params: {name!r} is not an axis of the enclosing "
          "jax.shard_map (or jaxfuse.vmap_workers); call it inside the "
          "per-worker step, with the "
          "mesh's axis name (jaxfuse.make_mesh() names it 'data').")
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

  Args:
    inner: the optax transform to run per worker.
    float32_state: low-precision (bfloat16, float16) leaves go through
      ``inner`` in float32, so its state is float32 (as ``sparse_sync``'s
      residual is); its outputs come back in the updates' dtype.

  Returns:
    An optax ``GradientTransformationExtraArgs`` whose state is a
    ``PerWorkerState`` (a leading worker axis on every leaf).

  Raises:
    SyncError: at ``update``, a state that is not its ``PerWorkerState``.
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


def is_sync_state(x) -> bool:
  return isinstance(x, SparseSyncState)


def is_worker_state(x) -> bool:
  return isinstance(x, (SparseSyncState, PerWorkerState))


def holds(tree, kind) -> bool:
  """Whether ``tree`` holds a node for which ``kind(node)`` is true (e.g.
  ``is_sync_state``), searched as ``jax.tree.leaves(tree, is_leaf=kind)``."""
  return any(kind(y) for y in jax.tree.leaves(tree, is_leaf=kind))


def per_worker_mask(tree):
  """Which leaves of an optimizer state are per worker.

  Args:
    tree: any pytree holding optimizer states.

  Returns:
    The same structure as ``tree``, True at the leaves of
    ``sparse_sync``'s and ``per_worker``'s states (a leading worker axis),
    False elsewhere.

  Raises:
    Nothing.
  """
  def mark(x):
    if is_worker_state(x):
      return jax.tree.map(lambda _: True, x)
    return False
  return jax.tree.map(mark, tree, is_leaf=is_worker_state)


def layout_mismatch(tree, plan: plans.Plan) -> str | None:
  """The first layout part (``bucket_steps.LAYOUT_PARTS``) in which a
  ``SparseSyncState`` in ``tree`` differs from ``plan``'s layout; None
  when every one has it (or carries none)."""
  digest = bucket_steps.layout_digest(plan)
  for x in jax.tree.leaves(tree, is_leaf=is_sync_state):
    part = (is_sync_state(x) and x.layout
            and bucket_steps.digest_difference(x.layout, digest))
    if part:
      return part
  return None


def sync_stats(opt_state) -> SyncStats:
  """The ``SyncStats`` inside an optimizer state (first ``sparse_sync``).

  Args:
    opt_state: an optimizer state holding a ``sparse_sync`` state.

  Returns:
    That state's ``SyncStats`` (the last step's).

  Raises:
    SyncError: ``opt_state`` holds no ``sparse_sync`` state.
  """
  for x in jax.tree.leaves(opt_state, is_leaf=is_sync_state):
    if is_sync_state(x):
      return x.stats
  raise SyncError("no sparse_sync state in this optimizer state.")
