"""The optimizer state on the mesh: ``init_state`` and ``state_specs``.

Per-worker state (``sparse_sync``'s residuals, thresholds and stats, and
what ``per_worker`` wraps) has a leading axis of size 1 inside
``shard_map``; globally that axis has size K, sharded over the worker
axes: ``P(axis_name)``. Everything else is replicated, ``P()``.
``state_specs`` first refuses states that no such spec can hold, each
with the fix: an optax wrapper that decides on one worker's gradient, a
stateful transform before the sync outside ``per_worker``, injected
hyperparameters narrower than float32, an axis the state's mesh lacks,
and a state of one worker's shapes (``optimizer.init`` instead of
``init_state``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from jaxfuse import _compat
from jaxfuse import plans
from jaxfuse.state import simulated
from jaxfuse.transform import SyncError
from jaxfuse.transform import axis_names
from jaxfuse.transform import holds
from jaxfuse.transform import is_sync_state
from jaxfuse.transform import is_worker_state


# optax wrappers that branch on, or keep, the gradient they are given: around
# a jaxfuse optimizer that is each worker's own, so the workers would part.
_LOCAL_WRAPPERS = {
    optax.ApplyIfFiniteState: (
        "optax.apply_if_finite decides on each worker's own gradient, so one "
        "worker would skip the collectives the others run. Use "
        "jaxfuse.apply_if_finite(optimizer, max_consecutive_errors): it "
        "decides on the synced update, the same on every worker."),
    optax.MultiStepsState: (
        "optax.MultiSteps runs the optimizer, and so its collectives, on "
        "every micro-step, and keeps each worker's own accumulated gradient "
        "as state no PartitionSpec can hold. Accumulate the micro-batches' "
        "gradients inside the step instead, before opt.update (a lax.scan "
        "over micro-batches: docs/choosing.md, \"Gradient accumulation\")."),
}


def on_worker_axis(sharding):
  """``sharding`` kept on the leading (worker) axis only, replicated over
  the rest: for an array cut from a per-worker state array (a group's
  row, a leaf's slice of it) or stacked into one."""
  if isinstance(sharding, jax.sharding.NamedSharding):
    return jax.sharding.NamedSharding(sharding.mesh, P(*sharding.spec[:1]))
  return sharding


def _refuse_one_workers_state(opt_state, axis_name) -> None:
  """``SyncError`` for per-worker leaves holding one worker's shape where
  there are several devices: leading axis 1, and either on a mesh whose
  worker axes have more than one device but not sharded over them, or no
  mesh's at all (numpy, one device's array). That is a state from
  ``optimizer.init(params)`` (or flax's ``TrainState.create``) instead of
  ``init_state``. Abstract states pass."""
  if jax.device_count() == 1:
    return
  _, names = axis_names(axis_name)

  def one_workers(x) -> bool:
    if not (isinstance(x, (jax.Array, np.ndarray)) and
            not _compat.is_tracer(x) and x.ndim and x.shape[0] == 1):
      return False
    sharding = getattr(x, "sharding", None)
    if not isinstance(sharding, jax.sharding.NamedSharding):
      return True
    workers = 1
    for n in names:
      workers *= dict(sharding.mesh.shape).get(n, 1)
    spec = sharding.spec
    first = (spec[0] if len(spec) and isinstance(spec[0], tuple)
             else tuple(spec[:1]))
    return workers > 1 and not set(names) & set(first)

  for state in jax.tree.leaves(opt_state, is_leaf=is_worker_state):
    if not is_worker_state(state):
      continue
    for x in jax.tree.leaves(state):
      if one_workers(x):
        raise SyncError(
            f"the {type(state).__name__} in this state holds one worker's "
            f"shape {x.shape} (leading axis 1) on {jax.device_count()} "
            "devices: it was made by optimizer.init(params) (or flax's "
            "TrainState.create). Make it with jaxfuse.init_state(optimizer, "
            "params, mesh), which gives each worker its own part "
            "(with a TrainState: state.replace(opt_state=jaxfuse.init_state("
            "...))).")


def check_worker_state(updates, opt_state, axis_name, where: str) -> None:
  """``SyncError`` when, inside the step's ``shard_map``, the per-worker
  parts of ``opt_state`` did not come in as per-worker: the gradient
  varies over the worker axes but the state does not (it entered with
  ``P()``: ``optimizer.init`` in place of ``init_state``, or ``P()`` in
  place of ``state_specs``; JAX would stop at ``out_specs`` with "could
  not infer replication"), or a part's leading axis is not 1 (the whole
  K-worker array entered each worker: ``P()`` in place of
  ``state_specs``). Outside ``shard_map``, or under ``check_vma=False``
  (nothing is marked varying), nothing is checked."""
  axis_name, names = axis_names(axis_name)
  if _compat.axis_size(axis_name) is None:
    return
  grads = [g for g in jax.tree.leaves(updates) if _compat.is_tracer(g)]
  grads_vary = any(set(names) <= _compat.varying_axes(g) for g in grads)
  fix = (f"Make the state with jaxfuse.init_state(optimizer, params, mesh) "
         f"and give the step's shard_map in_specs and out_specs "
         f"jaxfuse.state_specs(state) for it (P({axis_name!r}) for the "
         "per-worker parts, P() elsewhere).")
  for state in jax.tree.leaves(opt_state, is_leaf=is_worker_state):
    if not is_worker_state(state):
      continue
    for x in jax.tree.leaves(state):
      if not _compat.is_tracer(x):
        continue
      if (not x.ndim or x.shape[0] != 1) and _compat.vmap_axis(axis_name):
        raise SyncError(
            f"{where}: the {type(state).__name__} in the optimizer state has "
            f"shape {tuple(x.shape)} on each simulated worker, not a leading "
            "axis of 1: jax.vmap's in_axes=0 took the worker axis off it. "
            "Map the step with jaxfuse.vmap_workers(local, "
            "jaxfuse.simulated_mesh(K), in_specs, out_specs) and "
            "jaxfuse.state_specs(state), which keeps it (each worker's "
            "(K, ...) leaf row as (1, ...)).")
      if not x.ndim or x.shape[0] != 1:
        raise SyncError(
            f"{where}: the {type(state).__name__} in the optimizer state has "
            f"shape {tuple(x.shape)} on each worker, not a leading axis of "
            "1: its whole K-worker array came into every worker, so the "
            "step's shard_map gave it P() where jaxfuse.state_specs(state) "
            f"gives P({axis_name!r}). {fix}")
      if grads_vary and not set(names) <= _compat.varying_axes(x):
        raise SyncError(
            f"{where}: the {type(state).__name__} in the optimizer state "
            f"came into the step replicated (P()), but it is each worker's "
            "own (residuals, velocity, stats): it was made by "
            "optimizer.init(params) instead of jaxfuse.init_state, or "
            "given P() instead of jaxfuse.state_specs(state) in the step's "
            f"in_specs. {fix}")


def _children(x) -> list:
  """The immediate children of a pytree node (none for a leaf)."""
  if jax.tree_util.treedef_is_leaf(jax.tree.structure(x)):
    return []
  return jax.tree_util.tree_flatten(x, is_leaf=lambda y: y is not x)[0]


def _local_floats(x) -> bool:
  """Per-parameter float arrays (ndim ≥ 1) outside any worker state."""
  return any(not is_worker_state(y) and np.ndim(y) >= 1 and
             _compat.is_float_dtype(getattr(y, "dtype", None))
             for y in jax.tree.leaves(x, is_leaf=is_worker_state)
             if hasattr(y, "dtype"))


def _state_name(x) -> str:
  """The type of the first optax state (a NamedTuple) in ``x`` that holds
  per-parameter floats: a nested chain names its transform's state."""
  if hasattr(x, "_fields") and _local_floats(x):
    return type(x).__name__
  for child in _children(x):
    if _local_floats(child):
      return _state_name(child)
  return type(x).__name__


def _refuse_local_state_before_sync(opt_state) -> None:
  """``SyncError`` for a transform chained before ``sparse_sync`` that
  keeps per-parameter float state outside ``per_worker``: it sees each
  worker's own gradient, so its state differs per worker, and
  ``shard_map`` would stop at ``out_specs=P()`` with JAX's advice to turn
  the check off. Chains are plain tuples of states (``optax.named_chain``'s
  dict is not read: a dict is also a parameter tree)."""
  def visit(x) -> None:
    if is_worker_state(x):
      return
    if type(x) is tuple:  # pylint: disable=unidiomatic-typecheck
      first = next((i for i, y in enumerate(x) if holds(y, is_sync_state)),
                   0)
      for y in x[:first]:
        if _local_floats(y):
          raise SyncError(
              f"a transform chained before jaxfuse.sparse_sync keeps "
              f"per-parameter state ({_state_name(y)}): it sees each "
              "worker's own gradient, so its state differs per worker. "
              "Wrap it, optax.chain(jaxfuse.per_worker(<transform>), "
              "jaxfuse.sparse_sync(plan), ...), or move it after the sync.")
    for child in _children(x):
      visit(child)

  visit(opt_state)


def _refuse_axes_off_the_mesh(opt_state, axis_name) -> None:
  """``SyncError`` when the state's arrays live on a mesh without the
  worker axes ``axis_name`` names (``state_specs(state, "batch")`` for a
  state made on a ``"data"`` mesh)."""
  _, names = axis_names(axis_name)
  for x in jax.tree.leaves(opt_state):
    if _compat.is_tracer(x):
      return
    sharding = getattr(x, "sharding", None)
    if isinstance(sharding, jax.sharding.NamedSharding):
      if not set(names) <= set(sharding.mesh.axis_names):
        raise SyncError(
            f"state_specs: axis_name={axis_name!r}, but this state lives on "
            f"a mesh with axes {tuple(sharding.mesh.axis_names)}; pass the "
            "axis name the state was made with (jaxfuse.init_state(..., "
            "axis_name=...)).")
      return


def _refuse_local_wrappers(opt_state) -> None:
  """``SyncError`` for an optax wrapper of ``_LOCAL_WRAPPERS`` around a
  state with per-worker parts (it may follow ``sparse_sync`` in a chain)."""
  wrappers = tuple(_LOCAL_WRAPPERS)
  for x in jax.tree.leaves(opt_state,
                           is_leaf=lambda x: isinstance(x, wrappers)):
    if isinstance(x, wrappers) and holds(x, is_worker_state):
      raise SyncError(f"{type(x).__name__} holds a jaxfuse state: "
                      f"{_LOCAL_WRAPPERS[type(x)]}")


_FREEZING = ("Leave frozen parameters out of what you differentiate, or "
             "give every part of optax.multi_transform a jaxfuse optimizer "
             "with its part's plan (docs/choosing.md, \"Freezing "
             "parameters, and optax.multi_transform\").")


def _refuse_partial_wrappers(opt_state) -> None:
  """``SyncError`` for a jaxfuse optimizer under ``optax.masked`` (the
  masked-out leaves' updates are their gradients, each worker's own under
  ``local_params``) or in an ``optax.multi_transform`` next to parts
  without one (``set_to_zero`` gives per-worker zeros; an optax optimizer
  steps on one worker's gradient)."""
  wrappers = (optax.MultiTransformState, optax.MaskedState)
  for x in jax.tree.leaves(opt_state,
                           is_leaf=lambda x: isinstance(x, wrappers)):
    if isinstance(x, optax.MultiTransformState):
      bare = sorted(str(label) for label, part in x.inner_states.items()
                    if not holds(part, is_worker_state))
      if bare and len(bare) < len(x.inner_states):
        raise SyncError(
            f"optax.multi_transform has parts {bare} without a jaxfuse "
            "optimizer next to parts with one: under jaxfuse.local_params "
            "their gradients are each worker's own, so optax.set_to_zero "
            "gives each worker its own zeros and an optax optimizer would "
            f"step on one worker's gradient. {_FREEZING}")
    elif isinstance(x, optax.MaskedState) and holds(x, is_worker_state):
      raise SyncError(
          "optax.masked holds a jaxfuse optimizer: it passes the masked-out "
          "leaves' gradients through as their updates, each worker's own "
          f"under jaxfuse.local_params. {_FREEZING}")


# optax.inject_hyperparams's states (the stateful one from optax 0.2.3 on)
_INJECTED = tuple(k for k in (
    getattr(optax, "InjectHyperparamsState", None),
    getattr(optax, "InjectStatefulHyperparamsState", None)) if k is not None)


def _refuse_narrow_hyperparams(opt_state) -> None:
  """``SyncError`` for ``optax.inject_hyperparams`` keeping a jaxfuse
  optimizer's hyperparameters in a float narrower than float32. optax
  stores them in the parameters' dtype unless told otherwise; in bfloat16
  b2 = 0.999 is 1.0, so Adam's bias correction 1 − b2ᵗ is 0 and every
  update NaN, and ε = 1e-8 is 0 in float16."""
  for x in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(
      x, _INJECTED)):
    if not (isinstance(x, _INJECTED) and holds(x, is_worker_state)):
      continue
    narrow = {name: str(v.dtype) for name, v in x.hyperparams.items()
              if hasattr(v, "dtype") and _compat.is_float_dtype(v.dtype)
              and jnp.dtype(v.dtype).itemsize < 4}
    if narrow:
      raise SyncError(
          f"optax.inject_hyperparams keeps {sorted(narrow)} in "
          f"{sorted(set(narrow.values()))} (the parameters' dtype, optax's "
          "default), too narrow for an optimizer's constants: in bfloat16 "
          "b2=0.999 is 1.0 and Adam's bias correction divides by zero. "
          "Pass hyperparam_dtype=jnp.float32: optax.inject_hyperparams("
          "jaxfuse.<recipe>, static_args=..., hyperparam_dtype=jnp.float32)"
          ".")


