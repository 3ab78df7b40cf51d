"""Section graph: the workload cut into coarse sections joined by edges.

Plain Python (no JAX import): a `Section` holds callables that the section programs jit,
host-side functions that the scheduler and batcher call on samples (or their `SampleInfo`),
and its declared cost per work unit, which the simulator, cost and memory models read. The
graph is the one description of a workload: runtime, planner and simulator all read it.

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


class GraphError(ValueError):
    """A section callback that breaks its contract; the message names the section and the sample."""


def sample_view(x: SampleLike) -> SampleLike:
    """What `activates` and `work` receive on every path: the sample's `SampleInfo` (`length`,
    `shapes(modality)`, `has(modality)`). The scheduler of a training run holds only metadata,
    so a callback that read more (the items, the tokens) would pass `verify`, which holds whole
    samples, and fail in `train`; given the same type everywhere, it fails in both, named."""
    info = getattr(x, "info", None)
    return info() if callable(info) else x


def ask(section: Section, callback: str, info: SampleLike):
    """`section.<callback>(info)` (`activates` or `work`), a failure named as a `GraphError`."""
    try:
        return getattr(section, callback)(info)
    except (AttributeError, KeyError, TypeError, IndexError) as err:
        raise GraphError(
            f"error: section {section.name!r}: {callback}(sample) failed on sample id={getattr(info, 'id', '?')} "
            f"({type(err).__name__}: {err}); it receives the sample's SampleInfo on every path: read "
            f"sample.length, sample.shapes(modality) or sample.has(modality)"
        ) from None


@dataclasses.dataclass(frozen=True)
class Edge:
    """A named tensor `src` produces for `dst`, laid out `rows x ...` (row-major on batch).

    `bytes_per_unit`: bytes it carries per work unit of the producer (prices the transfer).
    `positions_per_unit`: for an array laid out rows x positions x features (tokens, patches or
    frames) whose consumer takes whole rows of the micro-steps it is sent (`mj.rows.gather`), the
    positions per work unit of the producer (a decoder's pipeline stage sends one a token: 1.0).
    The runtime splits every such array's positions over the meshes' context and tensor axes
    where they divide (`runtime.sharding.edge_sharding`); the planner credits that split only to
    an edge that declares it (0: none declared, whole rows priced, as for an image edge whose
    consumer picks single positions and so gathers them whole)."""

    name: str
    src: str
    dst: str
    bytes_per_unit: float = 0.0
    positions_per_unit: float = 0.0


# the kinds of layer the cost model prices at rates of their own (`UnitCost.rate_kind`)
RATE_KINDS = ("decoder", "decoder_moe", "vit")


@dataclasses.dataclass(frozen=True)
class UnitCost:
    """What one work unit (token, patch, frame) of a section costs, declared by whoever writes
    the section, so that planning needs no second description of the model.

    flops: forward FLOPs per unit outside attention (a weight costs 2 per unit).
    attention_flops: forward FLOPs per unit per unit of attention context; the context is the
      sample's whole work in the section, or `attention_span` units when attention runs within
      fixed windows (a ViT within each image). Causal attention declares half.
    width: the model width; narrow matmuls (heavily tensor-sharded) run below peak.
    layer_bytes, layer_bytes_sharded, layers: activation bytes one layer keeps per unit for its
      backward at float32 (the part replicated across tensor shards, the part split by them; a
      bfloat16 section keeps half) and the
      number of layers: the memory model's working set and stashed residuals.
    logits: the vocabulary width of the loss (the sink's logits and their gradient).
    kv_width: key and value features one unit adds per layer (2 x kv_heads x head_dim): what
      context parallelism gathers per layer (0: no attention to split).
    routed_width: features each unit sends to each of its experts per mixture-of-experts layer
      (experts_per_token x width; 0 for dense layers): what expert parallelism exchanges.
    rate_kind: the kind of layer the FLOPs run in, which sets the rate the analytic cost model
      prices them at (`planning.cost.KIND_RATE`, each kind's measured rate beside the dense
      decoder's): `decoder` (a dense decoder; also any layer no GPU row has measured, priced by
      the dense curve), `decoder_moe` (a mixture-of-experts decoder) or `vit` (a vision tower's block).
    """

    flops: float
    attention_flops: float = 0.0
    attention_span: float | None = None
    width: int = 1024
    layer_bytes: float = 0.0
    layer_bytes_sharded: float = 0.0
    layers: int = 0
    logits: int = 0
    kv_width: int = 0
    routed_width: int = 0
    rate_kind: str = "decoder"

    def __post_init__(self):
        if self.rate_kind not in RATE_KINDS:
            raise GraphError(f"error: UnitCost.rate_kind={self.rate_kind!r}: unknown; valid: {', '.join(RATE_KINDS)}")

    def forward_flops(self, units: float) -> float:
        """Forward FLOPs of a sample's `units` units: the per-unit work plus attention over the
        sample's units (or the `attention_span` window)."""
        span = self.attention_span if self.attention_span is not None else units
        return (self.flops + self.attention_flops * span) * units


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
    activates and work receive a `Sample` or its `SampleInfo` (length and item shapes only).
    cost: what a work unit costs (`UnitCost`), for the simulator, planner and memory model.
    packed_batch(rows, routes, shards, pack): `host_batch` with sequence packing, or None for
      a section that does not pack. `rows` are then sample slots (shard-major over `shards` data
      shards) and the arrays have the rows `schedule.packing.pack_rows` lays them into under
      `pack` (P slots a row, or a `TokenBudget` of tokens a row); `forward` takes
      either layout, and its outputs on every edge keep one row per slot (the row contract).
      The runtime calls it where `sections.<name>.pack` is not 1; the monolithic step never does.
    stages(k, layers=None): the section cut into `k` pipeline stages (a `core.stages.StageSplit`),
      or None for a section that does not split; `sections.<name>.stages` > 1 calls it
      (`core.stages`). `layers`, where the function takes it, is each stage's layer count (a cut
      of `sections.<name>.stage_layers` or the planner's); a section whose `stages` takes only `k`
      is always cut its own way, and a config that gives it a cut is refused.
    reads: the sample parts `host_batch` reads (`"tokens"`, modality names; None: all). A
      process decodes a part of a sample only where some section that reads it holds a row of
      that sample on the process's devices.
    """

    name: str
    trained: bool
    forward: Callable[..., Any]
    host_batch: Callable[[Sequence[SampleLike | None], Mapping[str, Any]], dict[str, Any]]
    activates: Callable[[SampleLike], bool]
    work: Callable[[SampleLike], int]
    cost: UnitCost = UnitCost(flops=0.0)
    reads: tuple[str, ...] | None = None
    packed_batch: Callable[[Sequence[SampleLike | None], Mapping[str, Any], int, Any], dict[str, Any]] | None = None
    stages: Callable[[int], Any] | None = None


@dataclasses.dataclass(frozen=True)
class SectionGraph:
    """A DAG of sections with one sink (the section that holds the loss).

    init(key) -> {section: {"params": ..., "consts": ...}} with logically partitioned leaves;
    the runtime evaluates it once per section, under that section's sharding.
    loss_count(samples) -> the global-batch normaliser of the sink's `loss_sum`: a sum over
      samples (processes count disjoint subsets and add them up).
    staging: for a graph with pipeline stages (`core.stages.stage_graph`), a `core.stages.Staging`:
      the unstaged graph and each staged section's split (what saving a section as one needs).
    """

    sections: tuple[Section, ...]
    edges: tuple[Edge, ...]
    init: Callable[[Any], dict[str, dict[str, Any]]]
    loss_count: Callable[[Sequence[SampleLike]], int]
    staging: Any = None

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
        trained = {s.name for s in self.sections if s.trained}
        for s in self.sections:
            if s.name not in trained and any(e.src in trained for e in self.producers_of(s.name)):
                raise ValueError(
                    f"section {s.name!r} is frozen but consumes the trained section(s) "
                    f"{sorted(e.src for e in self.producers_of(s.name) if e.src in trained)}: gradients "
                    f"cannot reach them through it; make {s.name!r} trained or merge it into its consumer"
                )
        if self.sink not in trained:
            raise ValueError(f"the sink {self.sink!r} holds the loss and must be trained")

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
