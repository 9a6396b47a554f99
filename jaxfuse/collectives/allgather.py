"""``"allgather"``: every worker's packed slots to every worker (AGsparse).

One ``all_gather`` of the bucket's packed buffer (K, W)
(``fusion.pack_groups``: units of one shape side by side), then each unit
is decoded by adding the K workers' (value, index) slots into a dense
vector in rank order and dividing by K (a group's units in one vmap)::

  ĝ = (1/K) · Σ_k scatter(idx_k, v_k)

Lossless (kept = 0), bitwise identical on every worker (``base.decode``),
memory O(K·c + n) per unit. Traffic per worker grows as (K−1)·C.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax

from jaxfuse import _compat
from jaxfuse import fusion
from jaxfuse import plans
from jaxfuse.collectives import base


@dataclasses.dataclass(frozen=True)
class AllGather(base.AnyMesh):
  """``"allgather"`` and its configuration.

  packed_indices: send each index in b = ⌈log₂(n + 1)⌉ bits instead of 32
    (n: the unit's size, n itself the empty slot), c indices in ⌈c·b/32⌉
    words: lossless, 22 bits for a 768 × 3072 matrix.
  """
  packed_indices: bool = False
  name: ClassVar[str] = "allgather"
  sparse: ClassVar[bool] = True

  @property
  def packs_indices(self) -> bool:
    return bool(self.packed_indices)

  def sync(self, parts, units, axis_name, settings) -> base.Synced:
    del settings
    gathered = _compat.all_gather_invariant(
        fusion.pack_groups(parts, units), axis_name)
    out = [None] * len(units)
    # units of one shape travel and decode together: (K, G, c) slots
    for members, values, indices in fusion.unpack_groups(gathered, units):
      dense = jax.vmap(base.decode, in_axes=(1, 1, None))(
          values, indices, units[members[0]].size)
      for i, n in enumerate(members):
        out[n] = dense[i]
    return base.Synced(out, [None] * len(units))

  def steps(self, units, num_workers, settings):
    del num_workers, settings
    return (base.Step("allgather",
                      sum(plans.payload_bytes(u) for u in units)),)
