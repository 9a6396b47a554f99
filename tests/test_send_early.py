"""``jaxfuse.send_early``: the same results, and the program order the plan
asks for, read from the step's jaxpr.

The model is a chain of dense layers of distinct shapes, so the backward
equation that makes each layer's gradient is known by its output shape.
Dependencies are read from the traced step (``shard_map``'s body): XLA's
CPU compiler drops optimization barriers before it schedules, while the
GPU compiler keeps them through its scheduling, so the jaxpr is where the
barriers can be checked on this machine."""

import warnings

import hypothesis
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

import jaxfuse
from jaxfuse.optim import overlap
from jaxfuse.planning import optimal

from _harness import fast_jit
from _harness import mesh_of
from _harness import NUM_WORKERS

# Four workers on CPU devices; on a GPU run every GPU up to four (one GPU
# is one worker: the split backward still runs on the GPU's compiler).
WORKERS = min(4, NUM_WORKERS)


def _dims(layers):
  return [32 + 2 * i for i in range(layers + 1)]   # > 1024 elements: sparse


def _problem(layers, seed=0, biases=False, scales=False, remat=False):
  """A tanh chain; with ``biases`` each layer is {"w", "b"} and the plan
  puts each small (dense) bias in a bucket of its own after its layer's.
  With ``scales``, "b" scales the layer's input instead (as a LayerNorm's
  scale does): its gradient needs the product x̄ = ȳ·wᵀ past w's. With
  ``remat``, each layer but the last (an LM's head) is a
  ``jax.checkpoint``: its backward, recompute included, is one equation of
  the step."""
  rng = np.random.default_rng(seed)
  dims = _dims(layers)
  params = {f"l{i}": jnp.asarray(0.4 * rng.normal(size=(dims[i], dims[i + 1])),
                                 jnp.float32) for i in range(layers)}
  if biases:
    params = {k: {"w": w, "b": jnp.full(w.shape[1:], 0.1)}
              for k, w in params.items()}
  if scales:
    params = {k: {"w": w, "b": jnp.full(w.shape[:1], 1.1)}
              for k, w in params.items()}
  x = jnp.asarray(rng.normal(size=(2 * WORKERS, dims[0])), jnp.float32)

  def layer(q, x):
    if biases:
      return jnp.tanh(x @ q["w"] + q["b"])
    if scales:
      return jnp.tanh((x * q["b"]) @ q["w"])
    return jnp.tanh(x @ q)

  def loss_fn(p, x):
    for i in range(layers):
      rematted = remat and i < layers - 1
      x = (jax.checkpoint(layer) if rematted else layer)(p[f"l{i}"], x)
    return jnp.mean(x ** 2)
  return params, x, loss_fn


def _setup(layers, recipe="onebit_adamw", bucket_bytes=6000, density=0.2,
           seed=0, biases=False, scales=False, num_buckets=None,
           collective="allgather", groups=None, finite=False, remat=False):
  """``finite``: the recipe inside ``jaxfuse.apply_if_finite``;
  ``num_buckets``: plan ``aligned`` with that many groups, else
  ``size`` with ``bucket_bytes``; ``collective``: the sparse buckets'
  scheme; ``groups``: then regroup the plan into these groups (positions
  in the backward-ready order; each a sparse and a dense bucket)."""
  mesh = mesh_of(WORKERS)
  params, x, loss_fn = _problem(layers, seed, biases, scales, remat)
  grouping = (dict(strategy="size", bucket_bytes=bucket_bytes)
              if num_buckets is None else
              dict(strategy="aligned", num_buckets=num_buckets))
  plan = jaxfuse.plan(params, density=density, collective=collective,
                      **grouping,
                      settings=jaxfuse.Settings(seed=0),
                      order=jaxfuse.planning.ordering.FromLoss(
                          loss_fn, (x[:2],)))
  if groups is not None:
    order = plan.provenance["backward_order"]
    plan = optimal.plan_from_groups(
        plan, [[order[i] for i in group] for group in groups])
  opt = jaxfuse.RECIPES[recipe](plan, 1e-2, clip_norm=1.0)
  if finite:
    opt = jaxfuse.apply_if_finite(opt, 3)
  params = jax.device_put(params, NamedSharding(mesh, P()))
  x = jax.device_put(x, NamedSharding(mesh, P("data")))
  state = jaxfuse.init_state(opt, params, mesh)
  specs = jaxfuse.state_specs(state)

  def local(params, state, x):
    loss, grads = jax.value_and_grad(loss_fn)(jaxfuse.local_params(params), x)
    updates, state = opt.update(grads, state, params)
    return (optax.apply_updates(params, updates), state,
            jax.lax.pmean(loss, "data"))

  def wrap(fn):
    return jax.shard_map(fn, mesh=mesh, in_specs=(P(), specs, P("data")),
                         out_specs=(P(), specs, P()))
  return plan, wrap, local, (params, state, x)


