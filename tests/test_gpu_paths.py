"""The GPU fast paths, checked where a CPU can check them: the attention implementation chosen
per backend and dtype, the XLA GPU flags (added only on a GPU, the user's own winning, and
every name known to the installed XLA), verify's float32 matmul precision, and buffer donation
(the update program reuses the state's buffers: compiled memory shows it, and a run that donates
trains the same losses as one that does not; `bench` and a run checkpointed and resumed donate
as an accelerator does)."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ROOT, TINY_KD
from maestro_jax.models.attention import cudnn_takes

from maestro_jax.config import load_config
from maestro_jax.runtime.build import build_runtime
from maestro_jax.runtime.xla_flags import (
    GPU_FLAGS,
    VERIFY_FLOAT32_FLAGS,
    gpu_expected,
    graph_flags,
    set_gpu_flags,
    with_gpu_flags,
)
from maestro_jax.tools.verify import matmul_precision


@pytest.mark.parametrize(
    ("platform", "dtype", "head_dim", "lengths", "capability", "expected"),
    [
        ("gpu", jnp.bfloat16, 128, (64, 64), 9.0, "cudnn"),
        ("gpu", jnp.float16, 64, (32, 48), 8.0, "cudnn"),
        ("gpu", jnp.float32, 128, (64, 64), 9.0, "xla"),  # cuDNN's kernel takes no float32
        ("cpu", jnp.bfloat16, 128, (64, 64), 0.0, "xla"),
        ("gpu", jnp.bfloat16, 68, (64, 64), 9.0, "xla"),  # not a multiple of 8
        ("gpu", jnp.bfloat16, 256, (64, 64), 9.0, "cudnn"),  # Hopper takes 256
        ("gpu", jnp.bfloat16, 256, (64, 64), 8.0, "xla"),  # Ampere stops at 128
        ("gpu", jnp.bfloat16, 64, (63, 63), 9.0, "xla"),  # odd lengths: no masked backward
    ],
)
def test_attention_implementation(platform, dtype, head_dim, lengths, capability, expected):
    assert ("cudnn" if cudnn_takes(platform, dtype, head_dim, *lengths, capability) else "xla") == expected


def test_gpu_flags_only_on_a_gpu_and_the_users_own_win():
    has_plugin = lambda name: name == "jax-cuda13-plugin"
    env = {"XLA_FLAGS": "--xla_gpu_enable_latency_hiding_scheduler=false --xla_dump_to=/tmp/d"}
    added = set_gpu_flags(True, env, has_plugin)
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" not in env["XLA_FLAGS"]  # the user's value stays
    assert env["XLA_FLAGS"].startswith("--xla_gpu_enable_latency_hiding_scheduler=false --xla_dump_to=/tmp/d")
    assert added == [f"--{k}={v}" for k, v in GPU_FLAGS.items() if k != "xla_gpu_enable_latency_hiding_scheduler"]
    assert all(a in env["XLA_FLAGS"] for a in added)

    env = {}
    assert set_gpu_flags(True, env, has_plugin) == [f"--{k}={v}" for k, v in GPU_FLAGS.items()]
    assert with_gpu_flags(env["XLA_FLAGS"]) == (env["XLA_FLAGS"], [])  # a second call adds nothing

    for env, plugin, enabled in [
        ({}, lambda name: False, True),  # no CUDA plugin: CPU
        ({"JAX_PLATFORMS": "cpu"}, has_plugin, True),  # the GPU ruled out
        ({}, has_plugin, False),  # compile.gpu_flags: false
    ]:
        assert set_gpu_flags(enabled, env, plugin) == [] and "XLA_FLAGS" not in env
    assert gpu_expected({"JAX_PLATFORMS": "cuda,cpu"}, has_plugin)


def test_verify_of_a_float32_section_autotunes_no_gemm_and_cuda_graphs_follow_the_config():
    """`verify` compiles its float32 programs without GEMM autotuning (the H200's 420 s compile),
    other commands and bfloat16 verifies keep XLA's autotuner; `compile.cuda_graph_min_thunks`
    reaches XLA as `xla_gpu_graph_min_graph_size`; both only where JAX starts on a GPU, and
    `compile.gpu_flags: false` leaves them (the command's own) in."""
    from maestro_jax.cli import COMMANDS, _command_flags

    f32 = load_config(ROOT / "configs/kd_tiny.yaml", [])
    bf16 = load_config(
        ROOT / "configs/kd_tiny.yaml", ["sections.student.precision=bfloat16", "sections.teacher.precision=bfloat16"]
    )
    assert _command_flags(COMMANDS["verify"], f32) == VERIFY_FLOAT32_FLAGS
    assert _command_flags(COMMANDS["verify"], bf16) == {} and _command_flags(COMMANDS["train"], f32) == {}
    graphs = load_config(ROOT / "configs/kd_tiny.yaml", ["compile.cuda_graph_min_thunks=1"])
    assert _command_flags(COMMANDS["train"], graphs) == {"xla_gpu_graph_min_graph_size": "1"}
    has_plugin = lambda name: name == "jax-cuda13-plugin"
    env = {}
    assert set_gpu_flags(False, env, has_plugin, VERIFY_FLOAT32_FLAGS) == ["--xla_gpu_autotune_level=0"]
    assert set_gpu_flags(True, {"JAX_PLATFORMS": "cpu"}, has_plugin, VERIFY_FLOAT32_FLAGS) == []


def test_every_gpu_flag_is_known_to_the_installed_xla():
    """XLA aborts at start-up on a flag it does not know; these parse even on CPU."""
    every = {**GPU_FLAGS, **VERIFY_FLOAT32_FLAGS, **graph_flags(1)}
    flags = " ".join(f"--{k}={v}" for k, v in every.items())
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-c", "import jax.numpy as jnp; print(float(jnp.ones(2).sum()))"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "2.0", proc.stderr[-2000:]


def test_verify_sets_highest_matmul_precision_on_gpu_for_float32():
    f32 = load_config(ROOT / "configs/kd_tiny.yaml", [])
    bf16 = load_config(
        ROOT / "configs/kd_tiny.yaml", [f"sections.{s}.precision=bfloat16" for s in ("teacher", "student")]
    )
    assert matmul_precision("gpu", f32) == "highest"
    assert matmul_precision("cpu", f32) is None  # full float32 already
    assert matmul_precision("gpu", bf16) is None  # its own tolerance


def _nbytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


@pytest.mark.slow
def test_donated_update_reuses_the_state_and_trains_the_same():
    """With `compile.donate=true` (what accelerators do by default) the update program aliases the
    section's params and optimizer state into its outputs: compiled memory shows the aliased bytes,
    the old buffers are gone after the update, and two steps give the same losses, grads and
    params as without donation."""
    results = {}
    for donate in (False, True):
        cfg = load_config(ROOT / "configs/kd_tiny.yaml", [*TINY_KD, f"compile.donate={str(donate).lower()}"])
        rt = build_runtime(cfg)
        states = rt.step.init()
        prog = rt.programs["student"]
        assert prog.donate is donate
        losses = []
        for samples in rt.batches()[:2]:
            old = states["student"]
            states, metrics = rt.step(states, samples)
            losses.append(float(metrics.loss))
            leaf = jax.tree.leaves(old.params)[0]
            assert leaf.is_deleted() is donate  # donated: the update reused its buffer
        results[donate] = losses, jax.tree.map(np.asarray, states["student"].params)
        if donate:
            entry = next(e for (kind, _), e in prog.cache.items() if kind == "update")
            m = entry.executable.memory_analysis()
            state_bytes = _nbytes(states["student"].params) + _nbytes(states["student"].opt_state)
            assert m.alias_size_in_bytes >= 0.9 * state_bytes, (m.alias_size_in_bytes, state_bytes)
    assert results[True][0] == results[False][0]
    for a, b in zip(jax.tree.leaves(results[True][1]), jax.tree.leaves(results[False][1])):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_bench_donates_as_an_accelerator_does(tmp_path):
    """`bench` with `compile.donate=true` (an accelerator's default) never hands a program a
    buffer an earlier update consumed: calibration goes on from the state its timed updates
    return, and every mode from its own latest state (on an H200, calibration once timed two
    updates of one state and stopped with "Array has been deleted")."""
    from maestro_jax.tools import calibrate
    from maestro_jax.tools.bench import bench

    cfg = load_config(ROOT / "configs/kd_tiny.yaml", [*TINY_KD, "compile.donate=true"])
    rt = build_runtime(cfg)
    assert all(p.donate for p in rt.programs.values())
    start = rt.step.init()
    _, after = calibrate.measure(rt, start, rt.batches()[:1], repeats=1)
    assert jax.tree.leaves(start["student"].params)[0].is_deleted(), "the timed updates donated"
    assert not jax.tree.leaves(after["student"].params)[0].is_deleted()
    report = bench(cfg, reps=1, num_batches=1, trace_dir=str(tmp_path), rt=rt)
    assert all(v > 0 for v in report["samples_per_s"].values())
    assert report["simulator"]["cost_source"] == "calibrated"


@pytest.mark.slow
def test_donating_run_checkpoints_and_resumes_like_one_that_does_not(tmp_path):
    """An accelerator's run donates each step's state to the next while Orbax saves it
    asynchronously: the checkpoint must hold the saved step's values, not buffers a later step
    consumed. Three donating steps, checkpointed every step, resumed to five, give the losses of
    five steps straight through without donation."""
    import json

    from maestro_jax.cli import main

    def run(out, steps, donate):
        args = ["train", "--config", str(ROOT / "configs/kd_tiny.yaml"), *TINY_KD, f"steps={steps}"]
        args += [f"output_dir={out}", "checkpoint_every=1", "async_checkpoint=true", f"compile.donate={donate}"]
        assert main(args) == 0
        return [json.loads(line)["train/loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]

    run(tmp_path / "donated", 3, "true")
    resumed = run(tmp_path / "donated", 5, "true")
    assert resumed == run(tmp_path / "kept", 5, "false")
    assert len(resumed) == 5
