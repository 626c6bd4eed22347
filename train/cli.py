"""Command-line plumbing shared by every CLI: one error type, one parser, one config-to-flags mechanism.

Each CLI describes what it runs as a frozen dataclass whose fields are declared with
:func:`option`. :func:`parse` turns that dataclass into flags (``batch_size`` <-> ``--batch-size``),
adds one flag per key of every registered remat policy (``--k 4``), parses ``argv`` and builds the
config; the dataclass's ``__post_init__`` validates values and raises :class:`UsageError`.
:func:`run_main` turns a :class:`UsageError` into a one-line message and exit code 2.

Flag kinds follow the field's type: ``bool`` is a switch (``--x``, or ``--x/--no-x`` when the
default is true), ``tuple[str, ...]`` is repeatable (``--policy a --policy b``), ``tuple[int, ...]``
and ``tuple[float, ...]`` take comma-separated values (``--needle-ks 0,1,2``), ``int``, ``float``
and ``str`` take one value.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import sys
import types
import typing
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from jremat import Budget, registry
from jremat.internal import BUILTIN_PARAMS
from jremat.train.usage import EXIT_USAGE, OneLineErrorParser, UsageError, program_name

#: Internal name of the field that collects the per-policy-key flags (``--k 4`` -> ``(("k", "4"),)``).
POLICY_KEYS_FIELD = "policy_keys"


def option(
    default: Any,
    help: str,
    *,
    choices: Sequence[str] | None = None,
    metavar: str | None = None,
    cli: bool = True,
    hidden: bool = False,
) -> Any:
    """A dataclass field that is also a command-line flag.

    Args:
      default: the field's default (also the flag's).
      help: one line of help text; the default is appended when it is not ``None`` or empty.
      choices: the valid values, checked by the parser and listed in the help.
      metavar: the value's name in the help.
      cli: ``False`` for a field that is not a flag.
      hidden: a flag left out of ``--help`` (internal use).
    """
    metadata = {
        "help": help,
        "choices": tuple(choices) if choices else None,
        "metavar": metavar,
        "cli": cli,
        "hidden": hidden,
    }
    if isinstance(default, (list, dict, set)):
        raise TypeError("option(): use a tuple for a sequence default")
    return dataclasses.field(default=default, metadata=metadata)


def flag_name(field_name: str) -> str:
    """``batch_size`` -> ``--batch-size``."""
    return "--" + field_name.replace("_", "-")


def cli_fields(config_cls: type) -> list[dataclasses.Field]:
    """The fields of ``config_cls`` that are command-line flags, in declaration order."""
    return [f for f in dataclasses.fields(config_cls) if f.metadata.get("cli", True) and f.name != POLICY_KEYS_FIELD]


def _base_type(hint: Any) -> Any:
    """``int | None`` -> ``int``; ``tuple[int, ...] | None`` -> ``tuple[int, ...]``."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return next(a for a in typing.get_args(hint) if a is not type(None))
    return hint


def _comma_list(item_type: type) -> Callable[[str], tuple]:
    def parse(text: str) -> tuple:
        try:
            return tuple(item_type(v) for v in text.split(",") if v.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated {item_type.__name__} values, got {text!r}"
            ) from None

    parse.__name__ = f"comma-separated {item_type.__name__}"
    return parse


def _scalar(item_type: type) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            return item_type(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected {'an integer' if item_type is int else 'a number'}, got {text!r}"
            ) from None

    parse.__name__ = item_type.__name__
    return parse


