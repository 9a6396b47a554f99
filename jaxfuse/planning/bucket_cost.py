"""What the sparse step computes, measured where it is paid: per unit
(``Costs.compress``), per bucket (``Costs.bucket``) and per scheme
(``Costs.schemes``).

``measure_compress``: what one more selection unit adds to a sparse bucket
(c against 2c units in one bucket, so that what the update pays once
cancels).

``measure_bucket_cost``: a sparse bucket runs kernels of its own besides
its units' compression: its selection call (one exact k-th largest per
bucket), reductions, packing and decoding. In a plain step XLA runs the
buckets' kernels together; under ``jaxfuse.send_early`` each bucket is
fenced into the backward at its own point, so they run one bucket at a
time and each bucket pays them, once per sparse bucket, a cost no single
unit's compression shows. So it is measured where it is paid, on one
device (no wire): the ``send_early`` training step of a tanh MLP of u
square layers of about x elements each, every layer sparse, planned as one
sparse bucket (t₁) and as one bucket per layer (t_u), timed round-robin::

  c = max(0, (t_u − t₁) / (u − 1))

``simulate`` adds c to each sparse bucket's compression, on the compute
stream.

``measure_scheme_costs``: the compute each sparse scheme other than
all_gather adds to a bucket, past its wire steps.
"""

from __future__ import annotations

import functools
import inspect
import math
from typing import Callable, Sequence
import warnings

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np

from jaxfuse import _compat
from jaxfuse import _deprecated
from jaxfuse.sync import bucket_steps
from jaxfuse import plans
from jaxfuse.planning import costs
from jaxfuse.planning import ordering
from jaxfuse.planning._measuring import Compression
from jaxfuse.planning._measuring import Timing
from jaxfuse.planning._measuring import legacy_groups
from jaxfuse.planning.backward import synthetic_model
from jaxfuse.planning.timing import ProfileError
from jaxfuse.planning.timing import jit as _jit
from jaxfuse.planning.timing import time_call
from jaxfuse.planning.timing import time_calls

# Elements per layer by platform: a transformer's largest matrices on an
# accelerator (768 × 3072 ≈ 2^21), small ones on a CPU.
DEFAULT_ELEMENTS = {"cpu": 2**14, "other": 2**21}

# Elements per leaf of the schemes' buckets (``measure_scheme_costs``).
DEFAULT_SCHEME_SIZES = {"cpu": (2**14, 2**17), "other": (2**18, 2**22)}
# Leaves per bucket in ``measure_scheme_costs``: several, so that the
# bucket's slots span a range the fit can use.
SCHEME_UNITS = 4


def _platform_key() -> str:
  return "cpu" if jax.devices()[0].platform == "cpu" else "other"


@_deprecated.legacy_keywords(legacy_groups(
    "measure_bucket_cost", compression=Compression(), timing=Timing()))
def measure_bucket_cost(mesh, *, units: int = 8, elements: int | None = None,
                        compression: Compression = Compression(),
                        timing: Timing = Timing(), axis_name: str = "data"
                        ) -> tuple[float, dict]:
  """The compute per sparse bucket beyond its units' compression.

  The module docstring's c = max(0, (t_u − t₁) / (u − 1)), on the first
  device of ``mesh``.

  Args:
    mesh: the mesh whose first device runs the steps.
    units: u, the MLP's layers (>= 2).
    elements: x, elements per layer; default ``DEFAULT_ELEMENTS`` of the
      platform.
    compression: the sparse step's estimator, density and headroom.
    timing: a ``Timing`` (``repeats`` and ``warmup`` are used).
    axis_name: the data axis's name.

  Returns:
    (c, raw): c in seconds, and the raw times.

  Raises:
    ProfileError: if ``units`` < 2.
  """
  if units < 2:
    raise ProfileError(f"units={units} must be >= 2 (one bucket against "
                       "several).")
  device = np.asarray(mesh.devices).flat[0]
  if elements is None:
    elements = DEFAULT_ELEMENTS["cpu" if device.platform == "cpu" else "other"]
  width = max(2, math.isqrt(int(elements)))
  kw = dict(units=units, width=width, compression=compression,
            axis_name=axis_name)
  one_mesh = jax.sharding.Mesh(np.array([device]), (axis_name,))
  steps = [early_step(one_mesh, strategy, **kw)
           for strategy in ("single", "layerwise")]
  with warnings.catch_warnings():   # the XLA flags are the caller's choice
    warnings.filterwarnings("ignore", "jaxfuse.send_early on GPU")
    one, each = time_calls([(step, *args) for step, args in steps],
                           **timing.calls())
  c = max(0.0, (each - one) / (units - 1))
  return c, {"units": units, "elements": width * width, "one_bucket": one,
             "bucket_per_unit": each,
             "method": "send_early step on one device, one bucket against "
                       "one per layer"}


