"""One run at a time per `output_dir` (and per `checkpoint_dir`): an OS lock on `<dir>/run.lock`.

`fcntl.flock` is held for the whole run; the kernel drops it when the process ends in any way
(`kill -9` included), so a lock left by a dead run never blocks the next one. The file itself
stays; it records the holder (pid, host, start time) for the refusal message of a second run.

Only process 0 takes the lock, and every process learns the outcome from it (`agree`), so a
refused multi-process run stops on all processes before anything is written. Across hosts this
needs a shared filesystem whose `flock` is coherent between clients: NFSv4 on Linux maps it to
NFS byte-range locks (a crashed client's lock expires with its lease); Lustre needs the `flock`
mount option. Where the filesystem refuses locks (ENOLCK, EOPNOTSUPP, ENOSYS) the run goes on
without one and says so: two runs on such a directory are then not detected.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
import time
from pathlib import Path

import jax

from maestro_jax.config import ConfigError
from maestro_jax.runtime.distributed import Coordinator

LOCK_FILE = "run.lock"
log = logging.getLogger("maestro_jax")


class DirectoryInUseError(ConfigError):
    """Another live run holds the lock on this output_dir or checkpoint_dir (status 2 in the CLI)."""


def _holder(path: Path) -> str:
    try:
        info = json.loads(path.read_text())
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info["since"]))
        return f"pid {info['pid']} on host {info['host']}, since {since}"
    except (OSError, ValueError, KeyError, TypeError):
        return "holder not yet recorded"


def _open(d: Path):
    """The lock file, opened for writing if possible; read-only where the storage is (flock
    works on either). None, with a warning, where it cannot be opened at all: the storage fault
    (a read-only or full checkpoint filesystem) is reported by whatever writes there next."""
    try:
        d.mkdir(parents=True, exist_ok=True)
        return open(d / LOCK_FILE, "a+")
    except OSError:
        try:
            return open(d / LOCK_FILE)
        except OSError as err:
            log.warning("cannot lock %s (%s): a second run on it would not be detected", d, err)
            return None


@contextlib.contextmanager
def hold_directories(directories: dict[str, str | Path | None], coordinator: Coordinator | None = None):
    """Hold `run.lock` in each directory ({config key: directory}; None: skipped) on process 0 for
    the duration; refuse with a `DirectoryInUseError` naming the key, the directory and the holder
    when another live run holds one."""
    held, refusal = [], None
    dirs = {}
    for key, d in directories.items():
        if d is not None:
            dirs.setdefault(Path(d).absolute(), key)
    try:
        if jax.process_index() == 0:
            for d, key in dirs.items():
                f = _open(d)
                if f is None:
                    continue
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    f.close()
                    refusal = (
                        f"error: {key} {d} is in use by another run ({_holder(d / LOCK_FILE)}); "
                        f"wait for it to end, stop it, or use another {key}"
                    )
                    break
                except OSError as err:
                    f.close()
                    if err.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                        raise
                    log.warning("cannot lock %s (%s): a second run on it would not be detected", d, err)
                    continue
                held.append(f)
                try:  # the holder's record, for the message of a refused run; best effort (a full disk)
                    f.truncate(0)
                    f.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}))
                    f.flush()
                except (OSError, ValueError):
                    pass
        refusal = (coordinator or Coordinator()).agree("output-dir-lock", refusal)
        if refusal is not None:
            raise DirectoryInUseError(refusal)
        yield
    finally:
        for f in held:
            fcntl.flock(f, fcntl.LOCK_UN)
            f.close()
