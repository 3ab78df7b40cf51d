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
import threading
import time
from pathlib import Path

import jax
from tqdm import tqdm

from maestro_jax.config import Config, dump_config
from maestro_jax.data import BadSamples
from maestro_jax.runtime.build import Runtime, build_runtime
from maestro_jax.runtime.distributed import PeerError, fetch, set_peer_timeout, step_barrier
from maestro_jax.runtime.optimizer import current_rate
from maestro_jax.training.checkpoint import Checkpointer, check_checkpoint_layout
from maestro_jax.training.dirlock import hold_directories
from maestro_jax.training.preemption import Preemption
from maestro_jax.training.prefetch import Prefetcher
from maestro_jax.training.storage import check_directories, write_error

log = logging.getLogger("maestro_jax")


class MetricsWriter:
    """Process 0 writes metrics: JSONL always, TensorBoard when tensorboardX is importable.

    A run that resumes from step `start` first cuts the log back to steps <= `start` (a crash
    after the last checkpoint left later steps that the resumed run computes again) and tells
    TensorBoard to purge its events after `start`, so each step appears once, with the values
    of the run the checkpoints continue.

    A file that cannot be written (a full or read-only `output_dir`) is a `StorageError` naming
    it. tensorboardX writes on a thread of its own, which dies on such an error and would then
    block the next writes forever once its queue fills: its death is noticed (and its traceback
    kept off stderr) at the next `write`, and its queue is long enough that no write blocks."""

    def __init__(self, out_dir: Path | None, start: int = 0):
        self.path = out_dir / "metrics.jsonl" if out_dir else None
        self.tb = None
        if self.path and self.path.exists():
            kept = [line for line in self.path.read_text().splitlines()
                    if line.strip() and _step_of(line) is not None and _step_of(line) <= start]
            tmp = self.path.with_suffix(".jsonl.tmp")
            try:
                tmp.write_text("".join(line + "\n" for line in kept))
                os.replace(tmp, self.path)
            except OSError as err:  # a full or read-only output_dir: one line, status 4
                tmp.unlink(missing_ok=True)
                raise write_error("output_dir", self.path, err) from None
        if out_dir:
            from tensorboardX import SummaryWriter

            try:
                self.tb = SummaryWriter(str(out_dir / "tb"), purge_step=start + 1 if start else None,
                                        max_queue=1024)
            except OSError as err:
                raise write_error("output_dir", out_dir / "tb", err) from None
            self._tb_error: BaseException | None = None
            self._tb_worker = getattr(getattr(self.tb.file_writer, "event_writer", None), "_worker", None)
            self._previous_hook = threading.excepthook
            threading.excepthook = self._thread_died

    def _thread_died(self, args) -> None:
        if self._tb_worker is not None and args.thread is self._tb_worker:
            self._tb_error = args.exc_value  # reported by `write` as a StorageError
        else:
            self._previous_hook(args)

    def write(self, rec: dict) -> None:
        if self.path:
            try:
                with open(self.path, "a") as f:
                    f.write(json.dumps(rec) + "\n")
            except OSError as err:  # a full or read-only output_dir: one line, status 4
                raise write_error("output_dir", self.path, err) from None
        if self.tb:
            if self._tb_worker is not None and not self._tb_worker.is_alive():
                err = self._tb_error
                err = err if isinstance(err, OSError) else OSError(f"its writer thread stopped: {err!r}")
                raise write_error("output_dir", Path(self.tb.logdir), err, "writing TensorBoard events to")
            for k, v in rec.items():
                if isinstance(v, (int, float)) and k != "step":
                    self.tb.add_scalar(f"train/{k}", v, rec["step"])

    def close(self) -> None:
        """Never raises: a failed final flush of TensorBoard events is a warning (the fault that
        ends a run, if any, is raised by whoever called; checkpoints still commit after this)."""
        if self.tb:
            try:
                self.tb.close()
            except Exception as err:
                log.warning("closing TensorBoard events in %s: %s", self.tb.logdir, err)
                events = getattr(getattr(self.tb, "file_writer", None), "event_writer", None)
                if events is not None:  # else tensorboardX's exit hook retries and prints a traceback
                    events._closed = True
            finally:
                if threading.excepthook == self._thread_died:
                    threading.excepthook = self._previous_hook
                self.tb = None


