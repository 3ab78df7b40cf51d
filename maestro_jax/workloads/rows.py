"""Building blocks for a section's `host_batch` and `forward`: the row and route plumbing.

A consumer micro-step's rows name producer outputs by *route* (an index into the producer
micro-steps it depends on, joined along rows; -1: none). These helpers hide that contract:
  host side (numpy)   `text_rows` (next-token rows; placeholders and what a sample's
                      `loss_mask` clears carry no loss; `loss_tokens` counts the rest),
                      `packed_text_rows` (the same, several samples per row: sequence packing),
                      `pack_items` (variable-size items packed per row, with segment ids),
                      `route` (a row's index into its producer's joined outputs);
  device side (jax)   `join` (producer outputs along rows), `gather` (the rows a consumer
                      needs), `gather_tokens` (single positions of them), `splice` and
                      `splice_tokens` (embeddings into placeholder positions), `unpack`
                      (a packed section's outputs back to one row per sample).
Every size is padded to a shape bucket (`core.buckets.bucket`), so a section compiles a few
programs, not one per batch: at `per_octave` buckets an octave, which a built-in workload's
sections pass from the config (`compile.buckets_per_octave`) and a user's section may pass or
leave at the default (`core.buckets.PER_OCTAVE`).

A route points at a row on the consumer row's own data shard (the runtime delivers each consumer
shard the rows of the producer shards that feed it, `runtime.transfer.deliver_rows`, and the
schedulers place samples so; in the monolithic step producer and consumer share rows), so
`gather` takes rows locally on each shard (`jax.shard_map` over the batch axes): no collective.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from maestro_jax.core.buckets import PER_OCTAVE, bucket
from maestro_jax.core.plan import position_axes
from maestro_jax.data.samples import Modality
from maestro_jax.meshes import BATCH_AXES
from maestro_jax.models.attention import segment_lengths, segment_lengths_wanted
from maestro_jax.schedule.packing import Pack, TokenBudget, pack_rows

Positions = Callable[[object], np.ndarray]  # a sample -> its next-token positions' own positions, n x k
# A modality, or the modalities one edge carries in the order its producer packs a sample's items
# (a VLM's tower sends a sample's image tokens, then its video tokens): each one's placeholder
# indices count on from the tokens of those before it.
Carried = Modality | tuple[Modality, ...]


def flat(modalities: Sequence[Carried]) -> tuple[Modality, ...]:
    """Every modality of `modalities`, groups opened."""
    return tuple(m for c in modalities for m in (c if isinstance(c, tuple) else (c,)))


def _after(modalities: Sequence[Carried]) -> list[tuple[Modality, tuple[Modality, ...]]]:
    """Each modality with those before it on its edge (`Carried`)."""
    out = []
    for c in modalities:
        group = c if isinstance(c, tuple) else (c,)
        out += [(m, group[:k]) for k, m in enumerate(group)]
    return out


def _empty_rows(r: int, length: int, modalities: Sequence[Carried], axes: int = 0) -> dict[str, np.ndarray]:
    """`r` rows of `length` next-token positions, all padding: what `_place` fills per sample
    (`axes` > 0: each position has that many coordinates, `Positions`)."""
    return {
        "input_ids": np.zeros((r, length), np.int32),
        "targets": np.zeros((r, length), np.int32),
        "loss_mask": np.zeros((r, length), np.float32),
        "positions": np.zeros((r, length, axes) if axes else (r, length), np.int32),
        "valid": np.zeros((r, length), bool),
        **{f"{m.name}_tok": np.full((r, length), -1, np.int32) for m in flat(modalities)},
    }


def text_rows(
    rows, modalities: Sequence[Carried] = (), positions: Positions | None = None, *, per_octave: int = PER_OCTAVE
) -> dict[str, np.ndarray]:
    """Next-token rows: inputs tokens[:-1], targets tokens[1:]; a target carries loss unless it
    is a placeholder or the sample's `loss_mask` clears it (`carries_loss`). The length is
    bucketed at `per_octave` buckets an octave.

    For each modality, `<name>_tok[i, t]` is the index of position t's placeholder among the
    row's placeholder tokens of that modality (-1 elsewhere): where `splice` puts embeddings;
    a modality in a group (`Carried`) counts on from the placeholders of those before it.
    `positions` (an M-RoPE LLM's, `models.llm.mrope_positions`) gives each sample's positions
    instead of 0, 1, 2, ...: `positions` is then rows x length x k."""
    length = bucket(max((len(s.tokens) - 1 for s in rows if s is not None), default=1), per_octave=per_octave)
    own, axes = _own_positions(rows, positions)
    out = _empty_rows(len(rows), length, modalities, axes)
    for i, s in enumerate(rows):
        if s is None:
            continue
        _place(out, i, slice(0, len(s.tokens) - 1), s, modalities, own[i])
    return out


def _own_positions(rows, positions: Positions | None) -> tuple[list, int]:
    """Each sample's own positions (None where `positions` is None or the slot empty), and their
    coordinate count (0: plain positions)."""
    own = [None if positions is None or s is None else positions(s) for s in rows]
    return own, next((p.shape[1] for p in own if p is not None), 0 if positions is None else 1)


def _place(out: dict, i: int, span: slice, s, modalities: Sequence[Carried], own=None) -> None:
    """Sample `s`'s next-token positions into row `i` at `span`: inputs, targets, loss (per
    `carries_loss`), positions from 0 (or `own`), validity, and each modality's placeholder
    indices counted within the sample, after those of the modalities before it on its edge
    (where `splice` puts its embeddings)."""
    t, n = s.tokens, span.stop - span.start
    out["input_ids"][i, span] = t[:-1]
    out["targets"][i, span] = t[1:]
    out["loss_mask"][i, span] = carries_loss(s, [m.placeholder for m in flat(modalities)])
    out["positions"][i, span] = np.arange(n) if own is None else own
    out["valid"][i, span] = True
    for m, before in _after(modalities):
        hit = t[:-1] == m.placeholder
        first = sum(int(np.count_nonzero(t == b.placeholder)) for b in before)
        out[f"{m.name}_tok"][i, span] = np.where(hit, np.cumsum(hit) - 1 + first, -1)


def carries_loss(sample, placeholders: Sequence[int]) -> np.ndarray:
    """Per target (tokens[1:]): whether it carries loss. Placeholders never do (an embedding
    stands there, not a token to predict); where the sample has a `loss_mask` (a chat sample:
    the assistant's turns), only the targets it sets do. `text_rows` (the loss) and
    `loss_tokens` (its normaliser) both read this, so they cannot disagree."""
    keep = ~np.isin(sample.tokens[1:], placeholders)
    return keep if sample.loss_mask is None else keep & (sample.loss_mask[1:] != 0)


def loss_tokens(modalities: Sequence[Carried] = ()) -> Callable[[Sequence], int]:
    """The sink's normaliser: the global count of target tokens that carry loss."""
    placeholders = [m.placeholder for m in flat(modalities)]
    return lambda samples: int(sum(np.count_nonzero(carries_loss(s, placeholders)) for s in samples))


def next_token_units(sample) -> int:
    """Work units of a text section: the positions that predict a next token."""
    return sample.length - 1


def route(routes: Mapping[str, Sequence[int]], edge: str, rows) -> np.ndarray:
    """Each row's index into the joined outputs of edge `edge`'s producer micro-steps (-1: none)."""
    return np.asarray(routes.get(edge, np.full(len(rows), -1)), np.int32)


def pack_items(
    rows,
    modality: str,
    cut: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]],
    features: int,
    minimum: int = 16,
    *,
    per_octave: int = PER_OCTAVE,
) -> dict[str, np.ndarray]:
    """All items of `modality` of a row packed into that row: `cut(item)` gives its pieces
    (N x features) and each piece's position (N x k); `segments` numbers the items from 1 (0:
    padding), so attention can stay within each item, and, where a fused kernel may take them
    (`models.attention.segment_lengths_wanted`), `segment_lengths` gives each row's item sizes.
    The piece count is bucketed (from `minimum`, `per_octave` buckets an octave)."""
    return pack_segments(rows, lambda s: [cut(x) for x in s.of(modality)], features, minimum, per_octave=per_octave)


