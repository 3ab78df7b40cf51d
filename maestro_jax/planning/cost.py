"""Cost model: how long a section's micro-step, or a transfer, takes. Plain Python, no JAX.

A micro-step runs all data shards in lockstep, every row padded to the micro-step's bucket, so
its compute is
    c = micro_batch * (per_unit * B + per_unit2 * B**2),   B = bucket(max row work)
(the quadratic term is attention; B at the section's granularity, `SectionCost.padded`: the
config's `compile.buckets_per_octave`, as the runtime pads). Collectives that XLA's
latency-hiding scheduler runs beside the compute (the fsdp all-gather of the next layer's
weights, `overlapped_s` for the whole micro-step) hide behind it layer by layer: with L layers
the first layer's gather waits, and each layer then takes the longer of its compute and the
next layer's gather, so
    t(F) = overhead + (c + g) / L + (L - 1) / L * max(c, g),   g = overlapped_s
(c + g with one layer: nothing to overlap), plus the host time to issue it (`dispatch_s`), which
overlaps the device work of earlier ops. Backward costs `backward_factor` forwards; the sink's
loss-and-grad costs `sink_factor` forwards; once per step a trained section pays `update_s`, its
gradients' data-parallel reduction and its optimizer update. Two sources fill the coefficients:
  * calibrated: fitted to the compiled programs timed on the machine at hand (`calibrate.py`);
  * analytic: FLOPs against a device's peak rate and an efficiency that grows with the work per
    device per micro-step (small micro-batches and thin tensor-parallel shards run below peak).
Every analytic constant cites its source: the device datasheets for `DEVICES`, and a least-squares
fit to published H100 training runs for `efficiency` (scripts/calibrate_published.py, which
writes benchmarks/calibration.md with the rows, their sources and the errors).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from maestro_jax.core.buckets import PER_OCTAVE, bucket

# The rate of each kind of layer (`UnitCost.rate_kind`) as a factor on the dense curve's
# (`efficiency`): what one NVIDIA H200 measured per kind, the project's own blocks timed alone in
# bfloat16 (scripts/gpu_check.sh's kernels step, 2026-11-27, benchmarks/gpu_check_h200.json) and
# fitted by scripts/calibrate_gpu.py's per-kind model (benchmarks/calibration_gpu.{md,json},
# `per_kind.model.factors`): a mixture-of-experts decoder layer (width 2048, 128 experts, top 8)
# ran at 0.25 of the dense curve's rate and a ViT block (SigLIP's, width 1152) at 0.648. Applied
# because, held out (leave-one-out), it lowers the median |log error| of those rows from 1.368 to
# 0.214 (MoE, 2 rows) and from 0.454 to 0.086 (ViT, 2 rows); the dense decoder's 34 rows and the
# published training runs (dense decoders) keep the dense curve (factor 1: the fit's own). Where
# the rows fall short: they ran attention through cuDNN with an explicit mask (the path the
# attention chooser has left since for causal and padded attention, `models.attention`), which
# the ViT block's factor prices in; two rows a kind. The next GPU check's kernel rows (prepared:
# the fast forms and every MoE dispatch) refit them. The attention rows' own factor (0.25) is not
# applied: no section is attention alone, and a decoder's layers include theirs.
KIND_RATE = {"decoder": 1.0, "decoder_moe": 0.25, "vit": 0.648}

DEVICES = {
    # peak dense bf16 FLOP/s and HBM bandwidth of one device; interconnect bytes/s per device (one
    # direction) inside a node. Sources (quoted in benchmarks/calibration.md):
    #   flops: H100 SXM and H200 SXM datasheets list "BFLOAT16 Tensor Core 1,979 teraFLOPS" with
    #     sparsity; dense is half, 989 TFLOP/s (the peak NVIDIA's own benchmark recipes divide by,
    #     github.com/NVIDIA/dgxc-benchmarking README "H100 ... BF16 989");
    #   hbm: H100 SXM datasheet "GPU memory bandwidth 3.35TB/s", H200 datasheet "4.8TB/s";
    #   link: NVLink 4, "NVLink: 900GB/s" per GPU in both datasheets, bidirectional: 450 GB/s each way;
    #   memory_gb: "GPU memory 80GB" (H100 SXM datasheet), "141GB" (H200 datasheet): the budget
    #     `simulate` gives the monolithic baseline when the config sets no `device_memory_gb`.
    # Across nodes the planner uses `simulate.link_gbps` (default 50 GB/s per device): DGX H100/H200
    # have one 400 Gb/s ConnectX-7 per GPU ("eight single-port NVIDIA ConnectX-7 VPI, ... up to
    # 400 Gb/s", NVIDIA DGX BasePOD reference architecture) = 50 GB/s each way.
    #   relative_peak: a compute precision's dense peak over bf16's. float32: jax computes float32
    #     matmuls in TF32 on these GPUs by default ("float32 dot products may be computed with
    #     reduced-precision arithmetic internally (... TF32 on recent GPUs)", docs.jax.dev
    #     "Matmul precision"), whose peak both datasheets give as "TF32 Tensor Core 989 teraFLOPS"
    #     with sparsity: 494.5 dense, half of bf16's. fp8 (a frozen section's weight matmuls in e4m3,
    #     `runtime.precision`): the measured end-to-end ratio of NVIDIA's Llama 3.1 70B recipes on
    #     64 H100, github.com/NVIDIA/dgxc-benchmarking @ 85380ffe02eac74e1d07e556b28cdcf7cce2d2f0
    #     (tag v25.04.01): llama3.1/README.md, "Llama 3.1 70b BF16 | 64x H100 GPUs ... Throughput in
    #     tokens per second | 71526" and "Llama 3.1 70b FP8 | 64x H100 GPUs ... | 106346": 1.49.
    #     Not the peaks' 2x (the same README: "The peak theoretical throughput for H100 FP8 is 1979
    #     TFLOPS and for H100 BF16 is 989 TFLOPS"): the ratio is of whole steps, so it prices the
    #     work FP8 does not speed up (attention, norms, communication), which 2x would credit with
    #     FP8's peak too. The H200 has the H100's compute (989 TFLOP/s above), so the same ratio.
    "h100": {
        "flops": 989e12,
        "hbm": 3.35e12,
        "link": 450e9,
        "memory_gb": 80.0,
        "relative_peak": {"float32": 0.5, "fp8": 1.49},
        "kind_rate": KIND_RATE,  # measured on the H200, whose compute is the H100's (above)
    },
    "h200": {
        "flops": 989e12,
        "hbm": 4.8e12,
        "link": 450e9,
        "memory_gb": 141.0,
        "relative_peak": {"float32": 0.5, "fp8": 1.49},
        "kind_rate": KIND_RATE,
    },
    # this kind of 2-core CI machine (XLA's CPU client runs programs one at a time: simulate serially);
    # not a measurement: rough magnitudes for simulating the CPU test configs
    "cpu": {"flops": 100e9, "hbm": 20e9, "link": 10e9, "overhead_s": 2e-3, "serial": True},
}

# devices that share one NVLink domain: a DGX H100/H200 node holds "8x NVIDIA H100/H200 Tensor Core
# GPUs" (DGX H100/H200 datasheets). Collectives within it run at `link`, beyond it at
# `simulate.link_gbps`; tensor parallelism stays within it, where the calibration's published runs
# (TP 1-8, benchmarks/calibration.md) price its per-layer all-reduces into the fitted efficiency
NODE_DEVICES = 8

# The optimizer step (`ring_allreduce_s`, `optimizer_update_s`; `cluster.update_time`):
#   GRAD_BYTES: gradients are reduced in float32, as this project accumulates them (float32 master
#     weights, `runtime.precision`) and as Megatron-LM does for bf16 training unless told otherwise
#     (megatron/training/arguments.py: "accumulate and all-reduce gradients in fp32 for bfloat16
#     data type", off only under --grad-reduce-in-bf16);
#   UPDATE_BYTES: the memory traffic of an Adam step per float32 parameter: read the parameter, its
#     gradient and both moments, write the parameter and both moments (7 x 4 bytes), and read the
#     gradient once more for the global-norm clipping (`runtime.optimizer`; Megatron clips by
#     default, --clip-grad 1.0): 32 bytes, at the device's HBM bandwidth (an elementwise update
#     does a few FLOPs per 32 bytes: memory-bound).
GRAD_BYTES = 4
UPDATE_BYTES = 32

# Bytes of one value by a section's precision (`runtime.precision`): its activations and edge
# tensors in its compute dtype (an fp8 section computes everything but its weight matmuls in
# bf16), and its weights as its forward reads them (an fp8 section's Dense kernels are stored in
# e4m3, one byte; its embedding and norms, bf16, are priced at that byte too: in an LLM the
# kernels hold nearly all the weights, and the runtime's own memory check reads the true dtypes).
ACTIVATION_BYTES = {"float32": 4, "bfloat16": 2, "fp8": 2}
WEIGHT_BYTES = {"float32": 4, "bfloat16": 2, "fp8": 1}


@dataclasses.dataclass(frozen=True)
class SectionCost:
    per_unit_s: float
    per_unit2_s: float = 0.0
    overhead_s: float = 0.0
    backward_factor: float = 2.0
    sink_factor: float = 3.0
    bucket_min: int = 16
    overlapped_s: float = 0.0  # per forward micro-step: collectives that overlap the compute
    layers: int = 1  # the layers `overlapped_s` is spread over (one gather per layer)
    update_s: float = 0.0  # per step: gradient reduction and optimizer update (`cluster.update_time`)
    per_octave: int = PER_OCTAVE  # shape buckets an octave (`core.buckets`): the spec's `buckets_per_octave`

    def padded(self, units: int) -> int:
        """The bucket a micro-step whose largest row has `units` work runs at (0: none, it does
        not run): every pricing site pads through this, at the section's granularity."""
        return bucket(units, self.bucket_min, self.per_octave) if units else 0

    def forward_s(self, bucket_units: int, micro_batch: int) -> float:
        """A forward micro-step of `micro_batch` rows padded to `bucket_units` (module docstring)."""
        c = micro_batch * (self.per_unit_s * bucket_units + self.per_unit2_s * bucket_units * bucket_units)
        g, n = self.overlapped_s, self.layers
        return self.overhead_s + (c + g) / n + (n - 1) / n * max(c, g)


