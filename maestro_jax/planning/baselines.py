"""What users run today, priced beside the fair monolithic baseline, and the ceiling.

The fair monolithic baseline (`monolithic_best`) gets everything maestro's sections get
but the sections: the same global length sort, dynamic shape buckets and padding, its best mesh,
micro-batch and checkpointing. Trainers in use today do less, and these prices say how much
less, each on the fair baseline's own layout (mesh, micro-batch, checkpointing, precision) and
cost model, so that only the named difference changes:

- `round_robin`: Megatron-LM's data order. Each micro-batch is the next `micro_batch x dp`
  samples in arrival order, dealt to the data-parallel ranks in contiguous slices
  (`MegatronPretrainingSampler`), no global length sort. Each rank pads its own micro-batch (its
  own shapes, as PyTorch runs them) and runs its micro-batches one after another; the ranks meet
  at the step's gradient reduction, so the step waits for the rank that drew the most work
  (Megatron-Bridge issue 4609: "a DP rank that draws a heavy-image shard stalls the whole group").
- `static_padding`: MaxText's static shapes. Every sample is padded to the most work any sample
  of the priced batches holds in each section (`max_num_images_per_example` images, the longest
  text), and every section runs for every sample (a static program cannot skip its encoder for
  a text-only sample).
- `shared_recipe` (workloads with a frozen section, such as distillation): the frozen sections in
  the trained sections' precision, as a KD recipe that gives the teacher the student's layout
  and precision does (Megatron/ModelOpt). Equal to the fair baseline where they share it already.
- `ceiling`: perfect balance and no padding: every sample's work in every section at its exact
  size, spread evenly over every device, no per-micro-step overhead, plus the optimizer steps.
  No schedule beats it on this cost model; `share` = ceiling time / a plan's time.

Each entry has `step_time_s` and `samples_per_s_per_device`, averaged over the problem's batches
as every other price is.

Every baseline, these and the two layouts searched on their own (the fair monolithic,
`monolithic_best`, and Megatron-LM's 1F1B pipeline, `pipeline.pipelined_best`), is a
plug-in behind one protocol (`Baseline`: `price` and `lines`), listed once in `BASELINES` in the
order they are priced (the users' baselines run on the fair monolithic one's layout, so after
it), and priced into a typed `BaselineResult`. A new baseline is one class and one entry there;
`plan` and `simulate` print `baseline_lines` and write `baselines_json`, reading no result by key.
Plain Python, no JAX.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import statistics
import weakref
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from maestro_jax.core.graph import UnitCost
from maestro_jax.core.plan import SectionPlan, mesh_shape
from maestro_jax.planning.cluster import cost_model, monolithic_time, packed_time
from maestro_jax.planning.cost import CostModel
from maestro_jax.planning.layout import divisors, group_memory, mesh_degrees, micro_batches
from maestro_jax.planning.pipeline import pipelined_best
from maestro_jax.planning.pricer import Pricer
from maestro_jax.planning.spec import SectionSpec, WorkloadSpec
from maestro_jax.planning.text import digits, layer_remat_text, mesh_text, seconds
from maestro_jax.schedule.ops import SampleMeta


def _factor(spec: WorkloadSpec, cost: CostModel, s: str) -> float:
    """A section's work per forward: the sink's loss and gradients, a trained producer's forward
    and backward, a frozen section's forward."""
    c = cost.sections[s]
    if s == spec.sink:
        return c.sink_factor
    return 1.0 + (c.backward_factor if spec.sections[s].trained else 0.0)


def round_robin_time(spec: WorkloadSpec, metas: Sequence, cost: CostModel, mb: int, dp: int) -> float:
    """One batch in Megatron-LM's data order (module docstring): the slowest rank's micro-batches,
    each padded to its own rows, then the optimizer steps."""
    rows = mb * dp
    ranks = [[m for i in range(0, len(metas), rows) for m in metas[i + r * mb : i + (r + 1) * mb]] for r in range(dp)]
    return max(packed_time(spec, mine, cost, mb, mb) for mine in ranks) + sum(cost.update_s.values())


def static_padding_time(
    spec: WorkloadSpec, metas: Sequence, most: Mapping[str, int], cost: CostModel, mb: int, dp: int
) -> float:
    """One batch with every sample padded to `most` (each section's largest work) in every
    section, `mb` rows a shard per micro-step, then the optimizer steps."""
    padded = SampleMeta(frozenset(s for s in spec.sections if most[s]), dict(most))
    return packed_time(spec, [padded] * len(metas), cost, mb, mb * dp) + sum(cost.update_s.values())


