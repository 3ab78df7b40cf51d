"""The training loop: `train(config)` is what the CLI, tests and notebooks call."""

from __future__ import annotations

import json
import time
from pathlib import Path

from tqdm import tqdm

from maestro_jax.config import Config, dump_config
from maestro_jax.runtime import build_runtime


def train(cfg: Config, progress: bool = True) -> list[dict]:
    """Run `cfg.steps` optimizer steps; returns one metrics dict per step."""
    rt = build_runtime(cfg)
    states = rt.init_states()
    batches = rt.batches()
    out_dir = Path(cfg.output_dir) if cfg.output_dir else None
    if out_dir:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.yaml").write_text(dump_config(cfg))
    history = []
    bar = tqdm(range(cfg.steps), disable=not progress, desc="train", unit="step")
    for step in bar:
        samples = batches[step]
        t0 = time.perf_counter()
        schedule = rt.schedule(samples)
        result = rt.executor.run(states, samples, schedule)
        states = rt.executor.update(states, result.grads)
        loss = float(result.loss)  # end of step: the one place the host waits for the devices
        dt = time.perf_counter() - t0
        tokens = sum(len(s.tokens) - 1 for s in samples)
        rec = {"step": step + 1, "loss": loss, "samples_per_s": len(samples) / dt, "tokens_per_s": tokens / dt,
               "step_time_s": dt, "scheduler": schedule.name}
        history.append(rec)
        bar.set_postfix(loss=f"{loss:.4f}", samples_per_s=f"{rec['samples_per_s']:.1f}")
        if out_dir:
            with open(out_dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps(rec) + "\n")
    return history
