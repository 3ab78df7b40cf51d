"""The planning view of a workload: its `planning.spec.WorkloadSpec` (parameter leaves, declared
costs, precisions, edges, how each section splits into pipeline stages) and planning batches
of sample metadata, what `plan` and `simulate` price."""

from __future__ import annotations

from maestro_jax.config import Config
from maestro_jax.core.graph import SectionGraph
from maestro_jax.workloads.graphs import build_graph, packing
from maestro_jax.workloads.sources import source_from_config


def describe(cfg: Config, graph: SectionGraph | None = None):
    """The planning view of a workload (`planning.spec.WorkloadSpec`), read off its graph (the
    config's workload, built here, unless a graph is given): the parameter leaves from
    `jax.eval_shape` of the graph's own `init` (traced, never compiled nor allocated) as
    `params.param_infos` records, the costs each section declares, each section's configured
    precision, the edges' bytes per unit. A section that declares no cost (no FLOPs per work
    unit) is refused with a `GraphError` naming it: the planner and the simulator would price it
    free and credit every plan with time it does not save."""
    from maestro_jax.core.plan import EdgeInfo
    from maestro_jax.planning.spec import WorkloadSpec

    graph = graph or build_graph(cfg)
    sections = _section_specs(cfg, graph)
    # the planner cuts whole sections (a staged graph's stages are priced as its sections)
    stagers = {} if graph.staging else {s: _stager(graph.section(s), sections[s]) for s in graph.names}
    stagers = {s: stager for s, stager in stagers.items() if stager is not None}

    def configured(s: str) -> tuple[int, list[int] | None]:
        own = cfg.sections.get(s)
        return (own.stages, own.stage_layers) if own else (1, None)

    return WorkloadSpec(
        cfg.workload or "+".join(graph.names),
        sections,
        tuple(EdgeInfo(e.name, e.src, e.dst) for e in graph.edges),
        {e.name: e.bytes_per_unit for e in graph.edges},
        graph.sink,
        {s: graph.staging.stages_of(s) for s in graph.staging.splits} if graph.staging else {},
        {s: _splits(stager, *configured(s)) for s, stager in stagers.items()},
        {s: p for s, p in packing(cfg).items() if s in sections},
        stagers,
        buckets_per_octave=cfg.compile.buckets_per_octave,
        edge_positions={e.name: e.positions_per_unit for e in graph.edges if e.positions_per_unit},
    )


def _section_specs(cfg: Config, graph: SectionGraph) -> dict:
    """Each section's `planning.spec.SectionSpec` in graph order: its parameter leaves from
    `jax.eval_shape` of the graph's `init`, its declared cost (a GraphError where it declares
    none) and its configured precision."""
    import jax

    from maestro_jax.core.graph import GraphError
    from maestro_jax.planning.spec import SectionSpec
    from maestro_jax.workloads.params import param_infos

    abstract = jax.eval_shape(lambda: graph.init(jax.random.key(cfg.seed)))
    sections = {}
    for s in graph.topological_order():
        sec = graph.section(s)
        if not (sec.cost.flops or sec.cost.attention_flops):
            raise GraphError(
                f"error: section {s!r}: declares no cost (Section.cost has no FLOPs per work unit), so plan and "
                f"simulate would price it free; declare cost=mj.UnitCost(flops=<forward FLOPs per unit, 2 per "
                f"weight>, ...) on the section"
            )
        sections[s] = SectionSpec(
            s,
            sec.trained,
            tuple(param_infos(abstract[s]["params"])),
            sec.cost,
            tuple(param_infos(abstract[s]["consts"])),
            cfg.section(s).precision if cfg.section_of(s) in cfg.sections else "float32",
        )
    return sections


def _stager(section, spec):
    """`section` (described as `spec`) cut for the planner (`planning.spec.StagedSection`): a
    function `(k, layers=None)` giving it in `k` stages, `layers` blocks each (where its `stages`
    takes a cut) or its own even cut, or None where it cannot be; each stage's leaves are the
    section's that its split's `owner` gives it, its cost the stage section's own. None for a
    section that does not split."""
    import dataclasses
    import re

    from maestro_jax.core.stages import takes_cut
    from maestro_jax.planning.spec import StagedSection

    if section.stages is None:
        return None

    def keys(info, top: str) -> tuple[str, ...]:
        return (top, *re.findall(r"\['([^']*)'\]", info.path))

    def stager(k: int, layers: tuple[int, ...] | None = None):
        if layers is not None and not takes_cut(section.stages):
            return None
        try:
            split = section.stages(k) if layers is None else section.stages(k, layers=tuple(layers))
        except ValueError:
            return None  # more stages than layers, a cut of the wrong size, a model that does not split
        stages = tuple(
            dataclasses.replace(
                spec,
                name=st.name,
                params=tuple(p for p in spec.params if split.owner(keys(p, "params")) == i),
                consts=tuple(p for p in spec.consts if split.owner(keys(p, "consts")) == i),
                cost=st.cost,
            )
            for i, st in enumerate(split.sections)
        )
        if sum(len(st.leaves) for st in stages) != len(spec.leaves):
            return None  # a leaf no stage owns: the split would not be priced whole
        return StagedSection(
            stages, dict(split.consumes), dict(split.produces), split.bytes_per_unit, split.positions_per_unit
        )

    return stager


def _splits(stager, configured: int, cut: list[int] | None) -> dict:
    """A section's splits into each of `planning.spec.SPLIT_COUNTS` stages it takes, evenly, and
    into the `configured` count as the config cuts it (which the planner checks a config's plan with)."""
    from maestro_jax.planning.spec import SPLIT_COUNTS

    out = {}
    for k in sorted({*SPLIT_COUNTS, configured} - {1}):
        split = stager(k, tuple(cut) if cut is not None and k == configured else None)
        if split is None:
            break  # more stages than layers, or a model that does not split: nor will more
        out[k] = split
    return out


def planning_batches(cfg: Config, graph: SectionGraph, count: int, source=None):
    """`count` global batches of sample metadata (sections activated, work units), from the
    source's `info` (sizes only, no payload): the source's samples in order, or in a seeded
    shuffled order under `data.shuffle`, repeated as often as `count` batches need."""
    import numpy as np

    from maestro_jax.data.sources import sample_info
    from maestro_jax.schedule import sample_metas

    source = source if source is not None else source_from_config(cfg)
    idx = np.arange(len(source))
    if cfg.data.shuffle:
        np.random.default_rng(cfg.seed).shuffle(idx)
    idx = np.tile(idx, 1 + (count * cfg.global_batch) // len(source))
    gb = cfg.global_batch
    return [
        sample_metas(graph, [sample_info(source, int(i)) for i in idx[b * gb : (b + 1) * gb]]) for b in range(count)
    ]
