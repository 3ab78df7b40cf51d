"""The order in which the host issues a schedule's operations (no JAX).

XLA's GPU client lets the host queue a bounded number of executions per device ahead of the
device ("allow the client to enqueue up to 32 executions ahead of the device",
xla/pjrt/pjrt_stream_executor_client.cc, implementation notes); one more blocks the calling
thread until the oldest finishes. The executor issues every section's programs from one thread,
so in schedule order a section whose queue is full would stall the launches of every other
section behind it, on devices that may be idle. `dispatch_order` instead defers the ops of a
lane (a section's devices) whose queue is full and issues later ops of other lanes whose
dependencies are already issued; it waits only when no op can go.

The values computed are those of the schedule order: each lane's ops keep their order (a
section's gradient and cotangent sums run in the same sequence), and an op is issued only after
every op it reads from.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence

from maestro_jax.schedule.ops import Op


def dispatch_order(
    ops: Sequence[Op],
    deps: Mapping[Op, Sequence[Op]],
    lane_of: Callable[[Op], Hashable],
    full: Callable[[Hashable], bool],
    wait: Callable[[Hashable], None],
) -> Iterator[Op]:
    """`ops` (a valid schedule order) in the order to issue them: the caller issues each op as
    it is yielded. `full(lane)`: the lane's launch queue cannot take another op now; `wait(lane)`:
    block until it can. Ops whose lane is full are deferred, with every later op of their lane,
    while the first op of another lane whose `deps` are all issued goes ahead. With no lane ever
    full the order is `ops` itself."""
    pending = list(ops)
    issued: set[Op] = set()
    while pending:
        blocked: set[Hashable] = set()
        chosen = None
        for i, op in enumerate(pending):
            lane = lane_of(op)
            if lane in blocked:
                continue
            if all(d in issued for d in deps.get(op, ())) and not full(lane):
                chosen = i
                break
            blocked.add(lane)  # its later ops wait behind it: a lane keeps its order
        if chosen is None:
            wait(lane_of(pending[0]))  # nothing can go: wait where the schedule order waits
            continue
        op = pending.pop(chosen)
        issued.add(op)
        yield op
