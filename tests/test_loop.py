"""training/loop.py: the host reads each step's results only after issuing the next step, except
where the next action needs them, and this changes no number."""

import json

import numpy as np
import pytest
from conftest import ROOT, TINY_KD

from maestro_jax.config import load_config
from maestro_jax.runtime.build import build_runtime
from maestro_jax.runtime.step import NonFiniteError, StepBatch
from maestro_jax.training.loop import train


def spied_runtime(cfg, events, monkeypatch):
    """The config's real runtime, with its step dispatch and the loop's result reads logged in order."""
    rt = build_runtime(cfg)
    run, fetch, fetch_all = rt.executor.run, rt.coordinator.fetch, rt.coordinator.fetch_all
    issued = iter(range(1, 1000))

    def logged_run(*args, **kw):  # a real step (compiling walks the step's abstract twin, its own executor)
        events.append(("issue", next(issued)))
        return run(*args, **kw)

    def logged_fetch(x):
        events.append(("read", None))
        return fetch(x)

    def logged_fetch_all(tree):  # a step's metrics: one read of the lot
        events.append(("read", None))
        return fetch_all(tree)

    monkeypatch.setattr(rt.executor, "run", logged_run)
    monkeypatch.setattr(rt.coordinator, "fetch", logged_fetch)
    monkeypatch.setattr(rt.coordinator, "fetch_all", logged_fetch_all)
    return rt


@pytest.mark.slow
def test_each_step_is_read_after_the_next_is_issued(tmp_path, monkeypatch):
    cfg = load_config(
        ROOT / "configs/kd_tiny.yaml", TINY_KD + ["steps=5", "checkpoint_every=2", f"output_dir={tmp_path / 'run'}"]
    )
    events = []
    history = train(cfg, progress=False, rt=spied_runtime(cfg, events, monkeypatch))
    # one read event per step's metrics (`Coordinator.fetch_all`: the lot at once)
    per_step = sum(kind == "read" for kind, _ in events) // len(history)
    order, reads = [], 0
    for kind, step in events:
        if kind == "issue":
            order.append(f"issue {step}")
        else:
            reads += 1
            if reads % per_step == 0:
                order.append(f"read {reads // per_step}")
    # step 2 and 4 are read before their checkpoints, step 5 at the end; 1 and 3 after the next is issued
    assert order == [
        "issue 1",
        "issue 2",
        "read 1",
        "read 2",
        "issue 3",
        "issue 4",
        "read 3",
        "read 4",
        "issue 5",
        "read 5",
    ]
    assert [r.get("wait_reason") for r in history] == [None, "checkpoint", None, "checkpoint", "checkpoint"]
    logged = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == [1, 2, 3, 4, 5]
    total = sum(r["step_time_s"] for r in history)  # the parts of the run's time add up within it
    assert sum(r["data_wait_s"] + r["dispatch_s"] + r["device_wait_s"] for r in history) <= total * 1.01 + 1e-3

    # the same numbers as reading every step at once, batch by batch
    rt = build_runtime(cfg)
    state, reader = rt.step.init(), rt.reader()
    for rec in history:
        batch = next(reader)
        state, metrics = rt.step(state, StepBatch(batch.samples, batch.schedule, batch.loss_count))
        ref = rt.step.read(metrics)
        assert ref["step"] == rec["step"] == state.step
        np.testing.assert_allclose(rec["train/loss"], ref["train/loss"], rtol=1e-6)


def test_a_non_finite_step_read_late_stops_before_anything_after_it_is_saved(tmp_path, monkeypatch):
    out = tmp_path / "run"
    cfg = load_config(
        ROOT / "configs/kd_tiny.yaml",
        TINY_KD + ["steps=6", "checkpoint_every=3", f"output_dir={out}", "optimizer.learning_rate=1e30"],
    )
    events = []
    with pytest.raises(NonFiniteError, match=r"^step (\d+): non-finite") as err:
        train(cfg, progress=False, rt=spied_runtime(cfg, events, monkeypatch))
    bad = int(err.value.args[0].split()[1].rstrip(":"))
    assert bad in (2, 3)  # step 1 starts from finite weights; its update overflows them
    logged = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert logged == list(range(1, bad))
    saved = sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.isdigit())
    assert saved == []  # the first checkpoint (step 3) would hold non-finite weights: never written


def test_a_profile_window_traces_its_steps_whole(tmp_path, monkeypatch):
    """`profile: {start_step: 2, steps: 2}`: the trace opens just before step 2 is issued and
    closes once step 3 is read (after step 4 is issued, the loop reading one step late), and a
    jax.profiler trace lands in <output_dir>/profile."""
    import jax

    out = tmp_path / "run"
    cfg = load_config(
        ROOT / "configs/kd_tiny.yaml", TINY_KD + ["steps=4", "profile={start_step: 2, steps: 2}", f"output_dir={out}"]
    )
    events = []
    rt = spied_runtime(cfg, events, monkeypatch)
    start, stop = jax.profiler.start_trace, jax.profiler.stop_trace
    monkeypatch.setattr(jax.profiler, "start_trace", lambda d: (events.append(("start", d)), start(d))[1])
    monkeypatch.setattr(jax.profiler, "stop_trace", lambda: (events.append(("stop", None)), stop())[1])
    train(cfg, progress=False, rt=rt)
    kinds = [e[0] if e[0] != "issue" else e for e in events]
    assert kinds.count("start") == 1 and kinds.count("stop") == 1
    assert kinds.index("start") == kinds.index(("issue", 2)) - 1
    assert events[kinds.index("start")][1] == str(out / "profile")
    stop_at = kinds.index("stop")
    assert kinds.index(("issue", 4)) < stop_at and "read" in kinds[kinds.index(("issue", 4)) : stop_at]
    assert "read" in kinds[stop_at:], "step 4 is read after the window closed"
    assert list((out / "profile" / "plugins" / "profile").glob("*/*.xplane.pb"))


