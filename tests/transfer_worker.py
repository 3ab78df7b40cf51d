"""Worker for tests/test_multiprocess.py: one of N processes moving arrays between sections of
other device counts, checking every destination shard exactly and printing its bytes (JSON)."""

import json
import os
import sys

pid, n, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={8 // n}"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from maestro_jax.runtime.distributed import maybe_initialize_distributed  # noqa: E402

maybe_initialize_distributed(f"127.0.0.1:{port}", n, pid)
from maestro_jax.runtime.transfer import plan_transfer, process_bytes, transfer  # noqa: E402

devs = jax.devices()


def mesh(ids, shape):
    return Mesh(np.array([devs[i] for i in ids]).reshape(shape), ("data", "fsdp", "tensor"))


full = np.arange(24 * 10, dtype=np.float32).reshape(24, 10)
CASES = {
    "fan-out 2->6": (mesh([0, 1], (2, 1, 1)), mesh(range(2, 8), (2, 1, 3))),
    "fan-in 6->2": (mesh(range(2, 8), (2, 1, 3)), mesh([0, 1], (2, 1, 1))),
    "layout 4->4": (mesh([0, 1, 2, 3], (4, 1, 1)), mesh([4, 5, 6, 7], (2, 2, 1))),
    "mixed 2->4": (mesh([0, 5], (2, 1, 1)), mesh([1, 2, 6, 7], (4, 1, 1))),
    "joined and replicated 4->2x2": (mesh([0, 1, 2, 3], (4, 1, 1)), mesh([4, 5, 6, 7], (2, 1, 2))),
    "uneven 3->2": (mesh([0, 1, 2], (3, 1, 1)), mesh([5, 6], (2, 1, 1))),
}
report = {}
for name, (a, b) in CASES.items():
    src, dst = NamedSharding(a, P(("data", "fsdp"))), NamedSharding(b, P(("data", "fsdp")))
    x = jax.make_array_from_callback(full.shape, src, lambda idx: full[idx], dtype=np.float32)
    y = jax.block_until_ready(transfer(x, dst))
    exact = all(np.array_equal(np.asarray(s.data), full[s.index]) for s in y.addressable_shards)
    report[name] = {
        "exact": exact,
        "shards": len(y.addressable_shards),
        "bytes": process_bytes(plan_transfer(src, dst, full.shape), 4).get(pid, {"sent": 0, "received": 0}),
    }
print("REPORT " + json.dumps(report), flush=True)
