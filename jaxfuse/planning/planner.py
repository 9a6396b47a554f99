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
from typing import NamedTuple, Sequence

import jax

from jaxfuse import _deprecated
from jaxfuse import collectives
from jaxfuse.collectives import spardl
from jaxfuse import plans
from jaxfuse.plans import checks as plan_checks
from jaxfuse.planning.costs import Costs
from jaxfuse.planning.costs import CostsError
from jaxfuse.planning import grouping
from jaxfuse.planning import leaves as leaf_planning
from jaxfuse.planning import ordering
from jaxfuse.planning import plan_keywords
from jaxfuse.planning.simulate import simulate
from jaxfuse.planning import strategies
from jaxfuse.sync import bucket_steps
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
  the settings and the sparse buckets' collective (a name or a configured
  scheme: what the wire carries)."""
  leaves: Sequence[plans.LeafPlan]
  costs: Costs
  settings: plans.Settings
  collective: object = "allgather"


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


@_deprecated.legacy_keywords(plan_keywords.upgrade)
def plan(params, *, density: float = 0.01, strategy: str | None = None,
         estimator: str = "dgc", num_buckets: int = 4,
         bucket_bytes: int = DEFAULT_BUCKET_BYTES,
         last_bucket_bytes: int | None = None, collective=None,
         settings: plans.Settings = plans.Settings(),
         num_workers: int | None = None, order=None,
         costs: Costs | str | os.PathLike | None = None
         ) -> plans.Plan:
  """Make a plan for ``params`` (arrays or ``jax.ShapeDtypeStruct``s).

  Args:
    params: the parameter pytree the gradients will have.
    density: share ρ of each sparse leaf to send per step, in (0, 1]; 1 means
      every leaf dense.
    strategy: one of ``STRATEGIES`` or ``COST_STRATEGIES`` (module
      docstring). Default ``"aligned"``; with ``num_workers=1``
      ``"single"``: one worker has no communication to hide, and one
      sparse bucket runs the fewest kernels.
    estimator: threshold estimator, one of ``plans.ESTIMATORS``.
    num_buckets: M for ``"aligned"`` (and the start of ``"safusion"``).
    bucket_bytes: dense bytes per bucket for ``"size"`` and ``"behind"``.
    last_bucket_bytes: with a rule strategy (``STRATEGIES``), cut the last
      group in ready order so that its final part holds at most this many
      dense bytes (whole leaves; ``grouping.cut_last``). Its buckets are the
      ones no backward can hide under ``send_early``, so a smaller last
      part leaves less of the wire after the backward ends
      (docs/choosing.md). Default None: no cut.
    collective: the scheme of every sparse bucket with its configuration,
      kept with each bucket (``BucketPlan.scheme``), e.g.
      ``jaxfuse.collectives.Zen(table=2.0, union=1.0)``,
      ``SparDL(teams=2)``, ``Hier(inner="zen")``,
      ``AllGather(packed_indices=True)``; or one of
      ``plans.SPARSE_COLLECTIVES`` for that scheme's defaults (dense
      buckets always ``"psum"``). Default None: ``"allgather"``; with
      ``num_workers=K`` > 1 and a rule strategy, each sparse bucket's
      lossless scheme that sends the fewest bytes on K (``fewest_bytes``:
      the all-gather on few workers, ZEN as K grows). A tuple of schemes, e.g.
      ``(AllGather(), SparDL(block=4.0))``: the first is the scheme of
      the rule strategies' buckets, and each one given is how that
      scheme runs wherever ``"auto"`` picks it (the others: defaults).
    settings: the knobs shared by every leaf, ``jaxfuse.Settings(headroom,
      min_sparse_size, seed, residual_dtype, full_wire, sparse_wire,
      estimation=jaxfuse.Estimation(refresh, feedback, sample_fraction,
      sidco_stages))``: capacity c = ⌈ρ·n·headroom⌉ (``"topk"``:
      c = ⌈ρ·n⌉ exactly); leaves with fewer than ``min_sparse_size`` elements (and
      non-float leaves) go dense.
    num_workers: K the plan is made for (default: the costs' ``workers``):
      the cost strategies group for the collectives' times on K
      (``Costs.on_workers``), ``"auto"`` also picks each sparse bucket's
      collective for it, and the predicted step time is for it. A
      ``collective`` that cannot run on K (e.g. ``"zen"`` past 64 workers)
      is refused here, with the error ``sparse_sync`` would raise.
    order: the backward-ready order: leaf ids (pytree order) in the order
      their gradients are ready; or where to read it from the gradient's
      jaxpr: ``jaxfuse.planning.ordering.FromLoss(loss_fn, (batch,))``
      (``loss_fn(params, *example_args)``, one worker's batch, arrays or
      ``jax.ShapeDtypeStruct``s), or a function of the parameters alone
      (``lambda p: loss_fn(p, batch)``). Default: reverse pytree order.
    costs: a ``jaxfuse.planning.costs.Costs`` or the path of its JSON,
      measured for this model (``costs.backward`` per leaf, pytree order).
      Needed by ``COST_STRATEGIES``; with any strategy it adds the simulated
      step time to ``plan.provenance["predicted_iteration"]`` (and the
      overlap η it used to ``plan.provenance["overlap"]``).

  0.2's keywords (``headroom``, ``min_sparse_size``, ``refresh``,
  ``feedback``, ``sample_fraction``, ``sidco_stages``, ``seed``,
  ``residual_dtype``, ``sparse_wire``, the scheme knobs ``zen_table`` …
  ``packed_indices``, ``ready_order``, ``loss_fn``, ``example_args``) still
  work until 0.4, each with a DeprecationWarning naming its new spelling
  (``plan_keywords``).

  Returns:
    The ``Plan``.

  Raises:
    PlanError: an argument that cannot make a plan, named with the fix.
  """
  a = _checked(dict(locals()))
  leaves = leaf_planning.leaf_plans(params, a["density"], a["estimator"],
                                 a["settings"])
  order = _ready_order(a, params, len(leaves))
  costs = _load_costs(a["costs"], a["strategy"], leaves)
  return _made(a, leaves, order, costs)


def _schemes(collective) -> tuple[str, dict]:
  """``collective`` (a name, a scheme object, a tuple of them, or 0.2's
  keywords' ``plan_keywords.Schemes``) as (the scheme's name, {name: the
  configured scheme}); a name not in the dict runs with its defaults."""
  if isinstance(collective, plan_keywords.Schemes):
    return collective.name, dict(collective.by_name)
  if isinstance(collective, (tuple, list)):
    if not collective:
      raise plans.PlanError("collective=(): give at least one scheme.")
    named = [_schemes(c) for c in collective]
    names = [name for name, _ in named]
    if len(set(names)) != len(names):
      raise plans.PlanError(
          f"collective={collective!r} names a scheme twice ({names}); give "
          "each scheme once, configured as it should run.")
    by_name = {}
    for _, schemes in named:      # with a Hier's inner scheme
      by_name.update(schemes)
    for name, schemes in named:   # a scheme given itself wins over an inner
      if name in schemes:
        by_name[name] = schemes[name]
    return names[0], by_name
  if isinstance(collective, str):
    if collective not in plans.SPARSE_COLLECTIVES:
      raise plans.PlanError(f"collective={collective!r}; use one of "
                            f"{plans.SPARSE_COLLECTIVES}.")
    return collective, {}
  if getattr(collective, "name", None) not in plans.SPARSE_COLLECTIVES:
    raise plans.PlanError(
        f"collective={collective!r}; use a scheme of jaxfuse.collectives "
        "(AllGather, Zen, SparDL, Hier) or one of "
        f"{plans.SPARSE_COLLECTIVES}.")
  collective = _plain_scheme(collective)
  inner = getattr(collective, "inner", None)   # Hier: its host-axis scheme
  by_name = {inner.name: inner} if inner is not None else {}
  return collective.name, dict(by_name, **{collective.name: collective})


def _plain_scheme(scheme):
  """``scheme`` with its numbers as Python's (a plan holds plain values)."""
  return dataclasses.replace(scheme, **{
      f.name: (_plain_scheme(v) if dataclasses.is_dataclass(v) else
               plans.as_python(v))
      for f in dataclasses.fields(scheme)
      for v in [getattr(scheme, f.name)]})


