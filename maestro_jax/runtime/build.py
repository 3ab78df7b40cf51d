"""From a config to running sections: graph, checked plan, meshes, programs, initial state."""

from __future__ import annotations

import dataclasses
import functools

import flax.linen as nn
import grain
import jax

from maestro_jax.config import Config, ConfigError
from maestro_jax.core import plan as plan_lib
from maestro_jax.core.graph import SectionGraph
from maestro_jax.data import BadSamples, global_batches, sample_check, source_from_config, training_batches
from maestro_jax.runtime.executor import Executor, sample_metas
from maestro_jax.runtime.monolithic import Monolithic
from maestro_jax.runtime.programs import SectionPrograms, SectionState, make_optimizer
from maestro_jax.runtime.sharding import param_infos, section_mesh, variable_shardings
from maestro_jax.schedule import Problem, Schedule, naive, wavefront
from maestro_jax.workloads import kd as kd_graph
from maestro_jax.workloads import vlm as vlm_graph
from models import LLMConfig, ViTConfig

WORKLOAD_SECTIONS = {"vlm": ("vision", "llm"), "kd": ("teacher", "student")}


def _model(cfg: Config, name: str, kind: str):
    m = cfg.models.get(name)
    if m is None:
        raise ConfigError(f"error: models.{name}: missing; workload {cfg.workload!r} needs models "
                          f"{', '.join(WORKLOAD_SECTIONS[cfg.workload])}")
    if m.kind != kind:
        raise ConfigError(f"error: models.{name}.kind={m.kind!r}: workload {cfg.workload!r} needs kind {kind!r} here")
    fields = {k: v for k, v in m.model_dump().items() if k != "kind"}
    if kind == "llm":
        moe = [fields.pop(k) for k in ("experts", "experts_per_token", "expert_mlp")]
        if any(moe):
            raise ConfigError(f"error: models.{name}.experts={m.experts}: mixture-of-experts models are described "
                              f"for `maestro-jax simulate` only; the Flax LLM is dense (experts: 0)")
    return (ViTConfig if kind == "vit" else LLMConfig)(**fields)


def build_graph(cfg: Config) -> SectionGraph:
    if cfg.workload == "vlm":
        graph = vlm_graph.build(_model(cfg, "vision", "vit"), _model(cfg, "llm", "llm"))
    else:
        graph = kd_graph.build(_model(cfg, "teacher", "llm"), _model(cfg, "student", "llm"),
                               cfg.distill.alpha, cfg.distill.temperature)
    want = set(graph.names)
    if set(cfg.sections) != want:
        raise ConfigError(f"error: sections={sorted(cfg.sections)}: workload {cfg.workload!r} has sections "
                          f"{sorted(want)}; give each exactly one entry")
    for e in cfg.edges:
        if e not in {x.name for x in graph.edges}:
            raise ConfigError(f"error: edges.{e}: unknown edge; edges are {[x.name for x in graph.edges]}")
    return graph


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
    cost: object = None  # CostModel the wavefront scheduler plans with (None: work units)

    def init_states(self, seed: int | None = None) -> dict[str, SectionState]:
        """Each section initialises straight into its own sharding (never a full copy on one
        device); sections with `init.hf_path` then take their weights from that checkpoint."""
        key = jax.random.key(self.cfg.seed if seed is None else seed)
        states = {s: _init_section(self.graph, s, self.meshes[s], self.shardings[s], self.programs[s], key)
                  for s in self.graph.names}
        return load_pretrained(self, states)

    def schedule(self, samples) -> Schedule:
        metas = sample_metas(self.graph, samples)
        if self.cfg.schedule.scheduler == "wavefront":
            return wavefront(metas, self.problem, self.cost)
        return naive(metas, self.problem)

    def batches(self):
        return global_batches(source_from_config(self.cfg), self.cfg.global_batch, self.cfg.seed,
                              self.cfg.data.shuffle, sample_check(self.cfg))

    def training_batches(self, bad: BadSamples | None = None) -> grain.IterDataset:
        """The training stream; pass `bad` to skip (and count) bad samples instead of failing."""
        return training_batches(source_from_config(self.cfg), self.cfg.global_batch, self.cfg.seed,
                                self.cfg.data.shuffle, sample_check(self.cfg), bad)

    @functools.cached_property
    def monolithic(self) -> MonolithicRuntime:
        return build_monolithic(self)


HF_MODELS = {("kd", "teacher"): "teacher", ("kd", "student"): "student", ("vlm", "llm"): "llm"}


def check_pretrained(cfg: Config) -> None:
    """Each `sections.<s>.init.hf_path` exists and matches `models.<s>` field by field (before compiling)."""
    from maestro_jax.tools import hf

    for s, sc in cfg.sections.items():
        if sc.init is None:
            continue
        model = HF_MODELS.get((cfg.workload, s))
        if model is None:
            raise ConfigError(f"error: sections.{s}.init.hf_path={sc.init.hf_path!r}: section {s!r} has no Hugging "
                              f"Face importer; supported: {sorted(k[1] for k in HF_MODELS if k[0] == cfg.workload)}")
        try:
            fields = hf.llm_fields(sc.init.hf_path)
        except (hf.HFError, KeyError) as err:
            raise ConfigError(f"error: sections.{s}.init.hf_path={sc.init.hf_path!r}: {err}") from None
        mine = cfg.models[model].model_dump()
        for k, v in fields.items():
            if mine.get(k) != v:
                raise ConfigError(f"error: models.{model}.{k}={mine.get(k)!r}: the checkpoint {sc.init.hf_path} has "
                                  f"{k}={v!r}; set models.{model} to the checkpoint's shape ({fields})")


