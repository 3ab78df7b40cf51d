"""Checkpoints: every trained section's params and optimizer state, the data iterator, the step.

Layout (`<output_dir>/checkpoints/`):
  <step>/section_<name>/   Orbax StandardSave of {"params", "opt_state"}, one item per section
  <step>/data/             Grain iterator state (Orbax JsonSave)
  <step>/meta/             step, seed, workload
  manifest-<step>.json     a sidecar: size and CRC32 of every file of the step, and its layout

Orbax owns commit and retention. A save is asynchronous: Orbax writes `<step>.orbax-checkpoint-
tmp-*`, then renames it to `<step>` (the commit; on every process once all of them wrote), then
deletes steps beyond the newest `max_to_keep` (its `LatestN` preservation policy), so the last
committed step never disappears before the next one is committed. A save interrupted at any
point (a `kill -9`, a full disk) is never restored from; Orbax removes its temporaries when the
directory is opened again. Errors of an asynchronous save surface as `CheckpointError` at the
next save or at `close`, never swallowed.

The manifest (`training.manifest`) is what Orbax does not offer. It is written by Orbax's finalisation callback
(process 0), after every file of the step is written and before the rename, so a committed
step always has one. Orbax does not notice a flipped bit in an array file: `restore_latest`
checks the sizes and checksums and falls back to the previous good checkpoint when they do not
match (moving the bad one to `<dir>/corrupt/`), saying so. The layout (each leaf's path, shape
and dtype) refuses a checkpoint of another config (another model size, optimizer or precision)
with a `ConfigError` naming the first leaf that differs, leaving it where it is. Restore
targets carry the *current* plan's shardings, so a checkpoint restores onto a different device
split or mesh layout.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import time
import traceback
from collections.abc import Iterator
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import AxisType, Mesh, NamedSharding

from maestro_jax.config import ConfigError
from maestro_jax.runtime.distributed import Coordinator, PeerError
from maestro_jax.runtime.programs import SectionState
from maestro_jax.training.dirlock import hold_directories
from maestro_jax.training.manifest import MANIFEST, file_checksums, layout_difference, state_layout, verify_step
from maestro_jax.training.storage import StorageError

log = logging.getLogger("maestro_jax")


class CheckpointError(StorageError):
    """A checkpoint could not be written or read; the message names the step, the path and why."""


class CheckpointMismatchError(ConfigError):
    """An intact checkpoint that the current config cannot resume (a changed model, optimizer or
    precision): refused before training, the checkpoint left in place."""


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
                raise NotImplementedError(
                    f"process {q} has fewer devices ({len(local)}) than the section mesh "
                    f"({mesh.devices.size}); cannot build a checkpoint view"
                )
            rows.append(np.array(local, dtype=object).reshape(mesh.devices.shape))
    union = Mesh(
        np.stack(rows),
        ("owner_rep",) + tuple(mesh.axis_names),
        axis_types=(AxisType.Auto,) * (1 + len(mesh.axis_names)),
    )
    return NamedSharding(union, sharding.spec)


def _to_view(x: jax.Array) -> jax.Array:
    view = _view_sharding(x.sharding)
    if view is None:
        return x
    own = {s.device: s.data for s in x.addressable_shards}
    shard_shape = x.sharding.shard_shape(x.shape)
    bufs = [
        own[d] if d in own else jax.device_put(np.zeros(shard_shape, x.dtype), d)
        for d in view.addressable_devices_indices_map(x.shape)
    ]
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
    from maestro_jax.config import ConfigError

    if jax.process_count() == 1:
        return
    devices = jax.devices()
    for name, sp in plan.sections.items():
        owners = sorted({devices[i].process_index for i in sp.devices})
        if 1 < len(owners) < jax.process_count():
            raise ConfigError(
                f"error: sections.{name}.devices={list(sp.devices)}: spans processes {owners} of "
                f"{jax.process_count()}, and such a section cannot be checkpointed yet; place it inside "
                f"one process or across all of them, or set keep_checkpoints=0 (no checkpoints)"
            )


class _OrbaxErrors(logging.Filter):
    """Orbax logs every failure of an asynchronous save from each of its threads, with a traceback
    (dozens on a full disk), and asyncio reports its failed write futures again at exit ("Future
    exception was never retrieved"); the same error reaches the user once, as the
    `CheckpointError` of `save` or `close`. Such records (logged from Orbax, or carrying an
    exception raised inside it) go to the `maestro_jax.orbax` logger at DEBUG instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR and (
            _in_orbax(record.pathname)
            or (
                record.exc_info and any(_in_orbax(frame.filename) for frame in traceback.extract_tb(record.exc_info[2]))
            )
        ):
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
    def __init__(
        self,
        directory: str | Path,
        max_to_keep: int = 3,
        asynchronous: bool = True,
        read_only: bool = False,
        coordinator: Coordinator | None = None,
    ):
        """`read_only`: for a reader outside a run (an export, `maestro-jax eval`): nothing is
        created or cleaned up, and `save` is not allowed; restoring from read-only storage works."""
        _quiet_orbax_errors()
        if jax.process_count() > 1:
            # dummy replicas of the checkpoint view must never write (see _view_sharding)
            ocp.type_handlers.register_type_handler(
                jax.Array, ocp.type_handlers.ArrayHandler(use_replica_parallel=False), override=True
            )
        self.directory = Path(directory).absolute()
        self.read_only = read_only
        self.coordinator = coordinator or Coordinator()
        self._saving: int | None = None  # the step whose save is in flight (one at a time)
        self._layout: dict = {}  # its `state_layout`, for the manifest
        try:
            if not read_only:
                self.directory.mkdir(parents=True, exist_ok=True)
            # Directories are created in `save` itself: created asynchronously, a failure
            # (read-only storage) left Orbax's other save threads waiting 300 s for the
            # directory's signal, and the process could not exit before them.
            self.manager = ocp.CheckpointManager(
                self.directory,
                options=ocp.CheckpointManagerOptions(
                    max_to_keep=max_to_keep or None,
                    create=not read_only,
                    read_only=read_only,
                    cleanup_tmp_directories=not read_only,
                    enable_async_checkpointing=asynchronous,
                    async_options=ocp.AsyncOptions(
                        create_directories_asynchronously=False,
                        barrier_sync_fn=self.coordinator.checkpoint_barrier(),
                        post_finalization_callback=self._write_manifest,
                    ),
                ),
            )
        except OSError as err:
            raise CheckpointError(f"checkpoint directory {self.directory} is not usable: {err}") from err
        if jax.process_index() == 0 and not read_only:
            self._remove_stray_manifests()
        self.coordinator.agree("checkpoint-dir-ready", True)  # nobody saves before the clean-up is done

    def __enter__(self):
        return self

    def __exit__(self, kind, err, tb) -> None:
        """Leaving a run: the last save is committed (`close`). Not after a lost peer: committing
        needs it, so that save is never committed. On another fault, a failed commit is logged:
        the fault comes first."""
        if isinstance(err, PeerError):
            return
        try:
            self.close()
        except Exception as close_err:
            if kind is None:
                raise
            log.error("%s", close_err)

    def _remove_stray_manifests(self) -> None:
        """Manifests whose step is not committed: a save killed between its manifest and Orbax's
        rename, or a step Orbax's retention deleted after the last manifest was written."""
        committed = set(self._steps())
        for m in self.directory.glob("manifest-*.json"):
            if _manifest_step(m) not in committed:
                m.unlink(missing_ok=True)
        for tmp in self.directory.glob(".manifest-*.tmp"):
            tmp.unlink(missing_ok=True)

    # -- saving -----------------------------------------------------------------------------
    def save(self, step: int, states: dict[str, SectionState], data_state: dict, meta: dict) -> None:
        """Start an asynchronous save of `step` and return; Orbax commits it once complete.

        Waits first for the previous save (and raises its error, if any)."""
        if self.read_only:
            raise CheckpointError(f"checkpoint directory {self.directory} was opened read-only")
        self.wait_committed()
        items = {
            f"section_{s}": ocp.args.StandardSave(
                jax.tree.map(_to_view, {"params": st.params, "opt_state": st.opt_state})
            )
            for s, st in states.items()
            if st.opt_state is not None
        }
        items["data"] = ocp.args.JsonSave(data_state)
        items["meta"] = ocp.args.JsonSave({**meta, "step": step})
        if delay := float(os.environ.get("MAESTRO_TEST_SAVE_DELAY_S", "0")):
            time.sleep(delay)  # test hook: this process joins a save its peers are in only later
        self._saving, self._layout = step, state_layout(states)
        try:
            self.manager.save(step, args=ocp.args.Composite(**items), force=True)
        except Exception as err:  # Orbax raises OSError, ValueError or its own types for storage faults
            self._saving = None
            raise self._save_error(step, err) from err

    def _write_manifest(self) -> None:
        """Orbax's finalisation callback (every process, on its save thread): every file of the
        step is written, not yet renamed. Process 0 writes the manifest; raising here keeps
        Orbax from committing the step, and the error reaches `wait_committed`."""
        step = self._saving
        if delay := float(os.environ.get("MAESTRO_TEST_COMMIT_DELAY_S", "0")):
            time.sleep(delay)  # test hook: widens the window between the files and the commit
        if jax.process_index() != 0 or step is None:
            return
        written = sorted(self.directory.glob(f"{step}.orbax-checkpoint-tmp*")) or [self.directory / str(step)]
        manifest = {"step": step, "layout": self._layout, "files": file_checksums(written[-1])}
        tmp = self.directory / f".{MANIFEST.format(step=step)}.tmp"
        try:
            tmp.write_text(json.dumps(manifest))
            os.replace(tmp, self.directory / MANIFEST.format(step=step))  # atomic on POSIX
        finally:
            tmp.unlink(missing_ok=True)

    def _save_error(self, step: int, err: BaseException) -> Exception:
        peer = self.coordinator.peer_fault(
            err, f"the checkpoint save of step {step}"
        )  # a lost or stuck peer is no storage fault
        if peer is not None:
            return peer
        return CheckpointError(
            f"checkpoint save of step {step} to {self.directory} failed: {type(err).__name__}: {err}".replace(
                "\n", " "
            )[:600]
            + f"; the last complete checkpoint (step {self.latest_step()}) is intact"
        )

    def wait_committed(self) -> None:
        """Wait until the last save is committed; raise its error as a `CheckpointError`."""
        step = self._saving
        if step is None:
            return
        try:
            self.manager.wait_until_finished()  # raises here if the asynchronous write failed
            self.manager.check_for_errors()
        except Exception as err:
            raise self._save_error(step, err) from err
        finally:
            self._saving = None
        if step not in self._steps():  # Orbax logs a failed finalisation, raises nothing
            raise self._save_error(step, RuntimeError("Orbax did not commit it (see the log above)"))

    def close(self) -> None:
        """Wait for the last save's commit (raising `CheckpointError` if it failed) and stop Orbax."""
        try:
            self.wait_committed()
        finally:
            try:
                self.manager.close()
                if jax.process_index() == 0 and not self.read_only:
                    self._remove_stray_manifests()
            except Exception as err:  # noqa: BLE001 - a failed save's leftovers; the error that matters is raised above
                log.warning("closing the checkpoint manager: %s: %s", type(err).__name__, err)

    # -- restoring --------------------------------------------------------------------------
    def committed_steps(self) -> list[int]:
        return self._steps() if self.directory.is_dir() else []

    def _steps(self) -> list[int]:
        """The steps Orbax committed, as the storage holds them now."""
        self.manager.reload()
        return sorted(self.manager.all_steps())

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
                except (OSError, ValueError) as err:  # missing, truncated or damaged: the step cannot be trusted
                    manifest = {}
                    problem = f"its manifest is unreadable ({type(err).__name__}: {err})"[:300]
                else:
                    problem = verify_step(self.directory / str(step), manifest)
                if problem is None and "layout" in manifest:
                    mismatch = layout_difference(manifest["layout"], state_layout(targets))
            problem, mismatch = self.coordinator.agree(f"checkpoint-verify-{step}", [problem, mismatch])
            if mismatch is not None:
                raise CheckpointMismatchError(
                    f"error: checkpoint step {step} in {self.directory} does not match this config ({mismatch}); "
                    f"resume with the model, optimizer and precision it was saved with, or use a new output_dir "
                    f"(the checkpoint is left in place)"
                )
            if problem is None:
                try:
                    return (step, *self.restore(step, targets))
                except Exception as err:  # noqa: BLE001 - a file that passed checksums but cannot be read
                    problem = f"restore failed: {type(err).__name__}: {err}".replace("\n", " ")[:400]
            self._quarantine(step, problem)
        return None

    def restore_params(self, step: int, section: str, target):
        """`section`'s params alone from `step`, into `target`'s shardings (its optimizer state is
        not read: Orbax's partial restore)."""
        view = {"params": jax.tree.map(_view_target, target)}
        args = ocp.args.PyTreeRestore(
            view, restore_args=ocp.checkpoint_utils.construct_restore_args(view), partial_restore=True
        )
        got = self.manager.restore(step, args=ocp.args.Composite(**{f"section_{section}": args}))
        return jax.tree.map(lambda v, t: _from_view(v, t.sharding), got[f"section_{section}"]["params"], target)

    def _quarantine(self, step: int, problem: str) -> None:
        earlier = [s for s in self.committed_steps() if s < step]
        where = f"falling back to step {earlier[-1]}" if earlier else "no earlier checkpoint: starting from scratch"
        log.warning("checkpoint step %d in %s is corrupt (%s); %s", step, self.directory, problem, where)
        print(f"warning: checkpoint step {step} is corrupt ({problem}); {where}", flush=True)
        if jax.process_index() == 0 and not self.read_only:  # a reader leaves the directory as it is
            bad = self.directory / "corrupt" / str(step)
            shutil.rmtree(bad, ignore_errors=True)
            bad.mkdir(parents=True)
            for part in (MANIFEST.format(step=step), str(step)):
                if (self.directory / part).exists():
                    (self.directory / part).rename(bad / part)
        self.coordinator.agree(f"checkpoint-quarantined-{step}", True)
        self.manager.reload()

    def restore(self, step: int, targets: dict[str, SectionState]) -> tuple[dict[str, SectionState], dict, dict]:
        """Restore into `targets`' shardings (the current plan). Missing or extra leaves fail loudly."""
        items = {
            f"section_{s}": ocp.args.StandardRestore(
                jax.tree.map(_view_target, {"params": st.params, "opt_state": st.opt_state})
            )
            for s, st in targets.items()
            if st.opt_state is not None
        }
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


def _manifest_step(path: Path) -> int:
    return int(path.stem.split("-")[1])


@contextlib.contextmanager
def reading_checkpoints(cfg, coordinator: Coordinator | None = None) -> Iterator[Checkpointer]:
    """A run's checkpoints for a reader outside the run (`export`, `eval`), opened read-only.

    The reader holds the run lock of `output_dir` and `checkpoint_dir` (`training.dirlock`)
    while it reads, so a live run cannot rotate or clean the checkpoints under it (and the
    reader is refused while a run holds them); nothing is created for a directory that does not
    exist."""
    directory = Path(cfg.checkpoint_dir or Path(cfg.output_dir) / "checkpoints")
    existing = {k: d for k, d in (("output_dir", Path(cfg.output_dir)), ("checkpoint_dir", directory)) if d.is_dir()}
    coordinator = coordinator or Coordinator(cfg.distributed.timeout_s)
    with (
        hold_directories(existing, coordinator),
        Checkpointer(directory, read_only=True, coordinator=coordinator) as ckpt,
    ):
        yield ckpt


def start_from_checkpoints(cfg, states: dict[str, SectionState], programs, coordinator: Coordinator | None = None):
    """Sections with `init.checkpoint_dir` take their params from the newest committed step of
    that directory (another run: a previous training stage), their optimizer started afresh
    (`programs[s].init_optimizer`). The step's files must match their manifest's checksums and
    its params the section's shapes; otherwise a `ConfigError` names the key and what is wrong.
    The directory's run lock is held while reading, so a live run cannot rotate the step away."""
    coordinator = coordinator or Coordinator(cfg.distributed.timeout_s)
    for s, sc in cfg.sections.items():
        if sc.init is None or sc.init.checkpoint_dir is None:
            continue
        directory = Path(sc.init.checkpoint_dir).absolute()
        key = f"sections.{s}.init.checkpoint_dir={sc.init.checkpoint_dir!r}"
        if states[s].opt_state is None:
            raise ConfigError(f"error: {key}: section {s!r} is not trained; only a trained section starts from a run")
        if not directory.is_dir():
            raise ConfigError(f"error: {key}: no such directory; give another run's checkpoint_dir")
        with (
            hold_directories({f"sections.{s}.init.checkpoint_dir": directory}, coordinator),
            Checkpointer(directory, read_only=True, coordinator=coordinator) as ckpt,
        ):
            step = ckpt.latest_step()
            if step is None:
                raise ConfigError(
                    f"error: {key}: holds no committed checkpoint; give the checkpoint_dir of a run that "
                    f"saved one (default <output_dir>/checkpoints)"
                )
            try:
                manifest = json.loads((directory / MANIFEST.format(step=step)).read_text())
            except (OSError, ValueError) as err:
                raise ConfigError(f"error: {key}: the manifest of step {step} is unreadable ({err})") from None
            problem = verify_step(directory / str(step), manifest)
            if problem is not None:
                raise ConfigError(f"error: {key}: step {step} is corrupt ({problem})")
            saved = manifest.get("layout", {})
            if s not in saved:
                raise ConfigError(f"error: {key}: step {step} holds no trained section {s!r}; it holds {sorted(saved)}")

            def params_only(layout):
                return {p: v for p, v in layout.items() if p.startswith("['params']")}

            mine = params_only(state_layout({s: states[s]})[s])
            difference = layout_difference({s: params_only(saved[s])}, {s: mine})
            if difference is not None:
                raise ConfigError(f"error: {key}: step {step} does not fit models.{s} ({difference})")
            params = ckpt.restore_params(step, s, states[s].params)
        states = {
            **states,
            s: dataclasses.replace(states[s], params=params, opt_state=programs[s].init_optimizer(params)),
        }
    return states
