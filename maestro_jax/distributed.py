"""Multi-controller set-up and the few host-side exchanges a multi-process run needs.

Every process runs the same driver and the same deterministic schedule, and calls every
section program (a no-op on processes without devices in that section's mesh). Host-side
values a process may not hold (the loss lives on the sink's devices) are shared through the
coordination service's key-value store, never through a device collective: a gloo barrier
after cross-process transfers can stall (notes/jax-0.10-probe.md, 3b).
"""

from __future__ import annotations

import itertools
import logging
import os

import jax
import numpy as np

log = logging.getLogger("maestro_jax")
_keys = itertools.count()


def maybe_initialize_distributed(coordinator: str | None = None, num_processes: int | None = None,
                                 process_id: int | None = None, transfer_port: int | None = None,
                                 timeout_s: int = 120) -> None:
    """Explicit settings, else auto-detect (SLURM and other launchers jax knows), else one process.

    Cross-process `device_put` needs a fixed socket address per process (port 0 hangs in jax
    0.10); it defaults to the coordinator's port + 1 + process id.
    """
    if coordinator is None and int(os.environ.get("SLURM_NTASKS", "1")) <= 1 and "JAX_COORDINATOR_ADDRESS" not in os.environ:
        return
    if coordinator is not None:
        host, port = coordinator.rsplit(":", 1)
        address = "127.0.0.1" if host in ("localhost", "127.0.0.1") else _own_address()
        base = transfer_port or int(port) + 1
        jax.config.update("jax_cross_host_transfer_socket_address", f"{address}:{base + int(process_id)}")
        jax.config.update("jax_cross_host_transport_addresses", ",".join([f"{address}:0"] * 4))
        jax.distributed.initialize(coordinator, num_processes, process_id, initialization_timeout=timeout_s)
    else:
        jax.distributed.initialize(initialization_timeout=timeout_s)
    log.info("process %d/%d, %d local / %d global devices", jax.process_index(), jax.process_count(),
             jax.local_device_count(), jax.device_count())


def _own_address() -> str:
    import socket  # noqa: PLC0415

    return socket.gethostbyname(socket.gethostname())


def fetch(x: jax.Array, timeout_ms: int = 600_000) -> np.ndarray:
    """The value of a small (replicated) array on every process.

    Single process: a plain read. Multi-process: the lowest process holding a shard publishes
    it in the key-value store and the others read it; every process must call this in the same
    order (the driver is the same everywhere, so it does).
    """
    if jax.process_count() == 1 or x.is_fully_addressable and len(x.sharding.device_set) == jax.device_count():
        return np.asarray(x)
    key = f"maestro/fetch/{next(_keys)}"
    client = jax._src.distributed.global_state.client
    owner = min(d.process_index for d in x.sharding.device_set)
    if jax.process_index() == owner:
        value = np.asarray(x.addressable_shards[0].data)
        client.key_value_set(key, f"{value.dtype.str};{value.tobytes().hex()}")
        return value
    dtype, data = client.blocking_key_value_get(key, timeout_ms).split(";")
    return np.frombuffer(bytes.fromhex(data), np.dtype(dtype)).reshape(np.shape(x))
