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
    micro_step_rows,
    op_duration,
    op_units,
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


# where a step's device time goes (`device_time`), in the order a report lists them
DEVICE_TIME = ("work", "row_padding", "empty_rows", "bucket_padding", "overhead", "collectives", "optimizer", "idle")


def device_time(timeline: Timeline, schedule: Schedule, problem: Problem, metas: Sequence[SampleMeta], cost) -> dict:
    """Each device's time over one simulated step (`timeline` of `schedule`, priced by the
    `CostModel` `cost`), split by what it is spent on, as shares of the makespan times every
    device (a device group counted once: co-located sections take turns on its devices):

    - `work`: each sample's own compute in each section at the op's per-unit rates, as if its
      rows held nothing else (what the `ceiling` baseline counts);
    - `row_padding`: rows computed at the micro-step's longest row (shards run in lockstep, so a
      shard with lighter rows waits for the heaviest); a packing section's packed rows and its
      empty ones count here too;
    - `empty_rows`: rows no sample fills (a micro-step with fewer samples than rows);
    - `bucket_padding`: the longest row rounded up to its shape bucket (`core.buckets`);
    - `overhead`: each program's fixed cost (`SectionCost.overhead_s`, the per-micro-step price);
    - `collectives`: the per-layer collectives a forward's compute does not hide;
    - `optimizer`: the updates (gradient reduction and the optimizer step, `cost.update_s`);
    - `idle`: no op runs (waiting on a dependency, a transfer or the host).

    Transfers run on links beside the devices (`resource_of`); where a device waits for one, the
    wait is idle. The shares sum to 1."""
    by_section = section_time(timeline, schedule, problem, metas, cost)
    out = {k: sum(d[k] for d in by_section.values()) for k in DEVICE_TIME[:-1]}
    idle = 1.0 - sum(out.values())
    out["idle"] = idle if idle > 1e-9 else 0.0  # an idle-free step's float rounding is no idle
    return out


def section_time(timeline: Timeline, schedule: Schedule, problem: Problem, metas: Sequence[SampleMeta], cost) -> dict:
    """`device_time` by section: {section: {share: value}} of the same total (every share but
    idle, which belongs to no section), so that the sections' shares and idle sum to 1."""
    size = {timeline.groups.get(s, s): n for s, n in timeline.devices.items()}
    total = timeline.makespan * sum(size.values())
    out = {s: dict.fromkeys(DEVICE_TIME[:-1], 0.0) for s in timeline.devices}
    if not total:
        return out
    for i in timeline.intervals:
        op = i.op
        if op.kind in ("X", "XB"):
            continue
        mine, n, t = out[op.section], timeline.devices[op.section], (i.end - i.start) / total
        if op.kind == "U":
            mine["optimizer"] += n * t
            continue
        c = cost.sections[op.section]
        factor = c.sink_factor if op.section == problem.sink else {"F": 1.0, "B": c.backward_factor}[op.kind]
        parts = _forward_parts(op, op_units(op, schedule.steps, metas), problem, c)
        for k, v in parts.items():
            mine[k] += n * factor * v / total
        mine["collectives"] += n * (t - factor * sum(parts.values()) / total)
    return out


def _forward_parts(op: Op, units: Sequence[int], problem: Problem, c) -> dict[str, float]:
    """One shard's forward of `op`'s micro-step (slots of `units` work, shard-major) as the cost
    model prices it (`SectionCost.forward_s`) less its hidden and exposed collectives, split into
    the samples' work, the padding (`device_time`) and the fixed overhead."""
    lengths, rows = micro_step_rows(op, units, problem)
    dp = problem.dp[op.section]

    def compute(u: float) -> float:
        return c.per_unit_s * u + c.per_unit2_s * u * u

    longest = max(lengths, default=0)
    computed, at_longest = rows * compute(c.padded(longest)), rows * compute(longest)
    work = sum(compute(u) for u in units) / dp
    empty = 0.0 if op.section in problem.pack else sum(u == 0 for u in units) / dp * compute(longest)
    return {
        "work": work,
        "row_padding": at_longest - empty - work,
        "empty_rows": empty,
        "bucket_padding": computed - at_longest,
        "overhead": c.overhead_s,
    }
