"""Planner: choose each section's devices, mesh, micro-batch, residual policy and the fanout.

Plain Python, no JAX. It enumerates candidate plans, drops those that break DESIGN.md
section 3 (through the same `plan.check_plan` the runtime runs, with the memory model below),
and scores the rest with the simulator on sample global batches under the analytic cost
model. Search is exact with respect to that score: candidates are simulated in order of a
lower bound on their step time (no section can finish before its own work is done), and the
search stops once the bound passes the best simulated time, so skipping the rest never
misses the optimum (`tests/test_planner.py` checks it against exhaustive search).

Memory per device (`section_memory`): params, plus grads and two Adam moments for trained
sections, all float32 and sharded by the mesh rules; activations of one micro-step; and, for
a trained producer, the residuals stashed for up to `schedule.max_in_flight` micro-steps
waiting for their backward (only the inputs under `residuals: remat`).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import statistics
from collections.abc import Sequence

from maestro_jax import workloads
from maestro_jax.buckets import bucket
from maestro_jax.config import Config
from maestro_jax.plan import ParamInfo, Plan, PlanError, SectionPlan, check_plan, state_bytes_per_device
from maestro_jax.scheduler import wavefront
from maestro_jax.simulate import cost_model, monolithic_time
from maestro_jax.simulator import simulate

F32 = 4


class InfeasibleError(ValueError):
    """No plan fits the request; the message says the smallest request that would."""


def model_params(cfg: Config, section: str) -> list[ParamInfo]:
    """The section's parameter leaves with the logical axes `models/` gives them (shapes only)."""
    m = cfg.models[section]
    p = lambda path, shape, logical: ParamInfo(path, tuple(shape), tuple(logical), F32)  # noqa: E731
    out = []
    if m.kind == "vit":
        hd = m.width // m.heads
        out += [p("patch_embed", (m.patch * m.patch * m.channels, m.width), ("patch", "embed")),
                p("pos_row", (m.max_grid, m.width), ("grid", "embed")), p("pos_col", (m.max_grid, m.width), ("grid", "embed")),
                p("merger_fc1", (m.merge**2 * m.width, 2 * m.out_width), ("embed", "mlp")),
                p("merger_fc2", (2 * m.out_width, m.out_width), ("mlp", "embed"))]
        for i in range(m.depth):
            out += [p(f"block_{i}.{n}", (m.width, m.heads, hd), ("embed", "heads", "head_dim")) for n in "qkv"]
            out += [p(f"block_{i}.o", (m.heads, hd, m.width), ("heads", "head_dim", "embed")),
                    p(f"block_{i}.fc1", (m.width, m.mlp), ("embed", "mlp")),
                    p(f"block_{i}.fc2", (m.mlp, m.width), ("mlp", "embed"))]
        return out
    out.append(p("embedding", (m.vocab, m.width), ("vocab", "embed")))
    if not m.tie_embeddings:
        out.append(p("lm_head", (m.width, m.vocab), ("embed", "vocab")))
    mlp = m.expert_mlp * m.experts if m.experts else m.mlp
    for i in range(m.depth):
        out += [p(f"block_{i}.q", (m.width, m.heads, m.head_dim), ("embed", "heads", "head_dim")),
                p(f"block_{i}.k", (m.width, m.kv_heads, m.head_dim), ("embed", "kv_heads", "head_dim")),
                p(f"block_{i}.v", (m.width, m.kv_heads, m.head_dim), ("embed", "kv_heads", "head_dim")),
                p(f"block_{i}.o", (m.heads, m.head_dim, m.width), ("heads", "head_dim", "embed")),
                p(f"block_{i}.gate", (m.width, mlp), ("embed", "mlp")), p(f"block_{i}.up", (m.width, mlp), ("embed", "mlp")),
                p(f"block_{i}.down", (mlp, m.width), ("mlp", "embed"))]
    return out


