"""The plans of one planning problem: every way to put its sections on its devices, enumerated
under a bound.

Plain Python, no JAX. A plan puts the sections into device groups (`PlanSpace.placements`): a
group is a contiguous device range, all devices are used, and the sections of one group share
its devices, each with its own layout (`options.SectionOptions`), their memory adding up (the
all-in-one group with one layout for every section is the monolithic layout's point in this
space). An edge joins any data-parallel degrees (fan-out, fan-in, uneven). `candidates` yields
every plan that passes every constraint with its lower bound (`bounds.Bounds`), pruning partial
plans whose bound already exceeds a threshold the search (`planning.search`) lowers as it
scores plans.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping, Sequence

from maestro_jax.core.plan import Plan
from maestro_jax.core.stages import stage_name
from maestro_jax.planning.bounds import Bounds, Option
from maestro_jax.planning.layout import group_memory, peak_memory
from maestro_jax.planning.options import SectionOptions
from maestro_jax.planning.pricer import Pricer
from maestro_jax.planning.problem import PlanningProblem


@dataclasses.dataclass
class Limit:
    """The bound above which candidate generation prunes; the search lowers it as it scores plans."""

    value: float


class PlanSpace:
    """The plans of `pricer`'s problem (module docstring), with its sections' options
    (`sections`, shared with the spaces of the same workload under other settings) and bounds."""

    def __init__(self, pricer: Pricer, sections: SectionOptions | None = None):
        self.pricer, self.problem, self.spec = pricer, pricer.problem, pricer.problem.spec
        self.sections = sections or SectionOptions(pricer)
        self.bounds = Bounds(pricer)

    def with_problem(self, problem: PlanningProblem) -> PlanSpace:
        """The space of `problem` (this workload under other settings: devices, stash bound,
        run-ahead), sharing the prices and enumerations those settings leave valid."""
        pricer = self.pricer.for_problem(problem)
        return PlanSpace(pricer, self.sections.with_pricer(pricer))

    def placements(self) -> list[tuple[tuple[str, ...], ...]]:
        """Every way to put the sections into device groups (set partitions): a group's sections
        share its devices (co-located), groups are disjoint; without `colocate`, every section
        in a group of its own. Sections inside a group and the groups are listed sink first, the
        order the search chooses them in."""
        order = tuple(reversed(self.spec.order))
        out: list[list[list[str]]] = [[]]
        for s in order:
            out = [p[:i] + [p[i] + [s]] + p[i + 1 :] for p in out for i in range(len(p))] + [p + [[s]] for p in out]
        if not self.problem.colocate:
            out = [p for p in out if len(p) == len(order)]
        # all sections on all devices first (the monolithic layout's point: a good first
        # incumbent for the search to prune against), then every section on its own devices
        return sorted(
            (tuple(tuple(g) for g in p) for p in out), key=lambda p: (len(p) != 1, len(p) != len(order), -len(p))
        )

    def candidates(
        self, budget: float | None = None, lightest: bool = False, threshold: float | Limit = math.inf
    ) -> Iterator[tuple[Plan, dict, float]]:
        """(plan, memory by section, lower bound) for every plan that passes every constraint and
        whose bound is at most `threshold`, over every placement of the sections into device
        groups. Groups and their sections are chosen sink first. A group's bound
        is the sum of its sections' (they take turns on its devices), its memory their sum.
        A partial plan is pruned on a bound that counts each section not chosen yet at its
        floor on the devices left to it (the smallest bound and micro-steps any of its options
        reaches there), in its group's sum and along the dependency paths alike."""
        budget = self.problem.budget_bytes if budget is None else budget
        limit = threshold if isinstance(threshold, Limit) else Limit(threshold)
        for groups in self.placements():
            yield from _Placement(self, groups, budget, lightest, limit).plans()

    def assemble(self, chosen: Mapping[str, Option], groups: Sequence[Sequence[str]]) -> Plan:
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
        return Plan(sections=sections, fanout=fanout, global_batch=self.problem.global_batch)


class _Placement:
    """The plans of one placement of the sections into device groups (`groups`), enumerated
    group by group and, inside a group, section by section, under `limit`."""

    def __init__(self, space: PlanSpace, groups, budget: float, lightest: bool, limit: Limit):
        self.space, self.groups, self.budget, self.lightest, self.limit = space, groups, budget, lightest, limit
        self.bounds = space.bounds
        self.group_of = {s: g for g in groups for s in g}

    def plans(self) -> Iterator[tuple[Plan, dict, float]]:
        return self._extend(0, self.space.problem.devices, {}, [])

    def _floor(self, s: str, most: int) -> Option:
        return self.space.sections.floor(s, most, self.budget, self.lightest)

    def _extend(self, i: int, left: int, chosen: dict, bounds: list) -> Iterator:
        """Group `i` on every device count that leaves each later group one, the groups before
        it chosen (`chosen`, their bounds `bounds`), `left` devices still free."""
        groups, bound_of = self.groups, self.bounds
        if i == len(groups):
            yield from self._complete(chosen, bounds)
            return
        after = len(groups) - i - 1
        if i:  # the groups chosen so far take their turns, the others at their floors
            fill = {r: self._floor(r, left - after) for g in groups[i:] for r in g}
            if bound_of.turns({**fill, **chosen}, groups[:i], self.group_of) > self.limit.value:
                return
        sizes = [left] if after == 0 else range(1, left - after + 1)
        for n in sizes:
            most = left - n - (after - 1)  # the most devices a later group can get
            later = {r: self._floor(r, most) for g in groups[i + 1 :] for r in g}
            rest = [sum(later[r].bound for r in g) for g in groups[i + 1 :]]
            yield from self._members(i, n, left, 0, chosen, bounds, rest, 0.0, [], later)

    def _complete(self, chosen: dict, bounds: list) -> Iterator:
        """The whole plan `chosen`, if its bound stays under the limit and, under run-ahead, its
        stash fits."""
        space, limit = self.space, self.limit
        bound = max(self.bounds.combine(bounds), self.bounds.chain(chosen, self.group_of))
        if bound > limit.value:
            return
        bound = max(bound, self.bounds.turns(chosen, self.groups, self.group_of))
        if bound > limit.value:
            return
        plan = space.assemble(chosen, self.groups)
        memory = space.pricer.with_stash(plan, _memories(chosen))
        if not (space.pricer.ahead_edges and peak_memory(plan, memory) > self.budget):
            yield plan, memory, bound

    def _members(self, i, n, left, j, chosen, bounds, rest, group_bound, memories, later) -> Iterator:
        """Section `j` of group `i` (on `n` devices) on each of its options, by bound, while the
        partial plan's bound stays under the limit."""
        group = self.groups[i]
        if j == len(group):
            yield from self._extend(i + 1, left - n, chosen, bounds + [group_bound])
            return
        s = group[j]
        unchosen = {r: self._floor(r, n) for r in group[j + 1 :]}
        waiting = sum(o.bound for o in unchosen.values())
        fill = {**later, **unchosen}
        for opt in self.space.sections.shared(s, n, self.budget, self.lightest, len(group)):  # smallest bound first
            total = group_bound + opt.bound
            if self.bounds.combine(bounds + [total + waiting] + rest) > self.limit.value:
                break
            if len(group) > 1 and group_memory(memories + [opt.memory]) > self.budget:
                continue
            now = {**chosen, s: opt}
            if self.bounds.paths and self.bounds.chain({**fill, **now}, self.group_of) > self.limit.value:
                continue
            yield from self._members(i, n, left, j + 1, now, bounds, rest, total, memories + [opt.memory], later)


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
