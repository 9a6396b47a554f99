"""A flax linen model's whole ``variables`` (``model.init``'s output) handed
to ``jaxfuse.plan``: with batch statistics it is refused, naming
``variables['params']``; the parameters alone are planned."""

import jax
import jax.numpy as jnp
import pytest
from flax import linen as nn

import jaxfuse


class _Net(nn.Module):
  @nn.compact
  def __call__(self, x, train: bool = False):
    x = nn.Dense(64)(x)
    x = nn.BatchNorm(use_running_average=not train)(x)
    return nn.Dense(1)(x)


def test_variables_with_batch_stats_are_refused():
  variables = _Net().init(jax.random.PRNGKey(0), jnp.ones((2, 32)))
  assert set(variables) == {"params", "batch_stats"}
  with pytest.raises(jaxfuse.PlanError, match=(
      r"params holds the flax collections \['params', 'batch_stats'\]: a "
      r"linen model's variables, not its parameters. Plan "
      r"variables\['params'\]")):
    jaxfuse.plan(variables, density=0.05,
                 settings=jaxfuse.Settings(min_sparse_size=16))
  plan = jaxfuse.plan(variables["params"], density=0.05,
                      settings=jaxfuse.Settings(min_sparse_size=16))
  assert not any("batch_stats" in leaf.path or "mean" in leaf.path
                 for leaf in plan.leaves)
  # 2 Dense (kernel, bias) and BatchNorm's scale and bias
  assert len(plan.leaves) == 6


def test_a_params_only_variables_dict_is_planned():
  # {"params": ...} alone (no other collection) is a parameter tree
  variables = {"params": {"w": jnp.zeros((64, 64))}}
  plan = jaxfuse.plan(variables, density=0.05,
                      settings=jaxfuse.Settings(min_sparse_size=16))
  assert [leaf.path for leaf in plan.leaves] == ["['params']['w']"]
