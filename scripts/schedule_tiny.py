"""Host time of the wavefront scheduler on the tiny configs, against the scheduler before issue 77.

For each tiny config: the runtime's problem and the metadata of `--batches` global batches, each
scheduled by the wavefront as training calls it (`wavefront(metas, problem)`: work units, no cost
model) and as `bench` calls it (`sample_metas` included, the planning cost model of the config's
plan on the CPU), by today's scheduler and by `tests/wavefront_previous.py` (the scheduler at
45843ff), alternately; per batch the least CPU time of 3 calls, then the median over batches.
The schedules are compared op by op and row by row.

    PYTHONPATH=. python scripts/schedule_tiny.py --batches 30 --json /tmp/schedule_tiny.json
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # wavefront_previous: the scheduler before issue 77

import wavefront_previous

from maestro_jax import workloads
from maestro_jax.config import load_config
from maestro_jax.planning.cluster import cost_model
from maestro_jax.runtime.build import build_runtime
from maestro_jax.schedule import sample_metas, wavefront

CONFIGS = ("kd_tiny", "vlm_tiny", "omni_tiny", "vlm_kd_tiny")


def least_cpu(call, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.process_time()
        call()
        times.append(time.process_time() - t0)
    return min(times)


def _schedule(scheduler, rt, samples, cost):
    return scheduler(sample_metas(rt.graph, samples), rt.problem, cost)


def measure(name: str, num_batches: int) -> dict:
    cfg = load_config(ROOT / "configs" / f"{name}.yaml", [])
    rt = build_runtime(cfg)
    spec = workloads.describe(cfg, rt.graph)
    planning = workloads.planning_batches(cfg, rt.graph, 4)
    cost = cost_model(spec, dict(rt.plan.sections), planning, "cpu", cfg.simulate.link_gbps)
    infos = rt.batch_infos(range(num_batches))
    schedulers = {"previous": wavefront_previous.wavefront, "today": wavefront}
    row = {"config": name, "batch": len(infos[0])}
    for way, costed in (("training", None), ("bench", cost)):
        times = {k: [] for k in schedulers}
        for samples in infos:
            for k, schedule in schedulers.items():
                call = functools.partial(_schedule, schedule, rt, samples, costed)
                times[k].append(least_cpu(call))
            new, old = (_schedule(s, rt, samples, costed) for s in schedulers.values())
            if (new.ops, new.steps) != (old.ops, old.steps):
                row["identical"] = False
        for k, v in times.items():
            row[f"{way}_{k}_ms"] = statistics.median(v) * 1e3
        row[f"{way}_ratio"] = row[f"{way}_previous_ms"] / row[f"{way}_today_ms"]
    row.setdefault("identical", True)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=30)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    print(
        f"{'config':12s} {'training: before':>17s} {'today':>8s} {'ratio':>6s} {'bench: before':>14s} {'today':>8s} {'ratio':>6s} same"
    )
    rows = []
    for name in args.configs:
        r = measure(name, args.batches)
        rows.append(r)
        print(
            f"{name:12s} {r['training_previous_ms']:15.2f}ms {r['training_today_ms']:6.2f}ms {r['training_ratio']:5.2f}x "
            f"{r['bench_previous_ms']:12.2f}ms {r['bench_today_ms']:6.2f}ms {r['bench_ratio']:5.2f}x {r['identical']}",
            flush=True,
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0 if all(r["identical"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
