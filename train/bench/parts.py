"""The bench's parts: each is a function ``(config, policies) -> rows``, listed in :data:`PART_FUNCTIONS`.

Rows are dicts with the columns :data:`CSV_COLUMNS` ("" where a column does not apply).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import jax

from jremat.fit import largest_fitting
from jremat.models import PRESETS, ModelConfig
from jremat.models.config import FUSED_ATTENTIONS
from jremat.models.policy_memory import policy_memory
from jremat.models.programs import loss_program
from jremat.train.bench import flops, harness, peers
from jremat.train.bench.config import MAXBATCH_POLICIES, MEGATRON_POLICIES, BenchConfig
from jremat.train.bench.harness import (
    GIB,
    MIB,
    Measured,
    bench_peak,
    gpt_program,
    log,
    measure,
    measured_ratios,
    memory_fields,
)
from jremat.train.cli import UsageError

#: The max-batch search: compiles per policy at most, and the largest batch tried.
MAXBATCH_PROBES = 8
MAXBATCH_LIMIT = 1 << 16

CSV_COLUMNS = (
    "part",
    "model",
    "policy",
    "scope",
    "compared_with",
    "n_layers",
    "batch_size",
    "seq_len",
    "d_model",
    "d_ff",
    "vocab_size",
    "dtype",
    "attention",
    "attn_dropout",
    "head_chunks",
    "k",
    "peak_bytes",
    "temp_bytes",
    "argument_bytes",
    "output_bytes",
    "alias_bytes",
    "peak_source",
    "peak_reduction_vs_none",
    "flops",
    "xla_flops",
    "flops_bound",
    "compile_s",
    "saved_bytes_per_layer",
    "saved_per_sbh",
    "megatron_per_sbh",
    "working_set_bytes",
    "analytic_peak_bytes",
    "analytic_error",
    "budget_bytes",
    "max_batch",
    "max_batch_verified",
    "time_ratio_vs_none",
    "time_ratio_low",
    "time_ratio_high",
    "time_steps",
    "step_s",
    "tokens_per_s",
    "model_flops",
    "model_tflops_per_s",
    "mfu",
    "peak_bf16_tflops",
    "micro_batches",
    "fit_role",
    "fit_digest",
    "search_s",
    "predicted_tokens_per_s",
    "best_fitting_policy",
    "best_fitting_time_ratio",
    "hlo_fingerprint",
)


def row(part: str, policy: str, cfg: ModelConfig, batch: int, seq: int, **values) -> dict:
    """One CSV row: the shape columns of ``cfg`` plus ``values``."""
    out = {c: "" for c in CSV_COLUMNS}
    out.update(part=part, policy=policy, **row_shape(cfg, batch, seq))
    out.update(values)
    return out


def row_shape(cfg: ModelConfig, batch: int, seq: int) -> dict:
    """The shape columns of ``cfg`` at ``batch`` x ``seq``."""
    return dict(
        n_layers=cfg.n_layers,
        batch_size=batch,
        seq_len=seq,
        d_model=cfg.d_model,
        d_ff=cfg.d_ff,
        vocab_size=cfg.vocab_size,
        dtype=cfg.dtype,
        attention=cfg.attention,
        attn_dropout=cfg.attn_dropout,
        head_chunks=cfg.remat_head_chunks,
    )


def needle_config(config: BenchConfig, d_ff: int, policy: str, head_chunks: int = 0) -> ModelConfig:
    """Preset ``needle`` with ``d_ff`` and ``policy`` at block granularity, its one layer unrolled,
    under ``--dtype`` and ``--attention`` (:meth:`BenchConfig.model`).

    Unrolled, not under ``lax.scan``: XLA turns a scan of length 1 into straight-line code and
    merges the recomputation with the forward pass; unrolled layers get the cotangent tie
    (:mod:`jremat._tie`), which keeps the recomputation in the backward pass.
    """
    return config.model(PRESETS["needle"]).replace(
        d_ff=d_ff,
        remat_policy=policy,
        remat_granularity="block",
        scan_layers=False,
        remat_head_chunks=head_chunks,
    )


def needle_scopes(head_chunks: int) -> list[tuple[str, str, int]]:
    """``(scope, policy, head chunks)`` of the Needle memory figures: none, blocks only, head only, whole step."""
    scopes = [("none", "none", 0), ("blocks", "every_k:k=4", 0)]
    if head_chunks:
        scopes += [("head", "none", head_chunks), ("whole step", "every_k:k=4", head_chunks)]
    return scopes


def part_needle(config: BenchConfig, policies: Sequence[str]) -> list[dict]:
    """Needle figures 1 and 2: Adam-step peak of ``every_k:k=4`` vs ``none`` on blocks, head, whole step."""
    rows = []
    points = [("needle_batch", b, config.needle_d_ff) for b in config.needle_batches]
    points += [("needle_dff", config.needle_batch, d) for d in config.needle_d_ffs]
    for part, batch, d_ff in points:
        found = {}
        for scope, spec, chunks in needle_scopes(config.remat_head_chunks):
            cfg = needle_config(config, d_ff, spec, chunks)
            found[scope] = (cfg, harness.step_memory(cfg, batch))
        base = bench_peak(found["none"][1].memory)
        log(
            f"[{part}] batch {batch} d_ff {d_ff}: "
            + ", ".join(f"{s} {bench_peak(m.memory) / MIB:.0f} MiB" for s, (_, m) in found.items())
        )
        for scope, (cfg, m) in found.items():
            rows.append(
                row(
                    part,
                    cfg.remat_policy,
                    cfg,
                    batch,
                    cfg.max_seq_len,
                    model="needle",
                    scope=scope,
                    k=4 if cfg.remat_policy != "none" else 0,
                    flops=m.flops,
                    xla_flops=m.xla_flops,
                    compile_s=m.compile_s,
                    peak_reduction_vs_none=1 - bench_peak(m.memory) / base,
                    **memory_fields(m.memory),
                )
            )
    return rows


def device_peak_tflops() -> float | None:
    """The dense bf16 peak of the device the bench runs on (:func:`flops.peak_bf16_tflops`; ``None``: unknown)."""
    return flops.peak_bf16_tflops(jax.devices()[0].device_kind)


def _timed_fields(
    m: Measured,
    base: Measured,
    timing: tuple[float, float, float],
    time_steps: int,
    cfg: ModelConfig,
    batch: int,
    seq: int,
) -> dict:
    """The CSV columns of one timed program: FLOPs and their bound, compile time, time ratio, memory,
    and the absolute figures of its median step (:func:`flops.throughput_fields`)."""
    ratio, low, high = timing
    absolute = flops.throughput_fields(cfg, batch, seq, m.step_s, device_peak_tflops()) if m.step_s else {}
    return dict(
        flops=m.flops,
        xla_flops=m.xla_flops,
        flops_bound=m.flops / base.flops if base.flops else "",
        compile_s=m.compile_s,
        time_ratio_vs_none=ratio,
        time_ratio_low=low,
        time_ratio_high=high,
        time_steps=time_steps,
        peak_reduction_vs_none=1 - bench_peak(m.memory) / bench_peak(base.memory),
        **memory_fields(m.memory),
        **absolute,
    )


def _timed_rows(
    part: str, model: str, configs: dict[str, ModelConfig], batch: int, config: BenchConfig, **extra
) -> list[dict]:
    """Time ``configs`` (label -> model; the first is the baseline) and give one row per label."""
    programs = [gpt_program(label, cfg, batch) for label, cfg in configs.items()]
    measured = measure(programs, steps=config.time_steps, rounds=config.time_rounds, seed=config.seed)
    base = next(iter(configs))
    ratios = measured_ratios(measured, base)
    base_m = measured[base]
    rows = []
    for label, cfg in configs.items():
        m = measured[label]
        rows.append(
            row(
                part,
                label,
                cfg,
                batch,
                cfg.max_seq_len,
                model=model,
                scope="whole step" if cfg.remat_head_chunks else "blocks",
                **_timed_fields(m, base_m, ratios[label], config.time_steps, cfg, batch, cfg.max_seq_len),
                **extra.get(label, {}),
            )
        )
    return rows


def part_needle_time(config: BenchConfig, policies: Sequence[str]) -> list[dict]:
    """Needle figure 3: step time of ``every_k:k=K`` vs ``none`` (K = 0), whole step."""
    configs = {}
    for k in sorted({0, *config.needle_ks}):
        spec = "none" if k == 0 else f"every_k:k={k}"
        configs[spec] = config.whole_step(needle_config(config, config.needle_d_ff, spec), spec)
    log(f"[needle_time] timing {len(configs)} steps at batch {config.needle_time_batch}")
    extra = {spec: {"k": 0 if spec == "none" else int(spec.split("=")[1])} for spec in configs}
    return _timed_rows("needle_time", "needle", configs, config.needle_time_batch, config, **extra)


def megatron_formulas(s: int, b: int, h: int, a: int, attention: str = "explicit") -> dict[str, float]:
    """Megatron-LM's activation bytes per layer (16-bit activations), in units of ``s*b*h``.

    ``none``: ``34 + 5*a*s/h``; ``selective``: 34; ``full``: 2 (Korthikanti et al. 2022, table 2).
    The ``5*a*s/h`` term is attention's ``[s, s]`` tensors (scores, softmax, dropout mask), which
    the fused kernels (``attention`` ``cudnn``, ``blockwise``, ``pallas``) never keep, as Megatron's selective
    recompute: ``none`` is then 34. Under ``xla`` (``jax.nn.dot_product_attention`` differentiated
    by XLA, no dropout) Megatron gives no figure for ``none``, and it is left out.
    """
    out = {"none": 34 + 5 * a * s / h, "selective": 34.0, "full": 2.0}
    if attention in FUSED_ATTENTIONS:
        out["none"] = 34.0
    elif attention != "explicit":
        del out["none"]
    return out


def part_megatron(config: BenchConfig, policies: Sequence[str]) -> list[dict]:
    """Per-layer saved activations vs Megatron-LM's formulas, and the analytic peak vs the compiled one.

    The step is the gradient step of :func:`models.policy_memory.policy_memory` (what ``train.memory``
    reports and its analytic estimate models), blocks only.
    """
    b, s = config.megatron_batch, config.megatron_seq
    none_cfg = config.megatron_config("none")
    sbh = s * b * none_cfg.d_model
    formulas = megatron_formulas(s, b, none_cfg.d_model, none_cfg.n_heads, none_cfg.attention)
    rows, base = [], None
    for spec in MEGATRON_POLICIES:
        cfg = config.megatron_config(spec)
        t0 = time.perf_counter()
        r = policy_memory(cfg, b, s, baseline_step_flops=base.step_flops if base else None)
        base = base or r
        err = r.analytic_peak_bytes / r.peak_bytes - 1
        log(
            f"[megatron] {spec}: saved/layer {r.saved_bytes_per_layer / sbh:.2f} sbh, peak {r.peak_bytes / GIB:.2f} "
            f"GiB, analytic {100 * err:+.1f}% ({time.perf_counter() - t0:.1f} s)"
        )
        rows.append(
            row(
                "megatron",
                spec,
                cfg,
                b,
                s,
                model=config.megatron_preset,
                scope="blocks",
                saved_bytes_per_layer=r.saved_bytes_per_layer,
                saved_per_sbh=r.saved_bytes_per_layer / sbh,
                megatron_per_sbh=formulas.get(spec, ""),
                peak_bytes=r.peak_bytes,
                temp_bytes=r.temp_bytes,
                peak_source=r.peak_source,
                peak_reduction_vs_none=1 - r.peak_bytes / base.peak_bytes,
                flops=r.step_flops,
                flops_bound=r.step_flops / base.step_flops,
                working_set_bytes=r.working_set_bytes,
                analytic_peak_bytes=r.analytic_peak_bytes,
                analytic_error=err,
            )
        )
    return rows


def part_maxbatch(config: BenchConfig, policies: Sequence[str]) -> list[dict]:
    """Largest batch per policy (whole step) whose compiled Adam-step peak fits the budget."""
    budget = int(config.maxbatch_budget_gib * GIB)
    seq = config.maxbatch_seq
    rows = []
    for spec in MAXBATCH_POLICIES:
        cfg = config.whole_step(config.megatron_config(spec), spec)
        t0 = time.perf_counter()
        batch, verified = largest_fitting(
            lambda b, cfg=cfg: bench_peak(harness.step_memory(cfg, b, seq).memory),
            budget,
            limit=MAXBATCH_LIMIT,
            max_probes=MAXBATCH_PROBES,
        )
        log(f"[maxbatch] {spec}: {batch}{'' if verified else ' (lower bound)'} ({time.perf_counter() - t0:.1f} s)")
        fields = memory_fields(harness.step_memory(cfg, batch, seq).memory) if batch else {}
        rows.append(
            row(
                "maxbatch",
                spec,
                cfg,
                batch,
                seq,
                model=config.megatron_preset,
                scope="whole step" if cfg.remat_head_chunks else "none",
                budget_bytes=budget,
                max_batch=batch,
                max_batch_verified=verified,
                **fields,
            )
        )
    return rows


def time_models(config: BenchConfig) -> list[tuple[str, ModelConfig, int]]:
    """``(label, model, batch)`` of the ``time`` part's head- and block-dominated models."""
    return [
        (f"head-dominated ({config.time_preset})", config.time_model(), config.time_batch),
        ("block-dominated", config.block_model(), config.block_batch),
    ]