def add_config_flags(parser: argparse.ArgumentParser, config_cls: type) -> None:
    """Add one flag per :func:`option` field of ``config_cls`` to ``parser``.

    Only flags the user gives reach the parsed namespace (``argparse.SUPPRESS``), so the
    dataclass's own defaults apply to the others.
    """
    hints = typing.get_type_hints(config_cls)
    for field in cli_fields(config_cls):
        meta = field.metadata
        kind = _base_type(hints[field.name])
        help_text = meta["help"]
        if field.default not in (None, (), "", False) and field.default is not dataclasses.MISSING:
            shown = ",".join(map(str, field.default)) if isinstance(field.default, tuple) else field.default
            help_text += f" (default {shown})"
        kwargs: dict[str, Any] = {
            "dest": field.name,
            "default": argparse.SUPPRESS,
            "help": argparse.SUPPRESS if meta["hidden"] else help_text,
        }
        if kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction if field.default else "store_true"
        elif typing.get_origin(kind) is tuple:
            item_type = typing.get_args(kind)[0]
            if item_type is str:
                kwargs.update(action="append", metavar=meta["metavar"] or "VALUE")
                kwargs["help"] = kwargs["help"] if meta["hidden"] else help_text + "; repeatable"
            else:
                kwargs.update(type=_comma_list(item_type), metavar=meta["metavar"] or "V1,V2,...")
        else:
            if kind in (int, float):
                kwargs["type"] = _scalar(kind)
            kwargs["metavar"] = meta["metavar"] or field.name.upper()
        if meta["choices"]:
            kwargs.update(choices=meta["choices"], metavar="{" + ",".join(meta["choices"]) + "}")
        parser.add_argument(flag_name(field.name), **kwargs)


#: The keys of every built-in policy (:mod:`jremat.policies`), by policy name: what the CLIs check
#: flags against before JAX is imported (:func:`check_before_imports`).
BUILTIN_POLICY_KEYS: dict[str, tuple[str, ...]] = {name: tuple(keys) for name, keys in BUILTIN_PARAMS.items()}
BUILTIN_POLICY_KEYS_ALL = frozenset(key for keys in BUILTIN_POLICY_KEYS.values() for key in keys)


#: Built-in policies of a layer stack (no keep_gathered or keep_collectives key).
STACK_POLICIES = frozenset({"nested"})


def with_universal_keys(params: dict[str, registry.Param], stack: bool) -> dict[str, registry.Param]:
    """A policy's ``params`` with ``keep_gathered`` and ``keep_collectives``, the keys every policy
    of one function takes (:data:`jremat.registry.UNIVERSAL_PARAMS`); a layer-stack policy
    (``stack``: registered with ``stack=True``, as the built-ins in :data:`STACK_POLICIES`) takes them not."""
    return params if stack else params | registry.UNIVERSAL_PARAMS


def registered_policy_params() -> dict[str, dict[str, registry.Param]]:
    """Every registered policy's keys, ``keep_gathered`` and ``keep_collectives`` included where the policy takes them."""
    return {name: with_universal_keys(entry.params, entry.stack) for name, entry in registry.entries().items()}


#: The policy-key flags that are switches: ``--keep-gathered`` is ``keep_gathered=true`` (``--keep-collectives``
#: ``keep_collectives=true``) in every ``--policy`` that takes it but ``none`` (which keeps everything, and
#: stays the baseline the reports compare with).
SWITCH_KEYS = {registry.KEEP_GATHERED: "true", registry.KEEP_COLLECTIVES: "true"}


def policy_key_flags(taken: set[str], keys: Iterable[str] | None = None) -> dict[str, str]:
    """Flag name of every policy key: ``{"k": "--k", "skip_cheap": "--skip-cheap"}``.

    Args:
      taken: flags the CLI has already; a key whose flag is among them is spelled ``--policy-<key>``.
      keys: the keys (default: every key of every registered policy, ``keep_gathered`` and ``keep_collectives``).
    """
    if keys is None:
        keys = [key for params in registered_policy_params().values() for key in params]
    flags = {}
    for key in keys:
        flag = flag_name(key)
        flags[key] = flag if flag not in taken else "--policy-" + key.replace("_", "-")
    return flags


def takes_key(name: str, key: str, params: dict[str, dict[str, registry.Param]]) -> bool:
    """Whether a policy-key flag ``key`` applies to policy ``name``: ``params`` gives it the key, and a
    switch (:data:`SWITCH_KEYS`) leaves ``none`` as it is."""
    return key in params.get(name, {}) and not (key in SWITCH_KEYS and name == "none")


