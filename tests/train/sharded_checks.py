"""The 8-device checks of train.sharding, run in a subprocess by tests/train/test_sharding.py.

``XLA_FLAGS=--xla_force_host_platform_device_count=8`` must be set before JAX starts, so these
run in their own process: ``python -m tests.train.sharded_checks [CHECK ...]`` prints one JSON
object with the measured figures (the test asserts on them). Checks: ``grads``, ``train_step``,
``sequence_memory``, ``errors`` (default: all).
"""

from __future__ import annotations

import os
import sys

from tests.compile_flags import FAST_COMPILE_XLA_FLAGS
from tests.device_checks import run_checks

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ["XLA_FLAGS"] += " " + FAST_COMPILE_XLA_FLAGS

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jremat
from jremat.models import cross_entropy_loss, preset
from jremat.train import sharded_steps as steps
from jremat.train import sharding as sh
from jremat.train import step as step_lib

jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_default_matmul_precision", "highest")

POLICIES = ("none", "full", "every_k:k=4", "selective", "full:keep_gathered=true")
BATCH, SEQ = 8, 16
SEQUENCE_MESH = "fsdp=2,tensor=2,sequence=2"


def _batch(cfg, seed=1):
    rng = np.random.RandomState(seed)
    tokens = rng.randint(0, cfg.vocab_size, (BATCH, SEQ)).astype(np.int32)
    return tokens, np.roll(tokens, -1, axis=1)


def _max_rel(tree, reference) -> float:
    """max |a - b| over all leaves / max |b| over all leaves (one global scale, as in conftest)."""
    diffs = [
        float(jnp.max(jnp.abs(np.asarray(a) - np.asarray(b))))
        for a, b in zip(jax.tree.leaves(tree), jax.tree.leaves(reference))
    ]
    scale = max(float(jnp.max(jnp.abs(b))) for b in jax.tree.leaves(reference))
    return max(diffs) / scale


def _single_grads(cfg, params, tokens, targets, key):
    graphdef, _ = step_lib.init_params(cfg, 0)

    def loss(p):
        return cross_entropy_loss(nnx.merge(graphdef, p), tokens, targets, key)

    return jax.jit(jax.value_and_grad(loss))(params)


def check_grads(spec: str = "data=4,fsdp=2") -> dict:
    """Loss and gradients sharded on ``spec``, for each policy in :data:`POLICIES`, vs one device.

    Remat changes no values, so one single-device reference (policy ``none``) serves every
    policy (and saves three compiles): each comparison covers the policy and the sharding.
    """
    mesh = sh.mesh_from_flag(spec)
    registered = set(jremat.available())
    base = preset("tiny", attn_dropout=0.5, resid_dropout=0.5, max_seq_len=SEQ, remat_policy="none")
    _, params = step_lib.init_params(base, 0)
    tokens, targets = _batch(base)
    key = jax.random.key(7)
    loss0, grads0 = _single_grads(base, params, tokens, targets, key)
    sharded = steps.shard_params(params, mesh)
    batch = sh.shard_batch(mesh, tokens), sh.shard_batch(mesh, targets)
    out = {"loss_single": float(loss0)}
    for policy in POLICIES:
        if policy.split(":")[0] not in registered:
            out[policy] = {"skipped": f"policy {policy!r} is not registered"}
            continue
        graphdef, _ = steps.abstract_params(base.replace(remat_policy=policy), mesh)
        loss1, grads1 = steps.make_grad_fn(graphdef, mesh, sharded)(sharded, *batch, key)
        out[policy] = {
            "loss_sharded": float(loss1),
            "grad_max_rel_diff": _max_rel(grads1, grads0),
            "grad_max_abs_diff": max(
                float(jnp.max(jnp.abs(np.asarray(a) - np.asarray(b))))
                for a, b in zip(jax.tree.leaves(grads1), jax.tree.leaves(grads0))
            ),
            "grad_specs": sorted({str(g.sharding.spec) for g in jax.tree.leaves(grads1)}),
        }
    # Every mesh axis at once (fsdp + tensor + sequence parallel), one policy.
    mesh3 = sh.mesh_from_flag(SEQUENCE_MESH)
    sharded3 = steps.shard_params(params, mesh3)
    graphdef, _ = steps.abstract_params(base.replace(remat_policy="full", remat_granularity="sublayer"), mesh3)
    loss3, grads3 = steps.make_grad_fn(graphdef, mesh3, sharded3)(
        sharded3, sh.shard_batch(mesh3, tokens), sh.shard_batch(mesh3, targets), key
    )
    out[SEQUENCE_MESH] = {
        "policy": "full (sublayer)",
        "loss_sharded": float(loss3),
        "grad_max_rel_diff": _max_rel(grads3, grads0),
        "grad_specs": sorted({str(g.sharding.spec) for g in jax.tree.leaves(grads3)}),
    }
    out["head_chunks"] = _head_chunk_grads(base, params, tokens, targets, key, grads0)
    return out


