"""What users run today, priced beside the fair baseline (`planning/baselines.py`): Megatron's
data order waits for its heaviest rank, static shapes pad every sample to the most work, the
shared KD recipe gives the teacher the student's precision, and no price beats the ceiling."""

import json

import pytest
from conftest import ROOT

from maestro_jax import cli
from maestro_jax.config import load_config
from maestro_jax.core.plan import SectionPlan, mesh_shape
from maestro_jax.planning import baselines
from maestro_jax.planning.baselines import (
    BASELINES,
    USERS,
    BaselineResult,
    baseline_lines,
    baselines_json,
    ceiling_time,
    price_baselines,
    round_robin_time,
    static_padding_time,
    user_baselines,
)
from maestro_jax.planning.cluster import cost_model, monolithic_time
from maestro_jax.planning.planner import Planner
from maestro_jax.planning.simulator import DEVICE_TIME
from maestro_jax.schedule.ops import SampleMeta
from maestro_jax.tools.plan import planner_for

KD = ROOT / "configs/kd_tiny.yaml"
VLM = ROOT / "configs/vlm_tiny.yaml"
H100 = ["simulate.device=h100"]


def priced(config, units_by_sample, devices=8, mesh=None, mb=1):
    """A planner whose one batch holds one sample per entry of `units_by_sample` (its work in
    every section), the monolithic layout `mesh` on all devices, and that layout's cost model."""
    spec = planner_for(load_config(config, H100), devices, 1.0).spec
    metas = [[SampleMeta(frozenset(s for s in spec.order if u), dict.fromkeys(spec.order, u)) for u in units_by_sample]]
    planner = Planner(spec, metas, devices, 1.0, global_batch=len(units_by_sample), device="h100", link_gbps=50.0)
    sp = SectionPlan(tuple(range(devices)), mesh_shape(**(mesh or {"data": devices})), mb)
    cost = cost_model(spec, dict.fromkeys(spec.order, sp), metas, "h100", 50.0)
    return planner, sp, cost


def test_round_robin_waits_for_the_rank_that_drew_the_most_work():
    """Megatron's sampler deals each micro-batch's samples to the ranks in contiguous slices:
    with 2 ranks and micro-batch 1, rank 0 takes samples 0 and 2, rank 1 samples 1 and 3; each
    pads only its own rows, and the step ends when the heavier rank does."""
    units = [4096, 64, 4096, 64]
    planner, _, cost = priced(KD, units, devices=2, mesh={"data": 2})
    spec, metas = planner.spec, planner.metas[0]

    def rank(samples):
        return sum(
            cost.step_time(s, "F", [m.work[s]], 1) * (cost.sections[s].sink_factor if s == spec.sink else 1.0)
            for m in samples
            for s in spec.order
        )

    expect = max(rank(metas[0::2]), rank(metas[1::2])) + sum(cost.update_s.values())
    assert round_robin_time(spec, metas, cost, 1, 2) == pytest.approx(expect, rel=1e-12)
    # the heavy samples dealt one to each rank instead: the ranks balance and the step is shorter
    swapped = [metas[0], metas[2], metas[1], metas[3]]
    assert round_robin_time(spec, swapped, cost, 1, 2) < expect


def test_static_shapes_pad_every_sample_in_every_section():
    """A VLM batch where one sample in eight holds images: static slots run the vision tower for
    all eight at the largest image count, so they cost more than the fair monolithic step, which
    buckets each micro-batch to its own work and skips text-only samples."""
    spec = planner_for(load_config(VLM, H100), 8, 1.0).spec
    text, image = (
        SampleMeta(frozenset({spec.sink}), {spec.sink: 200}),
        SampleMeta(frozenset(spec.order), {**dict.fromkeys(spec.order, 900), spec.sink: 1100}),
    )
    metas = [image] + [text] * 15  # two micro-steps of 8 rows: the second holds no image
    sp = SectionPlan(tuple(range(8)), mesh_shape(data=8), 1)
    cost = cost_model(spec, dict.fromkeys(spec.order, sp), [metas], "h100", 50.0)
    most = {s: max(m.work.get(s, 0) for m in metas) for s in spec.order}
    static = static_padding_time(spec, metas, most, cost, 1, 8)
    fair = monolithic_time(spec, metas, cost, 1, sp.rows)
    vision = next(s for s in spec.order if s != spec.sink)
    # the text-only micro-step pays for the vision tower and the longest text too
    padded = cost.step_time(vision, "F", [900], 1) * (1 + cost.sections[vision].backward_factor)
    padded += cost.step_time(spec.sink, "L", [1100], 1) - cost.step_time(spec.sink, "L", [200], 1)
    assert static - fair == pytest.approx(padded, rel=1e-9)
    one = SampleMeta(frozenset(spec.order), {**dict.fromkeys(spec.order, 900), spec.sink: 1100})
    assert static == pytest.approx(static_padding_time(spec, [one] * 16, most, cost, 1, 8), rel=1e-12)


