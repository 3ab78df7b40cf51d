"""A second baseline: the workload under pipeline parallelism with the 1F1B schedule, as
Megatron-LM runs it. Plain Python, no JAX.

The paper we follow reports its gains against Megatron-LM, which pipelines the LLM rather than
running every section on every device with one layout (`baselines.monolithic_best`). This module
prices that layout with the same analytic cost and memory models, and searches it as
`monolithic_best` searches its own:

Layout. P pipeline stages (P >= 2 divides the device count, P <= the sink's layers), each on
devices / P contiguous devices (Megatron's default rank order puts the pipeline axis outermost,
"tp-cp-ep-dp-pp"), every stage with the same (data, fsdp, expert, context, tensor) mesh, as
Megatron gives every stage the same parallel sizes.

Which section goes where:
  * the sink (the LLM, the student) is cut into P stages of consecutive layers. The search
    tries three cuts (`sink_cuts`): the even one (extra layers to the middle stages), one that
    balances the stages' FLOPs with the encoders in the first stage and the head(s) in the last,
    and one that balances the encoders only, as Megatron-LM users set
    `--decoder-first/last-pipeline-num-layers`; the best layout's cut is then improved one
    layer at a time, every cut section's layers by stage on their own (`refine_cut`), as
    `--pipeline-model-parallel-layout` sets them. The embedding sits in the first stage, the
    output head(s) and the final norm in the last (their FLOPs too: the head's matmuls are
    priced on the last stage only, `_tail_flops`);
  * a producer that reads the sink's own tokens (its work per sample equals the sink's in every
    planning sample: a KD teacher) is cut the same way, layer-proportionally: stage s runs its
    share of teacher layers and its share of student layers on each micro-batch, and the
    teacher's hidden states travel down the pipeline beside the student's. That is how
    Megatron-based distillation runs a teacher (Megatron Bridge / Model Optimizer KD: "Student
    and teacher models must support the same parallelism strategy",
    docs.nvidia.com/nemo/megatron-bridge/latest/training/distillation.html), and the simplest
    honest analogue: a whole 72B teacher in the first stage would make it the bottleneck by far;
  * any other producer (a vision or audio encoder) runs whole in the first stage, before the
    stage's LLM layers, as Megatron's multimodal models place it by default
    (`--encoder-pipeline-model-parallel-size 0`: "encoder shares first decoder pipeline rank",
    megatron/training/arguments.py), with the decoder's tensor-parallel size.

Step time. Each data shard's batch is cut into M micro-batches of `micro_batch` samples, packed
the best of the three ways `monolithic_time` packs them (`cluster.monolithic_time`: arrival
order, longest first by the sink's work, longest first by the whole modelled time). Each stage's
forward and backward of each micro-batch are priced by `cluster.section_cost` on the stage's
slice of each section (its layers' FLOPs, attention, parameters and exchanges), plus the
point-to-point send of the activations to the next stage (forward) and of their gradient to the
previous one (backward). Then the 1F1B schedule is played out exactly (`one_f_one_b`): each
stage runs min(P - s - 1, M) warm-up forwards, then alternates one forward and one backward,
then drains the backwards; an op starts when its stage is free and its input has arrived. With
equal stages and micro-batches this is the closed form (M + P - 1) (t_f + t_b): M micro-batches
of the bottleneck stage plus the fill and drain, the bubble (P - 1) / M of the ideal time
(Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", arXiv 2104.04473, section 2.2.1; `tests/test_pipeline_baseline.py` checks the
playout against it). With unequal stages (the first holds the encoder, the last the head) and
micro-batches of unequal sizes no closed form is exact: the usual estimate
sum_s t_s + (M - 1) max_s t_s (Zheng et al. 2022, Alpa, OSDI) is neither a lower nor an upper
bound of 1F1B (on random stage times the playout came out from 23% below to 4% above it), so
the schedule is played out instead; it is never below the busiest stage's own work. On a
serial device (the CPU client runs one program at a time) nothing overlaps and the step is the
sum of every op.

Point-to-point sends. A boundary carries micro_batch x tokens x width values (2 bytes under
bfloat16, 4 under float32) of the sink's hidden states (and a cut teacher's), padded to the
micro-step's bucket as the compute is; each device sends 1 / (tensor x context) of them, as
Megatron's p2p tensor shape is (seq / (tp x cp), micro_batch, hidden) under sequence and
context parallelism (megatron/core/pipeline_parallel/schedules.py, `get_tensor_shapes`).
Device d of stage s sends to device d + devices / P: over NVLink when both are in one
8-device node, else over the inter-node link (`cluster._link`). The sends are blocking, as the
non-interleaved 1F1B schedule's `send_forward_recv_backward` pairs are: the sender waits.

Memory. Stage s keeps the activations of min(P - s, M) micro-batches in flight (1F1B's bound,
Narayanan et al. 2021 section 2.2.1): `layout.section_memory` of each slice, with a trained
slice's residuals stashed for that many forwards (the sink's last stage holds one, plus its
logits); weights, grads and Adam state of the slice's parameters only. The first stage, which
also holds the encoder and its residuals for P micro-batches, is usually the binding one; every
stage must fit the planner's budget.

Optimizer step. Each stage reduces its slices' gradients over its data-parallel group and
updates their parameters after its own last backward (`cluster.update_time`, the rule every
side is priced by), while the stages before it still drain.

Left out: a teacher's hidden states waiting in the receive buffers.
"""