def require_keys_taken(specs: Sequence[str], keys: Iterable[str], params: dict[str, dict[str, registry.Param]]) -> None:
    """Each policy-key flag in ``keys`` applies to one of ``specs`` at least (:func:`takes_key`).

    Args:
      specs: the ``--policy`` specs (each one that parses).
      keys: the keys given as flags.
      params: each policy's keys, by policy name.

    Raises:
      UsageError: ``--keep-gathered is a key of dots, full, ..., not of the given policies (none)``.
    """
    keys = list(keys)
    if not keys:
        return
    names = [registry.parse_spec(spec)[0] for spec in specs]
    unused = sorted({key for key in keys if not any(takes_key(name, key, params) for name in names)})
    if unused:
        takers = {key: sorted(n for n in params if takes_key(n, key, params)) for key in unused}
        detail = "; ".join(f"--{k.replace('_', '-')} is a key of {', '.join(v)}" for k, v in takers.items())
        raise UsageError(f"{detail}, not of the given policies ({', '.join(specs)})")


def apply_policy_keys(specs: Sequence[str], keys: Sequence[tuple[str, str]]) -> tuple[str, ...]:
    """Each spec with the policy-key flags it accepts applied (then in canonical form); every spec is checked.

    ``apply_policy_keys(["none", "every_k"], [("k", "4")])`` -> ``("none", "every_k:k=4")``.

    Raises:
      UsageError: a spec is invalid, a key is accepted by none of ``specs``, or a value is bad.
    """
    keys = dict(keys)
    canonical = []
    accepting = registered_policy_params()
    for spec in specs:
        try:
            name = registry.parse_spec(spec)[0]
            mine = {k: v for k, v in keys.items() if takes_key(name, k, accepting)}
            normalized = registry.normalize_spec(spec, **mine)
            canonical.append(normalized if mine else spec)
        except ValueError as err:
            raise UsageError(f"bad policy {spec!r}: {err}") from None
    require_keys_taken(specs, keys, accepting)
    return tuple(canonical)


def load_policy_modules(argv: Sequence[str]) -> None:
    """Import every ``--policy-module`` in ``argv`` first, so their policies' keys become flags.

    Raises:
      UsageError: a module cannot be imported or registers nothing valid.
    """
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--policy-module", action="append", default=[])
    known, _ = pre.parse_known_args(list(argv))
    for module in known.policy_module:
        try:
            registry.load_module(module)
        except ValueError as err:
            raise UsageError(f"bad --policy-module: {err}") from None


