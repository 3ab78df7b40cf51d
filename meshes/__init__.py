"""Mesh presets and logical-axis rules: data, not code.

Every section mesh has the same five named axes (size 1 when unused), so one rule set maps
the models' logical axes onto any section's mesh:

  data     pure data parallelism (weights replicated);
  fsdp     data parallelism with weights sharded over their embedding dimension (ZeRO-3);
  expert   data parallelism for attention and dense layers, mixture-of-experts weights sharded
           by expert: each device group holds `experts / expert` experts and tokens reach them
           through collectives the compiler inserts;
  context  the sequence of every activation sharded (context parallelism): attention passes
           keys and values round the axis (or gathers them), everything else runs on its
           slice of positions;
  tensor   Megatron-style tensor parallelism over heads, MLP width and vocabulary.

A section's data-parallel degree is `data * fsdp * expert`: the batch is sharded over all three.
The order puts `tensor` innermost, where consecutive devices (one node's NVLink) sit.
"""

MESH_AXES = ("data", "fsdp", "expert", "context", "tensor")
BATCH_AXES = ("data", "fsdp", "expert")
# An edge array laid out rows x positions x features (tokens, patches or frames, each a feature
# vector) has its positions split over these axes, in this order, as far as their sizes' product
# divides the positions (`core.plan.position_axes`): each device then sends and receives only its
# own slice, as Megatron-LM's stage-to-stage sends do under context and sequence parallelism
# (their shape is seq / (tp x cp) x micro_batch x hidden), and the receiving program gathers the
# `tensor` slices over the node's own links.
POSITION_AXES = ("context", "tensor")

RULES: dict[str, tuple[tuple[str, str | tuple[str, ...] | None], ...]] = {
    # Megatron-style tensor parallelism + ZeRO-3 style fsdp over the embedding dimension.
    "default": (
        ("batch", BATCH_AXES),
        ("expert_batch", ("data", "fsdp")),  # tokens gathered over `expert` for the experts
        ("vocab", "tensor"),
        ("embed", "fsdp"),
        ("mlp", "tensor"),
        ("heads", "tensor"),
        ("kv_heads", "tensor"),
        ("expert", "expert"),
        ("length", "context"),  # activations' sequence (tokens, patches, frames)
        ("head_dim", None),
        ("norm", None),
        ("patch", None),
        ("grid", None),
        ("layers", None),  # the stacked-layer axis of scanned models (models.layers.layer_stack)
        ("act_embed", None),  # activations' feature dimension: whole on every device
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
