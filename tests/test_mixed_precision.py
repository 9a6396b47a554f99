"""bfloat16 gradients: float32 residuals by default, the wire in bfloat16.

Per worker, with acc = g + r computed in the residual's dtype::

  sent = wire(top(acc))   (bfloat16: what the collective carries)
  r'   = acc − sent       (float32: exact, the rounding of sent included)

so an unsent element keeps acc exactly and a sent one keeps its rounding;
``residual_dtype="gradient"`` rounds r' to bfloat16 and loses mass.
"""

import jax
from jax.sharding import PartitionSpec as P
import jax.numpy as jnp
import numpy as np
import pytest

import jaxfuse
from jaxfuse import plans as plan_lib

from _harness import gathered_words, init, list_plan, shard, sync
from _harness import NUM_WORKERS as K

SHAPES = [(4096,), (48, 64)]


def _bf16(x):
  return np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))


def _grads(step):
  """bfloat16 gradients of mixed scale: most elements ~1e-3, a few ~1, so
  small contributions meet large residuals (where bfloat16 rounds them)."""
  out = []
  for i, shape in enumerate(SHAPES):
    key = jax.random.fold_in(jax.random.PRNGKey(i), step)
    k1, k2 = jax.random.split(key)
    small = 1e-3 * jax.random.normal(k1, (K,) + shape)
    big = jnp.where(jax.random.uniform(k2, (K,) + shape) < 0.05,
                    jax.random.normal(k2, (K,) + shape), 0.0)
    out.append((small + big).astype(jnp.bfloat16))
  return out


def _run(plan, mesh, steps, acc_dtype=None, grads_of=None):
  """Per step: (acc, r', synced) per unit (one leaf each) as numpy arrays,
  acc = g + r in ``acc_dtype`` (default the residual's, as the transform
  computes it); g = ``grads_of(step)`` (default ``_grads``), and synced
  checked to come out in g's dtype."""
  leaf_of = [u.leaves[0] for u in plan_lib.units(plan)[0]]
  state = init(plan, mesh)
  for step in range(steps):
    grads = (grads_of or _grads)(step)
    old = [np.asarray(r) for r in jaxfuse.unit_residuals(plan, state)]
    synced, state = sync(plan, mesh, grads, state)
    assert [x.dtype for x in synced] == [np.asarray(g).dtype for g in grads]
    new = [np.asarray(r) for r in jaxfuse.unit_residuals(plan, state)]
    acc = [np.asarray(grads[j], np.float32).reshape(K, -1).astype(acc_dtype or r.dtype)
           + r.astype(acc_dtype or r.dtype)
           for j, r in zip(leaf_of, old)]
    yield acc, new, [np.asarray(synced[j], np.float32) for j in leaf_of]


def _plan(**settings):
  plan = list_plan(SHAPES, dtype="bfloat16", density=0.01,
                   strategy="layerwise",
                   settings=jaxfuse.Settings(min_sparse_size=64, **settings))
  assert all(l.mode == "sparse" for l in plan.leaves)
  return plan