@dataclasses.dataclass(frozen=True)
class CostModel:
    sections: Mapping[str, SectionCost]
    transfer_s_per_unit: Mapping[str, float] = dataclasses.field(default_factory=dict)  # edge -> s / unit / row
    transfer_overhead_s: float = 0.0
    in_place: frozenset[str] = frozenset()  # edges whose rows stay where they are: no transfer at all
    source: str = "analytic"
    host_s_per_sample: float = 0.0  # host-side batch packing before dispatch
    update_s: Mapping[str, float] = dataclasses.field(default_factory=dict)  # per section: its U op, once a step
    dispatch_s: Mapping[str, float] = dataclasses.field(default_factory=dict)  # host time to issue an op, by kind

    def dispatch_time(self, kind: str) -> float:
        return self.dispatch_s.get(kind, 0.0)

    def step_time(self, section: str, kind: str, units: Sequence[int], micro_batch: int) -> float:
        c = self.sections[section]
        b = c.padded(max(units, default=0))
        return c.forward_s(b, micro_batch) * {"F": 1.0, "B": c.backward_factor, "L": c.sink_factor}[kind]

    def transfer_time(self, edge: str, units: Sequence[int]) -> float:
        if edge in self.in_place:
            return 0.0
        return self.transfer_overhead_s + self.transfer_s_per_unit.get(edge, 0.0) * sum(units)


