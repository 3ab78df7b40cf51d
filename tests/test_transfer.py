"""Cross-mesh transfers are exact and never take the host path.

jax caches a host copy in `Array._npy_value` when `device_put` falls back to its slow path
(`shard_sharded_device_array_slow_path` reads `x._value`); a transfer that stays
device-to-device leaves it unset. The first test shows the detector fires on plain device_put.
"""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from maestro_jax.meshes import BATCH_AXES

from maestro_jax.core.plan import SectionPlan, mesh_shape
from maestro_jax.runtime.sharding import edge_sharding, row_sharding, section_mesh
from maestro_jax.runtime.transfer import plan_transfer, transfer


def mesh(devices, shape):
    """A section mesh from (data, fsdp, tensor) sizes."""
    data, fsdp, tensor = shape
    return section_mesh(SectionPlan(tuple(devices), mesh_shape(data=data, fsdp=fsdp, tensor=tensor), 1))


def source(sharding, shape=(12, 6, 4)):
    x = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    # a fresh device result, so no host copy exists yet
    arr = jax.jit(lambda v: v + 0, out_shardings=sharding)(x)
    assert arr._npy_value is None
    return x, arr


def test_plain_device_put_fan_out_goes_through_host():
    _, arr = source(row_sharding(mesh([0, 1], (2, 1, 1))))
    jax.device_put(arr, row_sharding(mesh([4, 5, 6, 7], (4, 1, 1)))).block_until_ready()
    assert arr._npy_value is not None, "detector: jax's slow path should have cached a host copy"


CASES = {
    "fan_out_2_to_4": ([0, 1], (2, 1, 1), P(("data", "fsdp")), [4, 5, 6, 7], (4, 1, 1), P(("data", "fsdp"))),
    "fan_in_4_to_2": ([0, 1, 2, 3], (2, 2, 1), P(("data", "fsdp")), [6, 7], (2, 1, 1), P(("data", "fsdp"))),
    "to_replicated_tensor_axis": (
        [0, 1],
        (2, 1, 1),
        P(("data", "fsdp")),
        [2, 3, 4, 5, 6, 7],
        (2, 1, 3),
        P(("data", "fsdp")),
    ),
    "tensor_sharded_to_data_sharded": (
        [0, 1, 2, 3],
        (1, 1, 4),
        P(None, None, "tensor"),
        [4, 5],
        (2, 1, 1),
        P(("data", "fsdp")),
    ),
    "data_to_last_dim": ([0, 1], (2, 1, 1), P("data"), [2, 3, 4, 5], (1, 2, 2), P(None, "fsdp", "tensor")),
    # 4-row source blocks into 6-row tiles: the middle block is cut in two, the others go whole
    "uneven_3_to_2": ([0, 1, 2], (3, 1, 1), P(("data", "fsdp")), [4, 5], (2, 1, 1), P(("data", "fsdp"))),
    # each tile joined from two blocks once, then copied to its tensor-parallel replica
    "layout_4_to_2x2_tensor": (
        [0, 1, 2, 3],
        (4, 1, 1),
        P(("data", "fsdp")),
        [4, 5, 6, 7],
        (2, 1, 2),
        P(("data", "fsdp")),
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_transfer_is_device_to_device_and_exact(case):
    sd, ss, sspec, dd, ds, dspec = CASES[case]
    x, arr = source(NamedSharding(mesh(sd, ss), sspec))
    dst = NamedSharding(mesh(dd, ds), dspec)
    out = transfer(arr, dst)
    assert out.sharding == dst
    np.testing.assert_array_equal(np.asarray(out), x)
    assert arr._npy_value is None, "transfer must not copy the source through host memory"
    for shard in out.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), x[shard.index])


def test_fan_out_tile_map_reads_each_destination_from_one_source_block():
    src = row_sharding(mesh([0, 1], (2, 1, 1)))
    dst = row_sharding(mesh([4, 5, 6, 7], (4, 1, 1)))
    tiles = plan_transfer(src, dst, (8, 3))
    assert len(tiles.tiles) == 4
    for _dev, pieces in tiles.tiles:
        assert len(pieces) == 1
    # destination shards 0,1 read source device 0; shards 2,3 read source device 1 (block map)
    assert [p[0].src_device.id for _, p in tiles.tiles] == [0, 0, 1, 1]


@pytest.mark.parametrize("case", list(CASES))
def test_transfer_host_calls_do_not_grow_with_pieces(case, monkeypatch):
    """Within a process a transfer issues at most two (batched) `device_put` calls, pieces to
    each tile's head and tiles to their replicas, however many pieces and devices (issue 14:
    one call per piece cost 9-15 ms at 56 devices)."""
    sd, ss, sspec, dd, ds, dspec = CASES[case]
    x, arr = source(NamedSharding(mesh(sd, ss), sspec))
    dst = NamedSharding(mesh(dd, ds), dspec)
    calls = []
    device_put = jax.device_put
    monkeypatch.setattr(jax, "device_put", lambda *a, **k: calls.append(a) or device_put(*a, **k))
    out = transfer(arr, dst)
    np.testing.assert_array_equal(np.asarray(out), x)
    assert len(calls) <= 2, [len(a[0]) if isinstance(a[0], list) else 1 for a in calls]


def test_replicated_tiles_are_fetched_once_per_process():
    src = row_sharding(mesh([0, 1], (2, 1, 1)))
    dst = row_sharding(mesh([2, 3, 4, 5, 6, 7], (2, 1, 3)))
    heads = plan_transfer(src, dst, (12, 3)).heads
    # two distinct tiles, each assembled on one device and copied to its two tensor replicas
    assert [(h.id, [r.id for r in reps]) for h, reps in heads] == [(2, [3, 4]), (5, [6, 7])]


