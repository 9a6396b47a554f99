"""What a plan may hold: the names each field takes, the numbers it
accepts, and ``check_plan``, the consistency check every ``Plan`` passes
when it is made (by ``jaxfuse.plan``, by hand or from a file). Errors are
``PlanError``s that name the field, leaf or bucket."""

from __future__ import annotations

import math
import numbers

import jax

from jaxfuse import _compat

MODES = ("sparse", "dense")
ESTIMATORS = ("topk", "dgc", "gaussian", "redsync", "sidco")
# jaxfuse.collectives
SPARSE_COLLECTIVES = ("allgather", "zen", "spardl", "hier")
RESIDUAL_DTYPES = ("float32", "gradient")  # Settings.residual_dtype
FULL_WIRES = ("gradient", "bfloat16")  # Settings.full_wire
SPARSE_WIRES = ("gradient", "bfloat16", "int8", "int4", "int2")
# Settings.sparse_wire's quantized values: bits per value, with one float32
# scale per QUANT_CHUNK slots (fusion.quantize_values)
QUANTIZED_WIRES = {"int8": 8, "int4": 4, "int2": 2}
QUANT_CHUNK = 64
COLLECTIVES = SPARSE_COLLECTIVES + ("psum",)
SPARSIFY = ("ahead", "behind")
MAX_LEAF_SIZE = 2**31 - 2  # int32 indices with one sentinel value left over
# sparse schemes that index a bucket as one space (allgather: each leaf)
BUCKET_INDEXED = ("zen", "spardl", "hier")


def overflows_one_space(collective: str, size: int) -> bool:
  """A sparse bucket of ``size`` elements that ``collective`` would index
  as one int32 space (``BUCKET_INDEXED``) too large for it."""
  return collective in BUCKET_INDEXED and size > MAX_LEAF_SIZE


class PlanError(ValueError):
  """A plan that is malformed or does not match the parameters."""


def is_leaf_order(order, num_leaves: int) -> bool:
  """Whether ``order`` lists each leaf id 0 … num_leaves − 1 exactly once."""
  return sorted(order) == list(range(num_leaves))


def check_density(where: str, density) -> None:
  if not is_real(density) or not 0 < density <= 1:
    raise PlanError(f"{where}: density={density!r} must be in (0, 1].")


def is_real(x) -> bool:
  """A real number (Python or numpy), not a bool."""
  return isinstance(x, numbers.Real) and not isinstance(x, bool)


def is_int(x) -> bool:
  """An integer (Python or numpy), not a bool."""
  return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def as_python(x):
  """A numpy integer or real, or a concrete 0-d JAX array, as the Python
  number of its value (JAX takes numpy scalars as typed: ``bf16 *
  np.float32(0.9)`` is float32, ``bf16 * 0.9`` bfloat16); anything else
  (a traced value included) as it is."""
  if is_int(x):
    return int(x)
  if is_real(x):
    return float(x)
  if (isinstance(x, jax.Array) and not _compat.is_tracer(x) and x.ndim == 0
      and x.dtype != bool):
    return x.item()
  return x


def is_dtype_name(name) -> bool:
  try:
    return isinstance(name, str) and bool(jax.numpy.dtype(name).name)
  except TypeError:
    return False


def one_of(field: str, value, choices) -> None:
  """PlanError naming ``field`` unless ``value`` is one of ``choices``."""
  if value not in choices:
    raise PlanError(f"{field}={value!r}; use one of "
                    f"{', '.join(map(repr, choices))}.")


def check_plan(plan) -> None:
  """Internal consistency: every field known, every leaf in exactly one
  bucket."""
  check_settings(plan.settings)
  _check_leaves(plan)
  _check_buckets(plan)


