"""Issuing one operation of a step's schedule: the section program it calls (or the transfer it
starts), its inputs gathered from the arrays the step holds so far, and what it produced kept
for the operations after it (`StepState`). The executor (`runtime.executor`) decides the order.

With `scan` above 1 (`compile.scan_micro_steps`), a frozen producer's forward or the sink's
loss-and-grad takes with it, in one program (`forward_run`, `loss_and_grad_run`: a scan), up to
`scan - 1` of the section's next micro-steps that are not issued yet, have the same signature and
whose producers' micro-steps are computed (their pending transfers issued first): one launch
instead of k, each micro-step's results kept apart as if issued alone (`executor` module
docstring).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence

import jax
import numpy as np

from maestro_jax.core.graph import SectionGraph
from maestro_jax.runtime.moves import EdgeMoves
from maestro_jax.runtime.programs import DryRun, SectionPrograms, SectionState, signature
from maestro_jax.schedule import Op, Problem, Schedule


@dataclasses.dataclass
class StepState:
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


class Issuer:
    """Issues one op at a time of `problem`'s steps on the sections' `programs`, moving edge arrays
    with `moves`. `scan`: the most micro-steps one program runs (1: one each); `dry`: an abstract
    twin's dry run, under which nothing waits."""

    def __init__(
        self,
        graph: SectionGraph,
        problem: Problem,
        programs: Mapping[str, SectionPrograms],
        moves: EdgeMoves,
        scan: int = 1,
        dry: DryRun | None = None,
    ):
        self.graph, self.problem, self.programs, self.moves = graph, problem, programs, moves
        self.scan, self.dry = scan, dry

    def inputs(self, section: str, step, ctx: StepState) -> dict:
        return {
            e.name: tuple(ctx.moved[(e.name, k)] for k in step.deps[e.name]) if e.name in step.deps else None
            for e in self.problem.in_edges(section)
        }

    def scannable_forwards(self, ops: Sequence[Op]) -> dict[str, list[Op]] | None:
        """Per section whose forwards may scan (`scan` > 1; frozen producers and the sink), its
        forwards among `ops` in their order; None without scanning."""
        if self.scan < 2:
            return None
        p, out = self.problem, {}
        for op in ops:
            if op.kind == "F" and (op.section == p.sink or not p.needs_backward(op.section)):
                out.setdefault(op.section, []).append(op)
        return {s: f for s, f in out.items() if len(f) > 1}

    def _ready_inputs(self, section: str, step, ctx: StepState) -> dict | None:
        """`_inputs`, issuing first the transfers still pending of producer micro-steps already
        computed (each then skipped where the schedule has it); None while a producer micro-step
        is not computed yet."""
        edges = self.problem.in_edges(section)
        wanted = [(e, k) for e in edges for k in step.deps.get(e.name, ()) if (e.name, k) not in ctx.moved]
        if any((e.src, k) not in ctx.outputs for e, k in wanted):
            return None
        for e, k in wanted:
            op = Op("X", e.src, k, e.name)
            ctx.ran[op] = self.execute(op, ctx)
        return self.inputs(section, step, ctx)

    def _run_of(self, op: Op, ctx: StepState) -> list[tuple[Op, dict, dict]]:
        """`op` and the section's next forwards that may run in its program: (op, inputs,
        batch) each, at most `scan`, up to the first one issued already, not ready, or of
        another signature (nothing is taken out of order; an issued forward's batch is gone)."""
        steps = ctx.schedule.steps[op.section]
        first = (op, self.inputs(op.section, steps[op.step], ctx), ctx.batches[(op.section, op.step)])
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

    def _forward_run(self, run: list[tuple[Op, dict, dict]], ctx: StepState):
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

    def _loss_and_grad_run(self, run: list[tuple[Op, dict, dict]], ctx: StepState):
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

    def execute(self, op: Op, ctx: StepState):
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
            return self._forward(op, ctx)
        if op.kind == "X":
            e, t0 = g.edge(op.edge), time.perf_counter()
            ctx.moved[(e.name, op.step)] = self.moves.deliver(e, ctx.outputs[(e.src, op.step)][e.name])
            ctx.transfer_issue_s += time.perf_counter() - t0
            return ctx.moved[(e.name, op.step)]
        if op.kind == "XB":
            e, t0 = g.edge(op.edge), time.perf_counter()
            ctx.moved_back[(op.edge, op.step)] = self.moves.back(e, ctx.cotangents.pop((op.edge, op.step)))
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

    def _forward(self, op: Op, ctx: StepState):
        """One micro-step's forward: the sink's loss-and-grad, a trained producer's forward with
        what its backward needs (within the stash bound), or a frozen producer's outputs."""
        p, prog, s = self.problem, self.programs[op.section], op.section
        step = ctx.schedule.steps[s][op.step]
        inputs = self.inputs(s, step, ctx)
        batch = ctx.batches.pop((s, op.step))
        if s == p.sink:
            loss, m, ctx.acc[s], d_inputs = prog.loss_and_grad(ctx.states[s], inputs, batch, ctx.norm, ctx.acc[s])
            ctx.losses.append(loss)
            ctx.metrics.append(m)
            self._collect_cotangents(prog, step, d_inputs, ctx.cotangents)
            return loss, ctx.acc[s], d_inputs
        key = (s, op.step)
        if p.needs_backward(s):
            ctx.outputs[key], ctx.handles[key] = prog.forward_vjp(ctx.states[s], inputs, batch)
            self._bound_in_flight(s, ctx)
            return ctx.outputs[key], ctx.handles[key]
        ctx.outputs[key] = prog.forward(ctx.states[s], inputs, batch)
        return ctx.outputs[key]

    @staticmethod
    def _collect_cotangents(prog: SectionPrograms, step, d_inputs, cotangents) -> None:
        """Sum each input cotangent into its producer micro-step's slot (still on this mesh)."""
        for edge, parts in d_inputs.items():
            if parts is None:  # no row of this micro-step used the edge
                continue
            for k, ct in zip(step.deps.get(edge, ()), parts):
                key = (edge, k)
                cotangents[key] = ct if key not in cotangents else prog.add(cotangents[key], ct)

    def _bound_in_flight(self, section: str, ctx: StepState) -> None:
        """Bounded stash memory: past the bound, wait for the oldest stashed forward before
        queuing more. The wavefront scheduler keeps the bound by construction, so this wait is
        a safety net; each one is counted in the step's result (`in_flight_waits`)."""
        stashed = [h for (s, _), h in ctx.handles.items() if s == section]
        if len(stashed) > self.problem.in_flight(section) and self.dry is None:
            t0 = time.perf_counter()
            jax.block_until_ready(stashed[0])
            ctx.in_flight_waits += 1
            ctx.in_flight_wait_s += time.perf_counter() - t0
