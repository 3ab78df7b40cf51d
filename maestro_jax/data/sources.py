"""Random-access sample sources (Grain's `RandomAccessDataSource` protocol: `__len__`,
`__getitem__`), plus optional methods the multi-process data path and its error messages use:
  `info(index)`: a sample's id, length and item shapes without its payload, which is all the
      scheduler and the planner read (every process reads every sample's info);
  `read(index, parts)`: the sample with only `parts` decoded (`tokens`, modality names) and
      the others hollow, plus the bytes read from storage: a process decodes only the payload
      its devices' rows need;
  `where(index)`: where the sample is stored (`record R of FILE`), which the pipeline puts in
      front of every validation error so that a bad sample can be found in the data.
`sample_info` and `read_parts` fall back to a full `__getitem__` for sources without them."""

from __future__ import annotations

import dataclasses
import json
import struct
import zipfile
import zlib
from pathlib import Path

import numpy as np

from maestro_jax.data.samples import (
    TOKENS,
    DataError,
    Modality,
    Sample,
    SampleInfo,
    decode_sample,
    hollow_sample,
    record_info,
    text_ids,
)


@dataclasses.dataclass(frozen=True)
class SyntheticItems:
    """Items of one modality in synthetic samples: `fraction` of samples carry 1..`max_items`
    items, each of a spatial size drawn from `sizes`."""

    modality: Modality
    fraction: float
    max_items: int
    sizes: tuple[tuple[int, ...], ...]


@dataclasses.dataclass(frozen=True)
class SyntheticSource:
    """A deterministic random-access source: sample `i` is a pure function of `(seed, i)`, so
    any host can rebuild any sample, and `info(i)` costs no payload.

    Text follows a noisy affine bigram rule (next = 7 * prev + 3 mod span, 90% of the time) over
    the ids `text_ids` gives (none is a placeholder of `items` or `reserved`) so that loss can
    fall. Each modality's placeholders go in at a random text position.
    """

    num_samples: int
    vocab: int
    text_len: tuple[int, int]
    items: tuple[SyntheticItems, ...] = ()
    seed: int = 0
    reserved: tuple[int, ...] = ()  # ids text never takes: every placeholder of the workload, items or not
    tags: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (name, values): each sample takes one value, uniformly

    def _tags(self, index: int) -> dict[str, str]:
        """Each tag's value for sample `index`, from a random stream of its own (so that adding a
        tag leaves the text and items as they were)."""
        out = {}
        for k, (name, values) in enumerate(self.tags):
            out[name] = values[int(np.random.default_rng([self.seed, int(index), 1000 + k]).integers(len(values)))]
        return out

    def __len__(self) -> int:
        return self.num_samples

    def _item_shapes(self, index: int) -> dict[str, list[tuple[int, ...]]]:
        out = {}
        for k, spec in enumerate(self.items):
            rng = np.random.default_rng([self.seed, int(index), 1 + k])
            if spec.sizes and rng.random() < spec.fraction:
                n = int(rng.integers(1, spec.max_items, endpoint=True))
                out[spec.modality.name] = [spec.sizes[int(rng.integers(len(spec.sizes)))] for _ in range(n)]
        return out

    def longest(self) -> int:
        """The most tokens a sample can hold: the longest text with the most items of each
        modality, each of its largest size (what a token budget must hold whole)."""
        items = sum(
            spec.max_items * max((spec.modality.tokens(s) for s in spec.sizes), default=0) for spec in self.items
        )
        return self.text_len[1] + items

    def info(self, index: int) -> SampleInfo:
        length = int(np.random.default_rng([self.seed, int(index)]).integers(*self.text_len, endpoint=True))
        shapes = self._item_shapes(index)
        for spec in self.items:
            length += sum(spec.modality.tokens(s) for s in shapes.get(spec.modality.name, ()))
        return SampleInfo(
            int(index),
            length,
            {m: tuple(tuple(s) + (self._channels(m),) for s in v) for m, v in shapes.items()},
            self._tags(index),
        )

    def _channels(self, name: str) -> int:
        return next(s.modality.channels for s in self.items if s.modality.name == name)

    def __getitem__(self, index: int) -> Sample:
        return self.read(index, None)[0]

    def read(self, index: int, parts: frozenset[str] | None) -> tuple[Sample, int]:
        """Sample `index` with only `parts` generated (None: all); nothing is read from storage.
        Text and each modality's items come from their own random streams, so one part is
        produced without the others."""
        index = int(index)
        rng = np.random.default_rng([self.seed, index])
        length = int(rng.integers(*self.text_len, endpoint=True))
        shapes = self._item_shapes(index)
        out: dict[str, object] = {}
        if parts is None or TOKENS in parts:
            out[TOKENS] = self._tokens(rng, length, shapes)
        for k, spec in enumerate(self.items):
            m = spec.modality
            if m.name in shapes and (parts is None or m.name in parts):
                item_rng = np.random.default_rng([self.seed, index, 100 + k])
                out[m.name] = tuple(
                    item_rng.standard_normal((*sh, m.channels)).astype(np.float32) for sh in shapes[m.name]
                )
        if parts is None:
            return Sample(index, out.pop(TOKENS), out, tags=self._tags(index)), 0
        return hollow_sample(self.info(index), out), 0

    def _tokens(self, rng, length: int, shapes) -> np.ndarray:
        ids = text_ids(self.vocab, (*self.reserved, *(spec.modality.placeholder for spec in self.items)))
        span = len(ids)
        text = np.empty(length, np.int64)
        text[0] = rng.integers(span)
        noise = rng.integers(span, size=length)
        follow = rng.random(length) < 0.9
        for i in range(1, length):
            text[i] = (7 * text[i - 1] + 3) % span if follow[i] else noise[i]
        text = ids[text]
        for spec in self.items:
            m = spec.modality
            if m.name in shapes:
                placeholders = np.full(sum(m.tokens(sh) for sh in shapes[m.name]), m.placeholder)
                cut = int(rng.integers(0, len(text)))
                text = np.concatenate([text[:cut], placeholders, text[cut:]])
        return text.astype(np.int32)


