"""Readers of the text files XLA dumps for a compiled module (any backend).

* ``*after_optimizations-buffer-assignment.txt``: allocations (parameter, output, preallocated
  temp, constant, thread-local) and the HLO values placed in each, with size and offset;
* ``*after_optimizations-live-range.txt``: the flattened schedule and each value's live range;
* ``*after_optimizations.txt``: the scheduled HLO, with each instruction's JAX name stack
  (``op_name``), Python stack frame, operands, and the module's while loops.

:mod:`jremat._measure.timeline` builds the memory timeline from them.
"""

from __future__ import annotations

import collections
import dataclasses
import re

_ALLOC_RE = re.compile(r"^allocation (\d+): size (\d+), (.*):$")
_VALUE_RE = re.compile(r"^ value: <(\d+) (\S+?)(\{[\d,]*\})?( \(phi\))? @\d+> \(size=(\d+),offset=(\d+)\): (.*)$")
_SEQ_RE = re.compile(r"^    (\d+):(\S+)$")
_RANGE_RE = re.compile(r"^    (\S+?)(\{[\d,]*\}):(\d+)-(\d+)$")
_INSTR_RE = re.compile(r"^\s+(?:ROOT )?%(\S+) = (.*?) ([a-z][\w-]*)\(")
_COMP_RE = re.compile(r"^(?:ENTRY )?%(\S+) ")
_OP_NAME_RE = re.compile(r'op_name="([^"]*)"')
_FRAME_ID_RE = re.compile(r"stack_frame_id=(\d+)")
_WHILE_RE = re.compile(r"condition=%([\w.\-]+), body=%([\w.\-]+)")
_TRIP_RE = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_CALLS_RE = re.compile(r"(?:to_apply|calls|true_computation|false_computation|branch_computations)=\{?%([\w.\-]+)")


@dataclasses.dataclass
class Value:
    """One HLO value (logical buffer) of the buffer assignment, placed in an allocation."""

    key: str  # name{index}, as the live-range dump spells it
    instruction: str
    size: int
    offset: int
    shape: str
    allocation: int


@dataclasses.dataclass
class Allocation:
    """One allocation of the buffer assignment and the values placed in it."""

    index: int
    size: int
    kind: str  # parameter, output, temp, constant, thread-local, other
    values: list


def parse_buffer_assignment(text: str) -> list[Allocation]:
    """Allocations and their values from XLA's ``*buffer-assignment.txt``.

    Raises:
      ValueError: if the text has no ``BufferAssignment:`` section.
    """
    if "BufferAssignment:" not in text:
        raise ValueError("not an XLA buffer-assignment dump: no 'BufferAssignment:' section")
    allocations: list[Allocation] = []
    started = False
    for line in text.splitlines():
        if line.startswith("BufferAssignment:"):
            started = True
            continue
        if not started:
            continue
        m = _ALLOC_RE.match(line)
        if m:
            attrs = m.group(3)
            if attrs.startswith("parameter "):
                kind = "parameter"
            elif "preallocated-temp" in attrs:
                kind = "temp"
            elif "live-out" in attrs or attrs.startswith("output shape"):
                kind = "output"
            elif "constant" in attrs:
                kind = "constant"
            elif "thread-local" in attrs:
                kind = "thread-local"
            else:
                kind = "other"
            allocations.append(Allocation(int(m.group(1)), int(m.group(2)), kind, []))
            continue
        m = _VALUE_RE.match(line)
        if m and allocations:
            name, index = m.group(2), m.group(3) or "{}"
            alloc = allocations[-1]
            alloc.values.append(Value(name + index, name, int(m.group(5)), int(m.group(6)), m.group(7), alloc.index))
            continue
        if allocations and not line.startswith(" "):
            break  # the per-value and summary sections that follow
    return allocations


def parse_live_range(text: str) -> tuple[list[str], dict[str, tuple[int, int]]]:
    """The flattened schedule and value live ranges from XLA's ``*live-range.txt``.

    Returns:
      ``(sequence, ranges)``: ``sequence[t]`` is the instruction at position ``t``; ``ranges``
      maps ``name{index}`` to its inclusive ``(start, end)`` positions.

    Raises:
      ValueError: if the text has no ``HloLiveRange`` header.
    """
    if not text.startswith("HloLiveRange"):
        raise ValueError("not an XLA live-range dump: it does not start with 'HloLiveRange'")
    sequence: list[str] = []
    ranges: dict[str, tuple[int, int]] = {}
    section = None
    for line in text.splitlines():
        stripped = line.strip()
        if stripped == "InstructionSequence:":
            section = "seq"
            continue
        if stripped == "BufferLiveRange:":
            section = "range"
            continue
        if line.startswith("  ") and not line.startswith("    "):
            section = None
            continue
        if section == "seq":
            m = _SEQ_RE.match(line)
            if m:
                sequence.append(m.group(2))
        elif section == "range":
            m = _RANGE_RE.match(line)
            if m:
                ranges[m.group(1) + m.group(2)] = (int(m.group(3)), int(m.group(4)))
    return sequence, ranges


