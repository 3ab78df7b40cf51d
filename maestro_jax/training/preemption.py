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

    @property
    def requested(self) -> bool:
        return _state["requested"]

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
