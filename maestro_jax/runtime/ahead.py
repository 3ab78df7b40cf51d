"""Compile ahead: every program a run will call, compiled before its first step.

Shape buckets used to compile lazily, on the step that first met them (issue 23: 66 compiles
over the first 6 steps of vlm_tiny). Here the shapes come from sample *metadata* alone: for each
global batch the run will take, its samples' `SampleInfo`s (no payload decoded) are scheduled
(`Runtime.schedule`), packed as the executor packs them (`Executor.host_batches` on
`hollow_sample`s: zeros of the right shapes), and the training step itself (`runtime.step`) walks
the whole step, update included, as its abstract twin (`SectionedStep.abstract`): each program call yields its abstract
outputs and records its signature, each transfer its cut and join programs. Nothing runs on the
devices.

Two passes. The first only traces (no compile), so the number of programs is known and said
before compiling; the second walks again the batches that brought a new signature and compiles
each one into its section's cache (the traces of the first pass are reused), then compiles the
transfers' programs. The second pass is needed because a few layouts exist only once a producer
is compiled (the vjp residuals `backward` reads, the optimizer state XLA lays out in `init_opt`).

Bound: a run of more than `max_batches` steps is not scanned whole: its first `max_batches // 2`
batches are, and `max_batches // 2` more spread evenly over the rest. Batches whose samples have
the same shapes in the same order as one already scanned are skipped. A shape nothing scanned
foresaw still works: the call compiles it into the same cache, with a log line
("compiling a new shape bucket for section X at step N").
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor

import jax

from maestro_jax.data.samples import DataError, SampleInfo, hollow_sample
from maestro_jax.runtime.programs import DryRun, SectionState

log = logging.getLogger("maestro_jax")

MAX_BATCHES = 256  # the default bound on the batches `SectionedStep.compile` scans
CACHE_HIT = "/jax/compilation_cache/cache_hits"  # jax.monitoring's event for a program its persistent cache held


def abstract_states(rt, programs) -> dict[str, SectionState]:
    """`rt`: a `Runtime` or a step's `RuntimeView` (graph, abstract, shardings). Each section's state as abstract values in its own layout; the optimizer state comes from
    its `init_opt` program, called on `programs` (the sections' abstract twins: traced or
    compiled, `SectionPrograms.abstract`)."""
    import flax.linen as nn

    out = {}
    for s in rt.graph.names:
        v = jax.tree.map(
            lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
            nn.meta.unbox(rt.abstract[s]),
            rt.shardings[s],
        )
        opt = programs[s].init_optimizer(v["params"]) if rt.graph.section(s).trained else None
        out[s] = SectionState(v["params"], v["consts"], opt)
    return out


@dataclasses.dataclass(frozen=True)
class _Batch:
    """A prepared batch, in the fields a step takes (`runtime.step.StepBatch`): its loss
    normaliser 1, no ahead work (the step then runs it itself, so its programs are among these)."""

    evaluate: bool
    samples: list
    schedule: object
    host: dict
    loss_count: int = 1
    ahead: object = None


def _prepare(rt, batch: Sequence, evaluate: bool) -> _Batch:
    """Schedule and pack one global batch from its samples or their `SampleInfo`s (hollow)."""
    samples = [hollow_sample(x) if isinstance(x, SampleInfo) else x for x in batch]
    schedule = rt.schedule(batch)
    return _Batch(evaluate, samples, schedule, rt.executor.host_batches(samples, schedule))


def _walk(step, state, b: _Batch) -> None:
    """The training step's own calls or its evaluation, over abstract values (`step`: an abstract
    twin, whose update is issued at once: `SectionedStep.abstract`)."""
    if b.evaluate:
        step.evaluate(state, b)
    else:
        step(state, b)


def _shapes(batch: Sequence) -> tuple:
    """What a batch's programs depend on: its samples' shapes and tags (a tag may decide which
    sections a sample activates: KD's routing), in order."""
    infos = [x if isinstance(x, SampleInfo) else x.info() for x in batch]
    return tuple(
        (
            i.length,
            tuple(sorted((m, tuple(map(tuple, v))) for m, v in i.item_shapes.items() if v)),
            tuple(sorted(i.tags.items())),
        )
        for i in infos
    )


@dataclasses.dataclass
class AheadReport:
    """What `compile_batches` did."""

    programs: int  # section programs compiled
    transfers: int  # transfer programs (cuts, joins) compiled
    sections: int  # sections that had programs to compile
    batches: int  # distinct batches scanned
    seconds: float
    used: dict[str, set]  # section -> (kind, signature) of every program the replayed batches call

    @property
    def count(self) -> int:
        return self.programs + self.transfers


def trace_batches(step, batches: Iterable[Sequence], evaluate: Iterable[Sequence] = (), replay_all: bool = False):
    """The first pass of `compile_batches`: walk each distinct batch over abstract values,
    tracing every program it calls, compiling none. A section's code that does not fit its
    shapes fails here (`SectionPrograms._trace`: a `GraphError` naming the section). Returns
    the tracer, the prepared batches that met a new program (or all, `replay_all`), and the
    distinct batch shapes seen. `step`: a `runtime.step.SectionedStep`."""
    tracer = DryRun(compile=False)
    replay, seen = [], set()
    twin = step.abstract(tracer)
    twin.abstract_state()
    for ev, batch in [(False, b) for b in batches] + [(True, b) for b in evaluate]:
        batch = list(batch)
        shapes = (ev, _shapes(batch))
        if shapes in seen:
            continue
        seen.add(shapes)
        before = (len(tracer.new), len(tracer.transfers))
        prepared = _prepare(step.view, batch, ev)
        _walk(twin, twin.abstract_state(), prepared)
        if replay_all or (len(tracer.new), len(tracer.transfers)) != before:
            replay.append(prepared)
    return tracer, replay, seen


def compile_batches(
    step,
    batches: Iterable[Sequence],
    evaluate: Iterable[Sequence] = (),
    say: Callable[[str], None] | None = None,
    replay_all: bool = False,
    threads: int | None = None,
) -> AheadReport:
    """Compile every program that training steps on `batches` and evaluations of `evaluate`
    (global batches as lists of `SampleInfo`s or samples) call and the caches lack. Says that it
    traces, then "compiling N programs for S sections" before compiling, then progress. `replay_all`: walk
    every batch again in the compiling pass (so that `used` covers them all). `threads`: programs
    compiled at once (default `default_threads()`; 1: one after the other). `step`: a
    `runtime.step.SectionedStep`."""
    say = say or (lambda _: None)
    rt = step.view
    t0 = time.perf_counter()
    loaded: list[None] = []  # one per program jax's persistent cache held (list.append: thread-safe)

    def listen(event: str, **_) -> None:
        if event == CACHE_HIT:
            loaded.append(None)

    say("tracing the steps' shape buckets to find the programs they call")
    tracer, replay, seen = trace_batches(step, batches, evaluate, replay_all)
    total = len(tracer.new) + len(tracer.transfers)
    sections = {s for s, _, _ in tracer.new}
    say(f"compiling {total} programs for {len(sections)} sections")
    threads = default_threads() if threads is None else threads
    pool = ThreadPoolExecutor(threads, thread_name_prefix="maestro-compile") if threads > 1 and total > 1 else None
    jax.monitoring.register_event_listener(listen)
    try:
        compiler = DryRun(compile=True, traced=tracer.traced, pool=pool)
        progress = _Progress(say, total)
        compiler.on_compile = progress.tick
        twin = step.abstract(compiler)
        state = twin.abstract_state()
        for prepared in replay:
            _walk(twin, state, prepared)
        for key, (program, args) in tracer.transfers.items():
            compiler.submit(_compile_transfer, program, args, key, rt.executor.compiled_transfers, progress)
        compiler.finish()
    finally:
        jax.monitoring.unregister_event_listener(listen)
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
    report = AheadReport(
        len(compiler.new), len(tracer.transfers), len(sections), len(seen), time.perf_counter() - t0, compiler.used
    )
    if total:
        cached = f" ({len(loaded)} loaded from the persistent compile cache)" if loaded else ""
        say(f"compiled {report.count} programs in {report.seconds:.1f} s{cached}")
    return report


def default_threads() -> int:
    """Programs compiled at once by default. On CPU devices, up to 4 with half the host's cores
    (XLA compiles outside Python's lock, so threads overlap; tracing and lowering stay serial).
    On accelerators 1: XLA autotunes kernels by timing them on the device, which concurrent
    compiles would disturb, and it parallelises each compile itself."""
    if jax.devices()[0].platform != "cpu":
        return 1
    return max(1, min(4, (os.cpu_count() or 1) // 2))


def _compile_transfer(program, args, key, compiled: set, progress) -> None:
    program.lower(*args).compile()  # jax keeps it: the transfer's own call finds it compiled
    compiled.add(key)
    progress.tick()


class _Progress:
    """A progress line at most every 10 s while compiling."""

    def __init__(self, say, total: int):
        self.say, self.total, self.done = say, total, 0
        self.last = time.perf_counter()
        self._lock = threading.Lock()

    def tick(self) -> None:
        with self._lock:
            self.done += 1
            now = time.perf_counter()
            if now - self.last < 10 or self.done >= self.total:
                return
            self.last = now
        self.say(f"  compiled {self.done}/{self.total} programs")


def bounded(steps: Sequence[int], max_batches: int = MAX_BATCHES) -> list[int]:
    """All of `steps` when there are at most `max_batches`; else the first `max_batches // 2` and
    `max_batches - max_batches // 2` spread evenly over the rest."""
    steps = list(steps)
    if len(steps) <= max_batches:
        return steps
    head = max_batches // 2
    rest, k = steps[head:], max_batches - head
    return steps[:head] + [rest[(i * len(rest)) // k] for i in range(k)]


def batch_infos(
    source, steps: Iterable[int], global_batch: int, seed: int, shuffle: bool, info_check=None
) -> list[list[SampleInfo]]:
    """The `SampleInfo`s (metadata only) of global batches `steps` of `source` in the training
    stream's order (`data.pipeline.BatchReader`: batch b starts at stream position b *
    global_batch). A sample whose metadata fails `info_check` is skipped and the batch filled from
    the next ones, as the reader's skip policy does; payload checks are not run, so a run that
    skips bad payloads may shift later batches by a few samples (their shapes then compile lazily)."""
    from maestro_jax.data.pipeline import _ordered
    from maestro_jax.data.sources import sample_info

    order = _ordered(source, seed, shuffle)
    out = []
    for b in steps:
        pos, infos, bad = b * global_batch, [], 0
        while len(infos) < global_batch and bad <= len(source):  # a source of only bad samples: the reader says
            index = int(order[pos])
            pos += 1
            try:
                info = sample_info(source, index)
                if info_check is not None:
                    info_check(info)
            except DataError:
                bad += 1
                continue
            infos.append(info)
        if len(infos) == global_batch:
            out.append(infos)
    return out
