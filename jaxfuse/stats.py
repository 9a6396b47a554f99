"""Per-step statistics of ``sparse_sync``: what each worker sent, per leaf.

Assembled from chunks, one per vmapped group of units or per dense bucket
(``(leaf ids, {stat: per-leaf array})``), put back in leaf order and into a
``SyncStats`` with a leading worker axis of size 1 (K outside shard_map).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxfuse import _compat
from jaxfuse import fusion
from jaxfuse import plans
from jaxfuse import sparsify


class SyncStats(NamedTuple):
  """What the last step did, per worker (leading axis) and per leaf.

  selected: elements sent (dense leaves: all of them).
  candidates: elements with |acc| ≥ τ (above capacity they stay in the residual;
    for ``topk`` after a slot overflow also those its pass could not stage,
    ``sparsify.topk_finish``).
  overflow: candidates − selected, what capacity held back.
  threshold: τ used (a "behind" bucket's one τ for each of its leaves).
  missing: the leaf had a non-zero gradient and sent nothing (SAFusion's
    tensor missing).
  nonfinite: the leaf's gradient had a NaN or Inf (its residual was kept).
  wire_bytes: bytes this worker sent on the network this step (its
    buckets' schemes on K workers, ``collectives.bucket_wire``: an
    all-gather of a P-byte payload sends (K − 1)·P), one per worker; not
    the payload (``plan.bytes_per_worker()``). A float32 (the state keeps
    its dtype without x64): exact up to 2²⁴ bytes (16 MiB), beyond that
    within 6·10⁻⁸ of the count; ``collectives.bucket_wire`` has it exact.
  """
  selected: jax.Array
  candidates: jax.Array
  overflow: jax.Array
  threshold: jax.Array
  missing: jax.Array
  nonfinite: jax.Array
  wire_bytes: jax.Array


def empty_stats(num_leaves: int) -> SyncStats:
  zi = jnp.zeros((1, num_leaves), jnp.int32)
  zb = jnp.zeros((1, num_leaves), bool)
  return SyncStats(zi, zi, zi, jnp.zeros((1, num_leaves), jnp.float32), zb,
                   zb, jnp.zeros((1,), jnp.float32))


def segment_counts(flags: jax.Array, sizes) -> jax.Array:
  """Number of True flags in each consecutive segment (static ``sizes``) of
  a flat bool array, from one cumsum: c[end] − c[start]."""
  sizes = np.asarray(sizes)
  ends = np.cumsum(sizes)
  c = jnp.concatenate([jnp.zeros((1,), jnp.int32),
                       jnp.cumsum(flags, dtype=jnp.int32)])
  return c[ends] - c[ends - sizes]


def sent_count(count, indices, n, nonfinite, *, finished: bool = False):
  """Slots of ``indices`` (G, c) that hold an element (index < n), from
  the pass's scalars instead of a reduce over the slots. A non-finite unit
  fills slot 0 only. Otherwise the pass fills min(m, c) slots when it
  counted m ≥ 1 candidates, and with m = 0 slot 0 only if it holds the
  unit's lone largest element. ``finished``: ``sparsify.topk_finish``'s
  result, whose m counts that element too (no slot is read: XLA 0.11's
  GPU compiler failed on a slice of that result). Equal to
  ``sum(indices < n, axis=1)`` (``sparsify_unit``)."""
  c = indices.shape[-1]
  kept = jnp.minimum(count, c)
  if not finished:
    kept = jnp.where(count > 0, kept, indices[..., 0] < n)
  return jnp.where(nonfinite, 1, kept).astype(jnp.int32)


def sparse_stats(sizes, settings, units, out, stacked):
  """Stats chunks of one vmapped group: (leaf ids, {stat: per-leaf array});
  ``sizes``: {leaf id: elements} of the bucket's leaves, ``settings``: the
  plan's."""
  if all(len(u.leaves) == 1 for u in units):
    first = units[0]   # the group's units share size and estimator
    finished = sparsify.needs_topk_finish(
        first.size, density=first.density, estimator=first.estimator,
        settings=settings)
    return [([u.leaves[0] for u in units], dict(
        selected=sent_count(out.count, out.indices, first.size,
                            out.nonfinite, finished=finished),
        candidates=out.count,
        threshold=out.tau,
        nonfinite=out.nonfinite,
        nonzero=out.nonzero))]
  chunks = []
  for i, unit in enumerate(units):   # a "behind" unit: several leaves
    unit_sizes = [sizes[j] for j in unit.leaves]
    acc, grad = out.acc[i], stacked[i]
    sent = jnp.zeros((unit.size,), bool).at[out.indices[i]].set(
        True, mode="drop")
    candidate = (jnp.abs(acc) >= out.tau[i]) & (acc != 0)
    chunks.append((list(unit.leaves), dict(
        selected=segment_counts(sent, unit_sizes),
        candidates=segment_counts(candidate, unit_sizes),
        threshold=jnp.full((len(unit_sizes),), out.tau[i], jnp.float32),
        nonfinite=segment_counts(~jnp.isfinite(grad), unit_sizes) > 0,
        nonzero=segment_counts(grad != 0, unit_sizes) > 0)))
  return chunks


def dense_stats(sizes, leaf_ids, flat):
  """Stats chunks of a dense (psum) bucket: everything is sent. The flags
  come from the psum's own per-dtype buffers (``fusion.pack_dense``);
  non-float leaves (no gradient) are neither non-finite nor non-zero.
  ``sizes``: {leaf id: elements} of ``leaf_ids``."""
  floats = [j for j in leaf_ids if _compat.is_float_dtype(flat[j].dtype)]
  others = [j for j in leaf_ids if j not in floats]
  of = lambda ids: [sizes[j] for j in ids]
  chunk = lambda ids, nonfinite, nonzero: (ids, dict(
      selected=jnp.asarray(of(ids), jnp.int32),
      candidates=jnp.asarray(of(ids), jnp.int32),
      threshold=jnp.zeros((len(ids),), jnp.float32),
      nonfinite=nonfinite, nonzero=nonzero))
  chunks = []
  for dtype, g in fusion.pack_dense([flat[j] for j in floats]).items():
    ids = [j for j in floats if str(flat[j].dtype) == dtype]
    chunks.append(chunk(ids, segment_counts(~jnp.isfinite(g), of(ids)) > 0,
                        segment_counts(g != 0, of(ids)) > 0))
  if others:
    none = jnp.zeros((len(others),), bool)
    chunks.append(chunk(others, none, none))
  return chunks


def in_order(chunks):
  """[(ids, tree of (len(ids),) arrays)] -> one tree of arrays indexed by id
  (the ids of all chunks together are 0, 1, …, n−1 in some order)."""
  ids = np.concatenate([np.asarray(i, np.int64) for i, _ in chunks])
  order = np.argsort(ids, kind="stable")
  assert (ids[order] == np.arange(len(ids))).all(), ids
  cat = jax.tree.map(lambda *xs: jnp.concatenate(xs),
                     *[tree for _, tree in chunks])
  if (order == np.arange(len(ids))).all():
    return cat
  return jax.tree.map(lambda x: x[order], cat)


def finish_stats(per_leaf, wire_bytes) -> SyncStats:
  row = lambda x, dtype: jnp.asarray(x, dtype)[None]
  selected = row(per_leaf["selected"], jnp.int32)
  candidates = row(per_leaf["candidates"], jnp.int32)
  return SyncStats(
      selected=selected,
      candidates=candidates,
      overflow=jnp.maximum(candidates - selected, 0),
      threshold=row(per_leaf["threshold"], jnp.float32),
      missing=row(per_leaf["nonzero"], bool) & (selected == 0),
      nonfinite=row(per_leaf["nonfinite"], bool),
      wire_bytes=jnp.full((1,), wire_bytes, jnp.float32))


def summarize(stats: SyncStats, plan: plans.Plan) -> dict[str, Any]:
  """Plain Python numbers for logging: means over workers.

  ``density``: elements sent over the sparse leaves' elements.
  ``slot_fill``: elements sent over the sparse leaves' slots, Σ selected /
  Σ capacity: the share of the sparse wire that carries a value (the
  rest is padding, there for the static shapes; ``headroom`` sets it,
  about 1/headroom for the sampled estimators, 1 for ``"topk"``).

  Args:
    stats: the step's ``SyncStats`` (``jaxfuse.sync_stats(state)``).
    plan: the plan of the phase that ran the step.

  Returns:
    A dict: ``wire_bytes``, ``missing_leaves``, ``overflow``,
    ``nonfinite_leaves`` (leaves whose gradient had a NaN or Inf on any
    worker), and with sparse leaves ``density`` and ``slot_fill``.

  Raises:
    PlanError: ``plan`` is not a plan.
    ValueError: the stats come from another phase's plan (their leaf
      count, or a unit that selected more than this plan's slots).
  """
  plans.require_plan(plan, "summarize")
  if np.shape(stats.selected)[-1] != len(plan.leaves):
    raise ValueError(f"summarize: the stats have "
                     f"{np.shape(stats.selected)[-1]} leaves, the plan "
                     f"{len(plan.leaves)}: pass the plan of the phase that "
                     "ran the step.")
  sparse = np.array([l.mode == "sparse" for l in plan.leaves])
  sizes = np.array([l.size for l in plan.leaves], np.float64)
  selected = np.asarray(stats.selected, np.float64)
  units = plans.units(plan)[0]
  for unit in units:
    most = selected[..., list(unit.leaves)].sum(-1).max()
    if most > unit.capacity:
      paths = [plan.leaves[j].path for j in unit.leaves]
      name = (f"leaf {paths[0]}" if len(paths) == 1 else
              f"the bucket of leaves {paths[0]} … {paths[-1]}")
      raise ValueError(
          f"summarize: {name} selected {int(most)} elements, more "
          f"than the {unit.capacity} slots this plan gives it: the stats "
          "come from another phase's plan (e.g. a dense warm-up step); "
          "pass the plan of the phase that ran the step.")
  out = {
      "wire_bytes": int(np.asarray(stats.wire_bytes).max()),
      "missing_leaves": float(np.asarray(stats.missing).sum(-1).mean()),
      "overflow": float(np.asarray(stats.overflow).sum(-1).mean()),
      "nonfinite_leaves": int(np.asarray(stats.nonfinite).any(0).sum()),
  }
  if sparse.any():
    sent = selected[:, sparse].sum(-1).mean()
    out["density"] = float(sent / sizes[sparse].sum())
    # a unit's capacity: a leaf's, or one for a "behind" bucket's leaves
    slots = sum(u.capacity for u in units)
    out["slot_fill"] = float(sent / slots)
  return out
