"""The house rules (CONTRIBUTING, issue 72), pinned on the source tree.

(a) at most 6 parameters per function outside jaxfuse/kernels/;
(b) optax-style Args:/Returns:/Raises: sections on every public function;
(c) the library speaks of itself: no card names, millisecond figures,
    dates or results/ paths;
(d) no module over 640 lines;
(e) no ``import ... as *_lib`` aliases: a module is imported by its name;
(f) README, docs/ and each CHANGELOG release short enough to read.
"""

import ast
import inspect
import pathlib
import re

import pytest

import jaxfuse

ROOT = pathlib.Path(jaxfuse.__file__).parent
MAX_PARAMS = 6
MAX_LINES = 640
LAB_TALK = re.compile(
    r"H100|H200|[0-9] ?ms\b|20[0-9]{2}-[0-9]{2}-[0-9]{2}|results/")
PUBLIC_MODULES = ("checkpoint", "clipping", "elastic", "grouped",
                  "collectives", "kernels")


def _sources():
  return sorted(ROOT.rglob("*.py"))


def _name(path):
  return str(path.relative_to(ROOT.parent))


def _param_count(fn: ast.FunctionDef) -> int:
  """positional + keyword-only + *args + **kwargs, without self/cls."""
  a = fn.args
  names = [x.arg for x in a.posonlyargs + a.args]
  if names and names[0] in ("self", "cls"):
    names = names[1:]
  return (len(names) + len(a.kwonlyargs) + (a.vararg is not None)
          + (a.kwarg is not None))


def test_the_parameter_count_sees_every_kind():
  fn, = ast.parse("def f(self, a, /, b, *c, d, e=1, **f): pass").body
  assert _param_count(fn) == 6
  fn, = ast.parse("def f(a, b, c, d, e, f, g): pass").body
  assert _param_count(fn) == 7


# The one documented exception: ``jaxfuse.plan``, the planner's front door
# (its knobs are the plan's own fields), takes at most 12.
WIDER = {("jaxfuse/planning/planner.py", "plan"): 12}


def test_no_function_outside_kernels_takes_more_than_six_parameters():
  over = []
  for path in _sources():
    if "kernels" in path.relative_to(ROOT).parts:
      continue
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        n = _param_count(node)
        if n > WIDER.get((_name(path), node.name), MAX_PARAMS):
          over.append(f"{_name(path)}:{node.lineno} {node.name} ({n})")
  assert not over, (
      f"functions with more than {MAX_PARAMS} parameters: {over}; group "
      "settings in a NamedTuple, and take old keywords with "
      "jaxfuse._deprecated.legacy_keywords")


def _public_functions():
  """(name, function) of jaxfuse.__all__ and of the public modules."""
  found = {}
  for name in jaxfuse.__all__:
    obj = getattr(jaxfuse, name)
    if inspect.isfunction(obj):
      found[f"jaxfuse.{name}"] = obj
  for module_name in PUBLIC_MODULES:
    module = getattr(jaxfuse, module_name)
    names = getattr(module, "__all__", None) or [
        n for n in dir(module) if not n.startswith("_")]
    for name in names:
      obj = getattr(module, name)
      if (inspect.isfunction(obj) and
          obj.__module__.startswith("jaxfuse")):
        found[f"jaxfuse.{module_name}.{name}"] = obj
  return sorted(found.items())


def _missing_sections(fn) -> list:
  doc = inspect.getdoc(fn) or ""
  wanted = ["Returns:", "Raises:"]
  takes = [p for p in inspect.signature(fn).parameters.values()
           if p.name not in ("self", "cls", "legacy")]
  if takes:
    wanted.insert(0, "Args:")
  return [s for s in wanted if not re.search(rf"^{s}", doc, re.M)]


def test_public_functions_are_found():
  names = dict(_public_functions())
  # one of each source: jaxfuse.__all__, a public module, a subpackage
  for name in ("jaxfuse.sparse_sync", "jaxfuse.checkpoint.save",
               "jaxfuse.collectives.get", "jaxfuse.kernels.select"):
    assert name in names


def test_every_public_function_has_args_returns_and_raises():
  missing = {name: gaps for name, fn in _public_functions()
             if (gaps := _missing_sections(fn))}
  assert not missing, (
      "public functions without optax-style docstring sections (add "
      f"them): {missing}")


def test_the_section_check_fails_on_a_bare_docstring():
  def bare(x):
    """Does something."""
  assert _missing_sections(bare) == ["Args:", "Returns:", "Raises:"]


def test_the_library_speaks_of_itself():
  hits = []
  for path in _sources():
    for i, line in enumerate(path.read_text().splitlines(), 1):
      if LAB_TALK.search(line):
        hits.append(f"{_name(path)}:{i}: {line.strip()}")
  assert not hits, ("card names, millisecond figures, dates or results/ "
                    f"paths in jaxfuse/ (say it in docs/): {hits}")


def test_no_module_is_over_640_lines():
  long = {_name(p): n for p in _sources()
          if (n := len(p.read_text().splitlines())) > MAX_LINES}
  assert not long, f"modules over {MAX_LINES} lines (split by concern): {long}"


@pytest.mark.parametrize("line,alias", [
    ("from jaxfuse import plans as plan_lib", True),
    ("from jaxfuse.planning import costs as costs_lib", True),
    ("import numpy as np", False),
    ("from jaxfuse import plans", False),
])
def test_the_alias_check_tells_them_apart(line, alias):
  assert bool(_lib_aliases(ast.parse(line))) == alias


def _lib_aliases(tree) -> list:
  return [a.asname for node in ast.walk(tree)
          if isinstance(node, (ast.Import, ast.ImportFrom))
          for a in node.names if a.asname and a.asname.endswith("_lib")]


def test_no_module_is_imported_under_a_lib_alias():
  found = {_name(p): names for p in _sources()
           if (names := _lib_aliases(ast.parse(p.read_text())))}
  assert not found, ("import the module by its name (rename a clashing "
                     f"local): {found}")


def test_the_docs_stay_short_enough_to_read():
  """(f) README.md at most 200 lines, docs/ at most 2,500 in all, and each
  release of CHANGELOG.md about one screen (at most 65 lines)."""
  repo = ROOT.parent
  readme = len((repo / "README.md").read_text().splitlines())
  docs = sum(len(p.read_text().splitlines())
             for p in (repo / "docs").glob("*.md"))
  assert readme <= 200, f"README.md has {readme} lines"
  assert docs <= 2500, f"docs/*.md have {docs} lines"
  releases = re.split(r"^## ", (repo / "CHANGELOG.md").read_text(),
                      flags=re.M)[1:]
  for release in releases:
    lines = len(release.splitlines())
    assert lines <= 65, f"CHANGELOG {release.splitlines()[0]}: {lines} lines"
