"""Executor: walks a schedule's operations, dispatching each section program asynchronously.

The host only enqueues work. It blocks in exactly two places: when a trained producer has
more micro-steps stashed than the in-flight bound allows (to cap activation memory), and at
the end of the step, to read the loss.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence

import jax
import numpy as np

from maestro_jax.graph import SectionGraph
from maestro_jax.programs import SectionPrograms, SectionState
from maestro_jax.scheduler import Problem, SampleMeta, Schedule
from maestro_jax.transfer import transfer


@dataclasses.dataclass
class StepResult:
    loss: jax.Array  # device scalar, summed over the sink's micro-steps
    grads: dict[str, object]  # trained section -> accumulated grads (on its mesh)
    metrics: dict[str, jax.Array]


def sample_metas(graph: SectionGraph, samples: Sequence) -> list[SampleMeta]:
    return [SampleMeta(frozenset(s.name for s in graph.sections if s.activates(x)),
                       {s.name: s.work(x) for s in graph.sections if s.activates(x)}) for x in samples]


class Executor:
    def __init__(self, graph: SectionGraph, problem: Problem, programs: Mapping[str, SectionPrograms]):
        self.graph, self.problem, self.programs = graph, problem, programs

    def host_batches(self, samples: Sequence, schedule: Schedule) -> dict[tuple[str, int], dict]:
        """Numpy inputs of every micro-step (host work, done before any dispatch)."""
        out = {}
        for s, steps in schedule.steps.items():
            section = self.graph.section(s)
            for st in steps:
                rows = [samples[i] if i >= 0 else None for i in st.rows]
                out[(s, st.index)] = section.host_batch(rows, schedule.routes(self.problem, s, st.index))
        return out

    def run(self, states: Mapping[str, SectionState], samples: Sequence, schedule: Schedule,
            host: dict | None = None, record: list | None = None) -> StepResult:
        """Forward and backward of one global batch: loss and accumulated grads, no update.

        With `record` (a list), every operation is waited for and appended as
        `(op, start_s, end_s, dispatch_s)`: a measured timeline for calibration and traces, with
        the host time spent issuing the op. This serialises the step; never use it for throughput.
        """
        p, g = self.problem, self.graph
        host = host if host is not None else self.host_batches(samples, schedule)
        norm = np.float32(max(g.loss_count(samples), 1))
        batches = {key: self.programs[key[0]].put_batch(b) for key, b in host.items()}
        acc = {s: self.programs[s].zeros_like_params(states[s]) for s in p.trained}
        outputs, handles, moved, cotangents, moved_back = {}, {}, {}, {}, {}
        losses, metrics = [], []
        t_origin = time.perf_counter()
        for op in schedule.ops:
            t_op = time.perf_counter()
            prog = self.programs[op.section]
            if op.kind == "F":
                step = schedule.steps[op.section][op.step]
                inputs = {e.name: tuple(moved[(e.name, k)] for k in step.deps[e.name]) if e.name in step.deps
                          else None for e in p.in_edges(op.section)}
                batch = batches.pop((op.section, op.step))
                if op.section == p.sink:
                    loss, m, acc[op.section], d_inputs = prog.loss_and_grad(
                        states[op.section], inputs, batch, norm, acc[op.section])
                    losses.append(loss)
                    metrics.append(m)
                    self._collect_cotangents(step, d_inputs, cotangents)
                elif p.needs_backward(op.section):
                    outputs[(op.section, op.step)], handles[(op.section, op.step)] = prog.forward_vjp(
                        states[op.section], inputs, batch)
                    self._bound_in_flight(op.section, handles)
                else:
                    outputs[(op.section, op.step)] = prog.forward(states[op.section], inputs, batch)
            elif op.kind == "X":
                e = g.edge(op.edge)
                moved[(e.name, op.step)] = transfer(outputs[(e.src, op.step)][e.name], self.programs[e.dst].rows)
            elif op.kind == "XB":
                moved_back[(op.edge, op.step)] = transfer(cotangents.pop((op.edge, op.step)), prog.rows)
            elif op.kind == "B":
                ct = {e.name: moved_back.pop((e.name, op.step)) for e in p.out_edges(op.section)
                      if (e.name, op.step) in moved_back}
                out = outputs.pop((op.section, op.step))
                ct = {k: ct.get(k, jax.numpy.zeros_like(v)) for k, v in out.items()}
                acc[op.section], d_inputs = prog.backward(states[op.section], handles.pop((op.section, op.step)),
                                                          ct, acc[op.section])
                self._collect_cotangents(schedule.steps[op.section][op.step], d_inputs, cotangents)
            if record is not None:
                # timed mode: wait for everything this op produced
                t_dispatched = time.perf_counter()
                jax.block_until_ready((acc, outputs, moved, moved_back, cotangents, losses))
                record.append((op, t_op - t_origin, time.perf_counter() - t_origin, t_dispatched - t_op))
        summed = {k: sum(m[k] for m in metrics) for k in (metrics[0] if metrics else {})}
        return StepResult(loss=sum(losses), grads=acc, metrics=summed)

    def _collect_cotangents(self, step, d_inputs, cotangents) -> None:
        """Sum each input cotangent into its producer micro-step's slot (still on this mesh)."""
        for edge, parts in d_inputs.items():
            if parts is None:  # no row of this micro-step used the edge
                continue
            for k, ct in zip(step.deps.get(edge, ()), parts):
                key = (edge, k)
                cotangents[key] = ct if key not in cotangents else cotangents[key] + ct

    def _bound_in_flight(self, section: str, handles) -> None:
        stashed = [h for (s, _), h in handles.items() if s == section]
        if len(stashed) > self.problem.max_in_flight:
            # Bounded stash memory: wait for the oldest stashed forward before queuing more.
            jax.block_until_ready(stashed[0])

    def update(self, states: Mapping[str, SectionState], grads: Mapping[str, object]) -> dict[str, SectionState]:
        new = dict(states)
        for s, gr in grads.items():
            new[s] = self.programs[s].update(states[s], gr)
        return new
