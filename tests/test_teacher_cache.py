"""`maestro-jax teacher-cache`: a KD config's teacher run once over its data, its top-k
log-probabilities per position written as ArrayRecord shards with a manifest; a stopped run
resumes to the same bytes, and what the cache cannot run is one `error:` line before compute."""

import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from conftest import ROOT, TINY_KD, compiles, free_ports
from maestro_jax.models import DecoderLM

from maestro_jax import cli
from maestro_jax.config import load_config
from maestro_jax.data.teacher_cache import MANIFEST, read_manifest, read_records
from maestro_jax.runtime.build import build_runtime
from maestro_jax.tools.teacher_cache import write_cache
from maestro_jax.tools.verify import verify
from maestro_jax.workloads import model

KD = ROOT / "configs" / "kd_tiny.yaml"
SMALL = [*TINY_KD, "data.num_samples=20"]  # 20 samples in batches of 8: the last batch holds 4


def kd(*extra):
    return load_config(KD, [*SMALL, *extra])


def _by_hand_top_k(cfg, k):
    """Each sample's teacher top-k ids, tempered log-probabilities and tail log-mass, from the
    teacher's whole model (its body and output layer) on the sample alone, in float64 numpy."""
    rt = build_runtime(cfg)
    states = jax.device_get(rt.step.init().sections)
    params = {**states["teacher"].consts["llm"], "lm_head": states["student"].consts["teacher_head"]}
    body = DecoderLM(model(cfg, "teacher", "llm"))
    samples = [rt.source[i] for i in range(len(rt.source))]
    lengths = [len(s.tokens) - 1 for s in samples]
    ids = np.zeros((len(samples), max(lengths)), np.int32)  # right-padded: causal, so each row is its sample's alone
    for row, s in enumerate(samples):
        ids[row, : lengths[row]] = s.tokens[:-1]
    pos = np.broadcast_to(np.arange(ids.shape[1]), ids.shape)
    z = np.asarray(body.apply({"params": params}, ids, pos, pos < np.asarray(lengths)[:, None]), np.float64)
    z = z / cfg.distill.temperature
    out = []
    for row, (s, n) in enumerate(zip(samples, lengths, strict=True)):
        logp = z[row, :n] - np.logaddexp.reduce(z[row, :n], axis=-1, keepdims=True)
        order = np.argsort(-logp, axis=-1)
        top, rest = order[:, :k], np.take_along_axis(logp, order[:, k:], -1)
        out.append((s.id, top, np.take_along_axis(logp, top, -1), np.logaddexp.reduce(rest, axis=-1)))
    return out


