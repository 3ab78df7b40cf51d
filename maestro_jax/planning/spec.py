"""A workload as planning sees it: plain data taken from the section graph itself.

`WorkloadSpec` holds, per section, whether it is trained, its parameter leaves (shapes and
logical axes, from `jax.eval_shape` of the graph's own `init`) and its declared `UnitCost`;
the edges with their bytes per unit; and the sink. `workloads.describe` makes it from a
graph, so the planner, the cost and memory models and the simulator never keep a second,
hand-written copy of a workload. No JAX here.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping

from maestro_jax.core.buckets import PER_OCTAVE
from maestro_jax.core.graph import UnitCost
from maestro_jax.core.plan import EdgeInfo, ParamInfo, Plan, device_groups
from maestro_jax.core.stages import edge_stage, stage_edge, stage_name
from maestro_jax.meshes import RULES, mesh_axes_for
from maestro_jax.schedule import Problem, SampleMeta
from maestro_jax.schedule.ops import pipeline_bounds
from maestro_jax.schedule.packing import Pack, slots

# the stage counts a section that splits is cut into for planning (`WorkloadSpec.splits`, which
# `workloads.describe` fills): what `plan --stages` may try (`planner.STAGE_COUNTS`, a prefix)
SPLIT_COUNTS = (2, 4, 8, 16)


@dataclasses.dataclass(frozen=True)
class SectionSpec:
    name: str
    trained: bool
    params: tuple[ParamInfo, ...]  # trained (or, in a frozen section, empty)
    cost: UnitCost
    consts: tuple[ParamInfo, ...] = ()  # frozen weights (a KD teacher, a teacher's head in the student)
    precision: str = "float32"  # the config's `sections.<name>.precision` (kept by every candidate plan)

    @property
    def leaves(self) -> tuple[ParamInfo, ...]:
        return self.params + self.consts

    @functools.cached_property
    def has_experts(self) -> bool:
        """Weights with an `expert` axis: the section can use expert parallelism. Cached: the
        planner asks for every layout it tries."""
        return any("expert" in (p.logical or ()) for p in self.leaves)

    @functools.cached_property
    def has_tensor_axes(self) -> bool:
        """Weights with an axis the mesh rules split over `tensor` (heads, MLP width,
        vocabulary): only such a section divides its work by tensor parallelism. Elsewhere (a
        user's module whose weights name no logical axes, or only replicated ones) a tensor
        axis would repeat the same work on every shard, so the planner never offers one."""
        return any("tensor" in mesh_axes_for(lg, RULES["default"]) for p in self.leaves for lg in (p.logical or ()))

    @functools.cached_property
    def param_count(self) -> int:
        return sum(math.prod(p.shape) for p in self.leaves)

    @functools.cached_property
    def expert_param_count(self) -> int:
        """The parameters of the experts' weights, which expert parallelism shards."""
        return sum(math.prod(p.shape) for p in self.leaves if "expert" in (p.logical or ()))

    @functools.cached_property
    def trained_param_count(self) -> int:
        """The trained parameters (`params`): what the gradient reduction and the optimizer move."""
        return sum(math.prod(p.shape) for p in self.params)

    @functools.cached_property
    def trained_expert_param_count(self) -> int:
        """The trained parameters of the experts' weights."""
        return sum(math.prod(p.shape) for p in self.params if "expert" in (p.logical or ()))


@dataclasses.dataclass(frozen=True)
class StagedSection:
    """A section cut into `len(stages)` pipeline stages, as its `Section.stages(k)` cuts it
    (`core.stages.StageSplit`): each stage's `SectionSpec` (its own leaves and declared cost),
    the section's input edges read by a stage other than the first and output edges written by
    one other than the last, and the bytes and positions per unit a stage-to-stage edge carries."""

    stages: tuple[SectionSpec, ...]
    consumes: Mapping[str, int] = dataclasses.field(default_factory=dict)
    produces: Mapping[str, int] = dataclasses.field(default_factory=dict)
    bytes_per_unit: float = 0.0
    positions_per_unit: float = 0.0


@dataclasses.dataclass(frozen=True)
class WorkloadSpec:
    name: str
    sections: Mapping[str, SectionSpec]  # in topological order
    edges: tuple[EdgeInfo, ...]
    edge_bytes: Mapping[str, float]  # bytes per producer work unit
    sink: str
    stages: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)  # section -> its pipeline stages
    # section -> stage count -> the section cut into that many stages: what the planner may stage
    splits: Mapping[str, Mapping[int, StagedSection]] = dataclasses.field(default_factory=dict)
    # section -> how it packs sequences (`sections.<name>.pack`, `schedule.packing`); the rest do not
    pack: Mapping[str, Pack] = dataclasses.field(default_factory=dict)
    # section -> (k, layers) -> the section in k stages of `layers` blocks each (None where it cannot
    # be cut so): the cuts other than `splits`' even ones that the planner tries (`with_cuts`);
    # functions of the graph, so two descriptions of one workload compare equal without them
    stagers: Mapping[str, Callable[[int, tuple[int, ...]], StagedSection | None]] = dataclasses.field(
        default_factory=dict, compare=False
    )
    buckets_per_octave: int = PER_OCTAVE  # the shape buckets the runtime pads to (`compile.buckets_per_octave`)
    # edge -> positions per producer work unit of a rows x positions x features array
    # (`core.graph.Edge.positions_per_unit`); an edge not here declares none
    edge_positions: Mapping[str, float] = dataclasses.field(default_factory=dict)

    @property
    def order(self) -> tuple[str, ...]:
        return tuple(self.sections)

    def producers_of(self, name: str) -> tuple[EdgeInfo, ...]:
        return tuple(e for e in self.edges if e.dst == name)

    def consumers_of(self, name: str) -> tuple[EdgeInfo, ...]:
        return tuple(e for e in self.edges if e.src == name)

    def with_cuts(self, cuts: Mapping[str, tuple[int, ...]]) -> WorkloadSpec | None:
        """This workload with each section of `cuts` (section -> its layers by stage) split so at
        that many stages (`splits[s][len(layers)]`, which `staged` then reads), or None where a
        section cannot be cut so."""
        splits = {s: dict(by_count) for s, by_count in self.splits.items()}
        for s, layers in cuts.items():
            stager = self.stagers.get(s)
            split = stager(len(layers), tuple(layers)) if stager else None
            if split is None:
                return None
            splits.setdefault(s, {})[len(layers)] = split
        return dataclasses.replace(self, splits=splits)

    def staged(self, counts: Mapping[str, int]) -> WorkloadSpec:
        """This workload with each section of `counts` (section -> a stage count of `splits`) in
        its pipeline stages, as `core.stages.stage_graph` cuts the graph: stage i sends to stage
        i + 1 on `stage_edge`, the section's edges read and written by the stages its split
        names (else the first reads, the last writes). Memoized: the planner asks once per plan
        it simulates."""
        key = tuple(sorted((s, k) for s, k in counts.items() if k > 1))
        cache = self.__dict__.setdefault("_staged", {})  # not a field: equality and repr ignore it
        if key not in cache:
            cache[key] = _staged(self, key)
        return cache[key]

    def problem(self, plan: Plan, max_in_flight: int, run_ahead: int = 0, balance_shards: bool = True) -> Problem:
        return Problem(
            order=self.order,
            sink=self.sink,
            trained=frozenset(s for s, spec in self.sections.items() if spec.trained),
            edges=self.edges,
            rows={s: slots(plan.sections[s].rows, self.pack.get(s, 1)) for s in self.order},  # packing: sample slots
            dp={s: plan.sections[s].dp for s in self.order},
            max_in_flight=max_in_flight,
            groups=device_groups(plan.sections),
            run_ahead=run_ahead,
            balance_shards=balance_shards,
            bounds=pipeline_bounds(self.stages),
            pack=self.pack,
        )


