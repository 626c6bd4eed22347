"""Orbax checkpoints: round trip, a crash in the middle of a save keeps the last good one, and resuming
skips damaged checkpoints without mistaking a read error for damage."""

import errno
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jremat.train.ptb import resume_from_newest_good
from jremat.train.state_files import CORRUPT_DIR, CorruptStateFiles, StateFiles, StateFilesError, check_writable
from tests.conftest import REPO


def test_save_restore_round_trip(tmp_path):
    ckpts = StateFiles(tmp_path / "ck", keep=2)
    state = {"w": jnp.arange(6.0).reshape(2, 3), "n": {"b": jnp.ones(2, jnp.int32)}}
    ckpts.save(5, state, {"step": 5})
    assert ckpts.latest_step() == 5 and ckpts.read_meta(5) == {"step": 5}
    template = jax.tree.map(jnp.zeros_like, state)
    restored = ckpts.restore_state(5, template)
    np.testing.assert_array_equal(restored["w"], state["w"])
    np.testing.assert_array_equal(restored["n"]["b"], state["n"]["b"])
    ckpts.close()


def test_unwritable_directory_is_a_clear_error(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    with pytest.raises(StateFilesError, match="is not writable.*--ckpt-dir"):
        check_writable(blocker / "ck")


CRASHING_SAVER = textwrap.dedent(
    """
    import os, sys
    import jax.numpy as jnp
    from orbax.checkpoint._src.handlers import json_checkpoint_handler
    from jremat.train.state_files import StateFiles

    ckpts = StateFiles(sys.argv[1])
    ckpts.save(1, {"w": jnp.full((4,), 1.0)}, {"step": 1})

    def die(self, *args, **kwargs):  # the process dies half-way through writing step 2
        os._exit(17)

    json_checkpoint_handler.JsonCheckpointHandler._save_fn = die
    ckpts.save(2, {"w": jnp.full((4,), 2.0)}, {"step": 2})
    """
)


@pytest.mark.heavy
def test_crash_during_save_keeps_the_last_good_checkpoint(tmp_path):
    directory = tmp_path / "ck"
    proc = subprocess.run(
        [sys.executable, "-c", CRASHING_SAVER, str(directory)], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 17, proc.stderr
    leftovers = sorted(p.name for p in directory.iterdir())
    assert "1" in leftovers and "2" not in leftovers
    assert any(name.startswith("2.") for name in leftovers), leftovers  # the half-written temp dir
    ckpts = StateFiles(directory)
    assert ckpts.latest_step() == 1
    restored = ckpts.restore_state(1, {"w": jnp.zeros((4,))})
    np.testing.assert_array_equal(restored["w"], np.full((4,), 1.0))
    assert ckpts.read_meta(1) == {"step": 1}
    ckpts.close()


def _two_checkpoints(directory):
    ckpts = StateFiles(directory)
    for step in (1, 2):
        ckpts.save(step, {"w": jnp.full((4,), float(step))}, {"step": step})
    return ckpts, {"w": jnp.zeros(4)}


def _accept(meta):
    return [f"note: resuming step {meta['step']}"]


def test_damaged_checkpoints_are_moved_aside_only_once_an_older_one_restores(tmp_path):
    ckpts, template = _two_checkpoints(tmp_path / "ck")
    intact_meta = (ckpts.path / "1" / "meta" / "metadata").read_text()
    for step in (1, 2):
        (ckpts.path / str(step) / "meta" / "metadata").write_text("")
    lines = []
    with pytest.raises(StateFilesError, match="no intact checkpoint.*nothing was moved"):
        resume_from_newest_good(ckpts, template, _accept, lines.append, move=True)
    assert ckpts.all_steps() == [2, 1] and not (ckpts.path / CORRUPT_DIR).exists()

    (ckpts.path / "1" / "meta" / "metadata").write_text(intact_meta)  # step 1 intact again
    step, meta, state = resume_from_newest_good(ckpts, template, _accept, lines.append, move=True)
    assert step == 1 and float(state["w"][0]) == 1.0
    assert ckpts.all_steps() == [1] and len(list((ckpts.path / CORRUPT_DIR).iterdir())) == 1
    assert lines[-1] == "note: resuming step 1"  # notes of the checkpoint resumed from only
    assert sum("note:" in line for line in lines) == 1
    ckpts.close()


def test_a_read_error_is_not_damage(tmp_path, monkeypatch):
    """An I/O error, or a file this user may not read, stops the resume; nothing is moved."""
    ckpts, template = _two_checkpoints(tmp_path / "ck")
    newest_meta = ckpts.path / "2" / "meta" / "metadata"
    real_read_text = Path.read_text

    def failing_read_text(path, *args, **kwargs):
        if path == newest_meta:
            raise OSError(errno.EIO, "Input/output error")
        return real_read_text(path, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", failing_read_text)
    with pytest.raises(StateFilesError, match="cannot read .*Input/output error") as raised:
        resume_from_newest_good(ckpts, template, _accept, print, move=True)
    assert not isinstance(raised.value, CorruptStateFiles)
    monkeypatch.undo()

    unreadable = next(p for p in (ckpts.path / "2" / "state").rglob("*") if p.is_file())
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: Path(path) != unreadable and real_access(path, mode))
    with pytest.raises(StateFilesError, match="is not readable by this user") as raised:
        resume_from_newest_good(ckpts, template, _accept, print, move=True)
    assert not isinstance(raised.value, CorruptStateFiles)
    assert ckpts.all_steps() == [2, 1] and not (ckpts.path / CORRUPT_DIR).exists()
    ckpts.close()
