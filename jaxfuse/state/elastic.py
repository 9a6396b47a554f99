"""Elastic restart: per-worker state saved on K workers, resumed on K'.

The synchronized update is the mean over workers, so what the workers owe
is (1/K)·Σ_k r_k (and the momentum they carry is (1/K)·Σ_k u_k). Old worker
k covers the share I_k = [k/K, (k+1)/K) of [0, 1), new worker j the share
J_j = [j/K', (j+1)/K'); with

  B_jk = K'·|J_j ∩ I_k|      (Σ_k B_jk = 1,  Σ_j B_jk = K'/K)

a float leaf (residuals, velocities, a recipe's per-worker moments,
thresholds and controller scales) becomes x'_j = Σ_k B_jk·x_k, a weighted
mean of the old workers j covers, and

  (1/K')·Σ_j x'_j = (1/K')·Σ_k (K'/K)·x_k = (1/K)·Σ_k x_k :

the owed update is kept exactly (to float rounding), for any K and K'.
K' = K/c gives each new worker the mean of c old ones; K' = c·K copies each
old worker's state to c new ones (their sum is then c times the old one's,
and so is the number of workers). Integer and bool leaves (step counters,
controller flags, the last step's stats) take the value of the old worker
that covers most of the new one's share (the first on a tie).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def shares(num_old: int, num_new: int) -> np.ndarray:
  """B, (num_new, num_old): B_jk = K'·|J_j ∩ I_k| (module docstring).

  Args:
    num_old: K, the old worker count (>= 1).
    num_new: K', the new worker count (>= 1).

  Returns:
    B, a (num_new, num_old) float64 array.

  Raises:
    ValueError: a worker count < 1.
  """
  if num_old < 1 or num_new < 1:
    raise ValueError(f"worker counts must be >= 1, got {num_old} -> "
                     f"{num_new}.")
  # Integer endpoints in units of 1/(K·K'): I_k = [k·K', (k+1)·K'), J_j =
  # [j·K, (j+1)·K); B_jk = K'·overlap/(K·K') = overlap / K.
  lo_new = np.arange(num_new)[:, None] * num_old
  lo_old = np.arange(num_old)[None, :] * num_new
  overlap = np.clip(np.minimum(lo_new + num_old, lo_old + num_new) -
                    np.maximum(lo_new, lo_old), 0, None)
  return overlap / num_old


def resize(x: np.ndarray, num_new: int) -> np.ndarray:
  """One per-worker leaf (leading axis K) on ``num_new`` workers.

  Args:
    x: the leaf, leading axis K (the old worker count).
    num_new: K', the new worker count (>= 1).

  Returns:
    The leaf with leading axis K', the same worker mean (``shares``).

  Raises:
    ValueError: a worker count < 1.
  """
  b = shares(x.shape[0], num_new)
  if jnp.issubdtype(x.dtype, jnp.floating):
    return np.tensordot(b, x.astype(np.float64), axes=1).astype(x.dtype)
  return x[np.argmax(b, axis=1)]


def resize_tree(tree: Any, per_worker: Any, num_new: int) -> Any:
  """``resize`` on the leaves ``per_worker`` marks (a tree of bools of the
  same structure: ``jaxfuse.per_worker_mask``); the rest as they are.

  Args:
    tree: a pytree of host arrays.
    per_worker: the same structure of bools.
    num_new: K', the new worker count (>= 1).

  Returns:
    ``tree`` with its marked leaves on K' workers.

  Raises:
    ValueError: a worker count < 1.
  """
  return jax.tree.map(lambda x, m: resize(np.asarray(x), num_new) if m else x,
                      tree, per_worker)


def owed(tree: Any, per_worker: Any) -> list[np.ndarray]:
  """The worker mean (1/K)·Σ_k x_k of each marked float leaf (float64):
  what ``resize_tree`` keeps.

  Args:
    tree: a pytree of host arrays (per-worker leaves: leading axis K).
    per_worker: the same structure of bools marking the per-worker leaves.

  Returns:
    One float64 array per marked float leaf, in leaf order.

  Raises:
    Nothing of its own.
  """
  return jax.tree.leaves(jax.tree.map(   # None marks no leaf: dropped
      lambda x, m: np.asarray(x, np.float64).mean(0)
      if m and jnp.issubdtype(x.dtype, jnp.floating) else None,
      tree, per_worker))
