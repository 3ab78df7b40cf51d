"""Compile ahead (`SectionedStep.compile`): every program a run takes is compiled before step 1,
from sample metadata, so that training compiles nothing more; a shape nothing foresaw still
compiles, lazily, into the same cache; the persistent compilation cache can be turned on.

Compiles are counted with `jax.monitoring`: jax 0.10 records `BACKEND_COMPILE` once per XLA
compile request (a persistent-cache hit included), with the jitted function's name."""

import contextlib
import dataclasses
import io
import itertools
import logging
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from conftest import ROOT, TINY_KD, TINY_VLM, TINY_VLM_KD, compiles

from maestro_jax.config import load_config
from maestro_jax.data.samples import Sample
from maestro_jax.runtime import compile_cache
from maestro_jax.runtime.build import build_runtime
from maestro_jax.runtime.step import StepBatch
from maestro_jax.training.loop import train

TRANSFER_PROGRAMS = ("_cut_pieces", "_join_pieces")
STEPS = 3
CONFIGS = {
    "kd": ("kd_tiny.yaml", TINY_KD),
    "vlm": ("vlm_tiny.yaml", TINY_VLM),
    # wavefront, a frozen teacher and a trained ViT feeding the student, run-ahead, global-norm
    # clipping (norms moved between meshes), edges that join pieces of several shards
    "vlm_kd": ("vlm_kd_tiny.yaml", TINY_VLM_KD + ["schedule.run_ahead=1", "optimizer.clip_norm=1.0"]),
}

TRACING = "tracing the steps' shape buckets to find the programs they call"


def is_transfer(name: str) -> bool:
    return any(t in name for t in TRANSFER_PROGRAMS)


# vlm (many shape buckets, 14 s on 2 cores) and vlm_kd (three sections) are slow; kd keeps the
# contract in the quick tier
@pytest.fixture(scope="module", params=[n if n == "kd" else pytest.param(n, marks=pytest.mark.slow) for n in CONFIGS])
def ahead(request):
    path, overrides = CONFIGS[request.param]
    cfg = load_config(ROOT / "configs" / path, overrides + [f"steps={STEPS}"])
    rt = build_runtime(cfg)
    said: list[str] = []
    with compiles() as during:
        count = rt.step.compile(range(cfg.steps), said.append)
    new_transfers = rt.executor.compiled_transfers
    return cfg, rt, count, said, during, new_transfers


@pytest.mark.slow
def test_compile_ahead_says_and_counts_what_it_compiles(ahead):
    """One line first, with the count returned; the count is the number of distinct signatures
    now in the sections' caches plus the transfer programs, each compiled exactly once."""
    _, rt, count, said, during, new_transfers = ahead
    entries = sum(len(p.cache) for p in rt.programs.values())
    sections = sum(1 for p in rt.programs.values() if p.cache)
    assert said[:2] == [TRACING, f"compiling {count} programs for {sections} sections"]
    assert count == entries + len(new_transfers)
    assert entries > len(rt.programs)  # several shape buckets, not one program per section
    # one XLA compile per signature at most: jax reuses the executables of module-level functions
    # (the transfers' cut and join, `squared_norm`, `tree_add`) compiled earlier in this process
    assert 0 < len([n for n in during if not is_transfer(n)]) <= entries
    assert len([n for n in during if is_transfer(n)]) <= len(new_transfers)
    assert not any(e.lazily for p in rt.programs.values() for e in p.cache.values())


def test_training_after_compile_ahead_compiles_nothing(ahead):
    """`steps` training steps through the training loop (prefetching, run-ahead, update, reads)
    after `SectionedStep.compile(range(0, steps))`: no XLA compile from the first step on."""
    cfg, rt, *_ = ahead
    run, first = rt.executor.run, []

    def marked(*args, **kwargs):
        if not first:
            first.append(len(during))
        return run(*args, **kwargs)

    rt.executor.run = marked
    try:
        with compiles() as during:
            history = train(cfg, progress=False, rt=rt)
    finally:
        del rt.executor.run
    assert [r["step"] for r in history] == list(range(1, STEPS + 1))
    assert all(np.isfinite(r["train/loss"]) for r in history)
    assert first and during[first[0] :] == []


