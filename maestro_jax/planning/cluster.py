"""Cluster-scale prediction (`maestro-jax simulate`): maestro vs monolithic throughput. No JAX.

Sample sizes come from the data, costs from the analytic model (each section's declared FLOPs
per unit at the device's peak, efficiency from the work per device; see cost.py), and the same
scheduler and simulator the runtime uses. The monolithic baseline runs every section's work
for each micro-batch on all its devices with one layout and one micro-batch size; a section
runs over every row of a micro-batch that holds one of its samples (static shapes in one
program), and nothing overlaps. Its micro-batches are packed the best way
of a few (`monolithic_time`), so the comparison is with the strongest packing, not arrival order.
Every side (maestro's sections, the monolithic layout, each stage of `pipeline`'s baseline) pays
the same optimizer step per trained section and layout (`update_time`) and the same exchanges.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Mapping

from maestro_jax.core.buckets import PER_OCTAVE
from maestro_jax.core.plan import Plan, SectionPlan, device_groups, position_axes
from maestro_jax.meshes import MESH_AXES
from maestro_jax.planning.cost import (
    ACTIVATION_BYTES,
    DEVICES,
    GRAD_BYTES,
    NODE_DEVICES,
    WEIGHT_BYTES,
    CostModel,
    SectionCost,
    analytic_section,
    optimizer_update_s,
    ring_allreduce_s,
)
from maestro_jax.planning.simulator import DEVICE_TIME, device_time, section_time, simulate
from maestro_jax.planning.spec import SectionSpec, WorkloadSpec
from maestro_jax.schedule import naive, wavefront
from maestro_jax.schedule.ops import delivered
from maestro_jax.schedule.packing import Pack, row_shape


def typical_units(name: str, metas_all) -> float:
    """A section's mean work units per sample it gets, over `metas_all` (1 when it gets none):
    the work per row at which the analytic model evaluates its efficiency."""
    units = [m.work[name] for batch in metas_all for m in batch if name in m.work]
    return statistics.mean(units) if units else 1.0


def section_cost(
    spec: SectionSpec,
    sp: SectionPlan,
    metas_all,
    device: str,
    link_gbps: float,
    is_sink: bool,
    typical: float | None = None,
    pack: Pack = 1,
    per_octave: int = PER_OCTAVE,
) -> SectionCost:
    """Analytic coefficients of one section under its plan, from the FLOPs it declares; its
    optimizer step's gradient reduction hides behind one backward micro-step of typical rows
    (`update_time`). `typical`: `typical_units(spec.name, metas_all)`, when the caller has it
    already (the planner prices thousands of layouts on the same samples). A section that packs
    sequences (`pack`) runs packed rows (`schedule.packing.row_shape` of typical samples): its
    efficiency is rated at their work per device, and the reduction hides behind one of them.
    `per_octave`: the shape buckets its micro-steps are padded to (the `WorkloadSpec`'s
    `buckets_per_octave`, `SectionCost.padded`)."""
    c = spec.cost
    if typical is None:
        typical = typical_units(spec.name, metas_all)
    rows, row_units = row_shape(sp.micro_batch, typical, pack)
    a = _compute_coefficients(spec, sp, rows, int(row_units), device, is_sink and spec.trained)
    layer = recompute_share(spec, sp, typical)
    section = 1.0 if sp.residuals == "remat" and not is_sink else 0.0
    cost = SectionCost(
        a.per_unit_s + exchange_s_per_unit(spec, sp, device, link_gbps),
        a.per_unit2_s,
        a.overhead_s,
        a.backward_factor + section + layer,
        a.sink_factor + (layer if spec.trained else 0.0),
        bucket_min=256,
        overlapped_s=fsdp_gather_s(spec, sp, device, link_gbps),
        layers=max(c.layers, 1),
        per_octave=per_octave,
    )
    backward = cost.sink_factor - 1.0 if is_sink else cost.backward_factor
    hidden = cost.forward_s(int(row_units), rows) * backward
    return dataclasses.replace(cost, update_s=update_time(spec, sp, device, link_gbps, hidden))


def _compute_coefficients(
    spec: SectionSpec, sp: SectionPlan, rows: int, row_units: int, device: str, trained_sink: bool
):
    """`analytic_section` of the section's declared FLOPs under its layout: attention within
    fixed windows (`attention_span`) is a per-unit cost; the rate is rated at `rows` rows of
    `row_units` units, the tensor slice's width, the compute precision and the kind of layer."""
    c = spec.cost
    linear, attn = c.flops, c.attention_flops
    if c.attention_span is not None:  # attention within fixed windows: a per-unit (linear) cost
        linear, attn = linear + attn * c.attention_span, 0.0
    tensor = sp.axis_sizes["tensor"]
    return analytic_section(
        linear,
        attn,
        rows,
        tensor,
        row_units,
        device=device,
        trained_sink=trained_sink,
        width_per_device=c.width / tensor,
        context=sp.axis_sizes["context"],
        precision=sp.precision,
        rate_kind=c.rate_kind,
    )


