"""A teacher's outputs computed once and kept as data (`maestro-jax teacher-cache`).

A KD config's teacher runs alone, on its own section's plan (devices, mesh, micro-batch,
precision), over every sample of the config's data once, and for each sample writes, at every
target position, the teacher's `k` likeliest tokens, their tempered log-probabilities and the log
of the mass left to the rest of the vocabulary (`workloads.kd.TopK`: what `distill.top_k` trains
with). Records go to ArrayRecord shards in the data's index order, one record per sample (its id
inside), `shard_batches` global batches a shard; `manifest.json` says what the cache was made
from (the teacher's identity, the tokenizer, k, the dtype, the data's fingerprint) and lists
the complete shards with their SHA-256. A shard is written under a temporary name and renamed
once complete, and the manifest rewritten after it (atomically), so a killed run resumes from
its last complete shard: the batches of a shard are always the same samples, so a resumed cache
is the uninterrupted one byte for byte.

Across processes (`--coordinator`, `--num-processes`, `--process-id`, as `train`), every process
runs the same steps (the teacher's programs are SPMD over its section's devices), and the
processes that hold a teacher device take turns writing: shard `i` is written by the `i % n`-th
of them, on a folder every process sees (a shared file system); each shard's name, count and
checksum then reach every process, and process 0 rewrites the manifest. Resuming, process 0
reads the manifest and checks the shards, and every process starts from what it found.

What it runs today: one teacher (`models.teacher`, or `models.teachers` with a single entry),
unstaged and unpacked; other layouts are refused before any compute.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from pathlib import Path

from maestro_jax.config import Config, ConfigError
from maestro_jax.data.teacher_cache import (
    DEFAULT_K,
    DTYPE,
    MANIFEST,
    CacheIdentity,
    CacheRecord,
    Manifest,
    Shard,
    data_fingerprint,
    read_manifest,
    sha256_of,
    shard_name,
    teacher_identity,
    tokenizer_identity,
)


def cached_teacher(cfg: Config):
    """The one teacher a cache is written for (`kd.Teacher`), or a ConfigError naming what the
    cache cannot run yet."""
    from maestro_jax.workloads.kd import teachers_of

    if cfg.distill.cache is not None:
        raise ConfigError(
            f"error: distill.cache={cfg.distill.cache}: this config trains from a teacher cache; teacher-cache "
            "writes one from a config that runs the teacher (leave distill.cache out)"
        )
    if cfg.workload != "kd":
        raise ConfigError(f"error: workload={cfg.workload!r}: teacher-cache runs a kd config's teacher; valid: kd")
    teachers = teachers_of(cfg)
    if len(teachers) != 1:
        names = ", ".join(t.name for t in teachers)
        raise ConfigError(
            f"error: models.teachers: {len(teachers)} teachers ({names}); teacher-cache runs one teacher "
            "(models.teacher, or models.teachers with one entry)"
        )
    (teacher,) = teachers
    section = cfg.sections[teacher.name]
    if section.stages > 1:
        raise ConfigError(
            f"error: sections.{teacher.name}.stages={section.stages}: teacher-cache runs the teacher unstaged; valid: 1"
        )
    if section.pack > 1:
        raise ConfigError(
            f"error: sections.{teacher.name}.pack={section.pack}: teacher-cache runs the teacher unpacked; valid: 1"
        )
    return teacher


def identity_of(cfg: Config, source, k: int, shard_samples: int) -> CacheIdentity:
    teacher = cached_teacher(cfg)
    return CacheIdentity(
        teacher=teacher_identity(cfg, teacher),
        tokenizer=tokenizer_identity(cfg, teacher),
        k=k,
        dtype=DTYPE,
        data=data_fingerprint(source),
        num_samples=len(source),
        shard_samples=shard_samples,
        temperature=cfg.distill.temperature,
    )


def check_k(k: int, vocab: int) -> None:
    if not 1 <= k < vocab:
        raise ConfigError(f"error: --top-k={k}: the teacher's vocabulary has {vocab} tokens; valid: 1 to {vocab - 1}")


def _write_manifest(out: Path, manifest: Manifest) -> None:
    tmp = out / (MANIFEST + ".tmp")
    tmp.write_text(manifest.to_json())
    os.replace(tmp, out / MANIFEST)


def resumable_shards(out: Path, identity: CacheIdentity) -> tuple[Shard, ...]:
    """The complete shards a cache in `out` already holds for `identity`, each still matching its
    checksum (a shard that does not is written again, with every one after it); a cache of
    anything else in `out` is refused (ConfigError naming the field that differs)."""
    manifest = read_manifest(out)
    if manifest is None:
        return ()
    if manifest.identity != identity:
        theirs, ours = dataclasses.asdict(manifest.identity), dataclasses.asdict(identity)
        field = next(f for f in ours if theirs[f] != ours[f])
        raise ConfigError(
            f"error: --out={out}: holds a teacher cache of another {field} ({theirs[field]!r}, this run's "
            f"{ours[field]!r}); valid: an empty folder, or this cache's own"
        )
    kept = []
    for shard in manifest.shards:
        if not (out / shard.file).is_file() or sha256_of(out / shard.file) != shard.sha256:
            break
        kept.append(shard)
    return tuple(kept)


@dataclasses.dataclass(frozen=True)
class _TeacherRun:
    """What a micro-step of the teacher needs: its section's states and program, the output layer
    on the teacher's devices, and the top-k program, whose result every device of the teacher's
    mesh holds whole (so each process that holds one reads it without a gather)."""

    rt: object
    states: dict
    teacher: object
    head: object
    top_k: Callable

    @classmethod
    def start(cls, rt, teacher, temperature: float, k: int) -> _TeacherRun:
        import jax
        from jax.sharding import NamedSharding, PartitionSpec

        from maestro_jax.runtime.transfer import transfer
        from maestro_jax.workloads.kd import tempered_log_probs, top_k_of

        states = rt.init_states(optimizer=False)  # forwards only: no student optimizer state held
        everywhere = NamedSharding(rt.programs[teacher.name].mesh, PartitionSpec())
        head = transfer(states["student"].consts[teacher.head], everywhere)  # the student's devices may be elsewhere
        top_k = jax.jit(
            lambda hidden, head: top_k_of(tempered_log_probs(hidden, head, teacher.model, temperature), k),
            out_shardings=everywhere,
        )
        return cls(rt, states, teacher, head, top_k)

    @property
    def readers(self) -> list[int]:
        """The processes holding a device of the teacher's section: those that read its results."""
        return sorted({d.process_index for d in self.rt.programs[self.teacher.name].mesh.devices.flat})

    def records(self, samples) -> list[CacheRecord]:
        """`samples`' records: the teacher section's micro-steps of their schedule, each through
        the output layer and the top-k, read back per sample (empty on a process that holds no
        teacher device: it runs the same steps, as every process of an SPMD program must)."""
        import jax

        rt, name = self.rt, self.teacher.name
        program, section = rt.programs[name], rt.graph.section(name)
        reads = jax.process_index() in self.readers
        schedule = rt.schedule(samples)
        out = {}
        for st in schedule.steps[name]:
            rows = [samples[i] if i >= 0 else None for i in st.positions]
            batch = program.put_batch(section.host_batch(rows, schedule.routes(rt.problem, name, st.index)))
            top = self.top_k(program.forward(self.states[name], {}, batch)[self.teacher.edge], self.head)
            if not reads:
                continue
            top = jax.device_get(top)
            for r, i in enumerate(st.positions):
                if i >= 0:
                    n = len(samples[i].tokens) - 1
                    out[i] = CacheRecord(samples[i].id, top.ids[r, :n], top.log_probs[r, :n], top.log_tail[r, :n])
        return [out[i] for i in sorted(out)]


