"""``"psum"``: dense leaves, one multi-operand all-reduce per bucket.

ĝ = (1/K)·Σ_k g_k via ``lax.pmean`` of the per-dtype concatenations
(``fusion.pack_dense``), equal to ``lax.pmean`` leaf by leaf. Also moves the
units of a density-1 phase (every element sent, residual zero).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
from jax import lax
import numpy as np

from jaxfuse import fusion
from jaxfuse.collectives import base


@dataclasses.dataclass(frozen=True)
class Psum(base.AnyMesh):
  """``"psum"``: dense buckets, one all-reduce (nothing to configure)."""
  name: ClassVar[str] = "psum"
  sparse: ClassVar[bool] = False
  packs_indices: ClassVar[bool] = False

  def sync(self, leaves, units, axis_name, settings) -> base.Synced:
    """``leaves``: dense arrays; returns their worker means (``units``
    unused: the arrays carry their shapes)."""
    del units, settings
    means = fusion.unpack_dense(
        lax.pmean(fusion.pack_dense(leaves), axis_name), leaves)
    return base.Synced(means, [None] * len(means))

  def steps(self, units, num_workers, settings):
    """``units``: (size, dtype) pairs of the leaves."""
    del num_workers, settings
    return (base.Step("allreduce", int(sum(
        n * np.dtype(d).itemsize for n, d in units))),)


def mean(leaves: list[jax.Array], axis_name: str) -> list[jax.Array]:
  """Worker mean of dense arrays, one all-reduce (``Psum().sync``)."""
  return Psum().sync(leaves, None, axis_name, None).means
