"""Sparsify one selection unit: threshold, fixed-capacity selection, residual.

For a unit (one leaf, or one fused "behind" buffer) with flat gradient g and
residual r, one step is::

  acc = g + r
  τ   = scale · estimate(|acc|)            (or the τ kept in state)
  M   = { i : |acc_i| ≥ τ, acc_i ≠ 0 }      (true count m = |M|)
  (v, idx) = first c members of M in a rotated order starting at a random
             offset, so overflow never favours low indices
  r'  = acc − scatter(idx, v)               (exactly: acc with sent slots
                                             zeroed)

If M is empty but acc is not zero, the largest |acc_i| is sent alone, so no
non-zero unit ever goes a step without sending (SAFusion's "no tensor
missing" holds by construction, whatever the estimator did).

Empty slots carry the sentinel index n, which decoding drops.
A controller (SparDL Alg. 2, in log τ) moves ``scale`` so m tracks k = ⌈ρ·n⌉.
It records the k it tracks: when a unit's k changes (a warm-up phase or a
``relayout`` to another density), τ is estimated afresh and the controller's
step starts again from ``INITIAL_LOG_STEP``, since both were tuned for the old k.

``sparsify_unit`` is that step for one unit. It is made of stages
(``sample_magnitudes``, ``unit_pass``, ``topk_finish``, ``unit_result``)
that ``bucket_pass`` runs over a whole bucket, each unit's k-th largest of
a sample found in one batched radix select (``radix_select``).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
from jax import lax
import jax.numpy as jnp
from jax.scipy.special import ndtri
import numpy as np

from jaxfuse import kernels
from jaxfuse.kernels import fused_pass
from jaxfuse.kernels.reference import hash32
from jaxfuse.kernels.reference import uniform_index
from jaxfuse.plans import ceil_product
from jaxfuse.plans import target_count
from jaxfuse.kernels.radix_select import kth_largest

MIN_LOG_STEP = 1e-3
MAX_LOG_STEP = 1.0
INITIAL_LOG_STEP = 0.1
MAX_LOG_SCALE = 12.0


class Selection(NamedTuple):
  """How a unit selects, fixed when the step is traced: its slots c, its
  density ρ, its estimator and the plan's ``Settings`` (``seed``, and
  the estimators' knobs in ``settings.estimation``: ``refresh``,
  ``feedback``, ``sample_fraction``, ``sidco_stages``)."""
  capacity: int
  density: float
  estimator: str
  settings: Any

  @classmethod
  def of(cls, unit, settings) -> "Selection":
    """The ``Selection`` of a ``plans.Unit`` under ``settings``."""
    return cls(unit.capacity, unit.density, unit.estimator, settings)

  def kw(self) -> dict:
    """density, estimator and settings as keywords (``sample_spec``,
    ``pass_capacity``, ``needs_topk_finish``)."""
    return dict(density=self.density, estimator=self.estimator,
                settings=self.settings)


class Tick(NamedTuple):
  """What varies step to step in a unit's threshold: the step, the unit's
  salt that step (``salt``) and, for a batch of units, whether any of them
  estimates τ afresh (``estimate_now``; None: the unit decides alone)."""
  step: jax.Array
  salt: jax.Array
  now: jax.Array | None = None


class Control(NamedTuple):
  """Per-unit threshold state (each field a float32/bool scalar per unit)."""
  threshold: jax.Array  # τ used last step, after feedback
  log_scale: jax.Array  # log of the multiplier applied to fresh estimates
  log_step: jax.Array   # signed step of the controller
  flag: jax.Array       # SparDL's "moved the right way once already"
  target: jax.Array     # the k they were tuned for (int32; 0: none yet)


def initial_control(num_units: int) -> Control:
  z = jnp.zeros((num_units,), jnp.float32)
  return Control(z, z, jnp.full((num_units,), INITIAL_LOG_STEP, jnp.float32),
                 jnp.zeros((num_units,), bool),
                 jnp.zeros((num_units,), jnp.int32))


# --- counter-based hashing (cheap randomness, no PRNG state) ------------------

def salt(seed: int, step, unit) -> jax.Array:
  """A uint32 drawn per (seed, step, unit); ``unit`` an int, or a sequence
  of them for one salt each."""
  word = np.asarray((np.asarray(unit, np.uint64) * 0x85EBCA6B) & 0xFFFFFFFF,
                    np.uint32)
  return hash32(hash32(jnp.uint32(seed) ^ (jnp.asarray(step, jnp.uint32) *
                                          jnp.uint32(0x9E3779B9)))
                ^ jnp.asarray(word))


# --- estimators: τ of acc = grad + residual --------------------------------
# "dgc" reads only its sample of acc and "topk" its bracket's sample
# (``sample_spec``: the k-th largest of a sample, batched across a bucket by
# ``bucket_pass``); "gaussian", "redsync" and "sidco" read all of |acc|
# (``ESTIMATORS``).

class Sample(NamedTuple):
  """The estimate is the ``rank``-th largest of ``size`` magnitudes of acc:
  all of them (``whole``) or drawn at uniform positions."""
  size: int
  rank: int
  whole: bool


def dgc_sample_spec(n: int, density: float, settings) -> Sample:
  """DGC's uniform sample: s = max(f·n, 256) positions (at most n),
  rank k_s = round(ρ·s) (at least 1)."""
  s = min(n, max(256, ceil_product(n, settings.estimation.sample_fraction)))
  return Sample(s, max(1, round(density * s)), False)


def sample_spec(n: int, *, density: float, estimator: str,
                settings) -> Sample | None:
  """What a unit's estimate is the k-th largest of: DGC's sample (when it
  is refreshed every step), or ``"topk"``'s bracket sample (``topk_bracket``;
  all of |acc| for a unit too small for one). None for the others."""
  if estimator == "dgc" and settings.estimation.refresh == 1:
    return dgc_sample_spec(n, density, settings)
  if estimator == "topk":
    k = target_count(density, n)
    s, r, wide = topk_bracket(k, n)
    return Sample(n, k, True) if wide >= n else Sample(s, r, False)
  return None


def sample_magnitudes(grad, residual, salt_, spec: Sample) -> jax.Array:
  """|acc| (float32) at ``spec.size`` positions drawn from ``salt_``, or all
  of it."""
  if spec.whole:
    return jnp.abs(grad + residual).astype(jnp.float32)
  idx = uniform_index(salt_, spec.size, grad.size)
  return jnp.abs(grad[idx] + residual[idx]).astype(jnp.float32)


def dgc_threshold(grad, residual, *, density, salt_, settings):
  """DGC: the k_s-th largest |acc| of a uniform sample of s = max(f·n, 256)
  elements, k_s = round(ρ·s); reads only the sampled elements."""
  spec = dgc_sample_spec(grad.size, density, settings)
  return kth_largest(sample_magnitudes(grad, residual, salt_, spec),
                     spec.rank)


def gaussian_threshold(a, *, density, salt_, settings, signed=None):
  """GaussianK: acc ~ N(μ, σ²) ⇒ P(|acc| ≥ τ) = ρ at
  τ = |μ| + σ·Φ⁻¹(1 − ρ/2)."""
  del salt_, settings
  x = a if signed is None else signed
  mu, sigma = jnp.mean(x), jnp.std(x)
  return jnp.abs(mu) + sigma * ndtri(1.0 - density / 2.0)


def redsync_threshold(a, *, density, salt_, settings, iterations=12):
  """RedSync: bisection on τ = mean + t·(max − mean), t ∈ [0, 1], towards k."""
  del salt_, settings
  k = target_count(density, a.size)
  lo, hi = jnp.mean(a), jnp.max(a)

  def body(_, bounds):
    lo, hi = bounds
    mid = 0.5 * (lo + hi)
    too_many = jnp.sum(a >= mid) > k
    return jnp.where(too_many, mid, lo), jnp.where(too_many, hi, mid)

  lo, hi = lax.fori_loop(0, iterations, body, (lo, hi))
  return hi


def sidco_threshold(a, *, density, salt_, settings):
  """SIDCo, multi-stage exponential fit.

  Stage j fits the exceedances a − τ_{j−1} (over a > τ_{j−1}) with an
  exponential of mean μ_j and sets τ_j = τ_{j−1} + μ_j·ln(1/δ), δ = ρ^(1/S),
  so that the stages multiply to a tail probability ρ.
  """
  del salt_
  stages = settings.estimation.sidco_stages
  log_inv_delta = -math.log(density) / stages
  tau = jnp.zeros((), a.dtype)
  for _ in range(stages):
    over = a > tau
    mu = jnp.sum(jnp.where(over, a - tau, 0)) / jnp.maximum(jnp.sum(over), 1)
    tau = tau + mu * log_inv_delta
  return tau


ESTIMATORS = {           # τ from all of a = |acc| (float32)
    "gaussian": gaussian_threshold,
    "redsync": redsync_threshold,
    "sidco": sidco_threshold,
}


def estimate_threshold(grad, residual, *, estimator, density, salt_,
                       settings):
  """τ of acc = grad + residual (unscaled), for every estimator but
  ``"topk"``."""
  if estimator == "dgc":
    return dgc_threshold(grad, residual, density=density, salt_=salt_,
                         settings=settings)
  acc = grad + residual
  a = jnp.abs(acc).astype(jnp.float32)
  if estimator == "gaussian":
    return gaussian_threshold(a, density=density, salt_=salt_,
                              settings=settings, signed=acc.astype(jnp.float32))
  return ESTIMATORS[estimator](a, density=density, salt_=salt_,
                               settings=settings)


def controller(ctrl_unit: Control, count, target: int, tau) -> Control:
  """SparDL Alg. 2 on log τ: keep moving while right (doubling every second
  step), reverse and halve when the count crosses the target. A state tuned
  for another target starts again from ``INITIAL_LOG_STEP`` (``rearmed``)."""
  ctrl_unit = rearmed(ctrl_unit, target)
  too_many = count > target
  right_way = too_many == (ctrl_unit.log_step > 0)
  step = jnp.where(right_way,
                   jnp.where(ctrl_unit.flag, 2 * ctrl_unit.log_step,
                             ctrl_unit.log_step),
                   -0.5 * ctrl_unit.log_step)
  flag = right_way & ~ctrl_unit.flag
  # a zero step (opposite steps averaged by an elastic resize) restarts at
  # the smallest one, the way the count says
  direction = jnp.where(step == 0, jnp.where(too_many, 1.0, -1.0),
                        jnp.sign(step))
  step = direction * jnp.clip(jnp.abs(step), MIN_LOG_STEP, MAX_LOG_STEP)
  log_scale = jnp.clip(ctrl_unit.log_scale + step, -MAX_LOG_SCALE,
                       MAX_LOG_SCALE)
  return Control(tau * jnp.exp(log_scale - ctrl_unit.log_scale), log_scale,
                 step, flag, jnp.full_like(ctrl_unit.target, target))


def rearmed(ctrl_unit: Control, target: int) -> Control:
  """``ctrl_unit`` with a fresh step (``INITIAL_LOG_STEP``, flag off) where
  it was tuned for another k than ``target``: a converged step (±1e-3)
  would take hundreds of steps to move log τ to the new density's. The
  scale is kept: the estimator's bias changes little with the density."""
  moved = ctrl_unit.target != target
  return ctrl_unit._replace(
      log_step=jnp.where(moved, jnp.float32(INITIAL_LOG_STEP),
                         ctrl_unit.log_step),
      flag=ctrl_unit.flag & ~moved)


