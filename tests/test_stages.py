"""Pipeline stages inside a section (`sections.<s>.stages`, `core.stages`): each stage holds its
share of the section's variables, a staged step is the unstaged monolithic step under both
schedulers, and a staged section is checkpointed whole, so it restores onto any stage count."""

import shutil

import jax
import numpy as np
import pytest
from conftest import ROOT, TINY_KD, TINY_VLM
from maestro_jax.meshes import BATCH_AXES

from maestro_jax import workloads
from maestro_jax.config import ConfigError, load_config
from maestro_jax.core.stages import layer_ranges, merge_variables, split_variables, stage_edge, stage_name
from maestro_jax.runtime.build import build_runtime
from maestro_jax.runtime.stages import whole_params
from maestro_jax.runtime.step import StepBatch
from maestro_jax.schedule import naive, sample_metas, wavefront
from maestro_jax.tools.verify import compare
from maestro_jax.training.loop import train

KD = ROOT / "configs" / "kd_tiny.yaml"
DEEP_KD = [*TINY_KD, "models.teacher.depth=3", "models.student.depth=2"]


def test_layer_ranges_cut_the_layers_in_consecutive_runs_the_earlier_stages_longer():
    assert layer_ranges(5, 2) == ((0, 3), (3, 5))
    assert layer_ranges(4, 4) == ((0, 1), (1, 2), (2, 3), (3, 4))
    assert layer_ranges(3, 1) == ((0, 3),)
    with pytest.raises(ValueError):
        layer_ranges(2, 3)


def test_a_given_cut_may_leave_the_first_and_last_stage_without_layers_but_no_middle_one():
    assert layer_ranges(28, 4, (0, 14, 14, 0)) == ((0, 0), (0, 14), (14, 28), (28, 28))
    assert layer_ranges(5, 2, (1, 4)) == ((0, 1), (1, 5))
    for bad in ((2, 2), (1, 3, 2), (3, 0, 2), (6, -1)):
        with pytest.raises(ValueError, match="layer counts"):
            layer_ranges(5, len(bad), bad)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["sections.student.stages=2", "sections.student.stage_layers=[1,2]"], "adding up to the model's 2"),
        (["sections.student.stages=2", "sections.student.stage_layers=[2]"], "1 layer counts for 2 stage(s)"),
        (["sections.student.stage_layers=[2]"], "stage_layers with stages > 1"),
        (
            [
                "sections.teacher.stages=4",
                "sections.teacher.mesh.data=4",
                "sections.teacher.mesh.tensor=1",
                "models.teacher.depth=4",
                "sections.teacher.stage_layers=[2,0,1,1]",
            ],
            "each at least 1 but",
        ),
    ],
)
def test_a_cut_the_section_cannot_take_is_one_line_naming_the_key(overrides, message):
    with pytest.raises(ConfigError) as err:
        workloads.build_graph(load_config(KD, [*DEEP_KD, *overrides]))
    cut = next(o for o in overrides if "stage_layers" in o).split("=")[0]
    assert str(err.value).startswith(f"error: {cut}") and message in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.slow
def test_a_staged_graph_cuts_the_section_and_its_variables_and_puts_them_back_together():
    cfg = load_config(KD, [*DEEP_KD, "sections.student.stages=2", "sections.teacher.stages=2"])
    graph = workloads.build_graph(cfg)
    assert graph.names == ("teacher.0", "teacher.1", "student.0", "student.1")
    edges = {e.name: (e.src, e.dst) for e in graph.edges}
    assert edges[stage_edge("student", 0)] == ("student.0", "student.1")
    assert edges["teacher_hidden"] == ("teacher.1", "student.1")  # the loss, in the last stage, reads it
    assert graph.sink == "student.1" and not graph.section("teacher.1").trained

    whole = graph.staging.whole.init(jax.random.key(0))
    staged = graph.init(jax.random.key(0))
    split = graph.staging.splits["student"]
    parts = split_variables(whole["student"], split)
    assert sorted(parts[0]["params"]) == ["block_0", "embedding"]
    assert sorted(parts[1]["params"]) == ["block_1", "final_norm", "lm_head"]
    assert sorted(parts[1]["consts"]) == ["teacher_head"] and parts[0]["consts"] == {}
    assert sorted(staged["teacher.1"]["consts"]["llm"]) == ["block_2", "final_norm"]  # 3 layers: 2 + 1
    for name in ("student", "teacher"):
        stages = graph.staging.stages_of(name)
        back = merge_variables([staged[s] for s in stages])
        assert jax.tree.structure(back) == jax.tree.structure(whole[name])
        for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(whole[name])):
            np.testing.assert_array_equal(np.asarray(nn_value(a)), np.asarray(nn_value(b)))


