"""Where step metrics go: a small tracker interface, with JSONL and TensorBoard built in.

A tracker takes each step's record (a flat dict: `step`, `loss`, timings, `lr/<section>`, ...)
once the host read it. `train(cfg, trackers=[...])` adds a user's own (W&B, MLflow, a queue):
anything with `write(record)`, `flush()` and `close()`. Process 0 writes; the others track
nothing.

Both built-in trackers write synchronously on the loop's thread, so a file that cannot be
written (a full or read-only `output_dir`) is a `StorageError` naming it at the step that hit
it. A run that resumes from step `start` first forgets what the log holds after `start` (a
crash after the last checkpoint left later steps, which the resumed run computes again), so
each step appears once, with the values of the run the checkpoints continue.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Protocol

from tensorboardX.event_file_writer import EventsWriter
from tensorboardX.proto.event_pb2 import Event, SessionLog
from tensorboardX.summary import scalar

from maestro_jax.training.storage import write_error

log = logging.getLogger("maestro_jax")


class Tracker(Protocol):
    def write(self, record: dict) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


class JsonlTracker:
    """`metrics.jsonl`: one JSON object per step, every key of the record."""

    def __init__(self, path: Path, start: int = 0):
        self.path = path
        if path.exists():
            kept = [
                line for line in path.read_text().splitlines() if (step := _step_of(line)) is not None and step <= start
            ]
            tmp = path.with_suffix(".jsonl.tmp")
            try:
                tmp.write_text("".join(line + "\n" for line in kept))
                os.replace(tmp, path)
            except OSError as err:
                tmp.unlink(missing_ok=True)
                raise write_error("output_dir", path, err) from None

    def write(self, record: dict) -> None:
        try:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")
        except OSError as err:
            raise write_error("output_dir", self.path, err) from None

    def flush(self) -> None:
        """Each `write` closes the file: nothing is buffered."""

    def close(self) -> None:
        """Nothing held open."""


class TensorBoardTracker:
    """TensorBoard events (`tb/`): every number of the record as the scalar `train/<key>`.

    Every run opens with a `SessionLog.START` event at `start + 1`, which tells TensorBoard to
    purge the events earlier runs wrote from that step on: a resume from a checkpoint, and a
    rerun from step 0 (no checkpoint yet) alike, so each step shows once. The loop flushes the
    events before each checkpoint save, so a kill after it loses none of the steps it holds."""

    def __init__(self, directory: Path, start: int = 0):
        self.directory = directory
        try:
            directory.mkdir(parents=True, exist_ok=True)
            self._events = EventsWriter(str(directory / "events"))
            self._events.write_event(
                Event(wall_time=time.time(), step=start + 1, session_log=SessionLog(status=SessionLog.START))
            )
        except OSError as err:
            raise write_error("output_dir", directory, err) from None

    def write(self, record: dict) -> None:
        numbers = {k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "step"}
        try:
            for key, value in numbers.items():
                self._events.write_event(
                    Event(wall_time=time.time(), step=record["step"], summary=scalar(f"train/{key}", value))
                )
        except OSError as err:
            raise write_error("output_dir", self.directory, err, "writing TensorBoard events to") from None

    def flush(self) -> None:
        try:
            self._events.flush()
        except OSError as err:
            raise write_error("output_dir", self.directory, err, "writing TensorBoard events to") from None

    def close(self) -> None:
        try:
            self._events.close()
        except OSError as err:
            raise write_error("output_dir", self.directory, err, "writing TensorBoard events to") from None


class Trackers:
    """Every tracker of a run, as one: a context manager that closes them all. Leaving on a
    fault closes them without raising (the fault comes first; a failed close is logged)."""

    def __init__(self, trackers: list):
        self.trackers = trackers

    def write(self, record: dict) -> None:
        for t in self.trackers:
            t.write(record)

    def flush(self) -> None:
        for t in self.trackers:
            t.flush()

    def __enter__(self):
        return self

    def __exit__(self, kind, err, tb) -> None:
        for t in self.trackers:
            try:
                t.close()
            except Exception as close_err:
                if kind is None:
                    raise
                log.error("%s", close_err)


def output_trackers(out_dir: Path | None, start: int, extra=()) -> Trackers:
    """JSONL and TensorBoard in `out_dir`, then `extra`, on process 0; none on the others."""
    import jax

    if jax.process_index() != 0:
        return Trackers([])
    trackers = []
    if out_dir:
        trackers += [JsonlTracker(out_dir / "metrics.jsonl", start), TensorBoardTracker(out_dir / "tb", start)]
    return Trackers(trackers + list(extra))


def _step_of(line: str) -> int | None:
    """The step of one metrics.jsonl line; None for a line a crash cut short."""
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None
