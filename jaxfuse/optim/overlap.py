"""``send_early``: each collective's input computed as soon as its data
allows, the rest of the backward made to wait for it, and the collectives
issued in the traced (the plan's) order, each ending within the next
bucket's backward.

XLA's GPU scheduler may start an async collective as soon as its input
exists, but it decides *when that input is computed* from its own cost
model, and it keeps one collective in flight at a time. In a sparse step
it computes every bucket's selection after the whole backward pass, and
it starts the loss's ``pmean`` right after the forward, where that scalar
holds the one collective slot through the backward. ``send_early(step)``
fixes both in the program itself, without touching the model or the
optimizer. With ``jaxfuse.xla_flags`` most of a sparse step's collective
time then runs under the backward (measured: docs/benchmarks.md,
"Overlap").

It traces ``step`` to a jaxpr and runs its equations in a new order. With
c_1, …, c_n the collectives in traced order (``sparse_sync`` issues its
buckets in the plan's backward-ready order) and w_i the input of c_i::

  for i = 1 … n:
    run every equation w_i depends on that has not run yet (traced order)
    fence:  (_, L_i) ← optimization_barrier(w_i, L_i)
            (w_i, _) ← optimization_barrier(w_i, out_j for j in after(i))
    out_i ← c_i(w_i)
  run the equations left (traced order)

L_i: the backward pass's values computed so far that a later equation
reads (the cotangents in flight, gradients not yet sent). The backward of
earlier layers reads the fenced L_i, so it cannot run before w_i exists,
and c_i can start then and run beside it. The second barrier orders the
collectives by *points* of the backward (``points_of_work``: fences with
a good share of the backward's matrix products between them): those of
one point (a sparse bucket and the small dense bucket of the same layers;
never two of one kind) run side by side, each point's after the point
before, in the plan's order; one not fed by the backward
(the loss's ``pmean``, traced last) waits for the rest instead of holding
the collective stream through the backward. Forward activations,
parameters and state stay out of the fences: holding them would make XLA
materialise values it otherwise fuses into their readers.
With ``finish_under_last`` (default) one more barrier makes the last
point's readers (its buckets' decode and update) wait for every earlier
collective's readers, which run right after the last collective: XLA can
then place those only before the last collective ends, under it, instead
of after it. Each barrier is an identity: the step's outputs are bitwise
unchanged.

What it needs of ``step``: the collectives at the top level of its jaxpr
(not inside a ``jax.jit`` or a loop of the step's own; ``jax.nn``'s jitted
helpers elsewhere are fine), and a backward pass that is not one opaque
call (``lax.scan`` over layers makes all gradients ready at once, so there
is nothing to overlap; ``jax.checkpoint``'d layers are fine, each layer's
backward one equation whose products ``work`` counts). Steps with ordered
effects (``io_callback``) run unchanged, with a warning.
"""

from __future__ import annotations

import functools
import itertools
import math
import warnings

import jax
from jax import lax
from jax.extend import core as jex

from jaxfuse import _compat
from jaxfuse.optim import compile_options
from jaxfuse.plans import checks as plan_checks

# Primitives that move data between workers (names as in jaxprs).
COLLECTIVES = frozenset({
    "all_gather", "all_gather_invariant", "psum", "psum_invariant",
    "psum_scatter", "reduce_scatter", "all_to_all", "ppermute", "pmax",
    "pmin", "ragged_all_to_all"})


# Primitives whose backward equations mark progress through the backward.
HEAVY = frozenset({"dot_general", "conv_general_dilated"})

# Share of the typical backward work between fences that opens a new point
# (``points_of_work``).
MERGE = 0.25