def _step_of(line: str) -> int | None:
    """The step of one metrics.jsonl line; None for a line a crash cut short."""
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None


class NonFiniteError(RuntimeError):
    """NaN or inf in the loss or a section's gradients, with `on_nonfinite: stop`."""


class IssuedStep:
    """One optimizer step issued to the devices whose results the host has not read yet.

    Reading the loss and the per-section finiteness flags (`read`) is the host's one wait on the
    devices in a step. The loop reads step N only after issuing step N+1, so the devices are
    never idle while the host dispatches; it reads at once only where the next action needs the
    result (a checkpoint, the last step, a preemption, `on_nonfinite: skip`), and the record's
    `wait_reason` says which."""

    def __init__(self, step: int, loss, finite: dict, sink: str, on_nonfinite: str, record: dict,
                 norms_sq: dict | None = None):
        self.step, self.loss, self.finite, self.sink, self.on_nonfinite = step, loss, finite, sink, on_nonfinite
        self.record = record
        self.norms_sq = norms_sq or {}  # each trained section's squared grad norm, a device scalar
        self.rates: dict = {}  # each trained section's learning rate in the update, once it is issued
        self.was_read = False

    def read(self) -> dict:
        """The step's metrics record (waiting for the devices); raises `NonFiniteError` for a
        non-finite step under `on_nonfinite: stop`, else marks it `skipped_nonfinite`."""
        if self.was_read:
            return self.record
        t0 = time.perf_counter()
        loss = float(fetch(self.loss))  # the host waits for the devices here
        bad = sorted(s for s, ok in self.finite.items() if not bool(fetch(ok)))
        norms = {s: float(fetch(n)[0]) for s, n in sorted(self.norms_sq.items())}
        rates = {s: float(fetch(r)) for s, r in sorted(self.rates.items())}
        self.was_read = True
        self.record.update(loss=loss, device_wait_s=time.perf_counter() - t0)
        if norms:  # the norm clipping reads (before clipping), over all sections and per section
            self.record["grad_norm"] = math.sqrt(sum(norms.values()))
            self.record.update({f"grad_norm/{s}": math.sqrt(v) for s, v in norms.items()})
        self.record.update({f"lr/{s}": v for s, v in rates.items()})
        if not math.isfinite(loss):
            bad = [f"{self.sink} (loss)"] + [b for b in bad if b != self.sink]
        if bad:
            msg = f"step {self.step}: non-finite loss or gradients in section(s) {', '.join(bad)}"
            if self.on_nonfinite == "stop":
                raise NonFiniteError(msg + " (on_nonfinite=stop; set on_nonfinite=skip to skip such steps)")
            self.record["skipped_nonfinite"] = bad
        return self.record


def issue_step(rt, states, samples, step: int, on_nonfinite: str = "stop", schedule=None, norm: int | None = None,
               host: dict | None = None, ahead=None):
    """Issue one optimizer step without waiting for it: returns the new states and its `IssuedStep`.

    NaN/inf in the loss or a section's gradients is detected per section when the step is read.
    Under `on_nonfinite="stop"` the update is issued at once: a non-finite step stops the run when
    it is read, before anything after it is saved (a checkpoint step is read before its save).
    Under `"skip"` the update depends on the check, so the step is read before the update is
    issued, and a bad step leaves every section's params and optimizer state untouched.
    `schedule` and `norm` come with a `LoadedBatch` (whose samples may be partly hollow), `host`
    with a `PreparedBatch` (the micro-steps' inputs, packed ahead), `ahead` with run-ahead (the
    batch's frozen forwards, issued during the step before: `Executor.run_ahead`). The record's host timeline:
    `dispatch_s` (issuing the step's programs, transfers and update, of which `transfer_issue_s`
    the transfers), `device_wait_s` (reading the results), and the in-flight bound's waits inside
    dispatch.
    """
    schedule = schedule if schedule is not None else rt.schedule(samples)
    t0 = time.perf_counter()
    result = rt.executor.run(states, samples, schedule, host=host, norm=norm, ahead=ahead)
    finite = {s: rt.programs[s].all_finite(g) for s, g in result.grads.items()}
    norms_sq = rt.executor.squared_norms(result.grads)
    issued = IssuedStep(step, result.loss, finite, rt.graph.sink, on_nonfinite, {
        "step": step, "in_flight_waits": result.in_flight_waits, "in_flight_wait_s": result.in_flight_wait_s,
        "transfer_issue_s": result.transfer_issue_s}, norms_sq)
    if on_nonfinite == "skip":
        issued.record["dispatch_s"] = time.perf_counter() - t0
        issued.record["wait_reason"] = "on_nonfinite=skip"
        if issued.read().get("skipped_nonfinite"):
            return states, issued
        states = rt.executor.update(states, result.grads, norms_sq)
        issued.record.update({f"lr/{s}": float(fetch(current_rate(states[s].opt_state))) for s in sorted(norms_sq)})
        return states, issued
    states = rt.executor.update(states, result.grads, norms_sq)
    issued.rates = {s: current_rate(states[s].opt_state) for s in norms_sq}
    issued.record["dispatch_s"] = time.perf_counter() - t0
    return states, issued


