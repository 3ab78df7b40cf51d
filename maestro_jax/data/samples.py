"""The sample schema: token ids with placeholders, and the items of each named modality.

A sample is text (token ids) plus zero or more items per modality (images H x W x C, audio
clips T x mel, ...). Every item occupies a run of placeholder tokens in the text, one per
`Modality.unit` block of the item, so the LLM's sequence length is known from shapes alone:
the scheduler and planner work from `SampleInfo` (ids, lengths and shapes, no payload).
"""

from __future__ import annotations

import dataclasses
import io
import math
from collections.abc import Mapping

import numpy as np

IMAGE_TOKEN = 1  # placeholder id of an image token (one per merged patch window)
AUDIO_TOKEN = 2  # placeholder id of an audio token (one per group of frames)
FIRST_TEXT_TOKEN = 3  # text ids start here; 0 is padding


@dataclasses.dataclass(frozen=True)
class Modality:
    """How items of one modality look and enter the token stream.

    An item is an array of `len(unit)` spatial dims plus a trailing feature dim of size
    `channels`; each spatial dim is a multiple of its `unit`, and every `unit` block becomes
    one placeholder token `placeholder` (an image of 32x16 pixels with unit (8, 8) takes 8).
    `max_shape` bounds the spatial dims (a ViT's position grid); None: unbounded.
    """

    name: str
    placeholder: int
    unit: tuple[int, ...]
    channels: int
    max_shape: tuple[int, ...] | None = None

    def tokens(self, shape: tuple[int, ...]) -> int:
        return math.prod(d // u for d, u in zip(shape, self.unit))


@dataclasses.dataclass(frozen=True, eq=False)
class SampleInfo:
    """What planning needs of a sample: its id, token count and the shapes of its items."""

    id: int
    length: int  # tokens, placeholders included
    item_shapes: Mapping[str, tuple[tuple[int, ...], ...]] = dataclasses.field(default_factory=dict)

    def shapes(self, modality: str) -> tuple[tuple[int, ...], ...]:
        return self.item_shapes.get(modality, ())

    def has(self, modality: str) -> bool:
        return bool(self.shapes(modality))


@dataclasses.dataclass(frozen=True, eq=False)
class Sample:
    """One training sample: token ids (with placeholders) and its items, by modality.

    Section callbacks `activates(sample)` and `work(sample)` may receive a `Sample` or its
    `SampleInfo`; both answer `length`, `shapes(modality)` and `has(modality)`.
    """

    id: int
    tokens: np.ndarray
    items: Mapping[str, tuple[np.ndarray, ...]] = dataclasses.field(default_factory=dict)

    @property
    def length(self) -> int:
        return len(self.tokens)

    def of(self, modality: str) -> tuple[np.ndarray, ...]:
        return self.items.get(modality, ())

    def shapes(self, modality: str) -> tuple[tuple[int, ...], ...]:
        return tuple(x.shape for x in self.of(modality))

    def has(self, modality: str) -> bool:
        return bool(self.of(modality))

    def info(self) -> SampleInfo:
        return SampleInfo(self.id, self.length, {m: self.shapes(m) for m in self.items if self.items[m]})


def image_tokens(image_hw: tuple[int, int], patch: int, merge: int) -> int:
    h, w = image_hw
    return (h // (patch * merge)) * (w // (patch * merge))


class DataError(ValueError):
    """A malformed sample; the message names its id and what is wrong."""


def validate_sample(s: Sample, modalities: tuple[Modality, ...] = (), max_tokens: int | None = None,
                    vocab: int | None = None) -> Sample:
    """Reject what must never be trained on silently: wrong dtypes or shapes, ids outside the
    vocabulary, placeholders that do not match the items, items of a modality the workload
    does not take, empty or oversized items, non-finite values, too long a sequence."""
    where = f"sample id={s.id}"
    if s.tokens.ndim != 1 or not np.issubdtype(s.tokens.dtype, np.integer):
        raise DataError(f"{where}: tokens must be a 1-D integer array, got {s.tokens.dtype}{list(s.tokens.shape)}")
    if s.tokens.size and (s.tokens.min() < 0 or (vocab is not None and s.tokens.max() >= vocab)):
        bad = int(s.tokens.min()) if s.tokens.min() < 0 else int(s.tokens.max())
        raise DataError(f"{where}: token id {bad} is outside the vocabulary [0, {vocab})")
    placeholders = {m.placeholder for m in modalities}
    text = int(np.count_nonzero(~np.isin(s.tokens, list(placeholders))))
    if text < 2:
        raise DataError(f"{where}: needs at least 2 text tokens, got {text}")
    if max_tokens is not None and len(s.tokens) > max_tokens:
        raise DataError(f"{where}: {len(s.tokens)} tokens exceed the largest bucket ({max_tokens})")
    known = {m.name: m for m in modalities}
    for name in s.items:
        if s.items[name] and name not in known:
            raise DataError(f"{where}: has {name} items, but this workload takes {sorted(known) or 'text only'}")
    for m in modalities:
        expected = sum(_check_item(where, m, i, x) for i, x in enumerate(s.of(m.name)))
        found = int(np.count_nonzero(s.tokens == m.placeholder))
        if found != expected:
            raise DataError(f"{where}: {found} {m.name}-placeholder tokens but its {m.name} items need {expected}")
    return s


def _check_item(where: str, m: Modality, i: int, x: np.ndarray) -> int:
    """Placeholder tokens item `i` needs, or DataError naming what is wrong with it."""
    spatial = len(m.unit)
    if x.ndim != spatial + 1 or x.dtype != np.float32 or x.shape[-1] != m.channels:
        raise DataError(f"{where}: {m.name} {i} must be float32 with {spatial} spatial dims and {m.channels} "
                        f"channels last, got {x.dtype}{list(x.shape)}")
    dims = x.shape[:spatial]
    if any(d == 0 or d % u for d, u in zip(dims, m.unit)):
        raise DataError(f"{where}: {m.name} {i} is {'x'.join(map(str, dims))}; each side must be a positive "
                        f"multiple of {'x'.join(map(str, m.unit))}")
    if m.max_shape is not None and any(d > b for d, b in zip(dims, m.max_shape)):
        raise DataError(f"{where}: {m.name} {i} is {'x'.join(map(str, dims))}, larger than the model takes "
                        f"({'x'.join(map(str, m.max_shape))})")
    if not np.isfinite(x).all():
        raise DataError(f"{where}: {m.name} {i} has NaN or inf values")
    return m.tokens(dims)


def encode_sample(s: Sample) -> bytes:
    """Portable record: npz (no pickle) of tokens and items; images as uint8, others float32."""
    buf = io.BytesIO()
    arrays = {"id": np.asarray(s.id, np.int64), "tokens": s.tokens.astype(np.int32)}
    for name, items in s.items.items():
        for i, x in enumerate(items):
            arrays[f"{name}_{i}"] = (np.clip(np.round((x + 1.0) * 127.5), 0, 255).astype(np.uint8)
                                     if name == "image" else x.astype(np.float32))
    np.savez(buf, **arrays)
    return buf.getvalue()


def decode_sample(record: bytes) -> Sample:
    with np.load(io.BytesIO(record), allow_pickle=False) as z:
        items: dict[str, list[np.ndarray]] = {}
        for key in sorted((k for k in z.files if k not in ("id", "tokens")), key=lambda k: int(k.rsplit("_", 1)[1])):
            name = key.rsplit("_", 1)[0]
            x = z[key]
            items.setdefault(name, []).append(x.astype(np.float32) / 127.5 - 1.0 if x.dtype == np.uint8 else x)
        return Sample(id=int(z["id"]), tokens=z["tokens"].astype(np.int32),
                      items={k: tuple(v) for k, v in items.items()})
