"""Reference Flax NNX transformer language model for jremat (needs the ``[train]`` extra)."""

from jremat._extras import missing_modules, train_extra_message

if _missing := missing_modules(("flax", "optax")):
    raise ImportError(train_extra_message("jremat.models", _missing))

from jremat.models.config import PRESETS, ModelConfig, preset
from jremat.models.gpt import GPT, cross_entropy_loss

__all__ = ["GPT", "ModelConfig", "PRESETS", "cross_entropy_loss", "preset"]
