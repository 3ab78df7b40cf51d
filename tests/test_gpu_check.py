"""scripts/gpu_check.sh keeps working between GPU windows: its dry run (the same steps on the
CPU) exits 0 and writes gpu_check.json with every section the GPU run fills, and its refusals are
one line with status 2."""

import json
import os
import shutil
import subprocess
import sys
import sysconfig

import pytest
from conftest import ROOT

from maestro_jax import fast_paths


def _check(tmp_path, *args, timeout=1200):
    env = {**os.environ, "PYTHON": sys.executable}
    return subprocess.run(
        ["bash", str(ROOT / "scripts/gpu_check.sh"), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=tmp_path,
    )


@pytest.mark.slow
def test_dry_run_writes_every_section(tmp_path):
    out = tmp_path / "gc"
    # one config and one precision (the script's loops run the same code for each; co-located
    # float32 verify is tests/test_colocation.py's)
    args = ["--configs", "kd_tiny", "--precisions", "bfloat16", "--bench-configs", "kd_tiny", "--deadline-s", "3000"]
    proc = _check(tmp_path, "--dry-run", "--out", str(out), *args)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "gpu_check.json").read_text())
    assert {"env", "verify", "bench", "kernels", "summary"} <= set(report)
    assert report["env"]["backend"] == "cpu" and report["env"]["device_count"] == 8
    assert [(v["config"], v["precision"], v["passed"]) for v in report["verify"]] == [("kd_tiny", "bfloat16", True)]
    assert report["verify"][0]["tolerance"] == 2e-2
    assert report["bench"][0]["ratios"]["wavefront_vs_monolithic"] > 0
    host = report["bench"][0]["host_time_s"]["wavefront"]
    assert host["schedule"] > 0 and host["dispatch"] > 0 and host["blocked"] >= -1e-6
    compile_ = report["compile"]
    assert compile_["cold"]["programs"] == compile_["warm"]["programs"] > 0
    kernels = report["kernels"]
    assert kernels and all(k["predicted_s"] > 0 and k["measured_s"] > 0 for k in kernels)
    assert {k["kernel"] for k in kernels} >= {"decoder", "decoder_moe", "vit", "attention"}
    assert {k["pass"] for k in kernels} == {"forward", "forward_backward"}
    checks = report["kernel_checks"]  # cuDNN said unavailable rather than failing; no peak on CPU
    assert not checks["skipped"]
    cudnn = [r for r in checks["attention_implementations"] if r["implementation"] == "cudnn"]
    assert cudnn and all(not r["available"] and "unavailable" in r["error"] for r in cudnn)
    assert checks["memory"] and all(
        r["compiled_bytes"] > 0 and r["measured_peak_bytes"] is None for r in checks["memory"]
    )
    levers = report["levers"]  # every lever's rows on CPU: XLA's run, cuDNN's and tokamax's say why not
    forms = {
        (r["shape"], r["form"], r["implementation"]): r for r in levers["attention_forms"] if r["pass"] == "forward"
    }
    assert {"causal", "padded", "packed"} <= {form for _, form, _ in forms}
    assert forms["causal", "causal", "xla"]["available"] and forms["causal", "causal", "xla"]["max_abs_diff"] < 1e-5
    assert forms["vit_padded", "padded", "xla"]["finite"] and not forms["packed", "packed", "cudnn"]["available"]
    moe = {(r["dispatch"], r["pass"]): r for r in levers["moe_dispatches"]}
    assert all(moe[d, "forward"]["max_abs_diff"] < 1e-4 for d in ("ragged", "sparse"))
    assert "needs" in moe["grouped", "forward"]["error"]
    assert [r["available"] for r in levers["cuda_graphs"]] == [True, False]
    scan = {r["issue"]: r for r in levers["scanned_micro_steps"]}  # the same layer, k launches or one scan
    assert set(scan) == {"launches", "scanned"} and scan["scanned"]["max_abs_diff"] < 1e-5
    assert any("one scanned program" in line for line in levers["summary"])
    made = {d["lever"]: d for d in levers["decisions"]}  # the fast-path table: a CPU figure decides nothing
    assert set(made) == set(fast_paths.BY_NAME) and not any(d["applies"] or d["changes"] for d in made.values())
    assert made["compile.scan_micro_steps"]["speedup"] > 0 and made["attention.causal"]["speedup"] is None
    assert sum(line.startswith("default ") for line in levers["summary"]) == len(fast_paths.LEVERS)
    assert report["summary"][-1] == "gpu check: ok"
    assert proc.stdout.rstrip().endswith("gpu check: ok")  # the summary is printed last