def _body(wrapped, args):
  """The equations of the shard_map body of ``wrapped`` traced on args."""
  outer = jax.make_jaxpr(wrapped)(*args).jaxpr
  (eqn,) = [e for e in outer.eqns if e.primitive.name == "shard_map"]
  inner = eqn.params["jaxpr"]
  return getattr(inner, "jaxpr", inner).eqns


def _ancestors(eqns):
  """For each equation index, the set of equation indices it depends on."""
  producer = {v: n for n, e in enumerate(eqns) for v in e.outvars}
  out = []
  for e in eqns:
    deps = set()
    for a in e.invars:
      n = producer.get(a) if isinstance(a, jax.extend.core.Var) else None
      if n is not None:
        deps.add(n)
        deps |= out[n]
    out.append(deps)
  return out


def _layers_of_buckets(plan):
  return [[int(plan.leaves[j].path.strip("[']l")) for j in b.leaves]
          for b in plan.buckets]


def _check_order(plan, eqns, shapes, window=None):
  """Assert: each bucket's wire is made before the backward of every later
  bucket's layers, the collectives run one after another in order, and the
  backward waits for a collective's result only ``window`` buckets later.
  Returns the number of (bucket, later layer) pairs checked."""
  anc = _ancestors(eqns)
  producer = {v: n for n, e in enumerate(eqns) for v in e.outvars}
  gathers = [n for n, e in enumerate(eqns)
             if e.primitive.name.startswith("all_gather")]
  buckets = _layers_of_buckets(plan)
  assert len(gathers) == len(buckets)
  grad_eqns = {l: [n for n, e in enumerate(eqns) if overlap.is_backward(e)
                   and any(tuple(v.aval.shape) in (shapes[l], shapes[l][::-1])
                           for v in e.outvars)]
               for l in shapes}
  checked = 0
  for i, g in enumerate(gathers):
    wire = producer[eqns[g].invars[0]]
    if eqns[wire].primitive.name == "optimization_barrier":   # the chain's
      wire = producer[eqns[wire].invars[0]]
    for j, later in enumerate(buckets[i + 1:], i + 1):
      for layer in later:
        assert grad_eqns[layer], layer
        for n in grad_eqns[layer]:
          assert wire in anc[n], (
              f"the backward of layer {layer} does not wait for bucket {i}")
          waits = g in anc[n]
          assert waits == (window is not None and j >= i + window + 1), (
              f"layer {layer}'s backward waits for bucket {i}'s result: "
              f"{waits}")
          checked += 1
    if i:
      assert gathers[i - 1] in anc[g], f"bucket {i} may start before {i - 1}"
  psums = [n for n, e in enumerate(eqns) if e.primitive.name.startswith("psum")
           and not e.outvars[0].aval.shape]
  assert psums and all(gathers[-1] in anc[n] for n in psums), (
      "the loss's pmean may start before the last bucket")
  return checked


@pytest.mark.parametrize("recipe, finite, remat", [
    *[(r, False, False) for r in sorted(set(jaxfuse.RECIPES) - {"sgd"})],
    ("onebit_adamw", True, False), ("onebit_adamw", False, True)])