def recompute_share(spec: SectionSpec, sp: SectionPlan, typical_units: float) -> float:
    """The share of a forward that the backward recomputes under `layer_remat`: all of it
    (`full`), or the attention (`dots` keeps the weight-matmul outputs, and attention's
    batched matmuls are not among them). `residuals: remat` adds a whole forward on top."""
    if sp.layer_remat == "full":
        return 1.0
    if sp.layer_remat == "dots":
        c = spec.cost
        attn = c.attention_flops * (c.attention_span if c.attention_span is not None else typical_units)
        return attn / (c.flops + attn) if c.flops + attn else 0.0
    return 0.0


def fsdp_gather_s(spec: SectionSpec, sp: SectionPlan, device: str, link_gbps: float) -> float:
    """Time of one all-gather of a section's fsdp-sharded weights, paid every micro-step (the
    backward pays it again plus a reduce-scatter of the gradients: `backward_factor` scales it
    with the compute). What a device receives is its slice before fsdp: the weights divided by
    every other axis that shards them (tensor; expert for the experts' weights), (fsdp - 1) /
    fsdp of it, in the compute precision (`WEIGHT_BYTES`: bf16, 2 bytes a value; a frozen fp8
    section's e4m3 kernels, 1). The fsdp group spans fsdp x
    expert x context x tensor consecutive devices (`meshes.MESH_AXES` order): NVLink when they
    fit in a node (`NODE_DEVICES`), else `link_gbps`. The caller overlaps it with the compute layer by layer
    (`SectionCost.overlapped_s`), as XLA's latency-hiding scheduler runs the next layer's gather
    beside this layer's matmuls; the calibration (benchmarks/calibration.md) compares the result
    with published FSDP runs that overlap it the same way."""
    sizes = sp.axis_sizes
    fsdp, tensor, expert = sizes["fsdp"], sizes["tensor"], sizes["expert"]
    if fsdp == 1:
        return 0.0
    routed = getattr(spec, "expert_param_count", 0)
    per_device = ((spec.param_count - routed) + routed / expert) / tensor
    value = WEIGHT_BYTES[sp.precision]
    group = fsdp * expert * sizes["context"] * tensor
    return value * per_device * (fsdp - 1) / fsdp / _link(device, link_gbps, group)


def update_time(spec: SectionSpec, sp: SectionPlan, device: str, link_gbps: float, hidden: float = 0.0) -> float:
    """A trained section's optimizer step under its layout, once per training step (0 when frozen):
      gradient reduction: each device's gradients, what remains of them after fsdp's per-micro-step
        reduce-scatter (priced in the backward, `fsdp_gather_s`), are all-reduced over the devices
        that hold the same weights (`cost.ring_allreduce_s`, float32, `cost.GRAD_BYTES`): the
        dense weights over data x expert x context, the experts' over data x context;
      optimizer update: Adam over each device's own float32 slice of the parameters, memory-bound
        (`cost.optimizer_update_s`).
    Once per step: gradients accumulate over the micro-steps on each device and are reduced
    after the last, as Megatron-LM's DDP launches its reduction in the last micro-batch's
    backward only. Overlap: the reduction runs beside `hidden` seconds of compute and only the
    rest shows; `section_cost` passes one backward micro-step of typical rows, unpadded (the
    last backward, beside which Megatron's `overlap_grad_reduce` reduces its gradient buckets and
    XLA's latency-hiding scheduler can run the reduction; nothing earlier, since the gradients
    are complete only then). The update waits for the reduction and overlaps nothing. Every side
    is priced by this rule: the simulator's U op after the section's last backward, the end of
    `monolithic_time`, each pipeline stage's slices after its own drain."""
    if not spec.trained:
        return 0.0
    sizes = sp.axis_sizes
    shards = sizes["tensor"] * sizes["fsdp"]
    routed = spec.trained_expert_param_count
    dense = (spec.trained_param_count - routed) / shards
    experts = routed / (shards * sizes["expert"])
    reduction = 0.0
    for values, axes in ((dense, ("data", "expert", "context")), (experts, ("data", "context"))):
        group = math.prod(sizes[a] for a in axes)
        reduction += ring_allreduce_s(GRAD_BYTES * values, group, _link(device, link_gbps, _span(sizes, axes)))
    return max(reduction - hidden, 0.0) + optimizer_update_s(dense + experts, device)