def test_a_profile_window_needs_an_output_dir():
    from maestro_jax.config import ConfigError

    with pytest.raises(ConfigError, match=r"profile: \{start_step: 2, steps: 2\} writes into <output_dir>/profile"):
        load_config(ROOT / "configs/kd_tiny.yaml", TINY_KD + ["profile={start_step: 2, steps: 2}"])


def _events(directory):
    """Every TensorBoard event in `directory`'s event files, in order."""
    import struct

    from tensorboardX.proto.event_pb2 import Event

    out = []
    for path in sorted(directory.glob("events*")):
        data, at = path.read_bytes(), 0
        while at + 12 <= len(data):
            (size,) = struct.unpack("<Q", data[at : at + 8])
            out.append(Event.FromString(data[at + 12 : at + 12 + size]))
            at += 12 + size + 4
    return out


@pytest.mark.slow
def test_trackers_come_from_the_config_each_with_the_resolved_config(tmp_path):
    """`trackers: [jsonl, tensorboard, wandb]`: metrics.jsonl; TensorBoard's hparams plugin holds
    the resolved config (flattened: `optimizer.learning_rate`); an offline W&B run under
    <output_dir>/wandb holds the config and the logged loss. `trackers: [jsonl]` writes no events."""
    pytest.importorskip("wandb")
    from tensorboardX.proto.plugin_hparams_pb2 import HParamsPluginData

    out = tmp_path / "run"
    overrides = TINY_KD + ["steps=2", "optimizer.learning_rate=0.0123", f"output_dir={out}"]
    cfg = load_config(ROOT / "configs/kd_tiny.yaml", overrides + ["trackers=[jsonl, tensorboard, wandb]"])
    history = train(cfg, progress=False)
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    hp = [
        HParamsPluginData.FromString(v.metadata.plugin_data.content)
        for e in _events(out / "tb")
        for v in e.summary.value
        if v.metadata.plugin_data.plugin_name == "hparams"
    ]
    infos = [h.session_start_info for h in hp if h.HasField("session_start_info")]
    assert len(infos) == 1 and infos[0].hparams["optimizer.learning_rate"].number_value == pytest.approx(0.0123)
    assert infos[0].hparams["global_batch"].number_value == cfg.global_batch
    (run,) = (out / "wandb").glob("offline-run-*/run-*.wandb")
    data = run.read_bytes()
    assert b"global_batch" in data and b"0.0123" in data and b"student/kl" in data
    assert history[-1]["train/loss"] > 0

    only = tmp_path / "only"
    train(load_config(ROOT / "configs/kd_tiny.yaml", TINY_KD + ["steps=1", f"output_dir={only}", "trackers=[jsonl]"]))
    assert (only / "metrics.jsonl").exists() and not (only / "tb").exists()


def test_a_wandb_tracker_without_its_package_is_refused_before_anything_compiles(tmp_path, monkeypatch):
    import importlib.util

    from maestro_jax.config import ConfigError

    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find(name, *a))
    cfg = load_config(ROOT / "configs/kd_tiny.yaml", TINY_KD + [f"output_dir={tmp_path}", "trackers=[jsonl, wandb]"])
    with pytest.raises(ConfigError, match=r"^error: trackers: wandb: the wandb package is not installed; valid: pip"):
        train(cfg, progress=False)
    assert not (tmp_path / "config.yaml").exists()


def test_hooks_see_every_nth_step_once_it_is_read_and_one_that_raises_stops_the_run(tmp_path):
    """`Trainer.add_hook(fn, every=2)` over 5 steps: called after steps 2 and 4 with their records
    as the trackers got them; a hook that raises ends the run with its error, the steps before
    it logged."""
    from maestro_jax.training.hooks import Hook
    from maestro_jax.training.trainer import Trainer

    trainer = Trainer(load_config(ROOT / "configs/kd_tiny.yaml", TINY_KD + ["steps=5", f"output_dir={tmp_path}"]))
    seen = []
    trainer.add_hook(lambda info: seen.append((info.step, dict(info.record))), every=2)
    history = trainer.train(progress=False)
    assert [s for s, _ in seen] == [2, 4]
    assert [r for _, r in seen] == [history[1], history[3]]

    class Stop(Exception):
        pass

    def stop(info):
        raise Stop(f"hook at step {info.step}")

    failing = Trainer(load_config(ROOT / "configs/kd_tiny.yaml", TINY_KD + ["steps=4"]))
    failing.add_hook(stop, every=3)
    with pytest.raises(Stop, match="hook at step 3"):
        failing.train(progress=False)
    with pytest.raises(ValueError, match=r"every=0: a hook runs every n steps; valid: an integer >= 1"):
        Hook(print, every=0)
