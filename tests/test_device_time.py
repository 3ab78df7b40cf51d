"""Where a simulated step's device time goes (`simulator.device_time`): each share checked
against sums done by hand on small schedules, idle against the timeline's own bubble ratio, and
`plan` reporting the best plan's."""

import pytest

from maestro_jax.core.plan import EdgeInfo
from maestro_jax.planning.cost import CostModel, SectionCost
from maestro_jax.planning.simulator import DEVICE_TIME, device_time, section_time, simulate
from maestro_jax.schedule import Problem, SampleMeta, wavefront

TEACHER = SectionCost(per_unit_s=1e-3, overhead_s=1e-2)
STUDENT = SectionCost(per_unit_s=2e-3, overhead_s=1e-2, sink_factor=3.0)


def kd(mb=1, groups=None):
    return Problem(
        order=("teacher", "student"),
        sink="student",
        trained=frozenset({"student"}),
        edges=(EdgeInfo("h", "teacher", "student"),),
        rows={"teacher": mb, "student": mb},
        dp={"teacher": 1, "student": 1},
        groups=groups or {},
    )


def spent(problem, units, teacher=TEACHER, devices=None):
    """(device-seconds by share, total device-seconds, timeline, schedule) of one batch whose
    samples take `units` in both sections."""
    cost = CostModel({"teacher": teacher, "student": STUDENT}, update_s={"student": 0.05})
    metas = [SampleMeta(frozenset(problem.order), dict.fromkeys(problem.order, u)) for u in units]
    schedule = wavefront(metas, problem, cost)
    timeline = simulate(schedule, problem, metas, cost, devices=devices)
    size = {timeline.groups.get(s, s): n for s, n in timeline.devices.items()}
    total = timeline.makespan * sum(size.values())
    shares = device_time(timeline, schedule, problem, metas, cost)
    assert set(shares) == set(DEVICE_TIME) and sum(shares.values()) == pytest.approx(1.0)
    assert shares["idle"] == pytest.approx(timeline.bubble_ratio)  # the timeline's own idle, counted apart
    by_section = section_time(timeline, schedule, problem, metas, cost)
    for k in DEVICE_TIME[:-1]:  # the sections' shares add up to the step's
        assert sum(d[k] for d in by_section.values()) == pytest.approx(shares[k], abs=1e-12), k
    assert by_section["teacher"]["optimizer"] == 0, "a frozen teacher takes no update"
    return {k: v * total for k, v in shares.items()}, total, timeline, schedule


def test_exact_rows_spend_work_overheads_and_the_update():
    """Four 32-unit samples, one a micro-step (32 is a bucket: no padding): the teacher's forward
    costs 0.032 s of work and 0.01 s of overhead each, the student's loss three times its
    0.064 s and 0.01 s; one 0.05 s update; the rest of two devices' makespan is idle."""
    assert TEACHER.padded(32) == 32
    got, total, _, _ = spent(kd(), [32] * 4)
    assert got["work"] == pytest.approx(4 * 0.032 + 4 * 3 * 0.064)
    assert got["overhead"] == pytest.approx(4 * 0.01 + 4 * 3 * 0.01)
    assert got["optimizer"] == pytest.approx(0.05)
    for k in ("row_padding", "empty_rows", "bucket_padding", "collectives"):
        assert got[k] == pytest.approx(0.0, abs=1e-12), k
    assert got["idle"] == pytest.approx(total - 0.896 - 0.16 - 0.05)


def test_padding_counts_shorter_rows_empty_rows_and_buckets():
    """Two rows a micro-step, samples of 32 and 16 units (both buckets): a micro-step computes
    both rows at its longest, an odd sample's micro-step an empty row too, read here off the
    schedule's micro-steps; no bucket pads. A 33-unit sample alone pads to its bucket."""
    assert TEACHER.padded(16) == 16
    units = [32, 16, 32]
    got, _, _, schedule = spent(kd(mb=2), units)
    shorter, empty = dict.fromkeys(("teacher", "student"), 0), dict.fromkeys(("teacher", "student"), 0)
    for s, steps in schedule.steps.items():
        for st in steps:
            held = [units[x] for x in st.positions if x >= 0]
            shorter[s] += len(held) * max(held) - sum(held)
            empty[s] += (len(st.positions) - len(held)) * max(held)
    assert empty["teacher"] > 0, "the odd sample's micro-step has an empty row"
    assert got["row_padding"] == pytest.approx(shorter["teacher"] * 1e-3 + shorter["student"] * 2e-3 * 3, abs=1e-12)
    assert got["empty_rows"] == pytest.approx(empty["teacher"] * 1e-3 + empty["student"] * 2e-3 * 3)
    assert got["bucket_padding"] == pytest.approx(0.0, abs=1e-12)
    assert got["work"] == pytest.approx(sum(units) * (1e-3 + 3 * 2e-3))

    b = TEACHER.padded(33)
    assert b > 33
    got, _, _, _ = spent(kd(), [33])
    assert got["bucket_padding"] == pytest.approx((b - 33) * (1e-3 + 3 * 2e-3))
    assert got["row_padding"] == pytest.approx(0.0, abs=1e-12) and got["empty_rows"] == 0