from __future__ import annotations

import dataclasses
import math
import re
import statistics
from collections.abc import Iterator, Mapping, Sequence
from typing import Protocol

from maestro_jax.core.graph import UnitCost
from maestro_jax.core.plan import ParamInfo, SectionPlan, mesh_shape
from maestro_jax.planning.cluster import _link, section_cost
from maestro_jax.planning.cost import ACTIVATION_BYTES, CostModel, SectionCost
from maestro_jax.planning.layout import (
    ShardedLeaves,
    divisors,
    group_memory,
    mesh_degrees,
    micro_batches,
    section_memory,
)
from maestro_jax.planning.spec import SectionSpec, WorkloadSpec


class Search(Protocol):
    """What the baseline reads of the problem the search beside it prices (`pricer.Pricer` is
    one, `planner.Planner` too): the same workload, samples, devices, budget and cost model, so
    the two compare like for like. A protocol, not the pricer's class: it keeps this module's
    needs in one place."""

    spec: WorkloadSpec
    metas: Sequence  # the planning batches' sample metadata
    devices: int
    global_batch: int
    budget: float  # bytes per device
    device: str  # a key of `cost.DEVICES`
    link_gbps: float
    serial: bool  # the device runs one program at a time (nothing overlaps)
    layer_remat: tuple[str, ...]  # the per-layer checkpointing policies searched
    contexts: tuple[int, ...]  # the context degrees searched
    max_units: dict[str, int]
    typical_units: dict[str, float]


NODE = 8  # devices per node (DGX H100/H200), as `cluster._link` assumes
_BLOCK = re.compile(r"block_(\d+)")


# -- the 1F1B schedule ------------------------------------------------------------------------
def one_f_one_b(
    forward: Sequence[Sequence[float]],
    backward: Sequence[Sequence[float]],
    send_forward: Sequence[Sequence[float]] | None = None,
    send_backward: Sequence[Sequence[float]] | None = None,
    update: Sequence[float] | None = None,
) -> float:
    """Makespan of the non-interleaved 1F1B schedule (PipeDream-Flush; Megatron-LM's
    `forward_backward_pipelining_without_interleaving`). `forward[s][i]`, `backward[s][i]`: stage
    s's compute on micro-batch i; `send_forward[s][i]`: stage s sending i's activations to s + 1,
    `send_backward[s][i]`: sending i's gradient to s - 1 (blocking: the sender waits, and the
    receiver has them when the send ends); `update[s]`: stage s's optimizer step, after its last
    backward. Stage s runs min(P - s - 1, M) warm-up forwards, then one forward and one backward
    in turn, then the remaining backwards, then its update."""
    stages, m = len(forward), len(forward[0])
    zero = [[0.0] * m for _ in range(stages)]
    send_forward, send_backward = send_forward or zero, send_backward or zero
    ops = []
    for s in range(stages):
        warm = min(stages - s - 1, m)
        seq = [("F", i) for i in range(warm)]
        for j in range(m - warm):
            seq += [("F", warm + j), ("B", j)]
        seq += [("B", j) for j in range(m - warm, m)]
        ops.append(seq)
    f_ready = [[None] * m for _ in range(stages)]  # when stage s + 1 has i's activations
    b_ready = [[None] * m for _ in range(stages)]  # when stage s - 1 has i's gradient
    clock, pos = [0.0] * stages, [0] * stages
    left = sum(len(seq) for seq in ops)
    while left:
        moved = False
        for s in range(stages):
            while pos[s] < len(ops[s]):
                kind, i = ops[s][pos[s]]
                if kind == "F":
                    dep = 0.0 if s == 0 else f_ready[s - 1][i]
                else:  # the last stage's backward follows its own forward (earlier in its order)
                    dep = 0.0 if s == stages - 1 else b_ready[s + 1][i]
                if dep is None:
                    break
                start = max(clock[s], dep)
                if kind == "F":
                    clock[s] = start + forward[s][i] + (send_forward[s][i] if s < stages - 1 else 0.0)
                    f_ready[s][i] = clock[s]
                else:
                    clock[s] = start + backward[s][i] + (send_backward[s][i] if s > 0 else 0.0)
                    b_ready[s][i] = clock[s]
                pos[s] += 1
                left -= 1
                moved = True
        if not moved:  # cannot happen for 1F1B's orders; guards the loop
            raise RuntimeError("1F1B schedule deadlocked")
    return max(c + u for c, u in zip(clock, update or [0.0] * stages))


