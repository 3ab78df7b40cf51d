"""maestro_jax: compound-workload training on per-section sub-meshes (see DESIGN.md)."""

__version__ = "0.1.0"
