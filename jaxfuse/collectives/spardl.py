"""``"spardl"``: SparDL (Zhao et al.): Spar-Reduce-Scatter, global residual
collection, Spar-All-Gather, over one data axis of K workers.

Teams: T = ``SparDL.teams`` teams of G = K/T workers, team
t = ranks [tG, (t+1)G), position p = r mod G. The bucket's slots live in one
flat index space [0, N) (``base.to_bucket``; C = Σ c_u slots, sentinel N)
cut into G contiguous blocks [⌊bN/G⌋, ⌊(b+1)N/G⌋); every message carries
whole blocks of m slots (static shapes, sentinel for empty slots).

1. Spar-Reduce-Scatter (§III-B), in every team: p keeps per block its
   top-m own slots; then for s = 2^{l−1}, …, 2, 1 (l = ⌈log₂G⌉) it sends the
   blocks p+s … p+e−1 (mod G; e = blocks still held, G at first) to p+s and
   appends those of p−s to its blocks p … p+e−s−1 (``send_schedule``). A
   block is merged (equal indices summed in a fixed order) and cut to its
   top-m by |v| only when it is sent (the paper's "sparsify only the blocks
   sent next"), so p ends with block p reduced over its team, cut to m.
2. Spar-All-Gather (§III-D), same position p across the T teams.
   R-SAG (T = 2^j): j rounds of recursive doubling, merge, top-m.
   B-SAG (other T): top-h with h = m/T (Alg. 2's starting h; its adaptive h
   needs state across steps), Bruck all-gather of the T blocks, merge in team
   order: the union has ≤ T·h = m slots, so nothing is dropped after it.
3. All-gather: every team holds the same G blocks; worker (t, p) gives slots
   [t·m/T, (t+1)·m/T) of block p to one ``all_gather`` over the K workers,
   and ĝ = (1/K)·Σ_rows scatter(idx, v) (``base.decode``: blocks and chunks
   are disjoint, one writer per element, bitwise the same everywhere).

Global residual (§III-C), the invariant. Every merge splits its inputs
exactly, Σ inputs = sent + dropped, where "dropped" is what the top-m cut
plus the rounding of the sent sums to the wire dtype; the merging worker
adds it to its ``kept``. A merge that c workers compute identically (R-SAG
round j: c = 2^{j+1}; the B-SAG merge: c = T) is kept 1/c on each. So per
unit and step, up to the float rounding of the sums themselves::

  K·ĝ + Σ_k kept_k = Σ_k sent_k

Non-finite sums are sent first (NaN ranks above every |v|) and never kept.

Capacity rule: m = min(⌈N/G⌉, max(1, ⌊b·C/G⌋)), rounded up to a multiple of
T; b = ``SparDL.block`` = 2 by default (the bound below; a larger b
drops less in merges for b/2 times the bytes). With T = 1 a worker receives
(K−1)·m slots in the reduce-scatter and (K−1)·m in the all-gather: 2(K−1)·m ≤
4(K−1)/K·C pairs (Table I's 4(P−1)/P·k with k = C; holds whenever 2C ≥ K),
where ``"allgather"`` receives (K−1)·C. A block of ⌈N/G⌉ ≤ m elements never
drops anything. Teams add log₂T blocks (R-SAG) or (T−1)·m/T slots (B-SAG) and
gather m/T. ``choose`` picks T for K workers from the link's costs (§III-D).
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar, NamedTuple

from jax import lax
import jax.numpy as jnp
import numpy as np

from jaxfuse import _compat
from jaxfuse.plans import checks as plan_checks
from jaxfuse import plans
from jaxfuse.collectives import base

INDEX_BYTES = 4  # int32 indices
TIE = 1e-9       # ``choose``: relative time differences below are ties


def send_schedule(num_workers: int) -> list[list[tuple[int, tuple[int, ...]]]]:
  """Spar-Reduce-Scatter rounds for G = ``num_workers`` (any G ≥ 1):
  ``rounds[i][r] = (peer, blocks)``, rank r sends ``blocks`` to ``peer``.

  Round i = 1..l (l = ⌈log₂G⌉), s = 2^{l−i}: r sends the bag
  r+s … r+e−1 (mod G) to r+s, e = s of the round before (G at first), and
  keeps r … r+s−1; the last round leaves r with block r alone.
  """
  g = num_workers
  rounds, held = [], g
  for i in range(1, (g - 1).bit_length() + 1):
    s = 2 ** ((g - 1).bit_length() - i)
    rounds.append([((r + s) % g, tuple((r + j) % g for j in range(s, held)))
                   for r in range(g)])
    held = s
  return rounds


def bruck_counts(teams: int) -> list[int]:
  """Blocks sent in each round of a Bruck all-gather over ``teams``."""
  return [min(2 ** j, teams - 2 ** j)
          for j in range((teams - 1).bit_length())]


def block_capacity(size: int, slots: int, team_size: int, teams: int = 1,
                   share: float = 2.0) -> int:
  """m = min(⌈N/G⌉, max(1, ⌊b·C/G⌋)) rounded up to a multiple of T
  (b = ``SparDL.block``, 2 by default)."""
  m = min(-(-size // team_size), max(1, math.floor(
      plans.decimal_product(slots, share)) // team_size))
  return teams * -(-m // teams)


def legal_teams(num_workers: int) -> tuple[int, ...]:
  """The team counts T that K workers can form: 1, and every divisor of K
  that leaves teams of at least 2 workers (ascending).

  Args:
    num_workers: K, an int >= 1.

  Returns:
    The legal T, ascending, 1 first.

  Raises:
    Nothing: a K below 4 has only T = 1.
  """
  k = num_workers
  return (1,) + tuple(d for d in range(2, k // 2 + 1) if k % d == 0)


def check_teams(where: str, num_workers: int, teams: int) -> None:
  """Raise ``SchemeError`` if T teams cannot be formed from K workers."""
  k, t = num_workers, teams
  if t == 1:
    return
  ok = list(legal_teams(k))
  fix = (f"give SparDL(teams=...) one of {ok} (a divisor of {k} leaving teams "
         "of at least 2 workers; 1: no teams).")
  if not plan_checks.is_int(t) or t < 1:
    raise base.SchemeError(f"{where}: SparDL(teams={t!r}); {fix}")
  if k % t:
    raise base.SchemeError(f"{where}: SparDL(teams={t}) does not divide the "
                           f"{k} workers; {fix}")
  if k // t < 2:
    raise base.SchemeError(f"{where}: SparDL(teams={t}) leaves teams of "
                           f"{k // t} worker on {k} workers; {fix}")


class BlockLayout(NamedTuple):
  """A bucket's SparDL sizes: teams, team size, slots per block."""
  size: int      # N
  teams: int     # T
  team: int      # G = K/T
  cap: int       # m, slots per block
  dtype: np.dtype

  @property
  def pair_bytes(self) -> int:
    return self.dtype.itemsize + INDEX_BYTES


