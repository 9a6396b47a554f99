"""The exact k-th largest magnitude equals ``lax.top_k``'s, on the fast path
(a band bracketed by a sample, compacted by the selection kernel) and on the
fallback (the bracket missed or the band overflowed). CPU: the kernel in
interpret mode."""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from _harness import NUM_WORKERS
from _harness import shard

import jaxfuse
from jaxfuse.kernels import reference
from jaxfuse.kernels import threshold
from jaxfuse.kernels.threshold import kth_largest_magnitude

INTERPRET = jax.default_backend() != "gpu"
N = threshold.MIN_SIZE + 4099          # above MIN_SIZE: the fast path runs


def _check(x, k):
  got = kth_largest_magnitude(x, k, interpret=INTERPRET)
  want = jnp.sort(jnp.abs(x))[::-1][k - 1]          # by a full sort
  assert got.dtype == x.dtype
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("k", [1, 7, 300, N // 100, N // 20])
def test_normal_values(k):
  x = jax.random.normal(jax.random.PRNGKey(k), (N,), jnp.float32)
  _check(x, k)


def test_ties_and_zeros():
  rng = np.random.default_rng(1)
  x = rng.choice(np.array([0.0, -0.0, 1.0, -1.0, 0.5, 2.0], np.float32), N)
  for k in (1, 10, 500, N // 3):
    _check(jnp.asarray(x), k)


def test_fewer_nonzeros_than_k_falls_back_to_zero():
  x = np.zeros(N, np.float32)
  x[::1000] = np.arange(1, N // 1000 + 2, dtype=np.float32)[:len(x[::1000])]
  _check(jnp.asarray(x), 200)            # only 70 non-zeros: the answer is 0
  assert float(kth_largest_magnitude(jnp.asarray(x), 200,
                                     interpret=INTERPRET)) == 0.0


def test_missed_bracket_falls_back(monkeypatch):
  """A sample that misleads: every sampled magnitude is tiny, so τ_lo lets
  everything through (m > C) and the reference path must answer."""
  x = np.full(N, 1e-3, np.float32)
  x[:100] = np.arange(100, 0, -1)        # the large values, never sampled
  monkeypatch.setattr(threshold, "SAMPLE", 16)
  kth_largest_magnitude.clear_cache()
  try:
    _check(jnp.asarray(x), 50)
  finally:
    kth_largest_magnitude.clear_cache()


def test_band_overflow_falls_back(monkeypatch):
  """A band that holds the k-th largest but overflows its slots (m > C).
  Magnitudes grow with the position, so the C slots (filled in position
  order) hold the band's smallest: ranking them would give a wrong answer."""
  signs = np.random.default_rng(2).choice([-1.0, 1.0], N)
  x = (signs * np.linspace(1e-3, 1.0, N)).astype(np.float32)
  # no upper bound, τ_lo at the sample's 2000th largest: m ≈ 2000 > C
  monkeypatch.setattr(threshold, "band_plan", lambda k, n: (n, 0, 2000, 1100))
  kth_largest_magnitude.clear_cache()
  threshold._kth_fn.cache_clear()  # pylint: disable=protected-access
  try:
    _check(jnp.asarray(x), 300)
  finally:
    kth_largest_magnitude.clear_cache()
    threshold._kth_fn.cache_clear()  # pylint: disable=protected-access


def test_band_brackets_rank_k_with_a_margin():
  """r_hi < k·s/n < r_lo by MARGIN sample deviations, C twice the band."""
  for k, n in ((1, 10**5), (1000, 10**8), (5 * 10**6, 10**8), (3, 70000)):
    s, r_hi, r_lo, slots = threshold.band_plan(k, n)
    r = k * s / n
    assert s == min(n, threshold.SAMPLE)
    assert r_lo - r >= threshold.MARGIN * r**0.5 and r_lo <= s
    assert r_hi == 0 or r - r_hi >= threshold.MARGIN * r**0.5
    assert slots >= 2 * (r_lo - r_hi) * n / s


def test_bfloat16_and_small_sizes():
  x = jax.random.normal(jax.random.PRNGKey(3), (N,), jnp.bfloat16)
  _check(x, 123)
  small = jax.random.normal(jax.random.PRNGKey(4), (1000,), jnp.float32)
  _check(small, 10)                       # below MIN_SIZE: the reference


def test_rejects_bad_arguments():
  x = jnp.ones((N,), jnp.float32)
  with pytest.raises(ValueError, match="k must be"):
    kth_largest_magnitude(x, 0)
  with pytest.raises(ValueError, match="flat"):
    kth_largest_magnitude(x.reshape(-1, 1), 1)


def _has_primitive(jaxpr, name):
  """Whether ``name`` runs in ``jaxpr`` or its sub-jaxprs, not counting
  those inside the Pallas kernels."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == name:
      return True
    if eqn.primitive.name != "pallas_call" and any(
        _has_primitive(sub, name)
        for sub in jax.extend.core.jaxprs_in_params(eqn.params)):
      return True
  return False


def _batched(k):
  return jax.vmap(lambda v: kth_largest_magnitude(v, k, interpret=INTERPRET))


def test_vmap_is_exact_and_keeps_the_fallback_out_of_the_batch():
  """Batched, the answer equals a full sort per row, and the program still
  branches (a ``cond`` on one predicate for the batch), instead of the
  select of both branches that a per-row ``cond`` becomes under vmap."""
  x = jax.random.normal(jax.random.PRNGKey(5), (3, N), jnp.float32)
  got = _batched(300)(x)
  want = jnp.sort(jnp.abs(x), axis=1)[:, N - 300]
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  jaxpr = jax.make_jaxpr(_batched(300))(x).jaxpr
  assert _has_primitive(jaxpr, "cond")


def test_vmap_falls_back_for_the_batch_when_one_row_misses(monkeypatch):
  x = np.array(jax.random.normal(jax.random.PRNGKey(6), (2, N)), np.float32)
  x[1] = 1e-3
  x[1, :100] = np.arange(100, 0, -1)     # row 1: the sample misses these
  monkeypatch.setattr(threshold, "SAMPLE", 16)
  kth_largest_magnitude.clear_cache()
  threshold._kth_fn.cache_clear()  # pylint: disable=protected-access
  try:
    got = _batched(50)(jnp.asarray(x))
  finally:
    kth_largest_magnitude.clear_cache()
    threshold._kth_fn.cache_clear()  # pylint: disable=protected-access
  want = np.sort(np.abs(x), axis=1)[:, N - 50]
  np.testing.assert_array_equal(np.asarray(got), want)


def test_vmap_inside_shard_map(monkeypatch):
  """The batching rule under ``shard_map`` (as the ``"topk"`` estimator runs
  it). The interpreter cannot run inside shard_map, so off GPU the
  selection step is the jnp reference, which has the same semantics."""
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top
  if INTERPRET:
    monkeypatch.setattr(threshold, "_select_band",
                        reference.select_band)
  kth_largest_magnitude.clear_cache()
  threshold._kth_fn.cache_clear()  # pylint: disable=protected-access
  workers = NUM_WORKERS
  mesh = jaxfuse.make_mesh(workers)
  x = jax.random.normal(jax.random.PRNGKey(7), (workers, 2, N), jnp.float32)
  try:
    fn = jax.jit(jax.shard_map(lambda b: _batched(300)(b[0])[None],
                               mesh=mesh, in_specs=P("data"),
                               out_specs=P("data")))
    got = fn(shard(mesh, x))
  finally:
    kth_largest_magnitude.clear_cache()
    threshold._kth_fn.cache_clear()  # pylint: disable=protected-access
  want = jnp.sort(jnp.abs(x), axis=2)[:, :, N - 300]
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_dispatch_takes_the_kernel_path_from_pays_from(monkeypatch):
  """On the Pallas backend the estimator's entry point runs the kernel path
  from ``PAYS_FROM`` elements for one array (or a batch of one) and from
  ``BATCHED_PAYS_FROM`` per row under vmap, ``lax.top_k`` below; all exact."""
  from jaxfuse import kernels  # pylint: disable=g-import-not-at-top
  x = jax.random.normal(jax.random.PRNGKey(9), (2, N), jnp.float32)
  want = np.asarray(jnp.sort(jnp.abs(x), axis=1)[:, N - 99])
  monkeypatch.setattr(kernels, "_backend", "pallas")
  cases = (  # (PAYS_FROM, BATCHED_PAYS_FROM, batched?, rows, kernel path?)
      (N + 1, N + 1, False, 1, False), (N, N, False, 1, True),
      (N + 1, N, False, 1, False), (N + 1, N, True, 2, True),
      (N + 1, N, True, 1, False), (N, N + 1, True, 2, False),
      (N, N + 1, True, 1, True))
  for single, per_row, batched, rows, uses_kernel in cases:
    monkeypatch.setattr(threshold, "PAYS_FROM", single)
    monkeypatch.setattr(threshold, "BATCHED_PAYS_FROM", per_row)
    # A new function each time: traces are cached by function.
    fn = lambda v: kernels.kth_largest_magnitude(v, 99)
    fn, v, w = ((jax.vmap(fn), x[:rows], want[:rows]) if batched
                else (fn, x[0], want[0]))
    jaxpr = jax.make_jaxpr(fn)(v).jaxpr
    assert _has_primitive(jaxpr, "pallas_call") == uses_kernel, (
        single, per_row, batched, rows)
    np.testing.assert_array_equal(np.asarray(fn(v)), w)
