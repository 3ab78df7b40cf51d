"""`maestro-jax simulate`: a config's plan predicted on a cluster, maestro vs monolithic.

The workload is read off its graph (`workloads.describe`: parameter shapes by `jax.eval_shape`,
nothing compiled or allocated) and its samples off the source's sizes; the prediction itself
is the JAX-free `planning.cluster`. `format_report` prints it in human units (s, ms, µs).
"""

from __future__ import annotations

from collections.abc import Callable

from maestro_jax import workloads
from maestro_jax.config import Config
from maestro_jax.core.plan import Plan, SectionPlan, check_fanout, check_meshes, check_resources, mesh_shape
from maestro_jax.planning.baselines import (
    BaselineResult,
    FairMonolithic,
    Pipelined1F1B,
    baseline_lines,
    pipelined_words,
    result_of,
    user_baselines,
)
from maestro_jax.planning.cluster import simulate_plan
from maestro_jax.planning.cost import DEVICES
from maestro_jax.planning.pricer import Pricer
from maestro_jax.planning.problem import PlanningProblem
from maestro_jax.planning.text import digits, layer_remat_text, mesh_text, rate, seconds
from maestro_jax.runtime.build import check_pack_budget


def baseline_problem(cfg: Config, spec, plan, metas) -> PlanningProblem | None:
    """The planning problem the baselines are priced on: as many devices as the plan uses, the
    memory budget `device_memory_gb`, else the device's own; None without one (a CPU device)."""
    n = len({d for sp in plan.sections.values() for d in sp.devices})
    memory_gb = cfg.device_memory_gb or DEVICES[cfg.simulate.device].get("memory_gb")
    if memory_gb is None:
        return None
    return PlanningProblem.of(
        spec,
        metas,
        n,
        memory_gb,
        global_batch=cfg.global_batch,
        device=cfg.simulate.device,
        link_gbps=cfg.simulate.link_gbps,
    )


def monolithic_baseline(cfg: Config, problem: PlanningProblem | None) -> tuple[SectionPlan, dict[str, str] | None, str]:
    """The monolithic layout to compare with, on the problem's devices: the fastest that fits its
    memory budget, as `plan` finds it, so that maestro is never measured against a layout no one
    would run, with its activation checkpointing per section. Without a budget (`problem` None:
    a CPU device), or where no layout fits it, the config's `monolithic` section, as written (one
    policy for every trained section: None), and the label says which."""
    if problem is None:
        return cfg.monolithic_plan(), None, "config"
    best = FairMonolithic().price(Pricer(problem), {})
    if best is None:  # said, never silent: the layout priced then is one that does not fit either
        return (
            cfg.monolithic_plan(),
            None,
            f"config; no monolithic layout fits {problem.memory_gb:g} GB on {problem.devices} devices",
        )
    sp = SectionPlan(tuple(range(problem.devices)), mesh_shape(**best.mesh), best.micro_batch)
    return sp, best.layer_remat, f"fastest that fits {problem.memory_gb:g} GB"


def pipelined_baseline(problem: PlanningProblem | None) -> BaselineResult | None:
    """The fastest 1F1B pipeline-parallel layout (Megatron-LM's, `planning.pipeline`) on the
    problem's devices within its memory budget; None without a budget (a CPU device) or when
    nothing fits."""
    return None if problem is None else Pipelined1F1B().price(Pricer(problem), {})


