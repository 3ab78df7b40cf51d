"""Schedules reused across steps (`schedule.memo`, issue 77 part 2): a batch whose samples ask what
an earlier batch's asked gets the earlier schedule, which is the one the scheduler computes again."""

import dataclasses
import random

import pytest
from conftest import ROOT, TINY_KD
from test_wavefront import DAG_CASES, PROBLEMS, dag_batch, random_batch

from maestro_jax.config import load_config
from maestro_jax.schedule import SampleMeta, naive, sample_metas, wavefront
from maestro_jax.schedule.memo import ScheduleMemo, signature


def counted(scheduler, problem):
    calls = []

    def compute(metas):
        calls.append(len(metas))
        return scheduler(metas, problem)

    return compute, calls


def copies(metas):
    """Equal metas, other objects (as the next step's samples give them)."""
    return [SampleMeta(frozenset(m.sections), dict(m.work)) for m in metas]


@pytest.mark.parametrize("scheduler", [wavefront, naive], ids=["wavefront", "naive"])
def test_a_repeated_signature_gets_the_schedule_the_scheduler_computes_again(scheduler):
    """On the VLM problems and every DAG case: the memo's answer equals a fresh schedule, a batch
    of equal metas (new objects) is answered without scheduling, and a batch that differs in one
    sample's work or active sections is scheduled anew."""
    rng = random.Random(3)
    cases = [(random_batch(rng, 16, 0.5), p) for p in PROBLEMS]
    cases += [(dag_batch(rng, p, s, 16, 0.5), p) for s, p in DAG_CASES.values()]
    for metas, problem in cases:
        compute, calls = counted(scheduler, problem)
        memo = ScheduleMemo(compute, scheduler.__name__, problem)
        first = memo(metas)
        assert first == scheduler(metas, problem)
        assert memo(copies(metas)) is first and calls == [len(metas)]
        busiest = max(range(len(metas)), key=lambda i: sum(metas[i].work.values()))
        more = dict(metas[busiest].work)
        section = next(iter(more))
        more[section] += 1
        other = [*metas[:busiest], SampleMeta(metas[busiest].sections, more), *metas[busiest + 1 :]]
        assert signature(other) != signature(metas)
        assert memo(other) == scheduler(other, problem) and len(calls) == 2
        assert (memo.hits, memo.misses) == (1, 2)


def test_the_least_recently_used_signature_is_dropped_past_the_capacity():
    rng = random.Random(5)
    problem = PROBLEMS[0]
    batches = [random_batch(rng, 8 + 4 * i, 0.5) for i in range(3)]
    compute, calls = counted(wavefront, problem)
    memo = ScheduleMemo(compute, "wavefront", problem, capacity=2)
    for metas in (batches[0], batches[1], batches[0], batches[2]):  # batches[1] is now the oldest
        memo(metas)
    assert len(calls) == 3
    memo(batches[0])
    assert len(calls) == 3
    memo(batches[1])
    assert len(calls) == 4
    with pytest.raises(ValueError, match="capacity=0; valid: at least 1"):
        ScheduleMemo(compute, "wavefront", problem, capacity=0)


def test_the_runtime_schedules_a_batch_like_an_earlier_one_once():
    """kd_tiny: the same samples under other ids (the next step's, of the same lengths) get the
    first batch's schedule, scheduled once; another scheduler or a changed problem gets a memo of
    its own."""
    from maestro_jax.runtime.build import build_runtime

    rt = build_runtime(load_config(ROOT / "configs/kd_tiny.yaml", [*TINY_KD, "schedule.scheduler=wavefront"]))
    batch = rt.batches()[0]
    later = [dataclasses.replace(s, id=s.id + 1000) for s in batch]
    first = rt.schedule(batch)
    assert rt.schedule(later) is first
    assert first == wavefront(sample_metas(rt.graph, later), rt.problem)
    memo = rt._schedules
    assert (memo.hits, memo.misses) == (1, 1)
    rt.cfg = rt.cfg.model_copy(update={"schedule": rt.cfg.schedule.model_copy(update={"scheduler": "naive"})})
    assert rt.schedule(later) == naive(sample_metas(rt.graph, later), rt.problem)
    assert rt._schedules is not memo and rt._schedules.scheduler == "naive"
