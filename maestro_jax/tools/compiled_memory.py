"""Compiled memory of a plan: what XLA says each section's programs need, per device.

The planner's memory model (`planner.section_memory`) is analytic, so it can score plans for
clusters that are not at hand. Where the plan can be compiled, this measures it: one global
batch runs with every section program's `memory_analysis()` recorded (as compiled with the
buffers an accelerator donates donated), and the section's figure is its largest program,
plus its optimizer state for the programs that do not take it as an argument (it stays
resident through the forward and backward programs; the update program counts it already).
`maestro-jax plan --measure` prints both side by side.
"""

from __future__ import annotations

import math

import jax


def _bytes_per_device(tree) -> int:
    return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def compiled_memory(rt, states, samples) -> dict[str, dict]:
    """{section: {"programs": {name: bytes}, "optimizer": bytes, "total": bytes}} per device."""
    for p in rt.programs.values():
        p.memory = {}
    try:
        result = rt.executor.run(states, samples, rt.schedule(samples))
        rt.executor.update(states, result.grads)
        jax.block_until_ready(result.loss)  # the measurement run must finish before the probes are read
        out = {}
        for s, p in rt.programs.items():
            opt = _bytes_per_device(states[s].opt_state) if states[s].opt_state is not None else 0
            resident = {name: peak + (0 if name == "update" else opt) for name, peak in p.memory.items()}
            out[s] = {"programs": dict(p.memory), "optimizer": opt, "total": max(resident.values(), default=0)}
        return out
    finally:
        for p in rt.programs.values():
            p.memory = None
