"""How the planning half's figures read in a line of text: durations, rates, meshes and
checkpointing. Here, beside the values, so that a typed result (`baselines.BaselineResult`) renders
itself and `plan`, `simulate` and `bench` print one format. Plain Python, no JAX."""

from __future__ import annotations

from collections.abc import Mapping


def seconds(t: float) -> str:
    """A duration in the unit that keeps 3 significant digits in view (`5.32 s`, `12.4 ms`,
    `812 µs`), so that a tiny config's step does not print as `0.00`."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):  # noqa: B007 - `unit` is read after the loop
        if abs(t) >= scale * (1 - 5e-4):  # 0.9997 s is `1.00 s`, not `1000 ms`
            break
    else:
        unit, scale = ("ns", 1e-9) if t else ("s", 1.0)
    return f"{digits(t / scale)} {unit}"


def rate(x: float) -> str:
    """A throughput with 3 significant digits (thousands grouped: `13,269`, `24.4`, `0.381`)."""
    return digits(x) if abs(x) < 1000 else f"{x:,.0f}"


def digits(x: float) -> str:
    """`x` with 3 significant digits, never in exponent form below 1000."""
    a = abs(x)
    if a == 0 or a >= 100:
        return f"{x:.0f}"
    if a >= 10:
        return f"{x:.1f}"
    if a >= 1:
        return f"{x:.2f}"
    return f"{x:#.3g}"


def mesh_text(mesh: Mapping[str, int]) -> str:
    """A mesh as `data=4 tensor=2` (axes of size 1 left out; `data=1` for one device)."""
    return " ".join(f"{a}={n}" for a, n in mesh.items() if n > 1) or "data=1"


def layer_remat_text(remat: str | Mapping[str, str]) -> str:
    """A monolithic layout's activation checkpointing for a line of text: one policy, or each
    section's (`baselines.monolithic_best` chooses per section)."""
    if isinstance(remat, str):
        return remat
    return ", ".join(f"{s} {r}" for s, r in remat.items())
