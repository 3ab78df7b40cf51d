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
import math
import os
import re
import socket
import sys
import threading
import time

import jax
import numpy as np

log = logging.getLogger("maestro_jax")


class PeerError(RuntimeError):
    """Another process did not answer within the bounded wait: it is dead or stuck."""


def _client():
    return jax._src.distributed.global_state.client


_FAILED = "maestro/failed/"
_POLL_S = 1.0  # how often a waiting process looks for a peer's failure notice


def announce_failure(message: str) -> None:
    """Tell every peer that this process is stopping on an error, so that their waits for it
    end at once with its message instead of running into the timeout. Best effort: the
    coordination service may itself be gone, and a second notice of the same process is refused
    by the store (its key exists), so only the first one counts."""
    if jax.process_count() == 1:
        return
    try:
        _client().key_value_set(f"{_FAILED}{jax.process_index()}", message.strip().splitlines()[-1][:500])
    except Exception:
        log.debug("could not announce the failure", exc_info=True)


def _failed_peer() -> tuple[int, str] | None:
    try:
        entries = _client().key_value_dir_get(_FAILED)
    except Exception:  # noqa: BLE001 - the service is gone: the caller reports the wait itself
        return None
    notices = sorted((int(k.rsplit("/", 1)[1]), v) for k, v in entries)
    return notices[0] if notices else None


def maybe_initialize_distributed(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    transfer_port: int | None = None,
    startup_timeout_s: float = 900.0,
    heartbeat_timeout_s: int = 100,
) -> None:
    """Explicit settings, else auto-detect (SLURM and other launchers jax knows), else one process.

    Processes of one job start minutes apart on a cluster (image pulls, node boot). With explicit
    settings every process first checks in with process 0 (`_rendezvous`), waiting up to
    `startup_timeout_s` and saying whom it waits for; a timeout is a `PeerError` naming the
    processes that did not come. Only then does jax connect, so its own start-up deadline (a
    fatal abort of the process, not an exception, in jax 0.10) is never the one that fires.
    Auto-detected launches go straight to jax, whose deadline is then `startup_timeout_s`.

    Cross-process `device_put` needs a fixed socket address per process (port 0 hangs in jax
    0.10); it defaults to the coordinator's port + 1 + process id.
    """
    if (
        coordinator is None
        and int(os.environ.get("SLURM_NTASKS", "1")) <= 1
        and "JAX_COORDINATOR_ADDRESS" not in os.environ
    ):
        return
    # jax's preemption service (`reached_preemption_sync_point`, unused here: the step check-in
    # carries the flags) installs a C SIGTERM handler that only logs `SIGTERM caught`. It takes
    # the signal over from a Python handler installed earlier, although `signal.getsignal` still
    # names that one, so a preemption notice caught from start-up on would be lost (jax 0.10).
    jax.config.update("jax_enable_preemption_service", False)
    if coordinator is not None:
        host, port = coordinator.rsplit(":", 1)
        _rendezvous(host, int(port), int(num_processes), int(process_id), startup_timeout_s)
        address = "127.0.0.1" if host in ("localhost", "127.0.0.1") else _own_address()
        base = transfer_port or int(port) + 1
        jax.config.update("jax_cross_host_transfer_socket_address", f"{address}:{base + int(process_id)}")
        jax.config.update("jax_cross_host_transport_addresses", ",".join([f"{address}:0"] * 4))
        jax.distributed.initialize(
            coordinator,
            num_processes,
            process_id,
            initialization_timeout=math.ceil(startup_timeout_s) + 60,  # every process has checked in already
            heartbeat_timeout_seconds=heartbeat_timeout_s,
        )
    else:
        jax.distributed.initialize(
            initialization_timeout=math.ceil(startup_timeout_s), heartbeat_timeout_seconds=heartbeat_timeout_s
        )
    log.info(
        "process %d/%d, %d local / %d global devices",
        jax.process_index(),
        jax.process_count(),
        jax.local_device_count(),
        jax.device_count(),
    )


