"""``jaxfuse.plan``: the front door of the planners.

Every strategy walks the leaves in backward-ready order and cuts that
sequence into contiguous groups; each group becomes up to two buckets, one
of its sparse leaves (``all_gather``) and one of its dense leaves (``psum``).

Simple rules (``STRATEGIES``; no costs needed):

  layerwise  one leaf per group (WFBP)
  single     one group
  aligned    SAFusion §3.2: N = ⌈L/M⌉ leaves per group, M = ``num_buckets``
  size       fill a group up to ``bucket_bytes`` dense bytes (Horovod / DDP)
  behind     as ``size``, but each sparse bucket is selected with ONE
             threshold over the fused buffer (sparsification-behind baseline)

Cost-model strategies (``COST_STRATEGIES``; need ``costs``, see
``jaxfuse.planning.strategies`` and docs/planner.md):

  safusion   SAFusion §3.3: adaptive buffer sizes (Eq. 1-2), long tail (Eq. 3)
  cupcake    Cupcake Alg. 1: the optimal grouping under ``simulate``
  asc        ASC-WFBP Theorem 1 (normal / merged / simultaneous leaves)
  mgwfbp     MG-WFBP: merge while it gains (ASC-WFBP Eq. 5-6)
  auto       the fastest of all of these, of the rules at several sizes and of
             all-dense, under ``simulate``; then groups switched to dense
             where sparse does not pay, and each sparse bucket's collective
             (allgather / zen / spardl) picked for K workers
"""

from __future__ import annotations

import dataclasses
import math
import os
import warnings
from typing import Callable, Mapping, NamedTuple, Sequence

import jax
import numpy as np

from jaxfuse import collectives
from jaxfuse.planning import costs as costs_lib
from jaxfuse.planning import grouping
from jaxfuse.planning import ordering
from jaxfuse import plans
from jaxfuse.sync import bucket_steps
from jaxfuse.planning import simulate as simulate_lib
from jaxfuse.planning import strategies
from jaxfuse.version import __version__

STRATEGIES = ("layerwise", "single", "aligned", "size", "behind")
COST_STRATEGIES = ("safusion", "cupcake", "asc", "mgwfbp", "auto")
DEFAULT_BUCKET_BYTES = 25 * 2**20
# The rule sizes "auto" tries besides the ones passed to plan().
AUTO_NUM_BUCKETS = (1, 2, 4, 8, 16, 32)
AUTO_BUCKET_BYTES = tuple(2**k for k in (18, 20, 22, 24, 26))
# The sparse schemes "auto" weighs per bucket ("hier" needs a 2-level mesh).
AUTO_COLLECTIVES = ("allgather", "zen", "spardl")


class CostInputs(NamedTuple):
  """What a cost strategy groups by: the leaves, the costs on K workers,
  the settings and the sparse buckets' collective (what the wire carries)."""
  leaves: Sequence[plans.LeafPlan]
  costs: costs_lib.Costs
  settings: plans.Settings
  collective: str = "allgather"


def _groups(strategy, order, nbytes, num_buckets, bucket_bytes,
            model: CostInputs | None = None):
  """Leaf ids per group, in ready order; the cost strategies but "auto" need
  ``model``."""
  if strategy in COST_STRATEGIES:
    p = strategies.problem(model.leaves, order, model.costs, model.settings,
                           model.collective)
    if strategy == "safusion":
      return strategies.safusion(p, num_buckets)
    if strategy == "asc":
      return strategies.asc(p, model.costs.contention)
    return getattr(strategies, strategy)(p)
  if strategy == "layerwise":
    return [[i] for i in order]
  if strategy == "single":
    return [list(order)]
  if strategy == "aligned":
    per = math.ceil(len(order) / num_buckets)
    return [list(order[i:i + per]) for i in range(0, len(order), per)]
  groups, current, filled = [], [], 0
  for i in order:  # "size" and "behind"
    current.append(i)
    filled += nbytes[i]
    if filled >= bucket_bytes:
      groups.append(current)
      current, filled = [], 0
  return groups + ([current] if current else [])


