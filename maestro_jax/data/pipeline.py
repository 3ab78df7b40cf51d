"""The Grain pipeline: shuffled global batches, validated samples, resumable iterator state."""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING

from maestro_jax.data.samples import DataError

if TYPE_CHECKING:
    import grain

log = logging.getLogger("maestro_jax")


def _read(source, check, keep_errors: bool, index: int):
    """Sample `index`, validated; under the `skip` policy a bad one comes back as its DataError."""
    try:
        return check(source[int(index)]) if check else source[int(index)]
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
    import grain

    ds = (_ordered(source, seed, shuffle).map(functools.partial(_read, source, check, bad is not None))
          .to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)))
    if bad is not None:
        ds = ds.filter(bad.keep)
    return ds.batch(global_batch, drop_remainder=True, batch_fn=list)
