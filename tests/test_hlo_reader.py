"""``jaxfuse.sync.hlo``: the HLO text reader under the buckets-apart
check, the overlap benchmark and the benchmarks' HLO tools."""

import textwrap

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import pytest

from jaxfuse.sync import hlo

from _harness import mesh_of


@pytest.fixture(scope="module")
def compiled_text():
  """A real 2-device program: a loop, a psum and a reduction."""
  mesh = mesh_of(2)

  def body(x):
    y = lax.fori_loop(0, 3, lambda i, v: jnp.sin(v) + i, x)
    return lax.psum(jnp.sum(y * y), "data")

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"),
                            out_specs=P()))
  x = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("data")))
  return f.lower(x).compile().as_text()


def test_reads_every_computation_with_the_entry_last(compiled_text):
  comps = hlo.computations(compiled_text)
  assert [c.entry for c in comps].count(True) == 1
  assert comps[-1].entry       # callers come after what they call
  names = [c.name for c in comps]
  assert len(set(names)) == len(names)
  assert all(c.instructions for c in comps)
  # Each instruction line of the text is read once, in some computation.
  listed = sum(len(c.instructions) for c in comps)
  lines = [l for l in compiled_text.splitlines()
           if " = " in l and l.startswith(" ")]
  assert listed == len(lines)


def test_called_computations_are_listed_before_their_caller(compiled_text):
  comps = hlo.computations(compiled_text)
  where = {c.name: n for n, c in enumerate(comps)}
  loops = [(n, i) for n, c in enumerate(comps) for i in c.instructions
           if i.opcode == "while"]
  assert loops, "the fori_loop compiles to a while"
  for n, inst in loops:
    for key in ("condition", "body"):
      called = inst.attributes.split(f"{key}=")[1].split(",")[0].lstrip("%")
      assert where[called] < n


def test_keeps_operands_parameters_and_attributes(compiled_text):
  entry = hlo.entry_instructions(compiled_text)
  params = sorted(i.parameter for i in entry if i.opcode == "parameter")
  assert params == list(range(len(params))) and params
  names = {i.name for i in entry}
  reduce = [i for i in entry if i.opcode in ("all-reduce", "all-reduce-start")]
  assert len(reduce) == 1
  assert "replica_groups=" in reduce[0].attributes
  assert reduce[0].operands and all(o in names for o in reduce[0].operands)
  # the psum's single input reaches it from the one parameter
  [(inst, deps)] = hlo.collective_inputs(compiled_text)
  assert inst.name == reduce[0].name and deps == frozenset({0})


GPU_STYLE = textwrap.dedent("""\
    HloModule jit_step, is_scheduled=true

    %add (a: f32[], b: f32[]) -> f32[] {
      %a = f32[] parameter(0)
      %b = f32[] parameter(1)
      ROOT %s = f32[] add(%a, %b)
    }, execution_thread="main"

    %wrapped (w: f32[4]) -> f32[16] {
      %w = f32[4]{0} parameter(0)
      ROOT %ag = f32[16]{0} all-gather(%w), replica_groups={{0,1,2,3}}, dimensions={0}
    }

    ENTRY %main.9 (p0: f32[4], p1: f32[4]) -> f32[16] {
      %p0 = f32[4]{0} parameter(0)
      %p1 = f32[4]{0} parameter(1)
      %f0 = f32[4]{0} fusion(%p0), kind=kLoop, calls=%x, metadata={op_name="jit(step)/jvp(f)/mul"}
      %b0 = f32[4]{0} fusion(%f0), kind=kLoop, calls=%x, metadata={op_name="jit(step)/transpose(jvp(f))/mul"}
      %ags = (f32[4]{0}, f32[16]{0}) all-gather-start(%b0), replica_groups={{0,1,2,3}}, dimensions={0}
      %b1 = f32[4]{0} fusion(%p1, %f0), kind=kLoop, calls=%x, metadata={op_name="jit(step)/transpose(jvp(f))/dot"}
      %ars = f32[4]{0} all-reduce-start(%b1), replica_groups={{0,1,2,3}}, to_apply=%add
      %agd = f32[16]{0} all-gather-done(%ags)
      %ard = f32[4]{0} all-reduce-done(%ars)
      ROOT %out = f32[16]{0} fusion(%agd, %ard), kind=kLoop, calls=%y
    }, execution_thread="main"
    """)


def test_computations_close_at_braces_with_attributes():
  comps = hlo.computations(GPU_STYLE)
  assert [(c.name, c.entry, len(c.instructions)) for c in comps] == [
      ("add", False, 3), ("wrapped", False, 2), ("main.9", True, 10)]