def build_parser(
    config_cls: type, prog: str, description: str, epilog: str = "", *, builtin_keys_only: bool = False
) -> OneLineErrorParser:
    """The parser of ``config_cls``: its :func:`option` flags, plus the policy-key flags when it has
    a ``policy_keys`` field.

    ``builtin_keys_only``: the keys of :data:`BUILTIN_POLICY_KEYS`, without help, so that the
    registry is not loaded.
    """
    parser = OneLineErrorParser(
        prog=prog,
        description=description,
        epilog=epilog,
        allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_flags(parser, config_cls)
    if POLICY_KEYS_FIELD in {f.name for f in dataclasses.fields(config_cls)}:
        group = parser.add_argument_group("policy keys (each applies to the --policy that takes it)")
        keys = BUILTIN_POLICY_KEYS_ALL | set(SWITCH_KEYS) if builtin_keys_only else None
        tables = {} if keys else registered_policy_params()
        for key, flag in sorted(key_flags(config_cls, keys).items()):
            helps = sorted({params[key].help for params in tables.values() if key in params})
            kwargs: dict[str, Any] = dict(dest="policykey__" + key, default=argparse.SUPPRESS, help="; ".join(helps))
            if key in SWITCH_KEYS:
                kwargs.update(action="store_const", const=SWITCH_KEYS[key])
                kwargs["help"] += f" ({key}={SWITCH_KEYS[key]} in every --policy that takes it but none)"
            else:
                kwargs["metavar"] = "VALUE"
            group.add_argument(flag, **kwargs)
    return parser


def parse(config_cls: type, argv: Sequence[str] | None, *, prog: str, description: str, epilog: str = ""):
    """Parse ``argv`` (default ``sys.argv[1:]``) into a validated ``config_cls``.

    ``--policy-module`` flags are imported first; repeatable flags become tuples; policy-key
    flags go to the ``policy_keys`` field as ``(key, raw value)`` pairs.

    Raises:
      UsageError: on an unknown flag, a malformed value, or one ``config_cls`` rejects.
      SystemExit: ``--help`` (code 0, after printing the help).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    load_policy_modules(argv)
    values = vars(build_parser(config_cls, prog, description, epilog).parse_args(argv))
    values, keys = _split_policy_keys(values)
    if keys:
        require_keys_given_once(_given_specs(values), keys, key_flags(config_cls), registered_policy_params())
        values[POLICY_KEYS_FIELD] = keys
    return config_cls(**values)


def _split_policy_keys(parsed: dict[str, Any]) -> tuple[dict[str, Any], tuple[tuple[str, str], ...]]:
    """Parsed flags as config field values (repeatable flags as tuples), and the policy-key flags as pairs."""
    keys = tuple((k.split("__", 1)[1], v) for k, v in parsed.items() if k.startswith("policykey__"))
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in parsed.items() if not k.startswith("policykey__")}
    return values, keys


def _given_specs(values: dict[str, Any]) -> tuple[str, ...]:
    """The ``--policy`` specs among parsed flag values (one spec or several)."""
    given = values.get("policy", ())
    return (given,) if isinstance(given, str) else tuple(given)


def key_flags(config_cls: type, keys: Iterable[str] | None = None) -> dict[str, str]:
    """The flag of every policy key in ``config_cls``'s parser (:func:`policy_key_flags`)."""
    return policy_key_flags({flag_name(f.name) for f in cli_fields(config_cls)} | {"--help"}, keys)


def check_before_imports(config_cls: type, argv: Sequence[str], *, prog: str) -> None:
    """The argument mistakes that are found without JAX: a CLI calls this before it imports JAX.

    Checks what the parser checks (unknown flags, malformed numbers, invalid choices); each
    ``--policy``'s spec syntax, name, keys and values against the built-in policies
    (:data:`jremat._apply.keys.BUILTIN_PARAMS`), with the policy-key flags applied; and the
    config's own value checks that need no JAX (its ``check_arguments``, when it has one), with
    the messages :func:`parse` gives. A spec given as a key's value (``nested``'s ``layer=``)
    is left to :func:`parse`. Nothing is checked for ``--help``, or when more than the
    built-ins may be named (``--policy-module``, a package's ``jremat.policies`` entry point):
    :func:`parse` checks those with the registry.

    Raises:
      UsageError: the first mistake found.
    """
    argv = list(argv)
    if any(a in ("-h", "--help") or a.startswith("--policy-module") for a in argv):
        return
    if importlib.metadata.entry_points(group=registry.ENTRY_POINT_GROUP):
        return
    values = vars(build_parser(config_cls, prog, "", builtin_keys_only=True).parse_args(argv))
    values, keys = _split_policy_keys(values)
    # A spec-valued key is written back as given: resolving it would load the policies (and JAX).
    params = {
        name: with_universal_keys(
            {key: dataclasses.replace(p, parse=None) if p.kind == "spec" else p for key, p in table.items()},
            name in STACK_POLICIES,
        )
        for name, table in BUILTIN_PARAMS.items()
    }
    specs = _given_specs(values)
    parsed: dict[str, tuple[str, dict[str, str]]] = {}  # each spec parsed once here
    for spec in specs:
        try:
            parsed[spec] = registry.parse_spec(spec)
            name = parsed[spec][0]
            if name not in params:
                raise ValueError(f"unknown policy {name!r}; valid policies: {', '.join(sorted(params))}")
        except ValueError as err:
            raise UsageError(f"bad policy {spec!r}: {err}") from None
    require_keys_given_once(
        specs, keys, key_flags(config_cls, BUILTIN_POLICY_KEYS_ALL | set(SWITCH_KEYS)), params, parsed=parsed
    )
    if specs:  # no --policy: the CLI's default policies, checked when parse fills them in
        require_keys_taken(specs, [key for key, _ in keys if key in SWITCH_KEYS], params)
    for spec in specs:
        name, written = parsed[spec]
        try:
            registry.convert_values(name, params[name], {**dict(k for k in keys if k[0] in params[name]), **written})
        except ValueError as err:
            raise UsageError(f"bad policy {spec!r}: {err}") from None
    check = getattr(config_cls, "check_arguments", None)
    if check is not None:
        check(unchecked_config(config_cls, values))


def unchecked_config(config_cls: type, values: dict[str, Any]) -> Any:
    """An instance of the dataclass ``config_cls`` with ``values`` (defaults for the rest), not validated.

    For a config's own checks before JAX is imported: ``__post_init__`` is not run.
    """
    config = object.__new__(config_cls)
    for field in dataclasses.fields(config_cls):
        if field.name in values:
            value = values[field.name]
        elif field.default is not dataclasses.MISSING:
            value = field.default
        else:
            value = field.default_factory()
        object.__setattr__(config, field.name, value)
    return config


def exit_on_argument_error(config_cls: type, module: str) -> None:
    """:func:`check_before_imports` on ``sys.argv``: on a mistake, print one ``error:`` line and exit 2.

    Args:
      config_cls: the CLI's config dataclass.
      module: the CLI's module (``"train.ptb"``), for its name in the message.
    """
    try:
        check_before_imports(config_cls, sys.argv[1:], prog=program_name(module))
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE) from None


