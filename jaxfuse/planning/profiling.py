"""Measure the cost model on the current devices: ``profile(...) -> Costs``.

Every time below is the median of ``repeats`` runs after ``warmup`` runs
(the first compiles), each run waited for with ``block_until_ready``
(``timing``).

  collectives  for each size x (bytes per worker) of a sweep, a chain of
               ``chain`` dependent collectives in one jitted ``shard_map``
               over the data axis, the same ones jaxfuse issues: an
               ``all_gather`` of a uint32 wire buffer (a sparse bucket) and a
               ``psum`` of a float32 buffer (a dense bucket).
               t(x) = time / chain (so one dispatch is not counted as
               latency); fitted g(x) = α + β·x (``costs.fit_linear``).
  compress     ``sparse_sync``'s update of one bucket of c and of 2c units
               of x elements (c = ``chain``) on a one-device mesh, timed
               round-robin (the estimator, density and headroom a plan
               would use): what one more unit costs,
               h(x) = (t_2c − t_c) / c, fitted h(x) = α_h + β_h·x. (The
               step's dispatch and its one bucket's kernels cancel; what
               a bucket costs beyond its units is ``bucket``.)
  bucket       the ``send_early`` training step of an MLP of u layers on
               one device, planned as one sparse bucket and as u: the
               compute per extra sparse bucket (``bucket_cost``).
  schemes      one bucket moved by each of ``auto``'s other schemes against
               all_gather, less the difference of their wire steps: the
               scheme's compute per bucket of c slots, fitted
               e_s(c) = α_s + β_s·c (``measure_scheme_costs``).
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

The backward's attribution, measurement and validation live in
``backward``, the timing helpers in ``timing``; their names are re-exported
here (``profiling`` was one module up to 0.2).

Every program is compiled with ``jaxfuse.xla_options()``, as a train step
should be, so the costs describe the step that will run.
"""

from __future__ import annotations

import datetime
import math
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
from jaxfuse import bucket_steps
from jaxfuse import plans as plan_lib
from jaxfuse.planning.timing import jit as _jit
from jaxfuse.version import __version__

# Also re-exported: profiling was one module up to 0.2 (tests, benchmarks and
# user code import these from here).
from jaxfuse.planning.backward import ATTRIBUTIONS
from jaxfuse.planning.backward import BackwardAnalysis
from jaxfuse.planning.backward import FREE_PRIMITIVES
from jaxfuse.planning.backward import analyze_backward
from jaxfuse.planning.backward import derive_backward
from jaxfuse.planning.backward import equation_work
from jaxfuse.planning.backward import machine_rates
from jaxfuse.planning.backward import measure_forward_backward
from jaxfuse.planning.backward import scale_shares
from jaxfuse.planning.backward import synthetic_model
from jaxfuse.planning.backward import validate_backward
from jaxfuse.planning.bucket_cost import measure_bucket_cost
from jaxfuse.planning.timing import Progress
from jaxfuse.planning.timing import ProfileError
from jaxfuse.planning.timing import human_bytes
from jaxfuse.planning.timing import text_progress
from jaxfuse.planning.timing import time_call
from jaxfuse.planning.timing import time_calls

__all__ = [
    "ATTRIBUTIONS", "BackwardAnalysis", "DEFAULT_COMPRESS_SIZES",
    "DEFAULT_SCHEME_SIZES", "DEFAULT_SIZES", "FREE_PRIMITIVES",
    "ProfileError", "Progress",
    "analyze_backward", "collective_chain", "contention_factor",
    "default_compress_sizes", "default_sizes", "derive_backward",
    "equation_work", "human_bytes", "machine_rates", "measure_collective",
    "measure_bucket_cost", "measure_compress", "measure_contention",
    "measure_forward_backward", "measure_overlap", "measure_scheme_costs",
    "overlap_factor", "profile", "same_on_every_process", "scale_shares",
    "synthetic_model", "text_progress", "time_call", "time_calls",
    "validate_backward",
]

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
# Elements per leaf of the schemes' buckets (``measure_scheme_costs``).
DEFAULT_SCHEME_SIZES = {"cpu": (2**14, 2**17), "other": (2**18, 2**22)}


