"""What a planning question is, as one value: the workload, its batches, the devices and their
memory, the cluster's links, and the space the search may choose from. Built once per command
(`tools.plan.problem_for`; `plan`, `simulate`) and changed with `replace`, so that every planner,
baseline and sub-search of one command reads the same settings. Plain Python, no JAX."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from maestro_jax.planning.spec import WorkloadSpec

RESIDUALS = ("vjp", "remat")  # how a trained producer keeps a forward for its backward (`sections.<s>.residuals`)
LAYER_REMAT = ("none", "dots", "full")  # per-layer activation checkpointing (`sections.<s>.layer_remat`)
CONTEXTS = (1, 2, 4, 8)  # context-parallel degrees a section with attention may take


@dataclasses.dataclass(frozen=True)
class PlanningProblem:
    """`spec` on `devices` devices of `memory_gb` each, priced on `metas` (planning batches, each a
    sequence of `SampleMeta`), `global_batch` samples a step, on the cost model's `device` with
    `link_gbps` per device across nodes. The search space: `residuals`, `layer_remat`,
    `contexts`, `stage_counts` (pipeline stage counts a splitting section may also take; none by
    default), the stash bound `max_in_flight`, `run_ahead` of frozen sections and
    `balance_shards`, as the config's `schedule` sets them, and `colocate`: whether sections may
    share devices (False: the disaggregated plans alone, each section on devices of its own)."""

    spec: WorkloadSpec
    metas: tuple
    devices: int
    memory_gb: float
    global_batch: int
    device: str = "h100"
    link_gbps: float = 50.0
    max_in_flight: int = 4
    residuals: tuple[str, ...] = RESIDUALS
    layer_remat: tuple[str, ...] = LAYER_REMAT
    contexts: tuple[int, ...] = CONTEXTS
    run_ahead: int = 0
    balance_shards: bool = True
    stage_counts: tuple[int, ...] = ()
    colocate: bool = True

    def __post_init__(self):
        for name in ("metas", "residuals", "layer_remat", "contexts", "stage_counts"):
            value = getattr(self, name)
            if not isinstance(value, tuple):
                object.__setattr__(self, name, tuple(value))

    @property
    def budget_bytes(self) -> float:
        return self.memory_gb * 2**30

    def replace(self, **changes) -> PlanningProblem:
        """This problem with `changes` (field -> value)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def of(
        cls,
        spec: WorkloadSpec,
        metas: Sequence,
        devices: int,
        memory_gb: float,
        *,
        global_batch: int,
        **settings,
    ) -> PlanningProblem:
        """The problem `Planner`'s 0.3.0 arguments describe (the same names)."""
        return cls(spec, tuple(metas), devices, memory_gb, global_batch, **settings)