def stage_layers(layers: int, stages: int) -> list[int]:
    """`layers` cut into `stages` consecutive runs, as even as possible; the extra layers go to
    the middle stages first (then the last, then the first), since the first stage also holds
    the encoders and the embedding and the last the output head."""
    base, extra = divmod(layers, stages)
    counts = [base] * stages
    order = list(range(1, stages - 1)) + [stages - 1, 0] if stages > 1 else [0]
    for s in order[:extra]:
        counts[s] += 1
    return counts


# -- slicing a section into stages -------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Slice:
    section: str
    spec: SectionSpec  # the stage's share: its layers' leaves and FLOPs
    first: bool  # holds the section's input side (embedding)
    last: bool  # holds the section's output side (head, final norm; the sink's loss)
    leaves: tuple[ShardedLeaves, ShardedLeaves]  # params, consts


def _layer_of(info: ParamInfo) -> int | None:
    m = _BLOCK.search(info.path)
    return int(m.group(1)) if m else None


def _is_input_side(info: ParamInfo) -> bool:
    """An embedding (token, patch: first stage); other leaves outside the layers (heads, final
    norms) sit with the last layer."""
    return "embed" in info.path


def _slice_leaves(
    leaves: Sequence[ParamInfo], lo: int, hi: int, total: int, first: bool, last: bool
) -> tuple[ParamInfo, ...]:
    """The leaves of layers [lo, hi) (per-layer leaves by their block index; stacked leaves of
    scanned models cut along their `layers` axis), the input side's on the first stage and the
    rest of the non-layer leaves (heads, final norm) on the last."""
    kept = []
    for info in leaves:
        layer = _layer_of(info)
        logical = info.logical or ()
        if layer is not None:
            if lo <= layer < hi:
                kept.append(info)
        elif "layers" in logical and info.shape[logical.index("layers")] == total:
            if hi > lo:
                shape = list(info.shape)
                shape[logical.index("layers")] = hi - lo
                kept.append(dataclasses.replace(info, shape=tuple(shape)))
        elif _is_input_side(info):
            if first:
                kept.append(info)
        elif last:
            kept.append(info)
    return tuple(kept)


def _tail_flops(sec: SectionSpec) -> float:
    """Forward FLOPs per unit of the section's matmuls outside its layers on the output side
    (the LM head, a KD teacher's head in the student): 2 per weight of each matrix there."""
    flops = 0.0
    for info in sec.leaves:
        if (
            _layer_of(info) is None
            and "layers" not in (info.logical or ())
            and not _is_input_side(info)
            and len(info.shape) >= 2
        ):
            flops += 2 * math.prod(info.shape)
    return min(flops, sec.cost.flops)


