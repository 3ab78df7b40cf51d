"""`maestro-jax bench` writes the JSON contract (numbers are for benchmarks/RESULTS.md, not tests),
says what it is doing while it runs, and leaves the runtime it is given as it found it."""

import json

import pytest
from conftest import ROOT, TINY_KD, TINY_OMNI, TINY_VLM

from maestro_jax.cli import main
from maestro_jax.config import load_config
from maestro_jax.tools.bench import MODES, ORDERS


@pytest.mark.slow
def test_bench_json_contract(tmp_path, capsys, config="omni_tiny.yaml", overrides=TINY_OMNI):
    """On omni (two producers into the LLM: the richest built-in graph)."""
    out = tmp_path / "bench.json"
    rc = main(
        [
            "bench",
            "--config",
            str(ROOT / "configs" / config),
            "--reps",
            "1",
            "--batches",
            "1",
            "--json",
            str(out),
            "--trace",
            str(tmp_path / "trace"),
            *overrides,
        ]
    )
    assert rc == 0
    said = capsys.readouterr()
    progress = [line for line in said.err.splitlines() if line.startswith("bench [")]  # one line per phase
    phases = [
        "building the runtime",
        "calibrating the cost model",
        *(f"warm-up {m}:" for m in MODES),
        "repetition 1/1: ",
        "text-only (modality items removed) warm-up",
        "text-only repetition 1/1: ",
        "writing traces to",
        "done",
    ]
    assert len(progress) == len(phases) and all(p in line for p, line in zip(phases, progress)), said.err
    assert all(f"{m} " in progress[5] and "/step" in progress[5] for m in MODES), progress[5]
    assert "wavefront_vs_naive" in said.out and "bench [" not in said.out, "progress on stderr, the report on stdout"
    r = json.loads(out.read_text())
    assert set(r["samples_per_s"]) == {"monolithic", "naive", "wavefront"}
    # the fair monolithic is the fastest of its orders; arrival order is the users' Megatron order
    assert set(r["monolithic_orders"]) == set(ORDERS) and r["monolithic_order"] in ORDERS
    assert r["samples_per_s"]["monolithic"] == pytest.approx(max(r["monolithic_orders"].values()), rel=1e-12)
    assert r["user_baselines"]["round_robin"]["samples_per_s"] == r["monolithic_orders"]["arrival"]
    assert r["ratios"]["wavefront_vs_round_robin"] >= r["ratios"]["wavefront_vs_monolithic"] * (1 - 1e-12)
    assert "users' baseline, Megatron-style data order" in said.out
    assert all(v > 0 for v in r["samples_per_s"].values())
    assert set(r["ratios"]) >= {"wavefront_vs_monolithic", "wavefront_vs_naive"}
    assert abs(r["ratios"]["wavefront_vs_naive"] - r["samples_per_s"]["wavefront"] / r["samples_per_s"]["naive"]) < 1e-9
    assert 0 < r["host_overhead_fraction"]["wavefront"] < 1
    # host time per launched op beside one op's device time (issue 77 part 3): omni's programs
    # and its two edges' transfers every step, each op kind timed in the calibration
    per_op = r["host_per_op"]
    for m in ("naive", "wavefront"):
        assert per_op[m]["programs"] > 0 and per_op[m]["transfers"] > 0
        assert all(per_op[m][k] >= 0 for k in ("schedule_s", "dispatch_s", "transfer_issue_s", "wait_s"))
        assert per_op[m]["dispatch_s"] > 0 and per_op[m]["schedule_s"] > 0
        assert f"host per op ({m}, " in said.out
    assert {"F", "B", "X", "XB"} <= set(per_op["device_s"]) and all(v > 0 for v in per_op["device_s"].values())
    assert "device time per op (calibration, each op waited for): F " in said.out
    assert r["simulator"]["cost_source"] == "calibrated"
    # MFU per mode, maestro's by section too: the same FLOPs over each mode's devices and time
    u = r["mfu"]
    assert all(u[m] > 0 for m in MODES) and set(u["by_section"]["wavefront"]) == set(r["config"]["sections"])
    assert u["wavefront"] / u["naive"] == pytest.approx(r["samples_per_s"]["wavefront"] / r["samples_per_s"]["naive"])
    assert "timed" in u["peak_source"] and "MFU wavefront: " in said.out
    assert set(r["efficiency_vs_text_only"]) == {"wavefront", "monolithic"}
    # ratios of the timings reported beside them, not constants (their size is the machine's: no bound)
    for m, v in r["efficiency_vs_text_only"].items():
        assert r["text_only_step_s"][m] > 0
        assert v == pytest.approx(r["text_only_step_s"][m] / r["step_time_s"][m]["median"], rel=1e-12)
    for f in ("measured_trace", "measured_gantt", "simulated_trace", "simulated_gantt"):
        assert (tmp_path / "trace").joinpath(r["traces"][f].split("/")[-1]).exists()
    trace = json.loads((tmp_path / "trace" / "measured_trace.json").read_text())
    rows = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"}
    assert set(r["config"]["sections"]) <= rows, "every section has its row in the trace"


