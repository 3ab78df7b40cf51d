"""From a config to running sections: graph, checked plan, meshes, programs, initial state."""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import jax

from maestro_jax.config import Config, ConfigError, PackTokens
from maestro_jax.core import plan as plan_lib
from maestro_jax.core.graph import GraphError, SectionGraph
from maestro_jax.data import BadSamples, global_batches
from maestro_jax.data.pipeline import BatchReader, ReadPlan
from maestro_jax.data.samples import TOKENS, DataError, parts_of, require_sample
from maestro_jax.data.sources import SyntheticSource
from maestro_jax.runtime import ahead as ahead_lib
from maestro_jax.runtime.distributed import Coordinator
from maestro_jax.runtime.executor import Executor
from maestro_jax.runtime.initial import TracedInit
from maestro_jax.runtime.monolithic import Monolithic
from maestro_jax.runtime.optimizer import check_sections, section_optimizer, section_squared_norm
from maestro_jax.runtime.precision import with_precision
from maestro_jax.runtime.programs import DryRun, SectionPrograms, SectionState
from maestro_jax.runtime.sharding import param_infos, rows_by_process, section_mesh, variable_shardings
from maestro_jax.runtime.stages import on_whole, stage_states, whole_params, whole_states
from maestro_jax.runtime.step import MonolithicStep, SectionedStep
from maestro_jax.schedule import Problem, Schedule, naive, sample_metas, wavefront
from maestro_jax.schedule.memo import ScheduleMemo
from maestro_jax.schedule.ops import pipeline_bounds
from maestro_jax.schedule.packing import slots


