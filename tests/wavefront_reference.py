"""The scheduler as it stood before it was made linear in the batch (commit 123c999), kept
verbatim as the reference the rewrite must match op by op (`test_wavefront.py`): the wavefront
and its helpers, and the pieces of ops, validate, timing and naive it used that have changed.
Not used by the package."""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping, Sequence

from maestro_jax.core.plan import EdgeInfo
from maestro_jax.schedule.ops import MicroStep, Op, Problem, SampleMeta, Schedule, ScheduleError, chunk
from maestro_jax.schedule.timing import resource_of, work_time


def link(
    problem: Problem, rows_by_section: Mapping[str, Sequence[tuple[int, ...]]]
) -> dict[str, tuple[MicroStep, ...]]:
    """Micro-steps with their producer dependencies derived from which samples they hold."""
    home: dict[tuple[str, int], int] = {}
    for s, chunks in rows_by_section.items():
        for k, rows in enumerate(chunks):
            for sample in rows:
                if sample >= 0:
                    home[(s, sample)] = k
    steps = {}
    for s, chunks in rows_by_section.items():
        built = []
        for k, rows in enumerate(chunks):
            deps = {}
            for e in problem.in_edges(s):
                ks = sorted({home[(e.src, x)] for x in rows if x >= 0 and (e.src, x) in home})
                if ks:
                    deps[e.name] = tuple(ks)
            built.append(MicroStep(s, k, rows, deps))
        steps[s] = tuple(built)
    return steps


def backward_ops(problem: Problem, steps: Mapping[str, Sequence[MicroStep]]) -> list[Op]:
    """Cotangent transfers and backwards in reverse topological order, then the updates."""
    ops = []
    for s in reversed(problem.order):
        if problem.needs_backward(s):
            for k in range(len(steps[s])):
                ops += [Op("XB", s, k, e.name) for e in problem.out_edges(s) if consumed(steps, e, k)]
                ops.append(Op("B", s, k))
    ops += [Op("U", s) for s in problem.order if s in problem.trained]
    return ops


def consumed(steps, e: EdgeInfo, k: int) -> bool:
    return any(k in st.deps.get(e.name, ()) for st in steps[e.dst])


def required_ops(schedule: Schedule, problem: Problem) -> dict[Op, list[Op]]:
    """Every op the schedule must contain, mapped to the ops it depends on."""
    steps, req = schedule.steps, {}
    for s in problem.order:
        for st in steps[s]:
            req[Op("F", s, st.index)] = [
                Op("X", e.src, k, e.name) for e in problem.in_edges(s) for k in st.deps.get(e.name, ())
            ]
        for e in problem.out_edges(s):
            for k in range(len(steps[s])):
                if not consumed(steps, e, k):
                    continue
                req[Op("X", s, k, e.name)] = [Op("F", s, k)]
                if problem.sends_cotangent(e):
                    done = "F" if e.dst == problem.sink else "B"
                    req[Op("XB", s, k, e.name)] = [
                        Op(done, e.dst, st.index) for st in steps[e.dst] if k in st.deps.get(e.name, ())
                    ]
    for s in problem.order:
        if problem.needs_backward(s):
            for k in range(len(steps[s])):
                req[Op("B", s, k)] = [Op("F", s, k)] + [
                    Op("XB", s, k, e.name) for e in problem.out_edges(s) if consumed(steps, e, k)
                ]
        if s in problem.trained:
            last = "B" if problem.needs_backward(s) else "F"
            req[Op("U", s)] = [Op(last, s, k) for k in range(len(steps[s]))]
    return req


