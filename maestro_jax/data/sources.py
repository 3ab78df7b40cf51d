"""Random-access sample sources (Grain's `RandomAccessDataSource` protocol: `__len__`,
`__getitem__`), plus `info(index)`: a sample's ids, length and item shapes without its payload,
which is all the scheduler and the planner read."""

from __future__ import annotations

import dataclasses

import numpy as np

from maestro_jax.data.samples import FIRST_TEXT_TOKEN, DataError, Modality, Sample, SampleInfo, decode_sample


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

    Text follows a noisy affine bigram rule (next = 7 * prev + 3 mod span, 90% of the time) so
    that loss can fall. Each modality's placeholders go in at a random text position.
    """

    num_samples: int
    vocab: int
    text_len: tuple[int, int]
    items: tuple[SyntheticItems, ...] = ()
    seed: int = 0

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

    def info(self, index: int) -> SampleInfo:
        length = int(np.random.default_rng([self.seed, int(index)]).integers(*self.text_len, endpoint=True))
        shapes = self._item_shapes(index)
        for spec in self.items:
            length += sum(spec.modality.tokens(s) for s in shapes.get(spec.modality.name, ()))
        return SampleInfo(int(index), length, {m: tuple(tuple(s) + (self._channels(m),) for s in v)
                                               for m, v in shapes.items()})

    def _channels(self, name: str) -> int:
        return next(s.modality.channels for s in self.items if s.modality.name == name)

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
        items = {}
        shapes = self._item_shapes(index)
        for spec in self.items:
            m = spec.modality
            if m.name not in shapes:
                continue
            items[m.name] = tuple(rng.standard_normal((*s, m.channels)).astype(np.float32) for s in shapes[m.name])
            placeholders = np.full(sum(m.tokens(s) for s in shapes[m.name]), m.placeholder)
            cut = int(rng.integers(0, len(text)))
            text = np.concatenate([text[:cut], placeholders, text[cut:]])
        return Sample(id=index, tokens=text.astype(np.int32), items=items)


@dataclasses.dataclass(frozen=True)
class ArrayRecordSource:
    """Samples stored as ArrayRecord files (`scripts/convert_images.py` writes them); a record
    that does not decode fails with its index (the pipeline validates what decodes)."""

    paths: tuple[str, ...]

    def __post_init__(self):
        import grain  # noqa: PLC0415 (grain imports jax; planning reads sources without it)

        object.__setattr__(self, "_source", grain.sources.ArrayRecordDataSource(list(self.paths)))

    def __len__(self) -> int:
        return len(self._source)

    def __getitem__(self, index: int) -> Sample:
        try:
            return decode_sample(self._source[int(index)])
        except (ValueError, KeyError, OSError) as err:  # numpy's npz reader: bad zip, missing array
            raise DataError(f"sample at record {index} of {list(self.paths)}: cannot be decoded ({err})") from err

    def info(self, index: int) -> SampleInfo:
        return self[index].info()


def sample_info(source, index: int) -> SampleInfo:
    """`source.info(index)` where the source offers it, else decoded from the sample itself."""
    info = getattr(source, "info", None)
    return info(index) if info is not None else source[index].info()
