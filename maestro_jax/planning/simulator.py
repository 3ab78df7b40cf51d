"""Simulator: schedule + cost model -> timeline, makespan, busy time, bubbles and bounds. No JAX.

Each device group (a section's devices, shared by the sections co-located on them) runs its
operations in schedule order (as a device queue does);
an operation starts when its group is free, everything it depends on has finished, and the
host has issued it (the host packs the batch, then issues ops one by one, each taking the
cost model's dispatch time). Transfers run on their own link, one per edge and direction.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from maestro_jax.schedule import (
    Op,
    Problem,
    SampleMeta,
    Schedule,
    op_duration,
    required_ops,
    resource_of,
    steady_order,
)


@dataclasses.dataclass(frozen=True)
class Interval:
    op: Op
    resource: str
    start: float
    end: float


@dataclasses.dataclass(frozen=True)
class Timeline:
    """`devices`: devices per section; `groups`: section -> its device group (co-located sections
    share one group, whose devices they take turns on)."""

    intervals: tuple[Interval, ...]
    devices: Mapping[str, int]
    groups: Mapping[str, str] = dataclasses.field(default_factory=dict)

    @property
    def makespan(self) -> float:
        return max((i.end for i in self.intervals), default=0.0)

    @property
    def busy(self) -> dict[str, float]:
        """Device time per section (its forwards, backwards and updates)."""
        out = dict.fromkeys(self.devices, 0.0)
        for i in self.intervals:
            if i.op.kind not in ("X", "XB") and i.op.section in out:
                out[i.op.section] += i.end - i.start
        return out

    @property
    def group_busy(self) -> dict[str, float]:
        """Device time per device group: the sum over its co-located sections."""
        out: dict[str, float] = {}
        for s, t in self.busy.items():
            g = self.groups.get(s, s)
            out[g] = out.get(g, 0.0) + t
        return out

    @property
    def bubble_ratio(self) -> float:
        """Share of device-time idle within the makespan."""
        size = {self.groups.get(s, s): n for s, n in self.devices.items()}
        total = self.makespan * sum(size.values())
        used = sum(t * size[g] for g, t in self.group_busy.items())
        return 1.0 - used / total if total else 0.0

    @property
    def lower_bound(self) -> float:
        """No schedule of this plan beats its busiest device group: max_g(work_g / devices_g)."""
        return max(self.group_busy.values(), default=0.0)


def simulate(
    schedule: Schedule,
    problem: Problem,
    metas: Sequence[SampleMeta],
    cost=None,
    devices: Mapping[str, int] | None = None,
    serial: bool = False,
) -> Timeline:
    """One step's timeline; under `problem.run_ahead`, a step in steady state (`steady_order`).
    `serial`: every operation shares one executor, as on XLA's CPU client, which runs one
    multi-device program at a time per process; device groups overlap only when False.
    Co-located sections (`problem.groups`) share their group's devices: one runs at a time."""
    req = required_ops(schedule, problem)
    duration = op_duration(cost, problem)
    finish: dict[Op, float] = {}
    origin = getattr(cost, "host_s_per_sample", 0.0) * len(metas)  # batches are packed before dispatch
    free: dict[str, float] = {}
    out = []
    issued = origin  # the host issues ops one after another; devices run them as they arrive
    dispatch = getattr(cost, "dispatch_time", lambda kind: 0.0)
    following: dict[Op, float] = {}  # the next batch's ahead ops, under run-ahead
    finish.update((op, 0.0) for op in schedule.ops if problem.is_ahead(op))  # computed the step before
    for op, next_batch in steady_order(schedule.ops, problem):
        res = resource_of(op, problem)
        done = following if next_batch else finish
        issued += dispatch(op.kind)
        start = max([issued, free.get("device" if serial else res, 0.0)] + [done[d] for d in req.get(op, ())])
        end = start + duration(op, schedule.steps, metas)
        done[op] = free["device" if serial else res] = end
        out.append(Interval(op, res, start, end))
    devices = devices or {s: problem.dp[s] for s in problem.order}
    return Timeline(tuple(out), dict(devices), {s: problem.group(s) for s in problem.order})