def test_same_results_bitwise(recipe, finite, remat):
  """Two steps of each recipe (``sgd``: the property test below), of one
  inside ``jaxfuse.apply_if_finite``, and of one on ``jax.checkpoint``'d
  layers."""
  plan, wrap, local, args = _setup(3 if remat else 2, recipe,
                                   bucket_bytes=2000, finite=finite,
                                   remat=remat)
  assert len(plan.buckets) >= 2
  # both compiled alike, with XLA:CPU's quicker codegen (the same HLO)
  plain = fast_jit(wrap(local))
  early = fast_jit(wrap(jaxfuse.send_early(local)))
  a, b = args, args
  for _ in range(2):
    a, b = plain(a[0], a[1], args[2]), early(b[0], b[1], args[2])
    jax.block_until_ready((a, b))
    same = jax.tree.map(lambda u, v: bool(jnp.array_equal(u, v)), a, b)
    assert all(jax.tree.leaves(same))


@pytest.mark.parametrize("collective", ["zen", "spardl"])
def test_every_scheme_same_results_bitwise(collective):
  """One step with each sparse scheme of a one-axis mesh (allgather:
  above; hier needs two axes). Their collectives mix values that vary
  over the mesh axis with invariant ones (ZEN's all_to_all beside its
  all-gathers), which the barriers must keep apart."""
  plan, wrap, local, args = _setup(3, bucket_bytes=2000,
                                   collective=collective)
  assert len(plan.buckets) >= 3
  plain = fast_jit(wrap(local))(*args)
  early = fast_jit(wrap(jaxfuse.send_early(local)))(*args)
  same = jax.tree.map(lambda u, v: bool(jnp.array_equal(u, v)), plain, early)
  assert all(jax.tree.leaves(same))


def test_backward_waits_for_each_wire_and_collectives_chain():
  plan, wrap, local, args = _setup(6)
  params = args[0]
  shapes = {int(k[1:]): tuple(v.shape) for k, v in params.items()}
  assert len(plan.buckets) >= 3
  checked = _check_order(
      plan, _body(wrap(jaxfuse.send_early(local, window=None)), args), shapes)
  assert checked >= 6


@pytest.mark.parametrize("window", [1, 2])
def test_window_bounds_where_each_collective_ends(window):
  plan, wrap, local, args = _setup(6)
  shapes = {int(k[1:]): tuple(v.shape) for k, v in args[0].items()}
  early = (jaxfuse.send_early(local) if window == 2    # the default
           else jaxfuse.send_early(local, window=window))
  assert _check_order(plan, _body(wrap(early), args), shapes,
                      window=window) >= 6
  for bad in (0, True, 1.5):
    with pytest.raises(ValueError, match=f"window={bad!r}"):
      jaxfuse.send_early(local, window=bad)


