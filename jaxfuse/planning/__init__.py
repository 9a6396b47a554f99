"""The offline wing: everything that makes or judges a plan before training.

costs (the cost model) ← profiling (measures it; backward, timing),
simulate (the timeline objective) ← optimal (exact grouping) ← strategies
(the papers' groupings) ← planner (the ``jaxfuse.plan`` front door) ← cli
(cli_show, cli_io), timeline_plot. ordering reads the backward-ready order
from the gradient's jaxpr; trace reads a measured step (its kernels, their
overlap) from a jax.profiler trace, the counterpart of simulate; hlo reads a
compiled step. Nothing here runs inside the train step; the step wing
(transform, sparsify, fusion, collectives, kernels) never imports this
package.
"""
