"""The training step as one object: `step(state, batch) -> (state, metrics)`.

Everything that trains, checks, measures or evaluates a step holds one of two steps with the same
interface (as nanodo's `Trainer.do_step` and Levanter's `train_step(state, batch)`):

- `SectionedStep`: the plan's sections, each its own programs on its own mesh, in the schedule's
  order (`runtime.executor`), tensors moved device to device;
- `MonolithicStep`: the whole graph as one program on one mesh, the reference every plan equals.

`init(seed)` gives a `TrainState` (the step number and each section's params, constants and
optimizer state); `__call__` issues one optimizer step and returns at once with the new state and
a `StepMetrics` still on the devices, which the caller reads when it chooses (the training loop
reads step N after issuing step N+1). `gradients` and `apply` are the step's two halves, for
`verify`, which compares gradients; `evaluate` is the forward-only loss; `compile` compiles every
program of the given batches before the first step.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import jax
import numpy as np

from maestro_jax.runtime import ahead
from maestro_jax.runtime.executor import StepResult
from maestro_jax.runtime.optimizer import current_rate
from maestro_jax.runtime.programs import DryRun, SectionState


@dataclasses.dataclass(frozen=True)
class TrainState:
    """What one optimizer step changes: the number of steps taken and each section's state."""

    step: int
    sections: Mapping[str, SectionState]

    def __getitem__(self, section: str) -> SectionState:
        return self.sections[section]


jax.tree_util.register_dataclass(TrainState, data_fields=["sections"], meta_fields=["step"])


@dataclasses.dataclass(frozen=True)
class StepBatch:
    """One global batch as a step takes it. Only `samples` is needed; the training loop hands in
    what its prefetch thread already computed: the `schedule`, the loss normaliser (`loss_count`,
    for samples that are partly hollow on this process), the micro-steps' packed host inputs
    (`host`) and the batch's frozen forwards issued during the step before (`ahead`)."""

    samples: Sequence
    schedule: object = None
    loss_count: int | None = None
    host: dict | None = None
    ahead: object = None


def as_batch(batch) -> StepBatch:
    """A `StepBatch` (or an object with its fields) as it is; a list of samples as a `StepBatch`."""
    return batch if hasattr(batch, "samples") else StepBatch(list(batch))


class NonFiniteError(RuntimeError):
    """NaN or inf in the loss or a section's gradients, with `on_nonfinite: stop`."""


class StepUnsupported(NotImplementedError):
    """A part of the `Step` interface one step cannot offer, asked of it: the message names the
    step, the method and why."""


class Step(Protocol):
    """What every training step offers (`SectionedStep`, `MonolithicStep`): the same methods, the
    same arguments and the same return types. A method a step cannot offer raises
    `StepUnsupported` naming itself."""

    def init(self, seed: int | None = None) -> TrainState: ...

    def gradients(self, state: TrainState, batch) -> tuple[object, dict, StepResult]:
        """(loss, grads, result): the step without its update; `result` the executor's
        `StepResult` (the sink's summed metrics, the loss normaliser, the host's waits)."""

    def squared_norms(self, grads: Mapping) -> dict: ...

    def apply(self, state: TrainState, grads: Mapping, norms_sq: Mapping | None = None) -> TrainState:
        """The optimizer update; `norms_sq` (`squared_norms(grads)`), where the caller has them,
        is what global-norm clipping reads instead of computing them again."""

    def __call__(self, state: TrainState, batch) -> tuple[TrainState, StepMetrics]: ...

    def read(self, metrics: StepMetrics) -> dict: ...

    def evaluate(self, state: TrainState, batch): ...

    def run_ahead(self, state: TrainState, batch): ...

    def timeline(self, state: TrainState, batch) -> tuple[dict, list]: ...

    def compile(self, steps, say=print, *, evaluate=(), max_batches: int = ..., threads: int | None = None) -> int: ...

    def abstract_state(self) -> TrainState: ...

    def memory_analysis(self) -> dict[str, dict[str, int]]: ...


