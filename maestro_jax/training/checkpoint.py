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
split or mesh layout. With several processes, every section saves and restores through one
layout over all devices (`SaveLayout`), whichever processes its mesh spans; such a checkpoint
restores onto any process count.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import os
import shutil
import traceback
from collections.abc import Iterator
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from maestro_jax.config import ConfigError
from maestro_jax.runtime.distributed import Coordinator, PeerError
from maestro_jax.runtime.programs import SectionState
from maestro_jax.runtime.transfer import transfer
from maestro_jax.training.dirlock import hold_directories
from maestro_jax.training.manifest import MANIFEST, file_checksums, layout_difference, state_layout, verify_step
from maestro_jax.training.storage import StorageError

log = logging.getLogger("maestro_jax")


class CheckpointError(StorageError):
    """A checkpoint could not be written or read; the message names the step, the path and why."""


class CheckpointMismatchError(ConfigError):
    """An intact checkpoint that the current config cannot resume (a changed model, optimizer or
    precision): refused before training, the checkpoint left in place."""


def _save_sharding(shape: tuple[int, ...], mesh: Mesh) -> NamedSharding:
    """Where a leaf lies while a multi-process run saves or restores it: split along its first
    dimension the device count divides, else (small leaves: biases of odd widths, counters)
    replicated on every device."""
    for d, size in enumerate(shape):
        if size % mesh.devices.size == 0:
            return NamedSharding(mesh, P(*(None,) * d, "save"))
    return NamedSharding(mesh, P())


class SaveLayout:
    """A multi-process run saves every section through one layout over all devices.

    Orbax writes global arrays in whose save every process takes part (it refuses an array that
    one process holds alone: `Cannot serialize host local jax.Array`), but a section's mesh may
    lie in one process, span all of them, or span a subset (the paper's layout: the vision tower
    on one host, the LLM across the others). So each leaf moves to `_save_sharding` over the mesh
    of all devices before a save (device to device, `runtime.transfer`), and back to its
    section's sharding after a restore. The checkpoint is Orbax's layout-free format: it restores
    onto any process count, device split or mesh. The copy lives until Orbax has staged it to
    host memory; split over all N devices, it costs each device about 1/N of the state. A single
    process saves its arrays as they are (`for_run` gives None)."""

    def __init__(self):
        self.mesh = Mesh(np.array(jax.devices()), ("save",), axis_types=(AxisType.Auto,))

    @classmethod
    def for_run(cls) -> SaveLayout | None:
        return cls() if jax.process_count() > 1 else None

    def target(self, x) -> jax.ShapeDtypeStruct:
        """The abstract leaf Orbax restores into."""
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=_save_sharding(tuple(x.shape), self.mesh))

    def gather(self, x: jax.Array) -> jax.Array:
        """`x` (in its section's sharding) in the save layout. Every process calls it, in one order."""
        if x.ndim == 0:  # a transfer moves rows: a scalar travels as one row
            row = _reshaped(x, (1,), NamedSharding(x.sharding.mesh, P()))
            return _reshaped(transfer(row, NamedSharding(self.mesh, P())), (), NamedSharding(self.mesh, P()))
        return transfer(x, _save_sharding(tuple(x.shape), self.mesh))

    def scatter(self, v: jax.Array, sharding: NamedSharding) -> jax.Array:
        """A restored leaf `v` (save layout) placed in its section's `sharding`."""
        if v.ndim == 0:
            row = transfer(_reshaped(v, (1,), NamedSharding(self.mesh, P())), NamedSharding(sharding.mesh, P()))
            return _reshaped(row, (), sharding)
        return transfer(v, sharding)


def _reshaped(x: jax.Array, shape: tuple[int, ...], sharding: NamedSharding) -> jax.Array:
    """`x` reshaped on its own devices (a call that does nothing on processes holding none of them)."""
    return _reshape_program(shape, sharding)(x)


@functools.lru_cache(maxsize=256)
def _reshape_program(shape: tuple[int, ...], sharding: NamedSharding):
    return jax.jit(lambda v: v.reshape(shape), out_shardings=sharding)