def _platform_key() -> str:
  return "cpu" if jax.devices()[0].platform == "cpu" else "other"


def default_sizes() -> tuple[int, ...]:
  """The collective sweep (bytes per worker) for the current platform."""
  return DEFAULT_SIZES[_platform_key()]


def default_compress_sizes() -> tuple[int, ...]:
  """The compression sweep (elements) for the current platform."""
  return DEFAULT_COMPRESS_SIZES[_platform_key()]


# --- collectives --------------------------------------------------------------

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
  """η = (T_bwd + T_comm − T_both) / min(T_bwd, T_comm) in [0, 1]: what
  hid, as a share of what an ideal overlap could hide (``simulate``'s η; 1
  when there is nothing to hide)."""
  ideal = min(t_backward, t_comm)
  if ideal <= 0:
    return 1.0
  return float(min(1.0, max(0.0, (t_backward + t_comm - t_both) / ideal)))


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


# --- compression --------------------------------------------------------------

def measure_compress(sizes: Sequence[int], *, estimator: str = "dgc",
                     density: float = 0.01, headroom: float = 1.5,
                     repeats: int = 5, warmup: int = 2, chain: int = 4,
                     device=None,
                     progress: Callable[[str], None] | None = None
                     ) -> list[tuple[int, float]]:
  """[(elements, seconds)]: what one more selection unit of x elements
  adds to a sparse bucket.

  What a step runs: ``sparse_sync``'s update for one bucket of float32
  leaves of x elements each (one state group: the batched k-th largests,
  the fused pass, packing, the collective, decoding, the residual and the
  statistics) on a one-device mesh, so the collective moves nothing; once
  with c = ``chain`` leaves and once with 2c, timed round-robin:
  h = max(0, t_2c − t_c) / c. The time per update divided by its units
  (what this measured before) also counted the dispatch and the bucket's
  own kernels once per unit: α = 0.12–0.14 ms per unit on 2 × H200, so
  gpt2-small's 97 units came to 11.3 ms where its traced compression
  kernels take about 2 ms.
  """
  if estimator not in plan_lib.ESTIMATORS:
    raise ProfileError(f"estimator={estimator!r}; use one of "
                       f"{plan_lib.ESTIMATORS}.")
  if not (plan_lib.is_int(chain) and chain >= 1):
    raise ProfileError(f"chain={chain!r} must be an int >= 1.")
  device = device or jax.local_devices()[0]
  mesh = jax.sharding.Mesh(np.array([device]), ("data",))
  out = []
  for n in sizes:
    n = int(n)
    if progress:
      progress(f"compress {n:,} elements")
    t_c, t_2c = _time_sparse_steps(
        mesh, [[n] * chain, [n] * (2 * chain)], "single",
        estimator=estimator, density=density, headroom=headroom,
        repeats=repeats, warmup=warmup)
    out.append((n, max(0.0, t_2c - t_c) / chain))
  return out


