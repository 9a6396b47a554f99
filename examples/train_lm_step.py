"""examples/train_lm.py's training step.

The jaxfuse modes train with ``jaxfuse.make_train_step``: ``step_options``
turns the flags into its ``StepOptions`` and ``with_flushes`` adds
``--flush-every``'s density-1 steps to the warm-up's phases. ``--sync
dense`` trains with ``DenseStep``, written with the low-level API
(``make_train_step`` here), as benchmarks/overhead.py's steps are.
"""

from __future__ import annotations

import jax
import optax
from jax.sharding import PartitionSpec as P

import jaxfuse
from jaxfuse.state.simulated import worker_map
from train_lm_args import AXIS
from train_lm_args import SEND_EARLY_WINDOW


def make_train_step(loss_fn, opt, mesh, opt_specs, sync: str,
                    compiler_options=None, grad_dtype=None, send_early=False,
                    window=SEND_EARLY_WINDOW, predict=False):
  """jit(shard_map(step)) (a vmap over the workers on a
  ``jaxfuse.simulated_mesh``): (params, opt_state, batch) -> same + mean loss,
  written with the low-level API: ``--sync dense``'s step (``DenseStep``)
  and benchmarks/overhead.py's. The jaxfuse modes train with
  ``jaxfuse.make_train_step``, which computes the same.
  ``grad_dtype``: differentiate a copy of the parameters in this dtype (the
  gradients, and what the sync sends, are in it; params stay float32).
  ``send_early``: the step under ``jaxfuse.send_early`` with ``window``
  (0: unbounded). ``predict``: the gradient at
  ``jaxfuse.predicted_params`` (``opt`` is ``jaxfuse.delayed(...,
  predict=True)``)."""
  def local(params, opt_state, batch):
    # Each worker's own gradient of its own shard of the batch.
    at = jaxfuse.predicted_params(params, opt_state) if predict else params
    loss, grads = jax.value_and_grad(loss_fn)(
        cast_params(jaxfuse.local_params(at, AXIS), grad_dtype), batch)
    if sync == "dense":
      grads = jax.lax.pmean(grads, AXIS)
    updates, opt_state = opt.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state,
            jax.lax.pmean(loss, AXIS))
  if send_early:
    local = jaxfuse.send_early(local, window=window or None)
  step = worker_map(local, mesh, (P(), opt_specs, P(AXIS)),
                    (P(), opt_specs, P()))
  return jax.jit(step, donate_argnums=(0, 1),
                 compiler_options=compiler_options or None)


def cast_params(tree, dtype):
  """``tree`` with every leaf cast to ``dtype`` (None: ``tree``)."""
  return tree if dtype is None else jax.tree.map(
      lambda x: x.astype(dtype), tree)


def step_options(args, grad_dtype, xla_options) -> jaxfuse.StepOptions:
  """The step builder's options for the flags: where each worker takes its
  gradient (``--predict``: at ``jaxfuse.predicted_params``; ``--grad-dtype``:
  at a copy in that dtype), ``--send-early`` with its window, and the XLA
  options (``--xla-option``, ``--xla-defaults``).

  Args:
    args: the parsed flags (``train_lm_args.parse_args``).
    grad_dtype: ``--grad-dtype`` (None: float32, the params' own).
    xla_options: the XLA options the step compiles with.

  Returns:
    The ``jaxfuse.StepOptions`` for ``jaxfuse.make_train_step``.
  """
  def grad_at(params, opt_state):
    at = (jaxfuse.predicted_params(params, opt_state) if args.predict
          else params)
    return cast_params(at, grad_dtype)
  moved = args.predict or grad_dtype is not None
  return jaxfuse.StepOptions(
      grad_at=grad_at if moved else None,
      send_early=args.send_early_window if args.send_early else False,
      compiler_options=xla_options)


def with_flushes(phases, flush_plan, every: int, steps: int) -> tuple:
  """``phases`` with every ``every``-th step (steps every-1, 2·every-1, ...
  below ``steps``) on ``flush_plan`` (``--flush-every``).

  Args:
    phases: the warm-up's ``jaxfuse.Phase``s.
    flush_plan: the density-1 plan (None: no flushes).
    every: ``--flush-every`` (0: no flushes).
    steps: the run's steps.

  Returns:
    The phases to give ``jaxfuse.make_train_step``: one plan object per
    plan, so that each compiles once; ``phases`` without flushes.
  """
  if not every or flush_plan is None:
    return tuple(phases)
  plan_at = [flush_plan if (s + 1) % every == 0 else
             phases[jaxfuse.phase_index(phases, s)].plan
             for s in range(steps)]
  out, first = [], 0
  for s in range(1, steps + 1):
    if s == steps or plan_at[s] is not plan_at[first]:
      out.append(jaxfuse.Phase(first, s, plan_at[first]))
      first = s
  last = out.pop()   # to the end (no step past the run's trains)
  out.append(jaxfuse.Phase(last.start, None, last.plan))
  return tuple(out)


class DenseStep:
  """``--sync dense``'s step, with ``jaxfuse.TrainStep``'s interface:
  a plain ``pmean`` of the gradients, then the dense twin of the optimizer
  (AdamW, or SGD with momentum), with no ``jaxfuse.sparse_sync``.

  Hand-written, not built by ``jaxfuse.make_train_step``. The builder
  steps only an optimizer that holds a ``sparse_sync``; through it, the
  dense baseline would be ``optax.chain(jaxfuse.sparse_sync(all-dense
  plan), twin)``, whose float32 steps are bitwise these (the sync of an
  all-dense plan is a ``pmean``), but (1) with ``--grad-dtype bfloat16``
  the builder keeps the optimizer state in the gradients' dtype, where
  this step keeps the twin's state float32 (the baseline's numbers would
  change), and (2) its state would hold a sync state, so a ``--sync
  dense`` checkpoint saved before would no longer resume."""

  def __init__(self, loss_fn, opt, mesh, compiler_options):
    self.phases = (jaxfuse.Phase(0, None, None),)
    self._step = make_train_step(loss_fn, opt, mesh, P(), "dense",
                                 compiler_options)
    self._agreed = False

  def compiled(self, index: int):
    del index   # one phase
    return self._step

  def __call__(self, state, batch):
    args = (state.params, state.opt_state, batch)
    if jax.process_count() > 1 and not self._agreed:
      # Programs whose collectives differ between processes would hang:
      # compare them first (the call below runs this compiled program).
      jaxfuse.check_same_collectives(self._step.lower(*args).compile(),
                                     what="the dense step")
      self._agreed = True
    params, opt_state, loss = self._step(*args)
    return state._replace(params=params, opt_state=opt_state,
                          step=state.step + 1), loss
