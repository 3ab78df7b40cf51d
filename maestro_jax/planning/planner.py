"""Planner: choose each section's devices, mesh, micro-batch and residual policy.

Plain Python, no JAX. It reads a workload's `WorkloadSpec` (its graph's parameter shapes and
declared costs, any DAG of sections) and sample metadata, enumerates candidate plans, drops
those that break a constraint (through the same `plan.check_plan` the runtime runs, with the
memory model below), and scores the rest with the wavefront scheduler and the simulator under
the analytic cost model. Search is branch and bound, exact up to a stated gap: candidates
are simulated in order of a lower bound on their step time, and a plan is skipped only when
its bound shows it cannot beat the K-th best simulated time by more than `tolerance` (default
1%; 0 finds the exact optimum, which `tests/test_planner.py` checks against exhaustive
search). The bounds: no section finishes before its own work (its micro-steps, then its
optimizer step) is done, co-located sections take turns, along a path of edges into the sink a
sample's forwards, the sink's loss and the backwards run one after another (`bounds.Bounds.chain`),
and each device group runs its sections' forwards, backwards and optimizer steps one at a time,
none before the least time any of them waits for nor later than the least time still to follow
(`bounds.Bounds.turns`). A partial plan is bounded with
every section not chosen yet at its floor on the devices left to it, so whole subtrees go at
once. Candidates are generated under a threshold that starts at the floor of every plan and
rises in small steps, falling to the best times found so far, so large clusters, many sections
and the thousands of near-equal plans of a small workload do not enumerate every split.

Memory per device and the layouts a section can take: `planning/layout.py`.
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq
import math
from collections.abc import Callable, Iterator, Mapping, Sequence

from maestro_jax.core.plan import (
    Plan,
)
from maestro_jax.core.stages import stage_name
from maestro_jax.planning.baselines import monolithic_best, price_baselines
from maestro_jax.planning.bounds import Bounds, Option
from maestro_jax.planning.cost import DEVICES
from maestro_jax.planning.layout import (
    group_memory,
    peak_memory,
)
from maestro_jax.planning.options import SectionOptions, tiebreak_section
from maestro_jax.planning.points import monolithic_point, pipelined_point
from maestro_jax.planning.pricer import Pricer, plan_key
from maestro_jax.planning.problem import PlanningProblem
from maestro_jax.planning.report import Candidate, InfeasibleError, PlanReport, format_table  # noqa: F401 - their old home
from maestro_jax.planning.simulator import DEVICE_TIME  # noqa: F401 - its old home (tools)
from maestro_jax.planning.spec import SPLIT_COUNTS, WorkloadSpec
from maestro_jax.planning.text import layer_remat_text  # noqa: F401 - its old home (cli, plug-ins)


def _powers(limit: int) -> list[int]:
    return [2**i for i in range(int(math.log2(max(limit, 1))) + 1)]


# pipeline stage counts `plan --stages` tries for a section that splits (`WorkloadSpec.splits`): the
# first three of the counts it is cut into (`spec.SPLIT_COUNTS`, which a config's own count of 16
# stages is checked with)
STAGE_COUNTS = SPLIT_COUNTS[:3]
_TIE = 1e-9  # relative: a plan whose bound is this close to the K-th best time can at best tie it
TOLERANCE = 0.01  # default relative gap: plans that could beat the K-th best by less are not simulated
_GROWTH = 1.02  # the search's threshold, from the smallest bound up, grows by this factor per pass (a pass
# under a tight threshold is cheap: the floors prune partial plans early)
_REFRESH = 256  # candidates generated between two refreshes of the incumbent the generation prunes against


@dataclasses.dataclass
class _Limit:
    """The bound above which candidate generation prunes; the search lowers it as it scores plans."""

    value: float


class Planner:
    """Search over plans of a workload (any section DAG) on `devices` devices with `memory_gb` each.

    Each section's options are enumerated on their own (device count, tensor degree,
    data-parallel degree, micro-batch, residual policy, per-layer activation checkpointing for
    trained sections, context and expert degrees where the section has attention or experts);
    the fsdp degree is the smallest that fits the memory budget, since fsdp costs communication
    (priced per micro-step). A plan puts the sections into device groups (`placements`): a group
    is a contiguous device range, all devices are used, and the sections of one group share its
    devices, each with its own layout, their memory adding up (the all-in-one group with one
    layout for every section is the monolithic layout's point in this space). An edge joins any
    data-parallel degrees (fan-out, fan-in, uneven). Candidates are scored with the
    wavefront scheduler and the simulator, which runs a group's sections one at a time.
    `problem` (`planning.problem.PlanningProblem`): the workload, batches, devices, budget and
    search space (its `stage_counts`: the pipeline stage counts a section that splits may also
    take; `plan --stages` gives `STAGE_COUNTS`, none by default); a planner with other settings
    (`_with`, `_of`) is one of `problem.replace(...)`. `tolerance`: the relative gap to the
    optimum the search may leave (module docstring). `progress`, when given, receives one line
    per pass of the search (`search` runs one per stash bound and run-ahead setting) and one
    before the baselines.
    """

    def __init__(
        self,
        problem: PlanningProblem | WorkloadSpec,
        metas: Sequence | None = None,
        devices: int | None = None,
        memory_gb: float | None = None,
        *,
        tolerance: float = TOLERANCE,
        progress: Callable[[str], None] | None = None,
        pricer: Pricer | None = None,
        **settings,
    ):
        """`Planner(problem)`; 0.3.0's form, `Planner(spec, metas, devices, memory_gb,
        global_batch=..., ...)` with `PlanningProblem`'s fields as keywords, builds the problem.
        `pricer`: the problem's (`Pricer.for_problem` of another's keeps the prices it can)."""
        if not isinstance(problem, PlanningProblem):
            problem = PlanningProblem.of(problem, metas, devices, memory_gb, **settings)
        elif metas is not None or devices is not None or memory_gb is not None or settings:
            raise TypeError("Planner(problem) takes the problem alone (change it with problem.replace)")
        if pricer is not None and pricer.problem is not problem:
            raise ValueError("Planner(problem, pricer=...): the pricer prices another problem")
        self.problem = problem
        self.pricer = pricer or Pricer(problem)
        self.progress = progress or (lambda line: None)
        self.tolerance = max(tolerance, _TIE)
        self._settings(problem)
        self._index_batches()
        self.sections = SectionOptions(self.pricer)

    def _settings(self, problem: PlanningProblem) -> None:
        """The problem's fields as the planner reads them."""
        self.spec, self.metas, self.devices, self.budget = (
            problem.spec,
            list(problem.metas),
            problem.devices,
            problem.budget_bytes,
        )
        self.run_ahead, self.balance_shards = problem.run_ahead, problem.balance_shards
        self.global_batch, self.device, self.link_gbps = problem.global_batch, problem.device, problem.link_gbps
        self.max_in_flight, self.residuals, self.layer_remat = (
            problem.max_in_flight,
            problem.residuals,
            problem.layer_remat,
        )
        self.contexts = problem.contexts
        self.stage_counts = problem.stage_counts
        self.serial = DEVICES[problem.device].get("serial", False)

    def _index_batches(self) -> None:
        """What the bounds read of the workload and its planning batches, computed once
        (`bounds.Bounds`; the prices' share: `Pricer`)."""
        self.bounds = Bounds(self.pricer)
        self._ahead, self._ahead_edges = self.pricer.ahead, self.pricer.ahead_edges
        self._paths = self.bounds.paths

    @property
    def max_units(self) -> dict[str, int]:
        """Each section's most work units in any planning sample (`Pricer.max_units`)."""
        return self.pricer.max_units

    @property
    def typical_units(self) -> dict[str, float]:
        """Each section's typical work units a sample (`Pricer.typical_units`)."""
        return self.pricer.typical_units

    def options(
        self, section: str, n: int, budget: float | None = None, lightest: bool = False, alone: bool = True
    ) -> list[Option]:
        """`section`'s options on `n` devices (`options.SectionOptions.options`)."""
        return self.sections.options(section, n, budget, lightest, alone)

    def placements(self) -> list[tuple[tuple[str, ...], ...]]:
        """Every way to put the sections into device groups (set partitions): a group's sections
        share its devices (co-located), groups are disjoint. Sections inside a group and the
        groups are listed sink first, the order the search chooses them in."""
        order = tuple(reversed(self.spec.order))
        out: list[list[list[str]]] = [[]]
        for s in order:
            out = [p[:i] + [p[i] + [s]] + p[i + 1 :] for p in out for i in range(len(p))] + [p + [[s]] for p in out]
        # all sections on all devices first (the monolithic layout's point: a good first
        # incumbent for the search to prune against), then every section on its own devices
        return sorted(
            (tuple(tuple(g) for g in p) for p in out), key=lambda p: (len(p) != 1, len(p) != len(order), -len(p))
        )

    def candidates(
        self, budget: float | None = None, lightest: bool = False, threshold: float | _Limit = math.inf
    ) -> Iterator[tuple[Plan, dict, float]]:
        """(plan, memory by section, lower bound) for every plan that passes every constraint and
        whose bound is at most `threshold`, over every placement of the sections into device
        groups. Groups and their sections are chosen sink first. A group's bound
        is the sum of its sections' (they take turns on its devices), its memory their sum.
        A partial plan is pruned on a bound that counts each section not chosen yet at its
        floor on the devices left to it (the smallest bound and micro-steps any of its options
        reaches there), in its group's sum and along the dependency paths alike."""
        budget = self.budget if budget is None else budget
        limit = threshold if isinstance(threshold, _Limit) else _Limit(threshold)

        def floor(s: str, most: int) -> Option:
            return self.sections.floor(s, most, budget, lightest)

        def extend(groups, i: int, left: int, chosen: dict, bounds: list) -> Iterator:
            if i == len(groups):
                bound = max(self.bounds.combine(bounds), self.bounds.chain(chosen, group_of))
                if bound > limit.value:
                    return
                bound = max(bound, self.bounds.turns(chosen, groups, group_of))
                if bound > limit.value:
                    return
                plan = self._assemble(chosen, groups)
                memory = self.pricer.with_stash(plan, _memories(chosen))
                if not (self._ahead_edges and peak_memory(plan, memory) > budget):
                    yield plan, memory, bound
                return
            after = len(groups) - i - 1
            if i:  # the groups chosen so far take their turns, the others at their floors
                fill = {r: floor(r, left - after) for g in groups[i:] for r in g}
                if self.bounds.turns({**fill, **chosen}, groups[:i], group_of) > limit.value:
                    return
            sizes = [left] if after == 0 else range(1, left - after + 1)
            for n in sizes:
                most = left - n - (after - 1)  # the most devices a later group can get
                later = {r: floor(r, most) for g in groups[i + 1 :] for r in g}
                rest = [sum(later[r].bound for r in g) for g in groups[i + 1 :]]
                yield from members(groups, i, n, left, 0, chosen, bounds, rest, 0.0, [], later)

        def members(groups, i, n, left, j, chosen, bounds, rest, group_bound, memories, later) -> Iterator:
            group = groups[i]
            if j == len(group):
                yield from extend(groups, i + 1, left - n, chosen, bounds + [group_bound])
                return
            s = group[j]
            unchosen = {r: floor(r, n) for r in group[j + 1 :]}
            waiting = sum(o.bound for o in unchosen.values())
            fill = {**later, **unchosen}
            for opt in self.sections.shared(s, n, budget, lightest, len(group)):  # by bound, smallest first
                total = group_bound + opt.bound
                if self.bounds.combine(bounds + [total + waiting] + rest) > limit.value:
                    break
                if len(group) > 1 and group_memory(memories + [opt.memory]) > budget:
                    continue
                now = {**chosen, s: opt}
                if self._paths and self.bounds.chain({**fill, **now}, group_of) > limit.value:
                    continue
                yield from members(groups, i, n, left, j + 1, now, bounds, rest, total, memories + [opt.memory], later)

        for groups in self.placements():
            group_of = {s: g for g in groups for s in g}  # read by extend and members
            yield from extend(groups, 0, self.devices, {}, [])

    def _assemble(self, chosen: dict, groups: Sequence[Sequence[str]]) -> Plan:
        """Contiguous device ranges, one per device group, in graph order of each group's first
        section; co-located sections share their group's range, a section in stages cuts it
        into consecutive equal shares, stage by stage. Fanouts are derived from the
        data-parallel degrees, and kept (as what the config may state) where they are whole."""
        first = {s: g for g in groups for s in g}
        sections, ranges, start = {}, {}, 0
        for s in self.spec.order:
            o, g = chosen[s], first[s]
            if g not in ranges:
                ranges[g] = tuple(range(start, start + len(o.plan.devices)))
                start += len(o.plan.devices)
            if not o.parts:
                sections[s] = dataclasses.replace(o.plan, devices=ranges[g])
                continue
            cut = len(ranges[g]) // len(o.parts)
            for i, p in enumerate(o.parts):
                sections[stage_name(s, i)] = dataclasses.replace(p.plan, devices=ranges[g][i * cut : (i + 1) * cut])
        edges = self.spec.staged(_counts(chosen)).edges
        fanout = {
            e.name: sections[e.dst].dp // sections[e.src].dp
            for e in edges
            if sections[e.dst].dp % sections[e.src].dp == 0
        }
        return Plan(sections=sections, fanout=fanout, global_batch=self.global_batch)

    # -- prices (the pricer's; kept here for the callers of 0.3.0) ------------------------------
    def check(self, plan: Plan) -> dict[str, dict[str, float]]:
        """The runtime's constraint checks on a whole plan (`Pricer.check`); raises PlanError."""
        return self.pricer.check(plan)

    def step_time(self, plan: Plan) -> float:
        """`plan`'s simulated step time (`Pricer.step_time`)."""
        return self.pricer.step_time(plan)

    def device_time(self, plan: Plan) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
        """Where `plan`'s device time goes (`Pricer.device_time`)."""
        return self.pricer.device_time(plan)

    def _stage_counts(self, plan: Plan) -> dict[str, int]:
        return self.pricer.stage_counts(plan)

    # -- search -------------------------------------------------------------------------------
    def search(self, top: int = 10) -> PlanReport:
        """The best plan and the `top` runners-up by simulated step time, over the stash bound
        too: `max_in_flight` as configured and each smaller power of two (a smaller bound holds
        fewer residuals, which co-located sections share their memory with; sections that share
        devices lose no overlap by it), and, with `run_ahead`, without it too (its stash may not fit
        where the plan without it does). Ties keep the configured settings."""
        bounds = [self.max_in_flight] + [f for f in _powers(self.max_in_flight - 1)[::-1] if f < self.max_in_flight]
        scored, considered, simulated = [], 0, 0
        for ahead in dict.fromkeys([self.run_ahead, 0]):
            for f in bounds:
                same = f == self.max_in_flight and ahead == self.run_ahead
                fastest: dict = {}  # each plan found so far at its fastest: what a later search must beat
                for c in scored:
                    fastest[plan_key(c.plan)] = min(fastest.get(plan_key(c.plan), math.inf), c.step_time_s)
                kth = sorted(fastest.values())[top - 1] if len(fastest) >= top else math.inf
                found, count, ran = (self if same else self._with(self.devices, f, ahead))._search(top, kth)
                scored, considered, simulated = scored + found, considered + count, simulated + ran
        priced = price_baselines(self)
        monolithic, pipelined = priced["monolithic"], priced["pipelined"]
        # both baselines' layouts are in the plan space: the search within `tolerance` never does worse
        points = (
            monolithic_point(self.pricer, monolithic),
            pipelined_point(self.pricer, pipelined and pipelined.to_json()),
        )
        scored += [p for p in points if p is not None]
        scored.sort(key=lambda c: (c.step_time_s, _tiebreak(c.plan)))  # stable: the configured settings first
        seen: set = set()  # a plan that fits under several bounds is listed once, at its fastest
        scored = [c for c in scored if not (plan_key(c.plan) in seen or seen.add(plan_key(c.plan)))]
        if not scored:
            raise InfeasibleError(self._infeasible_message())
        best = scored[0]
        return PlanReport(best, scored[:top], considered, simulated, priced, *self._spent(best))

    def _spent(self, c: Candidate) -> tuple[dict, dict]:
        """Where candidate `c`'s device time goes (`device_time`), priced as it was scored: its
        stash bound and run-ahead, its sections cut as it cuts them."""
        cut = self._of(self.spec.with_cuts(c.cuts), self.metas) if c.cuts else self
        return cut._with(self.devices, c.max_in_flight, c.run_ahead).device_time(c.plan)

    def _pipelined_point(self, pipelined: dict | None) -> Candidate | None:
        """The pipelined baseline's layout scored as a maestro plan (`points.pipelined_point`)."""
        return pipelined_point(self.pricer, pipelined)

    def _of(self, spec: WorkloadSpec, metas: Sequence) -> Planner:
        """A planner of `spec` (this workload staged or cut otherwise) on `metas`, with this one's
        devices, budget, pricing and search settings, no stage search and no run-ahead."""
        return Planner(
            self.problem.replace(spec=spec, metas=tuple(metas), run_ahead=0, stage_counts=()),
            tolerance=self.tolerance,
        )

    def _search(self, top: int, incumbent: float = math.inf) -> tuple[list[Candidate], int, int]:
        """The `top` best plans at this planner's `max_in_flight` that could enter a top list
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
        self.progress(
            f"searching plans on {self.devices} devices with {self.budget / 2**30:g} GB each: "
            f"schedule.max_in_flight {self.max_in_flight}, schedule.run_ahead {self.run_ahead}"
        )
        if next(self.candidates(), None) is None:  # no plan at all: the passes below would never end early
            return [], 0, 0
        floors = {s: self.sections.floor(s, self.devices, self.budget, False) for s in self.spec.order}
        first = max(self.bounds.combine([o.bound for o in floors.values()]), self.bounds.chain(floors))
        threshold = first / (1 - self.tolerance)
        while True:
            scored, considered = self._scored_under(threshold, top, incumbent)
            kth = min(incumbent, scored[top - 1].step_time_s if len(scored) >= top else math.inf)
            if kth * (1 - self.tolerance) <= threshold or threshold == math.inf:
                return scored[:top], considered, len(scored)
            # a small step: each pass builds every plan under its threshold, and the best-bounded
            # of them set the limit that prunes the rest; a pass that built none doubles it (the
            # bounds of the feasible plans may lie far above the floors, where parallelism the
            # sections cannot use leaves devices they cannot fill)
            threshold = min(kth, (_GROWTH if considered else 2.0) * threshold)
            if threshold > 1e6 * first:
                threshold = math.inf

    def _scored_under(self, threshold: float, top: int, incumbent: float) -> tuple[list[Candidate], int]:
        """One pass of `_search`: the plans it simulated, best first, and how many it generated."""
        limit = _Limit(min(threshold, incumbent * (1 - self.tolerance)))
        pending: list[tuple] = []  # (bound, order found, plan, memory): a heap
        scored: list[Candidate] = []
        ranks: list[tuple] = []  # (step time, tiebreak) of each scored candidate, in order: where the next goes

        def score(plan: Plan, mem: dict) -> None:
            t = self.step_time(plan)
            rank = (t, _tiebreak(plan))
            at = bisect.bisect_right(ranks, rank)  # after its equals, as a stable sort puts it
            ranks.insert(at, rank)
            scored.insert(
                at,
                Candidate(
                    plan,
                    t,
                    self.global_batch / t / self.devices,
                    {s: m["total"] / 2**30 for s, m in mem.items()},
                    self.max_in_flight,
                    peak_memory(plan, mem) / 2**30,
                    self.run_ahead,
                    self.spec.staged(self.pricer.stage_counts(plan)).stages,
                ),
            )
            if len(scored) >= top:
                limit.value = min(limit.value, scored[top - 1].step_time_s * (1 - self.tolerance))

        considered = 0
        for plan, mem, bound in self.candidates(threshold=limit):
            heapq.heappush(pending, (bound, considered, plan, mem))
            considered += 1
            while len(scored) < top and len(pending) >= top and pending[0][0] <= limit.value:  # an incumbent
                score(*heapq.heappop(pending)[2:])
            if considered % _REFRESH == 0 and pending and pending[0][0] < limit.value:
                score(*heapq.heappop(pending)[2:])  # a better incumbent: the best-bounded found since
        while pending and pending[0][0] <= limit.value:
            score(*heapq.heappop(pending)[2:])
        return scored, considered

    def monolithic_best(self) -> dict | None:
        """The fair monolithic baseline's best layout on this planner's devices
        (`baselines.monolithic_best`)."""
        self.progress(f"baselines on {self.devices} devices: the monolithic layout and the pipelined (1F1B) one")
        return monolithic_best(self.pricer)

    def _with(self, devices: int, max_in_flight: int | None = None, run_ahead: int | None = None) -> Planner:
        """This planner with other settings; the layouts' costs and weights, which none of them
        change, are shared."""
        problem = self.problem.replace(
            devices=devices,
            max_in_flight=max_in_flight or self.max_in_flight,
            run_ahead=self.run_ahead if run_ahead is None else run_ahead,
        )
        other = Planner(
            problem, tolerance=self.tolerance, progress=self.progress, pricer=self.pricer.for_problem(problem)
        )
        other.sections = self.sections.with_pricer(other.pricer)
        return other

    def _infeasible_message(self) -> str:
        if next(self.candidates(budget=math.inf), None) is None:  # not for lack of memory
            return (
                f"--devices {self.devices}: no device split satisfies the mesh and divisibility "
                f"constraints for global_batch={self.global_batch}; try another device count"
            )
        peaks = [peak_memory(plan, mem) for plan, mem, _ in self.candidates(budget=math.inf, lightest=True)]
        gb = self.budget / 2**30
        more = next((n for n in (2 * self.devices, 4 * self.devices) if next(self._with(n).candidates(), None)), None)
        alt = f", or --devices {more} at --memory-gb {gb:g}" if more else ""
        return (
            f"--memory-gb {gb:g}: no plan on {self.devices} devices fits in memory; the smallest feasible "
            f"request is --memory-gb {_ceil_significant(min(peaks) / 2**30):g} at --devices "
            f"{self.devices}{alt}"
        )


def _counts(chosen: Mapping[str, Option]) -> dict[str, int]:
    """The sections of a plan's options in pipeline stages, with their stage counts."""
    return {s: len(o.parts) for s, o in chosen.items() if o.parts}


def _memories(chosen: Mapping[str, Option]) -> dict[str, dict[str, float]]:
    """The memory of a plan's sections by the plan's section names (a section in stages: each
    stage's under its own)."""
    out = {}
    for s, o in chosen.items():
        if o.parts:
            out.update((stage_name(s, i), p.memory) for i, p in enumerate(o.parts))
        else:
            out[s] = o.memory
    return out


def _ceil_significant(x: float, digits: int = 3) -> float:
    """`x` rounded up to `digits` significant digits (a request that surely fits)."""
    scale = 10 ** (digits - 1 - math.floor(math.log10(x)))
    return math.ceil(x * scale) / scale


def _tiebreak(plan: Plan):
    """Equal predicted times: prefer fewer tensor, context and expert shards, then smaller
    micro-batches (less memory), then less recomputation."""
    return tuple(tiebreak_section(sp) for sp in plan.sections.values())
