"""Storage faults of a run's directories (`output_dir`, `checkpoint_dir`), in one line each.

`check_directories` runs before anything compiles: each directory is created if missing and a
small file is written, fsynced and removed there. A path taken by a plain file is a config
error (status 2: name the key, the value and what is valid); a directory that refuses writes
(read-only, full, no permission, quota) is a `StorageError` (status 4), like a checkpoint save
that fails later. Writes during the run (`metrics.jsonl`, `config.yaml`) that fail raise a
`StorageError` naming the file and the reason, never an `OSError` traceback.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from maestro_jax.config import ConfigError
from maestro_jax.runtime.distributed import Coordinator

PROBE = ".maestro-write-test"


class StorageError(RuntimeError):
    """A directory or file of the run cannot be written (status 4 in the CLI); the message names
    the config key, the path and why."""


def describe(err: OSError) -> str:
    """`[Errno 28] No space left on device` for any OSError, without the path it repeats."""
    if err.errno is not None:
        return f"[Errno {err.errno}] {err.strerror or os.strerror(err.errno)}"
    return f"{type(err).__name__}: {err}"


def write_error(key: str, path: Path, err: OSError, doing: str = "writing") -> StorageError:
    return StorageError(
        f"{key}: {doing} {path} failed: {describe(err)}; free space or make the directory "
        f"writable (or set another {key})"
    )


def directory_problem(key: str, d: Path) -> tuple[str, str] | None:
    """None when `d` is (or can be made) a writable directory; else ("config" | "storage", message)."""
    blocker = next((p for p in (d, *d.parents) if p.exists() or p.is_symlink()), None)
    if blocker is not None and not blocker.is_dir():
        what = "is a file" if blocker == d else f"cannot be created: {blocker} is a file"
        return "config", (
            f"error: {key}={str(d)!r}: {what}, not a directory; valid: a directory (existing, or "
            f"one that can be created)"
        )
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        if err.errno in (errno.ENOTDIR, errno.EEXIST, errno.ENAMETOOLONG):
            return "config", f"error: {key}={str(d)!r}: cannot be a directory ({describe(err)})"
        return "storage", f"{key} {d} cannot be created: {describe(err)}"
    probe = d / f"{PROBE}-{os.getpid()}"
    try:
        try:
            with open(probe, "wb") as f:
                f.write(b"maestro_jax write test\n" * 8)
                f.flush()
                os.fsync(f.fileno())
        finally:
            if probe.exists():
                probe.unlink()
    except OSError as err:
        return "storage", (
            f"{key} {d} is not writable: {describe(err)}; nothing was trained; free space or "
            f"make it writable, or set another {key}"
        )
    return None


def check_directories(directories: dict[str, str | Path | None], coordinator: Coordinator | None = None) -> None:
    """Refuse, before anything compiles, a run whose directories ({config key: path}; None:
    skipped) cannot take its files. Process 0 checks (they are shared); every process agrees."""
    import jax

    problem = None
    if jax.process_index() == 0:
        for key, d in directories.items():
            if d is not None and (problem := directory_problem(key, Path(d).absolute())):
                break
    problem = (coordinator or Coordinator()).agree("storage-check", problem)
    if problem is not None:
        kind, msg = problem
        raise (ConfigError if kind == "config" else StorageError)(msg)