@dataclasses.dataclass
class Runtime:
    cfg: Config
    graph: SectionGraph
    plan: plan_lib.Plan
    problem: Problem
    meshes: dict
    shardings: dict
    programs: dict[str, SectionPrograms]
    executor: Executor
    abstract: dict
    source: object  # random-access source of samples (Grain protocol)
    check: object = None  # check(sample, parts=...): payload validation (raises DataError), or None
    info_check: object = None  # info_check(SampleInfo): metadata validation (raises DataError), or None
    pretrained: dict = dataclasses.field(default_factory=dict)  # section -> Hugging Face loader
    coordinator: Coordinator = dataclasses.field(default_factory=Coordinator)  # exchanges between processes
    traced_init: TracedInit | None = None  # `graph`'s init traced once (`runtime.initial`); build_runtime's
    # the schedules of earlier steps by their samples' signature (`schedule.memo`), for this
    # runtime's scheduler and problem
    _schedules: ScheduleMemo | None = dataclasses.field(default=None, init=False, repr=False, compare=False)

    def init_states(self, seed: int | None = None, optimizer: bool = True) -> dict[str, SectionState]:
        """Each section initialises straight into its own sharding (never a full copy on one
        device); sections with `init.hf_path` then take their weights from that checkpoint
        (`init.checkpoint_dir` is the training loop's: `training.checkpoint.start_from_checkpoints`).
        Without `optimizer`, no optimizer state (`opt` None): for a caller that only runs
        forwards (`teacher-cache`), which then never holds a trained section's moments."""
        key = jax.random.key(self.cfg.seed if seed is None else seed)
        states = {
            s: _init_section(
                self.traced_init.section(s),
                self.meshes[s],
                self.shardings[s],
                self.programs[s] if optimizer and self.graph.section(s).trained else None,
                key,
            )
            for s in self.graph.names
        }
        for s, sc in self.cfg.sections.items():
            if sc.init is not None and sc.init.hf_path is not None:  # a staged section loads whole
                load = functools.partial(self.pretrained[s], s, sc.init.hf_path)
                states = self.on_whole(states, load)
        return states

    def schedule(self, samples) -> Schedule:
        """The batch's schedule under the config's scheduler; a batch whose samples ask what an
        earlier one's asked gets that one's (`schedule.memo`: the scheduler would compute it again)."""
        memo, scheduler = self._schedules, self.cfg.schedule.scheduler
        if memo is None or memo.scheduler != scheduler or memo.problem is not self.problem:
            memo = self._schedules = ScheduleMemo(self._scheduled, scheduler, self.problem)
        return memo(sample_metas(self.graph, samples))

    def _scheduled(self, metas) -> Schedule:
        if self.cfg.schedule.scheduler == "wavefront":
            return wavefront(metas, self.problem)  # ordered by work units (no cost model at run time)
        return naive(metas, self.problem)

    def batches(self):
        return global_batches(self.source, self.cfg.global_batch, self.cfg.seed, self.cfg.data.shuffle, self.check)

    def reader(self, bad: BadSamples | None = None) -> BatchReader:
        """The training stream, read per process; pass `bad` to skip (and count) bad samples
        instead of failing."""
        return BatchReader(
            self.source,
            self.cfg.global_batch,
            self.cfg.seed,
            self.cfg.data.shuffle,
            plan=self.read_plan,
            loss_count=self.graph.loss_count,
            info_check=self.info_check,
            check=self.check,
            bad=bad,
            gather=self.coordinator.gather,
        )

    def read_plan(self, infos) -> ReadPlan:
        """What this process decodes of a batch, from metadata: for each sample, the parts read
        by the sections that hold one of its rows on this process's devices (`put_batch` places
        only those rows). The lowest process that decodes a sample's tokens counts it in the
        loss normaliser; a sample whose tokens no section reads is counted by process 0."""
        t0 = time.perf_counter()
        schedule = self.schedule(infos)
        schedule_s = time.perf_counter() - t0
        me = jax.process_index()
        need = [[set() for _ in infos] for _ in range(jax.process_count())]
        for s, steps in schedule.steps.items():
            reads = self.graph.section(s).reads
            for st in steps:
                for q, held in rows_by_process(self.programs[s].row_sharding, len(st.positions)).items():
                    for r in held:
                        pos = st.positions[r]
                        if pos >= 0:
                            need[q][pos] |= parts_of(infos[pos]) if reads is None else set(reads)
        counts = []
        for pos in range(len(infos)):
            owner = next((q for q, n in enumerate(need) if TOKENS in n[pos]), 0)
            need[owner][pos].add(TOKENS)
            counts.append(owner == me)
        return ReadPlan([frozenset(n) for n in need[me]], counts, schedule, schedule_s)

    def whole_states(self, states: dict[str, SectionState]) -> dict[str, SectionState]:
        """States by section as the config names them, pipeline stages joined (what checkpoints
        and exports hold: `runtime.stages`)."""
        return whole_states(self.graph, self.programs, states)

    def stage_states(self, whole: dict[str, SectionState], like: dict[str, SectionState]) -> dict[str, SectionState]:
        """`whole_states` undone onto this plan's stages (`like`: states of this runtime)."""
        return stage_states(self.graph, whole, like)

    def on_whole(self, states: dict[str, SectionState], load) -> dict[str, SectionState]:
        """`load(states, programs) -> states` on the sections whole (`runtime.stages.on_whole`)."""
        return on_whole(self.graph, self.programs, states, load)

    def abstract_states(self) -> dict[str, SectionState]:
        """`init_states`' result as abstract values (shapes, dtypes, layouts), nothing computed;
        the optimizer state's layout is its `init_opt` program's, which this compiles if needed."""
        run = DryRun(compile=True)
        return ahead_lib.abstract_states(self, {s: prog.abstract(run) for s, prog in self.programs.items()})

    def batch_infos(
        self,
        steps,
        source=None,
        *,
        seed: int | None = None,
        shuffle: bool | None = None,
        global_batch: int | None = None,
    ) -> list[list]:
        """The `SampleInfo`s of global batches `steps` (indices) of `source` (default the training
        source, in the training stream's order), from metadata alone: what `SectionedStep.compile` scans."""
        return ahead_lib.batch_infos(
            self.source if source is None else source,
            steps,
            self.cfg.global_batch if global_batch is None else global_batch,
            self.cfg.seed if seed is None else seed,
            self.cfg.data.shuffle if shuffle is None else shuffle,
            self.info_check,
        )

    @functools.cached_property
    def step(self) -> SectionedStep:
        """The plan's training step (`runtime.step`), under the config's `on_nonfinite`."""
        return SectionedStep(self)

    @functools.cached_property
    def monolithic(self) -> MonolithicRuntime:
        return build_monolithic(self)


