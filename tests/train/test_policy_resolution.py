"""A policy spec is parsed and resolved once per configuration, at the edge: ``--policy`` is
resolved by the train config, and what flows inward (the model config, its remat config, the
layer stack) is the resolved policy, not the text."""

import collections

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import jremat
from jremat import registry
from jremat._apply import registry as registry_impl
from jremat.models import GPT, cross_entropy_loss, preset
from jremat.train import cli, ptb
from jremat.train.config import TrainConfig


@pytest.fixture
def counted(monkeypatch):
    """Count every parse of a spec's text (``parse_spec``) and every resolution (a policy built
    from a spec), wherever it is called from."""
    counts: collections.Counter = collections.Counter()
    parse, build = registry_impl.parse_spec, registry_impl._build

    def counting_parse(spec):
        counts["parse", spec] += 1
        return parse(spec)

    def counting_build(spec, overrides):
        counts["resolve", spec] += 1
        return build(spec, overrides)

    monkeypatch.setattr(registry_impl, "parse_spec", counting_parse)
    monkeypatch.setattr(registry, "parse_spec", counting_parse)  # the train CLIs read it from the facade
    monkeypatch.setattr(registry_impl, "_build", counting_build)
    return counts


def test_a_model_config_resolves_its_policy_once(counted):
    cfg = preset("tiny", vocab_size=64, max_seq_len=8, remat_policy="every_k:k=4", scan_layers=False)
    for _ in range(3):
        remat = cfg.remat_config()
        remat.resolved_policy()
        remat.layer_groups(cfg.n_layers)
    model = GPT(cfg, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    tokens = jnp.zeros((1, 8), jnp.int32)
    loss = lambda p: cross_entropy_loss(nnx.merge(graphdef, p), tokens, tokens, jax.random.key(0))
    jax.eval_shape(jax.grad(loss), params)  # the layer stack traced, forward and backward
    assert counted == {("parse", "every_k:k=4"): 1, ("resolve", "every_k:k=4"): 1}


def test_layer_groups_resolve_each_group_once(counted):
    config = jremat.RematConfig(policy="full", layer_policies="1:every_k:k=2,rest:none")
    for _ in range(3):
        config.layer_groups(4)
        config.resolved_policy()
    assert counted == {
        ("parse", "full"): 1,
        ("resolve", "full"): 1,
        ("parse", "every_k:k=2"): 1,
        ("resolve", "every_k:k=2"): 1,
        ("parse", "none"): 1,
        ("resolve", "none"): 1,
    }


# With a key flag, the argument parser also checks the flag against the spec's own keys.
@pytest.mark.parametrize(
    ("argv", "expected_parses"), [(["--policy", "every_k", "--k", "4"], 3), (["--policy", "every_k:k=4"], 2)]
)
def test_the_train_cli_resolves_policy_once(counted, argv, expected_parses):
    cli.check_before_imports(TrainConfig, ["--preset", "tiny", *argv], prog="ptb")
    before_jax_free_check = sum(n for (kind, _), n in counted.items() if kind == "parse")
    assert before_jax_free_check == 1, counted  # the CLI's check before JAX: the text parsed once
    cfg = ptb.parse_config(["--preset", "tiny", *argv])
    model_cfg = cfg.model_config(vocab_size=64)
    ptb.resolve_auto_policy(cfg, model_cfg)
    remat = model_cfg.remat_config()
    assert remat.resolved_policy() is cfg.resolved_policy().policy  # the edge's object flowed inward
    assert model_cfg.remat_policy == cfg.policy_spec() == "every_k:k=4"  # the config still reads as text
    resolutions = {spec: n for (kind, spec), n in counted.items() if kind == "resolve"}
    assert list(resolutions.values()) == [1], counted
    parses = sum(n for (kind, _), n in counted.items() if kind == "parse")
    # The JAX-free check, the argument parser's check of a key flag, and the one resolution.
    assert parses == expected_parses, counted


def test_a_new_configuration_is_resolved_again(counted):
    cfg = preset("tiny", vocab_size=64, remat_policy="every_k:k=4")
    cfg.replace(remat_policy="every_k:k=2").remat_config()
    assert counted[("resolve", "every_k:k=4")] == 1 and counted[("resolve", "every_k:k=2")] == 1