def require_keys_given_once(
    specs: Sequence[str],
    keys: Sequence[tuple[str, str]],
    flags: dict[str, str],
    params: dict[str, dict[str, registry.Param]],
    *,
    parsed: dict[str, tuple[str, dict[str, str]]] | None = None,
) -> None:
    """Each policy-key flag's value must be valid for every spec that takes the key, and a key
    written in a ``--policy`` spec and given as a flag must have one value in both.

    Values are compared as the key reads them: ``--policy every_k:k=4 --k 4`` and
    ``--policy auto:budget=1GiB --budget 1024MiB`` are accepted, ``--policy every_k:k=4 --k 2`` is
    refused, and ``--policy every_k:k=4 --k 4.0`` gets the key's own error (not an integer). Specs that do not parse, or name a policy
    ``params`` lacks, are left to the spec's own checks.

    Args:
      specs: the ``--policy`` specs the user gave.
      keys: the policy-key flags given, as ``(key, raw value)`` pairs.
      flags: each key's flag (``{"k": "--k"}``), for the message.
      params: each policy's keys, by policy name.
      parsed: the specs already parsed (``registry.parse_spec``), by spec; the others are parsed here.

    Raises:
      UsageError: a flag's value that the key refuses, with the flag and the key's own message;
        or two different values, naming the flag, the spec and both values.
    """
    for spec in specs:
        try:
            name, written = parsed[spec] if parsed and spec in parsed else registry.parse_spec(spec)
        except ValueError:
            continue
        table = params.get(name, {})
        for key, value in keys:
            if key not in table:
                continue
            flag = flags.get(key, flag_name(key))
            try:
                given = registry.convert_values(name, {key: table[key]}, {key: value})[key]
            except ValueError as err:
                raise UsageError(f"{flag} {value}: {err}") from None
            if key not in written:
                continue
            try:
                ours = registry.convert_values(name, {key: table[key]}, {key: written[key]})[key]
            except ValueError as err:
                raise UsageError(f"bad policy {spec!r}: {err}") from None
            if _comparable(ours) != _comparable(given):
                raise UsageError(f"{flag} {value} conflicts with {key}={written[key]} in --policy {spec}; give it once")


def _comparable(value: Any) -> Any:
    """A parsed key value as compared for sameness: a budget by its bytes or fraction, not its text."""
    return (value.bytes, value.fraction) if isinstance(value, Budget) else value


def run_main(body: Callable[[], int]) -> int:
    """Run a CLI's ``body``; a :class:`UsageError` prints ``error: <message>`` and returns 2.

    ``--help`` returns 0 after the help is printed.
    """
    try:
        return body()
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except SystemExit as exit_:
        return int(exit_.code or 0)
