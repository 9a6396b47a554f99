"""Saving a plan or costs file (``jaxfuse.plans.jsonfile.save``): whole or not
at all, with the permissions a file written by ``open`` would have."""

import os
import stat

import jax
import jax.numpy as jnp
import pytest

import jaxfuse


def _plan():
  return jaxfuse.plan([jax.ShapeDtypeStruct((4096,), jnp.float32)],
                      density=0.05,
                      settings=jaxfuse.Settings(min_sparse_size=64))


def _mode(path):
  return stat.S_IMODE(os.stat(path).st_mode)


def test_a_new_file_gets_the_umask_mode(tmp_path):
  old = os.umask(0o027)
  try:
    _plan().save(tmp_path / "plan.json")
  finally:
    os.umask(old)
  assert _mode(tmp_path / "plan.json") == 0o640   # 0o666 & ~0o027


def test_a_saved_over_file_keeps_its_mode(tmp_path):
  path = tmp_path / "plan.json"
  path.write_text("{}")
  os.chmod(path, 0o644)
  _plan().save(path)
  assert _mode(path) == 0o644
  os.chmod(path, 0o600)
  _plan().save(path)
  assert _mode(path) == 0o600
  assert jaxfuse.Plan.load(path) == _plan()


def test_a_failed_save_leaves_the_old_file_and_no_litter(tmp_path,
                                                         monkeypatch):
  path = tmp_path / "plan.json"
  path.write_text("old")

  def fail(*_):
    raise OSError("disk full")
  monkeypatch.setattr(os, "replace", fail)
  with pytest.raises(OSError, match="disk full"):
    _plan().save(path)
  assert path.read_text() == "old"
  assert sorted(os.listdir(tmp_path)) == ["plan.json"]


def test_a_missing_folder_is_named(tmp_path):
  with pytest.raises(FileNotFoundError, match="the folder .*nowhere does "
                     "not exist; make it first"):
    _plan().save(tmp_path / "nowhere" / "plan.json")


def test_a_symlink_is_written_through_and_a_folder_refused(tmp_path):
  """Saving to a link replaces its target's text and keeps the link (as
  ``open`` would); a path that is not a regular file is refused whole."""
  (tmp_path / "runs").mkdir()
  target = tmp_path / "runs" / "real.json"
  target.write_text("{}")
  link = tmp_path / "latest.json"
  link.symlink_to(target)
  plan = _plan()
  plan.save(link)
  assert link.is_symlink() and os.readlink(link) == str(target)
  assert jaxfuse.Plan.load(target).to_json() == plan.to_json()
  with pytest.raises(IsADirectoryError, match="not a regular file"):
    plan.save(tmp_path / "runs")
  assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == [
      "real.json"]