def part_time(config: BenchConfig, policies: Sequence[str]) -> list[dict]:
    """Step time, FLOPs bound, peak and compile time of every policy on a head- and a block-dominated model."""
    rows = []
    for model, cfg, batch in time_models(config):
        configs = {spec: config.whole_step(cfg, spec) for spec in dict.fromkeys(["none", *policies])}
        log(f"[time] {model}: {len(configs)} policies at batch {batch}")
        rows += _timed_rows("time", model, configs, batch, config)
    return rows


def part_peers(config: BenchConfig, policies: Sequence[str]) -> list[dict]:
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
            row(
                "peers",
                program.label,
                cfg,
                batch,
                cfg.max_seq_len,
                model="block-dominated",
                scope="blocks",
                compared_with=compared.get(program.label, ""),
                hlo_fingerprint=m.hlo_fingerprint,
                **_timed_fields(m, base, ratios[program.label], config.time_steps, cfg, batch, cfg.max_seq_len),
            )
        )
    return rows


def part_auto(config: BenchConfig, policies: Sequence[str]) -> list[dict]:
    """``auto`` at budgets between full's and none's Adam-step peak, timed against the built-ins.

    Each budget's plan is solved and verified on the step the bench measures; the built-ins and
    plans are timed in one interleaved run, and each budget's row names the fastest built-in that
    fits it. ``compile_s`` of an ``auto`` row is the planning time (solve + verification compiles).
    """
    from jremat.models.planning import plan_for_budget

    cfg, batch = config.time_model(), config.time_batch

    def peak(model_cfg: ModelConfig) -> int:
        return bench_peak(harness.step_memory(model_cfg, batch).memory)

    specs = auto_part_specs(policies)
    builtins = {spec: cfg.replace(remat_policy=spec) for spec in dict.fromkeys(["none", "full", *specs])}
    peaks = {spec: peak(c) for spec, c in builtins.items()}
    budgets = [int(peaks["full"] + f * (peaks["none"] - peaks["full"])) for f in config.auto_budget_fractions]
    plans, plan_s = {}, {}
    for budget in budgets:
        t0 = time.perf_counter()
        plan = plan_for_budget(cfg, batch, str(budget), measure_peak_bytes=peak)
        label = f"auto:budget={budget} ({plan.candidate.describe(cfg.n_layers)})"
        plans[label], plan_s[label] = plan, time.perf_counter() - t0
        log(f"[auto] budget {budget:,} B -> {plan.candidate.describe(cfg.n_layers)} ({plan_s[label]:.1f} s)")
    configs = {**builtins, **{label: plan.config for label, plan in plans.items()}}
    timed = {r["policy"]: r for r in _timed_rows("auto", config.time_preset, configs, batch, config)}
    rows = []
    for label, budget in zip(plans, budgets):
        best = min((s for s in builtins if peaks[s] <= budget), key=lambda s: timed[s]["time_ratio_vs_none"])
        rows.append(
            {
                **timed[label],
                "budget_bytes": budget,
                "compile_s": plan_s[label],
                "best_fitting_policy": best,
                "best_fitting_time_ratio": timed[best]["time_ratio_vs_none"],
            }
        )
    return rows


