"""The teacher cache's format, and the source that reads it beside the samples.

`maestro-jax teacher-cache` (`tools.teacher_cache`) writes it: ArrayRecord shards in the data's
index order, one record per sample (`CacheRecord`: its id, and at each target position the
teacher's top-k token ids, their tempered log-probabilities and the log of the tail's mass),
and `manifest.json` (`Manifest`). Training from it (`distill.cache`) reads each sample's record
with the sample (`TeacherCacheSource`), as a part of it: `Sample.extras`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
from pathlib import Path

import numpy as np

from maestro_jax.config import Config, ConfigError
from maestro_jax.data.samples import DataError, Sample, SampleInfo

FORMAT = "maestro_jax.teacher_cache/1"
MANIFEST = "manifest.json"
DEFAULT_K = 64
DTYPE = "float32"  # the log-probabilities as stored (the online loss computes them in float32)


@dataclasses.dataclass(frozen=True)
class CacheIdentity:
    """What a cache was made from: training from it holds a config to each field."""

    teacher: str  # SHA-256 of the teacher's model, its weights' origin and the temperature (`teacher_identity`)
    tokenizer: (
        str | None
    )  # SHA-256 of the teacher folder's tokenizer files; None: no folder (ids as the data holds them)
    k: int
    dtype: str
    data: str  # SHA-256 of every sample's id and length, in index order (`data_fingerprint`)
    num_samples: int
    shard_samples: int  # samples per shard (the last may hold fewer)
    temperature: float


@dataclasses.dataclass(frozen=True)
class Shard:
    file: str
    samples: int
    sha256: str


@dataclasses.dataclass(frozen=True)
class Manifest:
    identity: CacheIdentity
    shards: tuple[Shard, ...]

    @property
    def complete(self) -> bool:
        return sum(s.samples for s in self.shards) == self.identity.num_samples

    def to_json(self) -> str:
        body = {
            "format": FORMAT,
            **dataclasses.asdict(self.identity),
            "complete": self.complete,
            "shards": [dataclasses.asdict(s) for s in self.shards],
        }
        return json.dumps(body, indent=1)

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        body = json.loads(text)
        fields = {f.name for f in dataclasses.fields(CacheIdentity)}
        identity = CacheIdentity(**{k: v for k, v in body.items() if k in fields})
        return cls(identity, tuple(Shard(**s) for s in body["shards"]))


@dataclasses.dataclass(frozen=True)
class CacheRecord:
    """One sample's cached teacher outputs: `ids` and `log_probs` [positions, k], `log_tail` [positions]."""

    sample_id: int
    ids: np.ndarray
    log_probs: np.ndarray
    log_tail: np.ndarray

    def encode(self) -> bytes:
        buf = io.BytesIO()
        np.savez(buf, id=np.int64(self.sample_id), ids=self.ids, log_probs=self.log_probs, log_tail=self.log_tail)
        return buf.getvalue()

    @classmethod
    def decode(cls, data: bytes) -> CacheRecord:
        with np.load(io.BytesIO(data)) as z:
            return cls(int(z["id"]), z["ids"], z["log_probs"], z["log_tail"])


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.arrayrecord"


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def teacher_identity(cfg: Config, teacher) -> str:
    """SHA-256 of what fixes the teacher's tempered distribution: its model, where its weights
    come from (a Hugging Face folder: its config.json and its weight files' names and sizes; else
    the seed they are drawn from) and the temperature."""
    path = _hf_path(cfg, teacher)
    origin = _folder_identity(Path(path)) if path else {"seed": cfg.seed}
    body = {
        "model": cfg.models[teacher.name].model_dump(mode="json"),
        "origin": origin,
        "temperature": cfg.distill.temperature,
    }
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _folder_identity(path: Path) -> dict:
    """A Hugging Face folder as the weights it holds: its config.json's SHA-256 and each weight
    file's name and size (hashing every weight byte of a large teacher at each start would cost
    minutes; a file rewritten at its very size goes unseen)."""
    config = path / "config.json"
    weights = sorted((f.name, f.stat().st_size) for f in path.glob("*.safetensors"))
    return {
        "hf_path": str(path),
        "config": hashlib.sha256(config.read_bytes()).hexdigest() if config.is_file() else None,
        "weights": weights,
    }


def _hf_path(cfg: Config, teacher) -> str | None:
    """The teacher's Hugging Face folder: `models.<t>.hf`, else its section's `init.hf_path`."""
    folder = getattr(cfg.models[teacher.name], "hf", None)
    section = cfg.sections.get(teacher.name)
    init = section.init if section is not None else None
    return folder or (init.hf_path if init is not None else None)


def tokenizer_identity(cfg: Config, teacher) -> str | None:
    """SHA-256 of the teacher folder's tokenizer files (those it holds, by name), or None."""
    path = _hf_path(cfg, teacher)
    if not path:
        return None
    h = hashlib.sha256()
    found = False
    for name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"):
        f = Path(path) / name
        if f.is_file():
            h.update(name.encode() + b"\0" + f.read_bytes())
            found = True
    return h.hexdigest() if found else None


def data_fingerprint(source) -> str:
    """SHA-256 over every sample's id and length in index order, from metadata alone."""
    from maestro_jax.data.sources import sample_info

    h = hashlib.sha256()
    for i in range(len(source)):
        info = sample_info(source, i)
        h.update(f"{info.id}:{info.length}\n".encode())
    return h.hexdigest()


def read_manifest(out: str | os.PathLike) -> Manifest | None:
    path = Path(out) / MANIFEST
    return Manifest.from_json(path.read_text()) if path.exists() else None


