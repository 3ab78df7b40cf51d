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

GPU_FLAGS: Mapping[str, str] = {
    # XLA's latency-hiding scheduler orders the program so asynchronous collectives (fsdp
    # all-gathers, gradient reduce-scatters, transfers) run beside independent compute instead
    # of where they were traced. jax docs, "GPU performance tips" (docs/gpu_performance_tips.md:
    # "--xla_gpu_enable_latency_hiding_scheduler This flag enables latency hiding schedulers to
    # overlap asynchronous communication with computation efficiently. The default value is
    # False."); MaxText's GPU recipes and Levanter's docs set it too.
    "xla_gpu_enable_latency_hiding_scheduler": "true",
}

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


def set_gpu_flags(enabled: bool, env: MutableMapping[str, str] | None = None, installed=None) -> list[str]:
    """Add `GPU_FLAGS` to `env["XLA_FLAGS"]` (default `os.environ`) when `enabled` and JAX will
    start on a GPU; returns the flags added (none on CPU, or when the user set them all)."""
    env = os.environ if env is None else env
    if not enabled or not gpu_expected(env, installed):
        return []
    env["XLA_FLAGS"], added = with_gpu_flags(env.get("XLA_FLAGS", ""))
    return added
