"""JAX's persistent compilation cache: executables kept on disk, so that a second run of the same
programs (a restart, a resume, the next job on the machine) loads them instead of compiling.

`enable(directory)` turns it on for this process (before or after the first compile; a cache
already open in another directory is closed first); `using(directory)` turns it on for a block
and restores the settings it found (a training run in a process that goes on, such as a test
session or a notebook). By default every program is written,
whatever its compile time and size: jax's defaults skip programs that compile in under a second,
which is most programs of a small model on CPU. The cache is trusted: do not share the directory
with users you do not trust (jax's warning, `jax.experimental.compilation_cache`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import jax


def enable(directory: str | Path, *, min_compile_time_s: float = 0.0, min_entry_size_bytes: int = -1) -> Path:
    """Cache compiled executables in `directory` (created if missing); returns its path.

    `min_compile_time_s`: programs that compile faster are not written
    (`jax_persistent_cache_min_compile_time_secs`; jax's default is 1 s). `min_entry_size_bytes`:
    smaller executables are not written (`jax_persistent_cache_min_entry_size_bytes`; -1: no
    limit, and no platform override of it)."""
    from jax.experimental.compilation_cache import compilation_cache as cc

    path = Path(directory).expanduser().resolve()
    path.mkdir(parents=True, exist_ok=True)
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
    try:
        yield enable(directory)
    finally:
        cc.reset_cache()
        for name, value in before.items():
            jax.config.update(name, value)


def directory() -> Path | None:
    """The persistent cache's directory, or None when it is off."""
    d = jax.config.jax_compilation_cache_dir
    return Path(d) if d and jax.config.jax_enable_compilation_cache else None
