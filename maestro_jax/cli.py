"""`maestro-jax {train,verify,eval,bench,simulate,plan,teacher-cache,export} --config FILE [options] [key=value ...]`; check-hf --hf DIR.

The command line, and only it: parse, validate the config (before JAX starts: it sets the CPU
device count), call the library, and turn each kind of fault into its `error:` line and status
(below); each command's options and its call are one entry of the `COMMANDS` table, and what a
command computes lives in the library (`tools`, `training`). `maestro-jax --help` lists the commands (the `COMMANDS` table: one entry
each, with its options), `maestro-jax COMMAND --help` each option with its default.

XLA's C++ log (e.g. `[SPMD] Involuntary full rematerialization` notes while compiling) is off
below errors unless `--verbose` (`TF_CPP_MIN_LOG_LEVEL`, set before JAX loads; a level set in
the environment is kept). Python's own errors and the `error:` lines below always show.

Each fault ends with one `error:` line on stderr and its own status:
2 bad input (config, plan, data), 3 non-finite loss or gradients, 4 storage (a checkpoint,
`output_dir` or `checkpoint_dir` that cannot be written), 5 a dead or stuck peer process,
130 SIGINT (Ctrl-C: stops at once; the last committed checkpoint is intact). SIGTERM saves a
checkpoint and exits 0; before the first step (start-up, restore) it stops with nothing new to
save, also 0.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import re
import sys
import threading
import traceback
from collections.abc import Callable

from maestro_jax.config import Config, ConfigError, load_config
from maestro_jax.planning.planner import TOLERANCE

CPU_THREADS_PER_DEVICE = 4
XLA_LOG_LEVEL = "2"  # TF_CPP_MIN_LOG_LEVEL without --verbose: errors only (jax's own default, 1, shows warnings)
XLA_VERBOSE_LOG_LEVEL = "0"  # with --verbose: info, warnings and errors


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


def _xla_logging(verbose: bool) -> None:
    """XLA's C++ log level (TSL logging reads `TF_CPP_MIN_LOG_LEVEL` once, when jaxlib loads, so
    this must run before JAX is imported: later it changes nothing). Without `verbose`, errors
    only, unless the environment sets a level; with it, everything (info included)."""
    if verbose:
        os.environ["TF_CPP_MIN_LOG_LEVEL"] = XLA_VERBOSE_LOG_LEVEL
    else:
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", XLA_LOG_LEVEL)


# -- the commands ---------------------------------------------------------------------------------
Option = tuple[tuple[str, ...], dict]


def opt(*flags: str, **kwargs) -> Option:
    """One `add_argument` call of a command: its flags and keywords. Give every option a `help`
    that ends with its default when the default is None (`(default: not written)`); other
    defaults are appended by the help formatter."""
    return flags, kwargs


@dataclasses.dataclass(frozen=True)
class Command:
    """One `maestro-jax` command: a line of `--help`, what runs it and its own options (beside
    `--config`, the `key=value` overrides and `--verbose`, which every command takes).

    `devices`: it runs programs on this machine's devices, so the CPU device count is set, the
    multi-process options are offered and `jax.distributed` starts before `run`; otherwise
    (`simulate`, `plan`) nothing compiles and `run` sets up what it needs itself.
    `guard`: a context manager held from before the config is read until the command ends."""

    help: str
    run: Callable[[Config, argparse.Namespace], int]
    options: tuple[Option, ...] = ()
    devices: bool = True
    guard: Callable[[], contextlib.AbstractContextManager] | None = None
    config: bool = True  # it reads a run's config (--config and overrides); check-hf reads a folder


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's help ends with its default, `(default: off)` for a flag, or `(required)`."""

    def add_argument(self, action: argparse.Action) -> None:
        """argparse measures the commands' names without the indent it prints them at, so a name
        as long as `teacher-cache` would push its help to the next line; count the indent too."""
        super().add_argument(action)
        if isinstance(action, argparse._SubParsersAction) and action.help is not argparse.SUPPRESS:
            longest = max(len(self._format_action_invocation(a)) for a in action._get_subactions())
            indent = self._current_indent + self._indent_increment
            self._action_max_length = max(self._action_max_length, longest + indent)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if not text or text == argparse.SUPPRESS or "(default" in text or "(required" in text:
            return text
        if not action.option_strings and action.nargs not in (argparse.OPTIONAL, argparse.ZERO_OR_MORE):
            return text  # a positional that must be given, or a command in the list of commands
        if action.required:
            return f"{text} (required)"
        if action.nargs == 0 and action.const is True:  # a store_true flag
            return f"{text} (default: off)"
        if action.default is argparse.SUPPRESS:
            return text
        return f"{text} (default: %(default)s)"


