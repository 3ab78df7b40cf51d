"""`maestro-jax bench` writes the JSON contract (numbers are for benchmarks/RESULTS.md, not tests)."""

import json

from conftest import ROOT, TINY_OMNI

from maestro_jax.cli import main


def test_bench_json_contract(tmp_path, config="omni_tiny.yaml", overrides=TINY_OMNI):
    """On omni (two producers into the LLM: the richest built-in graph)."""
    out = tmp_path / "bench.json"
    rc = main(["bench", "--config", str(ROOT / "configs" / config), "--reps", "1", "--batches", "1",
               "--json", str(out), "--trace", str(tmp_path / "trace"), *overrides])
    assert rc == 0
    r = json.loads(out.read_text())
    assert set(r["samples_per_s"]) == {"monolithic", "naive", "wavefront"}
    assert all(v > 0 for v in r["samples_per_s"].values())
    assert set(r["ratios"]) >= {"wavefront_vs_monolithic", "wavefront_vs_naive"}
    assert abs(r["ratios"]["wavefront_vs_naive"] - r["samples_per_s"]["wavefront"] / r["samples_per_s"]["naive"]) < 1e-9
    assert 0 < r["host_overhead_fraction"]["wavefront"] < 1
    assert r["simulator"]["cost_source"] == "calibrated"
    assert set(r["efficiency_vs_text_only"]) == {"wavefront", "monolithic"}
    assert all(0 < v < 2 for v in r["efficiency_vs_text_only"].values())  # ratios of timings, not constants
    for f in ("measured_trace", "measured_gantt", "simulated_trace", "simulated_gantt"):
        assert (tmp_path / "trace").joinpath(r["traces"][f].split("/")[-1]).exists()
    trace = json.loads((tmp_path / "trace" / "measured_trace.json").read_text())
    rows = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"}
    assert set(r["config"]["sections"]) <= rows, "every section has its row in the trace"
