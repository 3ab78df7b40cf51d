"""`maestro-jax plan`: the JAX-free planner fed from a config's workload, and planned configs.

The workload's graph is described once (`workloads.describe`: parameter shapes from
`jax.eval_shape`, costs declared by its sections), so the planner plans what the runtime runs.
"""

from __future__ import annotations

from collections.abc import Callable

from maestro_jax import workloads
from maestro_jax.config import Config
from maestro_jax.core.stages import stage_edge
from maestro_jax.planning.planner import TOLERANCE, Candidate, Planner
from maestro_jax.planning.problem import PlanningProblem
from maestro_jax.runtime.build import check_pack_budget

PLANNING_BATCHES = 2  # global batches of sample sizes the planner scores plans on (`maestro-jax plan`)


def problem_for(
    cfg: Config,
    devices: int,
    memory_gb: float,
    batches: int = PLANNING_BATCHES,
    graph=None,
    source=None,
    metas=None,
    spec=None,
    **settings,
) -> PlanningProblem:
    """The planning question of `cfg`'s workload (or of a user's `graph` and `source`) on
    `devices` devices of `memory_gb` each: its spec, `batches` planning batches (or `metas`), and
    the config's global batch, cost model device, links and schedule settings; `settings`: other
    `PlanningProblem` fields (`stage_counts`, ...). `spec`: the workload's planning view
    (`workloads.describe(cfg)`, whole sections) where the caller holds it already: describing
    traces the whole graph's init (seconds at paper scale), so a sweep over device counts or
    memories describes its workload once."""
    graph = graph or workloads.build_graph(cfg)
    if graph.staging is not None:  # the planner chooses the stages itself: it plans the whole sections
        graph = graph.staging.whole
    source = source if source is not None else workloads.source_from_config(cfg)
    check_pack_budget(cfg, source)  # a packed row prices its samples whole
    spec = spec or workloads.describe(cfg, graph)
    metas = metas or workloads.planning_batches(cfg, graph, batches, source)
    return PlanningProblem.of(
        spec,
        metas,
        devices,
        memory_gb,
        global_batch=cfg.global_batch,
        device=cfg.simulate.device,
        link_gbps=cfg.simulate.link_gbps,
        max_in_flight=cfg.schedule.max_in_flight,
        run_ahead=cfg.schedule.run_ahead,
        balance_shards=cfg.schedule.balance_shards,
    ).replace(**settings)


def planner_for(
    cfg: Config,
    devices: int,
    memory_gb: float,
    batches: int = PLANNING_BATCHES,
    graph=None,
    source=None,
    progress: Callable[[str], None] | None = None,
    tolerance: float = TOLERANCE,
    **settings,
) -> Planner:
    """A planner of `problem_for(cfg, ...)`; `progress` and `tolerance` as `Planner`'s."""
    problem = problem_for(cfg, devices, memory_gb, batches, graph, source, **settings)
    return Planner(problem, tolerance=tolerance, progress=progress)


def plan_overrides(c: Candidate) -> dict[str, object]:
    """Config keys that set a candidate's plan (for `--write` and `key=value` overrides): a
    section in pipeline stages as `sections.<s>.stages` with its devices from the first stage's
    first to the last's last and its mesh over all of them (the stages' data axis times their
    count), as `Config.plan` cuts it again, and its layers by stage where the cut is not the even
    one (`stage_layers`); every other section planned `stages: 1`."""
    out: dict[str, object] = {}
    described = c.describe()
    of = {stage: s for s, order in c.stages.items() for stage in order}
    for s in dict.fromkeys(of.get(name, name) for name in described):
        order = c.stages.get(s, (s,))
        first, last = described[order[0]], described[order[-1]]
        out[f"sections.{s}.devices"] = f"{first['devices'].split(':')[0]}:{last['devices'].split(':')[1]}"
        out[f"sections.{s}.mesh"] = dict(first["mesh"], data=first["mesh"]["data"] * len(order))
        out[f"sections.{s}.micro_batch"] = first["micro_batch"]
        out[f"sections.{s}.residuals"] = first["residuals"]
        out[f"sections.{s}.layer_remat"] = first["layer_remat"]
        out[f"sections.{s}.stages"] = len(order)
        if s in c.cuts:
            out[f"sections.{s}.stage_layers"] = list(c.cuts[s])
    inner = {stage_edge(s, i) for s, order in c.stages.items() for i in range(len(order) - 1)}  # stage to stage
    out.update({f"edges.{e}.fanout": f for e, f in c.plan.fanout.items() if e not in inner})  # derived, where whole
    out["schedule.max_in_flight"] = c.max_in_flight
    out["schedule.run_ahead"] = c.run_ahead
    return out


def write_plan(config_path: str, overrides: list[str], best: Candidate, memory_gb: float, out_path: str) -> None:
    """The config at `config_path` (with `overrides`) with `best`'s plan, as YAML that `train`,
    `verify` and `bench` accept; checked by loading it back."""
    import yaml

    from maestro_jax.config import load_config, parse_overrides, set_dotted

    with open(config_path) as f:
        raw = yaml.safe_load(f) or {}
    for key, value in {**parse_overrides(overrides), **plan_overrides(best), "device_memory_gb": memory_gb}.items():
        set_dotted(raw, key, value)
    for name, edge in (raw.get("edges") or {}).items():  # a stated fanout the plan has none for (uneven): dropped
        if isinstance(edge, dict) and name not in best.plan.fanout:
            edge.pop("fanout", None)
    header = (
        f"# Written by `maestro-jax plan` from {config_path}: predicted {best.step_time_s:.4g} s/step.\n"
        f"#   maestro-jax bench --config {out_path}\n"
    )
    with open(out_path, "w") as f:
        f.write(header + yaml.safe_dump(raw, sort_keys=False))
    load_config(out_path)
