"""Worker for tests/test_faults.py: a Python SIGTERM handler installed before
`jax.distributed.initialize` (as a CLI that catches preemption from start-up does) must still
run after it; jax's preemption notifier takes the signal over at the C level otherwise."""

import os
import signal
import sys
import time

pid, port = int(sys.argv[1]), int(sys.argv[2])
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's package
got = []
signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))

from maestro_jax.runtime import distributed  # noqa: E402

distributed.maybe_initialize_distributed(f"127.0.0.1:{port}", 2, pid)
distributed.Coordinator(60).step_barrier(1)  # both are up
os.kill(os.getpid(), signal.SIGTERM)
deadline = time.monotonic() + 5
while not got and time.monotonic() < deadline:
    time.sleep(0.05)
print(f"HANDLED {bool(got)}", flush=True)
# process 0 hosts the coordination service: it leaves last, or its peer's error poll aborts (-6)
client = distributed._client()
if pid == 1:
    client.key_value_set("signal_worker/leaving/1", "1")
else:
    client.blocking_key_value_get("signal_worker/leaving/1", 60_000)
    time.sleep(1)
os._exit(0)