def _scheme(a: dict, name: str):
  """The configured scheme ``name`` of ``plan``'s arguments."""
  return a["schemes"].get(name) or collectives.SCHEMES[name]


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
  a["by_bytes"] = a["collective"] is None and strategy in STRATEGIES and (
      plans.is_int(a["num_workers"]) and a["num_workers"] > 1)
  if a["collective"] is None:
    a["collective"] = "allgather"
  a["collective"], a["schemes"] = _schemes(a["collective"])
  a["settings"] = _checked_settings(a["settings"])
  for name in ("num_buckets", "num_workers"):
    a[name] = plans.as_python(a[name])
  return a


def _checked_settings(settings) -> plans.Settings:
  """``settings`` checked (``PlanError`` naming the field), its numbers
  as Python's."""
  if not isinstance(settings, plans.Settings):
    raise plans.PlanError(
        f"settings={settings!r}; give a jaxfuse.Settings(...).")
  estimation = settings.estimation
  if not isinstance(estimation, plans.Estimation):
    raise plans.PlanError(
        f"settings.estimation={estimation!r}; give a "
        "jaxfuse.Estimation(...).")
  settings = dataclasses.replace(
      settings, estimation=dataclasses.replace(estimation, **{
          f.name: plans.as_python(getattr(estimation, f.name))
          for f in dataclasses.fields(estimation)}), **{
              f.name: plans.as_python(getattr(settings, f.name))
              for f in dataclasses.fields(settings)
              if f.name != "estimation"})
  plan_checks.check_settings(settings)
  return settings


