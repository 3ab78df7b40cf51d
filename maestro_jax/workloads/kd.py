"""Knowledge distillation: frozen `teacher` -> trained `student` (holds the loss).

As in production KD the teacher section sends its final hidden states (hidden << vocabulary)
and the teacher's output layer runs inside the student section, as a frozen constant there.
loss = alpha * T^2 * KL(teacher_T || student_T) + (1 - alpha) * CE, summed over target tokens.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from maestro_jax.config import Config, ConfigError
from maestro_jax.core.graph import Edge, Section, SectionGraph
from maestro_jax.data.samples import TOKENS
from maestro_jax.models import DecoderLM, LLMConfig, apply_with_losses, softcap
from maestro_jax.workloads import Workload, model
from maestro_jax.workloads import rows as R
from maestro_jax.workloads.costs import llm_cost
from maestro_jax.workloads.pretrained import load_llm_section, load_teacher_section
from maestro_jax.workloads.staged import decoder_stages

EDGE = "teacher_hidden"


def teacher_section(teacher: LLMConfig, modalities=(), edge: str = EDGE, *, per_octave: int) -> Section:
    """A frozen LLM body: token rows in (bucketed at `per_octave`, `compile.buckets_per_octave`),
    final-normed hidden states out (its head runs downstream).
    It splits into pipeline stages (`workloads.staged`), forward only, the last sending `edge`."""
    body = DecoderLM(teacher, with_head=False, rows_from_zero=True)  # text_rows' rows

    def forward(variables, inputs, batch):
        v = {"params": variables["consts"]["llm"]}
        x = body.apply(v, batch["input_ids"], method=DecoderLM.embed)
        if "segments" not in batch:
            return {edge: body.apply(v, x, batch["positions"], batch["valid"], method=DecoderLM.hidden)}
        packed = (batch["segments"], None, None, batch.get("segment_lengths"))
        h = body.apply(v, x, batch["positions"], batch["valid"], *packed, method=DecoderLM.hidden)
        return {edge: R.unpack(h, batch)}  # packed: back to one row per sample, as the edge carries it

    def stages(k: int, layers: tuple[int, ...] | None = None):
        return decoder_stages(
            section,
            teacher,
            k,
            layers=layers,
            finish=lambda module, variables, v, inputs, batch, h: {edge: h},
            cost=lambda c, last: llm_cost(c, head=False),
            at=("consts", "llm"),
            with_head=False,
        )

    section = Section(
        "teacher",
        trained=False,
        forward=forward,
        host_batch=lambda rows, routes: R.text_rows(rows, modalities, per_octave=per_octave),
        packed_batch=lambda rows, routes, shards, pack: R.packed_text_rows(
            rows, {}, shards, pack, modalities, unpacks=True, per_octave=per_octave
        ),
        activates=lambda s: True,
        work=R.next_token_units,
        cost=llm_cost(teacher, head=False),
        reads=(TOKENS,),
        stages=stages,
    )
    return section


def teacher_hidden(inputs, batch, edge: str):
    """The teacher's hidden state at each student position: its row's (`teacher_row`), or in a
    packed student row each position's own sample's (`<edge>_row`) at the sample's position."""
    if "segments" in batch:
        return R.gather_tokens(inputs, edge, batch[f"{edge}_row"], batch["positions"])
    return R.gather(inputs, edge, batch["teacher_row"], length=batch["input_ids"].shape[1])


def distill_loss(s_logits, t_logits, targets, mask, alpha: float, temperature: float):
    """Summed per-token KD loss over loss-carrying targets, with KL and CE as metrics."""
    t_logp = jax.nn.log_softmax(t_logits.astype(jnp.float32) / temperature)
    s_logp = jax.nn.log_softmax(s_logits.astype(jnp.float32) / temperature)
    kl = jnp.sum(jnp.exp(t_logp) * (t_logp - s_logp), axis=-1)
    ce = optax.softmax_cross_entropy_with_integer_labels(s_logits.astype(jnp.float32), targets)
    per_token = alpha * temperature**2 * kl + (1.0 - alpha) * ce
    return jnp.sum(per_token * mask), {"kl": jnp.sum(kl * mask), "ce": jnp.sum(ce * mask)}


