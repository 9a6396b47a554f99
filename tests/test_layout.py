"""The package's shape: imports point one way, schemes are registered once."""

import ast
import pathlib

import jaxfuse
from jaxfuse import collectives
from jaxfuse import plans as plan_lib

ROOT = pathlib.Path(jaxfuse.__file__).parent


def _module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(ROOT.parent).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
  """module -> the jaxfuse modules it imports (anywhere in its body)."""
  names = {_module_name(p) for p in ROOT.rglob("*.py")}
  graph = {}
  for path in ROOT.rglob("*.py"):
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Import):
        found.update(a.name for a in node.names)
      elif isinstance(node, ast.ImportFrom) and node.module:
        # `from pkg import mod` imports mod; `from mod import name`, mod.
        for a in node.names:
          sub = f"{node.module}.{a.name}"
          found.add(sub if sub in names else node.module)
    graph[_module_name(path)] = {m for m in found if m in names}
  return graph


def _reaches(graph, start, goal) -> bool:
  seen, todo = set(), [start]
  while todo:
    m = todo.pop()
    for n in graph.get(m, ()):
      if n == goal:
        return True
      if n not in seen:
        seen.add(n)
        todo.append(n)
  return False


def test_no_import_circles():
  graph = _imports()
  circles = [m for m in graph if _reaches(graph, m, m)]
  assert not circles, circles


def test_the_step_wing_never_imports_the_planning_wing():
  graph = _imports()
  step = [m for m in graph if not m.startswith("jaxfuse.planning")
          and m not in ("jaxfuse", "jaxfuse.__main__")]
  bad = {m: sorted(d for d in graph[m] if d.startswith("jaxfuse.planning"))
         for m in step}
  assert not {m: d for m, d in bad.items() if d}


def test_kernels_sit_below_sparsify():
  graph = _imports()
  kernels = [m for m in graph if m.startswith("jaxfuse.kernels")]
  assert kernels and not any(_reaches(graph, m, "jaxfuse.sparsify")
                             for m in kernels)
  assert _reaches(graph, "jaxfuse.sparsify", "jaxfuse.kernels")


def test_every_plan_collective_has_one_scheme():
  assert set(collectives.SCHEMES) == set(plan_lib.COLLECTIVES)
  for name, scheme in collectives.SCHEMES.items():
    assert scheme.name == name
    assert scheme.sparse == (name in plan_lib.SPARSE_COLLECTIVES)
