"""A policy covers the whole step by default: the CLIs remat the head and loss in chunks unless the policy is none."""

import pytest

import jremat
from jremat.models.config import whole_step_head_chunks
from jremat.train import fit, ptb
from jremat.train.config import TrainConfig
from jremat.train.memory import MemoryConfig
from jremat.train.usage import UsageError


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


def _fit_search_configs(monkeypatch, **flags):
    """The spec -> model config mapping ``train.ptb --batch-size auto`` hands its search (nothing compiled)."""
    builders = []

    def search(builder, *args, **kwargs):
        builders.append(builder)
        raise jremat.FitError("stopped before compiling")

    monkeypatch.setattr(fit, "search", search)
    cfg = TrainConfig(preset="tiny", batch_size="auto", memory_budget="4MiB", seq_len=16, **flags)
    with pytest.raises(UsageError, match="stopped before compiling"):
        ptb.fit_batch(cfg, 64, False)
    return builders[0].model_config


def test_train_ptb_batch_size_auto_searches_and_trains_the_given_head_chunks(monkeypatch):
    configs = _fit_search_configs(monkeypatch, policy="full", remat_head_chunks=0)
    assert configs("full").remat_head_chunks == 0
    configs = _fit_search_configs(monkeypatch, policy="auto", remat_head_chunks=2)
    assert [configs(spec).remat_head_chunks for spec in ("none", "full", "auto")] == [2, 2, 2]


def test_train_ptb_batch_size_auto_default_head_chunks_are_per_policy(monkeypatch):
    configs = _fit_search_configs(monkeypatch, policy="auto")
    assert [configs(spec).remat_head_chunks for spec in ("none", "full", "auto")] == [0, 4, 4]
    assert _fit_search_configs(monkeypatch, policy="full")("full").remat_head_chunks == 4
