"""The README's "Your own compound model" example runs as written and does what it says."""

import re
import subprocess
import sys

import pytest
from conftest import ROOT


@pytest.mark.slow
def test_own_model_example_runs(tmp_path):
    text = (ROOT / "README.md").read_text()
    section = text.split("## Your own compound model", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    script = tmp_path / "own_model.py"
    script.write_text(code)
    proc = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=600,
        env={"PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    diffs = dict(re.findall(r"^(\S+)\s+L2-relative difference (\S+)$", proc.stdout, re.M))
    assert set(diffs) == {
        "loss",
        "grad_norm",
        "adapter/grads",
        "adapter/params_after_update",
        "decoder/grads",
        "decoder/params_after_update",
    }
    assert all(float(v) < 1e-5 for v in diffs.values()), diffs
    first, last = map(float, re.search(r"^loss (\S+) -> (\S+)$", proc.stdout, re.M).groups())
    assert last < first


# Each command of the README's command table, as its synopsis writes it, on a shipped config:
# FILE a tiny config (shrunk by overrides, which every synopsis takes), DIR the run's output_dir
KD = "configs/kd_tiny.yaml"


def _command_lines(tmp_path) -> dict[str, list[str]]:
    run, tiny = tmp_path / "run", ["global_batch=8", "models.teacher.depth=1", "models.student.depth=1"]
    return {
        "train": ["--config", KD, *tiny, "steps=2", f"output_dir={run}"],
        "verify": ["--config", KD, "--json", str(tmp_path / "verify.json"), *tiny],
        "eval": ["--config", KD, *tiny, f"output_dir={run}", "--step", "2"],
        "bench": ["--config", KD, "--reps", "1", "--batches", "1", "--json", str(tmp_path / "bench.json"), *tiny],
        "plan": ["--config", KD, "--devices", "8", "--memory-gb", "1", "--top", "2", *tiny],
        "check-hf": ["--hf", str(ROOT / "tests/fixtures/hf/llama_untied")],
        "export": ["--config", KD, *tiny, f"output_dir={run}", "--section", "student", "--out", str(tmp_path / "hf")],
        "simulate": ["--config", KD, "--json", str(tmp_path / "simulate.json")],
    }


@pytest.mark.slow
def test_every_command_of_the_readme_table_runs_as_written(tmp_path):
    """Every row of the command table: its command and each option the line passes are in the
    row's synopsis, and the line runs to status 0 on a shipped config (train first: eval and
    export read its checkpoints; check-hf needs the `reference` extra)."""
    text = (ROOT / "README.md").read_text()
    rows = dict(re.findall(r"^\| `maestro-jax (\S+) ([^`]*)` \|", text, re.M))
    lines = _command_lines(tmp_path)
    assert set(rows) == set(lines), "a documented command without a line here, or one no longer documented"
    for command, args in lines.items():
        options = [a for a in args if a.startswith("--")]
        assert all(o in rows[command] for o in options), (command, options, rows[command])
        if command == "check-hf" and subprocess.run([sys.executable, "-c", "import torch"]).returncode:
            continue  # transformers' reference needs torch (the `reference` extra)
        proc = subprocess.run(
            [sys.executable, "-m", "maestro_jax.cli", command, *args],
            capture_output=True,
            text=True,
            timeout=900,
            cwd=ROOT,
        )
        assert proc.returncode == 0, (command, proc.stdout[-2000:], proc.stderr[-2000:])
