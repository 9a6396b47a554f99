"""``jaxfuse.check_same_collectives`` in one process, and the message it
raises with (tests/test_distributed.py runs it on 2 processes)."""

import jax
from jax import monitoring
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxfuse
from jaxfuse.sync import agreement

from _harness import mesh_of

GATHER = "all-gather f32[16]{0} {{0,1}}"
PSUM = "all-reduce f32[] {{0,1}}"


def test_equal_lists_need_no_message():
  assert agreement.describe_difference([[GATHER, PSUM]] * 3, "s") is None
  assert agreement.describe_difference([[]], "s") is None


def test_the_message_names_the_process_the_index_and_both_entries():
  msg = agreement.describe_difference(
      [[GATHER, PSUM], [GATHER, PSUM], [GATHER, GATHER]], "the step")
  assert "for the step: process 2 differs from process 0 at collective 1" \
      in msg
  assert f"process 0 has {PSUM!r}, process 2 {GATHER!r}" in msg


def test_a_list_that_ends_early_differs_where_it_ends():
  msg = agreement.describe_difference([[GATHER, PSUM], [GATHER]], "s")
  assert "at collective 1 (of 2 and 1)" in msg
  assert "process 1 nothing (it ends)" in msg
  assert agreement.first_difference([GATHER], [GATHER, PSUM]) == 1


def test_one_process_returns_the_programs_collectives_in_order():
  mesh = mesh_of(2)

  def body(x):
    return jax.lax.psum(jnp.sum(jax.lax.all_gather(x, "data", tiled=True)),
                        "data")
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"),
                            out_specs=P()))
  x = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("data")))
  compiled = f.lower(x).compile()
  listed = jaxfuse.check_same_collectives(compiled)
  assert [c.split(" ")[0] for c in listed] == ["all-gather", "all-reduce"]
  assert jaxfuse.check_same_collectives(compiled.as_text()) == listed
  assert float(f(x)) == 2 * sum(range(8))    # the step still runs


def test_the_call_after_the_check_runs_the_checked_program():
  """What the example relies on: the jitted call with the same arguments
  compiles nothing more (no compile, no cache lookup); a fresh function
  would (the listener sees compiles)."""
  mesh = mesh_of(2)
  step = lambda x: jax.lax.psum(jnp.sin(x), "data")
  make = lambda: jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P("data"),
                                       out_specs=P("data")),
                         donate_argnums=0)
  x = lambda: jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("data")))
  events = []
  record = lambda name, *args, **kwargs: events.append(name)
  monitoring.register_event_listener(record)
  monitoring.register_event_duration_secs_listener(record)
  try:
    f, xs = make(), x()
    jaxfuse.check_same_collectives(f.lower(xs).compile())
    events.clear()
    jax.block_until_ready(f(xs))
    assert not [e for e in events if "compil" in e]
    g, xs = make(), x()
    jax.block_until_ready(g(xs))
    assert [e for e in events if "compil" in e]
  finally:
    monitoring.unregister_event_listener(record)
    monitoring.unregister_event_duration_listener(record)
