"""The host's issue order (schedule.dispatch_order, used by the executor on accelerators): a lane
whose launch queue is full is passed by other lanes' ready ops, each lane keeps its order, no op
goes before what it reads, and the step computes exactly what the schedule order computes."""

import jax
import numpy as np
import pytest
from conftest import ROOT, TINY_VLM

from maestro_jax.config import load_config
from maestro_jax.runtime.build import build_runtime
from maestro_jax.runtime.executor import LAUNCH_WINDOW
from maestro_jax.schedule import Op
from maestro_jax.schedule.dispatch import dispatch_order


def _issue(ops, deps, capacity):
    """Simulated lanes: lane "a" runs nothing until waited for; `capacity` ops fit its queue."""
    queued = {"a": 0, "b": 0}
    log = []

    def wait(lane):
        log.append(("wait", lane))
        queued[lane] = 0  # the device drained its queue

    for op in dispatch_order(ops, deps, lambda op: op.section, lambda lane: queued[lane] >= capacity[lane], wait):
        queued[op.section] += 1
        log.append(op)
    return log


def test_a_full_lane_is_passed_and_order_and_dependencies_hold():
    a = [Op("F", "a", k) for k in range(4)]
    b = [Op("F", "b", k) for k in range(3)]
    ops = a + b  # the schedule order: all of a first
    deps = {b[0]: [a[0]], b[2]: [a[3]]}  # b's third op reads a's last
    log = _issue(ops, deps, {"a": 2, "b": 10})
    issued = [x for x in log if isinstance(x, Op)]
    assert len(issued) == len(ops) and set(issued) == set(ops)
    assert issued[:2] == a[:2] and issued[2:4] == b[:2]  # a full after two: b's ready ops go ahead
    assert [x for x in issued if x.section == "a"] == a and [x for x in issued if x.section == "b"] == b
    assert issued.index(b[2]) > issued.index(a[3])  # never before what it reads
    assert log.count(("wait", "a")) == 1  # waited once, when nothing else could go


def test_no_full_lane_keeps_the_schedule_order():
    ops = [Op("F", s, k) for k in range(3) for s in ("a", "b")]
    assert _issue(ops, {}, {"a": 99, "b": 99}) == ops


@pytest.mark.slow
def test_executor_with_a_tiny_launch_window_computes_the_same_step():
    # the wavefront: its micro-steps share shapes, so the sink's two scan
    cfg = load_config(ROOT / "configs/vlm_tiny.yaml", [*TINY_VLM, "schedule.scheduler=wavefront"])
    rt = build_runtime(cfg)
    samples = rt.batches()[0]
    schedule = rt.schedule(samples)
    results = {}
    # None: the schedule's order, as on CPU by default; "scan": the issuing walk accelerators take
    # (their window) with the sink's micro-steps scanned (`compile.scan_micro_steps`)
    for window, scan in ((None, 1), (1, 1), ("scan", 4)):
        rt.executor.launch_window, rt.executor.scan = LAUNCH_WINDOW if window == "scan" else window, scan
        r = rt.executor.run(rt.init_states(), samples, schedule)
        results[window] = (float(r.loss), jax.tree.map(np.asarray, r.grads), r.launch_waits)
    assert results[1][0] == results[None][0]
    for x, y in zip(jax.tree.leaves(results[1][1]), jax.tree.leaves(results[None][1])):
        np.testing.assert_array_equal(x, y)
    np.testing.assert_allclose(results["scan"][0], results[None][0], rtol=1e-6)
    for x, y in zip(jax.tree.leaves(results["scan"][1]), jax.tree.leaves(results[None][1])):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-7)
    assert any(kind == "loss_and_grad_run" for kind, _ in rt.programs["llm"].cache)
    # one queued program per lane: the host waited (a lane's program is not done the instant
    # after it is issued); the schedule's own order never does
    assert results[None][2] == 0 and results[1][2] > 0
