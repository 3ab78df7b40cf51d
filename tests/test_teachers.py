"""Distillation from several teachers (`models.teachers`, `distill.combine`): each teacher is a
frozen section of its own, the student learns from the weighted mean of their tempered
distributions, the step equals the monolithic one, and every bad input is one `error:` line."""

import copy
import dataclasses
import json

import jax
import numpy as np
import pytest
import yaml
from conftest import ROOT, TINY_VLM_KD
from maestro_jax.models import DecoderLM

from maestro_jax.config import load_config
from maestro_jax.runtime.build import build_runtime
from maestro_jax.tools.verify import verify
from maestro_jax.workloads import model
from maestro_jax.workloads.kd import teachers_of

TWO = ROOT / "configs" / "kd_two_teachers_tiny.yaml"
# distill.combine mode route: each sample's `task` tag names its teacher
ROUTE = [
    "distill.combine={mode: route, field: task, routes: {code: big, chat: small}}",
    "data.tags={task: [code, chat]}",
]
TINY_TWO = ["global_batch=8", "data.text_len=[6,14]", "models.teachers.big.depth=2", "models.student.depth=1"]


def two(*extra):
    return load_config(TWO, [*TINY_TWO, *extra])


def written(tmp_path, path, edit, name="edited.yaml"):
    """The config file at `path` with `edit(raw)` applied to its YAML mapping, written beside the test."""
    raw = copy.deepcopy(yaml.safe_load(path.read_text()))
    edit(raw)
    out = tmp_path / name
    out.write_text(yaml.safe_dump(raw))
    return out


@pytest.mark.slow  # the quick tier's two-teacher step: test_routed_teachers_match_the_monolithic_step[wavefront]
@pytest.mark.parametrize("scheduler", ["wavefront", "naive"])
def test_two_teachers_on_their_own_devices_match_the_monolithic_step(scheduler):
    """Two teachers of other depths, widths, devices and micro-batches: the sectioned step's loss,
    gradient norm, the student's gradients and updated parameters equal the monolithic step's,
    which runs both teachers inside its one program. Under the wavefront scheduler this is the
    shipped config as is: README, "What to try next", `maestro-jax verify --config
    configs/kd_two_teachers_tiny.yaml`."""
    if scheduler == "wavefront":
        readme = (ROOT / "README.md").read_text()
        assert "`maestro-jax verify --config configs/kd_two_teachers_tiny.yaml`" in readme
        cfg = load_config(TWO)
    else:
        cfg = two(f"schedule.scheduler={scheduler}")
    rt = build_runtime(cfg)
    assert set(rt.graph.names) == {"big", "small", "student"}
    assert {(e.name, e.src, e.dst) for e in rt.graph.edges} == {
        ("big_hidden", "big", "student"),
        ("small_hidden", "small", "student"),
    }
    assert [cfg.sections[t].micro_batch for t in ("big", "small")] == [4, 2]
    diffs = verify(cfg, rt)
    assert {d.name for d in diffs} == {"loss", "grad_norm", "student/grads", "student/params_after_update"}
    assert all(d.max_rel < 1e-5 for d in diffs), diffs


