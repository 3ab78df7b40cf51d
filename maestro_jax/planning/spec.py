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
from collections.abc import Mapping

from maestro_jax.core.graph import UnitCost
from maestro_jax.core.plan import EdgeInfo, ParamInfo, Plan, device_groups
from maestro_jax.meshes import RULES, mesh_axes_for
from maestro_jax.schedule import Problem
from maestro_jax.schedule.ops import pipeline_bounds


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
class WorkloadSpec:
    name: str
    sections: Mapping[str, SectionSpec]  # in topological order
    edges: tuple[EdgeInfo, ...]
    edge_bytes: Mapping[str, float]  # bytes per producer work unit
    sink: str
    stages: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)  # section -> its pipeline stages

    @property
    def order(self) -> tuple[str, ...]:
        return tuple(self.sections)

    def producers_of(self, name: str) -> tuple[EdgeInfo, ...]:
        return tuple(e for e in self.edges if e.dst == name)

    def consumers_of(self, name: str) -> tuple[EdgeInfo, ...]:
        return tuple(e for e in self.edges if e.src == name)

    def problem(self, plan: Plan, max_in_flight: int, run_ahead: int = 0) -> Problem:
        return Problem(
            order=self.order,
            sink=self.sink,
            trained=frozenset(s for s, spec in self.sections.items() if spec.trained),
            edges=self.edges,
            rows={s: plan.sections[s].rows for s in self.order},
            dp={s: plan.sections[s].dp for s in self.order},
            max_in_flight=max_in_flight,
            groups=device_groups(plan.sections),
            run_ahead=run_ahead,
            bounds=pipeline_bounds(self.stages),
        )
