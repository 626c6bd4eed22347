"""The 8-device checks of expert parallelism, run in a subprocess by tests/train/test_moe_mesh.py.

``XLA_FLAGS=--xla_force_host_platform_device_count=8`` must be set before JAX starts, so these run
in their own process: ``python -m tests.train.moe_mesh_checks [CHECK ...]`` prints one JSON object
with the measured figures (the test asserts on them). Checks: ``grads``, ``drops`` (default: all).
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
import numpy as np
from flax import nnx

import jremat
from jremat.models import cross_entropy_loss, preset
from jremat.train import sharded_steps as steps
from jremat.train import sharding as sh
from jremat.train import step as step_lib

jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_default_matmul_precision", "highest")

BATCH, SEQ, EXPERTS, TOP_K = 8, 16, 8, 2
#: ``(mesh, policy)`` pairs of the gradient check: experts over 4 devices beside data parallelism, over
#: 4 beside FSDP (the experts' weights split over both), and over all 8.
MESHES = (("data=2,expert=4", "full"), ("fsdp=2,expert=4", "names:save=moe_hidden"), ("expert=8", "none"))


def _config(**changes):
    """The tiny MoE model; by default each device's slots hold all its tokens (capacity factor
    experts / top-k: ``capacity = tokens``), so no assignment is ever dropped."""
    base = dict(attn_dropout=0.5, resid_dropout=0.5, max_seq_len=SEQ, remat_policy="none")
    base |= dict(moe_experts=EXPERTS, moe_top_k=TOP_K, moe_capacity_factor=EXPERTS / TOP_K)
    return preset("tiny", **(base | changes))


def _batch(cfg, seed=1):
    rng = np.random.RandomState(seed)
    tokens = rng.randint(0, cfg.vocab_size, (BATCH, SEQ)).astype(np.int32)
    return tokens, np.roll(tokens, -1, axis=1)


def _max_rel(tree, reference) -> float:
    """max |a - b| over all leaves / max |b| over all leaves (one global scale, as in conftest)."""
    diffs = [
        float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
        for a, b in zip(jax.tree.leaves(tree), jax.tree.leaves(reference))
    ]
    return max(diffs) / max(float(np.max(np.abs(np.asarray(b)))) for b in jax.tree.leaves(reference))


def _single(cfg, params, tokens, targets, key):
    """Loss and gradients of the dropless model on one device."""
    graphdef, _ = step_lib.init_params(cfg, 0)
    loss = lambda p: cross_entropy_loss(nnx.merge(graphdef, p), tokens, targets, key)
    return jax.jit(jax.value_and_grad(loss))(params)


def _sharded(cfg, spec, params, tokens, targets, key):
    """Loss, gradients and the compiled collectives of the sharded gradient step on mesh ``spec``."""
    mesh = sh.mesh_from_flag(spec)
    graphdef, _ = steps.abstract_params(cfg, mesh)
    sharded = steps.shard_params(params, mesh)
    grad_fn = steps.make_grad_fn(graphdef, mesh, sharded)
    args = (sharded, sh.shard_batch(mesh, tokens), sh.shard_batch(mesh, targets), key)
    collectives = jremat.compiled_collectives_report(grad_fn.lower(*args).compile())
    loss, grads = grad_fn(*args)
    return loss, grads, collectives


def check_grads() -> dict:
    """Loss and gradients under expert parallelism (:data:`MESHES`) vs the dropless model on one device."""
    cfg = _config()
    _, params = step_lib.init_params(cfg, 0)
    tokens, targets = _batch(cfg)
    key = jax.random.key(7)
    loss0, grads0 = _single(cfg, params, tokens, targets, key)
    out = {"loss_single": float(loss0)}
    for spec, policy in MESHES:
        loss, grads, collectives = _sharded(cfg.replace(remat_policy=policy), spec, params, tokens, targets, key)
        moe_grads = [g for path, g in jax.tree_util.tree_leaves_with_path(grads) if "moe" in jax.tree_util.keystr(path)]
        out[spec] = {
            "policy": policy,
            "loss_sharded": float(loss),
            "grad_max_rel_diff": _max_rel(grads, grads0),
            "expert_grad_specs": sorted({str(g.sharding.spec) for g in moe_grads}),
            "all_to_all": collectives.count("all-to-all"),
        }
    return out


def check_drops() -> dict:
    """A capacity below the routing's need drops assignments: the loss moves away from the dropless one."""
    small = _config(moe_capacity_factor=0.25)
    _, params = step_lib.init_params(small, 0)
    tokens, targets = _batch(small)
    key = jax.random.key(7)
    loss0, _ = _single(small, params, tokens, targets, key)
    loss, _, _ = _sharded(small, "data=2,expert=4", params, tokens, targets, key)
    return {"loss_single": float(loss0), "loss_sharded": float(loss)}


CHECKS = {"grads": check_grads, "drops": check_drops}

if __name__ == "__main__":
    sys.exit(run_checks(CHECKS, sys.argv[1:]))
