"""Schedule validation: every sample placed once, every dependency and bound respected. Plain Python."""

from __future__ import annotations

from collections.abc import Sequence

from maestro_jax.core.plan import EdgeInfo
from maestro_jax.schedule.ops import MicroStep, Problem, SampleMeta, Schedule, ScheduleError, required_ops


def validate(schedule: Schedule, metas: Sequence[SampleMeta], problem: Problem, *, in_flight: bool = False,
             block_map: bool = False) -> None:
    """Raise ScheduleError unless every sample and dependency rule holds."""
    steps = schedule.steps
    for s in problem.order:
        seen: dict[int, int] = {}
        for st in steps.get(s, ()):
            if len(st.rows) != problem.rows[s]:
                raise ScheduleError(f"{s} micro-step {st.index} has {len(st.rows)} rows, plan says {problem.rows[s]}")
            for x in st.samples:
                if s not in metas[x].sections:
                    raise ScheduleError(f"sample {x} does not activate {s} but is in its micro-step {st.index}")
                seen[x] = seen.get(x, 0) + 1
        for i, m in enumerate(metas):
            if (s in m.sections) != (seen.get(i, 0) == 1) or seen.get(i, 0) > 1:
                raise ScheduleError(f"sample {i} passes {seen.get(i, 0)} times through {s}; "
                                    f"expected {int(s in m.sections)}")
    for s in problem.order:
        for st in steps[s]:
            for e in problem.in_edges(s):
                held = {x for k in st.deps.get(e.name, ()) for x in steps[e.src][k].samples}
                need = {x for x in st.samples if e.src in metas[x].sections}
                if not need <= held:
                    raise ScheduleError(f"{s} micro-step {st.index} needs samples {sorted(need - held)} from "
                                        f"{e.src} but does not depend on the micro-steps holding them")
                for k in st.deps.get(e.name, ()):
                    if not set(steps[e.src][k].samples) & need:
                        raise ScheduleError(f"{s} micro-step {st.index} depends on {e.src} micro-step {k} "
                                            f"without using any of its samples")
                if block_map:
                    _check_block_map(problem, schedule, e, st)
    _check_ops(schedule, problem, in_flight)


def _check_block_map(problem: Problem, schedule: Schedule, e: EdgeInfo, st: MicroStep) -> None:
    mb_p, mb_c, f = problem.micro_batch(e.src), problem.micro_batch(e.dst), problem.fanout.get(e.name, 1)
    shard_of = {x: q // mb_p for k in st.deps.get(e.name, ()) for q, x in enumerate(schedule.steps[e.src][k].rows)
                if x >= 0}
    for r, x in enumerate(st.rows):
        if x in shard_of and not shard_of[x] * f <= r // mb_c < (shard_of[x] + 1) * f:
            raise ScheduleError(f"sample {x}: {e.src} shard {shard_of[x]} feeds {e.dst} shards "
                                f"{shard_of[x] * f}..{(shard_of[x] + 1) * f - 1} (fanout {f}), but it sits on "
                                f"{e.dst} shard {r // mb_c}")


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
