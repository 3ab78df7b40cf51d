"""Sequence packing: which samples of a packing section's micro-step share each row. Plain Python.

A section packs in one of two forms (`sections.<name>.pack`):
  * a sample count P (an int > 1): P sample *slots* per row. The schedulers fill its micro-steps
    with `micro_batch x P` samples per data shard exactly as they fill any section's rows (longest
    first, so one micro-step holds samples of similar lengths), and `pack_rows` then lays each
    shard's slots into that shard's `micro_batch` rows, balancing the rows' token counts. A row
    is as long as its bucketed longest row, so balanced rows pad least.
  * a token budget (`TokenBudget`, `{tokens: N}`): each shard's `micro_batch` samples go into as
    few rows of at most N tokens as first-fit decreasing finds (a sample is never split), every
    row then N long (bucketed); the rows a micro-step has follow from the budget and its samples'
    lengths: the most any shard needs, the others padded with empty rows.
Every slot stays on its shard, so routes between sections (slot indices) still point at the shard
that reads them. `packed_shape` and `row_shape` give the same rows' shape to the cost and memory
models, which price a packing section's micro-steps as the packed rows the runtime runs.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class TokenBudget:
    """Rows filled to at most `tokens` tokens (`sections.<name>.pack: {tokens: N}`)."""

    tokens: int


Pack = int | TokenBudget  # samples per row, or a token budget per row


def packs(pack: Pack) -> bool:
    """Whether `pack` puts several samples in a row (1: one sample per row, no packing)."""
    return isinstance(pack, TokenBudget) or pack > 1


def slots(micro_batch: int, pack: Pack) -> int:
    """Samples per data shard a micro-step takes: `micro_batch` rows of P slots in the count form;
    `micro_batch` samples under a token budget (the rows they fill follow from their lengths)."""
    return micro_batch if isinstance(pack, TokenBudget) else micro_batch * pack


def pack_rows(lengths: Sequence[int | None], shards: int, pack: Pack) -> list[list[int]]:
    """Each row's slots, in row order: `lengths` has one entry per slot (a sample's token count,
    None for padding), shard-major, `len(lengths) / shards` slots a shard; every shard gets as
    many rows as the others (the form's, module docstring). Count form: shard j's slots go into its
    `len(lengths) / (shards x pack)` rows by longest-processing-time-first (each sample, longest
    first, ties by slot, to the row with the fewest tokens so far, ties by row). Token budget: by
    `first_fit_decreasing`, then empty rows up to the most any shard needs (at least one). A
    row's slots are listed in the order they were placed. Deterministic: same lengths, same rows."""
    n = len(lengths)
    per = pack if isinstance(pack, int) else 1
    if n % (shards * per):
        raise ValueError(f"{n} slots do not split into {shards} shards of rows of {per} slots")
    per_shard = n // shards
    mine = [
        [j * per_shard + i for i in range(per_shard) if lengths[j * per_shard + i] is not None] for j in range(shards)
    ]
    if isinstance(pack, TokenBudget):
        bins = [first_fit_decreasing(xs, lengths, pack.tokens) for xs in mine]
        rows = max(1, *map(len, bins))
        return [row for b in bins for row in b + [[] for _ in range(rows - len(b))]]
    out: list[list[int]] = []
    for xs in mine:
        out += _lpt(xs, lengths, per_shard // pack)
    return out


def _lpt(slots_: list[int], lengths: Sequence[int | None], rows: int) -> list[list[int]]:
    ordered = sorted(slots_, key=lambda x: -lengths[x])  # stable: equal lengths keep slot order
    bins: list[list[int]] = [[] for _ in range(rows)]
    loads = [(0, r) for r in range(rows)]  # a valid heap
    for x in ordered:
        load, r = loads[0]
        bins[r].append(x)
        heapq.heapreplace(loads, (load + lengths[x], r))
    return bins


def first_fit_decreasing(items: Sequence[int], lengths: Sequence[int | None], budget: int) -> list[list[int]]:
    """`items` (slot indices into `lengths`) in rows of at most `budget` tokens: longest first (ties
    by slot), each into the first row it fits, a new row when none has room. A sample longer than
    the budget is a ValueError, never split (`runtime.build.check_pack_budget` refuses such a
    config before anything runs)."""
    rows: list[list[int]] = []
    room: list[int] = []
    for x in sorted(items, key=lambda x: -lengths[x]):  # stable: equal lengths keep slot order
        n = lengths[x]
        if n > budget:
            raise ValueError(f"a sample of {n} tokens does not fit in a row of {budget} tokens")
        r = next((r for r, left in enumerate(room) if left >= n), len(rows))
        if r == len(rows):
            rows.append([])
            room.append(budget)
        rows[r].append(x)
        room[r] -= n
    return rows


@functools.lru_cache(maxsize=1 << 16)  # the wavefront prices the same micro-steps again and again
def packed_shape(units: tuple[int, ...], shards: int, per_shard: int, pack: Pack) -> tuple[int, int]:
    """(rows per shard, tokens a row is padded to before bucketing) of a packing section's
    micro-step whose slots hold `units` (shard-major, `per_shard` slots a shard, 0 for padding),
    as `pack_rows` lays them: the count form's fixed rows and its longest row; a token budget's
    rows, N long. More units than slots (a scheduler pricing part of a batch as one micro-step)
    get more slots a shard, in whole rows."""
    per = pack if isinstance(pack, int) else 1
    per_shard = max(per_shard, -(-len(units) // shards))
    per_shard = -(-per_shard // per) * per
    if per_shard == per and not isinstance(pack, TokenBudget):  # one row a shard holds all its slots
        return 1, max(sum(units[j * per : (j + 1) * per]) for j in range(shards))
    lengths = [u or None for u in units] + [None] * (shards * per_shard - len(units))
    rows = pack_rows(lengths, shards, pack)
    if isinstance(pack, TokenBudget):
        return len(rows) // shards, pack.tokens
    return len(rows) // shards, max((sum(lengths[x] for x in row) for row in rows), default=0)


def row_shape(micro_batch: int, units: float, pack: Pack) -> tuple[float, float]:
    """(rows, units a row) of a micro-step of a plan's `micro_batch` whose samples all take
    `units`, packed (`slots`): the count form's `micro_batch` rows of P such samples; a token
    budget's N-token rows, as many as hold `micro_batch` of them whole (floor(N / units) a row);
    unpacked, `micro_batch` rows of `units`. What the memory model sizes activations by (at the
    largest sample, as it sizes unpacked rows) and the analytic model rates efficiency at."""
    if isinstance(pack, TokenBudget):
        return -(-micro_batch // max(1, int(pack.tokens // max(units, 1)))), pack.tokens
    return micro_batch, units * pack
