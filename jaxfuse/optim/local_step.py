"""The step each worker runs inside ``shard_map`` (``make_train_step``).

Worker k differentiates its own loss L_k at ``local_params(params)``, so
g_k = ∇L_k(params) is its own gradient, not JAX's sum over the workers;
the optimizer syncs the g_k. What else leaves the worker is made the same
on every worker: the loss and float aux values as their mean
(1/K)·Σ_k x_k, integer aux values as their sum, and float model state
(BatchNorm statistics) as its mean.
"""

from __future__ import annotations

from typing import Callable

import jax
from jax import lax
import numpy as np
import optax

from jaxfuse import _compat
from jaxfuse import transform

_HOW_TO_ASK_FOR_AUX = "options=jaxfuse.StepOptions(has_aux=True)"


def per_worker_step(loss_fn: Callable, opt, has_aux: bool,
                    with_state: bool, axis: str,
                    grad_at: Callable | None = None) -> Callable:
  """The step one worker runs inside ``shard_map``.

  Args:
    loss_fn: the user's loss (``StepOptions`` says what it returns).
    opt: the phase's optax transform (it syncs the gradients).
    has_aux: ``loss_fn`` returns auxiliary outputs too.
    with_state: ``loss_fn`` takes and returns the model's state.
    axis: the workers' mesh axis.
    grad_at: ``grad_at(params, opt_state)``, the point each worker
      differentiates its loss at (``StepOptions.grad_at``); None: params.

  Returns:
    ``local(params, opt_state, model_state, batch) -> (params, opt_state,
    model_state, out)``, out the workers' mean loss (with aux).

  Raises:
    TypeError: (when traced) ``loss_fn`` returns other than the options
      say, or an integer model state that differs between workers.
  """

  def loss_and_rest(params, model_state, batch):
    if with_state:
      out = loss_fn(params, model_state, batch)
      _check_pair(out, "loss_fn(params, model_state, batch)",
                  "(loss, new_model_state)")
      loss, rest = out
      if has_aux:
        _check_pair(rest, "loss_fn(...)[1]", "(new_model_state, aux)")
        new_state, aux = rest
      else:
        new_state, aux = rest, None
    else:
      out = loss_fn(params, batch)
      if has_aux:
        _check_pair(out, "loss_fn(params, batch)", "(loss, aux)")
        loss, aux = out
      else:
        loss, aux = out, None
      new_state = None
    _check_scalar(loss)
    return loss, (new_state, aux)

  def local(params, opt_state, model_state, batch):
    at = params if grad_at is None else grad_at(params, opt_state)
    (loss, (new_state, aux)), grads = jax.value_and_grad(
        loss_and_rest, has_aux=True)(
            transform.local_params(at, axis), model_state, batch)
    updates, opt_state = opt.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    if with_state:
      new_state = worker_mean_state(new_state, model_state, axis)
    loss = lax.pmean(loss, axis)
    out = (loss, reduce_aux(aux, axis)) if has_aux else loss
    return params, opt_state, new_state, out

  return local


def _check_pair(out, what: str, expected: str) -> None:
  if not (isinstance(out, (tuple, list)) and len(out) == 2):
    raise TypeError(f"{what} returned {type(out).__name__}; it must return "
                    f"{expected}.")


def _check_scalar(loss) -> None:
  if isinstance(loss, (tuple, list, dict)):
    raise TypeError(
        f"loss_fn returned a {type(loss).__name__}, not a scalar loss; a "
        "loss with auxiliary outputs (loss, aux) needs "
        f"{_HOW_TO_ASK_FOR_AUX}, and one that updates model state "
        "StepOptions(model_state=initial_state).")
  if np.ndim(loss) != 0:
    raise TypeError(f"loss_fn returned an array of shape {np.shape(loss)}; "
                    "return the scalar loss (e.g. its mean over the rows).")


def worker_mean_state(new_state, old_state, axis: str):
  """``new_state`` with each float leaf that differs between the workers
  replaced by their mean (1/K)·Σ_k s_k; leaves equal on every worker pass
  as they are.

  Args:
    new_state: the model state ``loss_fn`` returned (inside ``shard_map``).
    old_state: the state it was given (the structure to keep).
    axis: the workers' mesh axis.

  Returns:
    The state, the same on every worker.

  Raises:
    TypeError: another structure than ``old_state``, or an integer leaf
      that differs between the workers (named).
  """
  if jax.tree.structure(new_state) != jax.tree.structure(old_state):
    raise TypeError(
        "loss_fn's new model state has another structure than "
        f"StepOptions.model_state ({jax.tree.structure(new_state)} against "
        f"{jax.tree.structure(old_state)}); return the whole state, updated.")

  def mean(path, x):
    if axis not in _compat.varying_axes(x):
      return x
    if _compat.is_float_value(x):
      return lax.pmean(x, axis)
    raise TypeError(
        f"model_state{jax.tree_util.keystr(path)}: an integer leaf that "
        "differs between the workers (it depends on the batch); keep such "
        "values float (they are averaged) or the same on every worker.")
  return jax.tree_util.tree_map_with_path(mean, new_state)


def reduce_aux(aux, axis: str):
  """aux over the workers: float leaves averaged, integer and boolean
  leaves summed (counts); leaves equal on every worker as they are.

  Args:
    aux: ``loss_fn``'s auxiliary outputs (inside ``shard_map``).
    axis: the workers' mesh axis.

  Returns:
    aux, the same on every worker.
  """
  def over(x):
    if axis not in _compat.varying_axes(x):
      return x
    if _compat.is_float_value(x):
      return lax.pmean(x, axis)
    if x.dtype == bool:
      x = x.astype(np.int32)
    return lax.psum(x, axis)
  return jax.tree.map(over, aux)