@dataclasses.dataclass(frozen=True)
class ArrayRecordSource:
    """Samples stored as ArrayRecord files (`scripts/convert_images.py` writes them), in the
    order of `paths`. A record that cannot be read or decoded fails as a DataError naming its
    file and record (`where`), and so do the pipeline's checks of what decodes: a bad sample is
    found in the data by its location, not only by its id.

    `info` reads `<file>.index.json` (`write_index`) where a file has one: metadata then costs
    no record read. Without an index it reads the record and decodes its npy headers only."""

    paths: tuple[str, ...]
    key: str = "data.paths"  # the config key that named the paths, for the errors (`eval.data.paths`)

    def __post_init__(self):
        files, indexes = [], []
        for p in self.paths:
            files.append(_open_array_record(p, self.key))
            index = Path(f"{p}.index.json")
            rows = json.loads(index.read_text()) if index.is_file() else None
            if rows is not None and len(rows) != len(files[-1]):
                raise DataError(
                    f"{self.key}: {index} lists {len(rows)} records but {p} holds {len(files[-1])}; "
                    f"rewrite it with write_index"
                )
            indexes.append(rows)
        object.__setattr__(self, "_files", tuple(files))
        object.__setattr__(self, "_indexes", tuple(indexes))
        object.__setattr__(self, "_starts", np.cumsum([0] + [len(f) for f in files]))

    def __len__(self) -> int:
        return int(self._starts[-1])

    def _locate(self, index: int) -> tuple[int, int]:
        """(file number, record number in that file) of the source's `index`-th record."""
        if not 0 <= index < len(self):
            raise IndexError(f"record {index} of a source of {len(self)}")
        f = int(np.searchsorted(self._starts, index, side="right")) - 1
        return f, int(index - self._starts[f])

    def where(self, index: int) -> str:
        f, record = self._locate(int(index))
        return f"record {record} of {self.paths[f]}"

    def _record(self, index: int) -> bytes:
        f, record = self._locate(int(index))
        try:
            return self._files[f][record]
        except (RuntimeError, ValueError, KeyError, OSError, IndexError) as err:  # Riegeli: RuntimeError
            raise DataError(f"{self.where(index)}: cannot be read ({_first_line(err)})") from err

    def _decode(self, index: int, fn, *args):
        try:
            return fn(*args)
        except _DAMAGED as err:
            raise DataError(f"{self.where(index)}: cannot be decoded ({_first_line(err)})") from err

    def __getitem__(self, index: int) -> Sample:
        return self._decode(index, decode_sample, self._record(index))

    def read(self, index: int, parts: frozenset[str] | None) -> tuple[Sample, int]:
        record = self._record(index)
        return self._decode(index, decode_sample, record, parts), len(record)

    def info(self, index: int) -> SampleInfo:
        f, record = self._locate(int(index))
        if self._indexes[f] is not None:
            sample_id, length, shapes, *tags = self._indexes[f][record]  # older indexes hold no tags
            shapes = {m: tuple(tuple(s) for s in v) for m, v in shapes.items()}
            return SampleInfo(sample_id, length, shapes, tags[0] if tags else {})
        return self._decode(index, record_info, self._record(index))


