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
``backward``, the compression, bucket and scheme costs in ``bucket_cost``,
the timing helpers in ``timing``; their names are re-exported here
(``profiling`` was one module up to 0.2). What a measurement is given is
grouped: ``Model`` (the loss, parameters and a sample batch), ``Timing``
(repeats, warmup, chain), ``Compression`` (estimator, density, headroom)
and ``Sweep`` (the sizes and their timing); the keywords these replace
still work until 0.4, with a ``DeprecationWarning``.

Every program is compiled with ``jaxfuse.xla_options()``, as a train step
should be, so the costs describe the step that will run.
"""

from __future__ import annotations

import datetime
import warnings
from typing import Any, Callable, Sequence

import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np

from jaxfuse import _compat
from jaxfuse import _deprecated
from jaxfuse.optim import compile_options
from jaxfuse.planning.costs import Costs
from jaxfuse.planning.costs import MEASURABLE
from jaxfuse.planning.costs import fit_linear
from jaxfuse.planning._measuring import Compression
from jaxfuse.planning._measuring import Model
from jaxfuse.planning._measuring import Sweep
from jaxfuse.planning._measuring import Timing
from jaxfuse.planning._measuring import legacy_groups
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
from jaxfuse.planning.bucket_cost import DEFAULT_SCHEME_SIZES
from jaxfuse.planning.bucket_cost import SCHEME_UNITS
from jaxfuse.planning.bucket_cost import _check_sweep
from jaxfuse.planning.bucket_cost import _platform_key
from jaxfuse.planning.bucket_cost import measure_bucket_cost
from jaxfuse.planning.bucket_cost import measure_compress
from jaxfuse.planning.bucket_cost import measure_scheme_costs
from jaxfuse.planning.timing import Progress
from jaxfuse.planning.timing import ProfileError
from jaxfuse.planning.timing import human_bytes
from jaxfuse.planning.timing import text_progress
from jaxfuse.planning.timing import time_call
from jaxfuse.planning.timing import time_calls

__all__ = [
    "ATTRIBUTIONS", "BackwardAnalysis", "Compression",
    "DEFAULT_COMPRESS_SIZES", "DEFAULT_SCHEME_SIZES", "DEFAULT_SIZES",
    "FREE_PRIMITIVES", "Model", "ProfileError", "Progress", "SCHEME_UNITS",
    "Sweep", "Timing",
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


def default_sizes() -> tuple[int, ...]:
  """The collective sweep for the current platform.

  Returns:
    Bytes per worker: ``DEFAULT_SIZES`` of the platform (``"cpu"`` or
    ``"other"``).
  """
  return DEFAULT_SIZES[_platform_key()]


def default_compress_sizes() -> tuple[int, ...]:
  """The compression sweep for the current platform.

  Returns:
    Elements per unit: ``DEFAULT_COMPRESS_SIZES`` of the platform.
  """
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

  Args:
    kind: one of ``costs.MEASURABLE``.
    mesh: the mesh whose axis ``axis_name`` the collectives run over.
    nbytes: bytes per worker of each collective.
    chain: dependent rounds.
    parallel: independent collectives per round.
    axis_name: the data axis's name.

  Returns:
    (fn, inputs): the jitted program and its inputs, sharded over the axis.

  Raises:
    ProfileError: for an unknown ``kind`` or an ``axis_name`` not in
      ``mesh``.
  """
  if kind not in MEASURABLE:
    raise ProfileError(f"kind={kind!r}; use one of {MEASURABLE}.")
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


@_deprecated.legacy_keywords(legacy_groups("measure_collective",
                                           timing=Timing()))
def measure_collective(kind: str, mesh, sizes: Sequence[int], *,
                       timing: Timing = Timing(), axis_name: str = "data",
                       progress: Callable[[str], None] | None = None
                       ) -> list[tuple[int, float]]:
  """The time of one collective of ``kind`` at each size of a sweep.

  Each size is timed as ``collective_chain`` of ``timing.chain`` dependent
  collectives: t(x) = time / chain.

  Args:
    kind: one of ``costs.MEASURABLE`` (see ``collective_chain``).
    mesh: the mesh whose axis ``axis_name`` the collectives run over.
    sizes: bytes per worker.
    timing: a ``Timing``.
    axis_name: the data axis's name.
    progress: called with a line before each size.

  (0.2's keywords ``chain``, ``repeats`` and ``warmup`` still work until 0.4,
  with a ``DeprecationWarning``.)

  Returns:
    [(bytes per worker, seconds per collective)] over ``sizes``.

  Raises:
    ProfileError: for an unknown ``kind`` or an ``axis_name`` not in
      ``mesh``.
  """
  out = []
  for nbytes in sizes:
    if progress:
      progress(f"{kind} {human_bytes(nbytes)}")
    fn, inputs = collective_chain(kind, mesh, nbytes, chain=timing.chain,
                                  axis_name=axis_name)
    t = time_call(fn, *inputs, **timing.calls())
    out.append((inputs[0].size // mesh.shape[axis_name] * 4,
                t / timing.chain))
  return out


