"""The baselines' layouts as maestro plans, scored like any plan: the fair monolithic layout
(every section on all devices, one forward in flight) and the 1F1B pipeline's (its stages as
pipeline stages, cut as it cuts them or evenly). Both lie in the plan space, so the search
within its tolerance never does worse than either (`Planner.search` adds them to its
candidates). Plain Python, no JAX; each is priced by the problem's `Pricer`."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from maestro_jax.core.plan import Plan, PlanError, SectionPlan, mesh_shape
from maestro_jax.core.stages import even_layers, stage_name
from maestro_jax.planning.baselines import BaselineResult
from maestro_jax.planning.layout import peak_memory
from maestro_jax.planning.pricer import Pricer
from maestro_jax.planning.report import Candidate


def monolithic_point(pricer: Pricer, monolithic: BaselineResult | None) -> Candidate | None:
    """The monolithic layout as a maestro plan: every section on all devices with its mesh,
    micro-batch and checkpointing, one forward in flight (the monolithic step's memory), no
    run-ahead; scored like any plan. None when there is no monolithic layout."""
    if monolithic is None:
        return None
    sp = SectionPlan(tuple(range(pricer.problem.devices)), mesh_shape(**monolithic.mesh), monolithic.micro_batch)
    sections = {
        s: dataclasses.replace(sp, precision=sec.precision, layer_remat=monolithic.layer_remat[s])
        for s, sec in pricer.problem.spec.sections.items()
    }
    plan = Plan(sections, {e.name: 1 for e in pricer.problem.spec.edges}, pricer.problem.global_batch)
    return _point(pricer, plan, 1)


def pipelined_point(pricer: Pricer, pipelined: dict | None) -> Candidate | None:
    """The pipelined baseline's layout (`pipeline.pipelined_best`) as a maestro plan: each
    section it cuts into its P stages in P pipeline stages (`sections.<s>.stages`), stage i on
    the i-th P-th of the devices, the stages of different sections co-located stage by stage
    (a KD teacher's stage i beside the student's, as one Megatron stage holds both); a section
    it runs whole in its first stage co-located with the first stages; every section with its
    stage mesh and micro-batch, the trained ones with its checkpointing; P forwards in flight
    (1F1B's first stage holds P). Scored like any plan, by maestro's own schedule, cut as the
    baseline cuts it (`sections.<s>.stage_layers`) and evenly, the faster kept. None when
    there is no pipelined layout, a section it cuts cannot take P stages
    (`WorkloadSpec.splits`) or packs (the runtime's stages do not pack), or the plan breaks a
    constraint."""
    if pipelined is None:
        return None
    k, per = pipelined["stages"], pipelined["devices_per_stage"]
    layers = {s: tuple(c) for s, c in pipelined["layers_per_stage"].items()}
    if any(k not in pricer.problem.spec.splits.get(s, {}) or s in pricer.problem.spec.pack for s in layers):
        return None  # a section that packs never runs in stages (`sections.<s>.stages`)
    mesh = mesh_shape(**pipelined["mesh"])
    sections = {}
    for s, sec in pricer.problem.spec.sections.items():
        remat = pipelined["layer_remat"] if sec.trained else "none"
        sp = SectionPlan((), mesh, pipelined["micro_batch"], precision=sec.precision, layer_remat=remat)
        if s not in layers:
            sections[s] = dataclasses.replace(sp, devices=tuple(range(per)))
        for i in range(k) if s in layers else ():
            sections[stage_name(s, i)] = dataclasses.replace(sp, devices=tuple(range(i * per, (i + 1) * per)))
    edges = pricer.problem.spec.staged(dict.fromkeys(layers, k)).edges
    plan = Plan(
        sections, {e.name: sections[e.dst].dp // sections[e.src].dp for e in edges}, pricer.problem.global_batch
    )
    even = {s: tuple(even_layers(pricer.problem.spec.sections[s].cost.layers, k)) for s in layers}
    scored = [c for c in (_cut_point(pricer, plan, k, layers), _cut_point(pricer, plan, k, even)) if c is not None]
    return min(scored, key=lambda c: c.step_time_s, default=None)


def _cut_point(pricer: Pricer, plan: Plan, k: int, cuts: Mapping[str, tuple[int, ...]]) -> Candidate | None:
    """`plan` (sections in `k` pipeline stages) scored with those sections cut as `cuts` give
    (section -> its layers by stage), `k` forwards in flight; None where a section cannot be
    cut so or the plan breaks a constraint. The even cut is recorded as none."""
    spec = pricer.problem.spec.with_cuts(cuts)
    if spec is None:
        return None
    point = _point(Pricer(pricer.problem.replace(spec=spec, run_ahead=0, stage_counts=())), plan, k)
    uneven = {s: c for s, c in cuts.items() if list(c) != even_layers(pricer.problem.spec.sections[s].cost.layers, k)}
    return point and dataclasses.replace(point, cuts=uneven)


def _point(pricer: Pricer, plan: Plan, max_in_flight: int) -> Candidate | None:
    """A baseline's layout as a scored maestro plan with `max_in_flight` and no run-ahead;
    None when it breaks a constraint."""
    one = pricer.for_problem(pricer.problem.replace(max_in_flight=max_in_flight, run_ahead=0))
    try:
        mem = one.check(plan)
    except PlanError:
        return None
    t = one.step_time(plan)
    return Candidate(
        plan,
        t,
        pricer.problem.global_batch / t / pricer.problem.devices,
        {s: m["total"] / 2**30 for s, m in mem.items()},
        max_in_flight,
        peak_memory(plan, mem) / 2**30,
        0,
        pricer.problem.spec.staged(pricer.stage_counts(plan)).stages,
    )
