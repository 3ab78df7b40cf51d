"""The training loop: `train(config)` is what the CLI, `Trainer`, tests and notebooks call.

With `output_dir`, the run writes `metrics.jsonl` (one JSON object per step), TensorBoard
events (`tb/`), the resolved `config.yaml` and Orbax checkpoints (`checkpoints/`); running
again with the same `output_dir` resumes from the latest committed checkpoint, data order
included, and gives the same per-step losses as an uninterrupted run.

The loop issues step N+1 before it reads step N, so the devices never wait on the host. What
happens at a step boundary is one method each (`_Loop`): reading a step (non-finite handling,
metrics to the trackers), evaluation, checkpoints, preemption. One `ExitStack` owns every
resource of the run (the SIGTERM handler, directory locks, the prefetch thread, the
checkpointer, the trackers, a profiler trace) and closes them in reverse order, on a fault too.

Faults end the run with an exception the CLI maps to an exit status (`docs/faults.md`):
`DataError` (a bad sample under `data.on_bad_sample: error`), `NonFiniteError`,
`CheckpointError` (storage), `PeerError` (a dead or stuck process).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import os
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

import jax
import yaml
from tqdm import tqdm

from maestro_jax.config import Config, ConfigError, dump_config
from maestro_jax.core.plan import check_resources
from maestro_jax.data import BadSamples
from maestro_jax.runtime import compile_cache
from maestro_jax.runtime.build import Runtime, build_runtime
from maestro_jax.runtime.distributed import Coordinator, PeerError
from maestro_jax.runtime.mfu import MfuMeter
from maestro_jax.runtime.step import StepBatch, StepMetrics, TrainState
from maestro_jax.training.checkpoint import Checkpointer, check_start_points, start_from_checkpoints
from maestro_jax.training.dirlock import hold_directories
from maestro_jax.training.evaluate import Evaluation, evaluation_for, held_out_source
from maestro_jax.training.preemption import Preemption, raise_if_interrupted
from maestro_jax.training.prefetch import Prefetcher, PreparedBatch
from maestro_jax.training.profile import ProfileWindow
from maestro_jax.training.storage import check_directories, write_error
from maestro_jax.training.trackers import Trackers, check_trackers, flat_config, output_trackers, tracker_directories

log = logging.getLogger("maestro_jax")


def train(
    cfg: Config, progress: bool = True, rt: Runtime | None = None, trackers=(), eval_source=None, hooks=()
) -> list[dict]:
    """Run until `cfg.steps` optimizer steps are done (resuming if `output_dir` has a checkpoint);
    returns the steps' metrics records.

    `rt`: an already built runtime (a user's own graph, see `Trainer`); else the config's
    workload. `trackers`: more metrics sinks beside JSONL and TensorBoard (`training.trackers`).
    `eval_source`: a user graph's held-out samples for the `eval` block (`training.evaluate`).
    `hooks`: `training.hooks.Hook`s, called with each step's record once it is read.
    Before step 1, every program the run's batches and evaluations need is compiled
    (`compile.ahead`), with jax's persistent compilation cache on (`compile.cache`), so step
    times measure steps. On SIGTERM, saves a checkpoint after the current step and returns early;
    one that arrives during start-up (compiling, restoring) stops the run before its first step, with nothing new
    to save. One run at a time per `output_dir` (and `checkpoint_dir`): another live run holding
    it is refused with a `DirectoryInUseError` (`dirlock`). Directories that cannot take the
    run's files are refused before anything compiles (`storage.check_directories`)."""
    coordinator = rt.coordinator if rt else Coordinator(cfg.distributed.timeout_s, cfg.distributed.startup_timeout_s)
    say = _Say(progress)
    with contextlib.ExitStack() as stack:
        preemption = stack.enter_context(Preemption())
        run = _RunDirs.checked(cfg, stack, coordinator, trackers, built=rt is not None)
        cache = stack.enter_context(compile_cache.using(_cache_dir(cfg), _cache_max_bytes(cfg)))
        if eval_source is None and cfg.eval is not None and cfg.eval.data is not None:
            eval_source = held_out_source(cfg)  # its own files are checked before anything compiles
        rt = rt or _build(cfg, coordinator, say)
        state, data, ckpt = _starting_state(cfg, rt, stack, run, coordinator, say)
        start = state.step
        if start >= cfg.steps:
            say(f"nothing to do: {run.out_dir} holds a checkpoint at step {start}, at or beyond steps={cfg.steps}")
            return []
        evaluation = evaluation_for(cfg, rt, eval_source)
        if cfg.compile.ahead:
            _compile_ahead(cfg, rt, start, evaluation, cache, say)
        if _preempted_in_startup(preemption, ckpt.directory if ckpt else run.out_dir, start):
            return []
        if run.out_dir and jax.process_index() == 0:  # only once the checkpoints (if any) are known to fit
            _write_config(cfg, run.out_dir)
        step_log, window = _outputs(cfg, rt, stack, run.out_dir, start, trackers, evaluation, hooks, progress, say)
        history = _Loop(cfg, rt, data, ckpt, preemption, evaluation, step_log, say, window).run(state)
    skipped = sum(len(rec.get("skipped_samples", ())) for rec in history)  # batches trained on, not read ahead
    if skipped:
        say(f"skipped {skipped} bad sample(s) (data.on_bad_sample=skip); metrics.jsonl lists them per step")
    return history


@dataclasses.dataclass(frozen=True)
class _RunDirs:
    """Where the run writes: `out_dir` (None: nowhere) and whether it keeps checkpoints (`keep`)."""

    out_dir: Path | None
    keep: bool

    @classmethod
    def checked(cls, cfg: Config, stack, coordinator: Coordinator, trackers, built: bool) -> _RunDirs:
        """The run's directories checked and held (`stack` releases them), its trackers and start
        points checked and, without a runtime `built` by the caller, its plan on this host's
        devices: all before the compile cache opens (which logs what it moves aside)."""
        out_dir = Path(cfg.output_dir) if cfg.output_dir else None
        keep = bool(out_dir and cfg.keep_checkpoints)
        dirs = {"output_dir": cfg.output_dir, "checkpoint_dir": cfg.checkpoint_dir if keep else None}
        check_directories({**dirs, **tracker_directories(cfg, out_dir)}, coordinator)
        check_trackers(cfg, trackers)
        check_start_points(cfg)
        stack.enter_context(hold_directories(dirs, coordinator))
        if out_dir and not keep:
            _refuse_unkept_checkpoints(cfg, out_dir, coordinator)
        if not built:  # a plan on devices that do not exist or overlap: one error line
            check_resources(cfg.plan(), len(jax.devices()))
        return cls(out_dir, keep)


def _build(cfg: Config, coordinator: Coordinator, say) -> Runtime:
    devices = len({d for s in cfg.sections.values() for d in s.devices})
    say(
        f"building workload {cfg.workload}: {len(cfg.sections)} sections on {devices} devices, "
        "initialising their states (each section's init compiles)"
    )
    return build_runtime(cfg, coordinator=coordinator)


def _starting_state(cfg: Config, rt: Runtime, stack, run: _RunDirs, coordinator: Coordinator, say):
    """The state the run starts from (a fresh one, the newest checkpoint's, or sections started
    from other runs' checkpoints), its data reader (positioned to match) and its checkpointer
    (None without `keep`), both closed by `stack`."""
    state = rt.step.init()
    bad = BadSamples() if cfg.data.on_bad_sample == "skip" else None
    data = stack.enter_context(contextlib.closing(Prefetcher(rt.reader(bad), rt.executor, bad)))
    ckpt = None
    if run.keep:
        ckpt = stack.enter_context(
            Checkpointer(
                cfg.checkpoint_dir or run.out_dir / "checkpoints",
                cfg.keep_checkpoints,
                cfg.async_checkpoint,
                coordinator=coordinator,
            )
        )
        state = _resume(cfg, rt, ckpt, state, data, say)
    if state.step == 0:  # a fresh run: sections that start from another run's checkpoint
        start_from = functools.partial(start_from_checkpoints, cfg, coordinator=coordinator)
        state = TrainState(0, rt.on_whole(state.sections, start_from))  # a staged section starts whole
    return state, data, ckpt


def _compile_ahead(cfg: Config, rt: Runtime, start: int, evaluation, cache, say) -> None:
    """Every program the batches of steps start+1..steps and the evaluations need, compiled."""
    rt.step.compile(
        range(start, cfg.steps),
        say,
        evaluate=evaluation.samples if evaluation else (),
        max_batches=cfg.compile.max_batches,
    )
    if cache is not None:
        cache.record()  # the new entries' checksums, now that no compile is in flight


def _outputs(cfg: Config, rt: Runtime, stack, out_dir, start: int, trackers, evaluation, hooks, progress, say):
    """The step log (trackers, progress bar, evaluation, hooks, MFU) and the profiler window,
    both closed by `stack`."""
    tracked = stack.enter_context(output_trackers(cfg, out_dir, start, trackers))
    bar = stack.enter_context(
        tqdm(
            total=cfg.steps,
            initial=start,
            desc="train",
            unit="step",
            disable=not progress or jax.process_index() != 0,
        )
    )
    say.bar_open = True
    window = stack.enter_context(contextlib.closing(ProfileWindow(cfg.profile, out_dir)))
    devices = {s: sp.devices for s, sp in rt.plan.sections.items()}
    meter = MfuMeter.for_run(rt.graph, devices, cfg.peak_flops)
    say(meter.describe())
    return _StepLog(tracked, bar, evaluation, rt.coordinator.fetch_all, hooks, meter), window


def _resume(cfg: Config, rt: Runtime, ckpt: Checkpointer, state: TrainState, data: Prefetcher, say) -> TrainState:
    """The newest good checkpoint's state, the reader moved to its data position (`state` itself
    where there is none); what changed in the config since the run that saved it is said and, on
    process 0, recorded in the output_dir."""
    if (latest := ckpt.latest_step()) is not None:
        say(f"checkpoint: restoring the newest good one of {ckpt.directory} (committed up to step {latest})")
    # another config's checkpoint stops here; a staged section is saved whole (`runtime.stages`)
    if (restored := ckpt.restore_latest(rt.whole_states(state.sections))) is None:
        return state
    start, whole, data_state, _ = restored
    data.set_state(data_state)
    say(f"resuming from the checkpoint of step {start} in {ckpt.directory}")
    out_dir = Path(cfg.output_dir) if cfg.output_dir else None
    if out_dir and (changes := config_changes(out_dir, cfg)):
        say(
            "changed since the run that saved it (applied from this config): "
            + ", ".join(f"{k} {old} -> {new}" for k, (old, new) in changes.items())
        )
        if jax.process_index() == 0:
            _record_changes(out_dir, start, changes)
    return TrainState(start, rt.stage_states(whole, state.sections))


def _refuse_unkept_checkpoints(cfg: Config, out_dir: Path, coordinator: Coordinator) -> None:
    """`keep_checkpoints=0` where checkpoints are: such a run starts from step 0, cuts
    metrics.jsonl back to nothing, and leaves the checkpoints for a later run to resume from,
    leaving a gap in the log. Refused before anything compiles (process 0 decides for all)."""
    directory = Path(cfg.checkpoint_dir) if cfg.checkpoint_dir else out_dir / "checkpoints"
    refusal = None
    if jax.process_index() == 0 and directory.is_dir():
        steps = sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit() and p.is_dir())
        if steps:
            refusal = (
                f"error: keep_checkpoints=0: {directory} holds checkpoints (steps {', '.join(map(str, steps))}); "
                f"a run without checkpoints would restart from step 0 and cut {out_dir / 'metrics.jsonl'} back; "
                f"resume with keep_checkpoints of 1 or more, or use another output_dir"
            )
    if refusal := coordinator.agree("unkept-checkpoints", refusal):
        raise ConfigError(refusal)


