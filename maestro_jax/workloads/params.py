"""A Flax parameter tree as the plain records the planning half reads (`core.plan.ParamInfo`).

`workloads.describe` gives the planner and the simulator each section's leaves from here, and the
runtime (`runtime.build`, through `runtime.sharding.param_infos`) checks the plan's memory and
divisibility with the very same records. It sits with the workloads, below the runtime, so that
describing a workload imports nothing from the runtime.
"""

from __future__ import annotations

import flax.linen as nn
import jax

from maestro_jax.core.plan import ParamInfo


def param_infos(abstract_boxed) -> list[ParamInfo]:
    """Flatten a boxed abstract tree (`jax.eval_shape` of a Flax `init`, logical axis names kept
    in `nn.Partitioned` boxes) into one `ParamInfo` per leaf, in tree order."""
    out = []
    leaves = jax.tree_util.tree_flatten_with_path(abstract_boxed, is_leaf=lambda x: isinstance(x, nn.Partitioned))[0]
    for path, leaf in leaves:
        names = tuple(leaf.names) if isinstance(leaf, nn.Partitioned) else None
        value = leaf.value if isinstance(leaf, nn.Partitioned) else leaf
        out.append(ParamInfo(jax.tree_util.keystr(path), tuple(value.shape), names, value.dtype.itemsize))
    return out
