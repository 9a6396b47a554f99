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
from jaxfuse.sync import bucket_pass
from jaxfuse import kernels

from _harness import list_plan, mesh_of, pass1_segments, shard

ON_GPU = (os.environ.get("JAXFUSE_TEST_GPU") == "1"
          and jax.default_backend() == "gpu")
SHAPES = [(40, 50), (2000,), (40, 50), (300,)]
K = min(2, len(jax.devices()))   # one GPU: one worker


def _setup(plan, workers, dtype=jnp.float32, **sync_kw):
  """(mesh, sparse_sync, its state, the state's specs) for ``plan`` on
  ``workers`` devices."""
  mesh = mesh_of(workers)
  tx = jaxfuse.sparse_sync(plan, **sync_kw)
  state = jaxfuse.init_state(tx, [jnp.zeros(l.shape, dtype)
                                  for l in plan.leaves], mesh)
  return mesh, tx, state, jaxfuse.state_specs(state)


def _run(plan, backend, grads_per_step):
  mesh, tx, state, specs = _setup(plan, K)
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
@pytest.mark.parametrize("estimator,strategy,shapes,one_pass", [
    ("dgc", "layerwise", SHAPES, False),
    # A unit large enough for topk's sampled bracket (topk_bracket).
    ("topk", "layerwise", [(40, 50), (120_000,), (300,)], False),
    ("redsync", "behind", SHAPES, False),
    # A state group of 6 rows: the pass reads chunks of 4 and 2; and the
    # bucket's two groups as segments of one pass (ONE_PASS_PER_BUCKET).
    ("dgc", "single", [(40, 50)] * 6 + [(300,)], False),
    ("dgc", "single", [(40, 50)] * 6 + [(300,)], True)])
def test_pallas_equals_reference(estimator, strategy, shapes, one_pass,
                                 monkeypatch):
  monkeypatch.setattr(bucket_pass, "ONE_PASS_PER_BUCKET", one_pass)
  plan = list_plan(shapes, density=0.05, estimator=estimator,
                   strategy=strategy,
                   settings=jaxfuse.Settings(min_sparse_size=64))
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
                   strategy="single",
                   settings=jaxfuse.Settings(min_sparse_size=64))
  mesh, tx, state, specs = _setup(plan, 1, momentum=momentum)
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


def _run_blend(plan, backend, steps, beta, blend):
  """Each step syncs x = β·m + (1 − β)·g: given as ``blend=(m, β)`` or as
  the updates, formed by the step (the recipe's expression)."""
  mesh, tx, state, specs = _setup(plan, K)

  def body(m, g, s):
    m, g = [x[0] for x in m], [x[0] for x in g]
    if blend:
      return tx.update(g, s, blend=(m, beta))
    return tx.update([beta * a + (1 - beta) * b for a, b in zip(m, g)], s)

  kernels.set_backend(backend)
  try:
    step = jax.jit(jax.shard_map(
        body, mesh=mesh, in_specs=(P("data"), P("data"), specs),
        out_specs=(P(), specs), check_vma=ON_GPU))
    out = []
    for m, g in steps:
      synced, state = step(shard(mesh, m), shard(mesh, g), state)
      out.append(jax.tree.map(np.asarray, (synced, state)))
  finally:
    kernels.set_backend("auto")
  return out


@pytest.mark.parametrize("estimator,strategy,shapes", [
    ("dgc", "single", [(40, 50)] * 3 + [(300,), (30,), (6, 5, 20)]),
    ("topk", "layerwise", [(40, 50), (120_000,), (30,)]),
    ("redsync", "behind", SHAPES + [(30,)])])
def test_a_blend_syncs_what_its_formed_stream_syncs(estimator, strategy,
                                                     shapes):
  """``update(g, s, blend=(m, β))`` is ``update(β·m + (1 − β)·g, s)`` bit
  for bit, on the Pallas kernels (which form x as they read m and g) and
  on the references, with a dense (psum) leaf, several-leaf units, a
  non-finite step and a worker whose stream is all zero."""
  plan = list_plan(shapes, density=0.05, estimator=estimator,
                   strategy=strategy,
                   settings=jaxfuse.Settings(min_sparse_size=64))
  rng = np.random.default_rng(1)
  draw = lambda: [rng.normal(size=(K,) + s).astype(np.float32)
                  for s in shapes]
  steps = [(draw(), draw()) for _ in range(3)]
  steps[1][0][0][0, 3] = np.nan   # m non-finite on worker 0
  steps[2][0][0][K - 1] = 0       # worker K−1: m and g both zero there
  steps[2][1][0][K - 1] = 0
  want = _run_blend(plan, "reference", steps, 0.9, blend=False)
  for backend in ("pallas", "reference"):
    got = _run_blend(plan, backend, steps, 0.9, blend=True)
    for t, (g, w) in enumerate(zip(got, want)):
      assert _bits(g) == _bits(w), f"{backend}, step {t}"
  assert any(np.isnan(x).any() for x in want[1][0])