def _train(cfg, args) -> int:
    from maestro_jax.data import DataError
    from maestro_jax.runtime.distributed import PeerError, announce_failure
    from maestro_jax.runtime.step import NonFiniteError
    from maestro_jax.training.loop import train
    from maestro_jax.training.storage import StorageError

    faults = ((NonFiniteError, 3), (StorageError, 4), (PeerError, 5), (DataError, 2))  # StorageError: checkpoints too
    try:
        history = train(cfg)
    except tuple(f for f, _ in faults) as err:
        print(_error_line(err), file=sys.stderr)
        announce_failure(f"{type(err).__name__}: {err}")
        return next(code for f, code in faults if isinstance(err, f))
    if history:  # else train said "nothing to do", naming the step the checkpoint holds
        print(
            f"trained steps {history[0]['step']}..{history[-1]['step']}: "
            f"loss {history[0]['train/loss']:.4f} -> {history[-1]['train/loss']:.4f}"
        )
    return 0


def _preemption() -> contextlib.AbstractContextManager:
    """From here on, SIGTERM is a preemption notice (kept until the loop reads it)."""
    from maestro_jax.training.preemption import Preemption

    return Preemption()


def _verify(cfg, args) -> int:
    from maestro_jax.tools.verify import report, verify

    diffs = verify(cfg, progress=lambda msg: print(f"verify: {msg}", flush=True))
    text, ok = report(diffs, cfg.verify_tolerance)
    print(text)
    _write_json(
        args.json,
        {"passed": ok, "tolerance": cfg.verify_tolerance, "diffs": [dataclasses.asdict(d) for d in diffs]},
    )
    return 0 if ok else 1


def _eval(cfg, args) -> int:
    from maestro_jax.config import EvalConfig
    from maestro_jax.runtime.build import build_runtime
    from maestro_jax.training.evaluate import evaluate_checkpoint

    step, loss = evaluate_checkpoint(cfg, build_runtime(cfg), args.step)
    print(f"step {step}: eval/loss {loss:.4f} over {(cfg.eval or EvalConfig()).batches} batches")
    return 0


def _simulate(cfg, args) -> int:
    from maestro_jax.tools.simulate import format_report, simulate_config

    r = simulate_config(cfg, gantt=args.gantt, progress=lambda msg: print(f"simulate: {msg}", flush=True))
    print(format_report(r))
    _write_json(args.json, r)
    return 0


def _teacher_cache(cfg, args) -> int:
    """The teacher's top-k outputs over the config's data, written (or finished) in --out."""
    from maestro_jax.tools.teacher_cache import DEFAULT_K, write_cache

    k = args.top_k if args.top_k is not None else (cfg.distill.top_k or DEFAULT_K)
    if args.shard_batches < 1:
        print(f"error: --shard-batches={args.shard_batches}: must be at least 1", file=sys.stderr)
        return 2
    manifest = write_cache(cfg, args.out, k, args.shard_batches, say=lambda line: print(line, flush=True))
    print(f"wrote {args.out}: {manifest.identity.num_samples} samples, top {k}, {len(manifest.shards)} shards")
    return 0