def _init_section(init, mesh, shardings, programs, key) -> SectionState:
    """`init(key)` (one section's, `TracedInit.section`) straight into its sharding; with
    `programs` (a section that trains and wants one), its optimizer state too."""
    with jax.set_mesh(mesh):
        v = jax.jit(init, out_shardings=shardings)(key)
    opt = programs.init_optimizer(v["params"]) if programs is not None else None
    return SectionState(v["params"], v["consts"], opt)


def _host_memory_bytes() -> float:
    """This host's RAM, or the cgroup's memory limit when lower (a container or a batch job)."""
    total = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    for limit in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(limit).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, float(text))
    return total


def check_device_memory(plan, state: dict[str, float]) -> None:
    """Without `device_memory_gb`, refuse before compiling a plan whose persistent state (params,
    grads, optimizer moments: the planner's memory model) cannot fit this machine's memory.

    An accelerator's limit is its allocator's (`memory_stats()['bytes_limit']`), per device, and
    co-located sections share it. CPU
    devices share the host's RAM: the state of every section, times its devices in this
    process, must fit it. Activations come on top, so this refuses only what can never run."""
    devices, me = jax.devices(), jax.process_index()
    local = {s: [devices[i] for i in sp.devices if devices[i].process_index == me] for s, sp in plan.sections.items()}
    if devices[0].platform == "cpu":
        total = _host_memory_bytes()
        need = {s: state.get(s, 0.0) * len(ds) for s, ds in local.items()}
        if sum(need.values()) > total:
            s = max(need, key=need.get)
            raise plan_lib.MemoryBudgetError(
                f"sections.{s}",
                f"{state[s] / 2**30:.3f} GiB/device",
                f"params, grads and optimizer state of all sections total {sum(need.values()) / 2**30:.3f} GiB on "
                f"this host's {len(jax.local_devices())} CPU devices, more than its memory "
                f"({total / 2**30:.3f} GiB); shrink the model (section {s!r} is the largest: "
                f"{need[s] / 2**30:.3f} GiB) or set device_memory_gb to plan for another machine",
            )
        return
    groups = plan_lib.device_groups(plan.sections)
    shared = {g: sum(state.get(s, 0.0) for s in plan.sections if groups[s] == g) for g in set(groups.values())}
    for s, ds in local.items():
        limits = [(d.memory_stats() or {}).get("bytes_limit") for d in ds]
        limits = [x for x in limits if x]
        if s == groups[s] and limits and shared[s] > min(limits):
            raise plan_lib.MemoryBudgetError(
                f"sections.{s}",
                f"{shared[s] / 2**30:.3f} GiB/device",
                f"params, grads and optimizer state exceed the device's memory ({min(limits) / 2**30:.3f} GiB, "
                f"{ds[0].device_kind}); give the section more devices, more fsdp/tensor sharding, or set "
                f"device_memory_gb to plan for another machine",
            )


def check_batch_fits_data(cfg: Config, source) -> None:
    """A global batch larger than the data would hold each sample several times in one step:
    refused before compiling when the source's size is known."""
    try:
        size = len(source)
    except TypeError:  # a source of unknown size
        return
    if cfg.global_batch > size:
        where = "data.num_samples" if cfg.data.kind == "synthetic" else "the data"
        raise ConfigError(
            f"error: global_batch={cfg.global_batch}: larger than the {size} samples of {where}; "
            f"one step would take each sample {-(-cfg.global_batch // size)} times; valid: at most {size}"
        )


def check_first_batch(cfg: Config, source, check, hint: str = "") -> None:
    """A user graph's first global batch of samples (indices 0..global_batch-1) through the
    sample check before anything is built or compiled: a mistake every sample shares (a modality
    or a vocabulary not declared, a token list) stops the run here, not after its programs
    compile. `hint` is added to the error (where the declared check comes from). Under
    `data.on_bad_sample: skip` only a batch with no good sample stops here (training drops and
    counts the bad ones). Training still checks every sample it reads."""
    try:
        n = min(cfg.global_batch, len(source))
    except TypeError:  # a source of unknown size
        n = cfg.global_batch
    first = None
    for i in range(n):
        sample = source[i]
        require_sample(sample, f"source[{i}]")  # the source's contract, whatever the check declares
        try:
            check(sample)
        except DataError as err:
            if cfg.data.on_bad_sample == "error":
                raise DataError(f"{err}{hint}") from err
            first = first or err
        else:
            return
    if first is not None:
        raise DataError(f"{first}{hint}; the first batch's other {n - 1} samples fail too") from first