@pytest.mark.slow
def test_bench_leaves_the_runtime_as_it_found_it():
    """A `Trainer`'s bench calibrates a cost model for its own schedules; the runtime schedules
    a batch after the bench exactly as before it (training orders by work units)."""
    from maestro_jax.training.trainer import Trainer

    trainer = Trainer(load_config(ROOT / "configs/kd_tiny.yaml", TINY_KD))
    samples = trainer.runtime.batches()[0]
    before = trainer.runtime.schedule(samples).ops
    r = trainer.bench(reps=1, batches=1)
    assert r["simulator"]["cost_source"] == "calibrated", "the bench did calibrate"
    assert trainer.runtime.schedule(samples).ops == before


@pytest.mark.slow
def test_bench_balance_times_the_wavefront_both_ways_on_one_runtime():
    """`bench --balance` (`bench_balance`): the wavefront with and without its producer-balancing
    variant on the same runtime and batches; the report's ratio is its tokens/s ratio, and each
    way's padded work counts every section's rows (none of it zero: both ways run every section)."""
    from maestro_jax.runtime.build import build_runtime
    from maestro_jax.tools.bench import bench_balance

    skewed = ["data.modalities.image.fraction=0.25", "data.modalities.image.max_items=4"]
    cfg = load_config(ROOT / "configs" / "vlm_tiny.yaml", [*TINY_VLM, *skewed])
    rt = build_runtime(cfg)
    said = []
    r = bench_balance(cfg, rt, [rt.batches()[0]], 1, said.append)
    assert set(r["tokens_per_s"]) == {"unbalanced", "balanced"} and all(v > 0 for v in r["tokens_per_s"].values())
    assert r["balanced_vs_unbalanced"] == pytest.approx(r["tokens_per_s"]["balanced"] / r["tokens_per_s"]["unbalanced"])
    assert {way: sorted(units) for way, units in r["padded_units"].items()} == {
        "unbalanced": ["llm", "vision"],
        "balanced": ["llm", "vision"],
    }
    assert all(n > 0 for units in r["padded_units"].values() for n in units.values())
    assert [line.split(":")[0] for line in said] == ["balance", "balance", "balance repetition 1/1"]
    assert rt.problem.balance_shards, "the runtime's own problem is left as it was"


