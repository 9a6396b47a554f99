"""The threshold estimators and the feedback controller, one at a time,
against references computed here (NumPy, the standard library's normal
quantile, hand-worked steps): the end-to-end tests run them with feedback
on, which hides an estimator's error and a controller's slip."""

import math
import statistics

import jax.numpy as jnp
import numpy as np
import pytest

from jaxfuse import plans as plan_lib
from jaxfuse import sparsify
from jaxfuse.sparsify import Control

SETTINGS = plan_lib.Settings()


def _normal(n, seed=0, loc=0.0):
  return np.random.default_rng(seed).normal(loc, 1.0, n).astype(np.float32)


def _tail_share(a, tau):
  return float(np.mean(np.abs(a) >= tau))


@pytest.mark.parametrize("density", [0.1, 0.01, 0.001])
def test_gaussian_is_the_normal_quantile_of_the_signed_moments(density):
  """τ = |μ| + σ·Φ⁻¹(1 − ρ/2) of the signed values, μ and σ their mean and
  standard deviation; on normal data it selects a share ρ."""
  g = _normal(200_000, loc=0.3)
  tau = float(sparsify.estimate_threshold(
      jnp.asarray(g), jnp.zeros_like(g), estimator="gaussian",
      density=density, salt_=jnp.uint32(0), settings=SETTINGS))
  want = abs(g.mean(dtype=np.float64)) + g.std(dtype=np.float64) * \
      statistics.NormalDist().inv_cdf(1 - density / 2)
  assert tau == pytest.approx(want, rel=1e-5)
  centred = g - g.mean()
  assert _tail_share(centred, tau - abs(g.mean())) == pytest.approx(
      density, rel=0.15)


@pytest.mark.parametrize("stages", [1, 2, 3])
@pytest.mark.parametrize("density", [0.05, 0.005])
def test_sidco_stages_multiply_to_the_tail(stages, density):
  """Each stage adds μ_j·ln(1/δ), δ = ρ^(1/S), μ_j the mean exceedance
  over the last τ (NumPy, float64); exponential magnitudes are memoryless,
  so every S lands at ρ."""
  a = np.random.default_rng(1).exponential(1.0, 400_000).astype(np.float32)
  settings = plan_lib.Settings(
      estimation=plan_lib.Estimation(sidco_stages=stages))
  tau = float(sparsify.sidco_threshold(jnp.asarray(a), density=density,
                                       salt_=None, settings=settings))
  want = 0.0
  for _ in range(stages):
    over = a[a > want].astype(np.float64)
    want += (over - want).mean() * math.log(1 / density) / stages
  assert tau == pytest.approx(want, rel=1e-4)
  assert _tail_share(a, tau) == pytest.approx(density, rel=0.15)


@pytest.mark.parametrize("density", [0.1, 0.01])
def test_redsync_bisects_to_the_target_count(density):
  """After 12 halvings of [mean, max], τ keeps at most k = ⌈ρ·n⌉ elements
  and one bisection width below it more than k do."""
  a = np.abs(_normal(50_000, seed=2))
  k = math.ceil(density * a.size)
  tau = float(sparsify.redsync_threshold(jnp.asarray(a), density=density,
                                         salt_=None, settings=SETTINGS))
  width = (a.max() - a.mean()) / 2**12
  assert np.sum(a >= tau) <= k
  assert np.sum(a >= tau - 1.01 * width) > k


def test_redsync_keeps_its_bound_when_values_sit_on_a_midpoint():
  # mean 1, max 3: the first midpoint is 2, where 49 of the 101 values
  # sit; τ must end above them (a count taken with > would stop at 2)
  a = np.array([3.0] + [2.0] * 49 + [0.0] * 51, np.float32)
  tau = float(sparsify.redsync_threshold(jnp.asarray(a), density=0.05,
                                         salt_=None, settings=SETTINGS))
  assert np.sum(a >= tau) <= math.ceil(0.05 * a.size)
  assert 2.0 < tau <= 3.0


def _ctrl(log_step, flag=False, log_scale=0.0, tau=2.0, target=100):
  return Control(jnp.float32(tau), jnp.float32(log_scale),
                 jnp.float32(log_step), jnp.bool_(flag), jnp.int32(target))