def _head_chunk_grads(base, params, tokens, targets, key, grads0) -> dict:
    """The loss head in 4 chunks, each device its own tokens (``models.head.ShardedHead``): on
    ``data=4,fsdp=2``, and on :data:`SEQUENCE_MESH` with the vocabulary split over ``tensor``;
    then a broken head that takes every target for one in each device's own vocabulary share."""
    from jremat.models import head as head_lib

    def run(spec, policy):
        mesh = sh.mesh_from_flag(spec)
        sharded = steps.shard_params(params, mesh)
        graphdef, _ = steps.abstract_params(base.replace(remat_policy=policy, remat_head_chunks=4), mesh)
        loss, grads = steps.make_grad_fn(graphdef, mesh, sharded)(
            sharded, sh.shard_batch(mesh, tokens), sh.shard_batch(mesh, targets), key
        )
        return {"loss_sharded": float(loss), "grad_max_rel_diff": _max_rel(grads, grads0)}

    cases = [("data=4,fsdp=2", "full"), ("data=4,fsdp=2", "full:keep_collectives=true")]
    cases.append((SEQUENCE_MESH, "full:keep_collectives=true"))
    out = {f"{spec} {policy}": run(spec, policy) for spec, policy in cases}
    exact = head_lib.token_statistics
    head_lib.token_statistics = lambda logits, targets: exact(logits, targets % logits.shape[-1])
    try:
        out["broken"] = run(SEQUENCE_MESH, "full")
    finally:
        head_lib.token_statistics = exact
    return out


def check_train_step() -> dict:
    """Two optimizer steps of the sharded train step (data=4,fsdp=2) vs train.step's single-device step.

    SGD with momentum, so the updated parameters are a linear function of the gradients; the
    AdamW state of train.step is checked for its shardings (moments like their parameters).
    """
    mesh = sh.mesh_from_flag("data=4,fsdp=2")
    cfg = preset("tiny", attn_dropout=0.5, resid_dropout=0.5, max_seq_len=SEQ, remat_policy="full")
    tx = optax.sgd(0.5, momentum=0.9)
    graphdef0, params0 = step_lib.init_params(cfg, 0)
    graphdef, params = steps.init_params(cfg, 0, mesh)
    init_diff = _max_rel(params, params0)
    params = steps.shard_params(params0, mesh)  # identical starting values
    opt0, opt = tx.init(params0), steps.init_opt_state(tx, params, mesh)
    single = step_lib.make_train_step(graphdef0, tx)
    # The AOT-compiled pair, as train.ptb uses it (uncommitted key, batches from shard_batch).
    sharded, sharded_eval = steps.compile_steps(graphdef, tx, mesh, params, opt, BATCH, SEQ)
    losses0, losses1 = [], []
    for step in range(2):
        tokens, targets = _batch(cfg, seed=10 + step)
        key = step_lib.dropout_key(jax.random.key(0), step, 0)
        params0, opt0, l0 = single(params0, opt0, tokens, targets, key)
        params, opt, l1 = sharded(params, opt, sh.shard_batch(mesh, tokens), sh.shard_batch(mesh, targets), key)
        losses0.append(float(l0))
        losses1.append(float(l1))
    tokens, targets = _batch(cfg, seed=20)
    eval0 = float(step_lib.make_eval_step(graphdef0)(params0, tokens, targets))
    eval1 = float(sharded_eval(params, sh.shard_batch(mesh, tokens), sh.shard_batch(mesh, targets)))
    adamw = step_lib.OptimizerConfig(1e-3, 0, 10, 1.0, 0.01, 2).build()
    adam_state = steps.init_opt_state(adamw, params, mesh)
    param_specs = {sh.path_names(p): leaf.sharding.spec for p, leaf in jax.tree_util.tree_leaves_with_path(params)}
    mismatched, matched = [], 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(adam_state):
        names = sh.path_names(path)
        for pnames, pspec in param_specs.items():
            if names[-len(pnames) :] == pnames and len(names) > len(pnames):
                matched += 1
                if leaf.sharding.spec != pspec:
                    mismatched.append(".".join(names))
    return {
        "losses_single": losses0,
        "losses_sharded": losses1,
        "params_max_rel_diff": _max_rel(params, params0),
        "eval_single": eval0,
        "eval_sharded": eval1,
        "init_max_rel_diff": init_diff,
        "fsdp_sharded_params": sum("fsdp" in str(p.sharding.spec) for p in jax.tree.leaves(params)),
        "n_params": len(jax.tree.leaves(params)),
        "param_shard_bytes": sum(p.addressable_shards[0].data.nbytes for p in jax.tree.leaves(params)),
        "param_bytes": sum(p.nbytes for p in jax.tree.leaves(params)),
        "opt_moments_matched": matched,
        "opt_moments_mismatched": mismatched,
    }


