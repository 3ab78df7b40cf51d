"""The wavefront scheduler: reorder a global batch so sections run concurrently. Plain Python.

Any section DAG with one sink, any data-parallel degrees. A sample sits on one data shard per
section; giving it one position in the sink shard c it sits on, and putting it on the shard of
every section s that holds that position (`ops.shard_of`: c // (DP(sink) / DP(s)) when DP(s)
divides DP(sink), whatever the sample), satisfies the placement rule on every edge at once
(producer shard i feeds consumer shard j when their shares of the batch overlap, `ops.feeds`;
both hold the sample's position). A schedule is therefore built from *columns*: the sink's
micro-steps in the order the sink runs them (then columns of samples that never reach the sink,
if any). Every other section takes, per shard, the column's samples placed on it, in column
order (`_derive`).
"""

from __future__ import annotations

import functools
import heapq
import math
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from itertools import chain

from maestro_jax.schedule.ops import (
    MicroStep,
    Op,
    Problem,
    SampleMeta,
    Schedule,
    ScheduleError,
    backward_ops,
    chunk,
    consumers,
    feeders,
    link,
    required_ops,
    shard_of,
)
from maestro_jax.schedule.packing import packs
from maestro_jax.schedule.timing import resource_of, steady_order, work_time
from maestro_jax.schedule.validate import validate

Rows = list[tuple[int, ...]]


