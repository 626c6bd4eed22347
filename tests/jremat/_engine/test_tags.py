"""jremat's tag protocol and the one reader of a policy callback's answer (``jremat._engine.tags``)."""

import dataclasses
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import Offloadable, Recompute, Saveable

import jremat
from jremat._apply.policy import CallbackPolicy
from jremat._engine import tags as _tags
from tests.conftest import saved_residuals


def sin_then_matmul(w, x):
    """One ``sin`` whose output the backward pass of the matmul after it reads."""
    return jnp.sum(jnp.sin(x @ w) @ w)


W, X = jnp.eye(3) * 0.5, jnp.ones((2, 3))


def keep_sin_answering(answer):
    """A callback that answers ``answer`` for ``sin`` and ``False`` for every other equation."""
    return CallbackPolicy(lambda prim, *avals, **params: answer if prim.name == "sin" else False)


def explained_saved_bytes(policy) -> int:
    explanation = jremat.explain(sin_then_matmul, policy, W, X, compile=False)
    return sum(d.bytes for d in explanation.decisions if d.decision == "save")


def run_saved_activation_bytes(policy) -> int:
    """Bytes of what running the policy keeps for the backward pass, the inputs left out."""
    kept = saved_residuals(lambda w: policy.wrap(sin_then_matmul)(w, X), W)
    return sum(
        aval.size * aval.dtype.itemsize
        for aval, why in kept
        if not why.startswith(("from the argument", "from a constant"))
    )


@pytest.mark.parametrize("answer", [True, Saveable], ids=["True", "Saveable"])
def test_explain_describes_a_saving_answer_as_it_runs(remat_engine, answer):
    policy = keep_sin_answering(answer)
    assert explained_saved_bytes(policy) == run_saved_activation_bytes(policy) == 2 * 3 * 4
    nothing = keep_sin_answering(False)
    assert explained_saved_bytes(nothing) == run_saved_activation_bytes(nothing) == 0


@pytest.mark.parametrize("answer", [1, "save", np.True_, None], ids=["int", "str", "numpy_bool", "None"])
def test_an_answer_jax_refuses_is_refused_alike_by_explain_and_by_the_run(remat_engine, answer):
    """The classic engine refuses a truthy non-bool; the remat3 lowering and explain refuse it too,
    so neither describes or runs a program the other does not."""
    policy = keep_sin_answering(answer)
    with pytest.raises(TypeError, match="remat policy"):
        run_saved_activation_bytes(policy)
    with pytest.raises(TypeError, match="a remat policy callback returned .* for sin; valid answers: True"):
        jremat.explain(sin_then_matmul, policy, W, X, compile=False)


def test_callback_decision_reads_every_answer_jax_accepts():
    assert _tags.callback_decision(True) == _tags.callback_decision(Saveable) == _tags.SAVE
    assert _tags.callback_decision(False) == _tags.callback_decision(Recompute) == _tags.RECOMPUTE
    assert _tags.callback_decision(Offloadable("device", "pinned_host")) == _tags.OFFLOAD
    with pytest.raises(TypeError, match="did you return the class Offloadable"):
        _tags.callback_decision(Offloadable)


def test_tags_are_recognised_and_user_names_are_not():
    prefix = _tags.new_prefix()
    tag = _tags.equation_tag(prefix, 12)
    names = [*_tags.output_names(tag, 1), *_tags.output_names(tag, 2), "mlp_out", "jremat", "jremat7/x"]
    assert names[:3] == [tag, f"{tag}.0", f"{tag}.1"]
    assert [_tags.is_internal(n) for n in names] == [True, True, True, False, False, False]
    assert _tags.user_names(names) == ["mlp_out", "jremat", "jremat7/x"]


def test_prefixes_are_unique_across_threads():
    minted: list[str] = []

    def mint():
        minted.extend(_tags.new_prefix() for _ in range(200))

    threads = [threading.Thread(target=mint) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(minted)) == len(minted) == 800


DotsSaveable = type(jax.checkpoint_policies.dots_saveable)


@dataclasses.dataclass(frozen=True)
class DotsAndSin(DotsSaveable):
    """A user's subclass of JAX's dots policy that also keeps ``sin``: remat3 would ask it about
    matmuls only, so jremat must lower it as a callback for its ``sin`` to be kept."""

    def __call__(self, prim, *avals, **params):
        return prim.name == "sin" or DotsSaveable.__call__(self, prim, *avals, **params)


def test_a_subclass_of_a_jax_policy_keeps_what_it_answers_and_explain_says_so(remat_engine):
    policy = CallbackPolicy(DotsAndSin(only_if_no_batch_dims=False))
    dots_only = CallbackPolicy(jax.checkpoint_policies.dots_saveable)
    # The run keeps x @ w and sin(x @ w), two [2, 3] float32 values, under either engine.
    assert run_saved_activation_bytes(policy) == 2 * (2 * 3 * 4)
    # explain also counts the last matmul's output, which the backward pass never reads; what it
    # says the subclass keeps beyond the dots policy is what the run keeps beyond it: sin's output.
    extra = 2 * 3 * 4
    assert explained_saved_bytes(policy) - explained_saved_bytes(dots_only) == extra
    assert run_saved_activation_bytes(policy) - run_saved_activation_bytes(dots_only) == extra