def test_collectives_the_compute_does_not_hide():
    """A forward with 0.05 s of per-layer gathers over 2 layers beside 0.032 s of compute takes
    0.01 + 0.082 / 2 + 0.05 / 2 = 0.076 s (`SectionCost.forward_s`): 0.034 s of it is exposed."""
    teacher = SectionCost(per_unit_s=1e-3, overhead_s=1e-2, overlapped_s=0.05, layers=2)
    got, _, _, _ = spent(kd(), [32], teacher=teacher)
    assert got["collectives"] == pytest.approx(0.076 - 0.01 - 0.032)


def test_co_located_sections_count_their_devices_once():
    """Teacher and student sharing two devices: the total is the makespan on two devices, not
    four, and each op's time counts on both."""
    got, total, timeline, _ = spent(
        kd(groups={"teacher": "g", "student": "g"}), [32] * 2, devices=dict.fromkeys(("teacher", "student"), 2)
    )
    assert total == pytest.approx(2 * timeline.makespan)
    assert got["work"] == pytest.approx(2 * (2 * 0.032 + 2 * 3 * 0.064))


def test_a_staged_plan_is_accounted_stage_by_stage():
    """The pipelined baseline's layout as a maestro plan (sections in pipeline stages, priced by
    the staged planner): its device time sums to 1, and by section it names the stages."""
    from conftest import ROOT

    from maestro_jax.config import load_config
    from maestro_jax.planning.pipeline import pipelined_best
    from maestro_jax.tools.plan import planner_for

    planner = planner_for(load_config(ROOT / "configs/kd_tiny.yaml", ["simulate.device=h100"]), 8, 1.0)
    staged = planner._pipelined_point(pipelined_best(planner))
    shares, by_section = planner._spent(staged)
    assert set(by_section) == set(staged.plan.sections) == {"teacher.0", "teacher.1", "student.0", "student.1"}
    assert sum(shares.values()) == pytest.approx(1.0)
    assert sum(sum(d.values()) for d in by_section.values()) + shares["idle"] == pytest.approx(1.0)
    assert by_section["teacher.0"]["optimizer"] == 0 < by_section["student.1"]["optimizer"]


def test_the_sinks_empty_rows_are_named_with_the_global_batches_that_fill_them():
    """`plan`'s note: over 2% of the device time in the sink's empty rows (its stages' summed)
    names the sink's rows a micro-step and the nearest global batches they divide; under it, or
    for another section's empty rows, nothing is said."""
    from maestro_jax.core.plan import Plan, SectionPlan, mesh_shape
    from maestro_jax.tools.simulate import empty_rows_note

    def plan(*names):
        return Plan({n: SectionPlan(tuple(range(32)), mesh_shape(data=32), 1) for n in names}, {}, 144)

    spent = {"vision": {"empty_rows": 0.05}, "llm": {"empty_rows": 0.072}}
    note = empty_rows_note(spent, plan("vision", "llm"), "llm", 144)
    assert note is not None and "7.20% of the device time is the llm's empty rows" in note
    assert "takes 32 rows a micro-step" in note and "global_batch=128 or 160" in note
    assert (
        empty_rows_note(
            {"vision": {"empty_rows": 0.05}, "llm": {"empty_rows": 0.01}}, plan("vision", "llm"), "llm", 144
        )
        is None
    )
    staged = {"llm.0": {"empty_rows": 0.015}, "llm.1": {"empty_rows": 0.015}}
    assert "3.00%" in empty_rows_note(staged, plan("llm.0", "llm.1"), "llm", 144)
    assert empty_rows_note({"llm": {"empty_rows": 0.5}}, plan("llm"), "llm", 16).endswith(
        "global_batch=32 fills them (a change of the training recipe, not of the plan)"
    )