def _agreed_shards(rt, out: Path, identity: CacheIdentity) -> tuple[Shard, ...]:
    """`resumable_shards` as process 0 finds them, on every process (its refusal too)."""
    import jax

    found = None
    if jax.process_index() == 0:
        try:
            found = {"shards": [dataclasses.asdict(s) for s in resumable_shards(out, identity)]}
        except ConfigError as err:
            found = {"error": str(err)}
    found = rt.coordinator.agree("teacher-cache resume", found)
    if "error" in found:
        raise ConfigError(found["error"])
    return tuple(Shard(**s) for s in found["shards"])


def write_cache(
    cfg: Config,
    out: str | os.PathLike,
    k: int = DEFAULT_K,
    shard_batches: int = 4,
    say: Callable[[str], None] = print,
) -> Manifest:
    """Write (or finish) the teacher cache of `cfg` in `out`; returns its manifest. Checks come
    first (the teacher, `k`, `out`'s own cache), then the teacher's programs compile."""
    import jax

    from maestro_jax.data.pipeline import every_sample_once
    from maestro_jax.runtime.build import build_runtime

    teacher = cached_teacher(cfg)
    check_k(k, teacher.model.vocab)
    out = Path(out)
    rt = build_runtime(cfg)
    shard_samples = shard_batches * cfg.global_batch
    identity = identity_of(cfg, rt.source, k, shard_samples)
    shards = list(_agreed_shards(rt, out, identity))
    out.mkdir(parents=True, exist_ok=True)
    manifest = Manifest(identity, tuple(shards))
    if manifest.complete:
        say(f"teacher-cache: {out} is complete ({len(shards)} shards, {identity.num_samples} samples)")
        return manifest
    total = -(-identity.num_samples // shard_samples)
    run = _TeacherRun.start(rt, teacher, cfg.distill.temperature, k)
    writers = run.readers
    say(
        f"teacher-cache: {identity.num_samples} samples in {total} shards of {shard_samples}, top {k}; "
        f"{len(shards)} complete already" + (f"; processes {writers} write in turn" if jax.process_count() > 1 else "")
    )
    batches = every_sample_once(rt.source, cfg.global_batch, rt.check)
    start, done = time.perf_counter(), 0
    for index in range(len(shards), total):
        span = range(index * shard_batches, min((index + 1) * shard_batches, len(batches)))
        # the shard's teacher steps all run before its file opens: on jaxlib 0.12's CPU client a
        # cross-process collective issued while the writing process held the shard's
        # ArrayRecordWriter open never completed (teacher spanning both processes; 0.10.2 passes)
        records = [r for b in span for r in run.records(batches[b])]
        writer = writers[index % len(writers)]
        shards.append(_shard_in_turn(rt, out / shard_name(index), records, writer))
        manifest = Manifest(identity, tuple(shards))
        if jax.process_index() == 0:
            _write_manifest(out, manifest)
        done += shards[-1].samples
        rate = done / max(time.perf_counter() - start, 1e-9)
        by = f" by process {writer}" if jax.process_count() > 1 else ""
        say(f"teacher-cache: shard {index + 1}/{total} written{by} ({done} samples this run, {rate:.1f} samples/s)")
    return manifest


def _shard_in_turn(rt, path: Path, records: list[CacheRecord], writer: int) -> Shard:
    """The shard of `records` at `path`, written by process `writer` (the others ran the same
    steps and drop theirs), then its name, count and checksum on every process."""
    import jax

    written = dataclasses.asdict(_write_shard(path, records)) if jax.process_index() == writer else None
    return Shard(**next(w for w in rt.coordinator.gather("teacher-cache shard", written) if w))


def _write_shard(path: Path, records) -> Shard:
    """`records` as the ArrayRecord file `path`: written under a temporary name and renamed once
    complete, so a shard under its own name is always whole."""
    from array_record.python.array_record_module import ArrayRecordWriter

    tmp = path.with_name(path.name + ".tmp")
    writer = ArrayRecordWriter(str(tmp), "group_size:1")  # one record a group: read one at a time
    count = 0
    for record in records:
        writer.write(record.encode())
        count += 1
    writer.close()
    os.replace(tmp, path)
    return Shard(path.name, count, sha256_of(path))