def state_specs(opt_state, axis_name: str | tuple = "data"):
  """``PartitionSpec`` tree for an optimizer state holding ``sparse_sync``.

  The leaves of ``sparse_sync``'s and ``per_worker``'s states get
  ``P(axis_name)`` (a tuple of axes: the leading axis over all of them,
  host-major); everything else (Adam moments after the sync, counts,
  …) is replicated, ``P()``. Works on real or abstract (``jax.eval_shape``)
  states. Refuses the optax wrappers that cannot wrap a sync
  (``optax.apply_if_finite``, ``optax.MultiSteps``), naming what to use.

  Args:
    opt_state: the optimizer state (from ``init_state``, or abstract).
    axis_name: the workers' mesh axis, or a tuple of axes.

  Returns:
    A pytree of ``PartitionSpec`` with ``opt_state``'s structure, for the
    step's ``shard_map`` ``in_specs`` and ``out_specs``.

  Raises:
    SyncError: the state cannot be held by such specs (an optax wrapper
      that decides per worker, a stateful transform before the sync
      outside ``per_worker``, injected hyperparameters narrower than
      float32, an axis the state's mesh lacks, one worker's shapes from
      ``optimizer.init``), naming the fix.
  """
  _refuse_local_wrappers(opt_state)
  _refuse_partial_wrappers(opt_state)
  _refuse_local_state_before_sync(opt_state)
  _refuse_narrow_hyperparams(opt_state)
  _refuse_axes_off_the_mesh(opt_state, axis_name)
  _refuse_one_workers_state(opt_state, axis_name)

  def spec(x):
    if is_worker_state(x):
      return jax.tree.map(lambda _: P(axis_name), x)
    return P()
  return jax.tree.map(spec, opt_state, is_leaf=is_worker_state)


