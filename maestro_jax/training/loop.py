"""The training loop: `train(config)` is what the CLI, tests and notebooks call.

With `output_dir`, the run writes `metrics.jsonl` (one JSON object per step), TensorBoard
events (`tb/`), the resolved `config.yaml` and Orbax checkpoints (`checkpoints/`); running
again with the same `output_dir` resumes from the latest complete checkpoint, data order
included, and gives the same per-step losses as an uninterrupted run.

Faults end the run with an exception the CLI maps to an exit status (README, "Fault behaviour"):
`DataError` (a bad sample under `data.on_bad_sample: error`), `NonFiniteError`,
`CheckpointError` (storage), `PeerError` (a dead or stuck process).
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import threading
import time
from pathlib import Path

import jax
from tqdm import tqdm

from maestro_jax.config import Config, dump_config
from maestro_jax.data import BadSamples
from maestro_jax.runtime.build import Runtime, build_runtime
from maestro_jax.runtime.distributed import PeerError, agree, fetch, set_peer_timeout, step_barrier
from maestro_jax.training.checkpoint import Checkpointer, check_checkpoint_layout
from maestro_jax.training.dirlock import hold_directories
from maestro_jax.training.prefetch import Prefetcher

log = logging.getLogger("maestro_jax")


class MetricsWriter:
    """Process 0 writes metrics: JSONL always, TensorBoard when tensorboardX is importable.

    A run that resumes from step `start` first cuts the log back to steps <= `start` (a crash
    after the last checkpoint left later steps that the resumed run computes again) and tells
    TensorBoard to purge its events after `start`, so each step appears once, with the values
    of the run the checkpoints continue."""

    def __init__(self, out_dir: Path | None, start: int = 0):
        self.path = out_dir / "metrics.jsonl" if out_dir else None
        self.tb = None
        if self.path and self.path.exists():
            kept = [line for line in self.path.read_text().splitlines()
                    if line.strip() and _step_of(line) is not None and _step_of(line) <= start]
            tmp = self.path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(line + "\n" for line in kept))
            os.replace(tmp, self.path)
        if out_dir:
            from tensorboardX import SummaryWriter

            self.tb = SummaryWriter(str(out_dir / "tb"), purge_step=start + 1 if start else None)

    def write(self, rec: dict) -> None:
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps(rec) + "\n")
        if self.tb:
            for k, v in rec.items():
                if isinstance(v, (int, float)) and k != "step":
                    self.tb.add_scalar(f"train/{k}", v, rec["step"])

    def close(self) -> None:
        if self.tb:
            self.tb.close()


def _step_of(line: str) -> int | None:
    """The step of one metrics.jsonl line; None for a line a crash cut short."""
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None


class NonFiniteError(RuntimeError):
    """NaN or inf in the loss or a section's gradients, with `on_nonfinite: stop`."""


def train_step(rt, states, samples, step: int, on_nonfinite: str = "stop", schedule=None, norm: int | None = None,
               host: dict | None = None):
    """One optimizer step; NaN/inf loss or grads are detected per section before any update.

    Returns the new states and a metrics record. With `on_nonfinite="skip"` a bad step leaves
    every section's params and optimizer state untouched (`skipped_nonfinite` names them).
    `schedule` and `norm` come with a `LoadedBatch` (whose samples may be partly hollow),
    `host` with a `PreparedBatch` (the micro-steps' inputs, packed ahead).
    The record's host timeline: `dispatch_s` (issuing the step's programs and transfers, of which
    `transfer_issue_s` the transfers), `device_wait_s` (then waiting for the loss), and the
    in-flight bound's waits inside dispatch.
    """
    schedule = schedule if schedule is not None else rt.schedule(samples)
    t0 = time.perf_counter()
    result = rt.executor.run(states, samples, schedule, host=host, norm=norm)
    finite = {s: rt.programs[s].all_finite(g) for s, g in result.grads.items()}
    t1 = time.perf_counter()
    loss = float(fetch(result.loss))  # end of step: the host waits for the devices here
    bad = sorted(s for s, ok in finite.items() if not bool(fetch(ok)))
    if not math.isfinite(loss):
        bad = [f"{rt.graph.sink} (loss)"] + [b for b in bad if b != rt.graph.sink]
    rec = {"step": step, "loss": loss, "dispatch_s": t1 - t0, "device_wait_s": time.perf_counter() - t1,
           "in_flight_waits": result.in_flight_waits, "in_flight_wait_s": result.in_flight_wait_s,
           "transfer_issue_s": result.transfer_issue_s}
    if bad:
        msg = f"step {step}: non-finite loss or gradients in section(s) {', '.join(bad)}"
        if on_nonfinite == "stop":
            raise NonFiniteError(msg + " (on_nonfinite=stop; set on_nonfinite=skip to skip such steps)")
        rec["skipped_nonfinite"] = bad
        return states, rec
    return rt.executor.update(states, result.grads), rec


