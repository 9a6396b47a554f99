"""docs/choosing.md's flax ``TrainState`` snippet, run as written: it steps
exactly as the plain Quickstart step; a state left as ``TrainState.create``
made it (one worker's shapes) is refused, naming the fix."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.training import train_state
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxfuse

from _harness import NUM_WORKERS, doc_snippet, mesh_of, mlp_loss, shard
from _harness import quickstart_step

K = NUM_WORKERS


def _problem():
  rng = np.random.default_rng(0)
  params = {"w1": rng.normal(size=(32, 64)).astype(np.float32) / 6,
            "w2": rng.normal(size=(64, 8)).astype(np.float32) / 8}
  batches = [(rng.normal(size=(4 * K, 32)).astype(np.float32),
              rng.normal(size=(4 * K, 8)).astype(np.float32))
             for _ in range(3)]
  return params, batches


def test_train_state_steps_as_the_plain_step():
  mesh = mesh_of(K)
  params, batches = _problem()
  start = params["w1"]
  params = jax.device_put(params, NamedSharding(mesh, P()))
  plan = jaxfuse.plan(params, density=0.1,
                      settings=jaxfuse.Settings(min_sparse_size=64))
  opt = jaxfuse.sgd(plan, 0.05, momentum=0.9)

  class Model:   # what TrainState keeps of the model: apply_fn
    apply = staticmethod(lambda variables, x: x)

  # its own copy of the parameters: the snippet's step donates its state
  user = dict(jax=jax, jaxfuse=jaxfuse, train_state=train_state, P=P,
              model=Model, params=jax.tree.map(jnp.copy, params), opt=opt,
              mesh=mesh, loss_fn=mlp_loss)
  snippet = doc_snippet("docs/choosing.md", "## With flax's `TrainState`")
  exec(snippet, user)  # pylint: disable=exec-used

  opt_state = jaxfuse.init_state(opt, params, mesh)
  plain = quickstart_step(opt, mesh, jaxfuse.state_specs(opt_state))
  state, p, s = user["state"], params, opt_state
  for batch in batches:
    batch = shard(mesh, batch)
    state, _ = user["train_step"](state, batch)
    p, s = plain(p, s, batch)
    jax.block_until_ready((state, p))
  assert int(state.step) == len(batches)
  for a, b in zip(jax.tree.leaves((state.params, state.opt_state)),
                  jax.tree.leaves((p, s)), strict=True):
    assert np.array_equal(np.asarray(a), np.asarray(b))
  assert not np.array_equal(np.asarray(p["w1"]), start)


def test_a_state_of_one_workers_shapes_is_refused():
  if len(jax.devices()) < 2:
    pytest.skip("one device: one worker's shapes are the state's")
  params, _ = _problem()
  opt = jaxfuse.sgd(jaxfuse.plan(params, density=0.1,
                                 settings=jaxfuse.Settings(min_sparse_size=64)),
                    0.05)
  state = train_state.TrainState.create(apply_fn=None, params=params, tx=opt)
  with pytest.raises(jaxfuse.SyncError, match=r"jaxfuse.init_state\("):
    jaxfuse.state_specs(state.opt_state)
  with pytest.raises(jaxfuse.SyncError, match="TrainState.create"):
    jaxfuse.state_specs(opt.init(params))
  mesh = mesh_of(K)
  with pytest.raises(jaxfuse.SyncError, match="one worker's shape"):
    jaxfuse.state_specs(jax.device_put(opt.init(params),   # replicated
                                       NamedSharding(mesh, P())))
  # accepted: what the snippet does, and a one-device mesh's state (its
  # arrays carry P(): XLA drops an axis of size 1 from their specs)
  fixed = state.replace(opt_state=jaxfuse.init_state(opt, params, mesh))
  one = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
  for ok in (fixed.opt_state, jaxfuse.init_state(opt, params, one)):
    specs = jaxfuse.state_specs(ok)
    assert specs[1].residuals[0] == P("data")


def test_phases_with_a_train_state_step_as_the_plain_loop():
  """The doc's phase loop with a TrainState (tx replaced in the state and
  the specs) steps bitwise as the plain loop over the same phases."""
  mesh = mesh_of(K)
  params, batches = _problem()
  params = jax.device_put(params, NamedSharding(mesh, P()))
  plan = jaxfuse.plan(params, density=0.1,
                      settings=jaxfuse.Settings(min_sparse_size=64))
  phases = jaxfuse.density_warmup(plan, dense_steps=1, steps=1,
                                  densities=(0.25,))
  make_opt = lambda plan: jaxfuse.onebit_adamw(plan, 1e-2)
  total = len(batches)
  sharded = [shard(mesh, b) for b in batches]

  class Model:
    apply = staticmethod(lambda variables, x: x)

  user = dict(jax=jax, jaxfuse=jaxfuse, train_state=train_state, P=P,
              model=Model, params=jax.tree.map(jnp.copy, params),
              opt=make_opt(phases[0].plan), mesh=mesh, loss_fn=mlp_loss,
              phases=phases, make_opt=make_opt, total=total)
  steps = iter(sharded)

  def next_batch():   # waits for the last step first (CPU collectives)
    jax.block_until_ready(user["state"])
    return next(steps)
  user["next_batch"] = next_batch
  exec(doc_snippet("docs/choosing.md", "## With flax's `TrainState`"),  # pylint: disable=exec-used
       user)
  exec(doc_snippet("docs/choosing.md", "### Phases with a `TrainState`"),  # pylint: disable=exec-used
       user)

  p = params
  s = jaxfuse.init_state(make_opt(phases[0].plan), params, mesh)
  specs = jaxfuse.state_specs(s)
  for phase in phases:
    plain = quickstart_step(make_opt(phase.plan), mesh, specs)
    for step in range(phase.start, min(phase.stop or total, total)):
      p, s = plain(p, s, sharded[step])
      jax.block_until_ready(p)
  state = user["state"]
  assert int(state.step) == total
  for a, b in zip(jax.tree.leaves((state.params, state.opt_state)),
                  jax.tree.leaves((p, s)), strict=True):
    assert np.array_equal(np.asarray(a), np.asarray(b))
  assert not np.array_equal(np.asarray(p["w1"]), np.asarray(params["w1"]))