def layout(units, num_workers: int, settings, config: "SparDL | None" = None
           ) -> BlockLayout:
  """The static shapes of one bucket on K workers (checks the teams);
  ``config``: the scheme's (None: its defaults, ``SparDL()``)."""
  del settings
  if config is None:
    config = SparDL()
  teams = config.teams
  check_teams(f"spardl bucket of leaves {[j for u in units for j in u.leaves]}",
              num_workers, teams)
  size = sum(u.size for u in units)
  slots = sum(u.capacity for u in units)
  team = num_workers // teams
  return BlockLayout(size, teams, team,
                     block_capacity(size, slots, team, teams,
                                    config.block),
                     np.dtype(jnp.result_type(*[u.dtype for u in units])))


def _pack(v, i):
  """Values and int32 indices -> one flat uint8 buffer (bits kept)."""
  return jnp.concatenate([lax.bitcast_convert_type(v, jnp.uint8).reshape(-1),
                          lax.bitcast_convert_type(i, jnp.uint8).reshape(-1)])


def _unpack(buf, shape, dtype):
  """(..., bytes) from ``_pack`` -> values and indices of ``shape``."""
  lead, n, isz = buf.shape[:-1], math.prod(shape), dtype.itemsize
  v, i = buf[..., :n * isz], buf[..., n * isz:]
  v = lax.bitcast_convert_type(v.reshape(*lead, n, isz) if isz > 1 else v,
                               dtype)
  i = lax.bitcast_convert_type(i.reshape(*lead, n, INDEX_BYTES), jnp.int32)
  return v.reshape(*lead, *shape), i.reshape(*lead, *shape)


