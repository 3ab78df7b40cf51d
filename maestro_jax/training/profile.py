"""`profile: {start_step, steps}`: a `jax.profiler` trace of a window of training steps.

The loop issues step N+1 before it reads step N, so the window opens before its first step is
issued and closes once its last step's results are read: the trace holds every program of those
steps, start to end (and the start of the next step's dispatch). Written into
`<output_dir>/profile` (`<output_dir>/profile/process_<i>` when several processes train), as
TensorBoard's profile plugin and Perfetto read it. A run resumed inside the window traces what
is left of it.
"""

from __future__ import annotations

from pathlib import Path

import jax

from maestro_jax.config import ProfileConfig


class ProfileWindow:
    def __init__(self, profile: ProfileConfig | None, out_dir: Path | None):
        self.window = range(profile.start_step, profile.start_step + profile.steps) if profile else range(0)
        self.directory = None
        if profile and out_dir is not None:
            self.directory = out_dir / "profile"
            if jax.process_count() > 1:
                self.directory = self.directory / f"process_{jax.process_index()}"
        self.tracing = False

    def before_issue(self, step: int) -> None:
        """Step `step` is about to be issued: open the trace if the step is in the window."""
        if not self.tracing and step in self.window and self.directory is not None:
            jax.profiler.start_trace(str(self.directory))
            self.tracing = True

    def after_read(self, step: int) -> None:
        """Step `step`'s results were read: close the trace after the window's last step."""
        if self.tracing and step >= self.window[-1]:
            self.close()

    def close(self) -> None:
        """Stop a trace still open (the run ended or failed inside the window)."""
        if self.tracing:
            self.tracing = False
            jax.profiler.stop_trace()
