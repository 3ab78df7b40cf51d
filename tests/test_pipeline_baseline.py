"""The 1F1B pipeline-parallel baseline (`planning.pipeline`, Megatron-LM's layout): the schedule's
closed form, the cut conserves each section's work and weights, one stage is the monolithic
layout, the bubble shrinks with more micro-batches, memory refuses what does not fit, and
`plan` prints it."""

import dataclasses
import itertools
import json
import math
import random
import statistics

import pytest
from conftest import ROOT, TINY_KD, paper_spec

from maestro_jax import cli
from maestro_jax.config import load_config
from maestro_jax.core.buckets import bucket
from maestro_jax.core.plan import SectionPlan, mesh_shape
from maestro_jax.planning.cluster import cost_model, monolithic_time, section_cost
from maestro_jax.planning.cost import DEVICES
from maestro_jax.planning.pipeline import (
    balanced_layers,
    layer_moves,
    one_f_one_b,
    pipelined_best,
    pipelined_time,
    sink_cuts,
    stage_layers,
    stage_memory,
    stage_plan,
)
from maestro_jax.planning.planner import Planner
from maestro_jax.schedule.ops import SampleMeta
from maestro_jax.tools.plan import planner_for

KD = ROOT / "configs/kd_tiny.yaml"
VLM = ROOT / "configs/vlm_tiny.yaml"
H100 = ["simulate.device=h100"]


def layout(devices: int, mb: int = 1, **mesh) -> SectionPlan:
    return SectionPlan(tuple(range(devices)), mesh_shape(**mesh), mb)


# -- the schedule -----------------------------------------------------------------------------
@pytest.mark.parametrize("stages", [1, 2, 3, 5])
def test_equal_stages_take_m_plus_p_minus_1_slots(stages):
    """Equal stages, equal micro-batches: (M + P - 1) (t_f + t_b), i.e. the bubble is (P - 1) / M
    of the ideal M (t_f + t_b) (Narayanan et al. 2021, section 2.2.1), M below P included."""
    f, b = 0.3, 0.7
    bubbles = []
    for m in range(1, 9):
        t = one_f_one_b([[f] * m] * stages, [[b] * m] * stages)
        assert t == pytest.approx((m + stages - 1) * (f + b))
        bubbles.append(t / (m * (f + b)) - 1)
    assert bubbles == pytest.approx([(stages - 1) / m for m in range(1, 9)])
    if stages > 1:
        assert all(x > y for x, y in itertools.pairwise(bubbles)), "more micro-batches, smaller bubble"


def test_unequal_stages_are_bounded_by_their_work_and_sends_delay():
    """Random stage and micro-batch times: never below the busiest stage's work nor one
    micro-batch's trip down and back; blocking sends only add."""
    rng = random.Random(0)
    for _ in range(200):
        p, m = rng.randint(1, 6), rng.randint(1, 9)
        f = [[rng.uniform(0.1, 2) for _ in range(m)] for _ in range(p)]
        b = [[rng.uniform(0.0, 4) for _ in range(m)] for _ in range(p)]
        t = one_f_one_b(f, b)
        assert t >= max(sum(f[s]) + sum(b[s]) for s in range(p)) - 1e-9
        assert t >= sum(f[s][0] + b[s][0] for s in range(p)) - 1e-9
        sends = [[rng.uniform(0, 0.5) for _ in range(m)] for _ in range(p)]
        assert one_f_one_b(f, b, sends, sends) >= t - 1e-9
    # a send on the only boundary of two one-micro-batch stages sits on the critical path twice
    assert one_f_one_b([[1.0], [1.0]], [[2.0], [2.0]], [[0.25], [0.0]], [[0.0], [0.5]]) == pytest.approx(6.75)


def test_layers_are_cut_evenly_extra_ones_to_the_middle():
    assert stage_layers(48, 4) == [12, 12, 12, 12]
    assert stage_layers(28, 8) == [3, 4, 4, 4, 4, 3, 3, 3]
    assert stage_layers(3, 2) == [1, 2]
    assert all(sum(stage_layers(n, p)) == n for n in range(1, 40) for p in range(1, 9))


