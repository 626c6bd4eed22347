"""StateFiles with orbax: parameters, optimizer state, step, data position and RNG key.

One checkpoint per saved step, as two orbax items: ``state`` (arrays, written with
``StandardSave``) and ``meta`` (JSON: step, data position, model shape, training settings,
vocabulary fingerprint). Orbax writes each checkpoint into a temporary directory and renames
it into place only when complete, so a crash during a save leaves the previous checkpoint as
the latest good one (the half-written temporary directory is ignored).

A checkpoint damaged afterwards (a file emptied, overwritten or deleted) is told apart from one
of another model: its stored array metadata matches the model and it still does not restore,
or its metadata does not read (:class:`CorruptStateFiles`). :meth:`StateFiles.quarantine` moves
it into ``corrupt/`` inside the directory, where orbax no longer sees it, so a resumed run
continues from the newest good checkpoint and can save that step again.

One run at a time writes a directory: :class:`RunLock` holds an exclusive ``flock`` on
``.jremat-run.lock`` for the run's lifetime. The kernel releases it when the process dies, so a
killed run's lock is taken over by the next run (and reported), never a stale lock to delete by hand.

Words: here a *checkpoint* is one saved step of the training state, orbax's word, kept in the
flags ``--ckpt-dir``, ``--ckpt-every`` and ``--keep-checkpoints`` and in the messages that name
them; it has nothing to do with :func:`jremat.checkpoint` (what a function keeps for its backward
pass). The code calls the directory and its steps the *state files*.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import gc
import inspect
import json
import os
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
from flax import nnx

from jremat.models import ModelConfig
from jremat.train import interrupts
from jremat.train.cli import UsageError
from jremat.train.config import TrainConfig
from jremat.train.data import Corpus

#: ModelConfig fields that determine the parameter shapes.
SHAPE_FIELDS = (
    "vocab_size",
    "max_seq_len",
    "n_layers",
    "d_model",
    "n_heads",
    "head_dim",
    "d_ff",
    "param_dtype",
    "moe_experts",
    "moe_shared_expert",
)


class StateFilesError(UsageError):
    """A checkpoint directory is unusable, empty on --resume, or holds an incompatible checkpoint."""


class CorruptStateFiles(StateFilesError):
    """A checkpoint whose files are damaged: its metadata or arrays do not read back."""


#: The lock file of the run that writes a checkpoint directory.
LOCK_NAME = ".jremat-run.lock"
#: Where damaged checkpoints are moved, inside the checkpoint directory.
CORRUPT_DIR = "corrupt"
#: Longest wait for a failed read's leftover callbacks to finish (:func:`_quietly`).
QUIET_WAIT_S = 3.0


class RunLock:
    """An exclusive lock on a checkpoint directory for one run (see the module docstring).

    Args:
      directory: the checkpoint directory (exists, writable).

    Attributes:
      taken_over: the holder written in the lock file by a run that ended without releasing it
        (killed), or ``""``.

    Raises:
      StateFilesError: if another live process holds the lock; the message names it.
    """

    def __init__(self, directory: Path):
        self.path = directory / LOCK_NAME
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            holder = os.read(fd, 512).decode(errors="replace").strip()
        except OSError as err:
            raise StateFilesError(
                f"cannot open the run lock {str(self.path)!r} ({err.strerror or err}); make it readable and "
                "writable, or choose another --ckpt-dir"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise StateFilesError(
                f"--ckpt-dir {str(directory)!r} is in use by another run ({holder or 'holder unknown'}); two runs "
                "writing one directory would overwrite each other's checkpoints: wait for it to end, or choose "
                "another --ckpt-dir"
            ) from None
        self.taken_over = holder
        os.ftruncate(fd, 0)
        os.pwrite(
            fd, f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}".encode(), 0
        )
        self._fd = fd
        interrupts.INTERRUPTS.before_exit(self.release)  # an interrupt is an end, not a crash to report

    def release(self) -> None:
        """Empty the lock file and release the lock (a clean end leaves nothing to take over)."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        interrupts.INTERRUPTS.forget(self.release)
        os.ftruncate(fd, 0)
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def check_writable(directory: str | os.PathLike) -> Path:
    """Create ``directory`` if needed and prove it is writable by writing and removing a file.

    Raises:
      StateFilesError: if it cannot be created or written.
    """
    path = Path(directory).expanduser().absolute()
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-probe-"):
            pass
    except OSError as err:
        raise StateFilesError(
            f"checkpoint directory {str(path)!r} is not writable ({err.strerror or err}); "
            "choose a directory you can write to with --ckpt-dir"
        ) from None
    return path


