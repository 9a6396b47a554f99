"""One bucket of ``sparse_sync``, stage after stage: accumulate each state
group's streams (momentum, decayed residual), select what each worker sends
(``bucket_pass``) or send all (a density-1 bucket), run the bucket's
collective, and cut the worker mean back into the bucket's leaves.

Per worker k and unit (``transform.sparse_sync`` has the whole rule)::

  acc_k = x_k + d·r_k ;  sent_k = top(acc_k) ;  r_k' = acc_k − sent_k + kept_k
  out = (1/K)·Σ_k sent_k − (1/K)·Σ_k kept_k

Reads only its bucket's ``bucket_steps.BucketStep``: the plan compiled once by
the transform; nothing here sees the whole plan.
"""

from __future__ import annotations

import functools

from typing import NamedTuple

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from jaxfuse import _compat
from jaxfuse.sync import bucket_pass
from jaxfuse import collectives
from jaxfuse import fusion
from jaxfuse import kernels
from jaxfuse import plans
from jaxfuse.sync import bucket_steps
from jaxfuse.stats import dense_stats
from jaxfuse.stats import sparse_stats


class Rule(NamedTuple):
  """The accumulation rule of one ``sparse_sync``."""
  momentum: float
  nesterov: bool
  mask_momentum: bool
  residual_decay: float


class BucketOut(NamedTuple):
  """What one bucket's sync produces: its leaves' worker means, its state
  groups' new residuals and velocities, its units' control and stats
  chunks."""
  leaves: dict
  residuals: dict
  velocity: dict
  control: list
  stats: list


class Inputs(NamedTuple):
  """What a bucket reads of this step's gradients.

  flat: the leaves' gradients by leaf id (the formed stream where a blend
    is given). parts: None, or the stream as a ``kernels.Blend`` of two
    lists of leaves: a sparse bucket without momentum hands the fused pass
    the parts of its groups in ``BucketStep.blends``, which it forms as it
    reads them. m_rows: {state group: (G, n) array} of the Blend's m kept
    in rows (``jaxfuse.grouped``), read as they are instead of leaf by
    leaf; the pass forms the stream of every such group."""
  flat: list
  parts: kernels.Blend | None = None
  m_rows: dict = {}


class Carry(NamedTuple):
  """The per-worker state a bucket reads: the state groups' residuals and
  velocities (by group id), the units' ``Control`` and the step."""
  residuals: list
  velocity: list
  ctrl: object
  step: jax.Array


def sync_bucket(b: bucket_steps.BucketStep, inputs: Inputs, carry: Carry,
                axis_name, rule: Rule) -> BucketOut:
  """One bucket: accumulate, select (or send all), collective, place.

  Args:
    b: the bucket's compiled step (units, groups, settings, scheme).
    inputs: this step's gradients (``Inputs``).
    carry: the per-worker state it reads (``Carry``).
    axis_name: the mesh axis (or axes) of the workers.
    rule: the accumulation rule (``Rule``).

  Returns:
    Its ``BucketOut``.
  """
  flat = inputs.flat
  if b.kind == bucket_steps.PSUM:
    leaves, stats = _psum_bucket(b, flat, axis_name)
    return BucketOut(leaves, {}, {}, [], stats)
  parts = inputs.parts
  if b.kind == bucket_steps.FULL or rule.momentum:
    parts = None
  streams = _bucket_streams(b, inputs._replace(parts=parts), carry, rule)
  if b.kind == bucket_steps.FULL:
    dense, res, vel, stats = _full_bucket(b, streams, carry, axis_name, rule)
    # Their thresholds are not used; kept as they were.
    control = [(list(b.units), jax.tree.map(
        lambda x: bucket_pass.take(x, b.units), carry.ctrl))]
  else:
    dense, res, vel, control, stats = _sparse_bucket(b, streams, carry,
                                                     axis_name, rule)
  return BucketOut(_place(b, dense, flat), res, vel, control, stats)


def stack_rows(rows):
  """jnp.stack(rows) for flat rows of one shape and dtype: one concatenate.

  XLA's GPU concatenate emitter takes at most four operands, so a state
  group of more rows goes to its slower loop emitter; nested concatenates
  of at most four (each level behind an optimization barrier) and writing
  the rows in place were both slower still, so this stays one
  concatenate. Only the momentum rule stacks (its velocity is stacked
  state); without momentum the fused pass reads the rows where they
  are."""
  return jnp.stack(rows)


class _Streams(NamedTuple):
  """Per state group of a bucket: what its rows accumulate this step (a
  list of flat rows without momentum, which the fused pass reads where
  they are, or a ``kernels.Blend`` of m's and g's, m such a list or its
  group's (G, n) rows; the (G, n) stack with momentum), the new velocity
  (None without momentum) and the (decayed) residual."""
  grads: dict
  moved: dict
  decayed: dict


