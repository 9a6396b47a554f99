"""Pallas kernels, and the switch that picks them or their jnp references.

Every kernel has a pure-jnp reference with the same semantics. Dispatch:

  JAXFUSE_KERNELS=auto       (default) Pallas on GPU, the reference elsewhere
                             and on a JAX without Pallas's Triton backend
  JAXFUSE_KERNELS=pallas     always Pallas (off GPU: Pallas interpret mode,
                             slow, and not inside shard_map with check_vma=True)
  JAXFUSE_KERNELS=reference  never Pallas

or ``jaxfuse.kernels.set_backend(...)`` at run time (before tracing: the
choice is made when a function is traced, so jitted functions keep theirs).
"""

from __future__ import annotations

import os
import warnings

import jax

from jaxfuse import _compat
from jaxfuse.kernels import reference
from jaxfuse.kernels.reference import Blend, formed  # noqa: F401

BACKENDS = ("auto", "pallas", "reference")
_backend = os.environ.get("JAXFUSE_KERNELS", "auto")


def set_backend(name: str) -> None:
  """Force ``"pallas"`` or ``"reference"`` kernels, or go back to ``"auto"``.

  Args:
    name: one of ``BACKENDS``.

  Returns:
    None; ``backend()`` follows it from the next trace on.

  Raises:
    ValueError: ``name`` is not one of ``BACKENDS``.
  """
  global _backend
  if name not in BACKENDS:
    raise ValueError(f"kernel backend {name!r}; use one of {BACKENDS}.")
  _backend = name


class KernelError(RuntimeError):
  """Pallas kernels asked for where this JAX cannot run them."""


def backend() -> str:
  """The backend in force now: ``"pallas"`` or ``"reference"``.

  The kernels are written for Pallas's Triton backend (deprecated in JAX
  0.12). On a JAX without it, ``"auto"`` takes the reference, with one
  warning on GPUs, and ``"pallas"`` is a ``KernelError``.

  Returns:
    ``"pallas"`` or ``"reference"``.

  Raises:
    ValueError: ``JAXFUSE_KERNELS`` names no backend.
    KernelError: ``"pallas"`` forced where this JAX has no Pallas Triton
      backend.
  """
  if _backend not in BACKENDS:
    raise ValueError(f"JAXFUSE_KERNELS={_backend!r}; use one of {BACKENDS}.")
  has_triton = _compat.pallas_triton() is not None
  if _backend == "auto":
    if jax.default_backend() != "gpu":
      return "reference"
    if not has_triton:
      _warn_no_triton()
      return "reference"
    return "pallas"
  if _backend == "pallas" and not has_triton:
    raise KernelError(
        f"JAXFUSE_KERNELS=pallas: JAX {jax.__version__} has no Pallas "
        "Triton backend (jax.experimental.pallas.triton), which jaxfuse's "
        "kernels are written for. Use JAXFUSE_KERNELS=auto or reference "
        "(the XLA reference: the same results, bit for bit, a little "
        "slower on GPUs).")
  return _backend


_warned = False


def _warn_no_triton() -> None:
  global _warned
  if not _warned:
    _warned = True
    warnings.warn(
        f"jaxfuse: JAX {jax.__version__} has no Pallas Triton backend; "
        "the GPU kernels fall back to their XLA reference (the same "
        "results, bit for bit, in more and slower kernels a step).",
        RuntimeWarning, stacklevel=3)


def select(acc, tau, capacity: int, offset):
  """Fixed-capacity threshold selection (see ``reference.select``).

  Args:
    acc: the flat values to select from.
    tau: the threshold: candidates are |acc| ≥ τ, acc ≠ 0.
    capacity: c, the slots written.
    offset: where the rotated ranking of candidates starts.

  Returns:
    (values[c], indices[c] int32 with the sentinel n in unused slots, the
    true candidate count m).

  Raises:
    ValueError: ``JAXFUSE_KERNELS`` names no backend.
    KernelError: ``"pallas"`` forced where this JAX has no Pallas Triton
      backend.
  """
  if backend() == "pallas":
    from jaxfuse.kernels import selection  # pylint: disable=g-import-not-at-top
    return selection.select_pallas(
        acc, tau, capacity, offset,
        interpret=jax.default_backend() != "gpu")
  return reference.select(acc, tau, capacity, offset)


def sparsify_pass(x, r, tau, capacity: int, offset):
  """acc = x + r, its selection, the new residual and the unit's checks in
  one pass (``fused_pass.sparsify_pass_reference``; the Pallas kernels for
  float32 x and r, the reference for narrower ones).

  Args:
    x: the unit's flat gradient.
    r: its residual (the same shape).
    tau: the selection threshold.
    capacity: the slots written.
    offset: where the rotated ranking starts.

  Returns:
    The ``PassResult`` (selection, new residual, checks).

  Raises:
    ValueError: ``JAXFUSE_KERNELS`` names no backend.
    KernelError: ``"pallas"`` forced where this JAX has no Pallas Triton
      backend.
  """
  from jaxfuse.kernels import fused_pass  # pylint: disable=g-import-not-at-top
  if backend() == "pallas" and x.dtype == r.dtype == jax.numpy.float32:
    return fused_pass.sparsify_pass_pallas(
        x, r, tau, capacity, offset,
        interpret=jax.default_backend() != "gpu",
        scan_blocks=fused_pass.SCAN_IN_PASS2_BLOCKS)
  return fused_pass.sparsify_pass_reference(x, r, tau, capacity, offset)


