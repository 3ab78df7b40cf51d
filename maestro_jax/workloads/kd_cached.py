"""Knowledge distillation from a teacher cache (`distill.cache: DIR`): no teacher section
(`kd.build_cached` builds the graph; this module checks the cache and lays out its records).

`maestro-jax teacher-cache` wrote, for every sample, the teacher's top-k tokens and tempered
log-probabilities at each position and the log of the tail's mass (`data.teacher_cache`); the
data source attaches each sample's record to it (`TeacherCacheSource`), the student's host batch
lays the records out as its rows are, and the student's loss is the top-k one
(`kd.sparse_kl`): the online run of the same config with `distill.top_k: k` is the step this
one must equal. `models.teacher` still names the teacher, which the cache must have been made
from (checked before any compute, with the temperature, `k` and the data); the student starts
from the weights the online run's student starts from.
"""

from __future__ import annotations

import numpy as np

from maestro_jax.config import Config, ConfigError
from maestro_jax.data.teacher_cache import (
    MANIFEST,
    TOP_K_IDS,
    TOP_K_LOG_PROBS,
    TOP_K_LOG_TAIL,
    Manifest,
    read_manifest,
    teacher_identity,
    tokenizer_identity,
)
from maestro_jax.workloads import rows as R

TOP_K_KEYS = (TOP_K_IDS, TOP_K_LOG_PROBS, TOP_K_LOG_TAIL)  # the host batch's arrays, in `kd.TopK`'s order


def checked_manifest(cfg: Config, teacher) -> Manifest:
    """The cache's manifest, held to the config: one `error:` line naming the file and the field
    that differs (the teacher, the tokenizer, the temperature, `distill.top_k`), or saying the
    cache is incomplete."""
    where = f"distill.cache={cfg.distill.cache}"
    manifest = read_manifest(cfg.distill.cache)
    if manifest is None:
        raise ConfigError(f"error: {where}: no {MANIFEST} there; valid: a folder `maestro-jax teacher-cache` wrote")
    if not manifest.complete:
        done = sum(s.samples for s in manifest.shards)
        raise ConfigError(
            f"error: {where}: the cache is incomplete ({done} of {manifest.identity.num_samples} samples); "
            "rerun `maestro-jax teacher-cache` with the same --out to finish it"
        )
    identity = manifest.identity
    if identity.temperature != cfg.distill.temperature:
        raise ConfigError(
            f"error: distill.temperature={cfg.distill.temperature}: the cache in {cfg.distill.cache} holds the "
            f"teacher at temperature {identity.temperature}; valid: {identity.temperature}"
        )
    if cfg.distill.top_k is not None and cfg.distill.top_k != identity.k:
        raise ConfigError(
            f"error: distill.top_k={cfg.distill.top_k}: the cache in {cfg.distill.cache} holds the top "
            f"{identity.k}; valid: {identity.k} (or unset: the cache's)"
        )
    if identity.teacher != teacher_identity(cfg, teacher):
        raise ConfigError(
            f"error: models.{teacher.name}: not the teacher the cache in {cfg.distill.cache} was made from (its "
            f"model, weights' origin or temperature differ: {MANIFEST} teacher={identity.teacher[:12]}...)"
        )
    if identity.tokenizer != tokenizer_identity(cfg, teacher):
        raise ConfigError(
            f"error: models.{teacher.name}: its tokenizer is not the one the cache in {cfg.distill.cache} was made "
            f"with ({MANIFEST} tokenizer={identity.tokenizer})"
        )
    return manifest


def one_teacher(cfg: Config, teachers):
    """The one teacher (`kd.Teacher`) a cache holds the outputs of."""
    if len(teachers) != 1:
        raise ConfigError(
            f"error: distill.cache={cfg.distill.cache}: a cache holds one teacher's outputs, the config names "
            f"{len(teachers)} ({', '.join(t.name for t in teachers)}); valid: models.teacher alone"
        )
    return teachers[0]


def check_student_layout(cfg: Config) -> None:
    if cfg.eval is not None:
        raise ConfigError(
            f"error: eval: a run from a teacher cache (distill.cache={cfg.distill.cache}) has the teacher's outputs "
            "for its training data only, not for held-out data; valid: no eval block for now"
        )
    section = cfg.sections["student"]
    if section.stages > 1:
        raise ConfigError(
            f"error: sections.student.stages={section.stages}: a student trained from a teacher cache runs "
            "unstaged for now; valid: 1"
        )
    if section.pack > 1:
        raise ConfigError(
            f"error: sections.student.pack={section.pack}: a student trained from a teacher cache runs unpacked "
            "for now; valid: 1"
        )


def cached_rows(rows, k: int, per_octave: int) -> dict[str, np.ndarray]:
    """`text_rows` and each row's cached top-k laid out as its positions are (zeros past a
    sample's end and in a row no sample fills, which the loss mask leaves out)."""
    out = R.text_rows(rows, per_octave=per_octave)
    length = out["input_ids"].shape[1]
    ids = np.zeros((len(rows), length, k), np.int32)
    log_probs = np.zeros((len(rows), length, k), np.float32)
    log_tail = np.zeros((len(rows), length), np.float32)
    for i, s in enumerate(rows):
        if s is None or TOP_K_IDS not in s.extras:  # padding, or a row another process places
            continue
        n = len(s.tokens) - 1
        ids[i, :n], log_probs[i, :n], log_tail[i, :n] = (
            s.extras[TOP_K_IDS],
            s.extras[TOP_K_LOG_PROBS],
            s.extras[TOP_K_LOG_TAIL],
        )
    return {**out, TOP_K_IDS: ids, TOP_K_LOG_PROBS: log_probs, TOP_K_LOG_TAIL: log_tail}