def _bucket_streams(b, inputs: Inputs, carry: Carry, rule: Rule
                    ) -> _Streams:
  grads, moved, decayed = {}, {}, {}
  parts, m_rows = inputs.parts, inputs.m_rows
  for g in b.groups:
    rows_of = lambda leaves, g=g: [
        _unit_stream(b.unit(u), leaves, b.dtype_of(g)) for u in b.units_of(g)]
    if parts is not None and (g in b.blends or g in m_rows):
      rows = kernels.Blend(   # m's rows where they are, if it has them
          m_rows[g] if g in m_rows else rows_of(parts.m), rows_of(parts.g),
          parts.beta)
    else:
      rows = rows_of(inputs.flat)
    if rule.momentum:
      grads[g], moved[g] = _accumulate(stack_rows(rows), carry.velocity[g],
                                       rule.momentum, rule.nesterov)
    else:
      grads[g], moved[g] = rows, None
    decayed[g] = (carry.residuals[g] * rule.residual_decay
                  if rule.residual_decay != 1 else carry.residuals[g])
  return _Streams(grads, moved, decayed)


def _psum_bucket(b, flat, axis_name):
  """Dense leaves: their exact worker mean, one ``pmean``. Non-float leaves
  (float0 or ints) have no gradient to average and pass through."""
  out = {j: flat[j] for j in b.leaves}
  ids = [j for j in b.leaves if _compat.is_float_dtype(flat[j].dtype)]
  for j, mean in zip(ids, collectives.psum.mean([flat[j] for j in ids],
                                                axis_name)):
    out[j] = mean
  return out, dense_stats(_sizes(b), b.leaves, flat)


def _sizes(b) -> dict:
  """{leaf id: elements} of the bucket's leaves."""
  return {j: int(np.prod(shape, dtype=np.int64))
          for j, shape in b.leaf_shapes}


def _full_bucket(b, streams, carry: Carry, axis_name, rule):
  """Density-1 units: every element sent with one ``pmean``; the residual
  becomes the wire's rounding (zero where the wire is acc's dtype)."""
  residuals, velocity = carry.residuals, carry.velocity
  order = [u for g in b.groups for u in b.units_of(g)]
  dense, finite, roundings, stats = _full_sync(
      b, order, [streams.grads[g][i] + streams.decayed[g][i]
                 for g in b.groups for i in range(len(b.units_of(g)))],
      axis_name)
  new_res, new_vel, rows = {}, {}, 0
  for g in b.groups:
    n = len(b.units_of(g))
    ok = jnp.stack(finite[rows:rows + n])[:, None]
    new_res[g] = jnp.where(ok, jnp.stack(roundings[rows:rows + n]),
                           residuals[g])
    if rule.momentum:
      moved = streams.moved[g]
      kept = jnp.zeros_like(moved) if rule.mask_momentum else moved
      new_vel[g] = jnp.where(ok, kept, velocity[g])
    rows += n
  return dict(zip(order, dense)), new_res, new_vel, stats


def _sparse_bucket(b, streams, carry: Carry, axis_name, rule):
  """Selection per state group (``bucket_pass``), then the bucket's
  collective; what the collective hands back stays owed in the residual."""
  residuals, velocity = carry.residuals, carry.velocity
  parts, ctrl_chunks, stats = {}, [], []
  new_res = {g: [] for g in b.groups}
  new_vel = {g: [] for g in b.groups}
  wire_of = dict(zip(b.units, b.wire_specs))
  for batch, out, stacked in bucket_pass.sparsify_groups(
      b.batches, streams.grads, streams.decayed, carry.ctrl, carry.step,
      b.settings):
    g, rows, ids = batch.group, batch.rows, batch.units
    values, residual = jax.vmap(functools.partial(
        _to_wire, wire=wire_of[ids[0]]))(
            out.values, out.indices, out.residual, out.nonfinite)
    for i, u in enumerate(ids):
      parts[u] = (values[i], out.indices[i])
    # A non-finite step keeps the residual sparsify was given: the decayed
    # one, so restore the old where it was decayed.
    bad = out.nonfinite[:, None]
    if rule.residual_decay != 1:
      residual = jnp.where(bad, bucket_pass.rows_of(residuals[g], rows),
                           residual)
    new_res[g].append((rows, residual))
    if rule.momentum:
      m = bucket_pass.rows_of(streams.moved[g], rows)
      kept = (jax.vmap(lambda v, i: v.at[i].set(0, mode="drop"))(
          m, out.indices) if rule.mask_momentum else m)
      new_vel[g].append((rows, jnp.where(
          bad, bucket_pass.rows_of(velocity[g], rows), kept)))
    ctrl_chunks.append((ids, out.control))
    stats.extend(sparse_stats(
        _sizes(b), b.settings, [b.unit(u) for u in ids], out, stacked))
  res = {g: _set_rows(residuals[g], new_res[g]) for g in b.groups}
  vel = ({g: _set_rows(velocity[g], new_vel[g]) for g in b.groups}
         if rule.momentum else {})
  order = list(b.units)   # the bucket's layout: its ready order
  dense, kept = b.scheme.sync(
      [parts[u] for u in order], list(b.wire_specs), axis_name, b.settings)
  for g in b.groups:  # dropped on the way: owed still
    back = [kept[order.index(u)] for u in b.units_of(g)]
    if any(x is not None for x in back):
      res[g] = res[g] + jnp.stack([
          jnp.zeros_like(res[g][0]) if x is None else
          x.astype(res[g].dtype) for x in back])
  return dict(zip(order, dense)), res, vel, ctrl_chunks, stats


