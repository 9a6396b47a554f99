"""Collectives, called inside ``shard_map``: one per bucket.

Sparse buckets: ``all_gather`` the packed buffer (K, W) and decode each unit
by adding the K workers' (value, index) slots into a dense vector, worker by
worker in rank order, then dividing by K::

  ĝ = (1/K) · Σ_k scatter(idx_k, v_k)

Within one worker the indices are distinct, so every scatter has a single
writer per element and the sum order is fixed: the result is bitwise the same
on every worker (replica consistency) without atomics deciding the order.
Memory per unit is O(K·c + n); K dense copies are never built.

Dense buckets: ``pmean`` of the per-dtype concatenations, one multi-operand
all-reduce, equal to ``lax.pmean`` leaf by leaf.
"""

from __future__ import annotations

import jax
from jax import lax
import jax.numpy as jnp

from jaxfuse import _compat
from jaxfuse import fusion

UNROLL_WORKERS = 16


def decode(values: jax.Array, indices: jax.Array, size: int) -> jax.Array:
  """(K, c) slots -> dense mean over the K workers, shape (size,).

  Sums in at least float32, so bfloat16 gradients lose nothing to the sum.
  """
  num_workers = values.shape[0]
  acc_dtype = jnp.promote_types(values.dtype, jnp.float32)
  add = lambda k, out: out.at[indices[k]].add(values[k].astype(acc_dtype),
                                               mode="drop")
  out = jnp.zeros((size,), acc_dtype)
  if num_workers <= UNROLL_WORKERS:
    for k in range(num_workers):
      out = add(k, out)
  else:
    out = lax.fori_loop(0, num_workers, add, out)
  return (out / num_workers).astype(values.dtype)


def allgather_sync(parts, bucket_units, axis_name: str) -> list[jax.Array]:
  """[(values, indices)] of this worker -> dense worker-mean per unit."""
  gathered = _compat.all_gather_invariant(fusion.pack_sparse(parts), axis_name)
  slots = fusion.unpack_sparse(gathered, bucket_units)
  groups = {}  # units of one shape decode as one vmap
  for n, u in enumerate(bucket_units):
    groups.setdefault((u.size, u.capacity, u.dtype), []).append(n)
  out = [None] * len(bucket_units)
  for (size, _, _), members in groups.items():
    if len(members) == 1:
      out[members[0]] = decode(*slots[members[0]], size)
      continue
    dense = jax.vmap(decode, in_axes=(0, 0, None))(
        jnp.stack([slots[n][0] for n in members]),
        jnp.stack([slots[n][1] for n in members]), size)
    for i, n in enumerate(members):
      out[n] = dense[i]
  return out


def psum_sync(leaves, axis_name: str) -> list[jax.Array]:
  """Dense leaves -> their worker-mean, one all-reduce for the bucket."""
  buffers = fusion.pack_dense(leaves)
  return fusion.unpack_dense(lax.pmean(buffers, axis_name), leaves)
