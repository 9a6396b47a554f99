"""The interface every collective scheme implements, and what they share.

A scheme moves one bucket per step inside ``shard_map`` over the data axis.
It states four things:

* ``check(where, num_workers, settings)``: whether it can run for K workers
  (raises ``SchemeError`` naming ``where``, the bucket, and the fix), and
  ``check_axes(where, axis_name, settings)``: whether it can run on these
  mesh axes (``"hier"`` needs a (host, local) pair);
* ``sync(parts, units, axis_name, settings)``: run inside ``shard_map``. For a
  sparse scheme, ``parts`` are this worker's (values (c,), indices (c,))
  slots per unit (sentinel index = unit size); it returns a ``Synced``: per
  unit the worker mean ĝ = (1/K)·Σ_k sent_k, identical on every worker, and
  per unit what this worker must put back into its residual (entries that
  found no room on the way: ZEN's overflow, SparDL's merge drops), or
  ``None``. Conservation, what every scheme keeps, per unit and step::

      K·ĝ + Σ_k kept_k = Σ_k sent_k        (sent_k: worker k's slots)

  so with the residual update r_k' = acc_k − sent_k + kept_k the owed sum
  Σ_k (r_k + x_k) = K·ĝ + Σ_k r_k' is exact.
* ``steps(units, num_workers, settings)``: the primitives it puts on the wire,
  as ``Step(primitive, nbytes)`` (bytes handed to the primitive by one
  worker); the cost model turns each into time (``planning.costs``) and
  ``wire`` into bytes sent and received per worker;
* ``name`` and ``sparse`` (takes slots, not dense leaves).
"""

from __future__ import annotations

import math
from typing import NamedTuple, Protocol, Sequence

import jax
from jax import lax
import jax.numpy as jnp

from jaxfuse import _compat
from jaxfuse import plans

PRIMITIVES = ("allgather", "allreduce", "alltoall", "ppermute")
UNROLL_WORKERS = 16


class SchemeError(plans.PlanError):
  """A collective that cannot run on this mesh (names the bucket and fix)."""


class Synced(NamedTuple):
  means: list[jax.Array]               # per unit, (size,), worker mean
  kept: list[jax.Array | None]         # per unit, (size,) back to residual


class Step(NamedTuple):
  """One primitive of a scheme: ``nbytes`` handed to it by one worker.

  allgather: this worker's contribution (it receives K−1 of them);
  allreduce: the buffer (ring: sends and receives 2(K−1)/K of it);
  alltoall: the whole send buffer, K tiles (K−1 tiles leave);
  ppermute: the message sent to one peer (one arrives from another).
  """
  primitive: str
  nbytes: int


class Wire(NamedTuple):
  sent: int       # bytes one worker sends per step
  received: int   # bytes one worker receives per step


class Scheme(Protocol):
  name: str
  sparse: bool

  def check(self, where: str, num_workers: int,
            settings: plans.Settings) -> None: ...

  def check_axes(self, where: str, axis_name,
                 settings: plans.Settings) -> None: ...

  def sync(self, parts, units: Sequence[plans.Unit], axis_name: str,
           settings: plans.Settings) -> Synced: ...

  def steps(self, units: Sequence[plans.Unit], num_workers: int,
            settings: plans.Settings) -> tuple[Step, ...]: ...


class AnyMesh:
  """``check`` and ``check_axes`` of a scheme that runs on any K, over one
  mesh axis or several (taken as one flat axis)."""

  def check(self, where: str, num_workers: int, settings) -> None:
    del where, num_workers, settings

  def check_axes(self, where: str, axis_name, settings) -> None:
    del where, axis_name, settings


def step_wire(step: Step, num_workers: int) -> Wire:
  """Bytes one worker sends and receives for one primitive (ring
  all-gather and all-reduce, pairwise all-to-all)."""
  k, x = num_workers, step.nbytes
  if step.primitive == "allgather":
    return Wire((k - 1) * x, (k - 1) * x)
  if step.primitive == "allreduce":
    b = math.ceil(2 * (k - 1) * x / k)
    return Wire(b, b)
  if step.primitive == "alltoall":
    b = math.ceil((k - 1) * x / k)
    return Wire(b, b)
  if step.primitive == "ppermute":
    return Wire(x, x)
  raise ValueError(f"primitive {step.primitive!r}; use one of {PRIMITIVES}.")


def wire(steps: Sequence[Step], num_workers: int) -> Wire:
  """Bytes per worker of a scheme's steps, summed."""
  per = [step_wire(s, num_workers) for s in steps]
  return Wire(sum(w.sent for w in per), sum(w.received for w in per))


def decode(values: jax.Array, indices: jax.Array, size: int,
           num_workers: int | None = None) -> jax.Array:
  """(R, c) slots -> (1/K)·Σ_r scatter(idx_r, v_r), shape (size,).

  Rows are added one at a time in row order; within a row the indices are
  distinct (sentinel ``size`` and beyond are dropped), so each scatter has
  one writer per element and the sum order is fixed: bitwise the same on
  every worker. Sums, and returns the mean, in at least float32 (a
  bfloat16 wire's values are not rounded again here; ``_place`` casts to
  the gradient's dtype). K defaults to the row count.
  Past ``UNROLL_WORKERS`` rows the sum is a loop whose carry varies over
  the mesh axes the rows vary over (e.g. ``"hier"``'s host rows, which
  differ across its local axis).
  """
  rows = values.shape[0]
  k = rows if num_workers is None else num_workers
  acc_dtype = jnp.promote_types(values.dtype, jnp.float32)
  add = lambda r, out: out.at[indices[r]].add(values[r].astype(acc_dtype),
                                              mode="drop")
  out = jnp.zeros((size,), acc_dtype)
  if rows <= UNROLL_WORKERS:
    for r in range(rows):
      out = add(r, out)
  else:
    axes = _compat.varying_axes(values) | _compat.varying_axes(indices)
    if axes:
      out = _compat.to_varying(out, tuple(sorted(axes)))
    out = lax.fori_loop(0, rows, add, out)
  return out / k


def bucket_offsets(units: Sequence[plans.Unit]) -> list[int]:
  """Start of each unit in the bucket's flat index space [0, Σ n_u)."""
  out, start = [], 0
  for u in units:
    out.append(start)
    start += u.size
  return out


def to_bucket(parts, units) -> tuple[jax.Array, jax.Array]:
  """Units' slots -> one (values, indices) pair over the bucket's flat index
  space (values in the units' promoted dtype; sentinel = bucket size)."""
  total = sum(u.size for u in units)
  dtype = jnp.result_type(*[u.dtype for u in units])
  vals, idx = [], []
  for (v, i), u, start in zip(parts, units, bucket_offsets(units)):
    vals.append(v.astype(dtype))
    idx.append(jnp.where(i < u.size, i + start, total).astype(jnp.int32))
  return jnp.concatenate(vals), jnp.concatenate(idx)


def from_bucket(flat: jax.Array, units, dtype=None) -> list[jax.Array]:
  """A (Σ n_u,) array over the bucket's index space -> one per unit, in each
  unit's dtype, or in ``dtype`` (what a scheme hands back to the residuals:
  its accumulation dtype, not the wire's)."""
  return [flat[s:s + u.size].astype(dtype or u.dtype)
          for u, s in zip(units, bucket_offsets(units))]