def _span(sizes: Mapping[str, int], axes: tuple[str, ...]) -> int:
    """Consecutive devices a group over `axes` spreads across: from its outermost axis of size > 1
    inward (`meshes.MESH_AXES` order, tensor innermost)."""
    for i, a in enumerate(MESH_AXES):
        if a in axes and sizes[a] > 1:
            return math.prod(sizes[b] for b in MESH_AXES[i:])
    return 1


def _link(device: str, link_gbps: float, group: int) -> float:
    """Bytes/s per device of a collective over `group` devices: NVLink inside a node
    (`NODE_DEVICES`), the inter-node link beyond."""
    return DEVICES[device]["link"] if group <= NODE_DEVICES else link_gbps * 1e9


def exchange_s_per_unit(spec: SectionSpec, sp: SectionPlan, device: str, link_gbps: float) -> float:
    """Communication time per work unit of a row, in the forward (the backward's mirror image is
    scaled in by `backward_factor`), counted in full rather than overlapped:
      context parallelism: each layer passes keys and values round the ring (or all-gathers
        them: the same bytes), so a device receives (context - 1) / context of the row's
        `kv_width` features per unit (heads split by tensor); attention FLOPs are the causal
        half, which the ring's balanced order computes (`models.layers.ring_attention`);
      expert parallelism: each layer sends every token to its experts_per_token experts and
        back (dispatch and combine, the all-to-all pair), of which (expert - 1) / expert cross
        devices. The tokens are divided as the layout divides them, as Megatron-LM's all-to-all
        dispatcher divides them (megatron/core/transformer/moe/token_dispatcher.py,
        MoEAlltoAllTokenDispatcher, "num_local_tokens: S/TP*B"): each device sends its
        1 / (context x tensor) of the row; then, with tensor > 1, the tensor group all-gathers
        what it received (each device holds a slice of every local expert's `expert_mlp`) and
        reduce-scatters the results back (`gather_from_sequence_parallel_region`,
        `reduce_scatter_to_sequence_parallel_region` there): (tensor - 1) / tensor of the
        group's routed slots per device, inside a node. Not overlapped: the dispatch's result
        feeds the experts' matmuls and the combine's the next layer, so XLA's latency-hiding
        scheduler has no independent compute to hide them behind (`models.llm.sparse_experts`
        issues one all-to-all per direction, each consumed by the next op), and nothing here
        shows XLA overlapping them; Megatron hides them only by interleaving two micro-batches
        (`overlap_moe_expert_parallel_comm`), which no side here models. Note that
        `sparse_experts` itself still sends each token from every tensor rank (its tokens are
        not split over `tensor`): this prices the divided dispatch, on every side alike.
    Activations move at 2 bytes per value in bfloat16 and fp8 sections, 4 in float32."""
    c, sizes = spec.cost, sp.axis_sizes
    tensor, context, expert = sizes["tensor"], sizes["context"], sizes["expert"]
    value = ACTIVATION_BYTES[sp.precision]
    t = 0.0
    if context > 1 and c.kv_width:
        t += (
            c.layers
            * c.kv_width
            / tensor
            * value
            * (context - 1)
            / context
            / _link(device, link_gbps, context * tensor)
        )
    if expert > 1 and c.routed_width:
        routed = c.layers * 2 * c.routed_width * value / context  # dispatch and combine, per unit of the row
        t += routed * (expert - 1) / expert / tensor / _link(device, link_gbps, expert * context * tensor)
        t += routed * (tensor - 1) / tensor / _link(device, link_gbps, tensor)
    return t


