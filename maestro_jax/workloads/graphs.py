"""The workload's section graph as the config runs it: built by the workload, checked against the
config's sections and edges, cut into the pipeline stages the config asks for, and the
sections that pack sequences."""

from __future__ import annotations

from maestro_jax.config import Config, ConfigError, PackTokens
from maestro_jax.core.graph import SectionGraph
from maestro_jax.schedule.packing import Pack, TokenBudget, packs
from maestro_jax.workloads import checks
from maestro_jax.workloads.registry import Workload


def build_graph(cfg: Config, checked: Workload | None = None) -> SectionGraph:
    """The workload's graph, checked against the config's sections and edges (a `ValueError` the
    workload raises while building becomes a ConfigError naming the workload), with the pipeline
    stages the config asks for (`with_stages`). `checked`: `check_config(cfg)`'s workload, where
    the caller has checked the config already (`runtime.build` checks it once)."""
    workload = checked or checks.check_config(cfg)
    try:
        graph = workload.build(cfg)
    except ValueError as err:
        if isinstance(err, ConfigError):
            raise
        raise ConfigError(f"error: workload={cfg.workload!r}: {err}") from None
    check_sections(cfg, graph, f"workload {cfg.workload!r}")
    return with_stages(cfg, graph)


def with_stages(cfg: Config, graph: SectionGraph) -> SectionGraph:
    """`graph` with each section the config puts in `stages` > 1 cut into its pipeline stages
    (`core.stages.stage_graph`), as `stage_layers` cuts it; a section that cannot be is a
    ConfigError of one line."""
    from maestro_jax.core.stages import StageError, stage_graph

    staged = {n: s for n, s in cfg.sections.items() if s.stages > 1}
    cuts = {n: s.stage_layers for n, s in staged.items() if s.stage_layers is not None}
    try:
        return stage_graph(graph, {n: s.stages for n, s in staged.items()}, cuts)
    except StageError as err:
        raise ConfigError(str(err)) from None


def packing(cfg: Config) -> dict[str, Pack]:
    """The sections that pack sequences (`sections.<name>.pack` other than 1), each with its form
    as the scheduler, the executor and the planning half read it (`schedule.packing`: a sample
    count, or a `TokenBudget` for `{tokens: N}`)."""
    out: dict[str, Pack] = {}
    for name, sc in cfg.sections.items():
        pack = TokenBudget(sc.pack.tokens) if isinstance(sc.pack, PackTokens) else sc.pack
        if packs(pack):
            out[name] = pack
    return out


def check_sections(cfg: Config, graph: SectionGraph, owner: str = "the graph") -> None:
    """The config names exactly the graph's sections, and only edges the graph has; `precision:
    fp8` only on a frozen section (fp8 stores its weights in float8, `runtime.precision`, which
    no optimizer step updates)."""
    if set(cfg.sections) != set(graph.names):
        raise ConfigError(
            f"error: sections={sorted(cfg.sections)}: {owner} has sections {sorted(graph.names)}; "
            f"give each exactly one entry"
        )
    for name, sc in cfg.sections.items():
        if sc.precision == "fp8" and graph.section(name).trained:
            frozen = [s.name for s in graph.sections if not s.trained]
            raise ConfigError(
                f"error: sections.{name}.precision=fp8: section {name} is trained, and fp8 stores its weights in "
                f"float8, which no optimizer step updates; valid: float32, bfloat16 (fp8 only for a frozen "
                f"section: {', '.join(frozen) or 'none in this graph'})"
            )
    for e in cfg.edges:
        if e not in {x.name for x in graph.edges}:
            raise ConfigError(f"error: edges.{e}: unknown edge; edges are {[x.name for x in graph.edges]}")