def _check_sizes(a: dict) -> None:
  """``plan``'s bucket sizes and worker count checked."""
  num_buckets, bucket_bytes = a["num_buckets"], a["bucket_bytes"]
  num_workers, last = a["num_workers"], a["last_bucket_bytes"]
  if not (plans.is_int(num_buckets) and num_buckets >= 1):
    raise plans.PlanError(
        f"num_buckets={num_buckets!r} must be an int >= 1.")
  if not (plans.is_int(bucket_bytes) and bucket_bytes > 0):
    raise plans.PlanError(f"bucket_bytes={bucket_bytes!r} must be an int "
                             "> 0 (dense bytes, e.g. 64 * 2**20).")
  a["bucket_bytes"] = int(bucket_bytes)
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


def _ready_order(a: dict, params, num_leaves: int) -> tuple[list, str]:
  """(leaf ids in backward-ready order, where the order came from)."""
  given = a["order"]
  if given is None:
    return ordering.reverse_order(num_leaves), "reverse_pytree"
  if isinstance(given, ordering.FromLoss):
    return _backward_order(given.loss_fn, params,
                           given.example_args), "jaxpr"
  if callable(given):
    return _backward_order(given, params, ()), "jaxpr"
  given = list(given)
  ints = all(plans.is_int(i) for i in given)
  order = [int(i) for i in given] if ints else []
  if not (ints and plans.is_leaf_order(order, num_leaves)):
    raise plans.PlanError(
        f"order must list each of the {num_leaves} leaf ids "
        "(ints, pytree order) once, or be a function of the params.")
  return order, "given"


