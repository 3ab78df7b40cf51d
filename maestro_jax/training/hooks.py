"""Your own code at step boundaries: `Trainer.add_hook(fn, every=n)` (Levanter's `add_hook`).

A hook is called with the step's `StepInfo` once the step's results are read, which the loop
does one step late (after issuing the next step, so the devices never wait on a hook's host
work), on every process, in the order the hooks were added. Metrics only: the states of a
read step are already donated to the next one. A hook that raises stops the run as any fault
does (the steps before it are logged, the last checkpoint stays).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping


@dataclasses.dataclass(frozen=True)
class StepInfo:
    step: int  # the optimizer step, from 1
    record: Mapping  # the step's metrics record, as the trackers get it (a copy)


@dataclasses.dataclass(frozen=True)
class Hook:
    fn: Callable[[StepInfo], None]
    every: int = 1  # called after steps every, 2 every, ...

    def __post_init__(self):
        if not (isinstance(self.every, int) and self.every >= 1):
            raise ValueError(f"every={self.every!r}: a hook runs every n steps; valid: an integer >= 1")

    def __call__(self, step: int, record: dict) -> None:
        if step % self.every == 0:
            self.fn(StepInfo(step, dict(record)))
