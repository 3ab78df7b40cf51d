"""Side-by-side throughput: monolithic, naive and wavefront on the same devices and batches.

After a warm-up that compiles every shape bucket, repetitions are interleaved (mono, naive,
wavefront, mono, ...) so that drift on a shared machine hits all three alike. Each timed step
includes scheduling (host work), dispatch, the optimizer update and the final wait.

The monolithic step is timed in each order a monolithic trainer could feed it a global batch
(`ORDERS`, the analytic fair baseline's, `planning.cluster.monolithic_time`): `monolithic` is the
fastest of them, the fair baseline; arrival order is Megatron-LM's data order, reported beside it
as the users' baseline `round_robin`.

The cost model calibrated on the way is the bench's own, for its wavefront schedules and
its prediction: nothing is stored on the runtime it is given (a `Trainer`'s later `train()`
schedules by work units, as it would have without the bench).
`progress`, when given, receives one short line per phase (calibration, each mode's warm-up,
each repetition), since a bench compiles and runs for minutes.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable

import jax

from maestro_jax.config import Config
from maestro_jax.data.samples import Sample
from maestro_jax.planning.mfu import step_flops, utilization
from maestro_jax.planning.simulator import simulate
from maestro_jax.runtime.build import build_runtime
from maestro_jax.runtime.mfu import peak_of
from maestro_jax.runtime.step import StepBatch
from maestro_jax.schedule import Op, naive, sample_metas, wavefront
from maestro_jax.tools import calibrate
from maestro_jax.tools.simulate import seconds

MODES = ("monolithic", "naive", "wavefront")
# the orders the monolithic step is timed in: arrival (Megatron-LM's), longest first by the sink's
# work, longest first by the sample's whole modelled time alone
ORDERS = ("arrival", "sink_longest", "alone_longest")


def _mfu(cfg: Config, rt, batches, per_rep) -> dict:
    """Each mode's MFU over its median repetition (`planning.mfu`): maestro's step and sections
    on the plan's devices, the monolithic step on `monolithic.devices`, against the peak
    `runtime.mfu.peak_of` finds (`peak`, `peak_source`)."""
    flops = {}
    for b in batches:
        for s, f in step_flops(rt.graph, b).items():
            flops[s] = flops.get(s, 0.0) + f
    peak, source = peak_of(cfg.peak_flops, jax.devices()[0].device_kind)
    devices = {s: sp.devices for s, sp in rt.plan.sections.items()}
    mono = {"all": list(cfg.monolithic.devices)}
    out = {"peak": peak, "peak_source": source, "by_section": {}}
    for m in MODES:
        seconds = statistics.median(per_rep[m])
        u = utilization({"all": sum(flops.values())}, mono, seconds, peak) if m == "monolithic" else None
        u = u or utilization(flops, devices, seconds, peak)
        out[m] = u.step
        if m != "monolithic":
            out["by_section"][m] = dict(u.sections)
    return out


def bench(
    cfg: Config,
    reps: int = 5,
    num_batches: int = 3,
    trace_dir: str | None = None,
    rt=None,
    progress: Callable[[str], None] | None = None,
    pack: int | None = None,
    stages: int | None = None,
    balance: bool = False,
) -> dict:
    """Side-by-side throughput of `cfg`'s workload (or of the runtime `rt` of a user's graph,
    left as it was given: the calibrated cost model is not stored on it). With `pack`, also
    packed vs unpacked sequences (`bench_packing`), with `stages` the plan with its decoder
    sections in pipeline stages vs without (`bench_stages`), with `balance` the wavefront with and
    without its producer-balancing variant (`bench_balance`), on the same batches."""
    say = _stopwatch(progress)
    if rt is None:
        say("building the runtime")
        rt = build_runtime(cfg)
    batches = [rt.batches()[i] for i in range(num_batches)]
    timing = _Timing.calibrated(rt, batches, say)
    timing.warm_up(say)
    for rep in range(reps):
        timing.repeat(rep, reps, say)
    report = _report(cfg, timing)
    if any(s.items for b in batches for s in b):
        text_only = _text_only_step_s(batches, reps, timing.maestro_step, timing.fair_mono_step, say)
        report["text_only_step_s"] = text_only
        report["efficiency_vs_text_only"] = {m: text_only[m] / timing.median_step_s(m) for m in text_only}
    report["mfu"] = _mfu(cfg, rt, batches, timing.per_rep)
    report["simulator"] = _prediction(rt, timing.cost, batches, timing.per_rep, num_batches)
    if pack is not None:
        report["packing"] = bench_packing(cfg, pack, rt, batches, reps, say)
    if stages is not None:
        report["stages"] = bench_stages(cfg, stages, rt, batches, reps, say)
    if balance:
        report["balance"] = bench_balance(cfg, rt, batches, reps, say)
    if trace_dir:
        say(f"writing traces to {trace_dir}")
        report["traces"] = _traces(rt, timing.cost, timing.states["wavefront"], batches[0], trace_dir)
    say("done")
    return report


def _stopwatch(progress: Callable[[str], None] | None) -> Callable[[str], None]:
    """`say(msg)`: `msg` to `progress` (if any) with the seconds since the bench began."""
    start = time.perf_counter()

    def say(msg: str) -> None:
        if progress is not None:
            progress(f"bench [{time.perf_counter() - start:4.0f} s] {msg}")

    return say


def _no_stats() -> dict[str, list]:
    return {
        "schedule_s": [],
        "dispatch_s": [],
        "step_s": [],
        "transfer_issue_s": [],
        "in_flight_wait_s": [],
        "programs": [],
        "transfers": [],
    }


def _launches(schedule) -> tuple[int, int]:
    """(programs, transfers) a step launches for `schedule`: a program per forward, backward and
    update, a transfer per edge crossing (X) and per cotangent sent back (XB)."""
    transfers = sum(op.kind in ("X", "XB") for op in schedule.ops)
    return len(schedule.ops) - transfers, transfers


@dataclasses.dataclass
class _Timing:
    """The timed steps of one bench on `batches`: maestro's step under each scheduler (naive, and
    the wavefront on the bench's own calibrated `cost`) and the monolithic step in each of
    `ORDERS`, each mode's state advancing alone. `stats`: each timed mode's per-step host times;
    `per_rep`: each mode's time per repetition; `fair`: the monolithic step's fastest order."""

    rt: object
    step: object  # the run's step on the plan
    mono: object  # the monolithic step (one object: its compiled programs are its own)
    batches: list
    cost: object
    states: dict
    mono_state: object
    orders: dict
    ordered: dict
    stats: dict = dataclasses.field(default_factory=dict)
    per_rep: dict = dataclasses.field(default_factory=dict)
    fair: str = ORDERS[0]  # the monolithic step's fastest order so far: what the text-only step uses
    device_s: dict = dataclasses.field(default_factory=dict)  # `_device_time_by_kind` of the calibration

    @classmethod
    def calibrated(cls, rt, batches, say) -> _Timing:
        """Fresh states for every mode, the cost model calibrated on this machine (timed,
        serialised runs; also warms up naive) and every batch put in each monolithic order."""
        step, mono = rt.step, rt.monolithic.step
        states = {m: step.init() for m in ("naive", "wavefront")}
        mono_state = mono.init()
        say(f"calibrating the cost model: timed runs of {len(batches[:2])} batch(es) (compiles the section programs)")
        measured, states["naive"] = calibrate.measure(rt, states["naive"], batches[:2], repeats=1)
        cost = calibrate.fit(rt, measured)  # this bench's own: not stored on `rt`
        orders = monolithic_orders(rt, cost)
        ordered = {o: [orders[o](b) for b in batches] for o in ORDERS}  # each batch in each order, once
        timing = cls(rt, step, mono, batches, cost, states, mono_state, orders, ordered)
        timing.device_s = _device_time_by_kind(measured)
        timing.stats = {m: _no_stats() for m in timing.timed}
        timing.per_rep = {m: [] for m in timing.timed}
        return timing

    @property
    def timed(self) -> list[str]:
        return [*(f"monolithic:{o}" for o in ORDERS), "naive", "wavefront"]

    def maestro_step(self, mode: str, samples, stats: dict) -> None:
        """One maestro step under `mode`'s scheduler, its scheduling, dispatch and whole step timed."""
        rt = self.rt
        t0 = time.perf_counter()
        metas = sample_metas(rt.graph, samples)
        schedule = naive(metas, rt.problem) if mode == "naive" else wavefront(metas, rt.problem, self.cost)
        t1 = time.perf_counter()
        self.states[mode], metrics = self.step(self.states[mode], StepBatch(samples, schedule))
        t2 = time.perf_counter()
        jax.block_until_ready((metrics.loss, self.states[mode]))  # end of step
        t3 = time.perf_counter()
        stats["schedule_s"].append(t1 - t0)
        stats["dispatch_s"].append(t2 - t1)
        stats["step_s"].append(t3 - t0)
        stats["transfer_issue_s"].append(metrics.host["transfer_issue_s"])
        stats["in_flight_wait_s"].append(metrics.host["in_flight_wait_s"])
        programs, transfers = _launches(schedule)
        stats["programs"].append(programs)
        stats["transfers"].append(transfers)

    def mono_step(self, samples, stats: dict) -> None:
        """One monolithic step on `samples` as given, timed whole."""
        t0 = time.perf_counter()
        self.mono_state, metrics = self.mono(self.mono_state, samples)
        jax.block_until_ready((metrics.loss, self.mono_state))
        stats["step_s"].append(time.perf_counter() - t0)

    def fair_mono_step(self, samples, stats: dict) -> None:
        """The monolithic step on `samples` in its fastest order."""
        self.mono_step(self.orders[self.fair](samples), stats)

    def run(self, mode: str, j: int, stats: dict) -> None:
        if mode.startswith("monolithic:"):
            self.mono_step(self.ordered[mode.split(":")[1]][j], stats)
        else:
            self.maestro_step(mode, self.batches[j], stats)

    def warm_up(self, say) -> None:
        """Compile every bucket of every mode (each mode's states advance alone), over two steps
        at least: the monolithic step's second compiles again (its states, once updated, come in
        with the update's layouts), which one batch would leave to the first repetition."""
        steps = list(range(len(self.batches))) * (1 if len(self.batches) > 1 else 2)
        for mode in MODES:
            each = f" in each of its orders ({', '.join(ORDERS)})" if mode == "monolithic" else ""
            say(f"warm-up {mode}: {len(steps)} steps{each}, compiling every shape bucket")
            for m in [t for t in self.timed if t.split(":")[0] == mode]:
                for j in steps:
                    self.run(m, j, _no_stats())

    def repeat(self, rep: int, reps: int, say) -> None:
        """Repetition `rep`: every timed mode over every batch, interleaved; the fair monolithic
        order is the fastest so far."""
        for mode in self.timed:
            first = len(self.stats[mode]["step_s"])
            for j in range(len(self.batches)):
                self.run(mode, j, self.stats[mode])
            self.per_rep[mode].append(sum(self.stats[mode]["step_s"][first:]))
        self.fair = min(ORDERS, key=lambda o: statistics.median(self.per_rep[f"monolithic:{o}"]))
        fair = f"monolithic:{self.fair}"
        self.per_rep["monolithic"], self.stats["monolithic"] = self.per_rep[fair], self.stats[fair]
        say(
            f"repetition {rep + 1}/{reps}: "
            + ", ".join(f"{m} {seconds(self.per_rep[m][-1] / len(self.batches))}/step" for m in MODES)
            + f" (monolithic in its fastest order so far, {self.fair})"
        )

    def median_step_s(self, mode: str) -> float:
        return statistics.median(self.per_rep[mode]) / len(self.batches)