def plan(params, *, density: float = 0.01, strategy: str | None = None,
         estimator: str = "dgc", num_buckets: int = 4,
         bucket_bytes: int = DEFAULT_BUCKET_BYTES,
         last_bucket_bytes: int | None = None,
         headroom: float = plans.Settings.headroom,
         min_sparse_size: int = 1024, refresh: int = 1, feedback: bool = True,
         sample_fraction: float = 0.01, sidco_stages: int = 2, seed: int = 0,
         collective="allgather",
         residual_dtype: str = "float32", sparse_wire: str = "gradient",
         num_workers: int | None = None,
         loss_fn: Callable | None = None, example_args: Sequence = (),
         ready_order: Sequence[int] | None = None,
         costs: costs_lib.Costs | str | os.PathLike | None = None,
         **old) -> plans.Plan:
  """Make a plan for ``params`` (arrays or ``jax.ShapeDtypeStruct``s).

  Args:
    params: the parameter pytree the gradients will have.
    density: share ρ of each sparse leaf to send per step, in (0, 1]; 1 means
      every leaf dense.
    strategy: one of ``STRATEGIES`` or ``COST_STRATEGIES`` (module
      docstring). Default ``"aligned"``; with ``num_workers=1``
      ``"single"``: one worker has no communication to hide, and one
      sparse bucket runs the fewest kernels.
    estimator: threshold estimator, one of ``plan.ESTIMATORS``.
    num_buckets: M for ``"aligned"`` (and the start of ``"safusion"``).
    bucket_bytes: dense bytes per bucket for ``"size"`` and ``"behind"``.
    last_bucket_bytes: with a rule strategy (``STRATEGIES``), cut the last
      group in ready order so that its final part holds at most this many
      dense bytes (whole leaves; ``grouping.cut_last``). Its buckets are the
      ones no backward can hide under ``send_early``, so a smaller last
      part leaves less of the wire after the backward ends
      (docs/choosing.md). Default None: no cut.
    headroom: capacity c = ⌈ρ·n·headroom⌉ (``"topk"``: c = ⌈ρ·n⌉ exactly).
    min_sparse_size: leaves with fewer elements (and non-float leaves) go dense.
    refresh, feedback, sample_fraction, sidco_stages, seed: ``plan.Settings``.
    collective: the scheme of every sparse bucket with its configuration,
      e.g. ``jaxfuse.collectives.Zen(table=2.0, union=1.0)``,
      ``SparDL(teams=2)``, ``Hier(inner="zen")``,
      ``AllGather(packed_indices=True)``; or one of
      ``plans.SPARSE_COLLECTIVES`` for that scheme's defaults (dense
      buckets always ``"psum"``).
    residual_dtype: ``"float32"`` (residuals of low-precision leaves kept in
      float32, the wire in the gradient dtype) or ``"gradient"``
      (``plan.Settings``).
    sparse_wire: ``"gradient"`` or ``"bfloat16"``: the sparse values' wire
      dtype (``plan.Settings``; bfloat16 sends float32 slots in 6 bytes
      instead of 8, each worker's rounding kept in its residual).
    num_workers: K the plan is made for (default: the costs' ``workers``):
      the cost strategies group for the collectives' times on K
      (``Costs.on_workers``), ``"auto"`` also picks each sparse bucket's
      collective for it, and the predicted step time is for it. A
      ``collective`` that cannot run on K (e.g. ``"zen"`` past 64 workers)
      is refused here, with the error ``sparse_sync`` would raise.
    loss_fn, example_args: ``loss_fn(params, *example_args)``; its gradient's
      jaxpr gives the backward-ready order. Without it, reverse pytree order.
    ready_order: leaf ids in ready order, overriding ``loss_fn``.
    costs: a ``jaxfuse.planning.costs.Costs`` or the path of its JSON,
      measured for this model (``costs.backward`` per leaf, pytree order).
      Needed by ``COST_STRATEGIES``; with any strategy it adds the simulated
      step time to ``plan.provenance["predicted_iteration"]`` (and the
      overlap η it used to ``plan.provenance["overlap"]``).
    **old: 0.2's scheme keywords ``zen_table``, ``zen_union``,
      ``spardl_teams``, ``spardl_block``, ``hier_inner``,
      ``packed_indices``: deprecated (removed in 0.4), each with a
      DeprecationWarning naming its ``collective=`` spelling.

  Returns:
    The ``Plan``.

  Raises:
    PlanError: an argument that cannot make a plan, named with the fix.
  """
  a = dict(locals())
  a.update(_scheme_fields(a.pop("collective"), a.pop("old")))
  a = _checked(a)
  settings = _settings(a)
  leaves = _leaf_plans(params, a["density"], a["estimator"], settings)
  order = _ready_order(a, params, len(leaves))
  costs = _load_costs(a["costs"], a["strategy"], leaves)
  return _made(a, settings, leaves, order, costs)