def _activation_bytes_per_unit(cfg: Config, section: str, sp: SectionPlan, stash: bool) -> float:
    """Bytes one work unit (token or patch) keeps per device: a layer's working set, plus every
    layer's residuals when they are stashed for a backward pass."""
    m = cfg.models[section]
    tensor = sp.axis_sizes["tensor"]
    mlp = m.mlp if m.kind == "vit" or not m.experts else m.experts_per_token * m.expert_mlp
    per_layer = (6 * m.width + 3 * mlp / tensor) * F32  # activations saved by one block for its vjp
    working = per_layer * 2
    return working + (per_layer * m.depth if stash else 0.0)


def section_memory(cfg: Config, section: str, sp: SectionPlan, trained: bool, is_sink: bool,
                   max_units: int) -> dict[str, float]:
    """Per-device bytes of a section under a plan (see the module docstring)."""
    state = state_bytes_per_device(model_params(cfg, section), sp, trained)
    rows_units = sp.micro_batch * bucket(max_units, 16)
    stash = trained and (is_sink or sp.residuals == "vjp")
    act = rows_units * _activation_bytes_per_unit(cfg, section, sp, stash)
    if trained and not is_sink:
        held = cfg.schedule.max_in_flight
        act = act + (held - 1) * rows_units * (_activation_bytes_per_unit(cfg, section, sp, sp.residuals == "vjp")
                                               if sp.residuals == "vjp" else cfg.models[section].width * F32)
    if is_sink:
        vocab = cfg.models[section].vocab
        act += rows_units * vocab / sp.axis_sizes["tensor"] * F32 * 2  # logits and their gradient
    return {"state": state, "activations": act, "total": state + act}


@dataclasses.dataclass(frozen=True)
class Candidate:
    plan: Plan
    step_time_s: float
    samples_per_s_per_device: float
    memory_gb: dict[str, float]  # peak per device, by section

    def describe(self) -> dict:
        return {s: {"devices": f"{sp.devices[0]}:{sp.devices[-1] + 1}", "mesh": dict(sp.axis_sizes),
                    "micro_batch": sp.micro_batch, "residuals": sp.residuals}
                for s, sp in self.plan.sections.items()}


@dataclasses.dataclass(frozen=True)
class PlanReport:
    best: Candidate
    top: list[Candidate]
    considered: int  # candidates enumerated
    feasible: int  # that pass every constraint
    simulated: int  # that the bound did not rule out
    monolithic: dict  # the baseline's best layout on the same devices


