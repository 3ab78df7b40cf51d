"""The fast paths' defaults are one table decided by measurement (`maestro_jax.fast_paths`): every default
follows its rule from its measurement, the code runs what the table says, and the GPU check turns
its rows into each lever's speedup and the default that implies (`tools.levers.decisions`)."""

import dataclasses

import jax.numpy as jnp
import pytest
from maestro_jax.models.attention import choose_kernel
from maestro_jax.models.llm import AUTO_DISPATCH

from maestro_jax import fast_paths
from maestro_jax.config import CompileConfig
from maestro_jax.fast_paths import BY_NAME, LEVERS, Measured
from maestro_jax.tools import levers


def test_every_default_is_its_rule_applied_to_its_measurement():
    assert len(BY_NAME) == len(LEVERS)
    for lever in LEVERS:
        assert lever.unmeasured in (lever.baseline, lever.candidate), lever.name
        if lever.measured is None:
            assert lever.default == lever.unmeasured and lever.why_unmeasured, lever.name
        else:
            assert lever.measured.card.startswith("NVIDIA") and lever.measured.source, lever.name
            expected = lever.candidate if lever.measured.speedup >= lever.min_speedup else lever.baseline
            assert lever.default == expected, lever.name
        assert lever.name in lever.why() and repr(lever.default) in lever.why()


def test_a_measurement_below_the_margin_keeps_the_baseline():
    lever = dataclasses.replace(BY_NAME["attention.causal"], measured=Measured(1.05, "NVIDIA H100", "d", "s"))
    assert lever.default == "mask"
    assert dataclasses.replace(lever, measured=Measured(1.1, "NVIDIA H100", "d", "s")).default == "causal"
    assert lever.decide(None) == lever.unmeasured


def test_the_code_runs_what_the_table_says(monkeypatch):
    assert AUTO_DISPATCH["gpu"] == AUTO_DISPATCH["cuda"] == fast_paths.default("moe_dispatch auto (NVIDIA)")
    assert CompileConfig().scan_micro_steps == fast_paths.default("compile.scan_micro_steps")
    assert CompileConfig().cuda_graph_min_thunks == fast_paths.default("compile.cuda_graph_min_thunks")

    def chosen():
        return choose_kernel("gpu", jnp.bfloat16, 128, 4096, 4096, 9.0, (0, 12, 1), "causal").form

    assert chosen() == "causal"  # measured at 3.1x the mask path
    slower = dataclasses.replace(BY_NAME["attention.causal"], measured=Measured(0.9, "NVIDIA H100", "d", "s"))
    monkeypatch.setitem(BY_NAME, "attention.causal", slower)
    assert chosen() == "mask"
    assert choose_kernel("gpu", jnp.bfloat16, 128, 4096, 4096, 9.0, (0, 12, 1), "causal", forced=True).form == "causal"


def _rows(sparse_s, grouped_s, backend_rows=True):
    attention = [
        {"shape": shape, "form": form, "implementation": "cudnn", "pass": "forward_backward", "available": True}
        | {"measured_s": t}
        for shape, form, t in (("a", "mask", 6.0), ("a", "causal", 2.0), ("b", "mask", 3.0), ("b", "causal", 2.0))
    ]
    attention.append(attention[0] | {"implementation": "xla", "measured_s": 1.0})  # XLA rows decide nothing
    moe = [
        {"dispatch": d, "pass": p, "available": True, "measured_s": t}
        for d, t in (("sparse", sparse_s), ("grouped", grouped_s))
        for p in ("forward", "forward_backward")
    ]
    graphs = [{"tokens": 8, "graphs": "default", "available": True, "measured_s": 1.0}]  # the other side absent
    scan = [
        {"tokens": n, "issue": issue, "available": True, "measured_s": t}
        for n, issue, t in ((8, "launches", 2.0), (8, "scanned", 1.0), (64, "launches", 3.0), (64, "scanned", 2.5))
    ]
    return attention, moe, graphs, scan


def test_the_check_reads_each_levers_speedup_at_its_least_favourable_shape():
    got = levers.measured_speedups(*_rows(sparse_s=1.0, grouped_s=0.8))
    assert got["attention.causal"] == pytest.approx(1.5)  # shape b: 3.0 / 2.0 (a gives 3.0)
    assert got["attention.padded"] is None and got["attention.packed"] is None
    assert got["moe_dispatch auto (NVIDIA)"] == pytest.approx(1.25)
    assert got["compile.cuda_graph_min_thunks"] is None
    assert got["compile.scan_micro_steps"] == pytest.approx(1.2)
    assert set(got) == set(BY_NAME)


@pytest.mark.parametrize(
    "grouped_s, backend, implied, changes",
    [(0.8, "gpu", "grouped", True), (0.95, "gpu", "sparse", False), (0.5, "cpu", "sparse", False)],
)
def test_a_gpu_measurement_says_what_the_default_becomes(grouped_s, backend, implied, changes):
    made = {d["lever"]: d for d in levers.decisions(levers.measured_speedups(*_rows(1.0, grouped_s)), backend)}
    moe = made["moe_dispatch auto (NVIDIA)"]
    assert (moe["implied"], moe["changes"], moe["applies"]) == (implied, changes, backend == "gpu")
    assert moe["default"] == "sparse" and "1.1x" in moe["rule"]
    scan = made["compile.scan_micro_steps"]  # 1.2x >= 1.1: a scan of 8 on a GPU, nothing off one
    assert scan["implied"] == (8 if backend == "gpu" else 1) and scan["changes"] == (backend == "gpu")
    lines = levers.decision_lines(list(made.values()))
    assert len(lines) == len(LEVERS)
    assert any(line.startswith("default moe_dispatch auto (NVIDIA) = 'sparse'") for line in lines)
    assert any("update maestro_jax/fast_paths.py" in line for line in lines) == (backend == "gpu")
