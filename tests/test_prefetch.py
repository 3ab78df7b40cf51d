"""training/prefetch.py: the next batch is prepared while the loop holds this one, and
checkpoints, resumes and errors see the stream as if nothing were read ahead."""

import time

import pytest
from conftest import ROOT, TINY_KD

from maestro_jax.config import load_config
from maestro_jax.runtime.build import build_runtime
from maestro_jax.training.prefetch import Prefetcher


@pytest.fixture(scope="module")
def rt():
    return build_runtime(load_config(ROOT / "configs/kd_tiny.yaml", TINY_KD))


def ids(batch):
    return [int(s.id) for s in batch.samples]


def wait_until_ahead(prefetcher):
    deadline = time.monotonic() + 30
    while not prefetcher._queue.full():
        assert time.monotonic() < deadline, "the next batch was never prepared"
        time.sleep(0.01)


def test_the_next_batch_is_prepared_ahead_and_the_state_is_the_taken_ones(rt):
    plain = rt.reader()
    expected = [ids(next(plain)) for _ in range(3)]
    prefetcher = Prefetcher(rt.reader(), rt.executor)
    try:
        first = next(prefetcher)
        wait_until_ahead(prefetcher)  # batch 2 is read, scheduled and packed while we hold batch 1
        assert ids(first.batch) == expected[0]
        assert set(first.host) == {(s, st.index) for s, steps in first.batch.schedule.steps.items() for st in steps}
        state = prefetcher.get_state()  # after batch 1, although batch 2 was read
        resumed = rt.reader()
        resumed.set_state(state)
        assert ids(next(resumed)) == expected[1]
        assert ids(next(prefetcher).batch) == expected[1]
    finally:
        prefetcher.close()
    again = Prefetcher(rt.reader(), rt.executor)
    again.set_state(state)
    try:
        assert ids(next(again).batch) == expected[1]
        with pytest.raises(RuntimeError, match="set_state after the first batch"):
            again.set_state(state)
    finally:
        again.close()


class FailsAtBatch:
    """The real reader, raising at its `n`-th batch (as a bad sample under `error` would)."""

    def __init__(self, reader, n):
        self.reader, self.n, self.taken = reader, n, 0

    def __next__(self):
        self.taken += 1
        if self.taken == self.n:
            raise ValueError(f"batch {self.n} is bad")
        return next(self.reader)

    def get_state(self):
        return self.reader.get_state()

    def set_state(self, state):
        self.reader.set_state(state)


def test_an_error_surfaces_at_the_batch_it_belongs_to(rt):
    prefetcher = Prefetcher(FailsAtBatch(rt.reader(), 3), rt.executor)
    try:
        next(prefetcher)
        next(prefetcher)  # batch 3 failed in the thread meanwhile; batch 2 is still trained on
        for _ in range(2):
            with pytest.raises(ValueError, match="batch 3 is bad"):
                next(prefetcher)
    finally:
        prefetcher.close()
