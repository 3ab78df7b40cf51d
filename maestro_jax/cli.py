"""`maestro-jax train|verify --config FILE [key=value ...]`.

Thin entry point: parse, validate the config (before JAX starts: it sets the CPU device count),
then call the library. Each fault ends with one `error:` line on stderr and its own status:
2 bad input (config, plan, data), 3 non-finite loss or gradients, 4 storage (a checkpoint,
`output_dir` or `checkpoint_dir` that cannot be written), 5 a dead or stuck peer process,
130 SIGINT (Ctrl-C: stops at once; the last committed checkpoint is intact). SIGTERM saves a
checkpoint and exits 0; before the first step (start-up, restore) it stops with nothing new to
save, also 0.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
import threading
import traceback

from maestro_jax.config import ConfigError, load_config
from maestro_jax.planning.planner import TOLERANCE

CPU_THREADS_PER_DEVICE = 4


def _ensure_host_devices(n: int) -> None:
    """Give the CPU backend `n` virtual devices when nothing else is asked for (no-op on GPU),
    and a client thread pool large enough for them (`PJRT_NPROC`, unless set).

    The CPU client runs each device's part of a program on a pool thread, and a part that
    reaches a collective holds its thread until every peer arrives. The pool has one thread
    per device by default, so when several sections' programs are in flight (the wavefront
    order interleaves them), parts of one program can hold every thread while their peers wait
    for one: XLA then aborts after 40 s at a rendezvous. Four threads per device measured
    enough for a 32-device VLM plan with 16 micro-steps in flight (`tests/test_executor.py`)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()
    devices = re.search(r"xla_force_host_platform_device_count=(\d+)", os.environ["XLA_FLAGS"])
    os.environ.setdefault("PJRT_NPROC", str(CPU_THREADS_PER_DEVICE * int(devices.group(1))))


