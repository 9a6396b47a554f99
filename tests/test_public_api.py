"""The public surface, pinned; 0.1's moved modules, deprecated but working.

A name added to or dropped from ``jaxfuse.__all__`` (or a module added to
``jaxfuse.planning``) fails here on purpose: update the list below and say
so in CHANGELOG.md.
"""

import importlib
import re
import pathlib
import pkgutil
import sys
import warnings

import pytest

import jaxfuse
from jaxfuse import _deprecated
import jaxfuse.planning
from jaxfuse.planning import cli
from jaxfuse.planning import profiling

PUBLIC = [
    "ApplyIfFiniteState", "BucketPlan", "COST_STRATEGIES", "CollectivesDifferError",
    "DelayedState", "Estimation", "LeafPlan", "LocalStepsState",
    "PerWorkerState", "Phase", "Plan", "PlanError", "RECIPES",
    "RecipeOptions", "SGDOptions", "STRATEGIES",
    "Settings", "SparseSyncState", "StepOptions", "SyncError", "SyncStats",
    "TrainState", "__version__",
    "apply_if_finite", "check_phases", "check_same_collectives", "checkpoint", "clipping",
    "collectives", "delayed",
    "demo", "density_warmup", "elastic", "first_moment", "grouped",
    "init_state", "inner_params", "kernels",
    "local_adamw", "local_clip_by_global_norm", "local_params", "local_steps",
    "make_mesh",
    "make_train_step",
    "onebit_adamw", "per_worker", "per_worker_mask", "phase_index", "plan",
    "predicted_params", "relayout", "second_moment", "second_moment_change",
    "send_early", "sgd", "simulated_mesh",
    "sparse_sync", "state_specs", "summarize", "sync_adamw", "sync_stats",
    "unit_residuals", "vmap_workers", "with_density", "xla_flags", "xla_options",
]
PLANNING_MODULES = [
    "backward", "bucket_cost", "cli", "cli_io", "cli_show",
    "costs",
    "grouping", "leaves",
    "optimal", "ordering", "plan_keywords", "planner", "predict",
    "profiling",
    "simulate", "strategies",
    "timeline_plot", "timing", "trace",
]
# What profiling and cli export, their re-exports from the modules they were
# split into included (both were one module up to 0.2).
PROFILING = [
    "ATTRIBUTIONS", "BackwardAnalysis", "Compression",
    "DEFAULT_COMPRESS_SIZES", "DEFAULT_SCHEME_SIZES", "DEFAULT_SIZES",
    "FREE_PRIMITIVES", "Model", "ProfileError", "Progress", "SCHEME_UNITS",
    "Sweep", "Timing",
    "analyze_backward", "collective_chain", "contention_factor",
    "default_compress_sizes", "default_sizes", "derive_backward",
    "equation_work", "human_bytes", "machine_rates", "measure_collective",
    "measure_bucket_cost", "measure_compress", "measure_contention",
    "measure_forward_backward", "measure_overlap", "measure_scheme_costs",
    "overlap_factor", "profile", "same_on_every_process", "scale_shares",
    "synthetic_model", "text_progress", "time_call", "time_calls",
    "validate_backward",
]
CLI = [
    "EXIT_USAGE", "PLAN_OPTIONS", "UsageError", "build_parser", "cmd_plan",
    "cmd_profile", "cmd_show", "format_costs", "load_model", "main",
    "measured_table", "parse_size", "plan_table",
]
# 0.1's jaxfuse.<name>: moved into jaxfuse.planning by 0.2.
MOVED = ["cli", "costs", "optimal", "ordering", "planner", "profiling",
         "simulate", "strategies", "timeline_plot"]


@pytest.mark.parametrize("module, names", [(jaxfuse, PUBLIC),
                                           (profiling, PROFILING),
                                           (cli, CLI)],
                         ids=["jaxfuse", "profiling", "cli"])
def test_all_is_pinned_and_every_name_exists(module, names):
  assert sorted(module.__all__) == sorted(names)
  assert len(set(module.__all__)) == len(module.__all__)
  with warnings.catch_warnings():
    warnings.simplefilter("error")   # no public name is a deprecated alias
    missing = [n for n in module.__all__ if not hasattr(module, n)]
  assert not missing


def test_planning_modules_are_pinned_and_import():
  found = sorted(m.name for m in pkgutil.iter_modules(jaxfuse.planning.__path__)
                 if not m.name.startswith("_"))
  assert found == PLANNING_MODULES
  for name in found:
    importlib.import_module(f"jaxfuse.planning.{name}")


def test_split_modules_reexport_the_same_objects():
  from jaxfuse.planning import backward, bucket_cost, cli_io, cli_show, timing  # pylint: disable=g-import-not-at-top
  for name in PROFILING:
    for home in (backward, bucket_cost, timing):
      if hasattr(home, name):
        assert getattr(profiling, name) is getattr(home, name), name
  assert cli.UsageError is cli_io.UsageError
  assert cli.plan_table is cli_show.plan_table
  assert cli.main.__module__ == "jaxfuse.planning.cli"  # the console script


# --- 0.1's names, deprecated -----------------------------------------------------

@pytest.fixture
def fresh():
  """No moved module imported under its old name, before and after (the
  import system caches ``import jaxfuse.costs`` in sys.modules and as an
  attribute of jaxfuse)."""
  def clear():
    for name in MOVED:
      sys.modules.pop(f"jaxfuse.{name}", None)
      vars(jaxfuse).pop(name, None)
  clear()
  yield
  clear()