# -- along an edge: each consumer shard receives its feeders' rows; cotangents come back summed --
EDGES = {  # (producer devices, its (data, fsdp, tensor)), (consumer devices, its mesh), producer micro-batch
    "fan_out_2_to_6": (([0, 1], (2, 1, 1)), ([2, 3, 4, 5, 6, 7], (6, 1, 1)), 3),
    "fan_in_6_to_2_tensor": (([0, 1, 2, 3, 4, 5], (3, 2, 1)), ([6, 7], (1, 1, 2)), 2),
    "uneven_3_to_4": (([0, 1, 2], (3, 1, 1)), ([4, 5, 6, 7], (4, 1, 1)), 2),
    "uneven_6_to_4_tensor_replicas": (([0, 1, 2, 3, 4, 5], (6, 1, 1)), ([2, 3, 4, 5, 6, 7], (2, 1, 3)), 1),
    "uneven_4_to_3_shared_devices": (([0, 1, 2, 3], (2, 2, 1)), ([1, 2, 3], (3, 1, 1)), 3),
}


def edge_reference(x, dp_p, dp_c, mb):
    """What `deliver_rows` lays out (numpy): consumer shard j's block holds its feeders' rows, then zeros."""
    from maestro_jax.schedule.ops import delivered

    feeding, width = delivered(dp_p, dp_c)
    out = np.zeros((dp_c * width * mb, *x.shape[1:]), x.dtype)
    for j, f in enumerate(feeding):
        rows = x[f.start * mb : f.stop * mb]
        out[j * width * mb : j * width * mb + len(rows)] = rows
    back = np.zeros_like(x)
    for j, f in enumerate(feeding):
        back[f.start * mb : f.stop * mb] += out[j * width * mb : j * width * mb + len(f) * mb]
    return out, back


@pytest.mark.parametrize("case", list(EDGES))
def test_edge_row_maps_are_device_to_device_and_exact(case, monkeypatch):
    from maestro_jax.runtime.transfer import deliver_rows, return_rows

    (sd, ss), (dd, ds), mb = EDGES[case]
    src, dst = row_sharding(mesh(sd, ss)), row_sharding(mesh(dd, ds))
    dp_p, dp_c = ss[0] * ss[1], ds[0] * ds[1]
    x, arr = source(src, (dp_p * mb, 3, 2))
    calls = []
    device_put = jax.device_put
    monkeypatch.setattr(jax, "device_put", lambda *a, **k: calls.append(a) or device_put(*a, **k))
    out = transfer(arr, dst, deliver_rows(dp_p, dp_c, mb))
    assert len(calls) <= 2
    returned = transfer(out, src, return_rows(dp_p, dp_c, mb))
    assert arr._npy_value is None and out._npy_value is None, "transfers must not copy through host memory"
    expect, back = edge_reference(x, dp_p, dp_c, mb)
    assert out.sharding == dst and returned.sharding == src
    np.testing.assert_array_equal(np.asarray(out), expect)
    for shard in out.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), expect[shard.index])
    np.testing.assert_array_equal(np.asarray(returned), back)  # each row times the consumer shards holding it


def test_edge_arrays_split_their_positions_and_every_device_receives_only_its_own_slice():
    """`edge_sharding`: an array of rows x positions x features has its positions over `context`,
    then `tensor`, as far as they divide. Along an edge between such layouts (producer data 2 x
    tensor 2, consumer context 2 x tensor 2) the delivered rows and the returned cotangent are
    exact, and each destination device assembles only its quarter of the rows: no tile is copied
    on to replicas."""
    from maestro_jax.runtime.transfer import deliver_rows, return_rows

    produce = section_mesh(SectionPlan((0, 1, 2, 3), mesh_shape(data=2, tensor=2), 1))
    consume = section_mesh(SectionPlan((4, 5, 6, 7), mesh_shape(context=2, tensor=2), 1))
    assert edge_sharding(consume, (4, 8, 3)).spec == P(BATCH_AXES, ("context", "tensor"))
    assert edge_sharding(consume, (4, 6, 3)).spec == P(BATCH_AXES, ("context",))  # 4 does not divide 6
    assert edge_sharding(consume, (4, 5, 3)) == edge_sharding(consume, (4, 8)) == row_sharding(consume)
    assert edge_sharding(produce, (4, 8, 3)).spec == P(BATCH_AXES, ("tensor",))  # context 1 is left out
    mb, shape = 2, (4, 8, 3)
    deliver, give_back = deliver_rows(2, 1, mb), return_rows(2, 1, mb)
    src, dst = edge_sharding(produce, shape), edge_sharding(consume, (deliver.out_rows, *shape[1:]))
    x, arr = source(src, shape)
    out = transfer(arr, dst, deliver)
    returned = transfer(out, src, give_back)
    expect, back = edge_reference(x, 2, 1, mb)
    assert arr._npy_value is None and out._npy_value is None, "transfers must not copy through host memory"
    assert out.sharding == dst and returned.sharding == src
    np.testing.assert_array_equal(np.asarray(out), expect)
    np.testing.assert_array_equal(np.asarray(returned), back)
    tiles = plan_transfer(src, dst, shape, deliver)
    assert all(not replicas for _, replicas in tiles.heads)
    for _, pieces in tiles.tiles:
        assert sum(np.prod([hi - lo for lo, hi in p.bounds]) for p in pieces) == np.prod(expect.shape) // 4