def _check_hf(_cfg, args) -> int:
    """Exit 0 within the tolerance, 1 over it, 2 (one `error:` line) for a folder it cannot check."""
    from maestro_jax.hf_config import HFError
    from maestro_jax.tools.check_hf import DEFAULT_TOLERANCE, check_folder

    tolerance = DEFAULT_TOLERANCE if args.tolerance is None else args.tolerance
    if not tolerance > 0:
        print(f"error: --tolerance={args.tolerance}: must be > 0 (default {DEFAULT_TOLERANCE})", file=sys.stderr)
        return 2
    try:
        results = check_folder(args.hf, tolerance)
    except (HFError, KeyError) as err:
        print(_error_line(f"error: --hf={args.hf}: {err}"), file=sys.stderr)
        return 2
    for r in results:
        print(
            f"check-hf {args.hf} ({r.model_type}): {r.inputs}; {r.compared} max abs "
            f"diff {r.max_abs:.3e}, relative {r.max_rel:.3e} (tolerance {r.tolerance:g}): "
            + ("PASS" if r.passed else "FAIL")
        )
    return 0 if all(r.passed for r in results) else 1


def _latest_states(cfg) -> tuple[dict, int]:
    """Every section's state (a staged one whole) and its step: from the latest checkpoint in
    `output_dir`, read under the run's lock (`training.checkpoint.reading_checkpoints`), else the
    initial ones at step 0."""
    from maestro_jax.runtime.build import build_runtime
    from maestro_jax.training.checkpoint import reading_checkpoints

    rt = build_runtime(cfg)
    states = rt.whole_states(rt.step.init().sections)
    if cfg.output_dir:
        with reading_checkpoints(cfg) as ckpt:
            restored = ckpt.restore_latest(states)
        if restored is not None:
            return restored[1], restored[0]
    return states, 0


def _export(cfg, args) -> int:
    """The section's weights from the latest checkpoint in `output_dir` (else its initial ones)."""
    from maestro_jax.tools import hf
    from maestro_jax.workloads import build_graph

    valid = sorted(s for s in cfg.sections if s in cfg.models)
    names = args.section.split(",")
    sections = build_graph(cfg).sections
    frozen = [s.name for s in sections if not s.trained and s.name in names]
    if frozen:  # a KD teacher: what export would write is what models.<name> loaded
        print(
            f"error: --section={args.section!r}: {frozen[0]!r} is a frozen section (training never changes its "
            f"weights: they are the ones models.{frozen[0]} names); trained sections: "
            f"{sorted(s.name for s in sections if s.trained)}",
            file=sys.stderr,
        )
        return 2
    for name in names:
        if name not in valid:
            which = "" if len(names) == 1 else f"{name!r} is "
            print(
                f"error: --section={args.section!r}: {which}not a section with a model here; valid: {valid}",
                file=sys.stderr,
            )
            return 2
    if len(names) > 1:
        return _export_vlm(cfg, args, names)
    model = cfg.models[args.section]
    try:
        model_type = hf.export_type(model.model_dump(), args.model_type, args.section)
        hf.check_export_folder(args.out, args.overwrite)  # before any weight is read
    except hf.HFError as err:
        print(_error_line(err), file=sys.stderr)
        return 2
    states, step = _latest_states(cfg)
    try:
        hf.export_section(args.out, states[args.section].params, model.model_dump(), model_type, args.overwrite)
    except hf.HFError as err:
        print(_error_line(err), file=sys.stderr)
        return 2
    print(f"wrote {args.out}: section {args.section!r} at step {step} ({model_type})")
    return 0


def _export_audio_llm(cfg, args, names: list[str], kinds: dict[str, str]) -> int:
    """`--section audio,llm`: an audio LLM's encoder and language model as one Qwen2-Audio folder."""
    from maestro_jax.tools import hf
    from maestro_jax.workloads import settings

    if len(names) != 2 or set(kinds) != {"audio", "llm"} or args.model_type not in (None, "qwen2_audio"):
        print(
            f"error: --section={args.section!r} --model-type={args.model_type}: a whole audio LLM folder is one audio "
            f"and one llm section (e.g. --section audio,llm), written as qwen2_audio",
            file=sys.stderr,
        )
        return 2
    audio_token = settings(cfg).audio_token
    return _export_pair(
        cfg,
        args,
        kinds,
        ("audio", "llm"),
        "qwen2_audio",
        lambda audio, llm: hf.export_qwen2_audio(args.out, audio, llm, audio_token, args.overwrite),
    )