class UnitResult(NamedTuple):
  values: jax.Array
  indices: jax.Array
  count: jax.Array      # true number of candidates (may exceed capacity)
  residual: jax.Array
  control: Control
  tau: jax.Array
  nonfinite: jax.Array
  acc: jax.Array        # g + r (the old residual where g is non-finite)
  nonzero: jax.Array    # the stream had a non-zero element


# --- one unit's stages: the pass at τ ("topk": at its sampled bracket, then
# the k-th of the staged slots), and the result ---------------------------

# sample size s: fewer samples make a larger bracket C to sort through,
# more make the sample's own selection cost more; 2^14 keeps both small
# next to the pass over n (docs/benchmarks.md, "Overhead on one GPU")
TOPK_SAMPLE = 1 << 14
TOPK_MARGIN = 4.0       # sample standard deviations below rank k


def topk_bracket(k: int, n: int) -> tuple[int, int, int]:
  """(s, r, C): the bracket τ_lo is the r-th largest |acc| of a sample of
  s, and the fused pass at τ_lo gets C slots.

  Rank k of n sits at k·s/n in the sample, with standard deviation
  ≈ √(k·s/n); r = k·s/n + d, d = TOPK_MARGIN·√(k·s/n) + 1, puts τ_lo below
  the k-th largest |acc| but for a small chance (the Poisson tail of the
  sample count: ≈ 4·10⁻⁵ at ρ = 0.01, 10⁻⁴ at ρ = 0.001), and about k + d·n/s
  elements above it: C = k + 2·⌈d·n/s⌉ + 1024 holds them (never fewer
  than k: the k-th largest of the staged slots needs k of them)."""
  s = min(n, TOPK_SAMPLE)
  r = k * s / n
  d = TOPK_MARGIN * math.sqrt(r) + 1
  return s, min(s, max(1, math.ceil(r + d))), min(
      n, k + 2 * max(0, math.ceil(d * n / s)) + 1024)