def efficiency(
    tokens_per_device: float,
    width_per_device: float,
    peak: float = 0.537,
    half_tokens: float = 1.0,
    half_width: float = 89.0,
) -> float:
    """Fraction of peak reached. It saturates with the tokens one device gets per micro-step and
    with the width of its weight slices (narrow GEMMs from heavy tensor parallelism run slowly).

    The defaults are the least-squares fit (log error) of `analytic_section`'s predictions to nine
    published BF16 H100 training runs of dense decoders, 5B to 405B, Megatron/NeMo and MaxText/Paxml,
    TP 1-8, PP 1-8, CP 1-2, FSDP up to 128 (scripts/calibrate_published.py; table, sources and
    held-out errors in benchmarks/calibration.md): peak 0.537, half_tokens 1 (the bottom of the
    searched range), half_width 89. Those runs all do at least 512 tokens per device per micro-step
    and 1536 weight columns per device, and there they show no fall in MFU with smaller work, so the
    data bound the halves only from above (95%: half_tokens < 130, half_width < 840); below that work
    the curve is an extrapolation that no published row measures. Before the fit the defaults were
    set by hand (0.55, 2048, 128) and under-predicted the NeMo runs by 35-81% (TP 8 by about 80%)."""
    return (
        peak
        * tokens_per_device
        / (tokens_per_device + half_tokens)
        * width_per_device
        / (width_per_device + half_width)
    )


