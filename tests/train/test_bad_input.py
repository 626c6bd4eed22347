"""Bad input to every CLI: exit code 2 and one ``error:`` line naming what was wrong and what is valid.

The table is the specification: one row per kind of mistake, by flag class (numbers, policy
specs, paths, data files), for ``train.ptb``, ``train.memory``, ``train.bench`` and
``train.launch``. Each row runs the CLI's ``main`` in this process; none gets as far as a
training step.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from jremat.train import launch, memory, ptb
from jremat.train.bench import cli as bench

CLIS = {"ptb": ptb.main, "memory": memory.main, "bench": bench.main, "launch": launch.main}
TINY_RUN = "--preset tiny --steps 2 --eval-batches 1 --no-memory-report"

# (cli, flags, a piece of the one-line message); {data}: the offline PTB folder, {tmp}: a fresh
# folder holding a file "file", a folder "dir" and data files "empty/" (empty ptb.train.txt) and
# "partial/" (no ptb.test.txt).
TABLE = {
    "numbers": [
        ("ptb", "--batch-size 0", "--batch-size must be a positive integer, got 0"),
        ("ptb", "--steps many", "argument --steps: expected an integer, got 'many'"),
        ("ptb", "--lr -1", "--lr must be a positive number"),
        ("ptb", "--dropout 1.5", "--dropout must be in [0, 1), got 1.5"),
        ("ptb", "--seq-len 17", "--seq-len 17 is longer than the model has positions (16); pass --max-seq-len 17"),
        ("ptb", "--attention-block-size 0", "--attention-block-size must be a positive integer, got 0"),
        ("memory", "--seq-len 32", "--seq-len 32 is longer than the model has positions (16); pass --max-seq-len 32"),
        ("ptb", "--accum 0", "--accum must be a positive integer, got 0"),
        ("ptb", "--ckpt-every -1", "--ckpt-every must be an integer >= 0, got -1"),
        ("ptb", "--keep-checkpoints 0", "--keep-checkpoints must be a positive integer, got 0"),
        ("ptb", "--epochs 1", "give --steps or --epochs, not both"),
        ("memory", "--layers 0", "--layers must be a positive integer"),
        ("ptb", "--max-seq-len 0", "--max-seq-len must be a positive integer, got 0"),  # not --seq-len (its default)
        ("memory", "--remat-head-chunks 3 --max-seq-len -5", "--max-seq-len must be a positive integer, got -5"),
        ("memory", "--remat-head-chunks 3", "--remat-head-chunks 3 does not divide the sequence length 16"),
        ("memory", "--layers 1000000000000", "the model is too large: its parameters alone take"),
        ("ptb", "--seq-len 16 --max-seq-len 2147483648", "the model does not fit this device: its parameters take"),
        ("memory", "--heads 3", "--heads 3 does not divide d_model"),
        ("bench", "--time-steps -2", "--time-steps"),
        ("ptb", "--moe-experts 2 --moe-top-k 4", "--moe-top-k 4 is more than --moe-experts 2"),
        ("memory", "--moe-experts 4 --moe-top-k 0", "--moe-top-k must be a positive integer, got 0"),
        ("bench", "--parts time --moe-experts 4 --moe-top-k 8", "--moe-top-k 8 is more than --moe-experts 4"),
        ("memory", "--moe-experts -2", "--moe-experts must be an integer >= 0, got -2"),
        ("ptb", "--moe-experts 4 --moe-capacity-factor 0", "--moe-capacity-factor must be a positive number, got 0.0"),
        ("bench", "--parts time --moe-capacity-factor -1", "--moe-capacity-factor must be a positive number"),
        (
            "ptb",
            "--moe-experts 4 --moe-load-balance-coef -1",
            "--moe-load-balance-coef must be a number >= 0, got -1.0",
        ),
        ("memory", "--moe-router-z-coef nan", "--moe-router-z-coef must be a number >= 0, got nan"),
        (
            "ptb",
            "--moe-experts 6 --mesh expert=4 --batch-size 4",
            "--mesh expert=4: 6 experts do not split over the mesh's expert axis of size 4",
        ),
        (
            "memory",
            "--moe-experts 4 --mesh expert=3 --batch-size 6",
            "--mesh expert=3: 4 experts do not split over the mesh's expert axis of size 3",
        ),
        ("memory", "--mesh expert=2", "--mesh expert=2: the mesh's expert axis (size 2) splits the experts of an MoE"),
        ("bench", "--moe-experts 4", "--moe-experts applies to the parts time, auto, fit, maxbatch; needle,"),
        ("launch", "--processes 0 -- python -c pass", "--processes must be"),
    ],
    "attention": [
        ("ptb", "--attention flash", "argument --attention: invalid choice: 'flash'"),
        ("ptb", "--attention xla", "attention 'xla' (jax.nn.dot_product_attention) has no attention dropout"),
        ("ptb", "--attention pallas", "attention 'pallas' (JAX's Pallas flash attention) has no attention dropout"),
        (
            "ptb",
            "--attention pallas --dropout 0 --seq-len 12",
            "--attention pallas --attention-block-size 128: pallas attention: the kernel's block",
        ),
        ("ptb", "--attention cudnn --dropout 0", "needs an NVIDIA GPU with cuDNN, but JAX runs on cpu"),
        (
            "memory",
            "--attention cudnn --dropout 0 --dtype bfloat16",
            "needs an NVIDIA GPU with cuDNN, but JAX runs on cpu",
        ),
    ],
    "specs": [
        ("ptb", "--policy nosuch", "unknown policy 'nosuch'; valid policies:"),
        ("ptb", "--policy every_k --k 0", "k must be >= 1, got '0'"),
        ("ptb", "--policy full --k 4", "unknown key 'k' for policy 'full'"),
        ("ptb", "--policy nested:block=3", "block=3 does not divide the 2 layers; valid block sizes: auto, 1, 2"),
        ("ptb", "--policy names:save=not_a_tag", "names 'not_a_tag', which the checkpointed function does not tag"),
        ("ptb", "--policy-module no_such_module_xyz", "cannot import policy module 'no_such_module_xyz'"),
        ("ptb", "--mesh data=2,model=2", "--mesh: "),
        (
            "ptb",
            "--mesh data=4,fsdp=2 --batch-size 8",
            "--mesh: mesh data=4,fsdp=2 has 8 devices but only 1 is available",
        ),
        ("ptb", "--mesh data=3 --batch-size 4", "--batch-size 4 does not split over --mesh data=3"),
        ("ptb", "--policy every_k --k x", "k must be an integer, got 'x'"),
        ("ptb", "--resume", "--resume needs --ckpt-dir"),
        (  # --dropout 0 would be refused as a changed model: the hint names what works
            "ptb",
            "--resume --ckpt-dir {tmp}/dir --attention xla",
            "a resumed run keeps the checkpoint's dropout: resume with the original run's --attention and --dropout",
        ),
        ("ptb", "--policy full --memory-budget 1GiB", "--memory-budget applies only to --policy auto"),
        ("ptb", "--policy auto --memory-budget lots", "memory budget 'lots' is not a size like 6GiB"),
        ("ptb", "--batch-size lots", "--batch-size must be a positive whole number or auto, got 'lots'"),
        ("ptb", "--batch-size auto", "--batch-size auto needs --memory-budget, a size"),
        ("ptb", "--batch-size auto --memory-budget 0.5", "--batch-size auto needs --memory-budget as a size"),
        ("ptb", "--batch-size auto --memory-budget 1GiB --accum 2", "leave --accum at 1"),
        ("ptb", "--batch-size auto --memory-budget 1KiB --policy full", "nothing fits the budget 1.00 KiB"),
        ("memory", "--fit", "--fit needs --memory-budget, a size"),
        ("memory", "--fit --memory-budget 0.5", "--fit needs --memory-budget as a size"),
        ("memory", "--global-batch 8", "--global-batch applies only with --fit"),
        ("memory", "--fit --memory-budget 1KiB --policy none", "nothing fits the budget 1.00 KiB"),
        ("memory", "--fit --memory-budget 1GiB --policy auto", "--fit with only --policy auto: add the built-ins"),
        ("memory", "--policy every_k:k=0", "k must be >="),
        ("memory", "--policy none --memory-budget 0.5", "--memory-budget applies only to --policy auto or --fit"),
        ("memory", "--policy auto:budget=0.3 --memory-budget 0.5", "sets its own budget and --memory-budget 0.5"),
        ("ptb", "--policy auto:budget=0.3 --memory-budget 0.5", "sets its own budget and --memory-budget 0.5"),
        (
            "memory",
            "--fit --policy auto:budget=1GiB --memory-budget 4GiB",
            "drop budget= from --policy 'auto:budget=1GiB'",
        ),
        (
            "ptb",
            "--batch-size auto --policy auto:budget=1GiB --memory-budget 4GiB",
            "drop budget= from --policy 'auto:budget=1GiB' (--batch-size auto searches",
        ),
        ("ptb", "--policy skip_cheap:min_flops_per_byte=nan", "min_flops_per_byte must be a finite number"),
        ("memory", "--policy nested:block=3", "nested"),
        ("ptb", "--policy full:keep_gathered=false --keep-gathered", "--keep-gathered true conflicts with"),
        ("memory", "--policy none --keep-gathered", "--keep-gathered is a key of"),
        ("bench", "--policy dots:keep_gathered=false --keep-gathered", "conflicts with keep_gathered=false"),
        ("ptb", "--policy nested --keep-gathered", "--keep-gathered is a key of auto, dots,"),
        ("ptb", "--policy none --keep-gathered", "not of the given policies (none)"),
        ("memory", "--mesh fsdp=8 --timeline {tmp}/t.png", "--mesh: mesh fsdp=8 has 8 devices but only 1 is available"),
        ("bench", "--policy nosuch", "unknown policy 'nosuch'"),
        ("ptb", "--policy auto --memory-budget 1e400", "memory budget '1e400' is too large"),
        ("ptb", "--policy auto:budget=1e400", "memory budget '1e400' is too large"),
        ("ptb", "--batch-size auto --memory-budget 1e400", "memory budget '1e400' is too large"),
        ("memory", "--policy auto --memory-budget 1e400", "memory budget '1e400' is too large"),
        ("memory", "--fit --memory-budget 1e400GiB", "memory budget '1e400GiB' is too large"),
        ("bench", "--policy auto:budget=1e400", "memory budget '1e400' is too large"),
        (
            "bench",
            "--parts megatron,time --policy none --policy nested:block=3",
            "--policy 'nested:block=3' does not apply to the head-dominated (tiny) model of part time: "
            "nested: block=3 does not divide the 2 layers",
        ),
        (
            "bench",
            "--parts time --policy none --policy names:save=attn_context+attn_lse",
            "--policy 'names:save=attn_context+attn_lse' does not apply to the head-dominated (tiny) model",
        ),
    ],
    "paths": [
        ("ptb", "--ckpt-dir {tmp}/file/ck", "is not writable"),
        ("ptb", "--resume --ckpt-dir {tmp}/dir", "--resume: no checkpoint found in"),
        ("ptb", "--metrics-file {tmp}/dir", "is a directory; give a file path"),
        ("memory", "--plot {tmp}/dir", "--plot '{tmp}/dir': is a directory"),
        ("memory", "--timeline {tmp}/t.svg", "the file name must end in .png"),
        ("memory", "--json --plot {tmp}/missing/p.png", "does not exist"),
    ],
    "data files": [
        ("ptb", "--data-dir {tmp}/missing", "{tmp}/missing"),
        ("ptb", "--data-dir {tmp}/partial", "ptb.test.txt"),
        ("ptb", "--data-dir {tmp}/empty", "ptb.train.txt"),
    ],
}
ROWS = [(kind, *row) for kind, rows in TABLE.items() for row in rows]


@pytest.fixture
def folder(tmp_path, ptb_offline_dir):
    (tmp_path / "file").write_text("not a folder")
    (tmp_path / "dir").mkdir()
    for name, skip, empty in (("empty", None, "ptb.train.txt"), ("partial", "ptb.test.txt", None)):
        (tmp_path / name).mkdir()
        for split in ("train", "valid", "test"):
            file = f"ptb.{split}.txt"
            if file == skip:
                continue
            text = "" if file == empty else Path(ptb_offline_dir, file).read_text()
            (tmp_path / name / file).write_text(text)
    return tmp_path


#: Rows that compile several policies before they can say nothing fits: run with ``-m heavy``.
HEAVY_FLAGS = {"--batch-size auto --memory-budget 1KiB --policy full", "--fit --memory-budget 1KiB --policy none"}


@pytest.mark.parametrize(
    "kind, cli, flags, message",
    [pytest.param(*r, marks=pytest.mark.heavy) if r[2] in HEAVY_FLAGS else r for r in ROWS],
    ids=[f"{r[0]}:{r[1]}:{r[2]}" for r in ROWS],
)
def test_bad_input_is_one_line_and_exit_2(folder, ptb_offline_dir, capsys, kind, cli, flags, message):
    argv = flags.format(tmp=folder, data=ptb_offline_dir).split()
    if cli == "ptb":
        argv = TINY_RUN.split() + (["--data-dir", ptb_offline_dir] if "--data-dir" not in argv else []) + argv
    elif cli == "memory":
        argv = ["--preset", "tiny", *argv]
    elif cli == "bench":
        argv = ["--quick", "--report", "", "--out", str(folder / "bench"), *argv]
    assert CLIS[cli](argv) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("error: "), err
    assert message.format(tmp=folder) in err[0]
    assert "Traceback" not in err[0]


def test_the_table_covers_every_cli_and_class():
    assert {cli for _, cli, _, _ in ROWS} == set(CLIS)
    assert set(TABLE) == {"numbers", "attention", "specs", "paths", "data files"}