def simulate_config(
    cfg: Config, gantt: str | None = None, graph=None, source=None, progress: Callable[[str], None] | None = None
) -> dict:
    """The prediction for `cfg`'s workload, or for a user's `graph` and `source`; `progress`,
    when given, receives one line before each phase."""
    say = progress or (lambda _: None)
    say(f"describing workload {cfg.workload}: parameter shapes (jax.eval_shape) and {cfg.simulate.batches} batches")
    graph = graph or workloads.build_graph(cfg)
    source = source if source is not None else workloads.source_from_config(cfg)
    check_pack_budget(cfg, source)  # a packed row prices its samples whole
    spec = workloads.describe(cfg, graph)
    plan = _checked_plan(cfg, spec)
    metas = workloads.planning_batches(cfg, graph, cfg.simulate.batches, source)
    say("the fastest monolithic layout on the plan's devices")
    problem = baseline_problem(cfg, spec, plan, metas)  # one per call: both baselines read it
    mono_sp, mono_remat, baseline = monolithic_baseline(cfg, problem)
    say(f"the config's plan under the naive and wavefront schedules ({cfg.simulate.device})")
    report, timeline = simulate_plan(
        spec,
        plan,
        mono_sp,
        metas,
        mono_remat=mono_remat,
        device=cfg.simulate.device,
        link_gbps=cfg.simulate.link_gbps,
        max_in_flight=cfg.schedule.max_in_flight,
        run_ahead=cfg.schedule.run_ahead,
        balance_shards=cfg.schedule.balance_shards,
    )
    report["monolithic_layout"] = {
        "mesh": dict(mono_sp.axis_sizes),
        "micro_batch": mono_sp.micro_batch,
        "layer_remat": mono_remat or mono_sp.layer_remat,
        "chosen": baseline,
    }
    report["user_baselines"] = _users_on(cfg, spec, metas, mono_sp, mono_remat)
    say("the fastest pipelined (1F1B) layout on the plan's devices")
    pipelined = pipelined_baseline(problem)
    report["pipelined"] = pipelined and pipelined.to_json()
    if pipelined:  # on as many devices as the plan: a ratio of step times is one of per-device rates
        report["speedup_vs_pipelined"] = pipelined.ratio(report["step_time_s"]["wavefront"])
    if cached := teacher_cache_alternative(cfg, source, len(mono_sp.devices)):
        say("the student alone on every device, its teacher's outputs read from a teacher cache")
        report["teacher_cache"] = cached
    if gantt:
        from maestro_jax.tools.trace import write_gantt  # here: matplotlib only when asked

        write_gantt(timeline.intervals, gantt, f"{spec.name} wavefront, simulated on {cfg.simulate.device}")
        report["gantt"] = gantt
    return report


def _checked_plan(cfg: Config, spec) -> Plan:
    """The config's plan, its devices, meshes and fanouts checked as the runtime would."""
    plan = cfg.plan()
    check_resources(plan, max(d for sp in plan.sections.values() for d in sp.devices) + 1)
    check_meshes(plan)
    check_fanout(plan, spec.edges)
    return plan


def _users_on(cfg: Config, spec, metas, mono_sp: SectionPlan, mono_remat: dict[str, str] | None) -> dict | None:
    """The users' baselines (`planning.baselines.user_baselines`) on the monolithic layout
    `mono_sp`, each trained section checkpointed as `mono_remat` says (else as `mono_sp`)."""
    remat = mono_remat or {s: mono_sp.layer_remat if sec.trained else "none" for s, sec in spec.sections.items()}
    return user_baselines(
        spec,
        metas,
        {"mesh": dict(mono_sp.axis_sizes), "micro_batch": mono_sp.micro_batch, "layer_remat": remat},
        len(mono_sp.devices),
        cfg.global_batch,
        cfg.simulate.device,
        cfg.simulate.link_gbps,
    )


