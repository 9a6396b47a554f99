"""Fusion: from a plan to selection units and statically shaped wire buffers.

A *unit* is what one threshold selects from: a single sparse leaf in an
``"ahead"`` bucket, or the concatenation of all leaves of a ``"behind"``
bucket. A sparse bucket becomes ONE uint32 buffer per worker::

  words = [ bits(v_1) ‖ bits(idx_1) ‖ bits(v_2) ‖ bits(idx_2) ‖ … ]

(values keep their dtype's bits, 16-bit values two to a word), so a single
``all_gather`` moves it. A dense bucket becomes one flat array per dtype, all
reduced by a single multi-operand ``psum``.
"""

from __future__ import annotations

import dataclasses
import math

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from jaxfuse import plans as plan_lib

INDEX_DTYPE = np.dtype(np.int32)
_UINT = {1: jnp.uint8, 2: jnp.uint16}


@dataclasses.dataclass(frozen=True)
class Unit:
  leaves: tuple[int, ...]   # leaf ids, concatenated in this order
  size: int
  capacity: int
  density: float
  estimator: str
  dtype: str


def units(plan: plan_lib.Plan) -> tuple[tuple[Unit, ...], tuple[tuple[int, ...], ...]]:
  """Selection units in ready order, and per bucket the ids of its units."""
  out, per_bucket = [], []
  for b in plan.buckets:
    ids = []
    if b.collective == "allgather":
      if b.sparsify == "behind":
        leaves = [plan.leaves[j] for j in b.leaves]
        dtype = str(jnp.result_type(*[l.dtype for l in leaves]))
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


def is_full(unit: Unit) -> bool:
  """Density 1: every element is sent (a dense warm-up phase)."""
  return unit.density >= 1.0


def leaf_offsets(plan: plan_lib.Plan, unit: Unit) -> tuple[int, ...]:
  """Start of each of the unit's leaves inside its flat concatenation."""
  sizes = [plan.leaves[j].size for j in unit.leaves]
  return tuple(int(x) for x in np.cumsum([0] + sizes[:-1]))


# --- words: any dtype <-> uint32 ---------------------------------------------

def num_words(count: int, dtype) -> int:
  return math.ceil(count * jnp.dtype(dtype).itemsize / 4)


def to_words(x: jax.Array) -> jax.Array:
  """Bits of a flat array as uint32 words (zero padded to whole words)."""
  itemsize = np.dtype(x.dtype).itemsize
  if itemsize >= 4:
    return lax.bitcast_convert_type(x, jnp.uint32).reshape(-1)
  per_word = 4 // itemsize
  # Move bits as unsigned ints: float ops (pad) could canonicalize NaNs.
  x = lax.bitcast_convert_type(x, _UINT[itemsize])
  x = jnp.pad(x, (0, -x.size % per_word)).reshape(-1, per_word)
  return lax.bitcast_convert_type(x, jnp.uint32)


def from_words(words: jax.Array, dtype, count: int) -> jax.Array:
  """Inverse of ``to_words`` on the last axis: (..., W) words -> (..., count)."""
  dtype = jnp.dtype(dtype)
  lead = words.shape[:-1]
  if dtype.itemsize == 4:
    return lax.bitcast_convert_type(words, dtype)[..., :count]
  if dtype.itemsize > 4:
    words = words.reshape(*lead, -1, dtype.itemsize // 4)
    return lax.bitcast_convert_type(words, dtype)[..., :count]
  x = lax.bitcast_convert_type(words, _UINT[dtype.itemsize])  # (..., W, per)
  x = x.reshape(*lead, -1)[..., :count]
  return lax.bitcast_convert_type(x, dtype)


def unit_words(unit: Unit) -> tuple[int, int]:
  """Words of the unit's values and of its indices."""
  return num_words(unit.capacity, unit.dtype), num_words(unit.capacity,
                                                         INDEX_DTYPE)


def pack_sparse(parts) -> jax.Array:
  """[(values, indices), …] -> one flat uint32 buffer."""
  return jnp.concatenate([w for v, i in parts for w in (to_words(v),
                                                         to_words(i))])


def unpack_sparse(words: jax.Array, bucket_units) -> list:
  """(..., W) words -> [(values (..., c), indices (..., c)), …]."""
  out, start = [], 0
  for u in bucket_units:
    nv, ni = unit_words(u)
    v = from_words(words[..., start:start + nv], u.dtype, u.capacity)
    i = from_words(words[..., start + nv:start + nv + ni], INDEX_DTYPE,
                   u.capacity)
    out.append((v, i))
    start += nv + ni
  return out


def pack_dense(leaves) -> dict:
  """Flat concatenation per dtype: {dtype: array}."""
  groups = {}
  for x in leaves:
    groups.setdefault(str(x.dtype), []).append(x.reshape(-1))
  return {d: jnp.concatenate(xs) for d, xs in groups.items()}


def unpack_dense(buffers: dict, like) -> list:
  """Inverse of ``pack_dense`` given the leaves' shapes and dtypes."""
  starts = {d: 0 for d in buffers}
  out = []
  for x in like:
    d = str(x.dtype)
    n = math.prod(x.shape)
    out.append(buffers[d][starts[d]:starts[d] + n].reshape(x.shape))
    starts[d] += n
  return out


def bucket_wire_bytes(plan: plan_lib.Plan) -> list[int]:
  """Bytes one worker contributes to each bucket's collective per step."""
  all_units, per_bucket = units(plan)
  out = []
  for b, unit_ids in zip(plan.buckets, per_bucket):
    if b.collective == "psum" or all(is_full(all_units[u])
                                     for u in unit_ids):
      out.append(sum(plan.leaves[j].size *
                     jnp.dtype(plan.leaves[j].dtype).itemsize
                     for j in b.leaves))
    else:
      out.append(4 * sum(sum(unit_words(all_units[u])) for u in unit_ids))
  return out