def stage_flops(spec, metas, slices) -> list[float]:
    """Each stage's FLOPs over the samples, forward and backward (3 forwards when trained)."""

    def flops(c, u):
        return (c.flops + c.attention_flops * (c.attention_span if c.attention_span is not None else u)) * u

    return [
        sum(
            flops(sl.spec.cost, m.work[sl.section]) * (3 if spec.sections[sl.section].trained else 1)
            for sl in stage
            for batch in metas
            for m in batch
            if sl.section in m.work
        )
        for stage in slices
    ]


@pytest.mark.parametrize(
    "config,overrides",
    [
        ("kd_paper_scale.yaml", []),
        ("vlm_paper_scale.yaml", []),
        ("vlm_tiny.yaml", ["models.llm.depth=12", "models.vision.depth=8", "models.vision.width=256"]),
    ],
)
def test_the_balanced_cut_evens_the_stages_work(config, overrides):
    """The balanced cut of the sink's layers leaves the busiest stage no more FLOPs than the even
    cut does (the first stage runs the encoders, the last the heads), and the search tries it."""
    name = config.removesuffix("_paper_scale.yaml")
    spec = paper_spec(name) if name != config and not overrides else None
    p = planner_for(load_config(ROOT / "configs" / config, overrides), 64, 80.0, spec=spec)
    layers = p.spec.sections[p.spec.sink].cost.layers
    for stages in (2, 4, 8):
        even, *others = sink_cuts(p.spec, p.metas, stages)
        assert even == stage_layers(layers, stages)
        balanced = balanced_layers(p.spec, p.metas, stages)
        assert sum(balanced) == layers and (balanced == even or balanced in others)
        loads = {}
        for c in (even, balanced):
            slices = stage_plan(p.spec, p.metas, stages, {p.spec.sink: c})
            assert [sum(sl.spec.cost.layers for sl in stage if sl.section == p.spec.sink) for stage in slices] == c
            loads[tuple(c)] = max(stage_flops(p.spec, p.metas, slices))
        assert loads[tuple(balanced)] <= loads[tuple(even)] * (1 + 1e-12)
    if config.startswith("vlm_tiny"):  # a heavy encoder in the first stage: fewer LLM layers there
        assert balanced_layers(p.spec, p.metas, 4)[0] < stage_layers(layers, 4)[0]
    if config.startswith("kd"):  # the student's and the teacher's heads in the last stage: fewer layers there
        assert balanced_layers(p.spec, p.metas, 2)[1] < 14


# -- the cut ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "overrides", [[], ["models.student.scan_layers=true", "models.teacher.depth=4"]], ids=["blocks", "scanned"]
)
def test_the_cut_conserves_work_and_weights(overrides):
    """Summed over the stages, each cut section's FLOPs, attention, layers, parameters and
    per-unit cost are the whole section's; the embedding sits in the first stage, the heads
    (the student's and the KD teacher's) in the last, with their FLOPs."""
    p = planner_for(load_config(KD, H100 + overrides), 8, 1.0)
    sp = layout(4, 1, data=4)
    for stages in (1, 2):
        slices = stage_plan(p.spec, p.metas, stages)
        for name, sec in p.spec.sections.items():
            parts = [sl.spec for stage in slices for sl in stage if sl.section == name]
            assert len(parts) == stages, "a KD teacher reads the student's tokens: cut beside it"
            assert sum(x.cost.flops for x in parts) == pytest.approx(sec.cost.flops)
            assert sum(x.cost.attention_flops for x in parts) == pytest.approx(sec.cost.attention_flops)
            assert sum(x.cost.layers for x in parts) == sec.cost.layers
            assert sum(x.param_count for x in parts) == sec.param_count
            costs = [
                section_cost(x, sp, p.metas, p.device, p.link_gbps, name == p.spec.sink, p.typical_units[name])
                for x in parts
            ]
            whole = section_cost(sec, sp, p.metas, p.device, p.link_gbps, name == p.spec.sink, p.typical_units[name])
            assert sum(c.per_unit_s for c in costs) == pytest.approx(whole.per_unit_s)
            assert sum(c.per_unit2_s for c in costs) == pytest.approx(whole.per_unit2_s)
        first, last = ({leaf.path for sl in stage for leaf in sl.spec.leaves} for stage in (slices[0], slices[-1]))
        assert any("embedding" in x for x in first) and any("lm_head" in x for x in last)
        assert any("teacher_head" in x for x in last)
        if stages == 2:
            assert not any("lm_head" in x or "teacher_head" in x for x in first)
            student = slices[-1][-1].spec
            head = sum(math.prod(leaf.shape) for leaf in student.leaves if "head" in leaf.path)
            per_layer = (p.spec.sections["student"].cost.flops - 2 * head) / p.spec.sections["student"].cost.layers
            assert student.cost.flops == pytest.approx(per_layer * student.cost.layers + 2 * head)