def build_runtime(
    cfg: Config,
    graph: SectionGraph | None = None,
    source=None,
    check=None,
    coordinator: Coordinator | None = None,
    modalities: tuple = (),
    vocab: int | None = None,
) -> Runtime:
    """Check the whole plan (`docs/configuration.md`, "Configs") before building or compiling anything.

    Without `graph`, the config's workload builds it and supplies the source and sample checks;
    a user's own graph comes with its own `source`. Its samples are validated too: by its own
    `check`, else against the `modalities` and `vocab` it declares (`data.samples.validate_sample`:
    a token list instead of an array, placeholders that do not match the items, items of an
    undeclared modality, ids beyond the vocabulary, a malformed loss mask), so that no graph
    trains silently on what its sections cannot read. In named steps: the workload's parts
    (`_workload_parts`), the graph's init traced once with its shapes (`_traced_init`), the plan checked against
    them (`_check_whole_plan`), then each section's mesh, shardings and programs
    (`_section_programs`) and the executor's problem (`_executor_problem`)."""
    parts = _workload_parts(cfg, graph, source, check, modalities, vocab)
    graph, source = parts.graph, parts.source
    check_packing(cfg, graph)
    check_pack_budget(cfg, source)
    packing = _packing(cfg)
    plan = cfg.plan()
    graph = with_precision(graph, {s: sp.precision for s, sp in plan.sections.items()})
    traced = _traced_init(graph)
    abstract = traced.abstract
    _check_whole_plan(cfg, graph, plan, abstract, source)
    meshes = {s: section_mesh(plan.sections[s]) for s in graph.names}
    shardings = {s: variable_shardings(abstract[s], meshes[s], plan.sections[s].rules) for s in graph.names}
    programs = _section_programs(cfg, graph, plan, abstract, meshes, shardings)
    problem = _executor_problem(cfg, graph, plan, packing)
    executor = Executor(graph, problem, programs, problem.pack, scan=cfg.compile.scan_micro_steps)
    coordinator = coordinator or Coordinator(cfg.distributed.timeout_s, cfg.distributed.startup_timeout_s)
    return Runtime(
        *(cfg, graph, plan, problem, meshes, shardings, programs, executor, abstract, source),
        *(parts.check, parts.info_check, dict(parts.pretrained)),
        coordinator=coordinator,
        traced_init=traced,
    )


@dataclasses.dataclass(frozen=True)
class _WorkloadParts:
    """What a runtime is built from besides the config: the graph, its sample source, the check of
    each sample (and of its metadata alone: `info_check`), and the Hugging Face loaders."""

    graph: SectionGraph
    source: object
    check: Callable | None
    info_check: Callable | None = None
    pretrained: dict = dataclasses.field(default_factory=dict)


def _workload_parts(cfg: Config, graph, source, check, modalities, vocab) -> _WorkloadParts:
    """The config's workload's parts, checked (its pretrained folders), or a user graph's, checked
    against the config (its sections) and its first batch against what it declares."""
    from maestro_jax import workloads  # workloads import the runtime's users

    if graph is None:
        from maestro_jax.workloads.pretrained import check_pretrained

        workload = workloads.check_config(cfg)  # once: the steps below take it checked
        graph = workloads.build_graph(cfg, workload)
        pretrained = workload.loaders(cfg)
        check_pretrained(cfg, pretrained)
        return _WorkloadParts(
            graph,
            source if source is not None else workloads.source_from_config(cfg, checked=workload),
            check if check is not None else workloads.sample_check(cfg, workload),
            workloads.info_check(cfg, workload),
            pretrained,
        )
    workloads.check_sections(cfg, graph)
    graph = workloads.with_stages(cfg, graph)
    if source is None:
        raise ConfigError(
            "error: source: a user graph needs a sample source (any random-access source of maestro_jax.data.Sample)"
        )
    info_check, hint = None, ""
    if check is None:
        from maestro_jax.data.samples import validate_info, validate_sample

        declared = {"modalities": tuple(modalities), "max_tokens": cfg.data.max_tokens}
        check = functools.partial(validate_sample, vocab=vocab, **declared)
        info_check = functools.partial(validate_info, **declared)
        hint = (
            f" (checked against what Trainer(modalities=..., vocab=...) declares: modalities "
            f"{[m.name for m in modalities] or 'none, text only'}, vocab {vocab or 'not declared'}; declare what "
            "your samples carry)"
        )
    check_first_batch(cfg, source, check, hint)
    return _WorkloadParts(graph, source, check, info_check)


