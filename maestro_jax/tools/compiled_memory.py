"""Compiled memory of a plan: what XLA says each section's programs need, per device.

The planner's memory model (`planner.section_memory`) is analytic, so it can score plans for
clusters that are not at hand. Where the plan can be compiled, this measures it: the programs of
one global batch's training step are compiled (`runtime.ahead.compile_batches`: compiled only,
nothing runs) and each one's `memory_analysis()` is read (`SectionPrograms.memory_analysis`: as
compiled with the buffers an accelerator donates donated); the section's figure is its largest program,
plus its optimizer state for the programs that do not take it as an argument (it stays
resident through the forward and backward programs; the update program counts it already).
`maestro-jax plan --measure` prints both side by side.
"""

from __future__ import annotations

import math

import jax

from maestro_jax.runtime.ahead import compile_batches


def _bytes_per_device(tree) -> int:
    return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def compiled_memory(rt, states, samples) -> dict[str, dict]:
    """{section: {"programs": {name: bytes}, "optimizer": bytes, "total": bytes}} per device, for
    the step on the global batch `samples` (`states`: the sections' states, for the optimizer's)."""
    used = compile_batches(rt.step, [samples], replay_all=True).used
    out = {}
    for s, p in rt.programs.items():
        programs = p.memory_analysis(used.get(s, set()))
        opt = _bytes_per_device(states[s].opt_state) if states[s].opt_state is not None else 0
        resident = {name: peak + (0 if name == "update" else opt) for name, peak in programs.items()}
        out[s] = {"programs": programs, "optimizer": opt, "total": max(resident.values(), default=0)}
    return out