def _provenance(a: dict, order, source: str) -> dict:
  """What a plan records of how it was made."""
  provenance = {
      "strategy": a["strategy"], "jaxfuse_version": __version__,
      "ready_order": source, "backward_order": list(order),
      "parameters": {"density": a["density"], "estimator": a["estimator"],
                     "collective": a["collective"],
                     "num_buckets": a["num_buckets"],
                     "bucket_bytes": a["bucket_bytes"]},
  }
  if a["last_bucket_bytes"] is not None:
    provenance["parameters"]["last_bucket_bytes"] = a["last_bucket_bytes"]
  return provenance


def _made(a: dict, leaves, order_source, costs) -> plans.Plan:
  """The plan of checked arguments ``a``: groups by the strategy, buckets,
  provenance; with costs, the simulated step time (and for ``"auto"``,
  each sparse bucket's collective)."""
  order, source = order_source
  strategy, settings = a["strategy"], a["settings"]
  num_workers, scheme = a["num_workers"], _scheme(a, a["collective"])
  k = None if costs is None else (
      costs.workers if num_workers is None else num_workers)
  on_k = None if costs is None else costs.on_workers(k)  # groups made for K
  if strategy != "auto" and any(l.mode == "sparse" for l in leaves):
    _check_collective(scheme, num_workers or k, settings)
  provenance = _provenance(a, order, source)
  nbytes = [l.size * jax.numpy.dtype(l.dtype).itemsize for l in leaves]
  if strategy == "auto":
    leaves, groups, provenance["auto"] = _auto(
        tuple(leaves), order, nbytes, on_k, a)
  else:
    groups = _groups(strategy, order, nbytes, a["num_buckets"],
                     a["bucket_bytes"],
                     CostInputs(leaves, on_k, settings, scheme))
    if a["last_bucket_bytes"] is not None:
      groups = grouping.cut_last(groups, nbytes, a["last_bucket_bytes"])
  buckets = grouping.buckets_from_groups(
      leaves, groups, behind=strategy == "behind",
      headroom=settings.headroom, collective=scheme)
  made = plans.Plan(tuple(leaves), buckets, settings, provenance)
  if a["by_bytes"]:
    made, sent = fewest_bytes(made, num_workers, a["schemes"])
    provenance["parameters"]["collective"] = "fewest bytes"
    provenance["bytes_sent"] = sent
  if costs is None:
    return made
  if strategy == "auto":
    made, provenance["auto"]["collectives"] = pick_collectives(
        made, costs, k, a["schemes"])
  provenance["predicted_iteration"] = simulate(
      made, costs, k).iteration
  provenance["num_workers"] = k
  provenance["overlap"] = costs.overlap   # the η of predicted_iteration
  provenance["costs"] = dict(costs.provenance)
  return plans.Plan(made.leaves, made.buckets, settings, provenance)


def pick_collectives(plan: plans.Plan, costs: Costs,
                     num_workers: int, schemes=None) -> tuple[plans.Plan, list]:
  """Each sparse bucket moved by the scheme of ``AUTO_COLLECTIVES`` whose
  wire steps and extra compute take least time on K workers
  (``costs.steps_time`` + ``costs.scheme_time``); SparDL with the teams
  ``spardl.choose`` picks for K and the link, unless ``schemes`` configures
  it. The simulated step is
  non-decreasing in every bucket's link and compute time, so with the
  grouping fixed this is optimal where one scheme is cheapest in both;
  else it takes the least sum.

  Args:
    plan: the plan whose sparse buckets get a scheme.
    costs: the measured costs.
    num_workers: K.
    schemes: {name: configured scheme} to weigh (a name not in it: its
      defaults).

  Returns:
    The plan and, per bucket, {scheme: seconds} (empty for dense buckets).
  """
  def seconds(scheme, units):
    steps = _scheme_steps(scheme, units, plan, num_workers)
    return None if steps is None else (
        costs.steps_time(steps, num_workers) +
        costs.scheme_time(scheme.name, sum(u.capacity for u in units)))

  def configured(scheme, units):
    """SparDL's teams chosen for K and the link (``spardl.choose``)
    unless the caller configured SparDL."""
    if scheme.name != "spardl" or "spardl" in (schemes or {}):
      return scheme
    return spardl.choose(num_workers, [
        plans.wire_unit(u, plan.settings, scheme) for u in units], costs,
                         scheme)
  return _pick(plan, schemes, seconds, configure=configured)