def train_step(rt, states, samples, step: int, on_nonfinite: str = "stop", schedule=None, norm: int | None = None,
               host: dict | None = None):
    """One optimizer step, read at once: `issue_step` followed by `IssuedStep.read`.

    Returns the new states and the step's metrics record; under `on_nonfinite="stop"` a
    non-finite step raises `NonFiniteError` naming the step and the sections."""
    states, issued = issue_step(rt, states, samples, step, on_nonfinite, schedule, norm, host)
    return states, issued.read()


def train(cfg: Config, progress: bool = True, rt: Runtime | None = None) -> list[dict]:
    """Run until `cfg.steps` optimizer steps are done (resuming if `output_dir` has a checkpoint).

    `rt`: an already built runtime (a user's own graph, see `Trainer`); else the config's
    workload. On SIGTERM, saves a checkpoint after the current step and returns early.
    One run at a time per `output_dir` (and `checkpoint_dir`): another live run holding it is
    refused with a `DirectoryInUseError` (see `dirlock`). Directories that cannot take the run's
    files are refused before anything compiles (`storage.check_directories`). SIGTERM is caught
    from the start: one that arrives during start-up (compiling, restoring) stops the run before
    its first step, with nothing new to save."""
    set_peer_timeout(cfg.distributed.timeout_s)
    dirs = {"output_dir": cfg.output_dir,
            "checkpoint_dir": cfg.checkpoint_dir if cfg.output_dir and cfg.keep_checkpoints else None}
    with Preemption() as preemption:
        check_directories(dirs)
        with hold_directories(dirs):
            return _train(cfg, progress, rt, preemption)


def _preempted_in_startup(preemption: Preemption, out_dir: Path | None, start: int) -> bool:
    """A SIGTERM before the first step: say so (one process: a multi-process run stops at its
    first step boundary, where every process takes part in the checkpoint)."""
    if not preemption.requested or jax.process_count() > 1:
        return False
    held = f"the last committed checkpoint, step {start} in {out_dir}, is intact" if start else "no checkpoint yet"
    print(f"SIGTERM during start-up: stopping before the first step; nothing new to save ({held}); "
          f"re-run to resume", flush=True)
    return True


def _train(cfg: Config, progress: bool, rt: Runtime | None, preemption: Preemption) -> list[dict]:
    if cfg.output_dir and cfg.keep_checkpoints:
        check_checkpoint_layout(cfg.plan())  # before anything compiles
    if _preempted_in_startup(preemption, None, 0):
        return []
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
            try:
                (out_dir / "config.yaml").write_text(dump_config(cfg))
            except OSError as err:
                if ckpt:
                    ckpt.close()
                raise write_error("output_dir", out_dir / "config.yaml", err) from None
    if _preempted_in_startup(preemption, ckpt.directory if ckpt else out_dir, start):
        if ckpt:
            ckpt.close()
        data.close()
        return []
    if start >= cfg.steps and jax.process_index() == 0:
        print(f"nothing to do: {out_dir} holds a checkpoint at step {start}, at or beyond steps={cfg.steps}", flush=True)
    try:
        writer = MetricsWriter(out_dir if jax.process_index() == 0 else None, start)  # process 0 writes metrics
    except BaseException:
        data.close()
        if ckpt:
            ckpt.close()
        raise
    history = []
    bar = tqdm(range(start, cfg.steps), disable=not progress or jax.process_index() != 0, desc="train", unit="step", initial=start,
               total=cfg.steps)
    try:
        history = _loop(cfg, rt, states, data, bad, ckpt, writer, bar, history, preemption)
    finally:
        data.close()
    skipped = sum(len(rec.get("skipped_samples", ())) for rec in history)  # batches trained on, not read ahead
    if skipped:
        bar.write(f"skipped {skipped} bad sample(s) (data.on_bad_sample=skip); metrics.jsonl lists them per step")
    return history


