"""A step's state comes out as it went in: the same tree, shapes and dtypes,
and the updates in the parameters' dtypes, for every recipe, phase and
option. A state whose dtype drifts (a bfloat16 residual promoted to float32
by a float32 constant) recompiles the step, breaks buffer donation and
changes the update rule; a float32 update on bfloat16 parameters doubles
their memory traffic. Checked by tracing the step (``jax.eval_shape``):
nothing compiles."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings, strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxfuse

from _harness import NUM_WORKERS, mesh_of, sharded_update

RECIPES = sorted(jaxfuse.optim.recipes.RECIPES)


def _params(dtype):
  return {"emb": jnp.zeros((96, 64), dtype), "w": jnp.zeros((64, 64), dtype),
          "b": jnp.zeros((64,), dtype), "tiny": jnp.zeros((5,), dtype)}


def _options(recipe, draw):
  """Keyword arguments a user could give ``recipe``."""
  options = {"clip_norm": draw(st.sampled_from([None, 1.0]))}
  if recipe == "sgd":
    options.update(momentum=draw(st.sampled_from([0.0, 0.9])),
                   mask_momentum=draw(st.booleans()),
                   residual_decay=draw(st.sampled_from([1.0, 0.8])))
    options["nesterov"] = options["momentum"] > 0 and draw(st.booleans())
  if recipe == "demo":
    options["sign"] = draw(st.booleans())
  return options


def _jax_scalar(value):
  return jnp.asarray(value, jnp.float32)


def _traced_step(tx, params, mesh):
  """(state in, (updates, state out)) as ShapeDtypeStructs of one step
  under ``shard_map``, the gradients each worker's own."""
  state = jaxfuse.init_state(tx, params, mesh)
  step = sharded_update(tx, mesh, jaxfuse.state_specs(state),
                        with_params=True)
  grads = jax.tree.map(
      lambda p: jax.ShapeDtypeStruct((NUM_WORKERS,) + p.shape, p.dtype,
                                     sharding=NamedSharding(mesh, P("data"))),
      params)
  params = jax.device_put(params, NamedSharding(mesh, P()))
  return state, jax.eval_shape(step, grads, state, params)


def _avals(tree):
  return jax.tree.map(lambda x: (tuple(x.shape), jnp.dtype(x.dtype)), tree)


@pytest.mark.parametrize("recipe", RECIPES)
@settings(max_examples=12, deadline=None)
@given(data=st.data())
def test_a_step_keeps_the_state_and_the_parameters_dtypes(recipe, data):
  draw = data.draw
  mesh = mesh_of(NUM_WORKERS)
  dtype = draw(st.sampled_from([jnp.float32, jnp.bfloat16]), "dtype")
  params = _params(dtype)
  plan = jaxfuse.plan(
      params, density=draw(st.sampled_from([0.05, 0.3]), "density"),
      strategy=draw(st.sampled_from(["aligned", "size", "single"])),
      bucket_bytes=20_000, num_buckets=2,
      collective=draw(st.sampled_from([
          jaxfuse.collectives.AllGather(packed_indices=False),
          jaxfuse.collectives.AllGather(packed_indices=True), "zen",
          "spardl"])),
      settings=jaxfuse.Settings(
          min_sparse_size=64,
          residual_dtype=draw(st.sampled_from(["float32", "gradient"])),
          sparse_wire=draw(st.sampled_from(["gradient", "bfloat16"]))))
  phases = jaxfuse.density_warmup(
      plan, dense_steps=2, steps=1, densities=[0.5],
      dense_wire=draw(st.sampled_from(["gradient", "bfloat16"])))
  phase = draw(st.sampled_from(phases), "phase")
  options = _options(recipe, draw)
  # numbers as a user may give them: JAX types numpy and JAX scalars
  number = draw(st.sampled_from([float, np.float32, _jax_scalar]),
                "number type")
  options = {k: number(v) if type(v) is float else v  # pylint: disable=unidiomatic-typecheck
             for k, v in options.items()}
  make = jaxfuse.optim.recipes.RECIPES[recipe]
  tx = make(phase.plan, number(1e-3), **options)
  if draw(st.booleans(), "apply_if_finite"):
    tx = jaxfuse.apply_if_finite(tx, 2)
  if draw(st.booleans(), "delayed") and recipe != "sync_adamw":
    tx = jaxfuse.delayed(tx)
  state, (updates, new_state) = _traced_step(tx, params, mesh)
  assert _avals(new_state) == _avals(state)
  assert _avals(updates) == _avals(params)


def test_a_float32_constant_in_the_state_path_would_be_caught():
  """The check itself: a transform that promotes its bfloat16 state (the
  bug the check exists for) fails it."""
  mesh = mesh_of(NUM_WORKERS)
  params = _params(jnp.bfloat16)

  def update(updates, state, params=None):
    del params
    return (jax.lax.pmean(updates, "data"),
            jax.tree.map(lambda s: s * np.float32(0.9), state))

  tx = jaxfuse.per_worker(optax.GradientTransformation(
      lambda p: jax.tree.map(jnp.zeros_like, p), update), float32_state=False)
  state, (_, new_state) = _traced_step(tx, params, mesh)
  assert _avals(new_state) != _avals(state)


@pytest.mark.parametrize("collective", ["allgather", "zen", "spardl"])
@pytest.mark.parametrize("recipe", ["onebit_adamw", "sgd"])
def test_x64_keeps_float32_and_float64_states(recipe, collective):
  """With ``jax_enable_x64`` Python numbers trace as 64-bit: a float32
  model must not turn float64 anywhere, and a float64 model steps in
  float64."""
  mesh = mesh_of(NUM_WORKERS)
  with jax.enable_x64(True):
    for dtype in (jnp.float32, jnp.float64):
      params = _params(dtype)
      scheme = (jaxfuse.collectives.AllGather(packed_indices=True)
                if collective == "allgather" else collective)
      plan = jaxfuse.plan(params, density=0.05, strategy="size",
                          bucket_bytes=20_000, collective=scheme,
                          settings=jaxfuse.Settings(min_sparse_size=64))
      for phase in jaxfuse.density_warmup(plan, dense_steps=1, steps=0):
        tx = jaxfuse.RECIPES[recipe](phase.plan, 1e-3, clip_norm=1.0)
        state, (updates, new_state) = _traced_step(tx, params, mesh)
        assert _avals(new_state) == _avals(state), (dtype, phase.start)
        assert _avals(updates) == _avals(params), (dtype, phase.start)
        if dtype == jnp.float32:
          assert not any(jnp.dtype(x.dtype) == jnp.float64
                         for x in jax.tree.leaves(state)), phase.start