_GRACE_S = 10.0  # how much longer than its bound a coordination-service call may take before it counts as lost
_SAY_AFTER_S = 10.0  # a start-up wait says what it waits for once it has lasted this long, then every minute


class _Waiting:
    """Says, on stdout, what a start-up wait is waiting for: first after `_SAY_AFTER_S`, then
    every minute, so that a process held by a late peer is never silent."""

    def __init__(self, limit_s: float, setting: str):
        self.limit_s, self.setting = limit_s, setting
        self.started = time.monotonic()
        self._next = self.started + _SAY_AFTER_S

    def __call__(self, what: str) -> None:
        now = time.monotonic()
        if now >= self._next:
            self._next = now + 60.0
            print(
                f"waiting for {what} ({now - self.started:.0f}s of at most {self.limit_s:g}s, {self.setting})",
                flush=True,
            )


def _rendezvous(host: str, port: int, n: int, pid: int, timeout_s: float) -> None:
    """Every process checks in with process 0 over a plain TCP connection to the coordinator's
    address, before jax's coordination service exists: process 0 listens there until all the
    others have come (or names the missing ones), then tells each to go on and frees the port for
    the service. The others retry the connection until process 0 is up. Each waits at most
    `timeout_s` (`distributed.startup_timeout_s`); the clients close first, so the port is never
    left in TIME_WAIT on process 0's side."""
    deadline, setting = time.monotonic() + timeout_s, "distributed.startup_timeout_s"
    waiting = _Waiting(timeout_s, setting)
    if pid == 0:
        arrived = {}
        with socket.create_server(("", port)) as server:
            server.settimeout(_POLL_S)
            while len(arrived) < n - 1:
                missing = [q for q in range(1, n) if q not in arrived]
                if time.monotonic() > deadline:
                    for conn in arrived.values():
                        conn.close()
                    raise PeerError(
                        f"{_processes(missing)} did not start within {timeout_s:g}s ({setting}); "
                        f"started: {_processes([0, *sorted(arrived)])}"
                    )
                waiting(f"{_processes(missing)} to start")
                try:
                    conn, _ = server.accept()
                except TimeoutError:
                    continue
                conn.settimeout(30)
                try:
                    words = conn.recv(64).decode(errors="replace").split()
                    if words[0] != "maestro" or int(words[2]) != n or not 0 < int(words[1]) < n:
                        raise ValueError(words)
                except (OSError, ValueError, IndexError):  # not one of this job's processes
                    conn.close()
                    continue
                arrived[int(words[1])] = conn
            for conn in arrived.values():
                conn.sendall(b"go")
            for conn in arrived.values():
                with conn:
                    conn.recv(1)  # b"": the client closed its end
        return
    while True:
        try:
            conn = socket.create_connection((host, port), timeout=_POLL_S)
        except OSError:
            if time.monotonic() > deadline:
                raise PeerError(
                    f"process 0 (the coordinator, {host}:{port}) did not start within {timeout_s:g}s ({setting})"
                ) from None
            waiting(f"process 0 (the coordinator, {host}:{port}) to start")
            time.sleep(_POLL_S)
            continue
        with conn:
            conn.sendall(f"maestro {pid} {n}".encode())
            conn.settimeout(max(1.0, deadline - time.monotonic()) + 30)
            try:
                reply = conn.recv(16)
            except TimeoutError:
                reply = b""
        if reply == b"go":
            return
        raise PeerError(
            f"process 0 stopped waiting before every process had started (its {setting} ran out, or it failed)"
        )


def _own_address() -> str:
    return socket.gethostbyname(socket.gethostname())


# Errors that only a lost peer causes: a device collective failing (its connection closed), or the
# coordination service (run by process 0) gone. Not "Connection reset" or UNAVAILABLE alone:
# cloud storage reports those too, and a storage fault must stay one.
_LOST = ("Gloo", "coordination service")


def _processes(who: list[int]) -> str:
    if not who:
        return "a peer process"
    return f"process {who[0]}" if len(who) == 1 else f"processes {', '.join(map(str, who))}"