@pytest.mark.slow
def test_a_shape_nothing_foresaw_compiles_lazily(ahead, caplog):
    """A batch of sequences longer than any the data holds: its programs compile when called,
    into the same caches, with a warning naming the section and the step; the next call of the
    same shapes compiles nothing."""
    cfg, rt, *_ = ahead
    state = rt.step.init()
    text = [s for s in rt.batches()[0] if not any(s.items.values())]
    samples = [
        Sample(i, np.tile(s.tokens, 6)) for i, s in enumerate(itertools.islice(itertools.cycle(text), cfg.global_batch))
    ]
    schedule = rt.schedule(samples)
    before = {s: set(p.cache) for s, p in rt.programs.items()}
    with caplog.at_level(logging.WARNING, logger="maestro_jax"), compiles() as during:
        loss, _, _ = rt.step.gradients(dataclasses.replace(state, step=6), StepBatch(samples, schedule))
    assert np.isfinite(float(loss))
    lazy = {s: set(p.cache) - before[s] for s, p in rt.programs.items()}
    assert lazy[rt.graph.sink] and all(p.cache[k].lazily for s, p in rt.programs.items() for k in lazy[s])
    assert len([n for n in during if not is_transfer(n)]) <= sum(map(len, lazy.values()))
    warned = [r.getMessage() for r in caplog.records if "compiling a new shape bucket" in r.getMessage()]
    assert any(f"section {rt.graph.sink} at step 7" in m for m in warned), warned
    with compiles() as again:
        again_loss, _, _ = rt.step.gradients(dataclasses.replace(state, step=7), StepBatch(samples, schedule))
    assert again == [] and float(again_loss) == float(loss)


def test_persistent_cache_in_a_directory(tmp_path):
    """`compile_cache.enable` points jax's persistent cache at a directory, small CPU programs
    included; the settings before it come back after."""
    keys = (
        "jax_compilation_cache_dir",
        "jax_persistent_cache_min_compile_time_secs",
        "jax_persistent_cache_min_entry_size_bytes",
    )
    before = {k: getattr(jax.config, k) for k in keys}
    try:
        path = compile_cache.enable(tmp_path / "xla")
        assert compile_cache.directory() == path and path.is_dir()
        assert jax.config.jax_persistent_cache_min_compile_time_secs == 0.0
        assert jax.config.jax_persistent_cache_min_entry_size_bytes == -1
        scale = float(np.random.default_rng().integers(2, 1 << 30))  # a program no cache holds yet
        np.testing.assert_allclose(jax.jit(lambda x: x * scale + 1.0)(np.arange(4.0)), np.arange(4.0) * scale + 1.0)
        assert any(path.iterdir()), "the executable was written to the directory"
    finally:  # the session's cache back as it was (not through `enable`, which checks its entries)
        from jax.experimental.compilation_cache import compilation_cache as cc

        cc.reset_cache()
        for k, v in before.items():
            jax.config.update(k, v)


@contextlib.contextmanager
def cache_events():
    """Counts of jax's persistent-cache events inside the block: requests that may use the cache,
    and hits."""
    counts = {"requests": 0, "hits": 0}
    names = {
        "/jax/compilation_cache/compile_requests_use_cache": "requests",
        "/jax/compilation_cache/cache_hits": "hits",
    }

    def listen(event: str, **kwargs) -> None:
        if event in names:
            counts[names[event]] += 1

    jax.monitoring.register_event_listener(listen)
    try:
        yield counts
    finally:
        jax.monitoring.unregister_event_listener(listen)