class _Say:
    """Process 0's one-line reports (start-up, resume, checkpoints), kept clear of the progress
    bar: through `tqdm.write` once the bar is on screen (`bar_open`), printed before. (tqdm's
    first write creates its class lock, and a signal arriving then, during start-up, would
    leave the lock half made: an AttributeError instead of the interrupt.)"""

    def __init__(self, progress: bool):
        self.progress, self.bar_open = progress, False

    def __call__(self, line: str) -> None:
        if jax.process_index() == 0:
            tqdm.write(line) if self.progress and self.bar_open else print(line, flush=True)


def _cache_dir(cfg: Config) -> Path | None:
    """The persistent compilation cache's directory for this process, or None (`compile.cache:
    false`): `compile.cache_dir`, else jax's own `JAX_COMPILATION_CACHE_DIR` where it is set,
    else the user's cache (`$XDG_CACHE_HOME/maestro_jax/xla`, default `~/.cache/...`), which
    outlives any one output dir, so a rerun or another run of the same programs loads them. Runs
    share it safely (`runtime.compile_cache`). Each process of a multi-process run keeps its own:
    jax writes an entry in place, so a peer could read one half written."""
    if not cfg.compile.cache:
        return None
    root = cfg.compile.cache_dir or os.environ.get("JAX_COMPILATION_CACHE_DIR") or user_cache_dir()
    return Path(root) / f"process-{jax.process_index()}" if jax.process_count() > 1 else Path(root)


