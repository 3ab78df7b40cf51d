"""The CLI trains the shipped VLM config and the loss falls."""

import json
import os
import re
import subprocess
import sys

import pytest
from conftest import ROOT, TINY_VLM


@pytest.mark.slow
def test_train_cli_loss_falls(tmp_path):
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "maestro_jax.cli",
        "train",
        "--config",
        str(ROOT / "configs/vlm_tiny.yaml"),
        *TINY_VLM,
        "steps=6",
        f"output_dir={out}",
        "optimizer.learning_rate=0.01",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert all(r["samples_per_s"] > 0 for r in rows)
    assert rows[-1]["train/loss"] < rows[0]["train/loss"] - 0.2, [r["train/loss"] for r in rows]
    # the progress bar's throughput is over the recent steps (up to 10), not the last one's
    shown = float(re.findall(r"samples_per_s=([\d.]+)", proc.stderr)[-1])
    recent = sum(len(r["sample_ids"]) for r in rows[-10:]) / sum(r["step_time_s"] for r in rows[-10:])
    assert shown == pytest.approx(recent, abs=0.051), (shown, recent)
    for r in rows:  # the host timeline: preparation ran ahead
        assert 0 < r["schedule_ahead_s"] <= r["read_ahead_s"] and r["pack_ahead_s"] > 0
        assert 0 <= r["transfer_issue_s"] <= r["dispatch_s"]
        assert r["in_flight_waits"] == 0  # the wavefront schedule keeps the stash bound itself
    # each step is read after the next is issued, so the parts add up within the run, not per step
    total = sum(r["step_time_s"] for r in rows)
    assert sum(r["data_wait_s"] + r["dispatch_s"] + r["device_wait_s"] for r in rows) <= total * 1.01 + 1e-3


def test_cli_bad_config_exits_2_with_one_line(tmp_path):
    """Overlapping devices: one `error:` line, before anything else speaks, even where the compile
    cache holds an entry a killed run left unrecorded (which a run that opens the cache moves aside
    with a warning line of its own)."""
    cache = tmp_path / "xla"
    cache.mkdir()
    (cache / "jit_left_by_a_killed_run-0123-cache").write_bytes(b"half written")
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(cache)}
    cmd = [
        sys.executable,
        "-m",
        "maestro_jax.cli",
        "train",
        "--config",
        str(ROOT / "configs/vlm_tiny.yaml"),
        "sections.llm.devices=1:7",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("error: sections.llm.devices"), proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
