"""Fusion: a bucket's selection units into one statically shaped wire buffer.

A sparse bucket (its units: ``plans.units``) becomes ONE uint32 buffer per
worker, its units' slots group by group (units of one size, capacity and
dtype)::

  words = [ bits(V_1) ‖ bits(I_1) ‖ bits(V_2) ‖ bits(I_2) ‖ … ]

with V_g, I_g the (G, c) values and indices of group g's units (values keep
their dtype's bits, 16-bit values two to a word, or b-bit codes and their
scales, ``quantize_values``; indices int32, or
``Unit.index_bits`` each back to back, ``pack_indices``; each row whole
words), so
a single ``all_gather`` moves it and each group unpacks with one bitcast
(``pack_groups``). A dense bucket
becomes one flat array per dtype, all reduced by a single multi-operand
``psum``.
"""

from __future__ import annotations

import math

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from jaxfuse.plans import QUANT_CHUNK
from jaxfuse.plans import Unit
from jaxfuse.plans import index_words
from jaxfuse.plans import value_words

INDEX_DTYPE = np.dtype(np.int32)
_UINT = {1: jnp.uint8, 2: jnp.uint16}


# --- words: any dtype <-> uint32 ---------------------------------------------

def to_words(x: jax.Array) -> jax.Array:
  """Bits of an array's last axis as uint32 words, (..., n) -> (..., W)
  (each row zero padded to whole words)."""
  itemsize = np.dtype(x.dtype).itemsize
  lead = x.shape[:-1]
  if itemsize >= 4:
    return lax.bitcast_convert_type(x, jnp.uint32).reshape(*lead, -1)
  per_word = 4 // itemsize
  # Move bits as unsigned ints: float ops (pad) could canonicalize NaNs.
  x = lax.bitcast_convert_type(x, _UINT[itemsize])
  x = jnp.pad(x, [(0, 0)] * len(lead) + [(0, -x.shape[-1] % per_word)])
  return lax.bitcast_convert_type(x.reshape(*lead, -1, per_word), jnp.uint32)


def from_words(words: jax.Array, dtype, count: int) -> jax.Array:
  """Inverse of ``to_words`` on the last axis: (..., W) words ->
  (..., count)."""
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
  return value_words(unit), index_words(unit)


# --- values in b bits with a scale per chunk ----------------------------------

