"""How the report writes numbers and tables: percentages, ratios, SI figures, a row's absolute figures."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def percent(x) -> str:
    """``0.123`` -> ``12.3%`` (``n/a`` when not measured)."""
    return "n/a" if x in (None, "") else f"{100 * x:.1f}%"


def ratio(x) -> str:
    """``1.05`` -> ``1.050x`` (``n/a`` when not measured)."""
    return "n/a" if x in (None, "") else f"{x:.3f}x"


def step_time(r: dict) -> str:
    """A row's median step, in ms below a second ("" when not timed)."""
    x = r.get("step_s", "")
    return "" if x in (None, "") else (f"{1e3 * x:.3g} ms" if x < 1 else f"{x:.3g} s")


def si(x) -> str:
    """``12345.6`` -> ``12.3k`` (3 significant digits)."""
    if x in (None, ""):
        return ""
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.3g}{suffix}"
    return f"{x:.3g}"


#: The absolute columns of every timed table (:func:`absolute`); MFU is against the dense bf16 peak.
ABSOLUTE_HEADER = ("step", "tokens/s", "TFLOP/s", "MFU (bf16 peak)")


def absolute(r: dict) -> list[str]:
    """Step time, tokens/s, model TFLOP/s per device and MFU of a timed row ("" where not measured or no peak)."""
    tflops, mfu = r.get("model_tflops_per_s", ""), r.get("mfu", "")
    return [
        step_time(r),
        si(r.get("tokens_per_s", "")),
        "" if tflops in (None, "") else f"{tflops:.3g}",
        "" if mfu in (None, "") else f"{100 * mfu:.3g}%",
    ]


def quartiles(r: dict) -> str:
    """``1.050x (1.040-1.060)``: the time ratio and its quartiles."""
    return f"{ratio(r['time_ratio_vs_none'])} ({r['time_ratio_low']:.3f}-{r['time_ratio_high']:.3f})"


def precision(r: dict) -> str:
    """``float32, attention explicit``: a row's compute dtype and attention."""
    return f"{r['dtype']}, attention {r.get('attention') or 'explicit'}"


def table(header: Sequence[str], lines: Sequence[Sequence[Any]]) -> list[str]:
    """A markdown table, then an empty line."""
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return out + ["| " + " | ".join(str(c) for c in line) + " |" for line in lines] + [""]


def image(name: str, plots: Sequence[str], plot_dir: str) -> list[str]:
    """The markdown of plot ``name`` and an empty line, if it was written ([] if not)."""
    return [f"![{name}]({plot_dir}/{name})", ""] if name in plots else []