def main(argv: list[str] | None = None) -> int:
    """Run one command; SIGINT stops it with one line and status 130, at any point.

    Python's own SIGINT handler is installed even where the process inherited SIGINT ignored (a
    non-interactive shell starts background jobs so): a SIGINT sent to a run must stop it."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return _main(argv)
    except KeyboardInterrupt:
        print("error: interrupted (SIGINT): stopped without a new checkpoint; the last committed checkpoint is "
              "intact (re-run to resume; SIGTERM instead checkpoints first)", file=sys.stderr, flush=True)
        return 130


def _main(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(prog="maestro-jax", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    parsers = {}
    for name, help_ in (("train", "train from a config"), ("verify", "maestro vs monolithic on one batch"),
                        ("bench", "monolithic vs naive vs wavefront throughput, side by side"),
                        ("simulate", "predicted maestro vs monolithic throughput on a cluster (nothing compiled)"),
                        ("plan", "search devices, meshes and micro-batches for the best plan (nothing compiled)"),
                        ("export", "write a trained LLM section as a Hugging Face folder")):
        p = parsers[name] = sub.add_parser(name, help=help_)
        p.add_argument("--config", required=True)
        p.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. steps=4")
        if name not in ("simulate", "plan"):
            g = p.add_argument_group("multi-process (default: auto-detect SLURM, else one process)")
            g.add_argument("--coordinator", help="host:port of process 0's coordination service")
            g.add_argument("--num-processes", type=int)
            g.add_argument("--process-id", type=int)
    parsers["bench"].add_argument("--reps", type=int, default=5)
    parsers["bench"].add_argument("--batches", type=int, default=3, help="global batches per repetition")
    parsers["bench"].add_argument("--json", help="write the report as JSON here")
    parsers["bench"].add_argument("--trace", help="write measured and simulated traces and Gantt PNGs here")
    parsers["simulate"].add_argument("--json", help="write the report as JSON here")
    parsers["export"].add_argument("--section", required=True, help="an LLM section, e.g. student or llm")
    parsers["export"].add_argument("--out", required=True, help="the Hugging Face folder to write")
    parsers["export"].add_argument("--model-type", default="llama", choices=("llama", "qwen2", "qwen3", "qwen3_moe"))
    parsers["plan"].add_argument("--devices", type=int, required=True, help="devices the plan may use")
    parsers["plan"].add_argument("--memory-gb", type=float, required=True, help="memory per device, GB")
    parsers["plan"].add_argument("--top", type=int, default=10, help="candidates to list")
    parsers["plan"].add_argument("--tolerance", type=float, default=TOLERANCE,
                                 help="relative gap to the optimum the search may leave (0: exact)")
    parsers["plan"].add_argument("--write", help="write the config with the chosen plan here (train/bench accept it)")
    parsers["plan"].add_argument("--json", help="write the report as JSON here")
    parsers["plan"].add_argument("--measure", action="store_true",
                                 help="compile the chosen plan here and print XLA's memory analysis beside the model")
    parsers["simulate"].add_argument("--gantt", help="write the simulated Gantt chart PNG here")
    args = parser.parse_args(argv)
    if args.command == "train":
        from maestro_jax.training.preemption import Preemption

        with Preemption():  # from here on, SIGTERM is a preemption notice (kept until the loop reads it)
            return _command(args)
    return _command(args)


def _error_line(err) -> str:
    """The one `error:` line a fault ends with. Messages that carry a library's text (a
    tensorstore spec, an XLA status) can span lines; they are joined, so the line stays one."""
    text = " ".join(str(err).split())
    return text if text.startswith("error:") else f"error: {text}"


def _command(args) -> int:
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as err:
        print(_error_line(err), file=sys.stderr)
        return 2
    if args.command in ("simulate", "plan"):
        from maestro_jax.core.plan import PlanError

        if args.command == "plan" and args.measure:
            _ensure_host_devices(args.devices)  # before JAX starts: --measure compiles on these devices
        try:
            return _simulate(cfg, args) if args.command == "simulate" else _plan(cfg, args)
        except (ConfigError, PlanError) as err:
            print(_error_line(err), file=sys.stderr)
            return 2
    _ensure_host_devices(cfg.host_devices)
    if args.coordinator and (args.num_processes is None or args.process_id is None):
        print("error: --coordinator needs --num-processes and --process-id", file=sys.stderr)
        return 2
    from maestro_jax.runtime.distributed import maybe_initialize_distributed

    maybe_initialize_distributed(args.coordinator, args.num_processes, args.process_id,
                                 heartbeat_timeout_s=cfg.distributed.heartbeat_timeout_s)
    import jax

    from maestro_jax.runtime.distributed import announce_failure

    try:
        status = _run(cfg, args)
    except BaseException as err:
        if jax.process_count() == 1:
            raise
        if isinstance(err, KeyboardInterrupt):
            print("error: interrupted (SIGINT)", file=sys.stderr, flush=True)
            status = 130
        else:
            traceback.print_exc()
            status = 1
        announce_failure(f"{type(err).__name__}: {err}")
    if status != 0 and jax.process_count() > 1:
        # Peers waiting on this process learn of the failure now, and jax.distributed's
        # exit-time shutdown (which waits for every peer, and a failed peer may never come) is
        # skipped: leave with the error already printed rather than hang.
        announce_failure(f"exit status {status}")  # a no-op when the error was announced already
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    return status


def _run(cfg, args) -> int:
    from maestro_jax.core.plan import PlanError
    from maestro_jax.data import DataError
    from maestro_jax.runtime.distributed import PeerError
    from maestro_jax.training.loop import NonFiniteError
    from maestro_jax.training.storage import StorageError

    faults = ((NonFiniteError, 3), (StorageError, 4), (PeerError, 5), (DataError, 2))  # StorageError: checkpoints too
    try:
        if args.command == "train":
            from maestro_jax.training.loop import train

            try:
                history = train(cfg)
            except tuple(f for f, _ in faults) as err:
                print(_error_line(err), file=sys.stderr)
                from maestro_jax.runtime.distributed import announce_failure

                announce_failure(f"{type(err).__name__}: {err}")
                return next(code for f, code in faults if isinstance(err, f))
            if history:  # else train said "nothing to do", naming the step the checkpoint holds
                print(f"trained steps {history[0]['step']}..{history[-1]['step']}: "
                      f"loss {history[0]['loss']:.4f} -> {history[-1]['loss']:.4f}")
            return 0
        if args.command == "bench":
            return _bench(cfg, args)
        if args.command == "export":
            return _export(cfg, args)
        from maestro_jax.tools.verify import report, verify

        text, ok = report(verify(cfg), cfg.verify_tolerance)
        print(text)
        return 0 if ok else 1
    except (ConfigError, PlanError) as err:
        print(_error_line(err), file=sys.stderr)
        return 2


def _simulate(cfg, args) -> int:
    from maestro_jax.tools.simulate import simulate_config

    r = simulate_config(cfg, gantt=args.gantt)
    print(f"workload {r['workload']}: sections {', '.join(r['sections'])} on {r['devices']['maestro']} devices")
    print(f"{'mode':12s} {'samples/s':>10s} {'per device':>11s} {'step s':>9s}")
    for m in ("monolithic", "naive", "wavefront"):
        print(f"{m:12s} {r['samples_per_s'][m]:10.3f} {r['samples_per_s_per_device'][m]:11.5f} "
              f"{r['step_time_s'][m]:9.2f}")
    lay = r["monolithic_layout"]
    print(f"monolithic layout ({lay['chosen']}): mesh {lay['mesh']} micro_batch {lay['micro_batch']} "
          f"layer_remat {lay['layer_remat']}")
    print(f"per-device speedup (wavefront vs monolithic): {r['per_device_speedup']:.3f}")
    if r["pipelined"] is not None:
        print(pipelined_line(r["pipelined"], r["step_time_s"]["wavefront"]).replace("planned maestro", "wavefront"))
    print(f"end-to-end speedup: {r['end_to_end_speedup']:.3f}   wavefront vs naive: {r['wavefront_vs_naive']:.3f}")
    print(f"makespan / lower bound: {r['makespan_over_lower_bound']:.3f}   "
          f"critical section alone: {r['critical_section_alone_s']:.2f}s   bubble ratio: {r['bubble_ratio']:.3f}")
    eff = r["sink_efficiency_vs_alone"]
    print(f"loss section's efficiency relative to running alone (a VLM's LLM: relative to text-only): "
          f"maestro {eff['maestro']:.1%}, monolithic {eff['monolithic']:.1%}")
    _write_json(args.json, r)
    return 0


def _export(cfg, args) -> int:
    """The section's weights from the latest checkpoint in `output_dir` (else its initial ones).

    The export holds the run lock of `output_dir` and `checkpoint_dir` (`training.dirlock`) while
    it reads, so a live run cannot rotate or clean the checkpoints under it (and the export is
    refused while a run holds them); the checkpoint directory is opened read-only."""
    from pathlib import Path

    from maestro_jax.runtime.build import build_runtime
    from maestro_jax.tools import hf
    from maestro_jax.training.checkpoint import Checkpointer
    from maestro_jax.training.dirlock import hold_directories

    model = cfg.models.get(args.section)
    if args.section not in cfg.sections or model is None or model.kind != "llm":
        llms = sorted(s for s in cfg.sections if s in cfg.models and cfg.models[s].kind == "llm")
        print(f"error: --section={args.section!r}: not an LLM section of this config; valid: {llms}", file=sys.stderr)
        return 2
    rt = build_runtime(cfg)
    states, step = rt.init_states(), 0
    if cfg.output_dir:
        ck_dir = Path(cfg.checkpoint_dir or Path(cfg.output_dir) / "checkpoints")
        existing = {k: d for k, d in (("output_dir", Path(cfg.output_dir)), ("checkpoint_dir", ck_dir)) if d.is_dir()}
        with hold_directories(existing):  # nothing is created for an output_dir that does not exist
            ckpt = Checkpointer(ck_dir, read_only=True)
            try:
                restored = ckpt.restore_latest(states)
            finally:
                ckpt.close()
        if restored is not None:
            step, states = restored[0], restored[1]
    try:
        hf.save_llm(args.out, states[args.section].params, model.model_dump(), model_type=args.model_type)
    except hf.HFError as err:
        print(_error_line(err), file=sys.stderr)
        return 2
    print(f"wrote {args.out}: section {args.section!r} at step {step} ({args.model_type})")
    return 0


def _plan(cfg, args) -> int:
    from maestro_jax.planning.planner import InfeasibleError, format_table
    from maestro_jax.tools.plan import planner_for, write_plan

    if args.devices < 1 or args.memory_gb <= 0:
        print(f"error: --devices={args.devices} --memory-gb={args.memory_gb}: both must be positive", file=sys.stderr)
        return 2
    if not 0 <= args.tolerance < 1:
        print(f"error: --tolerance={args.tolerance}: must be in [0, 1)", file=sys.stderr)
        return 2
    try:
        report = planner_for(cfg, args.devices, args.memory_gb, tolerance=args.tolerance).search(top=args.top)
    except InfeasibleError as err:
        print(_error_line(err), file=sys.stderr)
        return 2
    print(f"workload {cfg.workload}: sections {', '.join(best_sections(report))}; {report.considered} plans within "
          f"the bound threshold pass every constraint; {report.simulated} simulated (the rest are ruled out by their "
          f"lower bound); cost model: {cfg.simulate.device}")
    print(format_table(report))
    mono, best = report.monolithic, report.best
    if mono:
        print(f"monolithic best layout: mesh {mono['mesh']} micro_batch {mono['micro_batch']} layer_remat "
              f"{mono['layer_remat']}: predicted "
              f"{mono['step_time_s']:.4g} s/step; planned maestro: {best.step_time_s:.4g} s/step "
              f"({mono['step_time_s'] / best.step_time_s:.3f}x)")
    else:
        print("monolithic: no layout fits in memory on these devices")
    print(pipelined_line(report.pipelined, best.step_time_s))
    if args.write:
        write_plan(args.config, args.overrides, best, args.memory_gb, args.write)
        print(f"wrote {args.write}: maestro-jax bench --config {args.write}")
    if args.measure:
        _measure_plan(cfg, args, best)
    _write_json(args.json, {"best": best.describe(), "step_time_s": best.step_time_s,
                            "samples_per_s_per_device": best.samples_per_s_per_device,
                            "top": [dict(plan=c.describe(), step_time_s=c.step_time_s, memory_gb=c.memory_gb)
                                    for c in report.top],
                            "monolithic": mono, "pipelined": report.pipelined, "considered": report.considered,
                            "simulated": report.simulated})
    return 0


def pipelined_line(pipe: dict | None, maestro_s: float) -> str:
    """The 1F1B pipeline-parallel baseline (Megatron-LM's layout, `planning.pipeline`) in one line."""
    if not pipe:
        return "pipelined (1F1B): no layout fits in memory on these devices (or the sink has too few layers)"
    where = "; ".join([f"{s} layers {'/'.join(map(str, n))}" for s, n in pipe["layers_per_stage"].items()]
                      + [f"{s} whole in stage 1" for s in pipe["first_stage_whole"]])
    return (f"pipelined (1F1B) best layout: {pipe['stages']} stages x {pipe['devices_per_stage']} devices, mesh "
            f"{pipe['mesh']} micro_batch {pipe['micro_batch']} ({pipe['micro_batches']} per step) layer_remat "
            f"{pipe['layer_remat']}; {where}: predicted {pipe['step_time_s']:.4g} s/step; planned maestro: "
            f"{maestro_s:.4g} s/step ({pipe['step_time_s'] / maestro_s:.3f}x)")


def best_sections(report) -> list[str]:
    return list(report.best.plan.sections)


def _measure_plan(cfg, args, best) -> None:
    """Compile the chosen plan on this machine's devices and compare its memory with the model."""
    from maestro_jax.config import load_config
    from maestro_jax.runtime.build import build_runtime
    from maestro_jax.tools.compiled_memory import compiled_memory
    from maestro_jax.tools.plan import plan_overrides

    planned = load_config(args.config, [*args.overrides, *(f"{k}={v}" for k, v in plan_overrides(best).items())])
    rt = build_runtime(planned)
    measured = compiled_memory(rt, rt.init_states(), rt.batches()[0])
    for s, m in measured.items():
        print(f"memory {s}: model {best.memory_gb[s]:.4g} GB/device, compiled {m['total'] / 2**30:.4g} GB/device "
              f"(largest program {max(m['programs'], key=m['programs'].get)}, optimizer state included)")


def _write_json(path: str | None, report: dict) -> None:
    if path:
        import json

        with open(path, "w") as f:
            json.dump(report, f, indent=2)


def _bench(cfg, args) -> int:
    from maestro_jax.tools.bench import MODES, bench

    r = bench(cfg, reps=args.reps, num_batches=args.batches, trace_dir=args.trace)
    print(f"{'mode':12s} {'samples/s':>10s} {'tokens/s':>10s} {'step median s':>14s} {'min':>8s} {'max':>8s}")
    for m in MODES:
        t = r["step_time_s"][m]
        print(f"{m:12s} {r['samples_per_s'][m]:10.2f} {r['tokens_per_s'][m]:10.1f} {t['median']:14.4f} "
              f"{t['min']:8.4f} {t['max']:8.4f}")
    for k, v in r["ratios"].items():
        print(f"{k}: {v:.3f}")
    for m, v in r["host_overhead_fraction"].items():
        print(f"host overhead ({m}): {v:.1%} of step time (scheduling {r['schedule_fraction'][m]:.1%})")
    if "efficiency_vs_text_only" in r:
        e = r["efficiency_vs_text_only"]
        print(f"efficiency relative to text-only (same token rows, modality items removed): "
              f"wavefront {e['wavefront']:.1%}, monolithic {e['monolithic']:.1%}")
    for m in ("naive", "wavefront"):
        p = r["simulator"][m]
        print(f"simulator ({r['simulator']['cost_source']}, serial={r['simulator']['serial']}) {m}: predicted "
              f"{p['predicted_step_s']:.4f}s vs measured {p['measured_step_s']:.4f}s ({p['relative_error']:+.1%})")
    _write_json(args.json, r)
    return 0


def console_main() -> None:
    """The `maestro-jax` command. A run that failed leaves without the interpreter's teardown:
    its `error:` line stays the last line on stderr (asyncio and Orbax threads of a failed
    save otherwise print tracebacks while the interpreter shuts down), and everything that must
    survive a fault (committed checkpoints, metrics) is written before the error is printed."""
    status = main()
    if status:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    sys.exit(status)


if __name__ == "__main__":
    console_main()
