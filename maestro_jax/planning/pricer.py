"""What a plan costs under one planning problem, and the answers kept.

Plain Python, no JAX. A `Pricer` answers every price question the search (`planner.Planner`)
and the baselines ask of one `PlanningProblem`: a section's memory per device on a layout
(`planning/layout.py`), its cost coefficients and lower bound on the step there
(`cluster.section_cost`, `section_bound`), its shortest micro-steps, a plan's extra stash under
run-ahead, the runtime's constraint check, the simulated step time and where the device time
goes. It keeps what it computed; `for_problem` gives a changed problem a pricer that keeps
what the change leaves valid (a stash bound, run-ahead or device count leaves every layout's
cost and weights valid), and `staged` the pricer of the workload with sections in pipeline
stages, each stage priced as a section of its own.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterator, Mapping

from maestro_jax.core.plan import Plan, SectionPlan, check_plan
from maestro_jax.core.stages import stage_name
from maestro_jax.planning.cluster import cost_model, section_cost, typical_units
from maestro_jax.planning.cost import DEVICES, CostModel, SectionCost
from maestro_jax.planning.layout import ShardedLeaves, section_memory
from maestro_jax.planning.problem import PlanningProblem
from maestro_jax.planning.simulator import DEVICE_TIME, device_time, section_time, simulate
from maestro_jax.planning.spec import WorkloadSpec, staged_metas
from maestro_jax.schedule import wavefront
from maestro_jax.schedule.ops import ahead_sections, delivered, pipeline_bounds
from maestro_jax.schedule.packing import TokenBudget, slots


class Pricer:
    """Prices of plans of `problem` (module docstring). Its caches: each layout's cost and bound
    (valid for the same workload, batches, device and links), each section's weights per
    device by mesh (the same workload), each plan's step time (this problem alone) and the
    pricers of the workload in stages (by stage counts)."""

    def __init__(self, problem: PlanningProblem):
        self.problem = problem
        self.serial = DEVICES[problem.device].get("serial", False)
        self._index_batches()
        self._prices: dict[tuple, tuple[SectionCost, float]] = {}
        self._weights: dict[tuple, tuple[float, float] | None] = {}
        self._times: dict[tuple, float] = {}
        self._staged: dict[tuple, Pricer] = {}  # this problem in stages, by stage counts
        self._staged_twins: dict[tuple, Pricer] = {}  # any stash bound's: whose prices a new one shares

    # what a baseline reads of the problem it is priced on (`pipeline.Search`): the same
    # workload, batches, devices, budget and cost model as the search beside it
    @property
    def spec(self) -> WorkloadSpec:
        return self.problem.spec

    @property
    def metas(self) -> tuple:
        return self.problem.metas

    @property
    def devices(self) -> int:
        return self.problem.devices

    @property
    def global_batch(self) -> int:
        return self.problem.global_batch

    @property
    def budget(self) -> float:
        return self.problem.budget_bytes

    @property
    def device(self) -> str:
        return self.problem.device

    @property
    def link_gbps(self) -> float:
        return self.problem.link_gbps

    @property
    def layer_remat(self) -> tuple[str, ...]:
        return self.problem.layer_remat

    @property
    def contexts(self) -> tuple[int, ...]:
        return self.problem.contexts

    def for_problem(self, problem: PlanningProblem) -> Pricer:
        """A pricer of `problem` holding this one's answers that `problem` leaves valid: the
        weights for the same workload, the layouts' costs and bounds (and the staged pricers'
        ones) for the same workload, batches, device and links."""
        other = Pricer(problem)
        old = self.problem
        if problem.spec is old.spec:
            other._weights = self._weights
            if problem.metas is old.metas and (problem.device, problem.link_gbps) == (old.device, old.link_gbps):
                other._prices, other._staged_twins = self._prices, self._staged_twins
        return other

    def _index_batches(self) -> None:
        """What the prices and bounds read of the workload and its planning batches, computed once."""
        p = self.problem
        spec, metas = p.spec, p.metas
        trained = frozenset(s for s, sec in spec.sections.items() if sec.trained)
        self.ahead = ahead_sections(spec.order, trained, spec.edges) if p.run_ahead else frozenset()
        # edges whose producer runs ahead into a consumer that does not: the consumer holds the
        # next batch's rows of them through the step (`ahead_stash`), the most units a batch sends
        self.ahead_edges = [
            (e, max(sum(m.work.get(e.src, 0) for m in b) for b in metas))
            for e in spec.edges
            if e.src in self.ahead and e.dst not in self.ahead
        ]
        self._stash = pipeline_bounds(spec.stages)  # a pipeline stage's 1F1B bound on forwards in flight
        self.max_units = {s: max((m.work.get(s, 0) for b in metas for m in b), default=1) for s in spec.order}
        self.typical_units = {s: typical_units(s, metas) for s in spec.order}
        # each section's work units per sample, largest first, by batch: what its bound reads
        self._units_desc = {
            s: [sorted((m.work[s] for m in batch if s in m.work), reverse=True) for batch in metas] for s in spec.order
        }
        self.min_units = {s: min((m.work[s] for b in metas for m in b if s in m.work), default=0) for s in spec.order}
        self._leaves = {s: (ShardedLeaves(sec.params), ShardedLeaves(sec.consts)) for s, sec in spec.sections.items()}

    # -- memory -------------------------------------------------------------------------------
    def memory(
        self,
        section: str,
        sp: SectionPlan,
        weights: tuple[float, float] | None = None,
        in_flight: int | None = None,
        packed: bool = True,
    ) -> dict[str, float]:
        """`section`'s memory per device on `sp` (`layout.section_memory`). `in_flight`: forwards
        a trained producer keeps residuals for (default `max_in_flight`, or less for a pipeline
        stage: 1F1B's bound, `schedule.ops.pipeline_bounds`); `packed`: a section that packs
        sequences holds its packed rows (False: the monolithic step's)."""
        spec, most = self.problem.spec, self.problem.max_in_flight
        return section_memory(
            spec.sections[section],
            sp,
            section == spec.sink,
            self.max_units[section],
            in_flight or min(most, self._stash.get(section, most)),
            weights,
            spec.pack.get(section, 1) if packed else 1,
            spec.buckets_per_octave,
        )

    def weights_on(self, section: str, mesh: tuple[int, ...]) -> tuple[float, float] | None:
        """Per-device bytes of `section`'s trained and frozen weights on `mesh`, or None when the
        mesh does not divide a sharded dimension. Once per mesh: a section's options on one mesh
        differ only in micro-batch and checkpointing, which leave the weights alone."""
        key = (section, mesh)
        if key not in self._weights:
            params, consts = (leaves.per_device(mesh) for leaves in self._leaves[section])
            self._weights[key] = None if params is None or consts is None else (params, consts)
        return self._weights[key]

    def with_stash(self, plan: Plan, memory: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
        """`memory` with, under run-ahead, each consumer of a section that runs ahead holding the
        next batch's rows of that edge through the step: per device, what its shard receives
        (`delivered`: the whole rows of each producer shard that feeds it, `width` of the DP(p)
        shards of the batch), at the most units any planning batch sends."""
        if not self.ahead_edges:
            return memory
        out = dict(memory)
        for e, units in self.ahead_edges:
            p, c = plan.sections[e.src], plan.sections[e.dst]
            extra = (
                self.problem.run_ahead * self.problem.spec.edge_bytes[e.name] * units * delivered(p.dp, c.dp)[1] / p.dp
            )
            m = out[e.dst]
            out[e.dst] = {
                **m,
                "activations": m["activations"] + extra,
                "held": m["held"] + extra,
                "total": m["total"] + extra,
            }
        return out

    def check(self, plan: Plan) -> dict[str, dict[str, float]]:
        """The runtime's constraint checks on a whole plan; raises PlanError. Returns the memory."""
        counts = self.stage_counts(plan)
        if counts:
            return self.staged(counts).check(plan)
        p, spec = self.problem, self.problem.spec
        mem = self.with_stash(plan, {s: self.memory(s, sp) for s, sp in plan.sections.items()})
        check_plan(
            plan,
            num_devices=p.devices,
            edges=spec.edges,
            sink=spec.sink,
            params={s: sec.leaves for s, sec in spec.sections.items()},
            budget_bytes=p.budget_bytes,
            state={s: m["state"] for s, m in mem.items()},
            activations={s: m["activations"] for s, m in mem.items()},
            held={s: m["held"] for s, m in mem.items()},
        )
        return mem

    # -- a section on a layout ----------------------------------------------------------------
    def price(self, section: str, sp: SectionPlan) -> tuple[SectionCost, float]:
        """`section`'s cost coefficients on `sp` and its bound on the step (`section_bound`), once
        per layout for every stash bound, run-ahead setting and device count (`for_problem`)."""
        key = (
            section,
            len(sp.devices),
            sp.mesh,
            sp.micro_batch,
            sp.residuals,
            sp.layer_remat,
        )  # hashing devices is slow
        if key not in self._prices:
            cost = self.section_cost(section, sp)
            self._prices[key] = cost, self.section_bound(section, sp, cost)
        return self._prices[key]

    def section_cost(self, section: str, sp: SectionPlan) -> SectionCost:
        p, spec = self.problem, self.problem.spec
        return section_cost(
            spec.sections[section],
            sp,
            p.metas,
            p.device,
            p.link_gbps,
            section == spec.sink,
            self.typical_units[section],
            spec.pack.get(section, 1),
            spec.buckets_per_octave,
        )

    def section_bound(self, section: str, sp: SectionPlan, cost: SectionCost) -> float:
        """No section finishes before its own micro-steps are done, however its samples are
        packed. Two valid floors, the larger is kept: (a) the rows' unpadded work spread over the
        data shards, or each micro-step's overlapped collectives if longer, plus each micro-step's
        overhead; (b) padding: a micro-step costs at least its
        largest row's bucket, and over any packing into micro-steps of `rows` samples the sum of
        those largest rows is at least that of the sorted packing (every `rows`-th largest). A
        section that packs sequences (`schedule.packing`) takes `slots` samples a micro-step: in the
        count form still `micro_batch` rows a shard, each at least its largest sample long; under a
        token budget at least one row of the budget (a packed row's work is at least its samples')."""
        spec = self.problem.spec
        sec, sink = spec.sections[section], section == spec.sink
        cm = CostModel({section: cost})
        factor = cost.sink_factor if sink else 1.0 + (cost.backward_factor if sec.trained else 0.0)
        pack = spec.pack.get(section, 1)
        bounds, rows, dp, mb = [], slots(sp.rows, pack), sp.dp, sp.micro_batch
        linear, quadratic = cost.per_unit_s, cost.per_unit2_s
        for units in self._units_desc[section]:
            steps = math.ceil(len(units) / rows)
            work = steps * cost.overhead_s + max(
                sum([linear * u + quadratic * u * u for u in units]) / dp, steps * cost.overlapped_s
            )
            if isinstance(pack, TokenBudget):
                padded = steps * cm.step_time(section, "F", [pack.tokens], 1)
            else:
                padded = sum(cm.step_time(section, "F", [units[j * rows]], mb) for j in range(steps))
            bounds.append(factor * max(work, padded))
        return statistics.mean(bounds)

    def shortest(self, section: str, sp: SectionPlan, cost: SectionCost) -> tuple[float, float]:
        """The shortest forward and backward micro-steps of `section`: at the fewest units any
        sample has there. The sink's forward is its loss-and-grad; a section that runs ahead
        has no forward in the step (computed the step before), a frozen one no backward. Under a
        token budget (`schedule.packing`) a micro-step runs at least one row of the budget."""
        spec = self.problem.spec
        cm, units, mb = CostModel({section: cost}), [self.min_units[section]], sp.micro_batch
        if isinstance(budget := spec.pack.get(section), TokenBudget):
            units, mb = [budget.tokens], 1
        if section == spec.sink:
            return cm.step_time(section, "L", units, mb), 0.0
        forward = 0.0 if section in self.ahead else cm.step_time(section, "F", units, mb)
        return forward, cm.step_time(section, "B", units, mb) if spec.sections[section].trained else 0.0

    # -- whole plans --------------------------------------------------------------------------
    def stage_counts(self, plan: Plan) -> dict[str, int]:
        """The sections `plan` holds in pipeline stages, with their stage counts."""
        out = {}
        for s in self.problem.spec.splits:
            k = 0
            while stage_name(s, k) in plan.sections:
                k += 1
            if k:
                out[s] = k
        return out

    def staged(self, counts: Mapping[str, int]) -> Pricer:
        """The pricer of the workload with the sections of `counts` in that many pipeline stages
        (`WorkloadSpec.staged`, its batches `staged_metas`), without run-ahead or a stage search:
        each stage priced as a section of its own (its leaves, its declared cost, 1F1B's stash
        bound). Its layouts' prices are shared with every pricer `for_problem` derives from this one."""
        counted = tuple(sorted(counts.items()))
        if counted not in self._staged:
            twin = self._staged_twins.get(counted)
            if twin is None:
                spec = self.problem.spec.staged(counts)
                metas = tuple(staged_metas(self.problem.metas, spec))
                staged = Pricer(self.problem.replace(spec=spec, metas=metas, run_ahead=0, stage_counts=()))
                self._staged_twins[counted] = staged
            else:
                staged = twin.for_problem(
                    self.problem.replace(spec=twin.problem.spec, metas=twin.problem.metas, run_ahead=0, stage_counts=())
                )
            self._staged[counted] = staged
        return self._staged[counted]

    def step_time(self, plan: Plan) -> float:
        """`plan`'s simulated step time, averaged over the planning batches."""
        counts = self.stage_counts(plan)
        if counts:  # simulated with each stage a section of its own
            return self.staged(counts).step_time(plan)
        key = plan_key(plan)
        if key not in self._times:
            self._times[key] = statistics.mean(t.makespan for t, *_ in self.simulated(plan))
        return self._times[key]

    def device_time(self, plan: Plan) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
        """Where `plan`'s device time goes (`simulator.device_time`: work, padding, overheads,
        collectives, optimizer, idle) and the same by section (`simulator.section_time`),
        shares averaged over the planning batches."""
        counts = self.stage_counts(plan)
        if counts:
            return self.staged(counts).device_time(plan)
        sims = list(self.simulated(plan))
        shares = [device_time(*sim) for sim in sims]
        by_section = [section_time(*sim) for sim in sims]
        return (
            {k: statistics.mean(d[k] for d in shares) for k in DEVICE_TIME},
            {s: {k: statistics.mean(d[s][k] for d in by_section) for k in DEVICE_TIME[:-1]} for s in by_section[0]},
        )

    def simulated(self, plan: Plan) -> Iterator[tuple]:
        """(timeline, schedule, problem, metas, cost) of `plan`'s wavefront step on each planning
        batch, priced by the analytic model."""
        p, spec = self.problem, self.problem.spec
        cost = cost_model(spec, dict(plan.sections), p.metas, p.device, p.link_gbps, self.typical_units)
        problem = spec.problem(plan, p.max_in_flight, p.run_ahead, p.balance_shards)
        devices = {s: len(sp.devices) for s, sp in plan.sections.items()}
        for m in p.metas:
            schedule = wavefront(m, problem, cost)
            yield simulate(schedule, problem, m, cost, devices=devices, serial=self.serial), schedule, problem, m, cost


def plan_key(plan: Plan) -> tuple:
    """A plan's sections as a hashable value."""
    return tuple(plan.sections.items())
