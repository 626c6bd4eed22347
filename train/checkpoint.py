"""Checkpoints with orbax: parameters, optimizer state, step, data position and RNG key.

One checkpoint per saved step, as two orbax items: ``state`` (arrays, written with
``StandardSave``) and ``meta`` (JSON: step, data position, model shape, training settings,
vocabulary fingerprint). Orbax writes each checkpoint into a temporary directory and renames
it into place only when complete, so a crash during a save leaves the previous checkpoint as
the latest good one (the half-written temporary directory is ignored).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import jax
from flax import nnx

from jremat.models import ModelConfig
from jremat.train.cli import UsageError

#: ModelConfig fields that determine the parameter shapes.
SHAPE_FIELDS = ("vocab_size", "max_seq_len", "n_layers", "d_model", "n_heads", "head_dim", "d_ff", "param_dtype")


class CheckpointError(UsageError):
    """A checkpoint directory is unusable, empty on --resume, or holds an incompatible checkpoint."""


def check_writable(directory: str | os.PathLike) -> Path:
    """Create ``directory`` if needed and prove it is writable by writing and removing a file.

    Raises:
      CheckpointError: if it cannot be created or written.
    """
    path = Path(directory).expanduser().absolute()
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-probe-"):
            pass
    except OSError as err:
        raise CheckpointError(
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


class Checkpoints:
    """An orbax ``CheckpointManager`` for one run directory (synchronous, atomic saves).

    Args:
      directory: where checkpoints go (created if missing; must be writable).
      keep: how many most recent checkpoints to keep.

    Raises:
      CheckpointError: if the directory is not writable.
    """

    def __init__(self, directory: str | os.PathLike, *, keep: int = 3):
        import orbax.checkpoint as ocp

        self._ocp = ocp
        self.path = check_writable(directory)
        self.manager = ocp.CheckpointManager(
            self.path,
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=False, create=True),
            item_names=("state", "meta"),
        )

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, or ``None``."""
        return self.manager.latest_step()

    def save(self, step: int, state: dict[str, Any], meta: dict[str, Any]) -> None:
        """Write the checkpoint of ``step`` and wait until it is complete on disk."""
        ocp = self._ocp
        self.manager.save(
            step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)), force=True
        )
        self.manager.wait_until_finished()

    def read_meta(self, step: int) -> dict[str, Any]:
        """The JSON metadata of the checkpoint of ``step``."""
        ocp = self._ocp
        return dict(self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"])

    def restore_state(self, step: int, template: dict[str, Any]) -> dict[str, Any]:
        """The array tree of the checkpoint of ``step``, restored into ``template``'s shapes and shardings.

        Raises:
          CheckpointError: if the stored arrays do not fit ``template``.
        """
        ocp = self._ocp
        try:
            restored = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(template)))[
                "state"
            ]
        except Exception as err:  # orbax raises various types for structure / shape mismatches
            raise CheckpointError(
                f"checkpoint step {step} in {str(self.path)!r} does not fit this model and optimizer: "
                f"{str(err).splitlines()[0] if str(err) else type(err).__name__}"
            ) from None
        return restored

    def close(self) -> None:
        """Release the manager's resources."""
        self.manager.close()


def check_compatible(meta: dict[str, Any], model_cfg: ModelConfig, vocab_md5: str, directory: Path) -> None:
    """Refuse to resume a checkpoint of a different model shape or vocabulary.

    Raises:
      CheckpointError: naming each differing field, the checkpoint's value and this run's.
    """
    stored = meta.get("model_shape", {})
    wanted = model_shape(model_cfg)
    diffs = [f"{k}: checkpoint {stored.get(k)!r}, this run {v!r}" for k, v in wanted.items() if stored.get(k) != v]
    if diffs:
        raise CheckpointError(
            f"cannot resume from {str(directory)!r} (step {meta.get('step')}): the checkpoint is for a "
            f"different model shape ({'; '.join(diffs)}). Resume with the checkpoint's --preset and data, "
            "or start a fresh run in another --ckpt-dir"
        )
    if meta.get("vocab_md5") != vocab_md5:
        raise CheckpointError(
            f"cannot resume from {str(directory)!r} (step {meta.get('step')}): the checkpoint was trained "
            "with a different vocabulary (other training data); use the same --data-dir as the original run"
        )
