"""The training loop's evaluation, trackers and reports: a held-out loss every N steps through
the training plan, equal to `maestro-jax eval` on the checkpoint; a user's tracker gets every
record; TensorBoard purges what a resumed run computes again."""

import logging
import struct

import pytest
from conftest import ROOT, TINY_VLM
from tensorboardX.proto.event_pb2 import Event

from maestro_jax import cli
from maestro_jax.config import load_config
from maestro_jax.runtime.build import build_runtime
from maestro_jax.training.evaluate import evaluate_checkpoint
from maestro_jax.training.loop import train
from maestro_jax.training.trainer import Trainer


def vlm(out, *extra):
    return load_config(ROOT / "configs/vlm_tiny.yaml", TINY_VLM + [f"output_dir={out}", *extra])


class Collect:
    """A user's tracker: keeps what it is given."""

    def __init__(self):
        self.records, self.flushes, self.closed = [], 0, False

    def write(self, record):
        self.records.append(dict(record))

    def flush(self):
        self.flushes += 1

    def close(self):
        self.closed = True


def events(tb_dir):
    """Every Event of every TensorBoard file in `tb_dir`, file by file (TFRecord framing)."""
    out = []
    for path in sorted(tb_dir.glob("events.*")):
        data, pos, found = path.read_bytes(), 0, []
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos : pos + 8])
            found.append(Event.FromString(data[pos + 12 : pos + 12 + length]))
            pos += 12 + length + 4
        out.append(found)
    return out


@pytest.mark.slow
def test_eval_loss_every_n_steps_equals_eval_of_the_checkpoint(tmp_path, capsys, caplog):
    out = tmp_path / "run"
    cfg = vlm(out, "steps=4", "eval.every=2", "eval.batches=2", "checkpoint_every=2")
    tracker = Collect()
    history = train(cfg, progress=False, trackers=[tracker])
    evaluated = {r["step"]: r["eval/loss"] for r in history if "eval/loss" in r}
    assert sorted(evaluated) == [2, 4]
    assert all(0 < v < 20 for v in evaluated.values()), evaluated
    assert evaluated[2] != evaluated[4], "the params changed between the evaluations"
    assert [r["step"] for r in tracker.records] == [1, 2, 3, 4] and tracker.closed
    assert tracker.flushes >= 2, "trackers are flushed before each checkpoint"
    said = capsys.readouterr().out
    assert f"checkpoint: saving step 2 to {out / 'checkpoints'}" in said

    step, loss = evaluate_checkpoint(cfg, build_runtime(cfg))
    assert step == 4
    assert loss == pytest.approx(evaluated[4], rel=1e-6, abs=1e-6)
    assert Trainer(cfg).evaluate(2) == (2, pytest.approx(evaluated[2], rel=1e-6, abs=1e-6))

    assert (
        cli.main(
            [
                "eval",
                "--config",
                str(ROOT / "configs/vlm_tiny.yaml"),
                *TINY_VLM,
                f"output_dir={out}",  # as the README's command table writes it: no eval block needed
                "--step",
                "2",
            ]
        )
        == 0
    )
    said = capsys.readouterr().out
    assert f"step 2: eval/loss {evaluated[2]:.4f}" in said, said
    # Orbax's notes on opening the checkpoints read-only say nothing to a user: not shown
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and "read only" in r.getMessage()]


@pytest.mark.slow
def test_resume_says_so_and_tensorboard_purges_recomputed_steps(tmp_path, capsys):
    out = tmp_path / "run"
    train(vlm(out, "steps=3", "checkpoint_every=2"), progress=False)
    capsys.readouterr()
    (out / "checkpoints" / "manifest-3.json").unlink()  # step 3 untrusted: the resume recomputes it
    train(vlm(out, "steps=4"), progress=False)
    said = capsys.readouterr().out
    restoring = f"checkpoint: restoring the newest good one of {out / 'checkpoints'} (committed up to step 3)"
    resuming = f"resuming from the checkpoint of step 2 in {out / 'checkpoints'}"
    lines = said.splitlines()
    assert lines.index(restoring) < lines.index(resuming), said  # said before the restore, then what it found
    first, second = events(out / "tb")
    assert any(e.HasField("summary") and e.step == 3 for e in first)
    purge = [e for e in second if e.HasField("session_log")]
    assert [(e.step, e.session_log.status) for e in purge] == [(3, 1)], "SessionLog.START at step 3 purges 3.."
    assert sorted({e.step for e in second if e.HasField("summary")}) == [3, 4]


@pytest.mark.slow
def test_a_run_with_nothing_to_do_leaves_the_config_as_it_was(tmp_path, capsys):
    out = tmp_path / "run"
    train(vlm(out, "steps=2"), progress=False)
    written = (out / "config.yaml").read_text()
    assert train(vlm(out, "steps=1"), progress=True) == []
    assert (out / "config.yaml").read_text() == written
    said = capsys.readouterr()
    assert "nothing to do" in said.out and "train:" not in said.err, "no progress bar for a run that does nothing"