def nn_value(x):
    return getattr(x, "value", x)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["sections.student.stages=3"], "error: sections.student.stages=3: the mesh's data axis (4) does not divide"),
        (["sections.student.stages=2", "sections.student.pack=2"], "error: sections.student.stages=2: not with pack=2"),
        (
            ["sections.student.stages=3", "models.student.depth=2", "sections.student.mesh.data=3"],
            "error: sections.student.stages=3: the mesh's axes multiply to 3 but the section has 4 devices",
        ),
    ],
)
def test_a_stage_count_the_section_cannot_take_is_one_line_naming_the_key(overrides, message):
    with pytest.raises(ConfigError) as err:
        workloads.build_graph(load_config(KD, [*DEEP_KD, *overrides]))
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    "config,overrides,message",
    [
        ("kd_tiny.yaml", ["sections.student.stages=4"], "the model has 2 layers; valid: 1 to 2"),
        ("kd_tiny.yaml", ["sections.student.stages=2", "models.student.scan_layers=true"], "layers are scanned"),
        ("kd_tiny.yaml", ["sections.student.stages=2", "models.student.tie_embeddings=true"], "tie_embeddings"),
        ("vlm_tiny.yaml", ["sections.vision.stages=2"], "section 'vision' does not split into pipeline stages"),
    ],
)
def test_a_section_that_cannot_be_staged_is_refused_before_anything_compiles(config, overrides, message):
    base = DEEP_KD if config == "kd_tiny.yaml" else TINY_VLM
    cfg = load_config(ROOT / "configs" / config, [*base, *overrides])
    with pytest.raises(ConfigError) as err:
        workloads.build_graph(cfg)
    stages = next(o for o in overrides if ".stages=" in o)
    assert str(err.value).startswith(f"error: {stages}: ") and message in str(err.value)


def test_plan_of_a_staged_config_plans_the_whole_sections_and_their_stages(tmp_path, capsys):
    """`plan --stages` on a config whose student is in stages plans the sections whole (choosing
    their stage counts itself) and writes the stage count it chose for every section."""
    import yaml

    from maestro_jax.cli import main

    out = tmp_path / "planned.yaml"
    args = ["plan", "--config", str(KD), "--devices", "8", "--memory-gb", "1", *DEEP_KD, "sections.student.stages=2"]
    assert main([*args, "simulate.device=cpu", "--stages", "--write", str(out)]) == 0
    assert "student" in capsys.readouterr().out
    # on the serial CPU client stages only add transfers: the plan takes the configured 2 back
    assert {s: c["stages"] for s, c in yaml.safe_load(out.read_text())["sections"].items()} == {
        "teacher": 1,
        "student": 1,
    }
    assert load_config(out).plan().sections.keys() == {"teacher", "student"}