def ceiling_time(spec: WorkloadSpec, metas: Sequence, cost: CostModel, dp: int) -> float:
    """One batch at the ceiling (module docstring): each sample's exact work, no overheads, on
    every device at once."""
    total = 0.0
    for s in spec.sections:
        c = cost.sections[s]
        work = sum(c.per_unit_s * u + c.per_unit2_s * u * u for u in (m.work.get(s, 0) for m in metas))
        total += work * _factor(spec, cost, s) / dp
    return total + sum(cost.update_s.values())


def user_baselines(
    spec: WorkloadSpec,
    metas_all: Sequence[Sequence],
    layout: Mapping,
    devices: int,
    global_batch: int,
    device: str,
    link_gbps: float,
    typical: Mapping[str, float] | None = None,
) -> dict[str, dict[str, float]]:
    """`round_robin`, `static_padding`, `shared_recipe` (with a frozen section) and `ceiling` on
    the fair monolithic baseline's `layout` (`monolithic_best`: mesh, micro-batch,
    checkpointing by section) over all `devices`, each as {step_time_s, samples_per_s_per_device}
    (the plug-ins' records; `BASELINES` prices them typed)."""
    on = OnLayout(spec, metas_all, layout, devices, global_batch, device, link_gbps, typical)
    priced = {b.name: b.price_on(on) for b in BASELINES if isinstance(b, UsersBaseline)}
    return {k: r.to_json() for k, r in priced.items() if r is not None}


# ---- typed results and the registry ---------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BaselineResult:
    """One baseline priced on the problem's devices: its step time and per-device rate (averaged
    over the planning batches), the layout it runs where it has one of its own (mesh,
    micro-batch, checkpointing: one policy, or a policy a section), its peak memory where priced,
    the layout in words (`layout`), and `record`: the JSON object `plan --json` and `simulate`
    write for it (keys unchanged since 0.3.0)."""

    name: str
    step_time_s: float
    samples_per_s_per_device: float
    mesh: Mapping[str, int] | None = None
    micro_batch: int | None = None
    layer_remat: str | Mapping[str, str] | None = None
    peak_gb: float | None = None
    layout: str = ""
    record: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    devices: int | None = None  # the devices its layout spans, where it says

    def ratio(self, maestro_s: float) -> float:
        """This baseline's step time over maestro's `maestro_s` (above 1: maestro is faster)."""
        return self.step_time_s / maestro_s

    def to_json(self) -> dict:
        return dict(self.record)

    @classmethod
    def of_record(cls, name: str, record: Mapping[str, Any]) -> BaselineResult:
        """A users' baseline (or the ceiling) back from the record `to_json` wrote (a `simulate`
        report's `user_baselines`)."""
        return cls(name, record["step_time_s"], record["samples_per_s_per_device"], record=record)


def result_of(name: str, record: Mapping[str, Any] | None) -> BaselineResult | None:
    """Baseline `name`'s result back from the record `to_json` wrote (a `simulate` or `plan
    --json` report), by its own plug-in; None for none."""
    return None if record is None else next(b for b in BASELINES if b.name == name).from_record(record)