def _summary(values) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _report(cfg: Config, t: _Timing) -> dict:
    """The bench's report of `t`'s repetitions: throughput, step times, ratios and host time by mode."""
    batches, per_rep = t.batches, t.per_rep
    samples_per_rep = sum(len(b) for b in batches)
    tokens_per_rep = sum(len(s.tokens) - 1 for b in batches for s in b)
    sps = {m: samples_per_rep / statistics.median(per_rep[m]) for m in MODES}
    by_order = {o: samples_per_rep / statistics.median(per_rep[f"monolithic:{o}"]) for o in ORDERS}
    return {
        "config": _config_record(cfg, t.rt, len(batches), len(per_rep["naive"])),
        "samples_per_s": sps,
        # the fair monolithic baseline is the fastest of its orders; each order's throughput
        "monolithic_order": t.fair,
        "monolithic_orders": by_order,
        # what users run today, measured: the monolithic step in arrival order (Megatron-LM's data order)
        "user_baselines": {"round_robin": {"samples_per_s": by_order["arrival"]}},
        "tokens_per_s": {m: tokens_per_rep / statistics.median(per_rep[m]) for m in MODES},
        "step_time_s": {m: _summary([x / len(batches) for x in per_rep[m]]) for m in MODES},
        "ratios": {
            "wavefront_vs_monolithic": sps["wavefront"] / sps["monolithic"],
            "wavefront_vs_naive": sps["wavefront"] / sps["naive"],
            "naive_vs_monolithic": sps["naive"] / sps["monolithic"],
            "wavefront_vs_round_robin": sps["wavefront"] / by_order["arrival"],
        },
        **_host_time(t.stats),
        "host_per_op": _host_per_op(t.stats, t.device_s),
    }