@pytest.mark.slow
def test_train_compiles_before_step_one_and_a_rerun_loads_from_the_cache(tmp_path):
    """`train` with an eval block: building, tracing, then "compiling N programs for S sections", each
    said before it starts; no XLA
    compile follows the "compiled" line (training steps, run-ahead, evaluations, reads), the eval
    loss is logged every `eval.every` steps. A second run of the same config sharing
    `compile.cache_dir` finds every program it compiles in jax's persistent cache."""
    path, overrides = CONFIGS["vlm_kd"]
    cache = tmp_path / "cache"
    args = overrides + ["steps=4", "eval.every=2", "eval.batches=1", f"compile.cache_dir={cache}", "keep_checkpoints=0"]
    out = io.StringIO()
    compiled = lambda: "\ncompiled " in "\n" + out.getvalue()  # the "compiled N programs" line was said
    with compiles(when=compiled) as after, contextlib.redirect_stdout(out):
        history = train(load_config(ROOT / "configs" / path, [*args, f"output_dir={tmp_path / 'a'}"]), progress=False)
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("building workload vlm_kd: 3 sections on 8 devices, initialising"), lines
    assert lines[1] == TRACING, lines
    assert lines[2].startswith("compiling ") and lines[2].endswith(" sections"), lines
    assert any(line.startswith("compiled ") for line in lines), lines
    assert after == []
    assert [r["step"] for r in history if "eval/loss" in r] == [2, 4]
    assert all(np.isfinite(r["eval/loss"]) for r in history if "eval/loss" in r)
    assert any(cache.rglob("*")), "executables were written to compile.cache_dir"
    assert compile_cache.directory() is None or compile_cache.directory() != cache, "the settings came back"

    said_again = io.StringIO()
    with cache_events() as counts, contextlib.redirect_stdout(said_again):
        again = train(load_config(ROOT / "configs" / path, [*args, f"output_dir={tmp_path / 'b'}"]), progress=False)
    assert counts["requests"] > 0 and counts["hits"] == counts["requests"], counts
    done = next(line for line in said_again.getvalue().splitlines() if line.startswith("compiled "))
    # "compiled N programs in T s (K loaded from the persistent compile cache)": K of the N were found
    # there (the transfers' programs this process compiled already come from jax's memory instead)
    n, k = int(done.split()[1]), int(done.rsplit("(", 1)[1].split()[0])
    assert 0 < k <= n and done.endswith(" loaded from the persistent compile cache)"), done
    assert [r["train/loss"] for r in again] == [r["train/loss"] for r in history]


@pytest.mark.slow
def test_a_garbled_cache_entry_is_moved_aside_and_compiled_again(tmp_path, caplog):
    """Every entry of a populated cache garbled inside a valid compressed stream (a disk or copy
    fault; XLA crashes deserialising such an entry): the next run moves each aside with one
    warning line, compiles those programs again and trains bit-identical losses."""
    from jax._src.compilation_cache import compress_executable, decompress_executable

    cache = tmp_path / "cache"
    args = TINY_KD + ["steps=2", f"compile.cache_dir={cache}", "keep_checkpoints=0"]
    kd = ROOT / "configs/kd_tiny.yaml"
    first = train(load_config(kd, [*args, f"output_dir={tmp_path / 'a'}"]), progress=False)
    entries = sorted(cache.glob("*-cache"))
    assert entries and all(e.with_name(e.name + compile_cache.SUM).exists() for e in entries)
    for entry in entries:
        raw = bytearray(decompress_executable(entry.read_bytes()))
        middle = slice(len(raw) // 2, len(raw) // 2 + 16)
        raw[middle] = bytes(b ^ 0xFF for b in raw[middle])
        entry.write_bytes(compress_executable(bytes(raw)))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="maestro_jax"):
        again = train(load_config(kd, [*args, f"output_dir={tmp_path / 'b'}"]), progress=False)
    assert [r["train/loss"] for r in again] == [r["train/loss"] for r in first]
    warned = [r.getMessage() for r in caplog.records if "moved aside" in r.getMessage()]
    assert len(warned) == 1 and f" {len(entries)} entries without a matching checksum" in warned[0], warned
    assert sorted(p.name for p in (cache / compile_cache.ASIDE).glob("*-cache")) == [e.name for e in entries]
    assert all(e.with_name(e.name + compile_cache.SUM).exists() for e in cache.glob("*-cache")), "recompiled, recorded"


