"""Executor: walks a schedule's operations, dispatching each section program asynchronously.

The host only enqueues work. On accelerators, in one process, it issues in the order
`schedule.dispatch_order` gives: the schedule's, except that a section whose devices already
hold `launch_window` queued programs is passed by later ops of other sections (XLA blocks the
host at its own per-device queue bound, which would stall every section behind that one);
elsewhere in the schedule's order. It waits in three places: when every op left is behind a
full queue (counted in `StepResult.launch_waits`), when a trained producer has more micro-steps
stashed than the in-flight bound allows (to cap activation memory; counted in
`StepResult.in_flight_waits`, and never taken under a wavefront schedule, which keeps the bound),
and when a caller reads the step's loss.

Every device computation a step issues is a section program from its section's cache of
compiled executables (`runtime.programs`), the sums of losses, metrics and cotangents included,
or a transfer's cut and join programs. An abstract twin (`Executor.abstract`, over the sections'
abstract twins) walks the same way over abstract values and compiles instead of running
(`runtime.ahead`, `SectionedStep.compile`).

With `scan` above 1 (`compile.scan_micro_steps`), a frozen producer's forward or the sink's
loss-and-grad takes with it, in one program (`forward_run`, `loss_and_grad_run`: a scan), up to
`scan - 1` of the section's next micro-steps that are not issued yet, have the same signature and
whose producers' micro-steps are computed (their pending transfers issued first): one launch
instead of k, the later micro-steps' work issued
earlier on the same devices, each micro-step's results kept apart as if issued alone. A consumer
of the first micro-step's outputs then waits for the whole run: the bound is the trade between
launches and that wait. Timed (`record`) and threaded steps, evaluation and trained producers
(whose backward reads per-micro-step residuals) issue one program per micro-step.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Mapping, Sequence

import jax
import numpy as np

from maestro_jax.core.graph import SectionGraph
from maestro_jax.runtime.programs import DryRun, SectionPrograms, SectionState, signature
from maestro_jax.runtime.transfer import abstract_transfer, deliver_rows, return_rows, transfer
from maestro_jax.schedule import Op, Problem, Schedule, required_ops
from maestro_jax.schedule.dispatch import dispatch_order
from maestro_jax.schedule.packing import Pack, packs

# Programs queued per device before the executor lets other sections' ops pass: half of what XLA's
# GPU client queues before it blocks the host (32, xla/pjrt/pjrt_stream_executor_client.cc), so
# the transfers' cut and join programs and co-located sections still find room.
LAUNCH_WINDOW = 16


@dataclasses.dataclass
class _StepState:
    """Everything one step's operations read and write (device arrays keyed by op)."""

    states: Mapping[str, SectionState]
    schedule: Schedule
    norm: np.float32
    batches: dict
    acc: dict
    outputs: dict = dataclasses.field(default_factory=dict)
    handles: dict = dataclasses.field(default_factory=dict)
    moved: dict = dataclasses.field(default_factory=dict)
    cotangents: dict = dataclasses.field(default_factory=dict)
    moved_back: dict = dataclasses.field(default_factory=dict)
    losses: list = dataclasses.field(default_factory=list)
    metrics: list = dataclasses.field(default_factory=list)
    in_flight_waits: int = 0
    in_flight_wait_s: float = 0.0
    transfer_issue_s: float = 0.0
    launch_waits: int = 0
    # with `scan`: per section that may scan, its forwards in issue order, and the results of
    # those already issued inside an earlier micro-step's run (op -> what it produced)
    forwards: dict | None = None
    ran: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Ahead:
    """A global batch's ahead work (`Problem.ahead`), issued during the step before the one that
    trains on it: its forwards' results already moved to their consumers' meshes."""

    moved: dict  # (edge, producer micro-step) -> array on the consumer's mesh


