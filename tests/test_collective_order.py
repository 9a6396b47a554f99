"""``benchmarks/collective_order.py``: whether the processes of a run
compiled the same collectives in the same order, from XLA dumps."""

import os
import subprocess
import sys
import textwrap

import pytest

from _harness import repo_modules

# Two programs on 2 CPU devices: an all-gather then a psum, and the same
# two the other way round (each result feeds the next, so the compiler
# keeps the order).
PROGRAM = textwrap.dedent("""
    import sys
    import jax, jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P
    mesh = jax.make_mesh((2,), ("d",))
    def gather_first(x):
      g = jax.lax.all_gather(x, "d")
      return jax.lax.psum(g.sum() * x, "d")
    def psum_first(x):
      s = jax.lax.psum(x, "d")
      return jax.lax.all_gather(s * 2, "d").sum(0)
    body = gather_first if sys.argv[1] == "gather" else psum_first
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"),
                              out_specs=P(), check_vma=False))
    f(jax.device_put(jnp.ones(8), NamedSharding(mesh, P("d")))).block_until_ready()
""")


@pytest.fixture(scope="module")
def co():
  with repo_modules("benchmarks", "collective_order") as module:
    yield module


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
  """XLA dumps: two of the gather-first program, one of psum-first."""
  root = tmp_path_factory.mktemp("dumps")
  out = {}
  for name, order in (("a", "gather"), ("b", "gather"), ("c", "psum")):
    env = dict(os.environ, JAX_NUM_CPU_DEVICES="2", JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_dump_to={root / name}")
    subprocess.run([sys.executable, "-c", PROGRAM, order], env=env,
                   check=True, capture_output=True, timeout=300)
    out[name] = root / name
  return out


def test_lists_the_collectives_in_program_order(co, dumps):
  f, found = co.scheduled_module(dumps["a"], None)
  assert "gather_first" in f.name
  assert [c.split()[0] for c in found] == ["all-gather", "all-reduce"]
  assert all("{{0,1}}" in c for c in found)
  _, other = co.scheduled_module(dumps["c"], None)
  assert [c.split()[0] for c in other] == ["all-reduce", "all-gather"]


def test_same_programs_agree_and_reordered_ones_do_not(co, dumps, capsys,
                                                       tmp_path):
  assert co.main([str(dumps["a"]), str(dumps["b"]),
                  "--lists-out", str(tmp_path)]) == 0
  assert "the same 2 collectives in the same order" in capsys.readouterr().out
  assert (tmp_path / "b.txt").read_text().splitlines()[1].startswith(
      "all-gather")
  assert co.main([str(dumps["a"]), str(dumps["c"])]) == 1
  out = capsys.readouterr().out
  assert "differs from" in out and "at collective 0:" in out


def test_a_module_filter_that_matches_nothing_finds_no_collectives(co, dumps):
  f, found = co.scheduled_module(dumps["a"], "no_such_module")
  assert f is None and found == []


def test_parses_gpu_style_async_starts(co):
  text = textwrap.dedent("""
      ENTRY %main {
        %p = f32[4]{0} parameter(0)
        %ags = (f32[4]{0}, f32[16]{0}) all-gather-start(%p), channel_id=3, replica_groups=[1,4]<=[4], dimensions={0}
        %agd = f32[16]{0} all-gather-done(%ags)
        ROOT %ars = f32[16]{0} all-reduce-start(%agd), channel_id=4, replica_groups={{0,1,2,3}}, to_apply=%add
      }""")
  assert co.collectives(text) == [
      "all-gather-start (f32[4]{0}, f32[16]{0}) [1,4]<=[4]",
      "all-reduce-start f32[16]{0} {{0,1,2,3}}"]
