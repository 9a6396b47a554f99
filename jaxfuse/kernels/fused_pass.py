"""The fused sparsify pass: one read of the stream and the residual.

For a unit's stream x (the gradient, or what a recipe accumulates; given
as a ``reference.Blend``, x = β·m + (1 − β)·g is formed as m and g are
read) and its residual r, at threshold τ with c slots and rotation
offset o::

  acc = x + r
  (v, idx, m) = select(acc, τ, c, o)          (``reference.select``)
  lone: m = 0 and acc ≠ 0  ⇒  slot 0 = (acc[t], t),  t = argmax |acc|
  r'  = acc with the sent slots zeroed
  finite = all(isfinite(acc)) ;  nonzero = any(x ≠ 0)

and, if acc is not finite: r' = r, v = NaN, idx = (0, n, n, …), m = 0 (the
update is non-finite on every worker; nothing of x enters the residual).

``sparsify_pass_pallas`` does this in the three kernels of
``selection.py``: pass 1 reads x and r once, writes acc over r in place
(so a donated residual needs no copy) and r to a scratch buffer, the
candidate mask, counts and staged positions, and per block whether acc is
finite, its largest |acc| (first position) and whether x has a non-zero;
the scan reduces those (or each pass-2 program does, ``scan_blocks``);
pass 2 writes the slots and zeroes them in the residual in place (or
copies r back from the scratch if acc was not finite). For float32 x and
r. Memory traffic: read x and r, write acc and the scratch (4n elements),
the n/8-byte mask, the staged positions and the slots. The XLA reference
reads acc about five times (finiteness, selection, argmax, scatter, the
``where``).
``sparsify_pass_reference`` is that reference; the two are equal bit for bit.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
import numpy as np

from jaxfuse import _compat
from jaxfuse.kernels import reference
from jaxfuse.kernels import segments
from jaxfuse.kernels import selection as sel
from jaxfuse.kernels.compare import comparison_threshold

plgpu = _compat.pallas_triton()  # None: this JAX has no Triton backend


class PassResult(NamedTuple):
  values: jax.Array     # (c,) acc's dtype
  indices: jax.Array    # (c,) int32, sentinel n
  count: jax.Array      # int32: candidates |acc| ≥ τ (0 if not finite)
  residual: jax.Array   # (n,) r'
  finite: jax.Array     # bool
  nonzero: jax.Array    # bool: x has a non-zero


def nonfinite_slots(values, indices, count, finite, n):
  """What a non-finite unit sends: NaN, at element 0 only."""
  c = indices.shape[0]
  slot0 = jnp.arange(c) == 0
  return (jnp.where(finite, values, jnp.nan).astype(values.dtype),
          jnp.where(finite, indices, jnp.where(slot0, 0, n)).astype(jnp.int32),
          jnp.where(finite, count, 0))


def sparsify_pass_reference(x, r, tau, capacity: int, offset) -> PassResult:
  """The pass in jnp (module docstring)."""
  acc = x + r
  n = acc.size
  finite = jnp.all(jnp.isfinite(acc))
  values, indices, count = reference.select(acc, tau, capacity, offset)
  top = jnp.argmax(jnp.abs(acc)).astype(jnp.int32)
  lone = (count == 0) & (acc[top] != 0)
  indices = indices.at[0].set(jnp.where(lone, top, indices[0]))
  values = values.at[0].set(jnp.where(lone, acc[top], values[0]))
  residual = jnp.where(finite, acc.at[indices].set(0, mode="drop"), r)
  values, indices, count = nonfinite_slots(values, indices, count, finite, n)
  return PassResult(values, indices, count, residual, finite,
                    jnp.any(x != 0))


class _BlendRow(NamedTuple):
  """A row formed as β·m + (1 − β)·g (``reference.blend``, the same
  expression as the recipe's) as it is loaded, from rows m and g (refs or
  ``selection.Switched``) of one length."""
  m: object
  g: object
  beta: float

  @property
  def shape(self):
    return self.m.shape

  def tile_at(self, start, tile, mask=None):
    m, g = (sel.load_tile(part, start, tile, mask)
            for part in (self.m, self.g))
    return reference.blend(m, g, self.beta)


def _mask_kernel(tau_ref, *refs, chunks, beta, n, block, tile, stage,
                 interpret, ids=None):
  """Pass 1 of ``selection.mask_kernel`` on acc = x + r, with the block's
  summaries (module docstring), for G units: grid (G, blocks), refs (x_0 …
  x_{C−1}, r, outputs…) with ``chunks`` = ((C, R),). The streams come in C
  flat arrays of R rows each (the last may hold fewer), and row g is row
  g mod R of x_{g div R} (``selection.Switched``), read where it is; r and
  the outputs are row g of their stacks (their BlockSpecs squeeze the
  row). With ``beta``, x is a ``reference.Blend``, read as ``_BlendRow``s:
  refs (m_0 … m_{C−1}, g_0 … g_{C'−1}, r, outputs…), ``chunks`` =
  ((C, R), (C', R')): m and g each in their own chunks (m often one (G, n)
  array, g rows apart). The streams are never padded: a unit shorter than
  a block is one partial block, whose loads are masked (r and the outputs
  are at least a block long). acc goes over r in place (``acc_ref`` is r's
  buffer) and r to ``old_ref``; the staged candidates
  are positions only (pass 2 reads their values from acc), so nothing here
  reads memory this pass has written. ``ids``: (g, b) given (a segment of
  ``segments.segmented_call``'s grid) instead of the program ids."""
  g, b = ids if ids is not None else (pl.program_id(0), pl.program_id(1))
  x_ref = []
  for count, per in chunks:
    x_ref.append(sel.Switched(g // per, (g % per) * n, refs[:count], n))
    refs = refs[count:]
  x_ref = x_ref[0] if beta is None else _BlendRow(*x_ref, beta)
  r_ref, refs = refs[0], refs[1:]
  tau = tau_ref[g]
  (bits_ref, cnt_ref, si_ref, acc_ref, old_ref, bmax_ref, bpos_ref, bfin_ref,
   bnz_ref) = refs
  rows = tile // sel.WORD
  shift = lax.broadcasted_iota(jnp.int32, (rows, sel.WORD), 1)
  row = lax.broadcasted_iota(jnp.int32, (rows,), 0)
  lanes = lax.broadcasted_iota(jnp.int32, (tile,), 0)

  def body(t, xr, pos, carry):
    count, fin, top_mag, top, nz = carry
    x, r = xr
    acc = x + r
    at = b * block + t * tile
    if pos is None:
      acc_ref[pl.ds(at, tile)] = acc
      old_ref[pl.ds(at, tile)] = r
      valid = jnp.ones((tile,), bool)
    else:
      valid = pos < n
      plgpu.store(acc_ref.at[pl.ds(at, tile)], acc, mask=valid)
      plgpu.store(old_ref.at[pl.ds(at, tile)], r, mask=valid)
    m = sel.candidates(acc, pos, n, tau).astype(jnp.int32)
    words = jnp.sum(m.reshape(rows, sel.WORD) << shift, axis=1)
    bits_ref[pl.ds(at // sel.WORD, rows)] = words
    counts = sel.popcount(words)
    rank0 = count + jnp.cumsum(counts) - counts       # in the block, from 0
    base = at + row * sel.WORD

    def peel(j, w):                 # stage the j-th candidate of every word
      rank = rank0 + j
      ok = (w != 0) & (rank < stage)
      slot = sel.masked_index(ok, rank, stage, interpret)
      plgpu.store(si_ref.at[slot], sel.lowest_bit_position(base, w), mask=ok)
      return w & (w - 1)

    lax.fori_loop(0, jnp.where(count < stage, jnp.max(counts), 0), peel,
                  words)
    mag = jnp.where(valid, jnp.abs(acc.astype(jnp.float32)), -1.0)
    bad = jnp.sum(jnp.where(valid & ~jnp.isfinite(mag), 1, 0))
    tile_mag = jnp.max(mag)
    tile_top = jnp.min(jnp.where(mag == tile_mag, at + lanes,
                                 jnp.int32(2**31 - 1)))
    better = tile_mag > top_mag                       # the first maximum
    nz = jnp.maximum(nz, jnp.max(jnp.where(valid & (x != 0), 1, 0)))
    return (count + jnp.sum(counts), jnp.where(bad > 0, 0, fin),
            jnp.where(better, tile_mag, top_mag),
            jnp.where(better, tile_top, top), nz)

  count, fin, top_mag, top, nz = sel.for_each_tile(
      (x_ref, r_ref), b, n, block, tile, body,
      (jnp.int32(0), jnp.int32(1), jnp.float32(-1.0), jnp.int32(0),
       jnp.int32(0)))
  cnt_ref[b] = count
  bfin_ref[b] = fin
  bmax_ref[b] = top_mag
  bpos_ref[b] = top
  bnz_ref[b] = nz


_STATIC = ("capacity", "block", "tile", "stage", "num_warps", "interpret",
           "scan_blocks")


class _Config(NamedTuple):
  """The kernels' static shapes for units of n elements."""
  n: int
  capacity: int
  block: int
  tile: int
  stage: int
  num_blocks: int
  padded_blocks: int
  scan_chunk: int
  fill_per_program: int
  params: object
  interpret: bool
  scan_in_pass2: bool     # the scan folded into pass 2 (``_scan_write_kernel``)

  @property
  def size(self):      # r's and acc's length: n, or one padded block
    return max(self.n, self.block)

  def pass1_outputs(self, out, dtype):
    per_block = lambda t: out((self.padded_blocks,), t)
    return (out((self.num_blocks * self.block // sel.WORD,), jnp.int32),
            per_block(jnp.int32), out((self.num_blocks * self.stage,),
                                      jnp.int32),
            out((self.size,), dtype), out((self.size,), dtype),
            per_block(jnp.float32), per_block(jnp.int32),
            per_block(jnp.int32), per_block(jnp.int32))


def _config(x, capacity, block, tile, stage, num_warps, interpret,
            scan_blocks):
  n = x.shape[-1]
  block, tile, stage = sel.config(n, capacity, block, tile, stage)
  num_blocks = pl.cdiv(n, block)
  scan_chunk = min(sel.MAX_SCAN_CHUNK, pl.next_power_of_2(num_blocks))
  return _Config(
      n, capacity, block, tile, stage, num_blocks,
      pl.cdiv(num_blocks, scan_chunk) * scan_chunk, scan_chunk,
      pl.next_power_of_2(pl.cdiv(capacity, num_blocks)),
      _compat.triton_params("sparsify_pass_pallas",
                            num_warps or sel.DEFAULT_NUM_WARPS), interpret,
      num_blocks <= (SCAN_IN_PASS2_BLOCKS if scan_blocks is None
                     else scan_blocks))


def _check_operands(xs, r):
  for x in xs:
    sel.check_acc(x)
    if x.shape != r.shape[-1:] or x.dtype != jnp.float32 or \
        r.dtype != x.dtype:
      raise ValueError(f"x and r must be float32 of one length, got "
                       f"{x.dtype}{list(x.shape)} and {r.dtype}"
                       f"{list(r.shape)}")


def _pad(a, cfg):
  """a with its last axis padded with zeros to one block if n < block (the
  residual, whose buffer pass 1 writes acc into; the streams are read
  unpadded)."""
  if cfg.n >= cfg.block:
    return a
  return jnp.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, cfg.block - cfg.n)])


def _mask_kernel_for(cfg, chunks, beta=None):
  return functools.partial(_mask_kernel, chunks=chunks, beta=beta, n=cfg.n,
                           block=cfg.block, tile=cfg.tile, stage=cfg.stage,
                           interpret=cfg.interpret)


class _Same(NamedTuple):
  """A ref-like holder of one value, whatever the index (pass 2 reads its
  block's start as ``start_ref[b]``)."""
  value: jax.Array

  def __getitem__(self, _):
    return self.value


def _scan_write_kernel(offset_ref, cnt_ref, bits_ref, bmax_ref, bpos_ref,
                       bfin_ref, bnz_ref, acc_ref, si_ref, old_ref, v_ref,
                       i_ref, res_ref, scal_ref, *, num_blocks, chunk,
                       b=None, **write):
  """Pass 2 with the scan folded in: program b scans the block counts and
  summaries itself (``selection.scan_scalars``: O(blocks) each), then
  writes block b (``selection.write_kernel``); program 0 also writes scal.
  ``b`` given: that block (``segments.segmented_call``) instead of the
  program id."""
  b = pl.program_id(0) if b is None else b
  scal, start = sel.scan_scalars(
      offset_ref[0], cnt_ref, bits_ref,
      (bmax_ref, bpos_ref, bfin_ref, bnz_ref), n=write["n"],
      block=write["block"], num_blocks=num_blocks, chunk=chunk, upto=b)

  @pl.when(b == 0)
  def _scalars():
    for i, value in enumerate(scal):
      scal_ref[i] = value

  sel.write_kernel(scal, cnt_ref, _Same(start), bits_ref, acc_ref, si_ref,
                   si_ref, old_ref, v_ref, i_ref, res_ref, b=b, **write)


# Pass 2 scans the block counts itself (one kernel fewer per state group)
# for units of at most this many blocks; larger ones keep the scan kernel
# (each program's scan is O(blocks)). 0: always the scan kernel. Folding
# trades a little GPU time for fewer launches; up to this size the two
# balance (measured: docs/benchmarks.md).
SCAN_IN_PASS2_BLOCKS = 4096


def _write_params(cfg) -> dict:
  """``selection.write_kernel``'s static arguments for ``cfg``."""
  return dict(n=cfg.n, block=cfg.block,
              words_per_step=min(cfg.block // sel.WORD,
                                 sel.MAX_WORDS_PER_STEP),
              stage=cfg.stage, capacity=cfg.capacity,
              fill_per_program=cfg.fill_per_program,
              interpret=cfg.interpret, tile=cfg.tile)


def _finish(cfg, out, offset, pass1) -> PassResult:
  """The scan kernel and pass 2 of one unit from pass 1's outputs (units
  of more than ``SCAN_IN_PASS2_BLOCKS`` blocks; vmapped over the rows)."""
  bits, counts, staged_i, acc, old, bmax, bpos, bfin, bnz = pass1
  whole = pl.BlockSpec()
  stage_spec = pl.BlockSpec((cfg.stage,), lambda b: (b,))
  start, scal = pl.pallas_call(
      functools.partial(sel.scan_kernel, n=cfg.n, block=cfg.block,
                        num_blocks=cfg.num_blocks, chunk=cfg.scan_chunk),
      out_shape=(out((cfg.padded_blocks,), jnp.int32), out((8,), jnp.int32)),
      grid=(1,), in_specs=[whole] * 7, out_specs=(whole, whole),
      compiler_params=cfg.params, interpret=cfg.interpret,
      name="jaxfuse_sparsify_scan",
  )(jnp.reshape(offset, (1,)), counts, bits, bmax, bpos, bfin, bnz)
  values, indices, residual = pl.pallas_call(
      functools.partial(sel.write_kernel, **_write_params(cfg)),
      out_shape=(out((cfg.capacity,), acc.dtype),
                 out((cfg.capacity,), jnp.int32), out(acc.shape, acc.dtype)),
      grid=(cfg.num_blocks,),
      in_specs=[whole] * 5 + [stage_spec] * 2 + [whole],
      out_specs=(whole, whole, whole),
      input_output_aliases={4: 2},
      compiler_params=cfg.params, interpret=cfg.interpret,
      name="jaxfuse_sparsify_pass2",
  )(scal, counts, start, bits, acc, staged_i, staged_i, old)
  return _result(cfg, values, indices, residual, scal)


def _result(cfg, values, indices, residual, scal) -> PassResult:
  """The unit's ``PassResult`` from pass 2's outputs and the scan's scal."""
  finite = scal[3] > 0
  values, indices, count = nonfinite_slots(values, indices, scal[2], finite,
                                            cfg.n)
  return PassResult(values, indices, count, residual[:cfg.n], finite,
                    scal[6] > 0)


@_compat.x32
@functools.partial(jax.jit, static_argnames=_STATIC)
def sparsify_pass_pallas(x: jax.Array, r: jax.Array, tau, capacity: int,
                         offset, *, block: int | None = None,
                         tile: int | None = None, stage: int | None = None,
                         num_warps: int | None = None,
                         interpret: bool = False,
                         scan_blocks: int | None = None) -> PassResult:
  """``sparsify_pass_reference`` as three Pallas kernels (two with the scan
  in pass 2), bit for bit: the pass of ``sparsify_pass_rows_pallas`` with
  one row.

  x, r: flat float32, n elements; the other arguments as
  ``selection.select_pallas``; ``scan_blocks``: units of at most this many
  blocks run the scan inside pass 2 (None: ``SCAN_IN_PASS2_BLOCKS`` when
  traced). (float32 only: XLA and Triton may both keep
  a bfloat16 x + r in float32 before comparing it, each in its own places,
  so a narrower acc could differ from the reference near τ.)
  """
  _check_operands([x], r)
  if r.ndim != 1:
    raise ValueError(f"r must be flat, got shape {list(r.shape)}")
  names = ("sparsify_pass_pallas", "sparsify_pass_reference")
  out = _run_batches([_prepare(
      [[x[None]]], None, r[None], jnp.reshape(jnp.asarray(tau), (1,)),
      jnp.reshape(jnp.asarray(offset, jnp.int32), (1,)), capacity,
      block=block, tile=tile, stage=stage, num_warps=num_warps,
      interpret=interpret, scan_blocks=scan_blocks, names=names)],
      interpret, names)[0]
  return jax.tree.map(lambda a: a[0], out)


def sparsify_pass_rows_reference(xs, r, taus, capacity: int,
                                 offsets) -> PassResult:
  """``sparsify_pass_reference`` of every row: x is ``xs`` (a (G, n)
  array, or a sequence of flat rows and (rows, n) chunks, in row order, or
  a ``reference.Blend`` of two such), x_i its row i, r_i = ``r[i]``."""
  x = (reference.formed(xs.map(reference.stacked_rows))
       if isinstance(xs, reference.Blend) else reference.stacked_rows(xs))
  return jax.vmap(lambda x_, r_, t, o: sparsify_pass_reference(
      x_, r_, t, capacity, o))(x, r, taus, offsets)


@_compat.x32
@functools.partial(jax.jit, static_argnames=_STATIC)
def sparsify_pass_rows_pallas(xs, r: jax.Array, taus, capacity: int,
                              offsets, *, block: int | None = None,
                              tile: int | None = None,
                              stage: int | None = None,
                              num_warps: int | None = None,
                              interpret: bool = False,
                              scan_blocks: int | None = None) -> PassResult:
  """``sparsify_pass_rows_reference`` in three Pallas kernels (two with the
  scan in pass 2), bit for bit.

  ``xs``: the G streams of n float32 elements, as one (G, n) array or as
  chunks of R rows each (flat rows: R = 1; the last chunk may hold fewer),
  read where they are: pass 1's program for row g loads row g mod R of
  chunk g div R, so no (G, n) stack is made. r: (G, n) float32; taus,
  offsets: (G,). Pass 1 is one kernel over all rows (grid G × blocks), and
  so is pass 2 with the scan in it; a scan kernel of its own runs per row
  (vmapped: one kernel over the rows). With ``xs`` a ``reference.Blend``
  of m and g (each in chunks of its own: m may be one (G, n) array and g
  its rows apart), pass 1 forms x = β·m + (1 − β)·g as it loads them: x is
  never written out. ``scan_blocks`` as ``sparsify_pass_pallas``'s.
  """
  names = ("sparsify_pass_rows_pallas", "sparsify_pass_rows_reference")
  return _run_batches([_prepare(
      *_stream_parts(xs, r), r, taus, offsets, capacity, block=block,
      tile=tile, stage=stage, num_warps=num_warps, interpret=interpret,
      scan_blocks=scan_blocks, names=names)], interpret, names)[0]


@_compat.x32
@functools.partial(jax.jit, static_argnames=("capacities",) + _STATIC[1:])
def sparsify_pass_bucket_pallas(xs, r, taus, capacities: tuple[int, ...],
                                offsets, *, block: int | None = None,
                                tile: int | None = None,
                                stage: int | None = None,
                                num_warps: int | None = None,
                                interpret: bool = False,
                                scan_blocks: int | None = None
                                ) -> list[PassResult]:
  """``sparsify_pass_rows_pallas`` of every batch of a bucket (lists: one
  ``xs``, r, taus, capacity and offsets per batch, of its own length), bit
  for bit, in two kernels in all: the batches' pass 1 as segments of one
  Pallas call, and their pass 2 with the scan in it as segments of another
  (``segments.segmented_call``); a batch of more than ``scan_blocks``
  blocks keeps its scan kernel and pass 2 of its own. ``block``, ``tile``,
  ``stage``: for every batch (None: each its own default).
  """
  names = ("sparsify_pass_bucket_pallas", "sparsify_pass_rows_reference")
  if not len(xs) == len(r) == len(taus) == len(capacities) == len(offsets):
    raise ValueError(f"{names[0]}: one xs, r, taus, capacity and offsets "
                     f"per batch, got {len(xs)}, {len(r)}, {len(taus)}, "
                     f"{len(capacities)} and {len(offsets)}")
  return _run_batches([_prepare(
      *_stream_parts(x, r_), r_, t, o, c, block=block, tile=tile,
      stage=stage, num_warps=num_warps, interpret=interpret,
      scan_blocks=scan_blocks, names=names)
      for x, r_, t, c, o in zip(xs, r, taus, capacities, offsets)],
      interpret, names)


def _stream_parts(xs, r):
  """(parts, β): the streams' chunks, [x's] or a ``Blend``'s [m's, g's],
  checked against r."""
  beta = xs.beta if isinstance(xs, reference.Blend) else None
  parts = ([xs] if beta is None else [xs.m, xs.g])
  parts = [reference.stream_chunks(p) for p in parts]
  shapes = [[list(c.shape) for c in p] for p in parts]
  covers = lambda p: (sum(c.shape[0] for c in p), p[0].shape[-1])
  if (any(c.ndim != 2 for p in parts for c in p) or
      covers(parts[-1]) != covers(parts[0])):
    raise ValueError(f"xs must be flat rows or (rows, n) chunks (a Blend's "
                     f"m and g of the same rows), got shapes {shapes}")
  _check_operands([jax.ShapeDtypeStruct(c.shape[1:], c.dtype)
                   for p in parts for c in p], r)
  return parts, beta


class _Operands(NamedTuple):
  """One batch's checked operands: G rows of n elements."""
  cfg: _Config
  layout: tuple         # (chunks, rows per chunk) of each part
  beta: float | None
  rows: int
  taus: jax.Array       # (G,) comparison thresholds
  offsets: jax.Array    # (G,) int32
  flat: tuple           # the streams' chunks, flat
  r: jax.Array          # (G, size), padded to a block


def _prepare(parts, beta, r, taus, offsets, capacity, *, block, tile,
             stage, num_warps, interpret, scan_blocks, names) -> _Operands:
  """The kernels' operands for checked (rows, n) chunks: ``parts`` = [x's]
  or, with ``beta``, [m's, g's] (``names``: the public function and its
  reference, for errors)."""
  chunks = parts[0]
  rows = sum(c.shape[0] for c in chunks)
  layout = []
  for name, p in zip(["x"] if len(parts) == 1 else ["m", "g"], parts):
    per = p[0].shape[0]
    if any(c.shape[0] != per for c in p[:-1]) or p[-1].shape[0] > per:
      raise ValueError(f"{names[0]}: {name}: every chunk but the last must "
                       f"hold the same number of rows, and the last no "
                       f"more; got {[c.shape[0] for c in p]}")
    layout.append((len(p), per))
  if r.shape != (rows, chunks[0].shape[1]):
    raise ValueError(f"r must be ({rows}, n) for {rows} rows, got "
                     f"shape {list(r.shape)}")
  cfg = _config(chunks[0], capacity, block, tile, stage, num_warps,
                interpret, scan_blocks)
  taus = jax.vmap(functools.partial(comparison_threshold, chunks[0].dtype))(
      jnp.reshape(jnp.asarray(taus), (rows,)))
  return _Operands(cfg, tuple(layout), beta, rows, taus,
                jnp.reshape(jnp.asarray(offsets, jnp.int32), (rows,)),
                tuple(jnp.reshape(c, (-1,)) for p in parts for c in p),
                _pad(r, cfg))


def _row(shape):
  """A (block shape, index map): row g of a (G,) + shape array."""
  return (None,) + tuple(shape), lambda g, b: (g,) + (0,) * len(shape)


def _at_block(size):
  """Row g's b-th ``size`` elements of a (G, B·size) array."""
  return (None, size), lambda g, b: (g, b)


def _pass1(batch, out) -> segments.Segment:
  """Pass 1 of a batch, grid G × blocks: acc over r in place (aliased: the
  residual stays in its buffer, which the caller may have donated), r kept
  in ``old`` for a non-finite step."""
  cfg, nf = batch.cfg, len(batch.flat)
  outs = cfg.pass1_outputs(
      lambda shape, dtype: out((batch.rows,) + shape, dtype), batch.r.dtype)
  specs = [_row(o.shape[1:]) for o in outs]
  specs[2] = _at_block(cfg.stage)
  kernel = _mask_kernel_for(cfg, batch.layout, batch.beta)
  return segments.Segment(
      kernel, (batch.taus, *batch.flat, batch.r),
      [None] * (1 + nf) + [_row((cfg.size,))], outs, specs, {1 + nf: 3},
      batch.rows, cfg.num_blocks)


def _pass2(batch, pass1, out) -> segments.Segment:
  """Pass 2 with the scan in it (``_scan_write_kernel``), grid G × blocks;
  the residual written over acc in place."""
  cfg, rows = batch.cfg, batch.rows
  bits, counts, staged_i, acc, old, bmax, bpos, bfin, bnz = pass1
  ins = (batch.offsets[:, None], counts, bits, bmax, bpos, bfin, bnz, acc,
         staged_i, old)
  in_specs = [_row(x.shape[1:]) for x in ins]
  in_specs[8] = _at_block(cfg.stage)
  outs = (out((rows, cfg.capacity), acc.dtype),
          out((rows, cfg.capacity), jnp.int32), out(acc.shape, acc.dtype),
          out((rows, 8), jnp.int32))
  write = functools.partial(_scan_write_kernel, num_blocks=cfg.num_blocks,
                            chunk=cfg.scan_chunk, **_write_params(cfg))
  return segments.Segment(
      lambda *refs, ids: write(*refs, b=ids[1]), ins, in_specs, outs,
      [_row(o.shape[1:]) for o in outs], {7: 2}, rows, cfg.num_blocks)


def _run_batches(batches, interpret, names) -> list[PassResult]:
  """Pass 1 of every batch in one call, pass 2 (scan inside) of those
  that fold it in another; the rest scan and write per batch."""
  operands = [(b.r, b.taus, b.offsets, *b.flat) for b in batches]
  flat, out = _compat.kernel_operands(
      *[x for ops in operands for x in ops], interpret=interpret,
      kernel=names[0], reference=names[1])
  ends = np.cumsum([len(ops) for ops in operands])
  batches = [b._replace(r=r, taus=taus, offsets=offsets, flat=tuple(chunks))
             for b, (r, taus, offsets, *chunks) in zip(   # made to vary alike
                 batches, (flat[e - len(ops):e]
                           for e, ops in zip(ends, operands)))]
  params = batches[0].cfg.params
  pass1 = segments.segmented_call(
      [_pass1(b, out) for b in batches], compiler_params=params,
      interpret=interpret, name="jaxfuse_sparsify_pass1")
  folded = [i for i, b in enumerate(batches) if b.cfg.scan_in_pass2]
  results = [None] * len(batches)
  if folded:
    pass2 = segments.segmented_call(
        [_pass2(batches[i], pass1[i], out) for i in folded],
        compiler_params=params, interpret=interpret,
        name="jaxfuse_sparsify_pass2")
    for i, got in zip(folded, pass2):
      results[i] = jax.vmap(functools.partial(_result, batches[i].cfg))(*got)
  for i, b in enumerate(batches):
    if results[i] is None:
      results[i] = jax.vmap(lambda o, *p, cfg=b.cfg: _finish(cfg, out, o, p))(
          b.offsets, *pass1[i])
  return results
