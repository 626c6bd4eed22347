"""train.metrics: resuming a metrics file: a torn last line is dropped, any other bad line is an error."""

import json
import os
import stat

import pytest

from jremat.train.metrics import COLUMNS, MetricsFile, read_rows
from jremat.train.usage import UsageError


def jsonl(path, steps, tail=""):
    path.write_text("".join(json.dumps({"step": s, "loss": 9.0 - s}) + "\n" for s in steps) + tail)
    return path


def csv_file(path, steps, tail=""):
    lines = [",".join(COLUMNS)] + [f"{s},{9.0 - s},1.0,0.001,0.1,100.0,,,," for s in steps]
    path.write_text("\r\n".join(lines) + "\r\n" + tail)
    return path


@pytest.mark.parametrize(
    "make, torn",
    [(jsonl, '{"step": 5, "loss": 9.0'), (csv_file, "5,9.0,1."), (csv_file, "5,9.0,1.0,0.001,0.1,1x")],
)
def test_a_torn_last_line_is_dropped_with_a_note(tmp_path, make, torn):
    path = make(tmp_path / ("m.csv" if make is csv_file else "m.jsonl"), [1, 2, 3, 4], tail=torn)
    notes = []
    metrics = MetricsFile(path, resume_step=4, log=notes.append)
    metrics.write({"step": 5, "loss": 4.5})
    metrics.close()
    assert [r["step"] for r in read_rows(path)] == [1, 2, 3, 4, 5]
    assert len(notes) == 1 and "dropped its last line, cut off by a killed run" in notes[0]


@pytest.mark.parametrize(
    "name, text, message",
    [
        ("m.jsonl", '{"step": 1}\n{"step": 2, "loss": oops}\n{"step": 3}\n', "line 2: not a JSON row"),
        ("m.jsonl", '{"step": 1}\n{"step": 2, "loss": 9.0\n', "line 2: not a JSON row"),  # ends in a newline
        ("m.jsonl", '{"step": 1}\n[1, 2]\n', "line 2: not a row: a JSON object with an integer 'step'"),
        ("m.csv", ",".join(COLUMNS) + "\n1,9,1,1,1,1,,,,\n2,9\n3,9,1,1,1,1,,,,\n", "line 3: 2 fields, 10 expected"),
        ("m.csv", "a,b\n1,2\n", "line 1: the header is not step,loss"),
    ],
)
def test_a_malformed_line_elsewhere_is_one_error_and_the_file_is_untouched(tmp_path, name, text, message):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(UsageError, match=message) as err:
        MetricsFile(path, resume_step=4)
    assert str(path) in str(err.value) and "\n" not in str(err.value)
    assert path.read_text() == text and os.listdir(tmp_path) == [name]


def test_resuming_keeps_the_files_mode(tmp_path):
    path = jsonl(tmp_path / "m.jsonl", [1, 2, 3])
    path.chmod(0o640)
    MetricsFile(path, resume_step=2).close()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o640 and [r["step"] for r in read_rows(path)] == [1, 2]