def student_stages(
    section: Section,
    student: LLMConfig,
    teacher: LLMConfig,
    k: int,
    alpha: float,
    temperature: float,
    layers: tuple[int, ...] | None = None,
    **embed,
):
    """A KD student (`section`) cut into `k` pipeline stages (`layers` blocks each, or evenly):
    the teacher's hidden states and output layer go to the last, which holds the loss; `embed`
    (optional) the first's inputs."""
    return decoder_stages(
        section,
        student,
        k,
        layers=layers,
        finish=lambda module, variables, v, inputs, batch, h: distill_loss(
            module.apply(v, h, method=DecoderLM.logits),
            softcap(teacher_hidden(inputs, batch, EDGE) @ variables["consts"]["teacher_head"], teacher.final_softcap),
            batch["targets"],
            batch["loss_mask"],
            alpha,
            temperature,
        ),
        cost=lambda c, last: llm_cost(c, head=last, extra_flops=2 * teacher.width * teacher.vocab if last else 0.0),
        last_keys=("teacher_head",),
        consumes={EDGE: k - 1},
        **embed,
    )


def init_teacher_and_student(teacher: LLMConfig, student: LLMConfig, key):
    """Teacher body params (frozen) and the student's params plus the teacher's output layer."""
    kt, ks = jax.random.split(key)
    ids, pos, valid = jnp.zeros((1, 4), jnp.int32), jnp.arange(4)[None], jnp.ones((1, 4), bool)
    t = dict(DecoderLM(teacher).init(kt, ids, pos, valid)["params"])
    if teacher.tie_embeddings:
        head = nn.LogicallyPartitioned(t["embedding"].value.T, names=("embed", "vocab"))
    else:
        head = t.pop("lm_head")
    s = DecoderLM(student).init(ks, ids, pos, valid)["params"]
    return t, s, head


def check_vocab(teacher: LLMConfig, student: LLMConfig) -> None:
    """Distillation compares the two models' logits token by token: one vocabulary."""
    if teacher.vocab != student.vocab:
        raise ConfigError(
            f"error: models.teacher.vocab={teacher.vocab}: differs from models.student.vocab={student.vocab} "
            f"(distillation compares their logits token by token); valid: {student.vocab}"
        )


def shared_vocab(cfg: Config) -> int:
    """The ids samples must stay inside: both the teacher's and the student's embedding tables
    take them, so the two vocabularies must be one."""
    teacher, student = model(cfg, "teacher", "llm"), model(cfg, "student", "llm")
    check_vocab(teacher, student)
    return student.vocab


def build(cfg: Config) -> SectionGraph:
    teacher, student = model(cfg, "teacher", "llm"), model(cfg, "student", "llm")
    check_vocab(teacher, student)
    alpha, temperature = cfg.distill.alpha, cfg.distill.temperature
    s_model = DecoderLM(student, rows_from_zero=True)  # text_rows' rows
    per_octave = cfg.compile.buckets_per_octave

    def student_batch(rows, routes):
        return {**R.text_rows(rows, per_octave=per_octave), "teacher_row": R.route(routes, EDGE, rows)}

    def student_packed_batch(rows, routes, shards, pack):
        return R.packed_text_rows(rows, {EDGE: R.route(routes, EDGE, rows)}, shards, pack, per_octave=per_octave)

    def student_forward(variables, inputs, batch):
        segments = (batch["segments"], None, batch.get("segment_lengths")) if "segments" in batch else ()
        s_logits, aux = apply_with_losses(
            s_model, {"params": variables["params"]}, batch["input_ids"], batch["positions"], batch["valid"], *segments
        )
        t_hidden = teacher_hidden(inputs, batch, EDGE)
        t_logits = softcap(t_hidden @ variables["consts"]["teacher_head"], teacher.final_softcap)
        loss, metrics = distill_loss(s_logits, t_logits, batch["targets"], batch["loss_mask"], alpha, temperature)
        return loss + aux, metrics

    def init(key):
        t, s, head = init_teacher_and_student(teacher, student, key)
        return {
            "teacher": {"params": {}, "consts": {"llm": t}},
            "student": {"params": s, "consts": {"teacher_head": head}},
        }

    student_section = Section(
        "student",
        trained=True,
        forward=student_forward,
        host_batch=student_batch,
        packed_batch=student_packed_batch,
        activates=lambda s: True,
        work=R.next_token_units,
        cost=llm_cost(student, head=True, extra_flops=2 * teacher.width * teacher.vocab),
        reads=(TOKENS,),
        stages=lambda k, layers=None: student_stages(student_section, student, teacher, k, alpha, temperature, layers),
    )
    return SectionGraph(
        sections=(teacher_section(teacher, per_octave=per_octave), student_section),
        edges=(Edge(EDGE, "teacher", "student", bytes_per_unit=2 * teacher.width),),
        init=init,
        loss_count=R.loss_tokens(),
    )


WORKLOAD = Workload(
    "kd", build, vocab=shared_vocab, pretrained={"teacher": load_teacher_section, "student": load_llm_section}
)