def test_window_and_chain_count_points_of_the_backward():
  """Each layer's bias goes in a dense bucket (psum) right after its
  weight's sparse one, with no matrix product between their fences. With
  window=1, the backward of the next layer must not wait for either
  (it is what their collectives overlap); from the layer after, it must.
  Counting every collective, or chaining the psum after the all-gather,
  would make the all-gather end before the next layer's backward, leaving
  nothing to overlap it with."""
  plan, wrap, local, args = _setup(4, bucket_bytes=2000, biases=True)
  kinds = [("w" if "'w'" in plan.leaves[b.leaves[0]].path else "b",
            int(plan.leaves[b.leaves[0]].path[3]))
           for b in plan.buckets]
  assert kinds == [(k, l) for l in (3, 2, 1, 0) for k in "wb"], kinds
  eqns = _body(wrap(jaxfuse.send_early(local, window=1)), args)
  anc = _ancestors(eqns)
  collectives = [n for n, e in enumerate(eqns) if overlap.is_collective(e)
                 and e.outvars[0].aval.shape][:len(kinds)]
  products = {l: [n for n, e in enumerate(eqns) if overlap.is_backward(e)
                  and e.primitive.name == "dot_general"
                  and any(tuple(v.aval.shape) in (s, s[::-1])
                          for v in e.outvars)]
              for l, s in ((l, tuple(args[0][f"l{l}"]["w"].shape))
                           for l in range(4))}
  checked = 0
  for c, (_, layer) in zip(collectives, kinds):
    for later in range(layer):
      for n in products[later]:
        assert (c in anc[n]) == (later <= layer - 2), (
            f"layer {later}'s backward waits for the bucket of layer "
            f"{layer}: {c in anc[n]}")
        checked += 1
  assert checked >= 12
  # The chain goes by points: a layer's two buckets run side by side, each
  # after both buckets of the layer before; the loss's pmean after all.
  for i, (c, (_, layer)) in enumerate(zip(collectives, kinds)):
    for d, (_, other) in zip(collectives[:i], kinds[:i]):
      assert (d in anc[c]) == (other > layer), (i, other, layer)
  loss = [n for n, e in enumerate(eqns) if overlap.is_collective(e)
          and not e.outvars[0].aval.shape]
  assert loss and all(c in anc[n] for n in loss for c in collectives)


def test_two_of_a_kind_never_share_a_point():
  """A collective whose kind is already in the point at less backward
  work opens a new point, however little work lies between (else XLA
  would combine the two, and the earlier bucket would wait for the
  later's gradients); of another kind, or at the same work, they share
  it. The waits then follow the points."""
  ag, ps = "all_gather", "psum"
  at = [5, 5, 9, 9, 10, 10, 10]
  # Work-weighted median gap 5: one unit of work alone opens no point.
  assert overlap.points_of_work(at) == [1, 1, 2, 2, 2, 2, 2]
  points = overlap.points_of_work(at, kinds=[ag, ps, ag, ps, ag, ps, ps])
  assert points == [1, 1, 2, 2, 3, 3, 3]
  after, held = overlap.waits(points, [True] * 6 + [False], 1)
  assert after == [[], [], [0, 1], [0, 1], [2, 3], [2, 3], [4, 5]]
  assert held == [[], [], [0, 1], [], [2, 3], [], []]
  # The same work: side by side.
  assert overlap.points_of_work([5, 5], kinds=[ag, ag]) == [1, 1]


def test_a_small_last_bucket_goes_on_its_own():
  """Three groups of an eight-layer chain, the last one layer: its fence
  comes a few products after the second group's, too few to open a
  point, but a second all-gather does. The last all-gather waits for the
  second (XLA cannot combine them), the last layer's backward does not
  (it is what the second hides behind), and the step is bitwise the
  same."""
  plan, wrap, local, args = _setup(8, num_buckets=2,
                                   groups=[[0, 1, 2, 3], [4, 5, 6], [7]])
  assert [b.collective for b in plan.buckets] == ["allgather"] * 3
  eqns = _body(wrap(jaxfuse.send_early(local)), args)
  anc = _ancestors(eqns)
  gathers = [n for n, e in enumerate(eqns)
             if e.primitive.name.startswith("all_gather")]
  assert len(gathers) == 3 and gathers[1] in anc[gathers[2]]
  first = tuple(args[0]["l0"].shape)
  products = [n for n, e in enumerate(eqns) if overlap.is_backward(e)
              and e.primitive.name == "dot_general"
              and tuple(e.outvars[0].aval.shape) in (first, first[::-1])]
  assert products and not any(gathers[1] in anc[n] for n in products)
  plain = fast_jit(wrap(local))(*args)
  early = fast_jit(wrap(jaxfuse.send_early(local)))(*args)
  assert all(jax.tree.leaves(jax.tree.map(
      lambda u, v: bool(jnp.array_equal(u, v)), plain, early)))


