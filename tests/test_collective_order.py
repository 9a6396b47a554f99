"""``benchmarks/collectives.py collective-order``: whether the processes of
a run compiled the same collectives in the same order, from XLA dumps."""

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
  with repo_modules("benchmarks/tools", "collective_order") as module:
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
  found = co.scheduled_modules(dumps["a"])
  assert list(found) == ["jit_gather_first.cpu#0"]
  listed = found["jit_gather_first.cpu#0"]
  assert [c.split()[0] for c in listed] == ["all-gather", "all-reduce"]
  # The groups as this JAX prints them.
  assert all(c.endswith((" {{0,1}}", " mesh['d'=2] {'d'}")) for c in listed)
  other = co.scheduled_modules(dumps["c"])["jit_psum_first.cpu#0"]
  assert [c.split()[0] for c in other] == ["all-reduce", "all-gather"]


def test_same_programs_agree_and_reordered_ones_do_not(co, dumps, capsys,
                                                       tmp_path):
  assert co.main([str(dumps["a"]), str(dumps["b"]),
                  "--lists-out", str(tmp_path)]) == 0
  assert ("the same 2 collectives in the same order in all 2 processes"
          in capsys.readouterr().out)
  listed = (tmp_path / "b" / "jit_gather_first.cpu_0").read_text()
  assert listed.splitlines()[0].startswith("all-gather")
  # Another program under another name: not compiled by the other.
  assert co.main([str(dumps["a"]), str(dumps["c"])]) == 1
  assert "not compiled by" in capsys.readouterr().out


def test_finds_where_two_lists_first_differ(co):
  assert co.first_difference(["a", "b"], ["a", "b"]) is None
  assert co.first_difference(["a", "b", "c"], ["a", "c", "b"]) == 1
  assert co.first_difference(["a", "b"], ["a", "b", "c"]) == 2


def test_pairs_modules_by_name_and_order_not_number(co, tmp_path, capsys):
  """Process 1 compiled one more module first (its numbers shift); its
  second 'jit_step' lists the psum first."""
  gather = "%a = f32[8]{0} all-gather(%p), replica_groups={{0,1}}\n"
  psum = "%b = f32[4]{0} all-reduce(%p), replica_groups={{0,1}}\n"
  for d, files in (("p0", {1: gather, 2: gather + psum}),
                   ("p1", {1: "", 2: gather, 3: psum + gather})):
    (tmp_path / d).mkdir()
    for number, text in files.items():
      name = "jit_other" if (d, number) == ("p1", 1) else "jit_step"
      (tmp_path / d / f"module_{number:04d}.{name}.gpu_after_optimizations"
       ".txt").write_text(f"HloModule {name}\n\nENTRY %main {{\n{text}}}\n")
  found = co.scheduled_modules(tmp_path / "p1")
  assert list(found) == ["jit_step.gpu#0", "jit_step.gpu#1"]
  assert co.main([str(tmp_path / "p0"), str(tmp_path / "p1")]) == 1
  out = capsys.readouterr().out
  assert "jit_step.gpu#0: the same 1 collectives" in out
  assert "jit_step.gpu#1: " in out and "at collective 0:" in out


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


def test_a_module_filter_that_matches_nothing_finds_no_collectives(co, dumps,
                                                                   capsys):
  assert co.scheduled_modules(dumps["a"], "no_such_module") == {}
  assert co.main([str(dumps["a"]), "--module", "no_such_module"]) == 1
  assert "no module with collectives" in capsys.readouterr().out
