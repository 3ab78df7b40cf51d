"""The XLA flags a run sets on NVIDIA GPUs, before JAX loads. No JAX here: XLA reads
`XLA_FLAGS` once, when the backend starts, so the CLI calls `set_gpu_flags` before importing it.

Each flag is one the best-kept JAX trainers set on GPU for overlapping communication with
compute (sources beside each). A flag the user's `XLA_FLAGS` already names is left as the user
set it; `compile.gpu_flags: false` sets none. They are set only where a CUDA plugin of jax is
installed and `JAX_PLATFORMS` does not rule the GPU out: on CPU nothing changes.
"""

from __future__ import annotations

import importlib.metadata
import os
from collections.abc import Mapping, MutableMapping

# Sources: [tips] jax docs, "GPU performance tips" (jax-ml/jax docs/gpu_performance_tips.md);
# [maxtext] AI-Hypercomputer/maxtext MaxText/configs/a3/llama_2_7b/1vm.sh, the XLA_FLAGS of its
# H100 recipes; [toolbox] NVIDIA/JAX-Toolbox rosetta/docs/GPU_performance.md. Each name was checked
# to exist in jaxlib 0.10.2 and in jaxlib 0.11.2 with jax-cuda13-plugin 0.11.2 (an unknown flag
# aborts XLA at start-up; several flags those scripts still set, such as
# xla_gpu_enable_async_all_gather or xla_gpu_graph_level, no longer exist);
# tests/test_gpu_paths.py starts the installed XLA with all of them.
GPU_FLAGS: Mapping[str, str] = {
    # order the program so asynchronous collectives (fsdp all-gathers, gradient reduce-scatters)
    # run beside independent compute; off by default [tips, maxtext]
    "xla_gpu_enable_latency_hiding_scheduler": "true",
    # the collectives' stream at the highest priority, so compute does not starve it [maxtext]
    "xla_gpu_enable_highest_priority_async_stream": "true",
    # start a scanned layer's all-gather / reduce-scatter / all-reduce one iteration early, so
    # it overlaps the previous layer's compute [toolbox, maxtext]; the names jax 0.11 still
    # accepts (its new xla_gpu_pipeline_* names do not exist in 0.10)
    "xla_gpu_enable_pipelined_all_gather": "true",
    "xla_gpu_enable_pipelined_reduce_scatter": "true",
    "xla_gpu_enable_pipelined_all_reduce": "true",
    # double-buffer scan loops so the next layer's collective has a buffer to land in [toolbox]
    "xla_gpu_enable_while_loop_double_buffering": "true",
    # combine small collectives into large ones (one layer's weights gathered at once) [tips,
    # maxtext: 128 MiB, 128 MiB, 64 MiB], whatever their dimension [maxtext]
    "xla_gpu_all_reduce_combine_threshold_bytes": str(128 << 20),
    "xla_gpu_all_gather_combine_threshold_bytes": str(128 << 20),
    "xla_gpu_reduce_scatter_combine_threshold_bytes": str(64 << 20),
    "xla_gpu_enable_all_gather_combine_by_dim": "false",
    "xla_gpu_enable_reduce_scatter_combine_by_dim": "false",
}

# `verify` where a section computes in float32 (matmuls at precision `highest`): every dot is then a
# GEMM-fusion autotuning candidate, and vlm_tiny's float32 verify was still compiling after 420 s
# on an H200 (bfloat16: 123 s; benchmarks/log/gpu.md "Running on a GPU"); the GEMM autotuner took
# 3.7 of 7 minutes of a MaxText compile (openxla/xla PR #13108). Level 0 autotunes nothing: both
# sides of the comparison then take XLA's default kernels, the same ones, so no autotuning noise
# separates them either (openxla/xla#37902: per-fusion autotune results vary between runs).
VERIFY_FLOAT32_FLAGS: Mapping[str, str] = {"xla_gpu_autotune_level": "0"}


def graph_flags(min_thunks: int | None) -> dict[str, str]:
    """`compile.cuda_graph_min_thunks` as XLA flags: a program of at least that many thunks runs
    as one CUDA graph (XLA's default: 5), so a short, launch-bound program pays one launch; None:
    XLA's default. A third-party launch-bound JAX step ran 1.71x faster with 1 (the GPU check times
    it on the 256- and 1024-token layers before any default changes)."""
    return {} if min_thunks is None else {"xla_gpu_graph_min_graph_size": str(min_thunks)}


CUDA_PLUGINS = ("jax-cuda12-plugin", "jax-cuda13-plugin")


def gpu_expected(env: Mapping[str, str], installed=None) -> bool:
    """Whether JAX will start on an NVIDIA GPU: a CUDA plugin is installed and `JAX_PLATFORMS`
    (when set) names `cuda` or `gpu`. `installed(name) -> bool` defaults to the package metadata."""
    platforms = env.get("JAX_PLATFORMS", "").strip().lower()
    if platforms and not ({"cuda", "gpu"} & {p.strip() for p in platforms.split(",")}):
        return False
    installed = installed or _installed
    return any(installed(p) for p in CUDA_PLUGINS)


def _installed(name: str) -> bool:
    try:
        importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def with_gpu_flags(xla_flags: str, flags: Mapping[str, str] = GPU_FLAGS) -> tuple[str, list[str]]:
    """`xla_flags` with each of `flags` appended unless it already names that flag (the user's
    value wins), and the flags added, as `--name=value`."""
    named = {word.lstrip("-").split("=", 1)[0] for word in xla_flags.split()}
    added = [f"--{name}={value}" for name, value in flags.items() if name not in named]
    return " ".join([xla_flags.strip(), *added]).strip(), added


def set_gpu_flags(
    enabled: bool, env: MutableMapping[str, str] | None = None, installed=None, extra: Mapping[str, str] = {}
) -> list[str]:
    """Add `GPU_FLAGS` to `env["XLA_FLAGS"]` (default `os.environ`) when `enabled`, and `extra`
    (the command's own: `VERIFY_FLOAT32_FLAGS`, `graph_flags`) whatever `enabled` says, when JAX
    will start on a GPU; returns the flags added (none on CPU, or when the user set them all)."""
    env = os.environ if env is None else env
    flags = {**(GPU_FLAGS if enabled else {}), **extra}
    if not flags or not gpu_expected(env, installed):
        return []
    env["XLA_FLAGS"], added = with_gpu_flags(env.get("XLA_FLAGS", ""), flags)
    return added