def test_the_baselines_cut_is_refined_until_no_one_layer_move_is_faster():
    """Each cut section's layers by stage on their own (`refine_cut`, as Megatron-LM's
    --pipeline-model-parallel-layout sets them): the best layout's cut conserves every section's
    layers, and no cut one layer away that fits is faster under the baseline's own 1F1B price."""
    overrides = [*H100, "models.teacher.depth=6", "models.student.depth=5"]
    p = planner_for(load_config(KD, overrides), 8, 4.0)
    best = pipelined_best(p)
    layers = best["layers_per_stage"]
    assert sum(layers["teacher"]) == 6 and sum(layers["student"]) == 5
    sp = layout(best["devices_per_stage"], best["micro_batch"], **best["mesh"])
    stages, remat = best["stages"], best["layer_remat"]
    slices = stage_plan(p.spec, p.metas, stages, layers)
    assert pipelined_time(p, stages, sp, remat, slices) == pytest.approx(best["step_time_s"])
    moves = 0
    for cut in layer_moves(layers):
        slices = stage_plan(p.spec, p.metas, stages, cut)
        mem = stage_memory(p, stages, sp, remat, best["micro_batches"], slices)
        if mem is not None and max(mem) <= p.budget:
            moves += 1
            assert pipelined_time(p, stages, sp, remat, slices) >= best["step_time_s"] * (1 - 1e-12)
    assert moves


def test_an_encoder_runs_whole_in_the_first_stage():
    p = planner_for(load_config(VLM, H100), 8, 1.0)
    slices = stage_plan(p.spec, p.metas, 2)
    assert [(sl.section, sl.spec.cost.layers) for sl in slices[0]] == [("vision", 2), ("llm", 1)]
    assert [(sl.section, sl.spec.cost.layers) for sl in slices[1]] == [("llm", 1)]


# -- step time --------------------------------------------------------------------------------
@pytest.mark.parametrize("config,device", [(KD, "h100"), (VLM, "h100"), (KD, "cpu")])
def test_one_stage_is_the_monolithic_layout(config, device):
    """With a single stage nothing is cut, sent or overlapped: the pipeline's step is
    `monolithic_time` of the same layout, packing for packing."""
    p = planner_for(load_config(config, [f"simulate.device={device}"]), 8, 1.0)
    for remat in ("none", "full"):
        for sp in (layout(8, 2, data=8), layout(8, 1, data=4, tensor=2)):
            plans = {
                s: dataclasses.replace(sp, precision=sec.precision, layer_remat=remat if sec.trained else "none")
                for s, sec in p.spec.sections.items()
            }
            cost = cost_model(p.spec, plans, p.metas, p.device, p.link_gbps, p.typical_units)
            mono = statistics.mean(monolithic_time(p.spec, m, cost, sp.micro_batch, sp.rows) for m in p.metas)
            assert pipelined_time(p, 1, sp, remat) == pytest.approx(mono, rel=1e-9)


def uniform_planner(config, samples: int, units: int, devices: int = 8) -> Planner:
    """A planner whose one batch has `samples` samples of `units` tokens each."""
    spec = planner_for(load_config(config, H100), devices, 1.0).spec
    metas = [[SampleMeta(frozenset(spec.order), dict.fromkeys(spec.order, units)) for _ in range(samples)]]
    return Planner(spec, metas, devices, 1.0, global_batch=samples, device="h100", link_gbps=50.0)