def test_the_cache_holds_each_samples_top_k_of_the_teacher(tmp_path):
    """Every sample once, in the data's order, one record each: at every target position the
    teacher's 8 likeliest tokens, their tempered log-probabilities and the log of the rest's mass,
    as the teacher's whole model gives them on the sample alone; the manifest lists the shards
    (2 global batches each: 16 and 4 samples) with their SHA-256."""
    cfg = kd()
    manifest = write_cache(cfg, tmp_path / "cache", k=8, shard_batches=2, say=lambda _: None)
    assert manifest.complete and [s.samples for s in manifest.shards] == [16, 4]
    assert (manifest.identity.k, manifest.identity.num_samples, manifest.identity.temperature) == (8, 20, 2.0)
    on_disk = json.loads((tmp_path / "cache" / MANIFEST).read_text())
    assert on_disk["complete"] and on_disk["format"] == "maestro_jax.teacher_cache/1"
    records = read_records(tmp_path / "cache")
    want = _by_hand_top_k(cfg, 8)
    assert [r.sample_id for r in records] == [w[0] for w in want]
    for r, (_, ids, log_probs, log_tail) in zip(records, want, strict=True):
        assert r.ids.shape == ids.shape and r.log_probs.dtype == np.float32
        np.testing.assert_array_equal(r.ids, ids)
        np.testing.assert_allclose(r.log_probs, log_probs, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(r.log_tail, log_tail, rtol=1e-4, atol=1e-5)


def test_a_stopped_run_resumes_to_the_same_bytes(tmp_path):
    """A run stopped after its first shard (a half-written second shard left behind), and a
    cache whose second shard was corrupted since, each finish on a rerun with the checksums of
    the uninterrupted run; a rerun of a complete cache computes nothing."""
    cfg = kd()
    whole = write_cache(cfg, tmp_path / "whole", k=8, shard_batches=1, say=lambda _: None)

    class Stop(Exception):
        pass

    def stop_after_first(line):
        if "shard 1/3 written" in line:
            (tmp_path / "cut" / "shard-00001.arrayrecord.tmp").write_bytes(b"half a shard")
            raise Stop

    with pytest.raises(Stop):
        write_cache(cfg, tmp_path / "cut", k=8, shard_batches=1, say=stop_after_first)
    assert [s.file for s in read_manifest(tmp_path / "cut").shards] == ["shard-00000.arrayrecord"]
    resumed = write_cache(cfg, tmp_path / "cut", k=8, shard_batches=1, say=lambda _: None)
    assert resumed.shards == whole.shards

    shard = tmp_path / "cut" / "shard-00001.arrayrecord"
    shard.write_bytes(shard.read_bytes()[:100])
    assert write_cache(cfg, tmp_path / "cut", k=8, shard_batches=1, say=lambda _: None).shards == whole.shards
    said = []
    with compiles() as compiled:
        write_cache(cfg, tmp_path / "cut", k=8, shard_batches=1, say=said.append)
    assert compiled == [] and said == [f"teacher-cache: {tmp_path / 'cut'} is complete (3 shards, 20 samples)"]


@pytest.mark.slow
def test_kill_9_during_teacher_cache_and_a_rerun_give_the_same_cache(tmp_path):
    """`kill -9` of the command once its first shard is in the manifest; the rerun's manifest
    (every shard's SHA-256) equals an uninterrupted run's."""
    args = ["--top-k", "8", "--shard-batches", "1", *TINY_KD, "data.num_samples=160"]  # 20 shards
    assert cli.main(["teacher-cache", "--config", str(KD), "--out", str(tmp_path / "whole"), *args]) == 0
    command = [sys.executable, "-m", "maestro_jax.cli", "teacher-cache", "--config", str(KD)]
    proc = subprocess.Popen([*command, "--out", str(tmp_path / "cut"), *args], stdout=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        manifest = read_manifest(tmp_path / "cut") if (tmp_path / "cut" / MANIFEST).exists() else None
        if manifest and manifest.shards:
            break
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL, "the run ended before it was killed"
    assert not read_manifest(tmp_path / "cut").complete
    assert cli.main(["teacher-cache", "--config", str(KD), "--out", str(tmp_path / "cut"), *args]) == 0
    assert read_manifest(tmp_path / "cut") == read_manifest(tmp_path / "whole")


@pytest.mark.parametrize(
    "config, overrides, said",
    [
        (KD, ["--top-k", "256"], "error: --top-k=256: the teacher's vocabulary has 256 tokens; valid: 1 to 255"),
        (
            KD,
            ["sections.teacher.stages=2"],
            "error: sections.teacher.stages=2: teacher-cache runs the teacher unstaged",
        ),
        (
            ROOT / "configs" / "kd_two_teachers_tiny.yaml",
            [],
            "error: models.teachers: 2 teachers (big, small); teacher-cache runs one teacher",
        ),
        (ROOT / "configs" / "vlm_tiny.yaml", [], "error: workload='vlm': teacher-cache runs a kd config's teacher"),
    ],
    ids=["k", "stages", "two-teachers", "workload"],
)
def test_what_the_cache_cannot_run_is_one_line_before_compute(tmp_path, capsys, config, overrides, said):
    with compiles() as compiled:
        status = cli.main(["teacher-cache", "--config", str(config), "--out", str(tmp_path / "c"), *overrides])
    err = capsys.readouterr().err
    assert status == 2 and err.startswith(said) and err.count("\n") == 1, err
    assert compiled == [] and not (tmp_path / "c").exists()


@pytest.mark.parametrize("config", ["vlm_kd_tiny.yaml", "vlm_tiny.yaml"])
def test_a_teacher_cache_is_kds_alone(capsys, config):
    """vlm_kd runs its teachers, vlm has none: `distill.cache` there is one line naming it."""
    assert cli.main(["verify", "--config", str(ROOT / "configs" / config), "distill.cache=/nowhere"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: distill.cache=/nowhere: workload ") and err.count("\n") == 1, err


def test_a_folder_holding_another_cache_is_refused_naming_what_differs(tmp_path, capsys):
    """`--out` with a cache of k=8: a run asking for k=4 is refused, the folder left as it was."""
    write_cache(kd(), tmp_path / "c", k=8, shard_batches=2, say=lambda _: None)
    before = (tmp_path / "c" / MANIFEST).read_text()
    args = ["teacher-cache", "--config", str(KD), "--out", str(tmp_path / "c"), "--top-k", "4", "--shard-batches", "2"]
    assert cli.main([*args, *SMALL]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --out={tmp_path / 'c'}: holds a teacher cache of another k (8, this run's 4)"), err
    assert (tmp_path / "c" / MANIFEST).read_text() == before


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """The teacher cache (top 8) of `kd()`'s config: 20 samples, 3 shards."""
    out = tmp_path_factory.mktemp("teacher_cache") / "cache"
    write_cache(kd(), out, k=8, shard_batches=1, say=lambda _: None)
    return out


# slow: the quick tier's test_the_cached_step_matches_the_monolithic_step and
# test_the_cache_holds_each_samples_top_k_of_the_teacher hold the step and the cache it reads
@pytest.mark.slow
@pytest.mark.parametrize("scheduler", ["wavefront", "naive"])
def test_training_from_the_cache_is_the_online_top_k_run(cache, scheduler):
    """`distill.cache` (no teacher section: the student alone, on its own devices) trains 3
    steps with the per-step losses of the online run of `distill.top_k: 8` (equal to float
    rounding: the cache's log-probabilities come from the teacher's devices, the online ones from
    the student's)."""
    from maestro_jax.training.loop import train

    common = ["steps=3", f"schedule.scheduler={scheduler}"]
    online = train(kd("distill.top_k=8", *common), progress=False)
    cfg = kd(f"distill.cache={cache}", *common)
    assert set(cfg.sections) == {"student"} and set(build_runtime(cfg).graph.names) == {"student"}
    cached = train(cfg, progress=False)
    assert [r["step"] for r in cached] == [1, 2, 3]
    for got, want in zip(cached, online, strict=True):
        assert got["sample_ids"] == want["sample_ids"]
        assert got["train/loss"] == pytest.approx(want["train/loss"], rel=1e-5), got["step"]


def test_the_cached_step_matches_the_monolithic_step(cache):
    diffs = verify(kd(f"distill.cache={cache}"))
    assert {d.name for d in diffs} == {"loss", "grad_norm", "student/grads", "student/params_after_update"}
    assert all(d.max_rel < 1e-5 for d in diffs), diffs


def _corrupt_second_shard(out):
    shard = out / "shard-00001.arrayrecord"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))


def _truncate_last_shard(out):
    shard = out / "shard-00002.arrayrecord"
    shard.write_bytes(shard.read_bytes()[:-10])


def _incomplete(out):
    manifest = json.loads((out / MANIFEST).read_text())
    manifest["shards"] = manifest["shards"][:1]
    (out / MANIFEST).write_text(json.dumps(manifest))


@pytest.mark.parametrize(
    "damage, overrides, said",
    [
        (None, ["distill.temperature=1.0"], "error: distill.temperature=1.0: the cache in {cache} holds the teacher"),
        (None, ["distill.top_k=4"], "error: distill.top_k=4: the cache in {cache} holds the top 8"),
        (None, ["models.teacher.depth=2"], "error: models.teacher: not the teacher the cache in {cache} was made from"),
        (None, ["seed=1"], "error: models.teacher: not the teacher the cache in {cache} was made from"),
        (None, ["data.num_samples=24"], "error: distill.cache={cache}: the cache holds 20 samples, the data 24"),
        (None, ["data.text_len=[6,15]"], "error: distill.cache={cache}: the data's samples (ids and lengths"),
        (_corrupt_second_shard, [], "error: distill.cache={cache}: shard-00001.arrayrecord: its SHA-256 is not"),
        (_truncate_last_shard, [], "error: distill.cache={cache}: shard-00002.arrayrecord: its SHA-256 is not"),
        (_incomplete, [], "error: distill.cache={cache}: the cache is incomplete (8 of 20 samples)"),
        ("empty", [], "error: distill.cache={cache}: no manifest.json there"),
        (None, ["eval={batches: 1}"], "error: eval: a run from a teacher cache (distill.cache={cache})"),
        (None, ["sections.student.pack=2"], "error: sections.student.pack=2: a student trained from a teacher cache"),
    ],
    ids=[
        "temperature",
        "top-k",
        "teacher",
        "teacher-seed",
        "extra-samples",
        "changed-samples",
        "corrupt",
        "truncated",
        "incomplete",
        "no-cache",
        "eval",
        "packed",
    ],
)
def test_a_cache_that_does_not_fit_the_config_is_one_line_before_compute(
    tmp_path, cache, capsys, damage, overrides, said
):
    import shutil

    copy = tmp_path / "cache"
    if damage == "empty":
        copy.mkdir()
    else:
        shutil.copytree(cache, copy)
        if damage is not None:
            damage(copy)
    with compiles() as compiled:
        status = cli.main(["train", "--config", str(KD), *SMALL, f"distill.cache={copy}", *overrides])
    err = capsys.readouterr().err
    assert status == 2 and err.startswith(said.format(cache=copy)) and err.count("\n") == 1, err
    assert compiled == []


def test_simulate_prices_the_student_alone_on_every_device_against_the_teacher_online(cache, capsys):
    """`simulate` on an online KD config adds the step of the student alone (its teacher read
    from a cache) on all the plan's devices, the layout the planner gives a cached config of it on
    as many devices, and the cache bytes a step reads (k int32 ids and float32 log-probabilities
    and a float32 tail a position: 8 * k + 4 bytes)."""
    from maestro_jax.tools.plan import planner_for
    from maestro_jax.tools.simulate import format_report, simulate_config

    reports = {k: simulate_config(kd(f"distill.top_k={k}")) for k in (8, 16)}
    cached = reports[8]["teacher_cache"]
    assert cached["devices"] == 8 and cached["k"] == 8 and 0 < cached["step_time_s"]
    positions = cached["cache_bytes_per_step"] / (8 * 8 + 4)
    assert positions == pytest.approx(reports[16]["teacher_cache"]["cache_bytes_per_step"] / (16 * 8 + 4))
    assert 8 * 5 <= positions <= 8 * 13  # a global batch of 8 samples of 6 to 14 tokens
    from_cache = kd(f"distill.cache={cache}")
    planned = planner_for(from_cache, 8, float("inf"), batches=from_cache.simulate.batches).search(top=1).best
    assert planned.step_time_s == pytest.approx(cached["step_time_s"], rel=1e-9)
    assert len(planned.plan.sections["student"].devices) == 8
    line = next(x for x in format_report(reports[8]).splitlines() if x.startswith("from a teacher cache"))
    assert "the student alone on 8 devices" in line and "(wavefront)" in line
    assert simulate_config(from_cache).get("teacher_cache") is None  # a cached run prices the student alone already


@pytest.mark.slow
def test_the_readmes_two_commands_run_as_written(tmp_path, monkeypatch):
    """README, "What to try next": the cache, then training from it, each command as written
    (from a folder whose `configs` is the repository's)."""
    readme = (ROOT / "README.md").read_text()
    lines = [
        "`maestro-jax teacher-cache --config configs/kd_tiny.yaml --out teacher_cache --top-k 16`",
        "`maestro-jax train --config configs/kd_tiny.yaml distill.cache=teacher_cache`",
    ]
    assert all(line in readme for line in lines)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    for line in lines:
        assert cli.main(line.strip("`").split()[1:]) == 0, line
    assert read_manifest(tmp_path / "teacher_cache").identity.k == 16


@pytest.mark.parametrize(
    "change, said",
    [
        (lambda d: (d / "tokenizer.json").write_text('{"model": "another"}'), "its tokenizer is not the one"),
        (lambda d: (d / "model.safetensors").write_bytes(b"x" * 10), "not the teacher the cache in"),
        (
            lambda d: (d / "config.json").write_text((d / "config.json").read_text() + " "),
            "not the teacher the cache in",
        ),
    ],
    ids=["tokenizer", "weights", "config"],
)
def test_a_cache_of_a_teacher_folder_is_refused_once_the_folder_changed(tmp_path, capsys, change, said):
    """A teacher from a Hugging Face folder (`models.teacher: {hf: DIR}`): its tokenizer files,
    config.json and weight files (names and sizes) are part of what the cache was made from."""
    from test_hf import _from_folder, make_hf

    _, path = make_hf(tmp_path, "llama_untied")
    (path / "tokenizer.json").write_text('{"model": "one"}')
    overrides = [f"models.student.vocab={model(_from_folder(path, f'{{hf: {path}}}'), 'teacher', 'llm').vocab}"]
    cfg = _from_folder(path, f"{{hf: {path}}}", *overrides, "data.num_samples=8")
    write_cache(cfg, tmp_path / "c", k=4, shard_batches=1, say=lambda _: None)
    own = [o for o in TINY_KD if not o.startswith("models.teacher")]
    args = [*own, f"models.teacher={{hf: {path}}}", *overrides, "data.num_samples=8", f"distill.cache={tmp_path / 'c'}"]
    assert build_runtime(load_config(KD, args)).graph.names == ("student",)  # the folder as the cache saw it
    change(path)
    with compiles() as compiled:
        assert cli.main(["train", "--config", str(KD), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: models.teacher: ") and said in err and err.count("\n") == 1, err
    assert compiled == []


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bfloat16", "fp8"])
def test_a_cache_of_a_low_precision_teacher_trains_as_it_does_online(tmp_path, precision):
    """The teacher section's own precision holds in the cache: from a bfloat16 or fp8 teacher's
    cache, 2 steps give the losses of the online top-k run with that teacher."""
    from maestro_jax.training.loop import train

    teacher = [f"sections.teacher.precision={precision}"]
    write_cache(kd(*teacher), tmp_path / "c", k=8, shard_batches=1, say=lambda _: None)
    online = train(kd(*teacher, "distill.top_k=8", "steps=2"), progress=False)
    cached = train(kd(*teacher, f"distill.cache={tmp_path / 'c'}", "steps=2"), progress=False)
    for got, want in zip(cached, online, strict=True):
        assert got["train/loss"] == pytest.approx(want["train/loss"], rel=1e-5), got["step"]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "devices, writers",
    [
        pytest.param(
            ["sections.teacher.devices=[2,3,4,5]", "sections.student.devices=[0,1,6,7]"],
            [0, 1],
            id="span",
        ),
        pytest.param(["sections.teacher.devices=[4,5,6,7]", "sections.student.devices=[0,1,2,3]"], [1], id="apart"),
    ],
)
def test_two_processes_write_the_one_process_cache(tmp_path, devices, writers):
    """`scripts/launch_local.sh 2` (real jax.distributed on localhost, 4 CPU devices a process):
    the teacher spanning both processes (each writes every other shard) or on process 1 alone
    (process 0, which holds no teacher device, runs the same steps and writes the manifest); the
    cache is the one a single process writes with the same plan: the same manifest identity and
    shards, each sample's record equal (ids exactly, log-probabilities to float rounding: the
    collectives differ)."""
    overrides = [*SMALL, *devices]
    one = write_cache(kd(*devices), tmp_path / "one", k=8, shard_batches=1, say=lambda _: None)
    env = {
        **os.environ,
        "MAESTRO_PORT": str(free_ports(3)),
        "MAESTRO_JAX": f"{sys.executable} -m maestro_jax.cli",
        "MAESTRO_COMMAND": "teacher-cache",
    }
    env.pop("XLA_FLAGS", None)
    args = ["--out", str(tmp_path / "two"), "--top-k", "8", "--shard-batches", "1", *overrides]
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts/launch_local.sh"), "2", str(KD), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    two = read_manifest(tmp_path / "two")
    assert two.complete and two.identity == one.identity
    assert (
        [(s.file, s.samples) for s in two.shards]
        == [(s.file, s.samples) for s in one.shards]
        == [
            ("shard-00000.arrayrecord", 8),
            ("shard-00001.arrayrecord", 8),
            ("shard-00002.arrayrecord", 4),
        ]
    )
    for index in range(3):
        assert f"shard {index + 1}/3 written by process {writers[index % len(writers)]}" in proc.stdout, proc.stdout
    for a, b in zip(read_records(tmp_path / "two"), read_records(tmp_path / "one"), strict=True):
        assert a.sample_id == b.sample_id
        np.testing.assert_array_equal(a.ids, b.ids)
        np.testing.assert_allclose(a.log_probs, b.log_probs, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(a.log_tail, b.log_tail, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_the_teacher_run_holds_no_optimizer_state():
    """`teacher-cache` runs forwards only: the states it holds have no optimizer state (a large
    student's moments are never allocated), and the student's consts, which hold the teacher's
    output layer, are there."""
    from maestro_jax.tools.teacher_cache import _TeacherRun, cached_teacher

    cfg = kd()
    rt = build_runtime(cfg)
    run = _TeacherRun.start(rt, cached_teacher(cfg), cfg.distill.temperature, 8)
    assert {s: st.opt_state for s, st in run.states.items()} == dict.fromkeys(rt.graph.names)
    assert run.teacher.head in run.states["student"].consts
