"""The wavefront scheduler: reorder a global batch so sections run concurrently. Plain Python."""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from maestro_jax.schedule.naive import naive
from maestro_jax.schedule.ops import (
    MicroStep,
    Op,
    Problem,
    SampleMeta,
    Schedule,
    ScheduleError,
    backward_ops,
    consumed,
    link,
    required_ops,
)
from maestro_jax.schedule.timing import op_duration, resource_of
from maestro_jax.schedule.validate import validate


def _lpt(items: Sequence[int], bins: int, capacity: int, weight) -> list[list[int]]:
    """Longest-processing-time-first over `bins` with a row capacity each (lockstep shards)."""
    loads, slots = [0.0] * bins, [[] for _ in range(bins)]
    for x in sorted(items, key=lambda i: (-weight(i), i)):
        b = min((i for i in range(bins) if len(slots[i]) < capacity), key=lambda i: (loads[i], i))
        slots[b].append(x)
        loads[b] += weight(x)
    return slots


def _pack(samples: Sequence[int], rows: int, dp: int, weight) -> list[list[list[int]]]:
    """Longest first into micro-steps (similar sizes share a bucket), LPT across shards inside each."""
    ordered = sorted(samples, key=lambda i: (-weight(i), i))
    return [_lpt(ordered[i:i + rows], dp, rows // dp, weight) for i in range(0, len(ordered), rows)]


def _flatten(shards: Sequence[Sequence[int]], micro_batch: int) -> tuple[int, ...]:
    return tuple(x for sh in shards for x in list(sh) + [-1] * (micro_batch - len(sh)))


def wavefront(metas: Sequence[SampleMeta], problem: Problem, cost=None) -> Schedule:
    """Keep the sink (the critical section) busy from the first moment.

    * Samples that skip the producer fill the sink's micro-steps while the producer works;
      image micro-steps enter the sink's order as soon as their inputs are estimated ready
      (or slightly before: waiting beats a backward tail when the producer is the bottleneck).
    * Samples that need the producer are packed into producer micro-steps, longest first so
      similar sizes share a bucket, LPT across its lockstep shards, and the sink consumes them
      in production order. Producer shard i feeds sink shards i*f .. i*f+f-1 (fanout f): the
      block map of the plan.
    * Padding rows left in those sink micro-steps are filled with the shortest text-only samples.
    * The operation order comes from list scheduling against the cost model (`list_schedule`):
      sections start work as early as dependencies allow; stashed forwards stay within the
      in-flight bound.
    A handful of such variants (packing order, slack) is scored with the same list schedule,
    together with the arrival-order schedule when it already respects the block map; the
    fastest is returned. Deterministic: same batch and plan, same schedule, on every host.
    """
    sink = problem.sink
    feeds = problem.in_edges(sink)
    if len(feeds) > 1 or any(problem.in_edges(e.src) for e in feeds):
        raise ScheduleError("the wavefront scheduler handles graphs whose producers feed the sink directly "
                            f"through one edge; got edges {[e.name for e in problem.edges]}")
    candidates, seen = [], {}
    for longest_first in (True, False):
        candidates += _variants(metas, problem, cost, feeds[0] if feeds else None, longest_first, seen)
    if feeds:
        for arrival in (False, True):
            candidates += _sink_driven(metas, problem, cost, feeds[0], arrival, seen)
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
        res = resource_of(op)
        finish[op] = free[res] = max([free.get(res, 0.0)] + [finish[d] for d in req[op]]) + duration(
            op, schedule.steps, metas)
    return max(finish.values(), default=0.0)


def _variants(metas, problem, cost, e, longest_first, seen) -> list[tuple[Schedule, float]]:
    sink = problem.sink
    mb_c, dp_c = problem.micro_batch(sink), problem.dp[sink]
    w_c = (lambda i: metas[i].work.get(sink, 0)) if longest_first else (lambda i: 0)
    active = [i for i, m in enumerate(metas) if sink in m.sections]
    rows: dict[str, list[tuple[int, ...]]] = {}
    if e is None:
        rows[sink] = [_flatten(sh, mb_c) for sh in _pack(active, problem.rows[sink], dp_c, w_c)]
        return [_finish(metas, problem, rows, cost, seen)]
    src, f = e.src, problem.fanout.get(e.name, 1)
    mb_p, dp_p = problem.micro_batch(src), problem.dp[src]
    w_p = (lambda i: metas[i].work.get(src, 0)) if longest_first else (lambda i: 0)
    need = [i for i in active if src in metas[i].sections]
    skip = sorted((i for i in active if src not in metas[i].sections), key=lambda i: (-w_c(i), i))
    produced = _pack(need, problem.rows[src], dp_p, w_p)
    rows[src] = [_flatten(sh, mb_p) for sh in produced]
    streams = [[x for step in produced for x in step[i]] for i in range(dp_p)]
    block = f * mb_c
    image_steps = []
    for j in range(max((-(-len(s) // block) for s in streams), default=0)):
        shards = []
        for i in range(dp_p):
            shards += _lpt(streams[i][j * block:(j + 1) * block], f, mb_c, w_c)
        image_steps.append(shards)
    # fill the padding of image micro-steps with the shortest text-only samples
    for shards in image_steps:
        for sh in sorted(shards, key=lambda s: sum(map(w_c, s))):
            while skip and len(sh) < mb_c:
                sh.append(skip.pop())
    text_steps = [_flatten(sh, mb_c) for sh in _pack(skip, problem.rows[sink], dp_c, w_c)]
    image_rows = [_flatten(sh, mb_c) for sh in image_steps]
    out = []
    for slack in (0.0, 0.5, 1.0, float("inf")):
        rows[sink] = _interleave(problem, metas, cost, rows[src], image_rows, text_steps, e, slack)
        out.append(_finish(metas, problem, dict(rows), cost, seen))
    return out


def _sink_driven(metas, problem, cost, e, arrival: bool, seen) -> list[tuple[Schedule, float]]:
    """Pack the sink first (its padding dominates when it is the bottleneck), then give each
    producer shard the image samples of the sink shards it feeds, in consumption order.
    `arrival`: keep samples in arrival order (the naive sink rows, made block-mapped)."""
    sink, src, f = problem.sink, e.src, problem.fanout.get(e.name, 1)
    mb_c, dp_c, mb_p, dp_p = problem.micro_batch(sink), problem.dp[sink], problem.micro_batch(src), problem.dp[src]
    w_c = (lambda i: 0) if arrival else (lambda i: metas[i].work.get(sink, 0))
    active = [i for i, m in enumerate(metas) if sink in m.sections]
    packed = _pack(active, problem.rows[sink], dp_c, w_c)
    uses = [any(src in metas[x].sections for sh in st for x in sh) for st in packed]
    out = []
    for image_first in (False, True, None):
        order = sorted(range(len(packed)), key=lambda j: (image_first is not None and uses[j] != image_first, j))
        streams = [[] for _ in range(dp_p)]
        for j in order:
            for c, sh in enumerate(packed[j]):
                streams[c // f] += [x for x in sh if src in metas[x].sections]
        n = max((-(-len(st) // mb_p) for st in streams), default=0)
        rows = {src: [_flatten([st[k * mb_p:(k + 1) * mb_p] for st in streams], mb_p) for k in range(n)],
                sink: [_flatten(packed[j], mb_c) for j in order]}
        out.append(_finish(metas, problem, rows, cost, seen))
    return out


def _interleave(problem, metas, cost, produced, image_rows, text_rows, edge, slack) -> list[tuple[int, ...]]:
    """Sink order: a text-only micro-step while the next image micro-step's inputs are not yet
    produced (estimated with the cost model), the image micro-step as soon as they are, or
    earlier when they are due within `slack` text-step times (waiting beats delaying the
    producer's backward when the producer is the bottleneck). Text-only steps left over run
    last, where they hide the producer's backward."""
    duration = op_duration(cost, problem)
    src, sink = edge.src, problem.sink
    tmp = {src: tuple(MicroStep(src, k, r, {}) for k, r in enumerate(produced)),
           sink: tuple(MicroStep(sink, k, r, {}) for k, r in enumerate(image_rows + text_rows))}
    ready, t = [], 0.0
    for k in range(len(produced)):
        t += duration(Op("F", src, k), tmp, metas)
        ready.append(t + duration(Op("X", src, k, edge.name), tmp, metas))
    home = {x: k for k, r in enumerate(produced) for x in r if x >= 0}
    need = [max((ready[home[x]] for x in r if x in home), default=0.0) for r in image_rows]
    order, clock, i, j = [], 0.0, 0, 0
    while i < len(image_rows) or j < len(text_rows):
        text_time = duration(Op("F", sink, len(image_rows) + j), tmp, metas) if j < len(text_rows) else 0.0
        if i < len(image_rows) and (j == len(text_rows) or need[i] <= clock + slack * text_time):
            clock = max(clock, need[i]) + duration(Op("F", sink, i), tmp, metas)
            order.append(image_rows[i])
            i += 1
        else:
            clock += duration(Op("F", sink, len(image_rows) + j), tmp, metas)
            order.append(text_rows[j])
            j += 1
    return order


def _finish(metas, problem, rows, cost, seen: dict | None = None) -> tuple[Schedule, float]:
    for s in problem.order:
        rows.setdefault(s, [])
    key = tuple(tuple(rows[s]) for s in problem.order)
    if seen is not None and key in seen:
        return seen[key]
    steps = link(problem, rows)
    ops, makespan = list_schedule(problem, steps, metas, cost)
    result = Schedule(steps, ops, len(metas), "wavefront"), makespan
    if seen is not None:
        seen[key] = result
    return result


def list_schedule(problem: Problem, steps, metas, cost=None) -> tuple[tuple[Op, ...], float]:
    """List scheduling: repeatedly start the op that can start earliest on its own device group.

    Per section the candidates are: the sink's next forward; a trained producer's oldest ready
    backward and its next forward while fewer than `max_in_flight` are stashed (the earlier
    start wins, forward on ties so the consumer is fed early; the bound caps the stash); a frozen
    producer's next forward (it stashes nothing). Transfers and updates start when ready.
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
    scheduled = [False] * len(ops)
    free: dict[str, float] = {}
    next_f = {s: 0 for s in problem.order}
    stashed = {s: 0 for s in problem.order}
    ready_b: dict[str, list[int]] = {s: [] for s in problem.order}  # heaps of (step) for ready backwards
    ready_other: set[int] = {i for i, op in enumerate(ops) if op.kind in ("X", "XB", "U") and pending[i] == 0}
    for i, op in enumerate(ops):
        if op.kind == "B" and pending[i] == 0:
            heapq.heappush(ready_b[op.section], op.step)
    f_index = {(op.section, op.step): i for i, op in enumerate(ops) if op.kind == "F"}
    b_index = {(op.section, op.step): i for i, op in enumerate(ops) if op.kind == "B"}
    order: list[tuple[float, int, Op]] = []

    def start_of(i):
        return max(free.get(resource_of(ops[i]), 0.0), dep_done[i])

    def candidates(relax: bool) -> list[int]:
        out = list(ready_other)
        for s in problem.order:
            if ready_b[s]:
                out.append(b_index[(s, ready_b[s][0])])
            i = f_index.get((s, next_f[s]))
            if i is not None and pending[i] == 0:
                if not problem.needs_backward(s) or relax or stashed[s] < problem.max_in_flight:
                    out.append(i)
        return out

    while len(order) < len(ops):
        cands = candidates(relax=False) or candidates(relax=True)
        if not cands:
            raise ScheduleError("list scheduling found no runnable operation (dependency cycle)")
        i = min(cands, key=lambda j: (start_of(j), ops[j].section != problem.sink, ops[j].kind == "B", j))
        op = ops[i]
        t0 = start_of(i)
        finish[i] = t0 + duration(op, steps, metas)
        free[resource_of(op)] = finish[i]
        scheduled[i] = True
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
