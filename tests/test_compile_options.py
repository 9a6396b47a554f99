"""``jaxfuse.xla_options``: command buffers off on GPU, nothing elsewhere,
and option names XLA accepts."""

import jax
import jax.numpy as jnp
import numpy as np

import jaxfuse


def test_gpu_turns_command_buffers_off_and_other_platforms_get_nothing():
  for platform in ("gpu", "cuda", "rocm"):
    assert jaxfuse.xla_options(platform) == {
        "xla_gpu_enable_command_buffer": ""}
  assert jaxfuse.xla_options("cpu") == {}
  assert jaxfuse.xla_options() == jaxfuse.xla_options(jax.default_backend())


def test_returns_a_new_dict_each_time():
  mine = jaxfuse.xla_options("gpu")
  mine["xla_gpu_enable_latency_hiding_scheduler"] = True
  assert "xla_gpu_enable_latency_hiding_scheduler" not in (
      jaxfuse.xla_options("gpu"))


def test_xla_accepts_the_options():
  """XLA rejects unknown option names when compiling: a misspelt flag fails
  here (the GPU options are accepted, and ignored, by the CPU compiler)."""
  step = jax.jit(lambda x: 2 * x + 1,
                 compiler_options=jaxfuse.xla_options("gpu"))
  np.testing.assert_array_equal(np.asarray(step(jnp.arange(3.0))), [1, 3, 5])
  bad = jax.jit(lambda x: x, compiler_options={
      "xla_gpu_enable_command_bufer": ""})
  try:
    bad(jnp.zeros(2))
  except Exception as e:  # pylint: disable=broad-except
    assert "command_bufer" in str(e)
  else:
    raise AssertionError("XLA accepted a misspelt option name")
