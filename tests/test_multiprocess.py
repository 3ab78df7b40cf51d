"""1 process x 8 devices and 2 processes x 4 devices (real jax.distributed on localhost, gloo,
socket transfers) give the same per-step losses, also when a section spans both processes."""

import json
import os
import socket
import subprocess
import sys

import pytest
from conftest import ROOT, TINY_KD, TINY_VLM

pytestmark = pytest.mark.multiprocess

KD_PLANS = {"sections_span_both_processes": ["sections.teacher.devices=[2,3,4,5]", "sections.student.devices=[0,1,6,7]"]}
VLM_ACROSS = ["sections.vision.devices=0:4", "sections.vision.mesh={data: 2, tensor: 2}", "sections.vision.micro_batch=2",
              "sections.llm.devices=4:8", "sections.llm.mesh={data: 2, tensor: 2}", "sections.llm.micro_batch=2",
              "edges.image_embeds.fanout=1", "models.llm.heads=4", "models.llm.kv_heads=2",
              "schedule.scheduler=wavefront"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def losses(out):
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def run_single(config, overrides, out):
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    proc = subprocess.run([sys.executable, "-m", "maestro_jax.cli", "train", "--config", str(config), *overrides,
                           f"output_dir={out}"], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return losses(out)


def run_two(config, overrides, out):
    env = {**os.environ, "MAESTRO_PORT": str(free_port()), "MAESTRO_JAX": f"{sys.executable} -m maestro_jax.cli"}
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run(["bash", str(ROOT / "scripts/launch_local.sh"), "2", str(config), *overrides,
                           f"output_dir={out}"], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return losses(out)


def test_kd_two_processes_match_one_with_checkpoint_resume(tmp_path):
    """Teacher on process 0, student on process 1. The 2-process run stops after 2 steps and
    resumes from its checkpoint (a process-local section saved through the global view)."""
    config = ROOT / "configs/kd_tiny.yaml"
    one = run_single(config, TINY_KD + ["steps=4"], tmp_path / "one")
    two_dir = tmp_path / "two"
    run_two(config, TINY_KD + ["steps=2", "checkpoint_every=1"], two_dir)
    assert sorted(p.name for p in (two_dir / "checkpoints").glob("manifest-*.json")) == ["manifest-1.json",
                                                                                          "manifest-2.json"]
    two = run_two(config, TINY_KD + ["steps=4", "checkpoint_every=1"], two_dir)
    assert len(one) == len(two) == 4
    for a, b in zip(one, two):
        assert abs(a - b) <= 1e-5 * abs(a), (one, two)


def test_kd_sections_spanning_both_processes(tmp_path):
    config = ROOT / "configs/kd_tiny.yaml"
    overrides = TINY_KD + KD_PLANS["sections_span_both_processes"] + ["steps=2"]
    one = run_single(config, overrides, tmp_path / "one")
    two = run_two(config, overrides, tmp_path / "two")
    assert len(one) == len(two) == 2
    for a, b in zip(one, two):
        assert abs(a - b) <= 1e-5 * abs(a), (one, two)


def test_vlm_cotangents_cross_processes(tmp_path):
    """Vision on process 0, LLM on process 1: embeddings go over and gradients come back."""
    config = ROOT / "configs/vlm_tiny.yaml"
    overrides = TINY_VLM + VLM_ACROSS + ["steps=2"]
    one = run_single(config, overrides, tmp_path / "one")
    two = run_two(config, overrides, tmp_path / "two")
    for a, b in zip(one, two):
        assert abs(a - b) <= 1e-5 * abs(a), (one, two)