def _by_hand(cfg, states, samples, mixed=None) -> float:
    """The batch's loss from each model's whole forward pass (body and output layer) on the batch
    right-padded (causal: a sample's logits are its own alone), in float64 numpy from there: the
    sum over targets of alpha*T^2*KL(mix_T || student_T) + (1-alpha)*CE, over the target count,
    with mix_T = sum_i w_i softmax(z_i / T) (`mixed(sample)`, where given: a teacher name -> weight
    mapping for that sample alone). With `distill.top_k` the KL is between both distributions
    coarsened to mix_T's k likeliest tokens and one outcome for the rest (`_coarsened_kl`)."""
    alpha, temp = cfg.distill.alpha, cfg.distill.temperature
    student = states["student"]
    longest = max(len(s.tokens) for s in samples) - 1
    ids = np.zeros((len(samples), longest), np.int32)
    for i, s in enumerate(samples):
        ids[i, : len(s.tokens) - 1] = s.tokens[:-1]
    pos, valid = np.broadcast_to(np.arange(longest), ids.shape), ids != 0

    def logits(m, params):
        return np.asarray(DecoderLM(m).apply({"params": params}, ids, pos, valid), np.float64)

    def tempered(z):
        return np.exp(z / temp - np.logaddexp.reduce(z / temp, axis=-1, keepdims=True))

    teachers = teachers_of(cfg)
    probs = {
        t.name: tempered(logits(t.model, {**states[t.name].consts["llm"], "lm_head": student.consts[t.head]}))
        for t in teachers
    }
    z = logits(model(cfg, "student", "llm"), student.params)
    total, count = 0.0, 0
    for i, s in enumerate(samples):
        n = len(s.tokens) - 1
        weights = mixed(s) if mixed else {t.name: t.weight for t in teachers}
        mix = sum(w * probs[name][i, :n] for name, w in weights.items())
        s_logp = z[i, :n] / temp - np.logaddexp.reduce(z[i, :n] / temp, axis=-1, keepdims=True)
        if cfg.distill.top_k is None:
            kl = np.sum(mix * (np.log(mix) - s_logp), axis=-1)
        else:
            kl = _coarsened_kl(mix, np.exp(s_logp), cfg.distill.top_k)
        logp = z[i, :n] - np.logaddexp.reduce(z[i, :n], axis=-1, keepdims=True)
        ce = -logp[np.arange(n), s.tokens[1:]]
        total += float(np.sum(alpha * temp**2 * kl + (1 - alpha) * ce))
        count += n
    return total / count


def _coarsened_kl(p, q, k: int):
    """KL(p || q) per row [n, vocab] over k + 1 outcomes: p's k likeliest tokens, the rest as one."""
    order = np.argsort(-p, axis=-1)
    top, rest = order[:, :k], order[:, k:]
    p_top, q_top = np.take_along_axis(p, top, -1), np.take_along_axis(q, top, -1)
    p_tail, q_tail = np.take_along_axis(p, rest, -1).sum(-1), np.take_along_axis(q, rest, -1).sum(-1)
    return np.sum(p_top * np.log(p_top / q_top), -1) + p_tail * np.log(p_tail / q_tail)


def test_the_loss_is_the_weighted_mean_of_the_teachers_distributions_by_hand():
    """Weights 2:1 (the shipped config's): the step's loss on a batch is the one computed by hand
    from each teacher's and the student's whole model on each sample alone."""
    cfg = two()
    rt = build_runtime(cfg)
    state, samples = rt.step.init(), rt.batches()[0]
    assert [t.weight for t in teachers_of(cfg)] == pytest.approx([2 / 3, 1 / 3])
    loss = float(rt.step.evaluate(state, samples))
    host = {s: jax.device_get(st) for s, st in state.sections.items()}
    assert loss == pytest.approx(_by_hand(cfg, host, samples), rel=1e-5)


def assert_same_student_step(rt, other, samples):
    """The two runtimes' steps on `samples`, each from its own initial state, give one loss and
    one gradient of the student."""
    (loss, grads), (want, want_grads) = [
        (float(r[0]), jax.device_get(r[1]["student"]))
        for r in (x.step.gradients(x.step.init(), samples) for x in (rt, other))
    ]
    assert loss == pytest.approx(want, rel=1e-6)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


@pytest.mark.slow  # 8.6 s alone; the idle routed teacher's test compares with weight 0 in the quick tier
def test_a_teacher_of_weight_0_leaves_the_step_to_the_other(tmp_path):
    """`weights: {small: 0}` is distillation from `big` alone: the same loss and student
    gradients as a config whose only teacher is `big` (the first teacher and the student start
    from the same weights however many teachers follow)."""

    def big_alone(raw):
        del raw["models"]["teachers"]["small"], raw["sections"]["small"]
        raw["distill"]["combine"] = {"mode": "mean"}

    both = build_runtime(two("distill.combine.weights={small: 0}"))
    alone = build_runtime(load_config(written(tmp_path, TWO, big_alone), TINY_TWO))
    assert set(alone.graph.names) == {"big", "student"}
    samples = both.batches()[0]
    assert_same_student_step(both, alone, samples)