class _OrbaxErrors(logging.Filter):
    """Orbax logs every failure of an asynchronous save from each of its threads, with a traceback
    (dozens on a full disk), and asyncio reports its failed write futures again at exit ("Future
    exception was never retrieved"); the same error reaches the user once, as the
    `CheckpointError` of `save` or `close`. Such records (logged from Orbax, or carrying an
    exception raised inside it) go to the `maestro_jax.orbax` logger at DEBUG instead, and so do
    the notes Orbax logs on opening a directory read-only (`READ_ONLY_NOTES`)."""

    # what Orbax says, at WARNING, each time a reader opens a directory read-only (`export`,
    # `eval`): the options it asked for, restated; nothing for a user to act on
    READ_ONLY_NOTES = (
        "CheckpointManagerOptions.read_only=True, setting",
        "Given directory is read only=",
    )

    def filter(self, record: logging.LogRecord) -> bool:
        if _in_orbax(record.pathname) and record.getMessage().startswith(self.READ_ONLY_NOTES):
            log.getChild("orbax").debug("%s", record.getMessage())
            return False
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
        self.save_layout = SaveLayout.for_run()
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
        except Exception as err:  # Orbax's barrier after creating the directory: a late or lost peer
            peer = self.coordinator.peer_fault(err, "opening the checkpoint directory")
            if peer is None:
                raise
            raise peer from None
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
        gather = self.save_layout.gather if self.save_layout else (lambda x: x)
        items = {
            f"section_{s}": ocp.args.StandardSave(
                jax.tree.map(gather, {"params": st.params, "opt_state": st.opt_state})
            )
            for s, st in states.items()
            if st.opt_state is not None
        }
        items["data"] = ocp.args.JsonSave(data_state)
        items["meta"] = ocp.args.JsonSave({**meta, "step": step})
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
        layout = self.save_layout

        def abstract(x):
            return layout.target(x) if layout else jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)

        view = {"params": jax.tree.map(abstract, target)}
        args = ocp.args.PyTreeRestore(
            view, restore_args=ocp.checkpoint_utils.construct_restore_args(view), partial_restore=True
        )
        params = self.manager.restore(step, args=ocp.args.Composite(**{f"section_{section}": args}))
        params = params[f"section_{section}"]["params"]
        return jax.tree.map(lambda v, t: layout.scatter(v, t.sharding), params, target) if layout else params

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
        target = self.save_layout.target if self.save_layout else (lambda x: x)
        items = {
            f"section_{s}": ocp.args.StandardRestore(
                jax.tree.map(target, {"params": st.params, "opt_state": st.opt_state})
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
                mine = {"params": st.params, "opt_state": st.opt_state}
                part = got[f"section_{s}"]
                if self.save_layout:
                    part = jax.tree.map(lambda v, t: self.save_layout.scatter(v, t.sharding), part, mine)
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
    coordinator = coordinator or Coordinator(cfg.distributed.timeout_s, cfg.distributed.startup_timeout_s)
    with (
        hold_directories(existing, coordinator),
        Checkpointer(directory, read_only=True, coordinator=coordinator) as ckpt,
    ):
        yield ckpt


def check_start_points(cfg) -> None:
    """Before anything compiles: each `sections.<s>.init.checkpoint_dir` of a run that starts
    fresh (its own checkpoint directory holds no step) names a directory holding a saved step
    (its manifest). The rest (a committed step, checksums, shapes) is checked as the section
    starts from it (`start_from_checkpoints`); a resume reads its own checkpoints instead."""
    if cfg.output_dir and cfg.keep_checkpoints:
        own = Path(cfg.checkpoint_dir or Path(cfg.output_dir) / "checkpoints")
        if any(own.glob(MANIFEST.format(step="*"))):
            return
    for s, sc in cfg.sections.items():
        if sc.init is None or sc.init.checkpoint_dir is None:
            continue
        directory = Path(sc.init.checkpoint_dir).absolute()
        key = f"sections.{s}.init.checkpoint_dir={sc.init.checkpoint_dir!r}"
        if not directory.is_dir():
            raise ConfigError(f"error: {key}: no such directory; give another run's checkpoint_dir")
        if not any(directory.glob(MANIFEST.format(step="*"))):
            raise ConfigError(
                f"error: {key}: holds no committed checkpoint; give the checkpoint_dir of a run that "
                f"saved one (default <output_dir>/checkpoints)"
            )


def start_from_checkpoints(cfg, states: dict[str, SectionState], programs, coordinator: Coordinator | None = None):
    """Sections with `init.checkpoint_dir` take their params from the newest committed step of
    that directory (another run: a previous training stage), their optimizer started afresh
    (`programs[s].init_optimizer`). The step's files must match their manifest's checksums and
    its params the section's shapes; otherwise a `ConfigError` names the key and what is wrong.
    The directory's run lock is held while reading, so a live run cannot rotate the step away."""
    coordinator = coordinator or Coordinator(cfg.distributed.timeout_s, cfg.distributed.startup_timeout_s)
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