def _config_record(cfg: Config, rt, num_batches: int, reps: int) -> dict:
    """What was benched: the workload, its sections, batches, devices and both layouts."""
    return {
        "workload": cfg.workload,
        "sections": list(rt.graph.names),
        "global_batch": cfg.global_batch,
        "batches": num_batches,
        "reps": reps,
        "devices": len(jax.devices()),
        "platform": jax.devices()[0].platform,
        "plan": {s: _layout(sp) for s, sp in rt.plan.sections.items()},
        "monolithic": _layout(cfg.monolithic_plan()),
    }


def _host_time(stats: dict) -> dict:
    """Maestro's host time per step, medians: its share of the step (scheduling and dispatch),
    scheduling's alone, and per step scheduling, issuing every program (dispatch) and the host
    blocked waiting for the devices at the end of the step (the rest of the step's time)."""
    modes = ("naive", "wavefront")

    def per_step(m):
        return list(zip(stats[m]["schedule_s"], stats[m]["dispatch_s"], stats[m]["step_s"]))

    return {
        "host_overhead_fraction": {m: statistics.median([(a + b) / c for a, b, c in per_step(m)]) for m in modes},
        "schedule_fraction": {m: statistics.median([a / c for a, _, c in per_step(m)]) for m in modes},
        "host_time_s": {
            m: {
                "schedule": statistics.median(stats[m]["schedule_s"]),
                "dispatch": statistics.median(stats[m]["dispatch_s"]),
                "blocked": statistics.median([c - a - b for a, b, c in per_step(m)]),
            }
            for m in modes
        },
    }