def _cut(sec: SectionSpec, counts: Sequence[int]) -> list[SectionSpec | None]:
    """`sec` cut into consecutive runs of `counts[s]` layers: each stage's own `SectionSpec`
    with its layers' share of the per-layer FLOPs, attention, activations and exchanges, its
    leaves only, the head's FLOPs and the logits on the last stage. None where a stage holds
    nothing of it."""
    c, total, stages = sec.cost, sec.cost.layers, len(counts)
    tail = _tail_flops(sec)
    per_layer = (c.flops - tail) / total
    out, lo = [], 0
    for s, n in enumerate(counts):
        first, last = s == 0, s == stages - 1
        params = _slice_leaves(sec.params, lo, lo + n, total, first, last)
        consts = _slice_leaves(sec.consts, lo, lo + n, total, first, last)
        lo += n
        if n == 0 and not params and not consts:
            out.append(None)
            continue
        cost = dataclasses.replace(
            c,
            flops=per_layer * n + (tail if last else 0.0),
            attention_flops=c.attention_flops * n / total,
            layers=n,
            logits=c.logits if last else 0,
        )
        out.append(dataclasses.replace(sec, params=params, consts=consts, cost=cost))
    return out


def token_aligned(spec, metas_all, name: str) -> bool:
    """Whether producer `name` reads the sink's own tokens: its work per sample equals the
    sink's in every planning sample that activates it (a KD teacher), so the pipeline cuts it
    beside the sink rather than placing it whole in the first stage (an encoder)."""
    samples = [m for batch in metas_all for m in batch if name in m.work]
    return bool(samples) and all(m.work[name] == m.work.get(spec.sink) for m in samples)


def stage_plan(spec, metas_all, stages: int, layers: Mapping[str, Sequence[int]] | None = None) -> list[list[_Slice]]:
    """Each stage's slices, in the order the stage runs them: the first stage's whole
    producers (encoders), then each cut section's layers in graph order (a teacher's before
    the student's, as its hidden states feed the student's loss). `layers`: a cut section's
    layers by stage (default the even cut, `stage_layers`; `sink_cuts`, `refine_cut`)."""
    return _stage_plan(spec, _aligned(spec, metas_all), stages, layers or {})


def _aligned(spec, metas_all) -> frozenset[str]:
    return frozenset(s for s in spec.order if s == spec.sink or token_aligned(spec, metas_all, s))


def balanced_layers(spec, metas_all, stages: int, head: bool = True) -> list[int]:
    """The sink's layers cut so that the stages' work is as even as it gets: the first stage
    also runs the encoders, the last the head(s), so they get fewer layers (as Megatron-LM users
    set `--decoder-first-pipeline-num-layers` and `--decoder-last-pipeline-num-layers`). Work is
    FLOPs over the planning samples, forward and backward (3 forwards when trained), attention
    included; the other cut sections (a teacher) count with their even cut. Each layer goes, one
    at a time, to the stage with the least work so far (optimal for equal layers). `head=False`:
    the head's work left out (the last stage balanced like a middle one)."""
    aligned, sink = _aligned(spec, metas_all), spec.sections[spec.sink]
    samples = [m for batch in metas_all for m in batch]

    def work(c: UnitCost, section: str) -> float:
        factor = 3 if spec.sections[section].trained else 1
        return sum(c.forward_flops(m.work[section]) for m in samples if section in m.work) * factor

    load = [0.0] * stages
    for name, sec in spec.sections.items():
        if name == spec.sink:
            continue
        if name not in aligned or not sec.cost.layers:
            load[0] += work(sec.cost, name)
        else:
            for s, part in enumerate(_cut(sec, stage_layers(sec.cost.layers, stages))):
                if part is not None:
                    load[s] += work(part.cost, name)
    tail = _tail_flops(sink)
    per_layer = dataclasses.replace(
        sink.cost,
        flops=(sink.cost.flops - tail) / sink.cost.layers,
        attention_flops=sink.cost.attention_flops / sink.cost.layers,
    )
    if not head:
        tail = 0.0
    load[-1] += work(UnitCost(flops=tail), spec.sink)
    layer = work(per_layer, spec.sink)
    counts = [0] * stages
    for _ in range(sink.cost.layers):
        s = min(range(stages), key=lambda i: (load[i], -i))  # ties: the later stage, which stashes less
        counts[s] += 1
        load[s] += layer
    return counts


