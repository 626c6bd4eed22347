"""The one config-to-flags mechanism (train.cli) and the policy-key flags every CLI shares."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from jremat import registry
from jremat._apply.keys import BUILTIN_PARAMS
from jremat.train import cli, ptb, value_checks
from jremat.train import memory as train_memory
from jremat.train.bench.config import BenchConfig
from jremat.train.config import TrainConfig
from tests.conftest import REPO

#: Seconds a CLI subprocess may run before the test fails: a hang guard, not a speed claim.
HANG_GUARD_S = 120


@dataclasses.dataclass(frozen=True)
class _Demo:
    name: str = cli.option("a", "a name", choices=("a", "b"))
    count: int = cli.option(1, "how many")
    scale: float | None = cli.option(None, "a scale")
    sizes: tuple[int, ...] = cli.option((1, 2), "sizes")
    policy: tuple[str, ...] = cli.option(("none",), "specs")
    policy_keys: tuple = cli.option((), "policy keys", cli=False)
    fast: bool = cli.option(False, "go fast")
    report: bool = cli.option(True, "print a report")

    def __post_init__(self):
        value_checks.require_int("count", self.count)


def _parse(argv):
    return cli.parse(_Demo, argv, prog="demo", description="demo")


def test_flags_follow_field_types_and_unset_flags_keep_defaults():
    assert _parse([]) == _Demo()
    cfg = _parse(
        [
            "--name",
            "b",
            "--count",
            "3",
            "--scale",
            "0.5",
            "--sizes",
            "4,5,6",
            "--policy",
            "full",
            "--policy",
            "dots",
            "--fast",
            "--no-report",
        ]
    )
    assert cfg == _Demo(name="b", count=3, scale=0.5, sizes=(4, 5, 6), policy=("full", "dots"), fast=True, report=False)


def test_policy_key_flags_are_collected():
    assert _parse(["--policy", "every_k", "--k", "4"]).policy_keys == (("k", "4"),)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--count", "x"], "expected an integer, got 'x'"),
        (["--count", "0"], "--count must be a positive integer, got 0"),
        (["--sizes", "1,b"], "expected comma-separated int values"),
        (["--name", "c"], "invalid choice"),
        (["--nope"], "unrecognized arguments: --nope"),
    ],
)
def test_bad_values_raise_one_usage_error(argv, message):
    with pytest.raises(cli.UsageError, match=message) as info:
        _parse(argv)
    assert "\n" not in str(info.value)


def test_run_main_turns_usage_errors_into_exit_2(capsys):
    def body():
        raise cli.UsageError("bad thing")

    assert cli.run_main(body) == 2
    assert capsys.readouterr().err == "error: bad thing\n"


def test_apply_policy_keys_applies_each_key_to_the_policies_that_take_it():
    assert cli.apply_policy_keys(["none", "every_k"], [("k", "4")]) == ("none", "every_k:k=4")
    assert cli.apply_policy_keys(["every_k:k=2"], []) == ("every_k:k=2",)
    with pytest.raises(cli.UsageError, match="--k is a key of every_k, not of the given policies"):
        cli.apply_policy_keys(["none", "full"], [("k", "4")])
    with pytest.raises(cli.UsageError, match="bad policy 'every_k'"):
        cli.apply_policy_keys(["every_k"], [("k", "0")])


def _bench_policy(argv):
    from jremat.train.bench.config import parse_config as bench_parse

    return bench_parse(["--quick", *argv]).policy[-1]


_EVERY_CLI = pytest.mark.parametrize(
    "parse_config",
    [
        lambda argv: ptb.parse_config(["--preset", "tiny", *argv]).policy_spec(),
        lambda argv: train_memory.parse_config(["--preset", "tiny", *argv]).policy[-1],
        _bench_policy,
    ],
    ids=["train.ptb", "train.memory", "train.bench"],
)


@_EVERY_CLI
def test_k_flag_works_in_every_cli_with_policy(parse_config):
    assert parse_config(["--policy", "every_k", "--k", "4"]) == "every_k:k=4"


@_EVERY_CLI
def test_a_key_in_the_spec_and_as_a_flag_with_two_values_is_refused(parse_config):
    with pytest.raises(cli.UsageError) as info:
        parse_config(["--policy", "every_k:k=4", "--k", "2"])
    assert str(info.value) == "--k 2 conflicts with k=4 in --policy every_k:k=4; give it once"


@_EVERY_CLI
@pytest.mark.parametrize("value", ["4", "04"])
def test_a_key_in_the_spec_and_as_a_flag_with_one_value_is_accepted(parse_config, value):
    assert parse_config(["--policy", "every_k:k=4", "--k", value]) == "every_k:k=4"


@_EVERY_CLI
@pytest.mark.parametrize(
    "spec, flag, value, same",
    [
        (
            "auto:budget=1GiB",
            "--budget",
            "1024MiB",
            lambda spec: registry.parse_spec(spec)[1]["budget"] in ("1GiB", "1024MiB"),
        ),
        ("auto:budget=0.5", "--budget", "0.50", lambda spec: spec in ("auto:budget=0.5", "auto:budget=0.50")),
        ("every_k:min_flops_per_byte=8", "--min-flops-per-byte", "8.0", lambda spec: spec.endswith("=8.0")),
        ("names:save=q+k", "--save", "q++k", lambda spec: spec == "names:save=q+k"),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_a_key_given_twice_is_compared_as_the_key_reads_it(parse_config, spec, flag, value, same):
    """A size by its bytes, a number as a number, names as the list: one value written two ways is accepted."""
    assert same(parse_config(["--policy", spec, flag, value]))


@_EVERY_CLI
def test_a_key_given_twice_with_an_invalid_flag_value_gets_the_keys_own_error(parse_config):
    with pytest.raises(cli.UsageError) as info:
        parse_config(["--policy", "every_k:k=4", "--k", "4.0"])
    assert str(info.value) == "--k 4.0: policy 'every_k': k must be an integer, got '4.0'"
    with pytest.raises(cli.UsageError, match=r"^--budget 2GiB conflicts with budget=1GiB in --policy auto:budget=1GiB"):
        parse_config(["--policy", "auto:budget=1GiB", "--budget", "2GiB"])


@_EVERY_CLI
@pytest.mark.parametrize("policy", ["full", "dots"])
@pytest.mark.parametrize("key", ["keep_gathered", "keep_collectives"])
def test_keep_switch_flags_are_the_spec_keys(parse_config, policy, key):
    flag = "--" + key.replace("_", "-")
    assert parse_config(["--policy", policy, flag]) == f"{policy}:{key}=true"
    assert parse_config(["--policy", f"{policy}:{key}=true", flag]) == f"{policy}:{key}=true"


@_EVERY_CLI
def test_keep_gathered_flag_and_a_spec_saying_false_are_refused_naming_both(parse_config):
    with pytest.raises(cli.UsageError) as info:
        parse_config(["--policy", "full:keep_gathered=false", "--keep-gathered"])
    assert str(info.value) == (
        "--keep-gathered true conflicts with keep_gathered=false in --policy full:keep_gathered=false; give it once"
    )


@pytest.mark.parametrize("module", ["train.ptb", "train.memory", "train.bench"])
def test_keep_gathered_conflict_is_found_before_imports(module):
    argv = ["--policy", "full:keep_gathered=false", "--keep-gathered"]
    with pytest.raises(cli.UsageError, match=r"^--keep-gathered true conflicts with keep_gathered=false"):
        cli.check_before_imports(_CONFIGS[module], argv, prog=module)


def test_keep_gathered_flag_leaves_the_none_baseline_and_needs_a_policy_that_takes_it():
    config = train_memory.parse_config(["--preset", "tiny", "--policy", "none", "--policy", "full", "--keep-gathered"])
    assert config.policy == ("none", "full:keep_gathered=true")
    with pytest.raises(cli.UsageError, match=r"^--keep-gathered is a key of .*not of the given policies \(none\)"):
        train_memory.parse_config(["--preset", "tiny", "--policy", "none", "--keep-gathered"])


@pytest.mark.parametrize("module", ["train.ptb", "train.memory", "train.bench"])
@pytest.mark.parametrize("policy", ["none", "nested"])
def test_keep_gathered_with_only_a_policy_that_does_not_take_it_is_refused_before_imports(module, policy):
    """``--keep-gathered`` leaves ``none`` as it is and ``nested`` takes no such key: with no other
    policy, every CLI refuses the flag, before imports and after, with the same message."""
    argv = ["--policy", policy, "--keep-gathered"]
    with pytest.raises(cli.UsageError) as early:
        cli.check_before_imports(_CONFIGS[module], argv, prog=module)
    with pytest.raises(cli.UsageError) as late:
        cli.parse(_CONFIGS[module], argv, prog=module, description="")
    assert str(early.value) == str(late.value)
    assert str(early.value).startswith("--keep-gathered is a key of auto, dots, dots_no_batch, every_k, full, ")
    assert str(early.value).endswith(f", not of the given policies ({policy})")


@pytest.mark.parametrize("module", ["train.ptb", "train.memory", "train.bench"])
def test_keep_gathered_without_a_policy_applies_to_the_default_policies(module):
    """No ``--policy``: the flag reaches each default policy that takes it, before imports and after."""
    argv = ["--keep-gathered"] if module == "train.bench" else ["--preset", "tiny", "--keep-gathered"]
    cli.check_before_imports(_CONFIGS[module], argv, prog=module)
    config = cli.parse(_CONFIGS[module], argv, prog=module, description="")
    policies = (config.policy_spec(),) if module == "train.ptb" else config.policy
    assert "full:keep_gathered=true" in policies
    assert all(p.endswith("keep_gathered=true") or p in ("none", "nested:block=auto") for p in policies)


def test_a_conflict_names_the_renamed_key_flag():
    """A key whose flag a CLI takes itself is ``--policy-<key>``; the message names that flag."""

    @dataclasses.dataclass(frozen=True)
    class TakesK:
        k: int = cli.option(1, "a CLI flag called --k")
        policy: str = cli.option("full", "spec")
        policy_keys: tuple = cli.option((), "policy keys", cli=False)

    with pytest.raises(cli.UsageError, match=r"^--policy-k 3 conflicts with k=4 in --policy every_k:k=4"):
        cli.parse(TakesK, ["--policy", "every_k:k=4", "--policy-k", "3"], prog="demo", description="demo")
    assert cli.parse(TakesK, ["--policy", "every_k", "--policy-k", "3"], prog="d", description="d").policy_keys == (
        ("k", "3"),
    )


def test_the_builtin_policy_keys_are_the_registrys():
    builtins = {
        name: entry.params
        for name, entry in registry.entries().items()
        if entry.factory.__module__.startswith("jremat.policies.")
    }
    assert builtins == BUILTIN_PARAMS  # the registry's entries hold the declarations the early check reads
    assert cli.BUILTIN_POLICY_KEYS == {name: tuple(params) for name, params in builtins.items()}


_CONFIGS = {"train.ptb": TrainConfig, "train.memory": train_memory.MemoryConfig, "train.bench": BenchConfig}


@pytest.mark.parametrize("module", sorted(_CONFIGS))
@pytest.mark.parametrize(
    "argv",
    [
        ["--bogus"],
        ["--policy", "nosuch"],
        ["--policy", "every_k:j=2"],
        ["--policy", "full:k=2"],
        ["--policy", "every_k:k"],
        ["--policy", "every_k:k=2,k=3"],
        ["--preset", "nope"],
        ["--seed", "x"],
    ],
    ids=str,
)
def test_mistakes_found_before_imports_read_as_parse_reports_them(module, argv):
    if module == "train.bench" and argv[0] == "--preset":
        argv = ["--time-preset", "nope"]
    with pytest.raises(cli.UsageError) as early:
        cli.check_before_imports(_CONFIGS[module], argv, prog=module)
    with pytest.raises(cli.UsageError) as late:
        cli.parse(_CONFIGS[module], argv, prog=module, description="")
    assert str(early.value) == str(late.value)


@pytest.mark.parametrize(
    "module, argv, message",
    [
        ("train.ptb", ["--policy", "every_k", "--k", "0"], "--k 0: policy 'every_k': k must be >= 1, got '0'"),
        ("train.memory", ["--policy", "every_k:k=4", "--k", "4.0"], "--k 4.0: policy 'every_k': k must be an integer"),
        ("train.bench", ["--policy", "every_k:k=4", "--k", "2"], "--k 2 conflicts with k=4 in --policy every_k:k=4"),
        ("train.ptb", ["--policy", "auto:budget=1GiB", "--budget", "1.5"], "--budget 1.5: memory budget '1.5' is not"),
        ("train.memory", ["--policy", "names"], "bad policy 'names': policy 'names' needs key 'save'"),
        ("train.memory", ["--policy", "nested:block=0"], "bad policy 'nested:block=0': policy 'nested': block must be"),
        ("train.memory", ["--fit"], "--fit needs --memory-budget"),
        ("train.memory", ["--remat-head-chunks", "-1"], "--remat-head-chunks must be an integer >= 0, got -1"),
        ("train.ptb", ["--batch-size", "0"], "--batch-size must be a positive integer, got 0"),
        ("train.ptb", ["--steps", "0"], "--steps must be a positive integer, got 0"),
        ("train.bench", ["--time-rounds", "0"], "--time-rounds must be a positive integer, got 0"),
    ],
    ids=str,
)
def test_bad_values_are_found_before_imports_as_parse_reports_them(module, argv, message):
    with pytest.raises(cli.UsageError) as early:
        cli.check_before_imports(_CONFIGS[module], argv, prog=module)
    with pytest.raises(cli.UsageError) as late:
        cli.parse(_CONFIGS[module], argv, prog=module, description="")
    assert str(early.value) == str(late.value)
    assert str(early.value).startswith(message)


@pytest.mark.parametrize(
    "argv",
    [
        ["--preset", "tiny", "--policy", "every_k:k=4", "--k", "4"],
        ["--policy", "auto:budget=1GiB", "--budget", "1024MiB"],  # one size, written two ways
        ["--policy-module", "no.such.module", "--policy", "mine"],  # more than the built-ins: parse checks
        ["--policy", "nosuch", "--help"],
    ],
    ids=str,
)
def test_what_is_left_to_parse_passes_before_imports(argv):
    cli.check_before_imports(TrainConfig, argv, prog="train.ptb")


def test_a_spec_given_as_a_keys_value_is_left_to_parse():
    """``nested``'s ``layer=`` is resolved by the registry (which loads the policies, and JAX)."""
    argv = ["--policy", "nested:layer=nosuch"]
    cli.check_before_imports(TrainConfig, argv, prog="train.ptb")
    with pytest.raises(cli.UsageError, match="unknown policy 'nosuch'"):
        cli.parse(TrainConfig, argv, prog="train.ptb", description="")