# 0.2's keywords of jaxfuse.plan that configure a scheme: the scheme and
# field that take each now (``collectives.configs``).
OLD_SCHEME_KEYWORDS = {
    "zen_table": ("Zen", "table"), "zen_union": ("Zen", "union"),
    "spardl_teams": ("SparDL", "teams"), "spardl_block": ("SparDL", "block"),
    "hier_inner": ("Hier", "inner"),
    "packed_indices": ("AllGather", "packed_indices"),
}


def _scheme_fields(collective, old: dict) -> dict:
  """``collective`` (a name or a scheme object) and 0.2's scheme keywords
  ``old`` as ``plan``'s arguments: the scheme's name and the ``Settings``
  fields that store its configuration (``collectives.settings_fields``).
  An old keyword warns (DeprecationWarning) with its new spelling."""
  unknown = sorted(set(old) - set(OLD_SCHEME_KEYWORDS))
  if unknown:
    raise TypeError(f"plan() got an unexpected keyword argument "
                    f"{unknown[0]!r}")
  for key, value in old.items():
    scheme, field = OLD_SCHEME_KEYWORDS[key]
    warnings.warn(
        f"jaxfuse.plan({key}=...) is deprecated (removed in 0.4): pass "
        f"collective=jaxfuse.collectives.{scheme}({field}={value!r}) "
        "(hier over a scheme: Hier(inner=Zen(...)), packed indices under "
        "hier: Hier(inner=AllGather(packed_indices=True))).",
        DeprecationWarning, stacklevel=3)
  defaults = {key: getattr(plans.Settings, key) for key in OLD_SCHEME_KEYWORDS}
  if isinstance(collective, str):
    return dict(defaults, **old, collective=collective)
  if old:
    raise plans.PlanError(
        f"plan: collective={collective!r} configures its scheme; leave "
        f"{sorted(old)} out (0.2's keywords), or give the scheme's name.")
  if getattr(collective, "name", None) not in plans.SPARSE_COLLECTIVES:
    raise plans.PlanError(
        f"collective={collective!r}; use a scheme of jaxfuse.collectives "
        "(AllGather, Zen, SparDL, Hier) or one of "
        f"{plans.SPARSE_COLLECTIVES}.")
  return dict(defaults, **collectives.settings_fields(collective),
              collective=collective.name)


