"""VLM distillation: frozen teacher LLMs and a trained `vision` encoder all feed a trained
`student` VLM (holds the loss).

The teacher reads the same token sequence (image placeholders as ordinary ids: a text-only
teacher distilling language ability) and sends its final hidden states; its output layer runs
in the student section. Several teachers (`models.teachers`) each send their own, mixed as in
`workloads.kd` (`teacher_log_probs`). The student splices the image embeddings into its input, and learns
from alpha * T^2 * KL(teacher_T || student_T) + (1 - alpha) * CE over text targets. A sink
with a frozen and a trained producer: only the vision edge carries gradients back.
"""

from __future__ import annotations

import jax

from maestro_jax.config import Config
from maestro_jax.core.graph import Edge, Section, SectionGraph
from maestro_jax.data.samples import TOKENS
from maestro_jax.models import DecoderLM
from maestro_jax.workloads import Workload, model
from maestro_jax.workloads import rows as R
from maestro_jax.workloads.costs import llm_cost
from maestro_jax.workloads.kd import (
    check_top_k,
    check_vocab,
    distill_loss,
    head_flops,
    init_teachers,
    loaders,
    refuse_prefix_lm,
    routing_of,
    sample_rule,
    shared_vocab,
    student_stages,
    teacher_edges,
    teacher_log_probs,
    teacher_rows,
    teacher_sections,
    teachers_of,
)
from maestro_jax.workloads.pretrained import load_vision_section
from maestro_jax.workloads.vlm import (
    VLMSettings,
    image_bytes_per_patch,
    image_modality,
    init_vision,
    mean_patches,
    multimodal_rows,
    packed_multimodal_rows,
    spliced_embeddings,
    spliced_logits,
    vision_section,
)

IMAGES = "image_embeds"


def build(cfg: Config) -> SectionGraph:
    teachers, vit, student = teachers_of(cfg), model(cfg, "vision", "vit"), model(cfg, "student", "llm")
    refuse_prefix_lm({t.name: t.model for t in teachers}, "vlm_kd")
    check_top_k(cfg.distill.top_k, check_vocab(teachers, student))
    image, routing = image_modality(cfg), routing_of(cfg)
    alpha, temperature, routed = cfg.distill.alpha, cfg.distill.temperature, routing is not None
    s_model = DecoderLM(student, rows_from_zero=True)  # text_rows' rows
    per_octave = cfg.compile.buckets_per_octave

    def student_batch(rows, routes):
        rows_ = multimodal_rows(
            rows, routes, {IMAGES: image}, student.bidirectional_images, per_octave=per_octave, prefix=student.prefix_lm
        )
        return {**rows_, **teacher_rows(routes, rows, teachers)}

    def student_packed_batch(rows, routes, shards, pack):
        return packed_multimodal_rows(
            rows,
            routes,
            shards,
            pack,
            {IMAGES: image},
            gathered=tuple(t.edge for t in teachers),
            images=student.bidirectional_images,
            per_octave=per_octave,
            prefix=student.prefix_lm,
        )

    def student_forward(variables, inputs, batch):
        s_logits, aux = spliced_logits(s_model, variables, inputs, batch, {IMAGES: image})
        t_logp = teacher_log_probs(variables, inputs, batch, teachers, temperature, routed)
        loss, metrics = distill_loss(
            s_logits, t_logp, batch["targets"], batch["loss_mask"], alpha, temperature, cfg.distill.top_k
        )
        return loss + aux, metrics

    def init(key):
        kt, kv = jax.random.split(key)
        sections, student_vars = init_teachers(teachers, student, kt)
        return {**sections, "vision": {"params": init_vision(vit, kv)["params"], "consts": {}}, "student": student_vars}

    def embed(module, v, inputs, batch):
        return spliced_embeddings(module, v, inputs, batch, {IMAGES: image})

    student_section = Section(
        "student",
        trained=True,
        forward=student_forward,
        host_batch=student_batch,
        packed_batch=student_packed_batch,
        activates=lambda s: True,
        work=R.next_token_units,
        cost=llm_cost(student, head=True, extra_flops=head_flops(teachers)),
        reads=(TOKENS,),
        stages=lambda k, layers=None: student_stages(
            student_section, student, teachers, k, alpha, temperature, layers, routed, cfg.distill.top_k, embed=embed
        ),
    )
    return SectionGraph(
        sections=(
            *teacher_sections(teachers, routing, (image,), per_octave=per_octave),
            vision_section(vit, student, mean_patches(cfg, vit), edges=(IMAGES,), per_octave=per_octave),
            student_section,
        ),
        edges=(
            *teacher_edges(teachers),
            Edge(IMAGES, "vision", "student", bytes_per_unit=image_bytes_per_patch(vit)),
        ),
        init=init,
        loss_count=R.loss_tokens((image,)),
    )


WORKLOAD = Workload(
    "vlm_kd",
    build,
    vocab=shared_vocab,
    modalities=lambda cfg: (image_modality(cfg),),
    pretrained=lambda cfg: {**loaders(cfg), "vision": load_vision_section},
    settings=VLMSettings,
    sample_rule=sample_rule,
)


__all__ = ["WORKLOAD", "build"]
