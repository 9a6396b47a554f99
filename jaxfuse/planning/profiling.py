"""Measure the cost model on the current devices: ``profile(...) -> Costs``.

Every time below is the median of ``repeats`` runs after ``warmup`` runs
(the first compiles), each run waited for with ``block_until_ready``.

  collectives  for each size x (bytes per worker) of a sweep, a chain of
               ``chain`` dependent collectives in one jitted ``shard_map``
               over the data axis, the same ones jaxfuse issues: an
               ``all_gather`` of a uint32 wire buffer (a sparse bucket) and a
               ``psum`` of a float32 buffer (a dense bucket).
               t(x) = time / chain (so one dispatch is not counted as
               latency); fitted g(x) = α + β·x (``costs.fit_linear``).
  compress     ``sparse_sync``'s update of one bucket of ``chain`` units of x
               elements on a one-device mesh, per unit (the estimator,
               density and headroom a plan would use), fitted
               h(x) = α_h + β_h·x.
  contention   γ (ASC-WFBP Eq. 9): two independent psums of m bytes at once
               take T₂ = α + γ·β·m, one takes T₁ = α + β·m, so
               γ = (T₂ − α) / (T₁ − α), clipped to [1, 2] (2: XLA ran them
               one after the other, or merged them into one).
  overlap      η = (T_bwd + T_comm − T_both) / T_comm, clipped to [0, 1]:
               the model's backward alone, its gradients' all-reduce alone,
               and both in one jit (the hidden share of the communication).
               Without a model, on a small synthetic MLP.
  forward      T_fwd = time(jit(loss)).
  backward     B = time(jit(grad(loss))) − T_fwd on one device, split over
               the leaves by ``analyze_backward`` (the program's own
               roofline costs, see there) and scaled so Σ backward = B.

``validate_backward`` measures the true ready times of a few prefixes of the
ready order and reports the error of the derived times (docs/cli.md).

Every program is compiled with ``jaxfuse.xla_options()``, as a train step
should be, so the costs describe the step that will run.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import statistics
import sys
import time
from typing import Any, Callable, Sequence

import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np

from jaxfuse import _compat
from jaxfuse import compile_options
from jaxfuse.planning import costs as costs_lib
from jaxfuse.planning import ordering
from jaxfuse import plans as plan_lib
from jaxfuse.version import __version__

Progress = Callable[[int, int, str], None]  # (done, total, what is next)

# Default sweeps per platform: bytes per worker for the collectives, elements
# for compression. The CPU ones keep a whole profile well under a minute on 8
# simulated devices; the accelerator ones reach bucket sizes that matter.
DEFAULT_SIZES = {
    "cpu": (2**12, 2**15, 2**18, 2**21),
    "other": (2**12, 2**15, 2**18, 2**21, 2**24, 2**26),
}
DEFAULT_COMPRESS_SIZES = {
    "cpu": (2**12, 2**15, 2**18),
    "other": (2**12, 2**15, 2**18, 2**21, 2**24),
}
# Operations that move no data once XLA has fused them (cost 0).
FREE_PRIMITIVES = frozenset({
    "reshape", "squeeze", "expand_dims", "broadcast_in_dim", "pvary", "pcast",
    "stop_gradient", "iota", "copy", "copy_p", "device_put",
    "optimization_barrier"})


def _jit(fn):
  """``jax.jit`` with the train step's options (``jaxfuse.xla_options``)."""
  return jax.jit(fn, compiler_options=compile_options.xla_options() or None)


class ProfileError(ValueError):
  """Arguments the profiler cannot measure with."""


def _platform_key() -> str:
  return "cpu" if jax.devices()[0].platform == "cpu" else "other"


def default_sizes() -> tuple[int, ...]:
  """The collective sweep (bytes per worker) for the current platform."""
  return DEFAULT_SIZES[_platform_key()]


def default_compress_sizes() -> tuple[int, ...]:
  """The compression sweep (elements) for the current platform."""
  return DEFAULT_COMPRESS_SIZES[_platform_key()]


# --- timing -------------------------------------------------------------------

def time_calls(calls: Sequence[tuple], *, warmup: int = 2,
               repeats: int = 5) -> list[float]:
  """Median wall time (seconds) of each ``(fn, *args)`` in ``calls``.

  Each is called ``warmup`` times first (at least once: compilation is never
  timed); then the calls are timed round-robin, ``repeats`` rounds, so a
  machine that gets busier or quieter meanwhile shifts them all alike (the
  differences we take stay meaningful).
  """
  if repeats < 1 or warmup < 0:
    raise ProfileError(f"repeats={repeats} must be >= 1 and warmup={warmup} "
                       ">= 0.")
  for fn, *args in calls:
    for _ in range(max(1, warmup)):
      jax.block_until_ready(fn(*args))
  times = [[] for _ in calls]
  for _ in range(repeats):
    for out, (fn, *args) in zip(times, calls):
      t0 = time.perf_counter()
      jax.block_until_ready(fn(*args))
      out.append(time.perf_counter() - t0)
  return [statistics.median(t) for t in times]