class _Batch:
    """What the scheduler asks of the batch over and over, computed once per `wavefront` call:
    each sample's sections, its work per section as plain lists, whether it needs a section
    besides the sink, the samples that reach the sink (`active`) and those that activate
    sections but not the sink (`orphans`: placed in columns the sink does not run), and the cost
    model's durations memoised on (kind, section, edge, rows) (the candidate schedules share
    most of their micro-steps), as are the work units of each micro-step (its forward, backward
    and transfers read the same ones). Keeps the host time linear in the batch with a small
    constant."""

    def __init__(self, metas: Sequence[SampleMeta], problem: Problem, cost):
        self.metas, self.problem = metas, problem
        self.sections, works = [m.sections for m in metas], [m.work for m in metas]
        self.work = {s: [w.get(s, 0) for w in works] for s in problem.order}
        self.no_work = [0] * len(metas)
        self.fed = [len(secs) > (problem.sink in secs) for secs in self.sections]
        self.active = [i for i, secs in enumerate(self.sections) if problem.sink in secs]
        self.orphans = [i for i, secs in enumerate(self.sections) if secs and problem.sink not in secs]
        self._time, self._durations, self._units = work_time(cost, problem), {}, {}
        # each sample's modelled time alone, every section's forward (one row, less the fixed
        # cost of a program): the key a monolithic trainer may pack by, so maestro may too
        forward = {s: Op("F", s) for s in problem.order}
        base = {s: self._time(op, []) for s, op in forward.items()}
        memo: dict[tuple[str, int], float] = {}  # (section, units): many samples share a size

        def single(s: str, u: int) -> float:
            if (s, u) not in memo:
                memo[(s, u)] = self._time(forward[s], [u]) - base[s]
            return memo[(s, u)]

        singles = [[(s, single(s, u)) for s, u in w.items() if s in base] for w in works]
        self.alone = [sum(t for _, t in one) for one in singles]
        # the same, of the sections besides the sink only: what a sample costs the producers
        # (`_balanced`)
        self.producing = [sum(t for s, t in one if s != problem.sink) for one in singles]
        self._placed: dict[tuple[str, tuple[int, ...]], list[list[int]]] = {}
        self._graphs: dict[int, tuple[object, _OpGraph]] = {}

    def graph(self, steps) -> _OpGraph:
        """The ops of micro-steps `steps` with their dependencies, devices and durations, once per
        steps object: a candidate's are read by its list schedules (one per priority) and by its
        naive order's makespan. Keyed by identity (the steps object is kept alive beside its
        entry, so its id is never reused)."""
        entry = self._graphs.get(id(steps))
        if entry is None:
            entry = self._graphs[id(steps)] = steps, _OpGraph(self, steps)
        return entry[1]

    def duration(self, op: Op, steps) -> float:
        rows = steps[op.section][op.step].positions if op.kind != "U" else ()
        key = (op.kind, op.section, op.edge, rows)
        if key not in self._durations:
            if (op.section, rows) not in self._units:
                work = self.work[op.section]
                self._units[(op.section, rows)] = [work[x] if x >= 0 else 0 for x in rows]  # `op_units`
            self._durations[key] = self._time(op, self._units[(op.section, rows)])
        return self._durations[key]

    def activating(self, rows: Sequence[int], s: str) -> list[int]:
        """The samples among `rows` (padding -1 skipped) that activate section s, in order."""
        sections = self.sections
        return [x for x in rows if x >= 0 and s in sections[x]]

    def placed(self, column: tuple[int, ...], s: str) -> list[list[int]]:
        """Per shard of s: the column's samples activating s, on the shard `ops.shard_of` gives
        them from their sink shard ((sink shard) // (DP(sink) / DP(s)) when DP(s) divides
        DP(sink)), in row order. Memoised: the variants reorder the same columns. Read-only."""
        key = (s, column)
        if key not in self._placed:
            problem, sections = self.problem, self.sections
            dp_sink, dp, mb = problem.dp[problem.sink], problem.dp[s], problem.micro_batch(problem.sink)
            shards: list[list[int]] = [[] for _ in range(dp)]
            if dp_sink % dp == 0:
                span = mb * (dp_sink // dp)
                for r, x in enumerate(column):
                    if x >= 0 and s in sections[x]:
                        shards[r // span].append(x)
            else:
                for r, x in enumerate(column):
                    if x >= 0 and s in sections[x]:
                        shards[shard_of(dp_sink, dp, r // mb, x)].append(x)
            self._placed[key] = shards
        return self._placed[key]


class _OpGraph:
    """Every op micro-steps require (`ops.required_ops`), as parallel lists by op index: what it
    waits on and what waits on it, the device group or link it occupies and its duration. What
    list scheduling and the makespan read per op, computed once however many orders of the same
    micro-steps are timed."""

    def __init__(self, batch: _Batch, steps):
        problem = batch.problem
        self.req = required_ops(Schedule(steps, (), len(batch.metas)), problem)
        self.ops = list(self.req)
        self.index = {op: i for i, op in enumerate(self.ops)}
        self.deps = [[self.index[d] for d in self.req[op]] for op in self.ops]
        self.dependents: list[list[int]] = [[] for _ in self.ops]
        for i, ds in enumerate(self.deps):
            for d in ds:
                self.dependents[d].append(i)
        self.waits = [len(ds) for ds in self.deps]
        self.resource = [resource_of(op, problem) for op in self.ops]
        self.duration = [batch.duration(op, steps) for op in self.ops]


def _longest_first(items: Iterable[int], weight) -> list[int]:
    """Items by decreasing weight, ties by increasing index: the order every packing takes them
    in. Two stable sorts keyed on `weight` alone (a list lookup in C for work weights) cost far
    less than one keyed on (-weight, index) tuples built in Python."""
    return sorted(sorted(items), key=weight, reverse=True)


def _lpt(ordered: Sequence[int], bins: int, capacity: int, weight) -> list[list[int]]:
    """Longest-processing-time-first over `bins` with a row capacity each (lockstep shards), of
    items already in `_longest_first` order (callers cut them from one sorted list): each item
    goes to the least-loaded bin with room (ties: the lowest index), kept in a heap so a batch
    costs O(n log bins), not O(n * bins)."""
    slots: list[list[int]] = [[] for _ in range(bins)]
    open_bins = [(0.0, b) for b in range(bins)] if capacity > 0 else []  # (load, index): a valid heap
    for x in ordered:
        load, b = open_bins[0]
        slots[b].append(x)
        if len(slots[b]) < capacity:
            heapq.heapreplace(open_bins, (load + weight(x), b))  # pop and push in one sift
        else:
            heapq.heappop(open_bins)
    return slots


def _balanced(batch: _Batch, columns: Rows) -> Rows | None:
    """The sink's micro-steps `columns` with each one's samples dealt anew to the sink's shards so
    that the producers' shards get even work (DistTrain's reordering within a micro-step): a
    sample's shard in a producer whose degree divides the sink's follows from its sink shard
    (`placed`), so the producers are balanced through the sink's rows. Which sink shard holds
    which row costs the sink nothing (every row of a micro-step is padded to its longest), so a
    column's samples go, heaviest for the producers first (`_Batch.producing`), each to the
    group of sink rows, one group a shard of the finest such producer, whose producer work so far
    (over the columns before too) is least and that has a free row; samples no producer reads
    fill the rows left, in order. None where nothing can be balanced so: no producer's degree
    divides the sink's (and exceeds 1), the sink packs (a row's samples share it), or no sample
    reaches the sink."""
    problem = batch.problem
    sink = problem.sink
    dp_sink = problem.dp[sink]
    degrees = [problem.dp[s] for s in problem.order if s != sink and 1 < problem.dp[s] and dp_sink % problem.dp[s] == 0]
    if not degrees or not columns or packs(problem.pack.get(sink, 1)):
        return None  # (no columns: no sample of the batch reaches the sink)
    bins = max(degrees)
    span = len(columns[0]) // bins  # sink rows per group (a producer shard of the finest degree)
    weight = batch.producing.__getitem__
    load = [0.0] * bins
    out = []
    for column in columns:
        samples = [x for x in column if x >= 0]
        groups: list[list[int]] = [[] for _ in range(bins)]
        open_groups = [(load[b], b) for b in range(bins)]  # (work so far, group): a heap, as `_lpt`'s
        heapq.heapify(open_groups)
        for x in _longest_first([x for x in samples if weight(x) > 0], weight):
            _, b = heapq.heappop(open_groups)
            groups[b].append(x)
            load[b] += weight(x)
            if len(groups[b]) < span:
                heapq.heappush(open_groups, (load[b], b))
        rest = iter([x for x in samples if weight(x) <= 0] + [-1] * (len(column) - len(samples)))
        out.append(tuple(x for g in groups for x in g + [next(rest) for _ in range(span - len(g))]))
    return out


def _pack(samples: Sequence[int], rows: int, dp: int, weight) -> Rows:
    """Longest first into micro-steps (similar sizes share a bucket), LPT across shards inside
    each, as rows (`_flatten`). With one row per shard no shard takes a second sample, and the
    empty ones tie at load 0: the i-th longest goes to shard i, so the rows are the longest-first
    order itself, padded (no list per shard: the sink's micro-steps at scale)."""
    ordered, mb = _longest_first(samples, weight), rows // dp
    if mb == 1:
        return [tuple(ordered[i : i + rows]) + (-1,) * (i + rows - len(ordered)) for i in range(0, len(ordered), rows)]
    return [_flatten(_lpt(ordered[i : i + rows], dp, mb, weight), mb) for i in range(0, len(ordered), rows)]


def _caps(problem: Problem) -> dict[str, tuple[int, object, object]]:
    """Sections one sink micro-step can overfill (the sink rows that can land on one of their
    shards outnumber their micro-batch): section -> (micro-batch, (sink shard, sample) -> the
    section's shard it lands on (`ops.shard_of`), sink shard -> the section's shards it can land on)."""
    sink = problem.sink
    dp_sink, mb_sink, out = problem.dp[sink], problem.micro_batch(sink), {}
    for s in problem.order:
        dp = problem.dp[s]
        if s == sink:
            continue
        if dp_sink % dp == 0:
            if problem.rows[sink] // dp > problem.micro_batch(s):
                out[s] = (
                    problem.micro_batch(s),
                    functools.partial(_divide, dp_sink // dp),
                    functools.partial(feeders, dp, dp_sink),
                )
        elif mb_sink * max(len(feeders(dp_sink, dp, i)) for i in range(dp)) > problem.micro_batch(s):
            out[s] = (
                problem.micro_batch(s),
                functools.partial(shard_of, dp_sink, dp),
                functools.partial(feeders, dp, dp_sink),
            )
    return out


def _divide(ratio: int, c: int, x: int) -> int:
    """`ops.shard_of` when DP(s) divides DP(sink) (`ratio` sink shards per shard of s)."""
    return c // ratio


class _Column:
    """One sink micro-step being filled: each sample on the least loaded sink shard with a free row
    whose shard in every section the sample activates still has room in that section's micro-batch."""

    def __init__(self, problem: Problem, metas: Sequence[SampleMeta], weight, caps: dict[str, tuple]):
        self.metas, self.weight, self.caps, self.mb = metas, weight, caps, problem.micro_batch(problem.sink)
        dp = problem.dp[problem.sink]
        self.shards, self.loads, self.used, self.free = [[] for _ in range(dp)], [0.0] * dp, {}, dp * self.mb
        self.version = [0] * dp  # bumped whenever a shard takes a sample: older heap entries are stale
        self.heaps: dict[tuple[str, ...], list] = {}  # per set of capped sections a sample activates

    def _heap(self, activated: tuple[str, ...]) -> list:
        """The shards with a free row, as (load, index, version), for samples activating exactly
        the capped sections `activated`; built on first use, then kept lazily (stale entries are
        skipped when popped, shards those samples can never use again in this column dropped)."""
        heap = self.heaps.get(activated)
        if heap is None:
            heap = self.heaps[activated] = [
                (self.loads[c], c, self.version[c]) for c in range(len(self.shards)) if len(self.shards[c]) < self.mb
            ]
            heapq.heapify(heap)
        return heap

    def place(self, x: int) -> bool:
        """Put sample `x` on the least loaded shard (lowest index on ties) that has a free row and
        room in every capped section it activates. The heap pops shards in that order, so a
        sample costs O(log dp) unless caps turn shards away: a shard whose capped shards are all
        full is dropped from the heap of samples activating those sections (counts only grow
        within a column), one turned away only for this sample (its position falls on a full
        shard) goes back untouched."""
        caps = [(s, cap, where, reach) for s, (cap, where, reach) in self.caps.items() if s in self.metas[x].sections]
        heap, used = self._heap(tuple(s for s, *_ in caps)), self.used
        turned_away, chosen = [], None
        while heap:
            entry = heapq.heappop(heap)
            c = entry[1]
            if entry[2] != self.version[c]:
                continue  # stale: the shard took a sample since (a newer entry stands for it) or is full
            if all(used.get((s, where(c, x)), 0) < cap for s, cap, where, _ in caps):
                chosen = c
                break
            if not any(all(used.get((s, i), 0) >= cap for i in reach(c)) for s, cap, _, reach in caps):
                turned_away.append(entry)
        for entry in turned_away:
            heapq.heappush(heap, entry)
        if chosen is None:
            return False
        c = chosen
        self.shards[c].append(x)
        self.loads[c] += self.weight(x)
        self.free -= 1
        self.version[c] += 1
        if len(self.shards[c]) < self.mb:
            for other in self.heaps.values():
                heapq.heappush(other, (self.loads[c], c, self.version[c]))
        for s, _, where, _ in caps:
            key = (s, where(c, x))
            used[key] = used.get(key, 0) + 1
        return True

    def rows(self) -> tuple[int, ...]:
        return _flatten(self.shards, self.mb)


def _pack_columns(samples: Sequence[int], problem: Problem, metas: Sequence[SampleMeta], weight) -> Rows:
    """`_pack` for the sink, except that a sample that would overfill some section's shard waits
    for a later micro-step: every column then fits every section's micro-batch (what `_derive`
    needs to keep the in-flight bound). Same result as `_pack` when nothing overfills: no section
    is capped, so no sample waits and each column is LPT over the next sink micro-step's worth of
    samples (the same heap order), which `_pack` computes without the per-sample bookkeeping."""
    caps = _caps(problem)
    if not caps:
        return _pack(samples, problem.rows[problem.sink], problem.dp[problem.sink], weight)
    ordered, dp = _longest_first(samples, weight), problem.dp[problem.sink]
    if problem.micro_batch(problem.sink) == 1 and len(caps) == 1:
        ((capped, (cap, _, _)),) = caps.items()
        if dp % problem.dp[capped] == 0:
            sections = [m.sections for m in metas]
            ratio = dp // problem.dp[capped]
            return _columns(ordered, functools.partial(_OneRowColumn, sections, capped, ratio, cap, dp))
    return _columns(ordered, functools.partial(_Column, problem, metas, weight, caps))


def _columns(ordered: Sequence[int], column: Callable[[], _Column | _OneRowColumn]) -> Rows:
    """Columns (`column()` makes an empty one) filled with the samples in `ordered` order; a
    sample that does not fit waits for the next column, and is tried first there."""
    out, waiting, i = [], [], 0
    while waiting or i < len(ordered):
        col = column()
        waiting = [x for x in waiting if not col.place(x)]
        while i < len(ordered) and col.free:
            if not col.place(ordered[i]):
                waiting.append(ordered[i])
            i += 1
        out.append(col.rows())
    return out


class _OneRowColumn:
    """`_Column` where the sink takes one sample a shard and one section is capped, whose shards
    each feed `ratio` consecutive sink shards (a group) and take `cap` samples a micro-step: the
    common case at scale, O(1) a sample. There every free shard has load 0, so `_Column.place`
    puts a sample on the lowest free shard (one that activates `capped`: the lowest free shard
    of a group with room), and a group's shards are taken lowest first; both lowest groups only
    move up within a column (shards and room only run out). The same rows, sample for sample
    (`tests/test_wavefront.py`)."""

    def __init__(self, sections: Sequence[frozenset], capped: str, ratio: int, cap: int, dp: int):
        self.sections, self.capped, self.ratio, self.cap = sections, capped, ratio, cap
        self.taken, self.used, self.row = [0] * (dp // ratio), [0] * (dp // ratio), [-1] * dp
        self.free, self.lowest = dp, [0, 0]  # the lowest group with a free shard; with room as well

    def place(self, x: int) -> bool:
        if not self.free:
            return False
        needs, taken, used = self.capped in self.sections[x], self.taken, self.used
        g = self.lowest[needs]
        while g < len(taken) and (taken[g] == self.ratio or (needs and used[g] >= self.cap)):
            g += 1
        self.lowest[needs] = g
        if g == len(taken):
            return False
        self.row[g * self.ratio + taken[g]] = x
        taken[g] += 1
        used[g] += needs
        self.free -= 1
        return True

    def rows(self) -> tuple[int, ...]:
        return tuple(self.row)


def _flatten(shards: Sequence[Sequence[int]], micro_batch: int) -> tuple[int, ...]:
    """Shard-major rows, each shard padded with -1 to the micro-batch."""
    pad, rows = [-1] * micro_batch, []
    for sh in shards:
        rows += sh
        if len(sh) < micro_batch:
            rows += pad[len(sh) :]
    return tuple(rows)


def _weight(batch: _Batch, section: str, by_work: bool):
    """Sample -> its work in the section, or 0 for all (arrival order); a list lookup either way."""
    return (batch.work[section] if by_work else batch.no_work).__getitem__


def wavefront(metas: Sequence[SampleMeta], problem: Problem, cost=None) -> Schedule:
    """Keep the sink (the critical section) busy from the first moment.

    Two families of variants, each list-scheduled against the cost model (`list_schedule`):
    * producer first (`_producer_first`), for every section d besides the sink whose data-parallel
      degree divides the sink's (so each shard of d feeds whole sink shards): d's samples are
      packed into d's micro-steps and the sink consumes them in production order; samples that
      skip d fill the sink's micro-steps while d works;
    * sink first (`_sink_first`): the sink's micro-steps are packed first (its padding dominates
      when it is the bottleneck), in several orders.
    List scheduling starts every section's work as early as dependencies allow and keeps stashed
    forwards within the in-flight bound (a plan with pipeline stages is list-scheduled twice, the
    second and third time in two of 1F1B's orders, `_list_schedule`, and the fastest kept); a variant whose dependencies cannot keep the bound is
    dropped (the sink-first variant with nested micro-steps always keeps it: see `_derive`).
    The naive operation order over each variant's micro-steps, and the arrival-order micro-steps
    (`_arrival`), compete too when they respect the bound and the placement rule (`validate`,
    `block_map`); the fastest by simulated makespan
    is returned, the earliest of them (in the order above) on ties. Deterministic: same batch and
    plan, same schedule, on every host.

    The sink-first variants are built first, though they come last on ties: they usually win at
    scale, and then the variants whose sink forwards alone outlast them are skipped before list
    scheduling (`_Search.hopeless`), which cannot change the winner.
    """
    batch = _Batch(metas, problem, cost)
    search = _Search(batch)
    sink_first = [c for arrival in (False, True) for c in _sink_first(batch, arrival, search)]
    candidates = []
    if not batch.orphans:  # producer first places samples through the sink's micro-steps only
        for longest_first in (True, False):
            for d in problem.order:  # d's shards must each feed whole sink shards (see `_producer_first`)
                if d != problem.sink and problem.dp[problem.sink] % problem.dp[d] == 0:
                    candidates += _producer_first(batch, d, longest_first, search)
    candidates = [c for c in candidates + sink_first if c is not None]
    return _fastest(batch, candidates + _naive_orders(batch, candidates, search))


def _naive_orders(batch: _Batch, candidates: list, search: _Search) -> list:
    """The naive operation order (`_phased`) over each candidate's micro-steps and over the
    arrival-order ones, each once, with its makespan, those that must be checked (`validate`)
    before they may win marked so. Left out: an order that would stash more forwards than the
    bound (it runs all of a section's forwards before its first backward) and one whose sink
    forwards alone outlast the best list schedule (`_Search.hopeless`: it comes after every list
    schedule on ties, so it cannot win)."""
    problem, steps_seen, out = batch.problem, [], []
    arrival = [(_arrival(batch.metas, problem), 0.0)] if _naive_keeps_bound(batch) else []
    for sched, _ in candidates + arrival:
        if any(sched.steps == s for s in steps_seen):
            continue
        steps_seen.append(sched.steps)
        if any(len(sched.steps[s]) > problem.in_flight(s) for s in problem.order if problem.needs_backward(s)):
            continue  # the naive order stashes all of a section's forwards before its first backward
        if search.hopeless([st.positions for st in sched.steps[problem.sink]]):
            continue
        phased = _phased(problem, sched.steps, len(batch.metas))
        out.append((phased, _makespan(phased, batch), True))
    return out


def _fastest(batch: _Batch, candidates: list) -> Schedule:
    """The candidate of least makespan, the earliest on ties, among those that hold the bound and
    the placement rule: `(schedule, makespan)` pairs are list schedules, which keep both by
    construction; `(schedule, makespan, True)` ones are checked (`validate`), in the order they
    would win, until one passes (one check, usually, instead of one each)."""
    for _, _, c in sorted((c[1], i, c) for i, c in enumerate(candidates)):
        if len(c) == 2:
            return c[0]
        try:
            validate(c[0], batch.metas, batch.problem, in_flight=True, block_map=True)
        except ScheduleError:
            continue
        return c[0]
    raise ScheduleError("no candidate schedule keeps the in-flight bound and the placement rule")


def _arrival(metas: Sequence[SampleMeta], problem: Problem) -> Schedule:
    """The micro-steps of arrival order, each section cut on its own (the naive order before
    `naive` placed producers by the sink's rows); a candidate when it happens to keep the
    placement rule and the bound. Ops are left to `_phased`."""
    rows = {s: chunk([i for i, m in enumerate(metas) if s in m.sections], problem.rows[s]) for s in problem.order}
    return Schedule(link(problem, rows), (), len(metas), "naive")


def _naive_keeps_bound(batch: _Batch) -> bool:
    """Whether the arrival-order schedule (`naive`) could keep the in-flight bound: it runs all of
    a trained producer's forwards before its first backward, so not with more micro-steps than
    the bound. Counted from the samples, so that a batch too large for it is not linked."""
    problem = batch.problem
    return all(
        -(-sum(s in secs for secs in batch.sections) // problem.rows[s]) <= problem.in_flight(s)
        for s in problem.order
        if problem.needs_backward(s)
    )


def _phased(problem: Problem, steps, n: int) -> Schedule:
    """The naive operation order (each section after its producers) over given micro-steps."""
    ops: list[Op] = []
    for s in problem.order:
        ops += [Op("F", s, k) for k in range(len(steps[s]))]
        for e in problem.out_edges(s):
            ops += [Op("X", s, k, e.name) for k in sorted(consumers(steps, e))]
    return Schedule(steps, tuple(ops + backward_ops(problem, steps)), n, "wavefront")


def _makespan(schedule: Schedule, batch: _Batch) -> float:
    """The step's simulated time (in steady state under run-ahead: `steady_order`)."""
    problem, graph = batch.problem, batch.graph(schedule.steps)
    index, deps, resource, duration = graph.index, graph.deps, graph.resource, graph.duration
    # each op's finish, this batch's and (under run-ahead) the next batch's; None: not run
    finish: list[float | None] = [None] * len(graph.ops)
    following: list[float | None] = [None] * len(graph.ops)
    for op in schedule.ops:
        if problem.is_ahead(op):
            finish[index[op]] = 0.0  # ran during the previous step
    free: dict[str, float] = {}
    for op, next_batch in steady_order(schedule.ops, problem):
        i, done = index[op], following if next_batch else finish
        res = resource[i]
        done[i] = free[res] = max([free.get(res, 0.0)] + [done[d] for d in deps[i]]) + duration[i]
    return max([t for t in finish + following if t is not None], default=0.0)


def _producer_first(batch: _Batch, d: str, longest_first: bool, search: _Search) -> list:
    """d's samples packed into d's micro-steps (longest first so similar sizes share a bucket, LPT
    across its lockstep shards); the sink consumes them in production order, d's shard i feeding
    sink shards i*r .. i*r+r-1 (r = DP(sink) / DP(d)). The samples that skip d fill the padding of
    those sink micro-steps, and the rest of them form sink micro-steps of their own, interleaved
    while d works (`_interleave`, at several slacks). Other sections follow the sink's order,
    in micro-steps nested in d's where d's split cleanly (`_derive`). No variant at all when the
    sink's micro-steps cannot beat the best schedule so far, whatever their order."""
    problem, sections = batch.problem, batch.sections
    sink = problem.sink
    w_c, w_d = _weight(batch, sink, longest_first), _weight(batch, d, longest_first)
    skip = _longest_first((i for i in batch.active if d not in sections[i]), w_c)
    fixed = {d: _pack([i for i in batch.active if d in sections[i]], problem.rows[d], problem.dp[d], w_d)}
    consuming = _consuming_columns(problem, d, fixed[d], w_c, skip)
    skipping = _pack_columns(skip, problem, batch.metas, w_c)
    if search.hopeless(consuming + skipping):
        return []
    due = _Due(batch, _step_time(batch), d, fixed[d])
    needs = [any(batch.fed[x] for x in c if x >= 0) for c in skipping]
    fillers = ([c for c, n in zip(skipping, needs) if n], [c for c, n in zip(skipping, needs) if not n])
    out = []
    for slack in (0.0, 0.5, 1.0, float("inf")):
        columns = _interleave(batch, due, consuming, fillers, slack)
        cuts = {d: _clean_cuts([due.span(c) for c in columns])}
        out.append(search.finish(_derive(batch, columns, fixed, cuts, grouped=True)))
    return out


def _consuming_columns(problem: Problem, d: str, produced: Rows, w_c, skip: list[int]) -> Rows:
    """Sink micro-steps in production order (`produced`: d's micro-steps): each shard of d's
    samples in blocks of r*mb_c (r = DP(sink) / DP(d)), LPT over the r sink shards it feeds;
    their padding is filled with the shortest of `skip` (taken from its end), least loaded shard
    first (lowest index on ties). With one row per sink shard (the usual case at scale) LPT
    keeps the longest-first order and the shards with room are the empty ones, all at load 0:
    each column is built as rows directly, its padding filled in row order, which saves a list
    per shard."""
    mb_c, mb_d, dp_d = problem.micro_batch(problem.sink), problem.micro_batch(d), problem.dp[d]
    r = problem.dp[problem.sink] // dp_d
    streams = [[x for rows in produced for x in rows[i * mb_d : (i + 1) * mb_d] if x >= 0] for i in range(dp_d)]
    block, pad, columns = r * mb_c, [-1] * r, []
    for j in range(0, max(map(len, streams), default=0), block):
        blocks = [st[j : j + block] for st in streams]
        if mb_c == 1:
            rows = []
            for b in blocks:
                rows += _longest_first(b, w_c) + pad[len(b) :]
            for c in [c for c, x in enumerate(rows) if x < 0][: len(skip)]:
                rows[c] = skip.pop()
            columns.append(tuple(rows))
            continue
        shards = []
        for b in blocks:
            shards += _lpt(_longest_first(b, w_c), r, mb_c, w_c)
        room = [c for c, sh in enumerate(shards) if len(sh) < mb_c]
        for c in sorted(room, key=lambda c: sum(map(w_c, shards[c]))):
            while skip and len(shards[c]) < mb_c:
                shards[c].append(skip.pop())
        columns.append(_flatten(shards, mb_c))
    return columns


def _sink_first(batch: _Batch, arrival: bool, search: _Search) -> list:
    """Pack the sink first, then give each other section's shard the samples of the sink shards it
    feeds, in consumption order. Sink steps that need no other section run first, last, or in
    packing order (each distinct order once). `arrival`: keep samples in arrival order (the naive
    sink rows, made block-mapped). Packings that cannot beat the best schedule so far, whatever
    their order, are skipped."""
    problem = batch.problem
    sink = problem.sink
    w_c = _weight(batch, sink, not arrival)
    packings = [_pack(batch.active, problem.rows[sink], problem.dp[sink], w_c)]
    if (
        not arrival
        and (whole := _pack(batch.active, problem.rows[sink], problem.dp[sink], batch.alone.__getitem__))
        not in packings
    ):
        packings.append(whole)  # by the sample's whole modelled time: the sink's padding is not all of it
    if _caps(problem) and (capped := _pack_columns(batch.active, problem, batch.metas, w_c)) != packings[0]:
        packings.append(capped)  # full sink micro-steps first; then ones that always keep the bound
    if not arrival and problem.balance_shards:  # each packing with the producers' shards balanced
        packings += [d for p in list(packings) if (d := _balanced(batch, p)) is not None and d not in packings]
    tail = _pack_columns(batch.orphans, problem, batch.metas, w_c)
    out = []
    for packed in packings:
        if search.hopeless(packed):
            continue
        uses = [any(batch.fed[x] for x in col if x >= 0) for col in packed]
        orders = {
            tuple(sorted(range(len(packed)), key=lambda j: (fed_first is not None and uses[j] != fed_first, j))): None
            for fed_first in (False, True, None)
        }  # a dict keeps them in this order
        for order in orders:
            columns = [packed[j] for j in order] + tail
            for grouped in (False, True):
                out.append(search.finish(_derive(batch, columns, {}, {}, grouped)))
    return out


def _derive(
    batch: _Batch, columns: Rows, fixed: dict[str, Rows], fixed_cuts: dict[str, set[int]], grouped: bool
) -> dict[str, Rows]:
    """Every section's micro-steps: the sink runs the columns (but those of samples that never reach
    it); sections in `fixed` keep theirs (`fixed_cuts`: the columns they split cleanly before, see
    `_clean_cuts`); every other section takes, per shard, the samples of the sink shards it feeds in column order, cut
    into micro-steps either every micro_batch samples per shard (fullest steps) or, when
    `grouped`, at column boundaries: a micro-step holds whole columns, and a section cuts wherever
    one of its producers cuts. Then each micro-step lies inside one micro-step of every producer
    and spans one or more whole sink steps, so the backward a stashed forward waits on never
    depends on a forward its section is held back from by the in-flight bound: list scheduling
    always finishes (take the unfinished op whose span starts, for a forward, or ends, for a
    backward, earliest; everything it waits on is done or runnable)."""
    problem, sections = batch.problem, batch.sections
    sink = problem.sink
    rows = {sink: [c for c in columns if any(x >= 0 and sink in sections[x] for x in c)], **fixed}
    cuts = dict(fixed_cuts)
    for s in problem.order:
        if s in rows:
            continue
        placed = [batch.placed(col, s) for col in columns]
        mb, dp = problem.micro_batch(s), problem.dp[s]
        if grouped:
            must = set().union(*(cuts[e.src] for e in problem.in_edges(s)))
            rows[s], cuts[s] = _grouped(placed, mb, dp, must)
        else:
            streams = [list(chain.from_iterable(shards)) for shards in zip(*placed)]  # per shard of s
            n = max((-(-len(st) // mb) for st in streams), default=0)
            rows[s] = [_flatten([st[k * mb : (k + 1) * mb] for st in streams], mb) for k in range(n)]
    return rows


def _grouped(placed, mb: int, dp: int, must: set[int]) -> tuple[Rows, set[int]]:
    """Micro-steps of whole consecutive columns: a new one starts at every column in `must` and
    before a column that would overfill a shard. Returns them and the columns they start at
    (`must` included, for the sections downstream). A column that alone overfills a shard, which
    only producer-first columns can do, is split."""
    steps, cuts, cur = [], set(must), [[] for _ in range(dp)]
    for j, add in enumerate(placed):
        if any(cur) and (j in must or any(len(c) + len(a) > mb for c, a in zip(cur, add))):
            steps.append(_flatten(cur, mb))
            cur = [[] for _ in range(dp)]
            cuts.add(j)
        for c, a in zip(cur, add):
            c += a
        while any(len(c) > mb for c in cur):
            steps.append(_flatten([c[:mb] for c in cur], mb))
            cur = [c[mb:] for c in cur]
    if any(cur):
        steps.append(_flatten(cur, mb))
    return steps, cuts


def _clean_cuts(spans: list[tuple[float, float]]) -> set[int]:
    """Columns before which fixed micro-steps split cleanly: none holds samples on both sides.
    `spans`: per column, the first and last fixed micro-step its samples come from (`_Due.span`)."""
    later = [math.inf] * (len(spans) + 1)
    for j in reversed(range(len(spans))):
        later[j] = min(later[j + 1], spans[j][0])
    cuts, before = set(), -1
    for j, (_, last) in enumerate(spans):
        if before < later[j]:
            cuts.add(j)
        before = max(before, last)
    return cuts


def _interleave(batch: _Batch, due: _Due, consuming: Rows, fillers: tuple[Rows, Rows], slack: float) -> Rows:
    """Sink order, estimated with the cost model (`_Due`). The next column that consumes d runs as
    soon as its inputs are due, or earlier when they are due within `slack` filler-step times
    (waiting beats delaying d's backward when d is the bottleneck). Until then a filler runs, a
    column of samples that skip d: one whose other inputs are due already (`fillers[0]`), else
    one that needs the sink alone ("text", `fillers[1]`), else the next. Fillers left over run
    last, text last of all, where they hide the producers' backwards."""
    time, sink = due.time, batch.problem.sink
    busy = dict.fromkeys(batch.problem.order, 0.0)  # when each section besides d is done with the columns so far
    order, clock, i, pos = [], 0.0, 0, [0, 0]
    while i < len(consuming) or pos[0] < len(fillers[0]) or pos[1] < len(fillers[1]):
        k = _next_filler(fillers, pos, due, busy, clock)
        need, at = due.of(consuming[i], busy) if i < len(consuming) else (0.0, {})
        if i < len(consuming) and (k is None or need <= clock + slack * time("F", sink, fillers[k][pos[k]])):
            col, i = consuming[i], i + 1
        else:
            col = fillers[k][pos[k]]
            need, at = due.of(col, busy)
            pos[k] += 1
        clock = max(clock, need) + time("F", sink, col)
        busy.update({s: t for s, t in at.items() if s != due.d})  # the column runs: its sections are busy till then
        order.append(col)
    return order


def _next_filler(
    fillers: tuple[Rows, Rows], pos: list[int], due: _Due, busy: dict[str, float], clock: float
) -> int | None:
    """Which filler goes next (0: of samples that need another section, 1: text): the first when its
    inputs are due by `clock`, else text, else the first; None when none is left."""
    fed, text = pos[0] < len(fillers[0]), pos[1] < len(fillers[1])
    if fed and (not text or due.of(fillers[0][pos[0]], busy)[0] <= clock):
        return 0
    return 1 if text else None


def _step_time(batch: _Batch):
    """(kind, section, rows, edge) -> the cost model's time of that op on a micro-step of `rows`."""

    def time(kind: str, s: str, rows: Sequence[int], edge: str | None = None) -> float:
        return batch.duration(Op(kind, s, 0, edge), {s: (MicroStep(s, 0, tuple(rows), {}),)})

    return time


class _Due:
    """When a column's inputs would be ready if the sink ran it next. d's come from d's micro-steps
    run back to back; every other section works through the columns in the sink's order (a
    column's share of one of its micro-steps costing that share of the step's rows), after the
    section's producers in the column. Built once per producer-first packing: what a column asks
    of each section is memoised across the sink orders tried."""

    def __init__(self, batch: _Batch, time, d: str, produced: Rows):
        self.batch, self.problem, self.time, self.d = batch, batch.problem, time, d
        self.ready, t = [], 0.0
        for r in produced:
            t += time("F", d, r)
            self.ready.append(t + max((time("X", d, r, e.name) for e in self.problem.out_edges(d)), default=0.0))
        self.home = {x: k for k, r in enumerate(produced) for x in r if x >= 0}
        self._loads: dict[tuple[int, ...], list[tuple[str, float]]] = {}
        self._spans: dict[tuple[int, ...], tuple[float, float]] = {}

    def _load(self, col: tuple[int, ...]) -> list[tuple[str, float]]:
        """What the column asks of each section besides the sink, whatever the clock: for d, when
        its inputs are ready; for the others, how long its share of a micro-step takes."""
        if col not in self._loads:
            load = []
            for s in self.problem.order:
                xs = self.batch.activating(col, s)
                if s == self.problem.sink or not xs:
                    continue
                if s == self.d:
                    load.append((s, max(self.ready[self.home[x]] for x in xs)))
                else:
                    load.append((s, self.time("F", s, xs) * len(xs) / self.problem.rows[s]))
            self._loads[col] = load
        return self._loads[col]

    def of(self, col: tuple[int, ...], busy: dict[str, float]) -> tuple[float, dict[str, float]]:
        """(when the column's inputs are ready, when each of its sections finishes its samples),
        the sections besides d being `busy` until then with earlier columns."""
        at: dict[str, float] = {}
        for s, value in self._load(col):
            if s == self.d:
                at[s] = value
            else:
                start = max([busy[s]] + [at[e.src] for e in self.problem.in_edges(s) if e.src in at])
                at[s] = start + value
        return max(at.values(), default=0.0), at

    def span(self, col: tuple[int, ...]) -> tuple[float, float]:
        """The first and last of d's micro-steps the column's samples come from (inf, -1: none)."""
        if col not in self._spans:
            ks = [self.home[x] for x in col if x in self.home]
            self._spans[col] = (min(ks, default=math.inf), max(ks, default=-1))
        return self._spans[col]


class _Search:
    """The candidates list-scheduled so far, memoised on their micro-steps, and the best makespan
    among them, against which `hopeless` prunes."""

    def __init__(self, batch: _Batch):
        self.batch, self.seen, self.best = batch, {}, math.inf
        self.time = _step_time(batch)

    def hopeless(self, columns: Rows) -> bool:
        """Whether the sink's forwards over its micro-steps `columns` alone take longer than the
        best makespan so far: the sink runs them one at a time, so no order of them and no
        micro-steps of the other sections can win, or tie. (The margin, a billionth, is far
        above the rounding of the sums taken in different orders, and far below any real
        difference.)"""
        sink = self.batch.problem.sink
        busy = sum(self.time("F", sink, c) for c in columns)
        return busy > self.best * (1 + 1e-9)

    def outlasts(self, rows: dict[str, Rows]) -> bool:
        """Whether some device group's work over the micro-steps `rows` alone (the forwards,
        backwards and update of every section on it) takes longer than the best makespan so far:
        a group runs one op at a time in the list schedule and in the naive order's makespan
        alike, so neither can win, or tie (`hopeless`'s margin)."""
        problem, time, busy = self.batch.problem, self.time, Counter()
        for s in problem.order:
            work = sum(time("F", s, r) for r in rows[s])
            if problem.needs_backward(s):
                work += sum(time("B", s, r) for r in rows[s])
            if s in problem.trained:
                work += self.batch.duration(Op("U", s), {})
            busy[problem.group(s)] += work
        return max(busy.values(), default=0.0) > self.best * (1 + 1e-9)

    def finish(self, rows: dict[str, Rows]) -> tuple[Schedule, float] | None:
        """List-schedule the micro-steps (memoised on them); None when the in-flight bound cannot
        hold, or when some device group's work alone outlasts the best so far (`outlasts`)."""
        batch, problem = self.batch, self.batch.problem
        key = tuple(tuple(rows[s]) for s in problem.order)
        if key in self.seen:
            return self.seen[key]
        if self.outlasts(rows):
            self.seen[key] = None
            return None
        steps = link(problem, {s: rows[s] for s in problem.order})
        found = []
        for priority in ("earliest", "oldest", "1f1b") if problem.bounds else ("earliest",):  # pipeline stages
            try:
                found.append(_list_schedule(batch, steps, priority))
            except ScheduleError:
                pass
        if not found:
            self.seen[key] = None
            return None
        ops, makespan = min(found, key=lambda f: f[1])
        self.seen[key] = Schedule(steps, ops, len(batch.metas), "wavefront"), makespan
        self.best = min(self.best, makespan)
        return self.seen[key]


def list_schedule(problem: Problem, steps, metas, cost=None) -> tuple[tuple[Op, ...], float]:
    """List scheduling: repeatedly start the op that can start earliest on its own device group.

    Per section the candidates are: the sink's next forward; a trained producer's oldest ready
    backward and its next forward while fewer than its bound (`Problem.in_flight`) are stashed (the earlier
    start wins, forward on ties so the consumer is fed early); a frozen producer's next forward
    (it stashes nothing). Transfers and updates start when ready. The bound is never exceeded:
    when the micro-steps' dependencies leave nothing runnable within it (a stashed forward's
    backward waits on a forward held back by the bound), ScheduleError is raised.
    Returns the ops ordered by planned start time, and the planned makespan.
    """
    return _list_schedule(_Batch(metas, problem, cost), steps)


def _one_f_one_b_age(op: Op, problem: Problem) -> float:
    """An op's place in 1F1B's sequence, for the `order="1f1b"` list schedule: stage i of K runs
    K - i - 1 warm-up forwards, then forward k + K - i - 1 just before backward k. A forward's age
    is its micro-step less its stage's warm-up (`Problem.bounds`: K - i), a backward's its
    micro-step and a half; a co-located section's (a ViT beside the first stage) by its own
    micro-steps, so its backward follows the first stage's backward of the same micro-step."""
    if op.kind == "F":
        return op.step - (problem.bounds.get(op.section, 1) - 1)
    if op.kind == "B":
        return op.step + 0.5
    return op.step


def _list_schedule(batch: _Batch, steps, priority: str = "earliest") -> tuple[tuple[Op, ...], float]:
    """`list_schedule` with the batch's memoised durations.

    `priority` breaks ties among the ops that could start at once. "earliest": the sink's first, then
    forwards. Two orders for pipeline stages, in both of which an update waits until its device
    group has run every forward and backward (a stage's gradient reduction would hold up the
    backwards of sections sharing its devices): "oldest", the op of the earliest micro-step
    first (a co-located teacher stage's next forward no longer runs ahead of the student stage's
    forward of an earlier micro-step, which the stages after it wait on); "1f1b", the op
    earliest in 1F1B's sequence (`_one_f_one_b_age`: a first stage's last forward, which every
    later stage waits on, no longer waits behind the backwards of earlier micro-steps)."""
    return _ListSchedule(batch, steps, priority).run()


class _ListSchedule:
    """One list schedule of micro-steps (`_list_schedule`): the startable ops in a heap on (planned
    start, rank), each entry's start as of its push. Starts only grow (devices and dependencies
    finish later, never earlier), so an entry whose start has grown goes back with its new one,
    and the first entry that is startable and still current is the op a `min` over every startable
    op's (start, rank) would take: O(log n) an op."""

    def __init__(self, batch: _Batch, steps, priority: str):
        problem, graph = batch.problem, batch.graph(steps)
        self.problem, self.ops, self.resource = problem, graph.ops, graph.resource
        self.duration, self.dependents = graph.duration, graph.dependents
        n = len(self.ops)
        self.pending, self.finish, self.dep_done, self.done = list(graph.waits), [0.0] * n, [0.0] * n, [False] * n
        self.free: dict[str, float] = {}
        self.next_f, self.stashed = dict.fromkeys(problem.order, 0), dict.fromkeys(problem.order, 0)
        # per section: how many forwards it may stash (None: unbounded, it keeps none)
        self.bound = {s: problem.in_flight(s) if problem.needs_backward(s) else None for s in problem.order}
        self.ready_b: dict[str, list[int]] = {s: [] for s in problem.order}  # heaps of ready backwards' steps
        self.f_index = {(op.section, op.step): i for i, op in enumerate(self.ops) if op.kind == "F"}
        self.b_index = {(op.section, op.step): i for i, op in enumerate(self.ops) if op.kind == "B"}
        self.staged = priority != "earliest"
        ages = {"earliest": lambda op: 0, "oldest": lambda op: op.step}.get(priority) or functools.partial(
            _one_f_one_b_age, problem=problem
        )
        # ties among ops that could start at once: by age, the sink's first, forwards first, op index
        self.rank = [(ages(op), op.section != problem.sink, op.kind == "B", i) for i, op in enumerate(self.ops)]
        # by device group: its forwards and backwards left (an update waits for none, when staged)
        self.left = Counter(self.resource[i] for i, op in enumerate(self.ops) if self.staged and op.kind in ("F", "B"))
        self.updates: dict[str, list[int]] = {}
        for i, op in enumerate(self.ops):
            if op.kind == "U":
                self.updates.setdefault(self.resource[i], []).append(i)
        self.heap: list[tuple] = []

    def startable(self, i: int) -> bool:
        """Whether op i may start now: its dependencies done, and for a forward its section's
        next within the stash bound, for a backward its section's oldest ready one, for an
        update (staged) every forward and backward of its device group done."""
        if self.done[i] or self.pending[i]:
            return False
        op = self.ops[i]
        if op.kind == "F":
            s = op.section
            return self.next_f[s] == op.step and (self.bound[s] is None or self.stashed[s] < self.bound[s])
        if op.kind == "B":
            return self.ready_b[op.section][0] == op.step
        return op.kind != "U" or not self.left[self.resource[i]]

    def start_of(self, i: int) -> float:
        return max(self.free.get(self.resource[i], 0.0), self.dep_done[i])

    def offer(self, i: int | None) -> None:
        if i is not None and self.startable(i):
            heapq.heappush(self.heap, (self.start_of(i), *self.rank[i]))

    def run(self) -> tuple[tuple[Op, ...], float]:
        """The ops by planned start time and the planned makespan."""
        for i, op in enumerate(self.ops):
            if op.kind == "B" and self.pending[i] == 0:
                heapq.heappush(self.ready_b[op.section], op.step)
        for i in range(len(self.ops)):
            self.offer(i)
        order: list[tuple[float, int, Op]] = []
        while len(order) < len(self.ops):
            i, t0 = self.next_op()
            self.start(i, t0)
            order.append((t0, len(order), self.ops[i]))
        return tuple(op for _, _, op in sorted(order)), max(self.finish, default=0.0)

    def next_op(self) -> tuple[int, float]:
        """The startable op of least (start, rank), and its start."""
        while self.heap:
            entry = heapq.heappop(self.heap)
            i = entry[-1]
            if not self.startable(i):
                continue
            t0 = self.start_of(i)
            if t0 > entry[0]:
                heapq.heappush(self.heap, (t0, *self.rank[i]))
                continue
            return i, t0
        problem = self.problem
        raise ScheduleError(
            "list scheduling is stuck: stashed forwards wait on forwards the in-flight "
            f"bounds {problem.max_in_flight} (and {dict(problem.bounds) or 'no stage bounds'}) hold back (or a "
            "dependency cycle)"
        )

    def start(self, i: int, t0: float) -> None:
        """Run op i from t0: its device busy till it ends, its section's stash and next forward
        moved on, and the ops it unblocks offered."""
        op, s, res = self.ops[i], self.ops[i].section, self.resource[i]
        self.done[i] = True
        self.finish[i] = self.free[res] = t0 + self.duration[i]
        if op.kind == "F":
            self.next_f[s] += 1
            self.stashed[s] += self.bound[s] is not None
        elif op.kind == "B":
            heapq.heappop(self.ready_b[s])
            self.stashed[s] -= 1
            self.offer(self.b_index[(s, self.ready_b[s][0])] if self.ready_b[s] else None)
        if op.kind in ("F", "B"):
            self.offer(self.f_index.get((s, self.next_f[s])))
            if self.staged:
                self.left[res] -= 1
                if not self.left[res]:
                    for u in self.updates.get(res, ()):
                        self.offer(u)
        for j in self.dependents[i]:
            self.pending[j] -= 1
            self.dep_done[j] = max(self.dep_done[j], self.finish[i])
            if self.pending[j] == 0:
                if self.ops[j].kind == "B":
                    heapq.heappush(self.ready_b[self.ops[j].section], self.ops[j].step)
                self.offer(j)