def early_step(mesh, strategy: str, *, units: int, width: int,
               compression: Compression, axis_name: str = "data"):
  """The jitted ``send_early`` step of a tanh MLP, every layer sparse.

  Args:
    mesh: the mesh to run on.
    strategy: the plan strategy (``"single"``: one bucket; ``"layerwise"``:
      one per layer).
    units: the MLP's layers, each (width, width).
    width: each layer's side.
    compression: the sparse step's estimator, density and headroom.
    axis_name: the data axis's name.

  Returns:
    (step, args): the step (gradient and ``sparse_sync`` update) and the
    arguments to call it with.
  """
  # pylint: disable=g-import-not-at-top
  from jaxfuse.optim import overlap
  from jaxfuse.state import placement
  from jaxfuse import transform
  from jaxfuse.planning import planner
  # pylint: enable=g-import-not-at-top
  loss_fn, params, (x,) = synthetic_model(width, layers=units, batch=8)
  plan = planner.plan(params, density=compression.density, strategy=strategy,
                      estimator=compression.estimator,
                      settings=plans.Settings(
                          headroom=compression.headroom, min_sparse_size=1),
                      order=ordering.FromLoss(loss_fn, (x,)))
  opt = transform.sparse_sync(plan, axis_name=axis_name)
  params = jax.device_put(params, NamedSharding(mesh, P()))
  x = jax.device_put(x, NamedSharding(mesh, P()))
  state = placement.init_state(opt, params, mesh, axis_name=axis_name)
  specs = placement.state_specs(state, axis_name)

  def local(params, state, x):
    grads = jax.grad(loss_fn)(transform.local_params(params, axis_name), x)
    return opt.update(grads, state)
  step = _jit(jax.shard_map(overlap.send_early(local), mesh=mesh,
                            in_specs=(P(), specs, P()),
                            out_specs=(P(), specs)))
  return step, (params, state, x)


@_deprecated.legacy_keywords(legacy_groups(
    "measure_compress", compression=Compression(), timing=Timing()))
def measure_compress(sizes: Sequence[int], *,
                     compression: Compression = Compression(),
                     timing: Timing = Timing(), device=None,
                     progress: Callable[[str], None] | None = None
                     ) -> list[tuple[int, float]]:
  """What one more selection unit of x elements adds to a sparse bucket.

  What a step runs: ``sparse_sync``'s update for one bucket of float32
  leaves of x elements each (one state group: the batched k-th largests,
  the fused pass, packing, the collective, decoding, the residual and the
  statistics) on a one-device mesh, so the collective moves nothing; once
  with c = ``timing.chain`` leaves and once with 2c, timed round-robin:
  h = max(0, t_2c − t_c) / c. The difference cancels what the update pays
  once whatever its units (its dispatch and the bucket's own kernels,
  ``bucket_cost``); the time per update divided by its units would charge
  those to every unit, many times the units' own compression on a model
  of many small leaves.

  Args:
    sizes: elements per unit, one measurement each.
    compression: the sparse step's estimator, density and headroom.
    timing: a ``Timing``.
    device: the device to run on (default the first local one).
    progress: called with a line before each size.

  Returns:
    [(elements, seconds)] over ``sizes``.

  Raises:
    ProfileError: for an unknown estimator or a chain that is not an int
      >= 1.
  """
  estimator, chain = compression.estimator, timing.chain
  if estimator not in plans.ESTIMATORS:
    raise ProfileError(f"estimator={estimator!r}; use one of "
                       f"{plans.ESTIMATORS}.")
  if not (plans.is_int(chain) and chain >= 1):
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
        compression=compression, timing=timing)
    out.append((n, max(0.0, t_2c - t_c) / chain))
  return out


def _legacy_units(fn: Callable) -> Callable:
  """``measure_scheme_costs`` still taking 0.2's ``units=`` (the bucket's
  leaves; a ``DeprecationWarning``, removed in 0.4); its other keywords
  go through ``fn``'s own upgrade."""
  groups = legacy_groups("measure_scheme_costs",
                         compression=Compression(), timing=Timing())

  @functools.wraps(fn)
  def wrapped(mesh, lines, **kwargs):
    if "units" not in kwargs:
      return fn(mesh, lines, **kwargs)
    units = kwargs.pop("units")
    warnings.warn("measure_scheme_costs(units=...) is deprecated: the "
                  "bucket has SCHEME_UNITS leaves "
                  "(jaxfuse.planning.profiling.SCHEME_UNITS); the keyword "
                  "goes in 0.4.", DeprecationWarning, stacklevel=2)
    kw = inspect.signature(fn).bind(mesh, lines, **groups(kwargs))
    kw.apply_defaults()
    kw = dict(kw.arguments)
    return _scheme_costs(mesh, lines, kw.pop("sizes"),
                         {k: kw[k] for k in ("compression", "timing",
                                             "axis_name")}, units)
  return wrapped


@_legacy_units
@_deprecated.legacy_keywords(legacy_groups(
    "measure_scheme_costs", 1, compression=Compression(), timing=Timing()))
