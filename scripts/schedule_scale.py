"""Host time of the wavefront scheduler at cluster scale, against the step it schedules.

Weak scaling of configs/vlm_paper_scale.yaml by k: vision `data: 8k`, LLM `data: 16k, tensor: 4`
(72k devices), global batch 144k, micro-batches unchanged. For each k: the median of 3
`wavefront()` calls on the first planning batch (wall and CPU time), the same for the scheduler
it replaced (tests/wavefront_reference.py) with the schedules compared op by op (the wavefront's
over the reference's variants, without the producer-balancing one that came after it), and the step
time `maestro-jax simulate` predicts for the plan (`simulate_plan`, same batches and costs).
Scheduling runs on the host between steps, so it should stay well under 1% of the step.

    PYTHONPATH=. python scripts/schedule_scale.py --json /tmp/schedule_scale.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # wavefront_reference: the scheduler before the rewrite

import wavefront_reference

from maestro_jax import workloads
from maestro_jax.config import load_config
from maestro_jax.core.plan import check_meshes
from maestro_jax.planning.cluster import cost_model, simulate_plan
from maestro_jax.schedule import wavefront


def weak_scaled(k: int):
    """configs/vlm_paper_scale.yaml on k times the devices and k times the global batch."""
    return load_config(
        ROOT / "configs" / "vlm_paper_scale.yaml",
        [
            f"global_batch={144 * k}",
            f"sections.vision.devices=0:{8 * k}",
            f"sections.vision.mesh.data={8 * k}",
            f"sections.llm.devices={8 * k}:{72 * k}",
            f"sections.llm.mesh.data={16 * k}",
            "sections.llm.mesh.fsdp=1",  # the config's own plan shards the LLM over fsdp: here data alone
            f"monolithic.devices=0:{72 * k}",
            f"monolithic.mesh.data={18 * k}",
        ],
    )


def timed(schedule, *args, repeats: int = 3):
    """(schedule, median wall seconds, median CPU seconds) over `repeats` calls."""
    walls, cpus = [], []
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        out = schedule(*args)
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return out, statistics.median(walls), statistics.median(cpus)


def measure(k: int, reference: bool) -> dict:
    cfg = weak_scaled(k)
    graph = workloads.build_graph(cfg)
    spec, plan = workloads.describe(cfg, graph), cfg.plan()
    check_meshes(plan)  # every mesh covers its devices: the scaled plan is the one described
    problem = spec.problem(plan, cfg.schedule.max_in_flight)
    batches = workloads.planning_batches(cfg, graph, cfg.simulate.batches)
    cost = cost_model(spec, dict(plan.sections), batches, cfg.simulate.device, cfg.simulate.link_gbps)
    metas = batches[0]
    _, new_s, new_cpu_s = timed(wavefront, metas, problem, cost)
    row = {"k": k, "devices": 72 * k, "global_batch": len(metas), "new_s": new_s, "new_cpu_s": new_cpu_s}
    if reference:  # over the reference's own variants: the producer-balancing one came after it
        unbalanced = dataclasses.replace(problem, balance_shards=False)
        old, old_s, old_cpu_s = timed(wavefront_reference.wavefront, metas, unbalanced, cost)
        same = wavefront(metas, unbalanced, cost)
        row.update(
            old_s=old_s,
            old_cpu_s=old_cpu_s,
            speedup=old_s / new_s,
            identical=(same.ops, same.steps) == (old.ops, old.steps),
        )
    report, _ = simulate_plan(
        spec,
        plan,
        cfg.monolithic_plan(),
        batches,
        device=cfg.simulate.device,
        link_gbps=cfg.simulate.link_gbps,
        max_in_flight=cfg.schedule.max_in_flight,
    )
    step = report["step_time_s"]["wavefront"]
    row.update(predicted_step_s=step, share_of_step=new_s / step, cpu_share_of_step=new_cpu_s / step)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--k", type=int, nargs="+", default=[1, 4, 16, 64], help="weak-scaling factors")
    parser.add_argument("--no-reference", action="store_true", help="skip timing the replaced scheduler")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    rows = []
    print(
        f"{'devices':>7} {'batch':>6} {'old':>9} {'new':>9} {'new cpu':>9} {'ratio':>6} {'same':>5} "
        f"{'step':>8} {'% step':>7}"
    )
    for k in args.k:
        r = measure(k, not args.no_reference)
        rows.append(r)
        old = f"{r['old_s'] * 1e3:7.1f}ms" if "old_s" in r else "-"
        ratio = f"{r['speedup']:5.1f}x" if "speedup" in r else "-"
        print(
            f"{r['devices']:>7} {r['global_batch']:>6} {old:>9} {r['new_s'] * 1e3:7.1f}ms "
            f"{r['new_cpu_s'] * 1e3:7.1f}ms {ratio:>6} {r.get('identical', '-')!s:>5} "
            f"{r['predicted_step_s']:7.2f}s {r['share_of_step'] * 100:6.2f}%",
            flush=True,
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0 if all(r.get("identical", True) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
