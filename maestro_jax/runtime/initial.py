"""A graph's `init` traced once, each section's initial variables computed from that one trace.

A `SectionGraph`'s `init(key)` returns every section's variables; a section initialises straight
into its own sharding on its own devices, so each section is its own program. Tracing `init` for
each of them (and again for its shapes, and again for the monolithic reference) repeats the whole
graph's Python tracing, Flax's module set-up included, once per section: with 8 pipeline stages,
16 whole-graph traces before the first step. `TracedInit` traces it once (`jax.make_jaxpr`, which
gives the shapes too); a section's program evaluates that jaxpr and keeps its own outputs, and
jit drops the rest before lowering. The values are the same: the same operations on the same key.

The variables are unboxed without a sharding constraint (Flax's `unbox` would add one under a
mesh): each section's program places its outputs by `out_shardings`, the layouts those names give.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import flax.linen as nn
import jax


def _unboxed(tree):
    """Flax's logical-axis boxes removed, their values kept as they are (no sharding constraint)."""
    return jax.tree.map(
        lambda x: x.unbox(apply_constraint=False) if isinstance(x, nn.meta.AxisMetadata) else x,
        tree,
        is_leaf=lambda x: isinstance(x, nn.meta.AxisMetadata),
    )


@dataclasses.dataclass(frozen=True)
class TracedInit:
    """`graph.init` as one jaxpr over its key, and its result's shapes (boxed, as `init` returns
    them: the logical axis names the shardings are read from)."""

    jaxpr: object  # the ClosedJaxpr of init(key) -> flat list of leaves
    abstract: dict  # {section: {"params": ..., "consts": ...}} of ShapeDtypeStruct, boxed

    @classmethod
    def of(cls, init: Callable, seed: int = 0) -> TracedInit:
        """Trace `init` (nothing is computed or compiled: the key is abstract, so that a plan refused
        after the trace has compiled nothing); the key's value is an input, not part of the trace."""
        key = jax.eval_shape(jax.random.key, seed)
        jaxpr, abstract = jax.make_jaxpr(init, return_shape=True)(key)
        return cls(jaxpr, abstract)

    def sections(self, names) -> Callable:
        """`key -> {name: variables}` (unboxed) for the sections `names`: the traced init
        evaluated, the other sections' outputs unused (jit removes their operations before
        lowering). Sections that share devices (the monolithic reference) initialise as one program."""
        closed, tree = self.jaxpr, jax.tree.structure(self.abstract)

        def init(key):
            whole = jax.tree.unflatten(tree, jax.core.eval_jaxpr(closed.jaxpr, closed.consts, key))
            return {name: _unboxed(whole[name]) for name in names}

        return init

    def section(self, name: str) -> Callable:
        """`key -> section name's variables` (unboxed): `sections` of one."""
        init = self.sections((name,))
        return lambda key: init(key)[name]
