"""The PTB training CLI: end-to-end training, exact resume, Ctrl-C, NaN stop, determinism, bad input."""

import json
import math
import os
import signal
import subprocess
import sys
import time

import jax.numpy as jnp
import numpy as np
import pytest

from jremat.models import preset
from jremat.train import data as data_lib
from jremat.train import ptb
from jremat.train.config import TrainConfig
from jremat.train.metrics import read_rows
from jremat.train.state_files import LOCK_NAME, StateFiles, pack_state, state_meta
from jremat.train.step import OptimizerConfig, init_params
from tests.conftest import REPO

STEPS = 20


def run_args(data_dir):
    """A short tiny-preset run with dropout on (tiny's train defaults: batch 4 x 16)."""
    flags = f"--preset tiny --steps {STEPS} --eval-every 10 --eval-batches 2 --dropout 0.3 --no-memory-report"
    return flags.split() + ["--data-dir", data_dir]


@pytest.fixture
def base_args(ptb_offline_dir):
    return run_args(ptb_offline_dir)


def losses_of(path):
    return {row["step"]: row["loss"] for row in read_rows(path)}


def wrap_train_step(monkeypatch, on_call):
    """Route every train-step call through ``on_call(n, outputs) -> outputs`` (n counts from 1)."""
    real = ptb.compiled_steps

    def patched(*args, **kwargs):
        train_step, eval_step = real(*args, **kwargs)
        calls = [0]

        def step(*step_args):
            calls[0] += 1
            return on_call(calls[0], train_step(*step_args))

        return step, eval_step

    monkeypatch.setattr(ptb, "compiled_steps", patched)


def signal_at_call(monkeypatch, n, signum=signal.SIGINT):
    """Send ``signum`` to this process while the n-th train step runs (the step finishes and is saved)."""

    def on_call(call, outputs):
        if call == n:
            signal.raise_signal(signum)
        return outputs

    wrap_train_step(monkeypatch, on_call)


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory, ptb_offline_dir):
    """An uninterrupted every_k:k=4 run of STEPS steps; its metrics rows."""
    out = tmp_path_factory.mktemp("reference")
    args = run_args(ptb_offline_dir) + ["--policy", "every_k", "--k", "4", "--metrics-file", str(out / "m.jsonl")]
    assert ptb.main(args) == 0
    return read_rows(out / "m.jsonl")


def test_reference_run_trains_and_logs_every_step(reference_run):
    assert [r["step"] for r in reference_run] == list(range(1, STEPS + 1))
    for row in reference_run:
        assert set(row) >= {"step", "loss", "perplexity", "lr", "step_time_s", "tokens_per_s"}
        assert math.isfinite(row["loss"]) and row["step_time_s"] > 0 and row["tokens_per_s"] > 0
        assert row["perplexity"] == pytest.approx(math.exp(row["loss"]))
    assert reference_run[-1]["loss"] < reference_run[0]["loss"] - 0.5
    assert "valid_ppl" in reference_run[9] and "valid_ppl" not in reference_run[8]
    assert reference_run[0]["lr"] == 0.0 and reference_run[2]["lr"] == pytest.approx(3e-3)  # 2 warmup steps


@pytest.mark.heavy
def test_interrupt_then_resume_matches_uninterrupted_run(monkeypatch, tmp_path, base_args, reference_run, capsys):
    ckpt, metrics = tmp_path / "ck", tmp_path / "m.csv"
    args = base_args + ["--policy", "every_k", "--k", "4", "--ckpt-dir", str(ckpt), "--metrics-file", str(metrics)]

    signal_at_call(monkeypatch, 8)
    assert ptb.main(args) == ptb.EXIT_INTERRUPTED
    assert "interrupted (SIGINT) after step 8" in capsys.readouterr().err
    assert StateFiles(ckpt).latest_step() == 8
    assert sorted(losses_of(metrics)) == list(range(1, 9))
    monkeypatch.undo()

    assert ptb.main(args + ["--resume"]) == 0
    resumed = losses_of(metrics)
    expected = {r["step"]: r["loss"] for r in reference_run}
    assert sorted(resumed) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):  # same compiled program, same data and keys: bitwise equal
        assert resumed[step] == expected[step], step
    assert StateFiles(ckpt).latest_step() == STEPS