def _checked(a: dict) -> dict:
  """``plan``'s arguments checked (``PlanError`` naming the one that is
  wrong and what it must be), numbers as Python's: a plan holds plain
  values."""
  if a["strategy"] is None:
    a["strategy"] = "single" if a["num_workers"] == 1 else "aligned"
  strategy, density = a["strategy"], a["density"]
  if strategy not in STRATEGIES + COST_STRATEGIES:
    raise plans.PlanError(f"strategy={strategy!r}; use one of "
                             f"{STRATEGIES + COST_STRATEGIES}.")
  if a["estimator"] not in plans.ESTIMATORS:
    raise plans.PlanError(
        f"estimator={a['estimator']!r}; use one of {plans.ESTIMATORS}.")
  if not plans.is_real(density) or not 0 < density <= 1:
    raise plans.PlanError(f"density={density!r} must be a number in "
                             "(0, 1].")
  a["density"] = float(density)   # numpy scalars too
  _check_sizes(a)
  if a["collective"] not in plans.SPARSE_COLLECTIVES:
    raise plans.PlanError(f"collective={a['collective']!r}; use one of "
                             f"{plans.SPARSE_COLLECTIVES}.")
  if not (plans.is_int(a["min_sparse_size"]) and
          a["min_sparse_size"] >= 1):
    raise plans.PlanError(
        f"min_sparse_size={a['min_sparse_size']!r} must be an int >= 1.")
  for name in ("num_buckets", "min_sparse_size", "num_workers", "headroom",
               "refresh", "sample_fraction", "sidco_stages", "seed",
               "zen_table", "zen_union", "spardl_teams", "spardl_block"):
    a[name] = plans.as_python(a[name])
  return a


def _check_sizes(a: dict) -> None:
  """``plan``'s bucket sizes, headroom and worker count checked."""
  num_buckets, bucket_bytes = a["num_buckets"], a["bucket_bytes"]
  headroom, num_workers = a["headroom"], a["num_workers"]
  last = a["last_bucket_bytes"]
  if not (plans.is_int(num_buckets) and num_buckets >= 1):
    raise plans.PlanError(
        f"num_buckets={num_buckets!r} must be an int >= 1.")
  if not (plans.is_int(bucket_bytes) and bucket_bytes > 0):
    raise plans.PlanError(f"bucket_bytes={bucket_bytes!r} must be an int "
                             "> 0 (dense bytes, e.g. 64 * 2**20).")
  a["bucket_bytes"] = int(bucket_bytes)
  if not (plans.is_real(headroom) and math.isfinite(headroom)
          and headroom >= 1):
    raise plans.PlanError(
        f"headroom={headroom!r} must be a finite number >= 1 (slots per leaf "
        f"over the target count ⌈ρ·n⌉; {plans.Settings.headroom} by "
        "default).")
  if num_workers is not None and not (plans.is_int(num_workers)
                                      and num_workers >= 1):
    raise plans.PlanError(f"num_workers={num_workers!r} must be an int "
                             ">= 1 (the workers the plan is for) or None.")
  if last is not None and not (plans.is_int(last) and last > 0):
    raise plans.PlanError(f"last_bucket_bytes={last!r} "
                             "must be an int > 0 (bytes) or None.")
  if last is not None and a["strategy"] in COST_STRATEGIES:
    raise plans.PlanError(
        "last_bucket_bytes cuts a rule strategy's last group; "
        f"strategy={a['strategy']!r} chooses its groups from the costs. "
        f"Leave last_bucket_bytes out, or use one of {STRATEGIES}.")
  if last is not None:
    a["last_bucket_bytes"] = int(last)   # numpy ints too


def _settings(a: dict) -> plans.Settings:
  """The ``Settings`` of ``plan``'s checked arguments."""
  return plans.Settings(**{f.name: a[f.name] for f in
                              dataclasses.fields(plans.Settings)
                              if f.name in a})


