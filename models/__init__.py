"""Reference Flax NNX transformer language model for jremat (needs the ``[train]`` extra).

``GPT``, ``cross_entropy_loss`` and ``moe_aux_losses`` (and with them Flax) load on first use (PEP 562), so the CLIs
read the presets and check their flags before JAX and Flax are imported.
"""

from jremat.internal import missing_modules, train_extra_message

if _missing := missing_modules(("flax",)):
    raise ImportError(train_extra_message("jremat.models", _missing))

from jremat.models.config import PRESETS, ModelConfig, preset

__all__ = ["GPT", "ModelConfig", "PRESETS", "cross_entropy_loss", "moe_aux_losses", "preset"]


def __getattr__(name: str):
    if name in ("GPT", "cross_entropy_loss", "moe_aux_losses"):
        from jremat.models import gpt

        value = getattr(gpt, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'jremat.models' has no attribute {name!r}")
