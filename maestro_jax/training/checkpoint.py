"""Checkpoints: every trained section's params and optimizer state, the data iterator, the step.

Layout (`<output_dir>/checkpoints/`):
  <step>/section_<name>/   Orbax StandardSave of {"params", "opt_state"}, one item per section
  <step>/data/             Grain iterator state (Orbax JsonSave)
  <step>/meta/             step, seed, plan summary
  manifest-<step>.json     written last, atomically (write to a temp file, then rename)

Saves are asynchronous: `save` starts writing and returns. A commit thread waits for Orbax to
report the save finished (on every process: Orbax renames the step directory only after all
processes wrote their part) and then process 0 writes the manifest, so a save counts as soon as
it is complete, without the training loop waiting for it. "The latest checkpoint" is the newest
step that has a manifest, so a save interrupted at any point (a `kill -9`, a full disk) is never
restored from, and is deleted when the directory is opened again. Errors of an asynchronous
save surface as `CheckpointError` at the next save or at `close`, never swallowed.

Retention (`max_to_keep`) is ours, not Orbax's: only after manifest-N is written are older
committed steps beyond the newest `max_to_keep` deleted (manifest first, then the directory),
so the last committed step never disappears before the next one is committed.

The manifest holds a CRC32 and size of every file of the step, leaves included: Orbax itself
does not notice a flipped bit in an array file. `restore_latest` checks them and falls back
to the previous good checkpoint when they do not match (moving the bad one to
`<dir>/corrupt/`), saying so. The manifest also records the layout of what was saved (each
leaf's path, shape and dtype): a checkpoint that does not match the current config (another
model size, optimizer or precision) is refused with a `ConfigError` naming the first leaf
that differs, and left where it is; it is not corrupt. Restore targets carry the *current* plan's shardings, so a
checkpoint restores onto a different device split or mesh layout.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
import traceback
import zlib
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import AxisType, Mesh, NamedSharding

from maestro_jax.config import ConfigError
from maestro_jax.runtime.distributed import agree, checkpoint_barrier, peer_fault
from maestro_jax.runtime.programs import SectionState
from maestro_jax.training.storage import StorageError

MANIFEST = "manifest-{step}.json"
log = logging.getLogger("maestro_jax")


class CheckpointError(StorageError):
    """A checkpoint could not be written or read; the message names the step, the path and why."""


class CheckpointMismatchError(ConfigError):
    """An intact checkpoint that the current config cannot resume (a changed model, optimizer or
    precision): refused before training, the checkpoint left in place."""


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
                return (f"section {s!r}: {path} is {a[path][0]} {a[path][1]} in the checkpoint, "
                        f"{b[path][0]} {b[path][1]} in this config")
    return None


def _file_checksums(root: Path) -> dict[str, list[int]]:
    """{relative path: [size, crc32]} of every file under a step directory."""
    out = {}
    for f in sorted(p for p in root.rglob("*") if p.is_file()):
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
    found = _file_checksums(step_dir) if step_dir.is_dir() else {}
    for name, (size, crc) in expected.items():
        if name not in found:
            return f"file {name} is missing"
        if found[name][0] != size:
            return f"file {name} is truncated or grown ({found[name][0]} bytes, expected {size})"
        if found[name][1] != crc:
            return f"file {name} fails its checksum (crc32 {found[name][1]:08x}, expected {crc:08x})"
    return None


def _view_sharding(sharding: NamedSharding) -> NamedSharding | None:
    """For a section mesh inside one process of a multi-process run: a sharding over a union
    mesh `("owner_rep", *section axes)` that holds the same shards, replicated once per
    process, the owner first. None when no view is needed (one process, or a spanning mesh).

    Orbax 0.12 (like jax's array serialization) refuses fully addressable arrays in a
    multi-process save (`Cannot serialize host local jax.Array`); a per-section manager with
    `active_processes` did not help (measured on jax 0.10 and Orbax 0.12). The view makes the array
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


def check_checkpoint_layout(plan) -> None:
    """Refuse, before anything compiles, a multi-process plan whose checkpoint could not be
    written: a section spanning some processes but not all (Orbax needs every array on process 0
    or in one process; the global view covers sections inside one process)."""
    from maestro_jax.config import ConfigError  # noqa: PLC0415

    if jax.process_count() == 1:
        return
    devices = jax.devices()
    for name, sp in plan.sections.items():
        owners = sorted({devices[i].process_index for i in sp.devices})
        if 1 < len(owners) < jax.process_count():
            raise ConfigError(f"error: sections.{name}.devices={list(sp.devices)}: spans processes {owners} of "
                              f"{jax.process_count()}, and such a section cannot be checkpointed yet; place it inside "
                              f"one process or across all of them, or set keep_checkpoints=0 (no checkpoints)")


class _OrbaxErrors(logging.Filter):
    """Orbax logs every failure of an asynchronous save from each of its threads, with a traceback
    (dozens on a full disk), and asyncio reports its failed write futures again at exit ("Future
    exception was never retrieved"); the same error reaches the user once, as the
    `CheckpointError` of `save` or `close`. Such records (logged from Orbax, or carrying an
    exception raised inside it) go to the `maestro_jax.orbax` logger at DEBUG instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR and (_in_orbax(record.pathname) or record.exc_info and any(
                _in_orbax(frame.filename) for frame in traceback.extract_tb(record.exc_info[2]))):
            log.getChild("orbax").debug("%s", record.getMessage(), exc_info=record.exc_info)
            return False
        return True


def _in_orbax(path: str) -> bool:
    return f"{os.sep}orbax{os.sep}" in path


def _quiet_orbax_errors() -> None:
    for logger in (logging.getLogger("absl"), logging.getLogger("asyncio")):
        if not any(isinstance(f, _OrbaxErrors) for f in logger.filters):
            logger.addFilter(_OrbaxErrors())


class Checkpointer:
    def __init__(self, directory: str | Path, max_to_keep: int = 3, asynchronous: bool = True,
                 read_only: bool = False):
        """`read_only`: for a reader outside a run (an export): nothing is created or cleaned up,
        and `save` is not allowed; restoring from read-only storage works."""
        _quiet_orbax_errors()
        if jax.process_count() > 1:
            # dummy replicas of the checkpoint view must never write (see _view_sharding)
            ocp.type_handlers.register_type_handler(
                jax.Array, ocp.type_handlers.ArrayHandler(use_replica_parallel=False), override=True)
        self.directory = Path(directory).absolute()
        self.read_only = read_only
        try:
            if not read_only:
                self.directory.mkdir(parents=True, exist_ok=True)
            if jax.process_index() == 0 and not read_only:
                self._discard_uncommitted()
        except OSError as err:
            raise CheckpointError(f"checkpoint directory {self.directory} is not usable: {err}") from err
        agree("checkpoint-dir-ready", True)  # nobody opens the manager before the clean-up is done
        # max_to_keep=None: Orbax deletes old steps as soon as a new one is written, before its
        # manifest exists; retention is done in `_commit`, after the manifest (see the docstring).
        # Directories are created in `save` itself: created asynchronously, a failure (read-only
        # storage) left Orbax's other save threads waiting 300 s for the directory's signal, and
        # the process could not exit before them.
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=None, create=not read_only, read_only=read_only,
                enable_async_checkpointing=asynchronous,
                async_options=ocp.AsyncOptions(create_directories_asynchronously=False,
                                               barrier_sync_fn=checkpoint_barrier())))
        self.max_to_keep = max_to_keep
        self.asynchronous = asynchronous
        self._committer: threading.Thread | None = None
        self._commit_error: tuple[int, BaseException] | None = None

    def _discard_uncommitted(self) -> None:
        """Delete what an interrupted save left: step directories without a manifest and Orbax
        temporaries. Otherwise a resumed run could not save that step again."""
        committed = {int(m.stem.split("-")[1]) for m in self.directory.glob("manifest-*.json")}
        for p in self.directory.iterdir():
            unfinished = ".orbax-checkpoint-tmp" in p.name or p.name.startswith(".manifest-")
            if unfinished or (p.is_dir() and p.name.isdigit() and int(p.name) not in committed):
                log.warning("removing uncommitted checkpoint data %s (an interrupted save)", p)
                shutil.rmtree(p) if p.is_dir() else p.unlink()

    # -- saving -----------------------------------------------------------------------------
    def save(self, step: int, states: dict[str, SectionState], data_state: dict, meta: dict) -> None:
        """Start an asynchronous save of `step`; a background thread commits it once complete.

        Waits first for the previous save's commit (and raises its error, if any)."""
        if self.read_only:
            raise CheckpointError(f"checkpoint directory {self.directory} was opened read-only")
        self._join_commit()
        items = {f"section_{s}": ocp.args.StandardSave(jax.tree.map(_to_view, {"params": st.params,
                                                                                "opt_state": st.opt_state}))
                 for s, st in states.items() if st.opt_state is not None}
        items["data"] = ocp.args.JsonSave(data_state)
        items["meta"] = ocp.args.JsonSave({**meta, "step": step})
        if delay := float(os.environ.get("MAESTRO_TEST_SAVE_DELAY_S", "0")):
            time.sleep(delay)  # test hook: this process joins a save its peers are in only later
        try:
            self.manager.save(step, args=ocp.args.Composite(**items), force=True)
        except Exception as err:  # Orbax raises OSError, ValueError or its own types for storage faults
            raise self._save_error(step, err) from err
        pending = {"step": step, "parts": sorted(items), "layout": state_layout(states)}
        if not self.asynchronous:
            self._commit(pending)
            self._join_commit()
            return
        # a daemon thread: a process that ends on a fault does not wait for a save that cannot complete
        self._committer = threading.Thread(target=self._commit, args=(pending,), daemon=True,
                                           name=f"checkpoint-commit-{step}")
        self._committer.start()

    def _save_error(self, step: int, err: BaseException) -> Exception:
        peer = peer_fault(err, f"the checkpoint save of step {step}")  # a lost or stuck peer is no storage fault
        if peer is not None:
            return peer
        return CheckpointError(f"checkpoint save of step {step} to {self.directory} failed: "
                               f"{type(err).__name__}: {err}".replace("\n", " ")[:600]
                               + f"; the last complete checkpoint (step {self.latest_step()}) is intact")

    def _commit(self, pending: dict) -> None:
        """Wait for Orbax to finish `pending`'s save, then (process 0) write its manifest and apply
        retention. Runs in the commit thread; an error is kept for `_join_commit` to raise."""
        step = pending["step"]
        try:
            self.manager.wait_until_finished()  # raises here if the asynchronous write failed
            self.manager.check_for_errors()
            delay = float(os.environ.get("MAESTRO_TEST_COMMIT_DELAY_S", "0"))
            if delay:  # test hook: widens the window between Orbax finishing and the commit
                time.sleep(delay)
            if jax.process_index() == 0:  # one writer on the shared filesystem
                pending["files"] = _file_checksums(self.directory / str(step))
                tmp = self.directory / f".{MANIFEST.format(step=step)}.tmp"
                try:
                    tmp.write_text(json.dumps(pending))
                    os.replace(tmp, self.directory / MANIFEST.format(step=step))  # atomic on POSIX
                finally:
                    tmp.unlink(missing_ok=True)
        except BaseException as err:
            self._commit_error = (step, err)
            return
        if jax.process_index() == 0:
            try:
                self._apply_retention()
            except OSError as err:  # a leftover is removed by the next run; training goes on
                log.warning("removing old checkpoints in %s: %s", self.directory, err)

    def _apply_retention(self) -> None:
        """Delete committed steps beyond the newest `max_to_keep` (and manifests whose step is gone).
        The manifest goes first: a step interrupted half-deleted is uncommitted data, removed
        when the directory is opened again."""
        committed = sorted(int(m.stem.split("-")[1]) for m in self.directory.glob("manifest-*.json"))
        for step in committed[:-self.max_to_keep] if self.max_to_keep else []:
            (self.directory / MANIFEST.format(step=step)).unlink(missing_ok=True)
            shutil.rmtree(self.directory / str(step), ignore_errors=True)

    def _join_commit(self) -> None:
        """Wait for the commit thread of the last save; raise its error as a `CheckpointError`."""
        if self._committer is not None:
            self._committer.join()
            self._committer = None
        if self._commit_error is not None:
            (step, err), self._commit_error = self._commit_error, None
            raise self._save_error(step, err) from err

    def wait_committed(self) -> None:
        """Wait until the last save is committed; raise its error if it failed."""
        self._join_commit()

    def close(self) -> None:
        """Wait for the last save's commit (raising `CheckpointError` if it failed) and stop Orbax."""
        try:
            self._join_commit()
        finally:
            try:
                self.manager.close()
            except Exception as err:  # a failed save's leftovers; the error that matters is raised above
                log.warning("closing the checkpoint manager: %s: %s", type(err).__name__, err)

    # -- restoring --------------------------------------------------------------------------
    def committed_steps(self) -> list[int]:
        if not self.directory.is_dir():
            return []
        steps = [int(m.stem.split("-")[1]) for m in self.directory.glob("manifest-*.json")]
        return sorted(s for s in steps if (self.directory / str(s)).is_dir())

    def latest_step(self) -> int | None:
        steps = self.committed_steps()
        return steps[-1] if steps else None

    def restore_latest(self, targets: dict[str, SectionState]):
        """Restore the newest committed checkpoint whose files match their checksums.

        A corrupt or unreadable one is moved to `<dir>/corrupt/<step>` with a warning and the
        previous one is tried. Returns `(step, states, data_state, meta)`, or None when there is
        no usable checkpoint. Every process reaches the same decision (process 0's)."""
        for step in reversed(self.committed_steps()):
            problem = mismatch = None
            if jax.process_index() == 0:
                try:
                    manifest = json.loads((self.directory / MANIFEST.format(step=step)).read_text())
                except (OSError, ValueError) as err:  # truncated or damaged: the step cannot be trusted
                    manifest = {}
                    problem = f"its manifest is unreadable ({type(err).__name__}: {err})"[:300]
                else:
                    problem = verify_step(self.directory / str(step), manifest)
                if problem is None and "layout" in manifest:
                    mismatch = layout_difference(manifest["layout"], state_layout(targets))
            problem, mismatch = agree(f"checkpoint-verify-{step}", [problem, mismatch])
            if mismatch is not None:
                raise CheckpointMismatchError(
                    f"error: checkpoint step {step} in {self.directory} does not match this config ({mismatch}); "
                    f"resume with the model, optimizer and precision it was saved with, or use a new output_dir "
                    f"(the checkpoint is left in place)")
            if problem is None:
                try:
                    return (step, *self.restore(step, targets))
                except Exception as err:  # a file that passed (or predates) checksums but cannot be read
                    problem = f"restore failed: {type(err).__name__}: {err}".replace("\n", " ")[:400]
            self._quarantine(step, problem)
        return None

    def _quarantine(self, step: int, problem: str) -> None:
        earlier = [s for s in self.committed_steps() if s < step]
        where = f"falling back to step {earlier[-1]}" if earlier else "no earlier checkpoint: starting from scratch"
        log.warning("checkpoint step %d in %s is corrupt (%s); %s", step, self.directory, problem, where)
        print(f"warning: checkpoint step {step} is corrupt ({problem}); {where}", flush=True)
        if jax.process_index() == 0 and not self.read_only:  # a reader leaves the directory as it is
            bad = self.directory / "corrupt" / str(step)
            shutil.rmtree(bad, ignore_errors=True)
            bad.mkdir(parents=True)
            (self.directory / MANIFEST.format(step=step)).rename(bad / MANIFEST.format(step=step))
            if (self.directory / str(step)).exists():
                (self.directory / str(step)).rename(bad / str(step))
        agree(f"checkpoint-quarantined-{step}", True)
        self.manager.reload()

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
