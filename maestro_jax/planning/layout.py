"""What a layout of a section holds and which layouts there are: shared by the planner
(`planner.Planner`) and the pipelined baseline (`pipeline.pipelined_best`), so that neither
imports the other and both price memory and enumerate meshes by one rule.

Memory per device (`section_memory`): params, plus grads and two Adam moments for trained
sections, all float32 and sharded by the mesh rules; frozen weights once (bfloat16 sections: frozen
weights, activations and a compute copy of trained weights in bf16); activations of one
micro-step (a packing section's: of its packed rows); and, for a trained producer, the residuals
stashed for up to `schedule.max_in_flight` micro-steps waiting for their backward (only the
inputs under `residuals: remat`); the sink's logits and their gradient.

Which layouts: the divisors of a device count, the micro-batches worth trying for a number of
data shards (`micro_batches`), and the (tensor, context, expert) degrees a section can use on
n devices (`mesh_degrees`: never a degree the section has no axis for).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator, Sequence

from maestro_jax.core.buckets import PER_OCTAVE, bucket
from maestro_jax.core.plan import (
    ParamInfo,
    Plan,
    SectionPlan,
    device_groups,
    group_bytes,
    state_bytes_per_device,
)
from maestro_jax.meshes import MESH_AXES, RULES, mesh_axes_for
from maestro_jax.planning.cost import ACTIVATION_BYTES, NODE_DEVICES, WEIGHT_BYTES
from maestro_jax.planning.spec import SectionSpec
from maestro_jax.schedule.packing import Pack, row_shape

F32 = 4


def section_memory(
    sec: SectionSpec,
    sp: SectionPlan,
    is_sink: bool,
    max_units: int,
    max_in_flight: int,
    weights: tuple[float, float] | None = None,
    pack: Pack = 1,
    per_octave: int = PER_OCTAVE,
) -> dict[str, float]:
    """Per-device bytes of a section under a plan (see the module docstring). Under bfloat16
    (`runtime.precision`) activations and frozen weights take half their float32 bytes, and a
    trained section adds the bf16 copy of its weights its forward computes with; under fp8 (frozen
    sections) activations take half, the weights a quarter (`cost.WEIGHT_BYTES`). `layer_remat`
    shrinks what each layer keeps for its backward; context parallelism splits every
    activation's positions, expert parallelism the experts' weights (through the mesh rules).
    `weights`: the per-device float32 bytes of the trained and the frozen weights under `sp`'s
    mesh, when the caller has them already (`Planner` computes them once per mesh). A section that
    packs sequences (`pack`) holds its packed rows (`schedule.packing.row_shape` at `max_units`,
    the largest sample, as unpacked rows are sized by it), padded to its shape bucket at
    `per_octave` buckets an octave (the `WorkloadSpec`'s `buckets_per_octave`)."""
    half = ACTIVATION_BYTES[sp.precision] / F32
    stored = WEIGHT_BYTES[sp.precision] / F32  # frozen weights, as stored
    if weights is None:
        weights = state_bytes_per_device(sec.params, sp, False), state_bytes_per_device(sec.consts, sp, False)
    params, consts = weights
    state = params * (4 if sec.trained else stored) + consts * stored
    if sec.trained and half < 1:
        state += params * half
    c, tensor = sec.cost, sp.axis_sizes["tensor"]
    per_layer = half * (c.layer_bytes + c.layer_bytes_sharded / tensor)  # what one block keeps per unit for its vjp
    working = 2 * per_layer
    # what each layer keeps for its backward under `layer_remat`: everything; only its input;
    # or its input plus the weight-matmul outputs (about half the replicated activations)
    kept = {
        "none": per_layer,
        "full": half * c.width * F32,
        "dots": half * (c.layer_bytes / 2 + c.layer_bytes_sharded / tensor),
    }[sp.layer_remat]

    rows, length = row_shape(sp.micro_batch, max_units, pack)
    rows_units = rows * bucket(int(length), 16, per_octave) / sp.axis_sizes["context"]  # positions split by context
    act = rows_units * working
    held = 0.0  # what outlives the section's own programs: residuals stashed for later backwards
    if sec.trained and not is_sink:  # each forward in flight keeps its residuals (its input under remat)
        held = max_in_flight * rows_units * (kept * c.layers if sp.residuals == "vjp" else c.width * F32 * half)
        act += held
    if is_sink:  # forward and backward in one program: its residuals, logits and their gradient
        act += rows_units * (kept * c.layers + c.logits / tensor * F32 * 2)
    return {"state": state, "activations": act, "held": held, "total": state + act}


class ShardedLeaves:
    """A section's parameter leaves reduced to what a mesh changes about them, so that checking
    a mesh costs a few steps per group of mesh axes rather than a pass over every leaf (the
    paper-scale LLM has hundreds of leaves, and a search at a thousand devices tries tens of
    thousands of meshes). The answer depends only on the shard counts of the axis groups the
    leaves are sharded over (fsdp, tensor, expert; not data or context), so it is computed once
    per distinct set of counts. Gives the same answers as `check_param_divisibility` and
    `state_bytes_per_device`: a mesh divides a dimension of every leaf exactly when it divides
    their gcd, and the bytes are summed leaf by leaf in the same order, so the floats are equal."""

    def __init__(self, leaves: Sequence[ParamInfo], rules: str = "default"):
        axes = {lg: mesh_axes_for(lg, RULES[rules]) for info in leaves for lg in (info.logical or ())}
        self._groups = tuple(dict.fromkeys(axes.values()))  # distinct tuples of mesh axes a dimension is split over
        group = {lg: self._groups.index(a) for lg, a in axes.items()}
        gcds = [0] * len(self._groups)  # by group: the gcd of every dimension split over it
        for info in leaves:
            for dim, lg in zip(info.shape, info.logical or ()):
                gcds[group[lg]] = math.gcd(gcds[group[lg]], dim)
        self._gcds = tuple(gcds)
        self._layouts = tuple(dict.fromkeys(tuple(group[lg] for lg in info.logical or ()) for info in leaves))
        index = {layout: i for i, layout in enumerate(self._layouts)}
        self._bytes = tuple(
            (math.prod(info.shape) * info.itemsize, index[tuple(group[lg] for lg in info.logical or ())])
            for info in leaves
        )
        self._by_shards: dict[tuple[int, ...], float | None] = {}

    def per_device(self, mesh: tuple[int, ...]) -> float | None:
        """Bytes per device of the leaves sharded over `mesh`, or None when the mesh does not
        divide a sharded dimension."""
        sizes = dict(zip(MESH_AXES, mesh))
        shards = tuple(math.prod(sizes[a] for a in axes) for axes in self._groups)
        if shards not in self._by_shards:
            if any(g % n for g, n in zip(self._gcds, shards)):
                self._by_shards[shards] = None
            else:
                by_layout = [math.prod(shards[g] for g in layout) for layout in self._layouts]
                self._by_shards[shards] = sum(n / by_layout[i] for n, i in self._bytes)
        return self._by_shards[shards]


def group_memory(members: Sequence[dict[str, float]]) -> float:
    """Bytes per device of co-located sections, from each one's `section_memory`."""
    return group_bytes([m["state"] for m in members], [m["activations"] for m in members], [m["held"] for m in members])


def peak_memory(plan: Plan, memory: dict[str, dict[str, float]]) -> float:
    """Bytes per device of the fullest device group."""
    groups = device_groups(plan.sections)
    return max(group_memory([memory[s] for s in memory if groups[s] == g]) for g in set(groups.values()))


@functools.cache
def divisors(n: int) -> tuple[int, ...]:
    """Cached: a search asks for the divisors of every device count many times over."""
    return tuple(d for d in range(1, n + 1) if n % d == 0)


@functools.cache
def micro_batches(global_batch: int, dp: int) -> tuple[int, ...]:
    """The micro-batches worth trying for `dp` data shards: for each number of micro-steps k the
    batch could take, the smallest micro-batch that takes k (any larger one with k steps only
    pads more; the last micro-step is padded when it is not full). None when a shard would get
    no sample."""
    per_shard = -(-global_batch // dp)
    if global_batch < dp:
        return ()
    return tuple(sorted({-(-per_shard // k) for k in range(1, per_shard + 1)}))


def mesh_degrees(sec: SectionSpec, n: int, contexts: Sequence[int]) -> Iterator[tuple[int, int, int]]:
    """(tensor, context, expert) degrees on `n` devices: tensor parallelism within a node
    (`NODE_DEVICES`: the cost model prices its all-reduces only there, through the
    calibrated efficiency) for sections whose weights have tensor-sharded axes
    (`SectionSpec.has_tensor_axes`); context parallelism in the powers of two `contexts`
    allows (`contexts`, the planner's), for sections with attention; expert parallelism over any divisor of the
    data-parallel devices, for sections with experts (elsewhere an expert axis is plain data
    parallelism)."""
    for tensor in (t for t in divisors(n) if t <= NODE_DEVICES) if sec.has_tensor_axes else (1,):
        for context in (c for c in contexts if (n // tensor) % c == 0 and (c == 1 or sec.cost.kv_width)):
            dp = n // (tensor * context)
            for expert in divisors(dp) if sec.has_experts else (1,):
                yield tensor, context, expert