def measure_scheme_costs(mesh, lines: costs_lib.Costs, *,
                         sizes: Sequence[int] | None = None,
                         units: int = 4, estimator: str = "dgc",
                         density: float = 0.01, headroom: float = 1.5,
                         repeats: int = 5, warmup: int = 2,
                         axis_name: str = "data"
                         ) -> tuple[dict[str, costs_lib.LinearCost], dict]:
  """({scheme: e_s}, raw): the compute each sparse scheme of ``auto``'s
  other than all_gather adds to a bucket (``Costs.schemes``).

  For each x of ``sizes``: one sparse bucket of ``units`` float32 leaves
  of x elements on ``mesh``, moved by all_gather (t_ag) and by the scheme
  (t_s). e = t_s − t_ag − (its wire steps − all_gather's, from ``lines``'
  collective lines) at c = the bucket's slots; fitted e_s(c) = α_s + β_s·c
  (α, β ≥ 0). A scheme that cannot run on this mesh is left out.
  ``sizes`` defaults to ``DEFAULT_SCHEME_SIZES`` of the platform.
  """
  from jaxfuse import collectives  # pylint: disable=g-import-not-at-top
  from jaxfuse.planning import planner  # pylint: disable=g-import-not-at-top
  k = mesh.shape[axis_name]
  sizes = tuple(int(x) for x in (sizes or
                                 DEFAULT_SCHEME_SIZES[_platform_key()]))
  _check_sweep("sizes", sizes)
  kw = dict(estimator=estimator, density=density, headroom=headroom,
            repeats=repeats, warmup=warmup, axis_name=axis_name)

  def wire(plan):
    return math.fsum(lines.steps_time(s, k)
                     for s in collectives.bucket_steps(
                         bucket_steps.compile_plan(plan), k))
  points, raw = {}, {"units": units, "points": {}}
  for x in sizes:
    t_ag, plan_ag = _time_sparse_step(mesh, [int(x)] * units, "single", **kw)
    slots = sum(l.capacity for l in plan_ag.leaves)
    for name in planner.AUTO_COLLECTIVES:
      if name == "allgather":
        continue
      try:
        collectives.get(name).check("profile", k, plan_ag.settings)
      except collectives.SchemeError:
        continue
      t_s, plan_s = _time_sparse_step(mesh, [int(x)] * units, "single",
                                      collective=name, **kw)
      e = t_s - t_ag - (wire(plan_s) - wire(plan_ag))
      points.setdefault(name, []).append((slots, e))
      raw["points"].setdefault(name, []).append([slots, t_s, t_ag, e])
  fits = {name: costs_lib.fit_linear(*zip(*pts))
          for name, pts in points.items() if len({c for c, _ in pts}) > 1}
  return fits, raw


def _check_sweep(name: str, sweep: Sequence[int]) -> None:
  if len(set(sweep)) < 2 or min(sweep) < 1:
    raise ProfileError(f"{name}={list(sweep)} needs at least two distinct "
                       "sizes >= 1 (one size cannot separate α from β).")


def _sparse_step(mesh, sizes, strategy, *, estimator, density, headroom,
                 axis_name="data", collective="allgather"):
  """(step, args, plan): one jitted ``sparse_sync`` update of float32
  leaves of ``sizes`` (standard normal, the same on every device of
  ``mesh``), planned as ``strategy`` with every leaf sparse and moved by
  ``collective``, and the arguments to call it with."""
  from jaxfuse import placement  # pylint: disable=g-import-not-at-top
  from jaxfuse import transform  # pylint: disable=g-import-not-at-top
  from jaxfuse.planning import planner  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(sum(sizes))
  grads = [jax.device_put(rng.standard_normal(n, np.float32),
                          NamedSharding(mesh, P())) for n in sizes]
  plan = planner.plan(grads, density=density, strategy=strategy,
                      estimator=estimator, headroom=headroom,
                      min_sparse_size=1, collective=collective)
  opt = transform.sparse_sync(plan, axis_name=axis_name)
  state = placement.init_state(opt, grads, mesh, axis_name=axis_name)
  specs = placement.state_specs(state, axis_name)
  step = _jit(jax.shard_map(
      lambda g, s: opt.update(_compat.to_varying(g, axis_name), s),
      mesh=mesh, in_specs=(P(), specs), out_specs=(P(), specs)))
  return step, (grads, state), plan


def _time_sparse_step(mesh, sizes, strategy, *, repeats, warmup, **kw):
  """(seconds, plan) of one ``_sparse_step`` update."""
  step, args, plan = _sparse_step(mesh, sizes, strategy, **kw)
  return time_call(step, *args, warmup=warmup, repeats=repeats), plan


