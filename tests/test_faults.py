"""Faults really happen here (kill -9, SIGSTOP, a full or read-only filesystem, flipped bits,
bad records, bad configs) and each test checks the outcome: files, losses, statuses, messages."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import ROOT, TINY_KD, TINY_VLM, compiles, free_ports

from maestro_jax import cli
from maestro_jax.config import load_config
from maestro_jax.data import IMAGE_TOKEN, DataError, Sample, encode_sample
from maestro_jax.training.checkpoint import Checkpointer
from maestro_jax.training.loop import train
from maestro_jax.training.manifest import MANIFEST, verify_step
from maestro_jax.training.storage import StorageError

KD = ROOT / "configs/kd_tiny.yaml"
VLM = ROOT / "configs/vlm_tiny.yaml"


def cli_args(config, overrides, hold=()):
    """The `train` command line; `hold`: tests/held_checkpoint_cli.py's options (its saves or
    commits held back), which then runs it."""
    entry = [str(ROOT / "tests" / "held_checkpoint_cli.py"), *hold] if hold else ["-m", "maestro_jax.cli"]
    return [sys.executable, *entry, "train", "--config", str(config), *overrides]


def metrics(out):
    """The complete lines of metrics.jsonl. Polled while the run writes, or read after a kill,
    the last line may be cut short (no newline yet); the run that resumes drops such a line
    itself (trackers.JsonlTracker), so a reader skips it too."""
    lines = (out / "metrics.jsonl").read_text().splitlines(keepends=True)
    return [json.loads(line) for line in lines if line.endswith("\n")]


def final_losses(out):
    """Loss by step as the log holds it (each step once, the values of the run the checkpoints continue)."""
    return {r["step"]: r["train/loss"] for r in metrics(out)}


def uncommitted(ck):
    """What an unfinished save leaves: Orbax temporaries and step directories without a manifest."""
    if not ck.is_dir():
        return []
    return sorted(
        p.name
        for p in ck.iterdir()
        if ".orbax-checkpoint-tmp" in p.name or (p.name.isdigit() and not (ck / MANIFEST.format(step=p.name)).exists())
    )


def kd(out, *extra):
    return load_config(KD, TINY_KD + [f"output_dir={out}", *extra])


# -- 1. kill -9 while a checkpoint is being written ----------------------------------------------
@pytest.mark.slow
def test_kill_9_during_save_resumes_from_last_complete(tmp_path):
    steps = 8
    out, ck = tmp_path / "run", tmp_path / "run" / "checkpoints"
    args = cli_args(KD, TINY_KD + [f"output_dir={out}", f"steps={steps}", "checkpoint_every=1"])
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seen, deadline = [], time.time() + 300
    while proc.poll() is None and time.time() < deadline:
        if len(list(ck.glob("manifest-*.json"))) >= 2 and (seen := uncommitted(ck)):
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.002)
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL, f"the run ended before it could be killed: {proc.stderr.read()[-2000:]}"
    assert seen, "killed while a save was unfinished"
    committed = Checkpointer(ck).committed_steps()
    assert committed and all(str(s) not in seen for s in committed)

    proc = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"trained steps {committed[-1] + 1}..{steps}" in proc.stdout, "resumed from the last complete checkpoint"
    assert not uncommitted(ck), "the partial save was cleaned up, then every later save committed"
    assert [r["step"] for r in metrics(out)] == list(range(1, steps + 1)), "each step logged once after the resume"
    straight = train(kd(tmp_path / "straight", f"steps={steps}"), progress=False)
    assert final_losses(out) == {r["step"]: r["train/loss"] for r in straight}


def _kill_when(proc, ready, timeout_s=300):
    """SIGKILL `proc` as soon as `ready()` holds; returns what `ready()` returned."""
    deadline = time.time() + timeout_s
    while proc.poll() is None and time.time() < deadline:
        if seen := ready():
            proc.send_signal(signal.SIGKILL)
            proc.communicate(timeout=60)
            return seen
        time.sleep(0.002)
    proc.kill()
    pytest.fail(f"the run ended before it could be killed: {proc.communicate()[1][-2000:]}")


_STRAIGHT = {}


def straight_losses(tmp_path, steps=10):
    """Per-step losses of an uninterrupted run (computed once per module)."""
    if steps not in _STRAIGHT:
        _STRAIGHT[steps] = {
            r["step"]: r["train/loss"] for r in train(kd(tmp_path / "straight", f"steps={steps}"), progress=False)
        }
    return _STRAIGHT[steps]


def tensorboard_losses(out) -> list[tuple[int, float]]:
    """(step, loss) as TensorBoard shows `train/loss` of `out/tb`: the event files in name order
    (a timestamp), read record by record (a record a kill cut short ends its file), where a
    `SessionLog.START` at step s purges every earlier event at step s or later (TensorBoard's
    event accumulator)."""
    import struct

    from tensorboardX.proto.event_pb2 import Event, SessionLog

    shown = []
    for path in sorted((out / "tb").glob("events*")):
        data, at = path.read_bytes(), 0
        while at + 12 <= len(data):
            (size,) = struct.unpack("<Q", data[at : at + 8])
            payload = data[at + 12 : at + 12 + size]
            at += 12 + size + 4
            if len(payload) < size:
                break
            event = Event.FromString(payload)
            if event.HasField("session_log") and event.session_log.status == SessionLog.START:
                shown = [(step, v) for step, v in shown if step < event.step]
            shown += [(event.step, v.simple_value) for v in event.summary.value if v.tag == "train/loss"]
    return shown


@pytest.mark.slow
@pytest.mark.extended
def test_tensorboard_shows_each_step_once_after_a_rerun_and_a_kill_9(tmp_path):
    """A rerun from step 0 (no checkpoint) purges the earlier run's events, and a run killed after
    a checkpoint leaves every step the checkpoint holds on disk: after the resume TensorBoard
    shows steps 1..N once each, with metrics.jsonl's losses (float32 in the events)."""
    out = tmp_path / "rerun"
    train(kd(out, "steps=2", "keep_checkpoints=0"), progress=False)
    train(kd(out, "steps=3", "keep_checkpoints=0"), progress=False)
    logged = [(r["step"], np.float32(r["train/loss"])) for r in metrics(out)]
    assert [s for s, _ in logged] == [1, 2, 3] and tensorboard_losses(out) == logged

    out = tmp_path / "killed"
    args = cli_args(KD, TINY_KD + [f"output_dir={out}", "steps=6", "checkpoint_every=2"])
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _kill_when(proc, lambda: (out / "metrics.jsonl").exists() and len(metrics(out)) >= 3)
    assert subprocess.run(args, capture_output=True, text=True, timeout=600).returncode == 0
    logged = [(r["step"], np.float32(r["train/loss"])) for r in metrics(out)]
    assert [s for s, _ in logged] == [1, 2, 3, 4, 5, 6] and tensorboard_losses(out) == logged


