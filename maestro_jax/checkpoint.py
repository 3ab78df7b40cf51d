"""Checkpoints: every trained section's params and optimizer state, the data iterator, the step.

Layout (`<output_dir>/checkpoints/`):
  <step>/section_<name>/   Orbax StandardSave of {"params", "opt_state"}, one item per section
  <step>/data/             Grain iterator state (Orbax JsonSave)
  <step>/meta/             step, seed, plan summary
  manifest-<step>.json     written last, atomically (write to a temp file, then rename)

Saves are asynchronous: `save` starts writing and returns; the manifest of a save is written
only once Orbax reports that save finished (at the next save, or at `close`). "The latest
checkpoint" is the newest step that has a manifest, so a save interrupted at any point is
never restored from. Restore targets carry the *current* plan's shardings, so a checkpoint
restores onto a different device split or mesh layout.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax
import orbax.checkpoint as ocp

from maestro_jax.programs import SectionState

MANIFEST = "manifest-{step}.json"


def _abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


class Checkpointer:
    def __init__(self, directory: str | Path, max_to_keep: int = 3, asynchronous: bool = True):
        self.directory = Path(directory).absolute()
        self.directory.mkdir(parents=True, exist_ok=True)
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True,
                                                 enable_async_checkpointing=asynchronous))
        self._pending: dict | None = None

    # -- saving -----------------------------------------------------------------------------
    def save(self, step: int, states: dict[str, SectionState], data_state: dict, meta: dict) -> None:
        """Start an asynchronous save of `step`; commits the previous save's manifest first."""
        self._commit_pending()
        items = {f"section_{s}": ocp.args.StandardSave({"params": st.params, "opt_state": st.opt_state})
                 for s, st in states.items() if st.opt_state is not None}
        items["data"] = ocp.args.JsonSave(data_state)
        items["meta"] = ocp.args.JsonSave({**meta, "step": step})
        self.manager.save(step, args=ocp.args.Composite(**items), force=True)
        self._pending = {"step": step, "parts": sorted(items)}

    def _commit_pending(self) -> None:
        if self._pending is None:
            return
        self.manager.wait_until_finished()  # raises here if the asynchronous write failed
        step = self._pending["step"]
        tmp = self.directory / f".{MANIFEST.format(step=step)}.tmp"
        tmp.write_text(json.dumps(self._pending))
        os.replace(tmp, self.directory / MANIFEST.format(step=step))  # atomic on POSIX
        self._pending = None
        kept = set(self.manager.all_steps())
        for m in self.directory.glob("manifest-*.json"):
            if int(m.stem.split("-")[1]) not in kept:
                m.unlink()

    def close(self) -> None:
        self._commit_pending()
        self.manager.close()

    # -- restoring --------------------------------------------------------------------------
    def committed_steps(self) -> list[int]:
        on_disk = set(self.manager.all_steps())
        steps = [int(m.stem.split("-")[1]) for m in self.directory.glob("manifest-*.json")]
        return sorted(s for s in steps if s in on_disk)

    def latest_step(self) -> int | None:
        steps = self.committed_steps()
        return steps[-1] if steps else None

    def restore(self, step: int, targets: dict[str, SectionState]) -> tuple[dict[str, SectionState], dict, dict]:
        """Restore into `targets`' shardings (the current plan). Missing or extra leaves fail loudly."""
        items = {f"section_{s}": ocp.args.StandardRestore(_abstract({"params": st.params, "opt_state": st.opt_state}))
                 for s, st in targets.items() if st.opt_state is not None}
        items["data"] = ocp.args.JsonRestore()
        items["meta"] = ocp.args.JsonRestore()
        got = self.manager.restore(step, args=ocp.args.Composite(**items))
        states = dict(targets)
        for s, st in targets.items():
            if st.opt_state is not None:
                part = got[f"section_{s}"]
                states[s] = SectionState(part["params"], st.consts, part["opt_state"])
        return states, got["data"], got["meta"]