def pass_capacity(n: int, *, capacity: int, density: float, estimator: str,
                  settings) -> int:
  """The slots of ``unit_pass``'s pass: the unit's c, or for ``"topk"``
  with a drawn sample the bracket's C (``topk_bracket``)."""
  if estimator != "topk" or sample_spec(n, density=density,
                                        estimator=estimator,
                                        settings=settings).whole:
    return capacity
  return topk_bracket(target_count(density, n), n)[2]


def estimate_now(step, ctrl: Control, target: int, settings) -> jax.Array:
  """Whether any of the units of control state ``ctrl`` (one batch, all of
  target k) needs a fresh estimate this step: a refresh step, a kept τ
  that is not > 0 (none was set, as after a dense phase; the controller's
  τ·e^Δ would keep 0 at 0), or a kept τ tuned for another k (a warm-up
  phase of another density). One scalar for a batch, so its ``lax.cond``
  stays one branch under ``vmap``."""
  return ((step % settings.estimation.refresh == 0) |
          jnp.any(~(ctrl.threshold > 0)) |
          jnp.any(ctrl.target != target))


def unit_threshold(grad, residual, ctrl_unit: Control, tick: Tick,
                   estimate, *, sel: Selection):
  """(τ, rotation offset) of ``unit_pass``'s pass.

  Args:
    grad, residual: the unit's flat stream and residual.
    ctrl_unit: its ``Control`` (scalar fields).
    tick: the step, the unit's salt and the batch's ``estimate_now``
      (None: this unit's own).
    estimate: the k-th largest of the unit's ``sample_spec`` (None where
      that is None).
    sel: the unit's ``Selection``.

  Returns:
    (τ, offset). For ``"topk"`` τ is ``estimate`` (the bracket τ_lo);
    otherwise the scaled estimate, a fresh estimate or the kept τ: fresh
    where ``estimate_now`` says so.
  """
  step, salt_, now = tick
  density, estimator, settings = sel.density, sel.estimator, sel.settings
  offset = uniform_index(hash32(salt_), 0, grad.size)
  if estimator == "topk":
    return estimate, offset
  scale = jnp.exp(ctrl_unit.log_scale)
  if estimate is not None:
    return (estimate * scale).astype(jnp.float32), offset
  fresh = lambda: (estimate_threshold(
      grad, residual, estimator=estimator, density=density, salt_=salt_,
      settings=settings) * scale).astype(jnp.float32)
  if settings.estimation.refresh == 1:
    return fresh(), offset
  kept = ctrl_unit.threshold
  renew = estimate_now(step, ctrl_unit, target_count(density, grad.size),
                       settings)   # this unit's own
  return lax.cond(renew if now is None else now,
                  lambda: jnp.where(renew, fresh(), kept),
                  lambda: kept), offset