def test_one_teacher_is_the_teacher_section_it_always_was():
    """`models.teacher` (the shipped kd configs) is a list of one: section `teacher`, edge
    `teacher_hidden`, its output layer `teacher_head` in the student, weight 1."""
    cfg = load_config(ROOT / "configs" / "kd_tiny.yaml")
    (t,) = teachers_of(cfg)
    assert (t.name, t.edge, t.head, t.weight) == ("teacher", "teacher_hidden", "teacher_head", 1.0)
    assert cfg.distill.teachers == ()


def test_the_teachers_group_reads_as_one_model_and_section_each():
    """`models.teachers: {big, small}` is `models.big`, `models.small` and `distill.teachers`,
    which is what the resolved config (config.yaml of a run) holds and loads back as."""
    from maestro_jax.config import Config, dump_config

    cfg = two()
    assert cfg.distill.teachers == ("big", "small") and {"big", "small", "student"} == set(cfg.models)
    assert Config.model_validate(yaml.safe_load(dump_config(cfg))) == cfg


@pytest.mark.slow  # test_workloads verifies vlm_kd in the quick tier; this adds its second teacher
def test_vlm_kd_distils_from_two_teachers(tmp_path):
    """`vlm_kd` with two teachers (the shipped one and a shallower copy sharing the vision
    section's devices), routed by a `lang` tag naming the teacher, verifies under the wavefront
    scheduler. (Mixing is the distillation loss kd and vlm_kd share, and both build their teachers'
    sections with `kd.teacher_sections`: kd's tests check `mode: mean`.)"""
    combine = ["distill.combine={mode: route, field: lang}", "data.tags={lang: [t1, t2]}"]

    def two_teachers(raw):
        teacher = raw["models"].pop("teacher")
        raw["models"]["teachers"] = {"t1": teacher, "t2": {**teacher, "depth": 1}}
        raw["sections"]["t1"] = raw["sections"].pop("teacher")
        raw["sections"]["t2"] = {"devices": "2:4", "mesh": {"data": 2}, "micro_batch": 2}

    tiny = [o.replace(".teacher.", ".t1.").replace("models.t1.", "models.teachers.t1.") for o in TINY_VLM_KD]
    cfg = load_config(written(tmp_path, ROOT / "configs" / "vlm_kd_tiny.yaml", two_teachers), [*tiny, *combine])
    assert [t.name for t in teachers_of(cfg)] == ["t1", "t2"]
    diffs = verify(cfg)
    assert {d.name.split("/")[0] for d in diffs} == {"loss", "grad_norm", "vision", "student"}
    assert all(d.max_rel < 1e-5 for d in diffs), diffs


def _no_section_small(raw):
    del raw["sections"]["small"]


def _also_models_teacher(raw):
    raw["models"]["teacher"] = dict(raw["models"]["student"])


def _a_teacher_named_like_the_student(raw):
    raw["models"]["teachers"]["student"] = raw["models"]["teachers"].pop("small")


