"""Shape buckets (`core.buckets`) at every granularity `compile.buckets_per_octave` accepts: what
they cover and pad, the granularity in force, the setting refused when invalid, and the runtime
and the simulator using the config's buckets."""

import threading

import pytest
from conftest import ROOT

from maestro_jax.config import ConfigError, load_config
from maestro_jax.core import buckets
from maestro_jax.core.buckets import PER_OCTAVE, VALID, bucket, granularity


@pytest.mark.parametrize("per_octave", VALID)
@pytest.mark.parametrize("minimum", [1, 8, 16, 256])
def test_buckets_cover_every_size_and_bound_the_padding(per_octave, minimum):
    """Every size fits its bucket, a multiple of `minimum`; past `minimum * per_octave` the
    padding is under 1 / per_octave of the size, below it under `minimum`; buckets grow with the
    size, and their number only logarithmically with the largest (per_octave an octave)."""
    with granularity(per_octave):
        sizes = range(1, 20000)
        got = [bucket(n, minimum) for n in sizes]
    for n, b in zip(sizes, got):
        assert b >= n and b % minimum == 0
        assert b - n < (n / per_octave if n > minimum * per_octave else minimum)
    assert got == sorted(got)
    octaves = (max(sizes) // minimum).bit_length()
    assert len(set(got)) <= 1 + per_octave * octaves


def test_the_default_granularity_is_eight_an_octave():
    """Outside any `granularity` block: 8 an octave (at most 12.5% past the minimum's octaves)."""
    assert buckets.per_octave() == PER_OCTAVE == 8
    assert [bucket(n) for n in (16, 17, 128, 129, 144, 145, 1000)] == [16, 32, 128, 144, 144, 160, 1024]
    with granularity(1):
        assert [bucket(n) for n in (17, 33, 129, 1000)] == [32, 64, 256, 1024]
        with granularity(2):
            assert bucket(129) == 192
        assert bucket(129) == 256
    assert bucket(129) == 144


def test_a_granularity_holds_in_its_own_thread_only():
    seen = []
    with granularity(1):
        worker = threading.Thread(target=lambda: seen.append(buckets.per_octave()))
        worker.start()
        worker.join()
        assert buckets.per_octave() == 1
    assert seen == [PER_OCTAVE]


@pytest.mark.parametrize("value", ["3", "0", "64", "true", "1.5", '"8"'])
def test_an_invalid_granularity_is_refused_in_one_line(value):
    with pytest.raises(ConfigError) as err:
        load_config(ROOT / "configs/vlm_tiny.yaml", [f"compile.buckets_per_octave={value}"])
    message = str(err.value)
    assert message.startswith("error: compile.buckets_per_octave=") and "\n" not in message
    if value in ("3", "0", "64"):
        assert message.endswith("valid: one of 1, 2, 4, 8, 16, 32 (a power of two: buckets per octave of size)")
    with pytest.raises(ValueError, match="one of 1, 2, 4, 8, 16, 32, got 3"):
        with granularity(3):
            pass


def test_the_simulator_prices_the_configs_buckets(monkeypatch):
    """`simulate_config` prices every micro-step at the config's granularity (what the runtime
    pads to), not the default."""
    from maestro_jax.planning import cost
    from maestro_jax.tools.simulate import simulate_config

    priced = []

    def spy(n, minimum=16):
        priced.append(buckets.per_octave())
        return bucket(n, minimum)

    monkeypatch.setattr(cost, "bucket", spy)
    simulate_config(load_config(ROOT / "configs/vlm_tiny.yaml", ["compile.buckets_per_octave=2"]))
    assert priced and set(priced) == {2}


def test_the_runtime_packs_batches_to_the_configs_buckets():
    """Sectioned and monolithic host batches at `compile.buckets_per_octave=1`: every bucketed
    length a power of two, whatever granularity the caller is in."""
    from maestro_jax.runtime.build import build_monolithic, build_runtime

    small = ["global_batch=8", "models.vision.depth=1", "models.llm.depth=1"]  # lengths 16 to 144: several octaves
    cfg = load_config(ROOT / "configs/vlm_tiny.yaml", small + ["compile.buckets_per_octave=1"])
    rt = build_runtime(cfg)
    samples = [rt.source[i] for i in range(cfg.global_batch)]
    host = rt.executor.host_batches(samples, rt.schedule(samples))
    mono = build_monolithic(rt).model.host_batches(samples)
    lengths = {b["input_ids"].shape[1] for (s, _), b in host.items() if s == "llm"}
    lengths |= {b["llm"]["input_ids"].shape[1] for b in mono}
    patches = {b["patches"].shape[1] for (s, _), b in host.items() if s == "vision"}
    assert lengths and patches and all(n & (n - 1) == 0 for n in lengths | patches), (lengths, patches)


QUICK_START_PROGRAMS = 30  # configs/vlm_tiny.yaml's 8 steps at one bucket an octave (56 at eight)


def test_the_quick_start_compiles_at_most_its_measured_program_count():
    """The README's first command (`train --config configs/vlm_tiny.yaml`): the programs its
    steps need, counted by tracing them as `train` does before compiling (its "compiling N
    programs" line), stay within the count its coarse buckets gave."""
    from maestro_jax.runtime import ahead
    from maestro_jax.runtime.build import build_runtime

    cfg = load_config(ROOT / "configs/vlm_tiny.yaml")
    rt = build_runtime(cfg)
    rt.step.init()  # as `train` does: init's own programs are compiled before
    tracer, _, _ = ahead.trace_batches(rt.step, rt.batch_infos(ahead.bounded(range(cfg.steps))))
    assert len(tracer.new) + len(tracer.transfers) <= QUICK_START_PROGRAMS
