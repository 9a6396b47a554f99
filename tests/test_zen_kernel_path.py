"""ZEN's hierarchical hash (Alg. 1) runs in the Pallas kernel along the
whole path of a training step when ``jaxfuse.kernels.backend()`` is
"pallas": inside ``shard_map`` over devices and under
``jaxfuse.simulated_mesh`` (a named vmap over the workers), where the one
``pallas_call`` is batched over the worker axis (a grid dimension of K),
not looped. No trace of the jnp reference (``_reference_jit``, whose
claims are a ``scatter-min``) remains in the step.

On CPU the kernel runs in the Pallas interpreter (``shard_map`` without vma
checks: the interpreter of JAX 0.10-0.12 fails on varying operands); the
jaxpr is what a GPU compiles, with ``interpret`` off.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxfuse
from jaxfuse import kernels
from jaxfuse import plans as plan_lib
from jaxfuse.collectives import zen as zen_lib
from jaxfuse.kernels import hash_partition as hp
from jaxfuse.sync import bucket_steps

from _harness import list_plan, mesh_of, shard

K = 4
SHAPES = [(24, 20), (300,)]          # ZEN buckets
KERNEL = "zen_hierarchical_hash"     # the pallas_call's name


def _plan():
  plan = list_plan(SHAPES, density=0.05, estimator="topk", collective="zen",
                   settings=jaxfuse.Settings(min_sparse_size=64))
  assert [b.collective for b in plan.buckets] == ["zen"] * len(plan.buckets)
  return plan


def _buckets():
  return len(_plan().buckets)


def _grads(seed=0):
  rng = np.random.default_rng(seed)
  return [rng.normal(size=(K,) + s).astype(np.float32) for s in SHAPES]


def _eqns(jaxpr):
  """Every equation, nested jaxprs included (not a pallas_call's body),
  with how many loops (while, scan) enclose it."""
  def walk(jx, loops):
    for e in jx.eqns:
      yield e, loops
      if e.primitive.name == "pallas_call":
        continue
      inner = loops + (e.primitive.name in ("while", "scan"))
      for v in e.params.values():
        for x in (v if isinstance(v, (list, tuple)) else [v]):
          sub = getattr(x, "jaxpr", x)
          if hasattr(sub, "eqns"):
            yield from walk(sub, inner)
  return list(walk(jaxpr.jaxpr, 0))


def _hash_calls(jaxpr):
  return [(e, loops) for e, loops in _eqns(jaxpr)
          if e.primitive.name == "pallas_call" and e.params["name"] == KERNEL]


def _no_reference(jaxpr):
  names = [e.primitive.name for e, _ in _eqns(jaxpr)]
  pjits = [e.params.get("name") for e, _ in _eqns(jaxpr)
           if e.primitive.name in ("pjit", "jit")]
  assert "_reference_jit" not in pjits and "hash_partition" not in pjits
  assert "scatter-min" not in names and "scatter_min" not in names


def _zen_step(backend, simulated=False):
  """(the jaxpr of one ZEN sync of K workers, on K devices or simulated on
  one device, the step's outputs)."""
  plan = _plan()
  mesh = jaxfuse.simulated_mesh(K) if simulated else mesh_of(K)
  tx = jaxfuse.sparse_sync(plan)
  state = jaxfuse.init_state(tx, [jnp.zeros(s, jnp.float32) for s in SHAPES],
                             mesh)
  specs = jaxfuse.state_specs(state)
  if simulated:   # a worker's rows keep their leading axis of 1
    step = jaxfuse.vmap_workers(lambda g, s: tx.update(g, s), mesh,
                                (P("data"), specs), (P(), specs))
    grads = [g.reshape((K * s[0],) + s[1:]) for g, s in zip(_grads(), SHAPES)]
  else:
    step = jax.shard_map(
        lambda g, s: tx.update([x[0] for x in g], s), mesh=mesh,
        in_specs=(P("data"), specs), out_specs=(P(), specs),
        check_vma=False)
    grads = shard(mesh, _grads())
  kernels.set_backend(backend)
  try:
    step = jax.jit(step)
    jaxpr = jax.make_jaxpr(step)(grads, state)
    out = jax.tree.map(np.asarray, step(grads, state))
  finally:
    kernels.set_backend("auto")
  return jaxpr, out


def test_the_device_step_hashes_in_the_kernel_and_equals_the_reference():
  jaxpr, out = _zen_step("pallas")
  calls = _hash_calls(jaxpr)
  assert len(calls) == _buckets() and all(l == 0 for _, l in calls), calls
  _no_reference(jaxpr)
  ref_jaxpr, ref = _zen_step("reference")
  assert not _hash_calls(ref_jaxpr)           # the probe can tell them apart
  assert any(e.params.get("name") == "_reference_jit"
             for e, _ in _eqns(ref_jaxpr) if e.primitive.name in ("pjit", "jit"))
  # The rows are the same sets either way, so the sync is bitwise the same.
  for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
    assert a.tobytes() == b.tobytes()


def test_simulated_workers_batch_the_kernel_over_the_worker_axis():
  jaxpr, out = _zen_step("pallas", simulated=True)
  calls = _hash_calls(jaxpr)
  assert len(calls) == _buckets(), calls               # one per bucket
  for eqn, loops in calls:
    assert loops == 0                                 # no loop over workers
    assert eqn.params["grid_mapping"].grid[0] == K    # batched: a grid row
  _no_reference(jaxpr)                                # per worker
  _, ref = _zen_step("reference", simulated=True)
  for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
    assert a.tobytes() == b.tobytes()


def test_the_buckets_traced_pull_through_the_hash_bitmap():
  """The traces above cover Alg. 2's pull (bitmap encode and decode)."""
  plan = _plan()
  sched = bucket_steps.compile_plan(plan)
  for step in sched.buckets:
    units = [plan_lib.wire_unit(u, plan.settings, "zen")
             for u in sched.bucket_units(step)]
    assert zen_lib.layout(units, K, plan.settings).bitmap


@pytest.mark.parametrize("backend,want", [("pallas", 1), ("reference", 0),
                                          ("auto", 0)])   # auto: CPU here
def test_auto_follows_the_kernel_backend(backend, want):
  kernels.set_backend(backend)
  try:
    jaxpr = jax.make_jaxpr(lambda i: hp.hash_partition(
        i, 4, 50, r1=8, r2=2))(jnp.arange(0, 40, 3, dtype=jnp.int32))
  finally:
    kernels.set_backend("auto")
  assert len(_hash_calls(jaxpr)) == want
