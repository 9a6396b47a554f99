"""XLA options for the jitted train step that runs ``sparse_sync``.

  step = jax.jit(train_step, compiler_options=jaxfuse.xla_options())

On GPU, XLA records runs of kernels into CUDA graphs ("command buffers") and,
on every call of the executable, updates those graphs on the host with the
call's buffer addresses before it launches them. ``sparse_sync`` adds a few
hundred small kernels to a step (selection, packing, decoding per unit), so
that update becomes a host cost of every step, during which the GPU waits.
Turning command buffers off launches the kernels one by one instead, which
costs less here: gpt2-small on 1 × H100 (JAX 0.11.2) took 72.8 ms per step
with them and 59.9–61.6 ms without; the same model trained dense went from
58.6 to 55.5 ms (docs/benchmarks.md, "XLA command buffers").
"""

from __future__ import annotations

import jax

_GPU_PLATFORMS = ("gpu", "cuda", "rocm")


def xla_options(platform: str | None = None) -> dict[str, str]:
  """Compile options for ``jax.jit(..., compiler_options=...)``.

  Args:
    platform: the platform the step compiles for (default: JAX's default
      backend). On GPU: command buffers off; elsewhere: none.

  Returns:
    A new dict, safe to update with options of your own.
  """
  platform = platform or jax.default_backend()
  if platform in _GPU_PLATFORMS:
    return {"xla_gpu_enable_command_buffer": ""}
  return {}
