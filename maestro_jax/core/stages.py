"""Pipeline stages inside a section: one section cut into K consecutive stage sections.

Plain Python (no JAX). A section that can be staged says how through `Section.stages(k)` (or
`Section.stages(k, layers)`, given each stage's layer count), which returns a `StageSplit`: K
stage sections (each a `Section` of its own, named `stage_name`), which stage reads each of the
section's input edges and writes each of its output edges, and which stage holds each of its
variables (`owner`). `stage_graph` puts the stages in the
section's place: stage i sends its activations to stage i + 1 on the edge `stage_edge(section,
i)`, and cotangents come back on it in the backward, as between any two sections, so the
scheduler, the transfers, the executor and the monolithic step need nothing new. The staged
graph's `init` is the whole graph's, cut up: a staged run starts from the same values as an
unstaged one, and its monolithic step is the unstaged monolithic step.

Each stage's variables are the matching subtree of the section's (a decoder stage's blocks keep
the whole model's names), so saving a staged section as one and restoring it onto another stage
count is a union and a selection of leaves by `owner` (`split_variables`, `merge_variables`;
the runtime does the same to optimizer states).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from maestro_jax.core.graph import Edge, Section, SectionGraph


class StageError(ValueError):
    """A stage count a section cannot take; the message is one `error:` line naming the key."""


def stage_name(section: str, i: int) -> str:
    """The name of stage `i` of `section` (its metrics, traces and programs carry it)."""
    return f"{section}.{i}"


def stage_edge(section: str, i: int) -> str:
    """The edge on which stage `i` of `section` sends its activations to stage `i + 1`."""
    return f"{section}.{i}>{i + 1}"


def stage_aux_edge(section: str, i: int) -> str:
    """The edge on which stage `i` of `section` sends its rows' auxiliary loss terms (one value per
    row, the MoE balance loss of its layers and the stages before it) to stage `i + 1`."""
    return f"{stage_edge(section, i)}:aux"


def edge_stage(
    section: str, edge: str, k: int, consumes: Mapping[str, int], produces: Mapping[str, int], dst: bool
) -> str:
    """The stage of `section` (cut into `k`) at the `dst` (reading) or source end of its edge
    `edge`: the one its split names, else the first reads and the last writes."""
    return stage_name(section, (consumes if dst else produces).get(edge, 0 if dst else k - 1))


def layer_ranges(depth: int, k: int, layers: Sequence[int] | None = None) -> tuple[tuple[int, int], ...]:
    """`depth` layers cut into `k` consecutive runs: `layers` of them by stage (a cut the config
    gives, `sections.<s>.stage_layers`, or the planner chose), else as equal as they come, the
    earlier stages taking the extra layers (the last holds the output layer and the loss
    besides). A given cut may leave the first stage (which holds the embedding) or the last
    (the final norm, the output layer, the loss) without layers, as Megatron-LM's
    `--decoder-first/last-pipeline-num-layers` may; a middle stage holds at least one."""
    if layers is None:
        layers = even_layers(depth, k)
    elif len(layers) != k or sum(layers) != depth or min(layers) < 0 or any(n < 1 for n in layers[1:-1]):
        raise ValueError(
            f"a cut of {list(layers)} layers; valid: {k} layer counts (one a stage) adding up to the model's "
            f"{depth}, each at least 1 but the first's and the last's (at least 0)"
        )
    starts = [sum(layers[:i]) for i in range(k)]
    return tuple((a, a + n) for a, n in zip(starts, layers))


def even_layers(depth: int, k: int) -> list[int]:
    """`depth` layers in `k` runs as equal as they come, the earlier stages taking the extra ones:
    the cut a section in `k` stages gets without `stage_layers`."""
    if not 1 <= k <= depth:
        raise ValueError(f"{depth} layers cannot make {k} stages")
    return [depth // k + (i < depth % k) for i in range(k)]


def takes_cut(stages: Callable) -> bool:
    """Whether a section's `stages` accepts an explicit cut (`stages(k, layers=...)`)."""
    params = inspect.signature(stages).parameters.values()
    return any(p.name == "layers" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


@dataclasses.dataclass(frozen=True)
class StageSplit:
    """A section cut into `len(sections)` stages, as its `Section.stages(k)` returns it.

    sections: the stages in order, stage i named `stage_name(section, i)`; stage i + 1 reads stage
      i's output on `stage_edge(section, i)` (one row per row, routed like any edge).
    consumes: the section's input edges read by a stage other than the first (edge -> stage).
    produces: the section's output edges written by a stage other than the last (edge -> stage).
    owner(path): the stage that holds a variable leaf, from the dict keys on its way down from
      the section's variables (`("params", "block_3", "q", "kernel")`), or None for a leaf that is
      no parameter's (an optimizer's step count): every parameter and constant has one owner.
    bytes_per_unit: what a stage-to-stage edge carries per work unit (prices its transfer);
      positions_per_unit: its positions per work unit (`Edge.positions_per_unit`).
    aux: stage i also sends its rows' auxiliary loss terms to stage i + 1 on `stage_aux_edge`
      (one value per row, adding up those of every stage so far), and the last adds them to its
      loss: a loss term of each stage's own layers (an MoE balance loss) reaches the sink.
    """

    sections: tuple[Section, ...]
    owner: Callable[[tuple[str, ...]], int | None]
    consumes: Mapping[str, int] = dataclasses.field(default_factory=dict)
    produces: Mapping[str, int] = dataclasses.field(default_factory=dict)
    bytes_per_unit: float = 0.0
    positions_per_unit: float = 0.0
    aux: bool = False


@dataclasses.dataclass(frozen=True)
class Staging:
    """What `stage_graph` did: the unstaged graph, and for each staged section its split."""

    whole: SectionGraph
    splits: Mapping[str, StageSplit]

    def stages_of(self, section: str) -> tuple[str, ...]:
        """The stage sections of `section` in order (itself alone when it is not staged)."""
        split = self.splits.get(section)
        return (section,) if split is None else tuple(s.name for s in split.sections)

    def section_of(self, name: str) -> str:
        """The section a (stage) section of the staged graph belongs to."""
        for section, split in self.splits.items():
            if name in (s.name for s in split.sections):
                return section
        return name


def _split_dict(tree: Any, owner: Callable[[tuple[str, ...]], int | None], stage: int, path: tuple[str, ...]):
    """The part of a nested dict whose leaves `stage` owns; None where nothing is left."""
    if not isinstance(tree, Mapping):
        who = owner(path)
        if who is None:
            raise ValueError(f"variable {'/'.join(path)} has no stage (StageSplit.owner gives None)")
        return tree if who == stage else None
    out = {}
    for key, value in tree.items():
        part = _split_dict(value, owner, stage, (*path, str(key)))
        if part is not None:
            out[key] = part
    return out if out or not path[1:] else None


def split_variables(variables: Mapping[str, Any], split: StageSplit) -> list[dict[str, Any]]:
    """A section's `{"params": ..., "consts": ...}` cut into each stage's (nested dicts; a leaf
    goes to the stage `split.owner` names)."""
    return [
        {part: _split_dict(variables[part], split.owner, i, (part,)) or {} for part in ("params", "consts")}
        for i in range(len(split.sections))
    ]


def _union(trees: Sequence[Any]) -> Any:
    if not all(isinstance(t, Mapping) for t in trees):
        if len(trees) != 1:
            raise ValueError("two stages hold the same variable")
        return trees[0]
    keys = dict.fromkeys(k for t in trees for k in t)
    return {k: _union([t[k] for t in trees if k in t]) for k in keys}


def merge_variables(stages: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The stages' variables joined back into the section's (the inverse of `split_variables`)."""
    return {
        part: _union([s[part] for s in stages if s[part]]) if any(s[part] for s in stages) else {}
        for part in ("params", "consts")
    }


def stage_graph(
    graph: SectionGraph, counts: Mapping[str, int], cuts: Mapping[str, Sequence[int]] | None = None
) -> SectionGraph:
    """`graph` with each section of `counts` (section -> stage count > 1) replaced by its stages,
    cut as `cuts` gives (section -> layers by stage, `sections.<s>.stage_layers`) or evenly.
    StageError (one line naming `sections.<s>.stages` or `.stage_layers`) for a section that does
    not split or a split that breaks the contract."""
    splits: dict[str, StageSplit] = {}
    for name, k in counts.items():
        if k == 1:
            continue
        section = graph.section(name)
        cut = (cuts or {}).get(name)
        if section.stages is None:
            splitting = [s.name for s in graph.sections if s.stages is not None]
            raise StageError(
                f"error: sections.{name}.stages={k}: section {name!r} does not split into pipeline stages "
                f"(its Section has no `stages`); valid: 1, or stages on a section that splits "
                f"({', '.join(splitting) or 'none in this graph'})"
            )
        if cut is not None and not takes_cut(section.stages):
            raise StageError(
                f"error: sections.{name}.stage_layers={list(cut)}: section {name!r} takes no cut of its own (its "
                f"Section.stages has no `layers` argument); valid: no stage_layers (an even cut)"
            )
        try:
            split = section.stages(k) if cut is None else section.stages(k, layers=tuple(cut))
        except ValueError as err:
            key = f"stages={k}" if cut is None else f"stage_layers={list(cut)}"
            raise StageError(f"error: sections.{name}.{key}: {err}") from None
        names = [s.name for s in split.sections]
        if names != [stage_name(name, i) for i in range(k)]:
            raise StageError(
                f"error: sections.{name}.stages={k}: Section.stages({k}) returned stages {names}; valid: "
                f"{[stage_name(name, i) for i in range(k)]}"
            )
        if any(s.trained != section.trained for s in split.sections):
            raise StageError(f"error: sections.{name}.stages={k}: every stage must be trained as {name!r} is")
        splits[name] = split
    if not splits:
        return graph

    def stage(edge: Edge, end: str) -> str:
        name = getattr(edge, end)
        split = splits.get(name)
        if split is None:
            return name
        return edge_stage(name, edge.name, len(split.sections), split.consumes, split.produces, end == "dst")

    sections, edges = [], []
    for s in graph.sections:
        split = splits.get(s.name)
        if split is None:
            sections.append(s)
            continue
        sections.extend(split.sections)
        for i in range(len(split.sections) - 1):
            name, src, dst = stage_edge(s.name, i), stage_name(s.name, i), stage_name(s.name, i + 1)
            edges.append(Edge(name, src, dst, split.bytes_per_unit, split.positions_per_unit))
            if split.aux:  # one float32 a row: priced as nothing next to the activations
                edges.append(Edge(stage_aux_edge(s.name, i), stage_name(s.name, i), stage_name(s.name, i + 1), 0.0))
    edges.extend(dataclasses.replace(e, src=stage(e, "src"), dst=stage(e, "dst")) for e in graph.edges)

    def init(key):
        whole = graph.init(key)
        out = {}
        for name, variables in whole.items():
            split = splits.get(name)
            if split is None:
                out[name] = variables
            else:
                out.update(zip((s.name for s in split.sections), split_variables(variables, split)))
        return out

    return SectionGraph(tuple(sections), tuple(edges), init, graph.loss_count, staging=Staging(graph, dict(splits)))
