"""Which buffer is which in :func:`jremat.memory_timeline`: the kind and the name of each buffer
live at a schedule position (the kinds and names are described in :mod:`jremat._measure.timeline`).

A buffer is named after the instruction whose metadata best tells where it was computed (looking
through loop outputs, in-place updates, copies and XLA-made fusions); an all-gather's result, and
a copy of it in another layout or dtype, is a gathered weight whichever pass gathers it.
"""

from __future__ import annotations

import os
import re

import numpy as np

from jremat._engine import jaxpr as _jaxpr
from jremat._measure import timeline_data as kinds
from jremat._measure.timeline_data import TimelineBuffer
from jremat._measure.xla_dump import Hlo

#: The name-stack entry of the ops JAX's checkpoint runs again for the backward pass.
REMATTED = "rematted_computation"


def _kind(op_name: str) -> str:
    if REMATTED in op_name:
        return kinds.RECOMPUTATION
    if "transpose(" in op_name:
        return kinds.GRADIENT
    return kinds.FORWARD if op_name else kinds.OTHER


#: Opcodes that set up a buffer (gradient accumulators are zeroed early under the backward's names).
SETUP_OPS = frozenset({"broadcast", "constant", "parameter", "copy", "bitcast", "tuple", "get-tuple-element"})


def _combined(op_name: str) -> bool:
    """Whether an op name is that of several ops XLA combined into one (``.../(name:name:...)``)."""
    return "/(" in op_name and ":" in op_name


def is_backward(instruction: str, hlo: Hlo) -> bool:
    """Whether ``instruction`` is backward-pass math: a ``transpose(...)`` name stack, not a
    checkpoint's recomputation, not a set-up op, not a leaf (``partition-id``, ``iota``) and not a
    collective XLA combined from several (``.../(name:name:...)``, which may carry the loss's value
    beside the gradients)."""
    op_name = hlo.op_name.get(instruction, "")
    return (
        "transpose(" in op_name
        and REMATTED not in op_name
        and not _combined(op_name)
        and hlo.opcode.get(instruction) not in SETUP_OPS
        and not instruction.startswith("wrapped_broadcast")
        and bool(hlo.operands.get(instruction))
    )


def _feeds_backward(instruction: str, hlo: Hlo, users: dict) -> bool:
    """Whether a backward-pass instruction reads ``instruction``'s value, directly or through others
    (not through a combined collective: its parts go their own ways)."""
    seen, todo = {instruction}, [instruction]
    while todo:
        for user in users.get(todo.pop(), ()):
            if is_backward(user, hlo):
                return True
            if user not in seen and not _combined(hlo.op_name.get(user, "")):
                seen.add(user)
                todo.append(user)
    return False


def _read_by_forward(instruction: str, hlo: Hlo, users: dict) -> bool:
    """Whether a forward-pass instruction (a forward name stack, not a combined op) reads ``instruction``."""
    return any(
        _kind(op_name) == kinds.FORWARD and not _combined(op_name)
        for op_name in (hlo.op_name.get(user, "") for user in users.get(instruction, ()))
    )


def _users(hlo: Hlo) -> dict:
    out: dict = {}
    for instruction, operands in hlo.operands.items():
        for operand in operands:
            out.setdefault(operand, []).append(instruction)
    return out


def _short_op(op_name: str) -> str:
    parts = [p for p in op_name.split("/") if p]
    return "/".join(parts[-2:]) if parts else ""


def _elements(shape: str) -> int:
    m = re.match(r"^[a-z]\w*\[([\d,]*)\]", shape)
    if not m:
        return 0
    dims = [int(d) for d in m.group(1).split(",") if d]
    return int(np.prod(dims)) if dims else 1


def _origin(instruction: str, index: int | None, hlo: Hlo, depth: int = 0) -> str:
    """The instruction whose metadata best names a value: looks through loop outputs (to what the
    body stored), in-place updates (to the update), copies, bitcasts and XLA-made fusions."""
    if depth > 8:
        return instruction
    opcode = hlo.opcode.get(instruction, "")
    operands = hlo.operands.get(instruction, [])
    if opcode == "while" and index is not None and instruction in hlo.whiles:
        root = hlo.root.get(hlo.whiles[instruction][1])
        if root and hlo.opcode.get(root) == "tuple" and index < len(hlo.operands.get(root, [])):
            return _origin(hlo.operands[root][index], None, hlo, depth + 1)
        return instruction
    if opcode == "parameter" and index is not None:
        body = hlo.computation.get(instruction)
        caller = hlo.body_of.get(body)
        # A loop-carried value holds what the body stores at that index (else its initial value).
        root = hlo.root.get(body) if caller else None
        if root and hlo.opcode.get(root) == "tuple" and index < len(hlo.operands.get(root, [])):
            stored = _origin(hlo.operands[root][index], None, hlo, depth + 1)
            if hlo.op_name.get(stored) and stored != instruction:
                return stored
        init = hlo.operands.get(caller, [None])[0] if caller else None
        if init and hlo.opcode.get(init) == "tuple" and index < len(hlo.operands[init]):
            return _origin(hlo.operands[init][index], None, hlo, depth + 1)
        if init and hlo.opcode.get(init) == "while":
            return _origin(init, index, hlo, depth + 1)
        return instruction
    op_name = hlo.op_name.get(instruction, "")
    if (
        _jaxpr.DYNAMIC_UPDATE_SLICE in op_name
        or opcode == "dynamic-update-slice"
        or (opcode == "fusion" and not op_name and "dynamic-update-slice" in instruction)
    ):
        own = hlo.shape.get(instruction, "")
        updates = [o for o in operands if _elements(hlo.shape.get(o, "")) > 1 and hlo.shape.get(o) != own]
        if updates:
            return _origin(max(updates, key=lambda o: _elements(hlo.shape[o])), None, hlo, depth + 1)
    if operands and not op_name and opcode in ("copy", "bitcast", "fusion", "convert", "transpose"):
        big = max(operands, key=lambda o: _elements(hlo.shape.get(o, "")))
        found = _origin(big, None, hlo, depth + 1)
        if hlo.op_name.get(found):
            return found
    return instruction