def require_transform(optimizer, where: str) -> None:
  """``TypeError`` unless ``optimizer`` is an optax transform (has callable
  ``init`` and ``update``; a ``Plan`` is not one)."""
  if isinstance(optimizer, plans.Plan) or not (
      callable(getattr(optimizer, "init", None)) and
      callable(getattr(optimizer, "update", None))):
    raise TypeError(f"{where} expects an optax transform (e.g. "
                    f"jaxfuse.onebit_adamw(plan, lr)), got "
                    f"{type(optimizer).__name__}.")


def init_state(optimizer: optax.GradientTransformation, params,
               mesh: jax.sharding.Mesh, axis_name: str | tuple = "data"):
  """``optimizer.init(params)`` with per-worker leaves sharded over the axis
  (or the tuple of axes).

  Args:
    optimizer: an optax transform holding ``sparse_sync`` (a recipe).
    params: the parameters (replicated arrays, or shapes).
    mesh: the mesh the step runs on (``jaxfuse.make_mesh()``), or
      ``jaxfuse.simulated_mesh(workers=K)`` for K workers on one device.
    axis_name: the workers' mesh axis, or a tuple of axes.

  Returns:
    The optimizer state, per-worker leaves sharded ``P(axis_name)`` over
    the mesh (leading axis K), the rest replicated; on a simulated mesh
    the same global shapes on its one device.

  Raises:
    TypeError: ``optimizer`` is not an optax transform, or ``mesh`` not a
      ``jax.sharding.Mesh``.
    SyncError: the mesh lacks the axis, or ``state_specs`` refuses the
      state (naming the fix).
  """
  require_transform(optimizer, "init_state")
  if not isinstance(mesh, (jax.sharding.Mesh, simulated.SimulatedMesh)):
    raise TypeError(f"init_state expects the jax.sharding.Mesh the step "
                    f"runs on, got {type(mesh).__name__}; make one with "
                    "jaxfuse.make_mesh() (or jaxfuse.simulated_mesh() for "
                    "workers on one device).")
  axis_name, names = axis_names(axis_name)
  if not set(names) <= set(mesh.axis_names):
    raise SyncError(f"mesh has axes {mesh.axis_names}, not {axis_name!r}; "
                    "make the mesh with jaxfuse.make_mesh() or pass axis_name.")
  specs = state_specs(jax.eval_shape(optimizer.init, params), axis_name)
  if simulated.is_simulated(mesh):
    init = simulated.vmap_workers(optimizer.init, mesh, (P(),), specs)
    with jax.default_device(mesh.device):
      return jax.jit(init)(params)
  init = jax.shard_map(optimizer.init, mesh=mesh, in_specs=(P(),),
                       out_specs=specs)
  return jax.jit(init)(params)
