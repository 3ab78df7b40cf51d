"""`maestro-jax` with its checkpoint saves held back, for tests/test_faults.py: the faults it
tests (a kill between Orbax's files and its commit, a peer that joins a save late) need a
window wider than a tiny run leaves, and the production code has no hook for it.

    python tests/held_checkpoint_cli.py [--save-delay S] [--commit-delay S] train --config ...

--save-delay: each save waits S seconds before it enters Orbax (`CheckpointManager.save`, after
`Checkpointer.save` gathered the state: this process joins a save its peers are already in only
later); --commit-delay: each step's files are written, then
S seconds pass before the manifest and Orbax's commit (`Checkpointer._write_manifest`, Orbax's
finalisation callback)."""

import argparse
import functools
import sys
import time

import orbax.checkpoint as ocp

from maestro_jax import cli
from maestro_jax.training.checkpoint import Checkpointer


def held(method, delay_s: float):
    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        time.sleep(delay_s)
        return method(*args, **kwargs)

    return wrapper


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--save-delay", type=float, default=0.0)
    ap.add_argument("--commit-delay", type=float, default=0.0)
    args, rest = ap.parse_known_args()
    if args.save_delay:
        ocp.CheckpointManager.save = held(ocp.CheckpointManager.save, args.save_delay)
    if args.commit_delay:
        Checkpointer._write_manifest = held(Checkpointer._write_manifest, args.commit_delay)
    sys.argv = [sys.argv[0], *rest]
    cli.console_main()