#: Opcodes that can change a value's layout or type only (alone, or as the one op of a fusion).
_LAYOUT_OPS = frozenset({"copy", "bitcast", "transpose", "reshape", "convert", "fusion"})


def _is_gathered(instruction: str, hlo: Hlo, depth: int = 0) -> bool:
    """Whether ``instruction`` is an all-gather's result or a copy of one in another layout or
    dtype: one operand, as many elements (XLA copies a gathered weight to the layout a matmul of
    the backward pass reads, under the sharding constraint's name)."""
    opcode = hlo.opcode.get(instruction, "").removesuffix("-done")
    if opcode == "all-gather":
        return True
    operands = hlo.operands.get(instruction, [])
    if depth > 4 or opcode not in _LAYOUT_OPS or len(operands) != 1:
        return False
    same = _elements(hlo.shape.get(instruction, "")) == _elements(hlo.shape.get(operands[0], ""))
    return same and _is_gathered(operands[0], hlo, depth + 1)


def _name_for(instruction: str, hlo: Hlo, tags: dict) -> str:
    for loc in hlo.source.get(instruction, ()):
        if loc in tags:
            return "|".join(sorted(tags[loc]))
    return _short_op(hlo.op_name.get(instruction, "")) or instruction


def _argument_name(instruction: str) -> str:
    """``p__blocks____mlp____kernel___value.1`` (JAX's argument path, sanitized) -> ``p.blocks.mlp.kernel.value``."""
    return re.sub(r"_{2,}", ".", re.sub(r"\.\d+$", "", instruction)).strip("._") or instruction


def buffers_at(t: int, spans: list, allocations, hlo: Hlo, tags: dict, backward_start: int, top: int | None):
    alloc_kinds = {a.index: a.kind for a in allocations}
    groups: dict = {}
    for s, e, v, size, reserved in spans:
        if not s <= t <= e:
            continue
        key = (v.allocation, v.offset) if alloc_kinds[v.allocation] == "temp" else (v.allocation,)
        groups.setdefault(key, []).append((s, e, v, size, reserved))
    out = []
    users = None  # instruction -> the instructions that read it, built when first needed
    for members in groups.values():
        live_members = [m for m in members if not m[4]]
        reserved_only = not live_members
        members = members if reserved_only else live_members
        # Prefer the member with metadata (XLA copies and loop phis have none), then the largest.
        s, e, v, size, _ = max(members, key=lambda m: (bool(hlo.op_name.get(m[2].instruction)), m[3], -m[0]))
        alloc_kind = alloc_kinds[v.allocation]
        index = re.findall(r"\d+", v.key[len(v.instruction) :])
        origin = _origin(v.instruction, int(index[0]) if index else None, hlo)
        op_name = hlo.op_name.get(origin, "")
        if alloc_kind == "parameter":
            kind = kinds.ARGUMENT
        else:
            kind = _kind(op_name)
            start = min(m[0] for m in members)
            if kind == kinds.RECOMPUTATION and start < backward_start:
                # XLA merged the checkpoint's recomputation with the forward's own computation of the
                # same value when forward math reads it: computed once, for both passes.
                users = users if users is not None else _users(hlo)
                if _read_by_forward(origin, hlo, users) or _read_by_forward(v.instruction, hlo, users):
                    kind = kinds.FORWARD
            if kind == kinds.FORWARD and start >= backward_start:
                # Forward math the backward pass does again (or re-casts) is read by the backward pass;
                # forward math no backward instruction reads (the loss's value) is the forward's own.
                users = users if users is not None else _users(hlo)
                kind = kinds.RECOMPUTATION if _feeds_backward(origin, hlo, users) else kinds.FORWARD
            elif kind == kinds.FORWARD and e >= backward_start:
                kind = kinds.FORWARD_RESIDUAL
            if _is_gathered(origin, hlo):
                kind = kinds.GATHERED  # communication, not recomputed math, whichever pass gathers it
            if reserved_only or (kind == kinds.OTHER and alloc_kind == "output"):
                kind = kinds.OUTPUT
        chain = hlo.source.get(origin, ())
        source = f"{os.path.basename(chain[0][0])}:{chain[0][1]}" if chain else ""
        out.append(
            TimelineBuffer(
                name=_argument_name(v.instruction) if alloc_kind == "parameter" else _name_for(origin, hlo, tags),
                kind=kind,
                size_bytes=max(m[3] for m in members),
                shape=v.shape,
                instruction=v.instruction,
                op_name=op_name,
                source=source,
                start_position=min(m[0] for m in members),
                end_position=max(m[1] for m in members),
            )
        )
    out.sort(key=lambda b: (-b.size_bytes, b.start_position))
    return tuple(out if top is None else out[:top])


__all__ = ["buffers_at"]
