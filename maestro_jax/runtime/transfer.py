"""Cross-section transfers that are always device-to-device.

`jax.device_put` between disjoint device sets copies shard-to-shard only when source and
destination shards have identical indices; for fan-in, fan-out or a layout change it silently
pulls the whole array through host memory (jax 0.10, `shard_sharded_device_array_slow_path`).
Here a transfer is planned once per (source sharding, destination sharding, shape) as a tile
map: for every destination device, which piece of which source shard it needs. Executing it
slices each piece on the source device, copies it single-device to single-device, joins the
pieces on the destination device, and assembles the result with
`jax.make_array_from_single_device_arrays`. No step touches host memory.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, SingleDeviceSharding


@dataclasses.dataclass(frozen=True)
class Piece:
    src_device: object
    src_slices: tuple[slice, ...]  # relative to the source shard; full slices mean "whole shard"
    offset: tuple[int, ...]  # start of the piece inside the destination tile


@dataclasses.dataclass(frozen=True)
class TileMap:
    """For each destination device, the pieces that make up its tile."""

    tiles: tuple[tuple[object, tuple[Piece, ...]], ...]

    @property
    def crosses_processes(self) -> bool:
        return any(p.src_device.process_index != dev.process_index for dev, pieces in self.tiles for p in pieces)


def _bounds(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    return tuple((s.start or 0, shape[d] if s.stop is None else s.stop) for d, s in enumerate(index))


@functools.lru_cache(maxsize=1024)
def plan_transfer(src: NamedSharding, dst: NamedSharding, shape: tuple[int, ...]) -> TileMap:
    src_map = src.devices_indices_map(shape)
    # One source replica per distinct shard; replicas are used round-robin to spread the reads.
    replicas: dict[tuple, list] = {}
    for dev, idx in src_map.items():
        replicas.setdefault(_bounds(idx, shape), []).append(dev)
    turn = {b: 0 for b in replicas}
    tiles = []
    for dev, idx in dst.devices_indices_map(shape).items():  # all devices: the same plan on every process
        tile = _bounds(idx, shape)
        pieces = []
        for b, devs in replicas.items():
            inter = tuple((max(t0, s0), min(t1, s1)) for (t0, t1), (s0, s1) in zip(tile, b))
            if any(lo >= hi for lo, hi in inter):
                continue
            same = [d for d in devs if d == dev]
            near = [d for d in devs if d.process_index == dev.process_index]  # no cross-process read
            src_dev = same[0] if same else (near or devs)[turn[b] % len(near or devs)]
            turn[b] += 1
            rel = tuple(slice(lo - s0, hi - s0) for (lo, hi), (s0, _) in zip(inter, b))
            pieces.append(Piece(src_dev, rel, tuple(lo - t0 for (lo, _), (t0, _) in zip(inter, tile))))
        tiles.append((dev, tuple(sorted(pieces, key=lambda p: p.offset))))
    return TileMap(tuple(tiles))


def _join(parts: list[tuple[tuple[int, ...], jax.Array]], dim: int = 0) -> jax.Array:
    """Join grid pieces (offset, array) on one device by nested concatenation."""
    if len(parts) == 1:
        return parts[0][1]
    groups: dict[int, list] = {}
    for off, arr in parts:
        groups.setdefault(off[dim], []).append((off, arr))
    joined = [_join(groups[k], dim + 1) for k in sorted(groups)]
    return joined[0] if len(joined) == 1 else jnp.concatenate(joined, axis=dim)


def transfer(x: jax.Array, dst: NamedSharding) -> jax.Array:
    """Move `x` into `dst` (another section's mesh) without a host round trip.

    Every process must call it (multi-controller), with the same arguments. Each destination
    tile is assembled on its own device from pieces of source shards (`plan_transfer`, which
    reads within a process where a replica allows). Pieces that stay within a process are
    copied device to device; pieces that cross processes go as single-device `device_put`s that
    every process issues in the same order (the socket transport on CPU, XLA send/recv on GPU),
    each distinct piece once per destination process: any device counts on either side,
    fan-in, fan-out or a layout change, sections inside one process or spanning several.
    """
    if x.sharding == dst:
        return x
    tile_map = plan_transfer(x.sharding, dst, tuple(x.shape))
    local = {s.device: s.data for s in x.addressable_shards}
    moved = _move_across_processes(tile_map, local, x.dtype)
    mine = set(dst.addressable_devices)
    arrays = []
    for dev, pieces in tile_map.tiles:
        if dev not in mine:
            continue
        parts = [(p.offset, moved[(dev, i)] if (dev, i) in moved else jax.device_put(_cut(local[p.src_device], p), dev))
                 for i, p in enumerate(pieces)]
        arrays.append(_join(parts))
    return jax.make_array_from_single_device_arrays(x.shape, dst, arrays, dtype=x.dtype)


def _cut(shard: jax.Array, p: Piece) -> jax.Array:
    whole = all(sl.start == 0 and sl.stop == n for sl, n in zip(p.src_slices, shard.shape))
    return shard if whole else shard[p.src_slices]


def _move_across_processes(tile_map: TileMap, local: dict, dtype) -> dict:
    """{(destination device, piece index): single-device array} for every piece whose source sits
    in another process than its destination. Each distinct piece crosses once per destination
    process (tensor-parallel replicas of a tile share it) and is copied on within that process.
    The source's process cuts the piece; the others name it by an array without local data; every
    process then issues one single-device `device_put` per piece, in the same order. (One
    batched `device_put` over several process pairs delivered a piece to the wrong device with
    4 processes on jax 0.10; per piece is exact, `tests/test_multiprocess.py`.)"""
    crossing = [(dev, i, p) for dev, pieces in tile_map.tiles for i, p in enumerate(pieces)
                if p.src_device.process_index != dev.process_index]
    if not crossing:
        return {}
    first: dict[tuple, tuple] = {}  # distinct piece per destination process -> (piece, receiving device)
    for dev, _, p in crossing:
        first.setdefault(_piece_key(p, dev), (p, dev))
    sources = []
    for p, _ in first.values():
        if p.src_device in local:
            sources.append(_cut(local[p.src_device], p))
        else:
            shape = tuple(sl.stop - sl.start for sl in p.src_slices)
            sources.append(jax.make_array_from_single_device_arrays(shape, SingleDeviceSharding(p.src_device), [],
                                                                    dtype=dtype))
    received = {key: jax.device_put(x, SingleDeviceSharding(d)) for key, x, (_, d) in zip(first, sources, first.values())}
    out = {}
    for dev, i, p in crossing:
        key = _piece_key(p, dev)
        if dev.process_index == jax.process_index():
            out[(dev, i)] = received[key] if first[key][1] == dev else jax.device_put(received[key], dev)
    return out


def _piece_key(p: Piece, dev) -> tuple:
    """A piece's identity per destination process: its source device and bounds."""
    return p.src_device, tuple((sl.start, sl.stop) for sl in p.src_slices), dev.process_index


def process_bytes(tile_map: TileMap, itemsize: int) -> dict[int, dict[str, int]]:
    """Bytes each process sends to and receives from other processes for one transfer (each
    distinct piece once per destination process, as `transfer` moves them)."""
    out: dict[int, dict[str, int]] = {}
    seen = set()
    for dev, pieces in tile_map.tiles:
        for p in pieces:
            src, dst = p.src_device.process_index, dev.process_index
            if src == dst or _piece_key(p, dev) in seen:
                continue
            seen.add(_piece_key(p, dev))
            n = itemsize * math.prod(sl.stop - sl.start for sl in p.src_slices)
            out.setdefault(src, {"sent": 0, "received": 0})["sent"] += n
            out.setdefault(dst, {"sent": 0, "received": 0})["received"] += n
    return out
