"""MFU (planning/mfu.py, runtime/mfu.py): a step's model FLOPs agree with MaxText's
`calculate_tflops_training_per_device` for a Llama 3 8B-shaped model, each section's MFU is over
its own devices, the peaks come from the datasheets (or the config, or a CPU's timed matmul), and
every training run's metrics.jsonl carries `perf/mfu` and `perf/mfu/<section>`."""

import itertools
import json

import numpy as np
import pytest
from conftest import ROOT, TINY_VLM
from maestro_jax.models import LLMConfig

from maestro_jax import cli
from maestro_jax.core.graph import Edge, Section, SectionGraph, UnitCost
from maestro_jax.data.samples import Sample
from maestro_jax.planning.mfu import datasheet_peak, step_flops, utilization
from maestro_jax.runtime.mfu import peak_of
from maestro_jax.training.trackers import tensorboard_tag
from maestro_jax.workloads.costs import llm_cost

# Llama 3 8B (meta-llama/Meta-Llama-3-8B config.json): width 4096, 32 layers, 32 heads, 8 key/value
# heads of 128, MLP 14336, vocabulary 128256
LLAMA3_8B = LLMConfig(vocab=128256, width=4096, depth=32, heads=32, kv_heads=8, head_dim=128, mlp=14336)
S = 8192


def maxtext_training_flops() -> float:
    """MaxText's `calculate_tflops_training_per_device` (src/maxtext/utils/maxtext_utils.py, the
    dense branch) for per_device_batch_size 1, max_target_length S, mlp_activations
    ["silu", "linear"], worked from its source, in FLOPs."""
    e, m, h, kv, d, layers, v = 4096, 14336, 32, 8, 128, 32, 128256
    ffn = 2 * S * m * e * 2 + 2 * S * m * e  # ffn1 (two activations) + ffn2
    qkv = 2 * S * e * (h + 2 * kv) * d
    projection = 2 * S * e * h * d
    causal_attention = 4 * S**2 * h * d / 2  # "Divide attention flops by 2 due to causal mask"
    embedding = 2 * S * e * v
    learnable = ((ffn + qkv + projection) * layers + embedding) * 3
    return learnable + causal_attention * layers * 3


def _graph(*sections):
    edges = tuple(Edge(f"{a.name}_out", a.name, b.name) for a, b in itertools.pairwise(sections))
    return SectionGraph(sections, edges, init=lambda key: {}, loss_count=len)


def _section(name, trained, cost, activates=lambda s: True):
    return Section(name, trained, None, None, activates, lambda s: s.length - 1, cost)


def test_a_llama3_8b_steps_flops_are_maxtexts():
    assert maxtext_training_flops() == 421_645_529_382_912  # 421.6 TFLOP a step of 8192 tokens
    sample = Sample(0, np.zeros(S + 1, np.int32))  # S next-token positions
    trained = _graph(_section("llm", True, llm_cost(LLAMA3_8B, head=True)))
    assert step_flops(trained, [sample])["llm"] == pytest.approx(maxtext_training_flops(), rel=1e-12)
    kd = _graph(_section("teacher", False, llm_cost(LLAMA3_8B, head=True)), _section("student", True, UnitCost(1.0)))
    assert step_flops(kd, [sample])["teacher"] == pytest.approx(maxtext_training_flops() / 3, rel=1e-12)  # frozen


def test_a_sections_flops_count_only_the_samples_it_runs():
    cost = llm_cost(LLMConfig(vocab=64, width=32, depth=2, heads=4, kv_heads=2, head_dim=8, mlp=64), head=False)
    images = _section("vit", True, cost, activates=lambda s: s.length > 5)
    samples = [Sample(0, np.zeros(4, np.int32)), Sample(1, np.zeros(9, np.int32))]
    assert step_flops(_graph(images), samples)["vit"] == pytest.approx(3 * cost.forward_flops(8))


def test_each_section_is_over_its_own_devices_and_the_step_over_the_devices_used():
    u = utilization({"vit": 2e12, "llm": 6e12}, {"vit": [0, 1], "llm": [2, 3, 4, 5]}, 2.0, 1e12)
    assert u.sections == {"vit": pytest.approx(0.5), "llm": pytest.approx(0.75)}
    assert u.step == pytest.approx(8e12 / (6 * 2.0 * 1e12))
    shared = utilization({"a": 1e12, "b": 1e12}, {"a": [0], "b": [0]}, 1.0, 1e12)  # co-located: one device
    assert shared.step == pytest.approx(2.0) and shared.record()["perf/mfu/a"] == pytest.approx(1.0)
    assert tensorboard_tag("perf/mfu") == "perf/mfu" and tensorboard_tag("samples_per_s") == "perf/samples_per_s"


@pytest.mark.parametrize(
    ("kind", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756.5e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("TPU v5 lite", 197e12),
        ("TPU v5", 459e12),
        ("TPU v6 lite", 918e12),
        ("cpu", None),
    ],
)
def test_datasheet_peaks(kind, peak):
    assert datasheet_peak(kind) == peak


def test_the_peak_is_the_configs_else_the_datasheets_else_a_timed_matmul():
    assert peak_of(5e12, "NVIDIA H200") == (5e12, "the config's peak_flops")
    assert peak_of(None, "NVIDIA H200")[0] == 989e12
    measured, source = peak_of(None, "cpu")
    assert measured > 1e8 and "timed" in source


@pytest.mark.slow
def test_every_records_mfu_is_in_metrics_jsonl(tmp_path):
    out = tmp_path / "run"
    argv = ["train", "--config", str(ROOT / "configs/vlm_tiny.yaml"), *TINY_VLM, "steps=2", f"output_dir={out}"]
    assert cli.main([*argv, "peak_flops=1e11"]) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 2
    for rec in records:
        sections = {k.split("/", 2)[2] for k in rec if k.startswith("perf/mfu/")}
        assert sections == {"vision", "llm"}
        assert all(0 < rec[f"perf/mfu/{s}"] for s in sections) and 0 < rec["perf/mfu"]
        # the step's MFU is its sections' FLOPs over the devices they use: vlm_tiny's vision on 2
        # of the 8, the LLM on 6
        weighted = rec["perf/mfu/vision"] * 2 + rec["perf/mfu/llm"] * 6
        assert rec["perf/mfu"] == pytest.approx(weighted / 8, rel=1e-9)
