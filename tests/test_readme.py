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
