"""Sequence packing: which samples of a packing section's micro-step share each row. Plain Python.

A section that packs (`sections.<name>.pack: P > 1`) has P sample *slots* per row: the
schedulers fill its micro-steps with `micro_batch x P` samples per data shard exactly as they
fill any section's rows (longest first, so one micro-step holds samples of similar lengths), and
`pack_rows` then lays each shard's slots into that shard's `micro_batch` rows, balancing the rows'
token counts. A row is as long as its bucketed longest row, so balanced rows pad least. Every
slot stays on its shard, so routes between sections (slot indices) still point at the shard that
reads them.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence


def pack_rows(lengths: Sequence[int | None], shards: int, pack: int) -> list[list[int]]:
    """Each row's slots, in row order: `lengths` has one entry per slot (a sample's token count,
    None for padding), shard-major; shard j's `len(lengths) / shards` slots go into its
    `len(lengths) / (shards x pack)` rows by longest-processing-time-first (each sample, longest
    first, ties by slot, to the row with the fewest tokens so far, ties by row). A row's slots
    are listed in the order they were placed. Deterministic: same lengths, same rows."""
    slots = len(lengths)
    if slots % (shards * pack):
        raise ValueError(f"{slots} slots do not split into {shards} shards of rows of {pack} slots")
    per_shard, rows = slots // shards, slots // (shards * pack)
    out: list[list[int]] = []
    for j in range(shards):
        mine = [j * per_shard + i for i in range(per_shard) if lengths[j * per_shard + i] is not None]
        mine.sort(key=lambda x: -lengths[x])  # stable: equal lengths keep slot order
        bins: list[list[int]] = [[] for _ in range(rows)]
        loads = [(0, r) for r in range(rows)]  # a valid heap
        for x in mine:
            load, r = loads[0]
            bins[r].append(x)
            heapq.heapreplace(loads, (load + lengths[x], r))
        out += bins
    return out