@pytest.mark.heavy
def test_nan_loss_stops_naming_the_step_and_keeps_the_good_checkpoint(monkeypatch, tmp_path, base_args, capsys):
    ckpt = tmp_path / "ck"

    def nan_at_5(n, outputs):
        params, opt_state, loss = outputs
        return (params, opt_state, jnp.float32(math.nan)) if n == 5 else outputs

    wrap_train_step(monkeypatch, nan_at_5)
    args = base_args + ["--policy", "every_k", "--k", "4", "--ckpt-dir", str(ckpt), "--ckpt-every", "2"]
    assert ptb.main(args) == ptb.EXIT_NONFINITE
    err = capsys.readouterr().err
    assert "became nan at step 5" in err and "last good checkpoint is step 4" in err
    assert "Traceback" not in err
    assert StateFiles(ckpt).latest_step() == 4


def test_every_k_and_none_give_the_same_loss_curve(tmp_path, base_args, reference_run):
    metrics = tmp_path / "none.jsonl"
    assert ptb.main(base_args + ["--policy", "none", "--metrics-file", str(metrics)]) == 0
    none_losses = [r["loss"] for r in read_rows(metrics)]
    every_k_losses = [r["loss"] for r in reference_run]
    assert len(none_losses) == STEPS
    np.testing.assert_allclose(every_k_losses, none_losses, rtol=1e-4)


# ----------------------------------------------------------------------------- bad input


def test_budget_no_plan_fits_exits_2_with_the_smallest_peak(base_args, capsys, traced_reports):
    """The planner's error reaches the user as one line (measured by the stand-in: the wiring, not XLA)."""
    assert ptb.main(base_args + ["--policy", "auto", "--memory-budget", "1KiB"]) == ptb.EXIT_USAGE
    err = capsys.readouterr().err
    assert "smallest achievable peak is" in err and "Traceback" not in err
    assert traced_reports.cache_info().misses > 0  # the planner measured candidates (with the stand-in)


def test_missing_and_empty_data_files(tmp_path, base_args, capsys, ptb_offline_dir):
    args = [a if a != ptb_offline_dir else str(tmp_path) for a in base_args]
    assert ptb.main(args) == ptb.EXIT_USAGE
    assert "ptb.train.txt is missing" in capsys.readouterr().err
    for name in ("ptb.train.txt", "ptb.valid.txt"):
        (tmp_path / name).write_text("a b c\n")
    (tmp_path / "ptb.test.txt").write_text("")
    assert ptb.main(args) == ptb.EXIT_USAGE
    err = capsys.readouterr().err
    assert "ptb.test.txt is empty" in err and "JREMAT_PTB_DIR" in err


def test_resume_without_checkpoint(tmp_path, base_args, capsys):
    assert ptb.main(base_args + ["--ckpt-dir", str(tmp_path / "ck"), "--resume"]) == ptb.EXIT_USAGE
    assert "no checkpoint found" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--attention", "cudnn", "--dropout", "0"], "attention 'cudnn'"),
        (["--attention", "xla"], "no attention dropout"),
    ],
)
def test_a_refused_model_flag_makes_no_checkpoint_directory(tmp_path, base_args, capsys, flags, message):
    new = tmp_path / "new"
    assert ptb.main(base_args + ["--ckpt-dir", str(new), *flags]) == ptb.EXIT_USAGE
    assert message in capsys.readouterr().err and not new.exists()  # no folder, no .jremat-run.lock


def test_unwritable_ckpt_dir(tmp_path, base_args, capsys):
    (tmp_path / "file").write_text("x")
    assert ptb.main(base_args + ["--ckpt-dir", str(tmp_path / "file" / "ck")]) == ptb.EXIT_USAGE
    assert "is not writable" in capsys.readouterr().err