def pack_state(params, opt_state, rng_key: jax.Array) -> dict[str, Any]:
    """The array tree orbax stores: params as a plain nested dict, optimizer leaves by index, raw key data."""
    return {
        "params": nnx.to_pure_dict(params),
        "opt_state": {f"{i:05d}": leaf for i, leaf in enumerate(jax.tree.leaves(opt_state))},
        "rng_key": jax.random.key_data(rng_key),
    }


def unpack_state(tree: dict[str, Any], params_template, opt_state_template) -> tuple[Any, Any, jax.Array]:
    """Invert :func:`pack_state` using freshly initialized ``params`` / ``opt_state`` for the structure.

    ``params_template`` is updated in place and returned.
    """
    nnx.replace_by_pure_dict(params_template, tree["params"])
    leaves = [tree["opt_state"][k] for k in sorted(tree["opt_state"])]
    opt_state = jax.tree.unflatten(jax.tree.structure(opt_state_template), leaves)
    return params_template, opt_state, jax.random.wrap_key_data(tree["rng_key"])


def model_shape(model_cfg: ModelConfig) -> dict[str, Any]:
    """The parameter-shape-determining fields of a model config."""
    return {k: getattr(model_cfg, k) for k in SHAPE_FIELDS}


class StateFiles:
    """The training-state files of one run directory (``--ckpt-dir``): one saved step each (orbax calls
    it a checkpoint), through an orbax ``CheckpointManager`` (synchronous, atomic saves).

    Args:
      directory: where the saved steps go (created if missing; must be writable).
      keep: how many most recent saved steps to keep.
      lock: hold the directory's :class:`RunLock` (one run at a time).

    Raises:
      StateFilesError: if the directory is not writable.
    """

    def __init__(self, directory: str | os.PathLike, *, keep: int = 3, lock: bool = False):
        import orbax.checkpoint as ocp

        self._ocp = ocp
        self.keep = keep
        self.path = check_writable(directory)
        self.lock = RunLock(self.path) if lock else None
        try:
            self.manager = ocp.CheckpointManager(
                self.path,
                options=ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=False, create=True),
                # Handlers named up front, so that a fresh manager reads a checkpoint's array metadata.
                item_handlers={"state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()},
            )
        except BaseException:
            if self.lock is not None:
                self.lock.release()
            raise

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, or ``None``."""
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        """Every complete checkpoint's step, newest first."""
        return sorted(self.manager.all_steps(), reverse=True)

    def quarantine(self, step: int) -> Path:
        """Move the checkpoint of ``step`` into ``corrupt/`` (out of orbax's sight); returns where it went."""
        target = self.path / CORRUPT_DIR / f"{step}-{time.strftime('%Y%m%d-%H%M%S')}"
        try:
            target.parent.mkdir(exist_ok=True)
            shutil.move(str(self.path / str(step)), str(target))
        except OSError as err:
            raise StateFilesError(
                f"cannot move the damaged checkpoint step {step} to {str(target)!r} ({err.strerror or err}); move or "
                "delete it by hand and resume again"
            ) from None
        self.manager.reload()
        return target

    def prune(self) -> None:
        """Delete the oldest checkpoints beyond ``keep`` (orbax counts only the steps it saved itself)."""
        for step in self.all_steps()[self.keep :]:
            self.manager.delete(step)

    def save(self, step: int, state: dict[str, Any], meta: dict[str, Any]) -> None:
        """Write the checkpoint of ``step``, wait until it is complete on disk, keep the newest ``keep``."""
        ocp = self._ocp
        self.manager.save(
            step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)), force=True
        )
        self.manager.wait_until_finished()
        self.prune()

    def read_meta(self, step: int) -> dict[str, Any]:
        """The JSON metadata of the checkpoint of ``step``.

        Raises:
          CorruptStateFiles: if it does not read as a JSON object.
        """
        self._check_readable(step)
        path = self.path / str(step) / "meta" / "metadata"
        try:
            meta = json.loads(path.read_text())
        except (FileNotFoundError, IsADirectoryError, UnicodeDecodeError, ValueError) as err:
            raise CorruptStateFiles(f"its metadata {str(path)!r} does not read ({_first_line(err)})") from None
        except OSError as err:  # an I/O error is not damage to move aside
            raise StateFilesError(
                f"checkpoint step {step}: cannot read {str(path)!r} ({err.strerror or err}); fix the file system "
                "or the permissions and resume again"
            ) from None
        if not isinstance(meta, dict) or "step" not in meta:
            raise CorruptStateFiles(f"its metadata {str(path)!r} holds no step")
        return meta

    def _check_readable(self, step: int) -> None:
        """Raise :class:`StateFilesError` (not corruption) for a file or folder this process may not read."""
        root = self.path / str(step)
        for folder, subfolders, files in os.walk(root):
            for name in [*subfolders, *files]:
                path = Path(folder) / name
                if not os.access(path, os.R_OK | (os.X_OK if path.is_dir() else 0)):
                    raise StateFilesError(
                        f"checkpoint step {step}: {str(path)!r} is not readable by this user; fix its permissions "
                        "and resume again"
                    )

    def restore_state(self, step: int, template: dict[str, Any]) -> dict[str, Any]:
        """The array tree of the checkpoint of ``step``, restored into ``template``'s shapes and shardings.

        Raises:
          StateFilesError: if the stored arrays do not fit ``template`` (another model or
            optimizer): the message lists the first differences.
          CorruptStateFiles: if the stored metadata does not read, or fits ``template`` but the
            arrays do not restore (damaged files).
        """
        ocp = self._ocp
        stored, reason = _quietly(lambda: self.manager.item_metadata(step)["state"])
        stored = getattr(stored, "tree", stored)
        if reason is not None:
            raise CorruptStateFiles(f"its array metadata does not read ({reason})")
        if not isinstance(stored, dict):
            raise CorruptStateFiles("its array metadata is missing")
        differences = _tree_differences(stored, template)
        if differences:
            raise StateFilesError(
                f"checkpoint step {step} in {str(self.path)!r} does not fit this model and optimizer: "
                + "; ".join(differences[:5])
                + (f"; and {len(differences) - 5} more" if len(differences) > 5 else "")
            )
        restored, reason = _quietly(
            lambda: self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(template)))
        )
        if reason is not None:  # the metadata fits: the array files are damaged
            raise CorruptStateFiles(f"its arrays do not restore ({reason})")
        return restored["state"]

    def close(self) -> None:
        """Release the manager's resources and the run lock."""
        try:
            self.manager.close()
        finally:
            if self.lock is not None:
                self.lock.release()