@dataclasses.dataclass
class StepMetrics:
    """One step's results, still on the devices until `read`.

    `read` is the host's one wait on the devices in a step. Its record names what each value is:
    `train/loss`; `train/grad_norm` (before clipping, over every trained section) and
    `train/grad_norm/<section>`; `train/lr/<section>` (the rate the update used); and each metric
    the sink returns, `train/<sink>/<metric>` (KD's `kl` and `ce`), summed over the batch in the
    step's own programs and divided by the loss's normaliser as the loss is (per loss-carrying
    token). Beside them, the host's timeline of issuing the step (`dispatch_s`,
    `transfer_issue_s`, the in-flight bound's waits) and `device_wait_s`, the read's own wait."""

    step: int
    sink: str
    loss: object  # device scalar, already divided by `norm`
    finite: dict  # section -> device bool: its gradients are finite
    norms_sq: dict  # trained section -> its gradients' squared norm, a device array
    sink_metrics: dict  # the sink's metrics summed over the batch (device scalars, not normalised)
    norm: float = 1.0  # the batch's loss normaliser
    rates: dict = dataclasses.field(default_factory=dict)  # trained section -> the update's learning rate
    host: dict = dataclasses.field(default_factory=dict)  # the host's timeline of issuing the step
    on_nonfinite: str = "stop"
    record: dict | None = None  # once read
    bad: list[str] | None = None  # the non-finite sections, once checked (`nonfinite`)

    @property
    def was_read(self) -> bool:
        return self.record is not None

    def nonfinite(self, fetch: Callable = np.asarray, loss: float | None = None, finite=None) -> list[str]:
        """The sections whose gradients (or the sink's loss) hold NaN or inf (waits for the devices
        once: the answer is kept). `loss` and `finite` (section -> flag): what the caller has read
        already."""
        if self.bad is None:
            flags = finite if finite is not None else {s: fetch(ok) for s, ok in self.finite.items()}
            bad = sorted(s for s, ok in flags.items() if not bool(ok))
            if not math.isfinite(float(fetch(self.loss)) if loss is None else loss):
                bad = [f"{self.sink} (loss)"] + [b for b in bad if b != self.sink]
            self.bad = bad
        return self.bad

    def read(self, fetch: Callable = np.asarray, *, fetch_all: Callable | None = None) -> dict:
        """The step's record (waiting for the devices). Every device value it reads (loss, norms,
        rates, the sink's metrics, the finiteness flags) is one pytree read at once: `fetch_all`
        (`Coordinator.fetch_all`: one transfer of what this process holds, a value another process
        holds from its owner), else `jax.device_get`, else, given only a per-value `fetch`
        (`Coordinator.fetch`), each value through it. A non-finite step raises `NonFiniteError`
        under `on_nonfinite: stop`, else is marked `skipped_nonfinite`."""
        if self.record is not None:
            return self.record
        t0 = time.perf_counter()
        if fetch_all is None:
            fetch_all = jax.device_get if fetch is np.asarray else functools.partial(jax.tree.map, fetch)
        device = (self.loss, self.norms_sq, self.rates, self.sink_metrics, self.finite if self.bad is None else {})
        loss, norms_sq, rates, sink_metrics, finite = jax.tree.map(np.asarray, fetch_all(device))
        bad = self.nonfinite(fetch, float(loss), finite if self.bad is None else None)
        rec = {"step": self.step, "train/loss": float(loss), **self.host}
        rec["device_wait_s"] = time.perf_counter() - t0
        rec.update({f"train/{self.sink}/{k}": float(v) / self.norm for k, v in sorted(sink_metrics.items())})
        norms = {s: float(np.ravel(v)[0]) for s, v in sorted(norms_sq.items())}
        if norms:  # the norm clipping reads (before clipping), over all sections and per section
            rec["train/grad_norm"] = math.sqrt(sum(norms.values()))
            rec.update({f"train/grad_norm/{s}": math.sqrt(v) for s, v in norms.items()})
        rec.update({f"train/lr/{s}": float(v) for s, v in sorted(rates.items())})
        self.record = rec
        if bad:
            msg = f"step {self.step}: non-finite loss or gradients in section(s) {', '.join(bad)}"
            if self.on_nonfinite == "stop":
                raise NonFiniteError(msg + " (on_nonfinite=stop; set on_nonfinite=skip to skip such steps)")
            rec["skipped_nonfinite"] = bad
        return rec


