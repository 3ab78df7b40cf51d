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
from maestro_jax.runtime.issuer import Issuer, StepState
from maestro_jax.runtime.moves import EdgeMoves
from maestro_jax.runtime.programs import DryRun, SectionPrograms, SectionState
from maestro_jax.schedule import Op, Problem, Schedule, required_ops
from maestro_jax.schedule.dispatch import dispatch_order
from maestro_jax.schedule.packing import Pack, packs

# Programs queued per device before the executor lets other sections' ops pass: half of what XLA's
# GPU client queues before it blocks the host (32, xla/pjrt/pjrt_stream_executor_client.cc), so
# the transfers' cut and join programs and co-located sections still find room.
LAUNCH_WINDOW = 16


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
        compiled: set | None = None,
    ):
        """`dry`: an abstract twin's dry run (`abstract`): transfers are recorded, not issued,
        and nothing waits. `scan`: the most micro-steps one program runs (1: one each).
        `compiled`: the keys of the transfers' programs compiled ahead (`EdgeMoves`)."""
        self.graph, self.problem, self.programs, self.dry = graph, problem, programs, dry
        # sections that pack sequences: samples per row or a token budget per row
        # (`schedule.packing`; their `problem.rows` count sample slots)
        self.pack = {s: p for s, p in (pack or {}).items() if packs(p)}
        self.moves = EdgeMoves(problem, programs, dry, compiled)
        self.issuer = Issuer(graph, problem, programs, self.moves, scan, dry)
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
        return Executor(
            self.graph, self.problem, programs, self.pack, dry=run, scan=self.scan, compiled=self.compiled_transfers
        )

    @property
    def scan(self) -> int:
        """The most micro-steps one program runs (`Issuer.scan`)."""
        return self.issuer.scan

    @scan.setter
    def scan(self, value: int) -> None:
        self.issuer.scan = value

    @property
    def row_maps(self) -> dict:
        """Each edge's (deliver, return) row maps (`EdgeMoves.row_maps`; 0.3.0's attribute)."""
        return self.moves.row_maps

    @property
    def compiled_transfers(self) -> set:
        """Keys of the transfers' cut and join programs compiled ahead (`EdgeMoves`)."""
        return self.moves.compiled_transfers

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

    def _start(self, states, samples, schedule, host, norm, sections=None, grads: bool = True) -> StepState:
        """`sections`: the sections whose inputs to put on their devices (default all); `grads`:
        start a grad accumulator for each trained one."""
        host = host if host is not None else self.host_batches(samples, schedule)
        norm = self.graph.loss_count(samples) if norm is None else norm
        return StepState(
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
        ctx.forwards = self.issuer.scannable_forwards(ops)
        for op in ops:
            self.issuer.execute(op, ctx)
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

    def _finish(self, ctx: StepState) -> StepResult:
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
            ctx.forwards = self.issuer.scannable_forwards(ops)
        if record is None and self.dry is None and self.launch_window is not None:
            self._issue(ops, ctx)
            return self._finish(ctx)
        t_origin = time.perf_counter()
        for op in ops:
            t_op = time.perf_counter()
            produced = self.issuer.execute(op, ctx)
            if record is not None:
                # timed mode: wait for everything this op produced
                t_dispatched = time.perf_counter()
                jax.block_until_ready(produced)
                record.append((op, t_op - t_origin, time.perf_counter() - t_origin, t_dispatched - t_op))
        return self._finish(ctx)

    def _lane(self, op: Op):
        return self.lanes[self.graph.edge(op.edge).dst if op.kind == "XB" else op.section]

    def _issue(self, ops: Sequence[Op], ctx: StepState) -> None:
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
            marker = _first_array(self.issuer.execute(op, ctx))
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
                inputs = self.issuer.inputs(op.section, step_, ctx)
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
                ctx.moved[(e.name, op.step)] = self.moves.deliver(e, ctx.outputs[key][e.name])
                uses[key] -= 1
                if not uses[key]:
                    del ctx.outputs[key]  # every consumer has its copy
        return self._summed(ctx.losses, ctx.metrics)[0]

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
                    jax.block_until_ready(self.issuer.execute(op, ctx))
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
            here = tuple(self.moves.move(norms_sq[t], prog.replicated) for t in sorted(grads)) if clipped else ()
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
