"""What a sparse bucket computes beyond its units' compression
(``Costs.bucket``).

A sparse bucket runs kernels of its own besides its units' compression: its
selection call (one exact k-th largest per bucket), reductions, packing and
decoding. In a plain step XLA runs the buckets' kernels together; under
``jaxfuse.send_early`` each bucket is fenced into the backward at its own
point, so they run one bucket at a time and each bucket pays them (2 ×
H200, gpt2-small: about 0.4 ms a sparse bucket, docs/benchmarks.md). So it
is measured where it is paid, on one device (no wire): the ``send_early``
training step of a tanh MLP of u square layers of about x elements each,
every layer sparse, planned as one sparse bucket (t₁) and as one bucket per
layer (t_u), timed round-robin::

  c = max(0, (t_u − t₁) / (u − 1))

``simulate`` adds c to each sparse bucket's compression, on the compute
stream.
"""

from __future__ import annotations

import math
import warnings

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np

from jaxfuse.planning.backward import synthetic_model
from jaxfuse.planning.timing import ProfileError
from jaxfuse.planning.timing import jit as _jit
from jaxfuse.planning.timing import time_calls

# Elements per layer by platform: a transformer's largest matrices on an
# accelerator (768 × 3072 ≈ 2^21), small ones on a CPU.
DEFAULT_ELEMENTS = {"cpu": 2**14, "other": 2**21}


def measure_bucket_cost(mesh, *, units: int = 8, elements: int | None = None,
                        estimator: str = "dgc", density: float = 0.01,
                        headroom: float = 1.5, repeats: int = 5,
                        warmup: int = 2, axis_name: str = "data"
                        ) -> tuple[float, dict]:
  """(c, raw): the compute per sparse bucket beyond its units' compression
  (module docstring), on the first device of ``mesh``. ``elements`` per
  layer defaults to ``DEFAULT_ELEMENTS`` of the platform."""
  if units < 2:
    raise ProfileError(f"units={units} must be >= 2 (one bucket against "
                       "several).")
  device = np.asarray(mesh.devices).flat[0]
  if elements is None:
    elements = DEFAULT_ELEMENTS["cpu" if device.platform == "cpu" else "other"]
  width = max(2, math.isqrt(int(elements)))
  kw = dict(units=units, width=width, estimator=estimator, density=density,
            headroom=headroom, axis_name=axis_name)
  one_mesh = jax.sharding.Mesh(np.array([device]), (axis_name,))
  steps = [early_step(one_mesh, strategy, **kw)
           for strategy in ("single", "layerwise")]
  with warnings.catch_warnings():   # the XLA flags are the caller's choice
    warnings.filterwarnings("ignore", "jaxfuse.send_early on GPU")
    one, each = time_calls([(step, *args) for step, args in steps],
                           warmup=warmup, repeats=repeats)
  c = max(0.0, (each - one) / (units - 1))
  return c, {"units": units, "elements": width * width, "one_bucket": one,
             "bucket_per_unit": each,
             "method": "send_early step on one device, one bucket against "
                       "one per layer"}


def early_step(mesh, strategy: str, *, units: int, width: int, estimator: str,
               density: float, headroom: float, axis_name: str = "data"):
  """(step, args): the jitted ``send_early`` step (gradient and
  ``sparse_sync`` update) of a tanh MLP of ``units`` (width, width) layers
  on ``mesh``, every layer sparse, planned as ``strategy``."""
  # pylint: disable=g-import-not-at-top
  from jaxfuse import overlap
  from jaxfuse import placement
  from jaxfuse import transform
  from jaxfuse.planning import planner
  # pylint: enable=g-import-not-at-top
  loss_fn, params, (x,) = synthetic_model(width, layers=units, batch=8)
  plan = planner.plan(params, density=density, strategy=strategy,
                      estimator=estimator, headroom=headroom,
                      min_sparse_size=1, loss_fn=loss_fn, example_args=(x,))
  opt = transform.sparse_sync(plan, axis_name=axis_name)
  params = jax.device_put(params, NamedSharding(mesh, P()))
  x = jax.device_put(x, NamedSharding(mesh, P()))
  state = placement.init_state(opt, params, mesh, axis_name=axis_name)
  specs = placement.state_specs(state, axis_name)

  def local(params, state, x):
    grads = jax.grad(loss_fn)(transform.local_params(params, axis_name), x)
    return opt.update(grads, state)
  step = _jit(jax.shard_map(overlap.send_early(local), mesh=mesh,
                            in_specs=(P(), specs, P()),
                            out_specs=(P(), specs)))
  return step, (params, state, x)