def _foreign_checkpoint(directory, ptb_offline_dir, preset_name):
    """A checkpoint as train.ptb writes it, of preset ``preset_name`` at step 3 (params as initialized)."""
    corpus = data_lib.load_corpus(ptb_offline_dir)
    cfg = TrainConfig(preset=preset_name, steps=10, data_dir=ptb_offline_dir)
    model_cfg = cfg.model_config(corpus.vocab_size)
    opt = OptimizerConfig(cfg.lr, cfg.warmup, 10, cfg.clip, cfg.weight_decay, cfg.accum).build()
    _, params = init_params(model_cfg, 0)
    import jax

    ckpts = StateFiles(directory)
    ckpts.save(
        3,
        pack_state(params, opt.init(params), jax.random.key(0)),
        state_meta(cfg, model_cfg, corpus, 3, 100, 10),
    )
    ckpts.close()


@pytest.mark.heavy
def test_resume_from_a_different_model_shape(tmp_path, base_args, capsys, ptb_offline_dir):
    ckpt = tmp_path / "ck"
    _foreign_checkpoint(ckpt, ptb_offline_dir, "needle")
    before = sorted(os.listdir(ckpt))
    assert ptb.main(base_args + ["--ckpt-dir", str(ckpt), "--resume"]) == ptb.EXIT_USAGE
    err = capsys.readouterr().err
    assert "the checkpoint is of another model or data" in err and "d_model: checkpoint 20, this run 32" in err
    # Nothing written but the (empty, released) run lock
    assert sorted(set(os.listdir(ckpt)) - {LOCK_NAME}) == before and StateFiles(ckpt).latest_step() == 3


def test_fresh_run_refuses_to_overwrite_checkpoints_or_metrics(tmp_path, base_args, capsys, ptb_offline_dir):
    ckpt = tmp_path / "ck"
    _foreign_checkpoint(ckpt, ptb_offline_dir, "tiny")
    assert ptb.main(base_args + ["--ckpt-dir", str(ckpt)]) == ptb.EXIT_USAGE
    assert "already holds checkpoints (latest step 3)" in capsys.readouterr().err
    metrics = tmp_path / "m.jsonl"
    metrics.write_text(json.dumps({"step": 1, "loss": 1.0}) + "\n")
    assert ptb.main(base_args + ["--metrics-file", str(metrics)]) == ptb.EXIT_USAGE
    assert "already has rows" in capsys.readouterr().err
    assert metrics.read_text() == json.dumps({"step": 1, "loss": 1.0}) + "\n"