@pytest.mark.parametrize("state,count,want_step,want_flag", [
    # too many, moving up: keep going; the second move the right way doubles
    (_ctrl(0.1), 150, 0.1, True),
    (_ctrl(0.1, flag=True), 150, 0.2, False),
    # too few while moving up (or exactly k): reverse and halve
    (_ctrl(0.1), 50, -0.05, False),
    (_ctrl(0.1, flag=True), 100, -0.05, False),
    # too few, moving down: keep going, then double
    (_ctrl(-0.1), 50, -0.1, True),
    (_ctrl(-0.1, flag=True), 50, -0.2, False),
    # too many while moving down: reverse and halve
    (_ctrl(-0.1, flag=True), 150, 0.05, False),
    # steps clipped to [1e-3, 1] in magnitude
    (_ctrl(0.8, flag=True), 150, 1.0, False),
    (_ctrl(0.0015), 50, -1e-3, False),
    # a zero step (an elastic resize averaged +s and -s) restarts at the
    # smallest step the way the count says, instead of staying at 0
    (_ctrl(0.0), 150, 1e-3, False),
    (_ctrl(-0.0, flag=True), 150, 1e-3, False),
    (_ctrl(0.0), 50, -1e-3, True),
    (_ctrl(0.0), 100, -1e-3, True),
    # a state tuned for another target (a phase of another density, or
    # the initial state's 0) starts again from the initial step +0.1,
    # flag off, whatever its converged step was
    (_ctrl(-1e-3, flag=True, target=400), 150, 0.1, True),
    (_ctrl(-1e-3, flag=True, target=400), 50, -0.05, False),
    (_ctrl(1e-3, flag=True, target=25), 150, 0.1, True),
    (_ctrl(0.1, target=0), 150, 0.1, True),
])
def test_controller_steps(state, count, want_step, want_flag):
  """SparDL Alg. 2 on log τ, worked by hand for a target of 100: the new
  step and flag, the scale moved by the step and the threshold by its
  exponential; the state records the target it now tracks."""
  out = sparsify.controller(state, jnp.int32(count), 100, jnp.float32(3.0))
  assert int(out.target) == 100
  assert float(out.log_step) == pytest.approx(want_step, rel=1e-6)
  assert bool(out.flag) == want_flag
  assert float(out.log_scale) == pytest.approx(want_step, rel=1e-6)
  assert float(out.threshold) == pytest.approx(3.0 * math.exp(want_step),
                                               rel=1e-6)


def test_controller_scale_is_bounded():
  """log scale stays within ±12 however long the count stays off: τ is
  moved by what the clip allowed, not by the step."""
  out = sparsify.controller(_ctrl(1.0, flag=True, log_scale=11.5), 10**6,
                            100, jnp.float32(1.0))
  assert float(out.log_scale) == pytest.approx(12.0)
  assert float(out.log_step) == pytest.approx(1.0)
  assert float(out.threshold) == pytest.approx(math.exp(0.5), rel=1e-6)
  out = sparsify.controller(_ctrl(-1.0, flag=True, log_scale=-11.9), 0, 100,
                            jnp.float32(1.0))
  assert float(out.log_scale) == pytest.approx(-12.0)
  assert float(out.threshold) == pytest.approx(math.exp(-0.1), rel=1e-5)


@pytest.mark.parametrize("kept,step,fresh", [
    (2.0, 5, False),    # between refreshes: the kept τ
    (2.0, 8, True),     # a refresh step
    (0.0, 5, True),     # none kept (after a dense phase): estimate now
    (float("nan"), 5, True),
    (2.0, 5, "ρ=0.04"),  # kept for another density (a warm-up phase's)
])
def test_refresh_estimates_where_no_threshold_is_kept(kept, step, fresh):
  """refresh = 4: τ is re-estimated on steps 0, 4, 8, … and kept between;
  a kept τ of 0 (a dense phase sets none) is estimated afresh, since the
  controller's τ·e^Δ would keep it at 0 and every element pass, and so is
  one tuned for another density's k (ρ = 0.04 of 4096: k = ⌈163.84⌉ =
  164, where this unit's ρ = 0.01 has k = ⌈40.96⌉ = 41)."""
  target = 164 if fresh == "ρ=0.04" else 41
  settings = plan_lib.Settings(
      estimation=plan_lib.Estimation(refresh=4))
  rng = np.random.default_rng(0)
  g = jnp.asarray(rng.normal(size=4096).astype(np.float32))
  r = jnp.zeros_like(g)
  salt = sparsify.salt(0, step, 0)
  want = float(sparsify.estimate_threshold(
      g, r, estimator="gaussian", density=0.01, salt_=salt,
      settings=settings))
  assert want > 2.5                     # the 1 % tail of N(0, 1)
  tau, _ = sparsify.unit_threshold(
      g, r, _ctrl(0.1, tau=kept, target=target),
      sparsify.Tick(jnp.int32(step), salt), None,
      sel=sparsify.Selection(1, 0.01, "gaussian", settings))
  assert float(tau) == pytest.approx(want if fresh else kept, rel=1e-6)