def contention_factor(t_one: float, t_two: float, alpha: float) -> float:
  """γ = (T₂ − α)/(T₁ − α) in [1, 2] (ASC-WFBP Eq. 9; 1 when T₁ ≤ α).

  Args:
    t_one: T₁, one psum's time.
    t_two: T₂, two simultaneous psums' time.
    alpha: the psum line's latency α.

  Returns:
    γ, clipped to [1, 2].
  """
  if t_one - alpha <= 0:
    return 1.0
  return float(min(2.0, max(1.0, (t_two - alpha) / (t_one - alpha))))


def overlap_factor(t_backward: float, t_comm: float, t_both: float) -> float:
  """η = (T_bwd + T_comm − T_both) / min(T_bwd, T_comm) in [0, 1]: what
  hid, as a share of what an ideal overlap could hide (``simulate``'s η).

  Args:
    t_backward: T_bwd, the backward alone.
    t_comm: T_comm, the all-reduce alone.
    t_both: T_both, both in one program.

  Returns:
    η, clipped to [0, 1]; 1 when there is nothing to hide.
  """
  ideal = min(t_backward, t_comm)
  if ideal <= 0:
    return 1.0
  return float(min(1.0, max(0.0, (t_backward + t_comm - t_both) / ideal)))


@_deprecated.legacy_keywords(legacy_groups("measure_contention",
                                           timing=Timing()))
def measure_contention(mesh, nbytes: int, alpha: float, *,
                       timing: Timing = Timing(), axis_name: str = "data"
                       ) -> tuple[float, dict]:
  """γ from one against two simultaneous psums (``contention_factor``).

  Args:
    mesh: the mesh whose axis ``axis_name`` the psums run over.
    nbytes: bytes per worker of each psum.
    alpha: the psum line's latency α (seconds).
    timing: a ``Timing``.
    axis_name: the data axis's name.

  (0.2's keywords ``chain``, ``repeats`` and ``warmup`` still work until 0.4,
  with a ``DeprecationWarning``.)

  Returns:
    (γ, raw): γ in [1, 2], and the raw times.
  """
  chain = timing.chain
  calls = [collective_chain("psum", mesh, nbytes, chain=chain,
                            parallel=parallel, axis_name=axis_name)
           for parallel in (1, 2)]
  one, two = (t / chain for t in time_calls(
      [(fn, *inputs) for fn, inputs in calls], **timing.calls()))
  gamma = contention_factor(one, two, alpha)
  return gamma, {"bytes": int(nbytes), "one": one, "two": two,
                 "alpha": alpha}


# --- overlap ------------------------------------------------------------------

@_deprecated.legacy_keywords(legacy_groups("measure_overlap",
                                           timing=Timing()))
def measure_overlap(mesh, loss_fn: Callable, params,
                    example_args: Sequence = (), *,
                    timing: Timing = Timing(), axis_name: str = "data"
                    ) -> tuple[float, dict]:
  """η from backward alone, all-reduce alone and both in one jit
  (``overlap_factor``); per worker, the gradient of ``loss_fn`` on the whole
  example batch.

  Args:
    mesh: the mesh whose axis ``axis_name`` the all-reduce runs over.
    loss_fn: ``loss_fn(params, *example_args)``, one worker's loss.
    params: the parameters.
    example_args: a sample batch.
    timing: a ``Timing`` (``repeats`` and ``warmup`` are used).
    axis_name: the data axis's name.

  (0.2's keywords ``repeats`` and ``warmup`` still work until 0.4, with a
  ``DeprecationWarning``.)

  Returns:
    (η, raw): η in [0, 1], and the three times.
  """
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
      **timing.calls())
  eta = overlap_factor(t_bwd, t_comm, t_both)
  return eta, {"backward": t_bwd, "comm": t_comm, "both": t_both}


# --- everything ---------------------------------------------------------------