def send_early(step, *, window: int | None = 2, start_early: bool = True,
               finish_under_last: bool = True):
  """``step`` with each collective's input computed as early as its data
  allows, the backward after it fenced on it, and the collectives chained
  by points of the backward (module doc). Call the result where you would
  call ``step``: inside ``jax.shard_map``, under ``jax.jit``. Its outputs
  are bitwise those of ``step``. On GPU, set ``XLA_FLAGS`` to
  ``jaxfuse.xla_flags(network GB/s)`` before JAX starts: with XLA's
  default cost model the fenced step measured slower than the plain one
  (a warning says so). Measured: docs/benchmarks.md, "Overlap".

  ``window`` w (default 2): make the backward w points on wait for c_i's
  result, so c_i must end within the backward of the w buckets after it
  (unbounded, XLA leaves every collective's end at the end of the step,
  where one at a time they queue up). With w = 1 the backward stops at
  each point where an all-gather outlasts one bucket's backward; w = 2
  lets a collective run over two buckets' backward, which with
  ``xla_flags`` at half the link's speed is the faster setting measured
  (docs/benchmarks.md, "Overlap"). A point is a
  fence with at least a quarter of the typical backward work between
  fences since the point before, or a second collective of a kind
  already in the point (``points_of_work``): a small dense bucket right
  after a sparse one does not count. None: no such bound.

  ``start_early`` (default True): mark each collective
  ``scheduler_hint=force_delay_async``, which tells XLA's latency-hiding
  scheduler to start it as early and end it as late as its dependencies
  allow, whatever its cost model says.

  Under a named ``jax.vmap`` (workers simulated on one device,
  ``jaxfuse.simulated_mesh``) there is no network to overlap: ``step``
  runs unchanged.

  ``finish_under_last`` (default True): run the earlier buckets' readers
  (decode, update) right after the last collective is issued and make the
  last bucket's readers wait for them, so they run under the last
  collective rather than after it: less of the step's work is left after
  the last collective ends.

  Args:
    step: the per-worker step function (its collectives at the top level
      of its jaxpr).
    window: w, the bound above; None: no bound.
    start_early: mark the collectives to start early (above).
    finish_under_last: run the earlier readers under the last collective
      (above).

  Returns:
    A function with ``step``'s signature and bitwise outputs.

  Raises:
    TypeError: ``step`` is not callable.
    ValueError: ``window`` is not an integer >= 1 or None, or
      ``finish_under_last`` not a bool.
  """
  if not callable(step):
    raise TypeError(f"send_early wraps the per-worker step function; got "
                    f"{type(step).__name__}. Use jaxfuse.send_early(step) "
                    "as a decorator or call.")
  if not isinstance(finish_under_last, bool):
    raise ValueError(f"send_early: finish_under_last={finish_under_last!r} "
                     "must be True or False.")
  if window is not None and (not plan_checks.is_int(window) or window < 1):
    raise ValueError(f"send_early: window={window!r} must be an integer "
                     ">= 1 (points of the backward) or None.")

  @functools.wraps(step)
  def wrapped(*args, **kwargs):
    if any(_compat.batched_axes(x) for x in jax.tree.leaves((args, kwargs))):
      return step(*args, **kwargs)   # simulated workers: no network
    closed, out_shape = jax.make_jaxpr(step, return_shape=True)(*args,
                                                                **kwargs)
    flat = jax.tree.leaves((args, kwargs))
    ordered = _compat.ordered_effects(closed.jaxpr.effects)
    if ordered:
      warnings.warn(
          "jaxfuse.send_early: the step has ordered side effects "
          f"({sorted(map(str, ordered))[:3]}), whose order a new equation "
          "order could change; running it unchanged.", stacklevel=2)
      out = jex.jaxpr_as_fun(closed)(*flat)
    else:
      if not any(is_collective(e) for e in closed.jaxpr.eqns):
        nested = nested_collectives(closed.jaxpr)
        if nested:
          warnings.warn(
              "jaxfuse.send_early: the step's collectives sit inside "
              f"{', '.join(sorted(nested))} calls, where it cannot reorder "
              "them; nothing was changed. Call the optimizer's update "
              "directly in the step (not under its own jax.jit).",
              stacklevel=2)
      if compile_options.on_gpu() and not compile_options.network_flags_set():
        warnings.warn(
            "jaxfuse.send_early on GPU without jaxfuse.xla_flags in "
            "XLA_FLAGS: XLA's default cost model takes the network for "
            "NVLink and places the collectives where they cannot hide "
            "(measured slower than the plain step). Set os.environ"
            "['XLA_FLAGS'] = jaxfuse.xla_flags(network GB/s) before JAX "
            "starts.", stacklevel=2)
      out = run_fenced(closed, flat, window, start_early,
                       finish_under_last)
    return jax.tree.unflatten(jax.tree.structure(out_shape), out)

  return wrapped


