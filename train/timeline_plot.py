"""``python -m train.memory --timeline out.png``: memory timelines of several policies, drawn and tabulated.

One curve per policy on shared axes (schedule position, MiB), each policy's peak marked and its
compiled peak drawn as a dashed line; the spans of the top-level layer loops are shaded (a loop
body is scheduled once, so positions inside a span show one iteration; see
:mod:`jremat._measure.timeline`). Below the curves, one table per policy lists the ten largest buffers
live at its peak. The same tables are printed as text by :func:`format_timelines`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from jremat import MemoryTimeline, TimelineBuffer, format_bytes

#: Buffers listed per policy, in the figure and in the printed tables.
TOP_BUFFERS = 10


def png_path_problem(path) -> str | None:
    """Why ``path`` cannot take a PNG file, or ``None`` if it can (checked before any compile).

    Args:
      path: the ``--timeline`` value.
    """
    if not isinstance(path, str) or not path.strip():
        return "give a file path ending in .png"
    if os.path.isdir(path):
        return "is a directory; give a file path ending in .png"
    suffix = os.path.splitext(path)[1]
    if suffix.lower() != ".png":
        return f"the file name must end in .png, got {suffix or 'no suffix'!r}"
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.exists(parent):
        return f"directory {parent!r} does not exist"
    if not os.path.isdir(parent):
        return f"{parent!r} is not a directory"
    if not os.access(parent, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        return f"no permission to write in {parent!r}"
    return None


def timeline_json(timeline: MemoryTimeline, top: int = TOP_BUFFERS) -> dict:
    """A JSON-ready summary of ``timeline``: peak, agreement with the compiled peak, loops, the ``top``
    largest buffers at the peak (``top_buffers``) and all of them (``buffers_at_peak``); not the curve."""
    return {
        "positions": len(timeline.live_bytes),
        "peak_position": timeline.peak_position,
        "peak_bytes": timeline.peak_bytes,
        "compiled_peak_bytes": timeline.compiled_peak_bytes,
        "agreement": timeline.agreement,
        "loops": [
            {
                "instruction": lp.instruction,
                "start_position": lp.start_position,
                "end_position": lp.end_position,
                "trip_count": lp.trip_count,
                "op_name": lp.op_name,
            }
            for lp in timeline.loops
        ],
        "top_buffers": [_buffer_json(b) for b in timeline.top_buffers[:top]],
        "buffers_at_peak": [_buffer_json(b) for b in timeline.top_buffers],
        "notes": list(timeline.notes),
    }


def _buffer_json(b: TimelineBuffer) -> dict:
    return {
        "name": b.name,
        "kind": b.kind,
        "size_bytes": b.size_bytes,
        "shape": b.shape,
        "instruction": b.instruction,
        "source": b.source,
        "start_position": b.start_position,
        "end_position": b.end_position,
    }


def format_timelines(rows: Sequence, top: int = TOP_BUFFERS) -> str:
    """The text tables: for each row with a timeline, its peak line and the ``top`` buffers there."""
    parts = []
    for row in rows:
        if row.timeline is None:
            continue
        parts.append(f"timeline [{row.policy}]: " + row.timeline.table(top))
        parts.extend(f"  note: {n}" for n in row.timeline.notes[1:])
    if parts:
        parts.append(f"timeline {rows[0].timeline.notes[0]}" if rows[0].timeline is not None else "")
    return "\n".join(p for p in parts if p)


def legend_label(policy: str, timeline: MemoryTimeline) -> str:
    """A curve's legend entry: the policy and its timeline's peak (:func:`jremat.format_bytes`, so
    peaks a few KiB apart read apart)."""
    return f"{policy}: peak {format_bytes(timeline.peak_bytes)}"


def _table_lines(timeline: MemoryTimeline, top: int) -> list[str]:
    lines = [f"{'bytes':>10}  {'kind':<16} {'name':<30} {'shape':<24} {'live':>9}  source"]
    for b in timeline.top_buffers[:top]:
        lines.append(
            f"{format_bytes(b.size_bytes):>10}  {b.kind:<16} {b.name[:30]:<30} {b.shape.split('{')[0][:24]:<24} "
            f"{b.start_position:>4}-{b.end_position:<4}  {b.source}"
        )
    return lines


def write_timeline_png(rows: Sequence, path: str, top: int = TOP_BUFFERS, scope: str = "") -> None:
    """Draw the timelines of ``rows`` (rows of ``train.memory`` with a timeline) to ``path`` (PNG);
    ``scope`` ends the title (``", per device on mesh fsdp=8"``).

    Raises:
      ValueError: if no row has a timeline.
      OSError: if the file cannot be written (the CLI checks the path before compiling).
    """
    rows = [r for r in rows if r.timeline is not None]
    if not rows:
        raise ValueError("no policy has a memory timeline to draw")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mib = 2**20
    n = len(rows)
    fig = plt.figure(figsize=(13.0, 4.6 + 2.0 * n))
    grid = fig.add_gridspec(1 + n, 1, height_ratios=[4.6] + [2.0] * n, hspace=0.35)
    ax = fig.add_subplot(grid[0])
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, row in enumerate(rows):
        tl, color = row.timeline, colors[i % len(colors)]
        ys = [b / mib for b in tl.live_bytes]
        ax.plot(range(len(ys)), ys, color=color, lw=1.4, label=legend_label(row.policy, tl))
        ax.plot([tl.peak_position], [tl.peak_bytes / mib], "o", color=color, ms=7)
        ax.annotate(
            f"peak {row.policy}",
            (tl.peak_position, tl.peak_bytes / mib),
            textcoords="offset points",
            xytext=(6, 6),
            color=color,
            fontsize=8,
        )
        if tl.compiled_peak_bytes:
            ax.axhline(tl.compiled_peak_bytes / mib, color=color, lw=0.8, ls="--", alpha=0.7)
        for lp in tl.loops:
            if lp.end_position - lp.start_position >= 0.02 * len(ys):
                ax.axvspan(lp.start_position, lp.end_position, color=color, alpha=0.06)
    ax.set_xlabel("position in the compiled schedule (instructions; a shaded loop body is one iteration)")
    ax.set_ylabel("live MiB")
    first = rows[0]
    ax.set_title(
        f"memory timeline of the gradient step, {first.n_layers} layers, batch {first.batch_size} x "
        f"{first.seq_len}{scope} (dashed: compiled peak)"
    )
    ax.legend(loc="upper left", fontsize=8)
    ax.grid(alpha=0.3)
    for i, row in enumerate(rows):
        tax = fig.add_subplot(grid[1 + i])
        tax.axis("off")
        tl = row.timeline
        head = (
            f"{row.policy}: top {top} buffers at the peak (position {tl.peak_position}, "
            f"{format_bytes(tl.peak_bytes)}; compiled peak {format_bytes(tl.compiled_peak_bytes or 0)})"
        )
        tax.text(
            0.0,
            1.0,
            "\n".join([head] + _table_lines(tl, top)),
            family="monospace",
            fontsize=7.5,
            va="top",
            ha="left",
            color=colors[i % len(colors)],
            transform=tax.transAxes,
        )
    try:
        fig.savefig(path, format="png", dpi=110, bbox_inches="tight")
    finally:
        plt.close(fig)
