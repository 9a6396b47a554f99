"""docs/choosing.md's frozen parameters, run as written: only the trained
part is differentiated, synced and stepped, nothing of the frozen part is
sent; ``optax.multi_transform`` over the whole tree fails as the doc says,
and works with a jaxfuse optimizer (and its part's plan) in every part."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxfuse
from jaxfuse.state import checkpoint
from jaxfuse.optim import overlap
from jaxfuse import transform

from _harness import NUM_WORKERS, all_eqns, doc_snippet, mesh_of, mlp_loss
from _harness import quickstart_step

K = NUM_WORKERS


def _problem(mesh):
  rng = np.random.default_rng(0)
  params = {"embed": rng.normal(size=(32, 64)).astype(np.float32) / 6,
            "head": rng.normal(size=(64, 32)).astype(np.float32) / 8}
  batches = [jax.device_put((rng.normal(size=(4 * K, 32)).astype(np.float32),
                             rng.normal(size=(4 * K, 32)).astype(np.float32)),
                            NamedSharding(mesh, P("data")))
             for _ in range(3)]
  return jax.device_put(params, NamedSharding(mesh, P())), batches


def loss_fn(p, batch):
  return mlp_loss({"w1": p["embed"], "w2": p["head"]}, batch)


def _collectives(step, *args):
  return [e for e in all_eqns(jax.make_jaxpr(step)(*args).jaxpr)
          if e.primitive.name in overlap.COLLECTIVES]


def test_frozen_part_is_neither_differentiated_nor_sent():
  mesh = mesh_of(K)
  params, batches = _problem(mesh)
  user = dict(jax=jax, jaxfuse=jaxfuse, optax=optax, P=P, mesh=mesh,
              params=params, loss_fn=loss_fn)
  exec(doc_snippet("docs/choosing.md", "## Freezing parameters"), user)  # pylint: disable=exec-used
  frozen, trained, opt = user["frozen"], user["trained"], user["opt"]
  assert set(frozen) == {"embed"} and set(trained) == {"head"}
  start = jax.tree.map(jnp.copy, trained)

  # the Quickstart's step on a model whose frozen part is a constant
  embed = np.asarray(params["embed"])
  def local(trained, opt_state, batch):
    loss_of = lambda t, b: loss_fn({"embed": embed, **t}, b)
    loss, grads = jax.value_and_grad(loss_of)(jaxfuse.local_params(trained),
                                              batch)
    updates, opt_state = opt.update(grads, opt_state, trained)
    return (optax.apply_updates(trained, updates), opt_state,
            jax.lax.pmean(loss, "data"))

  specs = jaxfuse.state_specs(user["opt_state"])
  plain = jax.jit(jax.shard_map(local, mesh=mesh,
                                in_specs=(P(), specs, P("data")),
                                out_specs=(P(), specs, P())))
  snippet_args = (trained, frozen, user["opt_state"], batches[0])
  sent = _collectives(user["train_step"], *snippet_args)
  assert [e.primitive.name for e in sent] == [
      e.primitive.name for e in _collectives(
          plain, trained, user["opt_state"], batches[0])]
  frozen_shape = params["embed"].shape
  assert sent and not any(tuple(v.aval.shape) == frozen_shape
                          for e in sent for v in e.invars)

  mine = (trained, user["opt_state"])
  theirs = (jax.tree.map(jnp.copy, trained),
            jaxfuse.init_state(opt, trained, mesh))
  for batch in batches:
    t, s, loss = user["train_step"](mine[0], frozen, mine[1], batch)
    mine = (t, s)
    t2, s2, loss2 = plain(*theirs, batch)
    theirs = (t2, s2)
    assert float(loss) == float(loss2)
    for a, b in zip(jax.tree.leaves(mine), jax.tree.leaves(theirs),
                    strict=True):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert not np.allclose(mine[0]["head"], start["head"])   # it trained
  np.testing.assert_array_equal(frozen["embed"], params["embed"])


def test_multi_transform_with_a_whole_tree_plan_points_to_the_doc():
  mesh = mesh_of(K)
  params, _ = _problem(mesh)
  plan = jaxfuse.plan(params, density=0.1,
                      settings=jaxfuse.Settings(min_sparse_size=64))
  opt = optax.multi_transform({"train": jaxfuse.sgd(plan, 0.05),
                               "frozen": optax.set_to_zero()},
                              {"embed": "frozen", "head": "train"})
  with pytest.raises(jaxfuse.PlanError,
                     match=r"(?s)in the plan only \[\"\['embed'\]\"\].*"
                           "optax.multi_transform.*Freezing parameters"):
    jaxfuse.init_state(opt, params, mesh)


def test_freezing_with_set_to_zero_or_masked_is_refused_at_init():
  """As the doc says: per-worker zeros for a set_to_zero part (JAX's
  replication check stopped the step), the masked-out gradients passed
  through by optax.masked: both refused by init_state and state_specs,
  naming the doc's section, before a step is traced."""
  mesh = mesh_of(K)
  params, _ = _problem(mesh)
  plan = jaxfuse.plan({"head": params["head"]}, density=0.1,
                      settings=jaxfuse.Settings(min_sparse_size=64))
  zero = optax.multi_transform({"train": jaxfuse.sgd(plan, 0.05),
                                "frozen": optax.set_to_zero()},
                               {"embed": "frozen", "head": "train"})
  masked = optax.masked(jaxfuse.sgd(plan, 0.05),
                        {"embed": False, "head": True})
  for opt, what in ((zero, r"optax.multi_transform has parts \['frozen'\] "
                     "without a jaxfuse optimizer"),
                    (masked, "optax.masked holds a jaxfuse optimizer")):
    with pytest.raises(jaxfuse.SyncError,
                       match=f"(?s)^{what}.*Freezing parameters"):
      jaxfuse.init_state(opt, params, mesh)
    with pytest.raises(jaxfuse.SyncError, match=f"^{what}"):
      jaxfuse.state_specs(jax.eval_shape(opt.init, params))