def _leaf_plans(params, density: float, estimator: str,
                settings: plans.Settings) -> list[plans.LeafPlan]:
  """A ``LeafPlan`` per leaf of ``params``: sparse where it is a float leaf
  of at least ``min_sparse_size`` elements and ρ < 1, else dense."""
  _refuse_nnx_object(params)
  _refuse_linen_variables(params)
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  if not flat:
    raise plans.PlanError("params has no array leaves to plan for.")
  leaves = []
  for path, x in flat:
    name = jax.tree_util.keystr(path)
    dtype = _leaf_dtype(name, x)
    shape = tuple(int(d) for d in np.shape(x))
    size = math.prod(shape)
    if jax.numpy.issubdtype(dtype, jax.numpy.complexfloating):
      raise plans.PlanError(
          f"leaf {name}: {dtype} parameters are not supported (jaxfuse "
          "averages and sparsifies real gradients); keep the real and "
          "imaginary parts as two float leaves.")
    if size == 0:
      raise plans.PlanError(
          f"leaf {name}: has zero elements; remove it from the parameters.")
    sparse = (density < 1 and size >= settings.min_sparse_size and
              plans._is_float(dtype))  # pylint: disable=protected-access
    if sparse:
      cap = plans.capacity(density, size, estimator, settings.headroom)
      leaves.append(plans.LeafPlan(name, shape, dtype, "sparse",
                                      float(density), cap, estimator))
    else:
      leaves.append(plans.LeafPlan(name, shape, dtype, "dense", 1.0,
                                      size, None))
  return leaves


def _ready_order(a: dict, params, num_leaves: int) -> tuple[list, str]:
  """(leaf ids in backward-ready order, where the order came from)."""
  if a["ready_order"] is not None:
    given = list(a["ready_order"])
    ints = all(plans.is_int(i) for i in given)
    order = [int(i) for i in given] if ints else []
    if not (ints and plans.is_leaf_order(order, num_leaves)):
      raise plans.PlanError(
          f"ready_order must list each of the {num_leaves} leaf ids "
          "(ints, pytree order) once.")
    return order, "given"
  if a["loss_fn"] is not None:
    return _backward_order(a["loss_fn"], params, a["example_args"]), "jaxpr"
  return ordering.reverse_order(num_leaves), "reverse_pytree"


def _made(a: dict, settings, leaves, order_source, costs) -> plans.Plan:
  """The plan of checked arguments ``a``: groups by the strategy, buckets,
  provenance; with costs, the simulated step time (and for ``"auto"``,
  each sparse bucket's collective)."""
  order, source = order_source
  strategy, collective = a["strategy"], a["collective"]
  num_workers, last = a["num_workers"], a["last_bucket_bytes"]
  k = None if costs is None else (
      costs.workers if num_workers is None else num_workers)
  on_k = None if costs is None else costs.on_workers(k)  # groups made for K
  if strategy != "auto" and any(l.mode == "sparse" for l in leaves):
    _check_collective(collective, num_workers or k, settings)
  provenance = {
      "strategy": strategy, "jaxfuse_version": __version__,
      "ready_order": source, "backward_order": list(order),
      "parameters": {"density": a["density"], "estimator": a["estimator"],
                     "collective": collective,
                     "num_buckets": a["num_buckets"],
                     "bucket_bytes": a["bucket_bytes"]},
  }
  if last is not None:
    provenance["parameters"]["last_bucket_bytes"] = last
  nbytes = [l.size * jax.numpy.dtype(l.dtype).itemsize for l in leaves]
  if strategy == "auto":
    leaves, groups, provenance["auto"] = _auto(
        tuple(leaves), order, nbytes, on_k,
        (a["num_buckets"], a["bucket_bytes"]), settings)
  else:
    groups = _groups(strategy, order, nbytes, a["num_buckets"],
                     a["bucket_bytes"],
                     CostInputs(leaves, on_k, settings, collective))
    if last is not None:
      groups = grouping.cut_last(groups, nbytes, last)
  buckets = grouping.buckets_from_groups(
      leaves, groups, behind=strategy == "behind",
      headroom=settings.headroom, collective=collective)
  made = plans.Plan(tuple(leaves), buckets, settings, provenance)
  if costs is None:
    return made
  if strategy == "auto":
    made, provenance["auto"]["collectives"] = pick_collectives(made, costs, k)
  provenance["predicted_iteration"] = simulate_lib.simulate(
      made, costs, k).iteration
  provenance["num_workers"] = k
  provenance["overlap"] = costs.overlap   # the η of predicted_iteration
  provenance["costs"] = dict(costs.provenance)
  return plans.Plan(made.leaves, made.buckets, settings, provenance)


