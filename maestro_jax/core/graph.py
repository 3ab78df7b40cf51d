"""Section graph: the workload cut into coarse sections joined by edges.

Plain Python (no JAX import): a `Section` holds callables that the section programs jit,
plus host-side functions that the scheduler and batcher call on sample metadata.

Row contract. A micro-step of a section processes `rows` (a fixed count per section plan),
each row one sample or padding. A consumer row that needs a producer's output names it by a
*route*: an index into the concatenation, along rows, of the producer micro-steps the
consumer depends on (-1: none). Routes are computed by the executor from the schedule and
handed to `host_batch`, so programs stay free of scheduling logic.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

SampleLike = Any  # maestro_jax.data.Sample; kept abstract so the graph stays import-light


@dataclasses.dataclass(frozen=True)
class Edge:
    """A named tensor `src` produces for `dst`, laid out `rows x ...` (row-major on batch)."""

    name: str
    src: str
    dst: str


@dataclasses.dataclass(frozen=True)
class Section:
    """One coarse piece of the workload, compiled as its own SPMD program family.

    forward(variables, inputs, batch): producers return `{edge_name: array}`; the sink returns
      `(loss_sum, metrics)` where `loss_sum` is summed (not averaged) over its rows, so that
      dividing by a global-batch count gives results independent of micro-batching.
      `variables = {"params": trained, "consts": frozen}`; `inputs[edge] = tuple of producer
      outputs (one per producer micro-step) or None when no row routes to that edge.
    host_batch(rows, routes): numpy arrays for one micro-step; `rows[i]` is a sample or None.
    activates(sample): whether the sample needs this section at all.
    work(sample): the section's work units for the sample (tokens, patches): cost and buckets.
    """

    name: str
    trained: bool
    forward: Callable[..., Any]
    host_batch: Callable[[Sequence[SampleLike | None], Mapping[str, Any]], dict[str, Any]]
    activates: Callable[[SampleLike], bool]
    work: Callable[[SampleLike], int]
    flops_per_unit: float = 0.0  # forward FLOPs per work unit, for the analytic cost model


@dataclasses.dataclass(frozen=True)
class SectionGraph:
    """A DAG of sections with one sink (the section that holds the loss).

    init(key) -> {section: {"params": ..., "consts": ...}} with logically partitioned leaves;
    the runtime evaluates it once per section, under that section's sharding.
    loss_count(samples) -> the global-batch normaliser of the sink's `loss_sum`.
    """

    sections: tuple[Section, ...]
    edges: tuple[Edge, ...]
    init: Callable[[Any], dict[str, dict[str, Any]]]
    loss_count: Callable[[Sequence[SampleLike]], int]

    def __post_init__(self):
        names = [s.name for s in self.sections]
        if len(set(names)) != len(names):
            raise ValueError(f"section names must be unique, got {names}")
        for e in self.edges:
            for end in (e.src, e.dst):
                if end not in names:
                    raise ValueError(f"edge {e.name!r} names unknown section {end!r}; sections are {names}")
        sinks = [n for n in names if not self.consumers_of(n)]
        if len(sinks) != 1:
            raise ValueError(f"a section graph needs exactly one sink (section without consumers), got {sinks}")
        self.topological_order()  # raises on cycles

    def section(self, name: str) -> Section:
        for s in self.sections:
            if s.name == name:
                return s
        raise KeyError(f"no section {name!r}; sections are {[s.name for s in self.sections]}")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.sections)

    @property
    def sink(self) -> str:
        return next(n for n in self.names if not self.consumers_of(n))

    def producers_of(self, name: str) -> tuple[Edge, ...]:
        return tuple(e for e in self.edges if e.dst == name)

    def consumers_of(self, name: str) -> tuple[Edge, ...]:
        return tuple(e for e in self.edges if e.src == name)

    def edge(self, name: str) -> Edge:
        return next(e for e in self.edges if e.name == name)

    def topological_order(self) -> tuple[str, ...]:
        order, done = [], set()
        pending = list(self.names)
        while pending:
            ready = [n for n in pending if all(e.src in done for e in self.producers_of(n))]
            if not ready:
                raise ValueError(f"section graph has a cycle among {pending}")
            for n in ready:
                order.append(n)
                done.add(n)
                pending.remove(n)
        return tuple(order)