@pytest.mark.slow
@pytest.mark.extended
def test_kill_9_before_commit_with_keep_1_keeps_the_last_committed_step(tmp_path):
    """keep_checkpoints=1: the only committed step is deleted only after the next one is
    committed. Killed after Orbax wrote step 4's files but before it committed them (the test
    commit is held open: tests/held_checkpoint_cli.py), the next run resumes from step 2,
    not from scratch."""
    steps = 10
    out, ck = tmp_path / "run", tmp_path / "run" / "checkpoints"
    overrides = TINY_KD + [f"output_dir={out}", f"steps={steps}", "checkpoint_every=2", "keep_checkpoints=1"]
    args = cli_args(KD, overrides)
    held = cli_args(KD, overrides, hold=["--commit-delay", "30"])
    proc = subprocess.Popen(held, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    since = []

    def ready():  # step 4 written, not committed; a retention that ran too early has had its chance
        if not list(ck.glob("4.orbax-checkpoint-tmp*")) or (ck / "4").exists():
            return False
        since.append(since[0] if since else time.time())
        return not (ck / "2").is_dir() or time.time() - since[0] > 2

    _kill_when(proc, ready)
    assert (ck / MANIFEST.format(step=2)).exists() and (ck / "2").is_dir(), (
        f"step 2 must stay until step 4 is committed: {sorted(p.name for p in ck.iterdir())}"
    )

    proc = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"trained steps 3..{steps}" in proc.stdout, "resumed from the last committed step, 2"
    assert [r["step"] for r in metrics(out)] == list(range(1, steps + 1)), "each step logged once after the resume"
    assert final_losses(out) == straight_losses(tmp_path, steps)
    assert sorted(p.name for p in ck.glob("manifest-*.json")) == [f"manifest-{steps}.json"], "keep_checkpoints=1"
    assert sorted(p.name for p in ck.iterdir() if p.name.isdigit()) == [str(steps)]


@pytest.mark.slow
def test_a_save_counts_as_soon_as_it_is_complete(tmp_path):
    """A finished save is committed without waiting for the next save: killed after step 50's
    save completed but before step 100's, the next run resumes from step 50, not from scratch."""
    every, steps = 50, 52
    out, ck = tmp_path / "run", tmp_path / "run" / "checkpoints"
    args = cli_args(KD, TINY_KD + [f"output_dir={out}", "steps=1000", f"checkpoint_every={every}"])
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def ready():
        logged = len(metrics(out)) if (out / "metrics.jsonl").exists() else 0
        if (ck / str(every)).is_dir() or logged >= 2 * every:  # Orbax committed step `every`
            return {"logged": logged}
        return None

    seen = _kill_when(proc, ready)
    assert seen["logged"] < 2 * every, f"step {every} was committed only at the next save"

    proc = subprocess.run(
        cli_args(KD, TINY_KD + [f"output_dir={out}", f"steps={steps}", f"checkpoint_every={every}"]),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"trained steps {every + 1}..{steps}" in proc.stdout, proc.stdout
    assert [r["step"] for r in metrics(out)] == list(range(1, steps + 1)), "each step logged once after the resume"
    assert final_losses(out) == straight_losses(tmp_path, steps)


@pytest.mark.slow
def test_a_second_run_on_one_output_dir_is_refused(tmp_path, capsys):
    """While a run holds `output_dir`, a second one exits 2 with one line naming the directory
    and the holder; once the holder is `kill -9`ed, its stale lock does not block a new run."""
    out = tmp_path / "run"
    args = cli_args(KD, TINY_KD + [f"output_dir={out}", "steps=100000", "keep_checkpoints=0"])
    holder = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 300
        while (
            holder.poll() is None
            and time.time() < deadline
            and not ((out / "metrics.jsonl").exists() and len(metrics(out)) >= 2)
        ):
            time.sleep(0.1)
        assert holder.poll() is None, holder.communicate()[1][-2000:]
        capsys.readouterr()
        status = cli.main(
            ["train", "--config", str(KD), *TINY_KD, f"output_dir={out}", "steps=2", "keep_checkpoints=0"]
        )
        err = capsys.readouterr().err.strip()
        assert status == 2, err
        assert err.startswith("error: ") and "\n" not in err, err
        assert str(out) in err and f"pid {holder.pid}" in err and socket.gethostname() in err, err
        assert holder.poll() is None, "the holder keeps running"
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.communicate(timeout=60)
    steps = [r["step"] for r in metrics(out)]
    assert steps == list(range(1, len(steps) + 1)), "only the holder wrote metrics"

    status = cli.main(["train", "--config", str(KD), *TINY_KD, f"output_dir={out}", "steps=2", "keep_checkpoints=0"])
    assert status == 0, capsys.readouterr().err[-2000:]
    assert [r["step"] for r in metrics(out)] == [1, 2], "the stale lock of the killed run did not block"


# -- 3. bad configs: status 2, one line, before any compilation -----------------------------------
@pytest.mark.parametrize(
    "overrides,text",
    [
        (["sections.student.micro_bach=2"], "sections.student.micro_bach: unknown key; did you mean 'micro_batch'?"),
        (["steps=many"], "steps='many'"),
        (["sections.student.mesh={data: 2, tensor: 3}"], "sections.student.mesh"),
        (["sections.student.devices=2:6"], "also used by section 'teacher'"),
        (["sections.student.devices=4:12"], "valid device ids are 0..7"),
        (["edges.teacher_hidden.fanout=3"], "edges.teacher_hidden.fanout"),
        (["device_memory_gb=0.00001"], "exceeds device_memory_gb"),
        (["global_batch=0"], "global_batch"),
        (["compile.scan_micro_steps=0"], "error: compile.scan_micro_steps=0: Input should be greater than 0"),
        (["steps=["], "override 'steps=[': the value is not valid YAML"),
        (["=5"], "error: override '=5': the key before '=' is empty; write key=value"),
        (["progress=1"], "error: progress: unknown key; valid keys: "),
        (["sections.student.devices=248"], 'base-60 number 248; quote the range: devices: "4:8"'),
        (["models.teacher.vocab=128"], "error: models.teacher.vocab=128: differs from models.student.vocab=256"),
        (["sections.student.init={checkpoint_dir: /no/such/run}"], "init.checkpoint_dir='/no/such/run': no such"),
        (["data={kind: array_record}"], "error: data.paths=[]: kind: array_record reads these files, and none"),
        (["eval={data: {kind: array_record}}"], "error: eval.data.paths=[]: kind: array_record reads these files"),
        ([f"sections.student.init={{checkpoint_dir: {ROOT / 'configs'}}}"], "configs': holds no committed checkpoint"),
    ],
)
def test_bad_config_exits_2_with_one_line_before_compiling(overrides, text, capsys):
    from test_plan import COUNTER

    before = COUNTER.count
    status = cli.main(["train", "--config", str(KD), *TINY_KD, *overrides])
    err = capsys.readouterr().err.strip()
    assert status == 2
    assert err.startswith("error: ") and "\n" not in err, err
    assert text in err, err
    assert COUNTER.count == before, "rejected before any compilation"


@pytest.mark.slow
def test_keep_checkpoints_0_where_checkpoints_are_is_refused(tmp_path, capsys):
    """A run without checkpoints on a directory holding some would restart from step 0, cut
    metrics.jsonl back and leave the old checkpoints to a later resume: refused, nothing touched."""
    out = tmp_path / "run"
    assert cli.main(["train", "--config", str(KD), *TINY_KD, f"output_dir={out}", "steps=1"]) == 0
    logged = (out / "metrics.jsonl").read_text()
    capsys.readouterr()
    assert cli.main(["train", "--config", str(KD), *TINY_KD, f"output_dir={out}", "steps=2", "keep_checkpoints=0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"error: keep_checkpoints=0: {out / 'checkpoints'} holds checkpoints (steps 1); a run without checkpoints "
        f"would restart from step 0 and cut {out / 'metrics.jsonl'} back; resume with keep_checkpoints of 1 or more, "
        f"or use another output_dir"
    ), err
    assert (out / "metrics.jsonl").read_text() == logged


def test_an_unquoted_device_range_in_yaml_is_named_as_written(tmp_path, capsys):
    """YAML 1.1 reads `devices: 4:8` as 248 (base 60): the error names the range the user wrote."""
    config = tmp_path / "kd.yaml"
    config.write_text(KD.read_text().replace('devices: "4:8"', "devices: 4:8"))
    assert cli.main(["train", "--config", str(config), *TINY_KD]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "error: sections.student.devices=248: YAML reads an unquoted 4:8 as the base-60 number 248; "
        'quote the range: devices: "4:8"'
    ), err


@pytest.mark.parametrize(
    "drop,said",
    [
        ("global_batch: 16\n", "error: global_batch: missing; this key is required"),
        ('    devices: "4:8"\n', "error: sections.student.devices: missing; this key is required"),
    ],
)
def test_a_missing_required_key_is_named_alone(tmp_path, capsys, drop, said):
    """Not the whole block around it as its "value" (once 839 characters for global_batch)."""
    config = tmp_path / "kd.yaml"
    assert drop in KD.read_text()
    config.write_text(KD.read_text().replace(drop, "", 1))
    assert cli.main(["train", "--config", str(config)]) == 2
    assert capsys.readouterr().err.strip() == said


@pytest.mark.parametrize(
    "content,text",
    [
        (b"42\n", "holds a YAML int ('42'), not a mapping of config keys"),
        (b"- workload\n- kd\n", "holds a YAML list"),
        (b"workload: kd\nseed: \xff\xfe\n", "not UTF-8 text (byte 19: b'\\xff')"),
    ],
)
def test_a_config_file_that_is_no_mapping_or_not_utf8_exits_2_with_one_line(tmp_path, content, text, capsys):
    path = tmp_path / "bad.yaml"
    path.write_bytes(content)
    status = cli.main(["train", "--config", str(path)])
    err = capsys.readouterr().err.strip()
    assert status == 2 and err.startswith("error: ") and "\n" not in err, err
    assert text in err, err


# -- 4. bad data: rejected with the sample id, or skipped, counted and reported -------------------
def _write_records(path):
    """24 records in order; ids 3, 7, 11, 15, 19 are bad in five different ways."""
    import io

    from array_record.python.array_record_module import ArrayRecordWriter

    rng = np.random.default_rng(0)
    writer = ArrayRecordWriter(str(path), "group_size:1")
    for i in range(24):
        image = rng.uniform(-1, 1, (8, 8, 3)).astype(np.float32)
        tokens = np.array([IMAGE_TOKEN] + list(rng.integers(2, 200, 9)), np.int32)
        if i == 3:  # NaN pixels (a float image stored as is)
            buf = io.BytesIO()
            np.savez(buf, id=np.int64(i), tokens=tokens, image_0=np.full((8, 8, 3), np.nan, np.float32))
            writer.write(buf.getvalue())
            continue
        if i == 7:
            tokens = np.array([IMAGE_TOKEN, IMAGE_TOKEN] + list(tokens[1:]), np.int32)  # 2 placeholders, 1 image
        if i == 11:
            tokens = np.array([IMAGE_TOKEN], np.int32)  # no text
        if i == 15:
            writer.write(b"not an npz record")
            continue
        if i == 19:
            tokens = np.concatenate([tokens, rng.integers(2, 200, 60).astype(np.int32)])  # past data.max_tokens
        writer.write(encode_sample(Sample(id=i, tokens=tokens, items={"image": (image,)})))
    writer.close()


@pytest.fixture(scope="module")
def bad_records(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "mixed.array_record"
    _write_records(path)
    return TINY_VLM + [
        "data.kind=array_record",
        f"data.paths=[{path}]",
        "data.shuffle=false",
        "data.max_tokens=40",
        "steps=2",
        "models.llm.vocab=261",
    ]


@pytest.mark.slow
def test_bad_sample_stops_with_its_id(bad_records, capsys):
    with pytest.raises(DataError, match=r"record 3 of .*mixed.array_record: sample id=3: image 0 has NaN or inf"):
        train(load_config(VLM, bad_records), progress=False)
    assert cli.main(["train", "--config", str(VLM), *bad_records]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].endswith("mixed.array_record: sample id=3: image 0 has NaN or inf values")


def test_bad_eval_samples_follow_the_eval_datas_own_policy(bad_records):
    """`eval.data.on_bad_sample: skip`: the held-out batches leave the bad records out (taking the
    next good ones, in order) and count them; under `error` (the default) the first one stops the
    run naming it, as for training data."""
    from maestro_jax.runtime.build import build_runtime
    from maestro_jax.training.evaluate import evaluation_for

    (paths,) = [o.split("=", 1)[1] for o in bad_records if o.startswith("data.paths=")]
    held_out = f"kind: array_record, paths: {paths}, shuffle: false, max_tokens: 40"
    base = TINY_VLM + ["models.llm.vocab=261", "data.max_tokens=40"]
    cfg = load_config(VLM, base + [f"eval={{batches: 2, data: {{{held_out}, on_bad_sample: skip}}}}"])
    evaluation = evaluation_for(cfg, build_runtime(cfg))
    ids = [[int(s.id) for s in batch] for batch in evaluation.samples]
    assert ids == [[0, 1, 2, 4, 5, 6, 8, 9], [10, 12, 13, 14, 16, 17, 18, 20]]
    assert len(evaluation.skipped) == 5 and "sample id=3: image 0 has NaN" in evaluation.skipped[0]
    strict = load_config(VLM, base + [f"eval={{batches: 2, data: {{{held_out}}}}}"])
    with pytest.raises(DataError, match=r"record 3 of .*mixed.array_record: sample id=3: image 0 has NaN"):
        evaluation_for(strict, build_runtime(strict))


def test_bad_samples_skipped_counted_and_reported(bad_records, capsys):
    history = train(load_config(VLM, bad_records + ["data.on_bad_sample=skip"]), progress=False)
    assert [r["sample_ids"] for r in history] == [[0, 1, 2, 4, 5, 6, 8, 9], [10, 12, 13, 14, 16, 17, 18, 20]]
    skipped = [r["skipped_samples"] for r in history]
    assert [len(s) for s in skipped] == [2, 3]
    # in the order found: metadata faults (every process, before scheduling) as samples are taken,
    # payload faults once the batch is decoded; the batch is then refilled (19 is taken then)
    assert "sample id=3: image 0 has NaN" in skipped[0][0]
    assert "sample id=7: 2 image-placeholder tokens but its image items need 1" in skipped[0][1]
    assert "record 15 of " in skipped[1][0] and "mixed.array_record: cannot be decoded" in skipped[1][0]
    assert "sample id=11: needs at least 2 text tokens" in skipped[1][1]
    assert "sample id=19: 70 tokens exceed the largest bucket (40)" in skipped[1][2]
    assert all(np.isfinite(r["train/loss"]) for r in history)
    assert "skipped 5 bad sample(s)" in capsys.readouterr().out


# -- 7. storage faults: a full, then a read-only checkpoint filesystem ----------------------------
@pytest.fixture
def small_filesystem(tmp_path):
    mount = tmp_path / "ck"
    mount.mkdir()
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)], capture_output=True, text=True
    )
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a size-limited tmpfs here: {proc.stderr.strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def _fill(mount):
    try:
        with open(mount / "filler", "wb") as f:
            while True:
                f.write(b"\0" * 4096)
                f.flush()
    except OSError:
        pass


@pytest.mark.slow
def test_full_then_read_only_checkpoint_storage(tmp_path, small_filesystem):
    ck = small_filesystem
    cfg = lambda steps: kd(tmp_path / "out", f"checkpoint_dir={ck}", "checkpoint_every=1", f"steps={steps}")
    train(cfg(2), progress=False)
    _fill(ck)
    # a disk with no space left is refused before anything compiles; one that fills during the run
    # fails the save instead (test_full_checkpoint_disk_prints_one_error_line_last)
    with pytest.raises(StorageError, match=r"checkpoint_dir .* is not writable: \[Errno 28\] No space left on device"):
        train(cfg(4), progress=False)
    manifests = {s: json.loads((ck / MANIFEST.format(step=s)).read_text()) for s in (1, 2)}
    assert all(verify_step(ck / str(s), m) is None for s, m in manifests.items()), "earlier checkpoints intact"
    (ck / "filler").unlink()

    subprocess.run(["mount", "-o", "remount,ro", str(ck)], check=True)
    proc = subprocess.run(
        cli_args(KD, TINY_KD + [f"output_dir={tmp_path / 'out'}", f"checkpoint_dir={ck}", "steps=4"]),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 4, proc.stderr[-2000:]
    assert "Read-only file system" in proc.stderr.strip().splitlines()[-1]
    subprocess.run(["mount", "-o", "remount,rw", str(ck)], check=True)

    resumed = train(cfg(4), progress=False)
    assert [r["step"] for r in resumed] == [3, 4], "a later run with space resumes from step 2"
    straight = train(kd(tmp_path / "straight", "steps=4"), progress=False)
    assert [r["train/loss"] for r in resumed] == [r["train/loss"] for r in straight[2:]]


# -- 8. corruption: a flipped bit or a truncated file is detected; the run falls back -------------
def _largest_file(step_dir):
    return max((p for p in step_dir.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


@pytest.mark.slow
def test_corrupt_checkpoints_fall_back_to_the_previous_good_one(tmp_path, capsys):
    straight = {r["step"]: r["train/loss"] for r in train(kd(tmp_path / "a", "steps=4"), progress=False)}
    out = tmp_path / "b"
    ck = out / "checkpoints"
    train(kd(out, "steps=3", "checkpoint_every=1"), progress=False)
    victim = _largest_file(ck / "3")
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x10  # one flipped bit
    victim.write_bytes(bytes(data))
    capsys.readouterr()

    resumed = train(kd(out, "steps=4", "checkpoint_every=1"), progress=False)
    said = capsys.readouterr().out
    assert "checkpoint step 3 is corrupt" in said and "fails its checksum" in said and "falling back to step 2" in said
    assert [r["step"] for r in resumed] == [3, 4]
    assert [r["train/loss"] for r in resumed] == [straight[3], straight[4]]
    assert (ck / "corrupt" / "3" / "3").is_dir(), "the bad checkpoint is kept aside, not deleted"

    for step in (4, 3):  # truncate a file in the two newest: the run goes back two checkpoints
        victim = _largest_file(ck / str(step))
        victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    again = train(kd(out, "steps=4", "checkpoint_every=1"), progress=False)
    said = capsys.readouterr().out
    assert "checkpoint step 4 is corrupt" in said and "truncated" in said and "falling back to step 3" in said
    assert "checkpoint step 3 is corrupt" in said and "falling back to step 2" in said
    assert [r["train/loss"] for r in again] == [straight[3], straight[4]]

    manifest = ck / "manifest-4.json"  # a truncated manifest: that step is not trusted either
    manifest.write_text(manifest.read_text()[:20])
    last = train(kd(out, "steps=4", "checkpoint_every=1"), progress=False)
    said = capsys.readouterr().out
    assert "checkpoint step 4 is corrupt (its manifest is unreadable" in said and "falling back to step 3" in said
    assert [r["train/loss"] for r in last] == [straight[4]]


# -- 6 and 9. a dead or stuck peer process ends the others with an error naming it, no hang ------
def _train_process(run_dir, pid, port, overrides, hold=()) -> subprocess.Popen:
    """Process `pid` of a 2-process tiny KD run (4 devices each), stdout and stderr piped;
    `hold` as `cli_args`'s."""
    process = ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(pid)]
    args = cli_args(KD, [*process, "host_devices=4", *TINY_KD, *overrides, f"output_dir={run_dir}"], hold)
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    return subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _start_two(tmp_path, overrides, hold_of=None, lines=2):
    """Two processes of 4 devices each, returned once process 0 logged `lines` steps; `hold_of`:
    `cli_args`'s `hold` per process id. stdout and stderr are piped."""
    port = free_ports(3)
    procs = [_train_process(tmp_path / "run", pid, port, overrides, (hold_of or {}).get(pid, ())) for pid in range(2)]
    metrics_file = tmp_path / "run" / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and all(p.poll() is None for p in procs):
        if metrics_file.exists() and len(metrics_file.read_text().splitlines()) >= lines:
            return procs
        time.sleep(0.1)
    for p in procs:
        p.kill()
    pytest.fail("the 2-process run did not start: " + procs[0].communicate()[1][-2000:])


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.extended
def test_a_late_process_is_waited_for_and_one_too_late_is_named(tmp_path):
    """Processes of one job start minutes apart on a cluster. Process 1 starting 60 s after
    process 0: process 0 says whom it waits for, and both train. With
    `distributed.startup_timeout_s=10` and process 1 not started: status 5 and one `error:` line
    naming it, no traceback (jax's own start-up deadline aborts the process instead)."""
    port = free_ports(3)
    early = _train_process(tmp_path / "late", 0, port, ["steps=2", "keep_checkpoints=0"])
    time.sleep(60)
    late = _train_process(tmp_path / "late", 1, port, ["steps=2", "keep_checkpoints=0"])
    (out, err), (_, late_err) = early.communicate(timeout=900), late.communicate(timeout=900)
    assert early.returncode == 0 and late.returncode == 0, (err[-2000:], late_err[-2000:])
    assert "waiting for process 1 to start" in out and "distributed.startup_timeout_s" in out, out[-2000:]
    assert len((tmp_path / "late" / "metrics.jsonl").read_text().splitlines()) == 2

    port = free_ports(3)
    alone = _train_process(tmp_path / "alone", 0, port, ["steps=2", "distributed.startup_timeout_s=10"])
    out, err = alone.communicate(timeout=300)
    assert alone.returncode == 5, err[-2000:]
    assert "Traceback" not in err and "Check failure" not in err, err[-2000:]
    assert [line for line in err.splitlines() if line.strip()] == [
        "error: process 1 did not start within 10s (distributed.startup_timeout_s); started: process 0"
    ]


def _survivor_outcome(procs, victim, sig, bound_s):
    """(status, stderr) of the process that was not signalled. `bound_s` only stops a hung test:
    the tests tell the bounded wait (its message names distributed.timeout_s) from the heartbeat
    by what the survivor says, never by the time it took, which a loaded machine stretches."""
    procs[victim].send_signal(sig)
    survivor = procs[1 - victim]
    try:
        _, err = survivor.communicate(timeout=bound_s)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    return survivor.returncode, err


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("victim", [1, 0])
def test_dead_peer_ends_the_survivor(tmp_path, victim):
    procs = _start_two(tmp_path, ["steps=100000", "distributed.timeout_s=15", "distributed.heartbeat_timeout_s=15"])
    status, err = _survivor_outcome(procs, victim, signal.SIGKILL, bound_s=180)
    assert status != 0, err[-3000:]
    named = (
        f"process {victim} did not" in err  # our bounded wait
        or f"unhealthy (stopped sending heartbeats):\n{victim}" in err  # the coordination service, on process 0
        or "leader task was preempted/died" in err
    )  # process 1 losing process 0's coordination service
    assert named, err[-3000:]


@pytest.mark.multiprocess
def test_a_peer_stopping_on_an_error_ends_the_others_at_once():
    """A process that stops on an error announces it; a peer waiting on it ends with that
    process's error, not at its 120 s timeout: only the announcement carries the error's text (the
    timeout's message says "did not publish"), so the message shows which path ended the wait."""
    port = free_ports(3)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(ROOT / "tests/peer_worker.py"), str(i), str(port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for i in range(2)
    ]
    out = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [5, 3], out
    assert "process 1 stopped on an error (DataError: sample 7: tokens out of range)" in out[0]


@pytest.mark.multiprocess
def test_a_sigterm_handler_installed_before_jax_distributed_still_runs():
    """jax.distributed.initialize's preemption notifier takes SIGTERM over at the C level; a
    Python handler installed before it (preemption caught from start-up on) would never run: the service is off."""
    port = free_ports(3)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(ROOT / "tests/signal_worker.py"), str(i), str(port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for i in range(2)
    ]
    try:
        out = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert [p.returncode for p in procs] == [0, 0], out
    assert all("HANDLED True" in o for o in out), out


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("victim", [1, 0])
def test_stuck_peer_is_named_within_the_timeout(tmp_path, victim):
    """SIGSTOP: the peer is alive but makes no progress. The step-boundary and fetch waits are
    bounded by distributed.timeout_s (10 s), well before the 120 s heartbeat would notice. A
    stopped process 0 also stops the coordination service it runs, so the survivor's calls into
    it never return: its watchdog names process 0 once a call outlasts the bound by 10 s."""
    procs = _start_two(tmp_path, ["steps=100000", "distributed.timeout_s=10", "distributed.heartbeat_timeout_s=120"])
    status, err = _survivor_outcome(procs, victim, signal.SIGSTOP, bound_s=180)
    assert status == 5, err[-3000:]
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, err[-3000:]
    bounded = (
        f"error: process {victim} did not reach step" in errors[0]
        or f"error: process {victim} did not publish" in errors[0]
    ) and "within 10s (distributed.timeout_s): it is dead or stuck" in errors[0]
    unanswered = victim == 0 and errors[0].startswith(
        "error: process 0 (it runs the coordination service) did not answer a "
    )
    assert bounded or unanswered, errors[0]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP])
def test_a_peer_lost_or_stuck_while_the_other_saves_is_named(tmp_path, sig):
    """`kill -9` or SIGSTOP of process 1 while process 0 is in the checkpoint save of step 3 (the
    tests/held_checkpoint_cli.py holds process 1 back from that save): process 0 stops with status 5 within about
    distributed.timeout_s (10 s), naming process 1. Not a storage fault (status 4, `Gloo
    AllGather failed`), and not left to the heartbeat (120 s): Orbax's waits on peers are
    coordination-service barriers bounded by the timeout."""
    procs = _start_two(
        tmp_path,
        ["steps=100000", "checkpoint_every=3", "distributed.timeout_s=10", "distributed.heartbeat_timeout_s=120"],
        hold_of={1: ["--save-delay", "300"]},
        lines=3,
    )
    time.sleep(1)  # process 0 is waiting in the save of step 3 for process 1, which sleeps in the hook
    status, err = _survivor_outcome(procs, 1, sig, bound_s=180)
    assert status == 5, err[-3000:]
    assert "error: process 1 did not reach the checkpoint save of step 3 within 10s (distributed.timeout_s)" in err, (
        err[-3000:]
    )


@pytest.mark.slow
@pytest.mark.multiprocess
def test_process_0_stopped_while_its_peer_saves_is_named(tmp_path):
    """SIGSTOP of process 0 (it runs the coordination service) while process 1 waits in the
    checkpoint save of step 3 (tests/held_checkpoint_cli.py holds process 0 back from it): Orbax's
    barrier there gets no answer, and its own deadline does not fire; process 1 ends with status 5
    and one line naming process 0 (distributed.timeout_s + 10 s), not jax's heartbeat abort (134)."""
    procs = _start_two(
        tmp_path,
        ["steps=100000", "checkpoint_every=3", "distributed.timeout_s=10", "distributed.heartbeat_timeout_s=120"],
        hold_of={0: ["--save-delay", "300"]},
        lines=3,
    )
    time.sleep(1)  # process 1 is waiting in the save of step 3 for process 0, which sleeps in the hook
    status, err = _survivor_outcome(procs, 0, signal.SIGSTOP, bound_s=180)
    assert status == 5, err[-3000:]
    assert "error: process 0 (it runs the coordination service) did not answer a wait_at_barrier call" in err, err[
        -3000:
    ]


def test_save_failures_are_classified_peer_or_storage(monkeypatch):
    """In a multi-process run a save that failed at a peer barrier is a PeerError naming the
    processes that did not arrive; storage errors (cloud storage's UNAVAILABLE or connection
    resets included) stay storage faults."""
    from maestro_jax.runtime import distributed

    coordinator = distributed.Coordinator()  # made with one process: no coordination service to ask
    monkeypatch.setattr(distributed.jax, "process_count", lambda: 2)
    monkeypatch.setattr(distributed.jax, "process_index", lambda: 0)
    monkeypatch.setattr(distributed, "_failed_peer", lambda: None)
    barrier = RuntimeError(
        "DEADLINE_EXCEEDED: Barrier timed out. Id: _async_write_complete.4::0. This usually "
        "happens because ...\n# of tasks that reached the barrier: 1/2.\nThe first task at the "
        "barrier: 0. Some timed out task names:\n1\nRPC: /xla.coordination.CoordinationService/Barrier"
    )
    try:
        raise TimeoutError("Timed out while waiting for async_write_complete barrier.") from barrier
    except TimeoutError as err:
        peer = coordinator.peer_fault(err, "the checkpoint save of step 4")
    assert isinstance(peer, distributed.PeerError)
    assert str(peer).startswith("process 1 did not reach the checkpoint save of step 4 within")
    assert "Id: _async_write_complete.4::0]" in str(peer)
    for storage in (OSError(28, "No space left on device"), RuntimeError("UNAVAILABLE: Connection reset by peer")):
        assert coordinator.peer_fault(storage, "the checkpoint save of step 4") is None


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("victim", [1])
def test_sigterm_to_one_process_checkpoints_every_process(tmp_path, victim):
    """A preemption notice on one host (the common case): every process checkpoints the same
    step and exits 0 (the flags travel in the step check-in); each says so only once the
    checkpoint is committed."""
    procs = _start_two(tmp_path, ["steps=100000", "distributed.timeout_s=30"])
    try:
        procs[victim].send_signal(signal.SIGTERM)
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
    said = re.search(r"SIGTERM: checkpoint saved at step (\d+); stopping", outs[victim][0])
    assert said, outs[victim]
    step = int(said.group(1))
    assert f"preemption notice on process {victim}: checkpoint saved at step {step}; stopping" in outs[1 - victim][0]
    assert (tmp_path / "run" / "checkpoints" / MANIFEST.format(step=step)).exists()
    assert [r["step"] for r in metrics(tmp_path / "run")] == list(range(1, step + 1))


@pytest.mark.slow
def test_sigterm_says_saved_only_once_committed(tmp_path):
    """ "checkpoint saved at step N" is printed only once Orbax committed step N, with its
    manifest (tests/held_checkpoint_cli.py holds the commit back 5 s after the files are written)."""
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        cli_args(KD, TINY_KD + [f"output_dir={out}", "steps=100000"], hold=["--commit-delay", "5"]),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        deadline = time.time() + 300
        while (
            proc.poll() is None
            and time.time() < deadline
            and not ((out / "metrics.jsonl").exists() and len(metrics(out)) >= 2)
        ):
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        committed = None
        for line in proc.stdout:
            if said := re.search(r"checkpoint saved at step (\d+)", line):
                ck, saved = out / "checkpoints", int(said.group(1))
                committed = (ck / MANIFEST.format(step=saved)).exists() and (ck / str(saved)).is_dir()
                break
        assert proc.wait(timeout=120) == 0
    finally:
        proc.kill()
        proc.wait()
    assert committed is not None, "the run said nothing of a checkpoint"
    assert committed, "said saved before the checkpoint was committed"


@pytest.mark.slow
def test_all_bad_samples_stop_instead_of_looping(tmp_path):
    """Under `skip`, data where no sample passes its checks ends with a DataError after one
    pass (not an endless loop); damaged or empty ArrayRecord files are DataErrors naming them."""
    from array_record.python.array_record_module import ArrayRecordWriter

    from maestro_jax.data import ArrayRecordSource

    path = tmp_path / "bad.array_record"
    writer = ArrayRecordWriter(str(path), "group_size:1")
    for i in range(8):  # no more than global_batch: a larger batch than the data is refused as a config error
        tokens = np.array([5, 400 + i, 6], np.int32)  # ids beyond the vocabulary: every sample bad
        writer.write(encode_sample(Sample(id=i, tokens=tokens)))
    writer.close()
    overrides = TINY_VLM + ["data.kind=array_record", f"data.paths=[{path}]", "steps=1", "data.on_bad_sample=skip"]
    with pytest.raises(DataError, match=r"bad samples in a row, more than the 8 the source holds"):
        train(load_config(VLM, overrides), progress=False)
    empty = tmp_path / "empty.array_record"
    empty.write_bytes(b"")
    with pytest.raises(DataError, match=r"data.paths: .*empty.array_record is empty"):
        ArrayRecordSource((str(empty),))
    damaged = tmp_path / "damaged.array_record"
    damaged.write_bytes(path.read_bytes()[:40] + b"\xff" * 64)
    with pytest.raises(DataError, match=r"damaged.array_record"):
        source = ArrayRecordSource((str(damaged),))
        [source[i] for i in range(len(source))]


# -- 10. storage of output_dir and checkpoint_dir: one line, the storage status, no hang ----------
def _private_tmpfs(mount, size, state, args, when=None, then="full"):
    """`args` run in a private mount namespace (`unshare`: as root or not) where `mount` is a
    tmpfs of `size`: `state` "ro" (read-only), "full" (filled first) or "rw"; with `when` (a
    path), the tmpfs is made `then` ("full": no byte left, "inodes": no inode left, "ro") as soon
    as that file exists (a remount read-only fails while the run has files open there). Returns the
    completed process; the mount ends with the namespace. The runs these tests guard against hung
    on Orbax's 300 s signal wait or forever (a dead TensorBoard writer): finishing at all within
    the timeout, under that wait, is the check, however loaded the machine."""
    if subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode != 0:
        pytest.skip("no private mount namespace here (unshare -rm): cannot mount a small or read-only tmpfs")
    mount.mkdir(parents=True, exist_ok=True)
    fill = f'head -c 1G /dev/zero > "{mount}/filler" 2>/dev/null'
    ro = f'mount -o remount,ro "{mount}"'
    inodes = f'i=0; while touch "{mount}/inode$i" 2>/dev/null; do i=$((i+1)); done'
    script = {"ro": f'{ro} && exec "$@"', "full": f'{fill}; exec "$@"', "rw": 'exec "$@"'}
    if when:
        script["rw"] = (
            f'"$@" & pid=$!; while kill -0 $pid 2>/dev/null && [ ! -e "{when}" ]; do sleep 0.02; done; '
            f"{ {'full': fill, 'ro': ro, 'inodes': inodes}[then] }; wait $pid"
        )
    cmd = [
        "unshare",
        "-rm",
        "sh",
        "-c",
        f'mount -t tmpfs -o size={size} tmpfs "{mount}" || exit 99; {script[state]}',
        "sh",
        *args,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280)
    assert proc.returncode != 99, proc.stderr
    return proc


# tensorstore's write callbacks, reaching the event loop of a save that already failed, print
# these tracebacks from native threads, interleaved (not through logging or sys.excepthook);
# no other traceback may appear
LATE_WRITE_CALLBACK = (
    "Traceback (most recent call last):",
    'asyncio/base_events.py", line',
    "self._check_closed()",
    "raise RuntimeError('Event loop is closed')",
    "RuntimeError: Event loop is closed",
)


def _one_error_line_last(stderr):
    lines = [line for line in stderr.replace("\r", "\n").splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1 and lines[-1] == errors[0], stderr[-3000:]
    rest = [line for line in lines if not any(noise in line for noise in LATE_WRITE_CALLBACK)]
    assert not any("Traceback" in line or 'File "' in line for line in rest), stderr[-3000:]
    return errors[0]


@pytest.mark.slow
def test_read_only_checkpoint_dir_exits_at_once_with_one_line(tmp_path):
    """A read-only checkpoint_dir: status 4 and one line, before anything is trained (it used to
    print its error, then wait 300 s for Orbax's save threads)."""
    ck = tmp_path / "ck"
    proc = _private_tmpfs(
        ck, "4m", "ro", cli_args(KD, TINY_KD + [f"output_dir={tmp_path / 'out'}", f"checkpoint_dir={ck}", "steps=2"])
    )
    assert proc.returncode == 4, proc.stderr[-3000:]
    err = _one_error_line_last(proc.stderr)
    assert f"checkpoint_dir {ck} is not writable: [Errno 30] Read-only file system" in err, err
    assert not (tmp_path / "out" / "metrics.jsonl").exists(), "nothing was trained"


@pytest.mark.slow
@pytest.mark.extended
def test_checkpoint_step_directory_not_created_exits_at_once(tmp_path):
    """The checkpoint filesystem runs out of inodes after the first save, so the next save cannot
    create its step directory (as on a read-only disk): one line, status 4, within seconds
    (Orbax's other save threads used to wait 300 s for that directory's signal)."""
    ck = tmp_path / "ck"
    args = cli_args(
        KD, TINY_KD + [f"output_dir={tmp_path / 'out'}", f"checkpoint_dir={ck}", "steps=1000", "checkpoint_every=100"]
    )
    proc = _private_tmpfs(ck, "4m,nr_inodes=2000", "rw", args, when=ck / MANIFEST.format(step=100), then="inodes")
    assert proc.returncode == 4, proc.stderr[-3000:]
    err = _one_error_line_last(proc.stderr)
    # the first save after the inodes ran out fails (200, or later when the filler was slower)
    failed = re.search(r"checkpoint save of step (\d+) ", err)
    step = int(failed.group(1)) if failed else None
    assert step and step >= 200 and "No space left on device" in err, err
    assert f"{step}.orbax-checkpoint-tmp" in err, err
    assert f"the last complete checkpoint (step {step - 100}) is intact" in err, err


@pytest.mark.parametrize("state", ["ro", "full"])
def test_read_only_or_full_output_dir_exits_4_with_one_line(tmp_path, state):
    out = tmp_path / "out"
    proc = _private_tmpfs(out, "256k", state, cli_args(KD, TINY_KD + [f"output_dir={out}", "steps=2"]))
    assert proc.returncode == 4, proc.stderr[-3000:]
    err = _one_error_line_last(proc.stderr)
    reason = "[Errno 30] Read-only file system" if state == "ro" else "[Errno 28] No space left on device"
    assert f"output_dir {out} is not writable: {reason}" in err, err


@pytest.mark.slow
def test_output_dir_filling_up_mid_run_exits_4_with_one_line(tmp_path):
    """The disk of output_dir fills while the run writes metrics: one line naming the file, status
    4, within seconds (TensorBoard's writer thread died of it and the run hung on its queue)."""
    out = tmp_path / "out"
    args = cli_args(KD, TINY_KD + [f"output_dir={out / 'run'}", "steps=100000", "keep_checkpoints=0"])
    proc = _private_tmpfs(out, "1m", "rw", args, when=out / "run" / "metrics.jsonl")
    assert proc.returncode == 4, proc.stderr[-3000:]
    err = _one_error_line_last(proc.stderr)
    assert "No space left on device" in err and str(out / "run") in err, err


@pytest.mark.slow
def test_full_checkpoint_disk_prints_one_error_line_last(tmp_path):
    """The checkpoint disk fills after the first save: status 4, and the `error:` line is the
    last thing on stderr, not buried under Orbax's thread tracebacks."""
    ck = tmp_path / "ck"
    args = cli_args(
        KD, TINY_KD + [f"output_dir={tmp_path / 'out'}", f"checkpoint_dir={ck}", "steps=6", "checkpoint_every=1"]
    )
    proc = _private_tmpfs(ck, "4m", "rw", args, when=ck / MANIFEST.format(step=1))
    assert proc.returncode == 4, proc.stderr[-3000:]
    err = _one_error_line_last(proc.stderr)
    assert "No space left on device" in err and "the last complete checkpoint (step" in err, err


@pytest.mark.parametrize("inside", ["", "sub"])
def test_output_dir_that_is_a_file_exits_2_before_compiling(tmp_path, inside, capsys):
    from test_plan import COUNTER

    taken = tmp_path / "taken"
    taken.write_text("a file, not a directory")
    out = taken / inside if inside else taken
    before = COUNTER.count
    status = cli.main(["train", "--config", str(KD), *TINY_KD, f"output_dir={out}", "steps=2"])
    err = capsys.readouterr().err.strip()
    assert status == 2 and err.startswith("error: ") and "\n" not in err, err
    assert f"output_dir={str(out)!r}" in err and "is a file, not a directory" in err, err
    assert COUNTER.count == before, "refused before any compilation"


@pytest.mark.parametrize("tracker, folder", [("tensorboard", "tb"), ("wandb", "wandb")])
def test_a_trackers_folder_that_cannot_be_one_exits_2_before_compiling(tmp_path, tracker, folder, capsys):
    """A file where a tracker writes its folder (`<output_dir>/tb`, `<output_dir>/wandb`): one line
    naming the tracker and the path, status 2, nothing compiled (W&B's used to be a
    NotADirectoryError traceback after 16 compiles, no step trained)."""
    from test_plan import COUNTER

    out = tmp_path / "out"
    out.mkdir()
    (out / folder).write_text("a file, not a directory")
    before = COUNTER.count
    status = cli.main(["train", "--config", str(KD), *TINY_KD, f"output_dir={out}", f"trackers=[jsonl,{tracker}]"])
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1, err
    assert err.startswith(f"error: trackers[{tracker}]={str(out / folder)!r}: is a file, not a directory"), err
    assert COUNTER.count == before, "refused before any compilation"


def test_a_users_tracker_refuses_in_its_check_before_compiling(tmp_path):
    """A tracker of the user's own (`train(..., trackers=[...])`) with a `check()`: called before
    anything compiles, and its ConfigError ends the run there, nothing written to it."""
    from maestro_jax.config import ConfigError

    class Unreachable:
        def __init__(self):
            self.records = []

        def check(self):
            raise ConfigError("error: my_tracker.url='http://nowhere': unreachable")

        def write(self, record):
            self.records.append(record)

        def flush(self): ...

        def close(self): ...

    tracker = Unreachable()
    cfg = load_config(KD, [*TINY_KD, f"output_dir={tmp_path / 'out'}", "steps=1"])
    with compiles() as compiled, pytest.raises(ConfigError, match=r"my_tracker\.url"):
        train(cfg, progress=False, trackers=[tracker])
    assert compiled == [] and tracker.records == []


def test_a_missing_eval_data_file_is_named_by_its_key_before_compiling(tmp_path, capsys):
    """`eval.data.paths` naming a file that is not there: one line naming `eval.data.paths` (the key
    the user wrote; it used to say `data.paths`, after 6 compiles), status 2, nothing compiled."""
    from test_plan import COUNTER

    missing = tmp_path / "eval" / "val.array_record"
    held_out = f"eval={{data: {{kind: array_record, paths: [{missing}]}}}}"
    before = COUNTER.count
    status = cli.main(["train", "--config", str(KD), *TINY_KD, f"output_dir={tmp_path / 'out'}", held_out])
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1, err
    assert err.startswith(f"error: eval.data.paths: {missing} is missing"), err
    assert COUNTER.count == before, "refused before any compilation"


# -- 11. signals during start-up -------------------------------------------------------------------
def _start_and_signal_in_startup(out, sig, steps, ignore_sigint=False):
    """Start a run on `out` and send `sig` as soon as it holds the run lock (start-up: compiling,
    restoring); `ignore_sigint` starts it as a non-interactive shell starts a background job."""
    args = cli_args(KD, TINY_KD + [f"output_dir={out}", f"steps={steps}", "checkpoint_every=1"])
    pre = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if ignore_sigint else None
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=pre)
    lock, deadline = out / "run.lock", time.time() + 120
    while proc.poll() is None and time.time() < deadline:
        if lock.exists() and f'"pid": {proc.pid}' in lock.read_text():
            break
        time.sleep(0.005)
    proc.send_signal(sig)
    try:
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    return proc.returncode, stdout, stderr


@pytest.mark.slow
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_signal_during_startup_and_restore(tmp_path, sig):
    """SIGTERM while a run starts up and restores: exit 0 with a line saying nothing new was saved
    (it used to die of the signal, 143). SIGINT, even where inherited as ignored: stop, status
    130, one error line. Either way the committed checkpoint and the metrics stay as they were."""
    out = tmp_path / "run"
    train(kd(out, "steps=2", "checkpoint_every=1"), progress=False)
    ck = out / "checkpoints"
    before = sorted(p.name for p in ck.iterdir())
    status, stdout, stderr = _start_and_signal_in_startup(
        out, getattr(signal, sig), steps=50, ignore_sigint=sig == "SIGINT"
    )
    if sig == "SIGTERM":
        assert status == 0, stderr[-3000:]
        assert "SIGTERM during start-up: stopping before the first step; nothing new to save" in stdout, stdout
        assert f"step 2 in {ck}, is intact" in stdout, stdout
        assert "error:" not in stderr, stderr[-3000:]
    else:
        assert status == 130, (status, stderr[-3000:])
        assert _one_error_line_last(stderr).startswith("error: interrupted (SIGINT)")
    assert sorted(p.name for p in ck.iterdir()) == before, "the committed checkpoints are untouched"
    assert [r["step"] for r in metrics(out)] == [1, 2]


@pytest.mark.slow
def test_a_sigint_swallowed_inside_a_gc_callback_still_stops_the_run(tmp_path):
    """Python swallows an exception raised inside a garbage-collection callback ("Exception
    ignored in: gc callback"): a SIGINT whose KeyboardInterrupt is raised there used to be lost,
    and the run trained on to its end. The CLI's handler remembers it; the loop stops at the
    next step boundary."""
    import gc

    from maestro_jax.training.preemption import Interrupt

    swallowed = []

    def interrupt_inside_gc(phase, info):
        if phase == "start" and not swallowed:
            swallowed.append(True)
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)  # the handler runs here, inside the callback

    class InterruptAtStep1:
        def write(self, record):
            if record["step"] == 1:
                gc.callbacks.append(interrupt_inside_gc)
                try:
                    gc.collect()
                finally:
                    gc.callbacks.remove(interrupt_inside_gc)

        def flush(self):
            pass

        def close(self):
            pass

    previous = signal.getsignal(signal.SIGINT)
    try:
        Interrupt().install()
        with pytest.raises(KeyboardInterrupt):
            train(kd(tmp_path / "run", "steps=6", "keep_checkpoints=0"), progress=False, trackers=[InterruptAtStep1()])
    finally:
        signal.signal(signal.SIGINT, previous)
    assert swallowed, "the SIGINT was sent inside the gc callback"
    assert len(metrics(tmp_path / "run")) < 6, "stopped at a step boundary, not at the end"


# -- 12. config escapes: impossible sizes refused before compiling ---------------------------------
@pytest.mark.parametrize(
    "overrides,text",
    [
        (
            [
                "models.student.width=16384",
                "models.student.mlp=65536",
                "models.student.depth=48",
                "models.student.heads=128",
                "models.student.head_dim=128",
                "models.student.kv_heads=8",
            ],
            "sections.student='",
        ),
        (["global_batch=65536"], "global_batch=65536: larger than the 512 samples of data.num_samples"),
    ],
)
def test_impossible_sizes_exit_2_before_compiling(overrides, text, capsys):
    """A model far too large for this machine with no device_memory_gb (it used to fail in XLA's
    allocator after 15 compilations), and a global batch larger than the data (no output for
    minutes): one line, status 2, nothing compiled."""
    from test_plan import COUNTER

    before = COUNTER.count
    status = cli.main(["train", "--config", str(KD), *TINY_KD, "data.num_samples=512", *overrides])
    err = capsys.readouterr().err.strip()
    assert status == 2 and err.startswith("error: ") and "\n" not in err, err
    assert text in err, err
    if "width=16384" in overrides[0]:
        assert "more than its memory" in err or "exceed the device's memory" in err, err
    assert COUNTER.count == before, "rejected before any compilation"
