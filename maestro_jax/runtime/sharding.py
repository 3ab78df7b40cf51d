"""Section meshes and shardings from plans and logical-axis rules."""

from __future__ import annotations

import contextlib
import functools

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from maestro_jax.core.plan import SectionPlan, position_axes
from maestro_jax.meshes import BATCH_AXES, MESH_AXES, RULES
from maestro_jax.models.layers import activation_rules

# `param_infos` (a boxed abstract tree as `core.plan.ParamInfo` records) is defined beside the
# workloads, which describe themselves with it below the runtime; it stays importable from here for
# the runtime's own callers (`runtime.build`).
from maestro_jax.workloads.params import param_infos  # noqa: F401


def section_mesh(sp: SectionPlan, devices=None) -> Mesh:
    """The section's own mesh over exactly its devices, in config order (Auto axes)."""
    devices = devices if devices is not None else jax.devices()
    grid = np.array([devices[i] for i in sp.devices], dtype=object).reshape(sp.mesh)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


@contextlib.contextmanager
def on_mesh(mesh: Mesh, rules_name: str):
    """Trace and run on a section's mesh: constants land on its devices, and the models'
    activation layouts (`models.layers.constrain`) resolve through its rule set."""
    with jax.set_mesh(mesh), activation_rules(RULES[rules_name]):
        yield


def row_sharding(mesh: Mesh) -> NamedSharding:
    """Batch rows over the data-parallel axes, everything else replicated."""
    return NamedSharding(mesh, P(BATCH_AXES))


@functools.lru_cache(maxsize=4096)  # asked for on every transfer: one object per (mesh, shape)
def edge_sharding(mesh: Mesh, shape: tuple[int, ...]) -> NamedSharding:
    """An edge array's layout on a section's mesh (a producer's output, a consumer's input, their
    cotangents): rows over the data-parallel axes and, for an array laid out rows x positions x
    features, its positions over `POSITION_AXES` as far as they divide (`core.plan.position_axes`).
    The producer's activations already hold their positions split over `context`, so it cuts its
    own slice without a collective; a transfer then moves each device's slice, not whole rows to
    every replica (`runtime.transfer`), and the receiving program gathers the `tensor` slices over
    the node's links. Arrays of another rank keep whole rows."""
    axes = position_axes(dict(mesh.shape), shape[1]) if len(shape) == 3 else ()
    return NamedSharding(mesh, P(BATCH_AXES, axes)) if axes else row_sharding(mesh)


@functools.lru_cache(maxsize=4096)
def rows_by_process(sharding: NamedSharding, rows: int) -> dict[int, frozenset[int]]:
    """{process: the row indices its devices hold} of a `rows`-row batch under `sharding`."""
    out: dict[int, set[int]] = {}
    for device, index in sharding.devices_indices_map((rows,)).items():
        out.setdefault(device.process_index, set()).update(range(rows)[index[0]])
    return {q: frozenset(r) for q, r in out.items()}


def variable_shardings(abstract_boxed, mesh: Mesh, rules_name: str):
    """Shardings of an (unboxed) variable tree from its logical annotations."""
    specs = nn.get_partition_spec(abstract_boxed)
    return nn.logical_to_mesh_sharding(specs, mesh, RULES[rules_name])
