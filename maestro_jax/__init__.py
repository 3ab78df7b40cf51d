"""maestro_jax: compound-workload training on per-section sub-meshes.

The public API (`import maestro_jax as mj`):
  mj.Section, mj.Edge, mj.SectionGraph, mj.UnitCost   describe your workload as a section DAG
  mj.rows                                             row/route helpers for host_batch and forward
  mj.Sample, mj.SampleInfo, mj.Modality               the sample schema (named modalities)
  mj.Config, mj.load_config                           plans and run settings (typed, validated)
  mj.Trainer                                          train / verify / bench / plan / simulate a graph
  mj.Workload, mj.Settings                            register a workload as a config plug-in, its typed settings
Names load on first use, so `maestro_jax.core`, `.schedule` and `.planning` import without JAX.
Architecture: docs/ARCHITECTURE.md.
"""

import importlib

__version__ = "0.3.0"

_EXPORTS = {
    "Section": "maestro_jax.core.graph",
    "Edge": "maestro_jax.core.graph",
    "SectionGraph": "maestro_jax.core.graph",
    "UnitCost": "maestro_jax.core.graph",
    "Sample": "maestro_jax.data.samples",
    "SampleInfo": "maestro_jax.data.samples",
    "Modality": "maestro_jax.data.samples",
    "DataError": "maestro_jax.data.samples",
    "Config": "maestro_jax.config",
    "ConfigError": "maestro_jax.config",
    "load_config": "maestro_jax.config",
    "Settings": "maestro_jax.config",
    "Trainer": "maestro_jax.training.trainer",
    "Workload": "maestro_jax.workloads",
}
__all__ = [*_EXPORTS, "rows"]


def __getattr__(name: str):
    if name == "rows":
        return importlib.import_module("maestro_jax.workloads.rows")
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'maestro_jax' has no attribute {name!r}")