def unit_pass(grad, residual, ctrl_unit: Control, tick: Tick, estimate, *,
              sel: Selection):
  """(τ, ``kernels.sparsify_pass`` result) of one unit, one step: τ and
  the offset of ``unit_threshold``, ``pass_capacity`` slots. For
  ``"topk"`` with a drawn sample ``topk_finish`` completes it."""
  tau, offset = unit_threshold(grad, residual, ctrl_unit, tick, estimate,
                               sel=sel)
  return tau, kernels.sparsify_pass(
      grad, residual, tau,
      pass_capacity(grad.size, capacity=sel.capacity, **sel.kw()), offset)


def needs_topk_finish(n: int, *, density: float, estimator: str,
                      settings) -> bool:
  """Whether ``unit_pass`` staged a ``"topk"`` bracket (``topk_finish``)."""
  return estimator == "topk" and not sample_spec(
      n, density=density, estimator=estimator, settings=settings).whole


def topk_finish(lo, out, kth, *, capacity: int, density: float, n: int):
  """(τ, pass result) of the exact top-k from the pass at the bracket τ_lo.

  ``out`` stages every m elements with |acc| ≥ τ_lo, in the rotated order,
  in C slots; ``kth`` is the k-th largest of their magnitudes |out.values|.
  The first c with |acc| ≥ kth are sent, and the other staged ones go back
  into the residual: ``select(acc, τ, c, o)`` with τ the exact k-th largest
  |acc| whenever k ≤ m ≤ C. Two rare cases differ:

  * a miss: the sample put τ_lo above the k-th largest (m < k, the small
    chance of ``topk_bracket``); the m largest are sent, and the
    candidates statistic shows m < k.
  * an overflow: ties at or just above τ_lo left m > C (only data on a
    coarse grid has such tie groups). The first C in the rotated order
    were staged, so τ, their k-th largest, can be below acc's, and the
    first c of them at or above τ are sent. The count adds the m − C
    unstaged, so the overflow statistic includes them.

  Either way nothing is lost or doubled. Redoing either one exactly
  would take a ``lax.cond``, whose predicate the GPU copies to the host
  every step (docs/architecture.md).
  """
  k = target_count(density, n)
  mags = jnp.abs(out.values).astype(jnp.float32)
  staged = out.finite & (out.indices < n)
  exact = out.count >= k
  keep = staged & (mags >= jnp.where(exact, kth, 0.0))   # a miss: all staged
  rank = jnp.cumsum(keep, dtype=jnp.int32) - 1
  sent = keep & (rank < capacity)
  slot = jnp.where(sent, rank, capacity)
  values = jnp.zeros((capacity,), out.values.dtype).at[slot].set(
      out.values, mode="drop")
  indices = jnp.full((capacity,), n, jnp.int32).at[slot].set(
      out.indices, mode="drop")
  back = jnp.where(staged & ~sent, out.indices, n)
  residual = out.residual.at[back].set(out.values, mode="drop")
  unstaged = jnp.maximum(out.count - out.values.shape[0], 0)   # m − C
  values, indices, count = fused_pass.nonfinite_slots(
      values, indices, jnp.sum(keep, dtype=jnp.int32) + unstaged,
      out.finite, n)
  return jnp.where(exact, kth, lo), out._replace(
      values=values, indices=indices, count=count, residual=residual)


