"""The plan: an immutable, JSON-serializable description of a sparse sync.

Per leaf (pytree order): path, shape, dtype, mode (``"sparse"`` | ``"dense"``),
density ρ, capacity c = ⌈ρ·n·headroom⌉ (static slots per step) and estimator.
Per bucket (backward-ready order): the leaf ids it fuses, in ready order, the
collective that moves its single buffer, and whether its sparse leaves are
selected each on its own (``"ahead"``, SAFusion) or jointly over the fused
buffer (``"behind"``, the baseline that starves small tensors).

JSON only, never pickle: a plan file from elsewhere cannot run code.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import os
from fractions import Fraction
from typing import Any, Mapping

import jax
import numpy as np

from jaxfuse import _compat
from jaxfuse.plans import jsonfile as _jsonfile
# a unit's slots on the wire (re-exported: plans.wire_unit, payload_bytes, ...)
from jaxfuse.plans.wire import (  # pylint: disable=unused-import
    narrower_dtype, index_bits, index_words, num_words, packs_indices,
    payload_bytes, value_words, wire_unit)
# the fields' names, the number checks and PlanError, used through here
from jaxfuse.plans.checks import (  # pylint: disable=unused-import
    COLLECTIVES, ESTIMATORS, FULL_WIRES, MAX_LEAF_SIZE, MODES,
    QUANT_CHUNK, QUANTIZED_WIRES, RESIDUAL_DTYPES, SPARSE_COLLECTIVES,
    SPARSE_WIRES, SPARSIFY, PlanError,
    as_python, check_plan, is_int, is_leaf_order, is_real,
    overflows_one_space)

FORMAT = "jaxfuse.plan"
FORMAT_VERSION = 2


def leaf_paths(tree) -> list[str]:
  """``jax.tree_util.keystr`` of every leaf, in pytree order."""
  return [jax.tree_util.keystr(p)
          for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def decimal_product(n: int, *factors: float) -> Fraction:
  """n·∏f exactly, each factor read as the shortest decimal that prints it:
  0.07 × 100 is 7, where binary 0.07000000000000000666 gives 7.000…01 (one
  slot more under ⌈·⌉). Slot counts from settings are taken of this."""
  exact = Fraction(n)
  for f in factors:
    exact *= Fraction(str(float(f)))
  return exact


def ceil_product(n: int, *factors: float) -> int:
  """⌈n·∏f⌉ of ``decimal_product``."""
  return math.ceil(decimal_product(n, *factors))


def capacity_for(density: float, size: int, headroom: float) -> int:
  """c = min(n, ⌈ρ·n·headroom⌉), at least 1 (ρ and headroom as decimals)."""
  return max(1, min(size, ceil_product(size, density, headroom)))


def target_count(density: float, size: int) -> int:
  """k = ⌈ρ·n⌉: how many elements a step should select (ρ as a decimal)."""
  return max(1, min(size, ceil_product(size, density)))


def capacity(density: float, size: int, estimator: str,
             headroom: float) -> int:
  """A unit's static slot count: k for the exact ``topk`` estimator, k with
  headroom for the sampled ones (n at density 1)."""
  if estimator == "topk":
    return target_count(density, size)
  return capacity_for(density, size, headroom)


@dataclasses.dataclass(frozen=True)
class LeafPlan:
  path: str
  shape: tuple[int, ...]
  dtype: str
  mode: str
  density: float
  capacity: int
  estimator: str | None

  @property
  def size(self) -> int:
    return math.prod(self.shape)


@dataclasses.dataclass(frozen=True)
class BucketPlan:
  """One bucket: its leaves, the collective that moves it and how.

  collective: the scheme's name (one of ``COLLECTIVES``).
  scheme: the scheme with its configuration, an object of
    ``jaxfuse.collectives`` (``AllGather(packed_indices)``,
    ``Zen(table, union)``, ``SparDL(teams, block)``, ``Hier(inner)``,
    ``Psum()``) whose ``name`` is ``collective``; None: that scheme's
    defaults. The plan's JSON stores its fields with the bucket.
  """
  leaves: tuple[int, ...]
  collective: str
  sparsify: str = "ahead"
  capacity: int = 0             # "behind" only: slots of the fused selection
  estimator: str | None = None  # "behind" only
  density: float = 1.0          # "behind" only
  scheme: Any = None


@dataclasses.dataclass(frozen=True)
class Estimation:
  """How the sampled estimators find their threshold τ (every leaf's).

  refresh: re-estimate τ every ``refresh`` steps; in between only feedback
    (and a fresh estimate where no τ is kept yet: after a dense phase or
    for a unit new after ``relayout``).
  feedback: scale τ step to step so the selected count tracks ρ·n.
  sample_fraction: share of elements the ``"dgc"`` estimator samples.
  sidco_stages: exponential-fit stages of ``"sidco"``.
  """
  refresh: int = 1
  feedback: bool = True
  sample_fraction: float = 0.01
  sidco_stages: int = 2


@dataclasses.dataclass(frozen=True)
class Settings:
  """Knobs shared by every leaf. Each bucket's collective keeps its own
  configuration (``BucketPlan.scheme``, e.g. ``jaxfuse.collectives.Zen(
  table, union)``); the estimators' knobs are in ``estimation``.

  headroom: capacity over target count (c = ⌈ρ·n·headroom⌉).
  min_sparse_size: leaves with fewer elements are synchronized dense.
  seed: for sampling and for the overflow rotation.
  residual_dtype: dtype of the per-worker residual and velocity of a unit.
    ``"float32"`` (default): at least float32 (``promote_types(dtype,
    float32)``), so a bfloat16 gradient's small contributions accumulate
    instead of rounding away; what goes on the wire stays in the gradient
    dtype, and its rounding error stays in the residual. ``"gradient"``:
    the gradient's own dtype (half the state memory for bfloat16, lossy).
  full_wire: dtype in which density-1 units (a dense warm-up phase) go on
    the wire: ``"gradient"`` (default, the gradient's), or ``"bfloat16"``
    for float32 gradients, which halves the phase's bytes (PyTorch DDP's
    compression hook; bfloat16 keeps float32's range, so nothing
    overflows). Each worker's rounding stays in its residual, sent with
    the next step: x_t + r_t = wire_t + r_{t+1}, so only the reduction's
    own rounding is lost. Phases may differ in it.
  sparse_wire: dtype of the selected values of sparse units on the wire
    (their indices: ``AllGather(packed_indices)``): ``"gradient"``
    (default), or ``"bfloat16"`` for float32 (or wider) gradients, which
    cuts a float32 slot from 8 to 6 bytes (a quarter of a sparse bucket's
    traffic). r' = acc − bf16(v) at the sent slots, so each worker's
    rounding is sent later; the schemes decode in float32 and keep what
    their own sums lose to the wire (ZEN's reducer, SparDL's merges,
    ``"hier"``'s mean on host 0) in a residual: nothing is lost but
    float32 rounding. A finite value beyond bfloat16's range goes as its
    largest value. ``"int8"``, ``"int4"``, ``"int2"``: b-bit codes with
    one float32 scale s per 64 slots (``fusion.quantize_values``; 2 bits
    and 1/2 bit of scale a value for ``"int2"``), the rounding kept in
    the residual as above; ``"allgather"`` buckets only.
  estimation: the threshold estimators' knobs (``Estimation``).
  """
  headroom: float = 1.5
  min_sparse_size: int = 1024
  seed: int = 0
  residual_dtype: str = "float32"
  full_wire: str = "gradient"
  sparse_wire: str = "gradient"
  estimation: Estimation = Estimation()


@dataclasses.dataclass(frozen=True)
class Plan:
  leaves: tuple[LeafPlan, ...]
  buckets: tuple[BucketPlan, ...]
  settings: Settings = Settings()
  provenance: Mapping[str, Any] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    check_plan(self)

  # --- derived views -------------------------------------------------------
  @property
  def ready_order(self) -> tuple[int, ...]:
    return tuple(i for b in self.buckets for i in b.leaves)

  def bytes_per_worker(self) -> int:
    """Bytes each worker contributes per step, all buckets (its packed
    slots; what the wire carries for K workers: ``jaxfuse.collectives``)."""
    return sum(bucket_payload_bytes(self))

  def dense_bytes(self) -> int:
    return sum(l.size * jax.numpy.dtype(l.dtype).itemsize for l in self.leaves)

  def summary(self) -> str:
    """The plan in a few lines: its totals, then each bucket's scheme with
    its configuration, how it sparsifies, and its leaves.

    A sparse bucket reads ``Zen(table=3.0, union=1.0), ahead, 2 leaves
    (ρ 0.05, dgc): ['a'], ['c']``: the scheme (its defaults where the plan
    keeps none), ``ahead`` (each leaf selected on its own, at its ρ) or
    ``behind`` (one fused selection, with its capacity), then its leaves;
    a dense bucket reads ``psum, 1 leaf: ['b']``.

    Returns:
      The text, one line a bucket after two of totals (the second: the
      bytes each worker sends a sync, also per parameter).
    """
    elements = sum(l.size for l in self.leaves)
    wire = self.bytes_per_worker()
    lines = [f"jaxfuse plan: {len(self.leaves)} leaves, {len(self.buckets)} "
             f"buckets, strategy={self.provenance.get('strategy', '?')}",
             f"  dense bytes {self.dense_bytes():,}; wire bytes per worker "
             f"{wire:,} ({wire / max(elements, 1):.4g} per parameter)"]
    for i, b in enumerate(self.buckets):
      lines.append(f"  bucket {i}: {self._bucket_line(b)}")
    return "\n".join(lines)

  def _bucket_line(self, b: BucketPlan) -> str:
    names = ", ".join(self.leaves[j].path for j in b.leaves[:3])
    more = f" … (+{len(b.leaves) - 3})" if len(b.leaves) > 3 else ""
    count = f"{len(b.leaves)} " + ("leaf" if len(b.leaves) == 1 else "leaves")
    if b.collective == "psum":
      return f"psum, {count}: {names}{more}"
    scheme = b.scheme if b.scheme is not None else SCHEME_TYPES.get(
        b.collective, lambda: b.collective)()
    if b.sparsify == "behind":
      how = (f"behind (ρ {b.density:g}, {b.estimator}, capacity "
             f"{b.capacity:,})")
      return f"{scheme!r}, {how}, {count}: {names}{more}"
    rhos = sorted({self.leaves[j].density for j in b.leaves})
    ests = sorted({str(self.leaves[j].estimator) for j in b.leaves})
    rho = "/".join(f"{r:g}" for r in rhos)
    return (f"{scheme!r}, ahead, {count} (ρ {rho}, "
            f"{'/'.join(ests)}): {names}{more}")

  # --- validation against parameters --------------------------------------
  def validate(self, params) -> None:
    """Raise ``PlanError`` naming the first leaf that does not match."""
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    paths = [jax.tree_util.keystr(p) for p, _ in flat]
    planned = [l.path for l in self.leaves]
    if paths != planned:
      missing = [p for p in planned if p not in paths]
      extra = [p for p in paths if p not in planned]
      if missing or extra:
        part = ("" if extra else
                " An optax wrapper such as optax.multi_transform or "
                "optax.masked hands its optimizer a part of the tree: to "
                "freeze parameters leave them out of what you differentiate; "
                "optax.multi_transform works when every part is a jaxfuse "
                "optimizer with its part's plan (docs/choosing.md, "
                "\"Freezing parameters, and optax.multi_transform\").")
        raise PlanError(
            "plan and parameters have different leaves: "
            f"in the plan only {missing[:5]}, in the parameters only "
            f"{extra[:5]}. Make the plan from these parameters "
            f"(jaxfuse.plan(params, ...)).{part}")
      raise PlanError("plan and parameters list their leaves in a different "
                      "order; make the plan from these parameters.")
    for (_, x), leaf in zip(flat, self.leaves):
      shape, dtype = tuple(np.shape(x)), str(jax.numpy.result_type(x))
      if shape != leaf.shape or dtype != leaf.dtype:
        raise PlanError(
            f"leaf {leaf.path}: plan has {leaf.dtype}{list(leaf.shape)}, "
            f"parameters have {dtype}{list(shape)}. Make a new plan for "
            "this model.")

  # --- JSON -------------------------------------------------------------------
  def to_json(self) -> str:
    """The plan as JSON text (format version 2: each bucket's ``scheme``
    as its fields, ``scheme_json``)."""
    return _jsonfile.write({
        "settings": dataclasses.asdict(self.settings),
        "provenance": dict(self.provenance),
        "leaves": [dict(dataclasses.asdict(l), shape=list(l.shape))
                   for l in self.leaves],
        "buckets": [_bucket_json(b) for b in self.buckets],
    }, fmt=FORMAT, version=FORMAT_VERSION)

  @classmethod
  def from_json(cls, text: str) -> "Plan":
    """The plan of ``to_json``'s text.

    Args:
      text: a plan file's text, format version 2 or 1 (what jaxfuse 0.2
        wrote: its ``settings`` held the schemes' knobs, which move into
        each bucket's ``scheme``, and the estimators', which move into
        ``Settings.estimation``).

    Returns:
      The ``Plan``.

    Raises:
      PlanError: not a plan, a later version (naming the file's and the
        newest this jaxfuse reads), or fields missing or unknown.
    """
    body = _jsonfile.read(text, fmt=FORMAT, max_version=FORMAT_VERSION,
                          error=PlanError, what="jaxfuse plan")
    try:
      if body["version"] == 1:
        body = _upgraded_v1(body)
      fields = dict(body["settings"])
      fields["estimation"] = Estimation(**fields.get("estimation", {}))
      settings = Settings(**fields)
      leaves = tuple(LeafPlan(**dict(l, shape=tuple(l["shape"])))
                     for l in body["leaves"])
      buckets = tuple(_bucket_of_json(b) for b in body["buckets"])
      provenance = dict(body.get("provenance", {}))
    except PlanError:
      raise
    except (KeyError, TypeError, ValueError) as e:   # ValueError: dict("x")
      raise PlanError(f"plan JSON is missing or has unknown fields ({e}); "
                      "the file is corrupted.") from None
    return cls(leaves, buckets, settings, provenance)

  def save(self, path: str | os.PathLike) -> None:
    """Write the plan's JSON to ``path`` (whole, or the old file kept)."""
    _jsonfile.save(path, self.to_json())

  @classmethod
  def load(cls, path: str | os.PathLike) -> "Plan":
    return cls.from_json(_jsonfile.read_file(path, error=PlanError,
                                             what="jaxfuse plan"))


# Format 1 (jaxfuse 0.2): ``settings`` held these knobs of the schemes ...
V1_SCHEME_FIELDS = ("zen_table", "zen_union", "spardl_teams",
                    "spardl_block", "hier_inner", "packed_indices")
# ... and of the estimators (now ``Settings.estimation``).
V1_ESTIMATION_FIELDS = ("refresh", "feedback", "sample_fraction",
                        "sidco_stages")


def scheme_json(scheme) -> dict | None:
  """A bucket's scheme object as JSON fields: its ``name`` and its
  configuration, e.g. ``{"name": "zen", "table": 2.0, "union": 1.0}``
  (``Hier``'s ``inner`` nested the same way); None stays None."""
  if scheme is None:
    return None
  out = {"name": scheme.name}
  for f in dataclasses.fields(scheme):
    value = getattr(scheme, f.name)
    out[f.name] = (scheme_json(value) if dataclasses.is_dataclass(value)
                   else as_python(value))
  return out


def _bucket_json(b: BucketPlan) -> dict:
  return dict(dataclasses.asdict(dataclasses.replace(b, scheme=None)),
              leaves=list(b.leaves), scheme=scheme_json(b.scheme))


# The scheme classes by name (``jaxfuse.collectives`` registers them when it
# is imported, as ``import jaxfuse`` does: the plan model imports no scheme).
SCHEME_TYPES: dict[str, type] = {}

# Format 1's settings field of each scheme field, by scheme.
V1_SCHEME_KNOBS = {"allgather": {"packed_indices": "packed_indices"},
                   "zen": {"table": "zen_table", "union": "zen_union"},
                   "spardl": {"teams": "spardl_teams", "block": "spardl_block"},
                   "psum": {}}


def register_schemes(types: Mapping[str, type]) -> None:
  """Make the scheme classes ``types`` ({name: class}) known to plan files
  (``jaxfuse.collectives`` calls this once)."""
  SCHEME_TYPES.update(types)


def _scheme_type(name) -> type:
  if name not in SCHEME_TYPES:
    raise PlanError(f"collective {name!r} is not available; use one of "
                    f"{tuple(SCHEME_TYPES)}.")
  return SCHEME_TYPES[name]


def scheme_of_json(fields: Mapping):
  """The scheme object of ``scheme_json``'s fields (``PlanError`` naming
  an unknown scheme or field)."""
  if not isinstance(fields, Mapping):
    raise PlanError(f"bucket scheme {fields!r} must be an object with a "
                    "'name'; the plan file is corrupted.")
  fields = dict(fields)
  name = fields.pop("name", None)
  kind = _scheme_type(name)
  known = {f.name for f in dataclasses.fields(kind)}
  if set(fields) - known:
    raise PlanError(
        f"bucket scheme {name!r} has no field(s) {sorted(set(fields) - known)}"
        f"; {name!r} takes {sorted(known)}. The plan file is corrupted.")
  if isinstance(fields.get("inner"), Mapping):
    fields["inner"] = scheme_of_json(fields["inner"])
  return kind(**fields)


def v1_scheme(name: str, knobs: Mapping):
  """The scheme ``name`` configured by the knobs a format-1 plan's
  settings stored (0.2's ``zen_table`` … ``packed_indices``; one missing:
  the scheme's default, which was 0.2's)."""
  if name == "hier":
    return _scheme_type(name)(
        inner=v1_scheme(knobs.get("hier_inner", "allgather"), knobs))
  fields = V1_SCHEME_KNOBS.get(name, {})
  return _scheme_type(name)(**{f: knobs[k] for f, k in fields.items()
                               if k in knobs})


def _bucket_of_json(fields: dict) -> BucketPlan:
  """A ``BucketPlan`` of its JSON fields (the scheme an object again)."""
  fields = dict(fields, leaves=tuple(fields["leaves"]))
  if fields.get("scheme") is not None:
    fields["scheme"] = scheme_of_json(fields["scheme"])
  return BucketPlan(**fields)


def _upgraded_v1(body: dict) -> dict:
  """A format-1 body as format 2: the scheme knobs of 0.2's ``settings``
  go into each bucket's ``scheme``, the estimators' into ``estimation``."""
  settings = dict(body["settings"])
  knobs = {k: settings.pop(k) for k in V1_SCHEME_FIELDS if k in settings}
  settings["estimation"] = {k: settings.pop(k) for k in V1_ESTIMATION_FIELDS
                            if k in settings}
  buckets = [dict(b, scheme=None if b.get("collective") == "psum" else
                  scheme_json(v1_scheme(b["collective"], knobs)))
             for b in body["buckets"]]
  return dict(body, version=FORMAT_VERSION, settings=settings,
              buckets=buckets)


def require_plan(plan, where: str) -> None:
  """TypeError unless ``plan`` is a ``Plan`` (``where``: the caller)."""
  if not isinstance(plan, Plan):
    raise TypeError(f"{where} expects a jaxfuse.Plan, got "
                    f"{type(plan).__name__}; make one with "
                    "jaxfuse.plan(params).")


def _is_float(dtype: str) -> bool:
  return _compat.is_float_dtype(dtype)


# --- derived views: selection units and their payload ----------------------

@dataclasses.dataclass(frozen=True)
class Unit:
  """What one threshold selects from: a sparse leaf of an ``"ahead"``
  bucket, or the concatenation of a ``"behind"`` bucket's leaves."""
  leaves: tuple[int, ...]   # leaf ids, concatenated in this order
  size: int
  capacity: int
  density: float
  estimator: str
  dtype: str
  index_bits: int = 32      # bits of an index on the wire (``wire_unit``)
  value_bits: int = 0       # bits of a quantized value on the wire; 0: dtype


def units(plan: Plan
          ) -> tuple[tuple[Unit, ...], tuple[tuple[int, ...], ...]]:
  """Selection units in ready order, and per bucket the ids of its units."""
  out, per_bucket = [], []
  for b in plan.buckets:
    ids = []
    if b.collective != "psum":
      if b.sparsify == "behind":
        leaves = [plan.leaves[j] for j in b.leaves]
        dtype = str(jax.numpy.result_type(*[l.dtype for l in leaves]))
        ids.append(len(out))
        out.append(Unit(b.leaves, sum(l.size for l in leaves), b.capacity,
                        b.density, b.estimator, dtype))
      else:
        for j in b.leaves:
          l = plan.leaves[j]
          ids.append(len(out))
          out.append(Unit((j,), l.size, l.capacity, l.density, l.estimator,
                          l.dtype))
    per_bucket.append(tuple(ids))
  return tuple(out), tuple(per_bucket)


def state_groups(plan: Plan) -> tuple[tuple[int, ...], ...]:
  """Unit ids whose per-worker state (residual, velocity) is stored as one
  (G, size) array: the units of one bucket with the same size and dtype, in
  ready order. The key ignores density and capacity, so every phase of a
  density warm-up (``with_density``) has the same groups and its state
  carries over. Stored together, a group's rows go through the selection
  as one batch with no copy in or out."""
  return group_units(*units(plan))


def group_units(all_units: tuple[Unit, ...],
                per_bucket: tuple[tuple[int, ...], ...]
                ) -> tuple[tuple[int, ...], ...]:
  """``state_groups`` of the units ``units(plan)`` returned."""
  out = []
  for ids in per_bucket:
    keys = {}
    for u in ids:
      keys.setdefault((all_units[u].size, all_units[u].dtype), []).append(u)
    out.extend(tuple(g) for g in keys.values())
  return tuple(out)


def unit_rows(plan: Plan) -> tuple[tuple[int, int], ...]:
  """Per unit (in ``units`` order): (its state group, its row there)."""
  rows = {u: (g, i) for g, ids in enumerate(state_groups(plan))
          for i, u in enumerate(ids)}
  return tuple(rows[u] for u in range(len(rows)))


def state_dtype(unit: Unit, settings: Settings) -> str:
  """dtype of the unit's residual and velocity (``Settings.residual_dtype``):
  the gradient's, or at least float32."""
  if settings.residual_dtype == "gradient":
    return unit.dtype
  return _at_least_float32(unit.dtype)


@functools.lru_cache(maxsize=None)
def _at_least_float32(dtype: str) -> str:
  return str(np.dtype(jax.numpy.promote_types(dtype, np.float32)))


def full_wire_dtype(unit: Unit, settings: Settings) -> str:
  """dtype of a density-1 unit on the wire (``Settings.full_wire``): the
  gradient's, or the narrower of it and ``full_wire``."""
  return narrower_dtype(unit.dtype, settings.full_wire)


def bucket_scheme(bucket: BucketPlan):
  """The bucket's configured scheme, or its name where it keeps its
  scheme's defaults (``BucketPlan.scheme`` None)."""
  return bucket.collective if bucket.scheme is None else bucket.scheme


def is_full(unit: Unit) -> bool:
  """Density 1: every element is sent (a dense warm-up phase)."""
  return unit.density >= 1.0


def leaf_offsets(plan: Plan, unit: Unit) -> tuple[int, ...]:
  """Start of each of the unit's leaves inside its flat concatenation."""
  sizes = [plan.leaves[j].size for j in unit.leaves]
  return tuple(itertools.accumulate(sizes[:-1], initial=0))


def bucket_payload_bytes(plan: Plan) -> list[int]:
  """Bytes one worker contributes to each bucket per step: its packed
  (values ‖ indices) slots, or the leaves themselves where all is sent.
  What reaches the wire for K workers depends on the collective
  (``jaxfuse.collectives``; ``"hier"`` counts the slots a worker selects,
  C = Σ_u c_u, although its host-axis shard sends min(⌈N/L⌉, C))."""
  all_units, per_bucket = units(plan)
  out = []
  for b, unit_ids in zip(plan.buckets, per_bucket):
    if b.collective == "psum":
      out.append(sum(plan.leaves[j].size *
                     np.dtype(plan.leaves[j].dtype).itemsize
                     for j in b.leaves))
    elif all(is_full(all_units[u]) for u in unit_ids):
      out.append(sum(all_units[u].size * np.dtype(
          full_wire_dtype(all_units[u], plan.settings)).itemsize
                     for u in unit_ids))
    else:
      out.append(sum(payload_bytes(wire_unit(all_units[u], plan.settings,
                                             bucket_scheme(b)))
                     for u in unit_ids))
  return out
