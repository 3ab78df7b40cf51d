"""`maestro-jax` says what it does: `--help` lists every command and gives every option's
default, and XLA's C++ warnings stay off unless `--verbose`."""

import os
import re
import subprocess
import sys

import pytest
from conftest import ROOT, TINY_KD

from maestro_jax import cli

SIX = {"train", "verify", "bench", "simulate", "plan", "export"}


def test_help_lists_every_command_with_one_line():
    proc = subprocess.run(
        [sys.executable, "-m", "maestro_jax.cli", "--help"], check=False, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert set(cli.COMMANDS) >= SIX
    for name, command in cli.COMMANDS.items():
        assert re.search(rf"^ +{name} +{re.escape(command.help.split()[0])}", proc.stdout, re.MULTILINE), (
            name,
            proc.stdout,
        )
    assert "--verbose" in proc.stdout
    first = cli.__doc__.splitlines()[0]
    assert all(name in first for name in cli.COMMANDS), f"the module docstring's first line names them all: {first}"


def _entries(help_text: str) -> dict[str, str]:
    """The help of each argument in a command's `--help`, whitespace joined (wrapping aside)."""
    entries: dict[str, str] = {}
    name = None
    for line in help_text.splitlines():
        m = re.match(r"^  (\S+)", line)
        if m:
            name = m.group(1).rstrip(",")
            entries[name] = line
        elif name and line.startswith("   "):
            entries[name] += line
        else:
            name = None
    return {k: " ".join(v.split()) for k, v in entries.items()}


@pytest.mark.parametrize("name", sorted(SIX))
def test_command_help_gives_every_default(name, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main([name, "--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    entries = _entries(text)
    flags = set(re.findall(r"\[?(--[a-z-]+)", text.split("\n\n")[0]))  # every option the usage line names
    assert {"--config", "--verbose"} <= flags and flags - {"--help"} <= set(entries), (flags, entries)
    for flag, entry in entries.items():
        if flag not in ("-h", "--help"):
            assert "(default:" in entry or "(required)" in entry, (name, entry)
    assert "(required)" in entries["--config"] and "(default: off)" in entries["--verbose"]
    expected = {
        "bench": {"--reps": "(default: 5)", "--batches": "(default: 3)", "--json": "(default: not written)"},
        "plan": {
            "--top": "(default: 10)",
            "--tolerance": f"(default: {cli.TOLERANCE})",
            "--devices": "(required)",
            "--measure": "(default: off)",
        },
        "export": {"--model-type": "(default: llama for an LLM,", "--section": "(required)"},
    }.get(name, {})
    for flag, default in expected.items():
        assert default in entries[flag], (flag, entries[flag])
    assert ("--coordinator" in entries) == cli.COMMANDS[name].devices


@pytest.mark.parametrize(
    "argv,verbose",
    [
        (["simulate", "--config", "x.yaml"], False),
        (["--verbose", "simulate", "--config", "x.yaml"], True),
        (["plan", "--config", "x.yaml", "--devices", "1", "--memory-gb", "1", "--verbose"], True),
    ],
)
def test_verbose_is_global(argv, verbose):
    assert cli._parser().parse_args(argv).verbose is verbose


def test_a_log_level_set_in_the_environment_is_kept_unless_verbose(monkeypatch):
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "1")
    cli._xla_logging(False)
    assert os.environ["TF_CPP_MIN_LOG_LEVEL"] == "1"
    cli._xla_logging(True)
    assert os.environ["TF_CPP_MIN_LOG_LEVEL"] == "0"
    monkeypatch.delenv("TF_CPP_MIN_LOG_LEVEL")
    cli._xla_logging(False)
    assert os.environ["TF_CPP_MIN_LOG_LEVEL"] == cli.XLA_LOG_LEVEL


# A command through `cli.main` (it imports JAX on the way), then a resharding that XLA's SPMD
# partitioner can only do by replicating, which it reports as a C++ warning while compiling:
# the `[SPMD] Involuntary full rematerialization` lines `verify` and `bench` printed on
# configs/vlm_tiny.yaml. Compiled fresh (no persistent cache), so the warning can be emitted.
SCRIPT = """
import os, sys
from maestro_jax import cli
assert "jax" not in sys.modules
status = cli.main(sys.argv[1:])
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

jax.config.update("jax_enable_compilation_cache", False)
print("status", status, "level", os.environ.get("TF_CPP_MIN_LOG_LEVEL"), flush=True)
mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("a", "b"))


def f(x):
    x = jax.lax.with_sharding_constraint(x + 1, NamedSharding(mesh, P(("a", "b"))))
    return jax.lax.with_sharding_constraint(x * 2, NamedSharding(mesh, P(None, None, "a")))


jax.jit(f)(jnp.ones((1, 128, 96))).block_until_ready()
"""


@pytest.mark.parametrize("verbose", [False, True], ids=["default", "verbose"])
def test_xla_warnings_only_with_verbose(verbose, tmp_path):
    script = tmp_path / "run.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CPP_MIN_LOG_LEVEL", "JAX_COMPILATION_CACHE_DIR")}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8")
    argv = [
        *(["--verbose"] if verbose else []),
        "simulate",
        "--config",
        str(ROOT / "configs/kd_tiny.yaml"),
        *TINY_KD,
        "simulate.batches=1",
    ]
    proc = subprocess.run(
        [sys.executable, str(script), *argv],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "per-device speedup" in proc.stdout, "the command ran"
    warned = "[SPMD] Involuntary full rematerialization" in proc.stderr
    assert warned == verbose, proc.stderr[-3000:]
    assert f"status 0 level {cli.XLA_VERBOSE_LOG_LEVEL if verbose else cli.XLA_LOG_LEVEL}" in proc.stdout
    if not verbose:
        assert not re.search(r"^[WI]\d{4} ", proc.stderr, re.MULTILINE), proc.stderr[-3000:]