def _traced_init(graph: SectionGraph) -> TracedInit:
    """The graph's init traced once (nothing compiles): every section's params and constants as
    shapes, each section's entry checked to hold both, and the trace each section's init runs."""
    traced = TracedInit.of(graph.init)
    abstract = traced.abstract
    for s in graph.names:
        entry = abstract.get(s) if isinstance(abstract, dict) else None
        if not (isinstance(entry, dict) and {"params", "consts"} <= set(entry)):
            got = "nothing" if entry is None else (sorted(entry) if isinstance(entry, dict) else type(entry).__name__)
            raise GraphError(
                f"error: section {s!r}: the graph's init returns {got} for it; return "
                f'{{"{s}": {{"params": ..., "consts": ...}}}} for every section (empty dicts where it has none)'
            )
    return traced


def _check_whole_plan(cfg: Config, graph: SectionGraph, plan, abstract: dict, source) -> None:
    """Every constraint of the plan (`core.plan.check_plan`) on the sections' parameters and
    state, the devices' memory, and a global batch the data can fill."""
    infos = {s: param_infos(abstract[s]) for s in graph.names}
    state = {
        s: plan_lib.state_bytes_per_device(infos[s], plan.sections[s], graph.section(s).trained)
        for s in graph.names
        if s in plan.sections
    }
    budget = cfg.device_memory_gb * 2**30 if cfg.device_memory_gb else None
    plan_lib.check_plan(
        plan,
        num_devices=len(jax.devices()),
        edges=_edge_infos(graph),
        sink=graph.sink,
        params=infos,
        budget_bytes=budget,
        state=state,
    )
    if budget is None:
        check_device_memory(plan, state)
    check_batch_fits_data(cfg, source)


def _edge_infos(graph: SectionGraph) -> tuple:
    return tuple(plan_lib.EdgeInfo(e.name, e.src, e.dst) for e in graph.edges)


def _section_programs(cfg: Config, graph: SectionGraph, plan, abstract, meshes, shardings) -> dict:
    """Each section's programs on its mesh (`SectionPrograms`), with its optimizer; the optimizer
    config's sections checked against the trained parameters first."""
    trained = frozenset(s.name for s in graph.sections if s.trained)
    whole = whole_params(graph, {s: abstract[s]["params"] for s in trained})
    check_sections(cfg.optimizer, sorted(whole), whole)
    programs = {}
    for s in graph.names:
        sp = plan.sections[s]
        programs[s] = SectionPrograms(
            graph.section(s),
            meshes[s],
            shardings[s],
            section_optimizer(cfg.optimizer, cfg.section_of(s), cfg.steps),
            sp.residuals,
            out_edges=tuple(e.name for e in graph.consumers_of(s)),
            diff_inputs=tuple(e.name for e in graph.producers_of(s) if e.src in trained),
            is_sink=s == graph.sink,
            rules=sp.rules,
            clip_norm=cfg.optimizer.clip_norm,
            squared_norm=section_squared_norm(cfg.optimizer, cfg.section_of(s)),
            donate=cfg.compile.donate,
        )
    return programs


def _packing(cfg: Config) -> dict:
    """Each packing section's samples (or tokens) a row (`workloads.packing`)."""
    from maestro_jax import workloads  # workloads import the runtime's users

    return workloads.packing(cfg)


