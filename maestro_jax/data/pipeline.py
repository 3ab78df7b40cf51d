"""The Grain pipeline: shuffled global batches, validated samples, resumable iterator state.

Two readers share one order (`seed`, `shuffle`):
  `global_batches`  random access to whole, decoded batches (verify, bench, calibration);
  `BatchReader`     the training stream, read per process: every process reads every sample's
                    metadata (`SampleInfo`: enough to schedule), then decodes only the parts
                    its own devices' rows need; the others stay hollow (zeros of the right
                    shape, never placed on a device).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from maestro_jax.data.samples import DataError, Sample, SampleInfo, decoded_bytes, hollow_sample
from maestro_jax.data.sources import read_parts, sample_info

if TYPE_CHECKING:
    import grain

log = logging.getLogger("maestro_jax")


def _located(source, index: int, check, *args, **kwargs):
    """`check(*args, **kwargs)`; a DataError it raises names where the sample is stored (a
    file and record, `source.where(index)`) when the source says, so that a bad sample can be
    found in the data, not only by its id. Sources' own read errors name that already."""
    try:
        return check(*args, **kwargs)
    except DataError as err:
        where = getattr(source, "where", None)
        if where is None:
            raise
        raise DataError(f"{where(index)}: {err}") from err


def _read(source, check, keep_errors: bool, index: int):
    """Sample `index`, validated; under the `skip` policy a bad one comes back as its DataError."""
    try:
        sample = source[int(index)]
        return _located(source, index, check, sample, parts=None) if check else sample
    except DataError as err:
        if keep_errors:
            return err
        raise


def _ordered(source, seed: int, shuffle: bool) -> grain.MapDataset:
    import grain

    ds = grain.MapDataset.range(len(source))
    return (ds.shuffle(seed=seed) if shuffle else ds).repeat(None)


def global_batches(source, global_batch: int, seed: int, shuffle: bool = True, check=None) -> grain.MapDataset:
    """Global batches (lists of samples), shuffled with a seed, repeating over epochs; random
    access (verify, bench). A bad sample raises `DataError` with its id."""
    return (
        _ordered(source, seed, shuffle)
        .map(functools.partial(_read, source, check, False))
        .batch(global_batch, drop_remainder=True, batch_fn=list)
    )


def every_sample_once(source, global_batch: int, check=None) -> grain.MapDataset:
    """Every sample of `source` once, in index order, in batches of `global_batch` (the last may
    be shorter): what a pass over the whole data set reads (`tools.teacher_cache`). A bad sample
    raises `DataError` with its id."""
    import grain

    return (
        grain.MapDataset.range(len(source))
        .map(functools.partial(_read, source, check, False))
        .batch(global_batch, drop_remainder=False, batch_fn=list)
    )


