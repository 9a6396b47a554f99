"""The recipes' arguments and the warnings their steps give.

The options groups every recipe takes (``RecipeOptions``, ``SGDOptions``),
0.2's keyword spellings they replace (a ``DeprecationWarning`` until 0.4),
the checks that name a bad hyperparameter, and the warnings a step gives
once a process: ``onebit_adamw``'s sparse step before any dense step (it
trains nothing) and a gradient with a NaN or Inf.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from jaxfuse import _compat
from jaxfuse.optim import clipping
from jaxfuse import plans
from jaxfuse import transform


# What each recipe fixes when its step is traced (the state's layout, a
# branch, a kernel's constants): ``optax.inject_hyperparams`` must keep
# these static; the others (learning_rate, weight_decay, eps) may be
# injected and changed between steps. ``betas`` and the options groups
# are tuples, which optax keeps static anyway.
STATIC_ARGS = {
    "sgd": ("momentum", "sgd_options", "options"),
    "local_adamw": ("betas", "options"),
    "sync_adamw": ("betas", "options"),
    "onebit_adamw": ("betas", "options"),
    "demo": ("momentum", "options"),
    "local_steps": ("every", "options"),
}


class RecipeOptions(NamedTuple):
  """What every recipe takes besides its hyperparameters.

  Attributes:
    clip_norm: clip each bucket at its share of clip_norm·√K
      (``jaxfuse.clipping``; ``sync_adamw``: the synced gradient's global
      norm); None: no clipping.
    mask: optax's weight-decay mask (a tree of bools or a callable).
    axis_name: the workers' mesh axis, or a tuple of axes.
  """
  clip_norm: float | None = None
  mask: Any = None
  axis_name: str | tuple = "data"


class SGDOptions(NamedTuple):
  """``jaxfuse.sgd``'s momentum settings besides m (DGC, Lin et al. 2018).

  Attributes:
    nesterov: DGC's Nesterov form u ← m·(u + g), sending g + u.
    mask_momentum: DGC's factor masking: zero the velocity where sent.
    residual_decay: d in (0, 1]: r ← d·r before the next velocity is
      added (``sparse_sync``); 1 keeps full error feedback.
  """
  nesterov: bool = False
  mask_momentum: bool = False
  residual_decay: float = 1.0


# 0.2's keyword arguments -> their 0.3 spelling (removed in 0.4)


# 0.2's keyword arguments -> their 0.3 spelling (removed in 0.4)
_MOVED = {"clip_norm": "options=jaxfuse.RecipeOptions(clip_norm=...)",
          "mask": "options=jaxfuse.RecipeOptions(mask=...)",
          "axis_name": "options=jaxfuse.RecipeOptions(axis_name=...)",
          "b1": "betas=(b1, b2)", "b2": "betas=(b1, b2)",
          "nesterov": "sgd_options=jaxfuse.SGDOptions(nesterov=...)",
          "mask_momentum":
              "sgd_options=jaxfuse.SGDOptions(mask_momentum=...)",
          "residual_decay":
              "sgd_options=jaxfuse.SGDOptions(residual_decay=...)"}


def upgrade(where: str, allowed: tuple) -> Callable[[dict], dict]:
  """The keyword upgrade of recipe ``where``, for
  ``_deprecated.legacy_keywords``: 0.2's keywords (those of ``allowed``)
  folded into ``betas=``, ``sgd_options=`` and ``options=``, with one
  ``DeprecationWarning`` naming each new spelling.

  Args:
    where: the recipe's name, for the message.
    allowed: the 0.2 keywords it took (``b1``, ``b2``, the fields of
      ``SGDOptions`` and ``RecipeOptions``).

  Returns:
    ``kwargs -> kwargs``; any other keyword passes through untouched (the
    recipe's own ``TypeError`` names an unknown one).

  Raises:
    Nothing itself; the recipe checks what it is given.
  """
  def run(kwargs: dict) -> dict:
    old = {k: kwargs.pop(k) for k in list(kwargs) if k in allowed}
    if not old:
      return kwargs
    warnings.warn(
        f"{where}: " + "; ".join(f"{k}= is now {_MOVED[k]}" for k in old)
        + " (the old keywords go in 0.4).", DeprecationWarning, stacklevel=3)
    for name, kind in (("options", RecipeOptions),
                       ("sgd_options", SGDOptions)):
      fields = {k: old[k] for k in kind._fields if k in old}
      base = kwargs.get(name)
      base = kind() if base is None else base
      if fields and isinstance(base, kind):   # else the recipe names it
        kwargs[name] = base._replace(**fields)
    if "b1" in old or "b2" in old:
      pair = kwargs.get("betas", (0.9, 0.999))
      if isinstance(pair, (tuple, list)) and len(pair) == 2:
        kwargs["betas"] = (old.get("b1", pair[0]), old.get("b2", pair[1]))
    return kwargs
  return run


def options(where: str, options, kind=RecipeOptions,
            keyword: str = "options"):
  """``options`` (a recipe's ``keyword``), default ``kind()``;
  ``SyncError`` for another kind."""
  if options is None:
    options = kind()
  if not isinstance(options, kind):
    fields = ", ".join(f"{f}=..." for f in kind._fields)
    raise transform.SyncError(
        f"{where}: {keyword}={options!r} must be a jaxfuse.{kind.__name__}"
        f"({fields}).")
  return options


def betas(where: str, pair) -> tuple:
  """(b1, b2) from ``pair`` (a recipe's ``betas``)."""
  if isinstance(pair, (int, float, np.number)) and not isinstance(
      pair, bool):
    raise transform.SyncError(
        f"{where}: betas={pair!r} is one number; pass betas=(b1, b2), e.g. "
        "(0.9, 0.999) (0.2's positional b1, b2 are now this pair).")
  if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
    raise transform.SyncError(f"{where}: betas={pair!r} must be (b1, b2), "
                              "e.g. (0.9, 0.999).")
  return (pair[0], pair[1])


def numbers(where: str, **values) -> list:
  """``values`` as Python numbers where given as numbers (numpy scalars,
  concrete JAX scalars: ``plan_checks.as_python``); a traced value stays
  traced, unless it is one of ``STATIC_ARGS[where]`` (``SyncError``)."""
  traced = [name for name in STATIC_ARGS[where]
            if _compat.is_tracer(values.get(name))]
  if traced:
    raise transform.SyncError(
        f"{where}: {', '.join(traced)} must be known when the step is "
        "traced (each shapes the state or the program), not traced. "
        "With optax.inject_hyperparams keep them static: "
        f"optax.inject_hyperparams(jaxfuse.{where}, "
        f"static_args=jaxfuse.optim.recipes.STATIC_ARGS[{where!r}]).")
  out = [plans.as_python(v) for v in values.values()]
  for name, v in zip(values, out):
    numeric = isinstance(v, (np.ndarray, jax.Array)) and (
        jnp.issubdtype(v.dtype, jnp.number))
    if not ((v is None and name == "clip_norm") or callable(v) or
            _compat.is_tracer(v) or numeric or
            (isinstance(v, (int, float)) and not isinstance(v, bool))):
      raise transform.SyncError(
          f"{where}: {name}={v!r} must be a number (or, for "
          "learning_rate, an optax schedule), e.g. 0.05, not "
          f"{'None' if v is None else 'a ' + type(v).__name__}.")
  return out


def check_clip(max_norm):
  try:
    clipping.check_max_norm(max_norm)
  except clipping.ClipError as e:
    raise transform.SyncError(str(e)) from None


def _nonfinite_seen(name: str, plan: plans.Plan, flags) -> None:
  flags = np.asarray(flags).reshape(-1)
  key = ("nonfinite", name)
  if key in _warned or not flags.any():
    return
  _warned.append(key)
  paths = [plan.leaves[j].path for j in np.flatnonzero(flags)
           if j < len(plan.leaves)]
  more = f" and {len(paths) - 5} more" if len(paths) > 5 else ""
  warnings.warn(
      f"{name}: a gradient had a NaN or Inf (leaves "
      f"{', '.join(paths[:5])}{more}): the "
      "loss or the learning rate has diverged. Its residual was kept, but "
      "the update of these leaves is not finite. Lower the learning rate "
      "(or the momentum), clip (clip_norm=), or skip such steps with "
      "jaxfuse.apply_if_finite(optimizer, max_consecutive_errors); "
      "jaxfuse.summarize(jaxfuse.sync_stats(state), plan) counts them "
      "each step.", UserWarning, stacklevel=2)


def warn_if_nonfinite(name: str, plan: plans.Plan, stats) -> None:
  """Warn (once a process and recipe) when a step's gradient had a NaN or
  Inf (``SyncStats.nonfinite``), for concrete stats (a step run eagerly).

  Under ``jit`` nothing is added to the step: a host callback there, even
  under a ``lax.cond``, makes a GPU wait for the host at every step. The
  step builder reports a non-finite loss instead (``step_watch``), and
  ``jaxfuse.summarize`` counts the leaves each step."""
  flags = stats.nonfinite
  if not _compat.is_tracer(flags):
    _nonfinite_seen(name, plan, flags)


NO_DENSE_STEP = (
    "onebit_adamw: a sparse step ran before any dense step, so the second "
    "moment v is still 0 and frozen and every update is zero: this run "
    "trains nothing. Start with dense steps, e.g. jaxfuse.density_warmup("
    "plan, dense_steps=..., steps=...), and step each phase with "
    "onebit_adamw(phase.plan, ...).")


_warned = []


def _no_dense_step_seen():
  if "no dense step" not in _warned:
    _warned.append("no dense step")
    warnings.warn(NO_DENSE_STEP, UserWarning, stacklevel=2)


def warn_if_no_dense_step(nu_count) -> None:
  """Warn (once a process) when a sparse step finds ``nu_count == 0``, for
  a concrete count (a step run eagerly, or the step builder's check when a
  sparse phase starts: ``step_watch.check_dense_before_sparse``). Under
  ``jit`` nothing is added to the step (no host callback: see
  ``warn_if_nonfinite``)."""
  if not _compat.is_tracer(nu_count) and int(nu_count) == 0:
    _no_dense_step_seen()


def check_betas(where: str, upper_closed: bool = False, **betas):
  """Each of ``betas`` in [0, 1) (``upper_closed``: (0, 1]); a traced
  one (``optax.inject_hyperparams``) is not checked."""
  for name, value in betas.items():
    transform.check_rate(where, name, value,
                         "(0, 1]" if upper_closed else "[0, 1)",
                         traced_ok=True)
