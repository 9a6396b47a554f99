"""The exact k-th largest of many rows of magnitudes, without a sort.

For a row a of non-negative float32 magnitudes (|acc| of a sample, or of
staged slots), the bit patterns b = bitcast(a, int32) order as the values
do (0 ≤ b < 2³¹), so the k-th largest is the largest pattern t with
#{i : b_i ≥ t} ≥ k: a radix select, built from the top bit down, a
digit per round::

  t ← 0;  for (shift, width) in ROUNDS:          (3 bits, then 4-bit digits)
    c_d = #{i : b_i ≥ t | d·2^shift}   d = 0 … 2^width − 1 (non-increasing)
    t ← t | (#{d : c_d ≥ k} − 1)·2^shift

Eight reductions, whatever the row length or k, for all of a bucket's rows
at once (rows of different lengths are padded with 0.0, which only ever
counts towards t = 0, where every row has k elements anyway): a fixed
number of reductions over all rows, where a ``lax.top_k`` sorts each row
(``benchmarks/kth_rows.py`` compares them). ``kernels.radix`` runs these
eight rounds in one Pallas kernel instead (``method="pallas"``: one
program per row, so its time grows with the longest row; the XLA rounds
spread each reduction over the whole device). Off GPU
``kth_largest_rows`` sorts instead (the same bits, less to compile).

Why two exact k-th-largest algorithms: ``kernels.threshold``
(``kernels.kth_largest_magnitude``) finds the k-th largest |x| of one
whole array in one read of it (a sampled bracket, the band between its
bounds staged by the selection kernel, a sort of the band), for arrays too
large to sort; the sync path never needs that, since its k-th largest are
all taken of short rows (DGC's samples, ``"topk"``'s bracket sample and
staged slots), which this module batches across a bucket. The sync path
uses only this one; ``kernels.kth_largest_magnitude`` stays a kernel of
the public ``jaxfuse.kernels`` API until that module's owners retire it.
"""

from __future__ import annotations

from typing import Sequence

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from jaxfuse import kernels
from jaxfuse.kernels import radix
from jaxfuse.kernels.radix import ROUNDS   # (shift, width): 3 bits, 7 × 4

METHODS = ("radix", "pallas", "sort")
GPU_METHODS = ("auto", "radix", "pallas")
# The method on GPUs where the Pallas kernels run: "pallas" (the rounds in
# one kernel, a program per row: its time grows with the longest row),
# "radix" (XLA's reductions, each round spread over the whole device, about
# 30 kernels: a fixed cost however short the rows) or "auto": the kernel
# for short rows (at most PALLAS_MAX_WIDTH), where the fixed cost of the
# rounds dominates, the XLA rounds for longer ones, where one program per
# row is the slower (docs/benchmarks.md, "A bucket's thresholds at once").
DEFAULT_GPU_METHOD = "auto"
PALLAS_MAX_WIDTH = 8192


def kth_largest_rows(rows: Sequence[jax.Array], ranks: Sequence[int],
                     method: str | None = None) -> list[jax.Array]:
  """Per (R_i, s_i) array of magnitudes (float32, ≥ 0 or NaN) and static
  rank 1 ≤ k_i ≤ s_i: the (R_i,) k_i-th largest of each row, bitwise
  ``lax.top_k(row, k_i)[0][k_i − 1]`` (NaN counts as the largest, as
  there).

  ``method``: ``"radix"`` (one computation for all of them), ``"pallas"``
  (the same rounds in one Pallas kernel, a program per row:
  ``kernels.radix``; off GPU in Pallas's interpreter) or ``"sort"``
  (``lax.top_k`` per array). Default: ``DEFAULT_GPU_METHOD`` wherever the
  Pallas kernels run (``jaxfuse.kernels.backend()``; "auto": pallas for
  rows of at most ``PALLAS_MAX_WIDTH``, radix for longer), radix on other
  GPUs (it is plain JAX), sort elsewhere: on a CPU the sort is about as fast
  and compiles in a sixth of the time (0.05 s against 0.31 s for a
  gpt2-small bucket's DGC samples). All are exact, so they agree bit for
  bit."""
  width = max((a.shape[-1] for a in rows), default=0)
  if method is None:
    method = (_gpu_method(width) if kernels.backend() == "pallas" else
              "radix" if jax.default_backend() == "gpu" else "sort")
  if method not in METHODS:
    raise ValueError(f"method={method!r}; use one of {METHODS}.")
  if len(rows) != len(ranks):
    raise ValueError(f"{len(rows)} row arrays but {len(ranks)} ranks.")
  for a, k in zip(rows, ranks):
    if a.ndim != 2 or a.dtype != jnp.float32 or not 1 <= k <= a.shape[1]:
      raise ValueError(f"rows must be (R, s) float32 with 1 <= k <= s; got "
                       f"{a.dtype}{list(a.shape)} and k={k}.")
  if method == "sort":
    return [lax.top_k(a, k)[0][:, k - 1] for a, k in zip(rows, ranks)]
  bits = jnp.concatenate([
      jnp.pad(lax.bitcast_convert_type(a, jnp.int32),
              ((0, 0), (0, width - a.shape[1]))) for a in rows])
  k = jnp.asarray(np.repeat(np.asarray(ranks, np.int32),
                            [a.shape[0] for a in rows]))
  if method == "pallas":
    t = radix.radix_rows_pallas(
        bits, k, tuple(a.shape[1] for a in rows for _ in range(a.shape[0])),
        interpret=jax.default_backend() != "gpu")
  else:
    t = radix_rows(bits, k)
  kth = lax.bitcast_convert_type(t, jnp.float32)
  return jnp.split(kth, np.cumsum([a.shape[0] for a in rows])[:-1])


def _gpu_method(width: int) -> str:
  """``DEFAULT_GPU_METHOD`` for rows of at most ``width`` magnitudes."""
  if DEFAULT_GPU_METHOD not in GPU_METHODS:
    raise ValueError(f"radix_select.DEFAULT_GPU_METHOD="
                     f"{DEFAULT_GPU_METHOD!r}; use one of {GPU_METHODS}.")
  if DEFAULT_GPU_METHOD == "auto":
    return "pallas" if width <= PALLAS_MAX_WIDTH else "radix"
  return DEFAULT_GPU_METHOD


def kth_largest(a: jax.Array, k: int) -> jax.Array:
  """The k-th largest of a flat float32 array of magnitudes (one row of
  ``kth_largest_rows``)."""
  return kth_largest_rows([a[None]], [k])[0][0]


def radix_rows(bits: jax.Array, k: jax.Array) -> jax.Array:
  """(R, W) int32 patterns ≥ 0 and (R,) ranks 1 ≤ k ≤ W -> (R,) the k-th
  largest pattern of each row (the rounds above)."""
  t = jnp.zeros((bits.shape[0],), jnp.int32)
  for shift, width in ROUNDS:
    cands = t[:, None] | (jnp.arange(1 << width, dtype=jnp.int32) << shift)
    counts = jnp.sum(bits[:, None, :] >= cands[:, :, None], axis=-1,
                     dtype=jnp.int32)
    t = t | ((jnp.sum(counts >= k[:, None], axis=1, dtype=jnp.int32) - 1)
             << shift)
  return t