def _export_vlm(cfg, args, names: list[str]) -> int:
    """`--section vision,llm`: a VLM's tower and language model as one Gemma 3 VLM folder, or a
    Qwen2.5-VL or Qwen3-VL one where the tower is of that layout (`hf_encoders.qwen_vl_type`), or a
    PaliGemma 2 one where its projector is linear, or a SmolVLM one where that has no bias."""
    from maestro_jax.models.hf_encoders import qwen_vl_type
    from maestro_jax.tools import hf
    from maestro_jax.workloads import settings

    kinds = {cfg.models[n].kind: n for n in names}
    if "audio" in kinds:
        return _export_audio_llm(cfg, args, names, kinds)
    qwen = qwen_vl_type(cfg.models[kinds["vit"]].model_dump()) if "vit" in kinds else None
    tower = cfg.models[kinds["vit"]] if "vit" in kinds else None
    linear = tower is not None and tower.projector == "linear"
    model_type = qwen or (("paligemma" if tower.projector_bias else "smolvlm") if linear else "gemma3")
    if len(names) != 2 or set(kinds) != {"vit", "llm"} or args.model_type not in (None, model_type):
        print(
            f"error: --section={args.section!r} --model-type={args.model_type}: a whole VLM folder is one vit and one "
            f"llm section (e.g. --section vision,llm), written as {model_type} (gemma3; qwen2_5_vl or qwen3_vl for a "
            f"Qwen2.5-VL or Qwen3-VL tower; paligemma for a tower with projector: linear; smolvlm for one without its bias)",
            file=sys.stderr,
        )
        return 2
    image_token = getattr(settings(cfg), "image_token", None)
    if image_token is None:
        print(f"error: workload={cfg.workload!r}: has no workload_settings.image_token; a VLM's has", file=sys.stderr)
        return 2
    video_token = getattr(settings(cfg), "video_token", None)  # the clips' placeholder, where a Qwen-VL took video
    write = {
        "paligemma": lambda v, t: hf.export_paligemma(args.out, v, t, image_token, args.overwrite),
        "smolvlm": lambda v, t: hf.export_smolvlm(args.out, v, t, image_token, args.overwrite),
        "gemma3": lambda v, t: hf.export_gemma3_vlm(args.out, v, t, image_token, args.overwrite),
    }.get(model_type, lambda v, t: hf.export_qwen_vl(args.out, v, t, image_token, args.overwrite, video_token))
    return _export_pair(cfg, args, kinds, ("vit", "llm"), model_type, write)


def _export_pair(cfg, args, kinds: dict[str, str], pair: tuple[str, str], model_type: str, write) -> int:
    """Two sections (`pair`: their model kinds) from the latest checkpoint in `output_dir`, each as
    `(params, fields)`, written as one folder by `write`; an HFError is one `error:` line, status 2."""
    from maestro_jax.tools import hf

    try:
        hf.check_export_folder(args.out, args.overwrite)  # before any weight is read
        states, step = _latest_states(cfg)
        write(*((states[kinds[k]].params, cfg.models[kinds[k]].model_dump()) for k in pair))
    except hf.HFError as err:
        print(
            _error_line(err if str(err).startswith("error:") else f"error: --section={args.section}: {err}"),
            file=sys.stderr,
        )
        return 2
    print(f"wrote {args.out}: sections {kinds[pair[0]]!r} and {kinds[pair[1]]!r} at step {step} ({model_type})")
    return 0