@pytest.mark.parametrize("devices,mesh", [(8, {"data": 4}), (8, {"data": 2, "tensor": 2}), (16, {"data": 8})])
def test_two_stages_are_the_explicit_schedule_of_their_slices(devices, mesh):
    """Equal samples on 2 stages: each stage's forward and backward from the cost model on its
    own layers (the teacher's share and the student's), its sends of both models' hidden states
    (each device 1 / tensor of them) over NVLink inside a node, the inter-node link across
    nodes, played out as 1F1B, then each stage's optimizer step on its own slices."""
    p = uniform_planner(KD, 16, 40, devices)
    sp = layout(devices // 2, 2, **mesh)
    slices = stage_plan(p.spec, p.metas, 2)
    m = 16 // sp.rows
    f, b, update = [], [], []
    for stage in slices:
        fs = bs = us = 0.0
        for sl in stage:
            c = section_cost(sl.spec, sp, p.metas, "h100", 50.0, sl.section == "student", 40)
            t = c.overhead_s + 2 * (c.per_unit_s * bucket(40, 256) + c.per_unit2_s * bucket(40, 256) ** 2)
            fs += t
            bs += t * (c.sink_factor - 1) if sl.section == "student" else 0.0
            us += c.update_s
        f.append([fs] * m)
        b.append([bs] * m)
        update.append(us)
    assert update[0] > 0 and update[1] > 0, "the student is trained on both stages"
    width = {s: p.spec.sections[s].cost.width for s in p.spec.order}
    link = DEVICES["h100"]["link"] if devices == 8 else 50e9
    tensor = mesh.get("tensor", 1)
    send_f = 2 * bucket(40, 256) * (width["teacher"] + width["student"]) * 4 / tensor / link
    send_b = 2 * bucket(40, 256) * width["student"] * 4 / tensor / link
    expect = one_f_one_b(f, b, [[send_f] * m, [0.0] * m], [[0.0] * m, [send_b] * m], update)
    assert pipelined_time(p, 2, sp, "none") == pytest.approx(expect, rel=1e-12)


def test_the_bubble_shrinks_as_micro_batches_grow():
    """Equal samples, a fixed micro-batch, more of them per step: the step time per
    micro-batch falls toward the bottleneck stage's (the fill and drain are paid once)."""
    per_micro_batch = []
    for samples in (8, 16, 32, 64):
        p = uniform_planner(KD, samples, 64)
        per_micro_batch.append(pipelined_time(p, 2, layout(4, 2, data=4), "none") / (samples // 8))
    assert all(x > y for x, y in itertools.pairwise(per_micro_batch))


# -- memory and search ------------------------------------------------------------------------
def test_stages_hold_one_micro_batch_in_flight_per_stage_after_them():
    """1F1B: stage s stashes the residuals of min(P - s, M) micro-batches."""
    p = planner_for(load_config(KD, H100), 8, 1.0)
    sp = layout(4, 1, data=4)
    one, many = stage_memory(p, 2, sp, "none", 1), stage_memory(p, 2, sp, "none", 4)
    assert many[0] > one[0], "the first stage keeps two micro-batches' residuals, not one"
    assert many[1] == pytest.approx(one[1]), "the last stage keeps one either way"


def test_memory_refuses_layouts_that_do_not_fit():
    p = planner_for(load_config(KD, H100), 8, 1.0)
    best = pipelined_best(p)
    assert best is not None and best["stages"] == 2 and best["peak_gb"] <= 1.0
    tight = pipelined_best(planner_for(load_config(KD, H100), 8, best["peak_gb"] * 0.99))
    assert tight is not None and tight["peak_gb"] <= best["peak_gb"] * 0.99
    assert tight["step_time_s"] >= best["step_time_s"]
    assert pipelined_best(planner_for(load_config(KD, H100), 8, 1e-4)) is None
    # the sink's layers bound the stage count: one student layer, no pipeline
    assert pipelined_best(planner_for(load_config(KD, TINY_KD + H100), 8, 1.0)) is None


def test_plan_cli_prints_the_pipelined_baseline(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert cli.main(["plan", "--config", str(KD), "--devices", "8", "--memory-gb", "1", "--json", str(out)]) == 0
    said = capsys.readouterr().out
    line = next(x for x in said.splitlines() if x.startswith("pipelined (1F1B)"))
    r = json.loads(out.read_text())
    cut = r["pipelined"]["layers_per_stage"]
    assert sum(cut["teacher"]) == 3 and sum(cut["student"]) == 2
    said_cut = "; ".join(f"{s} layers {'/'.join(map(str, c))}" for s, c in cut.items())
    assert "2 stages x 4 devices" in line and said_cut in line
    assert r["pipelined"]["stages"] == 2 and r["pipelined"]["step_time_s"] > 0
    assert f"predicted {r['pipelined']['step_time_s']:.4g} s/step" in line
    assert cli.main(["plan", "--config", str(KD), "--devices", "8", "--memory-gb", "1", *TINY_KD]) == 0
    assert "pipelined (1F1B): no layout" in capsys.readouterr().out
