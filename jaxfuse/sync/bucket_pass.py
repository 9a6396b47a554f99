"""A sparse bucket's state groups through ``sparsify``, stage by stage.

A batch is a state group's rows with one capacity, density and estimator
(usually the whole group); its units run vmapped, so transformer layers
that repeat shapes keep the program about one layer's size. The k-th
largest magnitudes the estimators need are found for all of a bucket's
batches at once (``radix_select.kth_largest_rows``: on GPU a few
reductions instead of a sort per group)::

  1. per batch: the sampled |acc| (``sparsify.sample_magnitudes``)
  2. the bucket: their k-th largest (DGC's estimate, topk's bracket τ_lo)
  3. per batch: τ (``sparsify.unit_threshold``) and the fused pass of all
     its rows (``kernels.sparsify_pass_rows``; or the bucket's batches at
     once, ``kernels.sparsify_pass_bucket``: ``ONE_PASS_PER_BUCKET``)
  4. the bucket: the k-th largest of topk's staged slots; per batch
     ``sparsify.topk_finish``
  5. per batch: controller and checks (``sparsify.unit_result``)

Bitwise the same as ``sparsify.sparsify_unit`` on each unit alone (on GPU
the controller's float fields, τ and the kept threshold, may differ by an
ulp: XLA may fuse a batch's arithmetic differently, so only a magnitude
lying between the two τ would be selected differently).
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxfuse import kernels
from jaxfuse import plans
from jaxfuse.kernels import radix_select
from jaxfuse import sparsify


class Batch(NamedTuple):
  group: int          # state group
  rows: list[int]     # its rows in the batch
  units: list[int]    # their unit ids
  unit: plans.Unit  # the first (capacity, density, estimator, size)


def take(x, ids):
  """x[ids] along axis 0 for static ids (a slice when they are contiguous)."""
  if list(ids) == list(range(ids[0], ids[0] + len(ids))):
    return x[ids[0]:ids[0] + len(ids)]
  return x[np.asarray(ids)]


def rows_of(x, rows):
  """x[rows] for static row ids (the array itself when they are all); a
  list of rows gives the list of those rows; a ``Blend``, those of each
  part."""
  if isinstance(x, kernels.Blend):
    return x.map(lambda part: rows_of(part, rows))
  if not isinstance(x, jax.Array):
    return [x[i] for i in rows]
  return x if list(rows) == list(range(x.shape[0])) else take(x, rows)


# Rows of a batch's streams stacked together for the fused pass, which
# reads each chunk where it is (``kernels.sparsify_pass_rows``). 1: every
# row where it is (nothing is copied into a stack, and a blended stream
# stays two reshaped leaves: docs/benchmarks.md, "Overhead on one GPU").
# 0: the whole batch at once. XLA's GPU concatenate emitter takes at most
# four operands; a larger stack goes to its slower loop emitter.
ROWS_PER_CHUNK = 1
# The fused pass of all of a bucket's batches as one kernel per pass
# (``kernels.sparsify_pass_bucket``), or kernels per batch (False, the
# default): one kernel per bucket launches fewer kernels in about the same
# step time, but one large Triton kernel compiles much longer than several
# small ones.
ONE_PASS_PER_BUCKET = False
# Pass 1 takes every chunk as an operand and switches among them per tile;
# a batch of more rows is cut into at most this many chunks (CUDA before
# 12.1 allows 4 KiB of kernel parameters, and the switch grows the
# compile). gpt2-small's largest state group has 48 rows.
MAX_CHUNKS = 64


def stacked(x):
  """A batch's streams as one (G, n) array (a list of rows is stacked, a
  ``Blend`` formed)."""
  x = kernels.formed(x)
  return x if isinstance(x, jax.Array) else jnp.stack(x)


def chunked(x):
  """A batch's streams for the fused pass: a (G, n) array as it is; a list
  of rows as (R, n) chunks of R = ``ROWS_PER_CHUNK`` rows, more if that
  makes over ``MAX_CHUNKS`` chunks (the last may hold fewer; 0: one chunk
  of all); a ``Blend`` part by part."""
  if isinstance(x, kernels.Blend):
    return x.map(chunked)
  if isinstance(x, jax.Array):
    return x
  per = max(ROWS_PER_CHUNK or len(x), -(-len(x) // MAX_CHUNKS))
  return [x[i][None] if per == 1 else jnp.stack(x[i:i + per])
          for i in range(0, len(x), per)]


def by_chunk(fn, x, *rowwise):
  """``fn(x, *rowwise)`` for a (G, n) array x; for chunks, ``fn`` of each
  chunk with its rows of ``rowwise`` (pytrees of arrays with a leading
  axis of G, or None), concatenated: nothing reads a stack of the whole
  batch's streams. ``fn`` works row by row (vmapped), so both agree. A
  ``Blend``'s chunks are formed for ``fn`` (XLA fuses β·m + (1 − β)·g
  into what reads them)."""
  x = kernels.formed(x)
  if isinstance(x, jax.Array):
    return fn(x, *rowwise)
  outs, start = [], 0
  for chunk in x:
    rows = slice(start, start + chunk.shape[0])
    start = rows.stop
    outs.append(fn(chunk, *jax.tree.map(lambda a, rows=rows: a[rows],
                                        rowwise)))
  return jax.tree.map(lambda *parts: jnp.concatenate(parts), *outs)


def batches(all_units: Sequence[plans.Unit], groups: Sequence[list[int]],
            gids: Sequence[int]) -> list[Batch]:
  """The batches of state groups ``gids``: rows of one capacity, density
  and estimator, in row order."""
  out = []
  for g in gids:
    by_kind = {}
    for row, u in enumerate(groups[g]):
      unit = all_units[u]
      by_kind.setdefault((unit.capacity, unit.density, unit.estimator),
                         []).append(row)
    for rows in by_kind.values():
      units = [groups[g][r] for r in rows]
      out.append(Batch(g, rows, units, all_units[units[0]]))
  return out


def sparsify_groups(todo: Sequence[Batch], grads, residuals, ctrl, step,
                    settings) -> list:
  """``sparsify_unit`` over every row of a bucket's batches.

  Args:
    todo: the bucket's ``Batch``es (``batches``), each a state group's rows
      of one capacity, density and estimator.
    grads: per state group, its (G, n) streams, or a list of the G flat
      streams (the fused pass then reads each where it is), or a ``Blend``
      of two such (formed as the pass reads them).
    residuals: per state group, its (decayed) (G, n) residuals.
    ctrl: per unit, the ``Control`` arrays.
    step: the step (a traced int32 scalar).
    settings: the plan's ``Settings`` (the estimators' knobs and ``seed``).

  Returns:
    [(batch, batched ``UnitResult``, the rows' streams)], in ``todo``'s
    order.
  """
  sels = [sparsify.Selection.of(b.unit, settings) for b in todo]
  x = [rows_of(grads[b.group], b.rows) for b in todo]
  r = [rows_of(residuals[b.group], b.rows) for b in todo]
  c = [jax.tree.map(lambda a, b=b: take(a, b.units), ctrl) for b in todo]
  salts = [sparsify.salt(settings.seed, step, b.units) for b in todo]

  chunks = [chunked(a) for a in x]   # what the fused pass reads
  specs = [sparsify.sample_spec(b.unit.size, **sel.kw())
           for b, sel in zip(todo, sels)]
  sampled = [i for i, s in enumerate(specs) if s is not None]
  sample = jax.vmap(sparsify.sample_magnitudes, in_axes=(0, 0, 0, None))
  estimate = dict(zip(sampled, _kth(
      [by_chunk(lambda x_, r_, s_, i=i: sample(x_, r_, s_, specs[i]),
                chunks[i], r[i], salts[i]) for i in sampled],
      [specs[i].rank for i in sampled])))

  pass_args = []   # (streams, r, τ, capacity, offset) per batch
  for i, b in enumerate(todo):
    target = plans.target_count(b.unit.density, b.unit.size)
    tau, offset = by_chunk(
        lambda x_, r_, c_, s_, e_, sel=sels[i], k=target: jax.vmap(
            lambda *a: sparsify.unit_threshold(
                a[0], a[1], a[2], sparsify.Tick(step, a[3], a[5]), a[4],
                sel=sel),
            in_axes=(0, 0, 0, 0, 0, None))(
                x_, r_, c_, s_, e_,
                sparsify.estimate_now(step, c_, k, settings)),
        chunks[i], r[i], c[i], salts[i], estimate.get(i))
    pass_args.append((chunks[i], r[i], tau, sparsify.pass_capacity(
        b.unit.size, capacity=b.unit.capacity, **sels[i].kw()), offset))
  passes = list(zip([a[2] for a in pass_args],
                    kernels.sparsify_pass_bucket(pass_args)
                    if ONE_PASS_PER_BUCKET else
                    [kernels.sparsify_pass_rows(*a) for a in pass_args]))

  staged = [i for i, b in enumerate(todo)
            if sparsify.needs_topk_finish(b.unit.size, **sels[i].kw())]
  kths = _kth([jnp.abs(passes[i][1].values).astype(jnp.float32)
               for i in staged],
              [plans.target_count(todo[i].unit.density, todo[i].unit.size)
               for i in staged])
  for i, kth in zip(staged, kths):
    b = todo[i]
    passes[i] = jax.vmap(functools.partial(
        sparsify.topk_finish, capacity=b.unit.capacity,
        density=b.unit.density, n=b.unit.size))(*passes[i], kth)

  return [(b, jax.vmap(functools.partial(sparsify.unit_result, sel=sels[i]))(
      stacked(x[i]), r[i], c[i], *passes[i]), kernels.formed(x[i]))
          for i, b in enumerate(todo)]


def _kth(rows, ranks):
  return radix_select.kth_largest_rows(rows, ranks) if rows else []