def validate(
    schedule: Schedule,
    metas: Sequence[SampleMeta],
    problem: Problem,
    *,
    in_flight: bool = False,
    block_map: bool = False,
) -> None:
    """Raise ScheduleError unless every sample and dependency rule holds."""
    steps = schedule.steps
    for s in problem.order:
        seen: dict[int, int] = {}
        for st in steps.get(s, ()):
            if len(st.positions) != problem.rows[s]:
                raise ScheduleError(
                    f"{s} micro-step {st.index} has {len(st.positions)} rows, plan says {problem.rows[s]}"
                )
            for x in st.samples:
                if s not in metas[x].sections:
                    raise ScheduleError(f"sample {x} does not activate {s} but is in its micro-step {st.index}")
                seen[x] = seen.get(x, 0) + 1
        for i, m in enumerate(metas):
            if (s in m.sections) != (seen.get(i, 0) == 1) or seen.get(i, 0) > 1:
                raise ScheduleError(
                    f"sample {i} passes {seen.get(i, 0)} times through {s}; expected {int(s in m.sections)}"
                )
    for s in problem.order:
        for st in steps[s]:
            for e in problem.in_edges(s):
                held = {x for k in st.deps.get(e.name, ()) for x in steps[e.src][k].samples}
                need = {x for x in st.samples if e.src in metas[x].sections}
                if not need <= held:
                    raise ScheduleError(
                        f"{s} micro-step {st.index} needs samples {sorted(need - held)} from "
                        f"{e.src} but does not depend on the micro-steps holding them"
                    )
                for k in st.deps.get(e.name, ()):
                    if not set(steps[e.src][k].samples) & need:
                        raise ScheduleError(
                            f"{s} micro-step {st.index} depends on {e.src} micro-step {k} "
                            f"without using any of its samples"
                        )
                if block_map:
                    _check_block_map(problem, schedule, e, st)
    _check_ops(schedule, problem, in_flight)


def _check_block_map(problem: Problem, schedule: Schedule, e: EdgeInfo, st: MicroStep) -> None:
    mb_p, mb_c, f = (
        problem.micro_batch(e.src),
        problem.micro_batch(e.dst),
        problem.dp[e.dst] // problem.dp[e.src],
    )  # whole fanouts only
    shard_of = {
        x: q // mb_p
        for k in st.deps.get(e.name, ())
        for q, x in enumerate(schedule.steps[e.src][k].positions)
        if x >= 0
    }
    for r, x in enumerate(st.positions):
        if x in shard_of and not shard_of[x] * f <= r // mb_c < (shard_of[x] + 1) * f:
            raise ScheduleError(
                f"sample {x}: {e.src} shard {shard_of[x]} feeds {e.dst} shards "
                f"{shard_of[x] * f}..{(shard_of[x] + 1) * f - 1} (fanout {f}), but it sits on "
                f"{e.dst} shard {r // mb_c}"
            )


def _check_ops(schedule: Schedule, problem: Problem, in_flight: bool) -> None:
    req = required_ops(schedule, problem)
    position = {}
    for i, op in enumerate(schedule.ops):
        if op in position:
            raise ScheduleError(f"operation {op} appears twice")
        position[op] = i
    missing = [str(op) for op in req if op not in position]
    extra = [str(op) for op in position if op not in req]
    if missing or extra:
        raise ScheduleError(f"operations missing: {missing}; unexpected: {extra}")
    for op, deps in req.items():
        for d in deps:
            if position[d] > position[op]:
                raise ScheduleError(f"{op} runs before {d}, which it depends on")
    if in_flight:
        for s in problem.order:
            if not problem.needs_backward(s):
                continue
            stash = peak = 0
            for op in schedule.ops:
                if op.section == s and op.kind in ("F", "B"):
                    stash += 1 if op.kind == "F" else -1
                    peak = max(peak, stash)
            if peak > problem.max_in_flight:
                raise ScheduleError(f"section {s} stashes {peak} micro-steps, bound is {problem.max_in_flight}")


def unit_cost(problem: Problem):
    """Cost when none is given: work units, padded to the micro-step's largest row."""

    def duration(op: Op, steps, metas) -> float:
        if op.kind in ("X", "XB", "U"):
            return 0.0
        st = steps[op.section][op.step]
        units = max((metas[x].work.get(op.section, 0) for x in st.samples), default=0)
        base = problem.micro_batch(op.section) * units
        return base * (2.0 if op.kind == "B" else 3.0 if op.section == problem.sink else 1.0)

    return duration