def _plan(cfg, args) -> int:
    if refused := _plan_refusal(args):
        print(refused, file=sys.stderr)
        return 2
    if args.measure:
        _ensure_host_devices(args.devices)  # before JAX starts: --measure compiles on these devices
    from maestro_jax.planning.planner import STAGE_COUNTS
    from maestro_jax.planning.report import InfeasibleError
    from maestro_jax.planning.search import search
    from maestro_jax.tools.plan import PLANNING_BATCHES, problem_for, write_plan

    def say(msg: str) -> None:  # on stdout: stderr holds nothing but a failure's `error:` line
        print(f"plan: {msg}", flush=True)

    say(f"describing workload {cfg.workload}: parameter shapes (jax.eval_shape) and {PLANNING_BATCHES} batches")
    try:  # one planning problem per call: the search and every baseline price it
        problem = problem_for(cfg, args.devices, args.memory_gb, stage_counts=STAGE_COUNTS if args.stages else ())
        report = search(problem, top=args.top, tolerance=args.tolerance, progress=say)
    except InfeasibleError as err:
        print(_error_line(err), file=sys.stderr)
        return 2
    print("\n".join(_plan_lines(cfg, report, problem.spec.sink)))
    if args.write:
        write_plan(args.config, args.overrides, report.best, args.memory_gb, args.write)
        print(f"wrote {args.write}: maestro-jax bench --config {args.write}")
    if args.measure:
        say(f"compiling the chosen plan on {args.devices} devices (--measure)")
        _measure_plan(cfg, args, report.best)
    _write_json(args.json, report.to_json())
    return 0


def _plan_refusal(args) -> str | None:
    """The `error:` line for `plan` arguments out of range (None: in range)."""
    if args.devices < 1 or args.memory_gb <= 0:
        return f"error: --devices={args.devices} --memory-gb={args.memory_gb}: both must be positive"
    if not 0 <= args.tolerance < 1:
        return f"error: --tolerance={args.tolerance}: must be in [0, 1)"
    return None


def _plan_lines(cfg, report, sink: str) -> list[str]:
    """What `plan` prints of `report`: what it searched, the table of the best plans, every
    baseline beside the best, and where the best plan's device time goes."""
    from maestro_jax.planning.baselines import baseline_lines
    from maestro_jax.planning.report import format_table
    from maestro_jax.tools.simulate import device_time_line, empty_rows_note

    best = report.best
    lines = [
        f"workload {cfg.workload}: sections {', '.join(best_sections(report))}; {report.considered} plans within "
        f"the bound threshold pass every constraint; {report.simulated} simulated (the rest are ruled out by their "
        f"lower bound); cost model: {cfg.simulate.device}",
        format_table(report),
        *baseline_lines(report.baselines, best.step_time_s),
    ]
    spent = device_time_line(report.device_time)
    empty = empty_rows_note(report.section_time, best.plan, sink, cfg.global_batch)
    return lines + [line for line in (spent, empty) if line]


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
    measured = compiled_memory(rt, rt.step.init(), rt.batches()[0])
    for s, m in measured.items():
        print(
            f"memory {s}: model {best.memory_gb[s]:.4g} GB/device, compiled {m['total'] / 2**30:.4g} GB/device "
            f"(largest program {max(m['programs'], key=m['programs'].get)}, optimizer state included)"
        )


def _write_json(path: str | None, report: dict) -> None:
    if path:
        import json

        with open(path, "w") as f:
            json.dump(report, f, indent=2)


def _bench(cfg, args) -> int:
    from maestro_jax.tools.bench import bench, format_report

    refused = _bench_refusal(cfg, args)
    if refused:
        print(refused, file=sys.stderr)
        return 2
    r = bench(
        cfg,
        reps=args.reps,
        num_batches=args.batches,
        trace_dir=args.trace,
        progress=lambda line: print(line, file=sys.stderr, flush=True),
        pack=args.pack,
        stages=args.stages,
        balance=args.balance,
    )
    print(format_report(r))
    _write_json(args.json, r)
    return 0


def _bench_refusal(cfg, args) -> str | None:
    """The `error:` line for a `--pack` or `--stages` the workload cannot take (None: it can)."""
    from maestro_jax import workloads
    from maestro_jax.tools.bench import stageable

    if args.pack is not None:
        packs = [s.name for s in workloads.build_graph(cfg).sections if s.packed_batch is not None]
        if args.pack < 2 or not packs:
            what = f"workload {cfg.workload!r} has no section that packs" if not packs else "must be 2 or more"
            return f"error: --pack={args.pack}: {what}; valid: an integer >= 2 on vlm, omni, vlm_kd or kd"
    if args.stages is not None:
        staged = stageable(cfg, workloads.build_graph(cfg), args.stages)
        if args.stages < 2 or not staged:
            what = "must be 2 or more" if args.stages < 2 else "no section splits into that many stages here"
            return (
                f"error: --stages={args.stages}: {what}; valid: an integer >= 2 that divides the mesh's data axis of "
                f"a section that splits (the LLM of vlm, omni, vlm_kd; teacher and student of kd, vlm_kd)"
            )
    return None