def _acc(dtype):
  return jnp.promote_types(dtype, jnp.float32)


def merge(v, i, size: int, dupes: int, cap: int, dtype):
  """Rows (R, W) of slots -> (R, cap) in ``dtype``, and what is dropped.

  Per row: stable sort by index, sum each run of equal indices left to right
  (a run has at most ``dupes`` + 1 members: one per merged source), keep the
  ``cap`` sums of largest |v| (NaN first). Dropped: [(values, indices)] in
  the accumulation dtype, the cut sums and the rounding of the kept ones to
  ``dtype``, so Σ inputs = kept + dropped up to the rounding of the sums.
  """
  acc = _acc(dtype)
  i, v = lax.sort((i, v.astype(acc)), dimension=1, num_keys=1, is_stable=True)
  rows, width = i.shape
  tot = v
  for d in range(1, min(dupes, width - 1) + 1):
    nxt = jnp.where(i[:, d:] == i[:, :-d], v[:, d:], 0)
    tot = tot + jnp.pad(nxt, ((0, 0), (0, d)))
  head = (i < size) & jnp.concatenate(
      [jnp.ones((rows, 1), bool), i[:, 1:] != i[:, :-1]], axis=1)
  tot, i = jnp.where(head, tot, 0), jnp.where(head, i, size)
  if width <= cap:
    out_v = jnp.pad(tot, ((0, 0), (0, cap - width)))
    out_i = jnp.pad(i, ((0, 0), (0, cap - width)), constant_values=size)
    dropped = []
  else:
    key = jnp.where(head, jnp.where(jnp.isnan(tot), jnp.inf, jnp.abs(tot)),
                    -1.0)
    _, pos = lax.top_k(key, cap)
    out_v = jnp.take_along_axis(tot, pos, axis=1)
    out_i = jnp.take_along_axis(i, pos, axis=1)
    chosen = jnp.zeros((rows, width), bool).at[
        jnp.arange(rows)[:, None], pos].set(True)
    dropped = [(jnp.where(chosen, 0, tot), i)]
  wire = out_v.astype(dtype)
  if jnp.dtype(dtype) != acc:
    dropped.append((out_v - wire.astype(acc), out_i))
  return wire, out_i, dropped


