"""Each section's options: the layouts it can take on a device count, priced and pruned.

Plain Python, no JAX. For a section on `n` devices: every tensor, context and expert degree,
micro-batch, residual policy and per-layer checkpointing (`layouts`), the meshes by fsdp degree,
the smallest that fits the budget kept (or the lightest); the options no other beats in every
cost coefficient and memory kind (`_undominated`); in pipeline stages where the problem asks for
stage counts (`staged`); under shares of the budget when co-located (`shared`); and each
section's floor on at most `m` devices (`floor`), what the search bounds unchosen sections with.
Prices come from the problem's `Pricer`; the search (`planner.Planner`) combines the options.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Mapping

from maestro_jax.core.plan import SectionPlan, mesh_shape
from maestro_jax.core.stages import stage_name
from maestro_jax.planning.bounds import FLOORED, Option, backs
from maestro_jax.planning.layout import divisors, mesh_degrees, micro_batches
from maestro_jax.planning.pricer import Pricer


class SectionOptions:
    """The options of `pricer`'s problem's sections, kept once computed (by device count, budget
    and kind), each priced once per layout."""

    def __init__(self, pricer: Pricer, staged: dict | None = None):
        self.pricer, self.problem, self.spec = pricer, pricer.problem, pricer.problem.spec
        self._options: dict[tuple, list[Option]] = {}
        self._layouts_by_count: dict[tuple, list] = {}
        self._priced: dict[tuple, Option] = {}
        self._shared: dict[tuple, list[Option]] = {}
        self._floors: dict[tuple, list[Option]] = {}
        # the enumerations of the workload in stages (`staged`), by stage counts and stash bound
        self._staged: dict[tuple, SectionOptions] = {} if staged is None else staged

    def with_pricer(self, pricer: Pricer) -> SectionOptions:
        """The options of `pricer`'s problem (this workload with other settings), sharing the
        staged enumerations."""
        return SectionOptions(pricer, self._staged)

    def options(
        self, section: str, n: int, budget: float | None = None, lightest: bool = False, alone: bool = True
    ) -> list[Option]:
        """Every layout of `section` on `n` devices that passes its own constraints and fits;
        `lightest`: with the fsdp degree that needs the least memory instead of the smallest that fits;
        `alone`: with the layouts in pipeline stages (a section in stages has its devices alone)."""
        budget = self.problem.budget_bytes if budget is None else budget
        key = (section, n, budget, lightest, alone)
        if key in self._options:
            return self._options[key]
        out = []
        for variants in self.layouts(section, n):
            fits = [(sp, mem) for sp, mem in variants if mem["total"] <= budget]
            if fits:
                out.append(self.option(section, *(min(fits, key=lambda f: f[1]["total"]) if lightest else fits[0])))
        kept = out if lightest else self._undominated(section, out)
        for k in self.problem.stage_counts if alone and not self.problem.run_ahead else ():
            # a stage on a power-of-two number of devices, as pipelines are laid out (a node, a
            # part of one, or whole nodes): the search prices every stage count on every such
            # device count, and each costs as much as pricing the section K times
            per_stage = n // k
            # a section that packs is never offered in stages: the runtime's stages do not pack
            # (`sections.<s>.stages` refuses `pack`), so no config could run the plan
            cuttable = k in self.spec.splits.get(section, {}) and section not in self.spec.pack
            if cuttable and n % k == 0 and per_stage & (per_stage - 1) == 0:
                staged = self._staged_options(section, k, n, budget, lightest)
                kept += staged if lightest else self._undominated(section, staged)
        self._options[key] = sorted(kept, key=lambda o: o.bound)  # the search stops at the first too slow
        return self._options[key]

    # -- pipeline stages ----------------------------------------------------------------------
    def staged(self, counts: Mapping[str, int]) -> SectionOptions:
        """The options of the workload with the sections of `counts` in that many pipeline stages
        (`Pricer.staged`: each stage priced as a section of its own, its leaves, its declared
        cost, 1F1B's stash bound). Without run-ahead (a stage never runs ahead; `options` offers
        stages only without it). Shared by the enumerations `with_pricer` derives."""
        key = (tuple(sorted(counts.items())), self.problem.max_in_flight)
        if key not in self._staged:
            self._staged[key] = SectionOptions(self.pricer.staged(counts))
        return self._staged[key]

    def _staged_options(self, section: str, k: int, n: int, budget: float, lightest: bool) -> list[Option]:
        """`section` in `k` pipeline stages on `n` devices: stage i on the i-th consecutive
        `n / k` of them, every stage with one mesh, micro-batch and checkpointing (as the config
        gives them: `sections.<s>.stages`), the smallest fsdp degree at which every stage fits
        (`lightest`: the least memory). Each stage priced as a section (`staged`), then
        summed up as one option (`_staged_option`)."""
        sub = self.staged({section: k})
        names = [stage_name(section, i) for i in range(k)]
        loss_last = section == self.spec.sink

        def key(sp: SectionPlan, i: int) -> tuple:
            a = sp.axis_sizes
            # the last stage of a sink holds the loss: no residual policy of its own
            res = None if i == k - 1 and loss_last else sp.residuals
            return sp.micro_batch, res, sp.layer_remat, a["tensor"], a["context"], a["expert"]

        # stages alike (the same leaves' shapes, cost and role: the middle stages of an even cut)
        # are priced once, under the first one's name
        def signature(name: str) -> tuple:
            st = sub.spec.sections[name]
            shapes = tuple((p.shape, p.logical, p.itemsize) for p in st.leaves)
            return st.trained, st.cost, st.precision, shapes, name == sub.spec.sink

        first_alike: dict[tuple, str] = {}
        priced_as = {name: first_alike.setdefault(signature(name), name) for name in names}
        later = []
        for i, name in enumerate(names[1:], 1):
            index = {}
            for variants in sub.layouts(name, n // k):
                index[key(variants[0][0], i)] = {sp.mesh: (sp, mem) for sp, mem in variants}
            later.append(index)
        out = []
        for variants in sub.layouts(names[0], n // k):
            fits = []
            for sp, mem in variants:
                stages = [(sp, mem)]
                for i, index in enumerate(later, 1):
                    found = index.get(key(sp, i), {}).get(sp.mesh)
                    if found is None:
                        break
                    stages.append(found)
                if len(stages) == k and all(m["total"] <= budget for _, m in stages):
                    fits.append(stages)
            if fits:
                chosen = min(fits, key=lambda f: max(m["total"] for _, m in f)) if lightest else fits[0]
                parts = tuple(
                    dataclasses.replace(sub.option(priced_as[name], sp, mem), memory=mem)
                    for name, (sp, mem) in zip(names, chosen)
                )
                out.append(self._staged_option(section, n, parts))
        return out

    def _staged_option(self, section: str, n: int, parts: tuple[Option, ...]) -> Option:
        """One option of a section from its stages' options. Its plan: the section's mesh over
        all `n` devices (the stages' data axis times their count, as `sections.<s>.mesh` states
        it). Its bound: each stage's own (on its own devices), after the shortest forwards of the
        stages before it and before their shortest backwards (1F1B's fill and drain), the
        largest such; its shortest micro-steps: a sample's path through the stages from where its inputs enter to where its
        outputs leave (for a sink, each stage's forward, the loss, and the stages' backwards
        back down); its memory: each kind's largest over the
        stages (what any device of the section holds at most, conservatively)."""
        first = parts[0].plan
        sizes = dict(first.axis_sizes, data=first.axis_sizes["data"] * len(parts))
        plan = dataclasses.replace(first, devices=tuple(range(n)), mesh=mesh_shape(**sizes))
        memory = {kind: max(p.memory[kind] for p in parts) for kind in parts[0].memory}
        busiest = max(parts, key=lambda p: p.forwards + p.backwards)
        split = self.spec.splits[section][len(parts)]
        # a sample's path through the stages: in at the latest stage an input edge enters, out at
        # the earliest an output edge leaves (a KD student reads its teacher in its last stage)
        a = max(split.consumes.values(), default=0)
        z = min(split.produces.values(), default=len(parts) - 1)
        if section == self.spec.sink:  # stages before the last are trained producers of the loss
            forward = sum(p.forward + p.backward for p in parts[a:-1]) + parts[-1].forward
            backward, forwards, backwards = 0.0, busiest.forwards + busiest.backwards, 0.0
        else:
            forward, backward = sum(p.forward for p in parts[a : z + 1]), sum(p.backward for p in parts[a : z + 1])
            forwards, backwards = busiest.forwards, busiest.backwards
        # stage j starts after one forward of each stage before it; after its last op (a
        # backward, or a frozen section's last forward) one backward of each stage before it
        # (one forward of each after it) still follows, beside its optimizer step
        trained = self.spec.sections[section].trained
        bound = max(
            sum(p.forward for p in parts[:j])
            + part.bound
            - part.update
            + max(
                part.update, sum(p.backward for p in parts[:j]) if trained else sum(p.forward for p in parts[j + 1 :])
            )
            for j, part in enumerate(parts)
        )
        return Option(
            plan,
            memory,
            None,
            bound,
            forward,
            backward,
            forwards,
            backwards,
            max(p.update for p in parts),
            parts,
        )

    def layouts(self, section: str, n: int) -> list[list[tuple[SectionPlan, dict]]]:
        """`section`'s layouts on `n` devices with their memory: for each tensor, context and
        expert degree, micro-batch and checkpointing, the meshes by fsdp degree, smallest first
        (once per device count: `options` picks from them for each budget)."""
        key = (section, n)
        if key in self._layouts_by_count:
            return self._layouts_by_count[key]
        sec, sink = self.spec.sections[section], section == self.spec.sink
        devices, out = tuple(range(n)), []
        for tensor, context, expert in mesh_degrees(sec, n, self.problem.contexts):
            dp = n // (tensor * context)
            choices = micro_batches(self.problem.global_batch, dp)
            if not choices:
                continue  # before pricing its meshes: at scale most degrees leave no micro-batch
            meshes = []  # by fsdp degree, smallest first: each mesh that can shard the weights, with their bytes
            for fsdp in divisors(dp // expert):
                mesh = mesh_shape(data=dp // expert // fsdp, fsdp=fsdp, expert=expert, context=context, tensor=tensor)
                weights = self.pricer.weights_on(section, mesh)
                if weights is not None:
                    meshes.append((mesh, weights))
            for mb in choices:
                for res, remat in itertools.product(
                    self.problem.residuals if sec.trained and not sink else ("vjp",),
                    self.problem.layer_remat if sec.trained else ("none",),
                ):
                    variants = []
                    for mesh, weights in meshes:
                        sp = SectionPlan(devices, mesh, mb, res, precision=sec.precision, layer_remat=remat)
                        variants.append((sp, self.pricer.memory(section, sp, weights)))
                    if variants:
                        out.append(variants)
        self._layouts_by_count[key] = out
        return out

    def option(self, section: str, sp: SectionPlan, mem: dict) -> Option:
        """`sp` priced: its cost, bound and shortest micro-steps (once per layout, whatever the
        budget; the cost and bound once for every stash bound and run-ahead setting, `_with`)."""
        key = (
            section,
            len(sp.devices),
            sp.mesh,
            sp.micro_batch,
            sp.residuals,
            sp.layer_remat,
        )  # hashing devices is slow
        if key not in self._priced:
            cost, work = self.pricer.price(section, sp)
            back = work * cost.backward_factor / (1.0 + cost.backward_factor) if backs(self.spec, section) else 0.0
            self._priced[key] = Option(
                sp,
                mem,
                cost,
                work + cost.update_s,
                *self.pricer.shortest(section, sp, cost),
                work - back,
                back,
                cost.update_s,
            )
        return self._priced[key]

    def _undominated(self, section: str, options: list[Option]) -> list[Option]:
        """Drop an option when another with the same data-parallel degree and micro-batch (all
        that fanouts and the schedule see of it; and the same stage count) costs no more in every coefficient of the cost
        model and needs no more memory of each kind: it can only tie or lose, alone or sharing
        devices with other sections. Keeps the search from simulating the many layouts (tensor vs
        context, expert degrees, checkpointing) that differ in name only."""

        def coefficients(o: Option) -> tuple:
            m = o.memory
            costs = [p.cost for p in o.parts] or [o.cost]  # in stages: every stage's
            return (
                *(
                    x
                    for c in costs
                    for x in (
                        c.per_unit_s,
                        c.per_unit2_s,
                        c.overhead_s,
                        c.backward_factor,
                        c.sink_factor,
                        c.overlapped_s,
                        c.update_s,
                    )
                ),
                m["state"],
                m["activations"],
                m["held"],
            )

        groups: dict[tuple, list[tuple[tuple, Option]]] = {}
        for o in options:
            groups.setdefault((len(o.parts), o.plan.dp, o.plan.micro_batch), []).append((coefficients(o), o))
        kept = set()  # ids: the options are distinct, and comparing dataclasses is slow
        for group in groups.values():
            group.sort(key=lambda g: (g[0], tiebreak_section(g[1].plan)))
            front: list[tuple] = []
            for coef, o in group:
                if not any(all(a <= b for a, b in zip(f, coef)) for f, _ in front):
                    front.append((coef, o))
            kept.update(id(o) for _, o in front)
        return [o for o in options if id(o) in kept]

    def shared(self, section: str, n: int, budget: float, lightest: bool, members: int) -> list[Option]:
        """`section`'s options when it shares its `n` devices with `members - 1` other sections:
        the layouts that fit some share of the budget (eighths, up to all of it: one section's
        working activations may reuse another's, `group_bytes`), each the cheapest for its
        share, so the group's search can trade one section's memory for another's speed. Not
        in pipeline stages: a section in stages is a device group of its own (its stages' device
        ranges would overlap another section's in part, which the runtime refuses)."""
        if members == 1:
            return self.options(section, n, budget, lightest)
        key = (section, n, budget, lightest)
        if key not in self._shared:
            seen, out = set(), []
            for eighths in range(1, 9) if not math.isinf(budget) else (8,):
                for o in self.options(section, n, budget * eighths / 8, lightest, alone=False):
                    if o.plan not in seen:
                        seen.add(o.plan)
                        out.append(o)
            self._shared[key] = sorted(out, key=lambda o: o.bound)
        return self._shared[key]

    def floor(self, section: str, most: int, budget: float, lightest: bool) -> Option:
        """The smallest bound and shortest micro-steps (each on its own) that any option of
        `section` reaches on at most `most` devices: a floor for every option a plan could give
        it there. Also when it shares them (`shared`): a share of the budget only
        raises the fsdp degree of a layout, and a larger fsdp degree never prices its micro-steps
        lower (its all-gather, `cluster.fsdp_gather_s`, only grows; `tests/test_planner_bounds.py`
        checks the floors against every share). It may price the optimizer step lower (fewer
        parameters per device, fewer replicas to reduce with), so the floor's bound leaves the
        step out. Grown one device count at a time and kept (linear in devices; the minimum over
        1..m each time would be quadratic)."""

        def value(o: Option, field: str) -> float:
            return o.bound - o.update if field == "bound" else getattr(o, field)

        known = self._floors.setdefault((section, budget, lightest), [Option(None, {}, None, *[math.inf] * 5)])
        while len(known) <= most:
            last, found = known[-1], self.options(section, len(known), budget, lightest)
            known.append(
                Option(None, {}, None, *(min([getattr(last, f), *(value(o, f) for o in found)]) for f in FLOORED))
            )
        return known[most]


def tiebreak_section(sp: SectionPlan) -> tuple:
    recompute = {"none": 0, "dots": 1, "full": 2}
    return (
        sp.axis_sizes["tensor"],
        sp.axis_sizes["context"],
        sp.axis_sizes["expert"],
        sp.micro_batch,
        sp.residuals,
        recompute[sp.layer_remat],
    )
