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


WIDE_VLM = TINY_VLM + [
    "host_devices=32",
    "global_batch=128",
    "data.num_samples=256",
    "sections.vision.devices=0:8",
    "sections.vision.mesh={data: 8}",
    "sections.vision.micro_batch=2",
    "sections.llm.devices=8:32",
    "sections.llm.mesh={data: 8, tensor: 3}",
    "sections.llm.micro_batch=1",
    "edges.image_embeds.fanout=1",
    "monolithic.devices=0:32",
    "monolithic.mesh={data: 32}",
]

_WIDE_RUN = """
import sys
from maestro_jax.cli import _ensure_host_devices
_ensure_host_devices(32)  # what the CLI does before JAX starts: 32 devices and their thread pool
from maestro_jax.config import load_config
from maestro_jax.schedule.ops import sample_metas
from maestro_jax.runtime.build import build_runtime
from maestro_jax.schedule import naive, wavefront
rt = build_runtime(load_config(sys.argv[1], sys.argv[2:]))
states, batches = rt.init_states(), iter(rt.batches())
for order in ("wavefront", "wavefront", "naive"):
    samples = next(batches)
    metas = sample_metas(rt.graph, samples)
    schedule = wavefront(metas, rt.problem) if order == "wavefront" else naive(metas, rt.problem)
    steps = len(schedule.steps["llm"])
    result = rt.executor.run(states, samples, schedule)
    print(order, steps, float(result.loss), result.in_flight_waits, flush=True)
"""


@pytest.mark.slow
@pytest.mark.extended  # 32 devices in a subprocess
def test_sixteen_micro_steps_on_32_devices_finish_under_both_orders():
    """The shape that used to abort under wavefront (XLA's 40 s rendezvous timeout): a VLM over
    32 CPU devices, the LLM's 24 with tensor groups of 3 and 16 micro-steps in flight. Every
    program part waiting at a collective holds a client thread; the CLI now sizes the pool
    (`PJRT_NPROC`) so interleaved sections cannot take every thread. Wavefront never waits on
    the in-flight bound."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PJRT_NPROC")}
    proc = subprocess.run(
        [sys.executable, "-c", _WIDE_RUN, str(ROOT / "configs/vlm_tiny.yaml"), *WIDE_VLM],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = [line.split() for line in proc.stdout.splitlines()]
    assert [r[0] for r in runs] == ["wavefront", "wavefront", "naive"]
    assert all(int(r[1]) == 16 for r in runs)
    assert all(np.isfinite(float(r[2])) for r in runs)
    assert [int(r[3]) for r in runs[:2]] == [0, 0]
