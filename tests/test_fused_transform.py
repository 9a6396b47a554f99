"""``sparse_sync`` with the Pallas kernels equals it with the references.

The whole transform (fused sparsify pass, exact k-th, selection) on both
kernel backends, several steps, every output and state leaf compared bit
for bit, for the estimators' three kinds of τ (sampled, exact top-k, a
statistic of all of acc) and both sparsification strategies. On CPU the
kernels run in the Pallas interpreter (shard_map without vma checks: the
interpreter of JAX 0.10-0.12 fails on varying operands); with
``JAXFUSE_TEST_GPU=1`` on a GPU the compiled kernels run.
"""

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxfuse
from jaxfuse import bucket_pass
from jaxfuse import kernels

from _harness import list_plan, mesh_of, shard

ON_GPU = (os.environ.get("JAXFUSE_TEST_GPU") == "1"
          and jax.default_backend() == "gpu")
SHAPES = [(40, 50), (2000,), (40, 50), (300,)]
K = min(2, len(jax.devices()))   # one GPU: one worker


def _run(plan, backend, grads_per_step):
  mesh = mesh_of(K)
  tx = jaxfuse.sparse_sync(plan)
  state = jaxfuse.init_state(tx, [jnp.zeros(l.shape) for l in plan.leaves],
                             mesh)
  specs = jaxfuse.state_specs(state)
  kernels.set_backend(backend)
  try:
    step = jax.jit(jax.shard_map(
        lambda g, s: tx.update([x[0] for x in g], s), mesh=mesh,
        in_specs=(P("data"), specs), out_specs=(P(), specs),
        check_vma=ON_GPU))
    out = []
    for grads in grads_per_step:
      synced, state = step(shard(mesh, grads), state)
      out.append(jax.tree.map(np.asarray, (synced, state)))
  finally:
    kernels.set_backend("auto")
  return out


def _bits(tree):
  return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


# The estimators differ only in τ (XLA on both backends); gaussian and sidco
# run the same pass as dgc and redsync.
@pytest.mark.parametrize("estimator,strategy,shapes", [
    ("dgc", "layerwise", SHAPES),
    # A unit large enough for topk's sampled bracket (topk_bracket).
    ("topk", "layerwise", [(40, 50), (120_000,), (300,)]),
    ("redsync", "behind", SHAPES),
    # A state group of 6 rows: the pass reads chunks of 4 and 2.
    ("dgc", "single", [(40, 50)] * 6 + [(300,)])])
def test_pallas_equals_reference(estimator, strategy, shapes):
  plan = list_plan(shapes, density=0.05, estimator=estimator,
                   strategy=strategy, min_sparse_size=64)
  rng = np.random.default_rng(0)
  steps = [[rng.normal(size=(K,) + s).astype(np.float32) for s in shapes]
           for _ in range(3)]
  steps[1][1][0, 5] = np.nan      # a non-finite step on worker 0
  steps[2][0][K - 1] = 0          # a unit with nothing to send
  got = _run(plan, "pallas", steps)
  want = _run(plan, "reference", steps)
  for t, (g, w) in enumerate(zip(got, want)):
    assert _bits(g) == _bits(w), f"step {t}"
  assert any(np.isnan(x).any() for x in want[1][0])  # the NaN is visible


@pytest.mark.parametrize("estimator,momentum,per,want", [
    ("dgc", 0.0, 4, {"4", "2"}), ("dgc", 0.0, 1, set()),
    ("dgc", 0.0, 0, {"6"}), ("redsync", 0.0, 4, {"4", "2"}),
    ("dgc", 0.9, 4, {"6"})])
def test_the_pass_reads_a_groups_streams_in_chunks(estimator, momentum, per,
                                                   want, monkeypatch):
  """Without momentum the compiled step stacks a state group's 6 streams
  at most ``ROWS_PER_CHUNK`` rows at a time (4 and 2; none with 1): the
  fused pass, DGC's sample and an estimator that reads all of acc
  (redsync) read each chunk where it is. With DGC's momentum the stream
  is m·u + x over the stacked velocity, which is stacked state, so the
  whole stack of 6 stays."""
  monkeypatch.setattr(bucket_pass, "ROWS_PER_CHUNK", per)
  shapes = [(40, 50)] * 6 + [(300,)]
  plan = list_plan(shapes, density=0.05, estimator=estimator,
                   strategy="single", min_sparse_size=64)
  mesh = mesh_of(1)
  tx = jaxfuse.sparse_sync(plan, momentum=momentum)
  state = jaxfuse.init_state(tx, [jnp.zeros(l.shape) for l in plan.leaves],
                             mesh)
  specs = jaxfuse.state_specs(state)
  kernels.set_backend("pallas")
  try:
    step = jax.jit(jax.shard_map(
        lambda g, s: tx.update([x[0] for x in g], s), mesh=mesh,
        in_specs=(P("data"), specs), out_specs=(P(), specs),
        check_vma=ON_GPU))
    hlo = step.lower(shard(mesh, [np.ones((1,) + s, np.float32)
                                  for s in shapes]), state).compile().as_text()
  finally:
    kernels.set_backend("auto")
  stacks = {m.group(1) for m in re.finditer(
      r"= f32\[(\d+),2000\]\S* concatenate\(", hlo)}
  assert stacks == want, stacks
