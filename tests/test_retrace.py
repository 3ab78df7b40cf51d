"""After the first step nothing is traced or compiled again: every program a step launches is
compiled ahead (`SectionedStep.compile`) and later steps of the same shapes call it as it is
(issue 57's dispatch at the C++ fast path starts from this). Checked with jax's own
`jax_explain_cache_misses`, which logs every tracing cache miss, and the persistent compilation
cache's misses, on every tiny config (kd, vlm, omni, vlm_kd) under both schedulers, in CI's tier."""

import logging
import time

import jax
import pytest
from conftest import ROOT, TINY_KD, TINY_OMNI, TINY_VLM, TINY_VLM_KD

from maestro_jax.config import load_config
from maestro_jax.runtime.build import build_runtime
from maestro_jax.runtime.step import StepBatch

MISSES = ("TRACING CACHE MISS", "never seen function", "COMPILATION CACHE MISS", "Compiling ")


class _Misses(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record):
        text = record.getMessage()
        if any(m in text for m in MISSES):
            self.messages.append(text.splitlines()[0][:300])


@pytest.mark.slow
@pytest.mark.parametrize("scheduler", ["wavefront", "naive"])
@pytest.mark.parametrize(
    ("config", "overrides"),
    [("kd_tiny", TINY_KD), ("vlm_tiny", TINY_VLM), ("omni_tiny", TINY_OMNI), ("vlm_kd_tiny", TINY_VLM_KD)],
)
def test_no_step_after_the_first_traces_or_compiles(config, overrides, scheduler):
    """Steps issued one at a time (each waited for), as the loop issues them after compiling ahead;
    the misses are counted from the second step's issue on."""
    cfg = load_config(ROOT / f"configs/{config}.yaml", [*overrides, "steps=4", f"schedule.scheduler={scheduler}"])
    rt = build_runtime(cfg)
    step, batches = rt.step, rt.batches()
    misses, jax_log = _Misses(), logging.getLogger("jax")
    before = jax_log.level
    jax_log.addHandler(misses)
    # every miss is logged at WARNING (tracing and persistent-cache misses with
    # jax_explain_cache_misses, each compile with jax_log_compiles): at DEBUG, jax would also format
    # a line for every trace, lowering and cache hit of the steps
    jax_log.setLevel(logging.WARNING)
    jax.config.update("jax_log_compiles", True)
    try:
        step.compile(range(cfg.steps), say=lambda _: None)
        compiled_ahead = len(misses.messages)
        state = step.init()
        for i in range(cfg.steps):
            if i == 1:
                # explained from the second step on: each explanation scans the process's tracing
                # caches, which in a long test process hold thousands of entries (the ahead
                # compiles' misses, explained, took this test from 10 s to 40 s there)
                jax.config.update("jax_explain_cache_misses", True)
                first = len(misses.messages)
            state, metrics = step(state, StepBatch(batches[i]))
            jax.block_until_ready((metrics.loss, state))
        later = misses.messages[first:]
        _probe(time.time_ns())  # a function never seen, a program never compiled: each kind of miss logged
        probed = misses.messages[first + len(later) :]
    finally:
        jax.config.update("jax_explain_cache_misses", False)
        jax.config.update("jax_log_compiles", False)
        jax_log.removeHandler(misses)
        jax_log.setLevel(before)
    assert compiled_ahead > 0, "the check sees the ahead compiles (the log is wired)"
    assert later == [], later
    for kind in ("TRACING CACHE MISS", "COMPILATION CACHE MISS", "Compiling "):
        assert any(kind in m for m in probed), (kind, probed)


def _probe(stamp: int) -> None:
    """A program of its own (`stamp` is a constant in it, so no cache holds it): the three kinds of
    miss the test counts are each logged for it, so an empty list above means none happened."""
    jax.block_until_ready(jax.jit(lambda x: x + stamp % 1000003)(1))