def test_a_small_bucket_a_few_products_late_shares_the_point():
  """Two groups of four layers (``aligned``): each a sparse bucket of
  weights and a dense one of input scales, whose gradients need one more
  product (the input's) than the weights'. That product is a seventh of
  the group's backward, so both buckets of a group share a point: with
  window=1 the next group's backward runs beside both collectives, and
  only what follows its own fence waits for them. Giving the scales' bucket
  a point of its own would make the whole next group wait (no overlap)."""
  plan, wrap, local, args = _setup(8, num_buckets=2, scales=True)
  groups = [(b.collective, sorted(int(plan.leaves[j].path[3])
                                  for j in b.leaves)) for b in plan.buckets]
  assert groups == [("allgather", [4, 5, 6, 7]), ("psum", [4, 5, 6, 7]),
                    ("allgather", [0, 1, 2, 3]), ("psum", [0, 1, 2, 3])]
  eqns = _body(wrap(jaxfuse.send_early(local, window=1)), args)
  anc = _ancestors(eqns)
  first = [n for n, e in enumerate(eqns) if overlap.is_collective(e)
           and e.outvars[0].aval.shape][:2]
  shapes = [tuple(args[0][f"l{l}"]["w"].shape) for l in range(4)]
  weight_grads = [n for n, e in enumerate(eqns) if overlap.is_backward(e)
                  and e.primitive.name == "dot_general"
                  and any(tuple(v.aval.shape) in (s, s[::-1])
                          for v in e.outvars for s in shapes)]
  assert len(weight_grads) == 4
  assert not any(c in anc[n] for n in weight_grads for c in first)
  # The window still holds: the second group's dense bucket (its input
  # product comes after the group's fence) waits for both.
  last_psum = [n for n, e in enumerate(eqns) if overlap.is_collective(e)
               and e.primitive.name.startswith("psum")
               and e.outvars[0].aval.shape][-1]
  assert all(c in anc[last_psum] for c in first)


@pytest.mark.parametrize("under_last", [True, False])
def test_finish_under_last_orders_the_updates(under_last):
  """With ``finish_under_last`` (the default) the last bucket's new
  parameters wait for every earlier bucket's (so XLA can run those only
  before the last collective ends), and the step is bitwise the same;
  without it nothing orders them."""
  plan, wrap, local, args = _setup(6)
  buckets = _layers_of_buckets(plan)
  assert len(buckets) >= 3
  early_local = (jaxfuse.send_early(local) if under_last else
                 jaxfuse.send_early(local, finish_under_last=False))
  outer = jax.make_jaxpr(wrap(early_local))(*args).jaxpr
  (eqn,) = [e for e in outer.eqns if e.primitive.name == "shard_map"]
  body = getattr(eqn.params["jaxpr"], "jaxpr", eqn.params["jaxpr"])
  anc = _ancestors(body.eqns)
  producer = {v: n for n, e in enumerate(body.eqns) for v in e.outvars}
  layers = sorted(int(k[1:]) for k in args[0])
  made = {l: producer[v] for l, v in zip(layers, body.outvars)}
  checked = 0
  for last in buckets[-1]:
    for bucket in buckets[:-1]:
      for layer in bucket:
        assert (made[layer] in anc[made[last]]) == under_last, (layer, last)
        checked += 1
  assert checked >= 3
  plain = fast_jit(wrap(local))(*args)
  early = fast_jit(wrap(early_local))(*args)
  assert all(jax.tree.leaves(jax.tree.map(
      lambda u, v: bool(jnp.array_equal(u, v)), plain, early)))
  with pytest.raises(ValueError, match="finish_under_last='yes'"):
    jaxfuse.send_early(local, finish_under_last="yes")


