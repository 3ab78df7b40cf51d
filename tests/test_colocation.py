"""Co-located sections: several sections on the same devices, each with its own mesh, micro-batch
and precision. The constraint checks accept them and share the memory budget, the scheduler and
the simulator run them one at a time on their devices, the planner searches them (the monolithic
layout is one point of its space), and the step stays the monolithic step."""

import dataclasses
import itertools

import pytest
from conftest import ROOT, TINY_KD, TINY_VLM, paper_spec

from maestro_jax.config import load_config
from maestro_jax.core.plan import (
    MemoryBudgetError,
    Plan,
    ResourceError,
    SectionPlan,
    check_memory,
    check_resources,
    device_groups,
    mesh_shape,
)
from maestro_jax.planning.cluster import cost_model
from maestro_jax.planning.simulator import simulate
from maestro_jax.schedule import naive, validate, wavefront
from maestro_jax.tools.plan import planner_for
from maestro_jax.tools.verify import verify

CPU = ["simulate.device=cpu"]
# both sections on all 8 devices, each with a layout of its own
COLOCATED_VLM = [
    "sections.vision.devices=0:8",
    "sections.vision.mesh={data: 4, tensor: 2}",
    "sections.vision.micro_batch=2",
    "sections.llm.devices=0:8",
    "sections.llm.mesh={data: 4, fsdp: 2}",
    "sections.llm.micro_batch=1",
    "edges.image_embeds.fanout=2",
]


def _plan(**devices) -> Plan:
    return Plan({s: SectionPlan(tuple(d), mesh_shape(data=len(d)), 1) for s, d in devices.items()}, {}, 8)


def test_sections_share_exactly_the_same_devices_or_none():
    check_resources(_plan(a=range(4), b=range(4), c=range(4, 8)), 8)
    assert device_groups(_plan(a=range(4), b=[3, 2, 1, 0], c=range(4, 8)).sections) == {"a": "a", "b": "a", "c": "c"}
    with pytest.raises(
        ResourceError,
        match=r"sections.b.devices=\[2, 3, 4, 5\]: device 2 is also used by section "
        r"'a' on \[0, 1, 2, 3\]; sections share either exactly the same",
    ):
        check_resources(_plan(a=range(4), b=range(2, 6)), 8)
    with pytest.raises(ResourceError, match="each device may appear once"):
        check_resources(_plan(a=[0, 0]), 8)
    with pytest.raises(ResourceError) as err:  # thousands of devices: one readable line
        check_resources(_plan(a=range(512), b=range(256, 4096)), 4096)
    assert str(err.value) == (
        "sections.b.devices='256:4096': device 256 is also used by section 'a' on 0:512; sections share "
        "either exactly the same devices (co-located) or none"
    )


def test_co_located_sections_share_the_memory_budget():
    plan = _plan(a=range(4), b=range(4), c=range(4, 8))
    state, act = {"a": 3.0, "b": 3.0, "c": 3.0}, {"a": 2.0, "b": 2.0, "c": 2.0}
    check_memory(plan, 8.0, state, act)  # a and b run one at a time: 3 + 3 + max(2, 2)
    with pytest.raises(MemoryBudgetError, match=r"sections.\{a,b\} \(co-located\)=.*exceeds"):
        check_memory(plan, 7.9, state, act)
    # a's stash outlives its programs: it sits beside b's working activations
    with pytest.raises(MemoryBudgetError, match="co-located"):
        check_memory(plan, 8.0, state, act, held={"a": 1.0})
    check_memory(plan, 9.0, state, act, held={"a": 1.0})


def _simulated(p, plan, metas):
    cost = cost_model(p.spec, dict(plan.sections), p.metas, p.device, p.link_gbps)
    problem = p.spec.problem(plan, p.max_in_flight)
    return simulate(wavefront(metas, problem, cost), problem, metas, cost)