def monolithic_best(pricer: Pricer) -> dict | None:
    """The monolithic baseline's best layout, micro-batch and per-layer activation
    checkpointing on the problem's devices (every section's state on every device, the smallest
    fsdp that fits), with each section's own precision, and the same context and expert
    parallelism choices as the sections get, applied to all of it at once.

    Activation checkpointing is chosen per trained section (`layer_remat`: section -> policy,
    "none" for frozen ones): one program can checkpoint its ViT blocks and not its LLM
    blocks, as `jax.checkpoint` wraps each block kind with its own policy (MaxText's
    per-decoder-layer `remat_policy`), so the fair baseline gets the same freedom the
    sections get."""
    problem, spec = pricer.problem, pricer.problem.spec
    best, gb, n = None, problem.global_batch, problem.devices
    trained = [s for s in spec.order if spec.sections[s].trained]
    for tensor, context, expert in mesh_degrees(_all_in_one(spec), n, problem.contexts):
        dp = n // (tensor * context)
        for mb in micro_batches(gb, dp):  # the same micro-batches and padding as the sections get
            for remats in itertools.product(problem.layer_remat, repeat=len(trained)):
                remat = dict.fromkeys(spec.order, "none") | dict(zip(trained, remats))
                for fsdp in divisors(dp // expert):
                    mesh = mesh_shape(
                        data=dp // expert // fsdp, fsdp=fsdp, expert=expert, context=context, tensor=tensor
                    )
                    sp = SectionPlan(tuple(range(n)), mesh, mb)
                    t = _monolithic_time(pricer, sp, remat)
                    if t is None:
                        continue
                    if best is None or t < best["step_time_s"]:
                        best = {
                            "mesh": dict(sp.axis_sizes),
                            "micro_batch": mb,
                            "layer_remat": remat,
                            "step_time_s": t,
                            "samples_per_s_per_device": gb / t / n,
                        }
                    break  # the smallest fsdp that fits
    return best


def _all_in_one(spec: WorkloadSpec) -> SectionSpec:
    """Every section's leaves as one section: what the monolithic layout's meshes must shard."""
    return SectionSpec(
        "all",
        True,
        tuple(p for sec in spec.sections.values() for p in sec.leaves),
        UnitCost(flops=0.0, kv_width=max(sec.cost.kv_width for sec in spec.sections.values())),
    )


def _monolithic_time(pricer: Pricer, sp: SectionPlan, remat: Mapping[str, str]) -> float | None:
    """The monolithic step's mean time with every section on `sp` (each with its precision and
    `remat[s]`), or None where a sharded dimension does not divide or it does not fit. One
    program per micro-batch: each trained producer keeps one forward's residuals while the
    sections after it run, as co-located sections do (the monolithic step never packs)."""
    problem, spec = pricer.problem, pricer.problem.spec
    weights = {s: pricer.weights_on(s, sp.mesh) for s in spec.order}
    if None in weights.values():
        return None
    plans = {
        s: dataclasses.replace(sp, precision=sec.precision, layer_remat=remat[s]) for s, sec in spec.sections.items()
    }
    mems = [pricer.memory(s, plans[s], weights[s], 1, packed=False) for s in spec.order]
    if group_memory(mems) > problem.budget_bytes:
        return None
    cost = cost_model(spec, plans, problem.metas, problem.device, problem.link_gbps, pricer.typical_units, packed=False)
    return statistics.mean(monolithic_time(spec, m, cost, sp.micro_batch, sp.rows) for m in problem.metas)


class Baseline(Protocol):
    """A way users train the workload today, priced on the problem's devices and cost model."""

    name: str

    def price(self, pricer: Pricer, priced: Mapping[str, BaselineResult | None]) -> BaselineResult | None:
        """The result on `pricer`'s problem: its devices, memory budget and batches (None: no
        layout fits), given the baselines priced before it (`priced`, by name)."""

    def lines(self, result: BaselineResult | None, maestro_s: float) -> list[str]:
        """What `plan` and `simulate` print of `result` beside maestro's step time `maestro_s`."""

    def from_record(self, record: Mapping[str, Any]) -> BaselineResult:
        """The result whose `to_json` is `record`."""


class FairMonolithic:
    """Every section on every device with one layout: the best mesh, micro-batch and per-section
    checkpointing that fit (`monolithic_best`)."""

    name = "monolithic"

    def price(self, pricer, priced) -> BaselineResult | None:
        best = monolithic_best(pricer)
        return None if best is None else dataclasses.replace(self.from_record(best), devices=pricer.devices)

    def from_record(self, record) -> BaselineResult:
        mesh, mb, remat = record["mesh"], record["micro_batch"], record["layer_remat"]
        words = f"mesh {mesh_text(mesh)}, micro_batch {mb}, layer_remat {layer_remat_text(remat)}"
        t, rate = record["step_time_s"], record["samples_per_s_per_device"]
        return BaselineResult(self.name, t, rate, mesh, mb, remat, None, words, record)

    def lines(self, result, maestro_s) -> list[str]:
        if result is None:
            return ["monolithic: no layout fits in memory on these devices"]
        return [
            f"monolithic best layout: {result.layout}: predicted {result.step_time_s:.4g} s/step; planned maestro: "
            f"{maestro_s:.4g} s/step ({result.ratio(maestro_s):.3f}x)"
        ]


def pipelined_words(pipe: Mapping) -> str:
    """A 1F1B pipeline-parallel layout (`pipeline.pipelined_best`'s record) in words: stages,
    mesh, micro-batches and where each section's layers sit."""
    where = "; ".join(
        [f"{s} layers {'/'.join(map(str, n))}" for s, n in pipe["layers_per_stage"].items()]
        + [f"{s} whole in stage 1" for s in pipe["first_stage_whole"]]
    )
    return (
        f"{pipe['stages']} stages x {pipe['devices_per_stage']} devices, mesh {mesh_text(pipe['mesh'])}, "
        f"micro_batch {pipe['micro_batch']} ({pipe['micro_batches']} per step), layer_remat "
        f"{pipe['layer_remat']}; {where}"
    )


class Pipelined1F1B:
    """Megatron-LM's layout: the sink (and a teacher reading its tokens) cut into pipeline stages
    under the 1F1B schedule, encoders whole in the first stage (`planning.pipeline`)."""

    name = "pipelined"

    def price(self, pricer, priced) -> BaselineResult | None:
        best = pipelined_best(pricer)
        return None if best is None else self.from_record(best)

    def from_record(self, record) -> BaselineResult:
        return BaselineResult(
            self.name,
            record["step_time_s"],
            record["samples_per_s_per_device"],
            record["mesh"],
            record["micro_batch"],
            record["layer_remat"],
            record["peak_gb"],
            pipelined_words(record),
            record,
            devices=record["stages"] * record["devices_per_stage"],
        )

    def lines(self, result, maestro_s) -> list[str]:
        if result is None:
            return ["pipelined (1F1B): no layout fits in memory on these devices (or the sink has too few layers)"]
        return [
            f"pipelined (1F1B) best layout: {result.layout}: predicted {result.step_time_s:.4g} s/step; "
            f"planned maestro: {maestro_s:.4g} s/step ({result.ratio(maestro_s):.3f}x)"
        ]


@dataclasses.dataclass(frozen=True)
class OnLayout:
    """What the users' baselines are priced on: the fair monolithic layout (`layout`: mesh,
    micro-batch, checkpointing by section) over all `devices`, and its cost model."""

    spec: WorkloadSpec
    metas_all: Sequence[Sequence]
    layout: Mapping
    devices: int
    global_batch: int
    device: str
    link_gbps: float
    typical: Mapping[str, float] | None = None

    @property
    def plan(self) -> SectionPlan:
        return SectionPlan(tuple(range(self.devices)), mesh_shape(**self.layout["mesh"]), self.layout["micro_batch"])

    def plans(self, precision: str | None = None, only: Sequence[str] = ()) -> dict[str, SectionPlan]:
        """Each section on the layout in its own precision (or `precision`, for the sections in
        `only`)."""
        sp = self.plan
        return {
            s: dataclasses.replace(
                sp,
                precision=precision if s in only else sec.precision,
                layer_remat=self.layout["layer_remat"][s],
            )
            for s, sec in self.spec.sections.items()
        }

    def cost(self, plans: Mapping[str, SectionPlan] | None = None) -> CostModel:
        """The cost model of `plans`, by default the layout's own (computed once: every users'
        baseline but the shared recipe prices on it)."""
        if plans is None:
            return self._layout_cost
        return cost_model(self.spec, plans, self.metas_all, self.device, self.link_gbps, self.typical, packed=False)

    @functools.cached_property
    def _layout_cost(self) -> CostModel:
        return self.cost(self.plans())

    def result(self, name: str, times: Sequence[float]) -> BaselineResult:
        t = statistics.mean(times)
        rate = self.global_batch / t / self.devices
        return BaselineResult(name, t, rate, record={"step_time_s": t, "samples_per_s_per_device": rate})


_ON_LAYOUT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # pricer -> (its monolithic result, OnLayout)


def _on_layout(pricer: Pricer, mono: BaselineResult) -> OnLayout:
    """The fair monolithic layout `mono` on `pricer`'s problem, one per pair: the users'
    baselines priced on it share its cost model."""
    held = _ON_LAYOUT.get(pricer)
    if held is not None and held[0] is mono:
        return held[1]
    layout = {"mesh": mono.mesh, "micro_batch": mono.micro_batch, "layer_remat": mono.layer_remat}
    on = OnLayout(
        pricer.spec,
        pricer.metas,
        layout,
        pricer.devices,
        pricer.global_batch,
        pricer.device,
        pricer.link_gbps,
        pricer.typical_units,
    )
    _ON_LAYOUT[pricer] = (mono, on)
    return on


class UsersBaseline:
    """A baseline priced on the fair monolithic baseline's layout (module docstring): `price_on`
    one `OnLayout`; none where the fair monolithic baseline found no layout."""

    name = ""
    text = ""  # how `lines` names it

    def price(self, pricer, priced) -> BaselineResult | None:
        mono = priced.get("monolithic")
        if mono is None:
            return None
        return self.price_on(_on_layout(pricer, mono))

    def price_on(self, on: OnLayout) -> BaselineResult | None:
        raise NotImplementedError

    def from_record(self, record) -> BaselineResult:
        return BaselineResult.of_record(self.name, record)

    def lines(self, result, maestro_s) -> list[str]:
        if result is None:
            return []
        return [
            f"users' baseline, {self.text}: predicted {seconds(result.step_time_s)}/step "
            f"({result.ratio(maestro_s):.3f}x maestro's step time)"
        ]


class RoundRobin(UsersBaseline):
    name, text = "round_robin", "Megatron-style data order (round robin to ranks, no length sort)"

    def price_on(self, on: OnLayout) -> BaselineResult:
        cost, sp = on.cost(), on.plan
        return on.result(self.name, [round_robin_time(on.spec, m, cost, sp.micro_batch, sp.dp) for m in on.metas_all])


class StaticPadding(UsersBaseline):
    name, text = "static_padding", "static image slots (every sample padded to the most items)"

    def price_on(self, on: OnLayout) -> BaselineResult:
        cost, sp, spec = on.cost(), on.plan, on.spec
        most = {s: max(m.work.get(s, 0) for metas in on.metas_all for m in metas) for s in spec.sections}
        times = [static_padding_time(spec, m, most, cost, sp.micro_batch, sp.dp) for m in on.metas_all]
        return on.result(self.name, times)


class SharedRecipe(UsersBaseline):
    name, text = "shared_recipe", "shared-recipe KD (the frozen sections in the trained ones' precision)"

    def price_on(self, on: OnLayout) -> BaselineResult | None:
        spec = on.spec
        frozen = [s for s in spec.order if not spec.sections[s].trained]
        if not frozen:
            return None
        shared = on.cost(on.plans(spec.sections[spec.sink].precision, frozen))
        sp = on.plan
        return on.result(self.name, [monolithic_time(spec, m, shared, sp.micro_batch, sp.rows) for m in on.metas_all])


class Ceiling(UsersBaseline):
    name = "ceiling"

    def price_on(self, on: OnLayout) -> BaselineResult:
        cost, sp = on.cost(), on.plan
        return on.result(self.name, [ceiling_time(on.spec, m, cost, sp.dp) for m in on.metas_all])

    def lines(self, result, maestro_s) -> list[str]:
        if result is None:
            return []
        ceiling = result.step_time_s
        beyond = " (its own layouts do better than the monolithic one's)" if maestro_s < ceiling else ""
        return [
            f"ceiling of the monolithic layout (perfect balance, no padding, every device busy): {seconds(ceiling)}/step; "
            f"maestro reaches {digits(100 * ceiling / maestro_s)}% of it{beyond}"
        ]


# in pricing order: the users' baselines and the ceiling run on the fair monolithic one's layout
BASELINES: tuple[Baseline, ...] = (
    FairMonolithic(),
    Pipelined1F1B(),
    RoundRobin(),
    StaticPadding(),
    SharedRecipe(),
    Ceiling(),
)
USERS = tuple(b.name for b in BASELINES if isinstance(b, UsersBaseline))


def price_baselines(pricer: Pricer, names: Sequence[str] | None = None) -> dict[str, BaselineResult | None]:
    """Every baseline of `BASELINES` (or those `names`, with what they are priced on) on
    `pricer`'s problem, in order: name -> result (None: no layout). A `Planner` stands for its
    pricer (0.3.0's callers)."""
    pricer = getattr(pricer, "pricer", pricer)
    wanted = None if names is None else set(names) | _needs(names)
    priced: dict[str, BaselineResult | None] = {}
    for b in BASELINES:
        if wanted is None or b.name in wanted:
            priced[b.name] = b.price(pricer, priced)
    return priced


def _needs(names: Sequence[str]) -> set[str]:
    """The baselines those `names` are priced on: the users' baselines need the fair monolithic one."""
    return {"monolithic"} if set(names) & set(USERS) else set()


def baseline_lines(priced: Mapping[str, BaselineResult | None], maestro_s: float) -> list[str]:
    """What `plan` prints of the baselines: each one's lines in `BASELINES` order."""
    return [line for b in BASELINES if b.name in priced for line in b.lines(priced[b.name], maestro_s)]


def baselines_json(priced: Mapping[str, BaselineResult | None]) -> dict:
    """The baselines as `plan --json` writes them: `monolithic` and `pipelined` (null where none
    fits), the users' baselines and the ceiling under `user_baselines` (null without a monolithic
    layout)."""
    users = {k: r.to_json() for k, r in priced.items() if k in USERS and r is not None}
    out = {k: None if priced.get(k) is None else priced[k].to_json() for k in ("monolithic", "pipelined")}
    return out | {"user_baselines": users or None}