def first_batches(
    source, global_batch: int, batches: int, check=None, skip: bool = False
) -> tuple[list[list], list[str]]:
    """Up to `batches` global batches of `source`'s samples in index order (an evaluation's: the
    same samples every time), and the bad samples' reasons. A bad sample raises `DataError`
    with its id, or under `skip` is left out (the batch takes the next good one)."""
    rows: list = []
    bad: list[str] = []
    for index in range(len(source)):
        if len(rows) == global_batch * batches:
            break
        got = _read(source, check, skip, index)
        if isinstance(got, DataError):
            bad.append(str(got))
        else:
            rows.append(got)
    full = min(len(rows) // global_batch, batches)
    return [rows[k * global_batch : (k + 1) * global_batch] for k in range(full)], bad


def _matches_info(sample: Sample, info: SampleInfo) -> None:
    """The payload has the length, item shapes and tags its metadata promised (what was scheduled)."""
    if (
        sample.length != info.length
        or any(sample.shapes(m) != tuple(map(tuple, v)) for m, v in info.item_shapes.items())
        or dict(sample.tags) != dict(info.tags)
    ):
        raise DataError(
            f"sample id={info.id}: its payload does not match its metadata (length {sample.length} "
            f"vs {info.length}, items {sample.info().item_shapes} vs {dict(info.item_shapes)}, tags "
            f"{dict(sample.tags)} vs {dict(info.tags)}); rebuild the source's index"
        )


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


@dataclasses.dataclass(frozen=True)
class ReadPlan:
    """What one process reads of a global batch, decided from metadata alone.

    parts[i]: the parts of sample i to decode here (`tokens`, modality names; None: all;
      empty: none, the sample stays hollow);
    counts[i]: this process adds sample i to the loss normaliser (exactly one process does,
      one that decodes its tokens);
    schedule: the batch's schedule (the same on every process);
    schedule_s: host seconds the scheduler took for it."""

    parts: list[frozenset[str] | None]
    counts: list[bool]
    schedule: object
    schedule_s: float = 0.0


@dataclasses.dataclass(frozen=True)
class LoadedBatch:
    """One global batch as this process holds it, plus what every process read for it."""

    samples: list[Sample]  # hollow where this process's devices hold no row of the sample
    schedule: object
    loss_count: int  # the global normaliser (`SectionGraph.loss_count` summed over processes)
    read_bytes: list[int | None]  # per process: bytes read from storage (None: the source does not say)
    decoded_bytes: list[int]  # per process: bytes of payload arrays decoded
    schedule_s: float = 0.0  # host seconds the scheduler took for it


class BatchReader:
    """The training stream of global batches, in `global_batches`' order, read per process.

    Per batch: take the next samples' `SampleInfo`s (metadata checks run here, identically on
    every process), ask `plan(infos)` what this process must decode (`ReadPlan`), decode and
    check only that, then share with the other processes (`gather`) the bad samples found,
    the loss-normaliser counts and the bytes read. A bad sample found by any process is bad
    everywhere: with `bad` (skip policy) it is dropped on every process and the batch filled
    from the next samples; without, every process raises the same `DataError`. `get_state` /
    `set_state` resume the stream exactly."""

    def __init__(
        self,
        source,
        global_batch: int,
        seed: int,
        shuffle: bool,
        *,
        plan: Callable[[list], ReadPlan],
        loss_count: Callable[[list], int],
        info_check=None,
        check=None,
        bad: BadSamples | None = None,
        gather: Callable[[str, object], list] = lambda name, value: [value],
    ):
        import grain

        self.source, self.global_batch, self.bad = source, global_batch, bad
        self._plan, self._loss_count, self._info_check, self._check = plan, loss_count, info_check, check
        self._gather = gather
        self._bad_in_a_row = 0
        self._it = iter(
            _ordered(source, seed, shuffle).to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
        )

    def get_state(self) -> dict:
        return self._it.get_state()

    def set_state(self, state: dict) -> None:
        self._it.set_state(state)

    def __iter__(self):
        return self

    def _next_info(self) -> tuple[int, SampleInfo]:
        while True:
            index = int(next(self._it))
            try:
                info = sample_info(self.source, index)
                return index, _located(self.source, index, self._info_check, info) if self._info_check else info
            except DataError as err:
                if self.bad is None:
                    raise
                self._skip(err)

    def _skip(self, err: DataError) -> None:
        """Count a bad sample under the skip policy. More bad samples in a row (no sample passing
        every check in between) than the source holds means a whole pass found nothing to train
        on: stop with a DataError rather than loop forever."""
        self.bad.keep(err)
        self._bad_in_a_row += 1
        if self._bad_in_a_row > len(self.source):
            raise DataError(
                f"data: {self._bad_in_a_row} bad samples in a row, more than the {len(self.source)} the "
                f"source holds: no sample can be trained on (the last: {err})"
            )

    def _read(self, index: int, info: SampleInfo, parts) -> tuple[Sample, int | None, int]:
        sample, read = read_parts(self.source, index, parts)
        _located(self.source, index, _matches_info, sample, info)
        if self._check:
            _located(self.source, index, self._check, sample, parts=parts)
        return sample, read, decoded_bytes(sample, parts)

    def __next__(self) -> LoadedBatch:
        taken: list[tuple[int, SampleInfo]] = []
        while True:
            while len(taken) < self.global_batch:
                taken.append(self._next_info())
            plan = self._plan([info for _, info in taken])
            samples, errors, read, decoded = [], {}, 0, 0
            for pos, (index, info) in enumerate(taken):
                parts = plan.parts[pos]
                sample = hollow_sample(info)
                if parts is None or parts:
                    try:
                        sample, nread, ndecoded = self._read(index, info, parts)
                        read = None if read is None or nread is None else read + nread
                        decoded += ndecoded
                    except DataError as err:
                        errors[pos] = str(err)
                samples.append(sample)
            owned = [s for s, mine in zip(samples, plan.counts) if mine]
            count = self._loss_count(owned) if owned and not errors else 0
            shared = self._gather("batch", {"bad": errors, "count": count, "read": read, "decoded": decoded})
            bad = {int(pos): msg for peer in shared for pos, msg in peer["bad"].items()}
            if len(bad) < len(taken):
                self._bad_in_a_row = 0  # some sample passed every check
            if not bad:
                return LoadedBatch(
                    samples,
                    plan.schedule,
                    sum(p["count"] for p in shared),
                    [p["read"] for p in shared],
                    [p["decoded"] for p in shared],
                    plan.schedule_s,
                )
            if self.bad is None:
                raise DataError(bad[min(bad)])
            for pos in sorted(bad):
                self._skip(DataError(bad[pos]))
            taken = [t for pos, t in enumerate(taken) if pos not in bad]
