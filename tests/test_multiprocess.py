"""1 process x 8 devices, 2 processes x 4 and 4 x 2 (real jax.distributed on localhost, gloo,
socket transfers) give the same per-step losses: the shipped plans unchanged (only the models
shrunk), sections alone in one process feeding sections of other device counts, sections
spanning processes, pipeline stages whose edges cross processes, gradients crossing back, stop
and resume."""

import json
import os
import shutil
import subprocess
import sys

import pytest
from conftest import ROOT, TINY_KD, TINY_VLM, free_ports

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

KD_MODELS = [o for o in TINY_KD if not o.startswith("sections.")]  # the shipped plan, smaller models
KD_PLANS = {
    "sections_span_both_processes": ["sections.teacher.devices=[2,3,4,5]", "sections.student.devices=[0,1,6,7]"]
}


def losses(out):
    return [json.loads(line)["train/loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def run_single(config, overrides, out):
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    proc = subprocess.run(
        [sys.executable, "-m", "maestro_jax.cli", "train", "--config", str(config), *overrides, f"output_dir={out}"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return losses(out)


def launch(n, config, overrides, out):
    env = {**os.environ, "MAESTRO_PORT": str(free_ports(n + 1)), "MAESTRO_JAX": f"{sys.executable} -m maestro_jax.cli"}
    env.pop("XLA_FLAGS", None)
    return subprocess.run(
        ["bash", str(ROOT / "scripts/launch_local.sh"), str(n), str(config), *overrides, f"output_dir={out}"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def first_error(stderr: str) -> str:
    """The first traceback or `error:` line of the merged logs (the root cause; later processes'
    shutdown noise fills the tail), then the tail."""
    lines = stderr.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith(("Traceback", "error:"))), len(lines))
    return "\n".join(lines[start : start + 40]) + "\n...\n" + stderr[-1500:]


def run_two(config, overrides, out, n=2):
    proc = launch(n, config, overrides, out)
    assert proc.returncode == 0, first_error(proc.stderr)
    return losses(out)


def same(one, other):
    assert len(one) == len(other)
    for a, b in zip(one, other):
        assert abs(a - b) <= 1e-5 * abs(a), (one, other)


@pytest.fixture(scope="module")
def kd_one(tmp_path_factory):
    """The 1-process losses of kd_tiny's shipped plan (smaller models), 4 steps: the reference of
    every KD layout below (any plan gives the same step: the equivalence invariant)."""
    return run_single(
        ROOT / "configs/kd_tiny.yaml", KD_MODELS + ["steps=4", "keep_checkpoints=0"], tmp_path_factory.mktemp("kd_one")
    )


def test_kd_two_processes_match_one_with_checkpoint_resume(tmp_path, kd_one):
    """Teacher on process 0, student on process 1. The 2-process run stops after 2 steps and
    resumes from its checkpoint (process-local sections saved through the layout over all devices)."""
    config = ROOT / "configs/kd_tiny.yaml"
    one = kd_one
    two_dir = tmp_path / "two"
    run_two(config, KD_MODELS + ["steps=2", "checkpoint_every=1"], two_dir)
    assert sorted(p.name for p in (two_dir / "checkpoints").glob("manifest-*.json")) == [
        "manifest-1.json",
        "manifest-2.json",
    ]
    two = run_two(config, KD_MODELS + ["steps=4", "checkpoint_every=1"], two_dir)
    assert len(one) == len(two) == 4
    for a, b in zip(one, two):
        assert abs(a - b) <= 1e-5 * abs(a), (one, two)


def test_kd_sections_spanning_both_processes(tmp_path, kd_one):
    """Both sections spread over both processes, with other micro-batches than the reference."""
    config = ROOT / "configs/kd_tiny.yaml"
    overrides = TINY_KD + KD_PLANS["sections_span_both_processes"] + ["steps=2"]
    same(kd_one[:2], run_two(config, overrides, tmp_path / "two"))


@pytest.mark.extended  # CI keeps stages in one process (tests/test_stages.py) and KD across two
def test_kd_pipeline_stages_across_processes(tmp_path):
    """Teacher and student each in 2 pipeline stages, every stage edge crossing from process 0 to
    process 1, the teacher's hidden states split over `tensor` and the student's over `context`
    on the way (`runtime.sharding.edge_sharding`): the losses of the same plan in one process
    (which is the unstaged monolithic step, `tests/test_stages.py`)."""
    config = ROOT / "configs/kd_tiny.yaml"
    staged = [
        *TINY_KD,
        "models.teacher.depth=2",
        "models.student.depth=2",
        "sections.teacher.devices=[0,1,6,7]",
        "sections.teacher.stages=2",
        "sections.student.devices=[2,3,4,5]",
        "sections.student.mesh={data: 2, context: 2}",
        "sections.student.stages=2",
        "steps=2",
        "keep_checkpoints=0",
    ]
    same(run_single(config, staged, tmp_path / "one"), run_two(config, staged, tmp_path / "two"))


@pytest.fixture(scope="module")
def vlm_one(tmp_path_factory):
    """The 1-process run of vlm_tiny's shipped plan (smaller models), 5 steps: its losses are the
    reference of every VLM layout below, its metrics.jsonl the 1-process decoding counts."""
    out = tmp_path_factory.mktemp("vlm_one")
    return run_single(ROOT / "configs/vlm_tiny.yaml", TINY_VLM + ["steps=5", "keep_checkpoints=0"], out), out


@pytest.mark.extended  # CI keeps KD on four processes and the 2-process resume
def test_vlm_shipped_plan_on_four_processes_resumes_bit_exactly(tmp_path, vlm_one):
    """configs/vlm_tiny.yaml's plan on 4 processes of 2 devices: vision on devices 0:2 (alone in
    process 0) feeds the LLM on 2:8 (processes 1-3: the paper's layout, a section over some
    processes but not all), and image gradients cross back. The run equals the 1-process run;
    with its last checkpoint gone (killed before step 4's save committed) it resumes from step 2
    bit-exactly, and one process resumes the 4-process checkpoint. (Two processes resume in the
    KD test above.)"""
    config = ROOT / "configs/vlm_tiny.yaml"
    one, _ = vlm_one
    out = tmp_path / "four"
    straight = run_two(config, TINY_VLM + ["steps=4", "checkpoint_every=2"], out, n=4)
    same(one[:4], straight)
    ck = out / "checkpoints"
    shutil.rmtree(ck / "4")
    (ck / "manifest-4.json").unlink()
    assert run_two(config, TINY_VLM + ["steps=4", "checkpoint_every=2"], out, n=4) == straight
    same(one, run_single(config, TINY_VLM + ["steps=5", "checkpoint_every=1"], out))


PAPER_SHAPE = [
    "sections.vision.devices=0:4",
    "sections.vision.mesh={data: 2, fsdp: 2}",
    "sections.vision.micro_batch=1",
    "sections.llm.devices=4:8",
    "sections.llm.mesh={data: 2, fsdp: 2}",
    "sections.llm.micro_batch=1",
]


@pytest.mark.extended
def test_each_process_decodes_only_the_payload_its_devices_need(tmp_path, vlm_one):
    """Vision alone in process 0, the LLM alone in process 1: process 0 decodes exactly the
    pixels of the batch's images (no text), process 1 exactly the token ids (no pixel); one
    process decodes both. Losses equal the 1-process run (of the shipped plan: any plan gives
    the same step, and the data order does not depend on the plan)."""
    from maestro_jax.config import load_config
    from maestro_jax.workloads import source_from_config

    config = ROOT / "configs/vlm_tiny.yaml"
    overrides = TINY_VLM + PAPER_SHAPE + ["steps=1", "keep_checkpoints=0"]
    one, one_dir = vlm_one
    same(one[:1], run_two(config, overrides, tmp_path / "two"))
    source = source_from_config(load_config(config, overrides))
    for run_dir, processes in ((one_dir, 1), (tmp_path / "two", 2)):
        for line in (run_dir / "metrics.jsonl").read_text().splitlines()[:1]:
            rec = json.loads(line)
            samples = [source.read(i, None)[0] for i in rec["sample_ids"]]
            pixels = sum(x.nbytes for s in samples for x in s.of("image"))
            tokens = sum(s.tokens.nbytes for s in samples)
            assert pixels > 0 and tokens > 0
            expected = [pixels + tokens] if processes == 1 else [pixels, tokens]
            assert rec["data_decoded_bytes"] == expected, (rec["data_decoded_bytes"], expected)
            assert rec["data_read_bytes"] == [0] * processes  # synthetic: generated, nothing read


def test_kd_shipped_plan_on_four_processes(tmp_path, kd_one):
    config = ROOT / "configs/kd_tiny.yaml"
    same(kd_one[:3], run_two(config, KD_MODELS + ["steps=3", "keep_checkpoints=0"], tmp_path / "four", n=4))


@pytest.mark.parametrize("n", [2, 4])
def test_transfers_between_processes_are_exact(n):
    """Fan-out, fan-in, layout change and a mixed layout across 2 and 4 processes: every shard
    exact; each distinct piece crosses once per destination process."""
    port = free_ports(n + 1)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(ROOT / "tests/transfer_worker.py"), str(i), str(n), str(port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for i in range(n)
    ]
    reports = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
        reports.append(json.loads(next(line for line in out.splitlines() if line.startswith("REPORT "))[7:]))
    for name in reports[0]:
        assert all(r[name]["exact"] for r in reports), name
        sent, received = (sum(r[name]["bytes"][k] for r in reports) for k in ("sent", "received"))
        assert sent == received
    # 2->6 fan-out, 24x10 float32 rows split over 2 data shards, each replicated over 3 tensor devices:
    # each half (480 bytes) crosses once into every other process holding one of its replicas
    fan_out = sum(r["fan-out 2->6"]["bytes"]["received"] for r in reports)
    assert fan_out == {2: 960, 4: 1920}[n]
