"""The one config-to-flags mechanism (train.cli) and the policy-key flags every CLI shares."""

from __future__ import annotations

import dataclasses

import pytest

from jremat.train import cli, ptb
from jremat.train import memory as train_memory


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
        cli.require_int("count", self.count)


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