def pick_collectives(plan: plans.Plan, costs: costs_lib.Costs,
                     num_workers: int) -> tuple[plans.Plan, list]:
  """Each sparse bucket moved by the scheme of ``AUTO_COLLECTIVES`` whose
  wire steps and extra compute take least time on K workers
  (``costs.steps_time`` + ``costs.scheme_time``). The simulated step is
  non-decreasing in every bucket's link and compute time, so with the
  grouping fixed this is optimal where one scheme is cheapest in both;
  else it takes the least sum. Returns the plan and, per bucket,
  {scheme: seconds} (empty for dense buckets)."""
  sched = bucket_steps.compile_plan(plan)
  buckets, report = [], []
  for b, step in zip(plan.buckets, sched.buckets):
    times = {}
    if step.kind == bucket_steps.SPARSE:
      for name in AUTO_COLLECTIVES:
        scheme = collectives.configured(name, plan.settings)
        units = [plans.wire_unit(u, plan.settings, scheme)
                 for u in sched.bucket_units(step)]
        if plans.overflows_one_space(name, sum(u.size for u in units)):
          continue  # one int32 index space cannot hold the bucket
        try:
          scheme.check("auto", num_workers, plan.settings)
          steps = scheme.steps(units, num_workers, plan.settings)
        except collectives.SchemeError:
          continue  # cannot run on K workers (e.g. SparDL's teams)
        times[name] = costs.steps_time(steps, num_workers) + \
            costs.scheme_time(name, sum(u.capacity for u in units))
      b = dataclasses.replace(b, collective=min(times, key=times.get))
    buckets.append(b)
    report.append(times)
  return plans.Plan(plan.leaves, tuple(buckets), plan.settings,
                       plan.provenance), report


_NNX_SPLIT = ("`graphdef, params, rest = nnx.split(model, nnx.Param, ...)`, "
              "then `jaxfuse.plan(params, ...)` (docs/choosing.md, \"With "
              "flax NNX\")")


def _leaf_dtype(name: str, x) -> str:
  """The dtype of a parameter leaf: an array (or array-like with shape and
  dtype) or a Python/numpy number; ``PlanError`` naming the leaf for
  anything else (a string, a dtype, an unregistered dataclass, PRNG
  keys)."""
  where = f"leaf {name}" if name else "params"
  dtype = getattr(x, "dtype", None)
  if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
    raise plans.PlanError(
        f"{where}: holds {dtype} values (PRNG keys), which have no "
        f"gradient; plan the trained parameters only (with flax NNX, "
        f"{_NNX_SPLIT}).")
  numeric = isinstance(x, (bool, int, float, complex, np.number)) or (
      hasattr(x, "shape") and dtype is not None and (
          jax.numpy.issubdtype(dtype, jax.numpy.number) or
          jax.numpy.issubdtype(dtype, jax.numpy.bool_)))
  if not numeric:
    what = (f"the type {x.__name__}" if isinstance(x, type) else
            f"an array of {dtype}" if hasattr(x, "shape") else
            f"a {type(x).__name__}")
    raise plans.PlanError(
        f"{where}: {what}, not a numeric array: params must be a pytree of "
        "arrays. Register a dataclass as a pytree "
        "(jax.tree_util.register_dataclass, flax.struct.dataclass) and keep "
        "strings, dtypes and other settings out of the tree.")
  return str(jax.numpy.result_type(x))


def _nnx_classes(x) -> list[str]:
  """Names of the flax NNX classes ``x`` is an instance of (none when flax
  is not in use: detected by the classes' module, so that flax stays an
  optional dependency)."""
  return [c.__name__ for c in type(x).__mro__
          if c.__module__.startswith("flax.nnx")]


