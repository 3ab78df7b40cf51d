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
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import AxisType, Mesh, NamedSharding

from maestro_jax.programs import SectionState

MANIFEST = "manifest-{step}.json"


def _view_sharding(sharding: NamedSharding) -> NamedSharding | None:
    """For a section mesh inside one process of a multi-process run: a sharding over a union
    mesh `("owner_rep", *section axes)` that holds the same shards, replicated once per
    process, the owner first. None when no view is needed (one process, or a spanning mesh).

    Orbax 0.12 (like jax's array serialization) refuses fully addressable arrays in a
    multi-process save (`Cannot serialize host local jax.Array`); a per-section manager with
    `active_processes` did not help (notes/jax-0.10-probe.md, 4). The view makes the array
    global without copying: the owner passes its shards, the others zero buffers that Orbax
    never writes (replica 0, the owner, writes; replica-parallel saving is disabled)."""
    if jax.process_count() == 1:
        return None
    mesh = sharding.mesh
    owners = {d.process_index for d in mesh.devices.flat}
    if len(owners) > 1:
        return None
    owner = owners.pop()
    rows = [np.asarray(mesh.devices)]
    for q in range(jax.process_count()):
        if q != owner:
            local = [d for d in jax.devices() if d.process_index == q][: mesh.devices.size]
            if len(local) < mesh.devices.size:
                raise NotImplementedError(f"process {q} has fewer devices ({len(local)}) than the section mesh "
                                          f"({mesh.devices.size}); cannot build a checkpoint view")
            rows.append(np.array(local, dtype=object).reshape(mesh.devices.shape))
    union = Mesh(np.stack(rows), ("owner_rep",) + tuple(mesh.axis_names),
                 axis_types=(AxisType.Auto,) * (1 + len(mesh.axis_names)))
    return NamedSharding(union, sharding.spec)


def _to_view(x: jax.Array) -> jax.Array:
    view = _view_sharding(x.sharding)
    if view is None:
        return x
    own = {s.device: s.data for s in x.addressable_shards}
    shard_shape = x.sharding.shard_shape(x.shape)
    bufs = [own[d] if d in own else jax.device_put(np.zeros(shard_shape, x.dtype), d)
            for d in view.addressable_devices_indices_map(x.shape)]
    return jax.make_array_from_single_device_arrays(x.shape, view, bufs)


def _from_view(v: jax.Array, sharding: NamedSharding) -> jax.Array:
    if v.sharding == sharding:
        return v
    own = {s.device: s.data for s in v.addressable_shards}
    bufs = [own[d] for d in sharding.addressable_devices_indices_map(v.shape)]
    return jax.make_array_from_single_device_arrays(v.shape, sharding, bufs, dtype=v.dtype)


def _view_target(x) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=_view_sharding(x.sharding) or x.sharding)


class Checkpointer:
    def __init__(self, directory: str | Path, max_to_keep: int = 3, asynchronous: bool = True):
        if jax.process_count() > 1:
            # dummy replicas of the checkpoint view must never write (see _view_sharding)
            ocp.type_handlers.register_type_handler(
                jax.Array, ocp.type_handlers.ArrayHandler(use_replica_parallel=False), override=True)
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
        items = {f"section_{s}": ocp.args.StandardSave(jax.tree.map(_to_view, {"params": st.params,
                                                                                "opt_state": st.opt_state}))
                 for s, st in states.items() if st.opt_state is not None}
        items["data"] = ocp.args.JsonSave(data_state)
        items["meta"] = ocp.args.JsonSave({**meta, "step": step})
        self.manager.save(step, args=ocp.args.Composite(**items), force=True)
        self._pending = {"step": step, "parts": sorted(items)}

    def _commit_pending(self) -> None:
        if self._pending is None:
            return
        self.manager.wait_until_finished()  # raises here if the asynchronous write failed
        pending, self._pending = self._pending, None
        if jax.process_index() != 0:  # one writer on the shared filesystem
            return
        step = pending["step"]
        tmp = self.directory / f".{MANIFEST.format(step=step)}.tmp"
        tmp.write_text(json.dumps(pending))
        os.replace(tmp, self.directory / MANIFEST.format(step=step))  # atomic on POSIX
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
        items = {f"section_{s}": ocp.args.StandardRestore(jax.tree.map(_view_target, {"params": st.params,
                                                                                     "opt_state": st.opt_state}))
                 for s, st in targets.items() if st.opt_state is not None}
        items["data"] = ocp.args.JsonRestore()
        items["meta"] = ocp.args.JsonRestore()
        got = self.manager.restore(step, args=ocp.args.Composite(**items))
        states = dict(targets)
        for s, st in targets.items():
            if st.opt_state is not None:
                target = {"params": st.params, "opt_state": st.opt_state}
                part = jax.tree.map(lambda v, t: _from_view(v, t.sharding), got[f"section_{s}"], target)
                states[s] = SectionState(part["params"], st.consts, part["opt_state"])
        return states, got["data"], got["meta"]
