"""Show sections overlapping in wall time on CPU: one device per section, one dispatch thread each.

XLA's CPU client serialises multi-device programs within a process but runs single-device
programs from different threads side by side. This script puts each section of a config on
one device, runs the same wavefront schedule with sequential and threaded dispatch (after
warm-up, interleaved), and writes the threaded run's measured trace and Gantt chart.

    python scripts/overlap_trace.py --config configs/kd_tiny.yaml --out benchmarks/overlap
"""

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax

from maestro_jax.config import load_config
from maestro_jax.runtime.build import build_runtime
from maestro_jax.tools.trace import write_chrome_trace, write_gantt

ONE_DEVICE = {
    "kd": [
        "sections.teacher.devices=[0]",
        "sections.teacher.mesh={data: 1}",
        "sections.student.devices=[1]",
        "sections.student.mesh={data: 1}",
        "edges.teacher_hidden.fanout=1",
        "sections.teacher.micro_batch=4",
        "sections.student.micro_batch=4",
    ],
    "vlm": [
        "sections.vision.devices=[0]",
        "sections.vision.mesh={data: 1}",
        "sections.llm.devices=[1]",
        "sections.llm.mesh={data: 1}",
        "edges.image_embeds.fanout=1",
        "sections.vision.micro_batch=4",
        "sections.llm.micro_batch=4",
    ],
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    base = load_config(args.config)
    cfg = load_config(args.config, ONE_DEVICE[base.workload] + ["schedule.scheduler=wavefront"] + args.overrides)
    rt = build_runtime(cfg)
    states = rt.step.init().sections
    samples = rt.batches()[0]
    schedule = rt.schedule(samples)
    runs = {
        "sequential": lambda: rt.executor.run(states, samples, schedule),
        "threaded": lambda: rt.executor.run_threaded(states, samples, schedule),
    }
    times = {k: [] for k in runs}
    for f in runs.values():  # warm-up
        jax.block_until_ready(f().loss)
    for _ in range(args.reps):
        for k, f in runs.items():
            t0 = time.perf_counter()
            jax.block_until_ready(f().loss)
            times[k].append(time.perf_counter() - t0)
    record: list = []
    rt.executor.run_threaded(states, samples, schedule, record=record)
    wall = max(r[2] for r in record) - min(r[1] for r in record)
    busy = {}
    for op, t0, t1, _ in record:
        if op.kind in ("F", "B"):
            busy[op.section] = busy.get(op.section, 0.0) + t1 - t0
    os.makedirs(args.out, exist_ok=True)
    write_chrome_trace(record, os.path.join(args.out, "threaded_trace.json"))
    write_gantt(record, os.path.join(args.out, "threaded_gantt.png"), "measured: one dispatch thread per section (CPU)")
    report = {
        "step_s": {k: statistics.median(v) for k, v in times.items()},
        "threaded_vs_sequential": statistics.median(times["sequential"]) / statistics.median(times["threaded"]),
        "busy_s": busy,
        "wall_s": wall,
        "overlap_factor": sum(busy.values()) / wall,
    }
    with open(os.path.join(args.out, "overlap.json"), "w") as f:
        json.dump(report, f, indent=2)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
