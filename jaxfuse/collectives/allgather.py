"""``"allgather"``: every worker's packed slots to every worker (AGsparse).

One ``all_gather`` of the bucket's packed buffer (K, W), then each unit is
decoded by adding the K workers' (value, index) slots into a dense vector in
rank order and dividing by K::

  ĝ = (1/K) · Σ_k scatter(idx_k, v_k)

Lossless (kept = 0), bitwise identical on every worker (``base.decode``),
memory O(K·c + n) per unit. Traffic per worker grows as (K−1)·C.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxfuse import _compat
from jaxfuse import fusion
from jaxfuse import plans as plan_lib
from jaxfuse.collectives import base


@dataclasses.dataclass(frozen=True)
class AllGather(base.AnyMesh):
  name: str = "allgather"
  sparse: bool = True

  def sync(self, parts, units, axis_name, settings) -> base.Synced:
    del settings
    gathered = _compat.all_gather_invariant(fusion.pack_sparse(parts),
                                            axis_name)
    slots = fusion.unpack_sparse(gathered, units)
    groups = {}  # units of one shape decode as one vmap
    for n, u in enumerate(units):
      groups.setdefault((u.size, u.capacity, u.dtype), []).append(n)
    out = [None] * len(units)
    for (size, _, _), members in groups.items():
      if len(members) == 1:
        out[members[0]] = base.decode(*slots[members[0]], size)
        continue
      dense = jax.vmap(base.decode, in_axes=(0, 0, None))(
          jnp.stack([slots[n][0] for n in members]),
          jnp.stack([slots[n][1] for n in members]), size)
      for i, n in enumerate(members):
        out[n] = dense[i]
    return base.Synced(out, [None] * len(units))

  def steps(self, units, num_workers, settings):
    del num_workers, settings
    return (base.Step("allgather",
                      sum(plan_lib.payload_bytes(u) for u in units)),)
