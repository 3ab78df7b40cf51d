"""Kernel timings against the cost model (maestro_jax/tools/kernels.py) and the GPU refit of the
efficiency curve (scripts/calibrate_gpu.py). No test asserts a wall time: the CPU only checks that
rows are well formed and that the predictions are the cost model's own."""

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from maestro_jax.planning import cost
from maestro_jax.tools import kernels
from maestro_jax.workloads import costs

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "calibrate_gpu.py"
KEYS = {
    "kernel",
    "pass",
    "width",
    "tensor",
    "width_per_device",
    "tokens",
    "seq_len",
    "dtype",
    "flops",
    "predicted_s",
    "measured_s",
    "achieved_flops_per_s",
}


@pytest.fixture(scope="module")
def cg():
    spec = importlib.util.spec_from_file_location("calibrate_gpu", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def rows():
    """One decoder shape of the dry-run grid, a tensor-4 rank (two compiles: a few seconds)."""
    shapes = [s for s in kernels.grid(True) if s.kernel == "decoder" and s.tokens == 256 and s.tensor == 4]
    assert len(shapes) == 1
    skipped = []
    out = kernels.measure(True, "cpu", shapes=shapes, repeats=2, skipped=skipped)
    assert not skipped
    return out


def _layer_flops(width, heads, kv_heads, head_dim, mlp, tokens, seq):
    """Forward FLOPs of one causal decoder layer over `tokens` in rows of `seq`, by transformer_flops."""
    linear, attn = cost.transformer_flops(width, 1, heads, kv_heads, head_dim, mlp)
    return linear * tokens + attn / 2 * (tokens // seq) * seq**2


def test_rows_are_complete_and_positive(rows):
    assert [(r["tensor"], r["pass"]) for r in rows] == [(4, p) for p in kernels.PASSES]
    for r in rows:
        assert KEYS <= r.keys(), KEYS - r.keys()
        assert r["kernel"] == "decoder" and r["dtype"] == "float32" and r["device"] == "cpu"
        for key in ("predicted_s", "measured_s", "achieved_flops_per_s", "flops"):
            assert math.isfinite(r[key]) and r[key] > 0, (key, r[key])
        assert r["achieved_flops_per_s"] == pytest.approx(r["flops"] / r["measured_s"])


def test_flops_are_transformer_flops_of_one_layer(rows):
    """The rank's share: heads, key/value heads and MLP divided by tensor; a forward-backward
    counts 1 + backward_factor forwards."""
    arch = kernels.DRY_ARCHS["decoder", 128]
    for r in rows:
        t = r["tensor"]
        assert t == 4 and r["width_per_device"] == r["width"] / t == 32
        fwd = _layer_flops(
            arch.width, arch.heads // t, arch.kv_heads // t, arch.head_dim, arch.mlp // t, r["tokens"], r["seq_len"]
        )
        factor = 1.0 if r["pass"] == "forward" else 1.0 + cost.SectionCost.backward_factor
        assert r["flops"] == pytest.approx(fwd * factor, rel=1e-12)
        eff = cost.efficiency(r["tokens"] / t, r["width_per_device"])
        assert r["predicted_s"] == pytest.approx(r["flops"] / (cost.DEVICES["cpu"]["flops"] * eff), rel=1e-12)


def test_calibrate_gpu_predicts_as_measure_does(rows, cg):
    """The refit recomputes a row's prediction from its fields: under cost.py's constants it is the
    row's own predicted_s."""
    for r in rows:
        assert cg.kernel_predicted_s(r, "cpu", cg.cp.current_params()) == pytest.approx(r["predicted_s"], rel=1e-12)


def test_grid_flops_and_pruning():
    """Every grid shape's FLOPs are the cost functions' (decoders: transformer_flops at the sliced
    config; the ViT block: the encoder layer the ViT cost counts, full attention); tensor slices
    divide the width; the accelerator grid fits its memory estimate on an 80 GB H100."""
    for dry in (True, False):
        for s in kernels.grid(dry):
            assert s.width_per_device == s.arch.width / s.tensor and s.tokens % s.seq_len == 0
            a = s.sliced()
            if s.kernel == "decoder":
                want = _layer_flops(a.width, a.heads, a.kv_heads, a.head_dim, a.mlp, s.tokens, s.seq_len)
                assert kernels.forward_flops(s) == pytest.approx(want, rel=1e-12)
                assert a.kv_heads * s.tensor == s.arch.kv_heads  # exact slices: no replicated heads
            if s.kernel == "vit":
                assert s.tensor == 1
                linear = costs._encoder_layer(a.width, a.mlp) * s.tokens
                want = linear + 4 * a.width * s.rows * s.seq_len**2
                assert kernels.forward_flops(s) == pytest.approx(want, rel=1e-12)
    gpu = kernels.grid(False)
    assert {s.kernel for s in gpu} == set(kernels.KINDS)
    assert {s.width_per_device for s in gpu if s.kernel == "decoder"} >= {256, 512, 1024, 2048, 4096, 8192}
    assert min(s.tokens for s in gpu) == 256 and max(s.tokens for s in gpu) == 32768
    assert [s.tier for s in gpu] == sorted(s.tier for s in gpu)
    budget = 0.7 * 0.75 * 80 * 2**30  # XLA preallocates 75% of an 80 GB H100
    assert all(kernels.estimate_bytes(s, 2) < budget for s in gpu)


def test_device_key():
    assert kernels.device_key("NVIDIA H100 80GB HBM3") == "h100"
    assert kernels.device_key("NVIDIA H200") == "h200"
    assert kernels.device_key("cpu") == "cpu"


# The whole dry run (kernel_report) runs in tests/test_gpu_check.py, inside the GPU check's own.


# ---- scripts/calibrate_gpu.py -------------------------------------------------------------------


def _synthetic(params, device="h100"):
    """Kernel rows whose measured time is the model's prediction under `params`, spread over the
    range the halves act in (tokens per device 32..32768, columns per device 16..8192)."""
    out = []
    for tokens in (256, 1024, 4096, 16384, 32768):
        for width, tensor in ((1024, 1), (2048, 2), (4096, 8), (8192, 1), (4096, 1), (128, 8), (512, 4)):
            for pass_, factor in (("forward", 1.0), ("forward_backward", 3.0)):
                row = {
                    "kernel": "decoder",
                    "pass": pass_,
                    "width": width,
                    "tensor": tensor,
                    "width_per_device": width / tensor,
                    "tokens": tokens,
                    "seq_len": min(tokens, 2048),
                    "dtype": "bfloat16",
                    "flops": factor * 2.4e8 * width / 1024 * tokens / tensor,
                }
                eff = cost.efficiency(tokens / tensor, width / tensor, *params)
                row["measured_s"] = row["flops"] / (cost.DEVICES[device]["flops"] * eff)
                out.append(row)
    return out


def _write(path, kind, rows):
    path.write_text(json.dumps({"env": {"device_kind": kind}, "kernels": rows, "summary": {}}))
    return path


def test_refit_recovers_known_parameters(tmp_path, cg, capsys):
    known = (0.61, 300.0, 700.0)
    src = _write(tmp_path / "gpu_check.json", "NVIDIA H100 80GB HBM3", _synthetic(known))
    out, md = tmp_path / "cal.json", tmp_path / "cal.md"
    assert cg.main([str(src), "--kernels-only", "--json", str(out), "--md", str(md)]) == 0
    rep = json.loads(out.read_text())
    after = rep["constants"]["after"]
    for name, value in zip(cg.NAMES, known):
        assert after[name] == pytest.approx(value, rel=0.02), (name, after)
    assert rep["kernel_errors"]["after"]["all"]["max_abs_log_error"] < 0.01
    assert rep["kernel_errors"]["before"]["all"]["max_abs_log_error"] > 0.1  # cost.py's constants differ
    text = md.read_text()
    assert "## Kernel rows" in text and "## Published rows" in text
    printed = capsys.readouterr().out
    assert "peak: float = 0.61," in printed  # the exact line to put in cost.py
    # combined with the published runs (the default): the published rows pull the fit away from
    # `known`, and the kernel rows pull the halves up from the published fit's
    assert cg.main([str(src), "--json", str(out), "--md", str(md)]) == 0
    combined = json.loads(out.read_text())
    assert combined["fit"]["weights"]["n_published"] == 9
    assert combined["constants"]["after"]["half_width"] > cg.cp.current_params()[2]


def test_refuses_cpu_rows_without_allow_cpu(tmp_path):
    src = _write(tmp_path / "gpu_check.json", "cpu", _synthetic((0.5, 10.0, 100.0), "cpu"))
    proc = subprocess.run([sys.executable, str(SCRIPT), str(src)], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: env.device_kind='cpu':"), lines
    assert "H100" in lines[0] and "--allow-cpu" in lines[0]
    before = {p: p.stat().st_mtime_ns for p in (ROOT / "benchmarks").glob("calibration*")}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(src), "--allow-cpu", "--kernels-only"], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    assert "wrote" not in proc.stdout  # nothing written unless --json / --md are named
    assert {p: p.stat().st_mtime_ns for p in (ROOT / "benchmarks").glob("calibration*")} == before


def test_refuses_bad_rows(tmp_path, cg, capsys):
    rows = _synthetic((0.5, 10.0, 100.0))
    rows[3]["measured_s"] = 0.0
    src = _write(tmp_path / "gpu_check.json", "NVIDIA H100 80GB HBM3", rows)
    assert cg.main([str(src)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: kernels[3].measured_s=0.0: a positive finite number"]


def test_the_per_kind_model_recovers_a_kind_factor_and_a_launch_floor_held_out(cg):
    """Rows timed as the dense curve would, but attention at 0.3 of its rate and no program under
    a 200 us floor: the per-kind fit finds both (grids of 2^(1/16) and 2^(1/4)) and its
    leave-one-out errors are small where the one curve's are not."""
    rows = []
    for r in _synthetic(cg.cp.current_params()):
        if r["width"] == 4096 and r["tensor"] == 1:
            r = r | {"kernel": "attention", "measured_s": r["measured_s"] / 0.3}
        rows.append(r | {"measured_s": max(2e-4, r["measured_s"])})
    rep = cg.per_kind_report(rows, "h100")
    model = rep["model"]
    assert model["factors"]["attention"] == pytest.approx(0.3, rel=0.05)
    assert model["launch_s"] == pytest.approx(2e-4, rel=0.2)
    held = rep["held_out"]
    assert held["all"]["per_kind"]["max_abs_log_error"] < 0.25
    assert held["attention"]["one_curve"]["median_abs_log_error"] > 1.0  # log(1 / 0.3)
    assert held["attention"]["per_kind"]["median_abs_log_error"] < 0.05