def op_duration(cost, problem: Problem):
    """(op, steps, metas) -> seconds, from a CostModel (or unit costs when None)."""
    if cost is None:
        return unit_cost(problem)

    def duration(op: Op, steps, metas) -> float:
        if op.kind == "U":
            return cost.update_s.get(op.section, 0.0)
        st = steps[op.section][op.step]
        if op.kind in ("X", "XB"):
            units = [metas[x].work.get(op.section, 0) for x in st.samples]
            return cost.transfer_time(op.edge, units)
        units = [metas[x].work.get(op.section, 0) for x in st.samples]
        kind = "L" if op.section == problem.sink else op.kind
        return cost.step_time(op.section, kind, units, problem.micro_batch(op.section))

    return duration


def naive(metas: Sequence[SampleMeta], problem: Problem) -> Schedule:
    """Samples in arrival order; each section runs all its micro-steps after its producers finish."""
    rows = {s: chunk([i for i, m in enumerate(metas) if s in m.sections], problem.rows[s]) for s in problem.order}
    steps = link(problem, rows)
    ops: list[Op] = []
    for s in problem.order:
        for k in range(len(steps[s])):
            ops.append(Op("F", s, k))
        for e in problem.out_edges(s):
            ops += [Op("X", s, k, e.name) for k in range(len(steps[s])) if consumed(steps, e, k)]
    ops += backward_ops(problem, steps)
    return Schedule(steps, tuple(ops), len(metas), "naive")


Rows = list[tuple[int, ...]]


def _lpt(items: Sequence[int], bins: int, capacity: int, weight) -> list[list[int]]:
    """Longest-processing-time-first over `bins` with a row capacity each (lockstep shards):
    each item goes to the least-loaded bin with room (ties: the lowest index), kept in a heap
    so a batch costs O(n log bins), not O(n * bins)."""
    slots: list[list[int]] = [[] for _ in range(bins)]
    open_bins = [(0.0, b) for b in range(bins)] if capacity > 0 else []  # (load, index): a valid heap
    for x in sorted(items, key=lambda i: (-weight(i), i)):
        load, b = heapq.heappop(open_bins)
        slots[b].append(x)
        if len(slots[b]) < capacity:
            heapq.heappush(open_bins, (load + weight(x), b))
    return slots


