"""Where maestro's gain comes from: the planner's best plan against the fair monolithic layout
(one program over all the devices) as a workload's sections grow uneven.

Sweeps (each point one in-process `maestro-jax plan`: `tools.plan.planner_for` + `search()`):

  vlm_image_share    configs/vlm_paper_scale.yaml, 64 devices, 80 GB: share of samples with images
  vlm_images         the same, images per sample (1..max_items)
  vlm_resolution     the same, image sizes (all 448x448 ... all 1344x1344)
  vlm_highres        configs/vlm_highres_paper_scale.yaml on 64 and 128 devices, and its image share
  kd_teacher         configs/kd_paper_scale.yaml, 64 devices: a 7B student under a 7B/14B/32B/72B teacher
  kd_student         the 72B teacher over a 7B/3B/1.5B/0.5B student

For each point: maestro's best step time, the fair monolithic's (the planner's
`monolithic_best`: same devices, memory, micro-batches and parallelism axes, one layout and one
checkpointing policy for everything), their ratio (step times on the same devices and global
batch: the per-device ratio), maestro's plan in short form, the best plan that puts the
sections on disjoint devices (`--no-split` skips it: it is a second search), the 1F1B pipelined
baseline where the planner reports one, and what makes the point uneven: the producer's share of
the samples, its work units per sample (patches, tokens) and their coefficient of variation, the
parameter counts, and its share of the model FLOPs (forward, x3 for trained sections, attention
included). The monolithic layout is one point of maestro's plan space (every section co-located
with the same layout), so the ratio should never be below 1; a ratio of 1.000 means the
monolithic layout is the right choice there. A point whose config equals an earlier point's
(each sweep's default) is searched once.

    PYTHONPATH=. .venv/bin/python scripts/heterogeneity_sweep.py --json benchmarks/heterogeneity_sweep.json

writes the JSON and, beside it (`--md`, default the JSON's name with .md), the markdown tables.
`--only vlm_image_share,kd_teacher` runs some sweeps; `--batches` sets the planning batches (2, as
`maestro-jax plan`); `--jobs 2` searches two points at a time. 20-90 s a point with the split
search; ~15 minutes in all on one core of a shared 2-core machine (2026-11).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from maestro_jax.config import load_config
from maestro_jax.planning.baselines import BaselineResult
from maestro_jax.planning.planner import InfeasibleError, Planner
from maestro_jax.planning.search import search
from maestro_jax.tools.plan import planner_for, problem_for

VLM = "configs/vlm_paper_scale.yaml"
VLM_HIGHRES = "configs/vlm_highres_paper_scale.yaml"
KD = "configs/kd_paper_scale.yaml"

# Qwen2.5-style dense decoders (one vocabulary, so any of them can teach any other).
QWEN25 = {
    "0.5B": {"width": 896, "depth": 24, "heads": 14, "kv_heads": 2, "head_dim": 64, "mlp": 4864},
    "1.5B": {"width": 1536, "depth": 28, "heads": 12, "kv_heads": 2, "head_dim": 128, "mlp": 8960},
    "3B": {"width": 2048, "depth": 36, "heads": 16, "kv_heads": 2, "head_dim": 128, "mlp": 11008},
    "7B": {"width": 3584, "depth": 28, "heads": 28, "kv_heads": 4, "head_dim": 128, "mlp": 18944},
    "14B": {"width": 5120, "depth": 48, "heads": 40, "kv_heads": 8, "head_dim": 128, "mlp": 13824},
    "32B": {"width": 5120, "depth": 64, "heads": 40, "kv_heads": 8, "head_dim": 128, "mlp": 27648},
    "72B": {"width": 8192, "depth": 80, "heads": 64, "kv_heads": 8, "head_dim": 128, "mlp": 29568},
}

DEFAULT_SIZES = [[448, 448], [896, 896], [1344, 896]]  # configs/vlm_paper_scale.yaml's mix


@dataclasses.dataclass(frozen=True)
class Point:
    sweep: str
    label: str  # the swept value, as the table shows it
    config: str
    devices: int
    overrides: dict
    memory_gb: float = 80.0


def _model(section: str, size: str) -> dict:
    return {f"models.{section}.{k}": v for k, v in QWEN25[size].items()}


def points() -> list[Point]:
    image = "data.modalities.image"
    out = [Point("vlm_image_share", f"{f:g}", VLM, 64, {f"{image}.fraction": f}) for f in (0.0, 0.25, 0.5, 0.75, 1.0)]
    out += [Point("vlm_images", f"1..{n}", VLM, 64, {f"{image}.max_items": n}) for n in (1, 4, 8)]
    for label, sizes in (
        ("448x448", [[448, 448]]),
        ("896x896", [[896, 896]]),
        ("default mix", DEFAULT_SIZES),
        ("1344x1344", [[1344, 1344]]),
    ):
        out.append(Point("vlm_resolution", label, VLM, 64, {f"{image}.sizes": sizes}))
    out += [Point("vlm_highres", f"{n} devices", VLM_HIGHRES, n, {}) for n in (64, 128)]
    out += [
        Point("vlm_highres", f"image share {f:g}, 64 devices", VLM_HIGHRES, 64, {f"{image}.fraction": f})
        for f in (0.0, 0.5)
    ]
    out += [
        Point("kd_teacher", f"{t} teacher / 7B student", KD, 64, _model("teacher", t))
        for t in ("7B", "14B", "32B", "72B")
    ]
    out += [
        Point("kd_student", f"72B teacher / {s} student", KD, 64, _model("student", s))
        for s in ("7B", "3B", "1.5B", "0.5B")
    ]
    return out


def short_plan(describe: dict, idle: frozenset = frozenset()) -> str:
    """`vision 0:64 d4 f4 c2 t2 mb1 dots; llm ...`: each section's devices, its mesh axes above 1
    (data, fsdp, expert, context, tensor), micro-batch, residuals and layer checkpointing; `idle`
    sections (no work in the planning batches: any layout ties) are only named."""
    parts = []
    for s, d in describe.items():
        if s in idle:
            parts.append(f"{s} {d['devices']} idle")
            continue
        mesh = " ".join(f"{a[0]}{n}" for a, n in d["mesh"].items() if n > 1) or "d1"
        extra = (" remat" if d["residuals"] == "remat" else "") + (
            "" if d["layer_remat"] == "none" else f" {d['layer_remat']}"
        )
        parts.append(f"{s} {d['devices']} {mesh} mb{d['micro_batch']}{extra}")
    return "; ".join(parts)


def short_mono(mono: BaselineResult | None) -> str:
    if not mono:
        return "-"
    mesh = " ".join(f"{a[0]}{n}" for a, n in mono.mesh.items() if n > 1) or "d1"
    remat = " ".join(f"{s}:{r}" for s, r in mono.layer_remat.items() if r != "none")
    return f"{mesh} mb{mono.micro_batch}" + (f" {remat}" if remat else "")


def shape(planner: Planner) -> dict:
    """What makes the point uneven: each section's share of the model FLOPs of the planning
    batches (forward, x3 for trained sections; attention over the sample's units in the section,
    or over `attention_span` units where it runs within windows, as the cost model counts), its
    mean work units per sample (tokens, patches) and their coefficient of variation over
    samples, the share of samples that activate it, and parameter counts."""
    spec, flops, units, active = planner.spec, {}, {}, {}
    metas = [m for batch in planner.metas for m in batch]
    for s, sec in spec.sections.items():
        c = sec.cost
        per = [m.work.get(s, 0) for m in metas]
        units[s] = per
        active[s] = sum(1 for u in per if u) / len(per)
        flops[s] = sum(u * (c.flops + c.attention_flops * (c.attention_span or u)) for u in per) * (
            3 if sec.trained else 1
        )
    total = sum(flops.values()) or 1.0
    out = {}
    for s, sec in spec.sections.items():
        per = units[s]
        mean = statistics.mean(per)
        out[s] = {
            "flops_share": flops[s] / total,
            "units_per_sample": mean,
            "units_cv": statistics.pstdev(per) / mean if mean else 0.0,
            "active_share": active[s],
            "params_b": sec.param_count / 1e9,
            "trained": sec.trained,
        }
    return out


def run_point(p: Point, batches: int, split: bool) -> dict:
    """One planner search for `p` (and, with `split`, one restricted to disjoint device groups)."""
    cfg = load_config(ROOT / p.config, dict(p.overrides))
    t0 = time.perf_counter()
    planner = planner_for(cfg, p.devices, p.memory_gb, batches=batches)
    report = planner.search(top=1)
    best, mono = report.best, report.baselines["monolithic"]
    pipe = report.baselines.get("pipelined")  # the 1F1B baseline, where one fits
    sections = shape(planner)
    idle = frozenset(s for s, d in sections.items() if not d["active_share"])
    row = {
        "sweep": p.sweep,
        "label": p.label,
        "config": p.config,
        "devices": p.devices,
        "memory_gb": p.memory_gb,
        "overrides": p.overrides,
        "maestro_step_s": best.step_time_s,
        "maestro_samples_per_s_per_device": best.samples_per_s_per_device,
        "monolithic_step_s": mono.step_time_s if mono else None,
        "monolithic_samples_per_s_per_device": mono.samples_per_s_per_device if mono else None,
        "ratio": mono.ratio(best.step_time_s) if mono else None,
        "maestro_plan": best.describe(),
        "maestro_plan_short": short_plan(best.describe(), idle),
        "colocated": len({d["devices"] for d in best.describe().values()}) == 1,
        "same_as_monolithic": _is_monolithic(best.describe(), mono, idle),
        "monolithic": mono and mono.to_json(),
        "monolithic_short": short_mono(mono),
        "pipelined_step_s": pipe.step_time_s if pipe else None,
        "pipelined": pipe and pipe.to_json(),
        "sections": sections,
    }
    if split:
        # the disaggregated layout, for comparison: each section on devices of its own (the
        # baselines are the main search's, priced above)
        apart = problem_for(
            cfg, p.devices, p.memory_gb, batches=batches, metas=planner.metas, spec=planner.spec, colocate=False
        )
        try:
            s = search(apart, top=1, baselines=()).best
            row.update(split_step_s=s.step_time_s, split_plan_short=short_plan(s.describe(), idle))
        except InfeasibleError:
            row.update(split_step_s=None, split_plan_short="no split plan fits")
    row["wall_s"] = time.perf_counter() - t0
    return row


def _is_monolithic(describe: dict, mono: BaselineResult | None, idle: frozenset) -> bool:
    """Every working section on all the devices with the monolithic mesh and micro-batch."""
    return bool(mono) and all(
        d["mesh"] == mono.mesh
        and d["micro_batch"] == mono.micro_batch
        and len({x["devices"] for x in describe.values()}) == 1
        for s, d in describe.items()
        if s not in idle
    )


def _code_version() -> dict | None:
    """The checkout's commit and whether the package differs from it, when ROOT is a git checkout."""
    try:
        commit = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(ROOT), "status", "--porcelain", "maestro_jax", "models"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return {"commit": commit, "uncommitted_changes": bool(dirty)}