JSON = opt("--json", metavar="PATH", help="write the report as JSON here (default: not written)")

# One entry per command, in `--help` order. Every command also takes --config, key=value
# overrides and --verbose (`_parser`); `devices=True` ones the multi-process options.
COMMANDS: dict[str, Command] = {
    "train": Command("train from a config", _train, guard=_preemption),
    "verify": Command(
        "maestro vs monolithic on one batch: loss, gradients, updated parameters",
        _verify,
        (JSON,),
    ),
    "eval": Command(
        "held-out loss (the eval block) of a checkpoint in output_dir",
        _eval,
        (opt("--step", type=int, metavar="N", help="the checkpoint's step (default: the latest committed)"),),
    ),
    "bench": Command(
        "monolithic vs naive vs wavefront throughput, side by side",
        _bench,
        (
            opt("--reps", type=int, default=5, metavar="N", help="timed repetitions of each mode, interleaved"),
            opt("--batches", type=int, default=3, metavar="N", help="global batches per repetition"),
            opt(
                "--pack",
                type=int,
                metavar="P",
                help="also time sequence packing: every section that packs at pack=P vs the config's own "
                "(default: not timed)",
            ),
            opt(
                "--stages",
                type=int,
                metavar="K",
                help="also time pipeline stages: every section that splits (and whose mesh's data axis K divides) "
                "in K stages vs the config's plan (default: not timed)",
            ),
            opt(
                "--balance",
                action="store_true",
                help="also time the wavefront with and without dealing the sink's rows to balance its producers' "
                "shards (schedule.balance_shards) (default: not timed)",
            ),
            JSON,
            opt(
                "--trace",
                metavar="DIR",
                help="write measured and simulated traces and Gantt PNGs here (default: not written)",
            ),
        ),
    ),
    "simulate": Command(
        "predicted maestro vs monolithic throughput on a cluster (nothing compiled)",
        _simulate,
        (JSON, opt("--gantt", metavar="PNG", help="write the simulated Gantt chart here (default: not drawn)")),
        devices=False,
    ),
    "plan": Command(
        "search devices, meshes and micro-batches for the best plan (nothing compiled)",
        _plan,
        (
            opt("--devices", type=int, required=True, metavar="N", help="devices the plan may use"),
            opt("--memory-gb", type=float, required=True, metavar="GB", help="memory per device, GB"),
            opt("--top", type=int, default=10, metavar="K", help="candidates to list"),
            opt(
                "--tolerance",
                type=float,
                default=TOLERANCE,
                metavar="G",
                help="relative gap to the optimum the search may leave (0: exact)",
            ),
            opt(
                "--stages",
                action="store_true",
                help="also search pipeline stage counts (2, 4, 8) for every section that splits (slower: each "
                "stage count is priced on every device count, and staged plans are simulated stage by stage)",
            ),
            opt(
                "--write",
                metavar="PATH",
                help="write the config with the chosen plan here (train/bench accept it) (default: not written)",
            ),
            JSON,
            opt(
                "--measure",
                action="store_true",
                help="compile the chosen plan here and print XLA's memory analysis beside the model",
            ),
        ),
        devices=False,
    ),
    "check-hf": Command(
        "run a Hugging Face folder (an LLM, a tower, a Gemma 3 or Qwen2.5-VL VLM) through transformers and "
        "through maestro; compare the logits (features)",
        _check_hf,
        (
            opt("--hf", required=True, metavar="DIR", help="the folder (config.json and safetensors)"),
            opt(
                "--tolerance",
                type=float,
                default=None,
                help="the largest logit difference relative to the largest logit that passes "
                "(default: 1e-4, float32 on both sides)",
            ),
        ),
        devices=False,
        config=False,
    ),
    "teacher-cache": Command(
        "run a kd config's teacher over its data once and write its top-k log-probabilities per "
        "position (ArrayRecord shards and a manifest; resumes a killed run)",
        _teacher_cache,
        (
            opt(
                "--out", required=True, metavar="DIR", help="the cache folder (created; a cache of this config resumes)"
            ),
            opt(
                "--top-k",
                type=int,
                default=None,
                help="tokens kept per position (default: distill.top_k, else 64)",
            ),
            opt(
                "--shard-batches", type=int, default=4, help="global batches per shard (the unit a rerun resumes from)"
            ),
        ),
    ),
    "export": Command(
        "write a trained section (LLM, vision or audio tower) as a Hugging Face folder",
        _export,
        (
            opt(
                "--section",
                required=True,
                help="a section with a model: an LLM (student, llm), vision or audio; or a VLM's vision and llm "
                "sections, comma-separated (vision,llm), written as one Gemma 3 VLM folder; or an omni model's audio "
                "and llm sections (audio,llm), as one Qwen2-Audio folder",
            ),
            opt("--out", required=True, metavar="DIR", help="the Hugging Face folder to write"),
            opt(
                "--model-type",
                default=None,
                choices=(
                    "llama",
                    "mistral",
                    "qwen2",
                    "qwen3",
                    "qwen3_moe",
                    "qwen2_moe",
                    "mixtral",
                    "gpt_oss",
                    "phi3",
                    "olmo2",
                    "gemma",
                    "gemma2",
                    "gemma3_text",
                    "siglip",
                    "clip",
                    "whisper",
                    "gemma3",
                    "qwen2_5_vl",
                    "qwen3_vl",
                    "qwen2_audio",
                    "paligemma",
                    "smolvlm",
                ),
                help="the Hugging Face architecture to write (default: llama for an LLM, gemma3_text or gemma2 for "
                "Gemma's block, gemma for Gemma 1's, olmo2 for OLMo 2's, gpt_oss for GPT-OSS's; a vision or audio tower's own layout: siglip, clip (class_token) or whisper; gemma3 for a "
                "VLM's two sections, qwen2_5_vl or qwen3_vl for a Qwen2.5-VL's or Qwen3-VL's, paligemma for a tower with a linear projector "
                "and a prefix-LM, smolvlm for a tower with a bias-free linear projector (its connector), qwen2_audio for an audio "
                "encoder pooled in pairs and its LLM)",
            ),
            opt(
                "--overwrite",
                action="store_true",
                help="replace the weights and config of a folder that holds files (other files stay)",
            ),
        ),
    ),
}

