"""The reference model's loss head on a mesh (train/head.py); its values: tests/train/test_sharding.py."""

from jremat.models import preset
from jremat.models.head import ShardedHead
from jremat.train import head
from tests.train.test_sharding import abstract_mesh


def test_sharded_head_splits_the_tokens_as_the_residual_stream_and_the_vocabulary_over_tensor():
    cfg = preset("tiny").replace(remat_head_chunks=4)  # vocab_size divides by 2, not by 3
    mesh = abstract_mesh(data=2, tensor=2, sequence=2)
    assert head.sharded_head(mesh, cfg) == ShardedHead(mesh, ("data", "fsdp"), ("sequence",), "tensor")
    odd = cfg.replace(vocab_size=cfg.vocab_size + 1)
    assert head.sharded_head(mesh, odd).vocab_axis is None  # a vocabulary tensor does not divide stays whole


def test_no_sharded_head_on_one_device_or_without_chunks():
    cfg = preset("tiny")
    assert head.sharded_head(abstract_mesh(), cfg.replace(remat_head_chunks=4)) is None
    assert head.sharded_head(abstract_mesh(fsdp=8), cfg.replace(remat_head_chunks=0)) is None
