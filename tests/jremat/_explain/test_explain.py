"""``jremat.explain``: every decision of a policy, unmatched names and no-saving cases, one line each."""

import json

import jax
import jax.numpy as jnp
import pytest
from jax.ad_checkpoint import checkpoint_name

import jremat
from jremat import explain_applied
from jremat._explain.explain import EXCLUDE, RECOMPUTE, SAVE


def mlp(w1, w2, x):
    """Four unrolled residual MLP layers, tagged mlp_in / mlp_out."""
    for _ in range(4):
        h = checkpoint_name(jnp.tanh(x @ w1), "mlp_in")
        x = x + checkpoint_name(h @ w2, "mlp_out")
    return jnp.sum(x**2)


ARGS = (
    jax.ShapeDtypeStruct((32, 128), jnp.float32),
    jax.ShapeDtypeStruct((128, 32), jnp.float32),
    jax.ShapeDtypeStruct((64, 32), jnp.float32),
)


def scanned(w1, w2, x, policy=None):
    """The same layers under lax.scan, each iteration checkpointed under ``policy`` (or not)."""

    def layer(x, _):
        h = checkpoint_name(jnp.tanh(x @ w1), "mlp_in")
        return x + checkpoint_name(h @ w2, "mlp_out"), None

    body = jremat.checkpoint(layer, policy, prevent_cse=False) if policy else layer
    return jnp.sum(jax.lax.scan(body, x, None, length=4)[0] ** 2)


def test_typo_name_is_one_line_listing_the_names_found():
    report = jremat.explain(mlp, "names:save=mlp_in+mlp_act", *ARGS, compile=False)
    unmatched = [m for m in report.messages if m.startswith("unmatched name")]
    assert unmatched == [
        (
            "unmatched name (names:save=mlp_in+mlp_act): save name 'mlp_act' matched nothing; "
            "the traced function tags mlp_in, mlp_out"
        )
    ]
    assert unmatched[0] in report.text().splitlines()
    by_name = {m.name: m for m in report.names}
    assert by_name["mlp_in"].count == 4 and by_name["mlp_in"].bytes == 4 * 64 * 128 * 4
    assert by_name["mlp_act"].count == 0
    # With names that all match there is no such line, and the named values are what is saved.
    report = jremat.explain(mlp, "names:save=mlp_in", *ARGS, compile=False)
    assert not report.messages
    (save,) = [d for d in report.decisions if d.decision == SAVE]
    assert save.count == 4 and save.names == ("mlp_in",) and save.where == "top level"
    assert save.bytes == 4 * 64 * 128 * 4 and report.count(RECOMPUTE) > 0


def test_no_saving_is_one_line_with_the_cause():
    report = jremat.explain(mlp, "full", *ARGS)
    assert report.count(SAVE) == 0 and report.count(RECOMPUTE) > 0
    assert report.saved_bytes == 0 < report.baseline_saved_bytes
    assert report.temp_bytes >= report.baseline_temp_bytes  # XLA kept every intermediate anyway
    (line,) = [m for m in report.messages if m.startswith("no saving")]
    assert "a single checkpoint around the whole differentiated function cannot save" in line and "\n" not in line
    assert line in report.text().splitlines()
    assert report.stack_depth is None  # a loss (a scalar) feeds no argument: no stack to measure


def residual_block(w1, w2, x):
    """One residual MLP block: its output has the shape of its argument x."""
    h = checkpoint_name(jnp.tanh(x @ w1), "mlp_in")
    return x + checkpoint_name(jnp.sin(h) @ w2, "mlp_out")


def test_a_block_is_explained_as_it_is_used_in_a_stack():
    """Explained on its own, one checkpoint around the differentiated block cannot save; the report
    gives the saving of the block as used: copies in sequence, each checkpointed."""
    report = jremat.explain(residual_block, "full", *ARGS)
    assert report.temp_bytes >= report.baseline_temp_bytes  # alone: nothing to save
    assert (report.stack_depth, report.stack_argnum) == (4, 2)
    assert report.stack_temp_bytes < report.baseline_stack_temp_bytes  # in a stack: it saves
    assert not [m for m in report.messages if m.startswith("no saving")]
    (line,) = [m for m in report.messages if m.startswith("one checkpoint (full)")]
    assert "cannot save" in line and "smaller pieces" not in line
    saved_per_block = (report.baseline_stack_temp_bytes - report.stack_temp_bytes) // 4
    assert f"({saved_per_block:,} per block): its saving where it is used in a stack" in line
    assert "of 4 in sequence (output fed back as argument 2)" in report.text()
    assert report.to_json()["stack_temp_bytes"] == report.stack_temp_bytes
    # Without remat there is no checkpoint and no stack to compare.
    none = jremat.explain(residual_block, "none", *ARGS)
    assert none.stack_depth is None and none.messages[0].startswith("no checkpoint")


def test_per_layer_checkpoints_in_a_scan_save_and_say_nothing_more():
    """The control: remat per scan iteration lowers temp memory, and no line claims otherwise."""
    report = explain_applied(
        lambda a, b, c: scanned(a, b, c, "full"), *ARGS, policy="full", baseline=lambda a, b, c: scanned(a, b, c)
    )
    assert report.checkpoints == 1 and report.temp_bytes < report.baseline_temp_bytes
    assert not report.messages
    (recompute,) = report.decisions
    assert recompute.decision == RECOMPUTE and recompute.iterations == 4
    assert recompute.where.startswith("inside scan(length=4) at ") and "scanned" in recompute.where
    assert recompute.total_bytes == 4 * recompute.bytes