def test_the_moved_table_is_0_1s():
  moved_in_0_2 = [n for n, (_, v, _) in _deprecated.MOVED_MODULES.items()
                  if v == "0.2"]
  assert sorted(moved_in_0_2) == MOVED
  assert not set(MOVED) & set(jaxfuse.__all__)


@pytest.mark.parametrize("name", MOVED)
def test_attribute_warns_and_is_the_new_module(fresh, name):
  new = importlib.import_module(f"jaxfuse.planning.{name}")
  with pytest.warns(DeprecationWarning,
                    match=rf"jaxfuse\.{name} moved to jaxfuse\.planning\."
                    rf"{name}\b.*removed in 0\.4"):
    old = getattr(jaxfuse, name)
  assert old is new


def test_from_jaxfuse_import_costs_simulate(fresh):
  with pytest.warns(DeprecationWarning) as record:
    from jaxfuse import costs, simulate  # pylint: disable=g-import-not-at-top
  messages = " ".join(str(w.message) for w in record)
  assert "jaxfuse.planning.costs" in messages
  assert "jaxfuse.planning.simulate" in messages
  assert all(w.filename == __file__ for w in record)  # the user's line
  from jaxfuse.planning import costs as new_costs  # pylint: disable=g-import-not-at-top
  from jaxfuse.planning import simulate as new_simulate  # pylint: disable=g-import-not-at-top
  assert costs is new_costs and simulate is new_simulate


def test_import_submodule_warns_and_is_the_new_module(fresh):
  with pytest.warns(DeprecationWarning, match=r"jaxfuse\.planning\.costs"):
    import jaxfuse.costs  # pylint: disable=g-import-not-at-top
  assert jaxfuse.costs is jaxfuse.planning.costs
  assert sys.modules["jaxfuse.costs"] is jaxfuse.planning.costs
  with pytest.warns(DeprecationWarning, match=r"jaxfuse\.planning\.simulate"):
    from jaxfuse.simulate import simulate  # pylint: disable=g-import-not-at-top
  assert simulate is jaxfuse.planning.simulate.simulate


def test_new_places_do_not_warn(fresh):
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    for name in MOVED:
      module = importlib.import_module(f"jaxfuse.planning.{name}")
      assert getattr(jaxfuse.planning, name) is module


def test_unknown_names_still_fail(fresh):
  with pytest.raises(AttributeError, match="no attribute 'costz'"):
    jaxfuse.costz  # pylint: disable=pointless-statement
  for name in ("jaxfuse.costz", "jaxfuse.planning.costs.x",
               "jaxfuse.planning.nothing"):
    with pytest.raises(ModuleNotFoundError):
      importlib.import_module(name)


# --- 0.2's module paths, moved into folders in 0.3 ----------------------------

MOVED_0_3 = {
    "recipes": "optim.recipes", "phases": "optim.phases",
    "clipping": "optim.clipping", "delay": "optim.delay",
    "nonfinite": "optim.nonfinite", "overlap": "optim.overlap",
    "compile_options": "optim.compile_options",
    "placement": "state.placement", "checkpoint": "state.checkpoint",
    "elastic": "state.elastic",
    "bucket_sync": "sync.bucket_sync", "bucket_pass": "sync.bucket_pass",
    "grouped": "sync.grouped", "schedule": "sync.bucket_steps",
    "radix_select": "kernels.radix_select",
    "plan_checks": "plans.checks", "_jsonfile": "plans.jsonfile",
    "planning.agreement": "sync.agreement", "planning.hlo": "sync.hlo",
}
PUBLIC_MODULES = ("checkpoint", "clipping", "elastic", "grouped")


def test_the_0_3_table():
  got = {n: new.removeprefix("jaxfuse.")
         for n, (new, v, removed) in _deprecated.MOVED_MODULES.items()
         if v == "0.3" and removed == "0.5"}
  assert got == MOVED_0_3


def test_package_root_holds_at_most_ten_modules():
  root = pathlib.Path(jaxfuse.__file__).parent
  assert len(list(root.glob("*.py"))) <= 10, sorted(root.glob("*.py"))


@pytest.mark.parametrize("name", sorted(MOVED_0_3))
def test_0_2_import_path_warns_and_is_the_new_module(name):
  new = importlib.import_module(f"jaxfuse.{MOVED_0_3[name]}")
  sys.modules.pop(f"jaxfuse.{name}", None)
  had = name in vars(jaxfuse)
  saved = vars(jaxfuse).pop(name, None)
  try:
    with pytest.warns(DeprecationWarning,
                      match=rf"jaxfuse\.{name} moved to "
                      rf"jaxfuse\.{re.escape(MOVED_0_3[name])} in jaxfuse 0\.3"
                      rf".*removed in 0\.5"):
      old = importlib.import_module(f"jaxfuse.{name}")
    assert old is new
  finally:
    sys.modules.pop(f"jaxfuse.{name}", None)
    if had:
      vars(jaxfuse)[name] = saved
    else:
      vars(jaxfuse).pop(name, None)


def test_relayout_stays_the_function():
  assert callable(jaxfuse.relayout)
  assert "relayout" not in _deprecated.MOVED_MODULES


def test_public_module_attributes_stay_without_warning():
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    for name in PUBLIC_MODULES:
      assert getattr(jaxfuse, name) is importlib.import_module(
          f"jaxfuse.{MOVED_0_3[name]}")
