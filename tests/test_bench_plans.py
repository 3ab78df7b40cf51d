"""`maestro-jax bench` runs plans beyond the configs' disjoint ones, and its JSON names the plan
it timed: a co-located plan (both sections on the same devices, each with its own mesh) and an
M:N plan (an edge between data-parallel degrees that do not divide). Numbers are for
benchmarks/fragment_bench_plans.md, not tests."""

import json

import pytest
from conftest import ROOT, TINY_KD

from maestro_jax.cli import main

PLANS = {
    # teacher {data 4, tensor 2} and student {data 8} on the same 8 devices
    "co_located": [
        "sections.teacher.devices=0:8",
        "sections.teacher.mesh={data: 4, tensor: 2}",
        "sections.student.devices=0:8",
        "sections.student.mesh={data: 8}",
    ],
    # uneven 3 -> 4: teacher shards feed overlapping student shards
    "uneven_3_to_4": [
        "sections.teacher.devices=0:3",
        "sections.teacher.mesh={data: 3}",
        "sections.student.devices=4:8",
        "sections.student.mesh={data: 4}",
    ],
}
EXPECTED = {
    "co_located": {
        "teacher": {"devices": "0:8", "mesh": {"data": 4, "tensor": 2}, "micro_batch": 2, "dp": 4},
        "student": {"devices": "0:8", "mesh": {"data": 8}, "micro_batch": 1, "dp": 8},
    },
    "uneven_3_to_4": {
        "teacher": {"devices": "0:3", "mesh": {"data": 3}, "micro_batch": 2, "dp": 3},
        "student": {"devices": "4:8", "mesh": {"data": 4}, "micro_batch": 1, "dp": 4},
    },
}


@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.slow
def test_bench_runs_the_plan_and_records_it(tmp_path, plan):
    out = tmp_path / "bench.json"
    trace = ["--trace", str(tmp_path / "trace")] if plan == "co_located" else []
    rc = main(
        [
            "bench",
            "--config",
            str(ROOT / "configs/kd_tiny.yaml"),
            "--reps",
            "1",
            "--batches",
            "1",
            "--json",
            str(out),
            *trace,
            *TINY_KD,
            *PLANS[plan],
        ]
    )
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["config"]["plan"] == EXPECTED[plan], "the report names the plan it timed"
    assert r["config"]["monolithic"] == {"devices": "0:8", "mesh": {"data": 4, "tensor": 2}, "micro_batch": 1, "dp": 4}
    sps = r["samples_per_s"]
    assert set(sps) == {"monolithic", "naive", "wavefront"} and all(v > 0 for v in sps.values())
    assert abs(r["ratios"]["wavefront_vs_monolithic"] - sps["wavefront"] / sps["monolithic"]) < 1e-9
    assert abs(r["ratios"]["wavefront_vs_naive"] - sps["wavefront"] / sps["naive"]) < 1e-9
    if trace:
        rows = {
            e["args"]["name"]
            for e in json.loads((tmp_path / "trace/measured_trace.json").read_text())["traceEvents"]
            if e["ph"] == "M"
        }
        assert {"teacher", "student"} <= rows, "co-located sections each have their row in the trace"
