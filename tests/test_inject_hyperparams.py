"""The recipes under ``optax.inject_hyperparams``: the learning rate (and
the other arithmetic hyperparameters) live in the state and change between
steps without a recompile; those that shape the step must stay static, and
leaving them out of ``static_args`` names the fix."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxfuse
from jaxfuse.optim import recipes

from _harness import NUM_WORKERS, fast_jit, mesh_of, shard, sharded_update

K = NUM_WORKERS
SHAPES = {"w": (64, 48), "b": (48,)}


def _setup():
  rng = np.random.default_rng(0)
  params = {k: rng.normal(size=s).astype(np.float32) / 8
            for k, s in SHAPES.items()}
  grads = [{k: rng.normal(size=(K,) + s).astype(np.float32)
            for k, s in SHAPES.items()} for _ in range(2)]
  return params, grads, jaxfuse.plan(params, density=0.1,
                                     settings=jaxfuse.Settings(
                                         min_sparse_size=64))


def _steps(tx, params, grads, mesh, set_lr=None):
  """Params after a step on each of ``grads``; ``set_lr``: the injected
  learning rate is set to it in the state before each step."""
  params = jax.device_put(params, NamedSharding(mesh, P()))
  state = jaxfuse.init_state(tx, params, mesh)
  specs = jaxfuse.state_specs(state)

  update = sharded_update(tx, mesh, specs, with_params=True)

  def train(params, state, grads):
    updates, state = update(grads, state, params)
    return optax.apply_updates(params, updates), state

  step = fast_jit(train)
  for g in grads:
    if set_lr is not None:
      old = state.hyperparams["learning_rate"]
      state.hyperparams["learning_rate"] = jax.device_put(
          np.asarray(set_lr, old.dtype), old.sharding)
    params, state = jax.block_until_ready(step(params, state,
                                               shard(mesh, g)))
  return params, step


# a dense first step for onebit_adamw: its update is zero until one
DENSE_FIRST = {"onebit_adamw"}


@pytest.mark.parametrize("recipe", sorted(jaxfuse.RECIPES))
def test_an_injected_learning_rate_is_the_given_one_and_can_change(recipe):
  mesh = mesh_of(K)
  params, grads, sparse = _setup()
  dense = jaxfuse.with_density(sparse, 1.0)
  make = jaxfuse.RECIPES[recipe]
  inject = lambda plan: optax.inject_hyperparams(
      make, static_args=recipes.STATIC_ARGS[recipe])(
          plan=plan, learning_rate=1e-2, clip_norm=1.0)
  # dense (every element sent): a selection among near-ties (Adam's first
  # steps are about ±1 everywhere) could part at the last bit
  got, _ = _steps(inject(dense), params, grads, mesh)
  want, _ = _steps(make(dense, 1e-2, clip_norm=1.0), params, grads, mesh)
  # to float32 rounding: XLA folds a constant rate into other constants
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4,
                               atol=1e-6)
  assert not np.allclose(np.asarray(got["w"]), params["w"])
  # sparse, the rate set to 0 in the state: nothing moves (onebit_adamw's
  # sparse phase moves nothing before a dense step anyway: its dense
  # phase), and nothing recompiles
  injected = inject(dense if recipe in DENSE_FIRST else sparse)
  _, step = _steps(injected, params, grads, mesh)
  frozen, again = _steps(injected, params, grads, mesh, set_lr=0.0)
  assert all(np.array_equal(np.asarray(frozen[k]), params[k])
             for k in SHAPES)
  # pylint: disable-next=protected-access
  assert again._cache_size() == step._cache_size()


@pytest.mark.parametrize("recipe", ["sgd", "demo"])
def test_static_hyperparameters_left_to_inject_name_the_fix(recipe):
  """sgd's and demo's momentum are numbers by default, so
  inject_hyperparams would trace them. (onebit_adamw's betas are a tuple
  since 0.3, which optax keeps static: injected without static_args, its
  state is made.)"""
  mesh = mesh_of(K)
  params, _, plan = _setup()
  onebit = optax.inject_hyperparams(jaxfuse.onebit_adamw)(
      plan=plan, learning_rate=1e-2)
  assert set(jaxfuse.init_state(onebit, params, mesh).hyperparams) == {
      "learning_rate", "eps", "weight_decay"}
  injected = optax.inject_hyperparams(jaxfuse.RECIPES[recipe])(
      plan=plan, learning_rate=1e-2)
  with pytest.raises(jaxfuse.SyncError,
                     match=rf"static_args=jaxfuse.optim.recipes.STATIC_ARGS\['{recipe}'\]"):
    jaxfuse.init_state(injected, params, mesh)


def test_sparse_sync_names_static_args_too():
  mesh = mesh_of(K)
  params, _, plan = _setup()
  injected = optax.inject_hyperparams(jaxfuse.sparse_sync)(plan=plan,
                                                           momentum=0.9)
  with pytest.raises(jaxfuse.SyncError, match="momentum is a traced value.*"
                     "static_args"):
    jaxfuse.init_state(injected, params, mesh)
  fixed = optax.inject_hyperparams(
      jaxfuse.sparse_sync, static_args=("momentum", "residual_decay"))(
          plan=plan, momentum=0.9)
  state = jaxfuse.init_state(fixed, params, mesh)
  assert state.inner_state.velocity   # the static momentum made its state


@pytest.mark.parametrize("recipe", ["sync_adamw", "sgd"])
def test_hyperparameters_of_a_bfloat16_model_must_be_float32(recipe):
  """optax keeps injected values in the parameters' dtype by default: in
  bfloat16 sync_adamw's b2 = 0.999 is 1.0 and every update NaN (the state
  check names the fix); with ``hyperparam_dtype=jnp.float32`` a bfloat16
  model steps as the recipe without the wrapper, to bfloat16 rounding."""
  mesh = mesh_of(K)
  params, grads, _ = _setup()
  params = {k: v.astype(jnp.bfloat16) for k, v in params.items()}
  plan = jaxfuse.plan(params, density=1.0)
  make = jaxfuse.RECIPES[recipe]
  inject = lambda **kw: optax.inject_hyperparams(
      make, static_args=recipes.STATIC_ARGS[recipe], **kw)(
          plan=plan, learning_rate=1e-2)
  with pytest.raises(jaxfuse.SyncError,
                     match=r"'learning_rate'.*hyperparam_dtype=jnp.float32"):
    jaxfuse.init_state(inject(), params, mesh)
  bf16_grads = [jax.tree.map(lambda g: g.astype(jnp.bfloat16), g)
                for g in grads]
  got, _ = _steps(inject(hyperparam_dtype=jnp.float32), params, bf16_grads,
                  mesh)
  want, _ = _steps(make(plan, 1e-2), params, bf16_grads, mesh)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert np.all(np.isfinite(a))
    np.testing.assert_allclose(a, b, rtol=2 ** -7, atol=1e-3)
  assert not np.allclose(np.asarray(got["w"], np.float32),
                         np.asarray(params["w"], np.float32))