# two jaxfuse parts, each with the plan of its part of the tree
LABELS = {"embed": "sparse", "head": "dense"}


def _parts(params):
  return {"sparse": jaxfuse.sgd(jaxfuse.plan(
              {"embed": params["embed"]}, density=0.1,
              settings=jaxfuse.Settings(min_sparse_size=64)),
              0.05, momentum=0.9),
          "dense": jaxfuse.sync_adamw(jaxfuse.plan({"head": params["head"]},
                                                   density=1.0), 1e-2)}


def test_multi_transform_of_jaxfuse_parts_steps_each_part_alone():
  """Each part's optimizer (its own plan) inside ``multi_transform``
  steps its part exactly as it does alone on that part's gradients."""
  mesh = mesh_of(K)
  params, batches = _problem(mesh)
  parts, labels = _parts(params), LABELS
  opt = optax.multi_transform(parts, labels)
  state = jaxfuse.init_state(opt, params, mesh)
  alone = {name: jaxfuse.init_state(
      tx, {k: params[k] for k in labels if labels[k] == name}, mesh)
           for name, tx in parts.items()}
  alone_specs = jaxfuse.state_specs(alone)

  def local_alone(params, states, batch):
    grads = jax.grad(loss_fn)(jaxfuse.local_params(params), batch)
    out, new = {}, {}
    for name, tx in parts.items():
      keys = [k for k in labels if labels[k] == name]
      part = lambda tree: {k: tree[k] for k in keys}  # pylint: disable=cell-var-from-loop
      updates, new[name] = tx.update(part(grads), states[name], part(params))
      out.update(optax.apply_updates(part(params), updates))
    return out, new

  step = quickstart_step(opt, mesh, jaxfuse.state_specs(state), loss_fn)
  step_alone = jax.jit(jax.shard_map(
      local_alone, mesh=mesh, in_specs=(P(), alone_specs, P("data")),
      out_specs=(P(), alone_specs)))
  mine, theirs = (params, state), (jax.tree.map(jnp.copy, params), alone)
  for batch in batches[:2]:
    mine = step(*mine, batch)
    theirs = step_alone(*theirs, batch)
    for k in labels:
      np.testing.assert_array_equal(np.asarray(mine[0][k]),
                                    np.asarray(theirs[0][k]), err_msg=k)
  assert not np.allclose(mine[0]["embed"], params["embed"])
  assert not np.allclose(mine[0]["head"], params["head"])
  # sync_stats: the first part's (multi_transform's parts in name order)
  first = jaxfuse.sync_stats(mine[1])
  np.testing.assert_array_equal(first.wire_bytes,
                                jaxfuse.sync_stats(theirs[1]["dense"]).wire_bytes)


def test_multi_transform_state_checkpoints_and_resizes(tmp_path):
  """The state of several jaxfuse parts saves and restores bitwise without
  a plan (a checkpoint holds one; here each part has its own), continues
  the same, and restored on half the workers keeps each float per-worker
  leaf's mean over workers (what they still owe: ``jaxfuse.elastic``)."""
  if K < 2:
    pytest.skip("one worker: nothing to resize")
  pytest.importorskip("orbax.checkpoint")
  mesh = mesh_of(K)
  params, batches = _problem(mesh)
  opt = optax.multi_transform(_parts(params), LABELS)
  state = jaxfuse.init_state(opt, params, mesh)
  step = quickstart_step(opt, mesh, jaxfuse.state_specs(state), loss_fn)
  saved = (jax.tree.map(jnp.copy, params), state)
  for batch in batches[:2]:
    saved = step(*saved, batch)
    jax.block_until_ready(saved)
  mngr = checkpoint.manager(tmp_path)
  checkpoint.save(mngr, 2, saved, None)
  mngr.wait_until_finished()
  host = [np.asarray(x) for x in jax.tree.leaves(saved)]
  _, out = checkpoint.restore(mngr, (params, jaxfuse.init_state(
      opt, params, mesh)), None)
  for a, b in zip(jax.tree.leaves(out), host, strict=True):
    assert np.array_equal(np.asarray(a), b)
  mine, theirs = step(*out, batches[2]), step(*saved, batches[2])
  for a, b in zip(jax.tree.leaves(mine), jax.tree.leaves(theirs),
                  strict=True):
    assert np.array_equal(np.asarray(a), np.asarray(b))

  half = mesh_of(K // 2)
  like = jax.device_put(params, NamedSharding(half, P()))
  _, small = checkpoint.restore(mngr, (like, jaxfuse.init_state(
      opt, like, half)), None)
  mask = jax.tree.leaves(transform.per_worker_mask(saved))
  resized = 0
  for a, b, per_worker in zip(jax.tree.leaves(small), host, mask,
                              strict=True):
    a = np.asarray(a)
    if not per_worker:
      assert np.array_equal(a, b)
    elif np.issubdtype(b.dtype, np.floating):
      assert a.shape[0] == K // 2
      np.testing.assert_allclose(a.mean(axis=0), b.mean(axis=0),
                                 rtol=1e-6, atol=1e-7)
      resized += bool(np.any(b))
  assert resized >= 2   # the sparse part's residual and velocity at least
