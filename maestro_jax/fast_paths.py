"""The defaults of the GPU fast paths, as one table decided by measurement (no JAX).

Each fast path (an attention form, the MoE dispatch, CUDA graphs, scanned micro-steps) is a
`Lever`: the value that runs without it (`baseline`), the value it offers (`candidate`), the rule
(the candidate is the default when a GPU measured it at least `min_speedup` times as fast as the
baseline at every timed shape) and the measurement the rule was applied to, with the record that
holds it. Where no GPU has timed a lever yet, `unmeasured` says which value runs and why. The code
reads its defaults from here (`models.llm.AUTO_DISPATCH`, `models.attention.choose_kernel`,
`config.CompileConfig`), and the GPU check (`scripts/gpu_check.py`, `tools.levers.decisions`)
prints each lever's measured ratio beside the rule and the default it implies, so that the next
GPU run changes a `Measured` entry here, not the logic that reads it.

`min_speedup` is 1.1 for every lever: a lever is turned on only for a gain clearly above the
spread of median timings between runs, not for a tie. It was chosen before any lever was timed
and is not fitted to a measurement.
"""

from __future__ import annotations

import dataclasses
from typing import Any

MIN_SPEEDUP = 1.1


@dataclasses.dataclass(frozen=True)
class Measured:
    """A lever's candidate timed beside its baseline on a GPU: `speedup` = baseline time /
    candidate time (the smallest over the timed shapes), on `card`, `date`, recorded in `source`."""

    speedup: float
    card: str
    date: str
    source: str


@dataclasses.dataclass(frozen=True)
class Lever:
    """One fast path and the rule that decides its default (module docstring)."""

    name: str  # what a user sets, or what the code chooses
    baseline: Any  # what runs without the lever
    candidate: Any  # what the lever runs
    unmeasured: Any  # what runs until a GPU has timed it (baseline or candidate)
    why_unmeasured: str
    measured: Measured | None = None
    min_speedup: float = MIN_SPEEDUP

    @property
    def default(self) -> Any:
        """The value the code runs: the rule applied to the measurement, else `unmeasured`."""
        if self.measured is None:
            return self.unmeasured
        return self.decide(self.measured.speedup)

    def decide(self, speedup: float | None) -> Any:
        """The default a measured `speedup` implies (None: no measurement, `unmeasured`)."""
        if speedup is None:
            return self.unmeasured
        return self.candidate if speedup >= self.min_speedup else self.baseline

    @property
    def rule(self) -> str:
        return (
            f"{self.name}: {self.candidate!r} when a GPU times it >= {self.min_speedup:g}x {self.baseline!r} "
            f"at every timed shape, else {self.baseline!r}"
        )

    def why(self) -> str:
        """One line: the default and what decided it."""
        if self.measured is None:
            return f"{self.name} = {self.default!r}: not timed on a GPU yet; {self.why_unmeasured}"
        m = self.measured
        return f"{self.name} = {self.default!r}: {m.speedup:.2f}x {self.baseline!r} on {m.card} ({m.date}, {m.source})"


LEVERS: tuple[Lever, ...] = (
    Lever(
        "attention.causal",
        baseline="mask",
        candidate="causal",
        unmeasured="causal",
        why_unmeasured="",
        measured=Measured(
            3.1,  # 6.59 ms -> 2.13 ms forward+backward, Llama-3.1-8B-shaped rows, 2 x 4096 tokens
            "NVIDIA H200",
            "2026-11-27",
            'benchmarks/log/gpu.md, "The second GPU run": the causal mask vs is_causal on cuDNN',
        ),
    ),
    Lever(
        "attention.padded",
        baseline="mask",
        candidate="padded",
        unmeasured="padded",
        why_unmeasured="the same cuDNN kernel as the causal form, without the B x Q x K bias it read there (3.1x)",
    ),
    Lever(
        "attention.packed",
        baseline="mask",
        candidate="packed",
        unmeasured="packed",
        why_unmeasured="cuDNN's segment lengths in place of a B x Q x K bias, as the causal form (3.1x); "
        "only where jax >= 0.11.2 on Hopper (models.attention.choose_kernel)",
    ),
    Lever(
        "moe_dispatch auto (NVIDIA)",
        baseline="sparse",
        candidate="grouped",
        unmeasured="sparse",
        why_unmeasured="sparse ran at 12-15% of the bf16 peak on an H200 (benchmarks/log/gpu.md); "
        "tokamax's grouped GEMM has not run beside it",
    ),
    Lever(
        "compile.cuda_graph_min_thunks",
        baseline=None,
        candidate=1,
        unmeasured=None,
        why_unmeasured="XLA's own threshold (5 thunks) until every program as one graph is timed",
    ),
    Lever(
        "compile.scan_micro_steps",
        baseline=1,
        candidate=8,
        unmeasured=1,
        why_unmeasured="one program a micro-step until a scan of 8 is timed against 8 launches",
    ),
)

BY_NAME = {lever.name: lever for lever in LEVERS}


def default(name: str) -> Any:
    """The value lever `name` runs (`Lever.default`)."""
    return BY_NAME[name].default
