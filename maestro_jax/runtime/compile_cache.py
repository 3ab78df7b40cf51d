"""JAX's persistent compilation cache: executables kept on disk, so that a second run of the same
programs (a restart, a resume, the next job on the machine) loads them instead of compiling.

`enable(directory)` turns it on for this process (before or after the first compile; a cache
already open in another directory is closed first); `using(directory)` turns it on for a block
and restores the settings it found (a training run in a process that goes on, such as a test
session or a notebook). By default every program is written,
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
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import jax

log = logging.getLogger("maestro_jax")
SUM = ".sha256"  # beside each entry: its SHA-256, hex
ASIDE = "moved_aside"  # where entries without a matching checksum go


def enable(directory: str | Path, *, min_compile_time_s: float = 0.0, min_entry_size_bytes: int = -1) -> Path:
    """Cache compiled executables in `directory` (created if missing); returns its path.

    `min_compile_time_s`: programs that compile faster are not written
    (`jax_persistent_cache_min_compile_time_secs`; jax's default is 1 s). `min_entry_size_bytes`:
    smaller executables are not written (`jax_persistent_cache_min_entry_size_bytes`; -1: no
    limit, and no platform override of it)."""
    from jax.experimental.compilation_cache import compilation_cache as cc

    path = Path(directory).expanduser().resolve()
    path.mkdir(parents=True, exist_ok=True)
    move_aside_unchecked(path)
    if jax.config.jax_compilation_cache_dir not in (None, str(path)):
        cc.reset_cache()  # the cache opens its directory once: close the other one
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_time_s))
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", int(min_entry_size_bytes))
    return path


_SETTINGS = (
    "jax_enable_compilation_cache",
    "jax_compilation_cache_dir",
    "jax_persistent_cache_min_compile_time_secs",
    "jax_persistent_cache_min_entry_size_bytes",
)


@contextlib.contextmanager
def using(directory: str | Path | None) -> Iterator[Path | None]:
    """`enable(directory)` inside the block (nothing with None), jax's earlier settings after it."""
    if directory is None:
        yield None
        return
    from jax.experimental.compilation_cache import compilation_cache as cc

    before = {name: getattr(jax.config, name) for name in _SETTINGS}
    path = enable(directory)
    try:
        yield path
    finally:
        record(path)
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


def move_aside_unchecked(path: Path) -> list[str]:
    """Move every entry of the cache in `path` whose checksum is missing or differs into
    `path/moved_aside/` (one warning line); returns their names."""
    moved = []
    for entry in _entries(path):
        side = entry.with_name(entry.name + SUM)
        try:
            good = side.read_text().strip() == _digest(entry)
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


def record(path: Path | None = None) -> None:
    """Write the checksum of every entry in `path` (default: the open cache's directory) that has
    none yet. Call it when no compile is in flight: jax writes an entry in place."""
    path = path or directory()
    if path is None:
        return
    for entry in _entries(path):
        side = entry.with_name(entry.name + SUM)
        if side.exists():
            continue
        tmp = side.with_name(f"{side.name}.{os.getpid()}.tmp")
        tmp.write_text(_digest(entry))
        os.replace(tmp, side)
