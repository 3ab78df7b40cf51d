"""Multi-controller set-up and the few host-side exchanges a multi-process run needs.

Every process runs the same driver and the same deterministic schedule, and calls every
section program (a no-op on processes without devices in that section's mesh). Host-side
values a process may not hold (the loss lives on the sink's devices) are shared through the
coordination service's key-value store, never through a device collective: a gloo barrier
after cross-process transfers was seen to stall on jax 0.10 (docs/ARCHITECTURE.md, "Multi-process").
"""

from __future__ import annotations

import collections
import itertools
import json
import logging
import os
import threading
import time

import jax
import numpy as np

log = logging.getLogger("maestro_jax")
# Key sequence numbers, one counter per kind of exchange: each kind is called in the same order
# on every process, but kinds run on different threads (the prefetch thread shares each batch's
# bad samples while the loop fetches losses), so one shared counter would number them
# differently on different processes.
_sequences: collections.defaultdict = collections.defaultdict(itertools.count)
_sequences_lock = threading.Lock()


def _next_key(kind: str) -> str:
    with _sequences_lock:
        return f"maestro/{kind}/{next(_sequences[kind])}"
# The longest a process waits for a peer (a fetched value, a step barrier, an agreement); past
# it the wait fails naming the peer instead of hanging. Set from `distributed.timeout_s`.
PEER_TIMEOUT_S = 300.0


class PeerError(RuntimeError):
    """Another process did not answer within the bounded wait: it is dead or stuck."""


def set_peer_timeout(seconds: float) -> None:
    global PEER_TIMEOUT_S
    PEER_TIMEOUT_S = float(seconds)


def _client():
    return jax._src.distributed.global_state.client


_FAILED = "maestro/failed/"
_POLL_S = 1.0  # how often a waiting process looks for a peer's failure notice
_announced = False


def announce_failure(message: str) -> None:
    """Tell every peer that this process is stopping on an error, so that their waits for it
    end at once with its message instead of running into the timeout. Best effort: the
    coordination service may itself be gone."""
    global _announced
    if jax.process_count() == 1 or _announced:
        return
    _announced = True
    try:
        _client().key_value_set(f"{_FAILED}{jax.process_index()}", message.strip().splitlines()[-1][:500])
    except Exception:  # noqa: BLE001 - nothing more can be told
        log.debug("could not announce the failure", exc_info=True)


def _failed_peer() -> tuple[int, str] | None:
    try:
        entries = _client().key_value_dir_get(_FAILED)
    except Exception:  # noqa: BLE001 - the service is gone: the caller reports the wait itself
        return None
    notices = sorted((int(k.rsplit("/", 1)[1]), v) for k, v in entries)
    return notices[0] if notices else None


def _get(key: str, owner: int, what: str, timeout_s: float | None = None) -> str:
    """A bounded read of a key another process publishes. It ends early, naming the process
    and its error, when any peer announces a failure (`announce_failure`); a timeout names
    `owner`."""
    timeout_s = PEER_TIMEOUT_S if timeout_s is None else timeout_s
    deadline = time.monotonic() + timeout_s
    while True:
        wait_ms = max(1, int(min(_POLL_S, deadline - time.monotonic()) * 1000))
        try:
            return _client().blocking_key_value_get(key, wait_ms)
        except Exception as err:  # XlaRuntimeError: DEADLINE_EXCEEDED, or UNAVAILABLE if the service died
            failed = _failed_peer()
            if failed is not None:
                raise PeerError(f"process {failed[0]} stopped on an error ({failed[1]}); stopping this process "
                                f"({jax.process_index()}) too") from err
            if time.monotonic() < deadline and "DEADLINE_EXCEEDED" in str(err):
                continue
            raise PeerError(f"process {owner} did not {what} within {timeout_s:g}s (distributed.timeout_s): it is "
                            f"dead or stuck; stopping this process ({jax.process_index()}) too. "
                            f"[{type(err).__name__}: {str(err).splitlines()[0][:200]}]") from err


def agree(name: str, value):
    """Process 0's `value` (JSON-able) on every process; a no-op with one process."""
    if jax.process_count() == 1:
        return value
    key = _next_key(f"agree/{name}")
    if jax.process_index() == 0:
        _client().key_value_set(key, json.dumps(value))
        return value
    return json.loads(_get(key, 0, f"share {name!r}"))


def gather(name: str, value) -> list:
    """Every process's `value` (JSON-able), in process order, on every process: a bounded
    all-gather through the key-value store. `[value]` with one process."""
    if jax.process_count() == 1:
        return [value]
    me = jax.process_index()
    prefix = _next_key(f"gather/{name}")
    _client().key_value_set(f"{prefix}/{me}", json.dumps(value))
    return [value if q == me else json.loads(_get(f"{prefix}/{q}", q, f"share {name!r}"))
            for q in range(jax.process_count())]


def step_barrier(step: int) -> None:
    """Every process checks in before step `step`; a peer that does not within the timeout is
    named in the error. Bounds the wait on a stuck or dead peer at every step boundary (a peer
    lost mid-step is caught by the coordination service's heartbeat, `distributed.heartbeat_timeout_s`)."""
    if jax.process_count() == 1:
        return
    me = jax.process_index()
    _client().key_value_set(f"maestro/step/{step}/{me}", "1")
    for q in range(jax.process_count()):
        if q != me:
            _get(f"maestro/step/{step}/{q}", q, f"reach step {step}")


def maybe_initialize_distributed(coordinator: str | None = None, num_processes: int | None = None,
                                 process_id: int | None = None, transfer_port: int | None = None,
                                 timeout_s: int = 120, heartbeat_timeout_s: int = 100) -> None:
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
        jax.distributed.initialize(coordinator, num_processes, process_id, initialization_timeout=timeout_s,
                                   heartbeat_timeout_seconds=heartbeat_timeout_s)
    else:
        jax.distributed.initialize(initialization_timeout=timeout_s, heartbeat_timeout_seconds=heartbeat_timeout_s)
    log.info("process %d/%d, %d local / %d global devices", jax.process_index(), jax.process_count(),
             jax.local_device_count(), jax.device_count())


def _own_address() -> str:
    import socket

    return socket.gethostbyname(socket.gethostname())


def fetch(x: jax.Array) -> np.ndarray:
    """The value of a small (replicated) array on every process.

    Single process: a plain read. Multi-process: the lowest process holding a shard publishes
    it in the key-value store and the others read it; every process must call this in the same
    order (the driver is the same everywhere, so it does).
    """
    if jax.process_count() == 1 or x.is_fully_addressable and len(x.sharding.device_set) == jax.device_count():
        return np.asarray(x)
    key = _next_key("fetch")
    owner = min(d.process_index for d in x.sharding.device_set)
    if jax.process_index() == owner:
        value = np.asarray(x.addressable_shards[0].data)
        _client().key_value_set(key, f"{value.dtype.str};{value.tobytes().hex()}")
        return value
    dtype, data = _get(key, owner, "publish a step result").split(";")
    return np.frombuffer(bytes.fromhex(data), np.dtype(dtype)).reshape(np.shape(x))