def _quietly(read):
    """``(read(), None)``, or ``(None, reason)`` when orbax fails to read damaged files.

    A failed orbax read leaves asyncio objects behind whose clean-up raises "Event loop is
    closed" when they are collected; they are collected here, their noise dropped, so the user
    sees one line instead of pages of "Exception ignored" tracebacks.
    """
    previous = sys.unraisablehook
    dropped = [0]
    sys.unraisablehook = lambda unraisable: dropped.__setitem__(0, dropped[0] + 1)
    try:
        try:
            return read(), None
        except Exception as err:  # orbax and TensorStore raise many types for damaged files
            reason = _first_line(err)
        # TensorStore completes the reads still in flight on its own threads, whose callbacks then
        # find orbax's event loop closed: wait until they have gone quiet.
        deadline = time.monotonic() + QUIET_WAIT_S
        while time.monotonic() < deadline:
            before = dropped[0]
            gc.collect()
            time.sleep(0.1)
            if dropped[0] == before:
                break
        _close_abandoned_orbax_coroutines()
        return None, reason
    finally:
        sys.unraisablehook = previous


def _close_abandoned_orbax_coroutines() -> None:
    """Close the coroutines a failed read left suspended in orbax (ours are synchronous, so none
    is still wanted), so that their clean-up error surfaces here rather than in a later garbage
    collection, far from the read."""
    for obj in gc.get_objects():
        if inspect.iscoroutine(obj) and obj.cr_frame is not None and "orbax" in obj.cr_code.co_filename:
            with contextlib.suppress(BaseException):
                obj.close()


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    line = text.splitlines()[0] if text else type(err).__name__
    return line.split(" See full TensorStore details")[0][:200]  # not the pages of detail behind it


