"""A sparse unit's slots as they travel: its values' dtype or bits, its
indices' bits, and the uint32 words and bytes they fill
(``jaxfuse.fusion`` packs by them, the collectives count by them).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np

from jaxfuse.plans.checks import QUANT_CHUNK
from jaxfuse.plans.checks import QUANTIZED_WIRES


def narrower_dtype(dtype: str, choice: str) -> str:
  """The gradient's dtype, or ``choice`` where it is narrower."""
  if choice == "gradient":
    return dtype
  wide = np.dtype(dtype).itemsize > np.dtype(jax.numpy.dtype(choice)).itemsize
  return choice if wide else dtype


def index_bits(size: int) -> int:
  """Bits that hold an index in [0, size] (``size``: the empty slot)."""
  return max(1, int(size).bit_length())


def packs_indices(collective) -> bool:
  """Whether ``collective`` sends indices in ``index_bits``.

  ``collective``: a scheme object (``jaxfuse.collectives``), which says
  so itself (``AllGather(packed_indices=True)``, a ``Hier`` over one;
  ZEN and SparDL keep int32), or a scheme's name (its defaults: int32).
  """
  if isinstance(collective, str):
    return False
  return bool(collective.packs_indices)


def wire_unit(unit, settings, collective="allgather"):
  """``unit`` as its slots travel in a bucket of ``collective`` (a scheme
  object or name, ``packs_indices``): the values' dtype the narrower of
  the gradient's and ``Settings.sparse_wire``, and its indices' bits
  (``index_bits(size)`` where ``packs_indices``, else 32): what the
  collectives pack, decode and count bytes by."""
  value_bits = QUANTIZED_WIRES.get(settings.sparse_wire, 0)
  dtype = (unit.dtype if value_bits else
           narrower_dtype(unit.dtype, settings.sparse_wire))
  bits = index_bits(unit.size) if packs_indices(collective) else 32
  if (dtype, bits, value_bits) == (unit.dtype, unit.index_bits,
                                   unit.value_bits):
    return unit
  return dataclasses.replace(unit, dtype=dtype, index_bits=bits,
                             value_bits=value_bits)


def num_words(count: int, dtype) -> int:
  """uint32 words that hold ``count`` elements of ``dtype``."""
  return math.ceil(count * np.dtype(dtype).itemsize / 4)


def index_words(unit) -> int:
  """uint32 words that hold the unit's c indices of ``unit.index_bits``
  bits each, back to back (32: one word each)."""
  return math.ceil(unit.capacity * unit.index_bits / 32)


def value_words(unit) -> int:
  """uint32 words that hold the unit's c values: in its dtype, or
  (``value_bits``) c codes of that many bits back to back, then one
  float32 scale per ``QUANT_CHUNK`` slots (``fusion.quantize_values``)."""
  if not unit.value_bits:
    return num_words(unit.capacity, unit.dtype)
  return (math.ceil(unit.capacity * unit.value_bits / 32) +
          math.ceil(unit.capacity / QUANT_CHUNK))


def payload_bytes(unit) -> int:
  """Bytes of one worker's slots of a unit: c values and c indices, each
  padded to whole uint32 words (``fusion.pack_groups``)."""
  return 4 * (value_words(unit) + index_words(unit))