def teacher_cache_alternative(cfg: Config, source, devices: int) -> dict | None:
    """For KD with one teacher run online: the step of the student alone on all `devices` (the
    teacher's outputs read from a `maestro-jax teacher-cache` cache: `distill.cache`), laid out
    by the planner, and the cache bytes a step reads (its I/O, which the step time leaves out:
    int32 ids and float32 log-probabilities for k tokens and a float32 tail a position). None
    for other configs (a cached run prices the student alone already)."""
    from maestro_jax.data.teacher_cache import DEFAULT_K
    from maestro_jax.workloads import kd

    if cfg.workload != "kd" or cfg.distill.cache is not None or len(teachers := kd.teachers_of(cfg)) != 1:
        return None
    k = cfg.distill.top_k or DEFAULT_K
    from maestro_jax.planning.search import search
    from maestro_jax.tools.plan import problem_for

    memory_gb = cfg.device_memory_gb or DEVICES[cfg.simulate.device].get("memory_gb") or float("inf")
    graph = kd.student_alone(cfg, teachers[0], k)
    problem = problem_for(cfg, devices, memory_gb, cfg.simulate.batches, graph=graph, source=source)
    best = search(problem, top=1).best
    positions = sum(m.work.get("student", 0) for batch in problem.metas for m in batch) / max(len(problem.metas), 1)
    student = best.plan.sections["student"]
    return {
        "k": k,
        "devices": devices,
        "step_time_s": best.step_time_s,
        "layout": {"mesh": dict(student.axis_sizes), "micro_batch": student.micro_batch},
        "cache_bytes_per_step": positions * (k * 8 + 4),
    }


pipelined_layout = pipelined_words  # its old name


def user_baseline_lines(users: dict | None, maestro_s: float) -> list[str]:
    """What users run today (`planning.baselines`: each plug-in's own lines), each against
    maestro's step time `maestro_s`, and the share of the monolithic layout's ceiling maestro
    reaches (over 100% where maestro's own layouts beat anything that layout can do); `users`:
    their records as `simulate` writes them."""
    if not users:
        return []
    priced = {name: result_of(name, record) for name, record in users.items()}
    return baseline_lines(priced, maestro_s)


# how `device_time_line` names each share of `simulator.device_time`
DEVICE_TIME_TEXT = {
    "work": "the samples' own work",
    "row_padding": "rows padded to their micro-step's longest",
    "empty_rows": "empty rows",
    "bucket_padding": "shape buckets",
    "overhead": "per-program overhead",
    "collectives": "collectives the compute does not hide",
    "optimizer": "optimizer steps",
    "idle": "idle (dependencies, transfers)",
}


def device_time_line(shares: dict | None) -> str | None:
    """Where maestro's step's device time goes (`simulator.device_time`, shares), in one line."""
    if not shares:
        return None
    return "maestro's device time (wavefront): " + ", ".join(
        f"{digits(100 * shares[k])}% {text}" for k, text in DEVICE_TIME_TEXT.items()
    )


# `empty_rows_note` speaks where the sink's empty rows take more than this share of the device time
EMPTY_ROWS_NOTE = 0.02


