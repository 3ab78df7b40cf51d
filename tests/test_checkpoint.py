"""Exact resume (bit-identical losses and data order) and restore onto a different plan."""

import json
import re
import shutil

import jax
import numpy as np
import pytest
from conftest import ROOT, TINY_KD, TINY_VLM

from maestro_jax.config import load_config
from maestro_jax.runtime.build import build_runtime
from maestro_jax.runtime.step import TrainState
from maestro_jax.training.checkpoint import Checkpointer
from maestro_jax.training.loop import train
from maestro_jax.workloads import source_from_config


def read_metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


BF16 = ["sections.vision.precision=bfloat16", "sections.llm.precision=bfloat16", "optimizer.learning_rate=0.01"]


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_resume_is_exact(tmp_path, precision):
    """Stopping after step 2 and resuming gives the uninterrupted run's losses bit for bit, in
    float32 and in bf16 (float32 master weights and Adam state saved, bf16 compute), on
    vlm_tiny's mix of text, images and video clips."""
    base = TINY_VLM + ["checkpoint_every=2", "schedule.scheduler=wavefront"] + (BF16 if precision == "bfloat16" else [])
    cfg = lambda out, steps: load_config(ROOT / "configs/vlm_tiny.yaml", base + [f"output_dir={out}", f"steps={steps}"])
    straight = train(cfg(tmp_path / "a", 4), progress=False)
    first = train(cfg(tmp_path / "b", 2), progress=False)
    assert [r["step"] for r in first] == [1, 2]
    resumed = train(cfg(tmp_path / "b", 4), progress=False)
    assert [r["step"] for r in resumed] == [3, 4], "the second run resumes after the last checkpoint"
    ref = {r["step"]: r for r in straight}
    for r in first + resumed:
        assert r["train/loss"] == ref[r["step"]]["train/loss"], (
            f"step {r['step']}: {r['train/loss']!r} != {ref[r['step']]['train/loss']!r}"
        )
        assert r["sample_ids"] == ref[r["step"]]["sample_ids"], "data order must continue exactly"
    assert [r["step"] for r in read_metrics(tmp_path / "b")] == [1, 2, 3, 4]
    source = source_from_config(cfg(tmp_path / "a", 4))
    seen = [source[i] for r in straight for i in r["sample_ids"]]
    assert any(s.has("video") for s in seen) and any(s.has("image") for s in seen), "the mix holds clips and images"
    if precision == "bfloat16":
        assert straight[-1]["train/loss"] < straight[0]["train/loss"] - 0.05, [r["train/loss"] for r in straight]
    ck = tmp_path / "b" / "checkpoints"
    assert sorted(p.name for p in ck.glob("manifest-*.json")) == ["manifest-2.json", "manifest-4.json"]
    assert list((tmp_path / "b" / "tb").glob("events.*")), "TensorBoard events are written"


