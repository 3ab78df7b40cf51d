"""Random-access sample sources (Grain's `RandomAccessDataSource` protocol)."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from maestro_jax.data.samples import (
    FIRST_TEXT_TOKEN,
    IMAGE_TOKEN,
    DataError,
    Sample,
    decode_sample,
    image_tokens,
    validate_sample,
)


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


@dataclasses.dataclass(frozen=True)
class ArrayRecordSource:
    """Samples stored as ArrayRecord files (`scripts/convert_images.py` writes them); a record
    that does not decode fails with its index (the pipeline validates what decodes)."""

    paths: tuple[str, ...]
    patch: int = 1
    merge: int = 1

    def __post_init__(self):
        import grain

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
