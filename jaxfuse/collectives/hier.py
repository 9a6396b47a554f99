"""``"hier"``: hosts × local devices (ZEN §4: dense within, sparse across).

The workers form an H × L grid, mesh axes ``(host, local)`` (K = H·L; make
the mesh with ``jaxfuse.make_mesh(local=L)`` and use ``sparse_sync(plan,
axis_name=("host", "local"))``). Per bucket (N elements over its units' flat
index space, S = ⌈N/L⌉, C = Σ_u c_u slots per worker), worker (h, l):

  1. x_hl = scatter(its slots)                      dense (N,), padded to L·S
  2. y_hl = Σ_l' x_hl'[l·S:(l+1)·S]                 ``psum_scatter`` over local
  3. sent_hl = the c_s = min(S, C) largest |y_hl|    ``lax.top_k``; non-finite
     entries first, so a NaN step stays visible; in the bucket's dtype
  4. ḡ_l = (1/K)·Σ_h sent_hl                         the inner sparse scheme
     over the host axis (``Hier.inner``; "allgather": all_gather of
     the slots, ``base.decode`` in host order)
  5. ĝ = ḡ_0 ‖ … ‖ ḡ_{L−1}, cut to N, per unit       ``all_gather`` over local

c_s = min(S, C): the host's L workers sent L·C slots spread over L shards,
C per shard on average, so a shard keeps as many slots as one worker sent
for the whole bucket; it is lossless unless the host's nonzeros pile up in
one shard (or S ≤ C: then every entry goes). The host-axis traffic per
worker is (H−1)·C slots, against (K−1)·C for a flat ``"allgather"``.

Conservation: what a shard does not send stays with the worker that holds
it, kept_hl = y_hl − sent_hl (zero where y is non-finite), placed at its
shard in the bucket and split per unit, so (exact arithmetic)::

  K·ĝ + Σ_hl kept_hl = Σ_h Σ_l (y_hl) = Σ_k sent_k    (sent_k: the slots)

(plus the inner scheme's own kept, added to the shard's). The kept entries
came from the host's other workers too: they are owed, and this worker's
residual sends them later.

Replicas: every worker of local rank l decodes the same gathered rows with
the same program, and step 5 only copies, so ĝ is bitwise the same on all K
workers. Against a flat scheme only the summation order differs (within a
host first): bitwise equal for integer-valued gradients, else within
rounding (|Δ| ≤ ~K·ε·Σ_k |sent_k| per element).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from jax import lax
import jax.numpy as jnp
import numpy as np

from jaxfuse import _compat
from jaxfuse import fusion
from jaxfuse import plans
from jaxfuse.collectives import allgather
from jaxfuse.collectives import base
from jaxfuse.collectives import spardl
from jaxfuse.collectives import zen

USAGE = ("make the mesh with jaxfuse.make_mesh(local=L) (axes ('host', "
         "'local')) and use sparse_sync(plan, axis_name=('host', 'local')), "
         "or plan this bucket with another collective")


@dataclasses.dataclass(frozen=True)
class Hier:
  """Dense reduce-scatter/all-gather over ``local``, sparse over ``host``.

  ``axis_name`` must be the pair ``(host, local)``; ``check_axes`` (called
  by ``sparse_sync`` per bucket) and ``sync`` raise ``SchemeError``
  otherwise.

  inner: the sparse scheme over the slow (host) axis: an
    ``AllGather`` (its ``packed_indices`` packs the host rows' indices),
    ``Zen`` or ``SparDL`` with its own configuration, or one of their names
    ``"allgather"``, ``"zen"``, ``"spardl"`` for its defaults.
  """
  inner: allgather.AllGather | zen.Zen | spardl.SparDL = (
      allgather.AllGather())
  name: ClassVar[str] = "hier"
  sparse: ClassVar[bool] = True

  def __post_init__(self):
    if isinstance(self.inner, str):
      if self.inner not in INNER:
        raise plans.PlanError(
            f"Hier(inner={self.inner!r}): the host-axis scheme must be one "
            f"of {tuple(INNER)}, or such a scheme's object.")
      object.__setattr__(self, "inner", INNER[self.inner])
    elif self.inner.name not in INNER:
      raise plans.PlanError(
          f"Hier(inner={self.inner!r}): the host-axis scheme must be one "
          f"of {tuple(INNER)}, or such a scheme's object.")

  @property
  def packs_indices(self) -> bool:
    return self.inner.packs_indices

  def check(self, where: str, num_workers: int, settings) -> None:
    del where, num_workers, settings  # any K = H·L; the axes: check_axes

  def check_axes(self, where: str, axis_name, settings) -> None:
    """Raise ``SchemeError`` unless ``axis_name`` is a bound (host, local)
    pair and ``inner`` runs on the host axis."""
    host, _ = _axes(where, axis_name)
    _inner(where, self.inner, host, _compat.axis_size(host))

  def sync(self, parts, units, axis_name, settings) -> base.Synced:
    where = ("the 'hier' bucket of leaves "
             f"{[j for u in units for j in u.leaves]}")
    host, local = _axes(where, axis_name)
    hosts, size = lax.axis_size(host), lax.axis_size(local)
    inner = _inner(where, self.inner, host, hosts)  # checked on H hosts
    n, s, cs, dtype = _layout(units, size)
    acc = jnp.promote_types(dtype, jnp.float32)

    vals, idx = base.to_bucket(parts, units)                        # 1
    dense = jnp.zeros((n,), acc).at[idx].add(vals.astype(acc), mode="drop")
    dense = jnp.pad(dense, (0, s * size - n))
    shard = lax.psum_scatter(dense, local, scatter_dimension=0,     # 2
                             tiled=True)
    if cs == s:                                                     # 3
      pick = jnp.arange(s, dtype=jnp.int32)
    else:
      key = jnp.where(jnp.isfinite(shard), jnp.abs(shard), jnp.inf)
      pick = lax.top_k(key, cs)[1].astype(jnp.int32)
    sent = shard[pick].astype(dtype)
    pick = jnp.where(sent != 0, pick, s)  # zeros: empty slots
    unit = _shard_unit(s, cs, dtype, settings, inner)
    if inner.name == "allgather":                                   # 4
      # Built in rather than inner.sync: one division by K = H·L, the
      # rounding of a flat "allgather".
      rows = _compat.all_gather_invariant(
          fusion.pack_groups([(sent, pick)], [unit]), host)
      ((_, rv, ri),) = fusion.unpack_groups(rows, [unit])   # (H, 1, c)
      mean, back = base.decode(rv[:, 0], ri[:, 0], s, hosts * size), None
    else:
      out = inner.sync([(sent, pick)], [unit], host, settings)
      mean = out.means[0].astype(acc) / size
      back = out.kept[0]
    wire = mean.astype(dtype)
    full = _compat.all_gather_invariant(wire, local).reshape(-1)[:n]  # 5
    means = base.from_bucket(full, units)

    if cs == s and acc == dtype and back is None:  # all sent, exactly
      return base.Synced(means, [None] * len(units))
    kept = shard.at[pick].add(-sent.astype(acc), mode="drop")
    if back is not None:
      kept = kept + back.astype(acc)
    if acc != dtype:
      # The mean's rounding to the wire, K·(ĝ − wire(ĝ)) for this shard,
      # kept once: by host 0's worker, of the H that hold the same shard.
      kept = kept + jnp.where(lax.axis_index(host) == 0,
                              hosts * size * (mean - wire.astype(acc)), 0)
    kept = jnp.where(jnp.isfinite(kept), kept, 0)
    kept = lax.dynamic_update_slice(jnp.zeros((s * size,), acc), kept,
                                    (lax.axis_index(local) * s,))
    return base.Synced(means, base.from_bucket(kept[:n], units, acc))

  def steps(self, units, num_workers, settings):
    """The host-axis primitives, ``num_workers`` read as H (hosts).

    Convention: K alone does not give H and L, and the cost lines model the
    slow network, so these are the steps across hosts only, for c_s = C
    slots (the shard size S = ⌈N/L⌉ is not known here; exact when C ≤ S).
    The fast local axis: ``local_steps``; both on a known mesh:
    ``mesh_wire``.
    """
    n, _, cs, dtype = _layout(units, 1)
    return _host_steps(_shard_unit(n, cs, dtype, settings, self.inner),
                       num_workers, settings, self.inner)

  def local_steps(self, units, local: int) -> tuple[base.Step, ...]:
    """The dense local-axis traffic: the reduce-scatter (in ≥ float32) and
    all-gather (in the bucket's dtype) of L·S elements are the two halves
    of a ring all-reduce, charged as one of their mean size."""
    _, s, _, dtype = _layout(units, local)
    a = np.dtype(jnp.promote_types(dtype, jnp.float32)).itemsize
    return (base.Step("allreduce", s * local * (a + np.dtype(dtype).itemsize)
                      // 2),)


def mesh_wire(units, hosts: int, local: int, settings,
              scheme: Hier | None = None) -> base.Wire:
  """Bytes one worker sends and receives per step for a ``"hier"`` bucket
  (``scheme``, default ``Hier()``) on an H × L mesh: its host-axis steps
  on H plus its local steps on L."""
  scheme = Hier() if scheme is None else scheme
  _, s, cs, dtype = _layout(units, local)
  unit = _shard_unit(s, cs, dtype, settings, scheme.inner)
  parts = (base.wire(_host_steps(unit, hosts, settings, scheme.inner),
                     hosts),
           base.wire(scheme.local_steps(units, local), local))
  return base.Wire(sum(p.sent for p in parts), sum(p.received for p in parts))


def _axes(where, axis_name) -> tuple[str, str]:
  if not (isinstance(axis_name, tuple) and len(axis_name) == 2 and
          all(isinstance(a, str) for a in axis_name)):
    raise base.SchemeError(
        f"{where}: collective 'hier' runs over two mesh axes (hosts, devices "
        f"per host), got axis_name={axis_name!r}; {USAGE}.")
  return axis_name


def _inner(where, scheme, host, hosts):
  """``scheme`` (``Hier.inner``), checked on the H hosts: raises
  ``SchemeError`` if it cannot run there."""
  scheme.check(f"{where} (Hier(inner={scheme.name!r}) over the {hosts} "
               f"hosts of axis {host!r})", hosts, None)
  return scheme


def _layout(units, local: int):
  """(N, S = ⌈N/L⌉, c_s = min(S, C), the bucket's dtype)."""
  n = sum(u.size for u in units)
  s = -(-n // local)
  dtype = jnp.result_type(*[u.dtype for u in units])
  return n, s, min(s, sum(u.capacity for u in units)), dtype


def _shard_unit(s, cs, dtype, settings=None, inner=None) -> plans.Unit:
  """A shard as a selection unit, what the host-axis scheme ``inner``
  moves (its values on ``settings``' sparse wire, its indices packed
  where ``inner`` packs them)."""
  unit = plans.Unit((), s, cs, cs / s, "topk", str(jnp.dtype(dtype)))
  if settings is None:
    return unit
  return plans.wire_unit(unit, settings, inner)


def _host_steps(unit, hosts, settings, inner):
  inner.check(f"Hier(inner={inner.name!r})", hosts, settings)
  return inner.steps([unit], hosts, settings)


# The sparse schemes that run over the host axis (``Hier.inner``, by name
# with their defaults; "allgather"'s sync is built into ``Hier.sync``, its
# steps and check are its own).
INNER = {"allgather": allgather.AllGather(), "zen": zen.Zen(),
         "spardl": spardl.SparDL()}