def sink_cuts(spec, metas_all, stages: int) -> list[list[int]]:
    """The cuts of the sink's layers the search tries: the even one, the one balanced for the
    encoders and the head, and the one balanced for the encoders only (fewer layers on the
    first stage, the rest even: it also eases the first stages' memory, which 1F1B loads most).
    Three cuts, not every cut: FLOPs only estimate the stages' times, and memory pulls the other
    way (compute balance puts layers on the early stages that stash the most micro-batches)."""
    cuts = [
        stage_layers(spec.sections[spec.sink].cost.layers, stages),
        balanced_layers(spec, metas_all, stages),
        balanced_layers(spec, metas_all, stages, head=False),
    ]
    return [c for i, c in enumerate(cuts) if c not in cuts[:i]]


def _stage_plan(spec, cut: frozenset[str], stages: int, layers: Mapping[str, Sequence[int]]) -> list[list[_Slice]]:
    out: list[list[_Slice]] = [[] for _ in range(stages)]
    for name, sec in spec.sections.items():
        if name not in cut or not sec.cost.layers:
            out[0].append(_Slice(name, sec, True, True, (ShardedLeaves(sec.params), ShardedLeaves(sec.consts))))
            continue
        counts = layers.get(name) or stage_layers(sec.cost.layers, stages)
        for s, part in enumerate(_cut(sec, counts)):
            if part is not None:
                out[s].append(
                    _Slice(
                        name, part, s == 0, s == stages - 1, (ShardedLeaves(part.params), ShardedLeaves(part.consts))
                    )
                )
    return out