class _StepLog:
    """Turns read steps into metrics records: history, progress bar, metrics.jsonl, TensorBoard.

    `step_time_s` is the time between two steps' results being read, the throughput interval
    when the host reads each step after issuing the next; its parts (`data_wait_s`,
    `dispatch_s`, `device_wait_s`) then belong to neighbouring steps, so they add up within the
    run's total time, not within each interval."""

    def __init__(self, writer: MetricsWriter, bar, history: list[dict]):
        self.writer, self.bar, self.history = writer, bar, history
        self.last_read = time.perf_counter()

    def read(self, issued: IssuedStep, prepared, data_wait_s: float, wait_reason: str | None = None) -> None:
        rec = issued.read()
        now = time.perf_counter()
        dt, self.last_read = now - self.last_read, now
        batch, samples = prepared.batch, prepared.batch.samples
        tokens = sum(len(s.tokens) - 1 for s in samples)
        rec.update({"samples_per_s": len(samples) / dt, "tokens_per_s": tokens / dt, "step_time_s": dt,
                    "data_wait_s": data_wait_s, "read_ahead_s": prepared.read_s,
                    "schedule_ahead_s": batch.schedule_s, "pack_ahead_s": prepared.pack_s,
                    "sample_ids": [int(s.id) for s in samples],
                    "data_read_bytes": batch.read_bytes, "data_decoded_bytes": batch.decoded_bytes})
        if wait_reason and "wait_reason" not in rec:
            rec["wait_reason"] = wait_reason
        if prepared.skipped is not None:
            rec["skipped_samples"] = prepared.skipped
        self.history.append(rec)
        self.bar.set_postfix(loss=f"{rec['loss']:.4f}", samples_per_s=f"{rec['samples_per_s']:.1f}")
        self.writer.write(rec)


def _loop(cfg, rt, states, data, bad, ckpt, writer, bar, history, preemption) -> list[dict]:
    log_ = _StepLog(writer, bar, history)
    pending = None  # the step issued last and not read yet: (IssuedStep, PreparedBatch, data wait)
    ahead = None  # this step's run-ahead work, issued with the step before (never across a restart)
    try:
        for step in bar:
            step_barrier(step + 1)  # a dead or stuck peer is named here, within distributed.timeout_s
            prepared = next(data)  # read, scheduled and packed while the previous step ran
            batch = prepared.batch
            states, issued = issue_step(rt, states, batch.samples, step + 1, cfg.on_nonfinite, batch.schedule,
                                        batch.loss_count, prepared.host, ahead)
            ahead = None
            if rt.problem.ahead and step + 1 < cfg.steps and (following := data.peek()) is not None:
                # the next batch's frozen forwards, queued behind this step's work on their devices
                nxt = following.batch
                ahead = rt.executor.run_ahead(states, nxt.samples, nxt.schedule, following.host)
            if pending:  # the previous step, read now that this one is queued behind it
                log_.read(*pending)
            pending = (issued, prepared, data.data_wait_s)
            done = step + 1
            due = done == cfg.steps or (cfg.checkpoint_every and done % cfg.checkpoint_every == 0)
            stop = preemption.stop_after(done)  # a notice on any process stops all of them here
            save = ckpt and (due or stop)
            if save or stop:  # a checkpoint holds only a step known to be finite
                log_.read(*pending, wait_reason="checkpoint" if save else "preemption")
                pending = None
            if save:
                ckpt.save(done, states, data.get_state(), {"seed": cfg.seed, "workload": cfg.workload})
            if stop:
                bar.write(preemption.report(done, ckpt))
                break
        if pending:
            log_.read(*pending, wait_reason="last step")
    except PeerError:
        writer.close()  # no checkpoint work: committing needs the lost peer (its save is never committed)
        raise
    except BaseException:
        if pending and not pending[0].was_read:  # a step the devices finished before this fault: log it
            try:
                log_.read(*pending)
            except Exception as err:  # NonFiniteError included: the fault being raised comes first
                log.error("%s", err)
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
