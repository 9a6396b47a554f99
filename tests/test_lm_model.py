"""The example LM in bfloat16: where its precision stays float32.

The token lookup's gradient is a scatter-add of one row per token into the
embedding table. Computed in bfloat16, the rows of a frequent token serialize
on a GPU's atomics (31-36 ms a step on an H200); the model reads
the float32 table and rounds after the lookup, so that scatter stays float32.
"""

import jax
import jax.numpy as jnp
import numpy as np

from _harness import all_eqns
from _harness import repo_modules


def _model_and_batch(dtype):
  with repo_modules("examples", "lm_model") as lm_model:
    model = lm_model.build_model("tiny", seq_len=32, dtype=dtype)
    tokens = np.random.default_rng(0).integers(0, 256, (2, 33), np.int32)
    params = model.init(jax.random.PRNGKey(0), tokens[:, :-1])["params"]
    return lm_model, model, params, tokens


def _scatters(jaxpr) -> list:
  """The abstract results of every scatter in a jaxpr, sub-jaxprs included."""
  return [v.aval for eqn in all_eqns(jaxpr)
          if eqn.primitive.name.startswith("scatter") for v in eqn.outvars]


def test_bfloat16_lookup_gradient_scatters_in_float32():
  lm_model, model, params, tokens = _model_and_batch("bfloat16")
  grad = jax.grad(lm_model.make_loss(model))
  closed = jax.make_jaxpr(grad)(params, tokens)
  scatters = _scatters(closed.jaxpr)
  table = params["Embed_0"]["embedding"].shape
  assert [s.dtype for s in scatters if s.shape == table] == [jnp.float32]
  assert {str(s.dtype) for s in scatters} == {"float32"}, scatters
  # The parameters stay float32, and the gradient with them.
  assert {str(a.dtype) for a in closed.out_avals} == {"float32"}


def test_bfloat16_model_tracks_the_float32_model():
  """The same parameters in both dtypes: logits within bfloat16's rounding
  of a dozen matrix products (not equal: the test would catch a model that
  ignored its dtype)."""
  lm_model, f32, params, tokens = _model_and_batch("float32")
  bf16 = lm_model.build_model("tiny", seq_len=32, dtype="bfloat16")
  hi = f32.apply({"params": params}, tokens[:, :-1])
  lo = bf16.apply({"params": params}, tokens[:, :-1])
  assert hi.dtype == lo.dtype == jnp.float32
  err = float(jnp.max(jnp.abs(hi - lo)))
  assert 0 < err < 0.05 * float(jnp.max(jnp.abs(hi)))
  # Parameter names unchanged: plans and checkpoints name these leaves.
  assert set(params) >= {"Embed_0", "pos_embed", "ln_f"}
  assert set(params["Embed_0"]) == {"embedding"}
