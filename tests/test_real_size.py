"""The real-size one-GPU configs (configs/kd_one_gpu.yaml, configs/vlm_one_gpu.yaml): their models
have the named Hugging Face models' parameter counts, they plan on one device and simulate on the
CPU, and the benchmark script's dry run (every model tiny) runs to its report."""

import json
import math
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from conftest import ROOT
from maestro_jax.models import DecoderLM

from maestro_jax import cli
from maestro_jax.config import load_config
from maestro_jax.workloads import model

KD, VLM = ROOT / "configs/kd_one_gpu.yaml", ROOT / "configs/vlm_one_gpu.yaml"


def _parameters(cfg, name) -> int:
    m = DecoderLM(model(cfg, name, "llm"))
    ids = jnp.zeros((1, 4), jnp.int32)
    shapes = jax.eval_shape(lambda: m.init(jax.random.key(0), ids, ids, jnp.ones((1, 4), bool)))
    return sum(math.prod(x.shape) for x in jax.tree.leaves(shapes))


def test_the_language_models_are_the_named_models_shapes():
    """Parameter counts of meta-llama/Llama-3.1-8B, meta-llama/Llama-3.2-1B (tied embeddings) and
    Qwen/Qwen2.5-3B (tied, qkv biases), as transformers' classes count them."""
    kd, vlm = load_config(KD, []), load_config(VLM, [])
    assert _parameters(kd, "teacher") == 8_030_261_248
    assert _parameters(kd, "student") == 1_235_814_400
    assert _parameters(vlm, "llm") == 3_085_938_688
    vit = model(vlm, "vision", "vit")
    assert (vit.width, vit.layers, vit.mlp, vit.max_grid, vit.patch) == (1152, 27, 4304, 27, 14)  # SigLIP-So400M


@pytest.mark.slow
@pytest.mark.parametrize("config", [KD, VLM], ids=["kd", "vlm"])
def test_the_real_size_configs_plan_on_one_device_and_simulate(config, capsys):
    assert cli.main(["plan", "--config", str(config), "--devices", "1", "--memory-gb", "80", "--top", "1"]) == 0
    assert "monolithic best layout" in capsys.readouterr().out
    assert cli.main(["simulate", "--config", str(config)]) == 0
    assert "per-device speedup" in capsys.readouterr().out


def _dry_run(tmp_path, config):
    cmd = [sys.executable, str(ROOT / "scripts/real_size_bench.py"), "--config", str(config), "--out", str(tmp_path)]
    proc = subprocess.run(
        [*cmd, "--dry-run", "--reps", "1", "--batches", "1"], capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads((tmp_path / f"{config.stem}.json").read_text())
    assert set(report["mfu"]["by_section"]["wavefront"]) == set(report["config"]["sections"])
    assert all(report["mfu"][m] > 0 for m in ("monolithic", "naive", "wavefront"))
    assert report["ratios"]["wavefront_vs_monolithic"] > 0 and 0 < report["host_overhead_fraction"]["wavefront"] <= 1
    compiled = report["memory"]["compiled_bytes"]
    assert set(compiled) == set(report["config"]["sections"]) and all(max(c.values()) > 0 for c in compiled.values())
    assert proc.stdout.strip().splitlines()[-1].startswith(f"{config.stem}: wavefront ")


@pytest.mark.slow
def test_the_real_size_benchmark_dry_run_kd(tmp_path):
    _dry_run(tmp_path, KD)


@pytest.mark.slow
@pytest.mark.extended
def test_the_real_size_benchmark_dry_run_vlm(tmp_path):
    _dry_run(tmp_path, VLM)


def test_a_bad_override_is_one_error_line():
    cmd = [sys.executable, str(ROOT / "scripts/real_size_bench.py"), "--config", str(KD), "--out", "/tmp/x", "steps=0"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert (
        proc.returncode == 2 and proc.stderr.strip().startswith("error: steps") and len(proc.stderr.splitlines()) == 1
    )