# What a record damaged inside (a flipped bit the file's own checksums did not catch, because it
# happened before the record was written) raises from numpy's npz reader and the zipfile and
# zlib modules under it: a bad zip directory or CRC, a garbled deflate stream or npy header, a
# truncated member, a flag bit zipfile does not implement, a missing array.
_DAMAGED = (
    ValueError,
    KeyError,
    OSError,
    EOFError,
    IndexError,
    NotImplementedError,
    zipfile.BadZipFile,
    zlib.error,
    struct.error,
)


def _open_array_record(path: str, key: str = "data.paths"):
    """One ArrayRecord file as a Grain source; a missing, empty, truncated or otherwise
    unopenable file is a DataError naming it (its records cannot even be counted, so no policy
    can skip them one by one)."""
    import grain

    if not Path(path).is_file() or Path(path).stat().st_size == 0:
        raise DataError(
            f"{key}: {path} is {'empty' if Path(path).is_file() else 'missing'}; give ArrayRecord "
            f"files written by scripts/convert_images.py"
        )
    try:
        return grain.sources.ArrayRecordDataSource([path])
    except (RuntimeError, ValueError, OSError) as err:  # Riegeli reports a damaged file as RuntimeError
        raise DataError(
            f"{key}: {path} cannot be opened as ArrayRecord (truncated or damaged: {_first_line(err)})"
        ) from err


def _first_line(err: Exception) -> str:
    """The first line of an error's message, or its type where it has none (Riegeli raises a
    bare RuntimeError for some damaged files)."""
    lines = str(err).strip().splitlines()
    return lines[0][:200] if lines else type(err).__name__


def write_index(path: str) -> Path:
    """Write `<path>.index.json`: each record's sample id, token count, item shapes and tags, in
    record order, so that every process reads all samples' metadata without reading their records."""
    import grain

    source = grain.sources.ArrayRecordDataSource([path])
    rows = []
    for i in range(len(source)):
        info = record_info(source[i])
        shapes = {m: [list(s) for s in v] for m, v in info.item_shapes.items()}
        rows.append([info.id, info.length, shapes, dict(info.tags)])
    out = Path(f"{path}.index.json")
    out.write_text(json.dumps(rows))
    return out


def sample_info(source, index: int) -> SampleInfo:
    """`source.info(index)` where the source offers it, else decoded from the sample itself."""
    info = getattr(source, "info", None)
    return info(index) if info is not None else source[index].info()


def read_parts(source, index: int, parts: frozenset[str] | None) -> tuple[Sample, int | None]:
    """`source.read(index, parts)` where the source offers it, else the whole sample (bytes
    read unknown: None)."""
    read = getattr(source, "read", None)
    return read(index, parts) if read is not None else (source[index], None)
