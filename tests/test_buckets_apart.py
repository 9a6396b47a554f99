"""Invariant 6, read from the compiled program: nothing a bucket's
collective waits for depends on another bucket's gradients.

The model is a sum of independent branches, one leaf each, so a bucket's
gradients depend on its own leaves only; any other leaf among the entry
parameters a collective depends on is a join the step added (a global
norm before the sync, collectives combined across buckets)."""

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

import jaxfuse
from jaxfuse.sync import hlo

from _harness import mesh_of

# Five sparse branches of different sizes and one small dense one.
SHAPES = {"a": (24, 40), "b": (24, 64), "c": (24, 16), "d": (24, 48),
          "e": (24, 32), "s": (6,)}


def loss_fn(params, x):
  """Each branch reads its own slice of the input: branches sharing an
  operand would let XLA merge their products (one dot for all), which
  joins them in the forward pass already, whatever the sync does."""
  total = 0.0
  for i, (name, w) in enumerate(sorted(params.items())):
    xi = x[:, 24 * i:24 * (i + 1)]
    if w.ndim == 2:
      total += jnp.mean(jnp.tanh(xi @ w) ** 2)
    else:
      total += jnp.mean((xi[:, :6] * w) ** 2)
  return total


def _problem(seed):
  """A 4-worker mesh, the branches' parameters (replicated) and a batch."""
  mesh = mesh_of(4)
  rng = np.random.default_rng(seed)
  params = jax.device_put(
      {n: jnp.asarray(0.3 * rng.normal(size=s), jnp.float32)
       for n, s in SHAPES.items()}, NamedSharding(mesh, P()))
  x = jax.device_put(
      jnp.asarray(rng.normal(size=(8, 24 * len(SHAPES))), jnp.float32),
      NamedSharding(mesh, P("data")))
  return mesh, params, x


def _recipe(name, plan):
  kw = dict(clip_norm=1.0)
  if name == "onebit_adamw":   # its sparse phase (the dense one psums)
    return jaxfuse.onebit_adamw(plan, 1e-3, **kw)
  return jaxfuse.RECIPES[name](plan, 1e-3, **kw)


def _compiled_step(mesh, plan, opt, params, x):
  state = jaxfuse.init_state(opt, params, mesh)
  specs = jaxfuse.state_specs(state)

  def local(params, state, x):
    # No loss out: XLA may compute it in one fusion with the gradients,
    # which joins every branch's gradient to the whole forward pass.
    grads = jax.grad(loss_fn)(jaxfuse.local_params(params), x)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  step = jax.jit(jax.shard_map(local, mesh=mesh,
                               in_specs=(P(), specs, P("data")),
                               out_specs=(P(), specs)),
                 keep_unused=True)
  return step.lower(params, state, x).compile().as_text()


# Entry parameter number -> leaf name: the model's parameters are the step's
# first arguments, and dicts flatten in sorted key order.
LEAF_OF = dict(enumerate(sorted(SHAPES)))


@pytest.mark.parametrize("recipe, finite", [
    *[(r, False) for r in sorted(jaxfuse.RECIPES)],
    ("onebit_adamw", True), ("sgd", True)])   # in jaxfuse.apply_if_finite
def test_each_collective_waits_for_its_own_leaves_only(recipe, finite):
  mesh, params, x = _problem(0)
  plan = jaxfuse.plan(params, density=0.1, strategy="layerwise",
                      settings=jaxfuse.Settings(min_sparse_size=64),
                      order=jaxfuse.planning.ordering.FromLoss(
                          loss_fn, (jnp.ones((2, 24 * len(SHAPES))),)))
  assert sum(b.collective == "allgather" for b in plan.buckets) == 5
  opt = _recipe(recipe, plan)
  if finite:   # its check of the synced update comes after every collective
    opt = jaxfuse.apply_if_finite(opt, 3)
  text = _compiled_step(mesh, plan, opt, params, x)
  bucket_of = {plan.leaves[j].path[2:-2]: b
               for b, bk in enumerate(plan.buckets) for j in bk.leaves}
  found = hlo.collective_inputs(text)
  gathers = [(i, deps) for i, deps in found if "all-gather" in i.opcode]
  assert len(gathers) == 5, [i.name for i, _ in found]
  seen = set()
  for inst, deps in found:
    leaves = {LEAF_OF[p] for p in deps if p in LEAF_OF}
    buckets = {bucket_of[n] for n in leaves}
    assert len(buckets) == 1, (
        f"{recipe}: {inst.name} ({inst.opcode}) waits for the leaves "
        f"{sorted(leaves)} of buckets {sorted(buckets)}")
    seen |= buckets
  assert seen == set(range(len(plan.buckets)))   # every bucket moved


def test_a_global_norm_before_the_sync_is_caught():
  """The check sees the join the global clip makes (the test can fail)."""
  mesh, params, x = _problem(1)
  plan = jaxfuse.plan(params, density=0.1, strategy="layerwise",
                      settings=jaxfuse.Settings(min_sparse_size=64))
  opt = optax.chain(jaxfuse.local_clip_by_global_norm(1.0),
                    jaxfuse.sgd(plan, 1e-3))
  text = _compiled_step(mesh, plan, opt, params, x)
  joined = [i for i, deps in hlo.collective_inputs(text)
            if "all-gather" in i.opcode and
            {LEAF_OF[p] for p in deps if p in LEAF_OF} == set(SHAPES)]
  assert len(joined) == 5


@pytest.mark.parametrize("recipe", ["sgd", "onebit_adamw"])
def test_delayed_collectives_wait_for_no_gradient_of_their_step(recipe):
  """Under ``jaxfuse.delayed`` the collectives move the previous step's
  gradients: no model parameter (hence no forward or backward of the step)
  is among what they wait for, so they can start at the top of the step."""
  mesh, params, x = _problem(2)
  plan = jaxfuse.plan(params, density=0.1, strategy="layerwise",
                      settings=jaxfuse.Settings(min_sparse_size=64))
  text = _compiled_step(mesh, plan, jaxfuse.delayed(_recipe(recipe, plan)),
                        params, x)
  found = hlo.collective_inputs(text)
  assert sum("all-gather" in i.opcode for i, _ in found) == 5
  for inst, deps in found:
    assert not {LEAF_OF[p] for p in deps if p in LEAF_OF}, inst.name