def _device_time_by_kind(measured) -> dict[str, float]:
    """Median device time of one op of each kind (F, B, X, XB), from the calibration's serialised
    runs (`calibrate.measure`: each op waited for, its issue time taken off)."""
    by_kind: dict[str, list[float]] = {}
    for op, *_, t in measured:
        if isinstance(op, Op):  # a timed op: (device seconds, issue seconds); else a host row
            by_kind.setdefault(op.kind, []).append(t[0])
    order = ["F", "B", "X", "XB", "U"]  # a schedule's kinds, in its own order
    return {k: statistics.median(by_kind[k]) for k in sorted(by_kind, key=order.index)}


def _host_per_op(stats: dict, device_s: dict[str, float]) -> dict:
    """Each maestro mode's host time per launched op, medians over steps: what a step launches
    (`_launches`), scheduling per op, the issue of a program (dispatch less the transfers' issue
    and the in-flight bound's waits) per program, a transfer's issue per transfer, and the host's
    wait (the in-flight bound's and the end of the step's) per op; beside it, the device time of
    one op of each kind (`device_s`, serialised calibration runs). Whether a small step is
    host-bound reads off the two: host time per op against device time per op."""
    out = {}
    for m in ("naive", "wavefront"):
        st = stats[m]
        steps = [
            {
                "programs": p,
                "transfers": n,
                "schedule_s": sched / (p + n),
                "dispatch_s": max(dispatch - issue - waited, 0.0) / p,
                "transfer_issue_s": issue / n if n else 0.0,
                "wait_s": (waited + step - sched - dispatch) / (p + n),
            }
            for sched, dispatch, step, issue, waited, p, n in zip(
                st["schedule_s"],
                st["dispatch_s"],
                st["step_s"],
                st["transfer_issue_s"],
                st["in_flight_wait_s"],
                st["programs"],
                st["transfers"],
            )
        ]
        out[m] = {k: statistics.median([row[k] for row in steps]) for k in steps[0]}
    out["device_s"] = dict(device_s)
    return out