def check_settings(s) -> None:
  """PlanError naming the field of ``Settings`` ``s`` that is wrong."""
  if not (is_real(s.headroom) and math.isfinite(s.headroom)
          and s.headroom >= 1):
    raise PlanError(f"settings.headroom={s.headroom!r} must be a finite "
                    "number >= 1 (slots per leaf over the target count "
                    "⌈ρ·n⌉; 1.5 by default).")
  if not (is_int(s.min_sparse_size) and s.min_sparse_size >= 1):
    raise PlanError(f"settings.min_sparse_size={s.min_sparse_size!r} must "
                    "be an integer >= 1.")
  if not (is_int(s.seed) and 0 <= s.seed < 2**32):
    raise PlanError(f"settings.seed={s.seed!r} must be an integer in "
                    "[0, 2**32) (it seeds uint32 hashes).")
  check_estimation(s.estimation)
  one_of("settings.full_wire", s.full_wire, FULL_WIRES)
  one_of("settings.sparse_wire", s.sparse_wire, SPARSE_WIRES)
  one_of("settings.residual_dtype", s.residual_dtype, RESIDUAL_DTYPES)


def _check_leaves(plan) -> None:
  """Each leaf's fields (PlanError naming the leaf)."""
  for i, leaf in enumerate(plan.leaves):
    if not isinstance(leaf.path, str):
      raise PlanError(f"leaf {i}: path={leaf.path!r} must be a string (the "
                      "leaf's key path, e.g. \"['dense1']['kernel']\"); the "
                      "plan file is corrupted: make the plan again.")
    where = f"leaf {leaf.path}"
    if not (isinstance(leaf.shape, tuple) and
            all(is_int(d) and d >= 0 for d in leaf.shape)):
      raise PlanError(f"{where}: shape={leaf.shape!r} must be a list of "
                      "integers >= 0.")
    if not is_dtype_name(leaf.dtype):
      raise PlanError(f"{where}: dtype={leaf.dtype!r} is not a dtype name "
                      "(e.g. 'float32').")
    one_of(f"{where}: mode", leaf.mode, MODES)
    if leaf.size == 0:
      raise PlanError(f"{where}: has zero elements; remove it from the "
                      "parameters or give it a non-empty shape.")
    if leaf.size > MAX_LEAF_SIZE:
      raise PlanError(f"{where}: {leaf.size} elements exceed int32 indices; "
                      "split the parameter.")
    check_density(where, leaf.density)
    if leaf.mode == "sparse":
      if not _compat.is_float_dtype(leaf.dtype):
        raise PlanError(f"{where}: dtype {leaf.dtype} cannot be sparse; "
                        "make it dense.")
      one_of(f"{where}: estimator", leaf.estimator, ESTIMATORS)
      if not (is_int(leaf.capacity) and
              1 <= leaf.capacity <= leaf.size):
        raise PlanError(f"{where}: capacity={leaf.capacity!r} must be an "
                        f"integer in [1, {leaf.size}] (its slots per step: "
                        "at least one, at most its elements); make the plan "
                        "again (jaxfuse.plan sets it from density and "
                        "headroom), or make the leaf dense.")


def check_estimation(e) -> None:
  """PlanError naming the ``settings.estimation`` field that is wrong."""
  if not isinstance(e.feedback, bool):
    raise PlanError(f"settings.estimation.feedback={e.feedback!r} must be "
                    "True or False.")
  if not (is_int(e.refresh) and e.refresh >= 1):
    raise PlanError(f"settings.estimation.refresh={e.refresh!r} must be an "
                    "integer >= 1.")
  if not (is_real(e.sample_fraction) and 0 < e.sample_fraction <= 1):
    raise PlanError(f"settings.estimation.sample_fraction="
                    f"{e.sample_fraction!r} must be a number in (0, 1].")
  if not (is_int(e.sidco_stages) and 1 <= e.sidco_stages <= 8):
    raise PlanError(f"settings.estimation.sidco_stages={e.sidco_stages!r} "
                    "must be 1..8.")


