"""A data-parallel train step built in one call: ``make_train_step``.

  state, step = jaxfuse.make_train_step(loss_fn, params, opt, phases, mesh)
  for batch in batches:
    state, loss = step(state, batch)

It puts together the low-level parts as a hand-written loop does, with
bitwise the same results (tests/test_readme.py): ``init_state`` and
``state_specs`` for the optimizer state, ``local_params`` so that worker k
differentiates its own loss L_k on its rows of the batch, ``jax.shard_map``
over the mesh axis, ``send_early`` where it pays, ``xla_options``, donation
of the state, and one compiled step per phase of a warm-up (compiled when
the first step of that phase runs, then cached). Each step computes

  g_k = ∇L_k(params),   (updates, opt_state) = opt.update(g_k, ...)

where ``opt`` (``optimizer(phase.plan)``) syncs the g_k through its plan's
buckets, and returns the workers' mean loss (1/K)·Σ_k L_k.

Resume: ``step.save(manager, state)`` writes the state with its step,
which is also the data position (one batch per step); ``step.restore(
manager, state)`` reads the latest back and the next call trains the
phase of ``state.step``.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Callable, NamedTuple, Sequence
import warnings

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np

from jaxfuse.state import checkpoint
from jaxfuse.optim import compile_options
from jaxfuse.optim import overlap
from jaxfuse.state import placement
from jaxfuse.state import simulated
from jaxfuse import plans
from jaxfuse import transform
from jaxfuse.optim.phases import Phase
from jaxfuse.optim.phases import check_phases
from jaxfuse.optim.phases import phase_index
from jaxfuse.optim.phases import wire_warnings
from jaxfuse.optim import local_step
from jaxfuse.optim import local_steps
from jaxfuse.optim import step_args
from jaxfuse.optim import step_watch
from jaxfuse.sync import agreement


@dataclasses.dataclass(frozen=True, eq=False)
class StepOptions:
  """How ``make_train_step`` builds the step (all optional).

  Attributes:
    has_aux: ``loss_fn`` returns ``(loss, aux)``; the step returns
      ``(state, (loss, aux))`` with aux's float leaves averaged over the
      workers and its integer leaves summed (e.g. a count of correct
      predictions over the whole batch).
    model_state: the model's initial non-parameter state (flax NNX
      ``BatchNorm`` statistics, linen ``batch_stats``, ...), or None. Given,
      ``loss_fn(params, model_state, batch)`` returns ``(loss,
      new_model_state)`` (with ``has_aux``: ``(loss, (new_model_state,
      aux))``); each float leaf that differs between the workers is
      replaced by the workers' mean, (1/K)·Σ_k s_k, so every replica keeps
      the same state. An integer leaf must come out the same on every
      worker (a step counter, an RNG count).
    send_early: run the step under ``jaxfuse.send_early``. None: on where
      it pays, several GPUs with ``jaxfuse.xla_flags`` in ``XLA_FLAGS``;
      off on CPU. True: on, with ``send_early``'s default window; an int
      w >= 0: on, with window w (0: unbounded). The results are bitwise
      the same either way. On a ``simulated_mesh`` a no-op (no network).
    donate: give the state's buffers to the step (updated in place, not
      copied); the state passed in is then consumed.
    check_replicas: after each step, check on the host that the params
      (and float model state) are bitwise identical on every device. On a
      ``simulated_mesh`` they are one array: ``jax.vmap`` refuses, when
      the step is traced, a replicated output that depends on the worker.
    axis_name: the mesh axis the workers lie along.
    grad_at: where each worker takes its gradient: ``grad_at(params,
      opt_state) -> params'``, a tree of the params' structure, and the
      step computes g_k = ∇L_k(params') (then steps ``params`` as
      always). E.g. a bfloat16 copy, ``lambda p, s: jax.tree.map(lambda x:
      x.astype(jnp.bfloat16), p)`` (the gradients and what the sync sends
      are then bfloat16), or ``jaxfuse.predicted_params`` under
      ``jaxfuse.delayed(..., predict=True)``. The plan is the plan of
      what ``grad_at`` returns (its dtypes are checked against it), and
      the optimizer state is initialized at the params cast to them (the
      gradients' dtypes). None: at ``params``; for a
      ``jaxfuse.local_steps`` optimizer, each worker's own params
      (``jaxfuse.inner_params``, set by ``make_train_step``).
    compiler_options: the XLA options the steps compile with. None:
      ``jaxfuse.xla_options()`` for the mesh's platform; a dict: these
      (``{}``: XLA's defaults).
  """
  has_aux: bool = False
  model_state: Any = None
  send_early: bool | int | None = None
  donate: bool = True
  check_replicas: bool = False
  axis_name: str = "data"
  grad_at: Callable | None = None
  compiler_options: dict | None = None

  def __post_init__(self):
    for name in ("has_aux", "donate", "check_replicas"):
      if not isinstance(getattr(self, name), bool):
        raise TypeError(f"StepOptions.{name}={getattr(self, name)!r} must "
                        "be True or False.")
    send = self.send_early
    if send is not None and not isinstance(send, (bool, int)) or (
        isinstance(send, int) and not isinstance(send, bool) and send < 0):
      raise TypeError(f"StepOptions.send_early={send!r} must be True, "
                      "False, None (on where it pays) or a window >= 0 "
                      "(0: unbounded).")
    if self.grad_at is not None and not callable(self.grad_at):
      raise TypeError(f"StepOptions.grad_at={self.grad_at!r} must be a "
                      "function (params, opt_state) -> params, or None.")
    if self.compiler_options is not None and not isinstance(
        self.compiler_options, dict):
      raise TypeError(f"StepOptions.compiler_options="
                      f"{self.compiler_options!r} must be a dict of XLA "
                      "options (e.g. jaxfuse.xla_options()), or None.")
    if not isinstance(self.axis_name, str):
      raise TypeError(f"StepOptions.axis_name={self.axis_name!r} must be "
                      "the mesh axis name, a string such as 'data'.")


class TrainState(NamedTuple):
  """What a training step carries: ``params`` (replicated),
  ``opt_state`` (per-worker parts sharded over the workers),
  ``model_state`` (None unless ``StepOptions.model_state``) and ``step``,
  a Python int: the steps trained so far, which is also the number of
  batches consumed (the data position to resume from)."""
  params: Any
  opt_state: Any
  model_state: Any
  step: int


def make_train_step(loss_fn: Callable, params: Any, optimizer: Any,
                    phases: Any, mesh: jax.sharding.Mesh,
                    options: StepOptions | None = None
                    ) -> tuple[TrainState, "TrainStep"]:
  """The initial train state and a step callable for data-parallel training.

  ``step(state, batch)`` splits the batch's leading axis over the K
  workers, gives each worker g_k = ∇L_k(params) on its rows, steps the
  params with the phase of ``state.step``'s optimizer (which syncs the
  g_k) and returns ``(new_state, loss)``, the loss averaged over the
  workers.
  A phase whose sparse steps would receive more bytes per worker than a
  dense step on the mesh's workers is named in a ``UserWarning``
  (``jaxfuse.optim.phases.wire_warnings``), once, when the step is made.

  Examples:
    >>> opt = functools.partial(jaxfuse.onebit_adamw, learning_rate=3e-4)
    >>> phases = jaxfuse.density_warmup(plan, dense_steps=100, steps=50)
    >>> state, step = jaxfuse.make_train_step(loss_fn, params, opt,
    ...                                       phases, mesh)
    >>> state, loss = step(state, batch)

  Args:
    loss_fn: ``loss_fn(params, batch) -> loss``, a scalar, on one worker's
      rows (``StepOptions`` says what it returns with ``has_aux`` or
      ``model_state``).
    params: the initial parameters (copied; placed replicated on ``mesh``).
    optimizer: a factory ``plan -> optax.GradientTransformation``, e.g.
      ``functools.partial(jaxfuse.onebit_adamw, learning_rate=3e-4)``; or a
      recipe of ``jaxfuse.RECIPES`` by name with its settings,
      ``("sgd", {"learning_rate": 0.1, "momentum": 0.9})`` (a name alone
      for a recipe whose settings all have defaults).
    phases: a ``jaxfuse.Plan`` (one phase for every step) or the
      ``jaxfuse.Phase``s of a warm-up (``jaxfuse.density_warmup``).
    mesh: the mesh the workers lie on (``jaxfuse.make_mesh()``), or
      ``jaxfuse.simulated_mesh(workers=K)``: K workers as a named
      ``jax.vmap`` on one device, computing what K devices compute.
    options: a ``StepOptions`` (default: ``StepOptions()``).

  Returns:
    ``(state, step)``: a ``TrainState`` at step 0 and a ``TrainStep``.

  Raises:
    TypeError: ``optimizer`` is a built transform rather than a factory,
      or one that holds no ``jaxfuse.sparse_sync``, ``grad_at`` set for a
      ``local_steps`` optimizer, or an argument has the wrong type.
    ValueError: a recipe name or setting that does not exist, or a mesh
      without ``options.axis_name``.
    PlanError: phases that do not tile the steps from 0 (``check_phases``).
  """
  options = StepOptions() if options is None else options
  if not isinstance(options, StepOptions):
    raise TypeError(f"options: expected jaxfuse.StepOptions, got "
                    f"{type(options).__name__}.")
  if not callable(loss_fn):
    raise TypeError(f"loss_fn must be a function, got "
                    f"{type(loss_fn).__name__}.")
  if not isinstance(mesh, (jax.sharding.Mesh, simulated.SimulatedMesh)):
    raise TypeError(f"mesh: expected the jax.sharding.Mesh to train on, got "
                    f"{type(mesh).__name__}; make one with "
                    "jaxfuse.make_mesh(), or jaxfuse.simulated_mesh(K) for "
                    "K workers on one device.")
  if options.axis_name not in mesh.axis_names:
    raise ValueError(f"mesh has axes {mesh.axis_names}, not "
                     f"{options.axis_name!r}: make it with jaxfuse.make_mesh() "
                     "or set StepOptions(axis_name=...).")
  phases = _as_phases(phases)
  _wire_warnings(phases, mesh, options.axis_name)
  factory = step_args.as_factory(optimizer)
  opt = step_args.build(factory, phases[-1].plan)
  params = _replicated_copy(params, mesh)
  model_state = options.model_state
  if model_state is not None:
    model_state = _replicated_copy(model_state, mesh)
  init_at = params
  if options.grad_at is not None:   # the state of the gradients' dtypes
    init_at = step_args.in_plan_dtypes(params, phases[-1].plan)
  opt_state = placement.init_state(opt, init_at, mesh, options.axis_name)
  if options.grad_at is not None:
    step_args.check_grad_at(options.grad_at, params, opt_state,
                            phases[-1].plan)
  if not transform.holds(opt_state, transform.is_sync_state):
    raise TypeError(
        "optimizer(plan) holds no jaxfuse.sparse_sync, so the workers' "
        "gradients would never be averaged and the replicas would drift "
        "apart; use a jaxfuse recipe (e.g. jaxfuse.onebit_adamw), or for a "
        "dense baseline lambda plan: jaxfuse.sync_adamw(jaxfuse.with_density("
        "plan, 1.0), lr) (exactly lax.pmean, then optax.adamw).")
  if local_steps.holds_local_steps(opt_state):
    if options.grad_at is not None:
      raise TypeError(
          "StepOptions.grad_at is set, but a jaxfuse.local_steps optimizer "
          "decides where each worker differentiates (its own params, "
          "jaxfuse.inner_params); leave grad_at None.")
    options = dataclasses.replace(options, grad_at=local_steps.inner_params)
  specs = placement.state_specs(opt_state, options.axis_name)
  step = TrainStep(loss_fn, factory, phases, mesh, options, specs)
  return TrainState(params, opt_state, model_state, 0), step


def _wire_warnings(phases: tuple[Phase, ...], mesh: jax.sharding.Mesh,
                   axis_name: str) -> None:
  """``phases.wire_warnings`` on the mesh's workers: K = the size of
  ``axis_name``, or the mesh's (hosts, devices per host) for a two-axis
  mesh (a ``"hier"`` plan's)."""
  workers = (tuple(int(n) for n in mesh.devices.shape)
             if mesh.devices.ndim == 2 else mesh.shape[axis_name])
  with warnings.catch_warnings():   # said again, at the caller's line
    warnings.simplefilter("ignore", UserWarning)
    messages = wire_warnings(phases, workers)
  for message in messages:
    warnings.warn(message, UserWarning, stacklevel=3)


def _replicated_copy(tree: Any, mesh: Any) -> Any:
  """``tree`` copied (the step donates its buffers, never the caller's)
  and placed on every device of ``mesh``."""
  tree = jax.tree.map(lambda x: jnp.array(x, copy=True), tree)
  return simulated.put(tree, mesh, P())


def _as_phases(phases: Any) -> tuple[Phase, ...]:
  """``phases`` as a checked tuple of ``Phase``s (a plan: one phase)."""
  if isinstance(phases, plans.Plan):
    return (Phase(0, None, phases),)
  if isinstance(phases, Phase):
    phases = (phases,)
  if not isinstance(phases, Sequence) or isinstance(phases, str):
    raise TypeError(f"phases: expected a jaxfuse.Plan or a sequence of "
                    f"jaxfuse.Phase (jaxfuse.density_warmup(plan, ...)), got "
                    f"{type(phases).__name__}.")
  phases = tuple(phases)
  check_phases(phases)
  return phases


class TrainStep:
  """``step(state, batch) -> (state, loss)``: one training step, compiled
  once per phase (made by ``make_train_step``).

  Attributes:
    phases: the warm-up's phases (one for a plain plan).
    mesh: the mesh the step runs on.
    options: its ``StepOptions``.
  """

  def __init__(self, loss_fn, factory, phases, mesh, options, specs):
    self.phases = phases
    self.mesh = mesh
    self.options = options
    self._loss_fn = loss_fn
    self._factory = factory
    self._specs = specs
    self._compiled = {}    # id(plan) -> (plan, its jitted step)
    self._agreed = set()   # ids of plans whose steps all processes agree on
    self._started = set()  # phases whose first step ran (their checks done)
    self._losses = step_watch.LossWatch()
    platform = mesh.devices.flat[0].platform
    self._platform = platform
    # XLA's CPU collectives can stall when steps queue up (one device has
    # none to wait for)
    on_one = simulated.is_simulated(mesh)   # K workers, one device
    self._block = platform == "cpu" and mesh.size > 1 and not on_one
    send = options.send_early
    if send is None:
      send = bool(compile_options.on_gpu(platform) and mesh.size > 1 and
                  compile_options.network_flags_set() and not on_one)
    self._send_early = send
    compiler = options.compiler_options
    self._compiler_options = (compile_options.xla_options(platform)
                              if compiler is None else dict(compiler))

  def __call__(self, state: TrainState, batch: Any):
    """One step: ``(state, batch) -> (new_state, loss)``.

    It returns once the step is dispatched, so the host's work (the next
    batch) overlaps the devices'; on several CPU devices it waits for the
    step (XLA's CPU collectives can stall when steps queue up).

    Args:
      state: a ``TrainState`` (from ``make_train_step``, a previous step or
        ``restore``); with ``donate`` its arrays are consumed.
      batch: a pytree of arrays whose leading axis (the global batch)
        splits evenly over the workers.

    Returns:
      ``(new_state, loss)``; with ``has_aux``, ``(new_state, (loss, aux))``.

    Raises:
      TypeError: ``state`` is not a ``TrainState``, or ``loss_fn`` returns
        other than the options say.
      ValueError: a batch leaf whose leading axis does not divide over the
        workers.
      SyncError: with ``check_replicas``, a leaf that differs between the
        devices.
      CollectivesDifferError: under ``jax.distributed``, processes that
        compiled a phase's step with different collectives (checked at
        its first step).
    """
    if not isinstance(state, TrainState):
      raise TypeError(f"state: expected the jaxfuse.TrainState that "
                      f"make_train_step returned, got {type(state).__name__}.")
    at = plans.as_python(state.step)
    index = phase_index(self.phases, at)
    compiled = self.compiled(index)
    args = (state.params, state.opt_state, state.model_state,
            self.place(batch))
    key = id(self.phases[index].plan)
    if jax.process_count() > 1 and key not in self._agreed:
      # programs whose collectives differ between processes would wait for
      # each other forever: compare them first (the call runs this one)
      agreement.check_same_collectives(
          compiled.lower(*args).compile(),
          what=f"the step of phase {index} (first at step {at})")
      self._agreed.add(key)
    if index not in self._started:
      self._started.add(index)
      step_watch.check_dense_before_sparse(state.opt_state,
                                           self.phases[index].plan)
    params, opt_state, model_state, out = compiled(*args)
    if self._block:
      jax.block_until_ready(out)
    self._losses.add(at, out[0] if self.options.has_aux else out)
    if self.options.check_replicas:
      check_replicas({"params": params, "model_state": model_state}, at)
    return TrainState(params, opt_state, model_state, at + 1), out

  def phase_at(self, step: int) -> Phase:
    """The phase that trains ``step``.

    Args:
      step: a step number, e.g. ``state.step - 1`` for the step just run.

    Returns:
      Its ``Phase``; its ``plan`` is the one to pass to ``jaxfuse.summarize``.

    Raises:
      ValueError: ``step`` is not an integer >= 0.
    """
    return self.phases[phase_index(self.phases, step)]

  def compiled(self, index: int):
    """The jitted step of one phase, built on first use and then cached
    by its plan: phases of the same ``Plan`` object share one step.

    Args:
      index: the phase's index in ``phases``.

    Returns:
      ``jit(shard_map(...))`` (on a simulated mesh ``jit(vmap(...))``,
      ``jaxfuse.vmap_workers``): ``(params, opt_state, model_state, batch) ->
      (params, opt_state, model_state, loss)`` (``(loss, aux)`` with
      ``has_aux``); e.g. for ``.lower(...).compile()``.

    Raises:
      TypeError: ``optimizer(plan)`` is not an optax transform.
    """
    plan = self.phases[index].plan
    if id(plan) not in self._compiled:
      opt = step_args.build(self._factory, plan)
      local = local_step.per_worker_step(
          self._loss_fn, opt, self.options.has_aux,
          self.options.model_state is not None, self.options.axis_name,
          self.options.grad_at)
      send = self._send_early
      if send is not False:
        window = {} if send is True else {"window": send or None}
        local = overlap.send_early(local, **window)
      axis = self.options.axis_name
      mapped = simulated.worker_map(
          local, self.mesh, (P(), self._specs, P(), P(axis)),
          (P(), self._specs, P(), P()))
      self._compiled[id(plan)] = (plan, jax.jit(
          mapped, donate_argnums=(0, 1, 2) if self.options.donate else (),
          compiler_options=self._compiler_options or None))
    return self._compiled[id(plan)][1]

  def with_phases(self, phases: Any) -> "TrainStep":
    """This step on other phases (e.g. a warm-up that ends early), sharing
    its compiled steps: a phase whose plan is a ``Plan`` object already
    compiled here does not compile again.

    Args:
      phases: a ``jaxfuse.Plan`` or ``Phase``s tiling the steps from 0,
        whose optimizers keep the state of this step's (the same layout).

    Returns:
      A ``TrainStep`` on ``phases``; this one is unchanged.

    Raises:
      TypeError: ``phases`` is neither a plan nor a sequence of phases.
      PlanError: phases that do not tile the steps from 0.
    """
    other = copy.copy(self)
    other.phases = _as_phases(phases)
    return other

  def place(self, batch: Any) -> Any:
    """``batch`` placed with its leading axis split over the workers.

    Args:
      batch: a pytree of arrays, the global batch. Under
        ``jax.distributed``, global ``jax.Array``s (e.g. from
        ``jax.make_array_from_process_local_data``), passed as they are.

    Returns:
      The batch sharded ``P(axis_name)``.

    Raises:
      ValueError: a leaf whose leading axis does not divide over the
        workers (named, with the fix).
    """
    workers = self.mesh.shape[self.options.axis_name]
    leaves = jax.tree_util.tree_leaves_with_path(batch)
    if not leaves:
      raise ValueError("batch has no arrays; pass the batch the loss reads.")
    for path, x in leaves:
      shape = np.shape(x)
      if not shape or shape[0] % workers:
        rows = shape[0] if shape else "no leading axis"
        raise ValueError(
            f"batch{jax.tree_util.keystr(path)}: shape {shape} ({rows}) "
            f"does not split over the {workers} workers; give every batch "
            f"leaf a leading axis of a multiple of {workers} rows (e.g. "
            "drop the last, partial batch).")
    if simulated.is_simulated(self.mesh):
      return simulated.put(batch, self.mesh, P())
    sharding = NamedSharding(self.mesh, P(self.options.axis_name))
    if jax.process_count() > 1:
      for path, x in leaves:
        if not isinstance(x, jax.Array):
          raise ValueError(
              f"batch{jax.tree_util.keystr(path)}: a {type(x).__name__} "
              "under jax.distributed; give each leaf as a global jax.Array "
              "of this process's rows, jax.make_array_from_process_local_"
              "data(NamedSharding(mesh, P(axis_name)), rows).")
      return batch
    return jax.device_put(batch, sharding)

  def save(self, mngr, state: TrainState, extra: dict | None = None
           ) -> None:
    """Checkpoint ``state`` as step ``state.step`` (``jaxfuse.checkpoint``)
    with the warm-up's final plan.

    Args:
      mngr: a ``jaxfuse.checkpoint.manager(directory)``.
      state: the ``TrainState`` to save (not consumed).
      extra: JSON values to keep beside it (e.g. a loader's seed), read
        back with ``jaxfuse.checkpoint.saved_extra(mngr)``.

    Raises:
      CheckpointError: the step is already saved, or ``extra`` is not JSON.
    """
    checkpoint.save(mngr, state.step, _tree(state), self.phases[-1].plan,
                    extra)

  def restore(self, mngr, state: TrainState, step: int | None = None
              ) -> TrainState:
    """``state`` filled from checkpoint ``step`` (default the latest; with
    none saved and ``step`` None, ``state`` itself): the next call trains
    the phase of the restored ``state.step``, from its data position.

    Args:
      mngr: a ``jaxfuse.checkpoint.manager(directory)``.
      state: a state of this step's shapes (``make_train_step``'s first).
      step: the checkpoint to read (default: the latest).

    Returns:
      The restored ``TrainState`` (on another worker count, redistributed
      by ``jaxfuse.elastic``).

    Raises:
      CheckpointError: no such step, or a checkpoint of another layout.
    """
    if step is None and mngr.latest_step() is None:
      return state
    at, tree = checkpoint.restore(mngr, _tree(state), self.phases[-1].plan,
                                  step)
    return TrainState(tree["params"], tree["opt_state"],
                      tree.get("model_state"), int(at))


def _tree(state: TrainState) -> dict:
  """The arrays of ``state`` as the checkpoint keeps them."""
  tree = {"params": state.params, "opt_state": state.opt_state}
  if state.model_state is not None:
    tree["model_state"] = state.model_state
  return tree


def check_replicas(tree, step: int) -> None:
  """Check that every replicated array of ``tree`` is bitwise the same on
  each of its devices (``StepOptions.check_replicas``).

  Args:
    tree: a pytree of replicated ``jax.Array``s (params, model state).
    step: the step just run, for the message.

  Raises:
    SyncError: naming the first leaf whose copies differ, and the device.
  """
  for path, x in jax.tree_util.tree_leaves_with_path(tree):
    shards = getattr(x, "addressable_shards", None)
    if not shards or len(shards) < 2:
      continue
    first = np.asarray(shards[0].data)
    for shard in shards[1:]:
      other = np.asarray(shard.data)
      if first.tobytes() != other.tobytes():
        raise transform.SyncError(
            f"check_replicas: after step {step}, "
            f"{jax.tree_util.keystr(path)} on {shard.device} differs from "
            f"its copy on {shards[0].device}; the workers' steps diverged "
            "(a loss or model state that is not the same function on every "
            "worker, or non-deterministic ops: on GPU set XLA_FLAGS="
            "--xla_gpu_deterministic_ops=true).")