def analytic_section(
    flops_per_unit: float,
    attn_flops_per_unit2: float,
    micro_batch: int,
    tensor: int,
    typical_units: int,
    device: str = "h100",
    trained_sink: bool = False,
    width_per_device: float = 4096.0,
    overhead_s: float = 2e-4,
    context: int = 1,
    precision: str = "bfloat16",
    rate_kind: str = "decoder",
) -> SectionCost:
    """Coefficients from FLOPs: tensor parallelism splits a row's FLOPs over `tensor` devices,
    context parallelism its positions over `context` devices (without thinning the weights). The
    section's compute `precision` scales the device's peak (`DEVICES[...]["relative_peak"]`: a
    float32 section runs at TF32's on a GPU, an fp8 one at 1.49 times bf16's, a measured ratio),
    and so does the kind of layer its FLOPs run in (the device's `kind_rate`, `KIND_RATE` on a
    GPU: a mixture-of-experts decoder or a ViT block at its measured share of the dense curve's
    rate; the CPU entry's magnitudes are not measured, so there every kind takes the dense curve).

    Efficiency is evaluated at the section's typical work per device per micro-step, so a
    micro-batch too small for the layout (or a model sliced too thin by tensor parallelism)
    shows up as a lower rate, as measured in practice (paper, Fig. 9).
    """
    peak = DEVICES[device]["flops"] * DEVICES[device].get("relative_peak", {}).get(precision, 1.0)
    overhead_s = DEVICES[device].get("overhead_s", overhead_s)
    eff = efficiency(micro_batch * typical_units / (tensor * context), width_per_device)
    eff *= DEVICES[device].get("kind_rate", {}).get(rate_kind, 1.0)
    rate = peak * eff * tensor * context
    return SectionCost(
        per_unit_s=flops_per_unit / rate,
        per_unit2_s=attn_flops_per_unit2 / rate,
        overhead_s=overhead_s,
        backward_factor=2.0,
        sink_factor=3.0 if trained_sink else 1.0,
    )


def ring_allreduce_s(nbytes: float, group: int, bytes_per_s: float) -> float:
    """An all-reduce of `nbytes` held by each of `group` devices: each moves 2 (group - 1) / group
    of them through its link, the least any algorithm built of sends and receives moves (a ring
    reaches it: Patarasuk & Yuan 2009, "Bandwidth optimal all-reduce algorithms for clusters of
    workstations", J. Parallel Distrib. Comput. 69(2); NVIDIA/nccl-tests doc/PERFORMANCE.md,
    "AllReduce: 2*(n-1)/n")."""
    return 2 * (group - 1) / group * nbytes / bytes_per_s if group > 1 else 0.0


def optimizer_update_s(params_per_device: float, device: str) -> float:
    """Adam's update of `params_per_device` float32 parameters at the device's HBM bandwidth
    (`UPDATE_BYTES` a parameter)."""
    return UPDATE_BYTES * params_per_device / DEVICES[device]["hbm"]


def transformer_flops(
    width: int,
    depth: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    mlp: int,
    vocab: int = 0,
    active_mlp_multiplier: float = 1.0,
) -> tuple[float, float]:
    """Forward FLOPs of a token: (linear part, attention coefficient per token of context)."""
    proj = 2 * width * (heads + 2 * kv_heads) * head_dim + 2 * heads * head_dim * width
    ffn = 3 * 2 * width * mlp * active_mlp_multiplier
    linear = depth * (proj + ffn) + 2 * width * vocab
    attn = depth * 2 * 2 * heads * head_dim  # QK^T and PV per pair of positions
    return float(linear), float(attn)
