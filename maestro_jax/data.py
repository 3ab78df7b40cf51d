"""Mixed-modality samples: schema, synthetic source and the Grain pipeline."""

from __future__ import annotations

import dataclasses
import functools
import io
import logging

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import grain

IMAGE_TOKEN = 1  # placeholder id; one per merged image token
FIRST_TEXT_TOKEN = 2
log = logging.getLogger("maestro_jax")


@dataclasses.dataclass(frozen=True)
class Sample:
    """One training sample: token ids (with IMAGE_TOKEN placeholders) and its images (H x W x C)."""

    id: int
    tokens: np.ndarray
    images: tuple[np.ndarray, ...] = ()

    @property
    def has_image(self) -> bool:
        return len(self.images) > 0


def image_tokens(image_hw: tuple[int, int], patch: int, merge: int) -> int:
    h, w = image_hw
    return (h // (patch * merge)) * (w // (patch * merge))


@dataclasses.dataclass(frozen=True)
class SyntheticSource:
    """A deterministic random-access source (Grain `RandomAccessDataSource` protocol).

    Sample `i` is a pure function of `(seed, i)`, so any host can rebuild any sample.
    `image_fraction` of samples carry 1..max_images images of sizes drawn from `image_sizes`;
    image placeholders are inserted at a random text position. Text follows a noisy affine
    bigram rule (next = 7 * prev + 3 mod vocab, 90% of the time) so that loss can fall.
    """

    num_samples: int
    vocab: int
    text_len: tuple[int, int]
    image_fraction: float = 0.0
    max_images: int = 1
    image_sizes: tuple[tuple[int, int], ...] = ()
    channels: int = 3
    patch: int = 4
    merge: int = 2
    seed: int = 0

    def __len__(self) -> int:
        return self.num_samples

    def sizes(self, index: int) -> tuple[int, list[tuple[int, int]]]:
        """(text length, image sizes) of sample `index`, without building it (for simulation)."""
        rng = np.random.default_rng([self.seed, int(index)])
        length = int(rng.integers(*self.text_len, endpoint=True))
        return length, self._image_sizes(np.random.default_rng([self.seed, int(index), 1]))

    def _image_sizes(self, rng) -> list[tuple[int, int]]:
        if self.image_sizes and rng.random() < self.image_fraction:
            n = int(rng.integers(1, self.max_images, endpoint=True))
            return [self.image_sizes[int(rng.integers(len(self.image_sizes)))] for _ in range(n)]
        return []

    def __getitem__(self, index: int) -> Sample:
        index = int(index)
        rng = np.random.default_rng([self.seed, index])
        length = int(rng.integers(*self.text_len, endpoint=True))
        span = self.vocab - FIRST_TEXT_TOKEN
        text = np.empty(length, np.int64)
        text[0] = rng.integers(span)
        noise = rng.integers(span, size=length)
        follow = rng.random(length) < 0.9
        for i in range(1, length):
            text[i] = (7 * text[i - 1] + 3) % span if follow[i] else noise[i]
        text += FIRST_TEXT_TOKEN
        images = ()
        sizes = self._image_sizes(np.random.default_rng([self.seed, index, 1]))
        if sizes:
            images = tuple(rng.standard_normal((h, w, self.channels)).astype(np.float32) for h, w in sizes)
            placeholders = np.full(sum(image_tokens(im.shape[:2], self.patch, self.merge) for im in images),
                                   IMAGE_TOKEN)
            cut = int(rng.integers(0, len(text)))
            text = np.concatenate([text[:cut], placeholders, text[cut:]])
        return Sample(id=index, tokens=text.astype(np.int32), images=images)


def _read(source, check, keep_errors: bool, index: int):
    """Sample `index`, validated; under the `skip` policy a bad one comes back as its DataError."""
    try:
        return check(source[int(index)]) if check else source[int(index)]
    except DataError as err:
        if keep_errors:
            return err
        raise


def _ordered(source, seed: int, shuffle: bool) -> grain.MapDataset:
    import grain  # noqa: PLC0415 (grain imports jax; the planner and simulator read sources without it)

    ds = grain.MapDataset.range(len(source))
    return (ds.shuffle(seed=seed) if shuffle else ds).repeat(None)


def global_batches(source, global_batch: int, seed: int, shuffle: bool = True, check=None) -> grain.MapDataset:
    """Global batches (lists of samples), shuffled with a seed, repeating over epochs; random
    access (verify, bench). A bad sample raises `DataError` with its id."""
    return (_ordered(source, seed, shuffle).map(functools.partial(_read, source, check, False))
            .batch(global_batch, drop_remainder=True, batch_fn=list))


class BadSamples:
    """Under `data.on_bad_sample: skip`: counts the bad samples dropped and keeps their reasons
    until the training loop reports them with the step that would have used them."""

    def __init__(self):
        self.total = 0
        self._pending: list[str] = []

    def keep(self, item) -> bool:
        if isinstance(item, DataError):
            self.total += 1
            self._pending.append(str(item))
            log.warning("skipping bad sample (data.on_bad_sample=skip): %s", item)
            return False
        return True

    def drain(self) -> list[str]:
        out, self._pending = self._pending, []
        return out


def training_batches(source, global_batch: int, seed: int, shuffle: bool, check, bad: BadSamples | None
                     ) -> grain.IterDataset:
    """The training stream: the same order as `global_batches`. With `bad` (skip policy) bad
    samples are dropped and the batch is filled from the next ones; without, they raise.
    Its iterator state (`get_state`/`set_state`) resumes the stream exactly."""
    import grain  # noqa: PLC0415

    ds = (_ordered(source, seed, shuffle).map(functools.partial(_read, source, check, bad is not None))
          .to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)))
    if bad is not None:
        ds = ds.filter(bad.keep)
    return ds.batch(global_batch, drop_remainder=True, batch_fn=list)


