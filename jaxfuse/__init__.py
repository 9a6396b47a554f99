"""jaxfuse: sparsify-ahead, fused gradient synchronization for JAX (Optax).

  mesh = jaxfuse.make_mesh()                       # axis "data"
  plan = jaxfuse.plan(params, density=0.05)
  state = jaxfuse.init_state(jaxfuse.onebit_adamw(plan, 3e-4), params, mesh)
  specs = jaxfuse.state_specs(state)               # P("data") per worker
  for phase in jaxfuse.density_warmup(plan, dense_steps=250, steps=50):
    opt = jaxfuse.onebit_adamw(phase.plan, 3e-4)   # or jaxfuse.sgd(plan, 0.1)
    # local(params, state, batch): grads of jaxfuse.local_params(params),
    # then opt.update (the README's Quickstart)
    step = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), specs,
                   P("data")), out_specs=(P(), specs, P())),
                   compiler_options=jaxfuse.xla_options())
    ...                                  # steps phase.start .. phase.stop
"""

from jaxfuse import _deprecated
from jaxfuse.state import checkpoint
from jaxfuse.optim import clipping
from jaxfuse import collectives
from jaxfuse.state import elastic
from jaxfuse.sync import grouped
from jaxfuse import kernels
from jaxfuse._compat import make_mesh
from jaxfuse.sync.agreement import CollectivesDifferError
from jaxfuse.sync.agreement import check_same_collectives
from jaxfuse.optim.compile_options import xla_flags
from jaxfuse.optim.compile_options import xla_options
from jaxfuse.optim.delay import DelayedState
from jaxfuse.optim.delay import delayed
from jaxfuse.optim.delay import predicted_params
from jaxfuse.optim.nonfinite import ApplyIfFiniteState
from jaxfuse.optim.nonfinite import apply_if_finite
from jaxfuse.optim.overlap import send_early
from jaxfuse.optim import StepOptions
from jaxfuse.optim import TrainState
from jaxfuse.optim import make_train_step
from jaxfuse.plans import BucketPlan
from jaxfuse.plans import Estimation
from jaxfuse.plans import LeafPlan
from jaxfuse.plans import Plan
from jaxfuse.plans import PlanError
from jaxfuse.plans import Settings
from jaxfuse.planning.planner import COST_STRATEGIES
from jaxfuse.planning.planner import STRATEGIES
from jaxfuse.optim.phases import Phase
from jaxfuse.optim.phases import check_phases
from jaxfuse.optim.phases import density_warmup
from jaxfuse.optim.phases import phase_index
from jaxfuse.optim.phases import with_density
from jaxfuse.planning.planner import plan
from jaxfuse.optim.local_steps import LocalStepsState
from jaxfuse.optim.local_steps import inner_params
from jaxfuse.optim.local_steps import local_steps
from jaxfuse.optim.recipes import RECIPES
from jaxfuse.optim.recipes import RecipeOptions
from jaxfuse.optim.recipes import SGDOptions
from jaxfuse.optim.recipes import demo
from jaxfuse.optim.recipes import first_moment
from jaxfuse.optim.recipes import local_adamw
from jaxfuse.optim.recipes import local_clip_by_global_norm
from jaxfuse.optim.recipes import onebit_adamw
from jaxfuse.optim.recipes import second_moment
from jaxfuse.optim.recipes import second_moment_change
from jaxfuse.optim.recipes import sgd
from jaxfuse.optim.recipes import sync_adamw
from jaxfuse.transform import SparseSyncState
from jaxfuse.transform import SyncError
from jaxfuse.stats import SyncStats
from jaxfuse.state.placement import init_state
from jaxfuse.transform import local_params
from jaxfuse.transform import per_worker
from jaxfuse.transform import per_worker_mask
from jaxfuse.transform import PerWorkerState
from jaxfuse.transform import sparse_sync
from jaxfuse.state.placement import state_specs
from jaxfuse.state.simulated import simulated_mesh
from jaxfuse.state.simulated import vmap_workers
from jaxfuse.state.relayout import relayout
from jaxfuse.stats import summarize
from jaxfuse.transform import sync_stats
from jaxfuse.transform import unit_residuals
from jaxfuse.version import __version__

__all__ = [
    "ApplyIfFiniteState", "apply_if_finite", "BucketPlan", "COST_STRATEGIES",
    "CollectivesDifferError", "DelayedState", "Estimation",
    "check_same_collectives", "checkpoint",
    "clipping", "collectives", "delayed", "elastic",
    "first_moment", "grouped", "kernels",
    "LeafPlan", "LocalStepsState", "Phase",
    "PerWorkerState", "Plan", "PlanError", "RECIPES", "RecipeOptions",
    "SGDOptions", "Settings", "STRATEGIES",
    "SparseSyncState", "StepOptions", "SyncError", "SyncStats", "TrainState",
    "check_phases", "demo",
    "density_warmup", "init_state", "inner_params", "local_adamw",
    "local_clip_by_global_norm", "local_params", "local_steps", "make_mesh",
    "make_train_step", "onebit_adamw", "per_worker",
    "per_worker_mask", "phase_index", "plan", "predicted_params", "relayout",
    "second_moment", "second_moment_change", "send_early", "sgd",
    "simulated_mesh", "sparse_sync", "state_specs", "summarize",
    "sync_adamw",
    "sync_stats", "unit_residuals", "vmap_workers", "with_density",
    "xla_flags", "xla_options", "__version__",
]

_deprecated.install()


def __getattr__(name: str):
  """0.1's ``jaxfuse.costs``, ``jaxfuse.simulate``, ... (moved to
  ``jaxfuse.planning`` in 0.2) with a DeprecationWarning; removed in 0.4."""
  if name in _deprecated.MOVED_MODULES:
    return _deprecated.moved_module(name)
  raise AttributeError(f"module 'jaxfuse' has no attribute {name!r}")