def fewest_bytes(plan: plans.Plan, num_workers: int,
                 schemes=None) -> tuple[plans.Plan, list]:
  """Each sparse bucket moved by the lossless scheme (``"allgather"`` or
  ``"zen"``) that sends the fewest bytes per worker on K workers
  (``collectives.Wire``'s ``sent``): without costs, what a slow link
  rewards. ZEN is taken where it sends under 90 % of the all-gather's
  bytes (the all-gather is one collective). The all-gather's bytes grow as (K − 1)·c
  and ZEN's do not, so past a few workers ZEN takes over. SparDL, whose
  reduction drops slots, is never picked here: pass it as ``collective``.

  Args:
    plan: the plan whose sparse buckets get a scheme.
    num_workers: K.
    schemes: {name: configured scheme} to weigh (a name not in it: its
      defaults).

  Returns:
    The plan and, per bucket, {scheme: bytes sent} (empty for dense
    buckets).
  """
  def sent(scheme, units):
    steps = _scheme_steps(scheme, units, plan, num_workers)
    return None if steps is None else collectives.base.wire(
        steps, num_workers).sent
  # ZEN's bytes weigh 1/0.9 in the choice: it must save 10 %
  return _pick(plan, schemes, sent, {"allgather": 1.0, "zen": 1 / 0.9})


def _pick(plan: plans.Plan, schemes, cost_of, weights=None,
          configure=None) -> tuple[plans.Plan, list]:
  """Each sparse bucket's scheme: of ``weights``' names (default
  ``AUTO_COLLECTIVES``, each weighing 1), the least weighted
  ``cost_of(scheme, units)`` (None: cannot run), the first on a tie;
  each scheme as ``configure(scheme, units)`` makes it for the bucket
  (default: as given)."""
  weights = weights or dict.fromkeys(AUTO_COLLECTIVES, 1.0)
  if plan.settings.sparse_wire in plans.QUANTIZED_WIRES:
    weights = {"allgather": 1.0}   # the one scheme that decodes them
  configure = configure or (lambda scheme, units: scheme)
  sched = bucket_steps.compile_plan(plan)
  buckets, report = [], []
  for b, step in zip(plan.buckets, sched.buckets):
    cost, chosen = {}, {}
    if step.kind == bucket_steps.SPARSE:
      units = sched.bucket_units(step)
      for name in weights:
        chosen[name] = configure(
            (schemes or {}).get(name) or collectives.SCHEMES[name], units)
        c = cost_of(chosen[name], units)
        if c is not None:
          cost[name] = c
      best = min(cost, key=lambda n: cost[n] * weights[n])
      b = dataclasses.replace(b, collective=best, scheme=chosen[best])
    buckets.append(b)
    report.append(cost)
  return plans.Plan(plan.leaves, tuple(buckets), plan.settings,
                       plan.provenance), report


def _scheme_steps(scheme, units, plan, num_workers):
  """``scheme``'s wire steps for a bucket of ``units`` on K workers, or
  None where it cannot run there."""
  units = [plans.wire_unit(u, plan.settings, scheme) for u in units]
  if plans.overflows_one_space(scheme.name, sum(u.size for u in units)):
    return None  # one int32 index space cannot hold the bucket
  try:
    scheme.check("auto", num_workers, plan.settings)
    return scheme.steps(units, num_workers, plan.settings)
  except collectives.SchemeError:
    return None  # cannot run on K workers (e.g. SparDL's teams)


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