def format_report(r: dict) -> str:
    """`bench`'s report as `maestro-jax bench` prints it: a table of throughput and step times by
    mode, the monolithic orders and the users' baseline, ratios, host overhead, MFU, the
    simulator's prediction and each variant benched (packing, stages, balance)."""
    return "\n".join([*_throughput_lines(r), *_share_lines(r), *_variant_lines(r)])


def _per_op_lines(per_op: dict) -> list[str]:
    """Host time per launched op by mode, then the device time of one op of each kind."""
    lines = []
    for m in ("naive", "wavefront"):
        h = per_op[m]
        lines.append(
            f"host per op ({m}, {h['programs']:.0f} programs and {h['transfers']:.0f} transfers a step): "
            f"scheduling {seconds(h['schedule_s'])}, dispatch {seconds(h['dispatch_s'])} a program, "
            f"transfer issue {seconds(h['transfer_issue_s'])} a transfer, wait {seconds(h['wait_s'])}"
        )
    device = ", ".join(f"{k} {seconds(v)}" for k, v in per_op["device_s"].items())
    lines.append(f"device time per op (calibration, each op waited for): {device or 'none measured'}")
    return lines


def _throughput_lines(r: dict) -> list[str]:
    lines = [f"{'mode':12s} {'samples/s':>10s} {'tokens/s':>10s} {'step median s':>14s} {'min':>8s} {'max':>8s}"]
    for m in MODES:
        t = r["step_time_s"][m]
        lines.append(
            f"{m:12s} {r['samples_per_s'][m]:10.2f} {r['tokens_per_s'][m]:10.1f} {t['median']:14.4f} "
            f"{t['min']:8.4f} {t['max']:8.4f}"
        )
    orders = ", ".join(f"{o} {v:.2f}" for o, v in r["monolithic_orders"].items())
    rr = r["user_baselines"]["round_robin"]["samples_per_s"]
    return [
        *lines,
        f"monolithic: the fastest of its orders, {r['monolithic_order']} (samples/s by order: {orders})",
        f"users' baseline, Megatron-style data order (the monolithic step in arrival order): {rr:.2f} samples/s",
        *(f"{k}: {v:.3f}" for k, v in r["ratios"].items()),
    ]


def _share_lines(r: dict) -> list[str]:
    """Host overhead, MFU, the efficiency relative to text-only and the simulator's prediction."""
    lines = [
        f"host overhead ({m}): {v:.1%} of step time (scheduling {r['schedule_fraction'][m]:.1%})"
        for m, v in r["host_overhead_fraction"].items()
    ]
    lines += _per_op_lines(r["host_per_op"])
    u = r["mfu"]
    for m in MODES:
        sections = ", ".join(f"{s} {v:.1%}" for s, v in u["by_section"].get(m, {}).items())
        lines.append(f"MFU {m}: {u[m]:.1%}" + (f" ({sections})" if sections else ""))
    lines.append(f"MFU against {u['peak'] / 1e12:.3g} TFLOP/s a device ({u['peak_source']})")
    if "efficiency_vs_text_only" in r:
        e = r["efficiency_vs_text_only"]
        lines.append(
            f"efficiency relative to text-only (same token rows, modality items removed): "
            f"wavefront {e['wavefront']:.1%}, monolithic {e['monolithic']:.1%}"
        )
    sim = r["simulator"]
    for m in ("naive", "wavefront"):
        p = sim[m]
        lines.append(
            f"simulator ({sim['cost_source']}, serial={sim['serial']}) {m}: predicted "
            f"{p['predicted_step_s']:.4f}s vs measured {p['measured_step_s']:.4f}s ({p['relative_error']:+.1%})"
        )
    return lines


