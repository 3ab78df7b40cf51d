"""Schedule validation: every sample placed once, every dependency and bound respected. Plain Python."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from maestro_jax.core.plan import EdgeInfo
from maestro_jax.schedule.ops import (
    MicroStep,
    Problem,
    SampleMeta,
    Schedule,
    ScheduleError,
    feeders,
    feeds,
    required_ops,
)


def _check_rows(s: str, steps, sections: list, rows: int | None) -> None:
    """Section `s`'s micro-steps have the plan's rows, and hold every sample that activates `s`
    exactly once and no other."""
    seen: Counter[int] = Counter()
    for st in steps:
        if len(st.positions) != rows:
            raise ScheduleError(f"{s} micro-step {st.index} has {len(st.positions)} rows, plan says {rows}")
        samples = st.samples
        for x in samples:
            if s not in sections[x]:
                raise ScheduleError(f"sample {x} does not activate {s} but is in its micro-step {st.index}")
        seen.update(samples)
    expected = [i for i, secs in enumerate(sections) if s in secs]
    if len(seen) != len(expected) or any(seen[i] != 1 for i in expected):
        for i, secs in enumerate(sections):
            if (s in secs) != (seen.get(i, 0) == 1) or seen.get(i, 0) > 1:
                raise ScheduleError(f"sample {i} passes {seen.get(i, 0)} times through {s}; expected {int(s in secs)}")


def validate(
    schedule: Schedule,
    metas: Sequence[SampleMeta],
    problem: Problem,
    *,
    in_flight: bool = False,
    block_map: bool = False,
) -> None:
    """Raise ScheduleError unless every sample and dependency rule holds. Linear in the rows: a
    consumer step's dependencies are checked through each sample's home producer step, never by
    gathering the samples of every step it depends on. `block_map`: also the placement rule on
    every edge (each sample on a consumer shard that its producer shard feeds, `ops.feeds`), which
    the runtime needs (a consumer gathers its rows locally) and both schedulers keep."""
    steps, sections = schedule.steps, [m.sections for m in metas]
    for s in problem.order:
        _check_rows(s, steps.get(s, ()), sections, problem.rows.get(s))
    # every sample now sits in exactly one micro-step of each section it activates
    producers = {e.src for e in problem.edges}
    home = {s: {x: k for k, st in enumerate(steps[s]) for x in st.positions if x >= 0} for s in producers}
    shard = {s: _shards(steps[s], problem.micro_batch(s)) for s in producers} if block_map else {}
    for s in problem.order:
        for st in steps[s]:
            for e in problem.in_edges(s):
                deps = st.deps.get(e.name, ())
                where = home[e.src]
                need = [x for x in st.samples if e.src in sections[x]]
                missing = sorted(x for x in need if where[x] not in deps)
                if missing:
                    raise ScheduleError(
                        f"{s} micro-step {st.index} needs samples {missing} from "
                        f"{e.src} but does not depend on the micro-steps holding them"
                    )
                used = {where[x] for x in need}
                for k in deps:
                    if k not in used:
                        raise ScheduleError(
                            f"{s} micro-step {st.index} depends on {e.src} micro-step {k} "
                            f"without using any of its samples"
                        )
                if block_map:
                    _check_block_map(problem, e, st, shard[e.src])
    _check_ops(schedule, problem, in_flight)


def _shards(steps: Sequence[MicroStep], micro_batch: int) -> dict[int, int]:
    """Sample -> the data shard it sits on in its micro-step."""
    return {x: q // micro_batch for st in steps for q, x in enumerate(st.positions) if x >= 0}


def _check_block_map(problem: Problem, e: EdgeInfo, st: MicroStep, shard_of: dict[int, int]) -> None:
    """Each row of `st` that the producer feeds sits on a consumer shard its producer shard feeds
    (`shard_of`: sample -> producer shard): the shares of the batch the two shards hold overlap,
    which for DP(c) = f * DP(p) is the block map (producer shard i feeds consumer shards
    i*f .. i*f+f-1)."""
    mb_c, dp_p, dp_c = problem.micro_batch(e.dst), problem.dp[e.src], problem.dp[e.dst]
    for r, x in enumerate(st.positions):
        if x in shard_of and not feeds(dp_p, shard_of[x], dp_c, r // mb_c):
            fed = feeders(dp_c, dp_p, shard_of[x])
            how = f" (fanout {dp_c // dp_p})" if dp_c % dp_p == 0 else ""
            raise ScheduleError(
                f"sample {x}: {e.src} shard {shard_of[x]} feeds {e.dst} shards "
                f"{fed.start}..{fed.stop - 1}{how}, but it sits on {e.dst} shard {r // mb_c}"
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
            if peak > problem.in_flight(s):
                raise ScheduleError(f"section {s} stashes {peak} micro-steps, bound is {problem.in_flight(s)}")
