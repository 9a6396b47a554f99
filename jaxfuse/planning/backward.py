"""Per-leaf backward times: derived from the program, measured, validated.

``analyze_backward`` reads the gradient's jaxpr (pure: traces, runs
nothing) and attributes the backward pass to the leaves by their roofline
costs; ``derive_backward`` scales those shares to one measured backward
pass B = time(jit(grad(loss))) − time(jit(loss)) on one device
(``measure_forward_backward``). ``validate_backward`` measures the true
ready times of a few prefixes of the ready order and reports the error of
the derived times (docs/cli.md). Timing: ``timing``. ``synthetic_model``:
the model the profiler measures on when it is given none.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxfuse import _deprecated
from jaxfuse.optim import overlap
from jaxfuse.planning import ordering
from jaxfuse.planning._measuring import Model
from jaxfuse.planning._measuring import Timing
from jaxfuse.planning._measuring import legacy_groups
from jaxfuse.planning.timing import ProfileError
from jaxfuse.planning.timing import jit as _jit
from jaxfuse.planning.timing import time_call
from jaxfuse.planning.timing import time_calls

# Operations that move no data once XLA has fused them (cost 0).
FREE_PRIMITIVES = frozenset({
    "reshape", "squeeze", "expand_dims", "broadcast_in_dim", "pvary", "pcast",
    "stop_gradient", "iota", "copy", "copy_p", "device_put",
    "optimization_barrier"})


def machine_rates(device=None, *, repeats: int = 5,
                  warmup: int = 2) -> tuple[float, float]:
  """(FLOP/s of a float32 matmul, bytes/s of an elementwise op) on
  ``device``.

  Args:
    device: the device (default the first local one).
    repeats: timed runs; the median counts.
    warmup: untimed runs first.

  Returns:
    (FLOP/s, bytes/s).
  """
  device = device or jax.local_devices()[0]
  cpu = device.platform == "cpu"
  m, n = (384, 2**21) if cpu else (4096, 2**26)
  a = jax.device_put(np.ones((m, m), np.float32), device)
  x = jax.device_put(np.ones((n,), np.float32), device)
  t_mm = time_call(_jit(lambda a: a @ a), a, warmup=warmup, repeats=repeats)
  t_ew = time_call(_jit(lambda x: x * 2 + 1), x, warmup=warmup,
                   repeats=repeats)
  return 2 * m**3 / t_mm, 2 * 4 * n / t_ew


def _nbytes(aval) -> int:
  shape, dtype = getattr(aval, "shape", None), getattr(aval, "dtype", None)
  if shape is None or dtype is None:
    return 0
  try:
    return math.prod(shape) * np.dtype(dtype).itemsize
  except TypeError:  # float0, tokens, extended dtypes
    return 0


def equation_work(eqn) -> tuple[float, float]:
  """(FLOPs, bytes) of one first-order jaxpr equation.

  dot_general: 2·|out|·Π(contracted dims); conv: 2·|out|·C_in/groups·Π(kernel
  window); everything else 0 FLOPs. Bytes: max(|out|, max |in|) in bytes (a
  fused elementwise chain touches each array about once); 0 for operations
  that are free once fused (``FREE_PRIMITIVES``).

  Args:
    eqn: a jaxpr equation.

  Returns:
    (FLOPs, bytes).
  """
  name = eqn.primitive.name
  if name in FREE_PRIMITIVES:
    return 0.0, 0.0
  out_bytes = sum(_nbytes(v.aval) for v in eqn.outvars)
  in_bytes = max([_nbytes(v.aval) for v in eqn.invars] + [0])
  flops = 0.0
  if name == "dot_general":
    (lhs_contract, _), _ = eqn.params["dimension_numbers"]
    lhs = eqn.invars[0].aval.shape
    out = eqn.outvars[0].aval.shape
    flops = 2.0 * math.prod(out) * math.prod(lhs[d] for d in lhs_contract)
  elif name == "conv_general_dilated":
    rhs = eqn.invars[1].aval.shape
    spec = eqn.params["dimension_numbers"].rhs_spec  # (out, in, *spatial)
    window = math.prod(rhs[d] for d in spec[2:])
    flops = 2.0 * math.prod(eqn.outvars[0].aval.shape) * rhs[spec[1]] * window
  return flops, float(max(out_bytes, in_bytes))


def _roofline(flops: float, nbytes: float, rates) -> float:
  return max(flops / rates[0], nbytes / rates[1])


def _program_time(jaxpr, rates) -> float:
  """Σ roofline time of every equation, through calls and control flow."""
  atoms = []
  _graph(jaxpr, rates, atoms, {}, {}, ())
  return sum(t for t, _ in atoms)


def _graph(jaxpr, rates, atoms: list, env: dict, keys: dict,
           prefix: tuple) -> None:
  """Append (roofline seconds, producer atoms) of each step to ``atoms``.

  A step ("atom") is a first-order equation; call-like equations (pjit,
  remat, custom_vjp, shard_map) are entered; scan / while / cond are one
  opaque step (a scan costs length × its body, a cond its dearest branch).
  ``env`` maps each variable to the atoms producing it (through calls: the
  callee's producers), so each atom lists the atoms it reads: the program's
  dependency graph. ``keys`` maps each variable to its ready key as in
  ``ordering`` (equation indices, outer to inner).
  """
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
  literal = lambda v: v is None or hasattr(v, "val")
  deps_of = lambda vs: sorted({a for v in vs if not literal(v)
                               for a in env.get(v, ())})
  for i, eqn in enumerate(jaxpr.eqns):
    key = prefix + (i,)
    subs, trips, combine = overlap.control_flow(eqn)
    sub = None if subs else ordering._sub_jaxprs(eqn)  # pylint: disable=protected-access
    if sub is not None:
      if len(sub.invars) == len(eqn.invars):
        inner = {sv: deps_of([v]) for sv, v in zip(sub.invars, eqn.invars)}
      else:  # unknown calling convention: each input may feed everything
        inner = {sv: deps_of(eqn.invars) for sv in sub.invars}
      inner_keys = {}
      _graph(sub, rates, atoms, inner, inner_keys, key)
      for j, v in enumerate(eqn.outvars):
        out = sub.outvars[j] if j < len(sub.outvars) else None
        env[v] = [] if literal(out) else list(inner.get(out, ()))
        keys[v] = key if literal(out) else inner_keys.get(out, key)
      continue
    if subs:
      parts = [_program_time(s, rates) for s in subs]
      t = trips * (max(parts) if combine == "max" else sum(parts))
    else:
      t = _roofline(*equation_work(eqn), rates)
    atoms.append((t, deps_of(eqn.invars)))
    for v in eqn.outvars:
      env[v] = [len(atoms) - 1]
      keys[v] = key


@dataclasses.dataclass(frozen=True)
class BackwardAnalysis:
  """What the program says about its backward pass (seconds, roofline).

  order: leaf ids (pytree order numbering) in backward-ready order.
  ready: per leaf (pytree order), roofline time from the start of the
    gradient program to the equation that produces the leaf's gradient.
  shares: per leaf (pytree order), roofline backward time attributed to it:
    the equations after the previous leaf's gradient up to its own (the
    first ready leaf: from the end of the forward pass).
  forward: roofline time of the loss alone (where the backward starts).
  total: roofline time of the whole gradient program.
  """
  order: tuple[int, ...]
  ready: tuple[float, ...]
  shares: tuple[float, ...]
  forward: float
  total: float


def _abstract(tree):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x),
                                                     jnp.result_type(x)), tree)


ATTRIBUTIONS = ("cones", "position")


def analyze_backward(loss_fn: Callable, params, example_args: Sequence = (), *,
                     rates: tuple[float, float] = (1e11, 1e10),
                     attribution: str = "cones") -> BackwardAnalysis:
  """Attribute the backward pass to the leaves, from the gradient's jaxpr.

  Each first-order equation e of ``jax.grad(loss_fn)`` costs its roofline
  time c(e) = max(FLOPs / rates[0], bytes / rates[1]) (``equation_work``).
  The cone K(i) of leaf i is every equation its gradient depends on
  (transitively, through calls). Leaves in backward-ready order i₁, i₂, …
  (the order ``ordering.ready_order`` gives) are ready, when the backward
  computes what the next gradient needs first, at

    R(i_j) = Σ c(e) over e ∈ K(i₁) ∪ … ∪ K(i_j)

  and, with F the cost of the loss's own jaxpr (the forward pass, in every
  cone), each gets share(i_j) = max(0, R(i_j) − max(F, R(i_{j−1}))).
  So Σ shares = R(i_last) − F: the backward, less anything no gradient
  needs. This is what ``validate_backward`` measures (XLA drops the rest
  of the backward from ``grad`` with respect to the first leaves).

  ``attribution="position"`` instead takes R(i) = Σ c(e) over every
  equation up to the one producing leaf i's gradient, in jaxpr order (the
  work listed between two gradients goes to the second; docs/cli.md
  compares the two). Pure: traces, runs nothing.

  Args:
    loss_fn: ``loss_fn(params, *example_args)``, one worker's loss.
    params: the parameters (arrays or shape-dtype structs).
    example_args: a sample batch.
    rates: (FLOP/s, bytes/s) of the roofline.
    attribution: ``"cones"`` or ``"position"``.

  Returns:
    The ``BackwardAnalysis``.

  Raises:
    ProfileError: for an unknown ``attribution``.
  """
  if attribution not in ATTRIBUTIONS:
    raise ProfileError(f"attribution={attribution!r}; use one of "
                       f"{ATTRIBUTIONS}.")
  params, args = _abstract((params, tuple(example_args)))
  closed = jax.make_jaxpr(jax.grad(loss_fn))(params, *args)
  atoms, env, keys = [], {}, {}
  _graph(closed.jaxpr, rates, atoms, env, keys, ())
  forward = _program_time(jax.make_jaxpr(loss_fn)(params, *args).jaxpr, rates)

  outvars = closed.jaxpr.outvars
  leaf_keys = [() if hasattr(v, "val") else keys.get(v, ())  # Literal: ()
               for v in outvars]
  order = sorted(range(len(leaf_keys)), key=lambda i: (leaf_keys[i], -i))
  seen = np.zeros(len(atoms), bool)
  ready, shares = [0.0] * len(order), [0.0] * len(order)
  cost, done = 0.0, forward
  cumulative = np.cumsum([t for t, _ in atoms])
  for i in order:
    producers = [] if hasattr(outvars[i], "val") else list(
        env.get(outvars[i], ()))
    if attribution == "position":
      cost = max([cost] + [float(cumulative[a]) for a in producers])
    stack = producers if attribution == "cones" else []
    while stack:  # add the part of leaf i's cone not computed yet
      a = stack.pop()
      if not seen[a]:
        seen[a] = True
        cost += atoms[a][0]
        stack.extend(atoms[a][1])
    ready[i] = cost
    shares[i] = max(0.0, cost - done)
    done = max(done, cost)
  total = float(sum(t for t, _ in atoms))
  return BackwardAnalysis(tuple(order), tuple(ready), tuple(shares), forward,
                          total)


def scale_shares(shares: Sequence[float], measured: float,
                 sizes: Sequence[int] | None = None) -> tuple[float, ...]:
  """Per-leaf times ∝ ``shares`` summing to ``measured`` (≥ 0).

  When every share is 0 (nothing to go by), ∝ ``sizes`` if given, else equal.

  Args:
    shares: per-leaf weights (roofline shares).
    measured: the total to scale to (negative counts as 0).
    sizes: per-leaf fallback weights for all-zero shares.

  Returns:
    Per-leaf times, Σ = max(0, ``measured``).
  """
  measured = max(0.0, float(measured))
  weights = np.asarray(shares, np.float64)
  if weights.size == 0:
    return ()
  if not weights.sum() > 0:
    weights = (np.asarray(sizes, np.float64) if sizes is not None
               else np.ones_like(weights))
  out = weights / weights.sum() * measured
  return tuple(float(t) for t in out)


def _on_device(tree, device):
  return jax.device_put(tree, device)


def measure_forward_backward(loss_fn: Callable, params,
                             example_args: Sequence = (), *, repeats: int = 5,
                             warmup: int = 2, device=None
                             ) -> tuple[float, float]:
  """(T_fwd, B = T_grad − T_fwd ≥ 0) of one worker, on one device.

  Args:
    loss_fn: ``loss_fn(params, *example_args)``, one worker's loss.
    params: the parameters.
    example_args: a sample batch.
    repeats: timed rounds; the median counts.
    warmup: untimed rounds first.
    device: the device (default the first local one).

  Returns:
    (T_fwd, B) in seconds, timed round-robin.
  """
  device = device or jax.local_devices()[0]
  params, args = _on_device((params, tuple(example_args)), device)
  t_fwd, t_grad = time_calls(
      [(_jit(loss_fn), params, *args),
       (_jit(jax.grad(loss_fn)), params, *args)],
      warmup=warmup, repeats=repeats)
  return t_fwd, max(0.0, t_grad - t_fwd)


def derive_backward(loss_fn: Callable, params, example_args: Sequence = (), *,
                    measured: float, rates: tuple[float, float]
                    ) -> tuple[float, ...]:
  """Per-leaf backward times (pytree order), Σ = ``measured``, all ≥ 0.

  Args:
    loss_fn: ``loss_fn(params, *example_args)``, one worker's loss.
    params: the parameters.
    example_args: a sample batch.
    measured: B, the measured backward (seconds).
    rates: (FLOP/s, bytes/s) for ``analyze_backward``.

  Returns:
    Per-leaf backward times: the roofline shares scaled to ``measured``
    (``scale_shares``; by size where every share is 0).
  """
  analysis = analyze_backward(loss_fn, params, example_args, rates=rates)
  sizes = [max(1, int(np.size(x))) for x in jax.tree.leaves(params)]
  return scale_shares(analysis.shares, measured, sizes)


# validate_backward's default: more rounds than a profile's, since its
# prefixes differ from each other by a few leaves' backward.
VALIDATE_TIMING = Timing(repeats=7)


def _upgrade_args(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
  """``validate_backward``'s arguments with the 0.2 form (loss_fn, params,
  example_args=(), backward=None) made (Model, backward), with a
  ``DeprecationWarning``: the upgrade of ``_deprecated.legacy_positional``.
  """
  if args and callable(args[0]):
    warnings.warn(
        "validate_backward(loss_fn, params, example_args, backward) is "
        "deprecated: pass validate_backward(Model(loss_fn, params, "
        "example_args), backward) (jaxfuse.planning.profiling.Model); the "
        "old form goes in 0.4.", DeprecationWarning, stacklevel=3)
    loss_fn, rest = args[0], args[1:]
    params = rest[0] if rest else kwargs.pop("backward", None)
    example_args = rest[1] if len(rest) > 1 else kwargs.pop(
        "example_args", ())
    backward = rest[2] if len(rest) > 2 else kwargs.pop("backward", None)
    return (Model(loss_fn, params, example_args), backward), kwargs
  if len(args) > 2:
    raise TypeError("validate_backward(model, backward) takes 2 positional "
                    f"arguments, not {len(args)}: give the rest by "
                    "keyword.")
  return args, kwargs


@_deprecated.legacy_positional(_upgrade_args)
@_deprecated.legacy_keywords(legacy_groups("validate_backward", 1,
                                           timing=VALIDATE_TIMING))
def validate_backward(model: Model, backward: Sequence[float] | None = None,
                      *, order: Sequence[int] | None = None,
                      num_prefixes: int = 3,
                      timing: Timing = VALIDATE_TIMING,
                      device=None) -> dict:
  """Measured vs derived ready times of the first leaves of the backward.

  For k leaves ready first (``num_prefixes`` values of k spread over the
  ready order), ``jit(grad)`` with respect to only those leaves (the rest of
  the backward is then not computed) gives the measured ready time
  T_k − T_fwd; the derived one is Σ of ``backward`` over those leaves.
  Forward, full gradient and prefixes are timed round-robin (``time_calls``).
  With e_k = (derived_k − measured_k) / B, a share of the whole backward
  pass B, the report's ``mean_abs_error`` is the mean of |e_k|.

  Args:
    model: the ``Model`` (loss, parameters, example arguments). The 0.2
      form ``validate_backward(loss_fn, params, example_args, backward)``
      still works, with a ``DeprecationWarning``.
    backward: derived per-leaf backward times (pytree order); default
      ``derive_backward`` with the device's measured rates.
    order: leaf ids in backward-ready order (default
      ``ordering.ready_order``).
    num_prefixes: how many prefixes of the ready order to measure.
    timing: a ``Timing`` (``repeats`` and ``warmup`` are used).
    device: the device to run on (default the first local one).

  (0.2's keywords ``repeats`` and ``warmup`` still work until 0.4, with a
  ``DeprecationWarning``.)

  Returns:
    {"device", "forward", "backward", "prefixes": [{"leaves", "measured",
    "derived", "error"}], "mean_abs_error"}.

  Raises:
    ProfileError: if ``backward`` has another length than ``params`` has
      leaves.
    TypeError: for more than two positional arguments after a ``Model``,
      or a keyword that is neither its own nor a 0.2 one.
  """
  loss_fn, params, example_args = model
  repeats, warmup = timing.repeats, timing.warmup
  device = device or jax.local_devices()[0]
  leaves, treedef = jax.tree.flatten(params)
  n = len(leaves)
  if backward is not None and len(backward) != n:
    raise ProfileError(f"backward has {len(backward)} times but params has "
                       f"{n} leaves.")
  if order is None:
    order = ordering.ready_order(loss_fn, params, *example_args)
  on_dev, args = _on_device((leaves, tuple(example_args)), device)
  counts = sorted({max(1, round(n * (j + 1) / (num_prefixes + 1)))
                   for j in range(num_prefixes)})

  def prefix_call(k):
    chosen = list(order[:k])
    rest = [i for i in range(n) if i not in set(chosen)]

    def partial_loss(sub, others, *args):
      full = [None] * n
      for i, x in zip(chosen, sub):
        full[i] = x
      for i, x in zip(rest, others):
        full[i] = x
      return loss_fn(jax.tree.unflatten(treedef, full), *args)
    return (_jit(jax.grad(partial_loss)), [on_dev[i] for i in chosen],
            [on_dev[i] for i in rest], *args)

  tree = jax.tree.unflatten(treedef, on_dev)
  calls = [(_jit(loss_fn), tree, *args),
           (_jit(jax.grad(loss_fn)), tree, *args)]
  calls += [prefix_call(k) for k in counts]
  forward, t_grad, *t_prefix = time_calls(calls, warmup=warmup,
                                          repeats=repeats)
  total = max(0.0, t_grad - forward)
  if backward is None:
    rates = machine_rates(device, repeats=repeats, warmup=warmup)
    backward = derive_backward(loss_fn, params, example_args, measured=total,
                               rates=rates)
  rows = []
  for k, t in zip(counts, t_prefix):
    measured = max(0.0, t - forward)
    derived = float(sum(backward[i] for i in order[:k]))
    rows.append({"leaves": k, "measured": measured, "derived": derived,
                 "error": (derived - measured) / total if total > 0 else 0.0})
  return {"device": f"{device.platform} ({device.device_kind})",
          "forward": forward, "backward": total, "prefixes": rows,
          "mean_abs_error": float(np.mean([abs(r["error"]) for r in rows]))}


def synthetic_model(width: int | None = None, layers: int = 4,
                    batch: int = 64):
  """(loss_fn, params, (x,)): a tanh MLP of ``layers`` (width, width)
  layers, for the measurements that need a model and are given none (η,
  the per-bucket cost).

  Args:
    width: each layer's side (default 256 on a CPU, 4096 elsewhere).
    layers: how many layers.
    batch: rows of the sample batch.

  Returns:
    A ``Model`` (loss_fn, params, (x,)), seeded (the same every call).
  """
  if width is None:
    width = 256 if jax.devices()[0].platform == "cpu" else 4096
  rng = np.random.default_rng(0)
  params = [rng.standard_normal((width, width), np.float32) / math.sqrt(width)
            for _ in range(layers)]
  x = rng.standard_normal((batch, width), np.float32)

  def loss_fn(params, x):
    for w in params:
      x = jnp.tanh(x @ w)
    return jnp.mean(x * x)
  return Model(loss_fn, params, (x,))
