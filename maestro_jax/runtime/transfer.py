"""Cross-section transfers that are always device-to-device, at a host cost that does not grow
with the number of pieces.

`jax.device_put` between disjoint device sets copies shard-to-shard only when source and
destination shards have identical indices; for fan-in, fan-out or a layout change it silently
pulls the whole array through host memory (jax 0.10, `shard_sharded_device_array_slow_path`).
Here a transfer is planned once per (source sharding, destination sharding, shape) as a tile
map: for every destination device, which piece of which source shard it needs. Each distinct
tile is assembled once per process, on one of its devices (the tile's head), and copied from
there to the tile's other devices in that process (tensor-parallel replicas).

Per-call host cost is what issue 14 measured: one eager slice, `device_put` and concatenation
per piece cost 9-15 ms per transfer at 56 devices. So a call issues a fixed set of batched
steps, precomputed per process and cached with the plan: one compiled cut per source device
(all its pieces in one program), one batched `device_put` of all pieces to the heads, one
compiled join per head that receives several pieces, one batched `device_put` of the tiles to
their replicas, and `jax.make_array_from_single_device_arrays`. Every copy is single-device to
single-device, so jax takes its direct copy path; no step touches host memory.

Along an edge the destination is not a plain reshard of the source but a row map (`RowMap`):
destination rows receive, or sum, ranges of source rows, the rest zero. A producer micro-step
goes to the consumer as `deliver_rows` lays it out: each consumer data shard receives the whole
rows of the producer shards that feed it (`schedule.ops.delivered`: any data-parallel degrees on
either side), zero-padded to a common count, so the consumer finds every row it needs on its own
shard and gathers locally (`mj.rows.gather`). The cotangent goes back by `return_rows`: each
producer shard sums the blocks of every consumer shard it fed. A tile is then joined from
pieces per *term* (pieces that do not overlap), zero-padded where no piece reaches, and the
terms summed, in the same one compiled program per head.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, SingleDeviceSharding

from maestro_jax.schedule.ops import delivered

Bounds = tuple[tuple[int, int], ...]  # (start, stop) per dimension


@dataclasses.dataclass(frozen=True)
class RowMap:
    """A linear map of the source's rows (dimension 0) onto a destination of `out_rows` rows, the other
    dimensions unchanged: per segment (start, stop, at), destination rows at .. at+stop-start
    receive source rows start .. stop; where segments overlap they add up; rows no segment
    reaches are zero."""

    segments: tuple[tuple[int, int, int], ...]
    out_rows: int

    def keeps(self, rows: int) -> bool:
        """Whether the map leaves a source of `rows` rows as it is: every row in its own place
        (an edge between co-located sections with one data-parallel layout)."""
        at = 0
        for start, stop, dst in sorted(self.segments):
            if start != at or dst != start:
                return False
            at = stop
        return at == rows == self.out_rows


def deliver_rows(dp_p: int, dp_c: int, micro_batch: int) -> RowMap:
    """A producer micro-step (DP(p) shards of `micro_batch` rows) as its consumer receives it:
    consumer shard j holds, in order, the rows of the producer shards that feed it
    (`schedule.ops.delivered`), in a block of `width` producer shards, zero-padded."""
    feeding, width = delivered(dp_p, dp_c)
    block = width * micro_batch
    return RowMap(
        tuple((f.start * micro_batch, f.stop * micro_batch, j * block) for j, f in enumerate(feeding)), dp_c * block
    )


def return_rows(dp_p: int, dp_c: int, micro_batch: int) -> RowMap:
    """The reverse of `deliver_rows` for the cotangent: each producer shard sums the blocks that the
    consumer shards it fed hold of it (with fan-out, f copies, each nonzero only on the rows of
    the samples that sit on that consumer shard)."""
    feeding, width = delivered(dp_p, dp_c)
    block = width * micro_batch
    return RowMap(
        tuple((j * block, j * block + len(f) * micro_batch, f.start * micro_batch) for j, f in enumerate(feeding)),
        dp_p * micro_batch,
    )


@dataclasses.dataclass(frozen=True)
class Piece:
    src_device: object
    src_slices: tuple[slice, ...]  # relative to the source shard; full slices mean "whole shard"
    offset: tuple[int, ...]  # start of the piece inside the destination tile
    term: int = 0  # the pieces of one term do not overlap; a tile is the sum of its terms

    @property
    def bounds(self) -> Bounds:
        return tuple((sl.start, sl.stop) for sl in self.src_slices)


@dataclasses.dataclass(frozen=True)
class TileMap:
    """For each destination device, the pieces that make up its tile; and for each distinct tile
    in each process, the device that assembles it (head) with the devices of that process that
    copy it from the head."""

    tiles: tuple[tuple[object, tuple[Piece, ...]], ...]
    heads: tuple[tuple[object, tuple[object, ...]], ...]

    @property
    def crosses_processes(self) -> bool:
        return any(p.src_device.process_index != dev.process_index for dev, pieces in self.tiles for p in pieces)


def _bounds(index: tuple[slice, ...], shape: tuple[int, ...]) -> Bounds:
    return tuple((s.start or 0, shape[d] if s.stop is None else s.stop) for d, s in enumerate(index))


def _dst_shape(shape: tuple[int, ...], row_map: RowMap | None) -> tuple[int, ...]:
    return shape if row_map is None else (row_map.out_rows, *shape[1:])


@functools.lru_cache(maxsize=1024)
def plan_transfer(
    src: NamedSharding, dst: NamedSharding, shape: tuple[int, ...], row_map: RowMap | None = None
) -> TileMap:
    """The tile map of moving an array of `shape` from `src` to `dst`, as it is (a reshard) or
    through a row map (`row_map`: the destination has `row_map.out_rows` rows)."""
    src_map = src.devices_indices_map(shape)
    # One source replica per distinct shard; replicas are used round-robin to spread the reads.
    replicas: dict[tuple, list] = {}
    for dev, idx in src_map.items():
        replicas.setdefault(_bounds(idx, shape), []).append(dev)
    turn = dict.fromkeys(replicas, 0)
    tiles = []
    copies: dict[tuple, list] = {}  # (tile bounds, process) -> its devices, the first one the head
    out_shape = _dst_shape(shape, row_map)
    segments = ((0, shape[0], 0),) if row_map is None else row_map.segments
    for dev, idx in dst.devices_indices_map(out_shape).items():  # all devices: the same plan on every process
        tile = _bounds(idx, out_shape)
        copies.setdefault((tile, dev.process_index), []).append(dev)
        (t0, t1), pieces, ends = tile[0], [], []  # ends: per term, the last destination row it covers
        clipped = sorted(
            (max(t0, at), min(t1, at + stop - start), start - at)
            for start, stop, at in segments
            if max(t0, at) < min(t1, at + stop - start)
        )
        for lo, hi, shift in clipped:  # destination rows lo..hi from source rows lo+shift..hi+shift
            term = next((k for k, end in enumerate(ends) if end <= lo), len(ends))
            ends[term : term + 1] = [hi]
            region = ((lo + shift, hi + shift), *tile[1:])
            for b, devs in replicas.items():
                inter = tuple((max(r0, s0), min(r1, s1)) for (r0, r1), (s0, s1) in zip(region, b))
                if any(a >= z for a, z in inter):
                    continue
                same = [d for d in devs if d == dev]
                near = [d for d in devs if d.process_index == dev.process_index]  # no cross-process read
                src_dev = same[0] if same else (near or devs)[turn[b] % len(near or devs)]
                turn[b] += 1
                rel = tuple(slice(a - s0, z - s0) for (a, z), (s0, _) in zip(inter, b))
                offset = (inter[0][0] - shift - t0, *(a - r0 for (a, _), (r0, _) in zip(inter[1:], tile[1:])))
                pieces.append(Piece(src_dev, rel, offset, term))
        if not pieces:
            raise ValueError(f"transfer: destination tile {tile} of {dev} receives no rows")
        tiles.append((dev, tuple(sorted(pieces, key=lambda p: (p.term, p.offset)))))
    heads = tuple((devs[0], tuple(devs[1:])) for devs in copies.values())
    return TileMap(tuple(tiles), heads)


@dataclasses.dataclass(frozen=True, eq=False)
class _Steps:
    """One process's part of a transfer, precomputed so that a call only dispatches.

    `cuts`: (local source device, bounds of the pieces cut from its shard); pieces that are whole
    shards are not cut. `crossing`: (piece, head) for every piece whose source and head sit in
    different processes, the same list in the same order on every process. `puts`: (piece, head)
    for the local pieces of local heads. `joins`: (head, the (term, offset) of its pieces in tile
    order, the tile's shape, whether one piece is the whole tile) for local heads; a piece that
    arrives is known by (head, term, offset). `copies`: (head, replica device). `devices`: the
    local destination devices, the order of the result's shards.
    """

    cuts: tuple[tuple[object, tuple[Bounds, ...]], ...]
    crossing: tuple[tuple[Piece, object], ...]
    puts: tuple[tuple[Piece, object], ...]
    joins: tuple[tuple[object, tuple[tuple[int, tuple[int, ...]], ...], tuple[int, ...], bool], ...]
    copies: tuple[tuple[object, object], ...]
    devices: tuple[object, ...]
    targets: dict  # device -> SingleDeviceSharding, built once


@functools.lru_cache(maxsize=1024)
def _process_steps(
    src: NamedSharding, dst: NamedSharding, shape: tuple[int, ...], process: int, row_map: RowMap | None = None
) -> _Steps:
    tile_map = plan_transfer(src, dst, shape, row_map)
    shard_shape, tile_shape = src.shard_shape(shape), dst.shard_shape(_dst_shape(shape, row_map))
    pieces_of = dict(tile_map.tiles)
    crossing, puts, joins, copies, cut = [], [], [], [], {}
    for head, replicas in tile_map.heads:
        for p in pieces_of[head]:
            if p.src_device.process_index == process and p.bounds != tuple((0, n) for n in shard_shape):
                cut.setdefault(p.src_device, {})[p.bounds] = None
            if p.src_device.process_index != head.process_index:
                crossing.append((p, head))
            elif head.process_index == process:
                puts.append((p, head))
        if head.process_index == process:
            pieces = pieces_of[head]
            whole = len(pieces) == 1 and tuple(hi - lo for lo, hi in pieces[0].bounds) == tile_shape
            joins.append((head, tuple((p.term, p.offset) for p in pieces), tile_shape, whole))
            copies.extend((head, r) for r in replicas)
    devices = tuple(dev for dev, _ in tile_map.tiles if dev.process_index == process)
    return _Steps(
        tuple((dev, tuple(b)) for dev, b in cut.items()),
        tuple(crossing),
        tuple(puts),
        tuple(joins),
        tuple(copies),
        devices,
        {d: SingleDeviceSharding(d) for d in devices},
    )


@functools.partial(jax.jit, static_argnums=1)
def _cut_pieces(shard: jax.Array, bounds: tuple[Bounds, ...]) -> tuple[jax.Array, ...]:
    """All the pieces one source shard gives, as one program on its device."""
    return tuple(jax.lax.slice(shard, [lo for lo, _ in b], [hi for _, hi in b]) for b in bounds)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _join_pieces(
    layout: tuple[tuple[int, tuple[int, ...]], ...], shape: tuple[int, ...], *parts: jax.Array
) -> jax.Array:
    """A tile of `shape` from its pieces ((term, grid offset) each) on the head, as one program: each
    term's pieces joined (zero-padded where they leave rows uncovered), the terms summed."""
    terms: dict[int, list] = {}
    for (term, offset), part in zip(layout, parts):
        terms.setdefault(term, []).append((offset, part))
    out = None
    for term in sorted(terms):
        pieces = terms[term]
        if sum(math.prod(p.shape) for _, p in pieces) == math.prod(shape):
            x = _join(pieces)
        else:
            x = jnp.zeros(shape, pieces[0][1].dtype)
            for offset, p in pieces:
                x = jax.lax.dynamic_update_slice(x, p, offset)
        out = x if out is None else out + x
    return out


def _join(parts: list[tuple[tuple[int, ...], jax.Array]], dim: int = 0) -> jax.Array:
    """Join grid pieces (offset, array) by nested concatenation."""
    if len(parts) == 1:
        return parts[0][1]
    groups: dict[int, list] = {}
    for off, arr in parts:
        groups.setdefault(off[dim], []).append((off, arr))
    joined = [_join(groups[k], dim + 1) for k in sorted(groups)]
    return joined[0] if len(joined) == 1 else jnp.concatenate(joined, axis=dim)


def transfer(x: jax.Array, dst: NamedSharding, row_map: RowMap | None = None) -> jax.Array:
    """Move `x` into `dst` (another section's mesh) without a host round trip; with `row_map`, through
    that row map (an edge's `deliver_rows` or `return_rows`).

    Every process must call it (multi-controller), with the same arguments. Each distinct
    destination tile is assembled once per process on its head from pieces of source shards
    (`plan_transfer`, which reads within a process where a replica allows) and copied on to the
    tile's other devices there. Pieces that stay within a process go in one batched device to
    device `device_put`; pieces that cross processes go as single-device `device_put`s that
    every process issues in the same order (the socket transport on CPU, XLA send/recv on GPU),
    each distinct piece once per destination process: any device counts on either side,
    fan-in, fan-out or a layout change, sections inside one process or spanning several.
    """
    if x.sharding == dst and (row_map is None or row_map.keeps(x.shape[0])):
        return x
    steps = _process_steps(x.sharding, dst, tuple(x.shape), jax.process_index(), row_map)
    shards = {s.device: s.data for s in x.addressable_shards}
    cut = {}
    for dev, bounds in steps.cuts:
        cut.update(zip(((dev, b) for b in bounds), _cut_pieces(shards[dev], bounds)))

    def piece(p: Piece) -> jax.Array:
        arr = cut.get((p.src_device, p.bounds))
        return shards[p.src_device] if arr is None else arr

    arrived = _move_across_processes(steps.crossing, piece, x.dtype)  # (head, term, offset) -> piece on the head
    if steps.puts:
        moved = jax.device_put([piece(p) for p, _ in steps.puts], [steps.targets[h] for _, h in steps.puts])
        arrived.update(zip(((h, p.term, p.offset) for p, h in steps.puts), moved))
    tile = {}
    for head, layout, shape, whole in steps.joins:
        parts = [arrived[(head, *at)] for at in layout]
        tile[head] = parts[0] if whole else _join_pieces(layout, shape, *parts)
    if steps.copies:
        copied = jax.device_put([tile[h] for h, _ in steps.copies], [steps.targets[r] for _, r in steps.copies])
        tile.update(zip((r for _, r in steps.copies), copied))
    return jax.make_array_from_single_device_arrays(
        _dst_shape(tuple(x.shape), row_map), dst, [tile[d] for d in steps.devices], dtype=x.dtype
    )


def abstract_transfer(
    x: jax.ShapeDtypeStruct, dst: NamedSharding, row_map: RowMap | None = None
) -> tuple[jax.ShapeDtypeStruct, dict[tuple, tuple]]:
    """`transfer` over an abstract value, nothing run: the result's abstract value and the programs
    the call runs in this process, {key: (jitted program, abstract arguments)} for its cuts and
    joins, so that they can be compiled ahead (`runtime.ahead`). Equal keys name one program."""
    if x.sharding is None:
        raise ValueError(f"transfer of an array of unknown layout {x}: pin the producing program's out_shardings")
    shape = tuple(x.shape)
    if x.sharding == dst and (row_map is None or row_map.keeps(shape[0])):
        return x, {}
    steps = _process_steps(x.sharding, dst, shape, jax.process_index(), row_map)
    shard = x.sharding.shard_shape(shape)
    programs = {}
    for dev, bounds in steps.cuts:
        args = (jax.ShapeDtypeStruct(shard, x.dtype, sharding=SingleDeviceSharding(dev)), bounds)
        programs[("cut", dev, shard, x.dtype, bounds)] = (_cut_pieces, args)
    pieces = {
        (head, p.term, p.offset): tuple(hi - lo for lo, hi in p.bounds) for p, head in steps.puts + steps.crossing
    }
    for head, layout, tile, whole in steps.joins:
        if not whole:
            parts = tuple(pieces[(head, *at)] for at in layout)
            args = (
                layout,
                tile,
                *(jax.ShapeDtypeStruct(p, x.dtype, sharding=SingleDeviceSharding(head)) for p in parts),
            )
            programs[("join", head, layout, tile, parts, x.dtype)] = (_join_pieces, args)
    return jax.ShapeDtypeStruct(_dst_shape(shape, row_map), x.dtype, sharding=dst), programs


def _move_across_processes(crossing: tuple[tuple[Piece, object], ...], piece, dtype) -> dict:
    """{(head, term, offset): single-device array} for the crossing pieces whose head is in this
    process. The source's process passes the cut piece; the others name it by an array without
    local data; every process issues one single-device `device_put` per piece, in the same
    order. (One batched `device_put` over several process pairs delivered a piece to the wrong
    device with 4 processes on jax 0.10; per piece is exact, `tests/test_multiprocess.py`.)"""
    me = jax.process_index()
    out = {}
    for p, head in crossing:
        if p.src_device.process_index == me:
            x = piece(p)
        else:
            shape = tuple(hi - lo for lo, hi in p.bounds)
            x = jax.make_array_from_single_device_arrays(shape, SingleDeviceSharding(p.src_device), [], dtype=dtype)
        received = jax.device_put(x, SingleDeviceSharding(head))
        if head.process_index == me:
            out[(head, p.term, p.offset)] = received
    return out


def process_bytes(tile_map: TileMap, itemsize: int) -> dict[int, dict[str, int]]:
    """Bytes each process sends to and receives from other processes for one transfer (the
    pieces of each tile's head: each distinct piece once per destination process, as `transfer`
    moves them)."""
    out: dict[int, dict[str, int]] = {}
    pieces_of = dict(tile_map.tiles)
    for head, _ in tile_map.heads:
        for p in pieces_of[head]:
            src, dst = p.src_device.process_index, head.process_index
            if src == dst:
                continue
            n = itemsize * math.prod(hi - lo for lo, hi in p.bounds)
            out.setdefault(src, {"sent": 0, "received": 0})["sent"] += n
            out.setdefault(dst, {"sent": 0, "received": 0})["received"] += n
    return out
