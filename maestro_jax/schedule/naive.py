"""The naive order: samples in arrival order, each section after its producers. Plain Python."""

from __future__ import annotations

from collections.abc import Sequence

from maestro_jax.schedule.ops import Op, Problem, SampleMeta, Schedule, backward_ops, chunk, consumers, link


def naive(metas: Sequence[SampleMeta], problem: Problem) -> Schedule:
    """Samples in arrival order; each section runs all its micro-steps after its producers finish."""
    rows = {s: chunk([i for i, m in enumerate(metas) if s in m.sections], problem.rows[s]) for s in problem.order}
    steps = link(problem, rows)
    ops: list[Op] = []
    for s in problem.order:
        for k in range(len(steps[s])):
            ops.append(Op("F", s, k))
        for e in problem.out_edges(s):
            ops += [Op("X", s, k, e.name) for k in sorted(consumers(steps, e))]
    ops += backward_ops(problem, steps)
    return Schedule(steps, tuple(ops), len(metas), "naive")
