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

from maestro_jax.config import Config
from maestro_jax.core.buckets import bucket
from maestro_jax.core.plan import (
    ParamInfo,
    Plan,
    PlanError,
    SectionPlan,
    check_param_divisibility,
    check_plan,
    state_bytes_per_device,
)
from maestro_jax.planning.cluster import cost_model, monolithic_time
from maestro_jax.planning.cost import DEVICES
from maestro_jax.planning.simulator import simulate
from maestro_jax.schedule import wavefront
from maestro_jax.workloads import shapes as workloads

F32 = 4


class InfeasibleError(ValueError):
    """No plan fits the request; the message says the smallest request that would."""


def model_params(cfg: Config, section: str) -> list[ParamInfo]:
    """The section's parameter leaves with the logical axes `models/` gives them (shapes only)."""
    m = cfg.models[section]
    p = lambda path, shape, logical: ParamInfo(path, tuple(shape), tuple(logical), F32)
    out = []
    if m.kind == "vit":
        hd = m.width // m.heads
        out += [p("patch_embed", (m.patch * m.patch * m.channels, m.width), ("patch", "embed")),
                p("pos_row", (m.max_grid, m.width), ("grid", "embed")),
                p("pos_col", (m.max_grid, m.width), ("grid", "embed")),
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
                p(f"block_{i}.gate", (m.width, mlp), ("embed", "mlp")),
                p(f"block_{i}.up", (m.width, mlp), ("embed", "mlp")),
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
    considered: int  # candidate plans that pass every constraint
    simulated: int  # that the bound did not rule out
    monolithic: dict  # the baseline's best layout on the same devices


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _powers(limit: int) -> list[int]:
    return [2**i for i in range(int(math.log2(max(limit, 1))) + 1)]


@dataclasses.dataclass(frozen=True)
class _Option:
    """One section's layout on `n` devices, with its memory and its share of the step-time bound."""

    plan: SectionPlan
    memory: dict
    bound: float


class Planner:
    """Search over plans of `cfg`'s workload on `devices` devices with `memory_gb` each.

    Each section's options are enumerated on their own (device count, tensor degree,
    data-parallel degree, micro-batch, residual policy); the fsdp degree is the smallest that
    fits the memory budget, since fsdp costs communication the cost model does not price.
    A plan is a pair of options on disjoint devices whose data-parallel degrees give a whole
    fanout. Candidates are scored with the wavefront scheduler and the simulator.
    """

    def __init__(self, cfg: Config, devices: int, memory_gb: float, batches: int = 2, residuals=("vjp", "remat"),
                 metas=None):
        self.cfg, self.devices, self.budget = cfg, devices, memory_gb * 2**30
        self.shape = workloads.SHAPES[cfg.workload]
        self.metas = metas or [workloads.metas(cfg, b) for b in range(batches)]
        self.max_units = {s: max((m.work.get(s, 0) for b in self.metas for m in b), default=1)
                          for s in self.shape.sections}
        self.params = {s: model_params(cfg, s) for s in self.shape.sections}
        self.residuals = residuals
        self.serial = DEVICES[cfg.simulate.device].get("serial", False)
        self._options: dict[tuple[str, int], list[_Option]] = {}

    # -- enumeration --------------------------------------------------------------------------
    def options(self, section: str, n: int, budget: float | None = None, lightest: bool = False) -> list[_Option]:
        """Every layout of `section` on `n` devices that passes its own constraints and fits;
        `lightest`: with the fsdp degree that needs the least memory instead of the smallest that fits."""
        budget = self.budget if budget is None else budget
        key = (section, n, budget, lightest)
        if key in self._options:
            return self._options[key]
        trained, sink = self.shape.sections[section], section == self.shape.sink
        gb = self.cfg.global_batch
        out = []
        for tensor in _divisors(n):
            dp = n // tensor
            for mb in _powers(gb // dp):
                if sink and gb % (dp * mb):
                    continue  # the sink's rows per micro-step must divide the global batch
                for res in (self.residuals if trained and not sink else ("vjp",)):
                    fits = []
                    for fsdp in _divisors(dp):
                        sp = SectionPlan(tuple(range(n)), (dp // fsdp, fsdp, tensor), mb, res)
                        try:
                            check_param_divisibility(section, sp, self.params[section])
                        except PlanError:
                            continue
                        mem = section_memory(self.cfg, section, sp, trained, sink, self.max_units[section])
                        if mem["total"] <= budget:
                            fits.append((sp, mem))
                            if not lightest:
                                break
                    if fits:
                        sp, mem = min(fits, key=lambda f: f[1]["total"]) if lightest else fits[0]
                        out.append(_Option(sp, mem, self._section_bound(section, sp)))
        self._options[key] = out
        return out

    def candidates(self, budget: float | None = None, lightest: bool = False):
        """(plan, memory by section, lower bound) for every plan that passes every constraint."""
        src, dst = self.shape.edge.src, self.shape.edge.dst
        for n_src in range(1, self.devices):
            n_dst = self.devices - n_src
            for a, b in itertools.product(self.options(src, n_src, budget, lightest),
                                            self.options(dst, n_dst, budget, lightest)):
                if b.plan.dp % a.plan.dp or a.plan.micro_batch % (b.plan.dp // a.plan.dp):
                    continue  # no whole fanout, or a producer micro-batch the block map cannot split
                dst_plan = dataclasses.replace(b.plan, devices=tuple(range(n_src, self.devices)))
                plan = Plan(sections={src: a.plan, dst: dst_plan},
                            fanout={self.shape.edge.name: b.plan.dp // a.plan.dp}, global_batch=self.cfg.global_batch)
                bound = a.bound + b.bound if self.serial else max(a.bound, b.bound)
                yield plan, {src: a.memory, dst: b.memory}, bound

    def check(self, plan: Plan) -> dict[str, dict[str, float]]:
        """The runtime's constraint checks on a whole plan; raises PlanError. Returns the memory."""
        mem = {s: section_memory(self.cfg, s, sp, self.shape.sections[s], s == self.shape.sink, self.max_units[s])
               for s, sp in plan.sections.items()}
        check_plan(plan, num_devices=self.devices, edges=(self.shape.edge,), sink=self.shape.sink,
                   params=self.params, budget_bytes=self.budget,
                   state={s: m["state"] for s, m in mem.items()},
                   activations={s: m["activations"] for s, m in mem.items()})
        return mem

    # -- scoring ------------------------------------------------------------------------------
    def _section_bound(self, section: str, sp: SectionPlan) -> float:
        """No section finishes before its own micro-steps are done, however its samples are
        packed. Two valid floors, the larger is kept: (a) the rows' unpadded work spread over the
        data shards, plus each micro-step's overhead; (b) padding: a micro-step costs at least its
        largest row's bucket, and over any packing into micro-steps of `rows` samples the sum of
        those largest rows is at least that of the sorted packing (every `rows`-th largest)."""
        cm = cost_model(self.cfg, {s: sp for s in self.shape.sections}, self.metas)
        cost = cm.sections[section]
        trained, sink = self.shape.sections[section], section == self.shape.sink
        factor = cost.sink_factor if sink else 1.0 + (cost.backward_factor if trained else 0.0)
        bounds = []
        for metas in self.metas:
            units = sorted((m.work[section] for m in metas if section in m.work), reverse=True)
            steps = math.ceil(len(units) / sp.rows)
            work = steps * cost.overhead_s + sum(cost.per_unit_s * u + cost.per_unit2_s * u * u for u in units) / sp.dp
            padded = sum(cm.step_time(section, "F", [units[j * sp.rows]], sp.micro_batch) for j in range(steps))
            bounds.append(factor * max(work, padded))
        return statistics.mean(bounds)

    def step_time(self, plan: Plan) -> float:
        cost, problem = cost_model(self.cfg, dict(plan.sections), self.metas), workloads.problem(self.cfg, plan)
        devices = {s: len(sp.devices) for s, sp in plan.sections.items()}
        return statistics.mean(simulate(wavefront(m, problem, cost), problem, m, cost, devices=devices,
                                        serial=self.serial).makespan for m in self.metas)

    # -- search -------------------------------------------------------------------------------
    def search(self, top: int = 10) -> PlanReport:
        """The best plan and the `top` runners-up by simulated step time.

        Candidates are simulated in order of their lower bound; once `top` are scored and the
        next bound exceeds the slowest of them, no remaining candidate can enter the top list."""
        found = list(self.candidates())
        if not found:
            raise InfeasibleError(self._infeasible_message())
        found.sort(key=lambda c: c[2])
        scored: list[Candidate] = []
        for plan, mem, bound in found:
            if len(scored) >= top and bound > scored[top - 1].step_time_s:
                break
            t = self.step_time(plan)
            used = sum(len(sp.devices) for sp in plan.sections.values())
            scored.append(Candidate(plan, t, self.cfg.global_batch / t / used,
                                    {s: m["total"] / 2**30 for s, m in mem.items()}))
            scored.sort(key=lambda c: (c.step_time_s, _tiebreak(c.plan)))
        return PlanReport(scored[0], scored[:top], len(found), len(scored), self.monolithic_best())

    def monolithic_best(self) -> dict | None:
        """The monolithic baseline's best layout and micro-batch on the same devices (every
        section's state on every device, the smallest fsdp that fits)."""
        best, gb = None, self.cfg.global_batch
        for tensor in _divisors(self.devices):
            dp = self.devices // tensor
            for mb in _powers(gb // dp):
                if gb % (dp * mb):
                    continue
                for fsdp in _divisors(dp):
                    sp = SectionPlan(tuple(range(self.devices)), (dp // fsdp, fsdp, tensor), mb)
                    try:
                        for s in self.shape.sections:
                            check_param_divisibility(s, sp, self.params[s])
                    except PlanError:
                        continue
                    mems = [section_memory(self.cfg, s, sp, t, s == self.shape.sink, self.max_units[s])
                            for s, t in self.shape.sections.items()]
                    if sum(m["state"] for m in mems) + max(m["activations"] for m in mems) > self.budget:
                        continue
                    cost = cost_model(self.cfg, {s: sp for s in self.shape.sections}, self.metas)
                    t = statistics.mean(monolithic_time(self.cfg, m, cost, mb, sp.rows) for m in self.metas)
                    if best is None or t < best["step_time_s"]:
                        best = {"mesh": dict(sp.axis_sizes), "micro_batch": mb, "step_time_s": t,
                                "samples_per_s_per_device": gb / t / self.devices}
                    break
        return best

    def _infeasible_message(self) -> str:
        sections = len(self.shape.sections)
        if self.devices < sections:
            return (f"--devices {self.devices}: the {self.cfg.workload} workload has {sections} sections and each "
                    f"needs its own devices; the smallest request is --devices {sections}")
        peaks = [max(m["total"] for m in mem.values())
                 for _, mem, _ in self.candidates(budget=float("inf"), lightest=True)]
        if not peaks:
            return (f"--devices {self.devices}: no device split satisfies the mesh, fanout and divisibility "
                    f"constraints for global_batch={self.cfg.global_batch}; try another device count")
        gb = self.budget / 2**30
        more = next((n for n in (2 * self.devices, 4 * self.devices)
                     if next(Planner(self.cfg, n, gb, residuals=self.residuals, metas=self.metas).candidates(), None)),
                    None)
        alt = f", or --devices {more} at --memory-gb {gb:g}" if more else ""
        return (f"--memory-gb {gb:g}: no plan on {self.devices} devices fits in memory; the smallest feasible "
                f"request is --memory-gb {_ceil_significant(min(peaks) / 2**30):g} at --devices "
                f"{self.devices}{alt}")


def _ceil_significant(x: float, digits: int = 3) -> float:
    """`x` rounded up to `digits` significant digits (a request that surely fits)."""
    scale = 10 ** (digits - 1 - math.floor(math.log10(x)))
    return math.ceil(x * scale) / scale


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
                 f"mb{d['micro_batch']}{' remat' if d['residuals'] == 'remat' else ''}"
                 for s, d in c.describe().items()]
        fan = ",".join(f"{f}" for f in c.plan.fanout.values())
        mem = " ".join(f"{s}={g:.3g}" for s, g in c.memory_gb.items())
        lines.append(f"{i + 1:2d}  {c.step_time_s:10.4g}  {c.samples_per_s_per_device:13.4g}  "
                     f"{' | '.join(parts)}; fanout {fan}  {mem}")
    return "\n".join(lines)


def write_plan(config_path: str, overrides: list[str], best: Candidate, memory_gb: float, out_path: str) -> None:
    """The config at `config_path` (with `overrides`) with `best`'s plan, as YAML that `train`,
    `verify` and `bench` accept; checked by loading it back."""
    import yaml

    from maestro_jax.config import _set_dotted, load_config, parse_overrides

    with open(config_path) as f:
        raw = yaml.safe_load(f) or {}
    for key, value in {**parse_overrides(overrides), **plan_overrides(best), "device_memory_gb": memory_gb}.items():
        _set_dotted(raw, key, value)
    header = (f"# Written by `maestro-jax plan` from {config_path}: predicted {best.step_time_s:.4g} s/step.\n"
              f"#   maestro-jax bench --config {out_path}\n")
    with open(out_path, "w") as f:
        f.write(header + yaml.safe_dump(raw, sort_keys=False))
    load_config(out_path)
