"""Schedules reused across steps: a step whose samples ask what an earlier step's asked (the same
sections active and the same work, sample by sample, in the same order) gets that step's schedule.

A schedule is a function of the batch's `SampleMeta`s and the problem alone (the schedulers draw
no random numbers and read no clock) and names samples by their position in the batch, so the
schedule kept is the very one the scheduler would compute again. Uniform data (fixed-length text,
a packed stream, steps that fall in few shape buckets) repeats its signatures, and the
scheduler's host time (milliseconds a step for the tiny configs, a tenth of a second at a thousand
devices) is then paid once per signature, not once per step."""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Sequence

from maestro_jax.schedule.ops import SampleMeta, Schedule

CAPACITY = 64  # signatures kept, the least recently used dropped first


def signature(metas: Sequence[SampleMeta]) -> tuple:
    """What a scheduler reads of a batch, hashable: each sample's active sections and its work in
    each, in batch order."""
    return tuple((tuple(sorted(m.sections)), tuple(sorted(m.work.items()))) for m in metas)


class ScheduleMemo:
    """`compute(metas)` (a scheduler over one problem) kept for the last `capacity` signatures;
    safe to call from the prefetch thread and the main thread at once. `scheduler` and `problem`
    name what it schedules for (its owner builds another memo when either changes); `hits` and
    `misses` count the calls answered from the memo and computed."""

    def __init__(
        self,
        compute: Callable[[Sequence[SampleMeta]], Schedule],
        scheduler: str,
        problem: object,
        capacity: int = CAPACITY,
    ):
        if capacity < 1:
            raise ValueError(f"capacity={capacity}; valid: at least 1")
        self._compute, self.scheduler, self.problem, self.capacity = compute, scheduler, problem, capacity
        self._kept: collections.OrderedDict[tuple, Schedule] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def __call__(self, metas: Sequence[SampleMeta]) -> Schedule:
        key = signature(metas)
        with self._lock:
            kept = self._kept.get(key)
            if kept is not None:
                self._kept.move_to_end(key)
                self.hits += 1
                return kept
        schedule = self._compute(metas)  # outside the lock: another thread may schedule meanwhile
        with self._lock:
            self.misses += 1
            self._kept[key] = schedule
            while len(self._kept) > self.capacity:
                self._kept.popitem(last=False)
        return schedule