def test_work_counts_multiply_adds():
  """A product's multiply-adds: out · contracted size; a convolution's:
  out · (input features · kernel window); anything else: none."""
  def eqn(fn, *shapes):
    (e,) = [e for e in jax.make_jaxpr(fn)(*[jnp.ones(s) for s in shapes])
            .jaxpr.eqns if e.primitive.name in overlap.HEAVY]
    return e
  assert overlap.work(eqn(jnp.matmul, (3, 4), (4, 5))) == 3 * 5 * 4
  assert overlap.work(eqn(lambda a, b: jnp.einsum("bij,bjk->bik", a, b),
                          (2, 3, 4), (2, 4, 5))) == 2 * 3 * 5 * 4
  conv = eqn(lambda x, w: jax.lax.conv(x, w, (1, 1), "VALID"),
             (1, 2, 8, 8), (6, 2, 3, 3))
  assert overlap.work(conv) == (1 * 6 * 6 * 6) * (2 * 3 * 3)
  (tanh,) = jax.make_jaxpr(jnp.tanh)(jnp.ones(3)).jaxpr.eqns
  assert overlap.work(tanh) == 0


def test_work_counts_what_nested_jaxprs_hold():
  """A checkpointed layer's backward (the recompute's product and the two
  of its transpose), a jit, a scan (its body × length) and a cond (its
  heaviest branch) count the products inside them."""
  def only(fn, *shapes, where=lambda e: True):
    (e,) = [e for e in jax.make_jaxpr(fn)(*[jnp.ones(s) for s in shapes])
            .jaxpr.eqns if where(e) and e.primitive.name not in overlap.HEAVY
            and jax.extend.core.jaxprs_in_params(e.params)]
    return e
  mm = 3 * 5 * 4                                          # (3,4) @ (4,5)
  layer = jax.checkpoint(lambda w, x: jnp.sum(jnp.tanh(x @ w)))
  backward = only(jax.grad(layer, argnums=(0, 1)), (4, 5), (3, 4),
                  where=overlap.is_backward)
  assert overlap.work(backward) == 3 * mm
  assert overlap.work(only(jax.jit(jnp.matmul), (3, 4), (4, 5))) == mm

  def body(c, w):
    return c @ w, None
  scan = only(lambda c, ws: jax.lax.scan(body, c, ws)[0], (3, 4), (7, 4, 4))
  assert overlap.work(scan) == 7 * (3 * 4 * 4)
  cond = only(lambda p, a, b, c: jax.lax.cond(p > 0, lambda: a @ b,
                                              lambda: (a @ b) @ c),
              (), (3, 4), (4, 5), (5, 5),
              where=lambda e: e.primitive.name == "cond")
  assert overlap.work(cond) == mm + 3 * 5 * 5


def test_checkpointed_layers_keep_the_window_and_chain():
  """Layers under ``jax.checkpoint`` (the head plain, as in an LM): each
  one's backward is one equation whose products are nested in it; they
  still count as the backward's work, so each bucket keeps a point of its
  own. Counting only the top level, the head's products were all the
  work, every later fence shared one point, and the collectives were
  neither chained nor bounded by the window."""
  plan, wrap, local, args = _setup(6, remat=True)
  shapes = {int(k[1:]): tuple(v.shape) for k, v in args[0].items()}
  assert len(plan.buckets) >= 4
  for window in (1, 2, None):
    early = jaxfuse.send_early(local, window=window)
    assert _check_order(plan, _body(wrap(early), args), shapes,
                        window=window) >= 10


def test_plain_step_has_no_such_order():
  """The control: without send_early nothing makes the backward wait for a
  bucket's wire, so the check above fails."""
  plan, wrap, local, args = _setup(6)
  shapes = {int(k[1:]): tuple(v.shape) for k, v in args[0].items()}
  with pytest.raises(AssertionError, match="does not wait"):
    _check_order(plan, _body(wrap(local), args), shapes)


def test_start_early_marks_the_collectives_only():
  plan, wrap, local, args = _setup(4)
  lines = jax.jit(wrap(jaxfuse.send_early(local, start_early=True))).lower(
      *args).as_text().splitlines()
  hint = 'scheduler_hint = "force_delay_async"'
  gathers = [l for l in lines if "stablehlo.all_gather" in l]
  assert len(gathers) == len(plan.buckets)
  assert all(hint in l for l in gathers)
  # The loss's pmean: a region op, its attributes on its closing line.
  assert any(l.strip().startswith("})") and hint in l for l in lines)
  for op in ("dot_general", "concatenate", "tanh", "optimization_barrier"):
    assert not any(f"stablehlo.{op}" in l and hint in l for l in lines), op
  assert all(hint in l for l in jax.jit(wrap(jaxfuse.send_early(local))).lower(
      *args).as_text().splitlines() if "stablehlo.all_gather" in l)
  off = jax.jit(wrap(jaxfuse.send_early(local, start_early=False))).lower(
      *args).as_text()
  assert hint not in off