def _equal_to_monolithic(cfg):
    rt = build_runtime(cfg)
    samples = rt.batches()[0]
    state = rt.step.init()
    mono = rt.monolithic
    assert set(mono.graph.names) == set(cfg.sections)  # the reference is the unstaged step
    m_loss, m_grads, _ = mono.step.gradients(mono.step.init(), samples)
    metas = sample_metas(rt.graph, samples)
    for schedule in (naive(metas, rt.problem), wavefront(metas, rt.problem)):
        for s in rt.problem.order:  # 1F1B's bound: stage i of K keeps at most K - i forwards for a backward
            if rt.problem.needs_backward(s) and schedule.name == "wavefront":  # naive runs forwards first
                stash = [op.kind for op in schedule.ops if op.section == s and op.kind in "FB"]
                peak = max(sum(1 if k == "F" else -1 for k in stash[: i + 1]) for i in range(len(stash)))
                assert peak <= rt.problem.in_flight(s), f"{schedule.name}: {s} stashes {peak}"
        loss, grads, _ = rt.step.gradients(state, StepBatch(samples, schedule))
        grads = whole_params(rt.graph, grads)
        assert set(grads) == set(m_grads)
        diffs = [compare("loss", loss, m_loss)]
        diffs += [compare(f"{s}/grads", grads[s], m_grads[s]) for s in m_grads]
        for d in diffs:
            assert d.max_rel <= 1e-5, f"{schedule.name}: {d.name} differs by {d.max_rel:.3e}"
    return rt


@pytest.mark.slow
def test_a_staged_kd_step_is_the_unstaged_monolithic_step_under_both_schedulers():
    """Teacher in 2 forward-only stages (each tensor 2, the data axis of 2 cut in two) and the
    student in 2 (each data 2): loss and every gradient equal the unstaged graph's monolithic step."""
    cfg = load_config(KD, [*DEEP_KD, "sections.teacher.stages=2", "sections.student.stages=2"])
    assert [sp.devices for sp in cfg.plan().sections.values()] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert build_runtime(cfg).problem.bounds == {"teacher.0": 2, "teacher.1": 1, "student.0": 2, "student.1": 1}
    _equal_to_monolithic(cfg)


@pytest.mark.slow
def test_a_kd_step_cut_unevenly_is_the_unstaged_monolithic_step_under_both_schedulers():
    """`stage_layers`: the teacher's first stage holds only the embedding and the student's last
    only the final norm, the heads and the loss (Megatron's --decoder-first/last-pipeline-num-layers
    0): each stage holds its cut's share of the variables, and the step is the monolithic one."""
    cuts = ["sections.teacher.stage_layers=[0,3]", "sections.student.stage_layers=[2,0]"]
    cfg = load_config(KD, [*DEEP_KD, "sections.teacher.stages=2", "sections.student.stages=2", *cuts])
    staged = workloads.build_graph(cfg).init(jax.random.key(0))
    assert sorted(staged["teacher.0"]["consts"]["llm"]) == ["embedding"]
    assert sorted(staged["student.1"]["params"]) == ["final_norm", "lm_head"]
    assert sorted(staged["student.0"]["params"]) == ["block_0", "block_1", "embedding"]
    _equal_to_monolithic(cfg)


@pytest.mark.slow
def test_stage_and_section_edges_move_their_positions_split_and_the_step_is_the_monolithic_one():
    """Teacher on context 2 x tensor 2, the student in 2 stages of context 2: the teacher's hidden
    states leave it split over both axes and the stage edge over context (`edge_sharding`: what
    the compiled forwards return), and the step still equals the monolithic one."""
    meshes = ["sections.teacher.mesh={context: 2, tensor: 2}", "sections.student.mesh={data: 2, context: 2}"]
    cfg = load_config(KD, [*DEEP_KD, *meshes, "sections.student.stages=2"])
    rt = _equal_to_monolithic(cfg)
    metas = sample_metas(rt.graph, rt.batches()[0])
    for schedule in (naive(metas, rt.problem), wavefront(metas, rt.problem)):  # the stages' rows, one bucket
        stage_rows = [[st.positions for st in schedule.steps[stage_name("student", i)]] for i in (0, 1)]
        assert stage_rows[0] == stage_rows[1]
    specs = {
        s: {e: tuple(sh.spec) for e, sh in (out[0] if kind == "forward_vjp" else out).items()}
        for s in ("teacher", "student.0")
        for (kind, _), entry in rt.step.programs[s].cache.items()
        if kind in ("forward", "forward_vjp")
        for out in [entry.executable.output_shardings]
    }
    assert specs == {
        "teacher": {"teacher_hidden": (BATCH_AXES, ("context", "tensor"))},
        "student.0": {stage_edge("student", 0): (BATCH_AXES, "context")},
    }