def _variant_lines(r: dict) -> list[str]:
    """One line for each variant benched beside the run: packing, pipeline stages, balanced shards."""
    lines = []
    if p := r.get("packing"):
        lines.append(
            f"packing ({', '.join(p['sections'])} pack={p['pack']}, {p['scheduler']}): tokens/s packed "
            f"{p['tokens_per_s']['packed']:.1f} vs unpacked {p['tokens_per_s']['unpacked']:.1f} "
            f"({p['packed_vs_unpacked']:.3f}x); rows filled {p['row_fill']['packed']:.1%} vs "
            f"{p['row_fill']['unpacked']:.1%}"
        )
    if p := r.get("stages"):
        lines.append(
            f"pipeline stages ({', '.join(p['sections'])} stages={p['stages']}, {p['scheduler']}): tokens/s staged "
            f"{p['tokens_per_s']['staged']:.1f} vs unstaged {p['tokens_per_s']['unstaged']:.1f} "
            f"({p['staged_vs_unstaged']:.3f}x)"
        )
    if p := r.get("balance"):
        units = ", ".join(
            f"{s} {n} vs {p['padded_units']['unbalanced'][s]}" for s, n in p["padded_units"]["balanced"].items()
        )
        lines.append(
            f"balanced shards (wavefront): tokens/s balanced {p['tokens_per_s']['balanced']:.1f} vs unbalanced "
            f"{p['tokens_per_s']['unbalanced']:.1f} ({p['balanced_vs_unbalanced']:.3f}x); padded work units {units}"
        )
    return lines


def monolithic_orders(rt, cost) -> dict[str, Callable[[list], list]]:
    """`ORDERS`: how a monolithic trainer could feed the step a global batch, as the analytic fair
    baseline prices them (`planning.cluster.monolithic_time`): as it arrives, longest first by
    the sink's work units, longest first by the sample's modelled time alone in every section
    (`cost`, the bench's calibrated model). Sorts are stable: ties keep arrival order. The step's
    loss and gradients do not depend on the order (up to the rounding of their sums)."""
    sink = rt.graph.sink

    def alone(m) -> float:
        c = cost.sections
        return sum(cost.step_time(s, "F", [u], 1) - c[s].overhead_s for s, u in m.work.items() if s in c)

    def longest_first(key):
        def order(samples: list) -> list:
            metas = sample_metas(rt.graph, samples)
            return [samples[i] for i in sorted(range(len(samples)), key=lambda i: key(metas[i]), reverse=True)]

        return order

    return {
        "arrival": list,
        "sink_longest": longest_first(lambda m: m.work.get(sink, 0)),
        "alone_longest": longest_first(alone),
    }


def bench_packing(cfg: Config, pack: int, rt, batches, reps: int, say: Callable[[str], None]) -> dict:
    """Sequence packing side by side: the config's scheduler over the same batches with every
    section that packs at `sections.<name>.pack` = `pack` and with the config's own packing (1
    unless set), repetitions interleaved after a warm-up of each. Tokens per second count the
    samples' tokens, not padding; `row_fill` is the share of the packing sections' row positions
    that hold a token (what packing raises)."""
    packs = [s.name for s in rt.graph.sections if s.packed_batch is not None]
    if not packs:
        raise ValueError(f"workload {cfg.workload!r} has no section that packs sequences")
    sections = {n: sc.model_copy(update={"pack": pack}) if n in packs else sc for n, sc in cfg.sections.items()}
    runtimes = {"unpacked": rt, "packed": build_runtime(cfg.model_copy(update={"sections": sections}))}
    fill = {}

    def count_fill(mode, r) -> None:
        held = total = 0
        for samples in batches:
            host = r.executor.host_batches(samples, _schedule(cfg, r, samples))
            for (section, _), b in host.items():
                if section in packs:
                    held, total = held + int(b["valid"].sum()), total + b["valid"].size
        fill[mode] = held / total

    tps = _side_by_side(cfg, runtimes, batches, reps, say, "packing", count_fill)
    return {
        "pack": pack,
        "sections": packs,
        "scheduler": cfg.schedule.scheduler,
        "tokens_per_s": tps,
        "packed_vs_unpacked": tps["packed"] / tps["unpacked"],
        "row_fill": fill,
    }


def stageable(cfg: Config, graph, stages: int) -> list[str]:
    """The sections of `graph` that `bench --stages` cuts into `stages` pipeline stages: those
    that split (`Section.stages`) and whose mesh's data axis `stages` divides."""
    return [
        s.name
        for s in graph.sections
        if s.stages is not None and s.name in cfg.sections and cfg.sections[s.name].mesh.data % stages == 0
    ]