def _f(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


TIE = 5e-4  # a ratio within this of 1 is a tie: the monolithic layout is the right choice


def markdown(rows: list[dict], command: str, note: str | None = None) -> str:
    lines = [f"    {command}", ""] + ([f"Code: {note}", ""] if note else [])
    pipelined = any(r.get("pipelined_step_s") for r in rows)
    for sweep in dict.fromkeys(r["sweep"] for r in rows):
        group = [r for r in rows if r["sweep"] == sweep]
        first = group[0]
        enc, sink = next(iter(first["sections"])), list(first["sections"])[-1]  # producer (vision, teacher), sink
        lines += [
            f"**{sweep}** (`{first['config']}`, {first['memory_gb']:g} GB per device)",
            "",
            f"| point | devices | params B {enc}/{sink} | samples with {enc} work | {enc} units/sample (cv) | "
            f"{enc} FLOPs share | maestro s/step | monolithic s/step | **ratio** | maestro plan | "
            f"monolithic layout | best split s/step | best split plan |" + (" 1F1B s/step |" if pipelined else ""),
            "|---" * (13 + pipelined) + "|",
        ]
        for r in group:
            e, k = r["sections"][enc], r["sections"][sink]
            flag = " (below 1: see notes)" if r["ratio"] is not None and r["ratio"] < 1 - TIE else ""
            lines.append(
                f"| {r['label']} | {r['devices']} | {e['params_b']:.1f}/{k['params_b']:.1f} | {e['active_share']:.0%} | "
                f"{e['units_per_sample']:.0f} ({e['units_cv']:.2f}) | {e['flops_share']:.1%} | "
                f"{r['maestro_step_s']:.3f} | {_f(r['monolithic_step_s'], '.3f')} | "
                f"**{_f(r['ratio'], '.3f')}x**{flag} | {r['maestro_plan_short']} | {r['monolithic_short']} | "
                f"{_f(r.get('split_step_s'), '.3f')} | {r.get('split_plan_short', '-')} |"
                + (f" {_f(r.get('pipelined_step_s'), '.3f')} |" if pipelined else "")
            )
        ties = [r["label"] for r in group if r["ratio"] is not None and abs(r["ratio"] - 1) <= TIE]
        gains = [r["label"] for r in group if r["ratio"] is not None and r["ratio"] > 1 + TIE]
        lines += [
            "",
            (
                f"Monolithic is the right choice (ratio within {TIE:g} of 1) at: {', '.join(ties) or 'none'}; "
                f"maestro gains at: {', '.join(gains) or 'none'}."
            ),
            "",
        ]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default="benchmarks/heterogeneity_sweep.json")
    ap.add_argument("--md", help="markdown tables (default: the JSON path with .md)")
    ap.add_argument("--only", help="comma-separated sweeps to run (default: all)")
    ap.add_argument("--batches", type=int, default=2, help="planning batches per point (maestro-jax plan: 2)")
    ap.add_argument("--note", help="free text stored in the JSON (e.g. which code version ran)")
    ap.add_argument("--render", action="store_true", help="only write the markdown of the existing --json")
    ap.add_argument("--jobs", type=int, default=1, help="points searched in parallel processes (default 1)")
    ap.add_argument(
        "--no-split", dest="split", action="store_false", help="skip the search restricted to disjoint device groups"
    )
    args = ap.parse_args()
    md = Path(args.md or Path(args.json).with_suffix(".md"))
    if args.render:
        out = json.loads(Path(args.json).read_text())
        md.write_text(markdown(out["points"], out["command"], out.get("note")) + "\n")
        print(f"wrote {md}")
        return 0
    chosen = [p for p in points() if not args.only or p.sweep in args.only.split(",")]
    # a point whose config equals an earlier one's (a sweep's default) is searched once
    keys = [(load_config(ROOT / p.config, dict(p.overrides)).model_dump_json(), p.devices, p.memory_gb) for p in chosen]
    first = {}
    for k, p in zip(keys, chosen):
        first.setdefault(k, p)
    pool = concurrent.futures.ProcessPoolExecutor(args.jobs) if args.jobs > 1 else None
    futures = {k: pool.submit(run_point, p, args.batches, args.split) for k, p in first.items()} if pool else {}
    done: dict = {}
    rows = []
    for k, p in zip(keys, chosen):
        if k in done:
            row = {**done[k], "wall_s": 0.0}  # the same search as an earlier point's
        else:
            row = done[k] = futures[k].result() if pool else run_point(p, args.batches, args.split)
        row = {**row, "sweep": p.sweep, "label": p.label, "overrides": p.overrides}
        rows.append(row)
        print(
            f"{p.sweep:16s} {p.label:32s} maestro {row['maestro_step_s']:8.3f} s  monolithic "
            f"{_f(row['monolithic_step_s'], '8.3f')} s  {_f(row['ratio'], '.3f')}x  split "
            f"{_f(row.get('split_step_s'), '8.3f')} s  ({row['wall_s']:.0f} s)  {row['maestro_plan_short']}",
            flush=True,
        )
    if pool:
        pool.shutdown()
    command = "PYTHONPATH=. .venv/bin/python " + shlex.join(["scripts/heterogeneity_sweep.py", *sys.argv[1:]])
    out = {"command": command, "note": args.note, "code": _code_version(), "batches": args.batches, "points": rows}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1, default=str) + "\n")
    md.write_text(markdown(rows, command, args.note) + "\n")
    print(f"wrote {args.json} and {md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