class Preemption:
    """SIGTERM (a scheduler's preemption notice) ends training at the next step boundary, after a
    checkpoint; the process then exits with status 0 and a re-run resumes from that step."""

    def __init__(self):
        self.requested = False
        self.by: list[int] = []  # the processes that got a notice
        self._previous = None

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def _handle(self, signum, frame):
        self.requested = True

    def stop_after(self, done: int) -> bool:
        """Whether to checkpoint and stop after step `done`: a notice on this process or on any
        other (multi-process: exchanged in the next step's check-in, so every process stops
        after the same step, and all of them take part in its checkpoint)."""
        self.by = step_barrier(done + 1, self.requested)
        return bool(self.by)

    def report(self, done: int, ckpt) -> str:
        """What stopping after step `done` left: a checkpoint is said to be saved only once it is
        committed (process 0 wrote its manifest). Raises the save's error instead, if it failed."""
        notice = "SIGTERM" if self.requested else f"preemption notice on process {', '.join(map(str, self.by))}"
        if ckpt is None:
            return f"{notice}: stopping after step {done}, no checkpoint (keep_checkpoints=0 or no output_dir)"
        ckpt.wait_committed()
        committed = agree(f"committed-{done}", ckpt.latest_step())  # process 0 writes the manifest
        if committed != done:
            return f"{notice}: the checkpoint of step {done} was not committed (the last committed is step {committed})"
        return f"{notice}: checkpoint saved at step {done}; stopping (re-run to resume)"

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)


def train(cfg: Config, progress: bool = True, rt: Runtime | None = None) -> list[dict]:
    """Run until `cfg.steps` optimizer steps are done (resuming if `output_dir` has a checkpoint).

    `rt`: an already built runtime (a user's own graph, see `Trainer`); else the config's
    workload. On SIGTERM, saves a checkpoint after the current step and returns early.
    One run at a time per `output_dir` (and `checkpoint_dir`): another live run holding it is
    refused with a `DirectoryInUseError` (see `dirlock`)."""
    set_peer_timeout(cfg.distributed.timeout_s)
    with hold_directories({"output_dir": cfg.output_dir,
                           "checkpoint_dir": cfg.checkpoint_dir if cfg.output_dir and cfg.keep_checkpoints else None}):
        return _train(cfg, progress, rt)