@dataclasses.dataclass(frozen=True)
class RuntimeView:
    """What a sectioned step reads of its runtime, and nothing else of it: the graph (its sink,
    its sections' roles), the sections' programs and shapes and layouts, the executor, the
    coordinator that reads values across processes, and four of the runtime's functions (its
    initial state, the schedule of a batch, the metadata of the training stream's batches).
    `of(rt)` takes a `runtime.build.Runtime`'s."""

    graph: object  # core.graph.SectionGraph
    on_nonfinite: str  # the config's default: stop | skip
    programs: Mapping  # section -> runtime.programs.SectionPrograms
    executor: object  # runtime.executor.Executor
    coordinator: object  # runtime.distributed.Coordinator
    abstract: Mapping  # section -> its variables' shapes, boxed with their logical axes
    shardings: Mapping  # section -> its variables' shardings
    init_states: Callable  # (seed) -> {section: SectionState}
    schedule: Callable  # (samples) -> Schedule
    batch_infos: Callable  # (steps) -> [[SampleInfo]]

    @classmethod
    def of(cls, rt) -> RuntimeView:
        return cls(
            *(rt.graph, rt.cfg.on_nonfinite, rt.programs, rt.executor, rt.coordinator, rt.abstract, rt.shardings),
            *(rt.init_states, rt.schedule, rt.batch_infos),
        )