def _staged(spec: WorkloadSpec, counts: tuple[tuple[str, int], ...]) -> WorkloadSpec:
    splits = {s: spec.splits[s][k] for s, k in counts if k > 1}
    if not splits:
        return spec
    sections: dict[str, SectionSpec] = {}
    edges, edge_bytes, stages = [], {}, dict(spec.stages)
    positions = dict(spec.edge_positions)
    for name, sec in spec.sections.items():
        split = splits.get(name)
        if split is None:
            sections[name] = sec
            continue
        k = len(split.stages)
        stages[name] = tuple(stage_name(name, i) for i in range(k))
        sections.update((stage_name(name, i), st) for i, st in enumerate(split.stages))
        for i in range(k - 1):
            e = stage_edge(name, i)
            edges.append(EdgeInfo(e, stage_name(name, i), stage_name(name, i + 1)))
            edge_bytes[e] = split.bytes_per_unit
            positions[e] = split.positions_per_unit

    def end(section: str, edge: str, dst: bool) -> str:
        split = splits.get(section)
        if split is None:
            return section
        return edge_stage(section, edge, len(split.stages), split.consumes, split.produces, dst)

    for e in spec.edges:
        edges.append(EdgeInfo(e.name, end(e.src, e.name, False), end(e.dst, e.name, True)))
        edge_bytes[e.name] = spec.edge_bytes[e.name]
    sink = end(spec.sink, "", False)
    pack = {s: p for s, p in spec.pack.items() if s in sections}  # a section in stages does not pack
    staged = WorkloadSpec(spec.name, sections, tuple(edges), edge_bytes, sink, stages, pack=pack)
    # the same shape buckets
    return dataclasses.replace(staged, buckets_per_octave=spec.buckets_per_octave, edge_positions=positions)


def staged_metas(metas, spec: WorkloadSpec) -> list:
    """Planning batches of sample metadata with each staged section's work under every one of
    its stages' names (a stage does its section's work on the same samples)."""
    if not spec.stages:
        return metas

    def expand(m):
        work = {}
        for s, u in m.work.items():
            for n in spec.stages.get(s, (s,)):
                work[n] = u
        return SampleMeta(frozenset(work), work)

    return [[expand(m) for m in batch] for batch in metas]
