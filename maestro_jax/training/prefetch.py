"""Schedule ahead: the next global batch is read, scheduled and packed while this step runs.

Reading, the wavefront schedule and packing the micro-steps' numpy inputs need only the
samples, never a device result, so a background thread prepares batch N+1 while the host
waits on step N's devices. The training loop then finds the next batch ready (its wait is
reported as `data_wait_s`) instead of paying for it between steps.

Exactness is kept: the data state a checkpoint records is the reader's state after the last
batch the loop took, not after the one prepared ahead, so a resume reads the same stream; a
bad-sample report travels with the batch it belongs to; an error raised while preparing a
batch reaches the loop when it asks for that batch, as it would without the thread.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time

from maestro_jax.data.pipeline import LoadedBatch


@dataclasses.dataclass
class PreparedBatch:
    """A global batch ready to dispatch."""

    batch: LoadedBatch
    host: dict  # the executor's numpy inputs per micro-step (`Executor.host_batches`)
    data_state: dict  # the reader's state once this batch was taken: what a checkpoint records
    skipped: list[str] | None  # bad samples dropped while reading it (skip policy), else None
    read_s: float  # host seconds reading, checking and scheduling it (off the step's path)
    pack_s: float  # host seconds packing its micro-steps' inputs (off the step's path)


_DONE = object()


class Prefetcher:
    """Iterator of `PreparedBatch`es, `depth` ahead of the loop, from `reader` (a `BatchReader`).

    `set_state` works until the first `next`; the thread starts then. `close` stops it."""

    def __init__(self, reader, executor, bad=None, depth: int = 1):
        self._reader, self._executor, self._bad = reader, executor, bad
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._state = reader.get_state()
        self._held = None  # the batch `peek` took off the queue, which `next` returns
        self.data_wait_s = 0.0  # how long the last `next` waited for its batch

    def get_state(self) -> dict:
        return self._state

    def set_state(self, state: dict) -> None:
        if self._thread is not None:
            raise RuntimeError("Prefetcher.set_state after the first batch was taken")
        self._reader.set_state(state)
        self._state = state

    def __iter__(self):
        return self

    def _take(self):
        if self._held is not None:
            item, self._held = self._held, None
            return item
        if self._thread is None:
            self._thread = threading.Thread(target=self._prepare_ahead, name="maestro-prefetch", daemon=True)
            self._thread.start()
        return self._queue.get()

    def peek(self) -> PreparedBatch | None:
        """The batch the next `next` returns, without taking it (the data state a checkpoint
        records stays that of the last batch taken): what run-ahead computes on during this step.
        None at the end of the data, or when preparing the batch failed (`next` raises it)."""
        if self._held is None:
            self._held = self._take()
        return self._held if isinstance(self._held, PreparedBatch) else None

    def __next__(self) -> PreparedBatch:
        t0 = time.perf_counter()
        item = self._take()
        self.data_wait_s = time.perf_counter() - t0
        if item is _DONE:
            raise StopIteration
        if isinstance(item, BaseException):
            self._queue.put(item)  # every later call raises it too
            raise item
        self._state = item.data_state
        return item

    def _prepare_ahead(self) -> None:
        while not self._stop.is_set():
            t0 = time.perf_counter()
            try:
                batch = next(self._reader)
                t1 = time.perf_counter()
                host = self._executor.host_batches(batch.samples, batch.schedule)
                item = PreparedBatch(
                    batch,
                    host,
                    self._reader.get_state(),
                    self._bad.drain() if self._bad is not None else None,
                    t1 - t0,
                    time.perf_counter() - t1,
                )
            except StopIteration:
                item = _DONE
            except BaseException as err:  # noqa: BLE001 - handed to the loop, raised at the batch it belongs to
                item = err
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if item is _DONE or isinstance(item, BaseException):
                return

    def close(self) -> None:
        """Stop preparing batches; a batch being read finishes first (reads are not interrupted)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