class SectionedStep:
    """The plan's step: each section's programs on its own mesh, in the schedule's order."""

    def __init__(self, rt, on_nonfinite: str | None = None, *, programs=None, executor=None):
        """`rt`: a `runtime.build.Runtime`, of which the step keeps only a `RuntimeView` (or that
        view itself). `on_nonfinite` (default the config's): "stop" issues
        the update at once and a non-finite step raises when read; "skip" reads the step's
        finiteness before issuing its update, and a bad step leaves every section's params and
        optimizer state as they were. `programs` and `executor`: other than the runtime's only
        in the step's abstract twin (`abstract`)."""
        self.view = rt if isinstance(rt, RuntimeView) else RuntimeView.of(rt)
        self.on_nonfinite = on_nonfinite or self.view.on_nonfinite
        self.programs = self.view.programs if programs is None else programs
        self.executor = self.view.executor if executor is None else executor

    @property
    def rt(self) -> RuntimeView:
        """The runtime's view (`view`), read as `rt` before the view existed: kept for a version."""
        return self.view

    def abstract(self, run: DryRun) -> SectionedStep:
        """This step over abstract values: every program call and transfer it makes is handed to
        `run` (a `runtime.programs.DryRun`: traced, or compiled into the sections' caches), and
        nothing runs or waits. `compile` walks it over the run's batches."""
        programs = {s: prog.abstract(run) for s, prog in self.programs.items()}
        twin = self.executor.abstract(programs, run)
        return SectionedStep(self.view, "stop", programs=programs, executor=twin)  # "stop": nothing is read

    def init(self, seed: int | None = None) -> TrainState:
        """Step 0: each section initialised into its own sharding, pretrained ones loaded
        (`Runtime.init_states`)."""
        return TrainState(0, self.view.init_states(seed))

    def schedule(self, batch: StepBatch):
        return batch.schedule if batch.schedule is not None else self.view.schedule(batch.samples)

    def gradients(self, state: TrainState, batch) -> tuple[object, dict, StepResult]:
        """The batch's loss, each trained section's accumulated gradients (on its mesh) and the
        sink's summed metrics: the step without its update. Returns (loss, grads, result) where
        `result` is the executor's `StepResult` (host timeline included)."""
        batch = as_batch(batch)
        result = self.executor.run(
            state.sections,
            batch.samples,
            self.schedule(batch),
            host=batch.host,
            norm=batch.loss_count,
            ahead=batch.ahead,
            step=state.step + 1,
        )
        return result.loss, result.grads, result

    def apply(self, state: TrainState, grads: Mapping, norms_sq: Mapping | None = None) -> TrainState:
        """Every trained section's optimizer update (clipped by the global norm when configured)."""
        return TrainState(state.step + 1, self.executor.update(state.sections, grads, norms_sq))

    def squared_norms(self, grads: Mapping) -> dict:
        """Each trained section's squared gradient norm, a device array on its own mesh."""
        return self.executor.squared_norms(grads)

    def __call__(self, state: TrainState, batch) -> tuple[TrainState, StepMetrics]:
        """Issue one optimizer step without waiting for it (under `on_nonfinite: skip`, after
        reading the step's finiteness, which the update then depends on)."""
        view = self.view
        t0 = time.perf_counter()
        loss, grads, result = self.gradients(state, batch)
        metrics = StepMetrics(
            step=state.step + 1,
            sink=view.graph.sink,
            loss=loss,
            finite={s: self.programs[s].all_finite(g) for s, g in grads.items()},
            norms_sq=self.squared_norms(grads),
            sink_metrics=result.metrics,
            norm=result.norm,
            on_nonfinite=self.on_nonfinite,
            host={
                "in_flight_waits": result.in_flight_waits,
                "in_flight_wait_s": result.in_flight_wait_s,
                "transfer_issue_s": result.transfer_issue_s,
            },
        )
        if self.on_nonfinite == "skip":
            metrics.host["wait_reason"] = "on_nonfinite=skip"
            if metrics.nonfinite(view.coordinator.fetch):
                metrics.host["dispatch_s"] = time.perf_counter() - t0
                return TrainState(state.step + 1, state.sections), metrics
        new = self.apply(state, grads, metrics.norms_sq)
        metrics.rates = {s: current_rate(new.sections[s].opt_state) for s in metrics.norms_sq}
        metrics.host["dispatch_s"] = time.perf_counter() - t0
        return new, metrics

    def read(self, metrics: StepMetrics) -> dict:
        """`metrics.read` through this runtime's `Coordinator.fetch_all`."""
        return metrics.read(fetch_all=self.view.coordinator.fetch_all)

    def run_ahead(self, state: TrainState, batch):
        """Issue `batch`'s ahead work (frozen sections reading only data) before the step that
        trains on it, which then takes it as `StepBatch.ahead` (`Executor.run_ahead`)."""
        batch = as_batch(batch)
        return self.executor.run_ahead(
            state.sections, batch.samples, self.schedule(batch), batch.host, step=state.step + 1
        )

    def evaluate(self, state: TrainState, batch):
        """The batch's loss, forward only (a device scalar; `Executor.evaluate`)."""
        batch = as_batch(batch)
        return self.executor.evaluate(
            state.sections, batch.samples, self.schedule(batch), host=batch.host, norm=batch.loss_count
        )

    def timeline(self, state: TrainState, batch) -> tuple[dict, list]:
        """The step's gradients with every operation waited for: (grads, [(op, start_s, end_s,
        dispatch_s)]), a measured timeline for calibration and traces. Serialised: never a
        throughput."""
        batch = as_batch(batch)
        record: list = []
        result = self.executor.run(state.sections, batch.samples, self.schedule(batch), host=batch.host, record=record)
        return result.grads, record

    def compile(
        self, steps, say=print, *, evaluate=(), max_batches: int = ahead.MAX_BATCHES, threads: int | None = None
    ) -> int:
        """Before step 1, compile every program the run needs for every shape bucket the global
        batches `steps` (their indices in the training stream, e.g. `range(start, cfg.steps)`) can
        produce, and the forward-only evaluation programs of the batches in `evaluate` (lists of
        samples or `SampleInfo`s, e.g. another source's); returns the number of programs compiled.

        `say` gets "compiling N programs for S sections" first, then progress. Shapes come from
        sample metadata (no payload is read) through the schedule and packing the executor uses,
        and this step's own calls walk them over abstract values (`runtime.ahead`). Runs longer
        than `max_batches` steps are sampled (`ahead.bounded`); a shape bucket no scanned batch
        has is compiled when it first appears, with a warning naming the section and step.
        Compiling only: nothing runs on the devices. `threads`: programs compiled at once
        (default `ahead.default_threads()`)."""
        infos = self.view.batch_infos(ahead.bounded(steps, max_batches))
        report = ahead.compile_batches(self, infos, evaluate, say, threads=threads)
        for prog in self.view.programs.values():
            prog.compiled_ahead = True
        return report.count

    def abstract_state(self) -> TrainState:
        """`init`'s result as abstract values in each section's layout, the optimizer state's
        from its `init_opt` program (traced or compiled by an abstract twin's run)."""
        return TrainState(0, ahead.abstract_states(self.view, self.programs))

    def memory_analysis(self) -> dict[str, dict[str, int]]:
        """Each section's compiled programs' device memory (XLA's `memory_analysis`), by section."""
        return {s: prog.memory_analysis() for s, prog in self.programs.items()}