def _executor_problem(cfg: Config, graph: SectionGraph, plan, packing) -> Problem:
    """What the scheduler and executor plan a step with: the graph's order and edges, each
    section's rows (sample slots, under `packing`) and data-parallel degree, the schedule's
    settings, the pipeline stages' stash bounds and the co-located device groups."""
    stages = {s: graph.staging.stages_of(s) for s in graph.staging.splits} if graph.staging else {}
    return Problem(
        order=graph.topological_order(),
        sink=graph.sink,
        trained=frozenset(s.name for s in graph.sections if s.trained),
        edges=_edge_infos(graph),
        rows={s: slots(plan.sections[s].rows, packing.get(s, 1)) for s in graph.names},  # packing: sample slots
        dp={s: plan.sections[s].dp for s in graph.names},
        max_in_flight=cfg.schedule.max_in_flight,
        run_ahead=cfg.schedule.run_ahead,
        balance_shards=cfg.schedule.balance_shards,
        bounds=pipeline_bounds(stages),
        groups=plan_lib.device_groups(plan.sections),
        pack={s: p for s, p in packing.items() if s in graph.names},
    )


def check_packing(cfg: Config, graph: SectionGraph) -> None:
    """`sections.<name>.pack` other than 1 only where the section packs (`Section.packed_batch`)."""
    for name, sc in cfg.sections.items():
        if sc.pack != 1 and name in graph.names and graph.section(name).packed_batch is None:
            packing = [s.name for s in graph.sections if s.packed_batch is not None]
            raise ConfigError(
                f"error: sections.{name}.pack={sc.pack}: section {name} does not pack sequences; "
                f"1, or pack a section that does ({', '.join(packing) or 'none in this workload'})"
            )


def check_pack_budget(cfg: Config, source) -> None:
    """A token budget (`sections.<name>.pack: {tokens: N}`) holds whole every sample the section can
    receive (a sample is never split), or the config is refused before anything is compiled. A
    packed row holds a sample's tokens but its last, which only a target reads
    (`rows.packed_text_rows`); a sample has at most `data.max_tokens` (a longer one is a bad sample)
    or, from synthetic data, the most its settings draw (`SyntheticSource.longest`). Other data
    without `data.max_tokens` has no known longest sample, and is refused too."""
    budgets = {name: sc.pack.tokens for name, sc in cfg.sections.items() if isinstance(sc.pack, PackTokens)}
    if not budgets:
        return
    if cfg.data.max_tokens is not None:
        longest, why = cfg.data.max_tokens - 1, f"data.max_tokens={cfg.data.max_tokens}, less the last token"
    elif isinstance(source, SyntheticSource):
        longest, why = (
            source.longest() - 1,
            "the longest synthetic sample (data.text_len and items), less the last token",
        )
    else:
        name, n = next(iter(budgets.items()))
        raise ConfigError(
            f"error: sections.{name}.pack={{tokens: {n}}}: the data's longest sample is not known, so no budget can "
            f"be shown to hold every sample whole; valid: set data.max_tokens (longer samples are bad samples)"
        )
    for name, n in budgets.items():
        if n < longest:
            raise ConfigError(
                f"error: sections.{name}.pack={{tokens: {n}}}: smaller than the longest sample {name} can receive, "
                f"{longest} tokens of a row ({why}); a sample is never split; valid: {{tokens: N}} with N >= {longest}"
            )


