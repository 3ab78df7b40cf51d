"""Every plan gives the monolithic step's loss, gradients and updated parameters (fp32 rounding)."""

import dataclasses

import numpy as np
import pytest
from conftest import ROOT, TINY_KD, TINY_VLM

from maestro_jax.config import load_config
from maestro_jax.data import FIRST_TEXT_TOKEN
from maestro_jax.runtime.build import build_runtime
from maestro_jax.tools.verify import compare, verify
from maestro_jax.workloads import modalities_of, source_from_config

RTOL = 1e-5

VLM_PLANS = {
    # 2 + 6 devices, tensor parallel LLM, vision data 2 -> LLM data 2 (the shipped plan)
    "shipped": [],
    # 1 + 4 devices, fan-out 1 -> 4, fsdp LLM, vision recomputes in backward, 3 devices idle
    "fanout4_fsdp_remat": [
        "sections.vision.devices=[0]",
        "sections.vision.mesh={data: 1}",
        "sections.vision.micro_batch=4",
        "sections.vision.residuals=remat",
        "sections.llm.devices=1:5",
        "sections.llm.mesh={data: 2, fsdp: 2}",
        "sections.llm.micro_batch=1",
    ],
    # tensor-parallel vision, fan-out 2 -> 4 (the fanout stated: a declared fanout is checked, and kept)
    "fanout2_tensor_vision": [
        "sections.vision.devices=0:4",
        "sections.vision.mesh={data: 2, tensor: 2}",
        "sections.vision.micro_batch=2",
        "sections.llm.devices=4:8",
        "sections.llm.mesh={data: 2, fsdp: 2}",
        "sections.llm.micro_batch=1",
        "edges.image_embeds.fanout=2",
    ],
    # fsdp everywhere, LLM fsdp x tensor
    "fsdp_tensor": [
        "sections.vision.mesh={fsdp: 2}",
        "sections.llm.mesh={fsdp: 2, tensor: 3}",
        "sections.llm.micro_batch=1",
        "sections.vision.micro_batch=1",
    ],
    # context parallelism: the ViT's patches over 2 devices, the LLM's tokens over 3; the
    # monolithic baseline with the same feature (one layout for all)
    "context": [
        "sections.vision.mesh={context: 2}",
        "sections.vision.micro_batch=2",
        "sections.llm.mesh={data: 2, context: 3}",
        "sections.llm.micro_batch=2",
        "monolithic.mesh={data: 2, context: 4}",
    ],
}
KD_PLANS = {
    "shipped_fanout2": [],  # teacher data 2 -> student data 4
    # mixture-of-experts teacher and student (top-2 of 4 experts, load-balancing loss), experts
    # sharded over an expert axis (x tensor-parallel FFNs in the teacher); the baseline likewise
    "moe": [
        "models.teacher.experts=4",
        "models.teacher.experts_per_token=2",
        "models.teacher.expert_mlp=32",
        "models.student.experts=4",
        "models.student.experts_per_token=2",
        "models.student.expert_mlp=16",
        "models.student.router_aux_loss=0.01",
        "sections.teacher.mesh={expert: 2, tensor: 2}",
        "sections.student.mesh={data: 2, expert: 2}",
        "monolithic.mesh={data: 2, expert: 2, tensor: 2}",
    ],
    "fanout1_tensor_student": ["sections.student.mesh={data: 2, tensor: 2}", "sections.student.micro_batch=2"],
    "fanout4": [
        "sections.teacher.devices=[0]",
        "sections.teacher.mesh={data: 1}",
        "sections.teacher.micro_batch=4",
        "sections.student.devices=1:5",
    ],
    "fsdp_student_6dev": [
        "sections.teacher.devices=0:2",
        "sections.teacher.mesh={data: 1, tensor: 2}",
        "sections.teacher.micro_batch=4",
        "sections.student.devices=2:8",
        "sections.student.mesh={data: 2, fsdp: 1, tensor: 3}",
        "models.student.heads=6",
        "models.student.kv_heads=3",
        "models.student.mlp=48",
        "models.student.vocab=258",
        "models.teacher.vocab=258",
        "monolithic.mesh={data: 4, fsdp: 2}",
    ],
}


def check(cfg, rt=None):
    diffs = verify(cfg, rt)
    for d in diffs:
        assert d.max_rel <= RTOL, f"{d.name}: relative difference {d.max_rel:.3e} > {RTOL}"
    assert {d.name for d in diffs} >= {"loss"} | {
        f"{s}/grads" for s in ("llm", "vision", "student") if any(d.name.startswith(s) for d in diffs)
    }
    return diffs


@pytest.mark.slow
@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
def test_vlm_image_fractions(fraction):
    cfg = load_config(ROOT / "configs/vlm_tiny.yaml", TINY_VLM + [f"data.modalities.image.fraction={fraction}"])
    rt = build_runtime(cfg)
    with_images = sum(s.has("image") for s in rt.batches()[0])
    assert with_images == {0.0: 0, 1.0: 8}.get(fraction, with_images)
    if fraction == 0.5:
        assert 0 < with_images < 8, "the mixed batch must hold both kinds of samples"
    diffs = check(cfg)
    names = {d.name for d in diffs}
    assert {"vision/grads", "llm/grads", "vision/params_after_update"} <= names


