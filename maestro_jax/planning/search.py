"""The plan search: the best plans of a planning problem by simulated step time, and its baselines.

Plain Python, no JAX. `search(problem)` scores the plans of `space.PlanSpace` with the wavefront
scheduler and the simulator under the analytic cost model (`Pricer.step_time`). Branch and
bound, exact up to a stated gap: candidates are simulated in order of a lower bound on their
step time (`bounds.Bounds`), and a plan is skipped only when its bound shows it cannot beat the
K-th best simulated time by more than `tolerance` (default 1%; 0 finds the exact optimum, which
`tests/test_planner.py` checks against exhaustive search). Candidates are generated under a
threshold that starts at the floor of every plan and rises in small steps, falling to the best
times found so far, so large clusters, many sections and the thousands of near-equal plans of a
small workload do not enumerate every split. The search runs once per stash bound (the
configured one and each smaller power of two) and with and without run-ahead; the baselines
(`baselines.BASELINES`) are priced beside it, and the layouts of the fair monolithic and the
pipelined ones are scored as plans too (`points`), so the search never does worse than either.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Callable, Sequence

from maestro_jax.core.plan import Plan
from maestro_jax.planning.baselines import price_baselines
from maestro_jax.planning.layout import peak_memory
from maestro_jax.planning.options import tiebreak_section
from maestro_jax.planning.points import monolithic_point, pipelined_point
from maestro_jax.planning.pricer import Pricer, plan_key
from maestro_jax.planning.problem import PlanningProblem
from maestro_jax.planning.report import Candidate, InfeasibleError, PlanReport
from maestro_jax.planning.space import Limit, PlanSpace

TOLERANCE = 0.01  # default relative gap: plans that could beat the K-th best by less are not simulated
TIE = 1e-9  # relative: a plan whose bound is this close to the K-th best time can at best tie it
_GROWTH = 1.02  # the search's threshold, from the smallest bound up, grows by this factor per pass (a pass
# under a tight threshold is cheap: the floors prune partial plans early)
_REFRESH = 256  # candidates generated between two refreshes of the incumbent the generation prunes against

Progress = Callable[[str], None]


def search(
    problem: PlanningProblem,
    pricer: Pricer | None = None,
    *,
    top: int = 10,
    tolerance: float = TOLERANCE,
    progress: Progress | None = None,
    space: PlanSpace | None = None,
    baselines: Sequence[str] | None = None,
) -> PlanReport:
    """The best plan of `problem` and the `top` runners-up by simulated step time, over the stash
    bound too: `max_in_flight` as configured and each smaller power of two (a smaller bound holds
    fewer residuals, which co-located sections share their memory with; sections that share
    devices lose no overlap by it), and, with `run_ahead`, without it too (its stash may not fit
    where the plan without it does). Ties keep the configured settings. `pricer`: the problem's
    (one of another problem's `for_problem` keeps its prices); `progress` receives one line per
    pass and one before the baselines; `space`: the problem's plan space, when one is at hand;
    `baselines`: the names of those to price beside (`baselines.BASELINES`; None: all, and both
    layouts scored as plans; `()`: none, where a caller has priced them already)."""
    space = space or PlanSpace(pricer or Pricer(problem))
    if space.problem is not problem:
        raise ValueError("search(problem, ...): the pricer or space prices another problem")
    progress = progress or (lambda line: None)
    tolerance = max(tolerance, TIE)
    scored, considered, simulated = [], 0, 0
    for ahead in dict.fromkeys([problem.run_ahead, 0]):
        for f in _stash_bounds(problem.max_in_flight):
            same = f == problem.max_in_flight and ahead == problem.run_ahead
            here = space if same else space.with_problem(problem.replace(max_in_flight=f, run_ahead=ahead))
            found, count, ran = best_plans(here, top, _kth(scored, top), tolerance, progress)
            scored, considered, simulated = scored + found, considered + count, simulated + ran
    if baselines is None or baselines:
        progress(f"baselines on {problem.devices} devices: the monolithic layout and the pipelined (1F1B) one")
    priced = price_baselines(space.pricer, baselines)
    monolithic, pipelined = priced.get("monolithic"), priced.get("pipelined")
    # both baselines' layouts are in the plan space (where sections may share devices: both
    # co-locate them): the search within `tolerance` never does worse
    points = (
        monolithic_point(space.pricer, monolithic),
        pipelined_point(space.pricer, pipelined and pipelined.to_json()),
    )
    points = points if problem.colocate else ()
    scored = _listed(scored + [p for p in points if p is not None])
    if not scored:
        raise InfeasibleError(infeasible_message(space))
    best = scored[0]
    return PlanReport(best, scored[:top], considered, simulated, priced, *spent(space.pricer, best))


def _stash_bounds(most: int) -> list[int]:
    """The stash bounds the search tries: `most`, then each smaller power of two, largest first."""
    powers = [2**i for i in range(int(math.log2(max(most - 1, 1))) + 1)]
    return [most] + [f for f in powers[::-1] if f < most]


def _kth(scored: list[Candidate], top: int) -> float:
    """The `top`-th best time among the distinct plans of `scored` (each at its fastest): what a
    later search must beat to enter the list."""
    fastest: dict = {}
    for c in scored:
        fastest[plan_key(c.plan)] = min(fastest.get(plan_key(c.plan), math.inf), c.step_time_s)
    return sorted(fastest.values())[top - 1] if len(fastest) >= top else math.inf


def _listed(scored: list[Candidate]) -> list[Candidate]:
    """`scored` best first, a plan that fits under several stash bounds once, at its fastest
    (a stable sort: the configured settings first among equals)."""
    scored = sorted(scored, key=lambda c: (c.step_time_s, tiebreak(c.plan)))
    seen: set = set()
    return [c for c in scored if not (plan_key(c.plan) in seen or seen.add(plan_key(c.plan)))]


def spent(pricer: Pricer, c: Candidate) -> tuple[dict, dict]:
    """Where candidate `c`'s device time goes (`Pricer.device_time`), priced as it was scored:
    its stash bound and run-ahead, its sections cut as it cuts them."""
    problem = pricer.problem.replace(max_in_flight=c.max_in_flight, run_ahead=c.run_ahead)
    if c.cuts:
        return Pricer(problem.replace(spec=problem.spec.with_cuts(c.cuts), stage_counts=())).device_time(c.plan)
    return pricer.for_problem(problem).device_time(c.plan)


def best_plans(
    space: PlanSpace,
    top: int,
    incumbent: float = math.inf,
    tolerance: float = TOLERANCE,
    progress: Progress | None = None,
) -> tuple[list[Candidate], int, int]:
    """The `top` best plans of `space` (at its problem's stash bound) that could enter a top list
    whose K-th best is `incumbent` (from the searches under other stash bounds), how many plans
    passed every constraint under the final threshold and how many were simulated.

    Branch and bound. Candidates under a bound threshold (from the smallest bound any plan
    could have, up in small steps) are generated; as soon as `top` of them are simulated (the
    best-bounded so far), the slowest of those becomes the limit the generation prunes
    against, so plans that could at best tie it are never built (a tiny workload has
    thousands that tie). The rest are simulated in order of their bound, and once the next
    bound shows that no remaining candidate can beat the K-th best by more than `tolerance`,
    the search stops (ties keep the first found). If the threshold fell short of that time,
    it grows and the search goes on (already simulated plans are not simulated again)."""
    p = space.problem
    (progress or (lambda line: None))(
        f"searching plans on {p.devices} devices with {p.memory_gb:g} GB each: "
        f"schedule.max_in_flight {p.max_in_flight}, schedule.run_ahead {p.run_ahead}"
    )
    if next(space.candidates(), None) is None:  # no plan at all: the passes below would never end early
        return [], 0, 0
    floors = {s: space.sections.floor(s, p.devices, p.budget_bytes, False) for s in p.spec.order}
    first = max(space.bounds.combine([o.bound for o in floors.values()]), space.bounds.chain(floors))
    threshold = first / (1 - tolerance)
    while True:
        scored, considered = scored_under(space, threshold, top, incumbent, tolerance)
        kth = min(incumbent, scored[top - 1].step_time_s if len(scored) >= top else math.inf)
        if kth * (1 - tolerance) <= threshold or threshold == math.inf:
            return scored[:top], considered, len(scored)
        # a small step: each pass builds every plan under its threshold, and the best-bounded
        # of them set the limit that prunes the rest; a pass that built none doubles it (the
        # bounds of the feasible plans may lie far above the floors, where parallelism the
        # sections cannot use leaves devices they cannot fill)
        threshold = min(kth, (_GROWTH if considered else 2.0) * threshold)
        if threshold > 1e6 * first:
            threshold = math.inf


def scored_under(
    space: PlanSpace, threshold: float, top: int, incumbent: float, tolerance: float
) -> tuple[list[Candidate], int]:
    """One pass of `best_plans`: the plans it simulated, best first, and how many it generated."""
    limit = Limit(min(threshold, incumbent * (1 - tolerance)))
    pending: list[tuple] = []  # (bound, order found, plan, memory): a heap
    scored: list[Candidate] = []
    ranks: list[tuple] = []  # (step time, tiebreak) of each scored candidate, in order: where the next goes

    def score(plan: Plan, mem: dict) -> None:
        c = _candidate(space.pricer, plan, mem)
        rank = (c.step_time_s, tiebreak(plan))
        at = bisect.bisect_right(ranks, rank)  # after its equals, as a stable sort puts it
        ranks.insert(at, rank)
        scored.insert(at, c)
        if len(scored) >= top:
            limit.value = min(limit.value, scored[top - 1].step_time_s * (1 - tolerance))

    considered = 0
    for plan, mem, bound in space.candidates(threshold=limit):
        heapq.heappush(pending, (bound, considered, plan, mem))
        considered += 1
        while len(scored) < top and len(pending) >= top and pending[0][0] <= limit.value:  # an incumbent
            score(*heapq.heappop(pending)[2:])
        if considered % _REFRESH == 0 and pending and pending[0][0] < limit.value:
            score(*heapq.heappop(pending)[2:])  # a better incumbent: the best-bounded found since
    while pending and pending[0][0] <= limit.value:
        score(*heapq.heappop(pending)[2:])
    return scored, considered


def _candidate(pricer: Pricer, plan: Plan, mem: dict) -> Candidate:
    """`plan` scored: its simulated step time, rate, memory and the settings it was priced under."""
    p = pricer.problem
    t = pricer.step_time(plan)
    return Candidate(
        plan,
        t,
        p.global_batch / t / p.devices,
        {s: m["total"] / 2**30 for s, m in mem.items()},
        p.max_in_flight,
        peak_memory(plan, mem) / 2**30,
        p.run_ahead,
        p.spec.staged(pricer.stage_counts(plan)).stages,
    )


def infeasible_message(space: PlanSpace) -> str:
    """Why `space` holds no plan, as one line naming the flag to change and a value that works."""
    p = space.problem
    if next(space.candidates(budget=math.inf), None) is None:  # not for lack of memory
        return (
            f"--devices {p.devices}: no device split satisfies the mesh and divisibility "
            f"constraints for global_batch={p.global_batch}; try another device count"
        )
    peaks = [peak_memory(plan, mem) for plan, mem, _ in space.candidates(budget=math.inf, lightest=True)]
    more = next(
        (
            n
            for n in (2 * p.devices, 4 * p.devices)
            if next(space.with_problem(p.replace(devices=n)).candidates(), None)
        ),
        None,
    )
    alt = f", or --devices {more} at --memory-gb {p.memory_gb:g}" if more else ""
    return (
        f"--memory-gb {p.memory_gb:g}: no plan on {p.devices} devices fits in memory; the smallest feasible "
        f"request is --memory-gb {_ceil_significant(min(peaks) / 2**30):g} at --devices "
        f"{p.devices}{alt}"
    )


def _ceil_significant(x: float, digits: int = 3) -> float:
    """`x` rounded up to `digits` significant digits (a request that surely fits)."""
    scale = 10 ** (digits - 1 - math.floor(math.log10(x)))
    return math.ceil(x * scale) / scale


def tiebreak(plan: Plan):
    """Equal predicted times: prefer fewer tensor, context and expert shards, then smaller
    micro-batches (less memory), then less recomputation."""
    return tuple(tiebreak_section(sp) for sp in plan.sections.values())