def test_past_its_deadline_the_check_starts_no_step_and_still_writes_its_report(tmp_path):
    """`--deadline-s`: a GPU call has a hard limit, so the check ends inside it, every step it
    could not start named in the report's failures and the summary."""
    out = tmp_path / "gc"
    proc = _check(
        tmp_path, "--dry-run", "--out", str(out), "--deadline-s", "0", "--real-size", "kd_one_gpu", timeout=300
    )
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads((out / "gpu_check.json").read_text())
    skipped = [f for f in report["failures"] if "skipped" in f]
    verifies = {f"verify_{c}_{p}" for c in ("vlm_tiny", "kd_tiny") for p in ("float32", "bfloat16")}
    rest = {"env", "levers", "kernels", "bench_vlm_tiny", "bench_kd_tiny", "train_vlm_tiny_cold", "train_vlm_tiny_warm"}
    rest |= {"real_size_kd_one_gpu"}
    assert sorted(f.split(":")[0] for f in skipped) == sorted(verifies | rest)
    assert len(skipped) == len(report["failures"])
    assert not report["verify"][0].get("passed") and report["verify"][0]["status"] == 124
    assert report["summary"][-1] == f"gpu check: {len(report['failures'])} step(s) failed"


def test_the_check_reads_configs_through_the_installed_package_as_on_a_gpu_machine(tmp_path):
    """On the GPU machine the project is installed as files (`pip install --target`, no editable
    finder), and the source tree alone lacks `maestro_jax.models` and `maestro_jax.meshes`
    (pyproject maps models/ and meshes/ into the package). The check once put the source tree
    first on sys.path and stopped there on its first GPU; an editable install hid it here. This
    lays the package out as such an install does and reads a config with no site hooks."""
    site = tmp_path / "site"
    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(ROOT / "maestro_jax", site / "maestro_jax", ignore=ignore)
    for sub in ("models", "meshes"):
        shutil.copytree(ROOT / sub, site / "maestro_jax" / sub, ignore=ignore)
    code = (
        f"import sys; sys.path.insert(0, {str(ROOT / 'scripts')!r}); import gpu_check; "
        "sections = sorted(gpu_check.Check._config('kd_tiny').sections); "
        "print(sys.modules['maestro_jax'].__file__); print(sections)"
    )
    # -S: no site-packages hooks (the editable install's finder); the libraries by PYTHONPATH
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), sysconfig.get_paths()["purelib"]])}
    proc = subprocess.run([sys.executable, "-S", "-c", code], env=env, capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    where, sections = proc.stdout.strip().splitlines()
    assert where.startswith(str(site)) and sections == "['student', 'teacher']"


def test_refusals_are_one_line(tmp_path):
    for args, field in [
        ((), "--out"),
        (("--out", str(tmp_path / "o"), "--configs", "nope"), "--configs"),
        (("--out", str(tmp_path / "o"), "--wheels", str(tmp_path)), "--wheels"),
        (("--out", str(tmp_path / "o"), "--real-size", "kd_tiny"), "--real-size"),
    ]:
        proc = _check(tmp_path, *args, timeout=120)
        assert proc.returncode == 2, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"error: {field}"), proc.stderr