@dataclasses.dataclass
class StepResult:
    loss: jax.Array  # device scalar, summed over the sink's micro-steps
    grads: dict[str, object]  # trained section -> accumulated grads (on its mesh)
    metrics: dict[str, jax.Array]  # the sink's metrics, summed over the batch (not normalised)
    norm: float = 1.0  # the batch's loss normaliser, which `loss` is already divided by
    in_flight_waits: int = 0  # times the host waited for a stashed forward (the in-flight bound)
    in_flight_wait_s: float = 0.0  # and for how long
    transfer_issue_s: float = 0.0  # host time spent issuing transfers between sections
    launch_waits: int = 0  # times every op left was behind a full launch queue (`launch_window`)


class Executor:
    def __init__(
        self,
        graph: SectionGraph,
        problem: Problem,
        programs: Mapping[str, SectionPrograms],
        pack: Mapping[str, Pack] | None = None,
        dry: DryRun | None = None,
        scan: int = 1,
    ):
        """`dry`: an abstract twin's dry run (`abstract`): transfers are recorded, not issued,
        and nothing waits. `scan`: the most micro-steps one program runs (1: one each)."""
        self.graph, self.problem, self.programs, self.dry = graph, problem, programs, dry
        self.scan = scan
        # sections that pack sequences: samples per row or a token budget per row
        # (`schedule.packing`; their `problem.rows` count sample slots)
        self.pack = {s: p for s, p in (pack or {}).items() if packs(p)}
        # per edge, how a producer micro-step reaches the consumer (each consumer shard gets its
        # feeders' rows: any data-parallel degrees) and how its cotangent goes back (summed)
        self.row_maps = {
            e.name: tuple(
                f(problem.dp[e.src], problem.dp[e.dst], problem.micro_batch(e.src)) for f in (deliver_rows, return_rows)
            )
            for e in problem.edges
        }
        self.compiled_transfers: set = set()  # keys of the cut and join programs compiled ahead
        # None: the schedule's order as it is. On CPU (no such queue bound) and across processes
        # (each process must issue collective programs in the same order, and readiness is local)
        cpu = next(iter(programs.values())).mesh.devices.flat[0].platform == "cpu" if programs else True
        self.launch_window: int | None = None if cpu or jax.process_count() > 1 else LAUNCH_WINDOW
        # a section's launch queue is its devices' (co-located sections share one)
        self.lanes = {s: tuple(sorted(d.id for d in prog.mesh.devices.flat)) for s, prog in programs.items()}

    def abstract(self, programs: Mapping[str, SectionPrograms], run: DryRun) -> Executor:
        """This executor over the sections' abstract twins (`SectionPrograms.abstract(run)`): the
        same walk, every program call and transfer handed to `run`; the transfers it compiles
        are recorded in this executor's `compiled_transfers`."""
        twin = Executor(self.graph, self.problem, programs, self.pack, dry=run, scan=self.scan)
        twin.compiled_transfers = self.compiled_transfers
        return twin

    def host_batches(self, samples: Sequence, schedule: Schedule) -> dict[tuple[str, int], dict]:
        """Numpy inputs of every micro-step (host work, done before any dispatch)."""
        out = {}
        for s, steps in schedule.steps.items():
            section = self.graph.section(s)
            for st in steps:
                row_samples = [samples[i] if i >= 0 else None for i in st.positions]
                routes = schedule.routes(self.problem, s, st.index)
                if s in self.pack:
                    out[(s, st.index)] = section.packed_batch(row_samples, routes, self.problem.dp[s], self.pack[s])
                else:
                    out[(s, st.index)] = section.host_batch(row_samples, routes)
        return out

    def _start(self, states, samples, schedule, host, norm, sections=None, grads: bool = True) -> _StepState:
        """`sections`: the sections whose inputs to put on their devices (default all); `grads`:
        start a grad accumulator for each trained one."""
        host = host if host is not None else self.host_batches(samples, schedule)
        norm = self.graph.loss_count(samples) if norm is None else norm
        return _StepState(
            states=states,
            schedule=schedule,
            norm=np.float32(max(norm, 1)),
            batches={
                key: self.programs[key[0]].put_batch(b)
                for key, b in host.items()
                if sections is None or key[0] in sections
            },
            acc={
                s: self.programs[s].zeros_like_params(states[s])
                for s in self.problem.order
                if grads and s in self.problem.trained and (sections is None or s in sections)
            },
        )  # graph order: same everywhere

    def _at_step(self, step: int | None) -> None:
        """Name the training step being issued in the programs' lazy-compile log lines."""
        if step is not None:
            for prog in self.programs.values():
                prog.step = step

    def run_ahead(
        self,
        states: Mapping[str, SectionState],
        samples: Sequence,
        schedule: Schedule,
        host: dict | None = None,
        step: int | None = None,
    ) -> Ahead:
        """Issue a global batch's ahead work (`Problem.ahead`: frozen sections that read only
        data and each other) before the step that trains on it; `run(..., ahead=)` then skips
        it. The same programs on the same inputs and frozen weights as inside that step, so the
        step's loss and gradients are those it would compute itself, bit for bit."""
        self._at_step(step)
        ctx = self._start(states, samples, schedule, host, 0, sections=self.problem.ahead)
        ops = [op for op in schedule.ops if self.problem.is_ahead(op)]
        ctx.forwards = self._scannable_forwards(ops)
        for op in ops:
            self._execute(op, ctx)
        return Ahead(ctx.moved)

    def _summed(self, losses: list, metrics: list):
        """The sink's micro-step losses and metrics summed in order, on the sink's mesh (one
        program call per micro-step; no losses: 0 and no metrics)."""
        if not losses:
            return 0, {}
        sink = self.programs[self.problem.sink]
        total = (losses[0], metrics[0])
        for pair in zip(losses[1:], metrics[1:]):
            total = sink.add(total, pair)
        return total

    def _finish(self, ctx: _StepState) -> StepResult:
        loss, summed = self._summed(ctx.losses, ctx.metrics)
        return StepResult(
            loss=loss,
            grads=ctx.acc,
            metrics=summed,
            norm=float(ctx.norm),
            in_flight_waits=ctx.in_flight_waits,
            in_flight_wait_s=ctx.in_flight_wait_s,
            transfer_issue_s=ctx.transfer_issue_s,
            launch_waits=ctx.launch_waits,
        )

    def _move(self, x, dst, row_map=None):
        """`transfer` (an abstract twin's: the abstract result, its cut and join programs recorded)."""
        run = self.dry
        if run is None:
            return transfer(x, dst, row_map)
        out, programs = abstract_transfer(x, dst, row_map)
        for key, program in programs.items():
            if key not in self.compiled_transfers:
                run.transfers.setdefault(key, program)
        return out

    def _deliver(self, e, x):
        """A producer micro-step's array of edge `e` onto its consumer's mesh (`deliver_rows`)."""
        row_map = self.row_maps[e.name][0]
        return self._move(x, self.programs[e.dst].edge_sharding((row_map.out_rows, *x.shape[1:])), row_map)

    def _return(self, e, cotangent):
        """The cotangent of edge `e`'s delivered array back onto its producer's mesh (`return_rows`)."""
        row_map = self.row_maps[e.name][1]
        return self._move(
            cotangent, self.programs[e.src].edge_sharding((row_map.out_rows, *cotangent.shape[1:])), row_map
        )

    def run(
        self,
        states: Mapping[str, SectionState],
        samples: Sequence,
        schedule: Schedule,
        host: dict | None = None,
        record: list | None = None,
        norm: int | None = None,
        ahead: Ahead | None = None,
        step: int | None = None,
    ) -> StepResult:
        """Forward and backward of one global batch: loss and accumulated grads, no update.

        `norm`: the batch's loss normaliser when `samples` are partly hollow (a multi-process
        `LoadedBatch`); by default `graph.loss_count(samples)`. `ahead`: the batch's ahead work,
        issued earlier (`run_ahead`); without it the step runs that work itself. `step`: the
        training step, named by the log line of a program compiled lazily (a shape bucket
        `SectionedStep.compile` did not foresee).

        With `record` (a list), every operation is waited for and appended as
        `(op, start_s, end_s, dispatch_s)`: a measured timeline for calibration and traces, with
        the host time spent issuing the op. This serialises the step; never use it for throughput.
        """
        self._at_step(step)
        skip = self.problem.ahead if ahead is not None else frozenset()
        ctx = self._start(
            states, samples, schedule, host, norm, sections=[s for s in self.problem.order if s not in skip]
        )
        if ahead is not None:
            ctx.moved.update(ahead.moved)
        ops = schedule.ops if ahead is None else [op for op in schedule.ops if not self.problem.is_ahead(op)]
        if record is None:
            ctx.forwards = self._scannable_forwards(ops)
        if record is None and self.dry is None and self.launch_window is not None:
            self._issue(ops, ctx)
            return self._finish(ctx)
        t_origin = time.perf_counter()
        for op in ops:
            t_op = time.perf_counter()
            produced = self._execute(op, ctx)
            if record is not None:
                # timed mode: wait for everything this op produced
                t_dispatched = time.perf_counter()
                jax.block_until_ready(produced)
                record.append((op, t_op - t_origin, time.perf_counter() - t_origin, t_dispatched - t_op))
        return self._finish(ctx)

    def _lane(self, op: Op):
        return self.lanes[self.graph.edge(op.edge).dst if op.kind == "XB" else op.section]

    def _issue(self, ops: Sequence[Op], ctx: _StepState) -> None:
        """Issue `ops` in `dispatch_order`, each lane's queue tracked by one output of every op
        issued on it (gone once ready, or once donated to a later program of the lane). Besides
        the schedule's dependencies, a backward goes after every transfer of its forward's
        outputs (it releases them)."""
        deps = required_ops(ctx.schedule, self.problem)
        sends = collections.defaultdict(list)
        for op in ops:
            if op.kind == "X":
                sends[(op.section, op.step)].append(op)
        listed = set(ops)  # a dependency issued before (ahead work) is not waited for
        deps = {
            op: [
                d for d in (*deps.get(op, ()), *(sends[(op.section, op.step)] if op.kind == "B" else ())) if d in listed
            ]
            for op in ops
        }
        queues: dict = collections.defaultdict(collections.deque)

        def full(lane) -> bool:
            q = queues[lane]
            while q and (q[0].is_deleted() or q[0].is_ready()):
                q.popleft()
            return len(q) >= self.launch_window

        def wait(lane) -> None:
            ctx.launch_waits += 1
            oldest = queues[lane].popleft()
            if not oldest.is_deleted():
                oldest.block_until_ready()

        for op in dispatch_order(ops, deps, self._lane, full, wait):
            marker = _first_array(self._execute(op, ctx))
            if marker is not None:
                queues[self._lane(op)].append(marker)

    def evaluate(
        self,
        states: Mapping[str, SectionState],
        samples: Sequence,
        schedule: Schedule,
        host: dict | None = None,
        norm: int | None = None,
        step: int | None = None,
    ):
        """The batch's loss, forward only: a device scalar equal to `run(...).loss` on the same
        batch (to float rounding), through the same sections, plan, meshes and schedule.

        Every producer runs its `forward` program (no vjp residuals), the sink its `loss` program
        (no gradients); only the schedule's forwards and forward transfers run, nothing is
        stashed for a backward and nothing waits. `norm` as in `run`."""
        self._at_step(step)
        ctx = self._start(states, samples, schedule, host, norm, grads=False)
        p = self.problem
        uses = {}  # (section, micro-step) -> transfers of its outputs still to issue
        for op in schedule.ops:
            if op.kind == "X":
                key = (self.graph.edge(op.edge).src, op.step)
                uses[key] = uses.get(key, 0) + 1
        for op in schedule.ops:
            prog = self.programs[op.section]
            if op.kind == "F":
                step_ = schedule.steps[op.section][op.step]
                inputs = self._inputs(op.section, step_, ctx)
                batch = ctx.batches.pop((op.section, op.step))
                if op.section == p.sink:
                    loss, m = prog.loss(ctx.states[op.section], inputs, batch, ctx.norm)
                    ctx.losses.append(loss)
                    ctx.metrics.append(m)
                elif uses.get((op.section, op.step)):
                    ctx.outputs[(op.section, op.step)] = prog.forward(ctx.states[op.section], inputs, batch)
            elif op.kind == "X":
                e = self.graph.edge(op.edge)
                key = (e.src, op.step)
                ctx.moved[(e.name, op.step)] = self._deliver(e, ctx.outputs[key][e.name])
                uses[key] -= 1
                if not uses[key]:
                    del ctx.outputs[key]  # every consumer has its copy
        return self._summed(ctx.losses, ctx.metrics)[0]

    def _inputs(self, section: str, step, ctx: _StepState) -> dict:
        return {
            e.name: tuple(ctx.moved[(e.name, k)] for k in step.deps[e.name]) if e.name in step.deps else None
            for e in self.problem.in_edges(section)
        }

    def run_threaded(
        self, states: Mapping[str, SectionState], samples: Sequence, schedule: Schedule, record: list | None = None
    ) -> StepResult:
        """Same step, each section dispatched from its own thread.

        XLA's CPU client runs one multi-device program at a time per process but runs
        single-device programs from different threads side by side, so this is how sections
        overlap on CPU. A thread waits for an op's dependencies (events set by other threads)
        and for its own op to finish before the next. Transfers run on the thread that owns
        their data: X on the producer's, XB on the consumer's.
        """
        ctx = self._start(states, samples, schedule, None, None)
        req = required_ops(schedule, self.problem)
        done = {op: threading.Event() for op in schedule.ops}
        owner = {op: self.graph.edge(op.edge).dst if op.kind == "XB" else op.section for op in schedule.ops}
        errors: list[BaseException] = []
        t_origin = time.perf_counter()

        def worker(section: str) -> None:
            try:
                for op in schedule.ops:
                    if owner[op] != section or op.kind == "U":
                        continue
                    for d in req.get(op, ()):
                        while not done[d].wait(timeout=1.0):
                            if errors:
                                return
                    t0 = time.perf_counter()
                    jax.block_until_ready(self._execute(op, ctx))
                    if record is not None:
                        record.append((op, t0 - t_origin, time.perf_counter() - t_origin, 0.0))
                    done[op].set()
            except BaseException as err:  # noqa: BLE001 - surfaced in the calling thread below
                errors.append(err)

        threads = [threading.Thread(target=worker, args=(s,), name=f"dispatch-{s}") for s in self.problem.order]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return self._finish(ctx)

    def _scannable_forwards(self, ops: Sequence[Op]) -> dict[str, list[Op]] | None:
        """Per section whose forwards may scan (`scan` > 1; frozen producers and the sink), its
        forwards among `ops` in their order; None without scanning."""
        if self.scan < 2:
            return None
        p, out = self.problem, {}
        for op in ops:
            if op.kind == "F" and (op.section == p.sink or not p.needs_backward(op.section)):
                out.setdefault(op.section, []).append(op)
        return {s: f for s, f in out.items() if len(f) > 1}

    def _ready_inputs(self, section: str, step, ctx: _StepState) -> dict | None:
        """`_inputs`, issuing first the transfers still pending of producer micro-steps already
        computed (each then skipped where the schedule has it); None while a producer micro-step
        is not computed yet."""
        edges = self.problem.in_edges(section)
        wanted = [(e, k) for e in edges for k in step.deps.get(e.name, ()) if (e.name, k) not in ctx.moved]
        if any((e.src, k) not in ctx.outputs for e, k in wanted):
            return None
        for e, k in wanted:
            op = Op("X", e.src, k, e.name)
            ctx.ran[op] = self._execute(op, ctx)
        return self._inputs(section, step, ctx)

    def _run_of(self, op: Op, ctx: _StepState) -> list[tuple[Op, dict, dict]]:
        """`op` and the section's next forwards that may run in its program: (op, inputs,
        batch) each, at most `scan`, up to the first one issued already, not ready, or of
        another signature (nothing is taken out of order; an issued forward's batch is gone)."""
        steps = ctx.schedule.steps[op.section]
        first = (op, self._inputs(op.section, steps[op.step], ctx), ctx.batches[(op.section, op.step)])
        run, forwards = [first], (ctx.forwards or {}).get(op.section, ())
        if not forwards:
            return run
        key = signature(first[1:])
        for later in forwards[forwards.index(op) + 1 :]:
            if len(run) == self.scan:
                break
            inputs = self._ready_inputs(op.section, steps[later.step], ctx)
            batch = ctx.batches.get((op.section, later.step))
            if inputs is None or batch is None or signature((inputs, batch)) != key:
                break
            run.append((later, inputs, batch))
        return run

    def _forward_run(self, run: list[tuple[Op, dict, dict]], ctx: _StepState):
        """A frozen producer's forwards of `run` in one program; each micro-step's outputs stored
        as its own forward's would be."""
        s = run[0][0].section
        for op, _, _ in run:
            del ctx.batches[(s, op.step)]
        _, inputs_k, batches_k = (tuple(x) for x in zip(*run))
        outs = self.programs[s].forward_run(ctx.states[s], inputs_k, batches_k)
        for (op, _, _), out in zip(run, outs):
            ctx.outputs[(s, op.step)] = out
            ctx.ran[op] = out
        return outs

    def _loss_and_grad_run(self, run: list[tuple[Op, dict, dict]], ctx: _StepState):
        """The sink's loss-and-grad of `run` in one program, the accumulator carried through;
        losses, metrics and input cotangents recorded per micro-step, in order."""
        s, prog = run[0][0].section, self.programs[run[0][0].section]
        for op, _, _ in run:
            del ctx.batches[(s, op.step)]
        _, inputs_k, batches_k = (tuple(x) for x in zip(*run))
        losses, metrics, ctx.acc[s], d_inputs = prog.loss_and_grad_run(
            ctx.states[s], inputs_k, batches_k, ctx.norm, ctx.acc[s]
        )
        for (op, _, _), loss, m, d in zip(run, losses, metrics, d_inputs):
            ctx.losses.append(loss)
            ctx.metrics.append(m)
            self._collect_cotangents(prog, ctx.schedule.steps[s][op.step], d, ctx.cotangents)
            ctx.ran[op] = (loss, ctx.acc[s], d)
        return losses, ctx.acc[s], d_inputs

    def _execute(self, op: Op, ctx: _StepState):
        """Dispatch one operation; returns what it produced (for callers that wait on it)."""
        if op in ctx.ran:  # issued inside an earlier micro-step's run
            return ctx.ran.pop(op)
        p, g, prog = self.problem, self.graph, self.programs[op.section]
        states, schedule = ctx.states, ctx.schedule
        if op.kind == "F" and ctx.forwards and op.section in ctx.forwards:
            run = self._run_of(op, ctx)
            if len(run) > 1:
                return self._loss_and_grad_run(run, ctx) if op.section == p.sink else self._forward_run(run, ctx)
        if op.kind == "F":
            step = schedule.steps[op.section][op.step]
            inputs = self._inputs(op.section, step, ctx)
            batch = ctx.batches.pop((op.section, op.step))
            if op.section == p.sink:
                loss, m, ctx.acc[op.section], d_inputs = prog.loss_and_grad(
                    states[op.section], inputs, batch, ctx.norm, ctx.acc[op.section]
                )
                ctx.losses.append(loss)
                ctx.metrics.append(m)
                self._collect_cotangents(prog, step, d_inputs, ctx.cotangents)
                return loss, ctx.acc[op.section], d_inputs
            if p.needs_backward(op.section):
                key = (op.section, op.step)
                ctx.outputs[key], ctx.handles[key] = prog.forward_vjp(states[op.section], inputs, batch)
                self._bound_in_flight(op.section, ctx)
                return ctx.outputs[key], ctx.handles[key]
            ctx.outputs[(op.section, op.step)] = prog.forward(states[op.section], inputs, batch)
            return ctx.outputs[(op.section, op.step)]
        if op.kind == "X":
            e, t0 = g.edge(op.edge), time.perf_counter()
            ctx.moved[(e.name, op.step)] = self._deliver(e, ctx.outputs[(e.src, op.step)][e.name])
            ctx.transfer_issue_s += time.perf_counter() - t0
            return ctx.moved[(e.name, op.step)]
        if op.kind == "XB":
            e, t0 = g.edge(op.edge), time.perf_counter()
            ctx.moved_back[(op.edge, op.step)] = self._return(e, ctx.cotangents.pop((op.edge, op.step)))
            ctx.transfer_issue_s += time.perf_counter() - t0
            return ctx.moved_back[(op.edge, op.step)]
        if op.kind == "B":
            ct = {
                e.name: ctx.moved_back.pop((e.name, op.step))
                for e in p.out_edges(op.section)
                if (e.name, op.step) in ctx.moved_back
            }
            out = ctx.outputs.pop((op.section, op.step))
            ct = {k: ct[k] if k in ct else prog.zeros_like(v) for k, v in out.items()}  # zeros only if unused
            ctx.acc[op.section], d_inputs = prog.backward(
                states[op.section], ctx.handles.pop((op.section, op.step)), ct, ctx.acc[op.section]
            )
            self._collect_cotangents(prog, schedule.steps[op.section][op.step], d_inputs, ctx.cotangents)
            return ctx.acc[op.section], d_inputs
        return None  # U: applied by `update` after the step

    @staticmethod
    def _collect_cotangents(prog: SectionPrograms, step, d_inputs, cotangents) -> None:
        """Sum each input cotangent into its producer micro-step's slot (still on this mesh)."""
        for edge, parts in d_inputs.items():
            if parts is None:  # no row of this micro-step used the edge
                continue
            for k, ct in zip(step.deps.get(edge, ()), parts):
                key = (edge, k)
                cotangents[key] = ct if key not in cotangents else prog.add(cotangents[key], ct)

    def _bound_in_flight(self, section: str, ctx: _StepState) -> None:
        """Bounded stash memory: past the bound, wait for the oldest stashed forward before
        queuing more. The wavefront scheduler keeps the bound by construction, so this wait is
        a safety net; each one is counted in the step's result (`in_flight_waits`)."""
        stashed = [h for (s, _), h in ctx.handles.items() if s == section]
        if len(stashed) > self.problem.in_flight(section) and self.dry is None:
            t0 = time.perf_counter()
            jax.block_until_ready(stashed[0])
            ctx.in_flight_waits += 1
            ctx.in_flight_wait_s += time.perf_counter() - t0

    def squared_norms(self, grads: Mapping[str, object]) -> dict[str, object]:
        """Each trained section's squared grad norm, a scalar on its own mesh."""
        return {s: self.programs[s].squared_norm(g) for s, g in grads.items()}

    def update(
        self,
        states: Mapping[str, SectionState],
        grads: Mapping[str, object],
        norms_sq: Mapping[str, object] | None = None,
    ) -> dict[str, SectionState]:
        """Every trained section's optimizer step. With `optimizer.clip_norm` each one clips by
        the global norm: every section's squared norm (`norms_sq`, computed here if not given)
        moves to its mesh, device to device, and is summed there in sorted section order, as the
        monolithic step sums them (`runtime.optimizer`)."""
        clipped = any(self.programs[s].clip_norm is not None for s in grads)
        if clipped and norms_sq is None:
            norms_sq = self.squared_norms(grads)
        new = dict(states)
        for s, gr in grads.items():
            prog = self.programs[s]
            here = tuple(self._move(norms_sq[t], prog.replicated) for t in sorted(grads)) if clipped else ()
            new[s] = prog.update(states[s], gr, here)
        return new


def _first_array(tree):
    """One array an op produced, found without flattening the whole tree (a backward returns the
    section's gradient accumulator: every parameter); None if it produced none."""
    if isinstance(tree, jax.Array):
        return tree
    children = tree.values() if isinstance(tree, Mapping) else tree if isinstance(tree, (tuple, list)) else None
    if children is None:
        leaves = jax.tree.leaves(tree)  # another pytree node: flatten it
        return leaves[0] if leaves else None
    for child in children:
        found = _first_array(child)
        if found is not None:
            return found
    return None
