"""Ring vs gather attention over a `context` split, measured side by side.

One causal LLM's loss and gradients on `--devices` devices, the sequence split over all of
them, under `context_attention: ring` (balanced order, empty blocks skipped, keys and values
passed round the devices) and `gather` (one all-gather of keys and values per layer, every
query against every key). Repetitions are interleaved; the figure is the ratio of medians.
XLA's memory analysis of each program is reported beside it.

    python scripts/context_attention_bench.py --devices 4 --length 4096 --json benchmarks/context_attention.json
"""

from __future__ import annotations

import argparse
import json
import os
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", type=int, default=4)
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args()
    os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={args.devices}")

    import dataclasses

    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import numpy as np
    from maestro_jax.models import DecoderLM, LLMConfig

    from maestro_jax.core.plan import SectionPlan, mesh_shape
    from maestro_jax.runtime.sharding import on_mesh, row_sharding, section_mesh, variable_shardings

    base = LLMConfig(vocab=256, width=128, depth=2, heads=8, kv_heads=2, head_dim=16, mlp=256)
    ids = jnp.zeros((args.rows, args.length), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(args.length), ids.shape)
    valid = jnp.ones(ids.shape, bool)
    mesh = section_mesh(SectionPlan(tuple(range(args.devices)), mesh_shape(context=args.devices), 1))
    rows = row_sharding(mesh)
    steps, memory = {}, {}
    for mode in ("ring", "gather"):
        model = DecoderLM(dataclasses.replace(base, context_attention=mode))
        boxed = jax.eval_shape(lambda m=model: m.init(jax.random.key(0), ids, positions, valid))
        shard = variable_shardings(boxed, mesh, "default")["params"]

        def loss(p, ids, positions, valid, model=model):
            logp = jax.nn.log_softmax(model.apply({"params": p}, ids, positions, valid))
            return -jnp.mean(jnp.take_along_axis(logp, ids[..., None], -1))

        step = jax.jit(jax.value_and_grad(loss), in_shardings=(shard, rows, rows, rows))
        with on_mesh(mesh, "default"):
            params = jax.device_put(
                nn.meta.unbox(model.init(jax.random.key(0), ids, positions, valid)["params"]), shard
            )
            compiled = step.lower(params, ids, positions, valid).compile()
        m = compiled.memory_analysis()
        memory[mode] = int(m.temp_size_in_bytes)
        steps[mode] = (compiled, params)
    times = {mode: [] for mode in steps}
    for _ in range(args.reps + 1):  # the first round warms up
        for mode, (compiled, params) in steps.items():
            t = time.perf_counter()
            jax.block_until_ready(compiled(params, ids, positions, valid))
            times[mode].append(time.perf_counter() - t)
    median = {mode: float(np.median(t[1:])) for mode, t in times.items()}
    report = {
        "devices": args.devices,
        "length": args.length,
        "rows": args.rows,
        "reps": args.reps,
        "median_step_s": median,
        "ring_over_gather_time": median["ring"] / median["gather"],
        "temp_bytes_per_device": memory,
        "ring_over_gather_temp_memory": memory["ring"] / memory["gather"],
    }
    print(json.dumps(report, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