def _time_sparse_steps(mesh, size_lists, strategy, *, repeats, warmup,
                       **kw) -> list[float]:
  """Seconds of one ``_sparse_step`` update per list of leaf sizes, timed
  round-robin (``time_calls``), so that their differences hold."""
  steps = [_sparse_step(mesh, sizes, strategy, **kw) for sizes in size_lists]
  return time_calls([(step, *args) for step, args, _ in steps],
                    warmup=warmup, repeats=repeats)


# --- overlap ------------------------------------------------------------------

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


# --- everything ---------------------------------------------------------------

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
  if axis_name in mesh.axis_names and mesh.shape[axis_name] < 2:
    raise ProfileError(
        f"the mesh's axis {axis_name!r} has one device: its collectives move "
        "nothing, so there is no communication to measure (and the costs "
        "read each line per link, over K₀ − 1 >= 1 links). Profile on 2 or "
        "more devices.")
  sizes = tuple(int(s) for s in (sizes or default_sizes()))
  compress_sizes = tuple(int(s) for s in
                         (compress_sizes or default_compress_sizes()))
  _check_sweep("sizes", sizes)
  _check_sweep("compress_sizes", compress_sizes)
  timing = dict(repeats=repeats, warmup=warmup)
  total = (len(costs_lib.MEASURABLE) * len(sizes) + len(compress_sizes) + 4 +
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

  step("bucket cost: one sparse bucket against one per layer")
  bucket, bucket_raw = measure_bucket_cost(
      mesh, estimator=estimator, density=density, headroom=headroom,
      axis_name=axis_name, **timing)
  step("schemes: one bucket moved by each scheme against all_gather")
  schemes, schemes_raw = measure_scheme_costs(
      mesh, costs_lib.Costs(collectives, compress, (),
                            workers=mesh.shape[axis_name]),
      estimator=estimator, density=density, headroom=headroom,
      axis_name=axis_name, **timing)

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
      "bucket": bucket_raw, "schemes": schemes_raw,
  }
  if backward_raw:
    provenance["backward"] = backward_raw
    # the model measured, so that planning another one is refused
    provenance["leaves"] = _model_leaves(params)
  return same_on_every_process(costs_lib.Costs(
      collectives, compress, backward, contention=gamma, overlap=eta,
      forward=forward, provenance=provenance,
      workers=mesh.shape[axis_name], bucket=bucket, schemes=schemes))


def _model_leaves(params) -> list[list]:
  """[path, shape] per leaf of ``params``, pytree order, paths as
  ``jaxfuse.plan`` names them (``Costs.model_leaves``)."""
  return [[jax.tree_util.keystr(path), [int(d) for d in np.shape(x)]]
          for path, x in jax.tree_util.tree_flatten_with_path(params)[0]]


def same_on_every_process(costs: costs_lib.Costs) -> costs_lib.Costs:
  """Process 0's ``costs`` on every process of a ``jax.distributed`` job
  (one process: ``costs`` itself); every process must call it.

  Each process times with its own clock, so its fits differ a little, and
  cost-strategy plans made from different costs can differ: the processes
  would then compile programs whose collectives never match (a hang, not
  an error). ``profile`` returns this, so all processes plan alike."""
  if jax.process_count() == 1:
    return costs
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  text = costs.to_json().encode() if jax.process_index() == 0 else b""
  size = int(multihost_utils.broadcast_one_to_all(np.int32(len(text))))
  buf = np.zeros(size, np.uint8)
  if jax.process_index() == 0:
    buf[:] = np.frombuffer(text, np.uint8)
  buf = np.asarray(multihost_utils.broadcast_one_to_all(buf), np.uint8)
  return costs_lib.Costs.from_json(buf.tobytes().decode())