def _upgrade_model(kwargs: dict) -> dict:
  """``profile``'s keywords with 0.2's ``loss_fn``, ``params`` and
  ``example_args`` made one ``model=`` (a ``DeprecationWarning``): the
  upgrade of ``_deprecated.legacy_keywords``."""
  given = {k: kwargs.pop(k) for k in ("loss_fn", "params", "example_args")
           if k in kwargs}
  if not given:
    return kwargs
  warnings.warn(
      f"profile({', '.join(f'{k}=...' for k in given)}) is deprecated: pass "
      "model=Model(loss_fn, params, example_args) "
      "(jaxfuse.planning.profiling.Model); the keywords go in 0.4.",
      DeprecationWarning, stacklevel=3)
  if (kwargs.get("model") is not None or
      ("loss_fn" in given) != ("params" in given)):
    raise ProfileError("give both loss_fn and params (a model), or neither: "
                       "profile(mesh, model=Model(loss_fn, params, "
                       "example_args)).")
  if "loss_fn" in given:
    kwargs["model"] = Model(given["loss_fn"], given["params"],
                            tuple(given.get("example_args", ())))
  return kwargs


@_deprecated.legacy_keywords(_upgrade_model)
@_deprecated.legacy_keywords(legacy_groups("profile", 1, **{
    "sweep": Sweep(), "sweep.timing": Timing(),
    "compression": Compression()}))
def profile(mesh=None, *, model: Model | None = None, sweep: Sweep = Sweep(),
            compression: Compression = Compression(),
            axis_name: str = "data", progress: Progress | None = None) -> Costs:
  """Measure a ``Costs`` on ``mesh`` (module docstring).

  With a ``model`` also the forward time, the per-leaf backward times
  (pytree order) and η on that model; without, ``backward`` is empty (costs
  for any plan's communication) and η is measured on ``synthetic_model()``.

  Args:
    mesh: the mesh to measure on; default all devices, axis ``axis_name``.
    model: the ``Model`` to measure the compute of, or None.
    sweep: the sizes measured and their ``Timing`` (a ``Sweep``).
    compression: the sparse step a plan would use (a ``Compression``).
    axis_name: the data axis's name.
    progress: ``progress(done, total, what)``, called before each
      measurement and once at the end.

  (0.2's keywords ``loss_fn``, ``params``, ``example_args`` (now ``model``),
  ``sizes``, ``compress_sizes``, ``repeats``, ``warmup``, ``chain`` (now
  ``sweep``), ``estimator``, ``density`` and ``headroom`` (now
  ``compression``) still work until 0.4, with a ``DeprecationWarning``.)

  Returns:
    The measured ``Costs``, the same on every process (process 0's).

  Raises:
    ProfileError: if the mesh's axis has one device, a sweep has fewer
      than two distinct sizes, or (0.2 keywords) only one of ``loss_fn``
      and ``params`` is given.
  """
  mesh = mesh if mesh is not None else _compat.make_mesh(axis_name=axis_name)
  if axis_name in mesh.axis_names and mesh.shape[axis_name] < 2:
    raise ProfileError(
        f"the mesh's axis {axis_name!r} has one device: its collectives move "
        "nothing, so there is no communication to measure (and the costs "
        "read each line per link, over K₀ − 1 >= 1 links). Profile on 2 or "
        "more devices.")
  sizes = tuple(int(s) for s in (sweep.sizes or default_sizes()))
  compress_sizes = tuple(int(s) for s in
                         (sweep.compress_sizes or default_compress_sizes()))
  _check_sweep("sizes", sizes)
  _check_sweep("compress_sizes", compress_sizes)
  timing = sweep.timing
  total = (len(MEASURABLE) * len(sizes) + len(compress_sizes) + 4 +
           (2 if model else 0))
  done = [0]

  def step(what):
    if progress:
      progress(done[0], total, what)
    done[0] += 1

  samples = {kind: measure_collective(kind, mesh, sizes, timing=timing,
                                      axis_name=axis_name, progress=step)
             for kind in MEASURABLE}
  collectives = {kind: fit_linear(*zip(*pts))
                 for kind, pts in samples.items()}
  samples["compress"] = measure_compress(
      compress_sizes, compression=compression, timing=timing, progress=step)
  compress = fit_linear(*zip(*samples["compress"]))

  step("bucket cost: one sparse bucket against one per layer")
  bucket, bucket_raw = measure_bucket_cost(
      mesh, compression=compression, timing=timing, axis_name=axis_name)
  step("schemes: one bucket moved by each scheme against all_gather")
  schemes, schemes_raw = measure_scheme_costs(
      mesh, Costs(collectives, compress, (),
                  workers=mesh.shape[axis_name]),
      compression=compression, timing=timing, axis_name=axis_name)

  step(f"contention: two psums of {human_bytes(max(sizes))}")
  gamma, contention_raw = measure_contention(
      mesh, max(sizes), collectives["psum"].alpha, timing=timing,
      axis_name=axis_name)

  step("overlap: backward, all-reduce, both")
  eta, overlap_raw = measure_overlap(mesh, *(model or synthetic_model()),
                                     timing=timing, axis_name=axis_name)
  overlap_raw["model"] = "given" if model else "synthetic MLP"

  forward, backward, backward_raw = measure_model(model, timing, step)
  if progress:
    progress(total, total, "done")

  provenance: dict[str, Any] = {
      **provenance_head("jaxfuse profile",
                        {str(a): int(s) for a, s in mesh.shape.items()}),
      "timing": timing._asdict(),
      "compiler_options": compile_options.xla_options(),
      "compress": compression._asdict(),
      "samples": {k: [[int(x), float(t)] for x, t in v]
                  for k, v in samples.items()},
      "contention": contention_raw, "overlap": overlap_raw,
      "bucket": bucket_raw, "schemes": schemes_raw,
  }
  if backward_raw:
    # the model measured, so that planning another one is refused
    provenance["leaves"] = backward_raw.pop("leaves")
    provenance["backward"] = backward_raw
  return same_on_every_process(Costs(
      collectives, compress, backward, contention=gamma, overlap=eta,
      forward=forward, provenance=provenance,
      workers=mesh.shape[axis_name], bucket=bucket, schemes=schemes))