def _holder(directory):
    """Another run holding `directory`'s writer lock (a live process), until its stdin closes."""
    code = (
        "import fcntl, os, sys; "
        f"fd = os.open({str(directory / compile_cache.WRITERS)!r}, os.O_RDWR | os.O_CREAT); "
        "fcntl.flock(fd, fcntl.LOCK_SH); print('held', flush=True); sys.stdin.read()"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_runs_share_a_cache_directory_safely(tmp_path, caplog):
    """While another run holds the directory: an entry it has not recorded yet stays where it is,
    a damaged one (its checksum differs) is moved aside, and no checksum is written (the other run
    may still be writing). Once it has ended, the last run records every entry; with no other run,
    an unrecorded entry is one a killed run left and is moved aside."""
    cache = tmp_path / "xla"
    cache.mkdir()
    (cache / "fresh-cache").write_bytes(b"written by the other run, not recorded yet")
    (cache / "damaged-cache").write_bytes(b"bit-flipped")
    (cache / ("damaged-cache" + compile_cache.SUM)).write_text("0" * 64)
    other = _holder(cache)
    try:
        with caplog.at_level(logging.WARNING, logger="maestro_jax"):
            moved = compile_cache.move_aside_unchecked(cache, unrecorded=False)
        assert moved == ["damaged-cache"] and (cache / "fresh-cache").exists()
        mine = compile_cache.Cache(cache)
        assert not mine.alone()
        mine.record()
        assert not (cache / ("fresh-cache" + compile_cache.SUM)).exists(), "checksummed while another writes"
    finally:
        other.communicate("")
    assert mine.alone()
    mine.close()  # the last run: records them all
    assert (cache / ("fresh-cache" + compile_cache.SUM)).exists()
    assert compile_cache.move_aside_unchecked(cache) == []
    (cache / "left-by-a-killed-run-cache").write_bytes(b"never recorded")
    assert compile_cache.move_aside_unchecked(cache) == ["left-by-a-killed-run-cache"]


@pytest.mark.slow
def test_the_users_cache_outlives_the_run_and_a_rerun_compiles_nothing(tmp_path):
    """Without `compile.cache_dir` or JAX_COMPILATION_CACHE_DIR the cache is the user's
    (`$XDG_CACHE_HOME/maestro_jax/xla`), with or without `output_dir`: a second run of the same
    command writes no new entry (every program found), and `compile.cache=false` uses none."""
    from conftest import TINY_KD

    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env["XDG_CACHE_HOME"] = str(tmp_path / "home-cache")
    user = tmp_path / "home-cache" / "maestro_jax" / "xla"
    command = [sys.executable, "-m", "maestro_jax.cli", "train", "--config", str(ROOT / "configs/kd_tiny.yaml")]
    command += [*TINY_KD, "steps=1"]

    def entries():
        return sorted(p.name for p in user.glob("*-cache"))

    for run in range(2):
        proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-2000:]
        if run == 0:
            first = entries()
            assert first and all((user / (e + compile_cache.SUM)).exists() for e in first)
    assert entries() == first, "the rerun compiled programs the cache held"
    off = subprocess.run([*command, "compile.cache=false"], env=env, capture_output=True, text=True, timeout=600)
    assert off.returncode == 0 and entries() == first


def test_the_cache_is_held_to_its_size_cap_and_forgets_the_checksums_of_what_it_removed(tmp_path):
    """Under `max_size_bytes` (`compile.cache_max_gb`), jax removes the least recently used
    entries as it writes new ones: after ten programs, each of them written, the entries left sum
    to no more than the cap and fewer than ten remain; `record` writes a checksum for each entry
    left and keeps none for an entry removed."""
    from jax.experimental.compilation_cache import compilation_cache as cc

    with compile_cache.using(tmp_path / "xla") as probe:  # one entry's size, measured without a cap
        scale = float(np.random.default_rng().integers(2, 1 << 30))
        jax.jit(lambda x: x * scale - 1.0)(np.arange(4.0)).block_until_ready()
        entry = max(p.stat().st_size for p in probe.path.glob("*-cache"))
    assert jax.config.jax_compilation_cache_max_size == -1, "the settings before the block come back"
    cap = 3 * entry + entry // 2  # room for three entries of about that size
    path = tmp_path / "capped"
    with compile_cache.using(path, max_size_bytes=cap):
        for i in range(10):
            scale = float(np.random.default_rng().integers(2, 1 << 30)) + i  # programs no cache holds
            jax.jit(lambda x, s=scale: x * s + 1.0)(np.arange(4.0)).block_until_ready()
        assert jax.config.jax_compilation_cache_max_size == cap
        written = sorted(path.glob("*-cache"))
        assert 0 < len(written) < 10, [p.name for p in written]
        assert sum(p.stat().st_size for p in written) <= cap
        (path / f"gone-cache{compile_cache.SUM}").write_text("0" * 64)  # a checksum whose entry jax removed
    cc.reset_cache()
    left = {p.name for p in path.glob("*-cache")}
    sums = {p.name.removesuffix(compile_cache.SUM) for p in path.glob(f"*-cache{compile_cache.SUM}")}
    assert sums == left, (sums, left)