class DataError(ValueError):
    """A malformed sample; the message names its id and what is wrong."""


def validate_sample(s: Sample, patch: int = 1, merge: int = 1, max_tokens: int | None = None) -> Sample:
    """Reject what must never be trained on silently (wrong dtypes or shapes, mismatched
    placeholders, empty text, non-finite pixels, sequences longer than the largest bucket)."""
    where = f"sample id={s.id}"
    if s.tokens.ndim != 1 or not np.issubdtype(s.tokens.dtype, np.integer):
        raise DataError(f"{where}: tokens must be a 1-D integer array, got {s.tokens.dtype}{list(s.tokens.shape)}")
    if np.count_nonzero(s.tokens != IMAGE_TOKEN) < 2:
        raise DataError(f"{where}: needs at least 2 text tokens, got {np.count_nonzero(s.tokens != IMAGE_TOKEN)}")
    if max_tokens is not None and len(s.tokens) > max_tokens:
        raise DataError(f"{where}: {len(s.tokens)} tokens exceed the largest bucket ({max_tokens})")
    expected = 0
    for i, im in enumerate(s.images):
        if im.ndim != 3 or im.dtype != np.float32:
            raise DataError(f"{where}: image {i} must be float32 H x W x C, got {im.dtype}{list(im.shape)}")
        if im.shape[0] % (patch * merge) or im.shape[1] % (patch * merge):
            raise DataError(f"{where}: image {i} is {im.shape[0]}x{im.shape[1]}; sides must be multiples of "
                            f"patch*merge = {patch * merge}")
        if not np.isfinite(im).all():
            raise DataError(f"{where}: image {i} has NaN or inf pixels")
        expected += image_tokens(im.shape[:2], patch, merge)
    found = int(np.count_nonzero(s.tokens == IMAGE_TOKEN))
    if found != expected:
        raise DataError(f"{where}: {found} image-placeholder tokens but its images need {expected}")
    return s


def encode_sample(s: Sample) -> bytes:
    """Portable record: npz (no pickle) of tokens and uint8 images."""
    buf = io.BytesIO()
    arrays = {"id": np.asarray(s.id, np.int64), "tokens": s.tokens.astype(np.int32)}
    for i, im in enumerate(s.images):
        arrays[f"image_{i}"] = np.clip(np.round((im + 1.0) * 127.5), 0, 255).astype(np.uint8)
    np.savez(buf, **arrays)
    return buf.getvalue()


def decode_sample(record: bytes) -> Sample:
    with np.load(io.BytesIO(record), allow_pickle=False) as z:
        n = sum(1 for k in z.files if k.startswith("image_"))
        images = tuple(z[f"image_{i}"].astype(np.float32) / 127.5 - 1.0 for i in range(n))
        return Sample(id=int(z["id"]), tokens=z["tokens"].astype(np.int32), images=images)


@dataclasses.dataclass(frozen=True)
class ArrayRecordSource:
    """Samples stored as ArrayRecord files (`scripts/convert_images.py` writes them); a record
    that does not decode fails with its index (the pipeline validates what decodes)."""

    paths: tuple[str, ...]
    patch: int = 1
    merge: int = 1

    def __post_init__(self):
        import grain  # noqa: PLC0415

        object.__setattr__(self, "_source", grain.sources.ArrayRecordDataSource(list(self.paths)))

    def __len__(self) -> int:
        return len(self._source)

    def __getitem__(self, index: int) -> Sample:
        try:
            return decode_sample(self._source[int(index)])
        except (ValueError, KeyError, OSError) as err:  # numpy's npz reader: bad zip, missing array
            raise DataError(f"sample at record {index} of {list(self.paths)}: cannot be decoded ({err})") from err

    def sizes(self, index: int) -> tuple[int, list[tuple[int, int]]]:
        s = self[index]
        return int(np.count_nonzero(s.tokens != IMAGE_TOKEN)), [im.shape[:2] for im in s.images]


def sample_check(cfg):
    """The validation every sample passes before training (`validate_sample` with the config's
    patch, merge and `data.max_tokens`)."""
    vision = cfg.models.get("vision") if cfg.workload == "vlm" else None
    patch, merge = (vision.patch, vision.merge) if vision else (1, 1)
    return functools.partial(validate_sample, patch=patch, merge=merge, max_tokens=cfg.data.max_tokens)


def source_from_config(cfg):
    """The configured sample source (`data.kind`)."""
    vision = cfg.models.get("vision") if cfg.workload == "vlm" else None
    patch, merge = (vision.patch, vision.merge) if vision else (1, 1)
    if cfg.data.kind == "array_record":
        return ArrayRecordSource(tuple(cfg.data.paths), patch, merge)
    sink_model = cfg.models["llm" if cfg.workload == "vlm" else "student"]
    return SyntheticSource(
        num_samples=cfg.data.num_samples, vocab=sink_model.vocab, text_len=tuple(cfg.data.text_len),
        image_fraction=cfg.data.image_fraction if vision else 0.0, max_images=cfg.data.max_images,
        image_sizes=tuple(tuple(s) for s in cfg.data.image_sizes) if vision else (),
        channels=vision.channels if vision else 3, patch=patch, merge=merge, seed=cfg.seed)
