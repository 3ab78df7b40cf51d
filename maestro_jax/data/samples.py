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

# The built-in workloads' default placeholder ids (`workload_settings.image_token`/`audio_token`
# set others: a real tokenizer's `<image>` id); a sample's placeholders are its `Modality.placeholder`.
IMAGE_TOKEN = 1  # placeholder id of an image token (one per merged patch window)
AUDIO_TOKEN = 2  # placeholder id of an audio token (one per group of frames)
FIRST_TEXT_TOKEN = 3  # synthetic and byte-level text ids start here (0 is padding), skipping placeholders


def text_ids(end: int, placeholders=()) -> np.ndarray:
    """The ids generated text may take, in order: FIRST_TEXT_TOKEN up to `end` (excluded), without
    the placeholder ids (text on one would be taken for an item's slot). With the default
    placeholders this is every id from FIRST_TEXT_TOKEN."""
    return np.setdiff1d(np.arange(FIRST_TEXT_TOKEN, end), np.asarray(placeholders, np.int64))


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
    tags: Mapping[str, str] = dataclasses.field(default_factory=dict)  # `Sample.tags`

    def shapes(self, modality: str) -> tuple[tuple[int, ...], ...]:
        return self.item_shapes.get(modality, ())

    def has(self, modality: str) -> bool:
        return bool(self.shapes(modality))


@dataclasses.dataclass(frozen=True, eq=False)
class Sample:
    """One training sample: token ids (with placeholders) and its items, by modality.

    `loss_mask` (optional, one 0/1 entry per token): whether token t carries loss as the target
    of position t - 1 (entry 0 is never a target). A chat sample sets it on the assistant's
    turns only, so the model is not trained to write the user's side. None: every text token
    carries loss. Placeholders never do, whatever the mask says. It is part of the `tokens`
    part: whoever decodes the ids decodes it too.

    `tags` (optional): short strings naming what the sample is (a task, a language, a source),
    which a workload may route by (KD's `distill.combine.mode: route` picks each sample's teacher
    by one). They are metadata: the `SampleInfo` carries them, so planning sees them.

    `extras` (optional): arrays a source attaches beside the data for a workload to read, by
    name: a teacher cache's top-k outputs of the sample (`data.teacher_cache`). They are not
    stored with the sample and planning never sees them.

    Section callbacks `activates(sample)` and `work(sample)` receive the sample's `SampleInfo`
    on every path (`core.graph.sample_view`): `length`, `shapes(modality)` and `has(modality)`.
    """

    id: int
    tokens: np.ndarray
    items: Mapping[str, tuple[np.ndarray, ...]] = dataclasses.field(default_factory=dict)
    loss_mask: np.ndarray | None = None
    tags: Mapping[str, str] = dataclasses.field(default_factory=dict)
    extras: Mapping[str, np.ndarray] = dataclasses.field(default_factory=dict)

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
        return SampleInfo(
            self.id, self.length, {m: self.shapes(m) for m in self.items if self.items[m]}, dict(self.tags)
        )


