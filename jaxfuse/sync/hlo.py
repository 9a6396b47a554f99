"""Reading a compiled step's HLO: which values each collective waits for,
and where the scheduler put it.

``compiled.as_text()`` of a jitted step is the optimized module; on GPU its
entry computation is listed in the order it runs (``is_scheduled=true``).
Three questions about a sparse step are answered from it:

- Buckets stay apart: the entry parameters each collective depends on
  (``collective_inputs``). A collective that depends on another bucket's
  leaves (a global norm, a combined collective) cannot start before that
  bucket's gradients exist.
- Overlap: where each async collective starts and ends relative to the
  backward pass's instructions (``schedule``), the ops whose metadata names
  an autodiff transpose.

- Agreement between processes: the collectives in the order each process
  issues them (``collective_list``; ``jaxfuse.check_same_collectives``).

``computations`` is the reader under all three: every computation's
instructions with their operands, metadata and attributes (the
benchmarks' HLO tools read the same).
"""

from __future__ import annotations

import dataclasses
import re
from typing import NamedTuple

_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([\w\-]+)\((.*)$")
# "%name (params) -> shape {" or "ENTRY %name ... {"; "}" closes it
_COMPUTATION = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_NAME = re.compile(r"[A-Za-z_][\w.\-]*")
_COMMENT = re.compile(r"/\*.*?\*/")
_PARAMETER = re.compile(r"parameter\((\d+)\)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all",
               "collective-permute")


# What the processes of a job must issue in one order: these collectives
# and two more, sync or as -start, point-to-point sends and receives, and
# async-start (GPU wraps some collectives in one).
_ORDERED = frozenset(
    op + suffix for op in COLLECTIVES + ("collective-broadcast",
                                         "ragged-all-to-all")
    for suffix in ("", "-start")) | {"async-start", "send", "recv"}
# Who takes part: {{0,1},{2,3}}, [1,4]<=[4] or mesh['d'=2] {'d'} (groups),
# {{0,1},{1,0}} (a permute's pairs); up to the next attribute.
_PEERS = re.compile(
    r"(?:replica_groups|source_target_pairs)=(.*?)(?:, [\w.]+=|$)")
# The attributes that name the computations an instruction runs: loops,
# branches, calls, reducers, fusions and async wrappers.
CALLING = ("body", "condition", "to_apply", "calls", "branch_computations",
           "true_computation", "false_computation")


class HloError(ValueError):
  """HLO text this module cannot read."""


@dataclasses.dataclass(frozen=True)
class Instruction:
  name: str
  opcode: str
  operands: tuple[str, ...]
  parameter: int | None   # the parameter number, for parameter()
  op_name: str            # the JAX op it came from (metadata), or ""
  shape: str
  attributes: str = ""    # after the operands: ", replica_groups=..., ..."


class Computation(NamedTuple):
  name: str
  entry: bool
  instructions: list[Instruction]


def _operand_names(args: str) -> tuple[str, ...]:
  """Names of the operands in "%a, f32[4]{0} %b, (f32[], s32[]) c": the
  last word of each top-level item, with or without its %."""
  args = _COMMENT.sub(" ", args)     # "/*index=5*/%f" every fifth operand
  names, depth, start = [], 0, 0
  for i, ch in enumerate(args + ","):
    if ch in "([{":
      depth += 1
    elif ch in ")]}":
      depth -= 1
    elif ch == "," and depth == 0:
      words = args[start:i].split()
      if words and _NAME.fullmatch(words[-1].lstrip("%")):
        names.append(words[-1].lstrip("%"))
      start = i + 1
  return tuple(names)


def _instruction(line: str) -> Instruction | None:
  m = _INSTRUCTION.match(line)
  if not m:
    return None
  name, shape, opcode, rest = m.groups()
  # Operands: up to the call's closing parenthesis (attributes follow).
  depth, end = 1, len(rest)
  for i, ch in enumerate(rest):
    depth += (ch == "(") - (ch == ")")
    if depth == 0:
      end = i
      break
  param = _PARAMETER.search(opcode + "(" + rest[:end + 1])
  op_name = _OP_NAME.search(rest)
  return Instruction(
      name, opcode,
      () if opcode in ("constant", "parameter") else _operand_names(
          rest[:end]),
      int(param.group(1)) if opcode == "parameter" and param else None,
      op_name.group(1) if op_name else "", shape, rest[end + 1:])


def computations(hlo_text: str) -> list[Computation]:
  """Every computation of the module with its instructions, both in the
  listed order (called computations before their callers; on GPU each
  computation is listed in the order it runs)."""
  out, current = [], None
  for line in hlo_text.splitlines():
    if current is None:
      m = _COMPUTATION.match(line)
      if m and not line.startswith("HloModule"):
        current = Computation(m.group(2), bool(m.group(1)), [])
    elif line.startswith("}"):
      out.append(current)
      current = None
    elif (inst := _instruction(line)) is not None:
      current.instructions.append(inst)
  if current is not None:   # text cut before the closing brace
    out.append(current)
  return out


def called_names(inst: Instruction, keys=CALLING) -> list[str]:
  """The computations ``inst`` names under the attributes ``keys``
  ("body=%b", "branch_computations={%t, %f}"), in the listed order."""
  if not keys:
    return []
  refs = re.findall(rf"\b(?:{'|'.join(keys)})=(\{{[^}}]*\}}|%?[\w.\-]+)",
                    inst.attributes)
  return [name for ref in refs for name in re.findall(r"[\w.\-]+", ref)]


def _entry(comps) -> Computation:
  entry = [c for c in comps if c.entry]
  if not entry:
    raise HloError("no ENTRY computation in this HLO text; pass "
                   "jax.jit(f).lower(...).compile().as_text().")
  return entry[0]


def entry_instructions(hlo_text: str) -> list[Instruction]:
  """The entry computation's instructions, in the listed order."""
  entry = _entry(computations(hlo_text))
  if not entry.instructions:
    raise HloError("the ENTRY computation has no instructions I can read.")
  return entry.instructions


def collective_list(hlo_text: str) -> list[str]:
  """The collectives in the order the program issues them, as "opcode
  shape peers": the entry's in its listed order (on GPU, its schedule),
  and each loop's, branch's or call's where the instruction that runs it
  stands, between "OPCODE{" and "}"."""
  comps = {c.name: c for c in computations(hlo_text)}
  memo: dict[str, list[str]] = {}

  def listed(name: str) -> list[str]:
    if name not in memo:
      memo[name] = []          # a computation never calls itself
      out = []
      for inst in comps[name].instructions:
        if inst.opcode in _ORDERED:
          peers = _PEERS.search(inst.attributes)
          out.append(f"{inst.opcode} {inst.shape}"
                     + (f" {peers.group(1)}" if peers else ""))
        for callee in called_names(inst):
          inner = listed(callee) if callee in comps else []
          if inner:
            out += [inst.opcode + "{", *inner, "}"]
      memo[name] = out
    return memo[name]

  return listed(_entry(comps.values()).name)


def _is_collective(inst: Instruction) -> bool:
  return any(inst.opcode == c or inst.opcode == c + "-start"
             for c in COLLECTIVES)


def collective_inputs(hlo_text: str) -> list[tuple[Instruction, frozenset]]:
  """Each collective of the entry computation (its start, for async ones)
  with the set of entry parameter numbers it depends on, in listed order."""
  insts = entry_instructions(hlo_text)
  by_name = {i.name: i for i in insts}
  memo: dict[str, frozenset] = {}

  def params_of(name: str) -> frozenset:
    # Iterative post-order: programs have thousands of instructions.
    stack = [name]
    while stack:
      top = stack[-1]
      if top in memo:
        stack.pop()
        continue
      inst = by_name.get(top)
      if inst is None:
        memo[top] = frozenset()
        stack.pop()
        continue
      todo = [o for o in inst.operands if o not in memo]
      if todo:
        stack.extend(todo)
        continue
      found = set() if inst.parameter is None else {inst.parameter}
      for o in inst.operands:
        found |= memo[o]
      memo[top] = frozenset(found)
      stack.pop()
    return memo[name]

  return [(i, params_of(i.name)) for i in insts if _is_collective(i)]


@dataclasses.dataclass(frozen=True)
class Schedule:
  """Positions in the entry computation's order (0-based)."""
  num_instructions: int
  backward: tuple[int, int] | None  # first and last backward instruction
  starts: tuple[int, ...]           # each async collective's start
  dones: tuple[int, ...]            # and its done (same order)
  opcodes: tuple[str, ...]

  def started_in_backward(self) -> int:
    """How many collectives start before the backward's last instruction."""
    if self.backward is None:
      return 0
    return sum(s < self.backward[1] for s in self.starts)


def is_backward(inst: Instruction) -> bool:
  """An instruction of the backward pass: JAX names autodiff's transposed
  ops ``transpose(jvp(...))`` in their metadata."""
  return "transpose(" in inst.op_name


def schedule(hlo_text: str, opcodes=("all-gather", "all-reduce")) -> Schedule:
  """Where the async collectives of ``opcodes`` start and finish, against the
  backward pass, in a scheduled module (GPU)."""
  insts = entry_instructions(hlo_text)
  pos = {i.name: n for n, i in enumerate(insts)}
  back = [n for n, i in enumerate(insts) if is_backward(i)]
  starts, dones, kinds = [], [], []
  for n, inst in enumerate(insts):
    for c in opcodes:
      if inst.opcode == c + "-done" and inst.operands:
        start = pos.get(inst.operands[0])
        if start is not None:
          starts.append(start)
          dones.append(n)
          kinds.append(c)
  order = sorted(range(len(starts)), key=starts.__getitem__)
  return Schedule(len(insts), (back[0], back[-1]) if back else None,
                  tuple(starts[i] for i in order),
                  tuple(dones[i] for i in order),
                  tuple(kinds[i] for i in order))
