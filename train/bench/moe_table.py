"""``python -m train.bench.moe_table``: every policy on the reference model's mixture-of-experts option,
beside the peers users write for it, compile-only (nothing runs): one markdown table per preset.

Per row: the compiled peak and temp of the Adam step (blocks checkpointed, the head whole), the
recompute as a share of ``none``'s step FLOPs (:func:`jremat.program_flops` of the traced step,
recomputation included), and the grouped matmuls (``jax.lax.ragged_dot``) the step runs
(:func:`jremat.kernels.count_grouped_matmuls`, a scanned layer once per layer). The peers are
``jax.checkpoint`` around the same block with ``dots_saveable``, with
``dots_with_no_batch_dims_saveable``, and with ``save_only_these_names`` of a hand list as MaxText
users write one. Then the targets of docs/moe.md, each with its measured figure.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import jax

from jremat import compiled_memory_report, format_bytes, jaxpr_flops, names, saved_residuals_report
from jremat.kernels import count_grouped_matmuls
from jremat.models import ModelConfig, preset
from jremat.train.bench.harness import bench_peak, gpt_program
from jremat.train.bench.peers import JaxCheckpointPeer
from jremat.train.programs import loss_program
from jremat.train.usage import EXIT_USAGE, OneLineErrorParser, UsageError

#: ``selective`` recomputes the attention core and the experts' activation; ``modules=moe_act`` the latter only.
SELECTIVE_VARIANTS = ("selective", "selective:modules=moe_act")
POLICIES = ("none", "full", "dots", "dots_no_batch", "skip_cheap", *SELECTIVE_VARIANTS, "every_k:k=4")
#: What a MaxText user lists by hand for an MoE block: the projections and the experts' matmul outputs.
HAND_LIST = (
    names.QUERY,
    names.KEY,
    names.VALUE,
    names.ATTN_OUT,
    names.MOE_HIDDEN_PRE_ACT,
    names.MOE_HIDDEN_UP,
    names.MOE_EXPERT_OUT,
)
PRESETS = ("tiny", "small")
BATCH = 8


def peers() -> dict[str, JaxCheckpointPeer]:
    """The peers by label: ``jax.checkpoint`` with JAX's dots policies and with a hand list of names."""
    cp = jax.checkpoint_policies
    return {
        "jax.checkpoint(dots_saveable)": JaxCheckpointPeer(cp.dots_saveable, "jax.checkpoint(dots_saveable)"),
        "jax.checkpoint(dots_with_no_batch_dims_saveable)": JaxCheckpointPeer(
            cp.dots_with_no_batch_dims_saveable, "jax.checkpoint(dots_with_no_batch_dims_saveable)"
        ),
        "jax.checkpoint(save_only_these_names(hand list))": JaxCheckpointPeer(
            cp.save_only_these_names(*HAND_LIST), "jax.checkpoint(save_only_these_names(hand list))"
        ),
    }


def measure(cfg: ModelConfig, batch: int) -> dict:
    """Compile-only figures of ``GPT(cfg)``'s Adam step: peak and temp bytes, traced FLOPs, grouped matmuls."""
    step, args = gpt_program("", cfg, batch).build()
    traced = step.trace(*args)
    compiled = traced.lower().compile()
    memory = compiled_memory_report(compiled)
    loss, loss_args = loss_program(cfg, batch, cfg.max_seq_len)
    residuals = saved_residuals_report(loss, *loss_args, param_argnums=(0,))
    return dict(
        peak_bytes=bench_peak(memory),
        temp_bytes=memory.temp_bytes,
        residual_bytes=residuals.computed_bytes,
        flops=jaxpr_flops(traced.jaxpr),
        grouped_matmuls=count_grouped_matmuls(traced.jaxpr),
    )


def rows_for(name: str, experts: int, top_k: int, batch: int) -> tuple[ModelConfig, list[dict]]:
    """Every policy and peer on the MoE ``name`` preset: ``(config, rows)``, ``none`` first."""
    base = preset(name, moe_experts=experts, moe_top_k=top_k, attn_dropout=0.0, resid_dropout=0.0)
    rows = []
    for label, policy in [(p, p) for p in POLICIES] + list(peers().items()):
        measured = measure(base.replace(remat_policy=policy), batch)
        rows.append(dict(policy=label, peer=label not in POLICIES, **measured))
        print(f"[moe] {name}: {label} done", file=sys.stderr, flush=True)
    return base, rows


