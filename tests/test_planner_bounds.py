"""The planner's dependency bounds on a user's 4-section DAG (a trained chain and a frozen teacher
into one sink), priced for H100s, where sections run side by side: every candidate's bound is at
most its simulated step time (what makes pruning exact), and the exact search (tolerance 0)
finds the exhaustive optimum."""

import sys

import pytest
from conftest import ROOT

import maestro_jax as mj
from maestro_jax.tools.plan import planner_for

sys.path.insert(0, str(ROOT / "examples"))
import four_sections


@pytest.fixture(scope="module")
def planner():
    trainer = mj.Trainer(four_sections.config(simulate={"device": "h100", "batches": 1}), four_sections.graph(),
                         four_sections.PictureCaptions())
    return planner_for(trainer.config, 2, 80.0, graph=trainer.graph, source=trainer.runtime.source, tolerance=0.0)


def test_dependency_bounds_hold_and_bind(planner):
    assert any(pivot == "teacher" for *_, pivot in planner._paths), "the teacher is a pivot of its path"
    everything = list(planner.candidates())
    assert len(everything) > 100
    binding = 0
    for plan, _, bound in everything[::11]:
        t = planner.step_time(plan)
        assert bound <= t * (1 + 1e-9), plan
        binding += bound > 0.99 * t
    assert binding > 0, "some bounds are tight (else they prune nothing)"


def test_exact_search_finds_the_exhaustive_optimum(planner):
    """Against every plan whose bound leaves it a chance (the bounds themselves are checked above)."""
    found, _, simulated = planner._search(3)
    everything = list(planner.candidates())
    brute = sorted(planner.step_time(plan) for plan, _, bound in everything if bound <= 1.5 * found[-1].step_time_s)
    assert [c.step_time_s for c in found] == pytest.approx(brute[:3], rel=1e-12)
    assert simulated < len(everything) / 10, "the bounds pruned most plans"
