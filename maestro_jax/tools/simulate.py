"""`maestro-jax simulate`: a config's plan predicted on a cluster, maestro vs monolithic.

The workload is read off its graph (`workloads.describe`: parameter shapes by `jax.eval_shape`,
nothing compiled or allocated) and its samples off the source's sizes; the prediction itself
is the JAX-free `planning.cluster`.
"""

from __future__ import annotations

from maestro_jax import workloads
from maestro_jax.config import Config
from maestro_jax.core.plan import SectionPlan, check_fanout, check_meshes, check_resources, mesh_shape
from maestro_jax.planning.cluster import simulate_plan
from maestro_jax.planning.cost import DEVICES
from maestro_jax.planning.pipeline import pipelined_best
from maestro_jax.planning.planner import Planner


def monolithic_baseline(cfg: Config, spec, plan, metas) -> tuple[SectionPlan, str]:
    """The monolithic layout to compare with, on as many devices as the plan uses: the fastest
    that fits the memory budget (`device_memory_gb`, else the device's own), as `plan` finds it,
    so that maestro is never measured against a layout no one would run. Without a budget (a CPU
    device) the config's `monolithic` section, as written."""
    n = len({d for sp in plan.sections.values() for d in sp.devices})
    memory_gb = cfg.device_memory_gb or DEVICES[cfg.simulate.device].get("memory_gb")
    if memory_gb is not None:
        best = Planner(spec, metas, n, memory_gb, global_batch=cfg.global_batch, device=cfg.simulate.device,
                       link_gbps=cfg.simulate.link_gbps).monolithic_best()
        if best is not None:
            return SectionPlan(tuple(range(n)), mesh_shape(**best["mesh"]), best["micro_batch"],
                               layer_remat=best["layer_remat"]), f"fastest that fits {memory_gb:g} GB"
    return cfg.monolithic_plan(), "config"


def pipelined_baseline(cfg: Config, spec, plan, metas) -> dict | None:
    """The fastest 1F1B pipeline-parallel layout (Megatron-LM's, `planning.pipeline`) on as many
    devices as the plan uses, within the memory budget `monolithic_baseline` uses; None without
    a budget (a CPU device) or when nothing fits."""
    n = len({d for sp in plan.sections.values() for d in sp.devices})
    memory_gb = cfg.device_memory_gb or DEVICES[cfg.simulate.device].get("memory_gb")
    if memory_gb is None:
        return None
    return pipelined_best(Planner(spec, metas, n, memory_gb, global_batch=cfg.global_batch,
                                  device=cfg.simulate.device, link_gbps=cfg.simulate.link_gbps))


def simulate_config(cfg: Config, gantt: str | None = None, graph=None, source=None) -> dict:
    """The prediction for `cfg`'s workload, or for a user's `graph` and `source`."""
    graph = graph or workloads.build_graph(cfg)
    spec = workloads.describe(cfg, graph)
    plan = cfg.plan()
    check_resources(plan, max(d for sp in plan.sections.values() for d in sp.devices) + 1)
    check_meshes(plan)
    check_fanout(plan, spec.edges)
    metas = workloads.planning_batches(cfg, graph, cfg.simulate.batches, source)
    mono_sp, baseline = monolithic_baseline(cfg, spec, plan, metas)
    report, timeline = simulate_plan(spec, plan, mono_sp, metas, device=cfg.simulate.device,
                                     link_gbps=cfg.simulate.link_gbps, max_in_flight=cfg.schedule.max_in_flight,
                                     run_ahead=cfg.schedule.run_ahead)
    report["monolithic_layout"] = {"mesh": dict(mono_sp.axis_sizes), "micro_batch": mono_sp.micro_batch,
                                   "layer_remat": mono_sp.layer_remat, "chosen": baseline}
    report["pipelined"] = pipelined_baseline(cfg, spec, plan, metas)
    if report["pipelined"]:  # on as many devices as the plan: a ratio of step times is one of per-device rates
        report["speedup_vs_pipelined"] = report["pipelined"]["step_time_s"] / report["step_time_s"]["wavefront"]
    if gantt:
        from maestro_jax.tools.trace import write_gantt  # noqa: PLC0415 (matplotlib only when asked)

        write_gantt(timeline.intervals, gantt, f"{spec.name} wavefront, simulated on {cfg.simulate.device}")
        report["gantt"] = gantt
    return report