def _check_collective(scheme, num_workers: int | None,
                      settings: plans.Settings) -> None:
  """The check ``sparse_sync`` makes of each sparse bucket's scheme on K
  workers, made now (``SchemeError``, a ``PlanError``); nothing without
  K."""
  if num_workers is not None:
    scheme.check(f"on {num_workers} workers", num_workers, settings)


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
      costs = Costs.load(costs)
    except (OSError, ValueError) as e:
      raise plans.PlanError(
          f"costs={os.fspath(costs)!r} cannot be read ({e}). Give the JSON "
          "written by `jaxfuse profile` or by Costs.save.") from e
  if not isinstance(costs, Costs):
    raise plans.PlanError(
        f"costs must be a jaxfuse.planning.costs.Costs or a path, not "
        f"{type(costs).__name__}.")
  try:
    costs.check(len(leaves), holder="params",
                leaves=[(l.path, l.shape) for l in leaves])
  except CostsError as e:
    raise plans.PlanError(str(e)) from None
  return costs


def _candidates(leaves, order, nbytes, costs, a: dict) -> list:
  """``_auto``'s candidates: (name, leaves, groups) of every cost strategy,
  ``layerwise``, ``single``, ``aligned`` and ``size`` at the given and at
  ``AUTO_NUM_BUCKETS`` / ``AUTO_BUCKET_BYTES`` sizes; each also with every
  leaf dense ("dense+…")."""
  num_buckets, bucket_bytes = a["num_buckets"], a["bucket_bytes"]
  gather = _scheme(a, "allgather")
  dense = tuple(leaf_planning.dense(l) for l in leaves)
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
    cands += [(prefix + name, ls, _groups(
        name, order, nbytes, num_buckets, bucket_bytes,
        CostInputs(ls, costs, a["settings"], gather)))
              for name in COST_STRATEGIES if name != "auto"]
    cands += [(prefix + name, ls, _groups(rule, order, nbytes, m, b))
              for name, rule, m, b in rules]
  return cands


def _auto(leaves, order, nbytes, costs, a: dict):
  """The fastest candidate under ``simulate``, then dense where it pays.

  Candidates: ``_candidates``. Then on the winner, ``strategies.densify``
  switches groups to dense one at a time while the step gets faster, and
  the new modes are regrouped optimally; each kept only if ``simulate``
  says it is faster. (``behind`` is no candidate: it may leave tensors out
  of a step.) ``a``: ``plan``'s checked arguments. Returns (leaves,
  groups, report).
  """
  settings, gather = a["settings"], _scheme(a, "allgather")

  def time(ls, groups):
    buckets = grouping.buckets_from_groups(ls, groups, behind=False,
                                           headroom=settings.headroom,
                                           collective=gather)
    return simulate(plans.Plan(ls, buckets, settings),
                                 costs, order=order).iteration

  times, best = {}, None
  for name, ls, groups in _candidates(leaves, order, nbytes, costs, a):
    times[name] = time(ls, groups)
    if best is None or times[name] < best[0]:
      best = (times[name], name, ls, groups)
  _, name, ls, groups = best

  p = strategies.problem(ls, order, costs, settings, gather)
  switch = set(strategies.densify(p, groups, [nbytes[i] for i in order]))
  if switch:
    mixed = tuple(leaf_planning.dense(l) if i in switch else l
                  for i, l in enumerate(ls))
    regrouped = strategies.cupcake(strategies.problem(mixed, order, costs,
                                                      settings, gather))
    dense_name = f"{name}+dense({len(switch)} leaves)"
    for trial, gs in ((dense_name, groups), (dense_name + "+cupcake",
                                              regrouped)):
      times[trial] = time(mixed, gs)
      if times[trial] < best[0]:
        best = (times[trial], trial, mixed, gs)
  _, winner, ls, groups = best
  return ls, groups, {"winner": winner, "candidates": times}