def read_records(out: str | os.PathLike) -> list[CacheRecord]:
    """Every record of the cache in `out`, in the data's index order."""
    reader = CacheReader(out)
    return [reader.record(i) for i in range(reader.manifest.identity.num_samples)]


def checked_source(source, out: str | os.PathLike) -> TeacherCacheSource:
    """`source` with the cache in `out` beside it, once the cache is whole and of this data:
    every shard's SHA-256 as the manifest lists it (a truncated or corrupted shard), and the
    samples' count and fingerprint (a missing, extra or changed sample); each fault one `error:`
    line naming `distill.cache`, the file and what differs."""
    reader = CacheReader(out)
    where, identity = f"distill.cache={out}", reader.manifest.identity
    if not reader.manifest.complete:
        raise ConfigError(
            f"error: {where}: the cache is incomplete ({sum(s.samples for s in reader.manifest.shards)} of "
            f"{identity.num_samples} samples); rerun `maestro-jax teacher-cache` with the same --out to finish it"
        )
    for shard in reader.manifest.shards:
        path = reader.out / shard.file
        if not path.is_file():
            raise ConfigError(f"error: {where}: {shard.file} is missing ({MANIFEST} lists it)")
        if sha256_of(path) != shard.sha256:
            raise ConfigError(
                f"error: {where}: {shard.file}: its SHA-256 is not the one {MANIFEST} lists (truncated or "
                "corrupted); delete it and rerun `maestro-jax teacher-cache` with the same --out to write it again"
            )
    if len(source) != identity.num_samples:
        raise ConfigError(
            f"error: {where}: the cache holds {identity.num_samples} samples, the data {len(source)}; valid: the "
            "data the cache was written for"
        )
    if data_fingerprint(source) != identity.data:
        raise ConfigError(
            f"error: {where}: the data's samples (ids and lengths, in order) are not those the cache was written "
            f"for ({MANIFEST} data={identity.data[:12]}...)"
        )
    return TeacherCacheSource(source, reader)


# `Sample.extras` keys of a sample's cached teacher outputs (`kd` reads them by these names)
TOP_K_IDS, TOP_K_LOG_PROBS, TOP_K_LOG_TAIL = "teacher_top_k_ids", "teacher_top_k_log_probs", "teacher_top_k_log_tail"


class CacheReader:
    """Random access to a complete cache's records by the data's sample index."""

    def __init__(self, out: str | os.PathLike):
        self.out = Path(out)
        manifest = read_manifest(self.out)
        if manifest is None:
            raise ConfigError(
                f"error: distill.cache={out}: no {MANIFEST} there; valid: a folder `maestro-jax teacher-cache` wrote"
            )
        self.manifest = manifest
        self._readers: dict[int, object] = {}

    def _reader(self, shard: int):
        from array_record.python.array_record_module import ArrayRecordReader

        if shard not in self._readers:
            self._readers[shard] = ArrayRecordReader(str(self.out / self.manifest.shards[shard].file))
        return self._readers[shard]

    def record(self, index: int) -> CacheRecord:
        per = self.manifest.identity.shard_samples
        shard = index // per
        if shard >= len(self.manifest.shards):
            raise DataError(
                f"{self.out / MANIFEST}: sample index {index} is beyond the cache's {self.manifest.identity.num_samples}"
            )
        return CacheRecord.decode(self._reader(shard).read([index % per])[0])

    def __getstate__(self):  # readers hold file handles: a copy (a Grain worker) opens its own
        return {**self.__dict__, "_readers": {}}


@dataclasses.dataclass
class TeacherCacheSource:
    """`source`'s samples, each with its cached teacher outputs in `Sample.extras` (the record
    of its index, whose id must be the sample's). The cache is a part of the sample named
    `TEACHER_PART`: a read that leaves it out (another process's rows) skips the cache too."""

    source: object
    reader: CacheReader

    def __len__(self) -> int:
        return len(self.source)

    def info(self, index: int) -> SampleInfo:
        from maestro_jax.data.sources import sample_info

        return sample_info(self.source, index)

    def where(self, index: int) -> str:
        where = getattr(self.source, "where", None)
        return where(index) if where is not None else f"sample index {index}"

    def __getitem__(self, index: int) -> Sample:
        return self._with_cache(index, self.source[index])

    def read(self, index: int, parts: frozenset[str] | None) -> tuple[Sample, int | None]:
        from maestro_jax.data.sources import read_parts

        sample, size = read_parts(self.source, index, parts)
        if parts is not None and TEACHER_PART not in parts:
            return sample, size
        return self._with_cache(index, sample), size

    def _with_cache(self, index: int, sample: Sample) -> Sample:
        record = self.reader.record(index)
        if record.sample_id != sample.id:
            raise DataError(
                f"{self.reader.out}: record {index} holds sample id={record.sample_id}, the data's sample there is "
                f"id={sample.id} (the cache was written for other data)"
            )
        n = len(sample.tokens) - 1
        if record.ids.shape[0] != n:
            raise DataError(f"sample id={sample.id}: the cache holds {record.ids.shape[0]} positions, the sample {n}")
        extras = {TOP_K_IDS: record.ids, TOP_K_LOG_PROBS: record.log_probs, TOP_K_LOG_TAIL: record.log_tail}
        return dataclasses.replace(sample, extras={**sample.extras, **extras})


TEACHER_PART = "teacher_cache"  # the sample part a cache's records are (`data.samples.parts_of`)
