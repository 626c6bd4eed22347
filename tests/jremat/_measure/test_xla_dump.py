"""jremat._measure.xla_dump: readers of XLA's buffer-assignment, live-range and scheduled-HLO text."""

import pytest

from jremat._measure import xla_dump
from tests.jremat._measure.test_timeline import BUFFERS, HLO, LIVE

LOOP_HLO = """HloModule m, is_scheduled=true

FileNames
1 "/src/model.py"

FunctionNames
1 "layer"

FileLocations
1 {file_name_id=1 function_name_id=1 line=7 end_line=7 column=1 end_column=9}
2 {file_name_id=1 function_name_id=1 line=3 end_line=3 column=1 end_column=9}

StackFrames
1 {file_location_id=2 parent_frame_id=1}
2 {file_location_id=1 parent_frame_id=2}

%body (arg_tuple.1: (s32[], f32[4])) -> (s32[], f32[4]) {
  %arg_tuple.1 = (s32[], f32[4]{0}) parameter(0)
  %x.1 = f32[4]{0} get-tuple-element(%arg_tuple.1), index=1
  %y.1 = f32[4]{0} sine(%x.1), metadata={op_name="jit(f)/while/body/sin" stack_frame_id=2}
  %i.1 = s32[] get-tuple-element(%arg_tuple.1), index=0
  ROOT %tuple.1 = (s32[], f32[4]{0}) tuple(%i.1, %y.1)
}

%cond (arg_tuple.2: (s32[], f32[4])) -> pred[] {
  %arg_tuple.2 = (s32[], f32[4]{0}) parameter(0)
  ROOT %c.1 = pred[] constant(true)
}

ENTRY %main (p.1: (s32[], f32[4])) -> (s32[], f32[4]) {
  %p.1 = (s32[], f32[4]{0}) parameter(0)
  ROOT %while.1 = (s32[], f32[4]{0}) while(%p.1), condition=%cond, body=%body, metadata={op_name="jit(f)/while"}, backend_config={"known_trip_count":{"n":"12"}}
}
"""


def test_buffer_assignment_kinds_and_values():
    allocations = xla_dump.parse_buffer_assignment(BUFFERS)
    assert [(a.kind, a.size) for a in allocations] == [("parameter", 16), ("output", 16), ("constant", 4), ("temp", 48)]
    temp = allocations[-1]
    assert [(v.key, v.offset, v.size) for v in temp.values] == [("a.1{}", 0, 32), ("b.1{}", 0, 32), ("c.1{}", 32, 16)]


def test_live_range_sequence_and_ranges():
    sequence, ranges = xla_dump.parse_live_range(LIVE)
    assert sequence == ["p.1", "a.1", "b.1", "c.1", "out.1"]
    assert ranges["b.1{}"] == (2, 3) and len(ranges) == 5


def test_hlo_loops_operands_and_stack_frames():
    hlo = xla_dump.parse_hlo(LOOP_HLO)
    assert hlo.entry == "main" and hlo.whiles["while.1"] == ("cond", "body", 12, "jit(f)/while")
    assert hlo.body_of == {"body": "while.1"} and hlo.root["body"] == "tuple.1"
    assert hlo.operands["tuple.1"] == ["i.1", "y.1"] and hlo.opcode["y.1"] == "sine"
    # Innermost frame first, then its caller (the text prints a frame's parent as its id + 1).
    assert hlo.source["y.1"] == (("/src/model.py", 7), ("/src/model.py", 3))
    assert xla_dump.parse_hlo(HLO).op_name["b.1"] == "jit(f)/transpose(jvp())/add"


def test_wrong_text_is_named():
    with pytest.raises(ValueError, match="not an XLA buffer-assignment dump"):
        xla_dump.parse_buffer_assignment("HloModule m")
    with pytest.raises(ValueError, match="not an XLA live-range dump"):
        xla_dump.parse_live_range("BufferAssignment:")
