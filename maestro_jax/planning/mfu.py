"""Model FLOPs utilization: what share of its devices' peak a step, and each section, spent on the
model's own FLOPs. Plain Python, no JAX.

A step's model FLOPs are each section's declared `UnitCost` over the samples it runs
(`UnitCost.forward_flops`: the weight matmuls, 2 FLOPs a weight a unit, plus attention over the
sample's context, causal attention counted at half), times 3 for a trained section (forward,
input gradient, weight gradient) and 1 for a frozen one (forward only: nothing backpropagates
through a frozen section, `schedule.Problem.needs_backward`). Recomputation under activation
checkpointing and the padding of rows to their bucket are not model FLOPs and are not counted:
MFU, not hardware FLOPs utilization.

For a decoder LLM this is MaxText's `calculate_tflops_training_per_device`
(`src/maxtext/utils/maxtext_utils.py`): 3 x ((FFN + QKV + output projection) x layers + the output
layer) plus 3 x causal attention x layers, causal attention halved as MaxText does since 2025
(after Megatron-LM and NeMo; NVIDIA's dgxc-benchmarking MFU counts it whole, so its MFU reads
higher for the same run). `tests/test_mfu.py` holds the two to MaxText's number for a Llama 3
8B-shaped model at 8192 tokens. Two differences: the input embedding lookup is no FLOPs in
either; a MoE section counts the router and its experts_per_token experts (MaxText's dropless
count) only where its dispatch runs them sparsely (`workloads.costs.llm_cost`).

The step's MFU is its model FLOPs over (the devices the plan uses x the step's time x the peak);
a section's is its own FLOPs over (its own devices x the step's time x the peak): the share of
its devices' step the section filled, which says which section to give more devices. (A
section's busy time alone would need device timers the run does not keep.)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping

from maestro_jax.core.graph import SectionGraph, ask, sample_view

# Dense bfloat16 peak FLOP/s of one device, by a piece of JAX's `device_kind`, most specific first
# (H100 PCIe before H100). Sources: the vendors' datasheets, which list NVIDIA's Tensor Core
# figures "with sparsity" (dense is half) and Google's per chip:
#   H100 SXM, H200: "BFLOAT16 Tensor Core 1,979 teraFLOPS" with sparsity (H100 and H200 datasheets);
#     989e12 is also the peak NVIDIA's recipes divide by (github.com/NVIDIA/dgxc-benchmarking,
#     "H100 ... BF16 989"), and `cost.DEVICES`;
#   H100 PCIe: "BFLOAT16 Tensor Core 1,513 teraFLOPS" with sparsity (H100 datasheet);
#   A100: "BFLOAT16 Tensor Core 312 TFLOPS | 624 TFLOPS*" (* with sparsity; A100 datasheet);
#   TPU v4 275, v5e 197, v5p 459, v6e (Trillium) 918 TFLOP/s bf16 a chip (cloud.google.com/tpu/docs,
#     "TPU v4", "TPU v5e", "TPU v5p", "TPU v6e" system architecture pages).
PEAKS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756.5e12),
    ("H100", 989e12),
    ("H200", 989e12),
    ("A100", 312e12),
    ("TPU v4", 275e12),
    ("TPU v5 lite", 197e12),
    ("TPU v5e", 197e12),
    ("TPU v5p", 459e12),
    ("TPU v5", 459e12),
    ("TPU v6 lite", 918e12),
    ("TPU v6e", 918e12),
)


def datasheet_peak(device_kind: str) -> float | None:
    """The dense bf16 peak of a JAX `device_kind` ("NVIDIA H100 80GB HBM3", "TPU v5 lite"), or
    None for a device the table does not know (a CPU)."""
    kind = device_kind.lower()
    return next((peak for name, peak in PEAKS if name.lower() in kind), None)


def step_flops(graph: SectionGraph, samples: Iterable) -> dict[str, float]:
    """Each section's model FLOPs for one optimizer step over `samples` (module docstring)."""
    infos = [sample_view(s) for s in samples]
    out = {}
    for section in graph.sections:
        forward = sum(
            section.cost.forward_flops(ask(section, "work", info)) for info in infos if ask(section, "activates", info)
        )
        out[section.name] = forward * (3.0 if section.trained else 1.0)
    return out


@dataclasses.dataclass(frozen=True)
class Utilization:
    """A step's MFU and each section's (fractions of the peak; module docstring)."""

    step: float
    sections: Mapping[str, float]

    def record(self) -> dict[str, float]:
        """As a metrics record's keys: `perf/mfu` and `perf/mfu/<section>`."""
        return {"perf/mfu": self.step, **{f"perf/mfu/{s}": v for s, v in self.sections.items()}}


def utilization(
    flops: Mapping[str, float], devices: Mapping[str, Iterable[int]], seconds: float, peak: float
) -> Utilization:
    """`flops` (by section) over `seconds` on each section's `devices` at `peak` FLOP/s a device;
    the step over the devices any section uses (co-located sections share theirs)."""
    used = {s: set(d) for s, d in devices.items()}
    every = set().union(*used.values()) if used else set()
    step = sum(flops.values()) / (len(every) * seconds * peak) if every else 0.0
    return Utilization(step, {s: f / (len(used[s]) * seconds * peak) for s, f in flops.items() if used.get(s)})
