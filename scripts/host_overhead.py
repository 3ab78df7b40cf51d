"""Host time per training step as the device count grows: scheduling, packing, dispatch,
transfer issue and device wait, read from `metrics.jsonl` of real `maestro-jax train` runs.

Weak scaling of configs/vlm_tiny.yaml with test-sized models (the host's work, not the
model's, is measured): on N virtual CPU devices the vision section and the LLM get N/2
devices each, pure data parallel, and the global batch is 4N samples. Each N runs in its
own process (the device count is fixed when JAX starts); the first `--warmup` steps (compiles)
are dropped and the rest give medians.

    python scripts/host_overhead.py --devices 8 16 32 64 --steps 6 --json benchmarks/host_overhead.json

Reading: `schedule` and `pack` run on the prefetch thread while the previous step runs; they
are off the step's path as long as `data wait` stays near zero. `dispatch` is the loop issuing
the step's programs, transfers and update (`transfer issue` of it), `device wait` reading the
loss and finiteness flags.

Each size runs twice, side by side: as configured (`on_nonfinite: stop`, each step read after
the next is issued) and with every step read at once (`on_nonfinite: skip`, whose update waits
for the check); the ratio of their median step times is what reading one step late buys.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SMALL_MODELS = [
    "models.vision.depth=1",
    "models.llm.depth=1",
    "data.text_len=[6,14]",
    "models.vision.width=32",
    "models.vision.mlp=64",
    "models.vision.out_width=48",
    "models.llm.width=48",
    "models.llm.head_dim=8",
    "models.llm.mlp=96",
    "data.modalities.image.sizes=[[8,8],[16,8]]",
    "data.modalities.image.max_items=2",
]
FIELDS = {
    "schedule": "schedule_ahead_s",
    "read (incl. schedule)": "read_ahead_s",
    "pack": "pack_ahead_s",
    "data wait": "data_wait_s",
    "dispatch": "dispatch_s",
    "transfer issue": "transfer_issue_s",
    "device wait": "device_wait_s",
    "step": "step_time_s",
}


def run(devices: int, steps: int, warmup: int, on_nonfinite: str) -> dict:
    vision = devices // 2
    overrides = SMALL_MODELS + [
        f"host_devices={devices}",
        f"global_batch={4 * devices}",
        f"data.num_samples={4 * devices * (steps + 1)}",
        f"sections.vision.devices=0:{vision}",
        f"sections.vision.mesh={{data: {vision}}}",
        f"sections.llm.devices={vision}:{devices}",
        f"sections.llm.mesh={{data: {devices - vision}}}",
        "edges.image_embeds.fanout=1",
        f"monolithic.devices=0:{devices}",
        f"monolithic.mesh={{data: {devices}}}",
        f"steps={steps}",
        "keep_checkpoints=0",
        f"on_nonfinite={on_nonfinite}",
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PJRT_NPROC")}
    with tempfile.TemporaryDirectory() as out:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "maestro_jax.cli",
                "train",
                "--config",
                str(ROOT / "configs/vlm_tiny.yaml"),
                *overrides,
                f"output_dir={out}",
            ],
            check=True,
            env=env,
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
        )
        records = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()][warmup:]
    return {name: statistics.median(r[key] for r in records) for name, key in FIELDS.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", type=int, nargs="+", default=[8, 16, 32, 64])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args()
    results, at_once = {}, {}
    for n in args.devices:  # each size's two modes back to back, so they see the same machine load
        results[n] = run(n, args.steps, args.warmup, "stop")
        at_once[n] = run(n, args.steps, args.warmup, "skip")
    print(f"{'devices':>8s} " + " ".join(f"{name:>22s}" for name in FIELDS) + "  step read at once / read late")
    for n, r in results.items():
        print(
            f"{n:8d} "
            + " ".join(f"{r[name] * 1e3:20.1f}ms" for name in FIELDS)
            + f"  {at_once[n]['step'] * 1e3:.1f}ms / {r['step'] * 1e3:.1f}ms = {at_once[n]['step'] / r['step']:.2f}"
        )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"medians_s": results, "read_at_once_medians_s": at_once, "steps": args.steps, "warmup": args.warmup},
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
