"""The planning question as one value (`planning.problem.PlanningProblem`): built once per command,
changed with `replace`, and a planner of it the planner 0.3.0's arguments built."""

import dataclasses

import pytest
from conftest import ROOT

from maestro_jax.config import load_config
from maestro_jax.planning.planner import Planner
from maestro_jax.planning.problem import PlanningProblem
from maestro_jax.tools.plan import planner_for, problem_for

KD = ROOT / "configs/kd_tiny.yaml"
H100 = ["simulate.device=h100"]


def test_a_problem_is_frozen_and_replace_keeps_the_rest():
    problem = problem_for(load_config(KD, [*H100, "schedule.max_in_flight=2"]), 8, 1.0)
    assert problem.max_in_flight == 2 and problem.devices == 8 and problem.budget_bytes == 2**30
    assert isinstance(problem.metas, tuple) and problem.stage_counts == ()
    with pytest.raises(dataclasses.FrozenInstanceError):
        problem.devices = 16
    wider = problem.replace(devices=16, stage_counts=[2, 4])
    assert (wider.devices, wider.stage_counts, problem.devices) == (16, (2, 4), 8)
    assert wider.spec is problem.spec and wider.metas is problem.metas


def test_the_planner_of_a_problem_is_the_one_its_arguments_built():
    """`Planner(problem)` and 0.3.0's `Planner(spec, metas, devices, memory_gb, ...)` search to the
    same report; the problem alone is taken, never beside its fields."""
    problem = problem_for(load_config(KD, H100), 8, 1.0)
    legacy = Planner(
        problem.spec,
        list(problem.metas),
        8,
        1.0,
        global_batch=problem.global_batch,
        device="h100",
        link_gbps=problem.link_gbps,
        max_in_flight=problem.max_in_flight,
    )
    assert legacy.problem == problem
    a, b = Planner(problem).search(top=3), legacy.search(top=3)
    assert [c.step_time_s for c in a.top] == [c.step_time_s for c in b.top]
    assert a.best.plan == b.best.plan and a.monolithic == b.monolithic
    with pytest.raises(TypeError, match="problem alone"):
        Planner(problem, devices=16)


def test_planners_with_other_settings_share_the_commands_problem():
    planner = planner_for(load_config(KD, H100), 8, 1.0, stage_counts=(2,))
    other = planner._with(4, max_in_flight=1)
    assert other.problem == planner.problem.replace(devices=4, max_in_flight=1)
    cut = planner._of(planner.spec, planner.metas)
    assert cut.problem == planner.problem.replace(run_ahead=0, stage_counts=())
    assert isinstance(cut.problem, PlanningProblem)