@pytest.mark.slow
def test_simulator_runs_co_located_sections_one_at_a_time():
    cfg = load_config(ROOT / "configs/vlm_paper_scale.yaml")
    p = planner_for(cfg, 64, 80.0)
    vision = SectionPlan(tuple(range(64)), mesh_shape(data=16, context=2, tensor=2), 2, "remat", precision="bfloat16")
    llm = SectionPlan(tuple(range(64)), mesh_shape(fsdp=8, expert=2, context=4), 1, precision="bfloat16")
    shared = Plan({"vision": vision, "llm": llm}, {"image_embeds": 1}, cfg.global_batch)
    timeline = _simulated(p, shared, p.metas[0])
    on_devices = sorted((i.start, i.end) for i in timeline.intervals if i.op.kind not in ("X", "XB"))
    assert all(a[1] <= b[0] + 1e-12 for a, b in itertools.pairwise(on_devices)), "one program at a time"
    assert timeline.makespan >= sum(timeline.busy.values()) - 1e-9
    assert timeline.lower_bound == pytest.approx(sum(timeline.busy.values()))
    # the same layouts on two halves of the devices do overlap
    apart = Plan(
        {
            "vision": dataclasses.replace(
                vision, devices=tuple(range(32)), mesh=mesh_shape(data=8, context=2, tensor=2)
            ),
            "llm": dataclasses.replace(llm, devices=tuple(range(32, 64)), mesh=mesh_shape(fsdp=4, expert=2, context=4)),
        },
        {"image_embeds": 1},
        cfg.global_batch,
    )
    timeline = _simulated(p, apart, p.metas[0])
    assert timeline.makespan < sum(timeline.busy.values())


@pytest.mark.slow
@pytest.mark.extended
def test_planner_searches_co_location_and_never_loses_to_the_monolithic_layout():
    """At paper scale the fair monolithic layout (its micro-batches packed its best way) is one
    point of maestro's space: both sections on all devices, with the monolithic mesh."""
    p = planner_for(load_config(ROOT / "configs/kd_paper_scale.yaml"), 64, 80.0, spec=paper_spec("kd"))
    placements = p.placements()
    assert (("student",), ("teacher",)) in placements and (("student", "teacher"),) in placements
    report = p.search(top=3)
    assert report.best.step_time_s <= report.monolithic["step_time_s"]
    mono = report.monolithic
    mesh = mesh_shape(**mono["mesh"])
    point = Plan(
        {
            s: SectionPlan(
                tuple(range(64)),
                mesh,
                mono["micro_batch"],
                precision=sec.precision,
                layer_remat=mono["layer_remat"][s],
            )
            for s, sec in p.spec.sections.items()
        },
        {"teacher_hidden": 1},
        p.global_batch,
    )
    p.check(point)  # the monolithic layout, co-located, passes every constraint: a candidate
    assert p.step_time(point) <= mono["step_time_s"] * 1.05, "priced like the monolithic step, transfers aside"


def test_plan_on_fewer_devices_than_sections_co_locates():
    p = planner_for(load_config(ROOT / "configs/kd_tiny.yaml", TINY_KD + CPU), 1, 1.0)
    best = p.search(top=1).best
    assert {sp.devices for sp in best.plan.sections.values()} == {(0,)}
    assert best.peak_gb <= 1.0


@pytest.mark.slow
@pytest.mark.parametrize("scheduler", ["naive", "wavefront"])
def test_co_located_vlm_verifies(scheduler):
    cfg = load_config(ROOT / "configs/vlm_tiny.yaml", TINY_VLM + COLOCATED_VLM + [f"schedule.scheduler={scheduler}"])
    diffs = verify(cfg)
    assert {d.name for d in diffs} >= {"loss", "vision/grads", "llm/grads"}
    for d in diffs:
        assert d.max_rel <= 1e-5, f"{d.name}: {d.max_rel:.3e}"


@pytest.mark.slow
def test_co_located_kd_with_its_own_teacher_layout_verifies():
    cfg = load_config(
        ROOT / "configs/kd_tiny.yaml",
        TINY_KD
        + [
            "sections.teacher.devices=0:4",
            "sections.teacher.mesh={data: 2, tensor: 2}",
            "sections.student.devices=0:4",
            "sections.student.mesh={data: 4}",
            "edges.teacher_hidden.fanout=2",
            "schedule.scheduler=wavefront",
        ],
    )
    for d in verify(cfg):
        assert d.max_rel <= 1e-5, f"{d.name}: {d.max_rel:.3e}"


def test_naive_and_wavefront_schedules_of_a_co_located_plan_are_valid():
    cfg = load_config(ROOT / "configs/vlm_tiny.yaml", TINY_VLM + COLOCATED_VLM + CPU)
    p = planner_for(cfg, 8, 1.0)
    plan = cfg.plan()
    problem = p.spec.problem(plan, 2)
    assert problem.group("llm") == problem.group("vision")
    for metas in p.metas:
        for sched in (naive(metas, problem), wavefront(metas, problem)):
            validate(sched, metas, problem)
