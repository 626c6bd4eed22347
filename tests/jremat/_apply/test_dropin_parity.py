"""``jremat.checkpoint`` against ``jax.checkpoint`` where a drop-in was last seen to differ, under both
remat engines: the programs a pullback called again lowers (JAX's issue 9661), the name stacks of
the equations inside the checkpoint, and what a JAX policy object keeps under ``jax.vmap``, with
the per-call reading jremat offers by name (``dots_no_batch:per_call=true``).
"""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import checkpoint_name

import jremat
from jremat._engine import jax_compat as _jax_compat
from jremat._engine import jaxpr as _jaxpr
from tests.conftest import REPO, saved_residuals

NO_BATCH = jax.checkpoint_policies.dots_with_no_batch_dims_saveable


@pytest.mark.heavy
def test_a_pullback_called_again_lowers_no_more_than_jax_checkpoints():
    """20 calls of the pullback of a checkpointed ``jax.jit`` function (JAX's issue 9661), with and
    without ``static_argnums``, under both engines, in a fresh process: jremat lowers no program
    ``jax.checkpoint`` does not. The count sees the programs an eager tie would add (``broken``)."""
    proc = subprocess.run(
        [sys.executable, "-m", "tests.jremat.pullback_compiles"], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    counts = json.loads(proc.stdout.strip().splitlines()[-1])
    for engine in ("classic", "remat3"):
        for form in ("plain", "static_argnums"):
            ours, jaxs = counts[engine][f"jremat {form}"], counts[engine][f"jax {form}"]
            assert 1 <= jaxs <= 2, (engine, form, counts)  # JAX's own test: at most 2
            assert ours <= jaxs, (engine, form, counts)
    assert counts["broken"] > counts["remat3"]["jax plain"], counts


X = jnp.linspace(-1.0, 1.0, 12).reshape(3, 4)
W = jnp.linspace(0.5, -0.5, 16).reshape(4, 4)
XS = jnp.stack([X, -X])
USER_OPS = ("tanh", "sin", "cos")


def block(w, x):
    with jax.named_scope("attn"):
        h = checkpoint_name(jnp.tanh(x @ w), "hidden")
    return jnp.sin(jnp.cos(h) @ w.T)


def untagged_block(w, x):
    """``block`` without its name tag: JAX's own remat3 name tag cannot vmap."""
    with jax.named_scope("attn"):
        h = jnp.tanh(x @ w)
    return jnp.sin(jnp.cos(h) @ w.T)


def _name_stacks(jaxpr) -> dict[str, set[str]]:
    """The name stacks of the user's ops (:data:`USER_OPS`), nested jaxprs included, by primitive."""
    found: dict[str, set[str]] = {}
    for eqn in _jaxpr.equations(jaxpr.jaxpr):
        if eqn.primitive.name in USER_OPS:
            found.setdefault(eqn.primitive.name, set()).add(str(eqn.source_info.name_stack))
    return found


def _lowered_op_names(fn) -> dict[str, set[str]]:
    """The op names (HLO locations) of the user's ops in ``jit(grad)`` lowered, by primitive."""
    text = jax.jit(jax.grad(lambda w: jnp.sum(fn(w, X)))).lower(W).as_text(debug_info=True)
    found: dict[str, set[str]] = {}
    for name in re.findall(r'loc\("([^"]*)"', text):
        if name.rsplit("/", 1)[-1] in USER_OPS:
            found.setdefault(name.rsplit("/", 1)[-1], set()).add(name)
    return found


NAME_STACKS = {
    "grad": lambda c: _name_stacks(jax.make_jaxpr(jax.grad(lambda w: jnp.sum(c(w, X))))(W)),
    "pullback": lambda c: _name_stacks(jax.make_jaxpr(lambda w: jax.vjp(lambda v: c(v, X), w)[1](X))(W)),
    "grad(vmap)": lambda c: _name_stacks(
        jax.make_jaxpr(jax.grad(lambda w: jnp.sum(jax.vmap(c, in_axes=(None, 0))(w, XS))))(W)
    ),
    "lowered jit(grad)": _lowered_op_names,
}


@pytest.mark.parametrize("policy", [None, NO_BATCH], ids=["none", "dots_with_no_batch_dims"])
@pytest.mark.parametrize("seen", NAME_STACKS.values(), ids=NAME_STACKS.keys())
def test_name_stacks_inside_the_checkpoint_are_jax_checkpoints(remat_engine, policy, seen):
    fn = untagged_block if seen is NAME_STACKS["grad(vmap)"] else block
    expected = seen(jax.checkpoint(fn, policy=policy))
    got = seen(jremat.checkpoint(fn, policy))
    assert got == expected
    # what is compared holds the backward pass's recomputation
    assert any("rematted_computation" in name for names in expected.values() for name in names), expected


def test_the_name_stack_comparison_sees_the_tie(remat_engine, monkeypatch):
    """Without keeping the caller's name stacks, the tie's ``jax.vjp`` adds ``jvp( )`` and
    ``transpose( )`` levels, and the comparison above fails."""
    monkeypatch.setattr(_jax_compat, "keep_name_stack", lambda: contextlib.nullcontext)
    monkeypatch.setattr(_jax_compat, "skip_next_name_transform", contextlib.nullcontext)
    got = NAME_STACKS["grad"](jremat.checkpoint(block))
    assert got != NAME_STACKS["grad"](jax.checkpoint(block))
    assert any("jvp(jvp(" in name for name in got["tanh"]), got


# A pipeline's vmap over stages (MaxText's): 4 stages, each [8, 16] @ [16, 32] and back.
STAGE_W = jnp.linspace(-0.1, 0.1, 4 * 16 * 32).reshape(4, 16, 32)
STAGE_X = jnp.linspace(-1.0, 1.0, 4 * 8 * 16).reshape(4, 8, 16)


#: What the pipeline's loss keeps outside the checkpoints (one value for the square).
STAGE_OUTPUT = "f32[4,8,16]"
#: The per-stage matmul outputs: ``x @ w`` and the product with ``w.T``.
STAGE_MATMULS = ["f32[4,8,16]", "f32[4,8,32]"]


def stage(w, x):
    return jnp.tanh(jnp.sin(x @ w) @ w.T)


def _stage_loss(checkpointed):
    return lambda w, x: jnp.sum(jax.vmap(checkpointed)(w, x) ** 2)


def _kept(checkpointed) -> list[str]:
    """The values the pipeline's gradient keeps besides its arguments (the stage weights and inputs)."""
    kept = saved_residuals(_stage_loss(checkpointed), STAGE_W, STAGE_X)
    return sorted(aval.str_short(short_dtypes=True) for aval, source in kept if "from the argument" not in source)


@pytest.mark.parametrize("prevent_cse", [True, False])
def test_a_jax_policy_under_vmap_keeps_what_jax_checkpoint_keeps(remat_engine, prevent_cse):
    """``dots_with_no_batch_dims_saveable`` under the vmap over stages keeps no matmul, as JAX's
    (only a value of the loss): the vmap gives each stage's matmuls a batch dimension. The named
    policy means the same."""
    expected = _kept(jax.checkpoint(stage, policy=NO_BATCH, prevent_cse=prevent_cse))
    assert expected == [STAGE_OUTPUT]
    assert _kept(jremat.checkpoint(stage, NO_BATCH, prevent_cse=prevent_cse)) == expected
    assert _kept(jremat.checkpoint(stage, "dots_no_batch", prevent_cse=prevent_cse)) == expected
    # a policy a vmap cannot change stays tied under it
    assert _kept(jremat.checkpoint(stage, jax.checkpoint_policies.dots_saveable)) == _kept(
        jax.checkpoint(stage, policy=jax.checkpoint_policies.dots_saveable)
    )


def _primitives(fn, *args) -> set[str]:
    return {eqn.primitive.name for eqn in _jaxpr.equations(jax.make_jaxpr(fn)(*args).jaxpr)}


def test_under_vmap_only_a_policy_the_vmap_can_change_runs_untied(remat_engine):
    vmapped = lambda policy: jax.vmap(jremat.checkpoint(stage, policy))
    assert "custom_vjp_call" not in _primitives(vmapped(NO_BATCH), STAGE_W, STAGE_X)
    for policy in (None, jax.checkpoint_policies.dots_saveable, "dots_no_batch:per_call=true"):
        assert "custom_vjp_call" in _primitives(vmapped(policy), STAGE_W, STAGE_X), policy


@pytest.mark.parametrize("prevent_cse", [True, False])
def test_per_call_keeps_each_stage_matmuls_under_vmap(remat_engine, prevent_cse):
    """``dots_no_batch:per_call=true`` judges each stage's own program: both per-stage matmul
    outputs are kept where JAX's reading keeps none; the gradients are JAX's."""
    per_call = jremat.checkpoint(stage, "dots_no_batch:per_call=true", prevent_cse=prevent_cse)
    kept_per_call = sorted([STAGE_OUTPUT, *STAGE_MATMULS])
    assert _kept(jax.checkpoint(stage, policy=NO_BATCH)) == [STAGE_OUTPUT]
    assert _kept(per_call) == kept_per_call
    assert _kept(jremat.checkpoint(jax.jit(stage), "dots_no_batch:per_call=true")) == kept_per_call
    grads = jax.grad(_stage_loss(per_call), argnums=(0, 1))(STAGE_W, STAGE_X)
    expected = jax.grad(_stage_loss(jax.checkpoint(stage, policy=NO_BATCH)), argnums=(0, 1))(STAGE_W, STAGE_X)
    for g, e in zip(grads, expected):
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=1e-6, atol=1e-7)


def test_per_call_is_a_key_of_dots_no_batch_and_of_callback_policies():
    assert jremat.resolve("dots_no_batch:per_call=true").per_call
    assert not jremat.resolve("dots_no_batch").per_call
    assert jremat.resolve("dots_no_batch", per_call=True).spec == "dots_no_batch:per_call=true"
    assert jremat.CallbackPolicy(NO_BATCH, per_call=True).per_call
    with pytest.raises(ValueError, match="per_call must be true or false"):
        jremat.resolve("dots_no_batch:per_call=maybe")
