"""The planning question as one value (`planning.problem.PlanningProblem`): built once per command,
changed with `replace`, and a planner of it the planner 0.3.0's arguments built."""

import dataclasses

import pytest
from conftest import ROOT

from maestro_jax.config import load_config
from maestro_jax.planning.planner import Planner
from maestro_jax.planning.pricer import Pricer
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


def test_a_pricer_for_a_changed_problem_keeps_the_prices_it_leaves_valid():
    """`Pricer.for_problem`: a stash bound or device count leaves every layout's cost and bound
    valid (shared, and equal to a fresh pricer's); other batches leave only the weights; the step
    time is the changed problem's own. A planner refuses a pricer of another problem."""
    problem = problem_for(load_config(KD, H100), 8, 1.0)
    base = Pricer(problem)
    plan = Planner(problem, pricer=base).search(top=1).best.plan
    t = base.step_time(plan)
    tighter = problem.replace(max_in_flight=1)
    kept = base.for_problem(tighter)
    assert kept._prices is base._prices and kept._weights is base._weights
    fresh = Pricer(tighter)
    assert kept.step_time(plan) == fresh.step_time(plan)
    assert kept.check(plan) == fresh.check(plan)
    for s, sp in plan.sections.items():
        assert kept.price(s, sp) == fresh.price(s, sp)
    assert base.step_time(plan) == t  # its own answer, not the changed problem's
    fewer = base.for_problem(problem.replace(metas=problem.metas[:1]))
    assert fewer._weights is base._weights and fewer._prices is not base._prices
    with pytest.raises(ValueError, match="another problem"):
        Planner(tighter, pricer=base)


def test_the_staged_pricer_prices_each_stage_as_a_section():
    """`Pricer.staged`: the workload with a section in stages, its prices shared by every stash
    bound's pricer of the same batches, and a staged plan's step time the staged pricer's."""
    problem = problem_for(load_config(KD, H100), 8, 4.0, stage_counts=(2,))
    base = Pricer(problem)
    staged = base.staged({"student": 2})
    assert set(staged.problem.spec.sections) == {"teacher", "student.0", "student.1"}
    assert staged.problem.run_ahead == 0 and staged.problem.stage_counts == ()
    other = base.for_problem(problem.replace(max_in_flight=1)).staged({"student": 2})
    assert other._prices is staged._prices and other.problem.max_in_flight == 1
    planner = Planner(problem, pricer=base)
    plan = next(p for p, _, _ in planner.candidates() if base.stage_counts(p))
    assert base.step_time(plan) == staged.step_time(plan)


def test_search_is_a_function_of_the_problem_and_colocate_keeps_sections_apart():
    """`search(problem)` gives `Planner(problem).search()`'s report; a pricer of another problem
    is refused; `colocate=False` searches plans whose sections each have devices of their own,
    none faster than the best of the whole space (it holds them)."""
    from maestro_jax.planning.search import search
    from maestro_jax.planning.space import PlanSpace

    problem = problem_for(load_config(KD, H100), 8, 1.0)
    a, b = search(problem, top=3), Planner(problem).search(top=3)
    assert [c.step_time_s for c in a.top] == [c.step_time_s for c in b.top]
    assert a.best.plan == b.best.plan and a.baselines == b.baselines
    with pytest.raises(ValueError, match="another problem"):
        search(problem.replace(devices=4), Pricer(problem))
    apart = problem.replace(colocate=False)
    assert all(len(p) == len(problem.spec.order) for p in PlanSpace(Pricer(apart)).placements())
    split = search(apart, top=3, baselines=())  # none priced: the disaggregated plans alone, as the sweep asks
    assert split.baselines == {} and split.monolithic is None
    for c in split.top:
        ranges = [set(sp.devices) for sp in c.plan.sections.values()]
        assert all(not (x & y) for i, x in enumerate(ranges) for y in ranges[i + 1 :]), c.describe()
    assert split.best.step_time_s >= a.best.step_time_s * (1 - 0.01)