def part_fit(config: BenchConfig, policies: Sequence[str]) -> list[dict]:
    """The fit search (:mod:`train.fit`) at budgets between full's and none's train-step peak at
    ``--time-batch``, then every built-in at its largest fitting batch and each winner timed
    together in one session, so each winner is compared with the best built-in that fits.

    ``search_s`` is the whole search's wall time (every budget); ``tokens_per_s`` is from the
    comparison session; ``best_fitting_time_ratio`` is the winner's tokens/s over the best
    built-in's (>= 1: the winner is faster).
    """
    import jremat
    from jremat.train import fit as fit_lib

    cfg, batch = config.time_model(), config.time_batch
    seq = cfg.max_seq_len
    builder = fit_lib.GPTStepBuilder(lambda spec: config.whole_step(cfg, spec), seq, fit_lib.SEARCH_OPTIMIZER)
    peaks = {s: builder.peak_bytes(builder.config(s, batch, 1), batch, 1) for s in ("none", "full")}
    budgets = [int(peaks["full"] + f * (peaks["none"] - peaks["full"])) for f in config.fit_budget_fractions]
    log(
        f"[fit] budgets {', '.join(f'{b:,}' for b in budgets)} B (full {peaks['full']:,}, none {peaks['none']:,} at batch {batch})"
    )
    t0 = time.perf_counter()
    results = fit_lib.search(
        builder, budgets, fit_lib.FIT_POLICIES, auto=True, rounds=config.fit_rounds, progress=False
    )
    search_s = time.perf_counter() - t0
    log(
        f"[fit] searched in {search_s:.0f} s: "
        + "; ".join(f"{r.budget_bytes:,} B -> {r.winner.probe.policy} b={r.winner.probe.batch_size}" for r in results)
    )

    def builtins(result):  # every built-in at its largest fitting batch for this budget
        return [f for f in result.rows if f.origin == "search" and f.probe.policy in fit_lib.FIT_POLICIES]

    keys = list(dict.fromkeys(f.probe.key for r in results for f in [r.winner, *builtins(r)]))
    measured = jremat.measure_throughput(builder, keys, tokens_per_example=seq, rounds=config.fit_rounds)
    median = {k: statistics.median(v) for k, v in measured.items()}
    rows = []
    for r in results:
        best = max(builtins(r), key=lambda fit_row: median[fit_row.probe.key])
        for fit_row in dict.fromkeys([r.winner, *builtins(r)]):
            p = fit_row.probe
            rows.append(
                row(
                    "fit",
                    builder.describe(*p.key),
                    builder.config(*p.key),
                    p.batch_size,
                    seq,
                    model=config.time_preset,
                    micro_batches=p.micro_batches,
                    fit_role=f"winner ({fit_row.origin})" if fit_row is r.winner else "built-in",
                    fit_digest=r.digest,
                    search_s=search_s,
                    budget_bytes=r.budget_bytes,
                    peak_bytes=p.peak_bytes,
                    predicted_tokens_per_s=fit_row.predicted_tokens_per_s,
                    tokens_per_s=median[p.key],
                    time_steps=config.fit_rounds * 3,
                    best_fitting_policy=f"{best.probe.policy} b={best.probe.batch_size}",
                    best_fitting_time_ratio=median[r.winner.probe.key] / median[best.probe.key],
                )
            )
    return rows