def test_exclude_by_name_and_json():
    report = jremat.explain(mlp, "names_except:exclude=mlp_in", *ARGS, compile=False)
    (excluded,) = [d for d in report.decisions if d.decision == EXCLUDE]
    assert excluded.count == 4 and excluded.names == ("mlp_in",)
    assert report.count(SAVE) > 0
    data = json.loads(json.dumps(report.to_json()))
    assert data["policy"] == "names_except:exclude=mlp_in" and data["names_found"] == ["mlp_in", "mlp_out"]
    # Saved values, the excluded ones, and (recomputed) unnamed stand-ins holding the same data.
    assert {SAVE, EXCLUDE} <= {d["decision"] for d in data["decisions"]} <= {SAVE, EXCLUDE, RECOMPUTE}


def test_policies_that_do_nothing_or_cannot_apply_say_so():
    none = jremat.explain(mlp, "none", *ARGS, compile=False)
    assert none.checkpoints == 0 and none.messages == (
        "no checkpoint (none): the policy adds no checkpoint to the traced function; the policy keeps every value",
    )
    with pytest.raises(ValueError, match="not on a single function"):
        jremat.explain(mlp, "nested", *ARGS, compile=False)
    with pytest.raises(ValueError, match="unknown policy 'fulll'"):
        jremat.explain(mlp, "fulll", *ARGS)
    with pytest.raises(ValueError, match="unknown decision"):
        none.count("keep")


def test_selective_says_how_it_found_the_attention_core():
    def attention(wq, x):
        q = x @ wq
        probs = jax.nn.softmax(q @ x.T, axis=-1)
        return jnp.sum(jnp.tanh(probs @ x) ** 2)

    structs = (jax.ShapeDtypeStruct((8, 8), jnp.float32), jax.ShapeDtypeStruct((16, 8), jnp.float32))
    untagged = jremat.explain(attention, "selective", *structs, compile=False)
    assert [line.split(": ", 1)[1].split(" (")[0] for line in untagged.matched] == ["attention core found by structure"]
    assert "matched: 1 checkpoint (top level): attention core found by structure" in untagged.text()
    assert untagged.to_json()["matched"] == list(untagged.matched)

    def tagged(wq, x):
        q, k, v = (checkpoint_name(t, n) for t, n in ((x @ wq, "q"), (x, "k"), (x, "v")))
        return jnp.sum(jnp.tanh(checkpoint_name(jax.nn.softmax(q @ k.T, axis=-1) @ v, "attn_context")) ** 2)

    assert "attention core found by tag" in jremat.explain(tagged, "selective", *structs, compile=False).matched[0]
    no_core = jremat.explain(mlp, "selective", *ARGS, compile=False)
    assert any("no attention core" in m for m in no_core.messages)


def test_selective_on_a_layer_stack_says_per_checkpoint_how_it_matched():
    """Per-layer checkpoints under scan: one line with their count and place; the model's own
    checkpoints without attention are not listed once one matched."""

    def layer(x, w):
        q = x @ w
        probs = jax.nn.softmax(q @ x.T, axis=-1)
        return jnp.tanh(probs @ x), None

    def model(w, x):
        body = jremat.checkpoint(layer, "selective", prevent_cse=False)
        other = jremat.checkpoint(jnp.tanh, "full")  # a checkpoint of the model's own, no attention
        return jnp.sum(other(jax.lax.scan(lambda h, _: body(h, w), x, None, length=3)[0]))

    structs = (jax.ShapeDtypeStruct((8, 8), jnp.float32), jax.ShapeDtypeStruct((16, 8), jnp.float32))
    report = explain_applied(model, *structs, policy="selective", compile=False)
    assert len(report.matched) == 1 and report.matched[0].startswith("1 checkpoint (inside scan(length=3)")
    assert "attention core found by structure" in report.matched[0]


def test_a_policy_that_keeps_more_than_none_is_said_to():
    remat_mlp = jremat.checkpoint(mlp, "full")
    more = explain_applied(
        remat_mlp, *ARGS, policy="full", baseline=mlp, temp_bytes=2_000_000, baseline_temp_bytes=1_000_000
    )
    assert any(m.startswith("more than none (full): compiled temp") and "2,000,000" in m for m in more.messages)
    less = explain_applied(remat_mlp, *ARGS, policy="full", baseline=mlp, temp_bytes=1, baseline_temp_bytes=1_000_000)
    assert not any(m.startswith("more than none") for m in less.messages)


def test_a_stack_feeds_the_output_back_as_activations_not_as_parameters():
    """A square block whose weight has the activations' shape: the stack feeds the output back as x
    (argument 1), never as the weight named in param_argnums, whatever comes first."""
    w, x = jnp.eye(16) * 0.1, jnp.ones((16, 16))
    report = jremat.explain(lambda w, x: x + jnp.tanh(jnp.sin(x @ w) @ w), "full", w, x, param_argnums=(0,))
    assert report.stack_argnum == 1
    # Without param_argnums both arguments qualify: the first is taken.
    assert jremat.explain(lambda w, x: x + jnp.tanh(jnp.sin(x @ w) @ w), "full", w, x).stack_argnum == 0
    # With the only matching argument a parameter, there is no stack to measure.
    alone = jremat.explain(lambda w, b: jnp.tanh(w) + b.sum(), "full", w, jnp.ones(3), param_argnums=(0,))
    assert alone.stack_depth is None