def _place(b, dense, flat):
  """Each leaf of the bucket cut from its unit's dense mean, in its shape
  and the gradient's dtype."""
  out, sizes = {}, _sizes(b)
  for u, leaves in b.placement:
    for j, start in leaves:
      out[j] = dense[u][start:start + sizes[j]].reshape(
          b.leaf_shape(j)).astype(flat[j].dtype)
  return out


def _accumulate(x, u, momentum, nesterov):
  """(what the residual accumulates, new velocity) of DGC's momentum
  correction: u' = m·u + x, adds u' (Nesterov: u' = m·(u + x), adds x + u').
  """
  if nesterov:
    u = momentum * (u + x)
    return x + u, u
  u = momentum * u + x
  return u, u


def round_to(x, wire_dtype):
  """(x rounded to ``wire_dtype`` but still in x's dtype, the same in
  ``wire_dtype``). ``lax.reduce_precision`` rounds explicitly: XLA may drop
  a convert round trip (``xla_allow_excess_precision``, on by default on
  GPU), which would lose the rounding we keep. A finite x beyond the wire's
  largest value goes as that value (the rest stays in the residual), not as
  inf."""
  if x.dtype == jnp.dtype(wire_dtype):
    return x, x
  info = jnp.finfo(wire_dtype)
  top = jnp.asarray(info.max, x.dtype)
  x = jnp.where(jnp.isfinite(x), jnp.clip(x, -top, top), x)
  rounded = lax.reduce_precision(x, exponent_bits=info.nexp,
                                 mantissa_bits=info.nmant)
  return rounded, rounded.astype(wire_dtype)


def _to_wire(values, indices, residual, nonfinite, wire):
  """Selected values as the ``wire`` unit sends them (its dtype, or
  ``fusion.quantize_values``' words), and the residual that keeps their
  rounding: r' = acc − wire(v) at the sent slots (exact in float32 for a
  bfloat16 wire), so nothing sent is lost to the cast."""
  if wire.value_bits:
    words = fusion.quantize_values(values, wire.value_bits)
    sent = fusion.dequantize_values(words, wire.value_bits, values.shape[-1])
    rounding = jnp.where(nonfinite, 0, values - sent.astype(values.dtype))
    return words, residual.at[indices].add(rounding, mode="drop")
  if values.dtype == jnp.dtype(wire.dtype):
    return values, residual
  rounded, narrow = round_to(values, wire.dtype)
  rounding = jnp.where(nonfinite, 0, values - rounded)
  return narrow, residual.at[indices].add(rounding, mode="drop")


def _full_sync(b, ids, accs, axis_name):
  """Density-1 units (``ids`` of bucket ``b``): every element sent, one
  ``pmean`` for the bucket.

  Returns the dense means per unit, per unit whether acc was finite, the
  new residual (zero, or acc's rounding to the wire dtype where the
  residual is kept wider; the wire dtype is ``plans.full_wire_dtype``: the
  unit's, unless ``Settings.full_wire`` is narrower) and the units'
  per-leaf stats chunks (everything selected)."""
  wires, roundings = [], []
  for u, acc in zip(ids, accs):
    rounded, wire = round_to(acc, plans.full_wire_dtype(b.unit(u), b.settings))
    wires.append(wire)
    roundings.append(acc - rounded)   # zero where the wire is acc's dtype
  means = collectives.psum.mean(wires, axis_name)
  placement, sizes = dict(b.placement), _sizes(b)
  per_leaf = {j: acc[start:start + sizes[j]]
              for u, acc in zip(ids, accs) for j, start in placement[u]}
  stats = dense_stats(sizes, list(per_leaf), per_leaf)
  return means, [jnp.all(jnp.isfinite(acc)) for acc in accs], roundings, stats


def _unit_stream(unit, flat, dtype):
  """A unit's flat stream: its leaves' gradients concatenated, in ``dtype``."""
  return jnp.concatenate([flat[j].reshape(-1).astype(dtype)
                          for j in unit.leaves])


def _set_rows(x, pieces):
  """x with rows replaced by [(rows, values)] (no copy if one piece covers
  every row in order)."""
  if len(pieces) == 1 and list(pieces[0][0]) == list(range(x.shape[0])):
    return pieces[0][1]
  for rows, values in pieces:
    x = x.at[np.asarray(rows)].set(values)
  return x
