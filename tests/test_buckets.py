"""Shape buckets (`core.buckets`) at every granularity `compile.buckets_per_octave` accepts: what
they cover and pad, the default, the setting refused when invalid, and the runtime, the planner
and the simulator using the config's buckets, passed explicitly (no ambient setting)."""

import dataclasses

import pytest
from conftest import ROOT

from maestro_jax.config import ConfigError, load_config
from maestro_jax.core.buckets import PER_OCTAVE, VALID, bucket


@pytest.mark.parametrize("per_octave", VALID)
@pytest.mark.parametrize("minimum", [1, 8, 16, 256])
def test_buckets_cover_every_size_and_bound_the_padding(per_octave, minimum):
    """Every size fits its bucket, a multiple of `minimum`; past `minimum * per_octave` the
    padding is under 1 / per_octave of the size, below it under `minimum`; buckets grow with the
    size, and their number only logarithmically with the largest (per_octave an octave)."""
    sizes = range(1, 20000)
    got = [bucket(n, minimum, per_octave) for n in sizes]
    for n, b in zip(sizes, got):
        assert b >= n and b % minimum == 0
        assert b - n < (n / per_octave if n > minimum * per_octave else minimum)
    assert got == sorted(got)
    octaves = (max(sizes) // minimum).bit_length()
    assert len(set(got)) <= 1 + per_octave * octaves


def test_the_default_granularity_is_eight_an_octave():
    """Unless given `per_octave`: 8 an octave (at most 12.5% past the minimum's octaves)."""
    assert PER_OCTAVE == 8
    assert [bucket(n) for n in (16, 17, 128, 129, 144, 145, 1000)] == [16, 32, 128, 144, 144, 160, 1024]
    assert [bucket(n, per_octave=1) for n in (17, 33, 129, 1000)] == [32, 64, 256, 1024]
    assert bucket(129, per_octave=2) == 192
    assert bucket(129) == 144


def test_a_python_caller_of_the_planner_prices_the_configs_buckets():
    """`planner_for` on a config at one bucket an octave, with nothing set up around it, prices
    and sizes the config's plan at that granularity: the padded micro-steps and activations of a
    planner at 1 exceed those of the same config at 8 (long texts: past the cost model's 256-unit
    smallest bucket). Under the old ambient setting both priced the default."""
    from maestro_jax.tools.plan import planner_for

    small = ["models.vision.depth=1", "models.llm.depth=1", "data.text_len=[300,700]"]
    coarse, fine = (
        load_config(ROOT / "configs/vlm_tiny.yaml", small + [f"compile.buckets_per_octave={k}"]) for k in (1, 8)
    )
    plan = coarse.plan()
    one, eight = planner_for(coarse, 8, 1.0), planner_for(fine, 8, 1.0)
    assert (one.spec.buckets_per_octave, eight.spec.buckets_per_octave) == (1, 8)
    assert one.step_time(plan) > eight.step_time(plan)
    memory = {p: {s: m["activations"] for s, m in p.check(plan).items()} for p in (one, eight)}
    assert all(memory[one][s] >= memory[eight][s] for s in plan.sections)
    assert any(memory[one][s] > memory[eight][s] for s in plan.sections)
    assert one.spec == dataclasses.replace(eight.spec, buckets_per_octave=1)  # the only difference


@pytest.mark.parametrize("value", ["3", "0", "64", "true", "1.5", '"8"'])
def test_an_invalid_granularity_is_refused_in_one_line(value):
    with pytest.raises(ConfigError) as err:
        load_config(ROOT / "configs/vlm_tiny.yaml", [f"compile.buckets_per_octave={value}"])
    message = str(err.value)
    assert message.startswith("error: compile.buckets_per_octave=") and "\n" not in message
    if value in ("3", "0", "64"):
        assert message.endswith("valid: one of 1, 2, 4, 8, 16, 32 (a power of two: buckets per octave of size)")
    with pytest.raises(ValueError, match="one of 1, 2, 4, 8, 16, 32, got 3"):
        bucket(100, per_octave=3)


def test_the_simulator_prices_the_configs_buckets(monkeypatch):
    """`simulate_config` prices every micro-step at the config's granularity (what the runtime
    pads to), not the default."""
    from maestro_jax.planning import cost
    from maestro_jax.tools.simulate import simulate_config

    priced = []

    def spy(n, minimum=16, per_octave=PER_OCTAVE):
        priced.append(per_octave)
        return bucket(n, minimum, per_octave)

    monkeypatch.setattr(cost, "bucket", spy)
    simulate_config(load_config(ROOT / "configs/vlm_tiny.yaml", ["compile.buckets_per_octave=2"]))
    assert priced and set(priced) == {2}


def test_the_runtime_packs_batches_to_the_configs_buckets():
    """Sectioned and monolithic host batches at `compile.buckets_per_octave=1`: every bucketed
    length a power of two (the sections were built from the config: nothing to set up)."""
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


@pytest.mark.parametrize("config", ["vlm_tiny", "kd_tiny", "omni_tiny", "vlm_kd_tiny"])
def test_every_built_in_section_pads_at_the_configs_buckets(config):
    """Each built-in workload's sections, built from the config (`workloads.build_graph`), pad
    every bucketed size (dim 1 of each batch array: lengths, patches, frames, class slots) at
    the config's granularity, in rows and in packed rows: at 1 an octave all powers of two; the
    same samples at 8 an octave give other sizes too (the check bites)."""
    from maestro_jax import workloads

    extra = (
        ["models.vision.class_token=true", "models.vision.pos_embed=table"]
        if "vlm" in config or "omni" in config
        else []
    )

    def sizes(per_octave: int) -> set[int]:
        cfg = load_config(ROOT / f"configs/{config}.yaml", extra + [f"compile.buckets_per_octave={per_octave}"])
        graph, source = workloads.build_graph(cfg), workloads.source_from_config(cfg)
        samples = [source[i] for i in range(32)]
        out = set()
        for sec in graph.sections:
            for i in range(0, len(samples), 4):
                rows = [x if sec.activates(x.info()) else None for x in samples[i : i + 4]]
                if not any(r is not None for r in rows):
                    continue
                batches = [sec.host_batch(rows, {})]
                if sec.packed_batch is not None:
                    batches.append(sec.packed_batch(rows, {}, 1, 2))
                out |= {a.shape[1] for b in batches for a in b.values() if a.ndim >= 2}
        return out

    coarse = sizes(1)
    assert all(n & (n - 1) == 0 for n in coarse), coarse
    assert any(n & (n - 1) for n in sizes(8))


# configs/vlm_tiny.yaml's 8 steps at one bucket an octave (56 at eight); 30 before its data mixed in
# video clips (2026-12-07), whose temporal patches give the tower more patch and segment counts
QUICK_START_PROGRAMS = 35


@pytest.mark.slow  # compiles the quick start's steps; the quick tier's bucket contract: test_the_runtime_packs_batches_to_the_configs_buckets
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
