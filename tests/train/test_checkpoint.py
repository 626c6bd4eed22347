"""Orbax checkpoints: round trip, and a crash in the middle of a save keeps the last good one."""

import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jremat.train.checkpoint import CheckpointError, Checkpoints, check_writable
from tests.conftest import REPO


def test_save_restore_round_trip(tmp_path):
    ckpts = Checkpoints(tmp_path / "ck", keep=2)
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
    with pytest.raises(CheckpointError, match="is not writable.*--ckpt-dir"):
        check_writable(blocker / "ck")


CRASHING_SAVER = textwrap.dedent(
    """
    import os, sys
    import jax.numpy as jnp
    from orbax.checkpoint._src.handlers import json_checkpoint_handler
    from jremat.train.checkpoint import Checkpoints

    ckpts = Checkpoints(sys.argv[1])
    ckpts.save(1, {"w": jnp.full((4,), 1.0)}, {"step": 1})

    def die(self, *args, **kwargs):  # the process dies half-way through writing step 2
        os._exit(17)

    json_checkpoint_handler.JsonCheckpointHandler._save_fn = die
    ckpts.save(2, {"w": jnp.full((4,), 2.0)}, {"step": 2})
    """
)


def test_crash_during_save_keeps_the_last_good_checkpoint(tmp_path):
    directory = tmp_path / "ck"
    proc = subprocess.run(
        [sys.executable, "-c", CRASHING_SAVER, str(directory)], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 17, proc.stderr
    leftovers = sorted(p.name for p in directory.iterdir())
    assert "1" in leftovers and "2" not in leftovers
    assert any(name.startswith("2.") for name in leftovers), leftovers  # the half-written temp dir
    ckpts = Checkpoints(directory)
    assert ckpts.latest_step() == 1
    restored = ckpts.restore_state(1, {"w": jnp.zeros((4,))})
    np.testing.assert_array_equal(restored["w"], np.full((4,), 1.0))
    assert ckpts.read_meta(1) == {"step": 1}
    ckpts.close()