def measure_scheme_costs(mesh, lines: costs.Costs, *,
                         sizes: Sequence[int] | None = None,
                         compression: Compression = Compression(),
                         timing: Timing = Timing(), axis_name: str = "data"
                         ) -> tuple[dict[str, costs.LinearCost], dict]:
  """The compute each sparse scheme of ``auto``'s other than all_gather
  adds to a bucket (``Costs.schemes``).

  For each x of ``sizes``: one sparse bucket of ``SCHEME_UNITS`` float32
  leaves of x elements on ``mesh``, moved by all_gather (t_ag) and by the
  scheme (t_s). e = t_s − t_ag − (its wire steps − all_gather's, from
  ``lines``' collective lines) at c = the bucket's slots; fitted
  e_s(c) = α_s + β_s·c (α, β ≥ 0). A scheme that cannot run on this mesh
  is left out.

  Args:
    mesh: the mesh the buckets are moved on.
    lines: ``Costs`` whose collective lines price the wire steps.
    sizes: elements per leaf; default ``DEFAULT_SCHEME_SIZES`` of the
      platform.
    compression: the sparse step's estimator, density and headroom.
    timing: a ``Timing`` (``repeats`` and ``warmup`` are used).
    axis_name: the data axis's name.

  Returns:
    ({scheme: e_s}, raw): the fits, and the raw points.

  Raises:
    ProfileError: if ``sizes`` has fewer than two distinct sizes >= 1.
  """
  return _scheme_costs(mesh, lines, sizes, dict(
      compression=compression, timing=timing, axis_name=axis_name),
                       SCHEME_UNITS)


def _scheme_costs(mesh, lines: costs.Costs, sizes, kw: dict,
                  units: int):
  """``measure_scheme_costs`` on buckets of ``units`` leaves; ``kw``: the
  ``compression``, ``timing`` and ``axis_name`` of ``_time_sparse_step``."""
  from jaxfuse import collectives  # pylint: disable=g-import-not-at-top
  from jaxfuse.planning import planner  # pylint: disable=g-import-not-at-top
  sizes = tuple(int(x) for x in (sizes or
                                 DEFAULT_SCHEME_SIZES[_platform_key()]))
  _check_sweep("sizes", sizes)
  k = mesh.shape[kw["axis_name"]]

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
  fits = {name: costs.fit_linear(*zip(*pts))
          for name, pts in points.items() if len({c for c, _ in pts}) > 1}
  return fits, raw


def _check_sweep(name: str, sweep: Sequence[int]) -> None:
  if len(set(sweep)) < 2 or min(sweep) < 1:
    raise ProfileError(f"{name}={list(sweep)} needs at least two distinct "
                       "sizes >= 1 (one size cannot separate α from β).")


def _sparse_step(mesh, sizes, strategy, *, compression, axis_name="data",
                 collective="allgather"):
  """(step, args, plan): one jitted ``sparse_sync`` update of float32
  leaves of ``sizes`` (standard normal, the same on every device of
  ``mesh``), planned as ``strategy`` with every leaf sparse, compressed as
  ``compression`` and moved by ``collective``, and the arguments to call
  it with."""
  from jaxfuse.state import placement  # pylint: disable=g-import-not-at-top
  from jaxfuse import transform  # pylint: disable=g-import-not-at-top
  from jaxfuse.planning import planner  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(sum(sizes))
  grads = [jax.device_put(rng.standard_normal(n, np.float32),
                          NamedSharding(mesh, P())) for n in sizes]
  plan = planner.plan(grads, density=compression.density,
                      strategy=strategy, estimator=compression.estimator,
                      settings=plans.Settings(
                          headroom=compression.headroom, min_sparse_size=1),
                      collective=collective)
  opt = transform.sparse_sync(plan, axis_name=axis_name)
  state = placement.init_state(opt, grads, mesh, axis_name=axis_name)
  specs = placement.state_specs(state, axis_name)
  step = _jit(jax.shard_map(
      lambda g, s: opt.update(_compat.to_varying(g, axis_name), s),
      mesh=mesh, in_specs=(P(), specs), out_specs=(P(), specs)))
  return step, (grads, state), plan


def _time_sparse_step(mesh, sizes, strategy, *, timing, **kw):
  """(seconds, plan) of one ``_sparse_step`` update."""
  step, args, plan = _sparse_step(mesh, sizes, strategy, **kw)
  return time_call(step, *args, **timing.calls()), plan


def _time_sparse_steps(mesh, size_lists, strategy, *, timing,
                       **kw) -> list[float]:
  """Seconds of one ``_sparse_step`` update per list of leaf sizes, timed
  round-robin (``time_calls``), so that their differences hold."""
  steps = [_sparse_step(mesh, sizes, strategy, **kw) for sizes in size_lists]
  return time_calls([(step, *args) for step, args, _ in steps],
                    **timing.calls())
