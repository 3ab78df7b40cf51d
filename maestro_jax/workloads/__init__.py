"""Workloads as plug-ins: each is described once, by a `Workload`, and found by name.

`workload: vlm | kd | omni | vlm_kd` names a built-in module of this package; any other value
is an import path `package.module:NAME` to a user's `Workload`. The workload builds the section
graph from the config (its sections, edges, models, declared costs); the same graph serves the
runtime, the planner, the simulator, the data checks and `verify`/`bench`.

A workload may bring its own typed settings (`Workload.settings`, read from the config's
`workload_settings:` block), model kinds of its own (`Workload.model_kinds`, for `models:`
entries of those kinds) and its own sample source (`Workload.source`, for `data.kind: workload`);
they are validated like every other key of the config, before anything is built (`check_config`).

This module turns a config into what those users take from its workload: the graph checked
against the config's sections (`build_graph`), the sample source and the sample checks
(`source_from_config`, `sample_check`, `info_check`), and the planning view (`describe`,
`planning_batches`). Workloads sit below the runtime: they import the models, the data schema,
the config and the planning half, never the runtime, training or tools (`tests/test_layering.py`);
the runtime imports them.

One concern a module, each name importable from here as before: `registry` (`Workload`,
`resolve`), `checks` (`check_config`, `settings`, `modalities_of`), `model_configs` (`model`), `graphs`
(`build_graph`, `with_stages`, `packing`, `check_sections`), `sources` (`source_from_config`,
`sample_check`, `info_check`, `mean_item_units`) and `planning_view` (`describe`,
`planning_batches`).
"""

from maestro_jax.workloads.checks import check_config, modalities_of, settings
from maestro_jax.workloads.graphs import build_graph, check_sections, packing, with_stages
from maestro_jax.workloads.model_configs import _said_grouped_fallback, model  # noqa: F401 - its old home
from maestro_jax.workloads.planning_view import describe, planning_batches
from maestro_jax.workloads.registry import BUILTIN, Workload, resolve
from maestro_jax.workloads.sources import info_check, mean_item_units, sample_check, source_from_config

__all__ = [
    "BUILTIN",
    "Workload",
    "build_graph",
    "check_config",
    "check_sections",
    "describe",
    "info_check",
    "mean_item_units",
    "modalities_of",
    "model",
    "packing",
    "planning_batches",
    "resolve",
    "sample_check",
    "settings",
    "source_from_config",
    "with_stages",
]