def check_scheme(where: str, scheme) -> None:
  """PlanError naming the bucket (``where``) and the field of its scheme
  (``BucketPlan.scheme``) whose value is out of range, with the fix."""
  name = getattr(scheme, "name", None)
  fix = "; give the bucket's scheme a valid value (jaxfuse.collectives)."
  if name == "zen":
    if not (is_real(scheme.table) and math.isfinite(scheme.table)
            and scheme.table >= 1):
      raise PlanError(f"{where}: Zen(table={scheme.table!r}) must be a "
                      f"finite number >= 1{fix}")
    if not (is_real(scheme.union) and 0 < scheme.union <= 1):
      raise PlanError(f"{where}: Zen(union={scheme.union!r}) must be in "
                      f"(0, 1]{fix}")
  elif name == "spardl":
    if not (is_int(scheme.teams) and scheme.teams >= 1):
      raise PlanError(f"{where}: SparDL(teams={scheme.teams!r}) must be an "
                      f"integer >= 1 (1: no teams){fix}")
    if not (is_real(scheme.block) and math.isfinite(scheme.block)
            and scheme.block > 0):
      raise PlanError(f"{where}: SparDL(block={scheme.block!r}) must be a "
                      f"finite number > 0{fix}")
  elif name == "allgather":
    if not isinstance(scheme.packed_indices, bool):
      raise PlanError(f"{where}: AllGather(packed_indices="
                      f"{scheme.packed_indices!r}) must be True or False"
                      f"{fix}")
  elif name == "hier":
    check_scheme(f"{where} (Hier's inner)", scheme.inner)
def _check_buckets(plan) -> None:
  """Each bucket's fields; every leaf in exactly one bucket."""
  seen = []
  for i, b in enumerate(plan.buckets):
    where = f"bucket {i}"
    if not b.leaves:
      raise PlanError(f"{where}: has no leaves.")
    one_of(f"{where}: collective", b.collective, COLLECTIVES)
    if b.scheme is not None and getattr(b.scheme, "name", None) != \
        b.collective:
      raise PlanError(f"{where}: scheme={b.scheme!r} is not a "
                      f"{b.collective!r} scheme; give a scheme of "
                      "jaxfuse.collectives whose name is the collective, "
                      "or scheme=None for its defaults (replacing a "
                      "bucket's collective: replace its scheme too).")
    check_scheme(where, b.scheme)
    one_of(f"{where}: sparsify", b.sparsify, SPARSIFY)
    if any(not is_int(j) or not 0 <= j < len(plan.leaves)
           for j in b.leaves):
      raise PlanError(f"{where}: leaf ids {list(b.leaves)} out of range "
                      f"[0, {len(plan.leaves)}).")
    modes = {plan.leaves[j].mode for j in b.leaves}
    if len(modes) != 1:
      raise PlanError(f"{where}: mixes sparse and dense leaves; a bucket "
                      "holds one mode.")
    mode = modes.pop()
    want = SPARSE_COLLECTIVES if mode == "sparse" else ("psum",)
    if b.collective not in want:
      raise PlanError(f"{where}: {mode} leaves need collective "
                      f"{' or '.join(map(repr, want))}, not {b.collective!r}.")
    if (mode == "sparse" and b.collective != "allgather" and
        plan.settings.sparse_wire in QUANTIZED_WIRES):
      raise PlanError(
          f"{where}: settings.sparse_wire={plan.settings.sparse_wire!r} "
          "quantizes each worker's values with its own scales, which only "
          f"'allgather' decodes exactly, not {b.collective!r}; pass "
          "collective='allgather' (or jaxfuse.collectives.AllGather("
          "packed_indices=True)), or a float sparse_wire.")
    size = sum(plan.leaves[j].size for j in b.leaves)
    if mode == "sparse" and overflows_one_space(b.collective, size):
      raise PlanError(
          f"{where}: {b.collective!r} indexes the bucket's {size} elements "
          f"as one int32 space (at most {MAX_LEAF_SIZE}); split the bucket "
          "(a smaller bucket_bytes, or strategy='layerwise') or send it with "
          "'allgather', which indexes each leaf on its own.")
    if b.sparsify == "behind" and mode == "sparse":
      if size > MAX_LEAF_SIZE:
        raise PlanError(f"{where}: fused size {size} exceeds int32 indices.")
      check_density(where, b.density)
      one_of(f"{where}: estimator", b.estimator, ESTIMATORS)
      if not (is_int(b.capacity) and 1 <= b.capacity <= size):
        raise PlanError(f"{where}: capacity={b.capacity!r} must be in "
                        f"[1, {size}].")
    seen.extend(b.leaves)
  if not is_leaf_order(seen, len(plan.leaves)):
    raise PlanError("every leaf must be in exactly one bucket; got leaf ids "
                    f"{sorted(seen)} for {len(plan.leaves)} leaves.")