def is_collective(eqn) -> bool:
  """A collective primitive (not one nested inside a call)."""
  return eqn.primitive.name in COLLECTIVES


def nested_collectives(jaxpr) -> set[str]:
  """Names of the top-level equations (``jit``, ``cond``, …) whose inner
  jaxprs hold a collective."""
  def holds(inner) -> bool:
    inner = getattr(inner, "jaxpr", inner)
    return any(is_collective(e) or any(
        holds(j) for j in jex.jaxprs_in_params(e.params)) for e in inner.eqns)
  return {e.primitive.name for e in jaxpr.eqns
          if any(holds(j) for j in jex.jaxprs_in_params(e.params))}


def is_backward(eqn) -> bool:
  """An equation of the backward pass: autodiff names its transposed
  equations ``transpose(jvp(...))``."""
  return "transpose(" in str(eqn.source_info.name_stack)


def fenced_order(jaxpr) -> tuple[list[int], list[int]]:
  """The new equation order, and the fences: the positions in that order
  of the collectives c_1 … c_n, each fence standing just before its
  collective."""
  eqns = jaxpr.eqns
  producer = {v: n for n, e in enumerate(eqns) for v in e.outvars}
  done: set[int] = set()
  order: list[int] = []
  fences: list[int] = []

  def needed(atoms) -> list[int]:
    """Equations not run yet that ``atoms`` depend on, in traced order."""
    found, stack = set(), [a for a in atoms if isinstance(a, jex.Var)]
    while stack:
      n = producer.get(stack.pop())
      if n is None or n in done or n in found:
        continue
      found.add(n)
      stack.extend(a for a in eqns[n].invars if isinstance(a, jex.Var))
    return sorted(found)

  for n, eqn in enumerate(eqns):
    if not is_collective(eqn) or n in done:
      continue
    before = needed(eqn.invars)
    order.extend(before)
    done.update(before)
    fences.append(len(order))
    order.append(n)
    done.add(n)
  order.extend(n for n in range(len(eqns)) if n not in done)
  return order, fences


def control_flow(eqn) -> tuple[list, int, str]:
  """(sub-jaxprs, trip count, "sum" or "max") of a control-flow equation:
  a ``scan`` its body × length, a ``cond`` its heaviest branch, a
  ``while`` its body and condition once (the trip count is not static);
  ``([], 1, "sum")`` for the others."""
  p = eqn.params
  if eqn.primitive.name == "scan":
    return [p["jaxpr"]], int(p.get("length", 1)), "sum"
  if "branches" in p:
    return list(p["branches"]), 1, "max"
  if "body_jaxpr" in p:
    return [p["body_jaxpr"], p["cond_jaxpr"]], 1, "sum"
  return [], 1, "sum"


def work(eqn) -> float:
  """Multiply-adds of a heavy equation: ``dot_general`` out·Π(contracting
  dims); a convolution out·(kernel size per output feature). An equation
  holding jaxprs counts theirs: control flow as ``control_flow`` says,
  any other (a ``jax.checkpoint``'d layer's backward, a nested ``jit``, a
  custom derivative; a Pallas kernel's one block) their sum."""
  name = eqn.primitive.name
  if name not in HEAVY:
    subs, trips, combine = control_flow(eqn)
    subs = subs or list(jex.jaxprs_in_params(eqn.params))
    inner = [sum(map(work, getattr(j, "jaxpr", j).eqns)) for j in subs]
    return trips * (max(inner, default=0.0) if combine == "max" else
                    sum(inner))
  out = math.prod(eqn.outvars[0].aval.shape)
  if name == "dot_general":
    (contract, _), _ = eqn.params["dimension_numbers"]
    lhs = eqn.invars[0].aval.shape
    return float(out * math.prod(lhs[d] for d in contract))
  rhs = eqn.invars[1].aval.shape
  features = rhs[eqn.params["dimension_numbers"].rhs_spec[0]]
  return float(out * math.prod(rhs) / max(features, 1))