def provenance_head(tool: str, mesh_shape: dict[str, int]) -> dict:
  """What every measured ``Costs``'s provenance starts with.

  Args:
    tool: what measured the costs, e.g. ``"jaxfuse profile"``.
    mesh_shape: {axis name: devices along it} of the mesh measured on.

  Returns:
    {"tool", "jaxfuse_version", "jax_version", "date" (UTC, ISO),
    "devices": {"platform", "kind" (the first device's), "mesh",
    "processes"}}.

  Raises:
    Nothing.
  """
  dev = jax.devices()[0]
  return {
      "tool": tool, "jaxfuse_version": __version__,
      "jax_version": jax.__version__,
      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
          timespec="seconds"),
      "devices": {"platform": dev.platform, "kind": dev.device_kind,
                  "mesh": dict(mesh_shape),
                  "processes": jax.process_count()}}


def measure_model(model: Model | None, timing: Timing,
                  step: Callable[[str], None] = lambda what: None
                  ) -> tuple[float, tuple[float, ...], dict | None]:
  """The forward and per-leaf backward times of ``model`` (the module
  docstring's forward and backward), on the first device.

  Args:
    model: the ``Model``, or None.
    timing: the ``Timing`` of each measurement.
    step: called with what is measured next (``profile``'s progress).

  Returns:
    (forward seconds, per-leaf backward seconds in pytree order, raw: how
    the backward was split, with ``"leaves"``, the model's [path, shape]
    per leaf); (0, (), None) without a model.

  Raises:
    Whatever ``loss_fn`` raises when traced or run.
  """
  if not model:
    return 0.0, (), None
  loss_fn, params, example_args = model
  step("forward and backward")
  forward, measured = measure_forward_backward(loss_fn, params,
                                               example_args,
                                               **timing.calls())
  step("backward per leaf (the gradient's jaxpr)")
  rates = machine_rates(**timing.calls())
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
                  "flops_per_s": rates[0], "bytes_per_s": rates[1],
                  "leaves": _model_leaves(params)}
  return forward, backward, backward_raw


def _model_leaves(params) -> list[list]:
  """[path, shape] per leaf of ``params``, pytree order, paths as
  ``jaxfuse.plan`` names them (``Costs.model_leaves``)."""
  return [[jax.tree_util.keystr(path), [int(d) for d in np.shape(x)]]
          for path, x in jax.tree_util.tree_flatten_with_path(params)[0]]


def same_on_every_process(costs: Costs) -> Costs:
  """Process 0's ``costs`` on every process of a ``jax.distributed`` job
  (one process: ``costs`` itself); every process must call it.

  Each process times with its own clock, so its fits differ a little, and
  cost-strategy plans made from different costs can differ: the processes
  would then compile programs whose collectives never match (a hang, not
  an error). ``profile`` returns this, so all processes plan alike.

  Args:
    costs: this process's ``Costs``.

  Returns:
    Process 0's ``Costs``.
  """
  if jax.process_count() == 1:
    return costs
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  text = costs.to_json().encode() if jax.process_index() == 0 else b""
  size = int(multihost_utils.broadcast_one_to_all(np.int32(len(text))))
  buf = np.zeros(size, np.uint8)
  if jax.process_index() == 0:
    buf[:] = np.frombuffer(text, np.uint8)
  buf = np.asarray(multihost_utils.broadcast_one_to_all(buf), np.uint8)
  return Costs.from_json(buf.tobytes().decode())