@pytest.mark.parametrize(
    "module, argv, message",
    [
        ("train.ptb", ["--bogus"], "error: unrecognized arguments: --bogus (see python -m train.ptb --help)"),
        ("train.ptb", ["--policy", "nosuch"], "error: bad policy 'nosuch': unknown policy 'nosuch'; valid policies: "),
        ("train.memory", ["--policy", "every_k:j=2"], "error: bad policy 'every_k:j=2': unknown key 'j'"),
        ("train.bench", ["--parts"], "error: argument --parts: expected one argument"),
        ("train.ptb", ["--policy", "every_k", "--k", "0"], "error: --k 0: policy 'every_k': k must be >= 1"),
        ("train.memory", ["--fit"], "error: --fit needs --memory-budget"),
        ("train.ptb", ["--policy", "names"], "error: bad policy 'names': policy 'names' needs key 'save'"),
        ("train.memory", ["--remat-head-chunks", "-1"], "error: --remat-head-chunks must be an integer >= 0"),
        ("train.ptb", ["--batch-size", "0"], "error: --batch-size must be a positive integer, got 0"),
        ("train.ptb", ["--steps", "0"], "error: --steps must be a positive integer, got 0"),
        ("train.bench", ["--time-rounds", "0"], "error: --time-rounds must be a positive integer, got 0"),
        ("train.memory", ["--policy", "every_k:k=4", "--k", "4.0"], "error: --k 4.0: policy 'every_k': k must be"),
        ("train.ptb", ["--policy", "none", "--keep-gathered"], "error: --keep-gathered is a key of auto, dots,"),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else v[:20],
)
def test_an_argument_error_exits_2_in_one_line_before_jax_is_imported(module, argv, message):
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", module, *argv],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    imported = [line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")]
    said = [line for line in done.stderr.splitlines() if not line.startswith("import time:")]
    assert done.returncode == 2 and done.stdout == ""
    assert len(said) == 1 and said[0].startswith(message), said
    assert "jremat.train.cli" in imported  # the import log is read right
    assert not {"jax", "flax", "optax", "orbax", "tqdm"} & set(imported)
    # No wall-clock bound: "before JAX is imported" is the import log above, not a time.