@dataclasses.dataclass
class Hlo:
    """What :func:`parse_hlo` reads from a scheduled HLO module's text, keyed by instruction or computation."""

    op_name: dict  # instruction -> op_name
    source: dict  # instruction -> tuple of (file, line), innermost first
    computation: dict  # instruction -> computation
    called: dict  # computation -> computations it calls (control flow and others)
    whiles: dict  # while instruction -> (condition, body, trip count or None, op_name)
    entry: str | None
    operands: dict  # instruction -> operand instructions
    shape: dict  # instruction -> HLO shape text
    opcode: dict  # instruction -> opcode
    root: dict  # computation -> its ROOT instruction
    body_of: dict  # loop body computation -> the while instruction that runs it


def _stack_tables(text: str):
    files, functions, locations, frames = {}, {}, {}, {}
    section = None
    for line in text.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            section = line
            continue
        if not line or line.startswith(("HloModule", "%", "ENTRY")):
            if line.startswith(("%", "ENTRY")):
                break
            section = None if not line else section
            continue
        parts = line.split(" ", 1)
        if len(parts) != 2 or not parts[0].isdigit():
            continue
        key, rest = int(parts[0]), parts[1]
        if section == "FileNames":
            files[key] = rest.strip('"')
        elif section == "FunctionNames":
            functions[key] = rest.strip('"')
        elif section == "FileLocations":
            f = re.search(r"file_name_id=(\d+)", rest)
            ln = re.search(r"\bline=(\d+)", rest)
            if f and ln:
                locations[key] = (files.get(int(f.group(1)), "?"), int(ln.group(1)))
        elif section == "StackFrames":
            loc = re.search(r"file_location_id=(\d+)", rest)
            parent = re.search(r"parent_frame_id=(\d+)", rest)
            if loc:
                frames[key] = (int(loc.group(1)), int(parent.group(1)) if parent else 0)
    return locations, frames


def _frame_chain(frame_id: int, locations, frames) -> tuple:
    chain, seen = [], set()
    while frame_id in frames and frame_id not in seen:
        seen.add(frame_id)
        loc, parent = frames[frame_id]
        if loc in locations:
            chain.append(locations[loc])
        frame_id = parent - 1  # the text prints a frame's parent as its id + 1 (1: no parent)
    return tuple(chain)


def parse_hlo(text: str) -> Hlo:
    """Instruction metadata, computations and while loops of a scheduled HLO module's text."""
    locations, frames = _stack_tables(text)
    hlo = Hlo({}, {}, {}, collections.defaultdict(set), {}, None, {}, {}, {}, {}, {})
    current = None
    for line in text.splitlines():
        if line.startswith(("%", "ENTRY")) and line.rstrip().endswith("{"):
            m = _COMP_RE.match(line)
            current = m.group(1) if m else None
            if line.startswith("ENTRY"):
                hlo.entry = current
            continue
        m = _INSTR_RE.match(line)
        if not m or current is None:
            continue
        name, opcode = m.group(1), m.group(3)
        hlo.computation[name] = current
        hlo.shape[name], hlo.opcode[name] = m.group(2), opcode
        args = line[m.end() :].split(")", 1)[0]
        hlo.operands[name] = re.findall(r"%([\w.\-]+)", args)
        if line.lstrip().startswith("ROOT "):
            hlo.root[current] = name
        op = _OP_NAME_RE.search(line)
        hlo.op_name[name] = op.group(1).replace("\\'", "'") if op else ""
        fid = _FRAME_ID_RE.search(line)
        hlo.source[name] = _frame_chain(int(fid.group(1)), locations, frames) if fid else ()
        if opcode == "while":
            w = _WHILE_RE.search(line)
            if w:
                trip = _TRIP_RE.search(line)
                hlo.whiles[name] = (w.group(1), w.group(2), int(trip.group(1)) if trip else None, hlo.op_name[name])
                hlo.body_of[w.group(2)] = name
                hlo.called[current].update((w.group(1), w.group(2)))
        for c in _CALLS_RE.findall(line):
            hlo.called[current].add(c)
    return hlo


# ---------------------------------------------------------------------------------------------
# Building the timeline
# ---------------------------------------------------------------------------------------------


__all__ = ("Allocation", "Hlo", "Value", "parse_buffer_assignment", "parse_hlo", "parse_live_range")