def quantize_values(values: jax.Array, bits: int) -> jax.Array:
  """(c,) float values -> uint32 words: c codes of ``bits`` bits, then one
  float32 scale per ``QUANT_CHUNK`` slots. With h = 2^(b−1), a chunk's
  scale s = max|v| / (h − ½) and its levels (j + ½)·s, j ∈ [−h, h − 1]::

    j = floor(v / s),   code = j + h,   v̂ = (j + ½)·s

  the nearest level (|v − v̂| ≤ s/2), ±max|v| to float32 rounding; s = 1
  for a chunk of zeros. ``dequantize_values`` gives v̂ (the sender keeps
  v − v̂)."""
  c = values.shape[-1]
  chunks = -(-c // QUANT_CHUNK)
  x = jnp.pad(values.astype(jnp.float32), (0, chunks * QUANT_CHUNK - c))
  x = x.reshape(chunks, QUANT_CHUNK)
  half = 2 ** (bits - 1)
  top = jnp.max(jnp.abs(x), axis=1, keepdims=True)
  scale = jnp.where(top > 0, top / (half - 0.5), 1.0)
  j = jnp.clip(jnp.floor(x / scale), -half, half - 1)
  codes = (j + half).astype(jnp.int32).reshape(-1)[:c]
  return jnp.concatenate([pack_indices(codes, bits, 2**bits - 1),
                          to_words(scale.reshape(-1))])


def dequantize_values(words: jax.Array, bits: int, count: int) -> jax.Array:
  """Inverse of ``quantize_values`` on (..., W) words: (..., count) float32
  values v̂ = (code − h + ½)·s."""
  nc = -(-count * bits // 32)
  codes = unpack_indices(words[..., :nc], bits, count).astype(jnp.float32)
  scale = from_words(words[..., nc:], jnp.float32, -(-count // QUANT_CHUNK))
  scale = jnp.repeat(scale, QUANT_CHUNK, axis=-1)[..., :count]
  return (codes - 2 ** (bits - 1) + 0.5) * scale


# --- indices in b bits: 32 of them fill b words -------------------------------

def _bit_tables(bits: int):
  """Static tables of one 32-index block in ``bits`` words: per word w and
  part t, the index k that lands there and its shift (k·b − 32·w: left if
  ≥ 0, right if < 0; parts past the word are masked); per index k, its
  first word and the shift into it."""
  parts = -(-32 // bits) + 1
  k = np.arange(bits)[:, None] * 32 // bits + np.arange(parts)[None, :]
  shift = k * bits - 32 * np.arange(bits)[:, None]
  valid = (k < 32) & (shift < 32)
  first, into = np.divmod(np.arange(32) * bits, 32)
  return np.minimum(k, 31), shift, valid, first, into


def pack_indices(x: jax.Array, bits: int, size: int) -> jax.Array:
  """(..., c) int32 indices in [0, size] -> (..., ⌈c·b/32⌉) uint32 words,
  index i in bits [i·b, (i+1)·b) (low bits first); for b < 32 anything
  outside [0, size] goes as ``size``, the empty slot. b = 32: a bitcast,
  as is.

  Every 32 indices fill exactly b words, so each word's parts (at most
  ⌈32/b⌉ + 1 indices) have static positions and shifts: one gather and
  a sum of disjoint bit fields per block."""
  if bits == 32:
    return to_words(x.astype(jnp.int32))
  if not 0 <= size < 2**bits:
    raise ValueError(f"pack_indices: size {size} does not fit {bits} bits "
                     "(plans.index_bits(size)).")
  c, lead = x.shape[-1], x.shape[:-1]
  x = jnp.where((x < 0) | (x > size), size, x).astype(jnp.uint32)
  x = jnp.pad(x, [(0, 0)] * len(lead) + [(0, -c % 32)])
  x = x.reshape(*lead, -1, 32)
  k, shift, valid, _, _ = _bit_tables(bits)
  v = x[..., k]                                       # (..., B, bits, parts)
  left = v << jnp.asarray(np.clip(shift, 0, 31), jnp.uint32)
  right = v >> jnp.asarray(np.clip(-shift, 0, 31), jnp.uint32)
  field = jnp.where(jnp.asarray(valid), jnp.where(jnp.asarray(shift >= 0),
                                                  left, right), 0)
  words = jnp.sum(field, axis=-1, dtype=jnp.uint32)   # disjoint bits: OR
  return words.reshape(*lead, -1)[..., :math.ceil(c * bits / 32)]


def unpack_indices(words: jax.Array, bits: int, count: int) -> jax.Array:
  """Inverse of ``pack_indices``: (..., W) words -> (..., count) int32."""
  if bits == 32:
    return from_words(words, INDEX_DTYPE, count)
  lead = words.shape[:-1]
  blocks = -(-count // 32)
  words = jnp.pad(words, [(0, 0)] * len(lead) +
                  [(0, blocks * bits + 1 - words.shape[-1])])
  *_, first, into = _bit_tables(bits)
  rows = jnp.arange(blocks)[:, None] * bits + first   # (B, 32) word of index
  into = jnp.asarray(into, jnp.uint32)
  low = words[..., rows] >> into
  high = jnp.where(jnp.asarray(into == 0), 0,
                   words[..., rows + 1] << (32 - jnp.maximum(into, 1)))
  x = (low | high) & jnp.uint32((1 << bits) - 1)
  return x.reshape(*lead, -1)[..., :count].astype(jnp.int32)


def shape_groups(units) -> list[list[int]]:
  """Positions of the units that share (size, capacity, dtype), group by
  group in order of first appearance."""
  groups = {}
  for n, u in enumerate(units):
    groups.setdefault((u.size, u.capacity, jnp.dtype(u.dtype), u.index_bits,
                       u.value_bits), []).append(n)
  return list(groups.values())


def pack_groups(parts, units) -> jax.Array:
  """[(values, indices), …] per unit -> one flat uint32 buffer, group by
  group (``shape_groups``): [bits(V_g) ‖ bits(I_g)] with V_g, I_g the
  group's (G, c) slots (each row whole words): ``plans.payload_bytes``
  per unit, one bitcast per group."""
  words = []
  for members in shape_groups(units):
    u = units[members[0]]
    words.append(to_words(jnp.stack([parts[n][0] for n in members]))
                 .reshape(-1))
    words.append(pack_indices(jnp.stack([parts[n][1] for n in members]),
                              u.index_bits, u.size).reshape(-1))
  return jnp.concatenate(words)


def unpack_groups(words: jax.Array, units) -> list:
  """Inverse of ``pack_groups`` on (..., W) words: per group (its unit
  positions, values (..., G, c), indices (..., G, c))."""
  out, start = [], 0
  lead = words.shape[:-1]
  for members in shape_groups(units):
    u = units[members[0]]
    g = len(members)
    nv, ni = unit_words(u)
    v = words[..., start:start + g * nv].reshape(*lead, g, nv)
    v = (dequantize_values(v, u.value_bits, u.capacity) if u.value_bits
         else from_words(v, u.dtype, u.capacity))
    start += g * nv
    i = unpack_indices(words[..., start:start + g * ni].reshape(*lead, g, ni),
                       u.index_bits, u.capacity)
    start += g * ni
    out.append((members, v, i))
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