def _psum_step():
  mesh = mesh_of(WORKERS)
  x = jax.device_put(jnp.arange(2.0 * WORKERS),
                     NamedSharding(mesh, P("data")))
  fn = lambda f: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("data"),
                                       out_specs=P()))
  return (lambda v: jax.lax.psum(v * 2.0, "data")), x, fn


def test_warns_on_gpu_without_the_network_flags(monkeypatch):
  step, x, fn = _psum_step()
  monkeypatch.setattr(overlap.jax, "default_backend", lambda: "gpu")
  monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_latency_hiding_scheduler"
                     "=true")
  with pytest.warns(UserWarning, match=r"jaxfuse.xla_flags\(network GB/s\)"):
    out = fn(jaxfuse.send_early(step))(x)
  np.testing.assert_array_equal(out, fn(step)(x))
  monkeypatch.setenv("XLA_FLAGS", "--foo=1 " + jaxfuse.xla_flags(3.0))
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    fn(jaxfuse.send_early(step))(x)
  monkeypatch.setattr(overlap.jax, "default_backend", lambda: "cpu")
  monkeypatch.delenv("XLA_FLAGS")
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    fn(jaxfuse.send_early(step))(x)


def test_ordered_effects_run_unchanged_with_a_warning():
  mesh = mesh_of(WORKERS)
  seen = []

  def step(x):
    jax.experimental.io_callback(lambda v: seen.append(float(v[0])) or v,
                                 jax.ShapeDtypeStruct((1,), jnp.float32),
                                 x[:1], ordered=True)
    return jax.lax.psum(x * 2.0, "data")
  x = jax.device_put(jnp.arange(2.0 * WORKERS),
                     NamedSharding(mesh, P("data")))
  fn = lambda f: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("data"),
                                       out_specs=P()))
  with pytest.warns(UserWarning, match="ordered side effects"):
    out = fn(jaxfuse.send_early(step))(x)
  np.testing.assert_array_equal(out, fn(step)(x))


def test_collectives_inside_a_jit_warn_and_change_nothing():
  step, x, fn = _psum_step()
  inner = jax.jit(step)
  with pytest.warns(UserWarning, match=r"inside p?jit calls"):
    out = fn(jaxfuse.send_early(inner))(x)
  np.testing.assert_array_equal(out, fn(inner)(x))


@hypothesis.settings(max_examples=3, deadline=None)
@hypothesis.given(layers=st.integers(2, 3),
                  bucket_bytes=st.sampled_from([2000, 6000]),
                  density=st.sampled_from([0.1, 0.3]),
                  seed=st.integers(0, 3))
def test_property_identity_and_order(layers, bucket_bytes, density, seed):
  """For any chain, bucket size and density: the same step, bitwise, with
  every bucket's wire ahead of the later buckets' backward, and each
  bucket's result needed two buckets on (the default window)."""
  plan, wrap, local, args = _setup(layers, "sgd", bucket_bytes, density,
                                   seed)
  hypothesis.assume(len(plan.buckets) >= 2)
  early = jaxfuse.send_early(local)
  with warnings.catch_warnings():
    # no fallback warning on a plain step (others, e.g. a GPU run's Pallas
    # deprecation or missing network flags, are not send_early's to judge)
    warnings.filterwarnings("error", message="jaxfuse.send_early: the step")
    # both compiled alike, with XLA:CPU's quicker codegen (the same HLO)
    a, b = fast_jit(wrap(local))(*args), fast_jit(wrap(early))(*args)
  assert all(jax.tree.leaves(jax.tree.map(
      lambda u, v: bool(jnp.array_equal(u, v)), a, b)))
  shapes = {int(k[1:]): tuple(v.shape) for k, v in args[0].items()}
  _check_order(plan, _body(wrap(early), args), shapes, window=2)


