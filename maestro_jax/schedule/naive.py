"""The naive order: samples in arrival order, each section after its producers. Plain Python."""

from __future__ import annotations

from collections.abc import Sequence

from maestro_jax.schedule.ops import Op, Problem, SampleMeta, Schedule, backward_ops, chunk, consumers, link, shard_of


def naive(metas: Sequence[SampleMeta], problem: Problem) -> Schedule:
    """Samples in arrival order; each section runs all its micro-steps after its producers finish.

    The sink's micro-steps take the samples as they arrive (those that skip the sink follow in
    sink-shaped micro-steps of their own, which the sink does not run); every other section puts
    each sample on the shard the placement rule gives it from its sink row (`ops.shard_of`), each
    shard takes its samples in that order, and a micro-step is cut every micro-batch. So every
    edge feeds every sample to the consumer shard that reads it, for any data-parallel degrees."""
    sink, sections = problem.sink, [m.sections for m in metas]
    columns = chunk([i for i, secs in enumerate(sections) if sink in secs], problem.rows[sink])
    rows = {sink: columns}
    columns = columns + chunk([i for i, secs in enumerate(sections) if secs and sink not in secs], problem.rows[sink])
    for s in problem.order:
        if s != sink:
            rows[s] = _placed_rows(problem, columns, s, sections)
    steps = link(problem, {s: rows[s] for s in problem.order})
    ops: list[Op] = []
    for s in problem.order:
        for k in range(len(steps[s])):
            ops.append(Op("F", s, k))
        for e in problem.out_edges(s):
            ops += [Op("X", s, k, e.name) for k in sorted(consumers(steps, e))]
    ops += backward_ops(problem, steps)
    return Schedule(steps, tuple(ops), len(metas), "naive")


def _placed_rows(problem: Problem, columns, s: str, sections) -> list[tuple[int, ...]]:
    """Section s's micro-steps: per shard, the samples of the sink-shaped `columns` placed on it,
    in column order, `micro_batch(s)` at a time; shard-major rows padded with -1."""
    dp, mb, dp_sink, mb_sink = (
        problem.dp[s],
        problem.micro_batch(s),
        problem.dp[problem.sink],
        problem.micro_batch(problem.sink),
    )
    streams: list[list[int]] = [[] for _ in range(dp)]
    for col in columns:
        for r, x in enumerate(col):
            if x >= 0 and s in sections[x]:
                streams[shard_of(dp_sink, dp, r // mb_sink, x)].append(x)
    n = max((-(-len(st) // mb) for st in streams), default=0)
    out = []
    for k in range(n):
        rows: list[int] = []
        for st in streams:
            part = st[k * mb : (k + 1) * mb]
            rows += part + [-1] * (mb - len(part))
        out.append(tuple(rows))
    return out
