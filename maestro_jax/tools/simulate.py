"""`maestro-jax simulate`: a config's plan predicted on a cluster, maestro vs monolithic.

The workload is read off its graph (`workloads.describe`: parameter shapes by `jax.eval_shape`,
nothing compiled or allocated) and its samples off the source's sizes; the prediction itself
is the JAX-free `planning.cluster`.
"""

from __future__ import annotations

from maestro_jax import workloads
from maestro_jax.config import Config
from maestro_jax.core.plan import check_fanout, check_meshes, check_resources
from maestro_jax.planning.cluster import simulate_plan


def simulate_config(cfg: Config, gantt: str | None = None, graph=None, source=None) -> dict:
    """The prediction for `cfg`'s workload, or for a user's `graph` and `source`."""
    graph = graph or workloads.build_graph(cfg)
    spec = workloads.describe(cfg, graph)
    plan = cfg.plan()
    check_resources(plan, max(d for sp in plan.sections.values() for d in sp.devices) + 1)
    check_meshes(plan)
    check_fanout(plan, spec.edges)
    metas = workloads.planning_batches(cfg, graph, cfg.simulate.batches, source)
    report, timeline = simulate_plan(spec, plan, cfg.monolithic_plan(), metas, device=cfg.simulate.device,
                                     link_gbps=cfg.simulate.link_gbps, max_in_flight=cfg.schedule.max_in_flight)
    if gantt:
        from maestro_jax.tools.trace import write_gantt  # noqa: PLC0415 (matplotlib only when asked)

        write_gantt(timeline.intervals, gantt, f"{spec.name} wavefront, simulated on {cfg.simulate.device}")
        report["gantt"] = gantt
    return report
