"""A bucket's groups through ``bucket_pass`` (the k-th largests batched
across the bucket by the radix select) equal ``sparsify_unit`` on each unit
alone (off GPU: with ``lax.top_k``), bitwise."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxfuse.sync import bucket_pass
from jaxfuse import kernels
from jaxfuse import plans as plan_lib
from jaxfuse.kernels import radix_select
from jaxfuse import sparsify

from _harness import list_plan

# Groups of several sizes in one sparse bucket: topk samples a bracket for
# all but the (40, 25) ones, which it sorts whole; DGC's samples are 256
# elements but for the (30_000,) ones (300: rows of two widths).
# Fields that may differ by an ulp on GPU (the test's docstring).
FLOAT_CONTROL = {".tau", ".control.threshold", ".control.log_scale",
                 ".control.log_step"}

SHAPES = [(60, 100), (40, 25), (60, 100), (30_000,), (6, 500), (30_000,),
          (6, 500), (40, 25)]


@functools.lru_cache(maxsize=None)
def _unit_step(capacity, density, estimator, *, settings):
  """``sparsify_unit`` jitted, one per (capacity, density, estimator,
  settings) for the whole module: the units of a repeated shape, and the
  cases below that check the same units, share its trace and compile."""
  return jax.jit(functools.partial(
      sparsify.sparsify_unit, sel=sparsify.Selection(
          capacity, density, estimator, settings)))


@pytest.mark.parametrize("estimator,method,ties", [
    ("dgc", "radix", False), ("topk", "radix", False),
    ("dgc", "pallas", False), ("topk", "pallas", False),
    ("topk", "radix", True), ("dgc+gaussian", "radix", False)])
def test_bucket_equals_each_unit_alone(estimator, method, ties, monkeypatch):
  """With the k-th largests from XLA's radix reductions or from the
  one-kernel radix select (``kernels.radix``, interpreted off GPU).
  ``ties``: the first (30_000,) row mostly tied at its k-th largest, so
  that topk's bracket pass counts more candidates than it has slots for
  that row (an overflow, ``sparsify.topk_finish``) and not for the other
  row of its batch. On GPU the float controller fields (τ, the threshold
  and its steps) may differ by an ulp: XLA may fuse the batch's arithmetic
  differently; the selection, residuals and counts stay bitwise."""
  monkeypatch.setattr(bucket_pass, "_kth", lambda rows, ranks: (
      radix_select.kth_largest_rows(rows, ranks, method=method)
      if rows else []))
  first, *other = estimator.split("+")
  plan = list_plan(SHAPES, density=0.01, estimator=first,
                   strategy="aligned", num_buckets=1,
                   settings=plan_lib.Settings(min_sparse_size=256))
  if other:   # a hand-made plan: the second leaf of each shape on another
    # estimator of the same capacity, so that one state group's rows
    # differ in estimator alone
    shapes, leaves = set(), []
    for l in plan.leaves:
      if l.shape in shapes:
        l = dataclasses.replace(l, estimator=other[0])
      shapes.add(l.shape)
      leaves.append(l)
    plan = dataclasses.replace(plan, leaves=tuple(leaves))
    assert len({l.estimator for l in plan.leaves}) == 2
  all_units, bucket_units = plan_lib.units(plan)
  groups = plan_lib.state_groups(plan)
  gids = sorted({g for g, ids in enumerate(groups) for u in ids
                 if u in bucket_units[0]})
  assert len(gids) == 4 and plan.buckets[0].collective == "allgather"
  rng = np.random.default_rng(1)
  group_arrays = lambda scale: [
      jnp.asarray(scale * rng.standard_t(3, size=(len(ids), all_units[
          ids[0]].size)).astype(np.float32)) for ids in groups]
  grads, residuals = group_arrays(1.0), group_arrays(0.3)
  tied = [g for g, ids in enumerate(groups)
          if all_units[ids[0]].size == 30_000]
  if ties:
    mags = rng.choice(np.float32([0.1, 1.0, 3.0]), size=30_000,
                      p=[0.4, 0.598, 0.002])
    grads[tied[0]] = grads[tied[0]].at[0].set(mags)
    residuals[tied[0]] = residuals[tied[0]].at[0].set(0.0)
  ctrl = sparsify.initial_control(len(all_units))
  ctrl = ctrl._replace(log_scale=jnp.asarray(
      rng.normal(size=len(all_units)) * 0.2, jnp.float32))
  step = jnp.int32(7)
  got = jax.jit(lambda *args: [(out, x) for _, out, x in (
      bucket_pass.sparsify_groups(
          bucket_pass.batches(all_units, groups, gids), *args,
          settings=plan.settings))])(
                                      grads, residuals, ctrl, step)
  unit_step = functools.partial(_unit_step, settings=plan.settings)
  on_gpu = jax.default_backend() == "gpu"
  seen = set()
  for batch, (out, stacked) in zip(
      bucket_pass.batches(all_units, groups, gids), got, strict=True):
    for i, (row, u) in enumerate(zip(batch.rows, batch.units)):
      unit = all_units[u]
      want = unit_step(unit.capacity, unit.density, unit.estimator)(
              grads[batch.group][row], residuals[batch.group][row],
              jax.tree.map(lambda x: x[u], ctrl), step,
              sparsify.salt(plan.settings.seed, step, u))
      row_out = jax.tree.map(lambda x: x[i], out)
      for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(want),
                              jax.tree.leaves(row_out), strict=True):
        name = jax.tree_util.keystr(path)
        if on_gpu and name in FLOAT_CONTROL:
          # XLA's GPU code may contract the controller's arithmetic
          # differently in a batch: an ulp, never a different selection
          np.testing.assert_array_max_ulp(np.asarray(a), np.asarray(b), 2)
        else:
          np.testing.assert_array_equal(np.asarray(a), np.asarray(b),
                                        err_msg=f"unit {u}: {name}")
      np.testing.assert_array_equal(stacked[i], grads[batch.group][row])
      if unit.estimator == "topk" and unit.size == 30_000:
        # more candidates than the bracket's slots: the tied row only
        wide = sparsify.topk_bracket(
            plan_lib.target_count(unit.density, unit.size), unit.size)[2]
        assert (int(out.count[i]) > wide) == (
            ties and batch.group == tied[0] and row == 0), unit
      seen.add(u)
  assert seen == set(bucket_units[0])


@pytest.mark.parametrize("rows,per,want", [
    (6, 1, [1] * 6), (6, 4, [4, 2]), (6, 0, [6]),
    (130, 1, [3] * 43 + [1]), (128, 1, [2] * 64), (64, 1, [1] * 64)])
def test_chunks_keep_every_row_in_order_and_stay_few(rows, per, want,
                                                     monkeypatch):
  """Rows are cut into chunks of ``ROWS_PER_CHUNK`` in order, but into at
  most ``MAX_CHUNKS`` chunks (pass 1 takes each as an operand); a Blend's
  two parts are cut alike."""
  monkeypatch.setattr(bucket_pass, "ROWS_PER_CHUNK", per)
  monkeypatch.setattr(bucket_pass, "MAX_CHUNKS", 64)
  x = [jnp.full((3,), i, jnp.float32) for i in range(rows)]
  chunks = bucket_pass.chunked(x)
  assert [c.shape[0] for c in chunks] == want
  np.testing.assert_array_equal(np.concatenate(chunks)[:, 0], np.arange(rows))
  blend = bucket_pass.chunked(kernels.Blend(x, x, 0.5))
  assert [c.shape[0] for c in blend.m] == [c.shape[0] for c in blend.g] == want