@pytest.mark.slow
@pytest.mark.parametrize("plan", [p for p in VLM_PLANS if p != "shipped"])
def test_vlm_plans(plan):
    cfg = load_config(ROOT / "configs/vlm_tiny.yaml", TINY_VLM + VLM_PLANS[plan])
    check(cfg)


@pytest.mark.slow
@pytest.mark.parametrize("plan", list(KD_PLANS))
def test_kd_plans(plan):
    cfg = load_config(ROOT / "configs/kd_tiny.yaml", TINY_KD + KD_PLANS[plan])
    diffs = check(cfg)
    assert [d.name for d in diffs] == ["loss", "grad_norm", "student/grads", "student/params_after_update"]


def test_vision_skips_text_only_samples():
    cfg = load_config(ROOT / "configs/vlm_tiny.yaml", TINY_VLM + ["data.modalities.image.fraction=0.5"])
    rt = build_runtime(cfg)
    samples = rt.batches()[0]
    schedule = rt.schedule(samples)
    in_vision = {x for st in schedule.steps["vision"] for x in st.samples}
    assert in_vision == {i for i, s in enumerate(samples) if s.has("image") or s.has("video")}
    assert any(s.has("video") and not s.has("image") for s in samples)  # a clip alone enters the tower too
    host = rt.executor.host_batches(samples, schedule)
    for st in schedule.steps["vision"]:
        segs = host[("vision", st.index)]["segments"]
        for r, x in enumerate(st.positions):
            assert (segs[r].max() > 0) == (x >= 0), "only image samples may occupy vision rows"


@pytest.mark.parametrize("workload,plan", [("vlm", "shipped"), ("vlm", "fanout4_fsdp_remat"), ("kd", "fanout4")])
@pytest.mark.slow
def test_wavefront_schedule_is_equivalent(workload, plan):
    """Reordering samples (wavefront) never changes the step: same loss, grads, params."""
    path, tiny, plans = (
        ("vlm_tiny.yaml", TINY_VLM, VLM_PLANS) if workload == "vlm" else ("kd_tiny.yaml", TINY_KD, KD_PLANS)
    )
    cfg = load_config(ROOT / "configs" / path, tiny + plans[plan] + ["schedule.scheduler=wavefront"])
    rt = build_runtime(cfg)
    samples = rt.batches()[0]
    schedule = rt.schedule(samples)
    assert schedule.name == "wavefront"
    arrival = [x for st in schedule.steps[rt.graph.sink] for x in st.samples]
    assert sorted(arrival) == list(range(len(samples)))
    check(cfg)


@dataclasses.dataclass(frozen=True)
class Masked:
    """`base`'s samples with a chat-like loss mask: the first third (a prompt) carries no loss,
    the rest (an answer) does, except the last token, so that a masked target can be changed."""

    base: object

    def __len__(self):
        return len(self.base)

    def __getitem__(self, index):
        s = self.base[index]
        mask = np.zeros(len(s.tokens), np.uint8)
        mask[len(s.tokens) // 3 : -1] = 1
        return dataclasses.replace(s, loss_mask=mask)


@pytest.mark.slow
@pytest.mark.parametrize("workload", ["vlm", "kd"])
def test_loss_mask_is_equivalent_and_masked_targets_carry_nothing(workload):
    """A batch of masked samples: the section runtime matches the monolithic step (both read the
    mask through the sink's rows and its normaliser); the normaliser counts exactly the targets
    the mask keeps (placeholders never); a masked target's id changes neither loss nor grads."""
    path, tiny = ("vlm_tiny.yaml", TINY_VLM) if workload == "vlm" else ("kd_tiny.yaml", TINY_KD)
    cfg = load_config(ROOT / "configs" / path, tiny)
    rt = build_runtime(cfg, source=Masked(source_from_config(cfg)))
    check(cfg, rt)
    samples = rt.batches()[0]
    placeholders = [m.placeholder for m in modalities_of(cfg)]  # vlm_tiny's images and clips
    kept = sum(int(((s.loss_mask[1:] == 1) & ~np.isin(s.tokens[1:], placeholders)).sum()) for s in samples)
    assert rt.graph.loss_count(samples) == kept
    assert 0 < kept < rt.graph.loss_count([dataclasses.replace(s, loss_mask=None) for s in samples])

    def step(batch):
        loss, grads, _ = rt.step.gradients(rt.step.init(), batch)
        return loss, grads

    span = cfg.models["llm" if workload == "vlm" else "student"].vocab - FIRST_TEXT_TOKEN
    changed = [
        dataclasses.replace(
            s, tokens=np.append(s.tokens[:-1], FIRST_TEXT_TOKEN + (s.tokens[-1] - FIRST_TEXT_TOKEN + 1) % span)
        )
        for s in samples
    ]
    assert all(s.tokens[-1] != c.tokens[-1] and s.loss_mask[-1] == 0 for s, c in zip(samples, changed))
    loss, grads = step(samples)
    changed_loss, changed_grads = step(changed)
    for d in (compare("loss", changed_loss, loss), compare("grads", changed_grads, grads)):
        assert d.max_abs == 0.0, f"{d.name}: a masked target changed it by {d.max_abs:.3e}"
    unmasked, _ = step([dataclasses.replace(s, loss_mask=None) for s in samples])
    assert compare("loss", unmasked, loss).max_rel > 1e-3, "the mask must change the loss"
