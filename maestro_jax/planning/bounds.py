"""Lower bounds on a plan's step time from its sections' options, what the search prunes with.

Plain Python, no JAX. No section finishes before its own work is done (each option's `bound`,
`Pricer.section_bound`); co-located sections take turns (`combine`); along a path of edges
into the sink a sample's forwards, the sink's loss and the backwards run one after another
(`chain`); and each device group runs its sections' forwards, backwards and optimizer steps one
at a time, none before the least time any of them waits for nor later than the least time
still to follow (`turns`). A partial plan is bounded with every section not chosen yet at its
floor (an `Option` of the least values any of its options reaches), so whole subtrees go at once.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from maestro_jax.core.plan import SectionPlan
from maestro_jax.planning.cluster import TRANSFER_OVERHEAD_S, edge_positions, transfer_s_per_unit
from maestro_jax.planning.cost import SectionCost
from maestro_jax.planning.pricer import Pricer
from maestro_jax.planning.spec import WorkloadSpec


@dataclasses.dataclass(frozen=True)
class Option:
    """One section's layout on `n` devices, with its memory, its cost coefficients and its share
    of the step-time bound."""

    plan: SectionPlan
    memory: dict
    cost: SectionCost
    bound: float
    forward: float = 0.0  # its shortest forward micro-step (the sink: loss-and-grad)
    backward: float = 0.0  # its shortest backward micro-step (trained producers)
    forwards: float = 0.0  # the forwards' share of `bound` (the sink: its losses)
    backwards: float = 0.0  # the backwards' share of `bound`
    update: float = 0.0  # the rest of `bound`: its optimizer step (`SectionCost.update_s`)
    parts: tuple = ()  # in pipeline stages: each stage's option, in order (`SectionOptions._staged_options`)


FLOORED = ("bound", "forward", "backward", "forwards", "backwards")  # what a floor of options keeps, in order


class Bounds:
    """The bounds of plans of `pricer`'s problem: its dependency paths (`chains`) and the sets of
    sections a sample has work in, read once from the workload and its planning batches."""

    def __init__(self, pricer: Pricer):
        self.pricer = pricer
        spec, metas = pricer.problem.spec, pricer.problem.metas
        self.spec, self.serial, self.ahead = spec, pricer.serial, pricer.ahead
        self.paths = chains(spec, metas)
        # the sets of sections one sample has work in, and each section's producers and
        # consumers among the sections: what the turn bound (`turns`) follows
        self.patterns = sorted({tuple(s for s in spec.order if s in m.work) for b in metas for m in b})
        self.producers = {s: tuple(e.src for e in spec.producers_of(s)) for s in spec.order}
        self.consumers = {s: tuple(e.dst for e in spec.consumers_of(s)) for s in spec.order}

    def chain(self, values: dict[str, Option], group_of: dict | None = None) -> float:
        """A lower bound from dependencies. Along a path of edges into the sink that one sample
        of every batch takes whole, that sample's forwards and transfers run one after another,
        then the sink's loss, then the cotangents and backwards of the trained producers that
        gradients reach, in reverse. When every sample the sink gets takes the path, all of the
        sink's work waits for the path's forwards and precedes those backwards. And when every
        sample of a frozen section on the path goes on along it to the sink (a teacher), all of
        that section's forwards precede the last of the sink's losses that reads them (a pivot:
        its whole bound, the path's shortest forwards before and after it). The sink's optimizer
        step is left out: it may run beside the producers' backwards. `values`: an option
        or a floor for each section counted (a partial plan's bound bounds every completion);
        `group_of`, each section's device group, for the transfers (`hops`)."""
        hops = self.hops(values, group_of)
        best = 0.0
        for sections, edges, whole, back, pivot in self.paths:
            if pivot in self.ahead:
                continue  # its forwards ran the step before
            t = 0.0
            for s in sections:
                if s in values:
                    o = values[s]
                    if s == pivot:
                        t += o.forwards
                    elif s == self.spec.sink:
                        t += o.forwards if whole and pivot is None else o.forward
                    else:
                        t += o.forward + (o.backward if s in back else 0.0)
            for e in edges:
                one = hops.get(e.name, 0.0)
                t += (0.0 if e.src in self.ahead else one) + (one if e.src in back else 0.0)
            best = max(best, t)
        return best

    def hops(self, values: dict[str, Option], group_of: dict | None) -> dict[str, float]:
        """Each edge's shortest transfer (either way): at the fewest units any sample sends when
        both ends have an option in `values`, else its fixed latency between device groups (and
        nothing known within one)."""
        if group_of is None:
            return {}
        out = {}
        for e in self.spec.edges:
            src, dst = values.get(e.src), values.get(e.dst)
            if (src is not None and src.parts) or (dst is not None and dst.parts):
                # an end in stages: its stage's mesh and devices are not the option's; the
                # fixed latency between groups bounds the transfer
                out[e.name] = TRANSFER_OVERHEAD_S if group_of[e.src] != group_of[e.dst] else 0.0
            elif src is not None and dst is not None and src.plan is not None and dst.plan is not None:
                per_unit = transfer_s_per_unit(
                    self.spec.edge_bytes[e.name],
                    src.plan,
                    dst.plan,
                    group_of[e.src] == group_of[e.dst],
                    self.pricer.problem.device,
                    self.pricer.problem.link_gbps,
                    edge_positions(self.spec, e.name, src.cost.bucket_min),
                )
                out[e.name] = 0.0 if per_unit is None else TRANSFER_OVERHEAD_S + per_unit * self.pricer.min_units[e.src]
            elif group_of[e.src] != group_of[e.dst]:
                out[e.name] = TRANSFER_OVERHEAD_S
        return out

    def turns(self, values: dict[str, Option], groups: Sequence[Sequence[str]], group_of: dict) -> float:
        """A lower bound from each device group's turns: its sections' forwards, losses and
        backwards all run on its devices one at a time, and no op starts before what it depends on
        or ends the step before what depends on it. For each kind of op of a section in the group
        (its forwards, its backwards), a head (the least time before any of them can start: the
        shortest forwards of the producers a sample passes first) and a tail (the least time after
        any of them: the shortest forwards on to the sink, its loss, and the backwards back down,
        including the section's own backward) from the shortest micro-steps in `values`, at the
        sample whose path is shortest (`patterns`), and its optimizer step (after its shortest
        backward at the earliest, nothing after it); then for any set of those kinds, the smallest
        head, their whole work (the bound's shares) and the smallest tail run one after another
        (the one-machine bound of job-shop scheduling). `values` holds an option or a floor for
        every section; `groups`, the device groups to bound."""
        spec, sink = self.spec, self.spec.sink
        hops = self.hops(values, group_of)
        x = {}  # (producer, consumer) -> the shortest transfer between them
        for e in spec.edges:
            x[e.src, e.dst] = min(x.get((e.src, e.dst), math.inf), hops.get(e.name, 0.0))
        f = {s: o.forward for s, o in values.items()}
        b = {s: o.backward if self.backs(s) else 0.0 for s, o in values.items()}
        inf = math.inf
        head_f, tail_f, head_b, tail_b = (dict.fromkeys(spec.order, inf) for _ in range(4))
        for pattern in self.patterns:
            hf, tb, tf, hb = {}, {}, {}, {}
            for s in pattern:  # graph order: producers first
                hf[s] = max((hf[p] + f[p] + x[p, s] for p in self.producers[s] if p in hf), default=0.0)
                tb[s] = max(
                    (x[p, s] + b[p] + tb[p] for p in self.producers[s] if p in tb and self.backs(p)), default=0.0
                )
            for s in reversed(pattern):
                tf[s] = (
                    tb[s]
                    if s == sink
                    else max((x[s, c] + f[c] + tf[c] for c in self.consumers[s] if c in tf), default=0.0)
                )
                if self.backs(s):
                    hb[s] = max(
                        [
                            hf[s] + f[s],
                            *(
                                (hf[c] + f[c] if c == sink else hb[c] + b[c]) + x[s, c]
                                for c in self.consumers[s]
                                if c in hb or (c == sink and c in hf)
                            ),
                        ]
                    )
            for s in pattern:
                head_f[s], tail_f[s] = min(head_f[s], hf[s]), min(tail_f[s], tf[s])
                if s in hb:
                    head_b[s], tail_b[s] = min(head_b[s], hb[s]), min(tail_b[s], tb[s])
        best = 0.0
        for group in groups:
            kinds = []  # (head, work, tail)
            for s in group:
                o = values[s]
                split = self.spec.splits[s][len(o.parts)] if o.parts else None
                if split is not None and (split.consumes or split.produces):
                    # an edge in or out at a middle stage: its busiest stage need not wait for it
                    kinds.append((0.0, o.forwards, 0.0))
                    if self.backs(s):
                        kinds.append((0.0, o.backwards, 0.0))
                    continue
                if s in self.ahead:  # its forwards are the next batch's: nothing in this step waits on them
                    kinds.append((0.0, o.forwards, 0.0))
                else:
                    kinds.append((_finite(head_f[s]), o.forwards, _finite(tail_f[s])))
                if self.backs(s):
                    kinds.append((_finite(head_b[s]), o.backwards, _finite(tail_b[s])))
                if o.update and not o.parts:  # after its last backward (the sink: loss-and-grad), the
                    # last op of its own (in stages: of its busiest stage, whose turn this bound does not follow)
                    last = head_b[s] + b[s] if self.backs(s) else head_f[s] + f[s]
                    kinds.append((_finite(last), o.update, 0.0))
            for a in {k[0] for k in kinds}:
                for z in {k[2] for k in kinds}:
                    work = sum(k[1] for k in kinds if k[0] >= a and k[2] >= z)
                    if work:
                        best = max(best, a + work + z)
        return best

    def backs(self, section: str) -> bool:
        """Whether `section` runs backwards (`backs`)."""
        return backs(self.spec, section)

    def combine(self, bounds) -> float:
        """A plan's bound from its sections': their sum on a serial client, else the largest."""
        return sum(bounds) if self.serial else max(bounds, default=0.0)


def backs(spec: WorkloadSpec, section: str) -> bool:
    """Whether `section` runs backwards (a trained producer)."""
    return section != spec.sink and spec.sections[section].trained


def chains(spec: WorkloadSpec, metas: Sequence[Sequence]) -> list[tuple]:
    """The paths of edges into the sink that the chain bound follows (`Bounds.chain`), each as
    (its sections, its edges, whether every sample the sink gets takes it whole, the producers on
    it whose backward the sink's gradient reaches: trained, with only trained sections between
    them and the sink, and a pivot or None). Kept when every batch has a sample that takes the
    path whole (one with work in every section on it); once more per pivot: a frozen section
    on it every sample of which has work in each section after it."""
    paths: list[tuple[tuple[str, ...], tuple]] = []

    def walk(section: str, sections: tuple[str, ...], edges: tuple) -> None:
        if len(sections) > 1:
            paths.append((sections, edges))
        for e in spec.producers_of(section):
            walk(e.src, (e.src, *sections), (e, *edges))

    walk(spec.sink, (spec.sink,), ())
    out = []
    for sections, edges in paths:
        takes = [[all(s in m.work for s in sections) for m in batch if spec.sink in m.work] for batch in metas]
        if not all(any(t) for t in takes):
            continue
        back = set()
        for s in reversed(sections[:-1]):
            if not spec.sections[s].trained:
                break
            back.add(s)
        out.append((sections, edges, all(all(t) for t in takes), frozenset(back), None))
        for i, s in enumerate(sections[:-1]):
            after = sections[i + 1 :]
            if not spec.sections[s].trained and all(
                all(a in m.work for a in after) for batch in metas for m in batch if s in m.work
            ):
                out.append((sections, edges, False, frozenset(back), s))
    return out


def _finite(x: float) -> float:
    """A head or tail no sample defines (a section no planning sample has work in) bounds nothing."""
    return 0.0 if math.isinf(x) else x