# NNX variable types that hold no trained parameters
_NNX_STATE = ("BatchStat", "RngState", "Cache", "Intermediate", "OptState")


# flax linen variable collections that hold no trained parameters
_LINEN_STATE = ("batch_stats", "cache", "intermediates", "perturbations",
                "losses")


def _refuse_linen_variables(params) -> None:
  """A flax linen ``variables`` dict (``model.init``'s whole output) with
  collections besides ``"params"``: the running statistics would be
  planned, and their gradients synced, as if trained."""
  if not isinstance(params, Mapping) or "params" not in params:
    return
  others = sorted(k for k in params if k in _LINEN_STATE)
  if others:
    raise plans.PlanError(
        f"params holds the flax collections {['params', *others]}: a linen "
        "model's variables, not its parameters. Plan variables['params'] "
        "(and differentiate with respect to it); keep the other "
        "collections out of the optimizer.")


def _refuse_nnx_object(params) -> None:
  """A flax NNX object (a ``Module``, an ``Optimizer``) anywhere in
  ``params``, or an NNX variable that is no parameter (batch statistics,
  RNG state, an optimizer's state): its ``nnx.Param`` part is what a plan
  covers."""
  def stop(x) -> bool:
    names = _nnx_classes(x)
    return bool(names) and "State" not in names
  for path, x in jax.tree_util.tree_flatten_with_path(params,
                                                       is_leaf=stop)[0]:
    names = _nnx_classes(x)
    where = (f"params{jax.tree_util.keystr(path)}" if path else "params")
    if names and "Variable" not in names and "State" not in names:
      raise plans.PlanError(
          f"{where} is a flax NNX {names[0]} ({type(x).__name__}), which "
          "can hold batch statistics, RNG state or an optimizer's state "
          f"besides parameters; plan its parameters: {_NNX_SPLIT}.")
    kind = next((n for n in names if n in _NNX_STATE), None)
    if kind:
      raise plans.PlanError(
          f"{where} is an nnx.{type(x).__name__} ({kind}), not a "
          f"parameter; plan the model's parameters: {_NNX_SPLIT}.")


def _backward_order(loss_fn, params, example_args) -> list[int]:
  """``ordering.ready_order``, with the user's loss named when it fails."""
  if not callable(loss_fn):
    raise plans.PlanError(f"loss_fn={loss_fn!r} must be a function "
                             "loss_fn(params, *example_args).")
  try:
    return ordering.ready_order(loss_fn, params, *tuple(example_args))
  except ordering.LossOutputError:
    raise   # names its own fixes; example_args are not the cause
  except Exception as e:  # the user's code: any error
    raise plans.PlanError(
        "reading the backward order: jax.grad(loss_fn)(params, "
        f"*example_args) raised {type(e).__name__}: {e}. Give example_args "
        "as one worker's batch, the arguments loss_fn takes after params."
    ) from e


def _check_collective(collective: str, num_workers: int | None,
                      settings: plans.Settings) -> None:
  """The check ``sparse_sync`` makes of each sparse bucket's scheme on K
  workers, made now (``SchemeError``, a ``PlanError``); nothing without
  K."""
  if num_workers is not None:
    collectives.configured(collective, settings).check(
        f"on {num_workers} workers", num_workers, settings)


def _load_costs(costs, strategy, leaves):
  """``costs`` as a checked ``Costs``, or None where none is needed."""
  if costs is None:
    if strategy in COST_STRATEGIES:
      raise plans.PlanError(
          f"strategy={strategy!r} needs costs=: a "
          "jaxfuse.planning.costs.Costs or the path of a costs JSON. Measure "
          "them on the training mesh with `jaxfuse profile`, or load a file "
          "with jaxfuse.planning.costs.Costs.load(path).")
    return None
  if isinstance(costs, (str, os.PathLike)):
    try:
      costs = costs_lib.Costs.load(costs)
    except (OSError, ValueError) as e:
      raise plans.PlanError(
          f"costs={os.fspath(costs)!r} cannot be read ({e}). Give the JSON "
          "written by `jaxfuse profile` or by Costs.save.") from e
  if not isinstance(costs, costs_lib.Costs):
    raise plans.PlanError(
        f"costs must be a jaxfuse.planning.costs.Costs or a path, not "
        f"{type(costs).__name__}.")
  try:
    costs.check(len(leaves), holder="params",
                leaves=[(l.path, l.shape) for l in leaves])
  except costs_lib.CostsError as e:
    raise plans.PlanError(str(e)) from None
  return costs


