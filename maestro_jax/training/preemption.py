"""SIGTERM (a scheduler's preemption notice) as a flag the training loop reads at step boundaries;
SIGINT as an interrupt that is never lost.

Light (no JAX) so that the CLI installs it before start-up: a notice that arrives while JAX
starts, the runtime compiles or a checkpoint is restored is kept, and the run then stops before
its first step with status 0 (nothing new to save; the last committed checkpoint stays as it
is) instead of dying of the signal (status 143). A `Preemption` entered while another one's
handler is installed (the CLI's, then `train`'s) shares that one's flag instead of replacing
it, so a notice is never lost between them; each restores the handler it found when it exits.
"""

from __future__ import annotations

import signal
import threading


class Interrupt:
    """SIGINT (Ctrl-C): raises KeyboardInterrupt at once, like Python's own handler, and also
    remembers it. Where that exception is swallowed (Python prints "Exception ignored" for one
    raised inside a garbage-collection callback or a `__del__`, and goes on), the training loop
    raises it again at its next step boundary (`raise_if_interrupted`). Installed by the CLI,
    also where SIGINT was inherited ignored (a background job of a non-interactive shell)."""

    def __init__(self):
        self.received = False

    def install(self) -> Interrupt:
        signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        self.received = True
        raise KeyboardInterrupt


def raise_if_interrupted() -> None:
    """KeyboardInterrupt if the installed SIGINT handler is an `Interrupt` that received one."""
    owner = getattr(signal.getsignal(signal.SIGINT), "__self__", None)
    if isinstance(owner, Interrupt) and owner.received:
        raise KeyboardInterrupt


class Preemption:
    """SIGTERM ends training at the next step boundary, after a checkpoint; the process then
    exits with status 0 and a re-run resumes from that step. Multi-process: every process brings
    its flag to the step check-in (`runtime.distributed.step_barrier`), so a notice on any one
    stops all of them after the same step."""

    def __init__(self):
        self._requested = False
        self._outer: Preemption | None = None  # the installed handler's owner, whose flag we share
        self._previous = None
        self._installed = False

    @property
    def requested(self) -> bool:
        return self._outer.requested if self._outer is not None else self._requested

    def _handle(self, signum, frame) -> None:
        self._requested = True

    def report(self, done: int, ckpt, by: list[int]) -> str:
        """What stopping after step `done` left (`by`: the processes that got a notice): a
        checkpoint is said to be saved only once it is committed. Raises the save's error
        instead, if it failed."""
        notice = "SIGTERM" if self.requested else f"preemption notice on process {', '.join(map(str, by))}"
        if ckpt is None:
            return f"{notice}: stopping after step {done}, no checkpoint (keep_checkpoints=0 or no output_dir)"
        ckpt.wait_committed()
        committed = ckpt.coordinator.agree(f"committed-{done}", ckpt.latest_step())
        if committed != done:
            return f"{notice}: the checkpoint of step {done} was not committed (the last committed is step {committed})"
        return f"{notice}: checkpoint saved at step {done}; stopping (re-run to resume)"

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            current = signal.getsignal(signal.SIGTERM)
            owner = getattr(current, "__self__", None)
            if isinstance(owner, Preemption):
                self._outer = owner
            else:
                self._previous = signal.signal(signal.SIGTERM, self._handle)
                self._installed = True
        return self

    def __exit__(self, *exc):
        if self._installed:
            previous = self._previous
            signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
            self._installed = False