_CONSOLE_RUN = """
import sys
from jremat.train import cli, console

seen = {}
check = cli.check_before_imports


def spy(config_cls, argv, *, prog):
    main = sys.modules["__main__"]
    seen.update(main_holds_config=getattr(main, config_cls.__name__, None) is config_cls, prog=prog)
    return check(config_cls, argv, prog=prog)


cli.check_before_imports = spy
sys.argv = ["/somewhere/bin/jremat-memory", *sys.argv[1:]]
try:
    console.memory()
except SystemExit as exit_:
    print(seen["main_holds_config"], seen["prog"], exit_.code)
"""


def test_a_console_script_runs_its_cli_as_the_main_module_under_its_own_name():
    """``MemoryConfig.__module__`` is ``__main__``: its names (type hints, dataclass fields) are looked
    up in ``sys.modules["__main__"]``, which must be the CLI's module, not the console wrapper."""
    done = subprocess.run(
        [sys.executable, "-c", _CONSOLE_RUN, "--batch-size", "0"], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert done.stdout.split() == ["True", "jremat-memory", "2"], done.stderr
    assert done.stderr.strip() == "error: --batch-size must be a positive integer, got 0"


def test_the_installed_console_script_names_itself_in_errors():
    script = Path(sys.executable).with_name("jremat-memory")
    if not script.exists():
        pytest.skip("jremat-memory is not installed beside this Python")
    done = subprocess.run([str(script), "--bogus"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip() == "error: unrecognized arguments: --bogus (see jremat-memory --help)"


@pytest.mark.parametrize(
    ("config_cls", "dtype", "head_chunks"),
    [(TrainConfig, None, None), (train_memory.MemoryConfig, None, None), (BenchConfig, "float32", 4)],
)
def test_compute_flags_are_declared_once_with_each_clis_default(config_cls, dtype, head_chunks):
    from jremat.train.model_flags import ComputeFlags

    shared = {f.name: f for f in dataclasses.fields(ComputeFlags)}
    fields = {f.name: f for f in dataclasses.fields(config_cls)}
    assert issubclass(config_cls, ComputeFlags)
    assert (fields["dtype"].default, fields["remat_head_chunks"].default) == (dtype, head_chunks)
    for name in ("dtype", "remat_head_chunks"):
        assert fields[name].metadata["choices"] == shared[name].metadata["choices"]
        assert fields[name].metadata["help"].startswith(shared[name].metadata["help"])
    assert shared["dtype"].metadata["choices"] == ("float32", "bfloat16")