def test_with_equal_samples_padding_and_order_change_nothing():
    """Samples that all hold the same work: no order or padding can differ, so the round-robin
    and static prices equal the fair monolithic one, and the ceiling is below them by the
    per-micro-step overheads and the bucket's padding alone."""
    planner, sp, cost = priced(KD, [512] * 16, devices=8, mesh={"data": 8})
    spec, metas = planner.spec, planner.metas[0]
    fair = monolithic_time(spec, metas, cost, 1, sp.rows)
    most = dict.fromkeys(spec.order, 512)
    assert round_robin_time(spec, metas, cost, 1, 8) == pytest.approx(fair, rel=1e-12)
    assert static_padding_time(spec, metas, most, cost, 1, 8) == pytest.approx(fair, rel=1e-12)
    ceiling = ceiling_time(spec, metas, cost, 8)
    overheads = 2 * sum(
        cost.sections[s].overhead_s * (cost.sections[s].sink_factor if s == spec.sink else 1.0) for s in spec.order
    )
    assert ceiling < fair - 0.9 * overheads


@pytest.mark.parametrize("config", [KD, VLM])
def test_no_price_beats_the_ceiling(config):
    """The planner's best plan, the fair monolithic and every users' baseline are all at or above
    the ceiling, on the tiny configs' own sample batches."""
    report = planner_for(load_config(config, H100), 8, 1.0).search(top=1)
    users = report.user_baselines
    assert set(users) >= {"round_robin", "static_padding", "ceiling"}
    assert ("shared_recipe" in users) == (config == KD)  # the KD teacher is frozen
    ceiling = users["ceiling"]["step_time_s"]
    times = [report.best.step_time_s, report.monolithic["step_time_s"]] + [v["step_time_s"] for v in users.values()]
    assert all(t >= ceiling * (1 - 1e-9) for t in times), times
    for v in users.values():
        assert v["samples_per_s_per_device"] == pytest.approx(
            report.best.samples_per_s_per_device * report.best.step_time_s / v["step_time_s"], rel=1e-9
        )


def test_the_shared_recipe_prices_the_teacher_in_the_students_precision():
    """A float32 teacher beside a bfloat16 student: the shared recipe runs the teacher in bfloat16,
    so it is faster than the fair baseline, which keeps each section's precision."""
    cfg = load_config(KD, [*H100, "sections.teacher.precision=float32", "sections.student.precision=bfloat16"])
    planner = planner_for(cfg, 8, 1.0)
    layout = planner.monolithic_best()
    users = user_baselines(
        planner.spec, planner.metas, layout, 8, cfg.global_batch, "h100", 50.0, planner.typical_units
    )
    assert users["shared_recipe"]["step_time_s"] < layout["step_time_s"]
    both = [*H100, "sections.teacher.precision=bfloat16", "sections.student.precision=bfloat16"]
    same = planner_for(load_config(KD, both), 8, 1.0)
    assert users["shared_recipe"]["step_time_s"] == pytest.approx(
        user_baselines(same.spec, same.metas, layout, 8, cfg.global_batch, "h100", 50.0, same.typical_units)[
            "shared_recipe"
        ]["step_time_s"],
        rel=1e-9,
    )


def test_plan_json_carries_the_users_baselines(tmp_path, capsys):
    out = tmp_path / "plan.json"
    code = cli.main(
        ["plan", "--config", str(KD), "--devices", "8", "--memory-gb", "1", "--top", "1", "--json", str(out), *H100]
    )
    assert code == 0
    said = capsys.readouterr().out
    users = json.loads(out.read_text())["user_baselines"]
    assert set(users) == {"round_robin", "static_padding", "shared_recipe", "ceiling"}
    assert all(v["samples_per_s_per_device"] > 0 for v in users.values())
    assert "users' baseline, Megatron-style data order" in said and "maestro reaches" in said
    spent = json.loads(out.read_text())["device_time"]  # the best plan's device time, by what it is spent on
    assert set(spent) == set(DEVICE_TIME) and sum(spent.values()) == pytest.approx(1.0)
    assert all(v >= -1e-12 for v in spent.values()) and spent["work"] > 0
    by_section = json.loads(out.read_text())["device_time_by_section"]
    assert set(by_section) == {"teacher", "student"}
    assert sum(sum(d.values()) for d in by_section.values()) + spent["idle"] == pytest.approx(1.0)
    assert "maestro's device time (wavefront): " in said