MOE_STUDENT = [
    "models.student.experts=4",
    "models.student.experts_per_token=2",
    "models.student.expert_mlp=16",
    "models.student.router_aux_loss=0.05",
]


@pytest.mark.slow
@pytest.mark.extended
def test_a_staged_moe_student_carries_its_balance_loss_to_the_last_stage():
    """An MoE student with a balance loss in 2 stages: stage 0 sends its rows' balance terms on
    with the rows (`core.stages.stage_aux_edge`) and the last adds them to the loss, so the step is
    the unstaged monolithic one, whose loss the balance term visibly changes."""
    cfg = load_config(KD, [*DEEP_KD, *MOE_STUDENT, "sections.student.stages=2"])
    without = load_config(KD, [*DEEP_KD, *MOE_STUDENT, "models.student.router_aux_loss=0.0"])
    losses = []
    for c in (cfg, without):
        rt = build_runtime(c)
        assert ("student.0>1:aux" in {e.name for e in rt.graph.edges}) == (c is cfg)
        mono = rt.monolithic.step
        losses.append(float(mono.evaluate(mono.init(), rt.batches()[0])))
    assert abs(losses[0] - losses[1]) > 1e-3 * abs(losses[1])  # the term is there to be carried
    _equal_to_monolithic(cfg)


@pytest.mark.slow
def test_a_staged_vlm_step_is_the_unstaged_monolithic_step_under_both_schedulers():
    """Its image tokens attend to their whole image (`bidirectional_images`, Gemma 3's): the host
    batch's image blocks reach every stage's layers."""
    overrides = [*TINY_VLM, "models.llm.depth=3", "sections.llm.stages=2", "models.llm.bidirectional_images=true"]
    cfg = load_config(ROOT / "configs" / "vlm_tiny.yaml", overrides)
    assert cfg.plan().sections[stage_name("llm", 1)].mesh == (1, 1, 1, 1, 3)
    _equal_to_monolithic(cfg)


@pytest.mark.slow
def test_a_staged_run_resumes_bit_exactly_and_restores_onto_another_cut(tmp_path):
    """3 steps straight vs 2 steps, a checkpoint, then step 3: the same losses to the bit. The
    section is saved whole, so the cut is the run's to choose: the same checkpoint resumes a run
    with the student unstaged, and one with it cut unevenly (2/0; float rounding only)."""
    base = [*DEEP_KD, "steps=3", "compile.ahead=false"]
    staged = [*base, "sections.student.stages=2", "sections.teacher.stages=2"]
    straight = train(load_config(KD, [*staged, f"output_dir={tmp_path / 'a'}"]), progress=False)
    train(load_config(KD, [*staged, "steps=2", f"output_dir={tmp_path / 'b'}"]), progress=False)
    for other in ("c", "d"):
        shutil.copytree(tmp_path / "b", tmp_path / other)
    resumed = train(load_config(KD, [*staged, f"output_dir={tmp_path / 'b'}"]), progress=False)
    assert [r["step"] for r in resumed] == [3]
    assert resumed[0]["train/loss"] == straight[2]["train/loss"]
    uneven = [*staged, "sections.student.stage_layers=[2,0]"]
    for cut, out in ((base, "c"), (uneven, "d")):
        other = train(load_config(KD, [*cut, f"output_dir={tmp_path / out}"]), progress=False)
        assert [r["step"] for r in other] == [3]
        assert other[0]["train/loss"] == pytest.approx(straight[2]["train/loss"], rel=1e-5), out