def auto_part_specs(policies: Sequence[str]) -> list[str]:
    """The ``--policy`` specs the ``auto`` part times its plans against (beside ``none`` and ``full``)."""
    return [p for p in policies if p in MEGATRON_POLICIES] or list(policies)


def policy_models(config: BenchConfig) -> list[tuple[str, str, str, Callable[[], ModelConfig]]]:
    """``(part, model, spec, build)`` of every ``--policy`` on every model of the requested parts
    that runs it (``time``: both of its models, whole step; ``auto``: its model); ``build()``
    gives the model config under the policy."""
    out = []
    if "time" in config.parts:
        for model, cfg, _ in time_models(config):
            out += [
                ("time", model, spec, lambda cfg=cfg, spec=spec: config.whole_step(cfg, spec)) for spec in config.policy
            ]
    if "auto" in config.parts:
        cfg = config.time_model()
        out += [
            ("auto", config.time_preset, spec, lambda spec=spec: cfg.replace(remat_policy=spec))
            for spec in auto_part_specs(config.policy)
        ]
    return out


def check_policies(config: BenchConfig) -> None:
    """Check every ``--policy`` against every model of the requested parts that runs it, before any
    part runs: the model is built and its loss traced at batch 1 (nothing is compiled).

    Raises:
      UsageError: for a policy that does not apply to such a model (``nested:block=3`` on 2 layers,
        ``names:save=`` a tag the model's attention does not have).
    """
    for part, model, spec, build in policy_models(config):
        try:
            loss, args = loss_program(build(), 1)
            jax.make_jaxpr(loss)(*args)
        except ValueError as err:
            raise UsageError(f"--policy {spec!r} does not apply to the {model} model of part {part}: {err}") from None


#: Part name -> part function, in run order.
PART_FUNCTIONS: dict[str, Callable[[BenchConfig, Sequence[str]], list[dict]]] = {
    "needle": part_needle,
    "needle_time": part_needle_time,
    "megatron": part_megatron,
    "maxbatch": part_maxbatch,
    "time": part_time,
    "peers": part_peers,
    "auto": part_auto,
    "fit": part_fit,
}