def pack_segments(
    rows,
    cut: Callable[[object], list[tuple[np.ndarray, np.ndarray]]],
    features: int,
    minimum: int = 16,
    *,
    per_octave: int = PER_OCTAVE,
) -> dict[str, np.ndarray]:
    """`pack_items` where a sample's segments are not one per item: `cut(sample)` gives each of
    its segments' pieces and positions in order (a VLM's tower: each image, then each temporal
    patch of each clip)."""
    cuts = [cut(s) if s is not None else [] for s in rows]
    n = bucket(max((sum(len(p) for p, _ in c) for c in cuts), default=0), minimum, per_octave)
    k = max((pos.shape[1] for c in cuts for _, pos in c), default=1)
    out = {
        "pieces": np.zeros((len(rows), n, features), np.float32),
        "segments": np.zeros((len(rows), n), np.int32),
        "positions": np.zeros((len(rows), n, k), np.int32),
    }
    for r, c in enumerate(cuts):
        off = 0
        for i, (pieces, pos) in enumerate(c):
            out["pieces"][r, off : off + len(pieces)] = pieces
            out["segments"][r, off : off + len(pieces)] = i + 1
            out["positions"][r, off : off + len(pieces)] = pos
            off += len(pieces)
    return with_segment_lengths(out)


def with_segment_lengths(rows: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """`rows` with `segment_lengths` (`models.attention.segment_lengths`) from their `segments`
    where a fused attention kernel may take them; as they are elsewhere."""
    if not segment_lengths_wanted():
        return rows
    return {**rows, "segment_lengths": segment_lengths(rows["segments"])}


def join(parts, length: int | None = None):
    """Producer outputs joined along rows, dim 1 padded or cut to a common size."""
    length = length or max(p.shape[1] for p in parts)
    fixed = []
    for p in parts:
        if p.shape[1] < length:
            p = jnp.pad(p, [(0, 0), (0, length - p.shape[1])] + [(0, 0)] * (p.ndim - 2))
        fixed.append(p[:, :length])
    return jnp.concatenate(fixed, axis=0)


def gather(inputs: Mapping, edge: str, route_B, length: int | None = None):
    """The producer output each consumer row needs (rows with route -1 get some row: mask them).

    `route_B` indexes the producer outputs joined along rows (`join`). Under a mesh whose batch
    axes split the rows (a section's program, the monolithic step), each route must point at a
    row on the consumer row's own shard, as the runtime guarantees: every shard then takes its
    rows from its own blocks (global index -> index into the shard's blocks joined), so the
    gather compiles to no collective; a plain `jnp.take` would all-gather every producer row to
    every device and all-reduce the gathered tensor. Producer rows x positions x features arrays
    of `length` positions arrive with their positions split over the mesh's context and tensor
    axes (`runtime.sharding.edge_sharding`) and are taken so, slice by slice: the rows taken keep
    that split (parts of other lengths are padded or cut whole). Without such a mesh, a plain
    take."""
    parts = tuple(inputs[edge])
    length = length or max(p.shape[1] for p in parts)
    return _take_local(parts, length, route_B, lambda joined, index: jnp.take(joined, index, axis=0), whole_rows=True)


def gather_tokens(inputs: Mapping, edge: str, route_BL, index_BL):
    """`gather` per position: out[b, l] = position `index_BL[b, l]` of the producer row
    `route_BL[b, l]` (a packed row takes each sample's positions from that sample's own producer
    row). Routes -1 and indices out of range give some value: mask them. Shard-local like `gather`."""
    parts = tuple(inputs[edge])
    length = max(p.shape[1] for p in parts)

    def pick(joined, index, position):
        flat = joined.reshape(-1, *joined.shape[2:])
        return jnp.take(flat, index * length + jnp.clip(position, 0, length - 1), axis=0)

    return _take_local(parts, length, route_BL, pick, index_BL)


def _take_local(parts, length: int, route, pick, *extra, whole_rows: bool = False):
    """`pick(join(parts, length), row index, *extra)` with `route` the global row indices (-1:
    none): on each data shard from its own blocks when the batch axes split the rows (see
    `gather`), else over the whole join. `whole_rows`: `pick` takes whole rows, so parts of
    `length` positions split over the mesh (`edge_sharding`) are taken slice by slice."""
    mesh = jax.sharding.get_abstract_mesh()
    axes = () if mesh.empty else tuple(a for a in BATCH_AXES if a in mesh.axis_names and mesh.shape[a] > 1)
    shards = math.prod(mesh.shape[a] for a in axes) if axes else 1
    split = ()
    if whole_rows and not mesh.empty and all(p.ndim == 3 and p.shape[1] == length for p in parts):
        split = position_axes(dict(mesh.shape), length)
    if (shards == 1 and not split) or route.shape[0] % shards or any(p.shape[0] % shards for p in parts):
        return pick(join(parts, length), jnp.maximum(route, 0), *extra)
    local_length = length // math.prod(mesh.shape[a] for a in split)
    starts, local_starts, g, loc = [], [], 0, 0
    for p in parts:  # where each part starts, in the global join and in a shard's join
        starts.append(g)
        local_starts.append(loc)
        g, loc = g + p.shape[0], loc + p.shape[0] // shards

    def local(route, extra, *blocks):
        index = jnp.zeros_like(route)
        for p, start, at in zip(parts, starts, local_starts):
            mine = (route >= start) & (route < start + p.shape[0])
            index = jnp.where(mine, at + (route - start) % (p.shape[0] // shards), index)
        return pick(join(blocks, local_length), index, *extra)

    spec, slices = PartitionSpec(axes), PartitionSpec(axes, split) if split else PartitionSpec(axes)
    run = jax.shard_map(local, in_specs=(spec, (spec,) * len(extra)) + (slices,) * len(parts), out_specs=slices)
    return run(route, extra, *parts)


def splice(x_BLD, inputs: Mapping, edge: str, route_B, tok_BL):
    """`x` with each placeholder position replaced by the matching producer embedding.

    `tok_BL` (from `text_rows`, `<modality>_tok`) indexes the row's embeddings; rows without a
    route and positions without a placeholder keep `x`. No-op when no row used the edge."""
    if inputs.get(edge) is None:
        return x_BLD
    rows_BTD = gather(inputs, edge, route_B)
    picked = jnp.take_along_axis(rows_BTD, jnp.maximum(tok_BL, 0)[..., None], axis=1)
    use = (tok_BL >= 0) & (route_B >= 0)[:, None]
    return jnp.where(use[..., None], picked.astype(x_BLD.dtype), x_BLD)


def splice_tokens(x_BLD, inputs: Mapping, edge: str, route_BL, tok_BL):
    """`splice` for packed rows: each position names its own producer row (`route_BL`, its
    sample's route) besides its index among that sample's embeddings (`tok_BL`)."""
    if inputs.get(edge) is None:
        return x_BLD
    picked = gather_tokens(inputs, edge, route_BL, tok_BL)
    use = (tok_BL >= 0) & (route_BL >= 0)
    return jnp.where(use[..., None], picked.astype(x_BLD.dtype), x_BLD)


def packed_text_rows(
    rows,
    routes: Mapping[str, Sequence[int]],
    shards: int,
    pack: Pack,
    modalities: Sequence[Carried] = (),
    unpacks: bool = False,
    positions: Positions | None = None,
    *,
    per_octave: int = PER_OCTAVE,
) -> dict[str, np.ndarray]:
    """`text_rows` with several samples per row (sequence packing): `rows` are the micro-step's
    slots (shard-major), laid into rows by `schedule.packing.pack_rows` (`pack` slots a row, as
    long as the longest row; or rows of a `TokenBudget`, each as long as the budget). Each
    sample keeps its own positions (RoPE restarts), its own `segments` id (attention stays
    inside it), its own loss targets (`carries_loss`) and placeholder indices; for each edge in
    `routes`, `<edge>_row` gives every position its sample's route. With `unpacks` (a section
    whose outputs go down an edge), `slot_row` and `slot_pos` (slots x the longest sample) say
    where each slot's positions sit: `unpack` reads them. `positions`: as `text_rows`'s. Lengths
    are bucketed at `per_octave`. `segment_lengths`: as `pack_items` gives them."""
    lengths = [len(s.tokens) - 1 if s is not None else None for s in rows]
    packed = pack_rows(lengths, shards, pack)
    longest = max((sum(lengths[x] for x in row) for row in packed), default=1)
    length = bucket(pack.tokens if isinstance(pack, TokenBudget) else longest, per_octave=per_octave)
    r = len(packed)
    own, axes = _own_positions(rows, positions)
    out = {
        **_empty_rows(r, length, modalities, axes),
        "segments": np.zeros((r, length), np.int32),
        **{f"{e}_row": np.full((r, length), -1, np.int32) for e in routes},
    }
    if unpacks:
        slot_len = bucket(max((n for n in lengths if n is not None), default=1), per_octave=per_octave)
        first_row = np.arange(len(rows)) // (len(rows) // shards) * (r // shards)  # of each slot's shard
        out["slot_row"] = np.repeat(first_row[:, None], slot_len, axis=1).astype(np.int32)  # padding: never read
        out["slot_pos"] = np.zeros((len(rows), slot_len), np.int32)
    for i, row in enumerate(packed):
        at = 0
        for seg, x in enumerate(row, start=1):
            n = lengths[x]
            span = slice(at, at + n)
            _place(out, i, span, rows[x], modalities, own[x])
            out["segments"][i, span] = seg
            for e, route in routes.items():
                out[f"{e}_row"][i, span] = route[x]
            if unpacks:
                out["slot_row"][x] = i
                out["slot_pos"][x] = np.minimum(at + np.arange(slot_len), length - 1)
            at += n
    return with_segment_lengths(out)


def unpack(h_BLD, batch: Mapping):
    """A packed section's per-position outputs back in one row per slot (the micro-step's
    samples in schedule order, each from position 0), as every edge carries them: a consumer
    routes to a sample's row whether or not its producer packs. Shard-local (`gather_tokens`)."""
    return gather_tokens({"packed": (h_BLD,)}, "packed", batch["slot_row"], batch["slot_pos"])