def test_policy_keys_become_flags_and_policy_module_adds_policies(tmp_path, monkeypatch):
    (tmp_path / "my_policies.py").write_text(
        "from jremat import Param, register, resolve\n"
        "@register('stride_test', doc='test policy', params={'stride': Param('int', 2, 'a stride', min=1)})\n"
        "def make(stride):\n"
        "    return resolve('full')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    from jremat import registry

    with registry.scoped():
        try:
            cfg = ptb.parse_config(["--policy-module", "my_policies", "--policy", "stride_test", "--stride", "3"])
            assert cfg.policy_spec() == "stride_test:stride=3"
        finally:
            sys.modules.pop("my_policies", None)
    assert "stride_test" not in registry.available()
    assert ptb.parse_config(["--policy", "every_k", "--k", "2", "--skip-cheap", "true"]).policy_spec() == (
        "every_k:k=2,skip_cheap=true"
    )
    assert ptb.parse_config(["--policy", "every_k"]).policy_spec() == "every_k"
    assert ptb.parse_config(["--policy", "nested", "--block", "2"]).policy_spec() == "nested:block=2"


def test_cli_subprocess_bad_input_has_no_traceback(ptb_offline_dir):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "train.ptb",
            "--preset",
            "tiny",
            "--policy",
            "every_k",
            "--k",
            "0",
            "--data-dir",
            ptb_offline_dir,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "k must be >= 1" in proc.stderr and "Traceback" not in proc.stderr


def test_help_lists_policies_and_their_keys(capsys):
    assert ptb.main(["--help"]) == 0
    out = capsys.readouterr().out
    for text in ("--k VALUE", "--skip-cheap VALUE", "--batch-size", "--ckpt-dir", "every_k", "Exit codes"):
        assert text in out
    assert preset("tiny").max_seq_len == 16  # the seq-len error case above relies on it


# ----------------------------------------------------------------------------- crash safety


def _child(mode, args, **kwargs):
    return subprocess.run(
        [sys.executable, "-m", "tests.train.multiprocess_child", mode, "--", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        **kwargs,
    )


def _assert_resume_matches_reference(args, metrics, reference_run, restored_at):
    assert ptb.main(args + ["--resume"]) == 0
    resumed, expected = losses_of(metrics), {r["step"]: r["loss"] for r in reference_run}
    after = [s for s in range(restored_at + 1, STEPS + 1)]
    assert [resumed[s] for s in after] == [expected[s] for s in after]  # bitwise: same program, data, keys


@pytest.mark.parametrize(
    "mode, restored_at",
    [
        pytest.param("save:8", 4, id="during-a-checkpoint-write"),
        pytest.param("11", 8, id="between-steps", marks=pytest.mark.slow),
    ],
)
@pytest.mark.heavy
def test_sigkill_then_resume_gives_the_uninterrupted_losses(tmp_path, base_args, reference_run, mode, restored_at):
    ckpt, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    args = base_args + ["--policy", "every_k", "--k", "4", "--ckpt-dir", str(ckpt), "--ckpt-every", "4"]
    args += ["--metrics-file", str(metrics)]
    killed = _child(mode, args)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert StateFiles(ckpt).latest_step() == restored_at  # the half-written step 8 is not a checkpoint
    _assert_resume_matches_reference(args, metrics, reference_run, restored_at)
    assert sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit()) == [12, 16, 20]  # --keep-checkpoints 3


def _damage(ckpt, step, how):
    step_dir = ckpt / str(step)
    if how == "meta emptied":
        (step_dir / "meta" / "metadata").write_text("")
    else:
        largest = max((p for p in (step_dir / "state").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
        if how == "data emptied":
            largest.write_bytes(b"")
        elif how == "data overwritten":
            largest.write_bytes(os.urandom(largest.stat().st_size))
        else:
            largest.unlink()


@pytest.mark.parametrize(
    "how",
    [
        "data overwritten",
        pytest.param("meta emptied", marks=pytest.mark.slow),
        pytest.param("data emptied", marks=pytest.mark.slow),
        pytest.param("data deleted", marks=pytest.mark.slow),
    ],
)
@pytest.mark.heavy
def test_a_damaged_newest_checkpoint_resumes_from_the_one_before(
    monkeypatch, tmp_path, base_args, reference_run, capsys, how
):
    ckpt, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    args = base_args + ["--policy", "every_k", "--k", "4", "--ckpt-dir", str(ckpt), "--ckpt-every", "4"]
    args += ["--metrics-file", str(metrics)]

    signal_at_call(monkeypatch, 12)
    assert ptb.main(args) == ptb.EXIT_INTERRUPTED
    monkeypatch.undo()
    _damage(ckpt, 12, how)
    capsys.readouterr()
    _assert_resume_matches_reference(args, metrics, reference_run, 8)
    captured = capsys.readouterr()
    assert "checkpoint step 12" in captured.out and "is damaged" in captured.out
    assert "moved the damaged checkpoint step 12 to" in captured.out
    assert "resumed from" in captured.out and "at step 8" in captured.out
    assert "Traceback" not in captured.err and "Exception ignored" not in captured.err
    assert len(os.listdir(ckpt / "corrupt")) == 1 and StateFiles(ckpt).latest_step() == STEPS


@pytest.mark.heavy
def test_sigterm_during_training_saves_the_step_and_exits_143(monkeypatch, tmp_path, base_args, capsys):
    ckpt = tmp_path / "ck"

    signal_at_call(monkeypatch, 5, signal.SIGTERM)
    assert ptb.main(base_args + ["--ckpt-dir", str(ckpt)]) == ptb.EXIT_TERMINATED
    assert "interrupted (SIGTERM) after step 5; checkpoint saved" in capsys.readouterr().err
    assert StateFiles(ckpt).latest_step() == 5


def _catches_sigterm(pid: int) -> bool:
    """Whether process ``pid`` has a SIGTERM handler (Linux ``/proc``): train.interrupts is installed."""
    with open(f"/proc/{pid}/status") as status:
        caught = next(int(line.split()[1], 16) for line in status if line.startswith("SigCgt:"))
    return bool(caught & (1 << (signal.SIGTERM - 1)))


def _start_and_signal(args, signum, wait_for):
    """Start ``python -m train.ptb ARGS`` and send ``signum`` once stdout shows ``wait_for``, or (empty)
    as soon as its handling is installed, while it imports JAX."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "train.ptb", *args],
        cwd=REPO,
        # Each line as printed; compiled afresh, not from the suite's cache: the signal lands while it compiles.
        env={**{k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}, "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    if wait_for:
        for line in proc.stdout:
            if wait_for in line:
                break
    else:
        while not _catches_sigterm(proc.pid):
            time.sleep(0.005)
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=120)
    return proc.returncode, err


@pytest.mark.parametrize(
    "signum, wait_for, code",
    [
        pytest.param(signal.SIGINT, "schedule:", 130, id="sigint-during-compile"),
        pytest.param(signal.SIGINT, "", 130, id="sigint-during-imports", marks=pytest.mark.slow),
        pytest.param(signal.SIGTERM, "", 143, id="sigterm-during-imports", marks=pytest.mark.slow),
        pytest.param(signal.SIGTERM, "schedule:", 143, id="sigterm-during-compile", marks=pytest.mark.slow),
    ],
)
@pytest.mark.heavy
def test_a_signal_before_training_ends_the_run_at_once(tmp_path, base_args, signum, wait_for, code):
    returncode, err = _start_and_signal(base_args + ["--ckpt-dir", str(tmp_path / "ck")], signum, wait_for)
    assert returncode == code, err[-2000:]
    assert f"interrupted ({signal.Signals(signum).name})" in err
    assert "Traceback" not in err and "Segmentation" not in err
    assert not (tmp_path / "ck").exists() or StateFiles(tmp_path / "ck").latest_step() is None
    lock = tmp_path / "ck" / LOCK_NAME
    assert not lock.exists() or lock.read_text() == ""  # an interrupt is not a crash for the next run to report


def test_two_runs_cannot_write_one_checkpoint_directory(tmp_path, base_args, capsys):
    holder = StateFiles(tmp_path / "ck", lock=True)  # another run, still going
    try:
        assert ptb.main(base_args + ["--ckpt-dir", str(tmp_path / "ck")]) == ptb.EXIT_USAGE
        err = capsys.readouterr().err
        assert f"is in use by another run (pid {os.getpid()} on" in err and err.count("\n") == 1
    finally:
        holder.close()


@pytest.mark.heavy
def test_the_lock_of_a_killed_run_is_taken_over(tmp_path, base_args, capsys):
    code = f"from jremat.train.state_files import StateFiles; import os, signal; StateFiles({str(tmp_path / 'ck')!r}, lock=True); os.kill(os.getpid(), signal.SIGKILL)"
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO, timeout=120).returncode == -signal.SIGKILL
    assert ptb.main(base_args + ["--ckpt-dir", str(tmp_path / "ck"), "--steps", "2"]) == 0
    assert "took over the lock of a run that ended without releasing it (pid" in capsys.readouterr().out


@pytest.mark.heavy
def test_resume_refuses_other_data_and_model_but_takes_another_policy(
    monkeypatch, tmp_path, base_args, capsys, reference_run
):
    ckpt, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    args = base_args + ["--policy", "every_k", "--k", "4", "--ckpt-dir", str(ckpt)]

    signal_at_call(monkeypatch, 10)
    assert ptb.main(args + ["--metrics-file", str(metrics)]) == ptb.EXIT_INTERRUPTED
    monkeypatch.undo()
    capsys.readouterr()
    assert ptb.main(args + ["--resume", "--dropout", "0.1", "--batch-size", "2"]) == ptb.EXIT_USAGE
    err = capsys.readouterr().err
    assert "attn_dropout: checkpoint 0.3, this run 0.1" in err and "--batch-size: checkpoint 4, this run 2" in err
    i = args.index("--policy")
    full = args[:i] + args[i + 4 :] + ["--policy", "full", "--resume"]  # drop --policy every_k --k 4
    assert ptb.main(full + ["--metrics-file", str(metrics), "--seed", "7"]) == 0
    out = capsys.readouterr().out
    assert "note: remat changed since the checkpoint (remat_policy: 'every_k:k=4' -> 'full')" in out
    assert "note: --seed 7 differs from the checkpoint's 0; the run continues with the checkpoint's random key" in out
    resumed, expected = losses_of(metrics), {r["step"]: r["loss"] for r in reference_run}
    after = range(11, STEPS + 1)
    np.testing.assert_allclose([resumed[s] for s in after], [expected[s] for s in after], rtol=1e-5)


@pytest.mark.heavy
def test_a_signal_during_the_final_save_ends_the_run_with_its_code(monkeypatch, tmp_path, base_args, capsys):
    real_save = StateFiles.save

    def save_then_signal(self, step, state, meta):
        real_save(self, step, state, meta)
        signal.raise_signal(signal.SIGTERM)  # arrives while the last step's checkpoint is written

    monkeypatch.setattr(StateFiles, "save", save_then_signal)
    args = base_args + ["--ckpt-dir", str(tmp_path / "ck"), "--steps", "3"]
    assert ptb.main(args) == ptb.EXIT_TERMINATED
    assert "interrupted (SIGTERM) after the last step, 3; checkpoint saved" in capsys.readouterr().err
    assert StateFiles(tmp_path / "ck").latest_step() == 3


@pytest.mark.heavy
def test_resume_past_the_last_step_says_so(tmp_path, base_args, capsys):
    args = base_args + ["--ckpt-dir", str(tmp_path / "ck"), "--steps", "3"]
    assert ptb.main(args) == 0
    assert ptb.main(args + ["--resume"]) == ptb.EXIT_USAGE
    assert "at step 3, which --steps 3 already reaches; nothing is left to train" in capsys.readouterr().err


@pytest.mark.heavy
def test_no_leftovers(tmp_path, base_args, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert ptb.main(base_args + ["--ckpt-dir", "none", "--steps", "1"]) == 0
    assert not (tmp_path / "none").exists()
    (tmp_path / "metrics").mkdir()
    assert ptb.main(base_args + ["--metrics-file", str(tmp_path / "metrics")]) == ptb.EXIT_USAGE
    assert "is a directory" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["metrics"]


class _StopBeforeCompiling(RuntimeError):
    pass


@pytest.mark.parametrize("report", [True, False])
def test_each_slow_phase_is_announced_before_it_starts(monkeypatch, ptb_offline_dir, report):
    """Reading the corpus, the initialization, the memory report's compiles and the steps' compile each get a
    line first."""
    lines = []

    def memory_report(*args):
        return "<the report>"

    def compiled_steps(*args):
        lines.append("<compiling the steps>")
        raise _StopBeforeCompiling

    monkeypatch.setattr(ptb, "memory_report", memory_report)
    monkeypatch.setattr(ptb, "compiled_steps", compiled_steps)
    flags = ["--preset", "tiny", "--data-dir", ptb_offline_dir, "--policy", "every_k:k=4"]
    cfg = ptb.parse_config(flags + ([] if report else ["--no-memory-report"]))
    with pytest.raises(_StopBeforeCompiling):
        ptb.train(cfg, log=lines.append, progress=False)
    assert lines[:2] == [
        f"reading the corpus in {ptb_offline_dir}...",
        "initializing the parameters and optimizer state...",
    ]
    announced = [line for line in lines if line.startswith("compiling") or line.startswith("<")]
    assert announced == [
        *(["compiling the memory report (every_k:k=4 vs none; skip it with --no-memory-report)..."] if report else []),
        *(["<the report>"] if report else []),
        "compiling the train and eval steps...",
        "<compiling the steps>",
    ]
