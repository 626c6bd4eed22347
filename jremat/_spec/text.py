"""Policy spec strings (``NAME`` or ``NAME:key=value,...``, :mod:`jremat.registry`) and the values
of their keys: the :class:`Param` a key is declared with, parsing and checking a value (given as
spec text or as a Python object), and writing values back as a canonical spec. Imports no JAX.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import re
from collections.abc import Callable
from typing import Any


@dataclasses.dataclass(frozen=True)
class Param:
    """One key a policy spec accepts.

    Attributes:
      kind: ``"int"``, ``"float"``, ``"bool"``, ``"str"``, ``"names"`` (``+``-joined list) or
        ``"spec"`` (another policy's spec, written with ``;`` for ``,`` and ``=`` kept).
      default: the value when the key is absent; ``REQUIRED`` makes it mandatory.
      help: one line for ``--help`` and docs.
      min: lower bound for numbers (inclusive).
      parse: optional custom parser ``str -> value`` raising ``ValueError``.
      format: optional writer ``value -> str`` for values :attr:`parse` returns, so that the
        canonical spec reads back to the same value.
    """

    kind: str
    default: Any
    help: str
    min: float | None = None
    parse: Callable[[str], Any] | None = None
    format: Callable[[Any], str] | None = None


REQUIRED = object()


#: A policy name: an identifier.
NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def parse_spec(spec: str) -> tuple[str, dict[str, str]]:
    """Split ``NAME`` or ``NAME:key=value,...`` into the name and raw string values.

    Raises:
      ValueError: if the string is malformed; the message shows the expected form.
    """
    form = "expected NAME or NAME:key=value[,key=value...]"
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"malformed policy spec {spec!r}: {form}")
    name, sep, rest = spec.strip().partition(":")
    if not NAME_RE.match(name):
        raise ValueError(f"malformed policy spec {spec!r}: bad name {name!r}; {form}")
    values: dict[str, str] = {}
    if sep:
        if not rest:
            raise ValueError(f"malformed policy spec {spec!r}: nothing after ':'; {form}")
        for part in rest.split(","):
            key, eq, value = part.partition("=")
            if not eq or not key or not value:
                raise ValueError(f"malformed policy spec {spec!r}: {part!r} is not key=value; {form}")
            if key in values:
                raise ValueError(f"malformed policy spec {spec!r}: key {key!r} given twice")
            values[key] = value
    return name, values


def value_as_text(policy: str, key: str, param: Param, value: Any) -> str:
    """Write a value given as a Python object the way a spec string would give it."""
    where = f"policy {policy!r}: {key}"
    if isinstance(value, str):
        return value
    if param.kind == "bool":
        if isinstance(value, bool):
            return "true" if value else "false"
        raise ValueError(f"{where} must be true or false, got {value!r} ({type(value).__name__})")
    if isinstance(value, bool):
        raise ValueError(f"{where} must be {_KIND_WORDS.get(param.kind, 'a ' + param.kind)}, got {value!r}")
    if param.kind == "names":
        if isinstance(value, (list, tuple)) and all(isinstance(n, str) and n and "+" not in n for n in value):
            return "+".join(value)
        raise ValueError(f"{where} must be names (strings without '+'), got {value!r}")
    if param.format is not None:
        try:
            return param.format(value)
        except (TypeError, AttributeError, ValueError):
            pass
    if param.kind in ("int", "float") and isinstance(value, numbers.Real):
        return str(value)
    if param.kind == "spec" and hasattr(value, "spec"):
        return value.spec.replace(",", ";")
    raise ValueError(f"{where} must be {_KIND_WORDS.get(param.kind, 'a ' + param.kind)}, got {value!r}")


_KIND_WORDS = {
    "int": "an integer",
    "float": "a number",
    "bool": "true or false",
    "names": "names joined by '+'",
    "spec": "a policy spec",
    "str": "a string",
}


def _convert(policy: str, key: str, param: Param, raw: Any) -> Any:
    """Parse one key's value; typed values are written as text first and parsed the same way."""
    where = f"policy {policy!r}: {key}"
    raw = value_as_text(policy, key, param, raw)
    if param.parse is not None:
        value = param.parse(raw)
    elif param.kind == "int":
        try:
            value = int(raw)
        except ValueError:
            raise ValueError(f"{where} must be an integer, got {raw!r}") from None
    elif param.kind == "float":
        try:
            value = float(raw)
        except ValueError:
            raise ValueError(f"{where} must be a number, got {raw!r}") from None
        if not math.isfinite(value):
            raise ValueError(f"{where} must be a finite number, got {raw!r}")
    elif param.kind == "bool":
        lowered = raw.lower()
        if lowered not in ("true", "false", "1", "0", "yes", "no"):
            raise ValueError(f"{where} must be true or false, got {raw!r}")
        value = lowered in ("true", "1", "yes")
    elif param.kind == "names":
        value = tuple(n for n in raw.split("+") if n)
        if not value:
            raise ValueError(f"{where} must list at least one name joined by '+', got {raw!r}")
    else:
        value = raw
    if param.min is not None and isinstance(value, (int, float)) and not isinstance(value, bool):
        if value < param.min:
            raise ValueError(f"{where} must be >= {param.min:g}, got {raw!r}")
    return value


def convert_values(name: str, params: dict[str, Param], raw_values: dict[str, Any]) -> dict[str, Any]:
    """Every key's value for policy ``name``: each given value parsed and checked, defaults for the rest.

    Args:
      name: the policy's name, for the messages.
      params: the policy's keys.
      raw_values: the given values, as spec text or typed values.

    Raises:
      ValueError: a key ``params`` lacks, a bad value, or a required key not given.
    """
    unknown = sorted(set(raw_values) - set(params))
    if unknown:
        valid = ", ".join(params) or "(none: this policy takes no keys)"
        raise ValueError(f"unknown key {', '.join(map(repr, unknown))} for policy {name!r}; valid keys: {valid}")
    kwargs = {}
    for key, param in params.items():
        if key in raw_values:
            kwargs[key] = _convert(name, key, param, raw_values[key])
        elif param.default is REQUIRED:
            raise ValueError(f"policy {name!r} needs key {key!r} ({param.help})")
        else:
            kwargs[key] = param.default
    return kwargs


def canonical_spec(name: str, values: dict[str, Any], params: dict[str, Param] | None = None) -> str:
    """Write ``name`` and parsed ``values`` back as a spec string that resolves to the same policy.

    Args:
      name: the policy name.
      values: parsed key values.
      params: the policy's :class:`Param` table, whose ``format`` writes custom values.
    """
    params = params or {}
    if not values:
        return name
    return name + ":" + ",".join(f"{k}={_format_value(params.get(k), v)}" for k, v in values.items())


def _format_value(param: Param | None, value: Any) -> str:
    """A parsed key value written as a spec gives it (``param``'s own ``format`` first)."""
    if param is not None and param.format is not None:
        return param.format(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (tuple, list)):
        return "+".join(map(str, value))
    return str(value)
