"""Worker for tests/test_faults.py: process 1 stops on an error and announces it; process 0,
waiting for a value process 1 never publishes, must end at once naming it (not at the timeout)."""

import os
import sys

pid, port = int(sys.argv[1]), int(sys.argv[2])
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's package

from maestro_jax.runtime import distributed  # noqa: E402

distributed.maybe_initialize_distributed(f"127.0.0.1:{port}", 2, pid)
coordinator = distributed.Coordinator(120)
coordinator.step_barrier(1)  # both are up
if pid == 1:
    distributed.announce_failure("DataError: sample 7: tokens out of range")
    sys.stdout.flush()
    os._exit(3)
try:
    coordinator.gather("a value process 1 never publishes", 0)
except distributed.PeerError as err:
    print(f"ERROR {err}", flush=True)
    os._exit(5)
os._exit(0)
