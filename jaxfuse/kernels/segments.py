"""Several kernels of (rows × blocks) grids as one Pallas call.

A segment s is a kernel over a grid of G_s rows × B_s blocks with its own
operands and outputs. ``segmented_call`` launches all of them as one
kernel over P = Σ_s G_s·B_s programs: program p belongs to the segment s
with P_s ≤ p < P_s + G_s·B_s (P_s = Σ_{t<s} G_t·B_t) and runs that
segment's kernel at row g = (p − P_s) div B_s and block b = (p − P_s) mod
B_s, on that segment's refs only. So a bucket's state groups, each with
its own length and kernel, take one launch instead of one each, and each
computes what it would alone.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
import numpy as np


class Segment(NamedTuple):
  """One kernel's part of a ``segmented_call``.

  kernel: called as ``kernel(*input_refs, *output_refs, ids=(g, b))``.
  inputs: its operands. in_specs / out_specs: per operand / output, None
    for the whole array in every program, or (block shape, index map of
    (g, b)) as for ``pl.BlockSpec``. outputs: ``jax.ShapeDtypeStruct``s.
  aliases: {input position: output position} within the segment.
  """
  kernel: Callable[..., None]
  inputs: Sequence[jax.Array]
  in_specs: Sequence[Any]
  outputs: Sequence[jax.ShapeDtypeStruct]
  out_specs: Sequence[Any]
  aliases: dict
  rows: int
  blocks: int


def _spec(spec, start: int, rows: int, blocks: int) -> pl.BlockSpec:
  """The segment's spec over the shared 1-d grid; programs of other
  segments see its row and block clamped in range (they never touch it)."""
  if spec is None:
    return pl.BlockSpec()
  shape, index_map = spec

  def shared(p):
    local = jnp.clip(p - start, 0, rows * blocks - 1)
    return index_map(local // blocks, local % blocks)

  return pl.BlockSpec(shape, shared)


def segmented_call(segments: Sequence[Segment], *, compiler_params,
                   interpret: bool, name: str) -> list[list[jax.Array]]:
  """Every segment's kernel in one ``pl.pallas_call`` (module docstring);
  returns each segment's outputs."""
  sizes = [s.rows * s.blocks for s in segments]
  starts = [int(v) for v in np.cumsum([0] + sizes)]
  in_specs, out_specs, inputs, outputs, aliases = [], [], [], [], {}
  bounds = []
  for seg, start in zip(segments, starts):
    if not len(seg.inputs) == len(seg.in_specs) or \
        not len(seg.outputs) == len(seg.out_specs):
      raise ValueError(f"{name}: a segment needs one spec per operand and "
                       f"output, got {len(seg.inputs)} operands, "
                       f"{len(seg.in_specs)} in_specs, {len(seg.outputs)} "
                       f"outputs and {len(seg.out_specs)} out_specs")
    for i, o in seg.aliases.items():
      aliases[len(inputs) + i] = len(outputs) + o
    bounds.append((len(inputs), len(inputs) + len(seg.inputs),
                   len(outputs), len(outputs) + len(seg.outputs)))
    inputs += list(seg.inputs)
    outputs += list(seg.outputs)
    in_specs += [_spec(x, start, seg.rows, seg.blocks) for x in seg.in_specs]
    out_specs += [_spec(x, start, seg.rows, seg.blocks)
                  for x in seg.out_specs]
  num_inputs = len(inputs)

  def kernel(*refs):
    p = pl.program_id(0)
    ins, outs = refs[:num_inputs], refs[num_inputs:]
    for seg, start, (i0, i1, o0, o1) in zip(segments, starts, bounds):
      def run(seg=seg, start=start, i0=i0, i1=i1, o0=o0, o1=o1):
        local = p - start
        seg.kernel(*ins[i0:i1], *outs[o0:o1],
                   ids=(local // seg.blocks, local % seg.blocks))
      if len(segments) == 1:
        run()
      else:
        pl.when((p >= start) & (p < start + seg.rows * seg.blocks))(run)

  out = pl.pallas_call(
      kernel, out_shape=tuple(outputs), grid=(starts[-1],),
      in_specs=in_specs, out_specs=tuple(out_specs),
      input_output_aliases=aliases, compiler_params=compiler_params,
      interpret=interpret, name=name)(*inputs)
  return [list(out[o0:o1]) for _, _, o0, o1 in bounds]
