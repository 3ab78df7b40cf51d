"""The real-size configs on one GPU: maestro (wavefront and naive) against the fair monolithic,
interleaved, as `maestro-jax bench` times them, with each mode's MFU (the step's and maestro's per
section), the host's share of the step, and the device's compiled and measured peak memory.

    python scripts/real_size_bench.py --config configs/kd_one_gpu.yaml --out DIR [--reps 3] [--batches 2]
    python scripts/real_size_bench.py --config configs/vlm_one_gpu.yaml --out DIR

One config a call: compiling both real-size configs' programs (every shape bucket of every mode)
and timing them takes most of a 10-minute GPU call (a GPU window is 15 minutes, start-up
included). `DIR/<config>.json` is bench's report plus `memory`; the last line printed is the
summary. `--dry-run` runs the same on the CPU with every model cut to a tiny width and depth
(DRY_RUN), how the script is kept working between GPU windows (tests/test_real_size.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


def _tiny_llm(name: str) -> list[str]:
    """`models.<name>` cut to a one-layer decoder of width 32 (vocabulary 512)."""
    shape = (("vocab", 512), ("width", 32), ("depth", 1), ("heads", 4), ("kv_heads", 2), ("head_dim", 8), ("mlp", 64))
    return [f"models.{name}.{k}={v}" for k, v in shape]


# each workload's models cut to tiny widths (the KD pair keeps one vocabulary)
DRY_RUN = {
    "kd": ["global_batch=4", "data.text_len=[6,14]", *_tiny_llm("teacher"), *_tiny_llm("student")],
    "vlm": [
        "global_batch=4",
        "data.text_len=[6,14]",
        "data.modalities.image.sizes=[[28,28]]",
        *(f"models.vision.{k}={v}" for k, v in (("width", 32), ("depth", 1), ("heads", 2), ("mlp", 64))),
        "models.vision.out_width=32",
        *_tiny_llm("llm"),
    ],
}


def memory(rt) -> dict:
    """The device's measured peak (`memory_stats`, None on CPU) beside each section's largest
    compiled program (arguments + outputs + temporaries - aliased, `SectionPrograms.memory_analysis`)."""
    import jax

    stats = jax.devices()[0].memory_stats() or {}
    compiled = {s: prog.memory_analysis() for s, prog in rt.programs.items()}
    return {"measured_peak_bytes": stats.get("peak_bytes_in_use"), "compiled_bytes": compiled}


def summary(name: str, r: dict) -> str:
    u, host = r["mfu"], r["host_overhead_fraction"]
    sections = ", ".join(f"{s} {v:.1%}" for s, v in u["by_section"]["wavefront"].items())
    return (
        f"{name}: wavefront {r['ratios']['wavefront_vs_monolithic']:.3f}x the fair monolithic, "
        f"{r['ratios']['wavefront_vs_naive']:.3f}x naive; MFU wavefront {u['wavefront']:.1%} ({sections}), "
        f"monolithic {u['monolithic']:.1%}; host {host['wavefront']:.1%} of the wavefront's step; "
        f"peak memory {r['memory']['measured_peak_bytes']} bytes measured"
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--config", required=True, help="a real-size config (configs/kd_one_gpu.yaml, configs/vlm_one_gpu.yaml)"
    )
    ap.add_argument("--out", required=True, help="the report is written here")
    ap.add_argument("--reps", type=int, default=3, help="interleaved repetitions of every mode")
    ap.add_argument("--batches", type=int, default=2, help="global batches a repetition")
    ap.add_argument("--dry-run", action="store_true", help="the same on the CPU, every model tiny")
    ap.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = ap.parse_args(argv)
    if args.dry_run:
        os.environ["JAX_PLATFORMS"] = "cpu"
    from maestro_jax.config import ConfigError, load_config

    try:
        cfg = load_config(args.config, args.overrides)
        if args.dry_run:
            cfg = load_config(args.config, [*DRY_RUN[cfg.workload], *args.overrides])
    except ConfigError as err:
        print(err, file=sys.stderr)
        return 2
    from maestro_jax.runtime.build import build_runtime
    from maestro_jax.tools.bench import bench

    t0 = time.perf_counter()
    rt = build_runtime(cfg)
    report = bench(cfg, reps=args.reps, num_batches=args.batches, rt=rt, progress=lambda m: print(m, flush=True))
    report["memory"] = memory(rt)
    report["wall_s"] = time.perf_counter() - t0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = Path(args.config).stem
    (out / f"{name}.json").write_text(json.dumps(report, indent=1))
    print(summary(name, report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