def test_bench_refuses_a_stage_count_no_section_takes(capsys):
    from maestro_jax.cli import main

    assert main(["bench", "--config", str(KD), "--stages", "3", *DEEP_KD]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --stages=3: no section splits into that many stages here") and err.count("\n") == 1


@pytest.mark.slow
@pytest.mark.extended
def test_staged_sections_start_from_a_hugging_face_folder_as_unstaged_ones(tmp_path):
    """Teacher and student both from one tiny Llama folder (`init.hf_path`), each in 2 stages or
    none: the same weights land in the sections (each stage's share on its own devices), each
    student stage starts its own optimizer, and the first step's loss is the unstaged one's."""
    from maestro_jax.models import hf
    from test_hf import _overrides, make_hf

    _, path = make_hf(tmp_path, "llama_untied")
    student = [f"models.student.{k}={v}" for k, v in hf.llm_fields(path).items() if k != "kind" and v is not None]
    base = [f"{k}={v}" for k, v in _overrides(path)] + student + [f"sections.student.init.hf_path={path}"]
    runs = {}
    for stages in (1, 2):
        cfg = load_config(KD, [*base, f"sections.teacher.stages={stages}", f"sections.student.stages={stages}"])
        rt = build_runtime(cfg)
        states = rt.step.init()
        if stages == 2:
            assert all(states[s].opt_state is not None for s in ("student.0", "student.1"))
            assert {d.id for d in jax.tree.leaves(states["teacher.1"].consts)[0].sharding.device_set} == {2, 3}
        runs[stages] = rt.whole_states(states.sections), float(rt.step.evaluate(states, rt.batches()[0]))
    (whole, loss), (staged, staged_loss) = runs[1], runs[2]
    for s in ("teacher", "student"):
        for a, b in zip(jax.tree.leaves(whole[s].variables), jax.tree.leaves(staged[s].variables)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert staged_loss == pytest.approx(loss, rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize(
    "config, overrides",
    [
        (ROOT / "configs" / "vlm_tiny.yaml", [*TINY_VLM, "models.llm.depth=2"]),
        (KD, [*TINY_KD, "models.teacher.depth=2", "models.student.depth=2"]),
    ],
    ids=["vlm", "kd"],
)
def test_the_pipelined_baselines_layout_is_a_plan_that_runs_as_the_monolithic_step(tmp_path, config, overrides):
    """The 1F1B baseline's layout as a maestro plan (`Planner._pipelined_point`): every section
    the baseline cuts in its stages, stage by stage on shared devices (the ViT beside the LLM's
    first stage; a KD teacher's stage i beside the student's stage i), with its stash bound.
    Written as a config (`plan --write`), the config cuts it back into the very plan priced, the
    search never returns a slower plan, and the step equals the unstaged monolithic step."""
    from maestro_jax.planning.pipeline import pipelined_best
    from maestro_jax.tools.plan import planner_for, write_plan

    cfg = load_config(config, overrides)
    planner = planner_for(cfg, 8, 1.0)
    pipelined = pipelined_best(planner)
    point = planner._pipelined_point(pipelined)
    k = pipelined["stages"]
    assert point is not None and point.max_in_flight == k
    sections = point.plan.sections
    for s in pipelined["layers_per_stage"]:  # each cut section in k stages, stage i on the i-th k-th
        assert [sections[stage_name(s, i)].devices for i in range(k)] == [
            tuple(range(i * 8 // k, (i + 1) * 8 // k)) for i in range(k)
        ]
    for s in pipelined["first_stage_whole"]:
        assert sections[s].devices == tuple(range(8 // k))
    assert planner.search(top=1).best.step_time_s <= point.step_time_s
    write_plan(str(config), overrides, point, 1.0, str(tmp_path / "pipelined.yaml"))
    planned = load_config(tmp_path / "pipelined.yaml")
    assert planned.schedule.max_in_flight == k
    written = planned.plan().sections
    assert {s: (w.devices, w.mesh, w.micro_batch) for s, w in written.items()} == {
        s: (sp.devices, sp.mesh, sp.micro_batch) for s, sp in sections.items()
    }
    for s in pipelined["layers_per_stage"]:  # the cut it was scored with (none written: the even one)
        assert planned.sections[s].stage_layers == (list(point.cuts[s]) if s in point.cuts else None)
    _equal_to_monolithic(planned)
