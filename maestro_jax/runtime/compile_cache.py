"""JAX's persistent compilation cache: executables kept on disk, so that a second run of the same
programs (a restart, a resume, the next job on the machine) loads them instead of compiling.

`enable(directory)` turns it on for this process (before or after the first compile; a cache
already open in another directory is closed first); `using(directory)` turns it on for a block
and restores the settings it found (a training run in a process that goes on, such as a test
session or a notebook), yielding a `Cache`. By default every program is written,
whatever its compile time and size: jax's defaults skip programs that compile in under a second,
which is most programs of a small model on CPU.

A damaged entry must never crash a run (XLA deserialises an entry garbled inside a valid
compressed stream into a segmentation fault). So every entry carries a SHA-256 beside it
(`<entry>.sha256`, written by `record` once the run's compiles are done: after compiling ahead,
and when the cache is closed), and `enable` first moves aside, into `moved_aside/`, every entry
whose checksum is missing or differs (a disk or copy fault, an entry a killed run left half
written or never recorded), with one warning line: those programs compile again. Do not share
the directory with users you do not trust all the same (jax's warning,
`jax.experimental.compilation_cache`): a checksum shows damage, not intent.

Runs may share one directory at the same time (a user-level cache): each run holds a shared lock
on `<directory>/.writers` (`fcntl.flock`, released by the kernel when a process dies) while it
may write entries. An entry without a checksum is moved aside only when no other run holds that
lock (then no one is still writing or about to record it: a killed run left it), and `record`
writes checksums only then too, so no run checksums an entry another is still writing; the last
run to close records them all. An entry whose checksum differs is moved aside whatever runs.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import jax

log = logging.getLogger("maestro_jax")
SUM = ".sha256"  # beside each entry: its SHA-256, hex
ASIDE = "moved_aside"  # where entries without a matching checksum go
WRITERS = ".writers"  # every run that may write entries holds a shared lock on it


class Cache:
    """An open cache directory this process may write entries to, with its shared lock on
    `WRITERS` held until `close` (module docstring)."""

    def __init__(self, path: Path):
        self.path = path
        self._fd = os.open(path / WRITERS, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(self._fd, fcntl.LOCK_SH)

    def alone(self) -> bool:
        """Whether no other run holds the directory (this one's lock made exclusive, then shared
        again)."""
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(self._fd, fcntl.LOCK_SH)
        return True

    def record(self) -> None:
        """`record` this directory's entries, when no other run is writing to it."""
        if self.alone():
            record(self.path)

    def close(self) -> None:
        self.record()
        os.close(self._fd)


def _others_live(path: Path) -> bool:
    """Whether another run holds `path`'s writer lock (this process holds none there yet)."""
    fd = os.open(path / WRITERS, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # and with it the lock, if taken
    return False


def enable(
    directory: str | Path,
    *,
    min_compile_time_s: float = 0.0,
    min_entry_size_bytes: int = -1,
    max_size_bytes: int = -1,
) -> Path:
    """Cache compiled executables in `directory` (created if missing); returns its path.

    `min_compile_time_s`: programs that compile faster are not written
    (`jax_persistent_cache_min_compile_time_secs`; jax's default is 1 s). `min_entry_size_bytes`:
    smaller executables are not written (`jax_persistent_cache_min_entry_size_bytes`; -1: no
    limit, and no platform override of it). `max_size_bytes`: past it, jax removes the least
    recently used entries as it writes new ones (`jax_compilation_cache_max_size`; -1: no cap)."""
    from jax.experimental.compilation_cache import compilation_cache as cc

    path = Path(directory).expanduser().resolve()
    path.mkdir(parents=True, exist_ok=True)
    move_aside_unchecked(path, unrecorded=not _others_live(path))
    if jax.config.jax_compilation_cache_dir not in (None, str(path)):
        cc.reset_cache()  # the cache opens its directory once: close the other one
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_time_s))
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", int(min_entry_size_bytes))
    jax.config.update("jax_compilation_cache_max_size", int(max_size_bytes))
    return path


_SETTINGS = (
    "jax_enable_compilation_cache",
    "jax_compilation_cache_dir",
    "jax_persistent_cache_min_compile_time_secs",
    "jax_persistent_cache_min_entry_size_bytes",
    "jax_compilation_cache_max_size",
)


@contextlib.contextmanager
def using(directory: str | Path | None, max_size_bytes: int = -1) -> Iterator[Cache | None]:
    """`enable(directory, max_size_bytes=...)` inside the block (nothing with None), holding the
    directory's writer lock (a `Cache`); jax's earlier settings after it, the entries recorded if
    no other run is writing."""
    if directory is None:
        yield None
        return
    from jax.experimental.compilation_cache import compilation_cache as cc

    before = {name: getattr(jax.config, name) for name in _SETTINGS}
    cache = Cache(enable(directory, max_size_bytes=max_size_bytes))
    try:
        yield cache
    finally:
        cache.close()
        cc.reset_cache()
        for name, value in before.items():
            jax.config.update(name, value)


def directory() -> Path | None:
    """The persistent cache's directory, or None when it is off."""
    d = jax.config.jax_compilation_cache_dir
    return Path(d) if d and jax.config.jax_enable_compilation_cache else None


def _entries(path: Path) -> list[Path]:
    return sorted(p for p in path.glob("*-cache") if p.is_file())


def _digest(entry: Path) -> str:
    with open(entry, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def move_aside_unchecked(path: Path, unrecorded: bool = True) -> list[str]:
    """Move every entry of the cache in `path` whose checksum differs, and with `unrecorded` every
    one that has none (only when no other run is writing: module docstring), into
    `path/moved_aside/` (one warning line); returns their names."""
    moved = []
    for entry in _entries(path):
        side = entry.with_name(entry.name + SUM)
        try:
            good = side.read_text().strip() == _digest(entry)
        except FileNotFoundError:
            good = not unrecorded
        except OSError:
            good = False
        if not good:
            (path / ASIDE).mkdir(exist_ok=True)
            os.replace(entry, path / ASIDE / entry.name)
            side.unlink(missing_ok=True)
            moved.append(entry.name)
    if moved:
        log.warning(
            "compile cache %s: %d entr%s without a matching checksum moved aside to %s (compiled again when needed)",
            path,
            len(moved),
            "y" if len(moved) == 1 else "ies",
            path / ASIDE,
        )
    return moved


def record(path: Path) -> None:
    """Write the checksum of every entry in `path` that has none yet, and remove the checksums of
    entries jax has removed (past the size cap). Call it when no compile is in flight anywhere
    (jax writes an entry in place): `Cache.record` checks that no other run holds the directory."""
    for side in path.glob(f"*-cache{SUM}"):
        if not side.with_name(side.name.removesuffix(SUM)).exists():
            side.unlink(missing_ok=True)
    for entry in _entries(path):
        side = entry.with_name(entry.name + SUM)
        if side.exists():
            continue
        tmp = side.with_name(f"{side.name}.{os.getpid()}.tmp")
        tmp.write_text(_digest(entry))
        os.replace(tmp, side)
