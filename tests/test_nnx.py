"""docs/choosing.md's flax NNX step, run as written on a model with batch
statistics and dropout: its parameters step bitwise as the same values
held in a plain dict; the batch statistics come back as the mean of the
workers' (checked against numpy); the RNG state advances and stays
replicated; the three trees checkpoint and restore bitwise. A module or a
PRNG key handed to ``jaxfuse.plan`` is refused, naming the split."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxfuse
from jaxfuse.state import checkpoint

from _harness import NUM_WORKERS, doc_snippet, mesh_of, shard

K = NUM_WORKERS
ROWS = 4   # rows per worker


class MLP(nnx.Module):

  def __init__(self, rngs):
    self.l1 = nnx.Linear(32, 64, rngs=rngs)
    self.norm = nnx.BatchNorm(64, rngs=rngs)
    self.drop = nnx.Dropout(0.25, rngs=rngs)
    self.l2 = nnx.Linear(64, 8, rngs=rngs)

  def __call__(self, x):
    return self.l2(self.drop(jax.nn.relu(self.norm(self.l1(x)))))


def _batches(n):
  rng = np.random.default_rng(0)
  return [(rng.normal(size=(ROWS * K, 32)).astype(np.float32),
           rng.normal(size=(ROWS * K, 8)).astype(np.float32))
          for _ in range(n)]


def _run_snippet(mesh):
  model = MLP(nnx.Rngs(0))
  user = dict(jax=jax, jnp=jnp, nnx=nnx, optax=optax, jaxfuse=jaxfuse,
              NamedSharding=NamedSharding, P=P, mesh=mesh, model=model)
  exec(doc_snippet("docs/choosing.md", "## With flax NNX"), user)  # pylint: disable=exec-used
  return model, user


def _plain_step(user, mesh):
  """The Quickstart's step on the same values held in a plain dict (no
  nnx.State, no ``Variable`` in the paths), fed the snippet's RNG state
  so that both draw the same dropout masks."""
  treedef = jax.tree.structure(user["params"])
  graphdef = user["graphdef"]
  pure = jax.tree.map(jnp.copy, nnx.to_pure_dict(user["params"]))
  plan = jaxfuse.plan(pure, density=0.05)
  opt = jaxfuse.sgd(plan, 0.05, momentum=0.9)
  state = jaxfuse.init_state(opt, pure, mesh)
  specs = jaxfuse.state_specs(state)

  def loss_fn(pure, rest, batch):
    params = jax.tree.unflatten(treedef, jax.tree.leaves(pure))
    x, y = batch
    model = nnx.merge(graphdef, params, rest, copy=True)
    return jnp.mean((model(x) - y) ** 2)

  def local(pure, rest, opt_state, batch):
    grads = jax.grad(loss_fn)(jaxfuse.local_params(pure), rest, batch)
    updates, opt_state = opt.update(grads, opt_state, pure)
    return optax.apply_updates(pure, updates), opt_state

  step = jax.jit(jax.shard_map(local, mesh=mesh,
                               in_specs=(P(), P(), specs, P("data")),
                               out_specs=(P(), specs)))
  return pure, state, step


def test_nnx_snippet_steps_as_a_plain_dict_and_averages_batch_stats():
  mesh = mesh_of(K)
  model, user = _run_snippet(mesh)
  pure, plain_state, plain = _plain_step(user, mesh)
  first = np.asarray(model.l1.kernel[...])
  key_before = np.asarray(jax.random.key_data(
      user["rest"]["drop"]["rngs"]["key"][...]))
  count_before = int(user["rest"]["drop"]["rngs"]["count"][...])
  params, rest, opt_state = user["params"], user["rest"], user["opt_state"]
  for i, batch in enumerate(_batches(3)):
    batch = shard(mesh, batch)
    pure, plain_state = plain(pure, rest, plain_state, batch)
    kernel = np.asarray(params["l1"]["kernel"][...])
    bias = np.asarray(params["l1"]["bias"][...])
    params, rest, opt_state, _ = user["train_step"](params, rest, opt_state,
                                                    batch)
    jax.block_until_ready((params, pure))
    if i == 0:   # from the initial mean 0 and variance 1, momentum 0.99
      h = (np.asarray(batch[0], np.float64) @ kernel + bias).reshape(
          K, ROWS, -1)
      mean, var = h.mean(axis=1), h.var(axis=1)
      # tolerances for a GPU's TF32 products; one worker's statistics
      # instead of the mean differ by up to about 1e-2
      np.testing.assert_allclose(np.asarray(rest["norm"]["mean"][...]),
                                 0.01 * mean.mean(axis=0), rtol=0, atol=2e-5)
      np.testing.assert_allclose(np.asarray(rest["norm"]["var"][...]),
                                 0.99 + 0.01 * var.mean(axis=0), rtol=0,
                                 atol=5e-5)
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(pure),
                  strict=True):
    assert np.array_equal(np.asarray(a), np.asarray(b))
  for a, b in zip(jax.tree.leaves(opt_state), jax.tree.leaves(plain_state),
                  strict=True):
    assert np.array_equal(np.asarray(a), np.asarray(b))
  # the dropout drew from the state it was given, and handed on its own
  assert int(rest["drop"]["rngs"]["count"][...]) == count_before + 3
  assert np.array_equal(
      np.asarray(jax.random.key_data(rest["drop"]["rngs"]["key"][...])),
      key_before)
  for leaf in jax.tree.leaves(rest):
    assert leaf.sharding.is_fully_replicated
  nnx.update(model, params, rest)
  assert np.array_equal(np.asarray(model.l1.kernel[...]),
                        np.asarray(params["l1"]["kernel"][...]))
  assert not np.array_equal(np.asarray(model.l1.kernel[...]), first)


def test_nnx_trees_checkpoint_and_restore_bitwise(tmp_path):
  pytest.importorskip("orbax.checkpoint")
  mesh = mesh_of(K)
  _, user = _run_snippet(mesh)
  params, rest, opt_state = user["params"], user["rest"], user["opt_state"]
  for batch in _batches(2):
    params, rest, opt_state, _ = user["train_step"](
        params, rest, opt_state, shard(mesh, batch))
    jax.block_until_ready(params)
  state = (params, rest, opt_state)
  mngr = checkpoint.manager(tmp_path)
  checkpoint.save(mngr, 2, state, user["plan"])
  mngr.wait_until_finished()
  _, fresh = _run_snippet(mesh)
  like = (fresh["params"], fresh["rest"], fresh["opt_state"])
  step, out = checkpoint.restore(mngr, like, user["plan"])
  assert step == 2
  flat = lambda t: [np.asarray(jax.random.key_data(x)) if jax.dtypes.issubdtype(
      x.dtype, jax.dtypes.extended) else np.asarray(x)
                    for x in jax.tree.leaves(t)]
  for a, b in zip(flat(out), flat(state), strict=True):
    assert np.array_equal(a, b)
  assert jax.tree.structure(out) == jax.tree.structure(state)


def test_a_module_or_a_key_is_refused_naming_the_split():
  model = MLP(nnx.Rngs(0))
  with pytest.raises(jaxfuse.PlanError, match=r"nnx\.split\(model, nnx\.Param"):
    jaxfuse.plan(model, density=0.05)
  with pytest.raises(jaxfuse.PlanError, match=r"params\['model'\] is a "
                     r"flax NNX Module \(MLP\)"):
    jaxfuse.plan({"model": model}, density=0.05)
  # the whole state: its RNG state and batch statistics are no parameters
  with pytest.raises(jaxfuse.PlanError,
                     match=r"params\['drop'\]\['rngs'\]\['count'\] is an "
                     r"nnx.RngCount \(RngState\)"):
    jaxfuse.plan(nnx.state(model), density=0.05)
  with pytest.raises(jaxfuse.PlanError, match=r"params\['norm'\]\['mean'\] "
                     r"is an nnx.BatchStat"):
    jaxfuse.plan(nnx.state(model, nnx.Not(nnx.RngState)), density=0.05)
  # the parameters alone are planned, every leaf a float one
  plan = jaxfuse.plan(nnx.state(model, nnx.Param), density=0.05)
  assert {leaf.dtype for leaf in plan.leaves} == {"float32"}
  assert len(plan.leaves) == 6

