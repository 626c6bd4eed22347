"""Reference Flax NNX transformer language model for jremat."""

from jremat.models.config import PRESETS, ModelConfig, preset
from jremat.models.gpt import GPT, cross_entropy_loss

__all__ = ["GPT", "ModelConfig", "PRESETS", "cross_entropy_loss", "preset"]
