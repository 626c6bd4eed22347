"""The keys of the built-in policies (:mod:`jremat.policies`), declared once and without JAX.

The policies register with these tables, and the command-line tools check a ``--policy`` and
its key flags against them before JAX is imported (``jremat.train.cli.check_before_imports``).
A key whose value is another policy's spec (kind ``"spec"``) is checked only by the registry.
"""

from __future__ import annotations

from typing import Any

from jremat._apply.registry import REQUIRED, Param
from jremat._spec.budget import parse_budget

#: ``skip_cheap``'s default threshold, in recompute FLOPs per byte kept.
DEFAULT_MIN_FLOPS_PER_BYTE = 8.0


def parse_nest(value: Any) -> int | str | None:
    """Check a :attr:`jremat.RematConfig.nest` value: ``None``, ``"auto"`` or a positive integer (or its text).

    Raises:
      ValueError: on anything else.
    """
    if value is None or value == "auto":
        return value
    message = f"nested: block must be 'auto' or a positive integer, got {value!r}"
    if isinstance(value, bool):
        raise ValueError(message)
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise ValueError(message) from None
    if number < 1 or (not isinstance(value, str) and number != value):
        raise ValueError(message)
    return number


def _parse_block(raw: str):
    try:
        return parse_nest(raw)
    except ValueError:
        raise ValueError(f"policy 'nested': block must be 'auto' or a positive integer, got {raw!r}") from None


def _parse_layer(raw: str) -> str:
    from jremat._apply.registry import resolve  # builds the layer's policy: loads the built-ins (and JAX)

    try:
        resolve(raw.replace(";", ","))  # refuses a nested layer= (a layer-stack spec)
    except ValueError as err:
        raise ValueError(f"policy 'nested': layer={raw!r}: {err}") from None
    return raw


_MIN_FLOPS_PER_BYTE_HELP = "recompute FLOPs per saved byte below which an op is cheap"

#: What ``selective`` may recompute, by Megatron-LM's ``--recompute-modules`` names: the attention
#: core and the experts' activation.
SELECTIVE_MODULES = ("core_attn", "moe_act")


def _parse_modules(raw: str) -> tuple[str, ...]:
    chosen = tuple(dict.fromkeys(m for m in raw.split("+") if m))
    unknown = [m for m in chosen if m not in SELECTIVE_MODULES]
    if not chosen or unknown:
        raise ValueError(
            f"policy 'selective': modules={raw!r}: {'unknown ' + ', '.join(map(repr, unknown)) if unknown else 'empty'}; "
            f"valid: {', '.join(SELECTIVE_MODULES)}, joined by '+'"
        )
    return chosen


#: Every built-in policy's keys, by policy name (an empty table: the policy takes no keys).
BUILTIN_PARAMS: dict[str, dict[str, Param]] = {
    "auto": {
        "budget": Param(
            "str", "0.5", "a size (6GiB, 512MiB) or a fraction in (0, 1]", parse=parse_budget, format=lambda b: b.text
        )
    },
    "dots": {},
    "dots_no_batch": {
        "per_call": Param("bool", False, "judge each call's own program, before a vmap around it (pipeline stages)")
    },
    "every_k": {
        "k": Param("int", 4, "save one compute op in every k", min=1),
        "skip_cheap": Param("bool", False, "number only ops that skip_cheap would keep"),
        "min_flops_per_byte": Param(
            "float", DEFAULT_MIN_FLOPS_PER_BYTE, "cheapness threshold when skip_cheap=true", min=0.0
        ),
    },
    "full": {},
    "names": {"save": Param("names", REQUIRED, "checkpoint_name tags to save, joined by '+'")},
    "names_except": {"exclude": Param("names", REQUIRED, "checkpoint_name tags not to save, joined by '+'")},
    "nested": {
        "block": Param(
            "str", "auto", "layers per group: auto or an integer dividing n_layers", parse=_parse_block, format=str
        ),
        "layer": Param("spec", "none", "per-layer policy inside a group (';' for ',')", parse=_parse_layer),
    },
    "none": {},
    "offload": {
        "names": Param("names", REQUIRED, "tensor names to offload to host, joined by '+'"),
        "save": Param("names", (), "tensor names to keep on the device, joined by '+'"),
    },
    "selective": {
        "modules": Param(
            "names",
            SELECTIVE_MODULES,
            "what to recompute, joined by '+': core_attn (the attention core), moe_act (the experts' activation)",
            parse=_parse_modules,
            format="+".join,
        )
    },
    "skip_cheap": {"min_flops_per_byte": Param("float", DEFAULT_MIN_FLOPS_PER_BYTE, _MIN_FLOPS_PER_BYTE_HELP, min=0.0)},
}