def _pack(samples: Sequence[int], rows: int, dp: int, weight) -> list[list[list[int]]]:
    """Longest first into micro-steps (similar sizes share a bucket), LPT across shards inside each."""
    ordered = sorted(samples, key=lambda i: (-weight(i), i))
    return [_lpt(ordered[i : i + rows], dp, rows // dp, weight) for i in range(0, len(ordered), rows)]


def _caps(problem: Problem) -> dict[str, tuple[int, int]]:
    """Sections one sink micro-step can overfill (it has more rows per shard of theirs than their
    micro-batch): section -> (micro-batch, sink shards per shard of the section)."""
    sink = problem.sink
    return {
        s: (problem.micro_batch(s), problem.dp[sink] // problem.dp[s])
        for s in problem.order
        if s != sink and problem.rows[sink] // problem.dp[s] > problem.micro_batch(s)
    }


class _Column:
    """One sink micro-step being filled: each sample on the least loaded sink shard with a free row
    whose shard in every section the sample activates still has room in that section's micro-batch."""

    def __init__(self, problem: Problem, metas: Sequence[SampleMeta], weight, caps: dict[str, tuple[int, int]]):
        self.metas, self.weight, self.caps, self.mb = metas, weight, caps, problem.micro_batch(problem.sink)
        dp = problem.dp[problem.sink]
        self.shards, self.loads, self.used, self.free = [[] for _ in range(dp)], [0.0] * dp, {}, dp * self.mb
        self.open = [(0.0, c) for c in range(dp)] if self.mb > 0 else []  # shards with a free row, a heap

    def place(self, x: int) -> bool:
        """Put sample `x` on the least loaded shard (lowest index on ties) that has a free row and
        room in every capped section it activates. The heap pops shards in that order, so a
        sample costs O(log dp) unless caps turn shards away (those go back untouched)."""
        caps = [(s, cap, ratio) for s, (cap, ratio) in self.caps.items() if s in self.metas[x].sections]
        turned_away, chosen = [], None
        while self.open:
            load, c = heapq.heappop(self.open)
            if all(self.used.get((s, c // ratio), 0) < cap for s, cap, ratio in caps):
                chosen = c
                break
            turned_away.append((load, c))
        for entry in turned_away:
            heapq.heappush(self.open, entry)
        if chosen is None:
            return False
        c = chosen
        self.shards[c].append(x)
        self.loads[c] += self.weight(x)
        self.free -= 1
        if len(self.shards[c]) < self.mb:
            heapq.heappush(self.open, (self.loads[c], c))
        for s, _, ratio in caps:
            self.used[(s, c // ratio)] = self.used.get((s, c // ratio), 0) + 1
        return True


def _pack_columns(
    samples: Sequence[int], problem: Problem, metas: Sequence[SampleMeta], weight
) -> list[list[list[int]]]:
    """`_pack` for the sink, except that a sample that would overfill some section's shard waits
    for a later micro-step: every column then fits every section's micro-batch (what `_derive`
    needs to keep the in-flight bound). Same result as `_pack` when nothing overfills."""
    ordered, caps, out, waiting, i = sorted(samples, key=lambda x: (-weight(x), x)), _caps(problem), [], [], 0
    while waiting or i < len(ordered):
        col = _Column(problem, metas, weight, caps)
        waiting = [x for x in waiting if not col.place(x)]
        while i < len(ordered) and col.free:
            if not col.place(ordered[i]):
                waiting.append(ordered[i])
            i += 1
        out.append(col.shards)
    return out


def _flatten(shards: Sequence[Sequence[int]], micro_batch: int) -> tuple[int, ...]:
    return tuple(x for sh in shards for x in list(sh) + [-1] * (micro_batch - len(sh)))


def _weight(metas: Sequence[SampleMeta], section: str, by_work: bool):
    return (lambda i: metas[i].work.get(section, 0)) if by_work else (lambda i: 0)


def _fed(meta: SampleMeta, sink: str) -> bool:
    """Whether the sample needs a section besides the sink."""
    return any(s != sink for s in meta.sections)


def _orphans(metas: Sequence[SampleMeta], problem: Problem) -> list[int]:
    """Samples that activate sections but not the sink: placed in columns the sink does not run."""
    return [i for i, m in enumerate(metas) if m.sections and problem.sink not in m.sections]


def wavefront(metas: Sequence[SampleMeta], problem: Problem, cost=None) -> Schedule:
    """Keep the sink (the critical section) busy from the first moment.

    Two families of variants, each list-scheduled against the cost model (`list_schedule`):
    * producer first (`_producer_first`), for every section d besides the sink: d's samples are
      packed into d's micro-steps and the sink consumes them in production order; samples that
      skip d fill the sink's micro-steps while d works;
    * sink first (`_sink_first`): the sink's micro-steps are packed first (its padding dominates
      when it is the bottleneck), in several orders.
    List scheduling starts every section's work as early as dependencies allow and keeps stashed
    forwards within the in-flight bound; a variant whose dependencies cannot keep the bound is
    dropped (the sink-first variant with nested micro-steps always keeps it: see `_derive`).
    The naive operation order over each variant's micro-steps, and the arrival-order schedule,
    compete too when they respect the bound and the block map; the fastest by simulated makespan
    is returned. Deterministic: same batch and plan, same schedule, on every host.
    """
    seen: dict = {}
    candidates = []
    if not _orphans(metas, problem):  # producer first places samples through the sink's micro-steps only
        for longest_first in (True, False):
            for d in problem.order:
                if d != problem.sink:
                    candidates += _producer_first(metas, problem, cost, d, longest_first, seen)
    for arrival in (False, True):
        candidates += _sink_first(metas, problem, cost, arrival, seen)
    candidates = [c for c in candidates if c is not None]
    steps_seen = []
    for sched, _ in list(candidates) + [(naive(metas, problem), 0.0)]:
        if any(sched.steps == s for s in steps_seen):
            continue
        steps_seen.append(sched.steps)
        phased = _phased(problem, sched.steps, len(metas))
        try:
            validate(phased, metas, problem, in_flight=True, block_map=True)
        except ScheduleError:
            continue
        candidates.append((phased, _makespan(phased, problem, metas, cost)))
    return min(candidates, key=lambda c: c[1])[0]


def _phased(problem: Problem, steps, n: int) -> Schedule:
    """The naive operation order (each section after its producers) over given micro-steps."""
    ops: list[Op] = []
    for s in problem.order:
        ops += [Op("F", s, k) for k in range(len(steps[s]))]
        for e in problem.out_edges(s):
            ops += [Op("X", s, k, e.name) for k in range(len(steps[s])) if consumed(steps, e, k)]
    return Schedule(steps, tuple(ops + backward_ops(problem, steps)), n, "wavefront")


def _makespan(schedule: Schedule, problem: Problem, metas, cost) -> float:
    req, duration = required_ops(schedule, problem), op_duration(cost, problem)
    finish, free = {}, {}
    for op in schedule.ops:
        res = resource_of(op, problem)
        finish[op] = free[res] = max([free.get(res, 0.0)] + [finish[d] for d in req[op]]) + duration(
            op, schedule.steps, metas
        )
    return max(finish.values(), default=0.0)


def _producer_first(metas, problem: Problem, cost, d: str, longest_first: bool, seen) -> list:
    """d's samples packed into d's micro-steps (longest first so similar sizes share a bucket, LPT
    across its lockstep shards); the sink consumes them in production order, d's shard i feeding
    sink shards i*r .. i*r+r-1 (r = DP(sink) / DP(d)). The samples that skip d fill the padding of
    those sink micro-steps, and the rest of them form sink micro-steps of their own, interleaved
    while d works (`_interleave`, at several slacks). Other sections follow the sink's order,
    in micro-steps nested in d's where d's split cleanly (`_derive`)."""
    sink = problem.sink
    mb_c, mb_d, dp_d = problem.micro_batch(sink), problem.micro_batch(d), problem.dp[d]
    w_c, w_d = _weight(metas, sink, longest_first), _weight(metas, d, longest_first)
    active = [i for i, m in enumerate(metas) if sink in m.sections]
    skip = sorted((i for i in active if d not in metas[i].sections), key=lambda i: (-w_c(i), i))
    produced = _pack([i for i in active if d in metas[i].sections], problem.rows[d], dp_d, w_d)
    fixed = {d: [_flatten(sh, mb_d) for sh in produced]}
    consuming = _consuming_columns(produced, dp_d, problem.dp[sink] // dp_d, mb_c, w_c, skip)
    skipping = [_flatten(sh, mb_c) for sh in _pack_columns(skip, problem, metas, w_c)]
    out = []
    for slack in (0.0, 0.5, 1.0, float("inf")):
        columns = _interleave(problem, metas, cost, d, fixed[d], consuming, skipping, slack)
        out.append(_finish(metas, problem, _derive(problem, metas, columns, fixed, grouped=True), cost, seen))
    return out


def _consuming_columns(produced, dp_d: int, r: int, mb_c: int, w_c, skip: list[int]) -> Rows:
    """Sink micro-steps in production order: each producer shard's samples in blocks of r*mb_c,
    LPT over the r sink shards it feeds; their padding is filled with the shortest of `skip`
    (taken from its end)."""
    streams = [[x for step in produced for x in step[i]] for i in range(dp_d)]
    block, steps = r * mb_c, []
    for j in range(max((-(-len(s) // block) for s in streams), default=0)):
        steps.append([sh for st in streams for sh in _lpt(st[j * block : (j + 1) * block], r, mb_c, w_c)])
    for shards in steps:
        for sh in sorted(shards, key=lambda s: sum(map(w_c, s))):
            while skip and len(sh) < mb_c:
                sh.append(skip.pop())
    return [_flatten(sh, mb_c) for sh in steps]


def _sink_first(metas, problem: Problem, cost, arrival: bool, seen) -> list:
    """Pack the sink first, then give each other section's shard the samples of the sink shards it
    feeds, in consumption order. Sink steps that need no other section run first, last, or in
    packing order. `arrival`: keep samples in arrival order (the naive sink rows, made block-mapped)."""
    sink = problem.sink
    mb_c, w_c = problem.micro_batch(sink), _weight(metas, sink, not arrival)
    active = [i for i, m in enumerate(metas) if sink in m.sections]
    packings = [_pack(active, problem.rows[sink], problem.dp[sink], w_c)]
    if not arrival:  # by each sample's modelled time alone, every section's forward less its fixed cost
        time = work_time(cost, problem)
        alone = [sum(time(Op("F", s), [u]) - time(Op("F", s), []) for s, u in m.work.items()) for m in metas]
        if (whole := _pack(active, problem.rows[sink], problem.dp[sink], lambda x: alone[x])) not in packings:
            packings.append(whole)
    if (capped := _pack_columns(active, problem, metas, w_c)) != packings[0]:
        packings.append(capped)  # full sink micro-steps first; then ones that always keep the bound
    tail = [_flatten(sh, mb_c) for sh in _pack_columns(_orphans(metas, problem), problem, metas, w_c)]
    out = []
    for packed in packings:
        uses = [any(_fed(metas[x], sink) for sh in st for x in sh) for st in packed]
        for fed_first in (False, True, None):
            order = sorted(range(len(packed)), key=lambda j: (fed_first is not None and uses[j] != fed_first, j))
            columns = [_flatten(packed[j], mb_c) for j in order] + tail
            for grouped in (False, True):
                out.append(_finish(metas, problem, _derive(problem, metas, columns, {}, grouped), cost, seen))
    return out


def _derive(problem: Problem, metas, columns: Rows, fixed: dict[str, Rows], grouped: bool) -> dict[str, Rows]:
    """Every section's micro-steps: the sink runs the columns (but those of samples that never reach
    it); sections in `fixed` keep theirs; every other section takes, per shard, the samples of the sink shards it feeds in column order, cut
    into micro-steps either every micro_batch samples per shard (fullest steps) or, when
    `grouped`, at column boundaries: a micro-step holds whole columns, and a section cuts wherever
    one of its producers cuts. Then each micro-step lies inside one micro-step of every producer
    and spans one or more whole sink steps, so the backward a stashed forward waits on never
    depends on a forward its section is held back from by the in-flight bound: list scheduling
    always finishes (take the unfinished op whose span starts, for a forward, or ends, for a
    backward, earliest; everything it waits on is done or runnable)."""
    sink = problem.sink
    rows = {sink: [c for c in columns if any(x >= 0 and sink in metas[x].sections for x in c)], **fixed}
    cuts = {s: _clean_cuts(columns, r) for s, r in fixed.items()}
    for s in problem.order:
        if s in rows:
            continue
        placed = _placed(problem, metas, columns, s)
        mb, dp = problem.micro_batch(s), problem.dp[s]
        if grouped:
            must = set().union(*(cuts[e.src] for e in problem.in_edges(s)))
            rows[s], cuts[s] = _grouped(placed, mb, dp, must)
        else:
            streams = [[x for col in placed for x in col[i]] for i in range(dp)]
            n = max((-(-len(st) // mb) for st in streams), default=0)
            rows[s] = [_flatten([st[k * mb : (k + 1) * mb] for st in streams], mb) for k in range(n)]
    return rows


def _placed(problem: Problem, metas, columns: Rows, s: str) -> list[list[list[int]]]:
    """Per column, per shard of s: the samples activating s, on shard (sink shard) // (DP(sink) / DP(s))."""
    mb_c, ratio = problem.micro_batch(problem.sink), problem.dp[problem.sink] // problem.dp[s]
    out = []
    for col in columns:
        shards = [[] for _ in range(problem.dp[s])]
        for r, x in enumerate(col):
            if x >= 0 and s in metas[x].sections:
                shards[r // mb_c // ratio].append(x)
        out.append(shards)
    return out


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


def _clean_cuts(columns: Rows, steps: Rows) -> set[int]:
    """Columns before which fixed micro-steps split cleanly: none holds samples on both sides."""
    home = {x: k for k, r in enumerate(steps) for x in r if x >= 0}
    used = [[home[x] for x in col if x in home] for col in columns]
    later = [math.inf] * (len(columns) + 1)
    for j in reversed(range(len(columns))):
        later[j] = min([later[j + 1]] + used[j])
    cuts, before = set(), -1
    for j, u in enumerate(used):
        if before < later[j]:
            cuts.add(j)
        before = max([before] + u)
    return cuts


def _interleave(problem, metas, cost, d: str, produced: Rows, consuming: Rows, skipping: Rows, slack: float) -> Rows:
    """Sink order, estimated with the cost model (`_Due`). The next column that consumes d runs as
    soon as its inputs are due, or earlier when they are due within `slack` filler-step times
    (waiting beats delaying d's backward when d is the bottleneck). Until then a filler runs, a
    column of samples that skip d: one whose other inputs are due already, else one that needs
    the sink alone ("text"), else the next. Fillers left over run last, text last of all, where
    they hide the producers' backwards."""
    time, sink = _step_time(problem, metas, cost), problem.sink
    due = _Due(problem, metas, time, d, produced)
    needs = [any(_fed(metas[x], sink) for x in c if x >= 0) for c in skipping]
    fillers = ([c for c, n in zip(skipping, needs) if n], [c for c, n in zip(skipping, needs) if not n])
    order, clock, i, pos = [], 0.0, 0, [0, 0]
    while i < len(consuming) or pos[0] < len(fillers[0]) or pos[1] < len(fillers[1]):
        k = _next_filler(fillers, pos, due, clock)
        need, at = due.of(consuming[i]) if i < len(consuming) else (0.0, {})
        if i < len(consuming) and (k is None or need <= clock + slack * time("F", sink, fillers[k][pos[k]])):
            col, i = consuming[i], i + 1
        else:
            col = fillers[k][pos[k]]
            need, at = due.of(col)
            pos[k] += 1
        clock = max(clock, need) + time("F", sink, col)
        due.commit(at)
        order.append(col)
    return order


def _next_filler(fillers: tuple[Rows, Rows], pos: list[int], due: _Due, clock: float) -> int | None:
    """Which filler goes next (0: of samples that need another section, 1: text): the first when its
    inputs are due by `clock`, else text, else the first; None when none is left."""
    fed, text = pos[0] < len(fillers[0]), pos[1] < len(fillers[1])
    if fed and (not text or due.of(fillers[0][pos[0]])[0] <= clock):
        return 0
    return 1 if text else None


def _step_time(problem: Problem, metas, cost):
    """(kind, section, rows, edge) -> the cost model's time of that op on a micro-step of `rows`."""
    duration = op_duration(cost, problem)

    def time(kind: str, s: str, rows: Sequence[int], edge: str | None = None) -> float:
        return duration(Op(kind, s, 0, edge), {s: (MicroStep(s, 0, tuple(rows), {}),)}, metas)

    return time


class _Due:
    """When a column's inputs would be ready if the sink ran it next. d's come from d's micro-steps
    run back to back; every other section works through the columns in the sink's order (a
    column's share of one of its micro-steps costing that share of the step's rows), after the
    section's producers in the column."""

    def __init__(self, problem: Problem, metas, time, d: str, produced: Rows):
        self.problem, self.metas, self.time, self.d = problem, metas, time, d
        self.clock = dict.fromkeys(problem.order, 0.0)
        self.ready, t = [], 0.0
        for r in produced:
            t += time("F", d, r)
            self.ready.append(t + max((time("X", d, r, e.name) for e in problem.out_edges(d)), default=0.0))
        self.home = {x: k for k, r in enumerate(produced) for x in r if x >= 0}

    def of(self, col: Sequence[int]) -> tuple[float, dict[str, float]]:
        """(when the column's inputs are ready, when each of its sections finishes its samples)."""
        at: dict[str, float] = {}
        for s in self.problem.order:
            xs = [x for x in col if x >= 0 and s in self.metas[x].sections]
            if s == self.problem.sink or not xs:
                continue
            if s == self.d:
                at[s] = max(self.ready[self.home[x]] for x in xs)
            else:
                start = max([self.clock[s]] + [at[e.src] for e in self.problem.in_edges(s) if e.src in at])
                at[s] = start + self.time("F", s, xs) * len(xs) / self.problem.rows[s]
        return max(at.values(), default=0.0), at

    def commit(self, at: dict[str, float]) -> None:
        """The column runs: its sections other than d are busy until then."""
        self.clock.update({s: t for s, t in at.items() if s != self.d})


def _finish(metas, problem: Problem, rows: dict[str, Rows], cost, seen: dict) -> tuple[Schedule, float] | None:
    """List-schedule the micro-steps (memoised on them); None when the in-flight bound cannot hold."""
    key = tuple(tuple(rows[s]) for s in problem.order)
    if key not in seen:
        steps = link(problem, {s: rows[s] for s in problem.order})
        try:
            ops, makespan = list_schedule(problem, steps, metas, cost)
            seen[key] = Schedule(steps, ops, len(metas), "wavefront"), makespan
        except ScheduleError:
            seen[key] = None
    return seen[key]


def list_schedule(problem: Problem, steps, metas, cost=None) -> tuple[tuple[Op, ...], float]:
    """List scheduling: repeatedly start the op that can start earliest on its own device group.

    Per section the candidates are: the sink's next forward; a trained producer's oldest ready
    backward and its next forward while fewer than `max_in_flight` are stashed (the earlier
    start wins, forward on ties so the consumer is fed early); a frozen producer's next forward
    (it stashes nothing). Transfers and updates start when ready. The bound is never exceeded:
    when the micro-steps' dependencies leave nothing runnable within it (a stashed forward's
    backward waits on a forward held back by the bound), ScheduleError is raised.
    Returns the ops ordered by planned start time, and the planned makespan.
    """
    req = required_ops(Schedule(steps, (), len(metas)), problem)
    duration = op_duration(cost, problem)
    ops = list(req)
    index = {op: i for i, op in enumerate(ops)}
    dependents: list[list[int]] = [[] for _ in ops]
    pending = [len(req[op]) for op in ops]
    for i, op in enumerate(ops):
        for d in req[op]:
            dependents[index[d]].append(i)
    finish = [0.0] * len(ops)
    dep_done = [0.0] * len(ops)  # latest finish among an op's dependencies
    free: dict[str, float] = {}
    next_f = dict.fromkeys(problem.order, 0)
    stashed = dict.fromkeys(problem.order, 0)
    ready_b: dict[str, list[int]] = {s: [] for s in problem.order}  # heaps of (step) for ready backwards
    ready_other: set[int] = {i for i, op in enumerate(ops) if op.kind in ("X", "XB", "U") and pending[i] == 0}
    for i, op in enumerate(ops):
        if op.kind == "B" and pending[i] == 0:
            heapq.heappush(ready_b[op.section], op.step)
    f_index = {(op.section, op.step): i for i, op in enumerate(ops) if op.kind == "F"}
    b_index = {(op.section, op.step): i for i, op in enumerate(ops) if op.kind == "B"}
    order: list[tuple[float, int, Op]] = []

    def start_of(i):
        return max(free.get(resource_of(ops[i], problem), 0.0), dep_done[i])

    def candidates() -> list[int]:
        out = list(ready_other)
        for s in problem.order:
            if ready_b[s]:
                out.append(b_index[(s, ready_b[s][0])])
            i = f_index.get((s, next_f[s]))
            if (
                i is not None
                and pending[i] == 0
                and (not problem.needs_backward(s) or stashed[s] < problem.max_in_flight)
            ):
                out.append(i)
        return out

    while len(order) < len(ops):
        cands = candidates()
        if not cands:
            raise ScheduleError(
                "list scheduling is stuck: stashed forwards wait on forwards the in-flight "
                f"bound {problem.max_in_flight} holds back (or a dependency cycle)"
            )
        i = min(cands, key=lambda j: (start_of(j), ops[j].section != problem.sink, ops[j].kind == "B", j))
        op = ops[i]
        t0 = start_of(i)
        finish[i] = t0 + duration(op, steps, metas)
        free[resource_of(op, problem)] = finish[i]
        if op.kind == "F":
            next_f[op.section] += 1
            stashed[op.section] += problem.needs_backward(op.section)
        elif op.kind == "B":
            heapq.heappop(ready_b[op.section])
            stashed[op.section] -= 1
        else:
            ready_other.discard(i)
        for j in dependents[i]:
            pending[j] -= 1
            dep_done[j] = max(dep_done[j], finish[i])
            if pending[j] == 0:
                if ops[j].kind == "B":
                    heapq.heappush(ready_b[ops[j].section], ops[j].step)
                elif ops[j].kind in ("X", "XB", "U"):
                    ready_other.add(j)
        order.append((t0, len(order), op))
    return tuple(op for _, _, op in sorted(order)), max(finish, default=0.0)