def _blend_update(dtype):
  """update(blend) on a two-leaf plan for ``dtype`` gradients (all ones),
  traced only (``jax.eval_shape``): the checks run when tracing."""
  plan = list_plan([(40, 50), (300,)], dtype=dtype, density=0.05,
                   settings=jaxfuse.Settings(min_sparse_size=64))
  mesh, tx, state, specs = _setup(plan, 1, dtype)
  g = shard(mesh, [np.ones((1,) + l.shape, dtype) for l in plan.leaves])
  return lambda blend: jax.eval_shape(jax.shard_map(
      lambda g_, s: tx.update([x[0] for x in g_], s, blend=blend),
      mesh=mesh, in_specs=(P("data"), specs), out_specs=(P(), specs),
      check_vma=False), g, state)


def test_bad_blends_name_the_fix():
  update = _blend_update(np.float32)
  m = [jnp.zeros((40, 50), jnp.float32), jnp.zeros((300,), jnp.float32)]
  with pytest.raises(jaxfuse.SyncError, match="pair"):
    update(m)
  with pytest.raises(jaxfuse.SyncError, match=r"beta=1\.0 must be in \[0, 1\)"):
    update((m, 1.0))
  with pytest.raises(jaxfuse.SyncError, match=r"tree like the updates; they "
                     r"differ at 1 leaves against 2"):
    update((m[:1], 0.9))
  with pytest.raises(jaxfuse.SyncError, match=r"m\[1\] is bfloat16\[300\]; "
                     r"it must be float32\[300\]"):
    update((m[:1] + [m[1].astype(jnp.bfloat16)], 0.9))
  with pytest.raises(jaxfuse.SyncError, match=r"m\[0\] is None\[\]"):
    update(([1.0, m[1]], 0.9))
  with pytest.raises(jaxfuse.SyncError, match="known when tracing"):
    jax.jit(lambda b: update((m, b)))(0.9)
  update((m, np.float32(0.9)))     # a NumPy number is a number
  with pytest.raises(jaxfuse.SyncError, match=r"gradient \[0\] is bfloat16"
                     r".*beta \* m \+ \(1 - beta\) \* updates"):
    _blend_update(jnp.bfloat16)((m, 0.9))


@pytest.mark.parametrize("one_pass", [False, True])
def test_the_pass_forms_a_blend_of_matrices_and_vectors(monkeypatch,
                                                        one_pass):
  """With ``blend=(m, β)`` the pass of a state group of matrices takes m's
  and g's rows (two operands a row: x is never written out); a group of
  3-d leaves takes x formed by XLA (one operand a row), which fuses the
  slice or layout change such a gradient often needs. The two groups'
  pass 1 is one kernel with ``ONE_PASS_PER_BUCKET``, else one each."""
  monkeypatch.setattr(bucket_pass, "ROWS_PER_CHUNK", 1)
  monkeypatch.setattr(bucket_pass, "ONE_PASS_PER_BUCKET", one_pass)
  shapes = [(40, 50)] * 3 + [(6, 5, 20)]
  plan = list_plan(shapes, density=0.05, estimator="dgc", strategy="single",
                   settings=jaxfuse.Settings(min_sparse_size=64))
  mesh, tx, state, specs = _setup(plan, 1)
  kernels.set_backend("pallas")
  try:
    step = jax.jit(jax.shard_map(
        lambda m, g, s: tx.update([x[0] for x in g], s,
                                  blend=([x[0] for x in m], 0.9)),
        mesh=mesh, in_specs=(P("data"), P("data"), specs),
        out_specs=(P(), specs), check_vma=False))
    args = shard(mesh, [np.ones((1,) + s, np.float32) for s in shapes])
    with pass1_segments() as calls:
      jax.make_jaxpr(step)(args, args, state)
  finally:
    kernels.set_backend("auto")
  assert len(calls) == (1 if one_pass else 2), calls
  streams = sorted(len(ops) - 2 for call in calls for ops in call)
  assert streams == [1, 6], streams   # τs and r besides the streams