def _dense(leaf: plans.LeafPlan) -> plans.LeafPlan:
  return plans.LeafPlan(leaf.path, leaf.shape, leaf.dtype, "dense", 1.0,
                           leaf.size, None)


def _auto(leaves, order, nbytes, costs, sizes, settings):
  """The fastest candidate under ``simulate``, then dense where it pays.

  Candidates: every cost strategy, ``layerwise``, ``single``, ``aligned`` and
  ``size`` at the given and at ``AUTO_NUM_BUCKETS`` / ``AUTO_BUCKET_BYTES``
  sizes; each also with every leaf dense ("dense+…"). Then on the winner,
  ``strategies.densify`` switches groups to dense one at a time while the
  step gets faster, and the new modes are regrouped optimally; each kept
  only if ``simulate`` says it is faster. (``behind`` is no candidate: it
  may leave tensors out of a step.) ``sizes``: (num_buckets,
  bucket_bytes) as given to ``plan``. Returns (leaves, groups, report).
  """
  num_buckets, bucket_bytes = sizes
  from jaxfuse.planning import strategies  # pylint: disable=g-import-not-at-top
  dense = tuple(_dense(l) for l in leaves)
  rules = [("layerwise", "layerwise", num_buckets, bucket_bytes),
           ("single", "single", num_buckets, bucket_bytes)]
  rules += [(f"aligned(num_buckets={m})", "aligned", m, bucket_bytes)
            for m in sorted({num_buckets, *AUTO_NUM_BUCKETS})]
  rules += [(f"size(bucket_bytes={b})", "size", num_buckets, b)
            for b in sorted({bucket_bytes, *AUTO_BUCKET_BYTES})]
  cands = []
  for prefix, ls in (("", leaves), ("dense+", dense)):
    if prefix and dense == leaves:
      break
    cands += [(prefix + name, ls, _groups(name, order, nbytes, num_buckets,
                                          bucket_bytes,
                                          CostInputs(ls, costs, settings)))
              for name in COST_STRATEGIES if name != "auto"]
    cands += [(prefix + name, ls, _groups(rule, order, nbytes, m, b))
              for name, rule, m, b in rules]

  def time(ls, groups):
    buckets = grouping.buckets_from_groups(ls, groups, behind=False,
                                  headroom=settings.headroom)
    return simulate_lib.simulate(plans.Plan(ls, buckets, settings),
                                 costs, order=order).iteration

  times, best = {}, None
  for name, ls, groups in cands:
    times[name] = time(ls, groups)
    if best is None or times[name] < best[0]:
      best = (times[name], name, ls, groups)
  _, name, ls, groups = best

  p = strategies.problem(ls, order, costs, settings)
  switch = set(strategies.densify(p, groups, [nbytes[i] for i in order]))
  if switch:
    mixed = tuple(dense[i] if i in switch else l for i, l in enumerate(ls))
    regrouped = strategies.cupcake(strategies.problem(mixed, order, costs,
                                                      settings))
    dense_name = f"{name}+dense({len(switch)} leaves)"
    for trial, gs in ((dense_name, groups), (dense_name + "+cupcake",
                                              regrouped)):
      times[trial] = time(mixed, gs)
      if times[trial] < best[0]:
        best = (times[trial], trial, mixed, gs)
  _, winner, ls, groups = best
  return ls, groups, {"winner": winner, "candidates": times}
