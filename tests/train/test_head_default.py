"""A policy covers the whole step by default: the CLIs remat the head and loss in chunks unless the policy is none."""

from jremat.models.config import whole_step_head_chunks
from jremat.train.config import TrainConfig
from jremat.train.memory import MemoryConfig


def test_whole_step_head_chunks():
    assert whole_step_head_chunks("none", 20) == 0
    assert whole_step_head_chunks("every_k:k=4", 20) == 4
    assert whole_step_head_chunks("full", 6) == 2
    assert whole_step_head_chunks("full", 7) == 0


def test_train_ptb_default_covers_the_head_and_an_explicit_value_wins():
    assert TrainConfig(preset="tiny", policy="every_k").remat_head_chunks == 4
    assert TrainConfig(preset="tiny", policy="none").remat_head_chunks == 0
    assert TrainConfig(preset="tiny", policy="full", remat_head_chunks=0).remat_head_chunks == 0


def test_train_memory_default_covers_the_head_per_policy():
    config = MemoryConfig(preset="needle", policy=("none", "every_k:k=4"))
    assert config.model_config("none").remat_head_chunks == 0
    assert config.model_config("every_k:k=4").remat_head_chunks == 4
    assert MemoryConfig(preset="needle", remat_head_chunks=0).model_config("full").remat_head_chunks == 0
