"""The jnp references of the kernels, and the hashing they share.

Each Pallas kernel in this package is checked bit for bit against its
reference here; ``jaxfuse.kernels`` picks one of the two per backend, and
``sparsify`` builds on these (it imports kernels, never the other way).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
from jax import lax
import jax.numpy as jnp


def hash32(x) -> jax.Array:
  """A 32-bit integer mix ("lowbias32"); uniform enough for sampling."""
  x = jnp.asarray(x, jnp.uint32)
  x = (x ^ (x >> 16)) * jnp.uint32(0x7FEB352D)
  x = (x ^ (x >> 15)) * jnp.uint32(0x846CA68B)
  return x ^ (x >> 16)


def uniform_index(salt_, count: int, n: int) -> jax.Array:
  """``count`` pseudo-random indices in [0, n) (or a scalar if count is 0)."""
  i = jnp.arange(max(count, 1), dtype=jnp.uint32) * jnp.uint32(0x9E3779B9)
  idx = (hash32(salt_ ^ i) % jnp.uint32(n)).astype(jnp.int32)
  return idx if count else idx[0]


@functools.partial(jax.tree_util.register_dataclass, data_fields=["m", "g"],
                   meta_fields=["beta"])
@dataclasses.dataclass(frozen=True)
class Blend:
  """The stream x = β·m + (1 − β)·g held as its two parts (1-bit Adam's
  local momentum: m the momentum, g the gradient), so that a kernel forms
  x where it reads m and g instead of reading an x written out first.
  ``m`` and ``g`` cover the same rows: each a flat row, a (rows, n) chunk,
  a (G, n) array or a list of them, each cut its own way. A pytree whose
  leaves are m's and g's; β (a Python float) is static."""
  m: Any
  g: Any
  beta: float

  def map(self, fn):
    """The Blend of ``fn(m)`` and ``fn(g)``."""
    return Blend(fn(self.m), fn(self.g), self.beta)


def blend(m, g, beta: float):
  """β·m + (1 − β)·g, elementwise (1-bit Adam's momentum update)."""
  return beta * m + (1 - beta) * g


def formed(x):
  """x itself, or a ``Blend``'s β·m + (1 − β)·g (a list part by part; a
  (G, n) array against a list of rows or chunks is cut like the list).

  Args:
    x: an array, a list of arrays, or a ``Blend`` of two such.

  Returns:
    ``x``, or the blend formed (a list where either part is one).

  Raises:
    ValueError: a ``Blend`` whose parts do not line up (``zip``'s strict
      check).
  """
  if not isinstance(x, Blend):
    return x
  m, g = x.m, x.g
  is_list = lambda p: isinstance(p, (list, tuple))
  if is_list(m) and is_list(g) and [a.shape for a in m] != [
      b.shape for b in g]:
    m = stacked_rows(m)        # cut differently: m cut as g is
  if is_list(m) or is_list(g):
    m = m if is_list(m) else _cut_like(m, g)
    g = g if is_list(g) else _cut_like(g, m)
    return [blend(a, b, x.beta) for a, b in zip(m, g, strict=True)]
  return blend(m, g, x.beta)


def stream_chunks(xs) -> list:
  """``xs`` as a list of (rows, n) chunks: a (G, n) array is one chunk, a
  flat array one row."""
  if isinstance(xs, jax.Array):
    xs = [xs]
  return [x[None] if x.ndim == 1 else x for x in xs]


def stacked_rows(xs) -> jax.Array:
  """Flat rows, (R, n) chunks or a (G, n) array as one (G, n) array."""
  return jnp.concatenate(stream_chunks(xs))


def _cut_like(rows, pieces):
  """A (G, n) array cut as ``pieces`` is: a flat piece takes one row, a
  (R, n) piece the next R."""
  out, start = [], 0
  for piece in pieces:
    if piece.ndim == 1:
      out.append(rows[start])
      start += 1
    else:
      out.append(rows[start:start + piece.shape[0]])
      start += piece.shape[0]
  if start != rows.shape[0]:
    raise ValueError(f"a Blend's parts cover {rows.shape[0]} and {start} "
                     "rows")
  return out


def kth_largest(a: jax.Array, k: int) -> jax.Array:
  """The k-th largest of a flat ``a`` (``lax.top_k``, a sort of all n)."""
  return lax.top_k(a, k)[0][k - 1]


def inclusive_count(mask: jax.Array) -> jax.Array:
  """cumsum(mask) (int32) of a flat bool array, by 32-bit words.

  With the mask packed into words w_b = Σ_t m_{32b+t}·2^t, the count up to
  i = 32b + t is Σ_{b' < b} popcount(w_b') + popcount(w_b & (2^{t+1} − 1)):
  a scan of n/32 word counts instead of n elements (as the Pallas kernels
  count; about 2× faster than ``jnp.cumsum`` on a CPU at millions of
  elements).
  """
  n = mask.size
  rows = -(-n // 32)
  bits = jnp.arange(32, dtype=jnp.uint32)
  m = jnp.pad(mask, (0, rows * 32 - n)).reshape(rows, 32).astype(jnp.uint32)
  words = jnp.sum(m << bits, axis=1, dtype=jnp.uint32)   # disjoint bits
  counts = lax.population_count(words).astype(jnp.int32)
  before = jnp.cumsum(counts) - counts
  # bits 0..t of each word; 2 << 31 wraps to 0, so t = 31 keeps them all
  upto = lax.population_count(
      words[:, None] & ((jnp.uint32(2) << bits) - jnp.uint32(1)))
  return (before[:, None] + upto.astype(jnp.int32)).reshape(-1)[:n]


def select(acc: jax.Array, tau: jax.Array, capacity: int,
           offset: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Fixed-capacity threshold selection of a flat ``acc``.

  Candidates are ranked in the rotated order offset, offset+1, …, n−1, 0, …
  and the first ``capacity`` are written; the rest of the slots get the
  sentinel index n. Returns (values[c], indices[c] int32, true count m).
  """
  n = acc.size
  mask = (jnp.abs(acc) >= tau) & (acc != 0)
  inclusive = inclusive_count(mask)
  total = inclusive[-1]
  before = jnp.where(offset > 0, inclusive[jnp.maximum(offset - 1, 0)], 0)
  pos = jnp.arange(n, dtype=jnp.int32)
  rank = jnp.where(pos >= offset, inclusive - before,
                   inclusive + total - before) - 1
  slot = jnp.where(mask & (rank < capacity), rank, capacity)
  indices = jnp.full((capacity,), n, jnp.int32).at[slot].set(pos, mode="drop")
  values = acc.at[indices].get(mode="fill", fill_value=0)
  return values, indices, total


def select_band(acc, lo, hi, capacity: int, interpret=False):
  """jnp reference of ``selection.select_band_pallas``: ``select`` from lo
  at offset 0 over acc with the elements not below hi zeroed (zeros are
  never candidates), and the count of |acc| ≥ hi, acc ≠ 0."""
  del interpret
  mags = jnp.abs(acc)
  values, indices, count = select(jnp.where(mags < hi, acc, 0), lo,
                                  capacity, 0)
  return values, indices, count, jnp.sum((mags >= hi) & (acc != 0),
                                         dtype=jnp.int32)