def check_sequence_memory() -> dict:
    """Per-device temp bytes of forward+backward (policy ``none``) with and without ``sequence=2``.

    Same per-device batch both ways: ``data=4`` over 4 devices vs ``data=4,sequence=2`` over 8.
    With policy ``none`` the temporaries are dominated by the saved activations.
    """
    devices = jax.devices()
    cfg = preset("tiny", max_seq_len=64, remat_policy="none")
    without = steps.sharded_step_memory(cfg, sh.make_mesh(sh.parse_mesh("data=4"), devices[:4]), 16, 64)
    with_sp = steps.sharded_step_memory(cfg, sh.make_mesh(sh.parse_mesh("data=4,sequence=2"), devices), 16, 64)
    return {
        "without": dataclass_dict(without),
        "with_sequence_2": dataclass_dict(with_sp),
        "temp_ratio": with_sp.temp / without.temp,
    }


def dataclass_dict(memory: steps.DeviceMemory) -> dict:
    """The fields of a :class:`train.sharded_steps.DeviceMemory` plus its peak."""
    return {
        "temp": memory.temp,
        "argument": memory.argument,
        "output": memory.output,
        "alias": memory.alias,
        "peak": memory.peak,
    }


def check_errors() -> dict:
    """The ValueError messages of bad meshes and batches on 8 devices."""
    messages = {}
    cases = {
        "product": lambda: sh.mesh_from_flag("data=4,fsdp=4"),
        "too_few": lambda: sh.mesh_from_flag("data=2"),
        "unknown_axis": lambda: sh.mesh_from_flag("data=4,model=2"),
        "batch": lambda: sh.shard_batch(sh.mesh_from_flag("data=4,fsdp=2"), np.zeros((6, 16), np.int32)),
        "seq": lambda: sh.check_batch(sh.mesh_from_flag("data=4,sequence=2"), 8, 15),
        "memory_batch": lambda: steps.sharded_step_memory(preset("tiny"), sh.mesh_from_flag("data=8"), 4, 16),
    }
    for name, fn in cases.items():
        try:
            fn()
        except ValueError as err:
            messages[name] = str(err)
        else:
            messages[name] = None
    return messages


CHECKS = {
    "grads": check_grads,
    "train_step": check_train_step,
    "sequence_memory": check_sequence_memory,
    "errors": check_errors,
}


if __name__ == "__main__":
    sys.exit(run_checks(CHECKS, sys.argv[1:]))