def cost_model(
    spec: WorkloadSpec,
    plans: Mapping[str, SectionPlan],
    metas_all,
    device: str,
    link_gbps: float,
    typical: Mapping[str, float] | None = None,
    packed: bool = True,
) -> CostModel:
    """`typical`: each section's `typical_units`, when the caller has them already. `packed`: the
    sections that pack sequences (`spec.pack`) run packed rows (False for the monolithic step,
    which never packs)."""
    pack = spec.pack if packed else {}
    sections = {
        s: section_cost(
            sec,
            plans[s],
            metas_all,
            device,
            link_gbps,
            s == spec.sink,
            None if typical is None else typical[s],
            pack.get(s, 1),
            spec.buckets_per_octave,
        )
        for s, sec in spec.sections.items()
    }
    transfer, in_place, groups = {}, set(), device_groups(plans)
    for e in spec.edges:
        per_unit = transfer_s_per_unit(
            spec.edge_bytes[e.name],
            plans[e.src],
            plans[e.dst],
            groups[e.src] == groups[e.dst],
            device,
            link_gbps,
            edge_positions(spec, e.name, sections[e.src].bucket_min),
        )
        if per_unit is None:
            in_place.add(e.name)
        else:
            transfer[e.name] = per_unit
    return CostModel(
        sections,
        transfer,
        TRANSFER_OVERHEAD_S,
        frozenset(in_place),
        source=f"analytic:{device}",
        update_s={s: c.update_s for s, c in sections.items() if c.update_s},
    )


TRANSFER_OVERHEAD_S = 20e-6  # per transfer: an assumed launch latency of a device-to-device copy, not fitted to data


def edge_positions(spec: WorkloadSpec, edge: str, bucket_min: int) -> int:
    """The positions every micro-step's array of `edge` holds a multiple of: its producer's
    smallest bucket (`SectionCost.bucket_min`; every bucket is a multiple of it, `core.buckets`)
    times the edge's positions per unit; 0 where the edge declares none or that is no whole
    number (no split credited)."""
    n = spec.edge_positions.get(edge, 0.0) * bucket_min
    return int(n) if n >= 1 and float(n).is_integer() else 0


