"""Mixed-modality samples: schema, synthetic source and the Grain pipeline."""

from __future__ import annotations

import dataclasses

import grain
import numpy as np

IMAGE_TOKEN = 1  # placeholder id; one per merged image token
FIRST_TEXT_TOKEN = 2


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


def global_batches(source, global_batch: int, seed: int, shuffle: bool = True) -> grain.MapDataset:
    """Global batches (lists of samples), shuffled with a seed, repeating over epochs."""
    ds = grain.MapDataset.source(source)
    if shuffle:
        ds = ds.shuffle(seed=seed)
    return ds.repeat(None).batch(global_batch, drop_remainder=True, batch_fn=list)