def load_pretrained(rt: Runtime, states: dict[str, SectionState]) -> dict[str, SectionState]:
    """Replace the random weights of sections with `init.hf_path` (KD teacher: its body and,
    in the student section, its output layer; KD student and VLM llm: the whole LLM)."""
    from maestro_jax.tools import hf

    states = dict(states)
    for s, sc in rt.cfg.sections.items():
        if sc.init is None:
            continue
        path, fields = sc.init.hf_path, hf.llm_fields(sc.init.hf_path)
        st = states[s]
        if (rt.cfg.workload, s) == ("kd", "teacher"):
            body = hf.load_llm(path, st.consts["llm"], fields, with_head=False)
            states[s] = SectionState(st.params, {**st.consts, "llm": body}, st.opt_state)
            student = states["student"]
            head = hf.output_layer(path, fields, student.consts["teacher_head"])
            states["student"] = SectionState(student.params, {**student.consts, "teacher_head": head},
                                             student.opt_state)
        else:
            params = hf.load_llm(path, st.params, fields)
            states[s] = SectionState(params, st.consts, rt.programs[s].init_optimizer(params))
    return states


def _init_section(graph, name, mesh, shardings, programs, key) -> SectionState:
    init = jax.jit(lambda k: nn.meta.unbox(graph.init(k)[name]), out_shardings=shardings)
    with jax.set_mesh(mesh):
        v = init(key)
    opt = programs.init_optimizer(v["params"]) if graph.section(name).trained else None
    return SectionState(v["params"], v["consts"], opt)


def build_runtime(cfg: Config) -> Runtime:
    """Check the whole plan (DESIGN.md section 3) before building or compiling anything."""
    graph = build_graph(cfg)
    check_pretrained(cfg)
    plan = cfg.plan()
    abstract = jax.eval_shape(lambda: graph.init(jax.random.key(cfg.seed)))  # traced only: no compile
    infos = {s: param_infos(abstract[s]) for s in graph.names}
    edges = tuple(plan_lib.EdgeInfo(e.name, e.src, e.dst) for e in graph.edges)
    state = {s: plan_lib.state_bytes_per_device(infos[s], plan.sections[s], graph.section(s).trained)
             for s in graph.names if s in plan.sections}
    budget = cfg.device_memory_gb * 2**30 if cfg.device_memory_gb else None
    plan_lib.check_plan(plan, num_devices=len(jax.devices()), edges=edges, sink=graph.sink, params=infos,
                        budget_bytes=budget, state=state)
    meshes = {s: section_mesh(plan.sections[s]) for s in graph.names}
    shardings = {s: variable_shardings(abstract[s], meshes[s], plan.sections[s].rules) for s in graph.names}
    trained = frozenset(s.name for s in graph.sections if s.trained)
    programs = {}
    for s in graph.names:
        sp = plan.sections[s]
        programs[s] = SectionPrograms(
            graph.section(s), meshes[s], shardings[s], make_optimizer(cfg.optimizer), sp.residuals,
            out_edges=tuple(e.name for e in graph.consumers_of(s)),
            diff_inputs=tuple(e.name for e in graph.producers_of(s) if e.src in trained),
            is_sink=s == graph.sink)
    problem = Problem(order=graph.topological_order(), sink=graph.sink, trained=trained, edges=edges,
                      rows={s: plan.sections[s].rows for s in graph.names},
                      dp={s: plan.sections[s].dp for s in graph.names},
                      fanout=dict(plan.fanout), max_in_flight=cfg.schedule.max_in_flight)
    return Runtime(cfg, graph, plan, problem, meshes, shardings, programs, Executor(graph, problem, programs),
                   abstract)


@dataclasses.dataclass
class MonolithicRuntime:
    model: Monolithic
    mesh: object
    shardings: dict

    def init_states(self, graph, cfg, seed=None) -> dict[str, SectionState]:
        key = jax.random.key(cfg.seed if seed is None else seed)
        out = {}
        for s in graph.names:
            init = jax.jit(lambda k, s=s: nn.meta.unbox(graph.init(k)[s]), out_shardings=self.shardings[s])
            with jax.set_mesh(self.mesh):
                v = init(key)
                opt = jax.jit(self.model.optimizers[s].init)(v["params"]) if graph.section(s).trained else None
            out[s] = SectionState(v["params"], v["consts"], opt)
        return out


def build_monolithic(rt: Runtime) -> MonolithicRuntime:
    cfg, graph = rt.cfg, rt.graph
    sp = cfg.monolithic_plan()
    mono_plan = plan_lib.Plan({s: sp for s in graph.names}, {}, cfg.global_batch)
    infos = {s: param_infos(rt.abstract[s]) for s in graph.names}
    try:
        plan_lib.check_resources(plan_lib.Plan({"all": sp}, {}, cfg.global_batch), len(jax.devices()))
        plan_lib.check_meshes(mono_plan)
        plan_lib.check_divisibility(mono_plan, graph.sink, infos)
    except plan_lib.PlanError as err:
        parts = err.key.split(".", 2)
        key = f"monolithic.{parts[2]}" if parts[0] == "sections" and len(parts) == 3 else err.key
        raise type(err)(key, err.value, err.problem) from None
    mesh = section_mesh(sp)
    shardings = {s: variable_shardings(rt.abstract[s], mesh, sp.rules) for s in graph.names}
    optimizers = {s: make_optimizer(cfg.optimizer) for s in graph.names if graph.section(s).trained}
    return MonolithicRuntime(Monolithic(graph, sp, mesh, shardings, optimizers), mesh, shardings)