# -- pricing -----------------------------------------------------------------------------------
def _boundary_bandwidth(device: str, link_gbps: float, devices: int, stages: int, s: int) -> float:
    """Bytes/s per device from stage s to s + 1: device d sends to d + devices / P."""
    k = devices // stages
    same_node = all(d // NODE == (d + k) // NODE for d in range(s * k, (s + 1) * k))
    return _link(device, link_gbps, 2 if same_node else max(devices, NODE + 1))


def _value_bytes(sec: SectionSpec) -> int:
    return ACTIVATION_BYTES[sec.precision]


def _chunks(spec, metas, rows: int, alone) -> list[list]:
    """Micro-batches (`rows` samples across the data shards) of `metas` in each of
    `monolithic_time`'s three orders."""
    sink = spec.sink
    orders = (
        list(metas),
        sorted(metas, key=lambda m: m.work.get(sink, 0), reverse=True),
        sorted(metas, key=alone, reverse=True),
    )
    return [[order[i : i + rows] for i in range(0, len(order), rows)] for order in orders]


def pipelined_time(
    planner: Search,
    stages: int,
    sp: SectionPlan,
    layer_remat: str,
    slices: list[list[_Slice]] | None = None,
    best: float = math.inf,
) -> float:
    """Mean step time over the planner's batches of the 1F1B pipeline with `stages` stages,
    each with `sp`'s mesh and micro-batch, each batch packed the best of `monolithic_time`'s
    three ways. math.inf when it cannot beat `best`: a stage's busy time (its compute and
    sends) bounds the step from below, so packings, and whole layouts, whose bound is no better
    are not played out."""
    return _pipelined(planner, stages, sp, layer_remat, slices, best)[0]


def _pipelined(
    planner: Search,
    stages: int,
    sp: SectionPlan,
    layer_remat: str,
    slices: list[list[_Slice]] | None = None,
    best: float = math.inf,
) -> tuple[float, float]:
    """`pipelined_time`, and the mean busy time of the busiest stage in the packings chosen
    (what the step would take without a bubble). Each batch's packings are priced as bounds
    (`_stage_ops`), most promising first; none is played out where the mean bound already loses to
    `best`."""
    spec = planner.spec
    slices = slices or stage_plan(spec, planner.metas, stages)
    costs = _stage_costs(planner, slices, sp, layer_remat)
    whole = _whole_costs(planner, sp)

    def alone(m) -> float:
        return sum(whole.step_time(s, "F", [u], 1) - whole.sections[s].overhead_s for s, u in m.work.items())

    update = [sum(c.update_s for _, c in row) for row in costs]  # each stage's optimizer step
    crossing = _Crossing.of(planner, slices, sp, stages)
    batches = []  # per batch: (bound, ops) of each packing, most promising first
    for metas in planner.metas:
        packings = []
        for chunks in _chunks(spec, metas, sp.rows, alone):
            f, b, sf, sb = _stage_ops(chunks, spec, costs, whole, sp.micro_batch, crossing)
            busy = [sum(f[s]) + sum(b[s]) + sum(sf[s]) + sum(sb[s]) + update[s] for s in range(stages)]
            packings.append((sum(busy) if planner.serial else max(busy), (f, b, sf, sb)))
        batches.append(sorted(packings, key=lambda p: p[0]))
    if statistics.mean(p[0][0] for p in batches) >= best:
        return math.inf, math.inf
    return _played_out(batches, planner.serial, update)


def _stage_costs(planner: Search, slices, sp: SectionPlan, layer_remat: str) -> list[list[tuple[str, SectionCost]]]:
    """Each stage's slices priced on the stage mesh `sp`, each in its section's precision, the
    trained ones under `layer_remat`."""
    spec, costs = planner.spec, []
    for stage in slices:
        row = []
        for sl in stage:
            sec = spec.sections[sl.section]
            plan = dataclasses.replace(sp, precision=sec.precision, layer_remat=layer_remat if sec.trained else "none")
            cost = section_cost(
                sl.spec,
                plan,
                planner.metas,
                planner.device,
                planner.link_gbps,
                sl.section == spec.sink,
                planner.typical_units[sl.section],
                per_octave=spec.buckets_per_octave,
            )
            row.append((sl.section, cost))
        costs.append(row)
    return costs


def _whole_costs(planner: Search, sp: SectionPlan) -> CostModel:
    """Every whole section on the stage mesh: what packs the micro-batches and pads their rows."""
    spec = planner.spec
    return CostModel(
        {
            s: section_cost(
                sec,
                dataclasses.replace(sp, precision=sec.precision),
                planner.metas,
                planner.device,
                planner.link_gbps,
                s == spec.sink,
                planner.typical_units[s],
                per_octave=spec.buckets_per_octave,
            )
            for s, sec in spec.sections.items()
        }
    )


@dataclasses.dataclass(frozen=True)
class _Crossing:
    """What crosses each stage boundary per padded unit of a micro-batch row, per device: each cut
    section's hidden states forward, the trained ones' gradients backward; and each boundary's
    bandwidth."""

    forward_bytes: dict[str, float]
    backward_bytes: dict[str, float]
    bandwidth: list[float]

    @classmethod
    def of(cls, planner: Search, slices, sp: SectionPlan, stages: int) -> _Crossing:
        spec, sizes = planner.spec, sp.axis_sizes
        shard = sizes["tensor"] * sizes["context"]
        devices = stages * len(sp.devices)
        bandwidth = [
            _boundary_bandwidth(planner.device, planner.link_gbps, devices, stages, s) for s in range(stages - 1)
        ]
        cut = [s for s in spec.order if any(sl.section == s for stage in slices[1:] for sl in stage)]
        forward = {s: spec.sections[s].cost.width * _value_bytes(spec.sections[s]) / shard for s in cut}
        return cls(forward, {s: v for s, v in forward.items() if spec.sections[s].trained}, bandwidth)


def _stage_ops(chunks, spec, costs, whole: CostModel, mb: int, crossing: _Crossing) -> tuple[list, list, list, list]:
    """Each stage's forward, backward, forward-send and backward-send time of each micro-batch
    (`chunks`), every row padded to the micro-batch's bucket of each section."""
    stages = len(costs)
    f, b, sf, sb = ([[0.0] * len(chunks) for _ in range(stages)] for _ in range(4))
    for i, chunk in enumerate(chunks):
        padded = {s: c.padded(max((m.work.get(s, 0) for m in chunk), default=0)) for s, c in whole.sections.items()}
        for st, row in enumerate(costs):
            for s, c in row:
                units = padded[s]
                if not units:  # no sample of the micro-batch needs it: not run (`monolithic_time`)
                    continue
                t = c.forward_s(units, mb)
                f[st][i] += t
                if s == spec.sink:
                    b[st][i] += t * (c.sink_factor - 1)
                elif spec.sections[s].trained:
                    b[st][i] += t * c.backward_factor
        fw = sum(mb * padded[s] * v for s, v in crossing.forward_bytes.items())
        bw = sum(mb * padded[s] * v for s, v in crossing.backward_bytes.items())
        for st in range(stages - 1):
            sf[st][i] = fw / crossing.bandwidth[st]
            sb[st + 1][i] = bw / crossing.bandwidth[st]
    return f, b, sf, sb


def _played_out(batches, serial: bool, update: list[float]) -> tuple[float, float]:
    """Each batch's fastest packing under 1F1B (`one_f_one_b`; a serial client runs one program at
    a time, nothing overlaps, the bound is the time), tried in bound order until a bound cannot
    beat the fastest; the mean time and the mean busy time of the busiest stage."""
    times, busiest = [], []
    for packings in batches:
        fastest, work = math.inf, math.inf
        for bound, (f, b, sf, sb) in packings:
            if bound >= fastest:
                break
            t = bound if serial else one_f_one_b(f, b, sf, sb, update)
            if t < fastest:
                fastest, work = t, bound
        times.append(fastest)
        busiest.append(work)
    return statistics.mean(times), statistics.mean(busiest)


def stage_memory(
    planner: Search,
    stages: int,
    sp: SectionPlan,
    layer_remat: str,
    micro_batches: int,
    slices: list[list[_Slice]] | None = None,
) -> list[float] | None:
    """Per-device bytes of each stage, or None when the mesh does not divide a stage's
    weights. Stage s holds min(P - s, M) micro-batches in flight (1F1B)."""
    spec = planner.spec
    slices = slices or stage_plan(spec, planner.metas, stages)
    out = []
    for s, stage in enumerate(slices):
        in_flight = min(stages - s, micro_batches)
        mems = []
        for sl in stage:
            sec = spec.sections[sl.section]
            params, consts = (leaves.per_device(sp.mesh) for leaves in sl.leaves)
            if params is None or consts is None:
                return None
            plan = dataclasses.replace(sp, precision=sec.precision, layer_remat=layer_remat if sec.trained else "none")
            loss = sl.section == spec.sink and sl.last  # the loss, its logits: one micro-batch, as 1F1B's last stage
            units, per_octave = planner.max_units[sl.section], spec.buckets_per_octave
            mems.append(section_memory(sl.spec, plan, loss, units, in_flight, (params, consts), per_octave=per_octave))
        out.append(group_memory(mems) if mems else 0.0)
    return out


def pipelined_best(planner: Search, stage_counts: Sequence[int] | None = None) -> dict | None:
    """The fastest 1F1B pipeline layout on the planner's devices that fits its memory budget:
    over the stage count (2 up to the sink's layers, dividing the devices; or `stage_counts`),
    the stage mesh (tensor, context, expert as `layout.mesh_degrees` offers them, the smallest fsdp
    that fits), the micro-batch and one `layer_remat` for every trained section, as
    `baselines.monolithic_best` searches its layout. None when nothing fits (or the sink declares
    too few layers to cut)."""
    spec, n = planner.spec, planner.devices
    layers = spec.sections[spec.sink].cost.layers
    every = SectionSpec(
        "all",
        True,
        tuple(p for sec in spec.sections.values() for p in sec.leaves),
        UnitCost(flops=0.0, kv_width=max(sec.cost.kv_width for sec in spec.sections.values())),
    )
    best = None
    for stages in (p for p in divisors(n) if 2 <= p <= layers and (stage_counts is None or p in stage_counts)):
        for counts in sink_cuts(spec, planner.metas, stages):
            best = _best_on(planner, stages, stage_plan(spec, planner.metas, stages, {spec.sink: counts}), every, best)
    return best and refine_cut(planner, best)


def layer_moves(layers: Mapping[str, Sequence[int]]) -> Iterator[dict[str, list[int]]]:
    """Every cut one layer away from `layers` (section -> its layers by stage): one of a section's
    layers moved from one stage to another, the first and last stage keeping at least 0 (they
    hold the embedding, the head), the others at least 1, as `core.stages.layer_ranges` allows."""
    for name, counts in layers.items():
        k = len(counts)
        for i in range(k):
            for j in range(k):
                floor = 0 if i in (0, k - 1) else 1
                if i != j and counts[i] > floor:
                    moved = list(counts)
                    moved[i] -= 1
                    moved[j] += 1
                    yield {**{n: list(c) for n, c in layers.items()}, name: moved}


def refine_cut(planner: Search, best: dict, passes: int = 8) -> dict:
    """`best` (a layout of `pipelined_best`) with the cut of every cut section improved one
    layer at a time while its 1F1B step gets faster and its stages fit: each section's layers
    by stage on their own, as Megatron-LM's `--pipeline-model-parallel-layout` sets any stage's
    layers (its docs, "Custom Pipeline Model Parallel Layout"), so the baseline gets the cut the
    planner may give maestro's stages (`Planner._pipelined_point`), searched the same way by its
    own model. At most `passes` rounds over every one-layer move."""
    spec, stages = planner.spec, best["stages"]
    sp = SectionPlan(tuple(range(best["devices_per_stage"])), mesh_shape(**best["mesh"]), best["micro_batch"])
    remat, layers = best["layer_remat"], best["layers_per_stage"]
    for _ in range(passes):
        improved = False
        for cut in layer_moves(layers):
            slices = stage_plan(spec, planner.metas, stages, cut)
            mem = stage_memory(planner, stages, sp, remat, best["micro_batches"], slices)
            if mem is None or max(mem) > planner.budget:
                continue
            t, busiest = _pipelined(planner, stages, sp, remat, slices, best["step_time_s"])
            if t < best["step_time_s"]:
                best = {
                    **best,
                    "step_time_s": t,
                    "samples_per_s_per_device": planner.global_batch / t / planner.devices,
                    **_describe(slices),
                    "bubble_fraction": 1 - busiest / t,
                    "peak_gb": max(mem) / 2**30,
                    "first_stage_gb": mem[0] / 2**30,
                }
                layers, improved = best["layers_per_stage"], True
        if not improved:
            break
    return best


def _best_on(
    planner: Search, stages: int, slices: list[list[_Slice]], every: SectionSpec, best: dict | None
) -> dict | None:
    """`best`, or a faster layout of `stages` stages cut as `slices` that fits."""
    gb, n = planner.global_batch, planner.devices
    k = n // stages
    for tensor, context, expert in mesh_degrees(every, k, planner.contexts):
        dp = k // (tensor * context)
        for mb in micro_batches(gb, dp):
            m = -(-gb // (dp * mb))
            for remat in planner.layer_remat:
                for fsdp in divisors(dp // expert):
                    sp = SectionPlan(
                        tuple(range(k)),
                        mesh_shape(data=dp // expert // fsdp, fsdp=fsdp, expert=expert, context=context, tensor=tensor),
                        mb,
                    )
                    mem = stage_memory(planner, stages, sp, remat, m, slices)
                    if mem is None or max(mem) > planner.budget:
                        continue
                    bound = math.inf if best is None else best["step_time_s"]
                    t, busiest = _pipelined(planner, stages, sp, remat, slices, bound)
                    if t < bound:
                        best = {
                            "stages": stages,
                            "devices_per_stage": k,
                            "mesh": dict(sp.axis_sizes),
                            "micro_batch": mb,
                            "micro_batches": m,
                            "layer_remat": remat,
                            "step_time_s": t,
                            "samples_per_s_per_device": gb / t / n,
                            **_describe(slices),
                            # the step's share that its busiest stage waits (fill, drain, imbalance)
                            "bubble_fraction": 1 - busiest / t,
                            "peak_gb": max(mem) / 2**30,
                            "first_stage_gb": mem[0] / 2**30,
                        }
                    break
    return best


def _describe(slices: list[list[_Slice]]) -> dict:
    """Where each section runs: the cut ones' layers by stage, the ones whole in the first stage."""
    cut = {sl.section for stage in slices[1:] for sl in stage}
    layers = {
        s: [next((sl.spec.cost.layers for sl in stage if sl.section == s), 0) for stage in slices]
        for s in dict.fromkeys(sl.section for stage in slices for sl in stage)
        if s in cut
    }
    return {"layers_per_stage": layers, "first_stage_whole": [sl.section for sl in slices[0] if sl.section not in cut]}


__all__ = [
    "balanced_layers",
    "one_f_one_b",
    "pipelined_best",
    "pipelined_time",
    "refine_cut",
    "sink_cuts",
    "stage_layers",
    "stage_memory",
    "stage_plan",
]
