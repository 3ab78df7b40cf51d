"""Mixed precision, chosen per section (`sections.<name>.precision`).

`bfloat16` runs a section's forward and backward in bfloat16: a trained section keeps float32
master weights and float32 optimizer state, and its forward casts them (and its inputs) to
bfloat16, so gradients arrive in float32 through the cast; a frozen section (a KD teacher)
stores its weights in bfloat16 only. Losses and softmaxes stay float32 (the workloads' losses
cast logits up). Edge tensors leave a bfloat16 section in bfloat16: half the transfer bytes.

The policy wraps the graph itself (`with_precision`), so the maestro programs and the
monolithic baseline run the very same casts and stay comparable op for op.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax
import jax.numpy as jnp

from maestro_jax.core.graph import Section, SectionGraph

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def cast_floats(tree, dtype):
    """Every floating-point leaf of `tree` as `dtype` (integers, booleans and None untouched)."""
    return jax.tree.map(
        lambda x: x.astype(dtype) if x is not None and jnp.issubdtype(x.dtype, jnp.floating) else x, tree
    )


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

    def init_with_precision(key):
        variables = init(key)
        return {s: {**v, "consts": cast_floats(v["consts"], low[s])} if s in low else v for s, v in variables.items()}

    sections = tuple(_low_precision_forward(s, low[s.name]) if s.name in low else s for s in graph.sections)
    return dataclasses.replace(graph, sections=sections, init=init_with_precision)