def test_operands_with_or_without_percent_types_and_comments():
  text = textwrap.dedent("""\
      ENTRY main {
        a = f32[4]{0} parameter(0)
        b = (f32[], s32[]) parameter(1)
        c = f32[4]{0} constant({1, 2, 3, 4})
        f = f32[4]{0} fusion(f32[4]{0} a, (f32[], s32[]) %b, c, a, a, /*index=5*/%c), kind=kLoop, calls=%x
      }""")
  insts = {i.name: i for i in hlo.entry_instructions(text)}
  assert insts["f"].operands == ("a", "b", "c", "a", "a", "c")
  assert insts["c"].operands == () and insts["b"].parameter == 1
  assert "kind=kLoop" in insts["f"].attributes


LOOP_THEN_GATHER = textwrap.dedent("""\
    HloModule m

    %body (t: (s32[], f32[4])) -> (s32[], f32[4]) {
      %t = (s32[], f32[4]{0}) parameter(0)
      %i = s32[] get-tuple-element(%t), index=0
      %x = f32[4]{0} get-tuple-element(%t), index=1
      %s = f32[4]{0} all-reduce(%x), replica_groups={{0,1}}, to_apply=%add
      ROOT %r = (s32[], f32[4]{0}) tuple(%i, %s)
    }

    ENTRY %main (p: f32[4], q: (s32[], f32[4])) -> f32[8] {
      %p = f32[4]{0} parameter(0)
      %q = (s32[], f32[4]{0}) parameter(1)
      %loop = (s32[], f32[4]{0}) while(%q), condition=%cond, body=%body
      %g = f32[8]{0} all-gather(%p), replica_groups={{0,1}}, dimensions={0}
      ROOT %cp = f32[4]{0} collective-permute(%p), source_target_pairs={{0,1},{1,0}}
    }
    """)


def test_collective_list_puts_a_loops_collectives_where_the_loop_runs():
  assert hlo.collective_list(LOOP_THEN_GATHER) == [
      "while{", "all-reduce f32[4]{0} {{0,1}}", "}",
      "all-gather f32[8]{0} {{0,1}}",
      "collective-permute f32[4]{0} {{0,1},{1,0}}"]
  loop = "  %loop = (s32[], f32[4]{0}) while(%q), condition=%cond, body=%body\n"
  gather = ("  %g = f32[8]{0} all-gather(%p), replica_groups={{0,1}}, "
            "dimensions={0}\n")
  swapped = LOOP_THEN_GATHER.replace(loop + gather, gather + loop)
  assert swapped != LOOP_THEN_GATHER
  assert hlo.collective_list(swapped)[0].startswith("all-gather")
  other_pairs = LOOP_THEN_GATHER.replace("{{0,1},{1,0}}", "{{1,0},{0,1}}")
  assert hlo.collective_list(other_pairs) != hlo.collective_list(
      LOOP_THEN_GATHER)


def test_collective_list_reads_gpu_async_starts_in_schedule_order():
  assert hlo.collective_list(GPU_STYLE) == [
      "all-gather-start (f32[4]{0}, f32[16]{0}) {{0,1,2,3}}",
      "all-reduce-start f32[4]{0} {{0,1,2,3}}"]
  with pytest.raises(hlo.HloError, match="no ENTRY"):
    hlo.collective_list(GPU_STYLE.replace("ENTRY ", ""))
  first = "  %p1 = f32[4]{0} parameter(1)\n"
  wrapper = ("  %as = ((f32[4]{0}), f32[16]{0}) async-start(%p1), "
             "calls=%wrapped\n")
  assert hlo.collective_list(GPU_STYLE.replace(first, first + wrapper))[:4] \
      == ["async-start ((f32[4]{0}), f32[16]{0})", "async-start{",
          "all-gather f32[16]{0} {{0,1,2,3}}", "}"]


def test_schedule_places_async_collectives_against_the_backward():
  s = hlo.schedule(GPU_STYLE)
  assert s.num_instructions == 10
  assert s.backward == (3, 5)          # b0 and b1
  assert s.starts == (4, 6) and s.dones == (7, 8)
  assert s.opcodes == ("all-gather", "all-reduce")
  assert s.started_in_backward() == 1  # the all-gather, between b0 and b1
  assert hlo.schedule(GPU_STYLE, ("all-gather",)).starts == (4,)


def test_collective_inputs_follow_operands_to_parameters():
  found = {i.name: deps for i, deps in hlo.collective_inputs(GPU_STYLE)}
  assert found == {"ags": frozenset({0}), "ars": frozenset({0, 1})}


def test_an_entry_alone_reads_and_text_without_one_is_refused():
  entry = GPU_STYLE[GPU_STYLE.index("ENTRY"):]
  assert [i.name for i in hlo.entry_instructions(entry)][:2] == ["p0", "p1"]
  with pytest.raises(hlo.HloError, match="no ENTRY"):
    hlo.entry_instructions(GPU_STYLE.replace("ENTRY ", ""))
  cut = entry[:entry.index("%agd")]        # no closing brace
  assert [i.name for i in hlo.entry_instructions(cut)][-1] == "ars"
  with pytest.raises(hlo.HloError, match="no instructions"):
    hlo.entry_instructions("ENTRY %main () -> f32[] {\n}\n")
