"""Whether every process of a ``jax.distributed`` job compiled the same
collectives.

NCCL (and gloo on CPU) pair up a communicator's collectives by the order
each rank issues them. Under ``jax.distributed`` every process compiles its
own program; if the programs list different collectives (another plan,
other XLA flags, another schedule) the first step waits for ever, with no
error. ``check_same_collectives(compiled)`` compares the lists, in order,
before that step runs, and raises instead:

  compiled = step.lower(params, opt_state, batch).compile()
  jaxfuse.check_same_collectives(compiled)   # every process calls it
  params, opt_state, loss = step(params, opt_state, batch)   # same program

Each process hashes its list (``sync.hlo.collective_list``: opcode,
shape and replica groups of every collective start, in program order);
the hashes are gathered, and only when they differ the lists themselves,
to say where.
"""

from __future__ import annotations

import hashlib

import jax
import numpy as np

from jaxfuse.sync import hlo


class CollectivesDifferError(RuntimeError):
  """The processes compiled different collectives: the step would hang."""


def first_difference(a: list[str], b: list[str]) -> int | None:
  """The first index where ``a`` and ``b`` differ (None: equal)."""
  at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
  if at is None and len(a) != len(b):
    at = min(len(a), len(b))
  return at


def describe_difference(lists: list[list[str]], what: str) -> str | None:
  """None when every process's list equals process 0's; else where the
  first process that differs first differs, and what to do about it."""
  for process, other in enumerate(lists[1:], start=1):
    at = first_difference(lists[0], other)
    if at is None:
      continue
    entry = lambda x: repr(x[at]) if at < len(x) else "nothing (it ends)"
    return (
        f"the processes compiled different collectives for {what}: process "
        f"{process} differs from process 0 at collective {at} (of "
        f"{len(lists[0])} and {len(other)}): process 0 has {entry(lists[0])}, "
        f"process {process} {entry(other)}. Run as it is, the step would "
        "wait for ever. Give every process the same plan (the same rules, a "
        "saved Plan.load, or costs from one file or from "
        "jaxfuse.planning.profiling.profile, which shares process 0's), the "
        "same step and optimizer, and the same XLA_FLAGS.")
  return None


def _gather(x: np.ndarray) -> np.ndarray:
  """Every process's ``x`` (same shape everywhere), stacked by process."""
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  return np.asarray(multihost_utils.process_allgather(x))


def equal_on_every_process(payload: bytes) -> bool:
  """Whether every process passed the same ``payload`` (its sha256 is
  gathered); every process must call it, and all get the same answer."""
  digest = np.frombuffer(hashlib.sha256(payload).digest(), np.uint8)
  digests = _gather(digest)
  return bool((digests == digests[0]).all())


def check_same_collectives(compiled, *, what: str = "the step") -> list[str]:
  """Raise ``CollectivesDifferError`` unless every process compiled the
  same collectives in the same order; returns this process's list.

  ``compiled``: ``jax.jit(f).lower(...).compile()`` or its ``as_text()``.
  Every process must call it (it gathers across processes); in one process
  it only reads the list. Calling the jitted function with the same
  arguments afterwards runs this compiled program, not a new compile.

  Args:
    compiled: a compiled step, or its HLO text.
    what: how the error names the program.

  Returns:
    This process's collectives, one line each, in program order.

  Raises:
    CollectivesDifferError: the processes' lists differ, naming the first
      collective that differs and the processes.
    TypeError: ``compiled`` is neither a compiled program nor text.
  """
  if not (isinstance(compiled, str) or callable(getattr(compiled, "as_text",
                                                        None))):
    raise TypeError(
        f"check_same_collectives expects the compiled step, "
        f"jax.jit(f).lower(*args).compile() (or its as_text()), got "
        f"{type(compiled).__name__}; lower and compile the jitted "
        "function first.")
  text = compiled if isinstance(compiled, str) else compiled.as_text()
  listed = hlo.collective_list(text)
  if jax.process_count() == 1:
    return listed
  payload = np.frombuffer("\n".join(listed).encode(), np.uint8)
  if equal_on_every_process(payload.tobytes()):
    return listed
  sizes = _gather(np.asarray(payload.size, np.int32))
  padded = np.zeros(int(sizes.max()), np.uint8)
  padded[:payload.size] = payload
  rows = _gather(padded)
  lists = [row[:size].tobytes().decode().split("\n") if size else []
           for row, size in zip(rows, sizes)]
  raise CollectivesDifferError(describe_difference(lists, what))