def transfer_s_per_unit(
    bytes_per_unit: float,
    src: SectionPlan,
    dst: SectionPlan,
    same_group: bool,
    device: str,
    link_gbps: float,
    positions: int = 0,
) -> float | None:
    """Seconds per producer work unit of an edge from `src` to `dst`, or None when its rows stay
    where they are (co-located sections with one layout: no transfer at all).

    Co-located sections share devices; when DP(producer) divides DP(consumer), a row's producer
    devices hold its consumer devices (batch axes lead the device order in both meshes): the
    tile map cuts pieces in place and copies each tile to its replicas only, a few neighbouring
    devices (NVLink). Otherwise rows cross the inter-node link. Shards send in parallel; the
    slowest device sets the time. A consumer shard receives the whole rows of every producer
    shard that feeds it (`delivered`: `width` of them), and a producer shard sends its rows to
    every consumer shard it feeds, the sends spread over its replicas
    (`runtime.transfer.plan_transfer` reads them in turn); of the micro-step's DP(p) shards of rows.

    `positions`: the fewest positions the edge's rows x positions x features array has in a
    micro-step (0: the edge declares no such layout). Where a mesh splits them
    (`runtime.sharding.edge_sharding`, `SectionPlan.position_shards`), a source device holds and
    sends only its slice of its shard's rows and a destination device receives only its own.
    Then the destination's devices that keep one slice whole share it over the node's links
    (`DEVICES[...]["link"]`): the transfer copies each tile from the device that assembled it to
    its replicas, and a program that received `tensor` slices gathers them (its activations are
    whole over `tensor`)."""
    if same_group and src.mesh == dst.mesh:
        return None
    local = same_group and dst.dp % src.dp == 0
    per_device = DEVICES[device]["link"] if local else link_gbps * 1e9
    split_src = src.position_shards(positions) if positions else 1
    split_dst = dst.position_shards(positions) if positions else 1
    width = delivered(src.dp, dst.dp)[1]  # producer shards per consumer shard, at most
    replicas = len(src.devices) // (src.dp * split_src)  # devices holding one slice of a producer shard
    sends = -(-delivered(dst.dp, src.dp)[1] // replicas)  # consumer shards per replica
    moved = bytes_per_unit * max(width / split_dst, (1 if local else sends) / split_src) / (per_device * src.dp)
    tile = bytes_per_unit * width / (src.dp * split_dst)  # what one destination device receives
    gathered = dst.axis_sizes["tensor"] - 1 if "tensor" in position_axes(dst.axis_sizes, positions or 1) else 0
    copies = len(dst.devices) // (dst.dp * split_dst) - 1
    return moved + tile * (copies + gathered) / DEVICES[device]["link"]


def monolithic_time(spec: WorkloadSpec, metas, cost: CostModel, mb: int, rows: int, only: str | None = None) -> float:
    """Every section (or `only` that one) one after the other on all devices, per micro-batch;
    the micro-batches packed the best of three ways a monolithic trainer could: arrival order,
    longest first by the sink's work (similar sequence lengths share a bucket, as maestro packs
    its sections), or longest first by the sample's whole modelled time. Then each section's
    optimizer step (`cost.update_s`), one after another on the same devices."""

    def alone(m) -> float:
        return sum(cost.step_time(s, "F", [u], 1) - cost.sections[s].overhead_s for s, u in m.work.items())

    sink = spec.sink
    orders = (
        list(metas),
        sorted(metas, key=lambda m: m.work.get(sink, 0), reverse=True),
        sorted(metas, key=alone, reverse=True),
    )
    update = sum(t for s, t in cost.update_s.items() if only in (None, s))
    return min(packed_time(spec, order, cost, mb, rows, only) for order in orders) + update


def packed_time(spec: WorkloadSpec, metas, cost: CostModel, mb: int, rows: int, only: str | None = None) -> float:
    """`metas` in that order, `rows` at a time (`mb` a shard), every section (or `only` that one)
    one after the other per micro-batch, each padded to its micro-batch's largest work; no
    optimizer step."""
    total = 0.0
    for i in range(0, len(metas), rows):
        chunk = metas[i : i + rows]
        for s, sec in spec.sections.items():
            if only is not None and s != only:
                continue
            units = [m.work.get(s, 0) for m in chunk]
            if not any(units):
                continue
            if s == spec.sink:
                total += cost.step_time(s, "L", units, mb)
            else:
                total += cost.step_time(s, "F", units, mb) * (
                    1 + (cost.sections[s].backward_factor if sec.trained else 0)
                )
    return total


def simulate_plan(
    spec: WorkloadSpec,
    plan: Plan,
    mono_sp: SectionPlan,
    metas_all,
    *,
    device: str,
    link_gbps: float,
    max_in_flight: int,
    run_ahead: int = 0,
    mono_remat: Mapping[str, str] | None = None,
    balance_shards: bool = True,
):
    """Naive, wavefront and monolithic step times of `plan` on `metas_all`, and what they imply;
    returns the report and the first batch's simulated wavefront timeline. The monolithic layout
    is `mono_sp` with each section's precision, and activation checkpointing by section from
    `mono_remat` (`baselines.monolithic_best`'s), else `mono_sp.layer_remat` for every trained one."""
    problem = spec.problem(plan, max_in_flight, run_ahead, balance_shards)
    cost = cost_model(spec, dict(plan.sections), metas_all, device, link_gbps)
    mono_cost = _monolithic_cost(spec, mono_sp, mono_remat, metas_all, device, link_gbps)
    devices = {s: len(plan.sections[s].devices) for s in spec.sections}
    runs = {"naive": [], "wavefront": [], "monolithic": []}
    sink_alone = []  # the monolithic layout running the sink's work only (the LLM on text alone)
    timelines, spent = [], []  # the wavefront's timelines, and where their device time goes
    for metas in metas_all:
        for name, sched in (("naive", naive(metas, problem)), ("wavefront", wavefront(metas, problem, cost))):
            t = simulate(sched, problem, metas, cost, devices=devices)
            runs[name].append(t.makespan)
            if name == "wavefront":
                timelines.append(t)
                spent.append(
                    (device_time(t, sched, problem, metas, cost), section_time(t, sched, problem, metas, cost))
                )
        runs["monolithic"].append(monolithic_time(spec, metas, mono_cost, mono_sp.micro_batch, mono_sp.rows))
        sink_alone.append(monolithic_time(spec, metas, mono_cost, mono_sp.micro_batch, mono_sp.rows, only=spec.sink))
    maestro_devices = len({d for sp in plan.sections.values() for d in sp.devices})  # co-located count once
    report = {
        "workload": spec.name,
        "sections": list(spec.sections),
        "device": device,
        "cost_source": cost.source,
        "devices": {"maestro": devices, "monolithic": len(mono_sp.devices)},
        **_rates(runs, plan.global_batch, maestro_devices, len(mono_sp.devices)),
        **_timeline_figures(spec, runs, sink_alone, timelines, spent),
    }
    return report, timelines[0]


def _monolithic_cost(spec: WorkloadSpec, mono_sp: SectionPlan, mono_remat, metas_all, device: str, link_gbps: float):
    """The cost model of the monolithic layout `mono_sp`, each section in its own precision and
    checkpointing (`simulate_plan`), its sequences unpacked."""
    mono_plans = {
        s: dataclasses.replace(
            mono_sp,
            precision=sec.precision,
            layer_remat=mono_remat[s] if mono_remat else mono_sp.layer_remat if sec.trained else "none",
        )
        for s, sec in spec.sections.items()
    }  # each section's precision, as `baselines.monolithic_best`
    return cost_model(spec, mono_plans, metas_all, device, link_gbps, packed=False)


def _rates(runs: Mapping[str, list], global_batch: int, maestro_devices: int, mono_devices: int) -> dict:
    """Throughput and step time by mode, per device, and the speedups they imply."""
    sps = {k: global_batch / statistics.mean(v) for k, v in runs.items()}
    per_device = {
        "monolithic": sps["monolithic"] / mono_devices,
        "naive": sps["naive"] / maestro_devices,
        "wavefront": sps["wavefront"] / maestro_devices,
    }
    return {
        "samples_per_s": sps,
        "samples_per_s_per_device": per_device,
        "step_time_s": {k: statistics.mean(v) for k, v in runs.items()},
        "end_to_end_speedup": sps["wavefront"] / sps["monolithic"],
        "per_device_speedup": per_device["wavefront"] / per_device["monolithic"],
        "wavefront_vs_naive": sps["wavefront"] / sps["naive"],
    }


def _timeline_figures(spec: WorkloadSpec, runs, sink_alone, timelines, spent) -> dict:
    """What the wavefront's simulated timelines say: the lower bound and the makespan over it, the
    critical section alone, the sink's efficiency against running alone, bubbles, busy time and
    where the device time goes."""
    bound = statistics.mean(t.lower_bound for t in timelines)
    return {
        "lower_bound_s": bound,
        "makespan_over_lower_bound": statistics.mean(runs["wavefront"]) / bound,
        "critical_section_alone_s": statistics.mean(t.busy[spec.sink] for t in timelines),
        # the sink's (the LLM's) throughput in the compound step over its throughput on the same
        # tokens alone, on the same devices and layout: the paper's "efficiency relative to
        # text-only" (Maestro 100%, Megatron-LM 93-94% there)
        "sink_efficiency_vs_alone": {
            "maestro": statistics.mean(t.busy[spec.sink] for t in timelines) / statistics.mean(runs["wavefront"]),
            "monolithic": statistics.mean(sink_alone) / statistics.mean(runs["monolithic"]),
        },
        "bubble_ratio": statistics.mean(t.bubble_ratio for t in timelines),
        "busy_s": {s: statistics.mean(t.busy[s] for t in timelines) for s in spec.sections},
        "device_time": {k: statistics.mean(d[k] for d, _ in spent) for k in DEVICE_TIME},
        "device_time_by_section": {
            s: {k: statistics.mean(d[s][k] for _, d in spent) for k in DEVICE_TIME[:-1]} for s in spec.sections
        },
    }


__all__ = ["DEVICES", "cost_model", "edge_positions", "monolithic_time", "simulate_plan", "transfer_s_per_unit"]