def unit_result(grad, residual, ctrl_unit: Control, tau, out, *,
                sel: Selection) -> UnitResult:
  """The unit's ``UnitResult`` from its pass: the controller's next state
  (kept on a non-finite step), τ (NaN then) and the checks."""
  target = target_count(sel.density, grad.size)
  if sel.settings.estimation.feedback and sel.estimator != "topk":
    new_ctrl = controller(ctrl_unit, out.count, target, tau)
  else:
    new_ctrl = ctrl_unit._replace(
        threshold=tau, target=jnp.full_like(ctrl_unit.target, target))
  new_ctrl = jax.tree.map(lambda new, old: jnp.where(out.finite, new, old),
                          new_ctrl, ctrl_unit)
  acc = grad + residual   # only "behind" units' statistics read it
  return UnitResult(out.values, out.indices, out.count, out.residual,
                    new_ctrl, jnp.where(out.finite, tau, jnp.nan),
                    ~out.finite, jnp.where(out.finite, acc, residual),
                    out.nonzero)


def sparsify_unit(grad, residual, ctrl_unit: Control, step, salt_, *,
                  sel: Selection) -> UnitResult:
  """One unit, one step (all arrays flat; ``ctrl_unit`` fields scalars).

  ``sel``: the unit's slots, density, estimator and settings
  (``Selection``); ``salt_``: its ``salt`` this step.

  acc = grad + residual, its selection and new residual are one pass
  (``kernels.sparsify_pass``: a fused Pallas kernel on GPU); ``"topk"``
  runs that pass at a sampled bracket (``topk_finish``). ``bucket_pass``
  runs these stages over a whole bucket, its k-th largests batched.

  Non-finite acc: nothing of ``grad`` enters the residual (it is kept as
  it was), the control state is kept, no candidate is counted, τ is NaN,
  and the values sent are NaN with slot 0 pointing at element 0, so the
  synchronized gradient is non-finite on every worker (as a dense
  ``pmean`` would be) and ``optax.apply_if_finite`` works.
  """
  n = grad.size
  spec = sample_spec(n, **sel.kw())
  estimate = (None if spec is None else kth_largest(
      sample_magnitudes(grad, residual, salt_, spec), spec.rank))
  tau, out = unit_pass(grad, residual, ctrl_unit, Tick(step, salt_),
                       estimate, sel=sel)
  if needs_topk_finish(n, **sel.kw()):
    kth = kth_largest(jnp.abs(out.values).astype(jnp.float32),
                      target_count(sel.density, n))
    tau, out = topk_finish(tau, out, kth, capacity=sel.capacity,
                           density=sel.density, n=n)
  return unit_result(grad, residual, ctrl_unit, tau, out, sel=sel)
