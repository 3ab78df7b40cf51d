"""The planner's bounds on a user's 4-section DAG (a trained chain and a frozen teacher into one
sink), priced for H100s, where sections run side by side: every candidate's bound (its sections'
own work, the dependency paths, each device group's turns) is at most its simulated step time
(what makes pruning exact), with and without a teacher running ahead; the floors a partial plan
is pruned on bound every option, also when sections share devices; the exact search
(tolerance 0) finds the exhaustive optimum; and at 64 devices the search simulates a few dozen
of the graph's millions of plans."""

import math
import sys

import pytest
from conftest import ROOT, paper_spec

import maestro_jax as mj
from maestro_jax.config import load_config
from maestro_jax.planning import search as plan_search
from maestro_jax.planning.planner import InfeasibleError
from maestro_jax.tools.plan import planner_for

sys.path.insert(0, str(ROOT / "examples"))
import four_sections


def four_section_planner(devices: int, run_ahead: int = 0, tolerance: float = 0.0, global_batch: int = 8):
    trainer = mj.Trainer(
        four_sections.config(
            global_batch=global_batch, simulate={"device": "h100", "batches": 1}, schedule={"run_ahead": run_ahead}
        ),
        four_sections.graph(),
        four_sections.PictureCaptions(),
        modalities=(four_sections.PICTURE,),
        vocab=four_sections.VOCAB,
    )
    return planner_for(
        trainer.config, devices, 80.0, graph=trainer.graph, source=trainer.runtime.source, tolerance=tolerance
    )


@pytest.fixture(scope="module")
def planner():
    return four_section_planner(2)


@pytest.mark.slow
@pytest.mark.parametrize("devices,run_ahead,every", [(2, 0, 11), (4, 0, 397), (4, 1, 397)])
@pytest.mark.extended
def test_bounds_hold_and_bind(devices, run_ahead, every):
    planner = four_section_planner(devices, run_ahead)
    assert any(pivot == "teacher" for *_, pivot in planner._paths), "the teacher is a pivot of its path"
    assert bool(planner._ahead) == bool(run_ahead)
    everything = list(planner.candidates())
    assert len(everything) > 100
    binding = 0
    for plan, _, bound in everything[::every]:
        t = planner.step_time(plan)
        assert bound <= t * (1 + 1e-9), plan
        binding += bound > 0.99 * t
    assert binding > 0, "some bounds are tight (else they prune nothing)"


def test_floors_bound_every_budget_share():
    """Where memory forces fsdp (the paper-scale VLM on 80 GB), a section sharing its devices picks
    from more layouts (`SectionOptions.shared`, each at a share of the budget) than the full-budget
    options the floors are taken over: none of them goes below a floor."""
    p = planner_for(load_config(ROOT / "configs/vlm_paper_scale.yaml"), 16, 80.0, spec=paper_spec("vlm"))
    fields = ("bound", "forward", "backward", "forwards", "backwards")
    forced, compared = False, 0
    for s in p.spec.order:
        for n in (4, 8, 16):
            floor = p.sections.floor(s, n, p.budget, False)
            shared = [o for m in range(1, n + 1) for o in p.sections.shared(s, m, p.budget, False, 2)]
            if not shared:  # nothing fits on so few devices: the floor is infinite
                assert math.isinf(floor.bound)
                continue
            compared += 1
            forced |= any(o.plan.axis_sizes["fsdp"] > 1 for o in shared)
            for f in fields:
                assert getattr(floor, f) <= min(getattr(o, f) for o in shared) * (1 + 1e-12), (s, n, f)
    assert compared >= 3 and forced, "some shares force fsdp"


def test_search_at_64_devices_simulates_few_plans():
    """The graph's many near-equal plans (every micro-step costs about its fixed overhead) are
    what the floors of partial plans and the turn bound prune: a few dozen are simulated."""
    report = four_section_planner(64, tolerance=0.01, global_batch=64).search(10)
    assert report.simulated < 200, report.simulated
    assert report.best.step_time_s <= report.monolithic["step_time_s"]


@pytest.mark.slow
def test_no_plan_at_all_is_said_before_any_pass(monkeypatch):
    """8 samples cannot fill 64 devices when no section's weights split over `tensor` (the graph's
    modules name no logical axes): the search says so at once instead of raising its threshold
    pass after pass towards infinity (each pass finding nothing)."""
    planner = four_section_planner(64, tolerance=0.01)
    passes = []
    monkeypatch.setattr(plan_search, "scored_under", lambda *a: passes.append(a) or ([], 0))
    with pytest.raises(InfeasibleError, match="global_batch=8"):
        planner.search(10)
    assert passes == []


@pytest.mark.slow
@pytest.mark.extended  # exhaustive; CI keeps the pruned-vs-exhaustive kd cases
def test_exact_search_finds_the_exhaustive_optimum(planner):
    """Against every plan whose bound leaves it a chance (the bounds themselves are checked above)."""
    found, _, simulated = planner._search(3)
    everything = list(planner.candidates())
    brute = sorted(planner.step_time(plan) for plan, _, bound in everything if bound <= 1.5 * found[-1].step_time_s)
    assert [c.step_time_s for c in found] == pytest.approx(brute[:3], rel=1e-12)
    assert simulated < len(everything) / 10, "the bounds pruned most plans"