def _pass_in_pallas(xs, r) -> bool:
  """Whether the fused pass of streams ``xs`` (any pytree of them) and
  residual r runs as Pallas kernels: their backend, float32 throughout."""
  f32 = jax.numpy.dtype("float32")
  return (backend() == "pallas" and
          {x.dtype for x in jax.tree.leaves(xs)} == {r.dtype} == {f32})


def sparsify_pass_rows(xs, r, taus, capacity: int, offsets):
  """``sparsify_pass`` of G units of one length at once: x is ``xs`` (a
  (G, n) array, or flat rows and (rows, n) chunks in row order, which the
  Pallas kernels read where they are; or a ``reference.Blend`` of two
  such, which they form as they read it), x_i its row i, r_i = ``r[i]``,
  τ_i = ``taus[i]``, o_i = ``offsets[i]``; a ``PassResult`` with a leading
  axis of G (``fused_pass.sparsify_pass_rows_reference``).

  Args:
    xs: the G units' streams (see above).
    r: the residuals, (G, n).
    taus: the thresholds, (G,).
    capacity: the slots written per unit.
    offsets: the rotated rankings' starts, (G,).

  Returns:
    A ``PassResult`` with a leading axis of G.

  Raises:
    ValueError: ``JAXFUSE_KERNELS`` names no backend.
    KernelError: ``"pallas"`` forced where this JAX has no Pallas Triton
      backend.
  """
  from jaxfuse.kernels import fused_pass  # pylint: disable=g-import-not-at-top
  if _pass_in_pallas(xs, r):
    return fused_pass.sparsify_pass_rows_pallas(
        xs, r, taus, capacity, offsets,
        interpret=jax.default_backend() != "gpu",
        scan_blocks=fused_pass.SCAN_IN_PASS2_BLOCKS)
  return fused_pass.sparsify_pass_rows_reference(xs, r, taus, capacity,
                                                 offsets)


def sparsify_pass_bucket(batches):
  """``sparsify_pass_rows`` of each batch of a bucket, ``batches`` a list
  of (xs, r, taus, capacity, offsets); the float32 batches' Pallas kernels
  as segments of one call per pass
  (``fused_pass.sparsify_pass_bucket_pallas``).

  Args:
    batches: a list of (xs, r, taus, capacity, offsets), one per batch of
      units of one length (``sparsify_pass_rows``' arguments).

  Returns:
    One ``PassResult`` per batch, in order.

  Raises:
    ValueError: ``JAXFUSE_KERNELS`` names no backend.
    KernelError: ``"pallas"`` forced where this JAX has no Pallas Triton
      backend.
  """
  from jaxfuse.kernels import fused_pass  # pylint: disable=g-import-not-at-top
  fast = [i for i, (xs, r, *_) in enumerate(batches)
          if _pass_in_pallas(xs, r)]
  out = [None] * len(batches)
  if fast:
    xs, r, taus, capacities, offsets = zip(*[batches[i] for i in fast])
    got = fused_pass.sparsify_pass_bucket_pallas(
        list(xs), list(r), list(taus), tuple(capacities), list(offsets),
        interpret=jax.default_backend() != "gpu",
        scan_blocks=fused_pass.SCAN_IN_PASS2_BLOCKS)
    for i, result in zip(fast, got):
      out[i] = result
  return [o if o is not None else
          fused_pass.sparsify_pass_rows_reference(*batch)
          for o, batch in zip(out, batches)]


def kth_largest_magnitude(x, k: int):
  """Exact k-th largest |x| (``threshold.kth_largest_magnitude``: a sampled
  bracket, the band kernel, a sort of the band). On the Pallas backend from
  ``threshold.PAYS_FROM`` elements (``BATCHED_PAYS_FROM`` per row under
  vmap); below, and on other backends, ``lax.top_k``, which is then faster.

  Args:
    x: the values (flat, or batched under ``vmap``).
    k: the rank, 1 <= k <= x.size.

  Returns:
    The k-th largest |x|, a scalar of x's dtype.

  Raises:
    ValueError: ``JAXFUSE_KERNELS`` names no backend.
    KernelError: ``"pallas"`` forced where this JAX has no Pallas Triton
      backend.
  """
  from jaxfuse.kernels import threshold  # pylint: disable=g-import-not-at-top
  if backend() == "pallas":              # it takes the reference below those
    return threshold.kth_largest_magnitude(
        x, k, interpret=jax.default_backend() != "gpu",
        pays_from=(threshold.PAYS_FROM, threshold.BATCHED_PAYS_FROM))
  return threshold.kth_largest_magnitude_reference(x, k)
