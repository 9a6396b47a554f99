"""docs/choosing.md's gradient accumulation, run as written: M micro-batches
inside the step give one large batch's step, with the sync's collectives
issued once per step, not once per micro-batch."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.extend import core as jex
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxfuse
from jaxfuse.optim import overlap

from _harness import NUM_WORKERS, all_eqns, doc_snippet, mesh_of, mlp_loss

K = NUM_WORKERS


def _step(local, mesh, specs):
  return jax.jit(jax.shard_map(local, mesh=mesh,
                               in_specs=(P(), specs, P("data")),
                               out_specs=(P(), specs, P())))


def test_micro_batches_inside_the_step_are_one_large_batch():
  mesh = mesh_of(K)
  rng = np.random.default_rng(0)
  params = {"w1": rng.normal(size=(32, 64)).astype(np.float32) / 6,
            "w2": rng.normal(size=(64, 8)).astype(np.float32) / 8}
  batch = (rng.normal(size=(16 * K, 32)).astype(np.float32),
           rng.normal(size=(16 * K, 8)).astype(np.float32))
  params = jax.device_put(params, NamedSharding(mesh, P()))
  batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
  plan = jaxfuse.plan(params, density=0.05,
                      settings=jaxfuse.Settings(min_sparse_size=64))
  # the dense phase: exact Adam on the mean gradient, so the two steps
  # agree to rounding whatever the selection would have done
  opt = jaxfuse.onebit_adamw(jaxfuse.with_density(plan, 1.0), 1e-2)
  state = jaxfuse.init_state(opt, params, mesh)
  specs = jaxfuse.state_specs(state)

  user = dict(jax=jax, jnp=jnp, optax=optax, jaxfuse=jaxfuse,
              loss_fn=mlp_loss, opt=opt)
  snippet = doc_snippet("docs/choosing.md", "## Gradient accumulation")
  exec(snippet, user)  # pylint: disable=exec-used
  assert user["M"] > 1

  def large(params, opt_state, batch):    # the Quickstart's step
    loss, grads = jax.value_and_grad(mlp_loss)(jaxfuse.local_params(params),
                                               batch)
    updates, opt_state = opt.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state,
            jax.lax.pmean(loss, "data"))

  micro_step, large_step = (_step(f, mesh, specs) for f in (user["local"],
                                                             large))
  got, want = micro_step(params, state, batch), large_step(params, state,
                                                           batch)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5,
                               atol=1e-6)
  assert not np.allclose(got[0]["w1"], params["w1"])   # a step was taken

  def collectives(eqns):
    return sorted(e.primitive.name for e in eqns
                  if e.primitive.name in overlap.COLLECTIVES)

  jaxprs = {name: jax.make_jaxpr(step)(params, state, batch).jaxpr
            for name, step in (("micro", micro_step), ("large", large_step))}
  scans = [e for e in all_eqns(jaxprs["micro"]) if e.primitive.name == "scan"]
  assert scans and not collectives(
      e for scan in scans for sub in jex.jaxprs_in_params(scan.params)
      for e in all_eqns(sub))      # nothing sent per micro-batch
  sent = collectives(all_eqns(jaxprs["large"]))
  assert sent and collectives(all_eqns(jaxprs["micro"])) == sent
