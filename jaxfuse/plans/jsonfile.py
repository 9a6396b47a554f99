"""Versioned JSON files ({"format": ..., "version": ...}): the shared header,
and writing a file whole or not at all (``save``, ``save_with``)."""

from __future__ import annotations

import json
import os
import stat
from typing import BinaryIO, Callable

import numpy as np


def read(text: str, *, fmt: str, max_version: int, error: type[Exception],
         what: str) -> dict:
  """Parse ``text``; raise ``error`` unless it is a ``fmt`` file we can read."""
  try:
    body = json.loads(text)
  except json.JSONDecodeError as e:
    raise error(f"{what} is not valid JSON ({e}); the file is corrupted or "
                f"not a {what}.") from None
  if not isinstance(body, dict) or body.get("format") != fmt:
    raise error(f"not a {what}: the 'format' field must be {fmt!r}.")
  version = body.get("version")
  if isinstance(version, bool) or not isinstance(version, int) or version < 1:
    raise error(f"{what} field 'version' is {version!r}; expected an integer "
                ">= 1.")
  if version > max_version:
    raise error(f"{what} format version {version} is newer than this jaxfuse "
                f"reads ({max_version}); upgrade jaxfuse.")
  return body


def write(fields: dict, *, fmt: str, version: int) -> str:
  """``fields`` as the JSON text of a ``fmt`` file, header first (numpy
  scalars as their Python values)."""
  return json.dumps({"format": fmt, "version": version, **fields}, indent=1,
                    default=_plain)


def _plain(x):
  if isinstance(x, np.generic):
    return x.item()
  raise TypeError(f"{type(x).__name__} {x!r} is not JSON serializable")


def read_file(path: str | os.PathLike, *, error: type[Exception],
              what: str) -> str:
  """The text of ``path``; ``error`` naming the file if it is not UTF-8."""
  try:
    with open(path, encoding="utf-8") as f:
      return f.read()
  except UnicodeDecodeError as e:
    raise error(f"{os.fspath(path)} is not a {what} (not UTF-8 text: {e}).") \
        from None


def _new_beside(path: str) -> tuple[int, str]:
  """A new file ``.NAME.XXXX.tmp`` beside ``path``, opened for writing,
  0o666 less the umask as ``open`` gives (``tempfile.mkstemp``'s 0o600
  would hide the saved file from other users)."""
  folder, name = os.path.split(path)
  while True:
    tmp = os.path.join(folder, f".{name}.{os.urandom(6).hex()}.tmp")
    try:
      return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), tmp
    except FileExistsError:
      continue


def writable_target(path: str | os.PathLike) -> str:
  """The file ``save`` would replace at ``path`` (through symlinks);
  ``FileNotFoundError`` for a missing folder, ``IsADirectoryError`` for
  anything but a regular file."""
  path = os.path.realpath(os.fspath(path))
  if os.path.exists(path) and not os.path.isfile(path):
    raise IsADirectoryError(f"cannot write {path}: not a regular file; give "
                            "a file name")
  folder = os.path.dirname(path) or "."
  if not os.path.isdir(folder):
    raise FileNotFoundError(f"cannot write {path}: the folder {folder} does "
                            "not exist; make it first")
  return path


def save(path: str | os.PathLike, text: str) -> None:
  """Write ``text`` to ``path`` whole or not at all (``save_with``)."""
  save_with(path, lambda f: f.write(text.encode("utf-8")))


def save_with(path: str | os.PathLike,
              write: Callable[[BinaryIO], object]) -> None:
  """Write a file with ``write(f)`` (``f`` a binary file) whole or not at
  all: into a temporary file beside ``path``, then renamed over it, so a
  failure never leaves ``path`` empty or half-written. The file keeps the
  mode it had (a new one: what ``open`` would give it, 0o666 less the
  umask). A symlink is written through (its target is replaced, the link
  kept); anything but a regular file (a device, a pipe, a folder) is
  refused."""
  path = writable_target(path)
  fd, tmp = _new_beside(path)
  try:
    with os.fdopen(fd, "wb") as f:
      write(f)
    if os.path.exists(path):   # keep its mode
      os.chmod(tmp, stat.S_IMODE(os.stat(path).st_mode))
    os.replace(tmp, path)
  except BaseException:
    os.unlink(tmp)
    raise
