"""``"zen"``: placeholder being implemented (see issue 11)."""

from __future__ import annotations

import dataclasses

from jaxfuse.collectives import base


@dataclasses.dataclass(frozen=True)
class Zen:
  name: str = "zen"
  sparse: bool = True

  def check(self, where: str, num_workers: int) -> None:
    raise base.SchemeError(f"{where}: collective 'zen' is not implemented yet.")

  def sync(self, parts, units, axis_name, settings) -> base.Synced:
    raise NotImplementedError

  def steps(self, units, num_workers, settings):
    raise NotImplementedError
