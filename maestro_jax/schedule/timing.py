"""How long each operation of a schedule takes, from a cost model (or unit costs). Plain Python."""

from __future__ import annotations

from maestro_jax.schedule.ops import Op, Problem


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


def resource_of(op: Op) -> str:
    return f"link:{op.edge}:{op.kind}" if op.kind in ("X", "XB") else op.section
