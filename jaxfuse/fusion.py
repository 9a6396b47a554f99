"""Fusion: a bucket's selection units into one statically shaped wire buffer.

A sparse bucket (its units: ``plans.units``) becomes ONE uint32 buffer per
worker::

  words = [ bits(v_1) ‖ bits(idx_1) ‖ bits(v_2) ‖ bits(idx_2) ‖ … ]

(values keep their dtype's bits, 16-bit values two to a word), so a single
``all_gather`` moves it. A dense bucket becomes one flat array per dtype, all
reduced by a single multi-operand ``psum``.
"""

from __future__ import annotations

import math

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from jaxfuse.plans import Unit
from jaxfuse.plans import num_words

INDEX_DTYPE = np.dtype(np.int32)
_UINT = {1: jnp.uint8, 2: jnp.uint16}


# --- words: any dtype <-> uint32 ---------------------------------------------

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
