"""MFU in every run's records: `perf/mfu` for the step and `perf/mfu/<section>` for each section
(`planning.mfu`: what is counted, against which devices and time), against the peak `peak_of`
finds for this machine's devices, said once at the start of a run."""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp

from maestro_jax.core.graph import SectionGraph
from maestro_jax.planning.mfu import datasheet_peak, step_flops, utilization

MATMUL = 512  # the side of the float32 matmul a CPU's peak is measured on


@functools.cache
def measured_peak() -> float:
    """FLOP/s of one float32 matmul of MATMUL x MATMUL on the default device, the best of 5
    timed calls after a warm-up: a CPU has no datasheet bf16 peak. On the CLI's 8 virtual CPU
    devices every device shares the machine's cores, so a CPU run's MFU checks the plumbing; it
    is not a figure to compare."""
    x = jnp.ones((MATMUL, MATMUL), jnp.float32)
    f = jax.jit(lambda a: a @ a)
    jax.block_until_ready(f(x))
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        jax.block_until_ready(f(x))
        best = min(best, time.perf_counter() - t0)
    return 2 * MATMUL**3 / best


def peak_of(given: float | None, device_kind: str) -> tuple[float, str]:
    """The peak FLOP/s of one device, and where it comes from: the config's `peak_flops`, else
    the card's datasheet figure (`planning.mfu.PEAKS`), else (a CPU) `measured_peak`."""
    if given is not None:
        return given, "the config's peak_flops"
    peak = datasheet_peak(device_kind)
    if peak is not None:
        return peak, f"the {device_kind} datasheet's dense bf16 peak"
    return measured_peak(), f"one {MATMUL}x{MATMUL} float32 matmul timed on {device_kind} (no datasheet peak)"


@dataclasses.dataclass(frozen=True)
class MfuMeter:
    """What a run's records need to carry MFU: the graph (each section's cost and work), each
    section's devices (the plan's) and the peak."""

    graph: SectionGraph
    devices: Mapping[str, Sequence[int]]
    peak: float
    source: str

    @classmethod
    def for_run(cls, graph: SectionGraph, devices: Mapping[str, Sequence[int]], given: float | None) -> MfuMeter:
        peak, source = peak_of(given, jax.devices()[0].device_kind)
        return cls(graph, devices, peak, source)

    def record(self, samples: Sequence, seconds: float) -> dict[str, float]:
        """`perf/mfu` and `perf/mfu/<section>` of one step over `samples` that took `seconds`."""
        return utilization(step_flops(self.graph, samples), self.devices, seconds, self.peak).record()

    def describe(self) -> str:
        return f"MFU against {self.peak / 1e12:.3g} TFLOP/s a device ({self.source})"
