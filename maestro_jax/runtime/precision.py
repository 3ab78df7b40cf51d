"""Mixed precision, chosen per section (`sections.<name>.precision`).

`bfloat16` runs a section's forward and backward in bfloat16: a trained section keeps float32
master weights and float32 optimizer state, and its forward casts them (and its inputs) to
bfloat16, so gradients arrive in float32 through the cast; a frozen section (a KD teacher)
stores its weights in bfloat16 only. Losses and softmaxes stay float32 (the workloads' losses
cast logits up). Edge tensors leave a bfloat16 section in bfloat16: half the transfer bytes.

`fp8` (frozen sections only: `workloads.check_sections`) is bfloat16 with the weight matmuls in float8
e4m3: each Dense kernel of the section's consts is stored as `models.fp8.Fp8Weight` (e4m3
values and a float32 per-tensor scale, made once here at init, or by the loader from a
checkpoint), a quarter of its float32 bytes, and the models' Dense layers multiply it e4m3 x
e4m3 with float32 accumulation, each input row quantized with its own scale (`models.fp8`).
The other weights (embeddings, norms, a MoE's experts) and every other op stay bfloat16, as do
the section's edge tensors.

The policy wraps the graph itself (`with_precision`), so the maestro programs and the
monolithic baseline run the very same casts and stay comparable op for op.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp

from maestro_jax.core.graph import Section, SectionGraph
from maestro_jax.models.fp8 import Fp8Weight, quantize

# each precision's compute dtype outside fp8's weight matmuls
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "fp8": jnp.bfloat16}


def cast_floats(tree, dtype):
    """Every floating-point leaf of `tree` as `dtype` (integers, booleans, None and float8
    kernels, `Fp8Weight`, untouched)."""
    return jax.tree.map(
        lambda x: (
            x if x is None or isinstance(x, Fp8Weight) or not jnp.issubdtype(x.dtype, jnp.floating) else x.astype(dtype)
        ),
        tree,
        is_leaf=lambda x: isinstance(x, Fp8Weight),
    )


def quantize_kernels(tree):
    """`tree` (a Flax variable tree, its leaves boxed with logical axis names or not) with every
    Dense kernel (a leaf named `kernel`) as an `Fp8Weight`: one scale per tensor, per layer of a
    scanned stack (the leading `layers` axes), boxed with those axes' names."""

    def one(path, x):
        if not path or getattr(path[-1], "key", None) != "kernel":
            return x
        if not isinstance(x, nn.Partitioned):
            return quantize(x)
        stacked = next((i for i, n in enumerate(x.names) if n != "layers"), len(x.names))
        q = quantize(x.value, stacked)
        return Fp8Weight(x.replace(value=q.value), x.replace(value=q.scale, names=x.names[:stacked]))

    return jax.tree_util.tree_map_with_path(one, tree, is_leaf=lambda x: isinstance(x, nn.Partitioned))


def _low_precision_forward(section: Section, dtype) -> Section:
    fwd = section.forward

    def forward(variables, inputs, batch):
        inputs = {k: None if v is None else tuple(cast_floats(x, dtype) for x in v) for k, v in inputs.items()}
        return fwd(cast_floats(variables, dtype), inputs, cast_floats(batch, dtype))

    return dataclasses.replace(section, forward=forward)


def with_precision(graph: SectionGraph, precision: Mapping[str, str]) -> SectionGraph:
    """`graph` with each section running at `precision[name]` (default float32)."""
    low = {s: DTYPES[p] for s, p in precision.items() if p != "float32"}
    if not low:
        return graph
    init = graph.init

    def stored(name, consts):
        return cast_floats(quantize_kernels(consts) if precision[name] == "fp8" else consts, low[name])

    def init_with_precision(key):
        variables = init(key)
        return {s: {**v, "consts": stored(s, v["consts"])} if s in low else v for s, v in variables.items()}

    sections = tuple(_low_precision_forward(s, low[s.name]) if s.name in low else s for s in graph.sections)
    return dataclasses.replace(graph, sections=sections, init=init_with_precision)
