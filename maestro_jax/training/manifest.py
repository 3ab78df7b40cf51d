"""The checkpoint manifest: what Orbax does not keep about a step, written beside it as
`manifest-<step>.json` (`training.checkpoint` writes it from Orbax's finalisation callback).

- The size and CRC32 of every file of the step: Orbax does not notice a flipped bit in an array
  file, so a restore checks them first (`verify_step`) and falls back to an earlier step.
- The layout, each saved leaf's path, shape and dtype (`state_layout`): a checkpoint of another
  config (model size, optimizer, precision) is refused naming the first leaf that differs
  (`layout_difference`) instead of failing inside Orbax or restoring into the wrong shapes.
"""

from __future__ import annotations

import zlib
from pathlib import Path

import jax
import numpy as np

from maestro_jax.runtime.programs import SectionState

MANIFEST = "manifest-{step}.json"
ORBAX_STEP_METADATA = "_CHECKPOINT_METADATA"  # Orbax's own step metadata, rewritten at commit: not summed


def state_layout(states: dict[str, SectionState]) -> dict[str, dict[str, list]]:
    """{section: {leaf path: [shape, dtype]}} of the params and optimizer state a checkpoint holds."""
    out = {}
    for s, st in states.items():
        if st.opt_state is not None:
            leaves = jax.tree_util.tree_flatten_with_path({"params": st.params, "opt_state": st.opt_state})[0]
            out[s] = {jax.tree_util.keystr(p): [list(np.shape(v)), str(v.dtype)] for p, v in leaves}
    return out


def layout_difference(saved: dict, current: dict) -> str | None:
    """The first difference between a saved and the current `state_layout`, in words."""
    for s in sorted(set(saved) | set(current)):
        if s not in current or s not in saved:
            where = "the checkpoint" if s in saved else "this config"
            return f"section {s!r} is trained only in {where}"
        a, b = saved[s], current[s]
        for path in sorted(set(a) | set(b), key=lambda p: (not p.startswith("['params']"), p)):  # params first
            if path not in a or path not in b:
                return f"section {s!r}: {path} exists only in {'the checkpoint' if path in a else 'this config'}"
            if a[path] != b[path]:
                return (
                    f"section {s!r}: {path} is {a[path][0]} {a[path][1]} in the checkpoint, "
                    f"{b[path][0]} {b[path][1]} in this config"
                )
    return None


def file_checksums(root: Path) -> dict[str, list[int]]:
    """{relative path: [size, crc32]} of every file under a step directory, but Orbax's own step
    metadata (`_CHECKPOINT_METADATA`, which it rewrites with the commit time)."""
    out = {}
    for f in sorted(p for p in root.rglob("*") if p.is_file() and (p.parent, p.name) != (root, ORBAX_STEP_METADATA)):
        crc = 0
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 22):
                crc = zlib.crc32(chunk, crc)
        out[str(f.relative_to(root))] = [f.stat().st_size, crc]
    return out


def verify_step(step_dir: Path, manifest: dict) -> str | None:
    """None when every file matches the manifest's sizes and checksums, else what is wrong."""
    expected = manifest.get("files")
    if expected is None:
        return "manifest has no checksums"
    found = file_checksums(step_dir) if step_dir.is_dir() else {}
    for name, (size, crc) in expected.items():
        if name not in found:
            return f"file {name} is missing"
        if found[name][0] != size:
            return f"file {name} is truncated or grown ({found[name][0]} bytes, expected {size})"
        if found[name][1] != crc:
            return f"file {name} fails its checksum (crc32 {found[name][1]:08x}, expected {crc:08x})"
    return None