def _cache_max_bytes(cfg: Config) -> int:
    """`compile.cache_max_gb` in bytes (-1: no cap). Each process of a multi-process run has its
    own directory (`_cache_dir`) and so its own cap."""
    gb = cfg.compile.cache_max_gb
    return -1 if gb is None else int(gb * 1e9)


def user_cache_dir() -> Path:
    """The compile cache every run of this user shares by default (the XDG base directory spec's
    cache home, as pip and jax-based tools keep theirs)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "maestro_jax" / "xla"


def config_changes(out_dir: Path, cfg: Config) -> dict[str, tuple]:
    """The settings (flattened keys) whose value differs from the config the run last wrote
    (`<out_dir>/config.yaml`), old -> new: what a resume applies from this config. Every setting
    a resume can change takes effect from the config, none from the checkpoint: the optimizer
    state holds no constant (only the rate is injected, and it is recomputed from the config's
    schedule at the stored count); a change the state cannot take (a freeze list, a shape) is
    refused when the checkpoint is restored."""
    try:
        before = yaml.safe_load((out_dir / "config.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return {}
    if not isinstance(before, dict):
        return {}
    old, new = flat_config(before), flat_config(cfg.model_dump(mode="json"))
    return {k: (old.get(k), new.get(k)) for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)}


def _record_changes(out_dir: Path, step: int, changes: dict[str, tuple]) -> None:
    """One line per resume that changed settings, in `<out_dir>/config_history.jsonl`."""
    path = out_dir / "config_history.jsonl"
    try:
        with open(path, "a") as f:
            f.write(json.dumps({"step": step, "changes": {k: list(v) for k, v in changes.items()}}) + "\n")
    except OSError as err:
        raise write_error("output_dir", path, err) from None


def _write_config(cfg: Config, out_dir: Path) -> None:
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.yaml").write_text(dump_config(cfg))
    except OSError as err:
        raise write_error("output_dir", out_dir / "config.yaml", err) from None


def _preempted_in_startup(preemption: Preemption, out_dir: Path | None, start: int) -> bool:
    """A SIGTERM before the first step: say so (one process: a multi-process run stops at its
    first step boundary, where every process takes part in the checkpoint). Checked once the
    checkpoints are known (after restoring), so that the line names the step that is intact; a
    check before building the runtime said "no checkpoint yet" without looking."""
    if not preemption.requested or jax.process_count() > 1:
        return False
    held = f"the last committed checkpoint, step {start} in {out_dir}, is intact" if start else "no checkpoint yet"
    print(
        f"SIGTERM during start-up: stopping before the first step; nothing new to save ({held}); re-run to resume",
        flush=True,
    )
    return True


class _StepLog:
    """Turns read steps into metrics records: history, progress bar, trackers.

    `step_time_s` is the time between two steps' results being read, the throughput interval
    when the host reads each step after issuing the next; its parts (`data_wait_s`,
    `dispatch_s`, `device_wait_s`) then belong to neighbouring steps, so they add up within the
    run's total time, not within each interval. The progress bar's `samples_per_s` is over the
    last `RECENT` steps (one step's swings with its shapes and with checkpoint saves)."""

    RECENT = 10

    def __init__(self, trackers: Trackers, bar, evaluation: Evaluation | None, fetch, hooks=(), meter=None):
        self.trackers, self.bar, self.evaluation, self.history = trackers, bar, evaluation, []
        self.meter: MfuMeter | None = meter  # perf/mfu and perf/mfu/<section> in each record
        self.fetch = fetch  # `Coordinator.fetch_all`: a step's device values on this host, one read
        self.hooks = tuple(hooks)
        self.last_read = time.perf_counter()
        self.recent: deque[tuple[int, float]] = deque(maxlen=self.RECENT)  # (samples, seconds) of each step

    def read(self, issued: _Issued, wait_reason: str | None = None) -> None:
        rec = issued.metrics.read(fetch_all=self.fetch)
        if issued.evaluated:
            rec["eval/loss"] = self.evaluation.read(issued.evaluated)
        prepared = issued.prepared
        now = time.perf_counter()
        dt, self.last_read = now - self.last_read, now
        batch, samples = prepared.batch, prepared.batch.samples
        tokens = sum(len(s.tokens) - 1 for s in samples)
        rec.update(
            {
                "samples_per_s": len(samples) / dt,
                "tokens_per_s": tokens / dt,
                "step_time_s": dt,
                "data_wait_s": issued.data_wait_s,
                "read_ahead_s": prepared.read_s,
                "schedule_ahead_s": batch.schedule_s,
                "pack_ahead_s": prepared.pack_s,
                "sample_ids": [int(s.id) for s in samples],
                "data_read_bytes": batch.read_bytes,
                "data_decoded_bytes": batch.decoded_bytes,
            }
        )
        if self.meter is not None:
            rec.update(self.meter.record(samples, dt))
        if wait_reason and "wait_reason" not in rec:
            rec["wait_reason"] = wait_reason
        if prepared.skipped is not None:
            rec["skipped_samples"] = prepared.skipped
        self.history.append(rec)
        self.bar.update(1)
        self.recent.append((len(samples), dt))
        recent = sum(n for n, _ in self.recent) / sum(t for _, t in self.recent)
        mfu = {"mfu": f"{100 * rec['perf/mfu']:.1f}%"} if "perf/mfu" in rec else {}
        self.bar.set_postfix(loss=f"{rec['train/loss']:.4f}", samples_per_s=f"{recent:.1f}", **mfu)
        self.trackers.write(rec)
        for hook in self.hooks:
            hook(rec["step"], rec)


@dataclasses.dataclass
class _Issued:
    """A step issued and not read yet: its metrics on the devices, its batch, the evaluation
    queued behind it (`Evaluation.issue`) and the time the loop waited for its batch."""

    metrics: StepMetrics
    prepared: PreparedBatch
    data_wait_s: float
    evaluated: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _Loop:
    """The steps of one run, and what happens at their boundaries."""

    cfg: Config
    rt: Runtime
    data: Prefetcher
    ckpt: Checkpointer | None
    preemption: Preemption
    evaluation: Evaluation | None
    log: _StepLog
    say: Callable[[str], None]
    window: ProfileWindow  # `profile`: the steps a jax.profiler trace holds
    pending: _Issued | None = None  # the step issued last and not read yet

    def run(self, state: TrainState) -> list[dict]:
        ahead = None  # this step's run-ahead work, issued with the step before (never across a restart)
        step = self.rt.step
        self.rt.coordinator.step_barrier(
            state.step + 1
        )  # a dead or stuck peer is named here, within distributed.timeout_s
        try:
            while state.step < self.cfg.steps:
                prepared = next(self.data)  # read, scheduled and packed while the previous step ran
                batch = prepared.batch
                self.window.before_issue(state.step + 1)
                state, metrics = step(
                    state, StepBatch(batch.samples, batch.schedule, batch.loss_count, prepared.host, ahead)
                )
                done = state.step
                issued = _Issued(metrics, prepared, self.data.data_wait_s)
                ahead = self._run_ahead(state)
                self._evaluate(state, issued)
                self._read_pending()  # the previous step, read now that this one is queued behind it
                self.pending = issued
                raise_if_interrupted()  # a SIGINT whose KeyboardInterrupt something swallowed
                stop_by = self.rt.coordinator.step_barrier(
                    done + 1, self.preemption.requested
                )  # a notice on any process
                self._checkpoint(state, stop_by)
                if stop_by:
                    tqdm.write(self.preemption.report(done, self.ckpt, stop_by))  # every process says it
                    break
            self._read_pending("last step")
        except BaseException as fault:
            self._log_finished_step(fault)
            raise
        return self.log.history

    def _run_ahead(self, state: TrainState):
        """The next batch's frozen forwards, queued behind this step's work on their devices."""
        if self.rt.problem.ahead and state.step < self.cfg.steps and (following := self.data.peek()) is not None:
            nxt = following.batch
            return self.rt.step.run_ahead(state, StepBatch(nxt.samples, nxt.schedule, host=following.host))
        return None

    def _evaluate(self, state: TrainState, issued: _Issued) -> None:
        """The held-out loss after the step when due, queued behind its update; read with it."""
        every = self.cfg.eval.every if self.evaluation else 0
        if every and (state.step % every == 0 or state.step == self.cfg.steps):
            issued.evaluated = self.evaluation.issue(state)

    def _read_pending(self, wait_reason: str | None = None) -> None:
        if self.pending:
            pending, self.pending = self.pending, None
            self.log.read(pending, wait_reason=wait_reason)
            self.window.after_read(pending.metrics.step)

    def _checkpoint(self, state: TrainState, stop_by: list[int]) -> None:
        """Save after the step when it is due or the run stops; a checkpoint holds only a step
        known to be finite, so the step is read first."""
        done = state.step
        due = done == self.cfg.steps or (self.cfg.checkpoint_every and done % self.cfg.checkpoint_every == 0)
        if not self.ckpt or not (due or stop_by):
            if stop_by:
                self._read_pending("preemption")
            return
        self._read_pending("checkpoint")
        self.log.trackers.flush()  # the metrics of every step the checkpoint holds are on disk first
        if not stop_by:  # said before the save, which may hold the step a while; a preemption's report says more
            self.say(f"checkpoint: saving step {done} to {self.ckpt.directory}")
        self.ckpt.save(
            done,
            self.rt.whole_states(state.sections),
            self.data.get_state(),
            {"seed": self.cfg.seed, "workload": self.cfg.workload},
        )

    def _log_finished_step(self, fault: BaseException) -> None:
        """A step the devices finished before `fault` is still logged (not after a lost peer:
        reading it would wait for that peer)."""
        if self.pending and not isinstance(fault, PeerError) and not self.pending.metrics.was_read:
            try:
                self._read_pending()
            except Exception as err:  # noqa: BLE001 - NonFiniteError included: the fault being raised comes first
                log.error("%s", err)
