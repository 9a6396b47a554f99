"""The planners at their boundaries, where the papers' inequalities are
strict: SAFusion's first buffer needs a gain, ``densify`` switches a group
only when that is faster, the ``size`` rule closes a group that reaches
``bucket_bytes`` exactly, a last group of exactly ``last_bucket_bytes``
stays whole; timing never times a call's first run; a costs file from
before ``workers`` reads K as at least 2. Expected values by hand."""

import json

import jax
import jax.numpy as jnp

import jaxfuse
from jaxfuse.planning import grouping
from jaxfuse.planning import optimal
from jaxfuse.planning import strategies
from jaxfuse.planning import timing
from jaxfuse.planning.costs import Costs
from jaxfuse.planning.costs import LinearCost

A = 2.0**-10    # α of both collectives; β = 0; backward A/2 a leaf


def _problem(n, sparse, backward, wire, alpha=A, beta=0.0):
  return optimal.GroupingProblem(
      order=tuple(range(n)), sparse=tuple(sparse), backward=tuple(backward),
      compress=(0.0,) * n, wire=tuple(wire),
      allgather=LinearCost(alpha, beta), psum=LinearCost(alpha, beta),
      forward=0.0, overlap=1.0)


def test_safusion_first_buffer_needs_a_strict_gain():
  # Eq. 2 for N_1 = 2: T_b(0..1) + C(0..1) = A + A against C(0) + C(1) =
  # 2A: equal, no gain, so N_1 = 1. Buffer 2 then fills until its fusion
  # time reaches C(0) = A: leaves 1, 2; buffer 3 is leaf 3. Long tail
  # (Eq. 3): Σ_{j>=2} F_j = A + A/2; C_1 + C_2 = 2A exceeds it, so
  # buffers 2 … 3 become one: [0], [1, 2, 3].
  p = _problem(4, [True] * 4, [A / 2] * 4, [0] * 4)
  assert strategies.safusion(p, num_buckets=2) == ((0,), (1, 2, 3))


def test_densify_keeps_a_group_whose_dense_step_is_no_faster():
  # Two sparse leaves, backward 1 s each, no compression; group [0]'s
  # collective (sparse 8 B or dense 400 B, β = 1e-6 s/B) hides under leaf
  # 1's backward either way, so making it dense changes nothing: kept
  # sparse. Group [1] dense would end later.
  p = _problem(2, [True, True], [1.0, 1.0], [8, 8], alpha=0.0, beta=1e-6)
  assert p.time([0, 1]) == 2.0 + 8e-6
  assert strategies.densify(p, [[0], [1]], [400, 400]) == ()


def test_size_closes_a_group_that_reaches_bucket_bytes_exactly():
  # Six float32 leaves of 1024 elements (4096 bytes each), ready in
  # reverse pytree order (5, 4, …, 0); bucket_bytes = 8192: every pair
  # reaches it exactly, so three groups of two.
  params = [jax.ShapeDtypeStruct((1024,), jnp.float32) for _ in range(6)]
  plan = jaxfuse.plan(params, strategy="size", bucket_bytes=8192,
                      density=1.0)
  assert [b.leaves for b in plan.buckets] == [(5, 4), (3, 2), (1, 0)]
  # One byte more: three leaves a group.
  plan = jaxfuse.plan(params, strategy="size", bucket_bytes=8193,
                      density=1.0)
  assert [b.leaves for b in plan.buckets] == [(5, 4, 3), (2, 1, 0)]


def test_a_last_group_of_exactly_the_limit_stays_whole():
  nbytes = [4096, 4096, 4096, 4096]
  assert grouping.cut_last([[0, 1], [2, 3]], nbytes, 8192) == [[0, 1], [2, 3]]
  # One byte less: the final part is the last leaf alone.
  assert grouping.cut_last([[0, 1], [2, 3]], nbytes, 8191) == [[0, 1], [2],
                                                               [3]]
  params = [jax.ShapeDtypeStruct((1024,), jnp.float32) for _ in range(4)]
  plan = jaxfuse.plan(params, strategy="single", density=1.0,
                      last_bucket_bytes=16384)
  assert [b.leaves for b in plan.buckets] == [(3, 2, 1, 0)]


def test_every_call_runs_once_untimed_even_with_no_warmup():
  calls = []

  def fn(x):
    calls.append(x)
    return x

  times = timing.time_calls([(fn, 1), (fn, 2)], warmup=0, repeats=3)
  assert len(times) == 2
  # One untimed call each, then 3 timed rounds, round-robin.
  assert calls == [1, 2] + [1, 2] * 3
  calls.clear()
  timing.time_calls([(fn, 1)], warmup=2, repeats=1)
  assert calls == [1, 1, 1]


def test_an_old_file_profiled_on_one_device_reads_as_two_workers():
  costs = Costs({"allgather": LinearCost(1e-4, 1e-9),
                 "psum": LinearCost(2e-4, 3e-9)}, LinearCost(0.0, 0.0),
                (1e-3,), workers=4)
  body = json.loads(costs.to_json())
  del body["workers"]                       # written before the field
  body["version"] = 1
  body["provenance"] = {"devices": {"mesh": {"data": 1}}}
  assert Costs.from_json(json.dumps(body)).workers == 2
  body["provenance"] = {"devices": {"mesh": {"host": 2, "local": 3}}}
  assert Costs.from_json(json.dumps(body)).workers == 6
  body["provenance"] = {}
  assert Costs.from_json(json.dumps(body)).workers == 2
