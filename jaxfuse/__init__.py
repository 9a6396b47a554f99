"""jaxfuse: sparsify-ahead, fused gradient synchronization for JAX (Optax).

  plan = jaxfuse.plan(params, density=0.01)
  opt = optax.chain(jaxfuse.sparse_sync(plan), optax.adamw(3e-4))
  step = jax.jit(train_step, compiler_options=jaxfuse.xla_options())
"""

from jaxfuse import kernels
from jaxfuse._compat import make_mesh
from jaxfuse.compile_options import xla_options
from jaxfuse.plans import BucketPlan
from jaxfuse.plans import LeafPlan
from jaxfuse.plans import Plan
from jaxfuse.plans import PlanError
from jaxfuse.plans import Settings
from jaxfuse.planner import COST_STRATEGIES
from jaxfuse.planner import STRATEGIES
from jaxfuse.planner import plan
from jaxfuse.transform import SparseSyncState
from jaxfuse.transform import SyncError
from jaxfuse.transform import SyncStats
from jaxfuse.transform import init_state
from jaxfuse.transform import local_params
from jaxfuse.transform import sparse_sync
from jaxfuse.transform import state_specs
from jaxfuse.transform import summarize
from jaxfuse.transform import sync_stats
from jaxfuse.version import __version__

__all__ = [
    "BucketPlan", "COST_STRATEGIES", "kernels", "LeafPlan", "Plan", "PlanError", "Settings", "STRATEGIES",
    "SparseSyncState", "SyncError", "SyncStats", "init_state", "local_params",
    "make_mesh", "plan", "sparse_sync", "state_specs", "summarize",
    "sync_stats", "xla_options", "__version__",
]