def bench_stages(cfg: Config, stages: int, rt, batches, reps: int, say: Callable[[str], None]) -> dict:
    """Pipeline stages side by side: the config's scheduler over the same batches with every
    section that `stageable` names in `stages` stages (cut evenly) and with the config's own plan,
    repetitions interleaved after a warm-up of each."""
    staged = stageable(cfg, rt.graph, stages)
    if not staged:
        raise ValueError(f"no section of workload {cfg.workload!r} splits into {stages} stages")
    evenly = {"stages": stages, "stage_layers": None}  # the config's own cut is for its own stage count
    sections = {n: sc.model_copy(update=evenly) if n in staged else sc for n, sc in cfg.sections.items()}
    runtimes = {"unstaged": rt, "staged": build_runtime(cfg.model_copy(update={"sections": sections}))}
    tps = _side_by_side(cfg, runtimes, batches, reps, say, "stages")
    return {
        "stages": stages,
        "sections": staged,
        "scheduler": cfg.schedule.scheduler,
        "tokens_per_s": tps,
        "staged_vs_unstaged": tps["staged"] / tps["unstaged"],
    }


def bench_balance(cfg: Config, rt, batches, reps: int, say: Callable[[str], None]) -> dict:
    """The wavefront side by side with and without dealing the sink's rows to balance its
    producers' shards (`schedule.balance_shards`, `schedule.wavefront._balanced`): one runtime, its
    schedules made both ways, repetitions interleaved after a warm-up of each. Also each way's
    padded work per section over the batches, free of timing noise: per micro-step its rows times
    the work of its largest row (what lockstep shards run), summed."""
    problems = {
        way: dataclasses.replace(rt.problem, balance_shards=way == "balanced") for way in ("unbalanced", "balanced")
    }
    padded = {way: dict.fromkeys(rt.problem.order, 0) for way in problems}
    for samples in batches:
        metas = sample_metas(rt.graph, samples)
        for way, p in problems.items():
            for s, steps in wavefront(metas, p).steps.items():
                padded[way][s] += sum(
                    len(st.positions) * max((metas[x].work.get(s, 0) for x in st.positions if x >= 0), default=0)
                    for st in steps
                )
    tps = _side_by_side(cfg, dict.fromkeys(problems, rt), batches, reps, say, "balance", problems=problems)
    return {"tokens_per_s": tps, "balanced_vs_unbalanced": tps["balanced"] / tps["unbalanced"], "padded_units": padded}


def _schedule(cfg: Config, r, samples):
    metas = sample_metas(r.graph, samples)
    return wavefront(metas, r.problem) if cfg.schedule.scheduler == "wavefront" else naive(metas, r.problem)


def _side_by_side(
    cfg: Config, runtimes: dict, batches, reps: int, say, what: str, warmed=None, problems: dict | None = None
) -> dict[str, float]:
    """Tokens per second of each runtime (mode -> runtime) on the same batches under the config's
    scheduler (or, with `problems`, mode -> the `Problem` the wavefront schedules each mode's
    batches by): a warm-up of each that compiles every shape bucket (then `warmed(mode,
    runtime)`), then `reps` repetitions interleaved; tokens count the samples', not padding."""
    states = {m: r.step.init() for m, r in runtimes.items()}
    tokens = sum(len(s.tokens) - 1 for b in batches for s in b)

    def schedule(mode, r, samples):
        if problems is None:
            return _schedule(cfg, r, samples)
        return wavefront(sample_metas(r.graph, samples), problems[mode])

    def step(mode, samples) -> float:
        r, t0 = runtimes[mode], time.perf_counter()
        states[mode], metrics = r.step(states[mode], StepBatch(samples, schedule(mode, r, samples)))
        jax.block_until_ready((metrics.loss, states[mode]))
        return time.perf_counter() - t0

    for mode, r in runtimes.items():
        say(
            f"{what}: warm-up {mode} ({'wavefront' if problems else cfg.schedule.scheduler}), compiling every shape bucket"
        )
        for samples in batches * 2:
            step(mode, samples)
        if warmed is not None:
            warmed(mode, r)
    times = {m: [] for m in runtimes}
    for rep in range(reps):
        for mode in runtimes:
            times[mode].append(sum(step(mode, samples) for samples in batches))
        say(f"{what} repetition {rep + 1}/{reps}: " + ", ".join(f"{m} {t[-1]:.3f} s" for m, t in times.items()))
    return {m: tokens / statistics.median(t) for m, t in times.items()}


