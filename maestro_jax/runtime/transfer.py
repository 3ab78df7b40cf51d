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

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding


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

    Every process must call it (multi-controller). Each process fills its own destination tiles
    from source shards it holds (so sections spanning processes in step need no network);
    tiles whose data sits in another process go through `_across_processes`.
    """
    if x.sharding == dst:
        return x
    tile_map = plan_transfer(x.sharding, dst, tuple(x.shape))
    if tile_map.crosses_processes:  # decided from the plan alone, so every process agrees
        return _across_processes(x, dst)
    local = {s.device: s.data for s in x.addressable_shards}
    mine = set(dst.addressable_devices)
    arrays = []
    for dev, pieces in tile_map.tiles:
        if dev not in mine:
            continue
        parts = []
        for p in pieces:
            shard = local[p.src_device]
            whole = all(sl.start == 0 and sl.stop == n for sl, n in zip(p.src_slices, shard.shape))
            piece = shard if whole else shard[p.src_slices]
            parts.append((p.offset, jax.device_put(piece, dev)))
        arrays.append(_join(parts))
    return jax.make_array_from_single_device_arrays(x.shape, dst, arrays, dtype=x.dtype)


def _across_processes(x: jax.Array, dst: NamedSharding) -> jax.Array:
    """Cross-process move: reshard on the source devices into the destination's layout, then
    `device_put`, which crosses processes only between equal shard shapes and device counts
    (jax 0.10; XLA send/recv on GPU, the socket transport on CPU)."""
    src_devices = list(x.sharding.mesh.devices.flat)
    if len(src_devices) != dst.num_devices:
        raise NotImplementedError(
            f"a transfer between processes needs equal device counts on both sides in jax 0.10; got "
            f"{len(src_devices)} source and {dst.num_devices} destination devices. Give the two sections the same "
            f"device count, or place them in one process")
    like = Mesh(np.array(src_devices, dtype=object).reshape(dst.mesh.devices.shape), dst.mesh.axis_names,
                axis_types=dst.mesh.axis_types)
    staged = _identity(NamedSharding(like, dst.spec))(x)
    return jax.device_put(staged, dst)


@functools.lru_cache(maxsize=256)
def _identity(sharding: NamedSharding):
    return jax.jit(lambda v: v, out_shardings=sharding)