def _factorizations(n: int) -> list[tuple[int, int, int]]:
    return [(d, f, n // (d * f)) for d in range(1, n + 1) if n % d == 0
            for f in range(1, n // d + 1) if (n // d) % f == 0]


def _powers(limit: int) -> list[int]:
    return [2**i for i in range(int(math.log2(max(limit, 1))) + 1)]


class Planner:
    """Search over plans of `cfg`'s workload on `devices` devices with `memory_gb` each."""

    def __init__(self, cfg: Config, devices: int, memory_gb: float, batches: int = 2, residuals=("vjp", "remat")):
        self.cfg, self.devices, self.budget = cfg, devices, memory_gb * 2**30
        self.shape = workloads.SHAPES[cfg.workload]
        self.metas = [workloads.metas(cfg, b) for b in range(batches)]
        self.max_units = {s: max((m.work.get(s, 0) for b in self.metas for m in b), default=1)
                          for s in self.shape.sections}
        self.params = {s: model_params(cfg, s) for s in self.shape.sections}
        self.residuals = residuals

    # -- enumeration --------------------------------------------------------------------------
    def candidates(self):
        src, dst = self.shape.edge.src, self.shape.edge.dst
        gb = self.cfg.global_batch
        for n_src in range(1, self.devices):
            n_dst = self.devices - n_src
            for m_src, m_dst in itertools.product(_factorizations(n_src), _factorizations(n_dst)):
                dp_src, dp_dst = m_src[0] * m_src[1], m_dst[0] * m_dst[1]
                if dp_dst % dp_src:
                    continue  # DP_producer * fanout == DP_consumer has no whole fanout
                fanout = dp_dst // dp_src
                for mb_dst in _powers(gb // dp_dst):
                    for mb_src in _powers(gb // dp_src):
                        for res in (self.residuals if self.shape.sections[src] else ("vjp",)):
                            yield Plan(
                                sections={src: SectionPlan(tuple(range(n_src)), m_src, mb_src, res),
                                          dst: SectionPlan(tuple(range(n_src, self.devices)), m_dst, mb_dst)},
                                fanout={self.shape.edge.name: fanout}, global_batch=gb)

    def memory(self, plan: Plan) -> dict[str, dict[str, float]]:
        return {s: section_memory(self.cfg, s, sp, self.shape.sections[s], s == self.shape.sink, self.max_units[s])
                for s, sp in plan.sections.items()}

    def check(self, plan: Plan, budget: float | None = None) -> dict[str, dict[str, float]]:
        """The runtime's constraint checks; raises PlanError. Returns the memory estimate."""
        mem = self.memory(plan)
        check_plan(plan, num_devices=self.devices, edges=(self.shape.edge,), sink=self.shape.sink,
                   params=self.params, budget_bytes=self.budget if budget is None else budget,
                   state={s: m["state"] for s, m in mem.items()},
                   activations={s: m["activations"] for s, m in mem.items()})
        return mem

    # -- scoring ------------------------------------------------------------------------------
    def _cost(self, plan: Plan):
        return cost_model(self.cfg, dict(plan.sections), self.metas)

    def lower_bound(self, plan: Plan) -> float:
        """No section finishes before its own work: per micro-step overhead plus its rows' work
        spread over its data shards, unpadded (padding and waiting only add)."""
        cost, problem = self._cost(plan), workloads.problem(self.cfg, plan)
        bounds = []
        for metas in self.metas:
            per_section = []
            for s, sp in plan.sections.items():
                c = cost.sections[s]
                units = [m.work[s] for m in metas if s in m.work]
                if not units:
                    continue
                steps = math.ceil(len(units) / sp.rows)
                kinds = ["L"] if s == problem.sink else ["F"] + (["B"] if problem.needs_backward(s) else [])
                factor = sum({"F": 1.0, "B": c.backward_factor, "L": c.sink_factor}[k] for k in kinds)
                work = sum(c.per_unit_s * u + c.per_unit2_s * u * u for u in units) / sp.dp
                per_section.append(factor * (steps * c.overhead_s + work))
            bounds.append(max(per_section))
        return statistics.mean(bounds)

    def step_time(self, plan: Plan) -> float:
        cost, problem = self._cost(plan), workloads.problem(self.cfg, plan)
        devices = {s: len(sp.devices) for s, sp in plan.sections.items()}
        return statistics.mean(simulate(wavefront(m, problem, cost), problem, m, cost, devices=devices).makespan
                               for m in self.metas)

    def _candidate(self, plan: Plan, mem, t: float) -> Candidate:
        used = sum(len(sp.devices) for sp in plan.sections.values())
        return Candidate(plan, t, self.cfg.global_batch / t / used, {s: m["total"] / 2**30 for s, m in mem.items()})

    # -- search -------------------------------------------------------------------------------
    def feasible(self) -> tuple[int, list[tuple[Plan, dict]]]:
        considered, ok = 0, []
        for plan in self.candidates():
            considered += 1
            try:
                ok.append((plan, self.check(plan)))
            except PlanError:
                continue
        return considered, ok

    def search(self, top: int = 10, exhaustive: bool = False) -> PlanReport:
        considered, ok = self.feasible()
        if not ok:
            raise InfeasibleError(self._infeasible_message())
        bounded = sorted(((self.lower_bound(p), i) for i, (p, _) in enumerate(ok)))
        scored: list[Candidate] = []
        for bound, i in bounded:
            if not exhaustive and len(scored) >= top and bound > scored[top - 1].step_time_s:
                break  # every remaining candidate is slower than the top ones already found
            plan, mem = ok[i]
            scored.append(self._candidate(plan, mem, self.step_time(plan)))
            scored.sort(key=lambda c: (c.step_time_s, _tiebreak(c.plan)))
        return PlanReport(scored[0], scored[:top], considered, len(ok), len(scored), self.monolithic_best())

    def monolithic_best(self) -> dict:
        """The monolithic baseline's best layout and micro-batch on the same devices."""
        best = None
        for mesh in _factorizations(self.devices):
            for mb in _powers(self.cfg.global_batch // (mesh[0] * mesh[1])):
                sp = SectionPlan(tuple(range(self.devices)), mesh, mb)
                if self.cfg.global_batch % sp.rows:
                    continue
                cost = cost_model(self.cfg, {s: sp for s in self.shape.sections}, self.metas)
                t = statistics.mean(monolithic_time(self.cfg, m, cost, mb, sp.rows) for m in self.metas)
                if best is None or t < best["step_time_s"]:
                    best = {"mesh": dict(sp.axis_sizes), "micro_batch": mb, "step_time_s": t}
        return best

    def _infeasible_message(self) -> str:
        sections = len(self.shape.sections)
        if self.devices < sections:
            return (f"--devices {self.devices}: the {self.cfg.workload} workload has {sections} sections and each "
                    f"needs its own devices; the smallest request is --devices {sections}")
        need = None
        for plan in self.candidates():
            try:
                mem = self.check(plan, budget=float("inf"))
            except PlanError:
                continue
            peak = max(m["total"] for m in mem.values()) / 2**30
            need = peak if need is None else min(need, peak)
        if need is None:
            return (f"--devices {self.devices}: no device split satisfies the mesh, fanout and divisibility "
                    f"constraints for global_batch={self.cfg.global_batch}; try another device count")
        more = next((n for n in range(self.devices + 1, 8 * self.devices + 1)
                     if Planner(self.cfg, n, self.budget / 2**30, len(self.metas), self.residuals).feasible()[1]), None)
        alt = f", or --devices {more} at {self.budget / 2**30:g} GB" if more else ""
        return (f"--memory-gb {self.budget / 2**30:g}: no plan on {self.devices} devices fits; the smallest "
                f"feasible request is --memory-gb {math.ceil(need * 100) / 100:g} at --devices {self.devices}{alt}")


def _tiebreak(plan: Plan):
    """Equal predicted times: prefer fewer tensor shards, then smaller micro-batches (less memory)."""
    return tuple((sp.axis_sizes["tensor"], sp.micro_batch, sp.residuals) for sp in plan.sections.values())


def plan_overrides(c: Candidate) -> dict[str, object]:
    """Config keys that set a candidate's plan (for `--write` and `key=value` overrides)."""
    out: dict[str, object] = {}
    for s, d in c.describe().items():
        out[f"sections.{s}.devices"] = d["devices"]
        out[f"sections.{s}.mesh"] = d["mesh"]
        out[f"sections.{s}.micro_batch"] = d["micro_batch"]
        out[f"sections.{s}.residuals"] = d["residuals"]
    out.update({f"edges.{e}.fanout": f for e, f in c.plan.fanout.items()})
    return out


def format_table(report: PlanReport, rows: Sequence[Candidate] | None = None) -> str:
    lines = [f"{'#':>2s}  {'step s':>10s}  {'samples/s/dev':>13s}  plan (devices mesh[data,fsdp,tensor] micro-batch "
             f"residuals; fanout)  peak GB/device"]
    for i, c in enumerate(rows or report.top):
        parts = [f"{s} {d['devices']} [{d['mesh']['data']},{d['mesh']['fsdp']},{d['mesh']['tensor']}] "
                 f"mb{d['micro_batch']}{' remat' if d['residuals'] == 'remat' else ''}" for s, d in c.describe().items()]
        fan = ",".join(f"{f}" for f in c.plan.fanout.values())
        mem = " ".join(f"{s}={g:.3g}" for s, g in c.memory_gb.items())
        lines.append(f"{i + 1:2d}  {c.step_time_s:10.4g}  {c.samples_per_s_per_device:13.4g}  "
                     f"{' | '.join(parts)}; fanout {fan}  {mem}")
    return "\n".join(lines)
