"""Workloads as plug-ins: each is described once, by a `Workload`, and found by name.

`workload: vlm | kd | omni | vlm_kd` names a built-in module of this package; any other value
is an import path `package.module:NAME` to a user's `Workload`. The workload builds the section
graph from the config (its sections, edges, models, declared costs); the same graph serves the
runtime, the planner, the simulator, the data checks and `verify`/`bench`.

A workload may bring its own typed settings (`Workload.settings`, read from the config's
`workload_settings:` block), model kinds of its own (`Workload.model_kinds`, for `models:`
entries of those kinds) and its own sample source (`Workload.source`, for `data.kind: workload`);
they are validated like every other key of the config, before anything is built (`check_config`).

This module turns a config into what those users take from its workload: the graph checked
against the config's sections (`build_graph`), the sample source and the sample checks
(`source_from_config`, `sample_check`, `info_check`), and the planning view (`describe`,
`planning_batches`). Workloads sit below the runtime: they import the models, the data schema,
the config and the planning half, never the runtime, training or tools (`tests/test_layering.py`);
the runtime imports them.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import logging
from collections.abc import Callable, Mapping

from maestro_jax.config import MODEL_KINDS, Config, ConfigError, PackTokens, PluginModelConfig, Settings, validate_block
from maestro_jax.core.graph import SectionGraph
from maestro_jax.data.samples import Modality
from maestro_jax.schedule.packing import Pack, TokenBudget, packs

log = logging.getLogger("maestro_jax")

BUILTIN = ("vlm", "kd", "omni", "vlm_kd")


@dataclasses.dataclass(frozen=True)
class Workload:
    """A workload plug-in.

    build(cfg): the section graph (models from `cfg.models`, costs declared on each section).
    modalities(cfg): the modalities its samples carry besides text (validated, synthesised).
    vocab(cfg): the token vocabulary samples must stay inside, read off the model configs (every
      embedding table the ids index).
    pretrained: section -> loader(section, path, states, programs) -> states, for sections that
      can start from a Hugging Face folder (`sections.<s>.init.hf_path`); checked before compiling
      by `pretrained.check_pretrained`, called by the runtime after its sections initialise. Or a
      function of the config giving that mapping, for sections the config names (KD's teachers);
      `loaders(cfg)` reads either.
    settings: the class (a `config.Settings`) the config's `workload_settings:` block is validated
      against; its defaults apply where the block leaves a field out. `settings(cfg)` reads it.
      None: the workload takes no settings.
    model_kinds: kind -> its fields' class (a `config.Settings`, without `kind`), for `models:`
      entries of kinds of the plug-in's own; `model(cfg, name, kind)` reads one.
    source: cfg -> a random-access sample source (`data.sources`), used for `data.kind: workload`
      (it reads `cfg.data`; under `eval`, that is `eval.data`, with `seed + 1`).
    sample_rule: cfg -> a check of a sample's metadata (its `SampleInfo`, or the `Sample`) of the
      workload's own, raising `data.samples.DataError` naming the sample, or None where the
      config needs none; run beside `validate_info` on every sample (KD routing by tag: every
      sample's tag must name a teacher), so a bad one is refused or skipped by
      `data.on_bad_sample` before any section sees it.
    """

    name: str
    build: Callable[[Config], SectionGraph]
    vocab: Callable[[Config], int]
    modalities: Callable[[Config], tuple[Modality, ...]] = lambda cfg: ()
    pretrained: Mapping[str, Callable] | Callable[[Config], Mapping[str, Callable]] = dataclasses.field(
        default_factory=dict
    )
    settings: type[Settings] | None = None
    model_kinds: Mapping[str, type[Settings]] = dataclasses.field(default_factory=dict)
    source: Callable[[Config], object] | None = None
    sample_rule: Callable[[Config], Callable[[object], None] | None] = lambda cfg: None

    def __post_init__(self):
        """A settings or model class that let unknown keys through would drop a misspelt key silently."""
        for what, cls in [
            ("settings", self.settings),
            *((f"model_kinds[{k!r}]", c) for k, c in self.model_kinds.items()),
        ]:
            if cls is not None and not (isinstance(cls, type) and issubclass(cls, Settings)):
                raise TypeError(
                    f"Workload {self.name!r}: {what} must be a maestro_jax.config.Settings subclass, not {cls!r}"
                )
        clash = sorted(set(self.model_kinds) & set(MODEL_KINDS))
        if clash:
            raise TypeError(f"Workload {self.name!r}: model_kinds {clash} are built-in kinds; name the plug-in's own")

    def loaders(self, cfg: Config) -> Mapping[str, Callable]:
        """The Hugging Face loader of each section that has one, under `cfg`."""
        return self.pretrained(cfg) if callable(self.pretrained) else self.pretrained


def resolve(name: str | None) -> Workload:
    """The workload a config names (a built-in name, or `package.module:NAME` imported); ConfigError
    naming the valid choices when it is missing, unknown, unimportable or not a `Workload`."""
    if name is None:
        raise ConfigError(
            f"error: workload: missing; valid: {', '.join(BUILTIN)}, or a plug-in "
            f"'package.module:NAME' (a Python caller may instead pass its own graph to Trainer)"
        )
    if name in BUILTIN:
        return importlib.import_module(f"maestro_jax.workloads.{name}").WORKLOAD
    module, _, attr = name.partition(":")
    if not attr:
        raise ConfigError(
            f"error: workload={name!r}: unknown; valid: {', '.join(BUILTIN)}, or a plug-in "
            f"'package.module:NAME' naming a maestro_jax.workloads.Workload"
        )
    try:
        found = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as err:
        raise ConfigError(
            f"error: workload={name!r}: cannot import it ({err}); valid: {', '.join(BUILTIN)}, or 'package.module:NAME'"
        ) from None
    if not isinstance(found, Workload):
        raise ConfigError(
            f"error: workload={name!r}: is a {type(found).__name__}, not a maestro_jax.workloads.Workload"
        )
    return found


def settings(cfg: Config) -> Settings | None:
    """The config's `workload_settings` as the workload's own settings class (its defaults where
    the block is silent); ConfigError of one line naming the key, as for any key of the config.
    None for a workload that takes no settings (and then the block must be empty)."""
    workload = resolve(cfg.workload)
    if workload.settings is None:
        if cfg.workload_settings:
            key = next(iter(cfg.workload_settings))
            raise ConfigError(
                f"error: workload_settings.{key}: unknown key; workload {cfg.workload!r} takes no settings"
            )
        return None
    given = _from_checkpoints(cfg, workload.settings)
    for key, (value, folder, field) in given.items():
        mine = cfg.workload_settings.get(key, value)
        if mine != value:
            raise ConfigError(
                f"error: workload_settings.{key}={mine!r}: the checkpoint {folder} has {field}={value!r}; leave "
                f"{key} out (the checkpoint fills it in) or write the checkpoint's value"
            )
    block = {**{k: v for k, (v, _, _) in given.items()}, **cfg.workload_settings}
    return validate_block(workload.settings, block, "workload_settings")


def _from_checkpoints(cfg: Config, cls: type[Settings]) -> dict[str, tuple[object, str, str]]:
    """The settings a `models.<s>.hf` folder gives (`Settings.checkpoint_fields`: setting -> the
    config.json field, as a VLM's `image_token` is its folder's `image_token_index`, or the first
    of several a family may name it by: Qwen-VL's `image_token_id`): setting -> (value, folder,
    field). Two folders that disagree are a ConfigError naming both."""
    from maestro_jax import hf_config

    fields = getattr(cls, "checkpoint_fields", {})
    out: dict[str, tuple[object, str, str]] = {}
    for folder in dict.fromkeys(m.hf for m in cfg.models.values() if getattr(m, "hf", None)):
        config = hf_config.read_config(folder)
        for key, names in fields.items():
            field = next((f for f in ((names,) if isinstance(names, str) else names) if f in config), None)
            if field is None:
                continue
            if key in out and out[key][0] != config[field]:
                raise ConfigError(
                    f"error: workload_settings.{key}: the checkpoints {out[key][1]} ({field}={out[key][0]!r}) and "
                    f"{folder} ({field}={config[field]!r}) disagree; valid: models from checkpoints that agree"
                )
            out.setdefault(key, (config[field], folder, field))
    return out


def check_config(cfg: Config) -> Workload:
    """The config's workload, with what only it can validate checked (its settings, `models:`
    entries of its own kinds, its modalities' placeholder ids): before anything is built."""
    workload = resolve(cfg.workload)
    settings(cfg)
    for name, m in cfg.models.items():
        if isinstance(m, PluginModelConfig):
            model(cfg, name, m.kind)
    modalities_of(cfg, workload)
    return workload


def modalities_of(cfg: Config, workload: Workload | None = None) -> tuple[Modality, ...]:
    """The workload's modalities, their placeholder ids checked: each inside the vocabulary (not
    0, the padding id) and no two alike, or a text token or another modality's item would be
    taken for one. ConfigError naming the setting (`workload_settings.<modality>_token` where the
    workload's settings have it)."""
    workload = workload or resolve(cfg.workload)
    modalities, vocab = workload.modalities(cfg), workload.vocab(cfg)
    fields = workload.settings.model_fields if workload.settings is not None else {}
    seen: dict[int, str] = {}
    for m in modalities:
        key = f"workload_settings.{m.name}_token" if f"{m.name}_token" in fields else f"the {m.name} placeholder id"
        if not 1 <= m.placeholder < vocab:
            raise ConfigError(
                f"error: {key}={m.placeholder}: outside the vocabulary; valid: 1 to {vocab - 1} (0 is padding; "
                f"the model's vocab is {vocab})"
            )
        if m.placeholder in seen:
            raise ConfigError(
                f"error: {key}={m.placeholder}: the {seen[m.placeholder]} placeholder has this id too; valid: "
                f"an id of its own"
            )
        seen[m.placeholder] = m.name
    return modalities


def model(cfg: Config, name: str, kind: str):
    """`models.<name>` as the model's own config: for a built-in kind the Flax model's config
    dataclass, with the activation checkpointing (`remat`) of the section named like it; for a
    kind the plug-in declares (`Workload.model_kinds`) its class's instance. ConfigError when
    missing, of another kind, or (a plug-in's kind) with fields its class refuses."""
    from maestro_jax.models import AudioConfig, LLMConfig, ViTConfig

    m = cfg.models.get(name)
    if m is None:
        raise ConfigError(
            f"error: models.{name}: missing; workload {cfg.workload!r} needs a model of kind {kind!r} named {name!r}"
        )
    if m.kind != kind and getattr(m, "hf", None) is not None:  # the kind came from the folder, or agrees with it
        raise ConfigError(
            f"error: models.{name}.hf={m.hf!r}: holds a model of kind {m.kind!r}; workload {cfg.workload!r} needs "
            f"kind {kind!r} for models.{name}"
        )
    if m.kind != kind:
        raise ConfigError(f"error: models.{name}.kind={m.kind!r}: workload {cfg.workload!r} needs kind {kind!r} here")
    fields = {k: v for k, v in m.model_dump().items() if k not in ("kind", "hf")}
    if kind not in MODEL_KINDS:
        own = resolve(cfg.workload).model_kinds
        if kind not in own:
            raise ConfigError(
                f"error: models.{name}.kind={kind!r}: unknown; valid: {', '.join([*MODEL_KINDS, *own])} "
                f"(the built-in kinds and those workload {cfg.workload!r} declares)"
            )
        return validate_block(own[kind], fields, f"models.{name}")
    if name in cfg.sections:  # the section that runs this model sets its activation checkpointing
        fields["remat"] = cfg.sections[name].layer_remat
    if kind == "llm":
        strict = fields.pop("moe_dispatch_strict", False)
        return _with_runnable_dispatch(LLMConfig.from_fields(fields), name, strict)
    return {"vit": ViTConfig, "audio": AudioConfig}[kind](**fields)


def _with_runnable_dispatch(llm, name: str, strict: bool = False):
    """`llm` with an MoE dispatch that runs on this process's backend: `grouped` where its kernel
    is missing here becomes `sparse` (the same dispatch, each device's experts through tiled
    matmuls instead of tokamax's grouped GEMM), said in one log line; with `strict`
    (`models.<name>.moe_dispatch_strict`), a ConfigError naming `models.<name>.moe_dispatch`."""
    import jax

    from maestro_jax.models.attention import compute_capability
    from maestro_jax.models.llm import grouped_gemm_missing

    if llm.experts and llm.moe_dispatch == "grouped":
        missing = grouped_gemm_missing(jax.default_backend(), compute_capability(), jax.__version_info__)
        if missing and strict:
            raise ConfigError(
                f"error: models.{name}.moe_dispatch='grouped' with moe_dispatch_strict: tokamax's grouped GEMM "
                f"needs {missing}; valid here: auto, dense, ragged, sparse (or moe_dispatch_strict: false, which "
                "runs sparse)"
            )
        if missing:
            _said_grouped_fallback(name, missing)
            return dataclasses.replace(llm, moe_dispatch="sparse")
    return llm


@functools.cache
def _said_grouped_fallback(name: str, missing: str) -> None:
    """One log line a section and reason, however often the model is built."""
    log.warning(
        "models.%s.moe_dispatch: grouped needs %s; running sparse, the same dispatch without tokamax's "
        "grouped GEMM (moe_dispatch_strict: true refuses instead)",
        name,
        missing,
    )


def build_graph(cfg: Config, checked: Workload | None = None) -> SectionGraph:
    """The workload's graph, checked against the config's sections and edges (a `ValueError` the
    workload raises while building becomes a ConfigError naming the workload), with the pipeline
    stages the config asks for (`with_stages`). `checked`: `check_config(cfg)`'s workload, where
    the caller has checked the config already (`runtime.build` checks it once)."""
    workload = checked or check_config(cfg)
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


def source_from_config(cfg: Config, key: str = "data", checked: Workload | None = None):
    """The configured sample source (`data.kind`), each sample with its cached teacher outputs
    where the config trains from a teacher cache (`distill.cache`: `data.teacher_cache`). `key`:
    where the config holds `cfg.data` (`eval.data` for a held-out source), for the errors;
    `checked` as `build_graph`'s."""
    source = _data_source(cfg, key, checked)
    if cfg.distill.cache is None:
        return source
    from maestro_jax.data.teacher_cache import checked_source

    return checked_source(source, cfg.distill.cache)


def _data_source(cfg: Config, key: str = "data", checked: Workload | None = None):
    """The ArrayRecord files as they are, the workload's own source (`workload`:
    `Workload.source`), or a seeded synthetic source over the workload's vocabulary whose items
    are the workload's modalities that `data.modalities` gives sizes to (each name and size
    checked against the workload); its text avoids every placeholder id of the workload."""
    from maestro_jax.data.sources import ArrayRecordSource, SyntheticItems, SyntheticSource

    if cfg.data.kind == "array_record":
        return ArrayRecordSource(tuple(cfg.data.paths), key=f"{key}.paths")
    workload = checked or check_config(cfg)
    if cfg.data.kind == "workload":
        if workload.source is None:
            raise ConfigError(
                f"error: data.kind='workload': workload {cfg.workload!r} brings no sample source "
                f"(Workload.source); valid: synthetic, array_record"
            )
        return workload.source(cfg)
    modalities = modalities_of(cfg, workload)
    known = {m.name: m for m in modalities}
    fields = workload.settings.model_fields if workload.settings is not None else {}
    for name in cfg.data.modalities:
        if name not in known:
            hint = f" (with workload_settings.{name}_token set, {name} too)" if f"{name}_token" in fields else ""
            raise ConfigError(
                f"error: data.modalities.{name}: workload {cfg.workload!r} takes {sorted(known) or 'text only'}{hint}"
            )
    items = []
    for name, m in known.items():
        d = cfg.data.modalities.get(name)
        if d is None or not d.sizes:
            continue
        for size in d.sizes:
            if len(size) != len(m.unit):
                raise ConfigError(
                    f"error: data.modalities.{name}.sizes={d.sizes}: each size has {len(m.unit)} "
                    f"spatial dims for {name}"
                )
        items.append(SyntheticItems(m, d.fraction, d.max_items, tuple(tuple(s) for s in d.sizes)))
    return SyntheticSource(
        num_samples=cfg.data.num_samples,
        vocab=workload.vocab(cfg),
        text_len=tuple(cfg.data.text_len),
        items=tuple(items),
        seed=cfg.seed,
        reserved=tuple(m.placeholder for m in modalities),
        tags=tuple((name, tuple(values)) for name, values in cfg.data.tags.items()),
    )


def sample_check(cfg: Config, checked: Workload | None = None):
    """`check(sample, parts=None)`: the validation every sample passes before it is trained on
    (`data.samples.validate_sample` against the workload's modalities, its vocabulary and
    `data.max_tokens`)."""
    import functools

    from maestro_jax.data.samples import validate_sample

    workload = checked or check_config(cfg)
    check = functools.partial(
        validate_sample,
        modalities=modalities_of(cfg, workload),
        max_tokens=cfg.data.max_tokens,
        vocab=workload.vocab(cfg),
    )
    return _with_rule(check, workload.sample_rule(cfg))


def info_check(cfg: Config, checked: Workload | None = None):
    """The metadata half of `sample_check` (`data.samples.validate_info`: length, modalities, item
    shapes; no vocabulary, which needs the tokens), run on every process before scheduling."""
    import functools

    from maestro_jax.data.samples import validate_info

    workload = checked or check_config(cfg)
    check = functools.partial(validate_info, modalities=modalities_of(cfg, workload), max_tokens=cfg.data.max_tokens)
    return _with_rule(check, workload.sample_rule(cfg))


def _with_rule(check, rule):
    """`check` followed by the workload's `rule` (`Workload.sample_rule`) on the same sample."""
    if rule is None:
        return check

    def checked(sample, *args, **kwargs):
        out = check(sample, *args, **kwargs)
        rule(sample)
        return out

    return checked


def mean_item_units(cfg: Config, modality: str, per_item: Callable[[tuple[int, ...]], float], default: float) -> float:
    """The mean work units of one item of `modality` over the sizes `data.modalities.<modality>`
    lists (`default` when it lists none), for the attention context a cost declaration assumes."""
    d = cfg.data.modalities.get(modality)
    sizes = [tuple(s) for s in d.sizes] if d else []
    return sum(per_item(s) for s in sizes) / len(sizes) if sizes else default


def describe(cfg: Config, graph: SectionGraph | None = None):
    """The planning view of a workload (`planning.spec.WorkloadSpec`), read off its graph (the
    config's workload, built here, unless a graph is given): the parameter leaves from
    `jax.eval_shape` of the graph's own `init` (traced, never compiled nor allocated) as
    `params.param_infos` records, the costs each section declares, each section's configured
    precision, the edges' bytes per unit. A section that declares no cost (no FLOPs per work
    unit) is refused with a `GraphError` naming it: the planner and the simulator would price it
    free and credit every plan with time it does not save."""
    import jax

    from maestro_jax.core.graph import GraphError
    from maestro_jax.core.plan import EdgeInfo
    from maestro_jax.planning.spec import SectionSpec, WorkloadSpec
    from maestro_jax.workloads.params import param_infos

    graph = graph or build_graph(cfg)
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