def _train(cfg: Config, progress: bool, rt: Runtime | None) -> list[dict]:
    if cfg.output_dir and cfg.keep_checkpoints:
        check_checkpoint_layout(cfg.plan())  # before anything compiles
    rt = rt or build_runtime(cfg)
    states = rt.init_states()
    bad = BadSamples() if cfg.data.on_bad_sample == "skip" else None
    data = Prefetcher(rt.reader(bad), rt.executor, bad)
    out_dir = Path(cfg.output_dir) if cfg.output_dir else None
    ckpt = None
    start = 0
    if out_dir:
        out_dir.mkdir(parents=True, exist_ok=True)
        if cfg.keep_checkpoints:
            ckpt = Checkpointer(cfg.checkpoint_dir or out_dir / "checkpoints", cfg.keep_checkpoints,
                                cfg.async_checkpoint)
            try:
                restored = ckpt.restore_latest(states)  # a checkpoint of another config stops here
            except BaseException:
                ckpt.close()
                raise
            if restored is not None:
                start, states, data_state, _ = restored
                data.set_state(data_state)
        if jax.process_index() == 0:  # only once the checkpoints (if any) are known to fit this config
            (out_dir / "config.yaml").write_text(dump_config(cfg))
    if start >= cfg.steps and jax.process_index() == 0:
        print(f"nothing to do: {out_dir} holds a checkpoint at step {start}, at or beyond steps={cfg.steps}", flush=True)
    writer = MetricsWriter(out_dir if jax.process_index() == 0 else None, start)  # process 0 writes metrics
    history = []
    bar = tqdm(range(start, cfg.steps), disable=not progress or jax.process_index() != 0, desc="train", unit="step", initial=start,
               total=cfg.steps)
    with Preemption() as preemption:
        try:
            history = _loop(cfg, rt, states, data, bad, ckpt, writer, bar, history, preemption)
        finally:
            data.close()
    skipped = sum(len(rec.get("skipped_samples", ())) for rec in history)  # batches trained on, not read ahead
    if skipped:
        bar.write(f"skipped {skipped} bad sample(s) (data.on_bad_sample=skip); metrics.jsonl lists them per step")
    return history


def _loop(cfg, rt, states, data, bad, ckpt, writer, bar, history, preemption) -> list[dict]:
    try:
        for step in bar:
            step_barrier(step + 1)  # a dead or stuck peer is named here, within distributed.timeout_s
            t0 = time.perf_counter()
            prepared = next(data)  # read, scheduled and packed while the previous step ran
            batch, samples = prepared.batch, prepared.batch.samples
            states, rec = train_step(rt, states, samples, step + 1, cfg.on_nonfinite, batch.schedule, batch.loss_count,
                                     prepared.host)
            dt = time.perf_counter() - t0
            tokens = sum(len(s.tokens) - 1 for s in samples)
            rec.update({"samples_per_s": len(samples) / dt, "tokens_per_s": tokens / dt, "step_time_s": dt,
                        "data_wait_s": data.data_wait_s, "read_ahead_s": prepared.read_s,
                        "schedule_ahead_s": batch.schedule_s, "pack_ahead_s": prepared.pack_s,
                        "sample_ids": [int(s.id) for s in samples],
                        "data_read_bytes": batch.read_bytes, "data_decoded_bytes": batch.decoded_bytes})
            if prepared.skipped is not None:
                rec["skipped_samples"] = prepared.skipped
            loss = rec["loss"]
            history.append(rec)
            bar.set_postfix(loss=f"{loss:.4f}", samples_per_s=f"{rec['samples_per_s']:.1f}")
            writer.write(rec)
            done = step + 1
            due = done == cfg.steps or (cfg.checkpoint_every and done % cfg.checkpoint_every == 0)
            stop = preemption.stop_after(done)  # a notice on any process stops all of them here
            if ckpt and (due or stop):
                ckpt.save(done, states, data.get_state(), {"seed": cfg.seed, "workload": cfg.workload})
            if stop:
                bar.write(preemption.report(done, ckpt))
                break
    except PeerError:
        writer.close()  # no checkpoint work: committing needs the lost peer (its save is never committed)
        raise
    except BaseException:
        writer.close()
        if ckpt:
            try:
                ckpt.close()  # the last complete save is still committed
            except Exception as err:  # the fault being raised matters more than this one
                log.error("%s", err)
        raise
    writer.close()
    if ckpt:
        ckpt.close()  # commits the final save; a storage fault raises CheckpointError here
    return history