class MonolithicStep:
    """The whole graph as one jitted program over one mesh (`runtime.monolithic`): the reference."""

    def __init__(self, mono, on_nonfinite: str | None = None):
        """`mono`: a `runtime.build.MonolithicRuntime`; `on_nonfinite` as `SectionedStep`'s."""
        self.mono = mono
        self.on_nonfinite = on_nonfinite or mono.cfg.on_nonfinite

    def init(self, seed: int | None = None) -> TrainState:
        """Step 0 on the monolithic mesh, from the sectioned step's initialisation and pretrained
        weights (`MonolithicRuntime.init_states`)."""
        return TrainState(0, self.mono.init_states(seed))

    def start_from(self, whole: Mapping[str, SectionState]) -> TrainState:
        """Step 0 on the monolithic mesh from the sectioned step's step-0 states (sections whole,
        `runtime.stages.whole_states`): the same weights moved, not initialised again
        (`MonolithicRuntime.states_from`)."""
        return TrainState(0, self.mono.states_from(whole))

    def gradients(self, state: TrainState, batch) -> tuple[object, dict, StepResult]:
        """(loss, grads, result) as `SectionedStep.gradients`: `result.metrics`, the sink's
        metrics summed over the batch; `result.norm`, the loss normaliser (one program: no host
        waits)."""
        samples = as_batch(batch).samples
        model = self.mono.model
        loss, metrics, grads = model.run(state.sections, samples)
        return loss, grads, StepResult(loss, grads, metrics, norm=float(max(model.graph.loss_count(samples), 1)))

    def squared_norms(self, grads: Mapping) -> dict:
        return self.mono.model.squared_norms(grads)

    def apply(self, state: TrainState, grads: Mapping, norms_sq: Mapping | None = None) -> TrainState:
        return TrainState(state.step + 1, self.mono.model.update(state.sections, grads, norms_sq))

    def __call__(self, state: TrainState, batch) -> tuple[TrainState, StepMetrics]:
        t0 = time.perf_counter()
        loss, grads, result = self.gradients(state, batch)
        model = self.mono.model
        metrics = StepMetrics(
            step=state.step + 1,
            sink=model.graph.sink,
            loss=loss,
            finite=model.all_finite(grads),
            norms_sq=self.squared_norms(grads),
            sink_metrics=result.metrics,
            norm=result.norm,
            on_nonfinite=self.on_nonfinite,
        )
        if self.on_nonfinite == "skip" and metrics.nonfinite():
            return TrainState(state.step + 1, state.sections), metrics
        new = self.apply(state, grads, metrics.norms_sq)
        metrics.rates = {s: current_rate(new.sections[s].opt_state) for s in grads}
        metrics.host["dispatch_s"] = time.perf_counter() - t0
        return new, metrics

    def read(self, metrics: StepMetrics) -> dict:
        return metrics.read()

    def evaluate(self, state: TrainState, batch):
        """The batch's loss (the monolithic program computes its gradients too; only the loss is kept)."""
        return self.gradients(state, batch)[0]

    def _unsupported(self, method: str, why: str):
        raise StepUnsupported(f"MonolithicStep.{method}: {why}; the plan's SectionedStep offers it")

    def run_ahead(self, state: TrainState, batch):
        self._unsupported("run_ahead", "one program computes every section of a step, none ahead of it")

    def timeline(self, state: TrainState, batch) -> tuple[dict, list]:
        self._unsupported("timeline", "one program has no operations between sections to time")

    def compile(self, steps, say=print, *, evaluate=(), max_batches: int = ahead.MAX_BATCHES, threads=None) -> int:
        self._unsupported("compile", "the reference compiles each batch shape when it first runs")

    def abstract_state(self) -> TrainState:
        self._unsupported("abstract_state", "its state is laid out when `init` places it on the monolithic mesh")

    def memory_analysis(self) -> dict[str, dict[str, int]]:
        self._unsupported("memory_analysis", "its programs are compiled when they first run, not ahead")
