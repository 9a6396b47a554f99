"""Versioned JSON files ({"format": ..., "version": ...}): the shared header."""

from __future__ import annotations

import json


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
  """``fields`` as the JSON text of a ``fmt`` file, header first."""
  return json.dumps({"format": fmt, "version": version, **fields}, indent=1)
