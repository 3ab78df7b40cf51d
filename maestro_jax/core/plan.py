"""Plans and their constraints (docs/ARCHITECTURE.md, "Constraints"), checked before any compute.

Plain Python, no JAX: the runtime hands in parameter shapes from `jax.eval_shape`, so every
check runs before a single program is compiled. Each violation raises its own `PlanError`
subclass whose message names the config key, the value and what would be valid.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence

from maestro_jax.meshes import BATCH_AXES, MESH_AXES, POSITION_AXES, RULES, mesh_axes_for


class PlanError(ValueError):
    """A plan that breaks a constraint; `key` is the dotted config key at fault."""

    def __init__(self, key: str, value, problem: str):
        self.key, self.value, self.problem = key, value, problem
        super().__init__(f"{key}={value!r}: {problem}")


class ResourceError(PlanError):
    pass


class MeshShapeError(PlanError):
    pass


class FanoutError(PlanError):
    pass


class DivisibilityError(PlanError):
    pass


class MemoryBudgetError(PlanError):
    pass


def mesh_shape(**sizes: int) -> tuple[int, ...]:
    """Mesh sizes in `MESH_AXES` order from sizes by axis name (the rest 1)."""
    unknown = set(sizes) - set(MESH_AXES)
    if unknown:
        raise ValueError(f"unknown mesh axes {sorted(unknown)}; valid: {MESH_AXES}")
    return tuple(sizes.get(a, 1) for a in MESH_AXES)


@dataclasses.dataclass(frozen=True)
class SectionPlan:
    """Where and how one section runs: its devices, mesh, micro-batch, residual policy and
    precision."""

    devices: tuple[int, ...]
    mesh: tuple[int, ...]  # sizes of MESH_AXES
    micro_batch: int  # rows per data-parallel shard per micro-step
    residuals: str = "vjp"  # "vjp": keep vjp residuals until backward; "remat": recompute
    rules: str = "default"
    precision: str = "float32"  # "bfloat16": bf16 compute and activations (float32 master weights)
    layer_remat: str = "none"  # per-layer activation checkpointing: "none" | "full" | "dots"

    @functools.cached_property
    def axis_sizes(self) -> dict[str, int]:
        """Cached (as `dp` and `rows`): the planner reads them for every layout it tries. Read only."""
        return dict(zip(MESH_AXES, self.mesh))

    @functools.cached_property
    def dp(self) -> int:
        return math.prod(self.axis_sizes[a] for a in BATCH_AXES)

    @functools.cached_property
    def rows(self) -> int:
        return self.dp * self.micro_batch

    def position_shards(self, positions: int) -> int:
        """Into how many slices this section's mesh splits an edge array of `positions` positions
        (`position_axes`)."""
        return math.prod(self.axis_sizes[a] for a in position_axes(self.axis_sizes, positions))


def position_axes(sizes: Mapping[str, int], positions: int) -> tuple[str, ...]:
    """The mesh axes (sizes by name) an edge array's `positions` are split over: `POSITION_AXES`
    in turn while the product of their sizes divides `positions`; axes of size 1 (or absent)
    left out."""
    axes, n = [], 1
    for a in POSITION_AXES:
        size = sizes.get(a, 1)
        if size == 1:
            continue
        if positions % (n * size):
            break
        axes.append(a)
        n *= size
    return tuple(axes)


@dataclasses.dataclass(frozen=True)
class Plan:
    sections: Mapping[str, SectionPlan]
    fanout: Mapping[str, int]  # edge name -> fanout
    global_batch: int


@dataclasses.dataclass(frozen=True)
class ParamInfo:
    """One parameter leaf as the constraint checks see it."""

    path: str
    shape: tuple[int, ...]
    logical: tuple[str | None, ...] | None
    itemsize: int


@dataclasses.dataclass(frozen=True)
class EdgeInfo:
    name: str
    src: str
    dst: str


def device_groups(sections: Mapping[str, SectionPlan]) -> dict[str, str]:
    """Section -> the name of its device group: the first section (in plan order) on the same
    device set. Co-located sections share one group; they run one after another on its devices,
    which the simulator and the scheduler treat as one resource and the memory check as one budget."""
    first: dict[frozenset[int], str] = {}
    return {name: first.setdefault(frozenset(sp.devices), name) for name, sp in sections.items()}


def devices_value(devices: Sequence[int]) -> list[int] | str:
    """Devices as an error line names them: a long consecutive run as the config's range
    ("0:512"), so a line stays one readable line on thousands of devices; else the list."""
    devices = list(devices)
    if len(devices) > 8 and devices == list(range(devices[0], devices[0] + len(devices))):
        return f"{devices[0]}:{devices[-1] + 1}"
    return devices


def check_resources(plan: Plan, num_devices: int) -> None:
    """Device ids exist; two sections either share exactly the same devices (co-located: each
    keeps its own mesh, micro-batch and precision) or none. A partial overlap is refused: the
    shared devices would serve two groups whose programs the runtime could not order as one."""
    owner: dict[int, str] = {}
    for name, sp in plan.sections.items():
        key = f"sections.{name}.devices"
        if not sp.devices:
            raise ResourceError(key, list(sp.devices), "a section needs at least one device")
        if len(set(sp.devices)) != len(sp.devices):
            raise ResourceError(key, list(sp.devices), "each device may appear once")
        for d in sp.devices:
            if not 0 <= d < num_devices:
                raise ResourceError(
                    key,
                    devices_value(sp.devices),
                    f"device {d} does not exist; valid device ids are 0..{num_devices - 1}",
                )
        for d in sp.devices:
            other = owner.get(d)
            if other is not None and set(plan.sections[other].devices) != set(sp.devices):
                raise ResourceError(
                    key,
                    devices_value(sp.devices),
                    f"device {d} is also used by section {other!r} on "
                    f"{devices_value(plan.sections[other].devices)}; sections share either exactly the same "
                    f"devices (co-located) or none",
                )
            owner.setdefault(d, name)


def check_meshes(plan: Plan) -> None:
    for name, sp in plan.sections.items():
        if len(sp.mesh) != len(MESH_AXES):
            raise MeshShapeError(f"sections.{name}.mesh", sp.mesh, f"needs one size per mesh axis {MESH_AXES}")
        size = math.prod(sp.mesh)
        if size != len(sp.devices):
            shape = " * ".join(f"{a}={n}" for a, n in zip(MESH_AXES, sp.mesh))
            raise MeshShapeError(
                f"sections.{name}.mesh",
                sp.axis_sizes,
                f"{shape} = {size} but the section has {len(sp.devices)} devices; "
                f"the mesh axes must multiply to the device count",
            )
        if sp.rules not in RULES:
            raise MeshShapeError(f"sections.{name}.rules", sp.rules, f"valid rule sets are {sorted(RULES)}")
        if sp.residuals not in ("vjp", "remat"):
            raise MeshShapeError(f"sections.{name}.residuals", sp.residuals, "valid values are 'vjp' and 'remat'")


def check_fanout(plan: Plan, edges: Sequence[EdgeInfo]) -> None:
    """An edge joins any data-parallel degrees (fan-out 2 -> 6, fan-in 6 -> 2, uneven 3 -> 4): a
    consumer shard receives the rows of every producer shard whose share of the batch overlaps
    its own (docs/ARCHITECTURE.md, "Terms"), so nothing about an edge must divide. A fanout the
    config still declares (`edges.<name>.fanout`) is derived, DP(consumer) / DP(producer): one
    that does not match the plan is refused, never ignored."""
    for e in edges:
        f = plan.fanout.get(e.name)
        if f is None:
            continue
        p, c = plan.sections[e.src], plan.sections[e.dst]
        if p.dp * f != c.dp:
            valid = (
                f"fanout {c.dp // p.dp}, or no fanout key"
                if c.dp % p.dp == 0
                else f"no fanout key (DP {p.dp} -> {c.dp} is an uneven edge, which needs none: edges join any "
                f"data-parallel degrees)"
            )
            raise FanoutError(
                f"edges.{e.name}.fanout",
                f,
                f"the fanout is derived, DP({e.dst})={c.dp} / DP({e.src})={p.dp}; valid: {valid}",
            )


def check_divisibility(plan: Plan, params: Mapping[str, Sequence[ParamInfo]]) -> None:
    """Every section's sharded parameters divide by its mesh. The global batch need not divide
    by any section's rows: a last micro-step that is not full is padded, and padded rows are
    masked out of the loss (they carry no tokens to count)."""
    for name, infos in params.items():
        check_param_divisibility(name, plan.sections[name], infos)


def check_param_divisibility(name: str, sp: SectionPlan, infos: Sequence[ParamInfo]) -> None:
    """Every sharded parameter dimension divides by the mesh axes it is sharded over."""
    rules, sizes = RULES[sp.rules], sp.axis_sizes
    for info in infos:
        for dim, logical in zip(info.shape, info.logical or ()):
            axes = mesh_axes_for(logical, rules)
            n = math.prod(sizes[a] for a in axes)
            if dim % n:
                raise DivisibilityError(
                    f"sections.{name}.mesh",
                    sizes,
                    f"parameter {info.path} dimension {logical!r} of size {dim} is sharded "
                    f"over {'*'.join(axes)}={n}, which does not divide it; use mesh sizes "
                    f"that divide {dim}",
                )


def sharded_bytes(info: ParamInfo, sp: SectionPlan) -> float:
    rules, sizes = RULES[sp.rules], sp.axis_sizes
    shards = math.prod(math.prod(sizes[a] for a in mesh_axes_for(lg, rules)) for lg in (info.logical or ()))
    return math.prod(info.shape) * info.itemsize / shards


def state_bytes_per_device(infos: Sequence[ParamInfo], sp: SectionPlan, trained: bool) -> float:
    """Params, plus grads and two Adam moments when trained, per device."""
    base = sum(sharded_bytes(i, sp) for i in infos)
    return base * (4 if trained else 1)


def group_bytes(state: Sequence[float], activations: Sequence[float], held: Sequence[float]) -> float:
    """Bytes per device of the sections on one device set: every state and every stash (`held`:
    the part of a section's activations that outlives its programs, residuals waiting for a
    backward) at once, but one program's working activations at a time, since co-located
    sections run one after another."""
    return sum(state) + sum(held) + max(a - h for a, h in zip(activations, held))


def check_memory(
    plan: Plan,
    budget_bytes: float | None,
    state: Mapping[str, float],
    activations: Mapping[str, float],
    held: Mapping[str, float] | None = None,
) -> None:
    """`state`/`activations`: per-device bytes of persistent state and of in-flight activations
    (of which `held` outlive the section's programs). Co-located sections share the budget."""
    if budget_bytes is None:
        return
    groups, held = device_groups(plan.sections), held or {}
    for group in dict.fromkeys(groups.values()):
        shared = [n for n, g in groups.items() if g == group]
        need = group_bytes(
            [state[n] for n in shared], [activations.get(n, 0.0) for n in shared], [held.get(n, 0.0) for n in shared]
        )
        if need > budget_bytes:
            what = f"sections.{group}" if len(shared) == 1 else f"sections.{{{','.join(shared)}}} (co-located)"
            raise MemoryBudgetError(
                what,
                f"{need / 2**30:.3f} GiB/device",
                f"exceeds device_memory_gb={budget_bytes / 2**30:g}; give the section more "
                f"devices, more fsdp/tensor sharding or a smaller micro_batch",
            )


def check_plan(
    plan: Plan,
    *,
    num_devices: int,
    edges: Sequence[EdgeInfo],
    sink: str,
    params: Mapping[str, Sequence[ParamInfo]],
    budget_bytes: float | None = None,
    state: Mapping[str, float] | None = None,
    activations: Mapping[str, float] | None = None,
    held: Mapping[str, float] | None = None,
) -> None:
    """Every constraint of a plan, cheapest first; raises the first violation."""
    check_resources(plan, num_devices)
    check_meshes(plan)
    check_fanout(plan, edges)
    check_divisibility(plan, params)
    check_memory(plan, budget_bytes, state or {}, activations or {}, held)