@dataclasses.dataclass
class MonolithicRuntime:
    """The monolithic step of a runtime's graph, its pipeline stages undone (`graph`: sections
    whole, as the config names them): the reference every sectioned plan must equal."""

    model: Monolithic
    cfg: Config
    mesh: object
    shardings: dict
    graph: SectionGraph
    pretrained: dict = dataclasses.field(default_factory=dict)  # section -> Hugging Face loader (Runtime's)
    hf_paths: dict = dataclasses.field(default_factory=dict)  # section -> its `init.hf_path`
    traced_init: TracedInit | None = None  # `graph`'s init traced once (`runtime.initial`)

    @property
    def step(self) -> MonolithicStep:
        """The monolithic training step (`runtime.step`), under the config's `on_nonfinite`."""
        return MonolithicStep(self)

    def init_states(self, seed=None) -> dict[str, SectionState]:
        """The sections' initial states on the monolithic mesh: the runtime's initialisation, the
        sections with `init.hf_path` then loaded from their checkpoints by the runtime's own
        loaders, so the reference starts where the sectioned step does."""
        key = jax.random.key(self.cfg.seed if seed is None else seed)
        with jax.set_mesh(self.mesh):  # every section on the one mesh: one program for all
            v = jax.jit(self.traced_init.sections(self.graph.names), out_shardings=self.shardings)(key)
        out = self._with_optimizer(v)
        programs = {s: _OptimizerInit(opt.init, self.mesh) for s, opt in self.model.optimizers.items()}
        for s, path in self.hf_paths.items():
            out = self.pretrained[s](s, path, out, programs)
        return out

    def states_from(self, whole: Mapping[str, SectionState]) -> dict[str, SectionState]:
        """Step-0 states on the monolithic mesh from the sectioned step's step-0 states (sections
        whole, `runtime.stages.whole_states`): params and constants moved as they are (pretrained
        weights included), fresh optimizer state from them, as `init_states` gives. The reference
        then starts from the very weights the sectioned step holds, and no second init of the
        whole graph compiles (`verify`)."""
        variables = {s: {"params": whole[s].params, "consts": whole[s].consts} for s in self.graph.names}
        return self._with_optimizer(jax.device_put(variables, self.shardings))

    def _with_optimizer(self, variables: dict) -> dict[str, SectionState]:
        """Each section's state from its variables on the monolithic mesh, a trained section's
        optimizer state initialised there (one program for all)."""
        optimizers = self.model.optimizers
        with jax.set_mesh(self.mesh):
            opt = jax.jit(lambda p: {s: optimizers[s].init(p[s]) for s in optimizers})(
                {s: variables[s]["params"] for s in optimizers}
            )
        return {s: SectionState(v["params"], v["consts"], opt.get(s)) for s, v in variables.items()}


@dataclasses.dataclass(frozen=True)
class _OptimizerInit:
    """What a pretrained loader asks of a section's programs (`init_optimizer`), on the monolithic mesh."""

    init: Callable
    mesh: object

    def init_optimizer(self, params):
        with jax.set_mesh(self.mesh):
            return jax.jit(self.init)(params)


def build_monolithic(rt: Runtime) -> MonolithicRuntime:
    cfg, graph, traced = rt.cfg, rt.graph, rt.traced_init
    if graph.staging is not None:
        graph = with_precision(graph.staging.whole, {s: sc.precision for s, sc in cfg.sections.items()})
        traced = TracedInit.of(graph.init)
    abstract = traced.abstract
    sp = cfg.monolithic_plan()
    mono_plan = plan_lib.Plan(dict.fromkeys(graph.names, sp), {}, cfg.global_batch)
    infos = {s: param_infos(abstract[s]) for s in graph.names}
    try:
        plan_lib.check_resources(plan_lib.Plan({"all": sp}, {}, cfg.global_batch), len(jax.devices()))
        plan_lib.check_meshes(mono_plan)
        plan_lib.check_divisibility(mono_plan, infos)
    except plan_lib.PlanError as err:
        parts = err.key.split(".", 2)
        key = f"monolithic.{parts[2]}" if parts[0] == "sections" and len(parts) == 3 else err.key
        raise type(err)(key, err.value, err.problem) from None
    mesh = section_mesh(sp)
    shardings = {s: variable_shardings(abstract[s], mesh, sp.rules) for s in graph.names}
    trained = [s for s in graph.names if graph.section(s).trained]
    optimizers = {s: section_optimizer(cfg.optimizer, cfg.section_of(s), cfg.steps) for s in trained}
    norms = {s: section_squared_norm(cfg.optimizer, cfg.section_of(s)) for s in trained}
    hf_paths = {s: sc.init.hf_path for s, sc in cfg.sections.items() if sc.init is not None and sc.init.hf_path}
    return MonolithicRuntime(
        Monolithic(graph, sp, mesh, shardings, optimizers, cfg.optimizer.clip_norm, norms),
        cfg,
        mesh,
        shardings,
        graph,
        rt.pretrained,
        hf_paths,
        traced,
    )