def empty_rows_note(by_section: dict | None, plan, sink: str, global_batch: int) -> str | None:
    """A line where the sink's empty rows (its stages' too) take over `EMPTY_ROWS_NOTE` of the
    device time (`simulator.section_time`): its micro-steps' rows do not divide the samples of a
    step, so the last one runs partly empty, which no schedule of whole samples avoids (on the
    paper VLM at 128 devices, 7.2%). It names the global batches that fill them."""
    mine = [s for s in (by_section or {}) if s == sink or s.startswith(f"{sink}.")]
    share = sum(by_section[s]["empty_rows"] for s in mine)
    if share <= EMPTY_ROWS_NOTE:
        return None
    rows = plan.sections[mine[0]].rows
    fits = sorted({n for n in (global_batch // rows * rows, -(-global_batch // rows) * rows) if n})
    return (
        f"note: {digits(100 * share)}% of the device time is the {sink}'s empty rows: it takes {rows} rows a "
        f"micro-step and a step has {global_batch} samples; where every sample reaches the {sink}, "
        f"global_batch={' or '.join(map(str, fits))} fills them (a change of the training recipe, not of the plan)"
    )


def teacher_cache_line(cached: dict, online_s: float) -> str:
    """`teacher_cache_alternative`'s step beside the config's own (the teacher online)."""
    layout = cached["layout"]
    return (
        f"from a teacher cache (top {cached['k']}; no teacher section): the student alone on {cached['devices']} "
        f"devices ({mesh_text(layout['mesh'])}, micro_batch {layout['micro_batch']}) "
        f"{seconds(cached['step_time_s'])} a step against the teacher online's {seconds(online_s)} (wavefront), "
        f"{cached['cache_bytes_per_step'] / 1e6:.2f} MB of cache read a step (not priced)"
    )


def _mode_rows(r: dict, pipe: BaselineResult | None) -> list[tuple[str, float, float, float]]:
    """(mode, step time, samples/s, per device) of each mode simulated, and of the 1F1B baseline."""
    rows = [
        (m, r["step_time_s"][m], r["samples_per_s"][m], r["samples_per_s_per_device"][m])
        for m in ("monolithic", "naive", "wavefront")
    ]
    if pipe:
        per_device = pipe.samples_per_s_per_device
        rows.append(("pipelined (1F1B)", pipe.step_time_s, per_device * pipe.devices, per_device))
    return rows


def format_report(r: dict) -> str:
    """`simulate_config`'s report as `maestro-jax simulate` prints it: a table of step times and
    throughput per mode, then the layouts compared and the ratios."""
    maestro = r["devices"]["maestro"]
    lines = [
        f"workload {r['workload']} on {r['device']} (cost model {r['cost_source']}): "
        + ", ".join(f"{s} on {n} device{'s' if n > 1 else ''}" for s, n in maestro.items())
        + f"; monolithic on {r['devices']['monolithic']}",
        f"{'mode':18s} {'step time':>10s} {'samples/s':>10s} {'per device':>11s}",
    ]
    pipe = result_of("pipelined", r.get("pipelined"))
    lines += [f"{m:18s} {seconds(t):>10s} {rate(sps):>10s} {rate(per):>11s}" for m, t, sps, per in _mode_rows(r, pipe)]
    lay = r["monolithic_layout"]
    lines.append(
        f"monolithic layout ({lay['chosen']}): mesh {mesh_text(lay['mesh'])}, micro_batch "
        f"{lay['micro_batch']}, layer_remat {layer_remat_text(lay['layer_remat'])}"
    )
    if pipe:
        lines.append(f"pipelined (1F1B) layout: {pipe.layout}")
    lines += user_baseline_lines(r.get("user_baselines"), r["step_time_s"]["wavefront"])
    if spent := device_time_line(r.get("device_time")):
        lines.append(spent)
    if cached := r.get("teacher_cache"):
        lines.append(teacher_cache_line(cached, r["step_time_s"]["wavefront"]))
    vs_pipe = f"   wavefront vs pipelined: {r['speedup_vs_pipelined']:.3f}" if pipe else ""
    lines.append(
        f"per-device speedup (wavefront vs monolithic): {r['per_device_speedup']:.3f}   end-to-end: "
        f"{r['end_to_end_speedup']:.3f}   wavefront vs naive: {r['wavefront_vs_naive']:.3f}{vs_pipe}"
    )
    lines.append(
        f"makespan / lower bound: {r['makespan_over_lower_bound']:.3f}   critical section alone: "
        f"{seconds(r['critical_section_alone_s'])}   bubble ratio: {r['bubble_ratio']:.3f}"
    )
    eff = r["sink_efficiency_vs_alone"]
    lines.append(
        f"loss section's efficiency relative to running alone (a VLM's LLM: relative to text-only): "
        f"maestro {eff['maestro']:.1%}, monolithic {eff['monolithic']:.1%}"
    )
    lines.append(
        f"priced: the config's own plan (its sections' devices, meshes and micro-batches); `maestro-jax plan "
        f"--config FILE --devices {r['devices']['monolithic']} --memory-gb M` searches this workload's plans on as "
        f"many devices and may find a faster one"
    )
    if r.get("gantt"):
        lines.append(f"wrote {r['gantt']}")
    return "\n".join(lines)
