"""XLA options for the jitted train step that runs ``sparse_sync``.

  step = jax.jit(train_step, compiler_options=jaxfuse.xla_options())

On GPU, XLA records runs of kernels into CUDA graphs ("command buffers") and,
on every call of the executable, updates those graphs on the host with the
call's buffer addresses before it launches them. ``sparse_sync`` adds a few
hundred small kernels to a step (selection, packing, decoding per unit), so
that update becomes a host cost of every step, during which the GPU waits.
Turning command buffers off launches the kernels one by one instead, which
costs less for a step of many small kernels, sparse or dense
(docs/choosing.md, "Where the figures come from", has the measurement).
"""

from __future__ import annotations

import math
import os

import jax

from jaxfuse.plans import checks as plan_checks

_GPU_PLATFORMS = ("gpu", "cuda", "rocm")


def xla_options(platform: str | None = None) -> dict[str, str]:
  """Compile options for ``jax.jit(..., compiler_options=...)``.

  Args:
    platform: the platform the step compiles for (default: JAX's default
      backend). On GPU: command buffers off; elsewhere: none.

  Returns:
    A new dict, safe to update with options of your own.

  Raises:
    Nothing: an unknown platform gets no options.
  """
  if on_gpu(platform):
    return {"xla_gpu_enable_command_buffer": ""}
  return {}


def on_gpu(platform: str | None = None) -> bool:
  """Whether ``platform`` (default: JAX's default backend) is a GPU."""
  return (platform or jax.default_backend()) in _GPU_PLATFORMS


def xla_flags(network_gbytes_s: float, *, gpus_per_node: int = 1) -> str:
  """``XLA_FLAGS`` that tell XLA's GPU scheduler what the network costs.

  XLA's latency-hiding scheduler starts an asynchronous collective early
  enough to cover what it estimates the collective takes. By default it
  assumes NVLink within a host, so on a slower network it starts the
  collectives too late to hide them. These flags switch on its
  speed-of-light estimator with every ``gpus_per_node`` GPUs a node and
  ``network_gbytes_s`` GB/s between nodes.

  Which figure: the scheduler starts a collective as late as its estimate
  (bytes / ``network_gbytes_s``) says still hides it. For
  ``jaxfuse.send_early`` give about half the link's speed: 1.5 for NCCL
  over 25–30 Gbit/s Ethernet, which moves about 3 GB/s (``jaxfuse
  profile`` measures it). Told the full speed, XLA starts some
  all-gathers late and the backward waits for them; dense training,
  whose all-reduces it estimates well, runs best with the link's own
  speed. The best figure can depend on the sparse wire's bytes (e.g. a
  lower ``headroom`` sends fewer slots): time the step at a few speeds
  when you change what the collectives carry.
  docs/benchmarks.md, "Overlap"; docs/choosing.md.

  XLA reads ``XLA_FLAGS`` once, when JAX starts its GPU backend: set it
  before the first JAX computation, e.g. ``os.environ["XLA_FLAGS"] += " " +
  jaxfuse.xla_flags(1.5)`` at the top of the training script, or export it.
  Pair it with ``jaxfuse.send_early`` (or ``jaxfuse.delayed``): XLA can
  only start a collective once its input exists, and the plain step makes
  the sparse buckets' inputs after the whole backward.

  Args:
    network_gbytes_s: GB/s between nodes (a finite number > 0).
    gpus_per_node: GPUs a node (an int >= 1).

  Returns:
    The flags, one string, to append to ``XLA_FLAGS``.

  Raises:
    ValueError: either argument out of range, naming it.
  """
  if not (plan_checks.is_real(network_gbytes_s) and
          math.isfinite(network_gbytes_s) and network_gbytes_s > 0):
    raise ValueError(f"network_gbytes_s={network_gbytes_s!r} must be a "
                     "number > 0 (GB/s between nodes).")
  if not plan_checks.is_int(gpus_per_node) or gpus_per_node < 1:
    raise ValueError(f"gpus_per_node={gpus_per_node!r} must be an int >= 1.")
  options = (f"nic_speed_gbps={network_gbytes_s:g},"
             f"gpus_per_node={gpus_per_node},partition_size={gpus_per_node},"
             "rtt_us=100")
  return ("--xla_gpu_enable_latency_hiding_scheduler=true "
          "--xla_gpu_enable_analytical_sol_latency_estimator=true "
          f"--xla_gpu_analytical_latency_estimator_options={options}")


_SOL_ESTIMATOR = "--xla_gpu_enable_analytical_sol_latency_estimator=true"


def network_flags_set(flags: str | None = None) -> bool:
  """Whether ``flags`` (default: this process's ``XLA_FLAGS``) switch on
  the speed-of-light estimator that ``xla_flags`` sets."""
  flags = os.environ.get("XLA_FLAGS", "") if flags is None else flags
  return _SOL_ESTIMATOR in flags.split()