@pytest.mark.parametrize(
    "edit, overrides, said",
    [
        (_no_section_small, [], "error: sections"),
        (
            None,
            ["distill.combine.weights={large: 1}"],
            "error: distill.combine.weights.large: not a teacher; valid: big, small",
        ),
        (
            None,
            ["distill.combine.weights={big: 0, small: 0}"],
            "error: distill.combine.weights={'big': 0.0, 'small': 0.0}: they sum to 0",
        ),
        (None, ["distill.combine.weights={big: -1}"], "error: distill.combine.weights.big=-1"),
        (None, ["models.teachers.small.vocab=300"], "error: models.small.vocab=300: differs from models.big.vocab=256"),
        (
            None,
            ["models.teachers.big.vocab=300", "models.teachers.small.vocab=300"],
            "error: models.big.vocab=300: differs from models.student.vocab=256",
        ),
        (_also_models_teacher, [], "error: models.teacher and models.teachers: both given"),
        (_a_teacher_named_like_the_student, [], "error: models.teachers.student: models.student is another model"),
        (None, ["distill.combine.mode=max"], "error: distill.combine.mode='max'"),
        (None, ["distill.combine={mode: route}"], "error: distill.combine.field: missing"),
        (None, [*ROUTE, "distill.combine.routes={code: large}"], "error: distill.combine.routes.code='large': not a"),
        (None, [*ROUTE, "distill.combine.default=large"], "error: distill.combine.default='large': not a teacher"),
        (None, [*ROUTE, "distill.combine.weights={big: 1}"], "error: distill.combine.weights: mode 'route' takes"),
        (None, [*ROUTE, "distill.combine.field=lang"], "error: distill.combine.field='lang': the synthetic data"),
        (None, [*ROUTE, "eval.data={num_samples: 16}"], "error: distill.combine.field='task': the synthetic eval.data"),
        (None, [*ROUTE, "distill.combine.routes={code: big}"], "error: data.tags.task: 'chat' routes to no teacher"),
        (None, ["distill.top_k=256"], "error: distill.top_k=256: keeps the whole vocabulary of 256 tokens"),
        (None, ["distill.top_k=0"], "error: distill.top_k=0"),
    ],
    ids=[
        "no-section",
        "unknown-weight",
        "zero-sum",
        "negative",
        "teachers-vocab",
        "student-vocab",
        "both",
        "clash",
        "mode",
        "route-no-field",
        "route-unknown-teacher",
        "route-unknown-default",
        "route-weights",
        "route-unknown-field",
        "route-eval-data-untagged",
        "route-unrouted-value",
        "top-k-whole-vocabulary",
        "top-k-zero",
    ],
)
def test_bad_teacher_settings_are_one_line_before_compute(tmp_path, edit, overrides, said, capsys):
    from maestro_jax import cli

    config = TWO if edit is None else written(tmp_path, TWO, edit)
    assert cli.main(["verify", "--config", str(config), *TINY_TWO, *overrides]) == 2
    err = capsys.readouterr().err
    assert err.startswith(said) and err.count("\n") == 1, err


@pytest.mark.slow
@pytest.mark.parametrize("combine", [[], ROUTE], ids=["mean", "route"])
def test_a_run_with_two_teachers_resumes_bit_exact(tmp_path, combine):
    """`train` 4 steps with two teachers, mixed or routed; a run stopped after step 2 and
    resumed gives the uninterrupted run's losses and data order bit for bit (the teachers are
    frozen: their weights come from the seed, as for one teacher, not from the checkpoint)."""
    from maestro_jax.training.loop import train

    cfg = lambda out, steps: two(*combine, "checkpoint_every=2", f"output_dir={out}", f"steps={steps}")
    straight = train(cfg(tmp_path / "a", 4), progress=False)
    first = train(cfg(tmp_path / "b", 2), progress=False)
    resumed = train(cfg(tmp_path / "b", 4), progress=False)
    assert [r["step"] for r in straight] == [1, 2, 3, 4] and [r["step"] for r in resumed] == [3, 4]
    for got, want in zip(first + resumed, straight, strict=True):
        assert (got["train/loss"], got["sample_ids"]) == (want["train/loss"], want["sample_ids"]), got["step"]
    assert straight[-1]["train/loss"] < straight[0]["train/loss"]


def test_plan_and_simulate_price_each_teacher(capsys):
    """`plan --devices 16` places each teacher on its own, and `simulate` prices the config's
    plan: both name the sections `big`, `small` and `student`."""
    from maestro_jax import cli

    assert cli.main(["plan", "--config", str(TWO), "--devices", "16", "--memory-gb", "80", "--top", "3"]) == 0
    planned = capsys.readouterr().out
    assert "workload kd: sections big, small, student;" in planned
    best = next(line for line in planned.splitlines() if line.startswith(" 1 "))
    assert all(f"{name} " in best for name in ("big", "small", "student")), best
    assert cli.main(["simulate", "--config", str(TWO)]) == 0
    simulated = capsys.readouterr().out
    assert "big on 2 devices, small on 2 devices, student on 4 devices" in simulated