def test_a_quarter_of_the_typical_gap_opens_a_point():
  # Fences at work 10, 20 and 20 + x: gaps 10, 10, x; the work-weighted
  # median gap is 10, so a point opens once 2.5 of work lie since the last
  # one opened: x = 3 opens a third point, x = 2 joins the second.
  assert overlap.points_of_work([10, 20, 23]) == [1, 2, 3]
  assert overlap.points_of_work([10, 20, 22]) == [1, 2, 2]
  # At exactly a quarter it opens.
  assert overlap.points_of_work([10, 20, 22.5]) == [1, 2, 3]


def test_the_last_point_holds_only_what_the_backward_feeds():
  # Two buckets at point 2 and the loss's pmean (not fed by the backward)
  # traced last at the same point: the last point is the two buckets, so
  # finish_under_last ties their readers, not the loss's.
  assert overlap.last_point([1, 2, 2, 2], [True, True, True, False]) == [1, 2]
  # A pmean at a point of its own after the last bucket changes nothing.
  assert overlap.last_point([1, 2, 3], [True, True, False]) == [1]
  assert overlap.last_point([1, 1], [False, False]) == []


def test_fences_at_no_work_share_one_point():
  # Every fence before any backward work (W = 0 for all): no work lies
  # between them, so they share the first point (side by side), unless a
  # kind repeats at more work (it cannot at the same work).
  assert overlap.points_of_work([0.0, 0.0, 0.0]) == [1, 1, 1]
  assert overlap.points_of_work(
      [0.0, 0.0], kinds=["all_gather", "psum"]) == [1, 1]


def test_without_products_each_backward_equation_counts_one():
  """A backward of elementwise equations only (no dot, no convolution):
  W_k is the number of backward equations run before fence k, so the
  fences still stand apart (all at work 0 they would share a point)."""
  def step(a, b):
    ga, gb = jax.grad(lambda a, b: jnp.sum(jnp.sin(a) * jnp.cos(b)),
                      argnums=(0, 1))(a, b)
    return jax.lax.psum(gb, "d"), jax.lax.psum(ga, "d")
  jaxpr = jax.make_jaxpr(step, axis_env=[("d", 2)])(jnp.ones(3),
                                                    jnp.ones(3)).jaxpr
  order, fences = overlap.fenced_order(jaxpr)
  assert len(fences) == 2
  # counted by hand from the order: backward equations before each fence
  backward = [overlap.is_backward(jaxpr.eqns[n]) for n in order]
  want = [float(sum(backward[:f])) for f in fences]
  assert 0 < want[0] < want[1] == sum(backward)
  assert overlap.fence_work(jaxpr.eqns, order, fences) == want
  assert overlap.points_of_work(want) == [1, 2]


def test_readers_run_early_are_no_collectives():
  """``finish_under_last`` runs the earlier results' readers ahead; a
  collective among them (here one reading a reader's output) stays in its
  turn, and so does what reads it."""
  def step(a):
    x = jax.lax.psum(a, "d")          # the earlier collective's result
    y = x * 2.0                       # its reader
    z = jax.lax.psum(y, "d")          # a later collective: not run early
    return y + 1.0, z + 1.0
  jaxpr = jax.make_jaxpr(step, axis_env=[("d", 2)])(jnp.ones(3)).jaxpr
  names = [e.primitive.name for e in jaxpr.eqns]
  assert names == ["psum", "mul", "psum", "add", "add"], names
  order = list(range(len(names)))
  (x,) = jaxpr.eqns[0].outvars
  available = {jaxpr.invars[0], x}
  # after position 0: the mul and the first add read x; the second psum
  # and the add after it wait for their turn
  assert overlap.readers(jaxpr.eqns, order, 0, [x], available, []) == [1, 3]