VERBOSE_HELP = "show XLA's C++ log on stderr: compiler warnings and info"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="maestro-jax",
        formatter_class=_HelpFormatter,
        description="Train, check, time and plan compound models, each section on its own devices.",
        epilog="`maestro-jax COMMAND --help` lists the command's options with their defaults.",
    )
    parser.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", title="commands")
    for name, command in COMMANDS.items():
        p = sub.add_parser(name, help=command.help, description=command.help, formatter_class=_HelpFormatter)
        if command.config:
            p.add_argument(
                "--config", required=True, metavar="FILE", help="the run's YAML config, e.g. configs/vlm_tiny.yaml"
            )
            p.add_argument(
                "overrides",
                nargs="*",
                metavar="key=value",
                help="dotted overrides of the config, e.g. steps=4 (default: none)",
            )
        for flags, kwargs in command.options:
            p.add_argument(*flags, **kwargs)
        p.add_argument("--verbose", action="store_true", default=argparse.SUPPRESS, help=VERBOSE_HELP)
        if command.devices:
            g = p.add_argument_group("multi-process (default: auto-detect SLURM, else one process)")
            g.add_argument(
                "--coordinator",
                metavar="HOST:PORT",
                help="process 0's coordination service (default: from the launcher)",
            )
            g.add_argument(
                "--num-processes",
                type=int,
                metavar="N",
                help="processes in the run, with --coordinator (default: from the launcher)",
            )
            g.add_argument(
                "--process-id",
                type=int,
                metavar="I",
                help="this process's index, 0..N-1, with --coordinator (default: from the launcher)",
            )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command; SIGINT stops it with one line and status 130, at any point.

    The SIGINT handler (`training.preemption.Interrupt`: Python's KeyboardInterrupt, remembered so
    that the loop raises it again if something swallowed it) is installed even where the process
    inherited SIGINT ignored (a non-interactive shell starts background jobs so): a SIGINT sent to
    a run must stop it."""
    from maestro_jax.training.preemption import Interrupt

    if threading.current_thread() is threading.main_thread():
        Interrupt().install()
    try:
        return _main(argv)
    except KeyboardInterrupt:
        print(
            "error: interrupted (SIGINT): stopped without a new checkpoint; the last committed checkpoint is "
            "intact (re-run to resume; SIGTERM instead checkpoints first)",
            file=sys.stderr,
            flush=True,
        )
        return 130


def _main(argv: list[str] | None) -> int:
    args = _parser().parse_args(argv)
    _xla_logging(args.verbose)  # before anything imports JAX
    command = COMMANDS[args.command]
    with command.guard() if command.guard else contextlib.nullcontext():
        return _command(command, args)


def _error_line(err) -> str:
    """The one `error:` line a fault ends with. Messages that carry a library's text (a
    tensorstore spec, an XLA status) can span lines; they are joined, so the line stays one."""
    text = " ".join(str(err).split())
    return text if text.startswith("error:") else f"error: {text}"


def _command_flags(command: Command, cfg) -> dict[str, str]:
    """The XLA GPU flags this command adds to the run's (`runtime.xla_flags`): CUDA graphs as
    `compile.cuda_graph_min_thunks` says, and for `verify` of a float32 section no GEMM
    autotuning (`VERIFY_FLOAT32_FLAGS`)."""
    from maestro_jax.runtime.xla_flags import VERIFY_FLOAT32_FLAGS, graph_flags

    flags = graph_flags(cfg.compile.cuda_graph_min_thunks)
    if command.run is _verify and any(s.precision == "float32" for s in cfg.sections.values()):
        flags.update(VERIFY_FLOAT32_FLAGS)
    return flags


def _command(command: Command, args) -> int:
    if not command.config:
        return command.run(None, args)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as err:
        print(_error_line(err), file=sys.stderr)
        return 2
    if not command.devices:
        return _run(command, cfg, args)
    _ensure_host_devices(cfg.host_devices)
    from maestro_jax.runtime.xla_flags import set_gpu_flags

    added = set_gpu_flags(cfg.compile.gpu_flags, extra=_command_flags(command, cfg))  # before JAX starts
    if added:
        print(f"XLA GPU flags: {' '.join(added)} (compile.gpu_flags=false: none)", flush=True)
    refused = _start_processes(cfg, args)
    if refused is not None:
        return refused
    return _run_among_processes(command, cfg, args)


def _start_processes(cfg, args) -> int | None:
    """`jax.distributed` started where `--coordinator` asks for it (None), or the exit status of
    why not: 2 for options that do not go together, 5 for a peer that did not come."""
    if args.coordinator and (args.num_processes is None or args.process_id is None):
        print("error: --coordinator needs --num-processes and --process-id", file=sys.stderr)
        return 2
    from maestro_jax.runtime.distributed import PeerError, maybe_initialize_distributed

    try:
        maybe_initialize_distributed(
            args.coordinator,
            args.num_processes,
            args.process_id,
            startup_timeout_s=cfg.distributed.startup_timeout_s,
            heartbeat_timeout_s=cfg.distributed.heartbeat_timeout_s,
        )
    except PeerError as err:
        print(_error_line(err), file=sys.stderr)
        return 5
    return None


def _run_among_processes(command: Command, cfg, args) -> int:
    """The command, in a run of several processes ending a failed one at once, its failure
    announced to its peers (one process: as any command)."""
    import jax

    from maestro_jax.runtime.distributed import announce_failure

    try:
        status = _run(command, cfg, args)
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


def _run(command: Command, cfg, args) -> int:
    """The command; a config or plan it finds wrong ends with one `error:` line and status 2."""
    from maestro_jax.core.graph import GraphError
    from maestro_jax.core.plan import PlanError

    try:
        return command.run(cfg, args)
    except (ConfigError, PlanError, GraphError) as err:
        print(_error_line(err), file=sys.stderr)
        return 2


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