def fence_work(eqns, order, fences) -> list[float]:
  """W_k: the backward's heavy work (``work``) before each fence; every
  backward equation counts 1 in a model without heavy equations."""
  backward = [is_backward(eqns[n]) for n in order]
  heavy = [work(eqns[n]) if b else 0.0 for b, n in zip(backward, order)]
  if not any(heavy):
    heavy = [float(b) for b in backward]
  done = [0.0, *itertools.accumulate(heavy)]
  return [done[stop] for stop in fences]


def points_of_work(at, merge: float = MERGE, kinds=None) -> list[int]:
  """Each fence's point of the backward. With W_k = ``at[k]`` the
  backward's heavy work before fence k (``fence_work``; non-decreasing),
  g_k = W_k − W_{k−1} the work between fences, and ĝ their work-weighted
  median (the g at which the gaps ≥ g hold half the work), a fence opens
  a new point when the work since its point opened reaches ``merge``·ĝ,
  or when its collective's kind (``kinds[k]``, a primitive name) is
  already in the point at less work::

    point_k = point_{k−1} + [W_k − W_{open(k−1)} ≥ merge·ĝ
                             or ∃ j in point_{k−1}: kind_j = kind_k, W_j < W_k]

  So collectives whose fences only a little work separates share a point:
  a small dense bucket right after a sparse one, or one whose leaves (a
  LayerNorm's, say) need a few more products than the sparse bucket's.
  Two of one kind never do (unless at the same work): XLA would combine
  two independent all-gathers into one, and the earlier bucket would wait
  for the later one's gradients; as points, the later waits for the
  earlier and the backward between them runs under the earlier."""
  gaps = sorted((b - a for a, b in zip([0.0, *at], at)), reverse=True)
  half, typical = sum(gaps) / 2, 0.0
  for g in gaps:             # the work-weighted median
    typical = g
    half -= g
    if half <= 0:
      break
  kinds = [None] * len(at) if kinds is None else kinds
  points, point, opened, seen = [], 0, None, {}
  for w, kind in zip(at, kinds):
    repeat = kind is not None and kind in seen and w > seen[kind]
    if (opened is None or repeat
        or w - opened >= merge * typical and w > opened):
      point, opened, seen = point + 1, w, {}
    if kind is not None:
      seen[kind] = w
    points.append(point)
  return points


def fed_by_backward(eqns, order, fences) -> list[bool]:
  """For each collective: whether its input depends on the backward pass
  (the loss's ``pmean`` does not)."""
  tainted: set = set()
  for e in eqns:
    if is_backward(e) or any(isinstance(a, jex.Var) and a in tainted
                             for a in e.invars):
      tainted.update(e.outvars)
  return [any(isinstance(a, jex.Var) and a in tainted
              for a in eqns[order[f]].invars) for f in fences]


def last_point(points, fed) -> list[int]:
  """The collectives (indices) of the backward's last point: those fed by
  the backward (``fed``) whose point (``points``) is the largest."""
  last = max((p for p, f in zip(points, fed) if f), default=None)
  return [k for k, (p, f) in enumerate(zip(points, fed)) if f and p == last]


def readers(eqns, order, pos, results, available, exclude) -> list[int]:
  """The positions in ``order`` after ``pos`` of the equations that read
  ``results`` (transitively) and can run now, with the equations they need
  that read nothing new (constants, iotas; none of the backward pass). An
  equation can run now if every input is ``available`` or made by another
  of them, and it is no collective and reads no ``exclude`` (transitively).
  In ``order``'s order."""
  new, out_of_reach = set(results), set(exclude)
  kind: dict[int, bool] = {}     # position -> reads results
  made: set = set()
  for p in range(pos + 1, len(order)):
    eqn = eqns[order[p]]
    ins = [a for a in eqn.invars if isinstance(a, jex.Var)]
    if any(a in out_of_reach for a in ins) or is_collective(eqn):
      out_of_reach.update(eqn.outvars)
      continue
    if not all(a in available or a in made for a in ins):
      continue
    reads = any(a in new for a in ins)
    if reads or not is_backward(eqn):
      kind[p] = reads
      made.update(eqn.outvars)
      if reads:
        new.update(eqn.outvars)
  # The readers, and the others only where a reader needs them.
  producer = {v: p for p in kind for v in eqns[order[p]].outvars}
  keep = {p for p, reads in kind.items() if reads}
  stack = list(keep)
  while stack:
    for a in eqns[order[stack.pop()]].invars:
      q = producer.get(a) if isinstance(a, jex.Var) else None
      if q is not None and q not in keep:
        keep.add(q)
        stack.append(q)
  return sorted(keep)


