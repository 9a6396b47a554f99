"""Pallas (Triton backend) kernel for fixed-capacity threshold selection.

``select_pallas(acc, tau, capacity, offset)`` returns exactly what
:func:`jaxfuse.kernels.reference.select` returns, bit for bit: the candidates
``M = {i : |acc_i| ≥ τ, acc_i ≠ 0}`` ranked in the rotated order
``offset, offset+1, …, n−1, 0, …, offset−1``, the first ``capacity`` written to
slots ``0, 1, …`` (value in ``acc``'s dtype, int32 index), the other slots
holding the sentinel index ``n`` and the value 0, and the true count ``|M|``.

The reference does a full-length cumsum and a scatter of n elements; this
streams ``acc`` once and then touches only the candidates. ``acc`` is cut in
blocks of B elements (one program each), a block in tiles of T (B, T powers
of two ≥ 32; T < B makes the program loop over its tiles, loading tile t+1
before working on tile t):

* **Pass 1 (mask)**: the candidate mask of a tile, viewed as T/32 rows of 32,
  is packed into one 32-bit word per row, ``w = Σ_j m_j · 2^j`` (a row
  reduction, no scan), and stored; the block's count is ``Σ popcount(w)``.
  The first S candidates of the block (S = B/16 by default) are also
  *staged*, in position order, as (value, index) at block-local rank: the
  ranks come from the exclusive scan of the T/32 word popcounts, and the
  program peels the lowest set bit of every word at once (``w & −w``,
  position ``31 − clz``), max_k popcount(w_k) times, re-reading the values
  from the tile it has just loaded (cache hits). Memory traffic: read n
  elements, write n/8 bytes and the staged pairs.
* **Scan** (one program, over ⌈n/B⌉ numbers): ``start`` = exclusive cumsum
  of the counts, ``total`` = their sum, ``before`` = candidates in ``[0,
  offset)`` = ``start`` of offset's block + the popcounts of that block's
  words below offset (B/32 words).
* **Pass 2 (write)**: the j-th candidate of block b has the global inclusive
  rank ``r = start_b + j + 1`` and, as in the reference, the slot ``r −
  before − 1`` if its position is ≥ offset, else ``r + total − before − 1``;
  it is written if the slot is < capacity. A block with ≤ S candidates
  copies its staged pairs (contiguous reads and writes); a denser block
  peels its mask words as pass 1 does, gathering the values from ``acc``
  (the rank of the j-th set bit of word k is ``start_b + Σ_{k'<k}
  popcount(w_k') + j + 1``). A block whose smallest slot is ≥ capacity does
  nothing (with the rotation, only the blocks right after ``offset`` win
  when the candidates overflow). Each program also writes the sentinel
  (0, n) into its share of the slots ``[min(total, capacity), capacity)``,
  so every slot is written exactly once.

Slot positions follow from the scans alone: the result is deterministic, no
atomics.

``select_band_pallas(acc, lo, hi, capacity)`` runs the same kernels on the
band lo ≤ |acc| < hi (offset 0) and also counts, in pass 1, the elements at
or above hi: the exact threshold (``threshold.py``) uses it. Its reference
is ``reference.select_band``.

Comparison semantics: ``|acc| ≥ τ`` is evaluated as the reference evaluates
it (τ is promoted with ``acc``'s dtype by JAX's rules, so a Python float τ is
rounded to bfloat16 for a bfloat16 ``acc``), then compared in float32, which
is exact. NaN never passes; +inf passes any finite τ; τ = +inf keeps only
±inf; τ = NaN keeps nothing.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxfuse import _compat
from jaxfuse.kernels.compare import comparison_threshold

plgpu = _compat.pallas_triton()  # None: this JAX has no Triton backend

# The fastest of the configurations swept on a GPU at 100M elements,
# densities 0.01 and 0.05 (benchmarks/kernels.py --sweep; docs/benchmarks.md).
DEFAULT_BLOCK = 8192
DEFAULT_TILE = 8192
DEFAULT_NUM_WARPS = 8
FILL_TILE = 1024
MAX_WORDS_PER_STEP = 1024  # pass 2: mask words per step
MAX_SCAN_CHUNK = 4096      # block counts per step of the scan


WORD = 32        # mask bits per word


def candidates(x, pos, n, tau, upper=None):
  """|x| ≥ τ, x ≠ 0, in range; and |x| < upper if given (the band)."""
  xf = x.astype(jnp.float32)
  m = (jnp.abs(xf) >= tau) & (xf != 0)
  if upper is not None:
    m &= jnp.abs(xf) < upper
  return m if pos is None else m & (pos < n)


def masked_index(ok, index, out_of_range, interpret):
  # Triton never touches masked lanes; the interpreter scatters them, so they
  # must point out of range (where the scatter drops them).
  return jnp.where(ok, index, out_of_range) if interpret else index


def popcount(w):
  return lax.population_count(w)


class Switched(NamedTuple):
  """A row of ``size`` elements inside one of several flat arrays: a tile
  at ``start`` loads ``refs[index][base + start:…]`` (``index`` and
  ``base`` follow from a program id, so every lane of the program takes
  the same branch of the switch)."""
  index: jax.Array
  base: jax.Array
  refs: tuple
  size: int

  @property
  def shape(self):
    return (self.size,)

  def tile_at(self, start, tile, mask=None):
    return lax.switch(self.index, [
        functools.partial(load_tile, r, self.base + start, tile, mask)
        for r in self.refs])


def load_tile(ref, start, tile, mask=None):
  """``ref[start:start + tile]`` (lanes off ``mask`` unread), ``ref`` a
  ref or a row that loads itself (``Switched``, ``fused_pass._BlendRow``:
  a ``tile_at`` method)."""
  if hasattr(ref, "tile_at"):
    return ref.tile_at(start, tile, mask)
  view = ref.at[pl.ds(start, tile)]
  return view[...] if mask is None else plgpu.load(view, mask=mask)


def for_each_tile(acc_ref, b, n, block, tile, body, carry):
  """carry = body(t, x, bounded_pos, carry) over the tiles of block b.

  ``acc_ref`` is the whole array (or a tuple of arrays of one length: x is
  then the tuple of their tiles; any may be a row that loads itself). Full
  blocks load without a mask (so the loads vectorize whatever n is) and
  pass ``bounded_pos=None``; only the last block, if partial, masks and
  passes the positions. With several tiles, the load of tile t+1 is issued
  before the work on tile t.
  """
  refs = acc_ref if isinstance(acc_ref, tuple) else (acc_ref,)
  ntiles = block // tile
  lanes = lax.broadcasted_iota(jnp.int32, (tile,), 0)

  def run(masked):
    def load(t):
      pos = b * block + t * tile + lanes
      start = b * block + t * tile
      xs = tuple(load_tile(r, start, tile, pos < n if masked else None)
                 for r in refs)
      return (xs if isinstance(acc_ref, tuple) else xs[0],
              pos if masked else None)

    if ntiles == 1:
      return body(0, *load(0), carry)

    def step(t, state):
      x, pos, c = state
      nxt = load(jnp.minimum(t + 1, ntiles - 1))
      return (*nxt, body(t, x, pos, c))

    return lax.fori_loop(0, ntiles, step, (*load(0), carry))[2]

  size = refs[0].shape[0]
  if size % block == 0:
    return run(masked=False)
  if size < block:                         # one partial block, nothing full
    return run(masked=True)
  last = size // block                     # the partial block
  return lax.cond(b == last, lambda: run(masked=True),
                  lambda: run(masked=False))


def lowest_bit_position(base, w):
  """Position of the lowest set bit of each word w (bit j of the word at
  ``base`` is position base + j)."""
  return base + (WORD - 1) - lax.clz(w & -w)


def mask_kernel(tau_ref, acc_ref, bits_ref, cnt_ref, sv_ref, si_ref,
                 *above_ref, n, block, tile, stage, interpret):
  """Pass 1. With ``above_ref`` (the band): candidates are τ ≤ |x| < τ_hi
  (τ_hi = tau_ref[1]) and above_ref[b] counts the block's |x| ≥ τ_hi."""
  b = pl.program_id(0)
  tau = tau_ref[0]
  upper = tau_ref[1] if above_ref else None
  rows = tile // WORD
  shift = lax.broadcasted_iota(jnp.int32, (rows, WORD), 1)
  row = lax.broadcasted_iota(jnp.int32, (rows,), 0)

  def body(t, x, pos, carry):
    count, above = carry
    m = candidates(x, pos, n, tau, upper).astype(jnp.int32)
    words = jnp.sum(m.reshape(rows, WORD) << shift, axis=1)   # disjoint bits
    bits_ref[pl.ds((b * block + t * tile) // WORD, rows)] = words
    counts = popcount(words)
    rank0 = count + jnp.cumsum(counts) - counts       # in the block, from 0
    base = b * block + t * tile + row * WORD

    def peel(j, w):                 # stage the j-th candidate of every word
      rank = rank0 + j
      ok = (w != 0) & (rank < stage)
      p = lowest_bit_position(base, w)
      v = plgpu.load(acc_ref.at[jnp.where(ok, p, 0)], mask=ok)   # cached
      slot = masked_index(ok, rank, stage, interpret)
      plgpu.store(sv_ref.at[slot], v, mask=ok)
      plgpu.store(si_ref.at[slot], p, mask=ok)
      return w & (w - 1)

    lax.fori_loop(0, jnp.where(count < stage, jnp.max(counts), 0), peel,
                  words)
    if upper is not None:
      above += jnp.sum(candidates(x, pos, n, upper).astype(jnp.int32))
    return count + jnp.sum(counts), above

  count, above = for_each_tile(acc_ref, b, n, block, tile, body,
                                (jnp.int32(0), jnp.int32(0)))
  cnt_ref[b] = count
  if above_ref:
    above_ref[0][b] = above


def scan_kernel(offset_ref, cnt_ref, bits_ref, *refs, n, block, num_blocks,
                chunk):
  """One program: start = exclusive scan of the block counts, then
  scal = (offset, before, total) with before = |M ∩ [0, offset)|.

  With the fused pass's block summaries (``refs`` = bmax, bpos, bfinite,
  bnonzero, start, scal) also scal[3:7] = (finite, top, lone, nonzero):
  top the first position of the largest |acc| (the first block holding the
  largest block maximum), lone = finite ∧ total = 0 ∧ max |acc| ≠ 0.
  """
  *summary, start_ref, scal_ref = refs
  scal, _ = scan_scalars(offset_ref[0], cnt_ref, bits_ref, summary, n=n,
                         block=block, num_blocks=num_blocks, chunk=chunk,
                         start_ref=start_ref)
  for i, value in enumerate(scal):
    scal_ref[i] = value


def scan_scalars(offset, cnt_ref, bits_ref, summary, *, n, block, num_blocks,
                 chunk, start_ref=None, upto=None):
  """``scan_kernel``'s scal as a tuple, and the exclusive scan of the
  counts at block ``upto`` (None without ``upto``); the whole scan is
  written to ``start_ref`` if given."""
  ob = jnp.clip(offset, 0, n - 1) // block          # offset's block
  lanes = lax.broadcasted_iota(jnp.int32, (chunk,), 0)
  below = lambda b, cnt, end: jnp.sum(jnp.where(b < end, cnt, 0))

  def step(c, carry):
    run, start_ob, start_upto = carry
    b = c * chunk + lanes
    cnt = plgpu.load(cnt_ref.at[pl.ds(c * chunk, chunk)], mask=b < num_blocks,
                     other=0)
    if start_ref is not None:
      plgpu.store(start_ref.at[pl.ds(c * chunk, chunk)],
                  run + jnp.cumsum(cnt) - cnt, mask=b < num_blocks)
    return (run + jnp.sum(cnt), start_ob + below(b, cnt, ob),
            start_upto + (0 if upto is None else below(b, cnt, upto)))

  total, start_ob, start_upto = lax.fori_loop(
      0, pl.cdiv(num_blocks, chunk), step,
      (jnp.int32(0), jnp.int32(0), jnp.int32(0)))
  more = ()
  if summary:
    bmax_ref, bpos_ref, bfin_ref, bnz_ref = summary

    def reduce(c, carry):
      best, top, fin, nz = carry
      b = c * chunk + lanes
      ok = b < num_blocks
      at = lambda ref: ref.at[pl.ds(c * chunk, chunk)]
      m = plgpu.load(at(bmax_ref), mask=ok, other=-1.0)
      p = plgpu.load(at(bpos_ref), mask=ok, other=0)
      cm = jnp.max(m)
      cp = jnp.min(jnp.where(m == cm, p, jnp.int32(2**31 - 1)))
      better = cm > best
      fin = jnp.minimum(fin, jnp.min(plgpu.load(at(bfin_ref), mask=ok,
                                                other=1)))
      nz = jnp.maximum(nz, jnp.max(plgpu.load(at(bnz_ref), mask=ok,
                                              other=0)))
      return (jnp.where(better, cm, best), jnp.where(better, cp, top), fin,
              nz)

    best, top, fin, nz = lax.fori_loop(
        0, pl.cdiv(num_blocks, chunk), reduce,
        (jnp.float32(-1.0), jnp.int32(0), jnp.int32(1), jnp.int32(0)))
    more = (fin, top,
            ((fin > 0) & (total == 0) & (best != 0)).astype(jnp.int32), nz)
  # The words of offset's block below offset, and the low bits of the word
  # holding it.
  words_per_block = block // WORD
  w = bits_ref[pl.ds(ob * words_per_block, words_per_block)]
  rel = offset - ob * block
  k = lax.broadcasted_iota(jnp.int32, (words_per_block,), 0)
  low = (jnp.int32(1) << (rel % WORD)) - 1
  kept = jnp.where(k < rel // WORD, w,
                   jnp.where(k == rel // WORD, w & low, 0))
  before = start_ob + jnp.sum(popcount(kept))
  before = jnp.where(offset <= 0, 0, jnp.where(offset >= n, total, before))
  scal = tuple(jnp.asarray(v, jnp.int32) for v in (offset, before, total)
               + more)
  return scal, None if upto is None else start_upto


def write_kernel(scal_ref, cnt_ref, start_ref, bits_ref, acc_ref, sv_ref,
                 si_ref, *refs, n, block, words_per_step, stage, capacity,
                 fill_per_program, interpret, tile=None, b=None):
  """Pass 2. ``refs`` = (values, indices), or for the fused pass (old
  residual, values, indices, residual): ``acc_ref`` then holds acc, and the
  residual (the same buffer) gets 0 at every sent position; the block of
  the largest |acc| sends it alone if nothing else is sent (lone); a
  non-finite unit sends nothing and its block copies the old residual back.
  The fused pass stages no values (``sv_ref`` is unused): staged slots
  read theirs from acc. ``b``: the block (default the program id).
  """
  fused = len(refs) == 4
  old_ref, v_ref, i_ref, res_ref = refs if fused else (None, *refs, None)
  b = pl.program_id(0) if b is None else b
  offset = scal_ref[0]
  before = scal_ref[1]
  total = scal_ref[2]
  cnt = cnt_ref[b]
  start = start_ref[b]
  first_pos = b * block
  # Smallest slot of the block (0 if the block straddles offset).
  first = jnp.where(first_pos >= offset, start - before,
                    jnp.where(first_pos + block <= offset,
                              start + total - before, 0))
  need = (cnt > 0) & (first < capacity)
  lone = jnp.int32(0)
  if fused:
    finite = scal_ref[3] > 0
    need &= finite
    lone = scal_ref[5]
    size = res_ref.shape[0]

  def emit(rank, pos, valid, vals=None):
    """Write the candidates of global inclusive ranks ``rank`` at ``pos``."""
    slot = jnp.where(pos >= offset, rank - before, rank + total - before) - 1
    ok = valid & (slot < capacity)
    if vals is None:
      vals = plgpu.load(acc_ref.at[jnp.where(ok, pos, 0)], mask=ok)
    slot = masked_index(ok, slot, capacity, interpret)
    plgpu.store(v_ref.at[slot], vals, mask=ok)
    plgpu.store(i_ref.at[slot], pos, mask=ok)
    if fused:
      plgpu.store(res_ref.at[masked_index(ok, pos, size, interpret)],
                  jnp.zeros(pos.shape, res_ref.dtype), mask=ok)

  @pl.when(need & (cnt <= stage))
  def _staged():
    j = lax.broadcasted_iota(jnp.int32, (stage,), 0)
    valid = j < cnt
    # The fused pass stages positions only: its values are in acc_ref.
    emit(start + j + 1, plgpu.load(si_ref, mask=valid, other=0), valid,
         None if fused else plgpu.load(sv_ref, mask=valid))

  @pl.when(need & (cnt > stage))
  def _from_mask():
    lanes = lax.broadcasted_iota(jnp.int32, (words_per_step,), 0)

    def words_step(s, run):
      word0 = b * (block // WORD) + s * words_per_step
      w = bits_ref[pl.ds(word0, words_per_step)]
      counts = popcount(w)
      rank0 = start + run + jnp.cumsum(counts) - counts   # exclusive, global
      base = (word0 + lanes) * WORD

      def peel(j, w):
        emit(rank0 + j + 1, lowest_bit_position(base, w), w != 0)
        return w & (w - 1)

      lax.fori_loop(0, jnp.max(counts), peel, w)
      return run + jnp.sum(counts)

    steps = block // WORD // words_per_step
    if steps == 1:
      words_step(0, jnp.int32(0))
    else:
      lax.fori_loop(0, steps, words_step, jnp.int32(0))

  if fused:
    top = scal_ref[4]

    @pl.when((lone > 0) & (top // block == b))
    def _lone():
      v_ref[0] = acc_ref[top]
      i_ref[0] = top
      res_ref[top] = jnp.zeros((), res_ref.dtype)

    @pl.when(jnp.logical_not(finite))
    def _keep_old():
      lanes = lax.broadcasted_iota(jnp.int32, (tile,), 0)

      def copy(t, carry):
        pos = b * block + t * tile + lanes
        ok = pos < size
        at = lambda ref: ref.at[pl.ds(b * block + t * tile, tile)]
        plgpu.store(at(res_ref), plgpu.load(at(old_ref), mask=ok), mask=ok)
        return carry

      lax.fori_loop(0, block // tile, copy, 0)

  # Sentinels: program b fills its share of [min(total, capacity), capacity)
  # (from slot 1 if slot 0 went to a lone element).
  fill_tile = min(FILL_TILE, fill_per_program)
  fill_from = jnp.maximum(jnp.minimum(total, capacity),
                          lone) + b * fill_per_program
  lanes = lax.broadcasted_iota(jnp.int32, (fill_tile,), 0)

  def fill(k, carry):
    slot = fill_from + k * fill_tile + lanes
    ok = slot < capacity
    slot = masked_index(ok, slot, capacity, interpret)
    plgpu.store(v_ref.at[slot], jnp.zeros((fill_tile,), v_ref.dtype), mask=ok)
    plgpu.store(i_ref.at[slot], jnp.full((fill_tile,), n, jnp.int32), mask=ok)
    return carry

  if fill_per_program == fill_tile:
    fill(0, 0)
  else:
    lax.fori_loop(0, fill_per_program // fill_tile, fill, 0)


def _is_pow2(v: int) -> bool:
  return v >= 1 and (v & (v - 1)) == 0


def config(n, capacity, block, tile, stage):
  """Checked (block, tile, stage), the defaults filled in."""
  if capacity < 1:
    raise ValueError(f"capacity must be >= 1, got {capacity}")
  if block is None:
    block = min(DEFAULT_BLOCK, max(WORD, pl.next_power_of_2(n)))
  if not _is_pow2(block) or block < WORD:
    raise ValueError(f"block must be a power of two >= {WORD}, got {block}")
  if tile is None:
    tile = min(DEFAULT_TILE, block)
  if not _is_pow2(tile) or tile > block or tile < WORD:
    raise ValueError(
        f"tile must be a power of two in [{WORD}, block], got {tile}")
  if stage is None:
    stage = max(1, block // 16)
  if not _is_pow2(stage) or stage > block:
    raise ValueError(f"stage must be a power of two <= block, got {stage}")
  if pl.cdiv(n, block) * block + block >= 2**31 or capacity >= 2**30:
    raise ValueError(f"acc too large for int32 positions: n={n}")
  return block, tile, stage


def check_acc(acc):
  if acc.ndim != 1:
    raise ValueError(f"acc must be flat (1-D), got shape {acc.shape}")
  if acc.shape[0] < 1:
    raise ValueError("acc must not be empty")
  if not jnp.issubdtype(acc.dtype, jnp.floating) or acc.dtype.itemsize > 4:
    raise ValueError(f"acc must be float32/bfloat16/float16, got {acc.dtype}")


def _run(acc, taus, capacity, offset, *, band, block, tile, stage, num_warps,
         interpret):
  """The three kernels. ``taus`` = [τ] or, for the band, [τ, τ_hi] (float32
  comparison thresholds). Returns (values, indices, count, above or None)."""
  n = acc.shape[0]
  num_blocks = pl.cdiv(n, block)
  words_per_block = block // WORD
  words_per_step = min(words_per_block, MAX_WORDS_PER_STEP)
  scan_chunk = min(MAX_SCAN_CHUNK, pl.next_power_of_2(num_blocks))
  padded_blocks = pl.cdiv(num_blocks, scan_chunk) * scan_chunk
  # Sentinel slots per program: a power of two, so a multiple of the fill tile.
  fill_per_program = pl.next_power_of_2(pl.cdiv(capacity, num_blocks))
  params = _compat.triton_params("select_pallas",
                                 num_warps or DEFAULT_NUM_WARPS)

  offset = jnp.asarray(offset, jnp.int32)
  # The kernels read acc whole (tiles by pl.ds); a single short block is
  # padded (with zeros, which are never candidates) so no tile overhangs.
  acc_k = jnp.pad(acc, (0, block - n)) if n < block else acc
  whole = pl.BlockSpec()                   # the whole array in every program
  stage_spec = pl.BlockSpec((stage,), lambda b: (b,))
  grid = (num_blocks,)

  # Inside shard_map (check_vma): every kernel operand and output varies over
  # the union of the mesh axes that acc, tau and offset vary over.
  (acc_k, taus, offset), out = _compat.kernel_operands(
      acc_k, taus, offset, interpret=interpret, kernel="select_pallas",
      reference="jaxfuse.kernels.reference.select")

  counts_shape = out((padded_blocks,), jnp.int32)
  bits, counts, staged_v, staged_i, *above = pl.pallas_call(
      functools.partial(mask_kernel, n=n, block=block, tile=tile,
                        stage=stage, interpret=interpret),
      out_shape=(out((num_blocks * words_per_block,), jnp.int32),
                 counts_shape,
                 out((num_blocks * stage,), acc.dtype),
                 out((num_blocks * stage,), jnp.int32),
                 *[counts_shape] * band),
      grid=grid,
      in_specs=[whole, whole],
      out_specs=(whole, whole, stage_spec, stage_spec, *[whole] * band),
      compiler_params=params,
      interpret=interpret,
      name="jaxfuse_select_mask",
  )(taus, acc_k)

  start, scal = pl.pallas_call(
      functools.partial(scan_kernel, n=n, block=block,
                        num_blocks=num_blocks, chunk=scan_chunk),
      out_shape=(out((padded_blocks,), jnp.int32), out((3,), jnp.int32)),
      grid=(1,),
      in_specs=[whole] * 3,
      out_specs=(whole, whole),
      compiler_params=params,
      interpret=interpret,
      name="jaxfuse_select_scan",
  )(jnp.reshape(offset, (1,)), counts, bits)

  values, indices = pl.pallas_call(
      functools.partial(write_kernel, n=n, block=block,
                        words_per_step=words_per_step, stage=stage,
                        capacity=capacity,
                        fill_per_program=fill_per_program,
                        interpret=interpret),
      out_shape=(out((capacity,), acc.dtype), out((capacity,), jnp.int32)),
      grid=grid,
      in_specs=[whole] * 5 + [stage_spec] * 2,
      out_specs=(whole, whole),
      compiler_params=params,
      interpret=interpret,
      name="jaxfuse_select_write",
  )(scal, counts, start, bits, acc_k, staged_v, staged_i)
  return values, indices, scal[2], (jnp.sum(above[0][:num_blocks]) if band
                                    else None)


_STATIC = ("capacity", "block", "tile", "stage", "num_warps", "interpret")


@_compat.x32
@functools.partial(jax.jit, static_argnames=_STATIC)
def select_pallas(acc: jax.Array, tau, capacity: int, offset, *,
                  block: int | None = None, tile: int | None = None,
                  stage: int | None = None, num_warps: int | None = None,
                  interpret: bool = False
                  ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Drop-in for :func:`jaxfuse.kernels.reference.select` as three Pallas
  kernels.

  Args:
    acc: flat float array (float32, bfloat16 or float16) of n elements.
    tau: scalar threshold (any float; promoted with ``acc`` as the reference).
    capacity: number of output slots (static).
    offset: int scalar, where the rotated order starts (in [0, n); values
      outside behave as in the reference).
    block: elements per program, a power of two ≥ 32 (default 8192, or n
      rounded up to a power of two if smaller).
    tile: elements per pass-1 step inside a program, a power of two in
      [32, block] (default min(8192, block)).
    stage: candidates per block that pass 1 stages, a power of two ≤ block
      (default block/16); pass 2 peels a denser block's mask instead.
    num_warps: Triton warps per program (default 8).
    interpret: run the kernels in the Pallas interpreter (any backend).

  Returns:
    (values[capacity] in acc's dtype, indices[capacity] int32, count int32).
  """
  check_acc(acc)
  block, tile, stage = config(acc.shape[0], capacity, block, tile, stage)
  taus = jnp.reshape(comparison_threshold(acc.dtype, tau), (1,))
  values, indices, count, _ = _run(
      acc, taus, capacity, offset, band=False, block=block, tile=tile,
      stage=stage, num_warps=num_warps, interpret=interpret)
  return values, indices, count


@_compat.x32
@functools.partial(jax.jit, static_argnames=_STATIC)
def select_band_pallas(acc: jax.Array, lo, hi, capacity: int, *,
                       block: int | None = None, tile: int | None = None,
                       stage: int | None = None, num_warps: int | None = None,
                       interpret: bool = False
                       ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """The elements with lo ≤ |acc| < hi, acc ≠ 0, and how many are above.

  As :func:`select_pallas` with offset 0 and the band for the candidates
  (same comparison semantics for each bound), in the same one read of
  ``acc``; also returns ``above`` = |{i : |acc_i| ≥ hi, acc_i ≠ 0}|.

  Returns:
    (values[capacity], indices[capacity], count, above), counts int32.
  """
  check_acc(acc)
  block, tile, stage = config(acc.shape[0], capacity, block, tile, stage)
  taus = jnp.stack([comparison_threshold(acc.dtype, lo),
                    comparison_threshold(acc.dtype, hi)])
  return _run(acc, taus, capacity, 0, band=True, block=block, tile=tile,
              stage=stage, num_warps=num_warps, interpret=interpret)