@pytest.mark.parametrize("config, section", [(TWO, "small"), (ROOT / "configs" / "kd_tiny.yaml", "teacher")])
def test_export_of_a_frozen_teacher_is_refused(tmp_path, capsys, config, section):
    """A teacher is frozen: `export --section` of it is one line naming the trained sections,
    and nothing is written (the weights are the ones `models.<name>` loads)."""
    from maestro_jax import cli

    out = tmp_path / "out"
    assert cli.main(["export", "--config", str(config), "--section", section, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --section='{section}': '{section}' is a frozen section") and err.count("\n") == 1
    assert "trained sections: ['student']" in err and not out.exists()


# slow: the quick tier's test_a_routed_sample_learns_from_its_teacher_alone checks the routed sectioned step sample by sample
@pytest.mark.slow
@pytest.mark.parametrize("scheduler", ["wavefront", "naive"])
def test_routed_teachers_match_the_monolithic_step(scheduler):
    """`mode: route`: each sample's teacher is the one its `task` tag routes to; the sectioned
    step (each teacher's section running only its own samples) equals the monolithic one."""
    cfg = two(*ROUTE, f"schedule.scheduler={scheduler}")
    diffs = verify(cfg)
    assert all(d.max_rel < 1e-5 for d in diffs), diffs


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [["sections.student.pack=2", "sections.small.pack=2"], ["sections.student.stages=2", "models.student.depth=2"]],
    ids=["packed", "staged"],
)
def test_routing_holds_in_packed_rows_and_pipeline_stages(layout):
    """Routed teachers with the student's rows packed (each position takes its own sample's
    teacher) or the student cut into two stages (the last holds every teacher's layer)."""
    diffs = verify(two(*ROUTE, *layout))
    assert all(d.max_rel < 1e-5 for d in diffs), diffs


def test_a_routed_sample_learns_from_its_teacher_alone():
    """The routed step's loss is, sample by sample, the one-teacher loss of the sample's own
    teacher, computed by hand; each teacher's section holds exactly the samples routed to it."""
    cfg = two(*ROUTE)
    rt = build_runtime(cfg)
    state, samples = rt.step.init(), rt.batches()[0]
    teacher = {"code": "big", "chat": "small"}
    assert {s.tags["task"] for s in samples} == {"code", "chat"}, "the batch holds samples of both teachers"
    schedule = rt.schedule(samples)
    for name in ("big", "small"):
        held = sorted(samples[p].id for m in schedule.steps[name] for p in m.samples)
        assert held == sorted(s.id for s in samples if teacher[s.tags["task"]] == name)
    loss = float(rt.step.evaluate(state, samples))
    host = {s: jax.device_get(st) for s, st in state.sections.items()}
    assert loss == pytest.approx(_by_hand(cfg, host, samples, lambda s: {teacher[s.tags["task"]]: 1.0}), rel=1e-5)


@pytest.mark.slow  # quick: test_a_routed_sample_learns_from_its_teacher_alone (each section holds its samples)
def test_a_teacher_no_sample_routes_to_runs_nothing():
    """Every sample tagged `code` (routed to `big`): `small` has no micro-step and no program
    runs for it, and the step is distillation from `big` alone (weight 0 on `small`)."""
    routed = build_runtime(two(*ROUTE, "data.tags={task: [code]}"))
    samples = routed.batches()[0]
    schedule = routed.schedule(samples)
    assert schedule.steps["small"] == () and not [op for op in schedule.ops if op.section == "small"]
    mixed = build_runtime(two("distill.combine.weights={small: 0}"))
    assert [s.id for s in mixed.batches()[0]] == [s.id for s in samples]
    assert_same_student_step(routed, mixed, samples)


def test_tags_in_records_route_and_an_untagged_sample_takes_the_default(tmp_path):
    """Samples read from ArrayRecord files carry their tags (in the record and in its index):
    with `default: small`, an untagged sample learns from `small`; without a default it is a bad
    sample, refused with one line naming it, or skipped under `data.on_bad_sample: skip`."""
    from array_record.python.array_record_module import ArrayRecordWriter

    from maestro_jax.data.pipeline import BadSamples
    from maestro_jax.data.samples import DataError, encode_sample
    from maestro_jax.data.sources import ArrayRecordSource, SyntheticSource, write_index

    plain = SyntheticSource(num_samples=16, vocab=256, text_len=(6, 14), seed=3)
    tagged = [
        dataclasses.replace(plain[i], tags={} if i % 4 == 0 else {"task": ["code", "chat"][i % 2]}) for i in range(16)
    ]
    path = tmp_path / "tagged.array_record"
    writer = ArrayRecordWriter(str(path), "group_size:1")
    for s in tagged:
        writer.write(encode_sample(s))
    writer.close()
    unindexed = ArrayRecordSource((str(path),))
    assert [unindexed.info(i).tags for i in range(4)] == [{}, {"task": "chat"}, {"task": "code"}, {"task": "chat"}]
    write_index(str(path))
    assert [ArrayRecordSource((str(path),)).info(i).tags for i in range(16)] == [s.tags for s in tagged]

    records = ["data.kind=array_record", f"data.paths=[{path}]", "data.shuffle=false"]
    route = "distill.combine={mode: route, field: task, routes: {code: big, chat: small}, default: small}"
    cfg = two(route, *records)
    rt = build_runtime(cfg)
    samples = rt.batches()[0]
    schedule = rt.schedule(samples)
    small = sorted(samples[p].id for m in schedule.steps["small"] for p in m.samples)
    assert small == sorted(s.id for s in samples if s.tags.get("task", "chat") == "chat")
    assert any(not s.tags for s in samples), "the batch holds an untagged sample"
    assert all(d.max_rel < 1e-5 for d in verify(cfg, rt))

    no_default = route.replace(", default: small", "")
    strict = build_runtime(two(no_default, *records))
    with pytest.raises(DataError, match=r"sample id=0: has no tag 'task' \(distill.combine.field\)"):
        next(strict.reader())
    bad = BadSamples()
    skipping = next(strict.reader(bad)).samples
    assert all(s.tags for s in skipping) and len(skipping) == 8 and bad.total == 3  # ids 0, 4, 8

    index = path.with_name(path.name + ".index.json")
    rows = json.loads(index.read_text())
    rows[1][3] = {"task": "code"}  # a stale index: the record says chat
    index.write_text(json.dumps(rows))
    with pytest.raises(DataError, match=r"sample id=1: its payload does not match its metadata .* tags \{'task': 'ch"):
        next(build_runtime(cfg).reader())


def test_the_simulator_prices_a_teacher_by_the_samples_routed_to_it(tmp_path):
    """`simulate` of routing: a teacher no sample routes to costs no device time, one that every
    sample routes to costs what it costs when mixed (it then runs every sample too), and split
    between them each teacher's work is the work of its own samples."""
    from maestro_jax import cli

    def simulated(name, *overrides):
        out = tmp_path / f"{name}.json"
        assert cli.main(["simulate", "--config", str(TWO), *TINY_TWO, *overrides, "--json", str(out)]) == 0
        got = json.loads(out.read_text())
        total = got["step_time_s"]["wavefront"] * sum(got["devices"]["maestro"].values())  # device seconds
        return got["busy_s"], {s: t["work"] * total for s, t in got["device_time_by_section"].items()}

    (mixed, mixed_work), (routed, _) = simulated("mean"), simulated("route", *ROUTE, "data.tags={task: [code]}")
    assert routed["small"] == 0.0 < mixed["small"]
    assert routed["big"] == pytest.approx(mixed["big"], rel=1e-9)
    _, split = simulated("split", *ROUTE)
    assert all(0.0 < split[t] < mixed_work[t] for t in ("big", "small")), (split, mixed_work)