def waits(points, fed, window: int | None):
  """For each collective c_k, from each collective's point (``points``,
  ``points_of_work``) and whether the backward feeds it (``fed``,
  ``fed_by_backward``): the earlier collectives whose results its
  input waits for (``after``), and the earlier collectives whose results
  the backward from its fence on waits for (``held``)::

    after(k) = {j < k : point_j = max{point_i < point_k}} for c_k fed by
               the backward; {j < k : point_j = the last point before c_k}
               for the others (the loss's pmean)
    held(k)  = {j < k : k = min{k' > j : point_k' ≥ point_j + window}}

  So the collectives of one point run side by side, each point's after the
  point before, and what does not come from the backward after the rest."""
  n = len(points)
  after = []
  for k, p in enumerate(points):
    below = [points[j] for j in range(k) if points[j] < p or not fed[k]]
    after.append([j for j in range(k) if below and points[j] == max(below)])
  tie_at = [None] * n
  if window is not None:
    tie_at = [next((k for k in range(j + 1, n)
                    if points[k] >= points[j] + window), None)
              for j in range(n)]
  held = [[j for j in range(k) if tie_at[j] == k] for k in range(n)]
  return after, held


def run_fenced(closed, args, window: int | None = 1,
               start_early: bool = True,
               finish_under_last: bool = True) -> list:
  """Evaluate ``closed`` (a ClosedJaxpr) on ``args`` in ``fenced_order``,
  with the fences of the module doc (``window``, ``start_early``,
  ``finish_under_last``: see ``send_early``)."""
  jaxpr = closed.jaxpr
  eqns = jaxpr.eqns
  order, fences = fenced_order(jaxpr)
  # Where each variable is last read (position in the new order; outputs:
  # after the end): the values a fence holds back are those read later.
  last_read: dict = {}
  for pos, n in enumerate(order):
    for a in eqns[n].invars:
      if isinstance(a, jex.Var):
        last_read[a] = pos
  for a in jaxpr.outvars:
    if isinstance(a, jex.Var):
      last_read[a] = len(order)

  from_backward = {v for e in eqns if is_backward(e) for v in e.outvars}
  at = fence_work(eqns, order, fences)
  kinds = [eqns[order[f]].primitive.name for f in fences]
  points = points_of_work(at, kinds=kinds)
  fed = fed_by_backward(eqns, order, fences)
  after, held = waits(points, fed, window)
  final = last_point(points, fed) if finish_under_last else []
  ran: set[int] = set()     # positions run ahead of their turn
  env = dict(zip(jaxpr.constvars, closed.consts))
  env.update(zip(jaxpr.invars, args))
  start, results = 0, []   # results: each collective's outputs, in order
  for k, stop in enumerate(fences + [len(order)]):
    _run_segment(jaxpr, [eqns[order[p]] for p in range(start, stop)
                         if p not in ran], env, last_read, stop)
    if stop == len(order):
      break
    collective = eqns[order[stop]]
    inputs = [a for a in collective.invars if isinstance(a, jex.Var)]
    live = [v for v in env if v in from_backward and v not in inputs
            and last_read.get(v, -1) >= stop]
    previous = [v for j in after[k] for v in results[j] if v in env]
    wait = [v for j in held[k] for v in results[j] if v in env]
    _fence(env, inputs, live, previous, wait)
    with _compat.xla_hints(start_early=start_early):
      _run_segment(jaxpr, [collective], env, last_read, stop + 1)
    results.append([v for v in collective.outvars
                    if not isinstance(v, jex.DropVar)])
    if final and k == final[-1]:
      last_results = [v for j in final for v in results[j]]
      earlier = [v for j in range(len(results)) if j not in final
                 for v in results[j]]
      ran.update(_finish_before_last(jaxpr, order, stop, env, last_read,
                                     (earlier, last_results)))
    start = stop + 1
  return [a.val if isinstance(a, jex.Literal) else env[a]
          for a in jaxpr.outvars]