def image_tokens(image_hw: tuple[int, int], patch: int, merge: int) -> int:
    h, w = image_hw
    return (h // (patch * merge)) * (w // (patch * merge))


class DataError(ValueError):
    """A malformed sample; the message names its id and what is wrong."""


TOKENS = "tokens"  # the part of a sample holding its token ids; other parts are named by modality
LOSS_MASK = "loss_mask"  # the record key of `Sample.loss_mask` (stored and decoded with the tokens)
TAG = "tag."  # the record key of each of `Sample.tags` is this prefix and the tag's name


def parts_of(s) -> frozenset[str]:
    """The parts a sample (or its `SampleInfo`) has: `tokens` and each modality it carries."""
    return frozenset(
        {TOKENS, *(m for m, v in s.item_shapes.items() if v)}
        if isinstance(s, SampleInfo)
        else {TOKENS, *(m for m, v in s.items.items() if v)}
    )


def hollow_sample(info: SampleInfo, parts: dict[str, object] | None = None) -> Sample:
    """A sample with `info`'s shapes whose parts not in `parts` are zeros: the rows a process
    builds but never places (another process's devices hold them) cost no read nor decode.
    `parts[LOSS_MASK]` goes with `parts[TOKENS]` (absent: no mask)."""
    parts = parts or {}
    tokens = parts.get(TOKENS)
    return Sample(
        info.id,
        tokens if tokens is not None else np.zeros(info.length, np.int32),
        {
            m: parts[m] if m in parts else tuple(np.zeros(sh, np.float32) for sh in shapes)
            for m, shapes in info.item_shapes.items()
        },
        parts.get(LOSS_MASK),
        info.tags,
    )


def validate_info(info: SampleInfo, modalities: tuple[Modality, ...] = (), max_tokens: int | None = None) -> SampleInfo:
    """The checks a sample's metadata answers (every process runs them before scheduling):
    sequence length, modalities the workload takes, each item's shape."""
    where = f"sample id={info.id}"
    if max_tokens is not None and info.length > max_tokens:
        raise DataError(f"{where}: {info.length} tokens exceed the largest bucket ({max_tokens})")
    known = {m.name: m for m in modalities}
    for name, shapes in info.item_shapes.items():
        if shapes and name not in known:
            raise DataError(f"{where}: has {name} items, but this workload takes {sorted(known) or 'text only'}")
    for m in modalities:
        for i, shape in enumerate(info.shapes(m.name)):
            _check_item_shape(where, m, i, tuple(shape))
    return info


def require_sample(x, where: str = "a sample of the source") -> None:
    """A DataError where a source gave something other than a `Sample` (a dict of its fields,
    say), naming what it gave and the constructor to use."""
    if isinstance(x, Sample):
        return
    got = f"a dict with keys {sorted(map(str, x))}" if isinstance(x, dict) else f"a {type(x).__name__}"
    raise DataError(
        f"{where} is {got}, not a Sample; a source's items are maestro_jax.Sample(id, tokens, items) "
        f"(maestro_jax.data.Sample)"
    )


def validate_sample(
    s: Sample,
    modalities: tuple[Modality, ...] = (),
    max_tokens: int | None = None,
    vocab: int | None = None,
    parts: frozenset[str] | None = None,
) -> Sample:
    """Reject what must never be trained on silently: wrong dtypes or shapes, ids outside the
    vocabulary, placeholders that do not match the items, items of a modality the workload
    does not take, empty or oversized items, non-finite values, too long a sequence.

    `parts`: the parts this process decoded (None: all); the others are hollow and unchecked
    here (the process that decodes them checks them)."""
    require_sample(s)
    where = f"sample id={s.id}"
    if not (isinstance(s.tokens, np.ndarray) and s.tokens.ndim == 1 and np.issubdtype(s.tokens.dtype, np.integer)):
        tokens = np.asarray(s.tokens)
        raise DataError(f"{where}: tokens must be a 1-D integer array, got {tokens.dtype}{list(tokens.shape)}")
    validate_info(s.info(), modalities, max_tokens)
    for m in modalities:
        for i, x in enumerate(s.of(m.name)):
            if x.dtype != np.float32:
                raise DataError(f"{where}: {m.name} {i} must be float32, got {x.dtype}")
    if parts is None or TOKENS in parts:
        _check_tokens(where, s, modalities, vocab)
        _check_loss_mask(where, s)
    for m in modalities:
        if parts is None or m.name in parts:
            for i, x in enumerate(s.of(m.name)):
                if not np.isfinite(x).all():
                    raise DataError(f"{where}: {m.name} {i} has NaN or inf values")
    return s


def _check_tokens(where: str, s: Sample, modalities: tuple[Modality, ...], vocab: int | None) -> None:
    if s.tokens.size and (s.tokens.min() < 0 or (vocab is not None and s.tokens.max() >= vocab)):
        bad = int(s.tokens.min()) if s.tokens.min() < 0 else int(s.tokens.max())
        valid = f"[0, {vocab}) (the model's vocabulary)" if vocab is not None else "0 or more"
        raise DataError(f"{where}: token id {bad} is outside the valid ids {valid}")
    text = int(np.count_nonzero(~np.isin(s.tokens, [m.placeholder for m in modalities])))
    if text < 2:
        raise DataError(f"{where}: needs at least 2 text tokens, got {text}")
    for m in modalities:
        expected = sum(m.tokens(shape[: len(m.unit)]) for shape in s.shapes(m.name))
        found = int(np.count_nonzero(s.tokens == m.placeholder))
        if found != expected:
            raise DataError(f"{where}: {found} {m.name}-placeholder tokens but its {m.name} items need {expected}")


def _check_loss_mask(where: str, s: Sample) -> None:
    """A mask is one 0/1 (or bool) entry per token: anything else would silently drop or weight
    the loss of tokens it does not line up with."""
    mask = s.loss_mask
    if mask is None:
        return
    if not (
        isinstance(mask, np.ndarray)
        and mask.ndim == 1
        and (mask.dtype == bool or np.issubdtype(mask.dtype, np.integer))
    ):
        got = np.asarray(mask)
        raise DataError(
            f"{where}: loss_mask must be a 1-D array of 0/1 (bool or integer), got {got.dtype}{list(got.shape)}"
        )
    if len(mask) != len(s.tokens):
        raise DataError(
            f"{where}: loss_mask has {len(mask)} entries but the sample has {len(s.tokens)} tokens; give one per token"
        )
    if mask.size and (mask.min() < 0 or mask.max() > 1):
        bad = int(mask.min()) if mask.min() < 0 else int(mask.max())
        raise DataError(f"{where}: loss_mask holds {bad}; valid entries are 0 (no loss) and 1 (loss)")


def _check_item_shape(where: str, m: Modality, i: int, shape: tuple[int, ...]) -> None:
    spatial = len(m.unit)
    if len(shape) != spatial + 1:
        raise DataError(
            f"{where}: {m.name} {i} must have {spatial} spatial dims and {m.channels} channels last, "
            f"got shape {list(shape)}"
        )
    if shape[-1] != m.channels:
        raise DataError(
            f"{where}: {m.name} {i} has {shape[-1]} channels (shape {list(shape)}); the model takes {m.channels}"
        )
    dims, size = shape[:spatial], "x".join(map(str, shape[:spatial]))
    at_most = f", at most {'x'.join(map(str, m.max_shape))}" if m.max_shape is not None else ""
    if any(d == 0 or d % u for d, u in zip(dims, m.unit)):
        raise DataError(
            f"{where}: {m.name} {i} is {size}; each side must be a positive multiple of "
            f"{'x'.join(map(str, m.unit))}{at_most}"
        )
    if m.max_shape is not None and any(d > b for d, b in zip(dims, m.max_shape)):
        raise DataError(
            f"{where}: {m.name} {i} is {size}, larger than the model takes ({'x'.join(map(str, m.max_shape))})"
        )


def encode_sample(s: Sample) -> bytes:
    """Portable record: npz (no pickle) of tokens, the loss mask (uint8, when the sample has one;
    DataError if it is not a valid mask) and items; images as uint8, others float32."""
    buf = io.BytesIO()
    arrays = {"id": np.asarray(s.id, np.int64), "tokens": s.tokens.astype(np.int32)}
    if s.loss_mask is not None:
        _check_loss_mask(f"sample id={s.id}", s)  # a cast to uint8 must not turn a bad mask into a valid one
        arrays[LOSS_MASK] = s.loss_mask.astype(np.uint8)
    for name, value in s.tags.items():
        arrays[TAG + name] = np.asarray(str(value))
    for name, items in s.items.items():
        for i, x in enumerate(items):
            arrays[f"{name}_{i}"] = (
                np.clip(np.round((x + 1.0) * 127.5), 0, 255).astype(np.uint8)
                if name == "image"
                else x.astype(np.float32)
            )
    np.savez(buf, **arrays)
    return buf.getvalue()


def _item_keys(files) -> list[str]:
    items = (k for k in files if k not in ("id", "tokens", LOSS_MASK) and not k.startswith(TAG))
    return sorted(items, key=lambda k: int(k.rsplit("_", 1)[1]))


def _tags(z) -> dict[str, str]:
    return {k.removeprefix(TAG): str(z[k]) for k in z.files if k.startswith(TAG)}


def record_info(record: bytes) -> SampleInfo:
    """A record's `SampleInfo` from the npy headers alone: no array is decoded."""
    with np.load(io.BytesIO(record), allow_pickle=False) as z:
        shapes: dict[str, list[tuple[int, ...]]] = {}
        for key in ["tokens", *_item_keys(z.files)]:
            with z.zip.open(f"{key}.npy") as f:
                version = np.lib.format.read_magic(f)
                header = (
                    np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
                )
                shape = tuple(int(d) for d in header(f)[0])
            if key == "tokens":
                length = shape[0] if shape else 0
            else:
                shapes.setdefault(key.rsplit("_", 1)[0], []).append(shape)
        return SampleInfo(int(z["id"]), length, {k: tuple(v) for k, v in shapes.items()}, _tags(z))


def decode_sample(record: bytes, parts: frozenset[str] | None = None) -> Sample:
    """The sample in `record`. With `parts`, only those parts (`tokens`, modality names) are
    decoded; the others are hollow (`hollow_sample`). Token ids keep their stored dtype: a
    cast would wrap ids beyond int32 or truncate float ones into valid-looking ids, which
    validation must see as they are."""
    with np.load(io.BytesIO(record), allow_pickle=False) as z:
        decoded: dict[str, object] = {}
        for key in _item_keys(z.files):
            name = key.rsplit("_", 1)[0]
            if parts is None or name in parts:
                x = z[key]
                decoded.setdefault(name, []).append(x.astype(np.float32) / 127.5 - 1.0 if x.dtype == np.uint8 else x)
        decoded = {k: tuple(v) for k, v in decoded.items()}
        if parts is None or TOKENS in parts:
            decoded[TOKENS] = z["tokens"]
            decoded[LOSS_MASK] = z[LOSS_MASK] if LOSS_MASK in z.files else None
        if parts is None:
            return Sample(int(z["id"]), decoded.pop(TOKENS), decoded, decoded.pop(LOSS_MASK), _tags(z))
    return hollow_sample(record_info(record), decoded)


def decoded_bytes(s: Sample, parts: frozenset[str] | None = None) -> int:
    """Bytes of the arrays of `s`'s `parts` (None: all): what decoding them materialised."""
    mask = 0 if s.loss_mask is None else s.loss_mask.nbytes
    total = s.tokens.nbytes + mask if parts is None or TOKENS in parts else 0
    return total + sum(x.nbytes for m, xs in s.items.items() if parts is None or m in parts for x in xs)
