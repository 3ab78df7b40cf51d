"""Mesh presets and logical-axis rules: data, not code.

Every section mesh has the same three named axes, `data`, `fsdp` and `tensor` (size 1 when
unused), so one rule set maps the models' logical axes onto any section's mesh. A section's
data-parallel degree is `data * fsdp`: the batch is sharded over both.
"""

MESH_AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")

RULES: dict[str, tuple[tuple[str, str | tuple[str, ...] | None], ...]] = {
    # Megatron-style tensor parallelism + ZeRO-3 style fsdp over the embedding dimension.
    "default": (
        ("batch", BATCH_AXES),
        ("vocab", "tensor"),
        ("embed", "fsdp"),
        ("mlp", "tensor"),
        ("heads", "tensor"),
        ("kv_heads", "tensor"),
        ("expert", None),  # experts replicated over the section mesh (no expert axis yet)
        ("head_dim", None),
        ("norm", None),
        ("patch", None),
        ("grid", None),
    ),
    # Everything replicated: pure data parallelism whatever the mesh says.
    "replicated": (("batch", BATCH_AXES),),
}


def mesh_axes_for(logical: str | None, rules) -> tuple[str, ...]:
    """The mesh axes a logical axis maps to under `rules` (empty: replicated)."""
    for name, axes in rules:
        if name == logical:
            if axes is None:
                return ()
            return (axes,) if isinstance(axes, str) else tuple(axes)
    return ()
