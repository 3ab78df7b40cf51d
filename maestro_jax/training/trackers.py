"""Where step metrics go: a small tracker interface, with JSONL, TensorBoard and W&B built in.

A tracker takes each step's record (a flat dict: `step`, `train/loss`, timings, `train/lr/<section>`, ...)
once the host read it. The config's `trackers` chooses the built-in ones (default JSONL and
TensorBoard), each given the resolved config as the run's hyper-parameters (config.yaml beside
metrics.jsonl; TensorBoard's hparams plugin; W&B's run config); `train(cfg, trackers=[...])`
adds a user's own (MLflow, a queue): anything with `write(record)`, `flush()` and `close()`.
Process 0 writes; the others track nothing.

JSONL and TensorBoard write synchronously on the loop's thread, so a file that cannot be
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
from tensorboardX.summary import hparams, scalar

from maestro_jax.config import Config, ConfigError
from maestro_jax.training.storage import write_error

log = logging.getLogger("maestro_jax")


class Tracker(Protocol):
    """A metrics sink. A tracker may also have `check()`, called before anything compiles, where
    it refuses what it cannot write to (raise `ConfigError` with one `error:` line naming the
    setting), so a run never compiles only to fail at its first record."""

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


def tensorboard_tag(key: str) -> str:
    """A record's key as a TensorBoard tag: named metrics as they are, the host's under `perf/`."""
    return key if key.startswith(("train/", "eval/", "perf/")) else f"perf/{key}"


class TensorBoardTracker:
    """TensorBoard events (`tb/`): every number of the record as a scalar, under its own name where
    it has one (`train/loss`, `train/kd/kl`, `eval/loss`...) and as `perf/<key>` where it is the
    host's (throughput and timings: `perf/samples_per_s`, `perf/dispatch_s`...).

    Every run opens with a `SessionLog.START` event at `start + 1`, which tells TensorBoard to
    purge the events earlier runs wrote from that step on: a resume from a checkpoint, and a
    rerun from step 0 (no checkpoint yet) alike, so each step shows once. The loop flushes the
    events before each checkpoint save, so a kill after it loses none of the steps it holds."""

    def __init__(self, directory: Path, start: int = 0, config: dict | None = None):
        self.directory = directory
        try:
            directory.mkdir(parents=True, exist_ok=True)
            self._events = EventsWriter(str(directory / "events"))
            self._events.write_event(
                Event(wall_time=time.time(), step=start + 1, session_log=SessionLog(status=SessionLog.START))
            )
            if config is not None:  # the hparams plugin's three summaries: the run's settings
                for summary in hparams(flat_config(config), {"train/loss": 0.0}):
                    self._events.write_event(Event(wall_time=time.time(), step=start + 1, summary=summary))
        except OSError as err:
            raise write_error("output_dir", directory, err) from None

    def write(self, record: dict) -> None:
        numbers = {k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "step"}
        try:
            for key, value in numbers.items():
                self._events.write_event(
                    Event(wall_time=time.time(), step=record["step"], summary=scalar(tensorboard_tag(key), value))
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


class WandbTracker:
    """A Weights & Biases run under `<output_dir>/wandb` (`WandbConfig`): the resolved config as
    its config, every number of the record logged at its step. Offline by default: files only."""

    def __init__(self, directory: Path, settings, config: dict):
        import wandb  # an optional extra: `check_trackers` refused the run where it is missing

        directory.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=settings.project,
            name=settings.name,
            mode=settings.mode,
            dir=str(directory),
            config=config,
            settings=wandb.Settings(silent=True, console="off", x_disable_stats=True),
        )

    def write(self, record: dict) -> None:
        numbers = {k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "step"}
        self.run.log(numbers, step=record["step"])

    def flush(self) -> None:
        """W&B writes from its own process; nothing to push here."""

    def close(self) -> None:
        self.run.finish()


# the folder each built-in tracker makes inside output_dir (W&B makes its own `wandb/`; JSONL
# writes output_dir's metrics.jsonl, checked with output_dir itself)
TRACKER_FOLDERS = {"tensorboard": "tb", "wandb": "wandb"}


def tracker_directories(cfg: Config, out_dir: Path | None) -> dict[str, Path]:
    """The folder each of the config's trackers writes to, by the key that names it in errors
    (`trackers[tensorboard]`): checked with output_dir before anything compiles."""
    if out_dir is None:
        return {}
    return {f"trackers[{name}]": out_dir / TRACKER_FOLDERS[name] for name in cfg.trackers if name in TRACKER_FOLDERS}


def check_trackers(cfg: Config, extra=()) -> None:
    """Before anything compiles: a tracker whose package is missing (W&B is an optional extra),
    and each of the `extra` trackers' own `check()` where it has one."""
    import importlib.util

    for tracker in extra:
        if callable(getattr(tracker, "check", None)):
            tracker.check()

    if "wandb" in cfg.trackers and importlib.util.find_spec("wandb") is None:
        raise ConfigError(
            "error: trackers: wandb: the wandb package is not installed; valid: pip install "
            "'maestro-jax[wandb]', or leave wandb out of trackers"
        )


def flat_config(config: dict, prefix: str = "") -> dict:
    """`{"optimizer": {"learning_rate": 0.01}}` as `{"optimizer.learning_rate": 0.01}`: numbers,
    strings and booleans as they are, anything else (lists, None) as its JSON text."""
    out = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flat_config(value, f"{name}."))
        elif isinstance(value, (bool, int, float, str)):
            out[name] = value
        else:
            out[name] = json.dumps(value)
    return out


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


def output_trackers(cfg: Config, out_dir: Path | None, start: int, extra=()) -> Trackers:
    """The config's `trackers` in `out_dir`, then `extra`, on process 0; none on the others."""
    import jax

    if jax.process_index() != 0:
        return Trackers([])
    trackers = []
    if out_dir:
        config = cfg.model_dump(mode="json")
        made = {
            "jsonl": lambda: JsonlTracker(out_dir / "metrics.jsonl", start),
            "tensorboard": lambda: TensorBoardTracker(out_dir / TRACKER_FOLDERS["tensorboard"], start, config),
            "wandb": lambda: WandbTracker(out_dir, cfg.wandb, config),
        }
        trackers += [made[name]() for name in cfg.trackers]
    return Trackers(trackers + list(extra))


def _step_of(line: str) -> int | None:
    """The step of one metrics.jsonl line; None for a line a crash cut short."""
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None
