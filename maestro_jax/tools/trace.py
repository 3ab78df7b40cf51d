"""Timelines as Chrome/Perfetto trace JSON and as a PNG Gantt chart (one row per section)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

COLORS = {"F": "#4C78A8", "B": "#E45756", "X": "#72B7B2", "XB": "#F58518", "U": "#54A24B"}


def rows_of(intervals: Iterable) -> list[tuple[str, str, str, float, float]]:
    """(row, kind, label, start_s, end_s) from simulator Intervals or recorded (op, start, end)."""
    out = []
    for item in intervals:
        op, start, end = (item.op, item.start, item.end) if hasattr(item, "op") else item[:3]
        row = f"{op.section}" if op.kind in ("F", "B", "U") else f"transfer {op.edge}"
        out.append((row, op.kind, str(op), float(start), float(end)))
    return out


def write_chrome_trace(intervals: Iterable, path: str | Path, time_scale: float = 1e6) -> Path:
    """Chrome trace events ('X' complete events); open in chrome://tracing or ui.perfetto.dev."""
    rows = rows_of(intervals)
    names = sorted({r[0] for r in rows})
    events = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": i, "args": {"name": n}} for i, n in enumerate(names)]
    for row, kind, label, start, end in rows:
        events.append(
            {
                "name": label,
                "cat": kind,
                "ph": "X",
                "pid": 0,
                "tid": names.index(row),
                "ts": start * time_scale,
                "dur": max(end - start, 0.0) * time_scale,
            }
        )
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    return path


def write_gantt(intervals: Iterable, path: str | Path, title: str = "") -> Path:
    """One row per section (and per transfer link), one bar per micro-step, F and B coloured apart."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows_of(intervals) if r[4] > r[3]]
    names = sorted({r[0] for r in rows}, key=lambda n: (n.startswith("transfer"), n))
    fig, ax = plt.subplots(figsize=(12, 1.0 + 0.6 * len(names)))
    for row, kind, label, start, end in rows:
        y = names.index(row)
        ax.barh(y, end - start, left=start, color=COLORS.get(kind, "grey"), edgecolor="black", linewidth=0.3)
        if len(rows) <= 80:
            ax.text(
                start + (end - start) / 2,
                y,
                label.split("(")[1].rstrip(")").split(",")[-1],
                ha="center",
                va="center",
                fontsize=6,
                color="white",
            )
    ax.set_yticks(range(len(names)), names)
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLORS.values()]
    ax.legend(
        handles,
        ["forward", "backward", "transfer", "cotangent transfer", "update"],
        loc="upper right",
        fontsize=7,
        ncol=5,
    )
    ax.set_title(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