def test_default_state_is_float32_and_the_wire_bfloat16(mesh):
  plan = _plan()
  assert plan.settings.residual_dtype == "float32"
  state = jaxfuse.init_state(jaxfuse.sparse_sync(plan, momentum=0.9),
                             [jnp.zeros(s, jnp.bfloat16) for s in SHAPES],
                             mesh)
  assert {str(r.dtype) for r in state.residuals + state.velocity} == {
      "float32"}
  # 2-byte values and 4-byte indices on the wire.
  units, _ = plan_lib.units(plan)
  assert plan.bytes_per_worker() == sum(
      4 * (-(-u.capacity * 2 // 4) + u.capacity) for u in units)
  low = _plan(residual_dtype="gradient")
  assert {str(r.dtype) for r in init(low, mesh).residuals} == {"bfloat16"}


def test_float32_residual_conserves_to_float32_exactness(mesh):
  for acc, new, synced in _run(_plan(), mesh, steps=6):
    for a, r, s in zip(acc, new, synced):
      sent = a - r                  # per worker, exact in float32
      assert (sent != 0).any()
      # What left the residual is exactly what the bfloat16 wire carries:
      np.testing.assert_array_equal(sent, _bf16(sent))
      # and an unsent element keeps acc bit for bit (nothing rounded away).
      np.testing.assert_array_equal(r[sent == 0], a[sent == 0])
      # The synchronized gradient is their mean, rounded once to bfloat16.
      mean = sent.astype(np.float64).mean(0)
      np.testing.assert_allclose(s.ravel(), mean, rtol=2**-8, atol=1e-30)


def test_bfloat16_residual_loses_small_contributions(mesh):
  """The setting matters: r' in bfloat16 drops part of every small g that
  lands on a large residual (the loss the float32 default avoids)."""
  lost, owed = 0.0, 0.0
  for acc, new, _ in _run(_plan(residual_dtype="gradient"), mesh, steps=6,
                          acc_dtype=np.float64):
    for a, r in zip(acc, new):
      a, r = a.astype(np.float64), r.astype(np.float64)
      unsent = r != 0
      lost += np.abs(a - r)[unsent].sum()
      owed += np.abs(a)[unsent].sum()
  assert lost > 1e-4 * owed   # float32 residual: exactly 0 (test above)


def test_residual_dtype_is_checked_and_part_of_the_layout():
  with pytest.raises(plan_lib.PlanError, match="residual_dtype"):
    _plan(residual_dtype="float16")
  from jaxfuse.sync import bucket_steps  # pylint: disable=g-import-not-at-top
  assert bucket_steps.layout_difference(
      _plan(), _plan(residual_dtype="gradient")) == "settings"


def test_recipe_moments_are_float32_for_bfloat16_gradients(mesh):
  """local_adamw's per-worker Adam runs in float32 (per_worker's default):
  after one step worker k's first moment is (1 − β1)·g_k of its bfloat16
  gradient, exactly in float32; the update goes on in bfloat16."""
  plan = _plan()
  opt = jaxfuse.local_adamw(plan, 1e-3)
  params = [jnp.zeros(s, jnp.bfloat16) for s in SHAPES]
  state = jaxfuse.init_state(opt, params, mesh)
  adam = state[1].inner
  assert {str(x.dtype) for x in jax.tree.leaves((adam.mu, adam.nu))} == {
      "float32"}
  specs = jaxfuse.state_specs(state)
  grads = _grads(0)

  def local(g, s):
    u, s = opt.update([x[0] for x in g], s, params)
    return u, s

  updates, state = jax.jit(jax.shard_map(
      local, mesh=mesh, in_specs=(P("data"), specs),
      out_specs=(P(), specs)))(shard(mesh, grads), state)
  assert {str(u.dtype) for u in updates} == {"bfloat16"}
  for g, mu in zip(grads, state[1].inner.mu):
    want = np.float32(1 - 0.9) * np.asarray(g, np.float32)
    np.testing.assert_allclose(np.asarray(mu), want, rtol=1e-6)


# --- float32 gradients, a dense phase on a bfloat16 wire ----------------------

def _dense_phase(dense_wire):
  plan = list_plan(SHAPES, density=0.01,
                   strategy="layerwise",
                   settings=jaxfuse.Settings(min_sparse_size=64))
  phases = jaxfuse.density_warmup(plan, steps=0, dense_steps=3,
                                  dense_wire=dense_wire)
  return phases[0].plan, phases


def _float32_grads(step):
  return [np.asarray(g, np.float32) * np.float32(1 + 1 / 3)
          for g in _grads(step)]   # not bfloat16-representable


def test_dense_phase_on_a_bfloat16_wire_carries_its_rounding(mesh):
  """Each worker sends bf16(acc) and keeps acc − bf16(acc), exactly, in its
  float32 residual: x_t + r_t = sent_t + r_{t+1}, so nothing but the
  reduction's own rounding is lost."""
  dense, _ = _dense_phase("bfloat16")
  for acc, new, synced in _run(dense, mesh, 3, grads_of=_float32_grads):
    for a, r1, s in zip(acc, new, synced):
      sent = a - r1
      np.testing.assert_array_equal(sent, _bf16(a))
      assert (r1 != 0).mean() > 0.5 and np.abs(r1).max() > 0
      np.testing.assert_allclose(s.ravel(), sent.astype(np.float64).mean(0),
                                 rtol=2**-7, atol=1e-30)


def test_dense_wire_halves_the_bytes_and_the_all_reduce(mesh):
  exact, _ = _dense_phase("gradient")
  half, phases = _dense_phase("bfloat16")
  assert half.settings.full_wire == "bfloat16"
  assert phases[-1].plan.settings.full_wire == "gradient"  # sparse: as given
  assert 2 * half.bytes_per_worker() == exact.bytes_per_worker()
  def reduced_types(plan):
    tx = jaxfuse.sparse_sync(plan)
    state = init(plan, mesh)
    from _harness import sharded_update  # pylint: disable=g-import-not-at-top
    text = jax.jit(sharded_update(tx, mesh, jaxfuse.state_specs(state))).lower(
        shard(mesh, [np.zeros((K,) + s, np.float32) for s in SHAPES]),
        state).as_text()
    lines = text.splitlines()
    # A region op: its types are on the line closing its region.
    starts = [i for i, l in enumerate(lines) if "stablehlo.all_reduce" in l]
    return [next(l for l in lines[i:] if l.strip().startswith("})")).split(
        "->")[-1].strip() for i in starts]
  assert reduced_types(half) == ["tensor<3072xbf16>", "tensor<4096xbf16>"]
  assert reduced_types(exact) == ["tensor<3072xf32>", "tensor<4096xf32>"]


def _check_wire_setting(plan, field):
  """``Settings.<field>`` rejects a dtype it does not offer, naming the
  field; a plan keeps it through JSON; a plan saved before the field loads
  with ``"gradient"``."""
  import dataclasses  # pylint: disable=g-import-not-at-top
  import json  # pylint: disable=g-import-not-at-top
  with pytest.raises(plan_lib.PlanError, match=f"{field}='float8'"):
    dataclasses.replace(plan, settings=dataclasses.replace(
        plan.settings, **{field: "float8"}))
  want = getattr(plan.settings, field)
  assert getattr(jaxfuse.Plan.from_json(plan.to_json()).settings,
                 field) == want
  body = json.loads(plan.to_json())
  del body["settings"][field]
  assert getattr(jaxfuse.Plan.from_json(json.dumps(body)).settings,
                 field) == "gradient"


def test_dense_wire_is_checked_saved_and_not_part_of_the_layout():
  from jaxfuse.sync import bucket_steps  # pylint: disable=g-import-not-at-top
  _check_wire_setting(list_plan(SHAPES), "full_wire")
  for bad in ("fp8", "float16"):   # float16 would overflow where f32 does not
    with pytest.raises(plan_lib.PlanError, match=f"dense_wire='{bad}'"):
      _dense_phase(bad)
  half, phases = _dense_phase("bfloat16")
  assert bucket_steps.layout_difference(phases[-1].plan, half) is None
  _check_wire_setting(half, "full_wire")


# --- float32 gradients, sparse values on a bfloat16 wire ----------------------

def _sparse_wire_plan(collective="allgather", sparse_wire="bfloat16"):
  return list_plan(SHAPES, density=0.01,
                   strategy="layerwise", collective=collective,
                   settings=jaxfuse.Settings(
                       min_sparse_size=64, sparse_wire=sparse_wire))


@pytest.mark.parametrize("collective", [
    "allgather", jaxfuse.collectives.Zen(union=0.05), "spardl",
    jaxfuse.collectives.SparDL(teams=4)], ids=str)
def test_sparse_wire_sends_bfloat16_values_and_keeps_their_rounding(
    mesh, collective):
  """float32 acc, bfloat16 wire: nothing is lost but float32 rounding,
  K·ĝ + Σ_k r'_k = Σ_k acc_k, though ZEN's reducers (pushed sums beyond
  ``Zen(union)``, and each sum's rounding to the wire) and SparDL's merges
  hand values back. ``allgather`` hands nothing back: per worker
  r' = acc − bf16(top(acc)) exactly, an unsent element keeps acc bit for
  bit, and ĝ is the float32 mean of what was sent."""
  if K % getattr(collective, "teams", 1):
    pytest.skip(f"{collective} needs a multiple of the teams as workers")
  plan = _sparse_wire_plan(collective)
  for acc, new, synced in _run(plan, mesh, 3, grads_of=_float32_grads):
    for a, r1, s in zip(acc, new, synced):
      a, r1, s = (x.astype(np.float64) for x in (a, r1, s))
      defect = K * s.ravel() + r1.sum(0) - a.sum(0)
      assert np.abs(defect).max() <= 1e-6 * np.abs(a).sum(0).max()
      if collective != "allgather":
        continue
      sent = a - r1
      assert (sent != 0).any()
      np.testing.assert_array_equal(sent, _bf16(sent))
      assert (sent != a)[sent != 0].mean() > 0.5   # the rounding stayed
      np.testing.assert_array_equal(r1[sent == 0], a[sent == 0])
      np.testing.assert_allclose(s.ravel(), sent.mean(0), rtol=1e-6,
                                 atol=1e-12)


def test_a_float32_value_beyond_bfloat16_goes_as_its_largest(mesh):
  """3.4e38 is finite in float32 but rounds to inf in bfloat16: the wire
  carries bfloat16's largest value and the residual the rest, so the step
  and every later one stay finite."""
  plan = _sparse_wire_plan()
  top = float(jnp.finfo(jnp.bfloat16).max)
  state = init(plan, mesh)
  for step in range(2):
    grads = [np.zeros((K,) + s, np.float32) for s in SHAPES]
    if step == 0:
      grads[0][K - 1, 7] = 3.4e38     # the last worker (K = 1 on one GPU)
    synced, state = sync(plan, mesh, grads, state)
    res = jaxfuse.unit_residuals(plan, state)
    assert all(np.isfinite(np.asarray(x)).all() for x in synced + res)
    if step == 0:
      assert np.asarray(synced[0])[7] == np.float32(top / K)
      (u,) = [u for u, unit in enumerate(plan_lib.units(plan)[0])
              if unit.leaves == (0,)]
      assert np.asarray(res[u])[K - 1, 7] == (np.float32(3.4e38) -
                                              np.float32(top))


def test_sparse_wire_cuts_the_slots_to_six_bytes(mesh):
  """Each unit's slots: c bfloat16 values (two to a word) and c int32
  indices, against 8·c bytes on a float32 wire; the compiled all-gather
  carries that many words."""
  exact, half = _sparse_wire_plan(sparse_wire="gradient"), _sparse_wire_plan()
  units = plan_lib.units(exact)[0]
  assert exact.bytes_per_worker() == sum(8 * u.capacity for u in units)
  assert half.bytes_per_worker() == sum(
      4 * (-(-u.capacity // 2) + u.capacity) for u in units)

  assert gathered_words(half, mesh) == sorted(
      -(-u.capacity // 2) + u.capacity for u in units)
  assert gathered_words(exact, mesh) == sorted(2 * u.capacity for u in units)


def test_sparse_wire_is_checked_and_saved():
  plan = _sparse_wire_plan()
  assert plan.settings.sparse_wire == "bfloat16"
  _check_wire_setting(plan, "sparse_wire")
  # the state does not hold the wire dtype: phases may differ in it
  from jaxfuse.sync import bucket_steps  # pylint: disable=g-import-not-at-top
  assert bucket_steps.layout_difference(
      plan, _sparse_wire_plan(sparse_wire="gradient")) is None
  assert bucket_steps.layout_difference(
      plan, _sparse_wire_plan(collective="zen")) is not None
  # bfloat16 gradients already travel in bfloat16: the setting changes nothing
  low = _plan(sparse_wire="bfloat16")
  assert low.bytes_per_worker() == _plan().bytes_per_worker()
