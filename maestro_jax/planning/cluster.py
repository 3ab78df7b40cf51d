"""`maestro-jax simulate`: predicted throughput of a config on a cluster, maestro vs monolithic.

No JAX and no model weights: sample sizes come from the data config, costs from the analytic
model (FLOPs at the device's peak, efficiency from the work per device; see cost.py), and the
same scheduler and simulator the runtime uses. The monolithic baseline runs every section's
work for each micro-batch, in arrival order, on all its devices with one layout and one
micro-batch size; vision runs over every row of a micro-batch that holds an image (static
shapes in one program), and nothing overlaps.
"""

from __future__ import annotations

import statistics

from maestro_jax.config import Config
from maestro_jax.core.plan import SectionPlan
from maestro_jax.planning.cost import DEVICES, CostModel, SectionCost, analytic_section
from maestro_jax.planning.simulator import simulate
from maestro_jax.schedule import naive, wavefront
from maestro_jax.workloads import shapes as workloads


def _section_cost(cfg: Config, section: str, sp: SectionPlan, metas_all, trained_sink: bool) -> SectionCost:
    linear, attn, width = workloads.flops(cfg, section)
    params = linear / 2  # a weight costs 2 FLOPs (multiply, add) per unit of work
    units = [m.work[section] for batch in metas_all for m in batch if section in m.work]
    typical = statistics.mean(units) if units else 1.0
    attn2 = attn
    if section == "vision":
        v = cfg.models["vision"]
        per_image = statistics.mean([(h // v.patch) * (w // v.patch) for h, w in cfg.data.image_sizes] or [1])
        linear, attn2 = linear + attn * per_image, 0.0  # block-diagonal: context is one image
    tensor = sp.axis_sizes["tensor"]
    c = analytic_section(linear, attn2, sp.micro_batch, tensor, int(typical), device=cfg.simulate.device,
                         trained_sink=trained_sink, width_per_device=width / tensor)
    return SectionCost(c.per_unit_s, c.per_unit2_s, c.overhead_s + fsdp_gather_s(cfg, sp, params),
                       c.backward_factor, c.sink_factor, bucket_min=256)


def fsdp_gather_s(cfg: Config, sp: SectionPlan, params: float) -> float:
    """Time of one all-gather of a section's fsdp-sharded bf16 weights, paid per micro-step (the
    backward pays it again plus a reduce-scatter: `backward_factor` scales it with the compute).
    Inside a node (<= 8 devices in the fsdp x tensor group) it runs at NVLink speed, across nodes
    at `simulate.link_gbps`. Counted in full, not overlapped with compute: a pessimistic price,
    but the price that keeps a planner from sharding everything with fsdp for free."""
    fsdp, tensor = sp.axis_sizes["fsdp"], sp.axis_sizes["tensor"]
    if fsdp == 1:
        return 0.0
    link = DEVICES[cfg.simulate.device]["link"] if fsdp * tensor <= 8 else cfg.simulate.link_gbps * 1e9
    return 2 * params / tensor * (fsdp - 1) / fsdp / link


def cost_model(cfg: Config, plans: dict[str, SectionPlan], metas_all) -> CostModel:
    shape = workloads.SHAPES[cfg.workload]
    sections = {s: _section_cost(cfg, s, plans[s], metas_all, s == shape.sink) for s in shape.sections}
    e = shape.edge
    src_model = cfg.models[e.src]
    bytes_per_unit = (2 * src_model.out_width / src_model.merge**2) if src_model.kind == "vit" else 2 * src_model.width
    dp = min(plans[e.src].dp, plans[e.dst].dp)
    link = cfg.simulate.link_gbps * 1e9 * dp
    return CostModel(sections, {e.name: bytes_per_unit / link}, 20e-6, source=f"analytic:{cfg.simulate.device}")


def monolithic_time(cfg: Config, metas, cost: CostModel, mb: int, rows: int) -> float:
    shape = workloads.SHAPES[cfg.workload]
    total = 0.0
    for i in range(0, len(metas), rows):
        chunk = metas[i:i + rows]
        for s, trained in shape.sections.items():
            units = [m.work.get(s, 0) for m in chunk]
            if not any(units):
                continue
            if s == shape.sink:
                total += cost.step_time(s, "L", units, mb)
            else:
                total += cost.step_time(s, "F", units, mb) * (1 + (cost.sections[s].backward_factor if trained else 0))
    return total


def simulate_config(cfg: Config, gantt: str | None = None) -> dict:
    shape = workloads.SHAPES[cfg.workload]
    plan, problem = cfg.plan(), workloads.problem(cfg)
    metas_all = [workloads.metas(cfg, b) for b in range(cfg.simulate.batches)]
    cost = cost_model(cfg, dict(plan.sections), metas_all)
    mono_sp = cfg.monolithic_plan()
    mono_cost = cost_model(cfg, {s: mono_sp for s in shape.sections}, metas_all)
    devices = {s: len(plan.sections[s].devices) for s in shape.sections}
    runs = {"naive": [], "wavefront": [], "monolithic": []}
    bounds, busy_sink, timelines = [], [], []
    for metas in metas_all:
        for name, sched in (("naive", naive(metas, problem)), ("wavefront", wavefront(metas, problem, cost))):
            t = simulate(sched, problem, metas, cost, devices=devices)
            runs[name].append(t.makespan)
            if name == "wavefront":
                bounds.append(t.lower_bound)
                busy_sink.append(t.busy[shape.sink])
                timelines.append(t)
        runs["monolithic"].append(monolithic_time(cfg, metas, mono_cost, mono_sp.micro_batch, mono_sp.rows))
    n = cfg.global_batch
    sps = {k: n / statistics.mean(v) for k, v in runs.items()}
    maestro_devices, mono_devices = sum(devices.values()), len(mono_sp.devices)
    per_device = {"monolithic": sps["monolithic"] / mono_devices, "naive": sps["naive"] / maestro_devices,
                  "wavefront": sps["wavefront"] / maestro_devices}
    report = {
        "device": cfg.simulate.device, "cost_source": cost.source,
        "devices": {"maestro": devices, "monolithic": mono_devices},
        "samples_per_s": sps, "samples_per_s_per_device": per_device,
        "step_time_s": {k: statistics.mean(v) for k, v in runs.items()},
        "end_to_end_speedup": sps["wavefront"] / sps["monolithic"],
        "per_device_speedup": per_device["wavefront"] / per_device["monolithic"],
        "wavefront_vs_naive": sps["wavefront"] / sps["naive"],
        "lower_bound_s": statistics.mean(bounds),
        "makespan_over_lower_bound": statistics.mean(runs["wavefront"]) / statistics.mean(bounds),
        "critical_section_alone_s": statistics.mean(busy_sink),
        "bubble_ratio": statistics.mean(t.bubble_ratio for t in timelines),
        "busy_s": {s: statistics.mean(t.busy[s] for t in timelines) for s in shape.sections},
    }
    if gantt:
        from maestro_jax.tools.trace import write_gantt

        write_gantt(timelines[0].intervals, gantt, f"{cfg.workload} wavefront, simulated on {cfg.simulate.device}")
        report["gantt"] = gantt
    return report


__all__ = ["DEVICES", "simulate_config"]