def _partition(v, i, lay: BlockLayout, pos):
  """Own slots -> rows (G, m): row j holds block (pos + j) mod G, its top-m
  slots by |v| (NaN first); the rest is dropped."""
  n, g, m = lay.size, lay.team, lay.cap
  lo = jnp.asarray([b * n // g for b in range(g)], jnp.int32)
  find = lambda a, x, side="left": jnp.searchsorted(a, x, side=side,
                                                   method="compare_all")
  rel = jnp.where(i < n, (find(lo, i, "right") - 1 - pos) % g,
                  g).astype(jnp.int32)
  key = jnp.where(jnp.isnan(v), -jnp.inf, -jnp.abs(v.astype(_acc(v.dtype))))
  rel, _, v, i = lax.sort((rel, key, v, i), num_keys=2)
  rank = jnp.arange(v.size) - find(rel, jnp.arange(g + 1))[rel]
  rows_v = jnp.zeros((g, m), v.dtype).at[rel, rank].set(v, mode="drop")
  rows_i = jnp.full((g, m), n, jnp.int32).at[rel, rank].set(i, mode="drop")
  return rows_v, rows_i, [(jnp.where((rel < g) & (rank >= m), v, 0), i)]


@dataclasses.dataclass(frozen=True)
class SparDL:
  """``"spardl"`` and its configuration.

  teams: Spar-All-Gather teams (1: plain SAG; T > 1: the K workers form T
    teams of K/T, R-SAG inside a team, then B-SAG).
  block: slots per block b·C/G (G workers in a team); 2 keeps Table I's
    4·C bound; more drops less in merges.
  """
  teams: int = 1
  block: float = 2.0
  name: ClassVar[str] = "spardl"
  sparse: ClassVar[bool] = True
  packs_indices: ClassVar[bool] = False   # int32 indices

  def check(self, where: str, num_workers: int, settings) -> None:
    """Runs on any K with T = 1; with teams (``teams``) T must divide K
    and leave teams of at least 2."""
    del settings
    check_teams(where, num_workers, self.teams)

  def check_axes(self, where: str, axis_name, settings) -> None:
    """The teams against the bound axis (``sparse_sync``, per bucket)."""
    del settings
    k = _compat.axis_size(axis_name)
    if k is not None:
      check_teams(where, k, self.teams)

  def sync(self, parts, units, axis_name, settings) -> base.Synced:
    k = int(lax.axis_size(axis_name))
    lay = layout(units, k, settings, self)
    n, g, nt, m, dtype = (lay.size, lay.team, lay.teams, lay.cap,
                          lay.dtype)
    rank = lax.axis_index(axis_name)
    team, pos = rank // g, rank % g
    ranks = lambda f: [(t * g + q, f(t, q)) for t in range(nt)
                       for q in range(g)]
    v, i = base.to_bucket(parts, units)
    rows_v, rows_i, dropped = _partition(v, i, lay, pos)

    # 1. Spar-Reduce-Scatter in every team (rows: block offsets from pos).
    schedule = send_schedule(g)
    for rnd, sends in enumerate(schedule):
      s, blocks = sends[0]  # rank 0's blocks are the offsets every rank sends
      assert blocks == tuple(range(s, rows_v.shape[0])), (s, blocks)
      out_v, out_i, drop = merge(rows_v[s:], rows_i[s:], n, rnd, m, dtype)
      dropped += drop
      got = lax.ppermute(_pack(out_v, out_i), axis_name,
                         ranks(lambda t, q, r=sends: t * g + r[q][0]))
      got_v, got_i = _unpack(got, out_v.shape, dtype)
      pad = ((0, s - len(blocks)), (0, 0))
      rows_v = jnp.concatenate([rows_v[:s], jnp.pad(got_v, pad)], axis=1)
      rows_i = jnp.concatenate(
          [rows_i[:s], jnp.pad(got_i, pad, constant_values=n)], axis=1)
    blk_v, blk_i, drop = merge(rows_v, rows_i, n, len(schedule), m, dtype)
    dropped += drop

    # 2. Spar-All-Gather across teams.
    if nt > 1 and nt & (nt - 1) == 0:  # R-SAG
      for j in range(nt.bit_length() - 1):
        got = lax.ppermute(_pack(blk_v, blk_i), axis_name,
                           ranks(lambda t, q, j=j: (t ^ 2 ** j) * g + q))
        got_v, got_i = _unpack(got, blk_v.shape, dtype)
        blk_v, blk_i, drop = merge(jnp.concatenate([blk_v, got_v], 1),
                                   jnp.concatenate([blk_i, got_i], 1),
                                   n, 1, m, dtype)
        dropped += [(x / 2 ** (j + 1), y) for x, y in drop]
    elif nt > 1:  # B-SAG
      held_v, held_i, drop = merge(blk_v, blk_i, n, 0, m // nt, dtype)
      dropped += drop
      for j, cnt in enumerate(bruck_counts(nt)):
        got = lax.ppermute(_pack(held_v[:cnt], held_i[:cnt]), axis_name,
                           ranks(lambda t, q, j=j: (t - 2 ** j) % nt * g + q))
        got_v, got_i = _unpack(got, (cnt, m // nt), dtype)
        held_v = jnp.concatenate([held_v, got_v])
        held_i = jnp.concatenate([held_i, got_i])
      order = (jnp.arange(nt) - team) % nt  # team order, the same everywhere
      blk_v, blk_i, drop = merge(held_v[order].reshape(1, m),
                                 held_i[order].reshape(1, m), n, nt - 1, m,
                                 dtype)
      dropped += [(x / nt, y) for x, y in drop]

    # 3. All-gather: (t, p) gives chunk t of block p.
    c = m // nt
    chunk = lambda x: lax.dynamic_slice_in_dim(x[0], team * c, c)
    got = _compat.all_gather_invariant(_pack(chunk(blk_v), chunk(blk_i)),
                                       axis_name)
    means = base.from_bucket(base.decode(*_unpack(got, (c,), dtype), n),
                             units, _acc(dtype))
    vals = jnp.concatenate([x.reshape(-1) for x, _ in dropped])
    idx = jnp.concatenate([y.reshape(-1) for _, y in dropped])
    kept = jnp.zeros((n,), _acc(dtype)).at[idx].add(vals, mode="drop")
    kept = jnp.where(jnp.isfinite(kept), kept, 0)
    return base.Synced(means, base.from_bucket(kept, units, _acc(dtype)))

  def steps(self, units, num_workers, settings):
    """What ``sync`` hands each primitive: per SRS round its bag of m-slot
    blocks, per SAG round one block (R-SAG) or h-slot blocks (B-SAG), then
    the m/T-slot chunk of the all-gather; slots of dtype bytes + 4."""
    lay = layout(units, num_workers, settings, self)
    b, nt, m = lay.pair_bytes, lay.teams, lay.cap
    out = [base.Step("ppermute", len(blocks) * m * b)
           for blocks in (rnd[0][1] for rnd in send_schedule(lay.team))]
    if nt > 1 and nt & (nt - 1) == 0:
      out += [base.Step("ppermute", m * b)] * (nt.bit_length() - 1)
    elif nt > 1:
      out += [base.Step("ppermute", cnt * (m // nt) * b)
              for cnt in bruck_counts(nt)]
    out.append(base.Step("allgather", m // nt * b))
    return tuple(out)


def choose(num_workers: int, units, costs, config: SparDL | None = None
           ) -> SparDL:
  """SparDL's team count for a bucket on K workers, from the link's costs.

  The paper (§III-D, "The selection of the optimal d") takes the d with
  the least time, running one epoch for each legal d; here the time is
  the α-β model of what ``sync`` sends (``SparDL.steps``, priced by
  ``costs.primitive_time(p, x, K)``: Eq. 5-10 for this implementation's
  messages). With s bytes a slot, m_T the block of T teams
  (``block_capacity``, ≈ b·C·T/K), G = K/T, |B_i| the blocks of SRS round
  i (``send_schedule``), a ppermute line α_p + β_p·x and the all_gather's
  per-message a + b·x::

    t(T) = Σ_i (α_p + β_p·|B_i|·m_T·s)           Spar-Reduce-Scatter
         + SAG(T)                                 T > 1
         + (K−1)·(a + b·(m_T/T)·s)                all_gather over K

  SAG(T) = log₂T·(α_p + β_p·m_T·s) for R-SAG (T a power of 2, Eq. 5) and
  Σ_j (α_p + β_p·min(2^j, T − 2^j)·h·s) for B-SAG (Eq. 8), with h = m_T/T:
  Alg. 2's starting h (k/P in the paper's units), the least time of its
  range [k/P, dk/P]; the paper moves h from there by the union sizes it
  counts at run time, which static shapes cannot carry. T* = argmin_T t(T)
  over ``legal_teams(K)``, the fewest teams on a tie (within a relative
  ``TIE``, the float rounding of the sums: more teams drop more in merges;
  T = K, one local top-h, is not legal).

  The paper's teams save latency in its last step, a Bruck all-gather
  inside each team (2⌈log₂(P/d)⌉ + ⌈log₂d⌉ rounds, Eq. 7). Here the last
  step is one all_gather over all K (a result typed identical on every
  worker needs one), so m_T/T ≥ m_1 and the SRS and SAG carry at least
  (K−1)·m_1 slots in at least ⌈log₂K⌉ rounds: T = 1 is always among the
  least, and T* = 1 unless the steps change.

  Args:
    num_workers: K.
    units: the bucket's units as they travel (``plans.wire_unit``): their
      sizes, capacities and dtypes.
    costs: a ``jaxfuse.planning.costs.Costs`` (its collective lines).
    config: the SparDL whose ``block`` is kept (default ``SparDL()``).

  Returns:
    ``SparDL(teams=T*, block=config.block)``.

  Raises:
    SchemeError: ``num_workers`` is not an int >= 1, or ``units`` is
      empty (naming the fix).
  """
  config = SparDL() if config is None else config
  k = num_workers
  if not plan_checks.is_int(k) or k < 1:
    raise base.SchemeError(f"spardl.choose: num_workers={k!r}; give the "
                           "workers K as an int >= 1.")
  if not units:
    raise base.SchemeError("spardl.choose: a bucket without units; give the "
                           "bucket's plans.Unit list.")
  settings = plans.Settings()
  best = None
  for teams in legal_teams(int(k)):
    scheme = dataclasses.replace(config, teams=teams)
    t = costs.steps_time(scheme.steps(units, int(k), settings), int(k))
    if best is None or t < best[0] * (1 - TIE):
      best = (t, scheme)
  return best[1]
