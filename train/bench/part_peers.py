"""The ``peers`` part (:data:`PEERS`): jremat next to ``jax.checkpoint``, ``nnx.remat``, Linen ``nn.remat`` /
``nn.remat_scan`` on the block-dominated model, blocks only (the programs: :mod:`train.bench.peers`)."""

from __future__ import annotations

from collections.abc import Sequence

from jremat import format_bytes
from jremat.train.bench import peers
from jremat.train.bench.config import BenchConfig
from jremat.train.bench.harness import gpt_program, log, measure, measured_ratios
from jremat.train.bench.markdown import ABSOLUTE_HEADER, absolute, image, precision, quartiles, ratio, table
from jremat.train.bench.part import Part, Target
from jremat.train.bench.rows import ROW_COLUMNS, TIMED_COLUMNS
from jremat.train.bench.timed import timed_fields


def run_peers(config: BenchConfig, policies: Sequence[str]) -> list[dict]:
    """jremat next to ``jax.checkpoint``, ``nnx.remat``, Linen ``nn.remat`` / ``nn.remat_scan`` (blocks only)."""
    cfg, batch = config.block_model(), config.block_batch
    ours = {
        "none": cfg.replace(remat_policy="none"),
        "full": cfg.replace(remat_policy="full"),
        "full (unrolled)": cfg.replace(remat_policy="full", scan_layers=False),
        "dots_no_batch": cfg.replace(remat_policy="dots_no_batch"),
    }
    programs = [gpt_program(label, c, batch) for label, c in ours.items()]
    programs.append(peers.linen_program("linen (no remat)", cfg, batch, "plain"))
    compared = {"linen (no remat)": "none"}
    for spec, program in peers.peer_programs(cfg, batch, gpt_program):
        programs.append(program)
        compared[program.label] = spec
    log(f"[peers] {len(programs)} programs at batch {batch}")
    measured = measure(programs, steps=config.time_steps, rounds=config.time_rounds, seed=config.seed)
    ratios = measured_ratios(measured, "none")
    base = measured["none"]
    rows = []
    for program in programs:
        m = measured[program.label]
        rows.append(
            PEERS.row(
                program.label,
                cfg,
                batch,
                cfg.max_seq_len,
                model="block-dominated",
                scope="blocks",
                compared_with=compared.get(program.label, ""),
                hlo_fingerprint=m.hlo_fingerprint,
                **timed_fields(m, base, ratios[program.label], config.time_steps, cfg, batch, cfg.max_seq_len),
            )
        )
    return rows


WORSE_NOTE = (
    "Where a peer is smaller or faster, jremat is worse on this model and shape; the peers table gives peak, "
    "temp, step time and compile time side by side."
)


def peers_targets(rows: list[dict]) -> list[Target]:
    """Per peer: its jremat counterpart's peak no larger, and its time within 5% (or the same compiled program)."""
    out = []
    ours = {r["policy"]: r for r in rows if not r["compared_with"]}
    for r in rows:
        mine = ours.get(r["compared_with"])
        if mine is None or r["compared_with"] == "none":
            continue
        same = bool(mine.get("hlo_fingerprint")) and mine.get("hlo_fingerprint") == r.get("hlo_fingerprint")
        ok = mine["peak_bytes"] <= r["peak_bytes"] and (
            same or mine["time_ratio_vs_none"] <= 1.05 * r["time_ratio_vs_none"]
        )
        out.append(
            Target(
                f"Peer {r['policy']}: jremat {r['compared_with']} peak <= it and time within 5%",
                f"peak {format_bytes(mine['peak_bytes'])} vs {format_bytes(r['peak_bytes'])}; time "
                f"{ratio(mine['time_ratio_vs_none'])} vs {ratio(r['time_ratio_vs_none'])}"
                + ("; the same compiled program (equal HLO fingerprints): the difference is noise" if same else ""),
                ok,
                WORSE_NOTE,
            )
        )
    return out


def peers_tables(rows: list[dict], plots: Sequence[str], plot_dir: str) -> list[str]:
    """Every program beside its jremat counterpart: peak, temp, time ratio, compile time, compiled HLO hash."""
    r0 = rows[0]
    lines = [
        f"## Peers: block-dominated model, batch {r0['batch_size']} x {r0['seq_len']}, {precision(r0)}, "
        "Adam step, blocks only, dropout 0",
        "",
    ]
    lines += table(
        (
            "program",
            "jremat counterpart",
            "peak",
            "temp",
            "time / jremat none (quartiles)",
            "FLOPs bound",
            "compile s",
            *ABSOLUTE_HEADER,
            "compiled HLO",
        ),
        [
            (
                r["policy"],
                r["compared_with"] or "(jremat)",
                format_bytes(r["peak_bytes"]),
                format_bytes(r["temp_bytes"]),
                quartiles(r),
                ratio(r["flops_bound"]),
                f"{r['compile_s']:.1f}",
                *absolute(r),
                f"`{r['hlo_fingerprint']}`" if r.get("hlo_fingerprint") else "",
            )
            for r in rows
        ],
    )
    lines += [
        "",
        "`compiled HLO`: a hash of the optimized HLO without metadata; rows with the same hash execute the same "
        "program, so their time ratios differ by the machine's noise alone.",
        "",
    ]
    return lines + image("peers.png", plots, plot_dir)


PEERS = Part(
    "peers", run_peers, (*ROW_COLUMNS, "compared_with", *TIMED_COLUMNS, "hlo_fingerprint"), peers_targets, peers_tables
)
