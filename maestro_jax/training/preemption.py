"""SIGTERM (a scheduler's preemption notice) as a flag the training loop reads at step boundaries.

Light (no JAX) so that the CLI installs it before start-up: a notice that arrives while JAX
starts, the runtime compiles or a checkpoint is restored is kept, and the run then stops before
its first step with status 0 (nothing new to save; the last committed checkpoint stays as it
is) instead of dying of the signal (status 143). Nested uses share one flag: the outermost
installs the handler and restores the previous one when it exits.
"""

from __future__ import annotations

import signal
import threading

_state = {"depth": 0, "requested": False, "previous": None}


class Preemption:
    """SIGTERM ends training at the next step boundary, after a checkpoint; the process then
    exits with status 0 and a re-run resumes from that step."""

    def __init__(self):
        self.by: list[int] = []  # the processes that got a notice (multi-process: any of them)

    @property
    def requested(self) -> bool:
        return _state["requested"]

    def stop_after(self, done: int) -> bool:
        """Whether to checkpoint and stop after step `done`: a notice on this process or on any
        other (multi-process: exchanged in the next step's check-in, so every process stops
        after the same step, and all of them take part in its checkpoint)."""
        from maestro_jax.runtime.distributed import step_barrier  # JAX-free until a run needs it

        self.by = step_barrier(done + 1, self.requested)
        return bool(self.by)

    def report(self, done: int, ckpt) -> str:
        """What stopping after step `done` left: a checkpoint is said to be saved only once it is
        committed (process 0 wrote its manifest). Raises the save's error instead, if it failed."""
        from maestro_jax.runtime.distributed import agree

        notice = "SIGTERM" if self.requested else f"preemption notice on process {', '.join(map(str, self.by))}"
        if ckpt is None:
            return f"{notice}: stopping after step {done}, no checkpoint (keep_checkpoints=0 or no output_dir)"
        ckpt.wait_committed()
        committed = agree(f"committed-{done}", ckpt.latest_step())  # process 0 writes the manifest
        if committed != done:
            return f"{notice}: the checkpoint of step {done} was not committed (the last committed is step {committed})"
        return f"{notice}: checkpoint saved at step {done}; stopping (re-run to resume)"

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            if _state["depth"] == 0:
                _state["requested"] = False
                _state["previous"] = signal.signal(signal.SIGTERM, _handle)
            _state["depth"] += 1
        return self

    def __exit__(self, *exc):
        if threading.current_thread() is threading.main_thread() and _state["depth"]:
            _state["depth"] -= 1
            if _state["depth"] == 0:
                previous = _state["previous"]
                signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
                _state["previous"] = None


def _handle(signum, frame):
    _state["requested"] = True