@pytest.mark.slow
def test_restore_onto_a_different_plan(tmp_path):
    out = tmp_path / "run"
    cfg = load_config(ROOT / "configs/kd_tiny.yaml", TINY_KD + [f"output_dir={out}", "steps=1"])
    train(cfg, progress=False)
    rt_a = build_runtime(cfg)
    ck = Checkpointer(out / "checkpoints")
    saved, _, meta = ck.restore(1, rt_a.init_states())
    assert meta["step"] == 1
    other = load_config(
        ROOT / "configs/kd_tiny.yaml",
        TINY_KD
        + [
            "sections.teacher.devices=4:8",
            "sections.student.devices=0:4",
            "sections.student.mesh={data: 2, tensor: 2}",
            "edges.teacher_hidden.fanout=1",
        ],
    )
    rt_b = build_runtime(other)
    moved, data_state, _ = ck.restore(1, rt_b.init_states())
    ck.close()
    for a, b in zip(jax.tree.leaves(saved["student"].params), jax.tree.leaves(moved["student"].params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    leaf = jax.tree.leaves(moved["student"].params)[0]
    assert {d.id for d in leaf.sharding.device_set} == {0, 1, 2, 3}, "restored onto the new plan's devices"
    assert data_state["next_index"] == cfg.global_batch, "the data stream resumes after the first batch"
    # and training continues on the new plan
    _, metrics = rt_b.step(TrainState(1, moved), rt_b.batches()[1])
    assert np.isfinite(rt_b.step.read(metrics)["train/loss"])


@pytest.mark.slow
def test_uncommitted_save_is_ignored(tmp_path):
    """What an interrupted save leaves (Orbax's temporary directory, a manifest whose step was
    never renamed into place) is never 'the latest' and is removed when the directory is opened;
    a committed step whose manifest is gone is not trusted: restoring falls back past it."""
    out = tmp_path / "run"
    cfg = load_config(ROOT / "configs/kd_tiny.yaml", TINY_KD + [f"output_dir={out}", "steps=2", "checkpoint_every=1"])
    train(cfg, progress=False)
    ck_dir = out / "checkpoints"
    shutil.copytree(ck_dir / "2", ck_dir / "3.orbax-checkpoint-tmp-1234")
    shutil.copy(ck_dir / "manifest-2.json", ck_dir / "manifest-3.json")
    ck = Checkpointer(ck_dir)
    assert ck.latest_step() == 2
    assert sorted(p.name for p in ck_dir.iterdir() if p.name[0].isdigit() or p.name.startswith("manifest")) == [
        "1",
        "2",
        "manifest-1.json",
        "manifest-2.json",
    ], "the interrupted save's leftovers are removed"
    (ck_dir / "manifest-2.json").unlink()
    step, *_ = ck.restore_latest(build_runtime(cfg).init_states())
    ck.close()
    assert step == 1
    assert (ck_dir / "corrupt" / "2" / "2").is_dir(), "the untrusted step is kept aside"


@pytest.mark.slow
def test_sigterm_checkpoints_and_exits_cleanly(tmp_path):
    """A real SIGTERM mid-run: checkpoint at the next step boundary, exit 0, resume from it."""
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "run"
    args = [
        sys.executable,
        "-m",
        "maestro_jax.cli",
        "train",
        "--config",
        str(ROOT / "configs/kd_tiny.yaml"),
        *TINY_KD,
        f"output_dir={out}",
        "steps=200",
    ]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = out / "metrics.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=240)
    assert proc.returncode == 0, stderr[-2000:]
    steps = [r["step"] for r in read_metrics(out)]
    last = steps[-1]
    assert 2 <= last < 200
    ck = Checkpointer(out / "checkpoints")
    assert ck.latest_step() == last, "the checkpoint is taken at the step boundary after the signal"
    ck.close()
    assert "SIGTERM" in stderr + stdout
    resumed = train(
        load_config(ROOT / "configs/kd_tiny.yaml", TINY_KD + [f"output_dir={out}", f"steps={last + 1}"]), progress=False
    )
    assert [r["step"] for r in resumed] == [last + 1], "the restart resumes from the SIGTERM checkpoint"


@pytest.mark.slow
@pytest.mark.parametrize(
    "change,named",
    [
        (
            "models.student.mlp=128",
            "['params']['block_0']['down']['kernel'] is [64, 32] float32 in the checkpoint, "
            "[128, 32] float32 in this config",
        ),
        ("optimizer.name=sgd", "exists only in the checkpoint"),
    ],
)
def test_a_checkpoint_of_another_config_is_refused_not_quarantined(tmp_path, change, named):
    """Resuming with a changed model or optimizer: a ConfigError (status 2 in the CLI) naming the
    first leaf that differs; the intact checkpoint stays where it is and still resumes."""
    from maestro_jax.training.checkpoint import CheckpointMismatchError

    out = tmp_path / "run"
    cfg = lambda *more, steps=2: load_config(
        ROOT / "configs/kd_tiny.yaml", TINY_KD + [f"output_dir={out}", f"steps={steps}", *more]
    )
    train(cfg(), progress=False)
    with pytest.raises(CheckpointMismatchError, match=r"checkpoint step 2 .* does not match this config") as err:
        train(cfg(change, steps=3), progress=False)
    assert named in str(err.value) and str(err.value).startswith("error: ")
    assert (out / "checkpoints" / "manifest-2.json").is_file() and not (out / "checkpoints" / "corrupt").exists()
    assert load_config(out / "config.yaml") == cfg(), "the run's config record is not overwritten by the refused one"
    assert [r["step"] for r in train(cfg(steps=3), progress=False)] == [3]


@pytest.mark.slow
def test_nothing_to_do_names_the_step_the_directory_holds(tmp_path, capsys):
    """steps=2 on a directory checkpointed at step 4: nothing is trained and the message says step 4."""
    from maestro_jax import cli

    out = tmp_path / "run"
    overrides = ["--config", str(ROOT / "configs/kd_tiny.yaml"), *TINY_KD, f"output_dir={out}"]
    train(load_config(ROOT / "configs/kd_tiny.yaml", TINY_KD + [f"output_dir={out}", "steps=4"]), progress=False)
    capsys.readouterr()
    assert cli.main(["train", *overrides, "steps=2"]) == 0
    said = capsys.readouterr().out
    assert f"nothing to do: {out} holds a checkpoint at step 4, at or beyond steps=2" in said, said
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3, 4], "the log of the 4 steps is kept"


@pytest.mark.slow
def test_export_holds_the_run_lock_and_reads_only(tmp_path, capsys):
    """`export` reads checkpoints under the run lock: refused (status 2, one line) while a run
    holds the directory, so a live run cannot rotate checkpoints under it; otherwise it opens
    the checkpoints read-only and leaves an unfinished save's leftovers for the run to clean."""
    from maestro_jax import cli
    from maestro_jax.training.dirlock import hold_directories

    out = tmp_path / "run"
    overrides = [*TINY_KD, f"output_dir={out}"]
    train(load_config(ROOT / "configs/kd_tiny.yaml", overrides + ["steps=1"]), progress=False)
    export = [
        "export",
        "--config",
        str(ROOT / "configs/kd_tiny.yaml"),
        "--section",
        "student",
        "--out",
        str(tmp_path / "hf"),
        *overrides,
    ]
    capsys.readouterr()
    with hold_directories({"output_dir": out}):  # a run holding it (flock is per open file: this process counts)
        status = cli.main(export)
    err = capsys.readouterr().err.strip()
    assert status == 2 and err.startswith("error: output_dir") and "is in use by another run" in err, err
    assert not (tmp_path / "hf").exists()
    leftover = out / "checkpoints" / "2.orbax-checkpoint-tmp"
    leftover.mkdir()
    assert cli.main(export) == 0, capsys.readouterr().err[-2000:]
    assert "at step 1" in capsys.readouterr().out
    assert leftover.is_dir(), "a reader does not clean up"


@pytest.mark.slow
def test_a_section_starts_from_another_runs_checkpoint(tmp_path):
    """`sections.<s>.init.checkpoint_dir`: a fresh run's section starts with the params of the other
    run's newest committed step (its optimizer afresh: the first update moves them from there);
    a directory without a checkpoint, a section that does not fit, and two sources are refused."""
    from maestro_jax.config import ConfigError
    from maestro_jax.training.checkpoint import start_from_checkpoints

    kd = ROOT / "configs/kd_tiny.yaml"
    first = load_config(kd, TINY_KD + [f"output_dir={tmp_path / 'a'}", "steps=1"])
    train(first, progress=False)
    rt = build_runtime(first)
    saved, _, _ = Checkpointer(tmp_path / "a/checkpoints", read_only=True).restore(1, rt.init_states())
    start = [f"sections.student.init={{checkpoint_dir: {tmp_path / 'a/checkpoints'}}}"]
    second = load_config(kd, TINY_KD + start)
    states = start_from_checkpoints(second, rt.init_states(), rt.programs)
    for a, b in zip(jax.tree.leaves(states["student"].params), jax.tree.leaves(saved["student"].params)):
        np.testing.assert_array_equal(a, b)
    fresh = rt.init_states()["student"].opt_state
    for a, b in zip(jax.tree.leaves(states["student"].opt_state), jax.tree.leaves(fresh)):
        np.testing.assert_array_equal(a, b)  # a fresh optimizer, not the other run's moments
    # the loop applies it on a fresh start: step 1 of the second run is not step 1 of the first
    history = train(load_config(kd, TINY_KD + start + ["steps=1"]), progress=False)
    assert history[0]["train/loss"] != read_metrics(tmp_path / "a")[0]["train/loss"]

    (tmp_path / "empty").mkdir()
    key = "error: sections.student.init.checkpoint_dir="
    for overrides, message in [
        ([f"sections.student.init={{checkpoint_dir: {tmp_path / 'empty'}}}"], "holds no committed checkpoint"),
        (start + ["models.student.mlp=96"], "does not fit models.student (section 'student': ['params']"),
    ]:
        cfg = load_config(kd, TINY_KD + overrides)
        with pytest.raises(ConfigError, match=re.escape(key) + ".*" + re.escape(message)):
            start_from_checkpoints(cfg, build_runtime(cfg).init_states(), rt.programs)
    both = f"sections.student.init={{checkpoint_dir: {tmp_path}, hf_path: {tmp_path}}}"
    with pytest.raises(ConfigError, match=r"^error: sections.student.init=.*give exactly one of hf_path"):
        load_config(kd, TINY_KD + [both])


@pytest.mark.slow
def test_a_resume_applies_and_names_the_changed_optimizer_settings(tmp_path, capsys):
    """Resuming with another learning rate and weight decay: one line names every change (old ->
    new), config_history.jsonl records it, and both apply: step 3 runs at the new rate, and
    step 4's loss differs from a resume that changed the rate alone (the decay moved the
    weights in update 3; the checkpoint's optimizer state holds no constant to override it)."""
    from maestro_jax.training.loop import train

    kd = ROOT / "configs/kd_tiny.yaml"
    run = tmp_path / "run"
    train(load_config(kd, TINY_KD + [f"output_dir={run}", "steps=2", "optimizer.learning_rate=0.01"]), progress=False)
    shutil.copytree(run, tmp_path / "rate_only")
    capsys.readouterr()
    both = train(
        load_config(
            kd,
            TINY_KD + [f"output_dir={run}", "steps=4", "optimizer.learning_rate=0.03", "optimizer.weight_decay=0.2"],
        ),
        progress=False,
    )
    (line,) = [x for x in capsys.readouterr().out.splitlines() if x.startswith("changed since")]
    assert line == (
        "changed since the run that saved it (applied from this config): optimizer.learning_rate 0.01 -> 0.03, "
        "optimizer.weight_decay 0.0 -> 0.2, steps 2 -> 4"
    ), line
    (recorded,) = [json.loads(x) for x in (run / "config_history.jsonl").read_text().splitlines()]
    assert recorded == {
        "step": 2,
        "changes": {"optimizer.learning_rate": [0.01, 0.03], "optimizer.weight_decay": [0.0, 0.2], "steps": [2, 4]},
    }
    rate_only = train(
        load_config(kd, TINY_KD + [f"output_dir={tmp_path / 'rate_only'}", "steps=4", "optimizer.learning_rate=0.03"]),
        progress=False,
    )
    assert [h["step"] for h in both] == [h["step"] for h in rate_only] == [3, 4]
    assert both[0]["train/lr/student"] == rate_only[0]["train/lr/student"] == pytest.approx(0.03)
    assert both[0]["train/loss"] == rate_only[0]["train/loss"], "step 3 starts from the same weights"
    assert both[1]["train/loss"] != rate_only[1]["train/loss"], "the new weight decay moved the weights in update 3"
