"""The cost model: plain, immutable data with a versioned JSON form.

Times are in seconds. Following Cupcake §4.1 and ASC-WFBP Eq. 3, every
operation whose time depends on a size is a straight line::

  one collective moving x bytes per worker   g(x) = α_g + β_g·x
  sparsifying one unit of x elements         h(x) = α_h + β_h·x

(one line per collective kind, measured on ``workers`` = K₀ devices), plus
the compute ``bucket`` a step spends on each sparse bucket beyond its
units' compression (its own selection call, reductions, packing and
decoding, which a step under ``send_early`` runs one bucket at a time: a
plan of many small buckets pays it many times), per sparse
scheme other than all_gather the compute it adds to a bucket of c slots::

  a scheme's encoding and decoding          e_s(c) = α_s + β_s·c

(``schemes``; e.g. ZEN's hash partition and scatter), the measured
per-leaf backward compute
times (in the plan's leaf order, i.e. pytree order), the forward time, the
contention factor γ of ASC-WFBP §III (each of two simultaneous collectives
moves its bytes γ times slower) and the overlap η: the share of what the
ideal WFBP schedule of the papers would hide that XLA really hides behind
backward compute (1 is that ideal; ``simulate`` has the rule).
``jaxfuse.planning.simulate`` turns a plan and these costs into a timeline.

Other worker counts K (``primitive_time``). Each measured line is read as
its ring algorithm on K₀ workers, which gives a per-message link cost
(a, b), and the same algorithm is evaluated on K workers::

  all_gather  (K−1) messages of x        (K−1)/(K₀−1)·(α + β·x)
  all_reduce  2(K−1) messages of x/K     (K−1)/(K₀−1)·α + (K−1)K₀/(K(K₀−1))·β·x
  all_to_all  K−1 messages of x/K        as all_reduce from its own line,
                                         else (K−1)·(a + b·x/K) with the
                                         all_gather's a = α/(K₀−1), b = β/(K₀−1)
  ppermute    one message of x           α + β·x of its own line, else a + b·x

``"alltoall"`` and ``"ppermute"`` lines are optional (``jaxfuse profile``
measures them); a scheme's time is the sum over its steps
(``jaxfuse.collectives``: ``Step(primitive, bytes)``).

JSON only, never pickle, like ``Plan``: ``{"format": "jaxfuse.costs",
"version": 1, ...}``. A bad, corrupted or newer file raises ``CostsError``
(a ``ValueError``) naming the field.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
import types
from typing import Any, Mapping, Sequence

import numpy as np

from jaxfuse.plans import jsonfile as _jsonfile
from jaxfuse.plans import checks as plan_checks

FORMAT = "jaxfuse.costs"
FORMAT_VERSION = 2   # 2 added ``bucket`` and ``schemes`` (a version-1
                     # file reads as 0 and none)
COLLECTIVES = ("allgather", "psum")       # required lines
OPTIONAL_COLLECTIVES = ("alltoall", "ppermute")
MEASURABLE = COLLECTIVES + OPTIONAL_COLLECTIVES
# The sparse schemes whose compute ``schemes`` may hold (all_gather's is in
# ``compress``); the names of plans.SPARSE_COLLECTIVES.
SCHEMES = ("zen", "spardl", "hier")
# A scheme's wire primitives (collectives.base.PRIMITIVES) -> the line used.
PRIMITIVE_LINE = {"allgather": "allgather", "allreduce": "psum",
                  "alltoall": "alltoall", "ppermute": "ppermute"}


class CostsError(ValueError):
  """A cost model that is malformed, or a costs file that cannot be read."""


# The largest time (s), time per unit (s per byte, element or slot) or
# factor a cost model holds: a day-long collective or backward pass is far
# below it, and sums of many such numbers stay finite.
MAX_VALUE = 1e9


def _number(where: str, x, *, low: float = 0.0,
            high: float = MAX_VALUE) -> float:
  if isinstance(x, bool) or not isinstance(x, (int, float, np.floating,
                                               np.integer)):
    raise CostsError(f"{where}={x!r} must be a number.")
  try:
    value = float(x)
  except OverflowError:   # an int beyond float's range
    value = math.inf
  if not (math.isfinite(value) and low <= value <= high):
    shown = f"{x!r}" if len(repr(x)) <= 24 else f"{repr(x)[:20]}…"
    raise CostsError(f"{where}={shown} must be finite and in [{low:g}, "
                     f"{high:g}]; measure the costs again with `jaxfuse "
                     "profile`.")
  return value


@dataclasses.dataclass(frozen=True)
class LinearCost:
  """time(x) = alpha + beta·x; both >= 0 (seconds, seconds per unit of x)."""
  alpha: float
  beta: float

  def __post_init__(self):
    object.__setattr__(self, "alpha", _number("alpha", self.alpha))
    object.__setattr__(self, "beta", _number("beta", self.beta))

  def time(self, x: float) -> float:
    return self.alpha + self.beta * x

  def to_dict(self) -> dict:
    return {"alpha": self.alpha, "beta": self.beta}


def fit_linear(sizes: Sequence[float], times: Sequence[float]) -> LinearCost:
  """Least-squares line through (size, time) points, with alpha, beta >= 0.

  Non-negative least squares in two unknowns: the minimum is either the
  unconstrained fit (when both coefficients come out >= 0) or lies on a face
  of the constraint set, so we take the best of the unconstrained fit, the
  fit through the origin (alpha = 0), the constant fit (beta = 0) and zero.
  Measured small sizes often give a slightly negative intercept; clipping it
  to 0 this way keeps the line the best one a cost model can use.

  Needs at least two distinct sizes (one size cannot separate alpha from
  beta), all finite, sizes >= 0.
  """
  x = np.asarray(sizes, dtype=np.float64).reshape(-1)
  y = np.asarray(times, dtype=np.float64).reshape(-1)
  if x.shape != y.shape:
    raise CostsError(f"fit_linear: {x.size} sizes but {y.size} times.")
  if not (np.all(np.isfinite(x)) and np.all(np.isfinite(y))):
    raise CostsError("fit_linear: sizes and times must be finite.")
  if np.any(x < 0):
    raise CostsError("fit_linear: sizes must be >= 0.")
  if np.unique(x).size < 2:
    raise CostsError("fit_linear: needs at least two distinct sizes to "
                     "separate alpha (latency) from beta (per unit).")
  candidates = [(0.0, 0.0), (max(0.0, float(y.mean())), 0.0)]
  sxx = float(np.dot(x, x))
  candidates.append((0.0, max(0.0, float(np.dot(x, y)) / sxx)))
  beta, alpha = np.polyfit(x, y, 1)
  if alpha >= 0 and beta >= 0:
    candidates.append((float(alpha), float(beta)))
  sse = lambda ab: float(np.sum((ab[0] + ab[1] * x - y) ** 2))
  alpha, beta = min(candidates, key=sse)
  return LinearCost(alpha, beta)


def contention_penalty(cost: LinearCost, gamma: float, nbytes_first: float,
                       offset: float) -> float:
  """ASC-WFBP Eq. 12-13: extra time when a second collective joins a first.

  The first collective moves ``nbytes_first`` bytes in ``cost.time(nbytes)``
  seconds; the second starts ``offset`` seconds after it (0 <= offset <=
  that time). The bytes of the first still in flight, m = m1·(1 - offset /
  t1), move γ times slower: penalty = (γ - 1)·β·m. (``simulate`` runs one
  collective at a time and does not use this; it is here for planners that
  consider simultaneous collectives.)
  """
  t1 = cost.time(nbytes_first)
  if not 0 <= offset <= t1:
    raise CostsError(f"contention_penalty: offset={offset} must be in "
                     f"[0, {t1}] (during the first collective).")
  overlapped = nbytes_first * (1 - offset / t1) if t1 > 0 else 0.0
  return (gamma - 1) * cost.beta * overlapped


@dataclasses.dataclass(frozen=True)
class Costs:
  """Everything the simulator needs besides the plan.

  collectives: {"allgather": LinearCost, "psum": LinearCost} and optionally
    "alltoall", "ppermute": time of ONE collective moving x bytes per worker
    on ``workers`` devices.
  compress: time to sparsify one selection unit of x elements.
  backward: backward compute time of each leaf, in the plan's leaf order
    (pytree order; the same length as ``plan.leaves``).
  contention: γ >= 1, slow-down of each of two simultaneous collectives.
  overlap: η in [0, 1], the share of what the ideal schedule hides that
    XLA hides behind backward compute (``simulate`` says exactly how it is
    applied).
  forward: forward compute time.
  workers: K₀, the devices the collective lines were measured on (≥ 2).
  provenance: free-form notes (devices, date, how measured); JSON values.
  bucket: seconds of compute per sparse bucket beyond its units'
    ``compress``; ``simulate`` adds it to the bucket's compression, on the
    compute stream (0: not measured).
  schemes: {scheme: LinearCost} for schemes of ``SCHEMES``: what a sparse
    bucket of c slots computes more under that scheme than under
    all_gather, beyond the difference of their wire steps; ``simulate``
    adds it to the bucket's compression (missing: 0).
  """
  collectives: Mapping[str, LinearCost]
  compress: LinearCost
  backward: tuple[float, ...]
  contention: float = 1.0
  overlap: float = 1.0
  forward: float = 0.0
  provenance: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  workers: int = 2
  bucket: float = 0.0
  schemes: Mapping[str, LinearCost] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    if not isinstance(self.collectives, Mapping):
      raise CostsError("collectives must map each of "
                       f"{COLLECTIVES} to a LinearCost.")
    names = set(self.collectives)
    if not set(COLLECTIVES) <= names <= set(MEASURABLE):
      raise CostsError(f"collectives has {sorted(names)}; it needs "
                       f"{list(COLLECTIVES)} and may have "
                       f"{list(OPTIONAL_COLLECTIVES)}.")
    if not (plan_checks.is_int(self.workers) and self.workers >= 2):
      raise CostsError(f"workers={self.workers!r} must be an integer >= 2 "
                       "(the devices the collectives were measured on).")
    for name in names:
      if not isinstance(self.collectives[name], LinearCost):
        raise CostsError(f"collectives[{name!r}] must be a LinearCost, not "
                         f"{type(self.collectives[name]).__name__}.")
    if not isinstance(self.compress, LinearCost):
      raise CostsError("compress must be a LinearCost.")
    if isinstance(self.backward, (str, bytes)) or not isinstance(
        self.backward, (Sequence, np.ndarray)):
      raise CostsError("backward must be a sequence of per-leaf times.")
    backward = tuple(_number(f"backward[{i}]", t)
                     for i, t in enumerate(self.backward))
    object.__setattr__(self, "collectives", types.MappingProxyType(
        {name: self.collectives[name] for name in MEASURABLE
         if name in names}))
    object.__setattr__(self, "backward", backward)
    object.__setattr__(self, "contention",
                       _number("contention", self.contention, low=1.0))
    object.__setattr__(self, "overlap",
                       _number("overlap", self.overlap, high=1.0))
    object.__setattr__(self, "forward", _number("forward", self.forward))
    object.__setattr__(self, "bucket", _number("bucket", self.bucket))
    if not isinstance(self.schemes, Mapping) or not set(
        self.schemes) <= set(SCHEMES) or not all(
            isinstance(c, LinearCost) for c in self.schemes.values()):
      raise CostsError(f"schemes={self.schemes!r} must map schemes of "
                       f"{SCHEMES} to a LinearCost each.")
    object.__setattr__(self, "schemes", types.MappingProxyType(
        {name: self.schemes[name] for name in SCHEMES
         if name in self.schemes}))
    object.__setattr__(self, "provenance", dict(self.provenance))
    self.model_leaves()   # a malformed record is refused now

  def comm_time(self, collective: str, nbytes: float) -> float:
    """One measured collective on ``workers`` devices."""
    return self.collectives[collective].time(nbytes)

  def scheme_time(self, scheme: str, slots: float) -> float:
    """e_s(slots): the compute a sparse bucket of ``slots`` slots adds under
    ``scheme`` over all_gather (0 for all_gather and unmeasured schemes)."""
    line = self.schemes.get(scheme)
    return line.time(slots) if line else 0.0

  def primitive_time(self, primitive: str, nbytes: float,
                     num_workers: int | None = None) -> float:
    """One wire primitive of x = ``nbytes`` per worker on K workers (module
    docstring: the ring algorithm of the line measured on K₀)."""
    k0, k = self.workers, self.workers if num_workers is None else num_workers
    if not (plan_checks.is_int(k) and k >= 1):
      raise CostsError(f"num_workers={num_workers!r} must be an int >= 1.")
    k = int(k)
    if primitive not in PRIMITIVE_LINE:
      raise CostsError(f"primitive {primitive!r}; use one of "
                       f"{tuple(PRIMITIVE_LINE)}.")
    if k == 1:
      return 0.0
    name = PRIMITIVE_LINE[primitive]
    ag = self.collectives["allgather"]
    per_a, per_b = ag.alpha / (k0 - 1), ag.beta / (k0 - 1)  # one message
    if primitive == "allgather":
      return (k - 1) * (per_a + per_b * nbytes)
    if primitive == "ppermute":
      line = self.collectives.get(name)
      return line.time(nbytes) if line else per_a + per_b * nbytes
    line = self.collectives.get(name)
    if line is None:  # all_to_all from the all_gather's link
      return (k - 1) * (per_a + per_b * nbytes / k)
    return ((k - 1) / (k0 - 1) * line.alpha +
            (k - 1) * k0 / (k * (k0 - 1)) * line.beta * nbytes)

  def on_workers(self, num_workers: int) -> "Costs":
    """The same costs with the collective lines of K = ``num_workers``
    (the ring reading of ``primitive_time``, which stays linear in x):

      all_gather            (K−1)/(K₀−1)·α,  (K−1)/(K₀−1)·β
      all_reduce, all_to_all (K−1)/(K₀−1)·α,  (K−1)K₀/(K(K₀−1))·β
      ppermute              unchanged

    so that ``c.on_workers(K).primitive_time(p, x)`` is
    ``c.primitive_time(p, x, K)``. K = 1 has no communication: every line
    is 0 (``workers`` stays K₀, which a line's ring reading needs)."""
    k0, k = self.workers, num_workers
    if not (plan_checks.is_int(k) and k >= 1):
      raise CostsError(f"num_workers={num_workers!r} must be an int >= 1.")
    k = int(k)
    if k == k0:
      return self
    if k == 1:
      return self.replace(collectives={
          name: LinearCost(0.0, 0.0) for name in self.collectives})
    hops = (k - 1) / (k0 - 1)
    share = (k - 1) * k0 / (k * (k0 - 1))
    scaled = {
        name: (line if name == "ppermute" else LinearCost(
            hops * line.alpha,
            (hops if name == "allgather" else share) * line.beta))
        for name, line in self.collectives.items()}
    return self.replace(collectives=scaled, workers=k)

  def steps_time(self, steps, num_workers: int | None = None) -> float:
    """Σ over a scheme's ``Step(primitive, nbytes)`` of ``primitive_time``."""
    return math.fsum(self.primitive_time(s.primitive, s.nbytes, num_workers)
                     for s in steps)

  def replace(self, **changes) -> "Costs":
    return dataclasses.replace(self, **changes)

  def link_scaled(self, factor: float) -> "Costs":
    """Every collective line times ``factor`` > 0 (α and β alike): the same
    costs on a link ``factor`` times slower, e.g. to match the collectives'
    time G measured on another machine: factor = G_measured / G_simulated."""
    if (isinstance(factor, bool) or not isinstance(factor, numbers.Real)
        or not math.isfinite(factor) or factor <= 0):
      raise CostsError(f"link_scaled: factor={factor!r} must be a finite "
                       "number > 0.")
    return self.replace(collectives={
        name: LinearCost(line.alpha * factor, line.beta * factor)
        for name, line in self.collectives.items()})

  def on_link(self, gbytes_per_s: float, latency_s: float) -> "Costs":
    """The same compute on another network: every collective line is its
    ring algorithm on a link moving ``gbytes_per_s`` GB/s with
    ``latency_s`` seconds per message, one message costing
    a + x/B (a = latency, B = bytes per second), on K₀ = ``workers``::

      all_gather   (K₀−1)·(a + x/B)         α = (K₀−1)·a,   β = (K₀−1)/B
      all_reduce   2(K₀−1)·(a + x/(K₀·B))   α = 2(K₀−1)·a,  β = 2(K₀−1)/(K₀·B)
      all_to_all   (K₀−1)·(a + x/(K₀·B))    α = (K₀−1)·a,   β = (K₀−1)/(K₀·B)
      ppermute     a + x/B

    so that ``primitive_time`` on any K reads each as the same ring on K
    workers. A link of G Gbit/s moves G/8 GB/s (10 Gbit/s Ethernet: 1.25).
    What the measured lines said of the real network (its contention γ,
    its overlap η) is kept.

    Args:
      gbytes_per_s: the link's bandwidth in GB/s (10⁹ bytes), > 0.
      latency_s: seconds per message, >= 0 (NCCL over TCP sockets on one
        host measured about 3e-4 in ``jaxfuse profile``'s all-gather line).

    Returns:
      A ``Costs`` with the link's collective lines, every other field kept.

    Raises:
      CostsError: a bandwidth that is not a finite number > 0, or a
        latency that is not a finite number >= 0.
    """
    for name, value, low in (("gbytes_per_s", gbytes_per_s, None),
                             ("latency_s", latency_s, 0.0)):
      if (isinstance(value, bool) or not isinstance(value, numbers.Real)
          or not math.isfinite(value) or
          (value <= 0 if low is None else value < low)):
        raise CostsError(f"on_link: {name}={value!r} must be a finite "
                         f"number {'> 0' if low is None else '>= 0'} (a "
                         "link of G Gbit/s moves G/8 GB/s).")
    k0, a, b = self.workers, float(latency_s), 1.0 / (gbytes_per_s * 1e9)
    lines = {"allgather": LinearCost((k0 - 1) * a, (k0 - 1) * b),
             "psum": LinearCost(2 * (k0 - 1) * a, 2 * (k0 - 1) * b / k0),
             "alltoall": LinearCost((k0 - 1) * a, (k0 - 1) * b / k0),
             "ppermute": LinearCost(a, b)}
    return self.replace(collectives=lines)

  def with_compute(self, seconds: float) -> "Costs":
    """The forward and per-leaf backward times scaled by one factor so that
    they add up to ``seconds``: the compute of a step measured on one
    device (e.g. another batch size, or the whole step's time with its
    update), in the shares the profile measured. The compression lines
    (``compress``, ``bucket``, ``schemes``), which depend on the
    parameters and not on the batch, are kept.

    Args:
      seconds: the measured time of one device's dense step, > 0.

    Returns:
      A ``Costs`` with forward + Σ backward = ``seconds``.

    Raises:
      CostsError: ``seconds`` is not a finite number > 0, or the costs
        hold no compute to scale (forward and backward all 0).
    """
    if (isinstance(seconds, bool) or not isinstance(seconds, numbers.Real)
        or not math.isfinite(seconds) or seconds <= 0):
      raise CostsError(f"with_compute: seconds={seconds!r} must be a "
                       "finite number > 0 (one device's measured step).")
    total = self.forward + math.fsum(self.backward)
    if total <= 0:
      raise CostsError("with_compute: these costs hold no forward or "
                       "backward time to scale; measure them with `jaxfuse "
                       "profile`.")
    factor = float(seconds) / total
    return self.replace(forward=self.forward * factor,
                        backward=tuple(t * factor for t in self.backward))

  def model_leaves(self) -> tuple[tuple[str, tuple[int, ...]], ...] | None:
    """The (path, shape) of each leaf of the model the backward times were
    measured on, pytree order (``provenance["leaves"]``, which ``jaxfuse
    profile --model`` records), or None for costs without that record."""
    record = self.provenance.get("leaves")
    if record is None:
      return None
    ok = isinstance(record, (list, tuple)) and all(
        isinstance(e, (list, tuple)) and len(e) == 2 and
        isinstance(e[0], str) and isinstance(e[1], (list, tuple)) and
        all(plan_checks.is_int(d) and d >= 0 for d in e[1]) for e in record)
    if not ok:
      raise CostsError("costs field 'provenance.leaves' must list [path, "
                       "shape] per leaf of the profiled model; the file is "
                       "corrupted: measure the costs again with `jaxfuse "
                       "profile --model MODULE:FUNCTION`.")
    return tuple((path, tuple(int(d) for d in shape))
                 for path, shape in record)

  def check(self, num_leaves: int, holder: str = "the plan",
            leaves: Sequence[tuple[str, Sequence[int]]] | None = None
            ) -> None:
    """Raise ``CostsError`` unless there is one backward time per leaf of
    ``holder`` (named in the message) and, when both ``leaves`` (holder's
    (path, shape) per leaf) and ``model_leaves()`` are known, the costs
    were measured on a model of those leaves."""
    if len(self.backward) != num_leaves:
      raise CostsError(f"costs.backward has {len(self.backward)} times but "
                       f"{holder} has {num_leaves} leaves; measure the costs "
                       "for this model (`jaxfuse profile --model "
                       "MODULE:FUNCTION`).")
    measured = self.model_leaves() if self.backward else None
    if measured is None or leaves is None:
      return
    for i, (mine, (path, shape)) in enumerate(zip(measured, leaves)):
      if mine != (path, tuple(shape)):
        raise CostsError(
            f"the costs were measured on another model: leaf {i} is "
            f"{mine[0]} {list(mine[1])} in the costs but {path} "
            f"{list(shape)} in {holder}; measure the costs for this model "
            "(`jaxfuse profile --model MODULE:FUNCTION`).")

  # --- JSON -------------------------------------------------------------------
  def to_json(self) -> str:
    return _jsonfile.write({
        "collectives": {n: c.to_dict() for n, c in self.collectives.items()},
        "compress": self.compress.to_dict(),
        "backward": list(self.backward),
        "contention": self.contention,
        "overlap": self.overlap,
        "forward": self.forward,
        "workers": self.workers,
        "bucket": self.bucket,
        "schemes": {n: c.to_dict() for n, c in self.schemes.items()},
        "provenance": dict(self.provenance),
    }, fmt=FORMAT, version=FORMAT_VERSION)

  @classmethod
  def from_json(cls, text: str) -> "Costs":
    body = _jsonfile.read(text, fmt=FORMAT, max_version=FORMAT_VERSION,
                          error=CostsError, what="jaxfuse costs file")
    known = {"format", "version", "collectives", "compress", "backward",
             "contention", "overlap", "forward", "provenance", "workers",
             "bucket", "schemes"}
    unknown = sorted(set(body) - known)
    if unknown:
      raise CostsError(f"costs JSON has unknown field(s) {unknown}; the file "
                       "is corrupted or from another program.")
    for field in ("collectives", "compress", "backward"):
      if field not in body:
        raise CostsError(f"costs JSON is missing the field {field!r}.")
    if body["version"] >= 2:   # every version-2 file of jaxfuse has them
      for field, meaning in _REQUIRED_SINCE_2.items():
        if field not in body:
          raise CostsError(
              f"costs JSON (version {body['version']}) is missing the field "
              f"{field!r} ({meaning}), which `jaxfuse profile` writes; "
              "measure the costs again with `jaxfuse profile`, or add the "
              "field.")

    def line(where, d):
      if not isinstance(d, dict) or set(d) != {"alpha", "beta"}:
        raise CostsError(f"costs field {where!r} must be an object with "
                         f"exactly 'alpha' and 'beta'; got {d!r}.")
      try:
        return LinearCost(d["alpha"], d["beta"])
      except CostsError as e:
        raise CostsError(f"costs field {where!r}: {e}") from None

    coll = body["collectives"]
    if not isinstance(coll, dict):
      raise CostsError("costs field 'collectives' must be an object.")
    if not set(COLLECTIVES) <= set(coll) <= set(MEASURABLE):
      raise CostsError(f"costs field 'collectives' has {sorted(coll)}; it "
                       f"needs {list(COLLECTIVES)} and may have "
                       f"{list(OPTIONAL_COLLECTIVES)}.")
    collectives = {n: line(f"collectives.{n}", coll[n]) for n in coll}
    compress = line("compress", body["compress"])
    schemes = body.get("schemes", {})
    if not isinstance(schemes, dict) or not set(schemes) <= set(SCHEMES):
      raise CostsError(f"costs field 'schemes' must be an object with keys "
                       f"among {list(SCHEMES)}; got {schemes!r}.")
    schemes = {n: line(f"schemes.{n}", schemes[n]) for n in schemes}
    if not isinstance(body["backward"], list):
      raise CostsError("costs field 'backward' must be a list of per-leaf "
                       "times.")
    provenance = body.get("provenance", {})
    if not isinstance(provenance, dict):
      raise CostsError("costs field 'provenance' must be an object.")
    try:
      return cls(collectives, compress, tuple(body["backward"]),
                 contention=body.get("contention", 1.0),
                 overlap=body.get("overlap", 1.0),
                 forward=body.get("forward", 0.0), provenance=provenance,
                 workers=body.get("workers", _measured_workers(provenance)),
                 bucket=body.get("bucket", 0.0), schemes=schemes)
    except CostsError as e:
      raise CostsError(f"costs JSON: {e}") from None

  def save(self, path: str | os.PathLike) -> None:
    """Write the costs' JSON to ``path`` (whole, or the old file kept)."""
    _jsonfile.save(path, self.to_json())

  @classmethod
  def load(cls, path: str | os.PathLike) -> "Costs":
    return cls.from_json(_jsonfile.read_file(path, error=CostsError,
                                             what="jaxfuse costs file"))


# Fields a version-1 file may lack (read as their defaults: overlap 1,
# forward 0, workers from the profiled mesh) but a version-2 one may not.
_REQUIRED_SINCE_2 = {
    "overlap": "η in [0, 1], the share of the ideal overlap XLA achieves",
    "workers": "the devices the collectives were measured on, >= 2",
    "forward": "the forward time in seconds",
}


def _measured_workers(provenance: Mapping[str, Any]) -> int:
  """K₀ of a file written before ``workers`` existed: its profiled mesh's
  device count (``jaxfuse profile`` records it), else 2."""
  devices = provenance.get("devices", {})
  mesh = devices.get("mesh", {}) if isinstance(devices, dict) else {}
  if not (isinstance(mesh, dict) and all(
      plan_checks.is_int(v) and 1 <= v <= 2**20 for v in mesh.values())):
    raise CostsError(
        f"costs field 'provenance.devices.mesh'={mesh!r} must map each mesh "
        "axis to its device count (e.g. {\"data\": 8}); it gives the devices "
        "the collectives were measured on, as the field 'workers' (missing "
        "here) would. Add 'workers', or measure the costs again with "
        "`jaxfuse profile`.")
  k = math.prod(int(v) for v in mesh.values()) if mesh else 2
  return max(2, k)
