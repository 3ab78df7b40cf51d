"""Run-ahead (`schedule.run_ahead: 1`): frozen sections that read only data compute the next
global batch during this step. Which sections qualify, that the step it feeds is the monolithic
step (and bit for bit the step without run-ahead), that training resumes bit-exactly, and that
the simulator and planner price the steady state it buys."""

import dataclasses

import jax
import numpy as np
import pytest
from conftest import ROOT, TINY_KD

from maestro_jax.config import load_config
from maestro_jax.core.plan import EdgeInfo
from maestro_jax.planning.simulator import simulate
from maestro_jax.runtime.build import build_runtime
from maestro_jax.runtime.step import StepBatch
from maestro_jax.schedule import Op, Problem, SampleMeta, naive, steady_order, wavefront
from maestro_jax.tools.plan import planner_for
from maestro_jax.tools.verify import compare
from maestro_jax.training.loop import train

KD = ROOT / "configs/kd_tiny.yaml"
AHEAD = ["schedule.run_ahead=1"]


def _problem(trained, edges, run_ahead=1, **dp):
    order = tuple(dp)
    return Problem(
        order=order,
        sink=order[-1],
        trained=frozenset(trained),
        edges=tuple(EdgeInfo(f"{a}>{b}", a, b) for a, b in edges),
        rows=dict(dp),
        dp=dict(dp),
        run_ahead=run_ahead,
    )


def test_only_frozen_sections_that_read_data_run_ahead():
    # vlm_kd's shape: a frozen encoder feeds a frozen teacher and the trained student
    p = _problem(
        {"student"},
        [("vision", "teacher"), ("vision", "student"), ("teacher", "student")],
        vision=1,
        teacher=1,
        student=1,
    )
    assert p.ahead == {"vision", "teacher"}
    # a frozen section behind a trained one reads trained weights' output: it waits for its step
    p = _problem({"encoder", "llm"}, [("encoder", "projector"), ("projector", "llm")], encoder=1, projector=1, llm=1)
    assert p.ahead == frozenset()
    assert _problem({"student"}, [("teacher", "student")], run_ahead=0, teacher=1, student=1).ahead == frozenset()
    ops = [Op("F", "teacher", 0), Op("X", "teacher", 0, "teacher>student"), Op("F", "student", 0)]
    p = _problem({"student"}, [("teacher", "student")], teacher=1, student=1)
    assert steady_order(ops, p) == [(ops[2], False), (ops[0], True), (ops[1], True)]


@pytest.mark.parametrize("scheduler", ["naive", "wavefront"])
@pytest.mark.slow
def test_a_step_fed_ahead_is_the_monolithic_step(scheduler):
    """The teacher's forwards for batch 1, issued before step 0's update and kept until step 1:
    step 1's loss and grads equal the monolithic step's (1e-5) and the step computed without
    run-ahead bit for bit."""
    cfg = load_config(KD, TINY_KD + AHEAD + [f"schedule.scheduler={scheduler}"])
    rt = build_runtime(cfg)
    assert rt.problem.ahead == {"teacher"}
    step = rt.step
    state = step.init()
    batches = rt.batches()
    first, second = batches[0], batches[1]
    ahead = step.run_ahead(state, second)  # issued during step 0
    state, _ = step(state, first)
    fed_loss, fed, _ = step.gradients(state, StepBatch(second, ahead=ahead))
    plain_loss, plain, _ = step.gradients(state, second)
    assert np.array_equal(np.asarray(fed_loss), np.asarray(plain_loss))
    for a, b in zip(jax.tree.leaves(fed), jax.tree.leaves(plain), strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))

    mono = rt.monolithic.step
    m_state, _ = mono(mono.init(), first)
    m_loss, m_grads, _ = mono.gradients(m_state, second)
    assert compare("loss", fed_loss, m_loss).max_rel <= 1e-5
    assert compare("student", fed["student"], m_grads["student"]).max_rel <= 1e-5


@pytest.mark.slow
def test_training_with_run_ahead_resumes_bit_exactly(tmp_path):
    """Stopped after step 2 and resumed, a run-ahead run gives the uninterrupted run's losses bit
    for bit, and so does a run without run-ahead: the work done ahead is recomputed after a
    restart, never saved."""
    base = TINY_KD + ["checkpoint_every=2", "schedule.scheduler=wavefront"]

    def cfg(out, steps, extra=()):
        return load_config(KD, base + list(extra) + [f"output_dir={out}", f"steps={steps}"])

    straight = train(cfg(tmp_path / "a", 4, AHEAD), progress=False)
    first = train(cfg(tmp_path / "b", 2, AHEAD), progress=False)
    resumed = train(cfg(tmp_path / "b", 4, AHEAD), progress=False)
    without = train(cfg(tmp_path / "c", 4), progress=False)
    assert [r["step"] for r in first + resumed] == [1, 2, 3, 4]
    losses = [r["train/loss"] for r in straight]
    assert [r["train/loss"] for r in first + resumed] == losses
    assert [r["train/loss"] for r in without] == losses
    assert [r["sample_ids"] for r in first + resumed] == [r["sample_ids"] for r in straight]


def test_steady_state_overlaps_the_teacher_with_the_student():
    """A frozen teacher on its own devices feeding a trained student: without run-ahead the
    student's first forward waits for the teacher's first micro-step; with it, a step lasts as
    long as its busier device group."""
    metas = [SampleMeta(frozenset({"teacher", "student"}), {"teacher": 50, "student": 50}) for _ in range(8)]
    plain = _problem({"student"}, [("teacher", "student")], run_ahead=0, teacher=2, student=2)
    ahead = dataclasses.replace(plain, run_ahead=1)
    for scheduler in (naive, wavefront):
        t0 = simulate(scheduler(metas, plain), plain, metas)
        t1 = simulate(scheduler(metas, ahead), ahead, metas)
        busy = t1.group_busy
        assert t1.makespan == pytest.approx(max(busy.values()))
        assert t1.makespan < t0.makespan
        assert busy == pytest.approx(t0.group_busy), "the same work, moved in time"


def test_the_planner_prices_run_ahead_and_counts_its_stash():
    """Asked for run-ahead, the planner's best KD plan on disjoint devices is faster than without
    it, and the student's memory holds the next batch's teacher outputs."""
    cfg = load_config(KD, TINY_KD + ["simulate.device=cpu"])
    plain = planner_for(cfg, 8, 1.0)
    ahead = planner_for(load_config(KD, TINY_KD + ["simulate.device=cpu"] + AHEAD), 8, 1.0)
    plan = plain.search().best.plan
    assert ahead.step_time(plan) <= plain.step_time(plan)
    mem_plain, mem_ahead = plain.check(plan)["student"], ahead.check(plan)["student"]
    assert mem_ahead["held"] > mem_plain["held"]
    best = ahead.search()
    assert best.best.step_time_s <= plain.search().best.step_time_s
    assert best.best.run_ahead in (0, 1)
