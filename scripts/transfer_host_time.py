"""Host time of one `transfer()` at 64 devices, the current executor against the one before
issue 14 (tests/transfer_reference.py), interleaved call by call in one process.

Cases, row-sharded activations as the executor moves them (448 x 1024 float32, 1.8 MiB):
fan-out 8 -> 56 devices (data 8 -> data 56), layout change 32 -> 32 devices (data 32 ->
data 8 x tensor 4) and fan-in 56 -> 8. Per call: `host_ms`, the time until `transfer()`
returns (what the executor's dispatch thread pays), and `done_ms`, until the result is ready on
every device. Medians over `--repeats` calls after a warm-up that compiles; every result is
checked bitwise against the source.

    PYTHONPATH=. python scripts/transfer_host_time.py --json /tmp/transfer_host_time.json
"""

from __future__ import annotations

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=64").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # transfer_reference: the executor before issue 14

import transfer_reference

from maestro_jax.core.plan import SectionPlan, mesh_shape
from maestro_jax.runtime.sharding import row_sharding, section_mesh
from maestro_jax.runtime.transfer import transfer

SHAPE = (448, 1024)
CASES = {  # name: (source devices, source mesh sizes, destination devices, destination mesh sizes)
    "fan-out 8 -> 56": (range(8), {"data": 8}, range(8, 64), {"data": 56}),
    "layout 32 -> 32": (range(32), {"data": 32}, range(32, 64), {"data": 8, "tensor": 4}),
    "fan-in 56 -> 8": (range(8, 64), {"data": 56}, range(8), {"data": 8}),
}
IMPLEMENTATIONS = {"before": transfer_reference.transfer, "after": transfer}


def rows(devices, sizes):
    return row_sharding(section_mesh(SectionPlan(tuple(devices), mesh_shape(**sizes), 1)))


def timed(fn, x, dst) -> tuple[float, float, jax.Array]:
    start = time.perf_counter()
    out = fn(x, dst)
    returned = time.perf_counter()
    out.block_until_ready()
    return returned - start, time.perf_counter() - start, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=40)
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args()
    assert jax.device_count() >= 64, f"needs 64 devices, got {jax.device_count()}"
    full = np.arange(np.prod(SHAPE), dtype=np.float32).reshape(SHAPE)
    results = {}
    for name, (sd, ss, dd, ds) in CASES.items():
        src, dst = rows(sd, ss), rows(dd, ds)
        x = jax.device_put(full, src)
        times = {impl: {"host": [], "done": []} for impl in IMPLEMENTATIONS}
        for impl, fn in IMPLEMENTATIONS.items():  # warm-up: compiles, and checks the result
            out = fn(x, dst)
            assert out.sharding == dst and all(
                np.array_equal(np.asarray(s.data), full[s.index]) for s in out.addressable_shards
            ), (name, impl)
        for _ in range(args.repeats):
            for impl, fn in IMPLEMENTATIONS.items():
                host, done, _ = timed(fn, x, dst)
                times[impl]["host"].append(host)
                times[impl]["done"].append(done)
        med = {
            impl: {f"{k}_ms": round(1e3 * statistics.median(v), 3) for k, v in t.items()} for impl, t in times.items()
        }
        med["host_ratio"] = round(med["before"]["host_ms"] / med["after"]["host_ms"], 2)
        med["done_ratio"] = round(med["before"]["done_ms"] / med["after"]["done_ms"], 2)
        results[name] = med
        print(
            f"{name:18s} host {med['before']['host_ms']:7.2f} -> {med['after']['host_ms']:6.2f} ms "
            f"({med['host_ratio']}x)   done {med['before']['done_ms']:7.2f} -> {med['after']['done_ms']:6.2f} ms "
            f"({med['done_ratio']}x)",
            flush=True,
        )
    report = {
        "devices": jax.device_count(),
        "backend": jax.default_backend(),
        "shape": list(SHAPE),
        "dtype": "float32",
        "repeats": args.repeats,
        "cases": results,
    }
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