def test_simulate_prices_the_users_baselines_beside_the_configs_plan(tmp_path, capsys):
    out = tmp_path / "simulate.json"
    assert cli.main(["simulate", "--config", str(VLM), "--json", str(out), *H100]) == 0
    said = capsys.readouterr().out
    report = json.loads(out.read_text())
    users = report["user_baselines"]
    assert set(users) == {"round_robin", "static_padding", "ceiling"}  # no frozen section in the VLM
    assert users["ceiling"]["step_time_s"] <= report["step_time_s"]["wavefront"]
    assert "users' baseline, static image slots" in said and "maestro reaches" in said
    spent = report["device_time"]  # the config's plan, priced the same way as `plan`'s best
    assert set(spent) == set(DEVICE_TIME) and sum(spent.values()) == pytest.approx(1.0)
    # idle is the bubble ratio, counted apart
    assert spent["idle"] == pytest.approx(report["bubble_ratio"], abs=1e-9)
    assert "maestro's device time (wavefront): " in said


def test_every_baseline_is_one_plug_in_priced_into_a_typed_result():
    """`BASELINES` lists each baseline once, the fair monolithic first (the users' baselines run
    on its layout); the search's typed results are what `plan --json` writes, and one baseline
    priced alone (as `simulate` prices it, no search) is the same figure."""
    names = [b.name for b in BASELINES]
    assert names[0] == "monolithic" and len(set(names)) == len(names)
    assert set(names) >= {"monolithic", "pipelined", "round_robin", "static_padding", "shared_recipe", "ceiling"}
    planner = planner_for(load_config(KD, H100), 8, 1.0)
    report = planner.search(top=1)
    results = report.baselines
    assert list(results) == names and all(isinstance(r, BaselineResult) for r in results.values())
    mono = results["monolithic"]
    assert mono.step_time_s == report.monolithic["step_time_s"] and mono.mesh == report.monolithic["mesh"]
    assert {k: r.step_time_s for k, r in results.items() if k in USERS} == {
        k: v["step_time_s"] for k, v in report.user_baselines.items()
    }
    alone = price_baselines(planner, ["round_robin"])
    assert list(alone) == ["monolithic", "round_robin"]  # what it is priced on, then itself
    assert alone["round_robin"] == results["round_robin"]
    written = baselines_json(results)
    assert set(written) == {"monolithic", "pipelined", "user_baselines"} and written["monolithic"] == mono.to_json()
    lines = baseline_lines(results, report.best.step_time_s)
    assert (
        lines[0].startswith("monolithic best layout: mesh ")
        and f"({mono.ratio(report.best.step_time_s):.3f}x)" in lines[0]
    )
    assert lines[-1].startswith("ceiling of the monolithic layout")


def test_a_new_baseline_is_one_class_and_one_registry_line(monkeypatch):
    """A baseline a user adds (here: the fair monolithic's layout with every sample's work doubled)
    is priced after what it reads and printed in its place, nothing else changed."""

    class Doubled:
        name = "doubled"

        def price(self, planner, priced):
            mono = priced["monolithic"]
            return BaselineResult(self.name, 2 * mono.step_time_s, mono.samples_per_s_per_device / 2)

        def lines(self, result, maestro_s):
            return [f"doubled: {result.ratio(maestro_s):.3f}x"]

    monkeypatch.setattr(baselines, "BASELINES", (*baselines.BASELINES, Doubled()))
    planner = planner_for(load_config(KD, H100), 8, 1.0)
    priced = baselines.price_baselines(planner)
    assert priced["doubled"].step_time_s == 2 * priced["monolithic"].step_time_s
    assert baselines.baseline_lines(priced, priced["monolithic"].step_time_s)[-1] == "doubled: 2.000x"


def test_without_a_monolithic_layout_the_users_baselines_are_not_priced():
    planner = planner_for(load_config(KD, H100), 8, 1e-6)  # nothing fits a micro-gigabyte
    priced = price_baselines(planner, ["ceiling"])
    assert priced == {"monolithic": None, "ceiling": None}
    assert baseline_lines(priced, 1.0) == ["monolithic: no layout fits in memory on these devices"]
    assert baselines_json(priced) == {"monolithic": None, "pipelined": None, "user_baselines": None}


def test_a_written_baseline_reads_back_as_its_typed_result():
    """`result_of(name, record)`: what `simulate` and `plan --json` wrote comes back through the
    baseline's own plug-in, the layout in words included, so no caller reads a record by key."""
    report = planner_for(load_config(VLM, H100), 8, 1.0).search(top=1)
    for name, result in report.baselines.items():
        if result is None:
            continue
        back = baselines.result_of(name, json.loads(json.dumps(result.to_json())))
        assert back.step_time_s == result.step_time_s and back.layout == result.layout, name
        assert back.mesh == result.mesh and back.micro_batch == result.micro_batch, name
        if name == "pipelined":
            assert back.devices == result.devices == 8
    assert baselines.result_of("pipelined", None) is None
