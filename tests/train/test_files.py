"""train.files: whole-file replacement keeps the replaced file's permissions; new files get the umask's."""

import os
import stat

import pytest

from jremat.train.files import write_text_atomically


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.mark.parametrize("before", [0o644, 0o640, 0o600])
def test_replacing_a_file_keeps_its_mode(tmp_path, before):
    path = tmp_path / "bench.csv"
    path.write_text("old\n")
    path.chmod(before)
    write_text_atomically(path, "new\r\nrow\n")
    assert path.read_bytes() == b"new\r\nrow\n" and mode(path) == before
    assert os.listdir(tmp_path) == ["bench.csv"]


def test_a_new_file_gets_the_umask_default(tmp_path):
    old = os.umask(0o027)
    try:
        write_text_atomically(tmp_path / "a.md", "text")
        os.umask(0o022)
        write_text_atomically(tmp_path / "b.md", "text")
    finally:
        os.umask(old)
    assert mode(tmp_path / "a.md") == 0o640 and mode(tmp_path / "b.md") == 0o644


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "report.md"
    path.write_text("old")
    with pytest.raises(TypeError):
        write_text_atomically(path, None)
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["report.md"]