class Coordinator:
    """A run's host-side exchanges between its processes, through jax's coordination service:
    agreeing on a value, gathering one from every process, fetching a device result held by
    another process, the step check-in, bounded Orbax barriers, and naming the peer behind a fault.

    Every wait on a peer is bounded by `timeout_s` (`distributed.timeout_s`) and ends naming it
    (`PeerError`). Each kind of exchange is numbered in call order, which is the same on every
    process (one driver), but kinds run on different threads (the prefetch thread gathers each
    batch's bad samples while the loop fetches losses), so each kind has its own counter. Keys live
    under a namespace per coordinator: the i-th coordinator a process makes gets the i-th number
    from a counter the coordination service keeps per process, so processes that make their
    coordinators in the same order (they run the same driver) share namespaces, and two runs in one
    job never read each other's keys. With one process every exchange is local.

    Until the first step's check-in, waits are bounded by `startup_timeout_s` instead
    (`distributed.startup_timeout_s`): processes reach the start-up exchanges (directory checks,
    the checkpoint directory, restoring) and the end of compiling minutes apart on a cluster,
    and such a wait says what it waits for."""

    def __init__(self, timeout_s: float = 300.0, startup_timeout_s: float | None = None):
        self.timeout_s = float(timeout_s)
        self.startup_timeout_s = float(startup_timeout_s or timeout_s)
        self._started = False  # past the first step's check-in: waits are bounded by timeout_s
        self._orbax_barriers = False  # checkpoint_barrier set Orbax's default barrier timeout
        self._calls: dict[int, tuple[float, str]] = {}  # thread -> (deadline, method) of its service call
        self._watcher: threading.Thread | None = None
        self._sequences: collections.defaultdict = collections.defaultdict(itertools.count)
        self._lock = threading.Lock()
        self._checked_in: dict[int, list[int]] = {}  # the last step barrier's outcome: a second call is free
        self._namespace = "maestro/0"
        if jax.process_count() > 1:
            number = _client().key_value_increment(f"maestro/coordinators/{jax.process_index()}", 1)
            self._namespace = f"maestro/{number}"

    @property
    def wait_s(self) -> float:
        """The bound of a wait on a peer now: the start-up one until the first step's check-in."""
        return self.timeout_s if self._started else self.startup_timeout_s

    @property
    def _setting(self) -> str:
        return "distributed.timeout_s" if self._started else "distributed.startup_timeout_s"

    def _start_steps(self) -> None:
        """Every process has checked in for its first step: from now on waits are bounded by
        `timeout_s`, Orbax's own barriers included."""
        self._started = True
        if self._orbax_barriers:
            from orbax.checkpoint._src.multihost import multihost

            multihost._DEFAULT_BARRIER_TIMEOUT = max(1, math.ceil(self.wait_s))

    def _service(self, method: str, *args):
        """`method` of the coordination service's client, watched (`_watched`)."""
        return self._watched(method, lambda: getattr(_client(), method)(*args))

    def _watched(self, what: str, call):
        """`call()`, a call into the coordination service, watched: a call that has not returned
        within the current bound plus `_GRACE_S` means the service does not answer. It lives in
        process 0, so a stopped (SIGSTOP) or hung process 0 holds every call of the others
        forever (the calls' own deadlines do not fire, and jax's heartbeat aborts with status 134
        minutes later, naming no one); the watchdog (`_watchdog`) then ends this process with
        one line naming process 0, status 5."""
        me = threading.get_ident()
        with self._lock:
            self._calls[me] = (time.monotonic() + self.wait_s + _GRACE_S, what)
            if self._watcher is None:
                self._watcher = threading.Thread(
                    target=self._watchdog, name="maestro-coordinator-watchdog", daemon=True
                )
                self._watcher.start()
        try:
            return call()
        finally:
            with self._lock:
                self._calls.pop(me, None)

    def _watchdog(self) -> None:
        while True:
            time.sleep(_POLL_S)
            with self._lock:
                late = [method for deadline, method in self._calls.values() if time.monotonic() > deadline]
            if late:
                print(
                    f"error: process 0 (it runs the coordination service) did not answer a {late[0]} call within "
                    f"{self.wait_s + _GRACE_S:g}s ({self._setting} + {_GRACE_S:g}s): it is stopped or hung; "
                    f"stopping this process ({jax.process_index()}) too",
                    file=sys.stderr,
                    flush=True,
                )
                sys.stdout.flush()
                os._exit(5)

    def _next_key(self, kind: str) -> str:
        with self._lock:
            return f"{self._namespace}/{kind}/{next(self._sequences[kind])}"

    def agree(self, name: str, value):
        """Process 0's `value` (JSON-able) on every process; a no-op with one process."""
        if jax.process_count() == 1:
            return value
        key = self._next_key(f"agree/{name}")
        if jax.process_index() == 0:
            self._service("key_value_set", key, json.dumps(value))
            return value
        return json.loads(self._get(key, 0, f"share {name!r}"))

    def gather(self, name: str, value) -> list:
        """Every process's `value` (JSON-able), in process order, on every process: a bounded
        all-gather through the key-value store. `[value]` with one process."""
        if jax.process_count() == 1:
            return [value]
        me = jax.process_index()
        prefix = self._next_key(f"gather/{name}")
        self._service("key_value_set", f"{prefix}/{me}", json.dumps(value))
        return [
            value if q == me else json.loads(self._get(f"{prefix}/{q}", q, f"share {name!r}"))
            for q in range(jax.process_count())
        ]

    def fetch(self, x: jax.Array) -> np.ndarray:
        """The value of a small (replicated) array on every process.

        Single process: a plain read. Multi-process: the lowest process holding a shard publishes
        it in the key-value store and the others read it; every process must call this in the same
        order (the driver is the same everywhere, so it does).
        """
        if self._held_whole(x):
            return np.asarray(x)
        key = self._next_key("fetch")
        owner = min(d.process_index for d in x.sharding.device_set)
        if jax.process_index() == owner:
            value = np.asarray(x.addressable_shards[0].data)
            self._service("key_value_set", key, f"{value.dtype.str};{value.tobytes().hex()}")
            return value
        dtype, data = self._get(key, owner, "publish a step result").split(";")
        return np.frombuffer(bytes.fromhex(data), np.dtype(dtype)).reshape(np.shape(x))

    def fetch_all(self, tree):
        """`fetch` of every array in `tree`, as one read: those this process holds whole in one
        `jax.device_get` (one device-to-host transfer for the lot), each other one from the
        process that publishes it (`fetch`, in the tree's order, the same on every process)."""
        leaves, treedef = jax.tree.flatten(tree)
        here = [i for i, x in enumerate(leaves) if not isinstance(x, jax.Array) or self._held_whole(x)]
        got = dict(zip(here, jax.device_get([leaves[i] for i in here])))
        return jax.tree.unflatten(treedef, [got[i] if i in got else self.fetch(x) for i, x in enumerate(leaves)])

    @staticmethod
    def _held_whole(x: jax.Array) -> bool:
        """Whether this process reads `x` without another's help (`fetch`'s plain read)."""
        return jax.process_count() == 1 or (x.is_fully_addressable and len(x.sharding.device_set) == jax.device_count())

    def step_barrier(self, step: int, preempted: bool = False) -> list[int]:
        """Every process checks in before step `step`; a peer that does not within the timeout is
        named in the error. Bounds the wait on a stuck or dead peer at every step boundary (a peer
        lost mid-step is caught by the coordination service's heartbeat, `distributed.heartbeat_timeout_s`).

        Each process brings its preemption flag (a SIGTERM it received); returns the processes that
        raised it, the same list on every process, so that a notice on any one host stops all of
        them after the same step. Only the first call for a step exchanges anything (the training
        loop checks in at the end of a step and again at the top of the next)."""
        if jax.process_count() == 1:
            return [0] if preempted else []
        if step in self._checked_in:
            return self._checked_in[step]
        me = jax.process_index()
        self._service("key_value_set", f"{self._namespace}/step/{step}/{me}", "preempted" if preempted else "1")
        flags = {
            q: preempted
            if q == me
            else self._get(f"{self._namespace}/step/{step}/{q}", q, f"reach step {step}") == "preempted"
            for q in range(jax.process_count())
        }
        self._checked_in.clear()
        self._checked_in[step] = [q for q, flag in flags.items() if flag]
        if not self._started:
            self._start_steps()
        return self._checked_in[step]

    def _watch_orbax_barriers(self, multihost) -> None:
        """Every barrier Orbax waits at outside the commit (`sync_global_processes`: the save's
        directory and finalisation barriers, the restore's) through this coordinator's watchdog:
        their deadlines do not fire while process 0, which runs the coordination service, is
        stopped, so without the watchdog a peer of a stopped process 0 hung in a save until jax's
        heartbeat aborted it naming no one. Orbax builds them with `get_barrier_sync_fn`, looked
        up at each call; it is replaced once per process by one that asks the latest coordinator."""
        own = getattr(multihost.get_barrier_sync_fn, "_maestro_original", None)
        original = own or multihost.get_barrier_sync_fn

        def watched_barrier_fn(*, processes=None):
            wait = original(processes=processes)

            def barrier(*, key: str, timeout_ms: int) -> None:
                self._watched("wait_at_barrier", lambda: wait(key=key, timeout_ms=timeout_ms))

            return barrier

        watched_barrier_fn._maestro_original = original
        multihost.get_barrier_sync_fn = watched_barrier_fn

    def checkpoint_barrier(self):
        """The barrier function for Orbax's `AsyncOptions(barrier_sync_fn=...)` that bounds every
        wait of a save on another process by `self.wait_s`; None with one process.

        By default Orbax synchronises processes with a device collective (`sync_global_devices`,
        a gloo all-gather on CPU): unbounded, so a SIGSTOPped peer held a save until the heartbeat
        gave up, and a killed one surfaced as `Gloo AllGather failed`, indistinguishable from a
        storage fault. Its coordination-service barriers instead time out and name the processes
        that did not arrive (`peer_fault` reads that). Process-wide settings of Orbax 0.12, made
        here: the flag `experimental_orbax_use_distributed_barrier` and its barrier timeout. The
        returned function serves the background commit, whose overall budget (writing included)
        stays Orbax's 20 minutes while each wait on a peer inside it is capped at `self.wait_s` (the
        start-up bound while the checkpoint directory is opened, `timeout_s` once steps run)."""
        if jax.process_count() == 1:
            return None
        from absl import flags as absl_flags
        from orbax.checkpoint._src.multihost import multihost

        flag = absl_flags.FLAGS["experimental_orbax_use_distributed_barrier"]
        flag.value, flag.present = True, 1  # readable without absl parsing the command line
        multihost._DEFAULT_BARRIER_TIMEOUT = max(1, math.ceil(self.wait_s))
        self._orbax_barriers = True
        self._watch_orbax_barriers(multihost)

        def barrier(*, key: str, timeout_ms: int) -> None:
            self._service("wait_at_barrier", key, max(1, min(int(timeout_ms), math.ceil(self.wait_s * 1000))))

        return barrier

    def peer_fault(self, err: BaseException, what: str) -> PeerError | None:
        """The `PeerError` behind `err`, raised by work that involves every process (`what`, e.g.
        "the checkpoint save of step 4"), or None when no peer is at fault (a storage fault stays
        one). A peer that announced an error is named with it; a coordination-service barrier that
        timed out names the processes that did not arrive; a closed connection (a collective
        failing because its peer died) names the processes that do not answer a bounded probe
        (`_silent_peers`)."""
        if jax.process_count() == 1:
            return None
        me = jax.process_index()
        failed = _failed_peer()
        if failed is not None and failed[0] != me:
            return PeerError(
                f"process {failed[0]} stopped on an error ({failed[1]}) during {what}; stopping this process ({me}) too"
            )
        chain, e = [], err
        while e is not None and len(chain) < 8:
            chain.append(f"{type(e).__name__}: {e}")
            e = e.__cause__ or e.__context__
        text = " | ".join(chain).replace("\n", " ")
        cause = next((c for c in reversed(chain) if any(m in c for m in ("Barrier timed out", *_LOST))), chain[0])
        detail = f"[{cause.splitlines()[0].split('. This usually')[0][:200]}]"
        if "Barrier timed out" in text:
            # "Some timed out task names: 1" (or ".../task:1"): the processes that did not arrive
            stuck = re.search(r"timed out task names?:(.*?)(?:RPC:|\[|$)", text)
            names = stuck.group(1) if stuck else ""
            found = re.findall(r"task:(\d+)", names) if "task:" in names else re.findall(r"\b(\d+)\b", names)
            who = sorted({int(t) for t in found} - {me})
            return PeerError(
                f"{_processes(who)} did not reach {what} within {self.wait_s:g}s ({self._setting}): "
                f"dead or stuck; stopping this process ({me}) too. {detail}"
            )
        if any(mark in text for mark in _LOST):
            who = self._silent_peers(what)
            return PeerError(
                f"{_processes(who)} was lost during {what}: a connection to it closed"
                f"{' and it did not answer' if who else ''}; stopping this process ({me}) too. {detail}"
            )
        return None

    def _silent_peers(self, what: str) -> list[int]:
        """The peers that do not answer within `self.wait_s`: every process that meets the same
        fault in `what` posts here, so those that stay silent are the lost ones. Without the
        coordination service (it ran in a lost process 0) that is process 0."""
        me, tag = jax.process_index(), re.sub(r"\W+", "-", what)
        try:
            _client().key_value_set(f"{self._namespace}/alive/{tag}/{me}", "1")
        except Exception:  # noqa: BLE001 - the service is gone with the process that ran it
            return [0] if me != 0 else []
        deadline, silent = time.monotonic() + self.wait_s, []
        for q in range(jax.process_count()):
            if q != me:
                try:
                    _client().blocking_key_value_get(
                        f"{self._namespace}/alive/{tag}/{q}", max(1, int((deadline - time.monotonic()) * 1000))
                    )
                except Exception:  # noqa: BLE001 - DEADLINE_EXCEEDED: silent; UNAVAILABLE: the service is gone
                    silent.append(q)
        return silent

    def _get(self, key: str, owner: int, what: str) -> str:
        """A bounded read of a key another process publishes. It ends early, naming the process
        and its error, when any peer announces a failure (`announce_failure`); a timeout names
        `owner`. A start-up wait says what it waits for."""
        timeout_s, setting = self.wait_s, self._setting
        waiting = None if self._started else _Waiting(timeout_s, setting)
        deadline = time.monotonic() + timeout_s
        while True:
            wait_ms = max(1, int(min(_POLL_S, deadline - time.monotonic()) * 1000))
            try:
                return self._service("blocking_key_value_get", key, wait_ms)
            except Exception as err:  # XlaRuntimeError: DEADLINE_EXCEEDED, or UNAVAILABLE if the service died
                failed = self._watched("key_value_dir_get", _failed_peer)
                if failed is not None:
                    raise PeerError(
                        f"process {failed[0]} stopped on an error ({failed[1]}); stopping this process "
                        f"({jax.process_index()}) too"
                    ) from err
                if time.monotonic() < deadline and "DEADLINE_EXCEEDED" in str(err):
                    if waiting:
                        waiting(f"process {owner} to {what}")
                    continue
                raise PeerError(
                    f"process {owner} did not {what} within {timeout_s:g}s ({setting}): it is "
                    f"dead or stuck; stopping this process ({jax.process_index()}) too. "
                    f"[{type(err).__name__}: {str(err).splitlines()[0][:200]}]"
                ) from err
                if time.monotonic() < deadline and "DEADLINE_EXCEEDED" in str(err):
                    continue
                raise PeerError(
                    f"process {owner} did not {what} within {timeout_s:g}s (distributed.timeout_s): it is "
                    f"dead or stuck; stopping this process ({jax.process_index()}) too. "
                    f"[{type(err).__name__}: {str(err).splitlines()[0][:200]}]"
                ) from err
