"""The transfer executor before issue 14, kept as the reference that
scripts/transfer_host_time.py times against the current one (and tests compare with).

One eager slice, one single-device `device_put` and one join per piece, per destination device
(tensor-parallel replicas each fetch their own pieces). The plan is the package's
`plan_transfer`: its per-device tiles are unchanged.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, SingleDeviceSharding

from maestro_jax.runtime.transfer import Piece, TileMap, plan_transfer


def _join(parts: list[tuple[tuple[int, ...], jax.Array]], dim: int = 0) -> jax.Array:
    if len(parts) == 1:
        return parts[0][1]
    groups: dict[int, list] = {}
    for off, arr in parts:
        groups.setdefault(off[dim], []).append((off, arr))
    joined = [_join(groups[k], dim + 1) for k in sorted(groups)]
    return joined[0] if len(joined) == 1 else jnp.concatenate(joined, axis=dim)


def transfer(x: jax.Array, dst: NamedSharding) -> jax.Array:
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
        parts = [
            (p.offset, moved[(dev, i)] if (dev, i) in moved else jax.device_put(_cut(local[p.src_device], p), dev))
            for i, p in enumerate(pieces)
        ]
        arrays.append(_join(parts))
    return jax.make_array_from_single_device_arrays(x.shape, dst, arrays, dtype=x.dtype)


def _cut(shard: jax.Array, p: Piece) -> jax.Array:
    whole = all(sl.start == 0 and sl.stop == n for sl, n in zip(p.src_slices, shard.shape))
    return shard if whole else shard[p.src_slices]


def _move_across_processes(tile_map: TileMap, local: dict, dtype) -> dict:
    crossing = [
        (dev, i, p)
        for dev, pieces in tile_map.tiles
        for i, p in enumerate(pieces)
        if p.src_device.process_index != dev.process_index
    ]
    if not crossing:
        return {}
    first: dict[tuple, tuple] = {}
    for dev, _, p in crossing:
        first.setdefault(_piece_key(p, dev), (p, dev))
    sources = []
    for p, _ in first.values():
        if p.src_device in local:
            sources.append(_cut(local[p.src_device], p))
        else:
            shape = tuple(sl.stop - sl.start for sl in p.src_slices)
            sources.append(
                jax.make_array_from_single_device_arrays(shape, SingleDeviceSharding(p.src_device), [], dtype=dtype)
            )
    received = {
        key: jax.device_put(x, SingleDeviceSharding(d)) for key, x, (_, d) in zip(first, sources, first.values())
    }
    out = {}
    for dev, i, p in crossing:
        key = _piece_key(p, dev)
        if dev.process_index == jax.process_index():
            out[(dev, i)] = received[key] if first[key][1] == dev else jax.device_put(received[key], dev)
    return out


def _piece_key(p: Piece, dev) -> tuple:
    return p.src_device, tuple((sl.start, sl.stop) for sl in p.src_slices), dev.process_index