def _layout(sp) -> dict:
    """A section's (or the monolithic baseline's) layout as the report records it, so that a
    report names the plan it timed (co-located sections share devices; DP degrees show M:N edges)."""
    d = sp.devices
    devices = f"{d[0]}:{d[-1] + 1}" if d == tuple(range(d[0], d[-1] + 1)) else list(d)
    return {
        "devices": devices,
        "mesh": {a: n for a, n in sp.axis_sizes.items() if n > 1} or {"data": 1},
        "micro_batch": sp.micro_batch,
        "dp": sp.dp,
    }


def _text_only_step_s(batches, reps, maestro_step, mono_step, say) -> dict:
    """Median step time on the same token rows with every modality item removed (placeholders
    stay ordinary tokens, so the LLM does identical work and only the encoders drop out), for the
    wavefront schedule and for the monolithic baseline, each on its own devices. Over the compound
    step's time it is the paper's "efficiency relative to text-only": 100%: the encoders cost the
    LLM nothing; below: the LLM waits for, or shares its devices with, them."""
    text = [[Sample(s.id, s.tokens) for s in b] for b in batches]
    say("text-only (modality items removed) warm-up: monolithic and wavefront, compiling the text-only buckets")
    for samples in text:  # warm-up: the text-only buckets
        mono_step(samples, {"step_s": []})
        maestro_step("wavefront", samples, _no_stats())
    alone = {"monolithic": [], "wavefront": []}
    for rep in range(reps):
        for mode, times in alone.items():
            stats = _no_stats()
            for samples in text:
                mono_step(samples, stats) if mode == "monolithic" else maestro_step(mode, samples, stats)
            times.append(sum(stats["step_s"]))
        say(
            f"text-only repetition {rep + 1}/{reps}: "
            + ", ".join(f"{m} {seconds(t[-1] / len(text))}/step" for m, t in alone.items())
        )
    return {m: statistics.median(alone[m]) / len(text) for m in alone}


def _prediction(rt, cost, batches, per_rep, num_batches) -> dict:
    """Calibrated simulator vs measured step time (serial: XLA's CPU client runs one program at a time)."""
    serial = jax.devices()[0].platform == "cpu"
    out = {"cost_source": cost.source, "serial": serial}
    for mode in ("naive", "wavefront"):
        predicted = 0.0
        for samples in batches:
            metas = sample_metas(rt.graph, samples)
            sched = naive(metas, rt.problem) if mode == "naive" else wavefront(metas, rt.problem, cost)
            predicted += simulate(sched, rt.problem, metas, cost, serial=serial).makespan
        measured = statistics.median(per_rep[mode])
        out[mode] = {
            "predicted_step_s": predicted / num_batches,
            "measured_step_s": measured / num_batches,
            "relative_error": (predicted - measured) / measured,
        }
    return out


def _traces(rt, cost, states, samples, trace_dir) -> dict:
    from pathlib import Path

    from maestro_jax.tools.trace import write_chrome_trace, write_gantt

    out = Path(trace_dir)
    metas = sample_metas(rt.graph, samples)
    sched = wavefront(metas, rt.problem, cost)
    _, record = rt.step.timeline(states, StepBatch(samples, sched))
    sim = simulate(sched, rt.problem, metas, cost)
    files = {
        "measured_trace": write_chrome_trace(record, out / "measured_trace.json"),
        "measured_gantt": write_gantt(record, out / "measured_gantt.png", "measured (timed, serialised)"),
        "simulated_trace": write_chrome_trace(sim.intervals, out / "simulated_trace.json"),
        "simulated_gantt": write_gantt(
            sim.intervals, out / "simulated_gantt.png", "simulated, sections on their own devices"
        ),
    }
    return {k: str(v) for k, v in files.items()}


__all__ = ["MODES", "ORDERS", "bench", "bench_packing", "monolithic_orders"]
