"""How long each operation of a schedule takes, from a cost model (or unit costs). Plain Python."""

from __future__ import annotations

from maestro_jax.schedule.ops import Op, Problem
from maestro_jax.schedule.packing import packed_shape


def micro_step_rows(op: Op, units, problem: Problem) -> tuple[list[int], int]:
    """`op`'s micro-step as its section runs it, from its slots' work units (`op_units`): (row
    lengths, rows a shard); a packing section's as `schedule.packing` packs them."""
    s = op.section
    if s not in problem.pack:
        return units, problem.micro_batch(s)
    n, length = packed_shape(tuple(units), problem.dp[s], problem.micro_batch(s), problem.pack[s])
    return [length] if any(units) else [], n


def work_time(cost, problem: Problem):
    """(op, work units of its micro-step's slots) -> seconds, from a CostModel (or unit costs
    when None: work units, padded to the micro-step's largest row). The units are listed by
    slot, shard-major, 0 for padding (`op_units`), so that a packing section's micro-step
    (`problem.pack`) is priced as the rows `schedule.packing.pack_rows` lays it into: that many
    rows a shard, each as long as the longest packed row (the count form) or the token budget,
    attention over the whole row (the runtime masks attention to each sample inside the row but
    computes every position pair of it). Separate from reading the units off the batch
    (`op_units`) so that a caller meeting the same micro-step again and again (the wavefront's
    candidates) reads them once."""

    if cost is None:

        def unit_time(op: Op, units) -> float:
            if op.kind in ("X", "XB", "U"):
                return 0.0
            lengths, n = micro_step_rows(op, units, problem)
            base = n * max(lengths, default=0)
            return base * (2.0 if op.kind == "B" else 3.0 if op.section == problem.sink else 1.0)

        return unit_time

    def time(op: Op, units) -> float:
        if op.kind == "U":
            return cost.update_s.get(op.section, 0.0)
        if op.kind in ("X", "XB"):
            return cost.transfer_time(op.edge, units)
        kind = "L" if op.section == problem.sink else op.kind
        lengths, n = micro_step_rows(op, units, problem)
        return cost.step_time(op.section, kind, lengths, n)

    return time


def op_units(op: Op, steps, metas) -> list[int]:
    """The work units, in the op's section, of its micro-step's slots (0 for padding, shard-major:
    what a packing section's pricing reads its shards from); none for an update."""
    if op.kind == "U":
        return []
    return [metas[x].work.get(op.section, 0) if x >= 0 else 0 for x in steps[op.section][op.step].positions]


def op_duration(cost, problem: Problem):
    """(op, steps, metas) -> seconds, from a CostModel (or unit costs when None)."""
    time = work_time(cost, problem)

    def duration(op: Op, steps, metas) -> float:
        return time(op, op_units(op, steps, metas))

    return duration


def resource_of(op: Op, problem: Problem) -> str:
    """What an op occupies: its edge's link in its direction, or its section's device group."""
    return f"link:{op.edge}:{op.kind}" if op.kind in ("X", "XB") else problem.group(op.section)


def steady_order(ops, problem: Problem) -> list[tuple[Op, bool]]:
    """The ops one step runs, in issue order, each with whether it is the *next* batch's.

    Without run-ahead, the schedule's ops. With it (`Problem.run_ahead`), a step in steady state:
    this batch's ahead ops (`Problem.is_ahead`) ran during the previous step, so their results
    are ready from the start and they are left out; the step issues its other ops, then the next
    batch's ahead ops (the same work, in this model), which run wherever their devices are free.
    Callers time an op of the next batch against that batch's ops only."""
    if not problem.ahead:
        return [(op, False) for op in ops]
    return [(op, False) for op in ops if not problem.is_ahead(op)] + [(op, True) for op in ops if problem.is_ahead(op)]