@pytest.mark.slow
def test_the_monolithic_orders_are_sorts_of_one_batch_with_one_loss():
    """`monolithic_orders`: each order is a permutation of the batch, the sorted ones longest
    first by their key with ties in arrival order, and the monolithic step's loss and gradients
    are the same in every order (up to the rounding of their sums): the order is a fair
    baseline's free choice, never a change of what it trains."""
    import jax
    import numpy as np

    from maestro_jax.runtime.build import build_runtime
    from maestro_jax.schedule import sample_metas
    from maestro_jax.tools.bench import monolithic_orders
    from maestro_jax.tools.calibrate import fit, measure

    cfg = load_config(ROOT / "configs/vlm_tiny.yaml", TINY_VLM)
    rt = build_runtime(cfg)
    samples = rt.batches()[0]
    measured, _ = measure(rt, rt.step.init(), [samples], repeats=1)
    cost = fit(rt, measured)
    # the fit files each op's time under its section and each update under its own (an op that
    # looked like one of fit's ('update', section) rows left every section unpriced once)
    assert all(c.overhead_s > 0 or c.per_unit_s > 0 for c in cost.sections.values()), cost.sections
    assert set(cost.update_s) == {s for s in rt.graph.names if rt.graph.section(s).trained}
    orders = monolithic_orders(rt, cost)
    assert set(orders) == set(ORDERS)
    sink = [m.work.get(rt.graph.sink, 0) for m in sample_metas(rt.graph, samples)]
    by_id = {s.id: u for s, u in zip(samples, sink)}
    results = {}
    for name, order in orders.items():
        got = order(list(samples))
        assert sorted(s.id for s in got) == sorted(s.id for s in samples)
        if name == "sink_longest":
            keys = [(-by_id[s.id], [x.id for x in samples].index(s.id)) for s in got]
            assert keys == sorted(keys), "longest first, ties in arrival order"
        loss, grads, _ = rt.monolithic.step.gradients(rt.monolithic.step.init(), got)
        results[name] = float(loss), jax.tree.map(np.asarray, grads)
    assert orders["arrival"](list(samples)) == list(samples)
    assert orders["sink_longest"](list(samples)) != list(samples), "the batch does arrive unsorted"
    loss, grads = results["arrival"]
    for name, (other_loss, other_grads) in results.items():
        assert other_loss == pytest.approx(loss, rel=1e-5), name
        for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(other_grads)):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_host_per_op_divides_each_host_time_by_what_it_launched():
    """`bench`'s host time per op from each step's timings: a program's dispatch is the step's
    dispatch less its transfers' issue and the in-flight bound's waits, over its programs; a
    transfer's issue over its transfers; scheduling and the waits over every op; medians over
    steps; the calibration's device time per op kind beside them."""
    from maestro_jax.schedule import Op, Schedule
    from maestro_jax.tools.bench import _device_time_by_kind, _host_per_op, _launches, _no_stats
    from maestro_jax.tools.calibrate import UpdateWork

    ops = (Op("F", "vision", 0), Op("X", "vision", 0, "img"), Op("F", "llm", 0), Op("XB", "vision", 0, "img"))
    ops += (Op("B", "vision", 0), Op("U", "vision"), Op("U", "llm"))
    assert _launches(Schedule({}, ops, 1)) == (5, 2)
    stats = {m: _no_stats() for m in ("naive", "wavefront")}
    for m, scale in (("naive", 1.0), ("wavefront", 2.0)):
        for step in range(3):  # the middle step is each median
            grow = 1 + step / 10
            for k, v in dict(
                schedule_s=0.7, dispatch_s=9.0, step_s=30.0, transfer_issue_s=2.0, in_flight_wait_s=1.0
            ).items():
                stats[m][k].append(v * scale * grow)
            stats[m]["programs"].append(5)
            stats[m]["transfers"].append(2)
    measured = [(Op("F", "llm", 0), None, None, (4.0, 0.1)), (Op("F", "vision", 0), None, None, (2.0, 0.1))]
    measured += [(Op("X", "vision", 0, "img"), None, None, (0.5, 0.2)), (UpdateWork("llm"), None, None, 9.0)]
    per_op = _host_per_op(stats, _device_time_by_kind(measured))
    g = 1.1 * 2.0  # the wavefront's middle step
    assert per_op["wavefront"] == pytest.approx(
        {
            "programs": 5,
            "transfers": 2,
            "schedule_s": 0.7 * g / 7,
            "dispatch_s": (9.0 - 2.0 - 1.0) * g / 5,
            "transfer_issue_s": 2.0 * g / 2,
            "wait_s": (1.0 + 30.0 - 0.7 - 9.0) * g / 7,
        }
    )
    assert per_op["device_s"] == {"F": 3.0, "X": 0.5}  # medians by kind; the update's row is not an op
