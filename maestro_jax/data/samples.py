"""The sample schema: token ids with placeholders, and the items of each modality."""

from __future__ import annotations

import dataclasses
import io

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