def activation_bytes(cfg: ModelConfig, batch: int) -> int:
    """The experts' activation outputs of the whole step: one float per token, routed copy and hidden unit, per layer."""
    return cfg.n_layers * batch * cfg.max_seq_len * cfg.moe_top_k * cfg.d_ff * 4


def markdown(name: str, cfg: ModelConfig, batch: int, rows: Sequence[dict]) -> list[str]:
    """The table of one preset and its targets."""
    none = rows[0]
    lines = [
        f"### `{name}` with {cfg.moe_experts} experts, top-{cfg.moe_top_k}: {cfg.n_layers} layers, d_model "
        f"{cfg.d_model}, d_ff {cfg.d_ff}, batch {batch} x {cfg.max_seq_len}, float32, Adam step, blocks checkpointed",
        "",
        "| policy | compiled peak | temp | saved residuals | recompute (share of step FLOPs) | grouped matmuls run |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        share = (r["flops"] - none["flops"]) / none["flops"]
        lines.append(
            f"| {'peer: ' if r['peer'] else ''}`{r['policy']}` | {format_bytes(r['peak_bytes'])} | "
            f"{format_bytes(r['temp_bytes'])} | {format_bytes(r['residual_bytes'])} | {share:+.2%} | "
            f"{r['grouped_matmuls']} |"
        )
    by = {r["policy"]: r for r in rows}
    kept = [p for p in ("dots", "skip_cheap") if by[p]["grouped_matmuls"] == none["grouped_matmuls"]]
    lines += [
        "",
        f"- `dots` and `skip_cheap` re-run no grouped matmul: {'met' if len(kept) == 2 else 'MISSED'} "
        f"(none runs {none['grouped_matmuls']}; dots {by['dots']['grouped_matmuls']}, skip_cheap "
        f"{by['skip_cheap']['grouped_matmuls']}).",
    ]
    for label in SELECTIVE_VARIANTS:
        if label in by:
            lines += _selective_targets(label, by[label], none, activation_bytes(cfg, batch))
    return lines + [""]


def _selective_targets(label: str, row: dict, none: dict, activation: int) -> list[str]:
    """The two targets of one ``selective`` variant: its recompute share and its peak's saving."""
    share = (row["flops"] - none["flops"]) / none["flops"]
    saving = none["peak_bytes"] - row["peak_bytes"]
    residual_saving = none["residual_bytes"] - row["residual_bytes"]
    return [
        f"- `{label}`'s recompute <= 2% of the step's FLOPs: {'met' if share <= 0.02 else 'MISSED'} ({share:.2%}).",
        f"- `{label}`'s peak below `none`'s by at least the experts' activation outputs "
        f"({format_bytes(activation)}): {'met' if saving >= activation else 'MISSED'} "
        f"(it is {format_bytes(saving)} below; the saved residuals, {format_bytes(residual_saving)} less, fall by "
        f"{residual_saving / activation:.2f} x the activation outputs).",
    ]


def main(argv: Sequence[str] | None = None) -> int:
    """Print the tables (markdown) for ``--preset`` (default: tiny and small) with 8 experts, top-2."""
    parser = OneLineErrorParser(prog="python -m train.bench.moe_table", description=__doc__.split("\n")[0])
    parser.add_argument("--preset", action="append", choices=PRESETS, help="preset (repeat; default: tiny, small)")
    parser.add_argument("--moe-experts", type=int, default=8)
    parser.add_argument("--moe-top-k", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=BATCH)
    try:
        args = parser.parse_args(argv)
        if args.moe_experts < 1 or not 1 <= args.moe_top_k <= args.moe_experts or args.batch_size < 1:
            raise UsageError(
                f"need --moe-experts >= 1, 1 <= --moe-top-k <= --moe-experts and --batch-size >= 1; got "
                f"{args.moe_experts}, {args.moe_top_k}, {args.batch_size}"
            )
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USAGE
    lines = [f"JAX {jax.__version__}, {jax.devices()[0].device_kind}, compile-only", ""]
    for name in args.preset or PRESETS:
        cfg, rows = rows_for(name, args.moe_experts, args.moe_top_k, args.batch_size)
        lines += markdown(name, cfg, args.batch_size, rows)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