def _finish_before_last(jaxpr, order, pos, env, last_read,
                        split) -> list[int]:
  """``finish_under_last``, once the last point's collectives have run at
  ``pos``: run the earlier collectives' readers now and tie the last
  point's results to what those readers leave for later, so that the last
  point's readers wait for them. ``split``: (the earlier collectives'
  results, the last point's). Returns the positions run."""
  eqns = jaxpr.eqns
  earlier, last_results = split
  early = readers(eqns, order, pos, earlier, env, last_results)
  mine = [eqns[order[p]] for p in early]
  _run_segment(jaxpr, mine, env, last_read, pos + 1)
  read_later = {a for p in range(pos + 1, len(order)) if p not in early
                for a in eqns[order[p]].invars if isinstance(a, jex.Var)}
  read_later.update(a for a in jaxpr.outvars if isinstance(a, jex.Var))
  left = [v for e in mine for v in e.outvars if v in read_later and v in env]
  _tie_by_axes(env, last_results, left)
  return early


def _fence(env, inputs, live, previous, held=()) -> None:
  """In ``env``: tie ``live`` to ``inputs`` (and to ``held``, results of an
  earlier collective), and ``inputs`` to ``previous`` (the last
  collective's results), with barriers. Two kinds of barrier, so that the
  backward waits for the inputs but not for the previous collective.

  A barrier's outputs vary over the union of its operands' varying mesh
  axes, so each barrier on live values holds those of one such set S ⊇ A,
  the inputs' axes, and only values varying over no more than its own
  outputs go in as operands whose outputs are dropped. Values varying over
  fewer axes than the inputs (replicated parameters) stay out: what reads
  them along with a cotangent waits through that operand anyway."""
  axes = frozenset().union(*(_compat.varying_axes(env[v]) for v in inputs))
  ins = [env[v] for v in inputs]
  _tie_by_axes(env, [v for v in live if _compat.varying_axes(env[v]) >= axes],
               held, ins)
  after = [env[v] for v in previous if _compat.varying_axes(env[v]) <= axes]
  if after:
    tied_in, _ = lax.optimization_barrier((ins, after))
    env.update(zip(inputs, tied_in))


def _tie_by_axes(env, names, held, ins=()) -> None:
  """In ``env``: tie ``names`` to ``held`` (and to ``ins``, values) with one
  barrier per set S of varying mesh axes among ``names``, each taking only
  the ``held`` values that vary over no more than S (a barrier's outputs
  vary over the union of its operands'); no barrier where there is nothing
  to tie to."""
  by_axes: dict[frozenset, list] = {}
  for v in names:
    by_axes.setdefault(_compat.varying_axes(env[v]), []).append(v)
  for s, group in by_axes.items():
    wait = [env[v] for v in held if _compat.varying_axes(env[v]) <= s]
    if ins or wait:
      _, tied, _ = lax.optimization_barrier(
          (list(ins), [env[v] for v in group], wait))
      env.update(zip(group, tied))


def _run_segment(jaxpr, seg, env, last_read, stop) -> None:
  """Run the equations ``seg`` on ``env`` (as one sub-jaxpr, so each keeps
  its source information), adding the values read after ``stop``."""
  if not seg:
    return
  defined = {v for e in seg for v in e.outvars}
  ins, seen = [], set()
  for e in seg:
    for a in e.invars:
      if isinstance(a, jex.Var) and a not in defined and a not in seen:
        seen.add(a)
        ins.append(a)
  outs = [v for e in seg for v in e.outvars
          if isinstance(v, jex.Var) and not isinstance(v, jex.DropVar)
          and last_read.get(v, -1) >= stop]
  sub = jex.Jaxpr([], ins, outs, seg, jaxpr.effects,
                 _compat.debug_info_for(jaxpr.debug_info, len(ins),
                                        len(outs)))
  vals = jex.jaxpr_as_fun(jex.ClosedJaxpr(sub, []))(*[env[v] for v in ins])
  env.update(zip(outs, vals))
