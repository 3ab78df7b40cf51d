"""The threaded dispatch path (one thread per section) computes exactly the same step."""

import jax
import numpy as np
import pytest
from conftest import ROOT, TINY_KD, TINY_VLM

from maestro_jax.config import load_config
from maestro_jax.runtime.build import build_runtime


@pytest.mark.parametrize("path,tiny", [("kd_tiny.yaml", TINY_KD), ("vlm_tiny.yaml", TINY_VLM)])
def test_threaded_equals_sequential(path, tiny):
    cfg = load_config(ROOT / "configs" / path, tiny + ["schedule.scheduler=wavefront"])
    rt = build_runtime(cfg)
    states = rt.init_states()
    samples = rt.batches()[0]
    schedule = rt.schedule(samples)
    a = rt.executor.run(states, samples, schedule)
    record: list = []
    b = rt.executor.run_threaded(states, samples, schedule, record=record)
    assert float(a.loss) == float(b.loss)
    for s in a.grads:
        for x, y in zip(jax.tree.leaves(a.grads[s]), jax.tree.leaves(b.grads[s])):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    ran = {str(op) for op, *_ in record}
    assert ran == {str(op) for op in schedule.ops if op.kind != "U"}
