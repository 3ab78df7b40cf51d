"""Cost model arithmetic, calibration fitting, buckets and trace files."""

import json

import numpy as np

from maestro_jax.core.buckets import bucket
from maestro_jax.core.plan import EdgeInfo
from maestro_jax.planning.cost import CostModel, SectionCost, efficiency
from maestro_jax.planning.simulator import simulate
from maestro_jax.schedule import Problem, SampleMeta, wavefront
from maestro_jax.tools.calibrate import _nnls
from maestro_jax.tools.trace import write_chrome_trace, write_gantt


def test_buckets_bound_padding():
    for n in range(1, 5000, 7):
        b = bucket(n)
        assert b >= n and (b <= 16 or b - n < max(16, n / 8))
    assert len({bucket(n) for n in range(1, 4097)}) <= 64  # logarithmic in the largest size


def test_step_time_uses_padded_bucket_and_factors():
    c = CostModel(
        {
            "s": SectionCost(
                per_unit_s=1.0, per_unit2_s=0.01, overhead_s=5.0, backward_factor=2.0, sink_factor=3.0, bucket_min=16
            )
        }
    )
    # bucket(20) = 32 (steps never finer than the minimum); 2 rows per shard
    f = 5 + 2 * (32 + 0.01 * 32 * 32)
    assert np.isclose(c.step_time("s", "F", [20, 3], 2), f)
    assert np.isclose(c.step_time("s", "B", [20, 3], 2), 2 * f)
    assert np.isclose(c.step_time("s", "L", [20, 3], 2), 3 * f)
    assert c.step_time("s", "F", [0, 0], 2) == 5.0


def test_efficiency_grows_with_work_and_width():
    assert efficiency(512, 1024) < efficiency(4096, 1024) < efficiency(65536, 1024) < 0.55
    assert efficiency(4096, 160) < efficiency(4096, 1280)


def test_nnls_recovers_coefficients():
    rng = np.random.default_rng(0)
    x = np.stack([np.ones(50), rng.uniform(1, 100, 50), rng.uniform(1, 1e4, 50)], 1)
    y = x @ np.array([0.5, 0.02, 0.0])
    coef = _nnls(x, y)
    assert np.allclose(coef, [0.5, 0.02, 0.0], atol=1e-9)
    assert (coef >= 0).all()


def test_trace_files(tmp_path):
    problem = Problem(
        order=("v", "l"),
        sink="l",
        trained=frozenset({"v", "l"}),
        edges=(EdgeInfo("e", "v", "l"),),
        rows={"v": 2, "l": 2},
        dp={"v": 1, "l": 2},
    )
    metas = [
        SampleMeta(frozenset({"v", "l"}), {"v": 10, "l": 5}) if i % 2 else SampleMeta(frozenset({"l"}), {"l": 7})
        for i in range(8)
    ]
    t = simulate(wavefront(metas, problem), problem, metas)
    trace = json.loads(write_chrome_trace(t.intervals, tmp_path / "t.json").read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == len(t.intervals)
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"}
    assert {"v", "l", "transfer e"} <= names
    assert max(e["ts"] + e["dur"] for e in spans) == t.makespan * 1e6
    png = write_gantt(t.intervals, tmp_path / "g.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