def time_call(fn: Callable, *args, warmup: int = 2, repeats: int = 5) -> float:
  """Median wall time of ``fn(*args)`` in seconds, after ``warmup`` calls."""
  return time_calls([(fn, *args)], warmup=warmup, repeats=repeats)[0]


def text_progress(stream=None, width: int = 24) -> Progress:
  """A plain-text progress bar: ``[#####-----] 5/10 psum 256 KiB``."""
  stream = sys.stderr if stream is None else stream
  tty = getattr(stream, "isatty", lambda: False)()

  def show(done: int, total: int, what: str) -> None:
    filled = int(width * done / max(total, 1))
    line = f"[{'#' * filled}{'-' * (width - filled)}] {done}/{total} {what}"
    if tty:
      stream.write("\r" + line.ljust(79) + ("\n" if done == total else ""))
    else:
      stream.write(line + "\n")
    stream.flush()
  return show


def human_bytes(n: float) -> str:
  for unit in ("B", "KiB", "MiB", "GiB"):
    if abs(n) < 1024 or unit == "GiB":
      return f"{n:.0f} {unit}" if unit == "B" else f"{n:.4g} {unit}"
    n /= 1024
  return f"{n} GiB"


# --- collectives ----------------------------------------------------------------

def collective_chain(kind: str, mesh, nbytes: int, *, chain: int = 4,
                     parallel: int = 1, axis_name: str = "data"):
  """(fn, inputs): ``chain`` dependent rounds of ``parallel`` collectives.

  ``kind`` is ``"allgather"`` (uint32 words, the sparse wire buffer, gathered
  to (K, n) typed invariant as jaxfuse does), ``"psum"`` (float32),
  ``"alltoall"`` (K tiles of n/K words) or ``"ppermute"`` (n words to the
  next worker on a ring: ZEN's and SparDL's primitives). Each
  round feeds the next, so the rounds never overlap; the ``parallel``
  collectives of one round are independent (for contention).
  """
  if kind not in costs_lib.MEASURABLE:
    raise ProfileError(f"kind={kind!r}; use one of {costs_lib.MEASURABLE}.")
  if axis_name not in mesh.axis_names:
    raise ProfileError(f"mesh has axes {mesh.axis_names}, not {axis_name!r}.")
  k = mesh.shape[axis_name]
  n = max(1, int(nbytes) // 4)
  if kind == "alltoall":
    n = k * max(1, n // k)
  dtype = np.float32 if kind == "psum" else np.uint32

  def one(x):
    if kind == "allgather":
      return _compat.all_gather_invariant(x, axis_name)[k - 1]
    if kind == "alltoall":
      return lax.all_to_all(x.reshape(k, -1), axis_name, 0, 0,
                            tiled=True).reshape(-1)
    if kind == "ppermute":
      return lax.ppermute(x, axis_name, [(i, (i + 1) % k) for i in range(k)])
    return lax.psum(x, axis_name)

  def body(*xs):
    for _ in range(chain):
      ys = [one(x) for x in xs]
      xs = [_compat.to_varying(y, axis_name) for y in ys]
    return tuple(ys)

  same = kind in ("allgather", "psum")  # results identical on every worker
  fn = _jit(jax.shard_map(body, mesh=mesh,
                             in_specs=(P(axis_name),) * parallel,
                             out_specs=(P() if same else P(axis_name),) *
                             parallel))
  sharding = NamedSharding(mesh, P(axis_name))
  inputs = [jax.device_put(np.full((k * n,), i + 1, dtype), sharding)
            for i in range(parallel)]
  return fn, inputs


def measure_collective(kind: str, mesh, sizes: Sequence[int], *,
                       chain: int = 4, repeats: int = 5, warmup: int = 2,
                       axis_name: str = "data",
                       progress: Callable[[str], None] | None = None
                       ) -> list[tuple[int, float]]:
  """[(bytes per worker, seconds per collective)] over ``sizes``."""
  out = []
  for nbytes in sizes:
    if progress:
      progress(f"{kind} {human_bytes(nbytes)}")
    fn, inputs = collective_chain(kind, mesh, nbytes, chain=chain,
                                  axis_name=axis_name)
    t = time_call(fn, *inputs, warmup=warmup, repeats=repeats)
    out.append((inputs[0].size // mesh.shape[axis_name] * 4, t / chain))
  return out


def contention_factor(t_one: float, t_two: float, alpha: float) -> float:
  """γ = (T₂ − α)/(T₁ − α) in [1, 2] (ASC-WFBP Eq. 9; 1 when T₁ ≤ α)."""
  if t_one - alpha <= 0:
    return 1.0
  return float(min(2.0, max(1.0, (t_two - alpha) / (t_one - alpha))))


def overlap_factor(t_backward: float, t_comm: float, t_both: float) -> float:
  """η = (T_bwd + T_comm − T_both)/T_comm in [0, 1] (1 when T_comm ≤ 0)."""
  if t_comm <= 0:
    return 1.0
  return float(min(1.0, max(0.0, (t_backward + t_comm - t_both) / t_comm)))


def measure_contention(mesh, nbytes: int, alpha: float, *, chain: int = 4,
                       repeats: int = 5, warmup: int = 2,
                       axis_name: str = "data") -> tuple[float, dict]:
  """γ from one vs two simultaneous psums of ``nbytes``; and the raw times."""
  calls = [collective_chain("psum", mesh, nbytes, chain=chain,
                            parallel=parallel, axis_name=axis_name)
           for parallel in (1, 2)]
  one, two = (t / chain for t in time_calls(
      [(fn, *inputs) for fn, inputs in calls], warmup=warmup,
      repeats=repeats))
  gamma = contention_factor(one, two, alpha)
  return gamma, {"bytes": int(nbytes), "one": one, "two": two,
                 "alpha": alpha}


# --- compression -----------------------------------------------------------------

def measure_compress(sizes: Sequence[int], *, estimator: str = "dgc",
                     density: float = 0.01, headroom: float = 1.5,
                     repeats: int = 5, warmup: int = 2, chain: int = 4,
                     device=None,
                     progress: Callable[[str], None] | None = None
                     ) -> list[tuple[int, float]]:
  """[(elements, seconds)]: one selection unit's share of a sparse bucket.

  What a step runs: ``sparse_sync``'s update for one bucket of ``chain``
  float32 leaves of x elements each (one state group: the batched k-th
  largests, the fused pass, packing, the collective, decoding, the residual
  and the statistics) on a one-device mesh, so the collective moves
  nothing; t = time / chain. (Timing one ``sparsify_unit`` at a time
  measured a path steps no longer run: α = 0.26–0.31 ms per unit on
  2 × H200, against 0.12–0.14 ms this way; docs/benchmarks.md.)
  """
  from jaxfuse import transform  # pylint: disable=g-import-not-at-top
  from jaxfuse.planning import planner  # pylint: disable=g-import-not-at-top
  if estimator not in plan_lib.ESTIMATORS:
    raise ProfileError(f"estimator={estimator!r}; use one of "
                       f"{plan_lib.ESTIMATORS}.")
  device = device or jax.local_devices()[0]
  mesh = jax.sharding.Mesh(np.array([device]), ("data",))
  out = []
  for n in sizes:
    n = int(n)
    if progress:
      progress(f"compress {n:,} elements")
    rng = np.random.default_rng(n)
    grads = [jax.device_put(rng.standard_normal(n, np.float32), device)
             for _ in range(chain)]
    plan = planner.plan(grads, density=density, strategy="single",
                        estimator=estimator, headroom=headroom,
                        min_sparse_size=1)
    opt = transform.sparse_sync(plan)
    state = transform.init_state(opt, grads, mesh)
    specs = transform.state_specs(state)
    step = _jit(jax.shard_map(
        lambda g, s: opt.update(_compat.to_varying(g, "data"), s),
        mesh=mesh, in_specs=(P(), specs),
        out_specs=(P(), specs)))
    t = time_call(step, grads, state, warmup=warmup, repeats=repeats)
    out.append((n, t / chain))
  return out


# --- the program's own costs: per-leaf backward attribution ---------------------

def machine_rates(device=None, *, repeats: int = 5,
                  warmup: int = 2) -> tuple[float, float]:
  """(FLOP/s of a float32 matmul, bytes/s of an elementwise op) on ``device``."""
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


def _opaque_jaxprs(eqn) -> tuple[list, int, str]:
  """(sub-jaxprs, trip count, how to combine) of control flow we don't enter."""
  p = eqn.params
  if eqn.primitive.name == "scan":
    return [p["jaxpr"]], int(p.get("length", 1)), "sum"
  if "branches" in p:
    return list(p["branches"]), 1, "max"
  if "body_jaxpr" in p:
    return [p["body_jaxpr"], p["cond_jaxpr"]], 1, "sum"
  return [], 1, "sum"


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
    subs, trips, combine = _opaque_jaxprs(eqn)
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
  """(T_fwd, B = T_grad − T_fwd ≥ 0) of one worker, on one device."""
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
  """Per-leaf backward times (pytree order), Σ = ``measured``, all ≥ 0."""
  analysis = analyze_backward(loss_fn, params, example_args, rates=rates)
  sizes = [max(1, int(np.size(x))) for x in jax.tree.leaves(params)]
  return scale_shares(analysis.shares, measured, sizes)


def validate_backward(loss_fn: Callable, params, example_args: Sequence = (),
                      backward: Sequence[float] | None = None, *,
                      order: Sequence[int] | None = None,
                      num_prefixes: int = 3, repeats: int = 7,
                      warmup: int = 2, device=None) -> dict:
  """Measured vs derived ready times of the first leaves of the backward.

  For k leaves ready first (``num_prefixes`` values of k spread over the
  ready order), ``jit(grad)`` with respect to only those leaves (the rest of
  the backward is then not computed) gives the measured ready time
  T_k − T_fwd; the derived one is Σ of ``backward`` over those leaves.
  Forward, full gradient and prefixes are timed round-robin (``time_calls``).
  ``backward`` defaults to ``derive_backward`` with measured rates.

  Returns {"device", "forward", "backward", "prefixes": [{"leaves",
  "measured", "derived", "error"}], "mean_abs_error"}, with error =
  (derived − measured) / backward, a share of the whole backward pass.
  """
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


# --- overlap --------------------------------------------------------------------

def synthetic_model(width: int | None = None, layers: int = 4,
                    batch: int = 64):
  """(loss_fn, params, (x,)): an MLP used for η when no model is given."""
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
  return loss_fn, params, (x,)


def measure_overlap(mesh, loss_fn: Callable, params,
                    example_args: Sequence = (), *, repeats: int = 5,
                    warmup: int = 2, axis_name: str = "data"
                    ) -> tuple[float, dict]:
  """η from backward alone, all-reduce alone and both in one jit (per worker:
  the gradient of ``loss_fn`` on the whole example batch)."""
  k = mesh.shape[axis_name]
  replicated = NamedSharding(mesh, P())
  params, args = jax.device_put((params, tuple(example_args)), replicated)
  nargs = len(args)

  def local_grad(p, *a):
    return jax.grad(loss_fn)(_compat.to_varying(p, axis_name), *a)

  shard = lambda f, out: _jit(jax.shard_map(
      f, mesh=mesh, in_specs=(P(),) * (1 + nargs), out_specs=out))
  backward = shard(lambda p, *a: jax.tree.map(lambda g: g[None],
                                              local_grad(p, *a)), P(axis_name))
  both = shard(lambda p, *a: lax.pmean(local_grad(p, *a), axis_name), P())
  comm = _jit(jax.shard_map(
      lambda g: lax.pmean(jax.tree.map(lambda x: x[0], g), axis_name),
      mesh=mesh, in_specs=(P(axis_name),), out_specs=P()))
  grads = jax.device_put(
      jax.tree.map(lambda x: np.ones((k,) + np.shape(x), jnp.result_type(x)),
                   params), NamedSharding(mesh, P(axis_name)))
  t_bwd, t_comm, t_both = time_calls(
      [(backward, params, *args), (comm, grads), (both, params, *args)],
      warmup=warmup, repeats=repeats)
  eta = overlap_factor(t_bwd, t_comm, t_both)
  return eta, {"backward": t_bwd, "comm": t_comm, "both": t_both}


# --- everything -------------------------------------------------------------------

def profile(mesh=None, *, loss_fn: Callable | None = None, params=None,
            example_args: Sequence = (), sizes: Sequence[int] | None = None,
            compress_sizes: Sequence[int] | None = None, repeats: int = 5,
            warmup: int = 2, chain: int = 4, estimator: str = "dgc",
            density: float = 0.01, headroom: float = 1.5,
            axis_name: str = "data",
            progress: Progress | None = None) -> costs_lib.Costs:
  """Measure a ``Costs`` on ``mesh`` (default: all devices, axis ``"data"``).

  With ``loss_fn`` and ``params`` (``loss_fn(params, *example_args)``: one
  worker's loss on a sample batch) also the forward time, the per-leaf
  backward times (pytree order; see the module docstring) and η on that
  model; without, ``backward`` is empty (costs for any plan's communication)
  and η is measured on ``synthetic_model()``. ``progress(done, total, what)``
  is called before each measurement and once at the end.
  """
  if (loss_fn is None) != (params is None):
    raise ProfileError("give both loss_fn and params (a model), or neither.")
  mesh = mesh if mesh is not None else _compat.make_mesh(axis_name=axis_name)
  sizes = tuple(int(s) for s in (sizes or default_sizes()))
  compress_sizes = tuple(int(s) for s in
                         (compress_sizes or default_compress_sizes()))
  for name, sweep in (("sizes", sizes), ("compress_sizes", compress_sizes)):
    if len(set(sweep)) < 2 or min(sweep) < 1:
      raise ProfileError(f"{name}={list(sweep)} needs at least two distinct "
                         "sizes >= 1 (one size cannot separate α from β).")
  timing = dict(repeats=repeats, warmup=warmup)
  total = (len(costs_lib.MEASURABLE) * len(sizes) + len(compress_sizes) + 2 +
           (2 if loss_fn else 0))
  done = [0]

  def step(what):
    if progress:
      progress(done[0], total, what)
    done[0] += 1

  samples = {kind: measure_collective(kind, mesh, sizes, chain=chain,
                                      axis_name=axis_name, progress=step,
                                      **timing)
             for kind in costs_lib.MEASURABLE}
  collectives = {kind: costs_lib.fit_linear(*zip(*pts))
                 for kind, pts in samples.items()}
  samples["compress"] = measure_compress(
      compress_sizes, estimator=estimator, density=density,
      headroom=headroom, chain=chain, progress=step, **timing)
  compress = costs_lib.fit_linear(*zip(*samples["compress"]))

  step(f"contention: two psums of {human_bytes(max(sizes))}")
  gamma, contention_raw = measure_contention(
      mesh, max(sizes), collectives["psum"].alpha, chain=chain,
      axis_name=axis_name, **timing)

  step("overlap: backward, all-reduce, both")
  model = (loss_fn, params, tuple(example_args)) if loss_fn else \
      synthetic_model()
  eta, overlap_raw = measure_overlap(mesh, *model, axis_name=axis_name,
                                     **timing)
  overlap_raw["model"] = "given" if loss_fn else "synthetic MLP"

  forward, backward, backward_raw = 0.0, (), None
  if loss_fn is not None:
    step("forward and backward")
    forward, measured = measure_forward_backward(loss_fn, params,
                                                 example_args, **timing)
    step("backward per leaf (the gradient's jaxpr)")
    rates = machine_rates(**timing)
    analysis = analyze_backward(loss_fn, params, example_args, rates=rates)
    sizes_ = [max(1, int(np.size(x))) for x in jax.tree.leaves(params)]
    roofline = float(sum(analysis.shares))
    method = "jaxpr roofline shares scaled to time(grad) - time(loss)"
    backward_time = measured
    if measured <= 0 and analysis.forward > 0:
      # Below the timing noise (a tiny model): the roofline backward, in the
      # forward's measured / roofline ratio.
      backward_time = roofline * forward / analysis.forward
      method = ("time(grad) - time(loss) <= 0 (below timing noise): roofline "
                "backward x measured/roofline forward")
    backward = scale_shares(analysis.shares, backward_time, sizes_)
    backward_raw = {"method": method, "measured": measured,
                    "roofline": roofline,
                    "roofline_forward": analysis.forward,
                    "flops_per_s": rates[0], "bytes_per_s": rates[1]}
  if progress:
    progress(total, total, "done")

  dev = jax.devices()[0]
  provenance: dict[str, Any] = {
      "tool": "jaxfuse profile", "jaxfuse_version": __version__,
      "jax_version": jax.__version__,
      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
          timespec="seconds"),
      "devices": {"platform": dev.platform, "kind": dev.device_kind,
                  "mesh": {str(a): int(s) for a, s in mesh.shape.items()},
                  "processes": jax.process_count()},
      "timing": {"repeats": repeats, "warmup": warmup, "chain": chain},
      "compiler_options": compile_options.xla_options(),
      "compress": {"estimator": estimator, "density": density,
                   "headroom": headroom},
      "samples": {k: [[int(x), float(t)] for x, t in v]
                  for k, v in samples.items()},
      "contention": contention_raw, "overlap": overlap_raw,
  }
  if backward_raw:
    provenance["backward"] = backward_raw
  return costs_lib.Costs(collectives, compress, backward, contention=gamma,
                         overlap=eta, forward=forward, provenance=provenance,
                         workers=max(2, mesh.shape[axis_name]))