def _tree_differences(stored, template) -> list[str]:
    """``path: checkpoint shape S, this run shape T`` for each leaf whose shape differs, and missing/extra paths."""
    flat_stored = {jax.tree_util.keystr(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(stored)[0]}
    flat_template = {jax.tree_util.keystr(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(template)[0]}
    out = [f"{k}: missing in the checkpoint" for k in flat_template if k not in flat_stored]
    out += [f"{k}: in the checkpoint, not in this run" for k in flat_stored if k not in flat_template]
    for key in flat_template.keys() & flat_stored.keys():
        s, t = flat_stored[key], flat_template[key]
        s_shape, t_shape = tuple(getattr(s, "shape", ())), tuple(getattr(t, "shape", ()))
        if s_shape != t_shape:
            out.append(f"{key}: checkpoint shape {s_shape}, this run {t_shape}")
    return sorted(out)


def resume_from_newest_good(
    state_files: StateFiles,
    template: dict,
    check: Callable[[dict], list[str]],
    log,
    move: bool,
    agree: Callable[[int], None] = lambda step: None,
):
    """``(step, meta, state)`` of the newest checkpoint that reads back and that ``check(meta)`` accepts.

    ``check`` raises to refuse a checkpoint (another model or data: the search stops) and
    returns notes, logged for the checkpoint resumed from. A damaged checkpoint
    (:class:`CorruptStateFiles`) is reported and the next older one tried. Once an older one has
    restored and ``agree(step)`` has accepted its step (every process of a run found the same),
    the damaged ones are moved aside when ``move`` (process 0). If none restores, nothing is moved.

    Raises:
      StateFilesError: no checkpoint, none intact, a checkpoint that cannot be read (permissions),
        ``check``'s refusal, or ``agree``'s.
    """
    damaged = []
    for step in state_files.all_steps():
        try:
            meta = state_files.read_meta(step)
            notes = check(meta)
            state = state_files.restore_state(step, template)
        except CorruptStateFiles as err:
            damaged.append((step, err))
            log(f"warning: checkpoint step {step} in {state_files.path} is damaged ({err}); trying the one before")
            continue
        agree(step)
        for bad_step, _ in damaged:
            if move:
                log(f"warning: moved the damaged checkpoint step {bad_step} to {state_files.quarantine(bad_step)}")
        for note in notes:
            log(note)
        return step, meta, state
    if not damaged:
        raise no_state_error(state_files.path)
    listed = "; ".join(f"step {step}: {err}" for step, err in damaged)
    raise StateFilesError(
        f"--resume: no intact checkpoint in {str(state_files.path)!r} ({listed}); nothing was moved; start a fresh run "
        "in another --ckpt-dir"
    )


def no_state_error(path) -> StateFilesError:
    """The error of ``--resume`` on a directory without checkpoints."""
    return StateFilesError(f"--resume: no checkpoint found in {str(path)!r}; run without --resume to start fresh")


def state_meta(
    cfg: TrainConfig, model_cfg, corpus: Corpus, step: int, batches_per_epoch: int, total_steps: int
) -> dict[str, Any]:
    """The JSON metadata stored with the checkpoint of ``step`` (what ``--resume`` checks)."""
    return {
        "step": step,
        "data_position": step * cfg.accum,
        "epoch": step * cfg.accum / batches_per_epoch,
        "model_shape": model_shape(model_cfg),
        "model": jsonable(dataclasses.asdict(model_cfg)),
        "train": jsonable(dataclasses.asdict(cfg)),
        "vocab_md5": corpus.vocab_md5(),
        "total_steps": total_steps,
    }


def jsonable(value):
    """``value`` as JSON reads it back (tuples as lists)."""
    return json.loads(json.dumps(value, default=list))
