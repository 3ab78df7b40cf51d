"""Knowledge-distillation section graph: frozen `teacher` -> trained `student` (holds the loss).

As in production KD the teacher section sends its final hidden states (hidden << vocabulary)
and the teacher's output layer runs inside the student section, as a frozen constant there.
loss = alpha * T^2 * KL(teacher_T || student_T) + (1 - alpha) * CE, summed over target tokens.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from maestro_jax.core.graph import Edge, Section, SectionGraph
from maestro_jax.workloads.text import loss_tokens, route, text_rows
from maestro_jax.workloads.vlm import concat_rows
from models.llm import DecoderLM, LLMConfig

EDGE = "teacher_hidden"


def build(teacher: LLMConfig, student: LLMConfig, alpha: float, temperature: float) -> SectionGraph:
    if teacher.vocab != student.vocab:
        raise ValueError(f"models.teacher.vocab ({teacher.vocab}) must equal models.student.vocab ({student.vocab})")
    t_model, s_model = DecoderLM(teacher), DecoderLM(student)
    t_body = DecoderLM(teacher, with_head=False)

    def teacher_forward(variables, inputs, batch):
        v = {"params": variables["consts"]["llm"]}
        x = t_body.apply(v, batch["input_ids"], method=DecoderLM.embed)
        return {EDGE: t_body.apply(v, x, batch["positions"], batch["valid"], method=DecoderLM.hidden)}

    def student_batch(rows, routes):
        return {**text_rows(rows), "teacher_row": route(routes, EDGE, rows)}

    def student_forward(variables, inputs, batch):
        v = {"params": variables["params"]}
        s_logits = s_model.apply(v, batch["input_ids"], batch["positions"], batch["valid"]).astype(jnp.float32)
        hidden = concat_rows(inputs[EDGE], length=batch["input_ids"].shape[1])
        t_hidden = jnp.take(hidden, jnp.maximum(batch["teacher_row"], 0), axis=0)
        t_logits = (t_hidden @ variables["consts"]["teacher_head"]).astype(jnp.float32)
        t_logp = jax.nn.log_softmax(t_logits / temperature)
        s_logp = jax.nn.log_softmax(s_logits / temperature)
        kl = jnp.sum(jnp.exp(t_logp) * (t_logp - s_logp), axis=-1)
        ce = optax.softmax_cross_entropy_with_integer_labels(s_logits, batch["targets"])
        per_token = alpha * temperature**2 * kl + (1.0 - alpha) * ce
        mask = batch["loss_mask"]
        return jnp.sum(per_token * mask), {"tokens": jnp.sum(mask), "kl": jnp.sum(kl * mask), "ce": jnp.sum(ce * mask)}

    def init(key):
        kt, ks = jax.random.split(key)
        ids, pos, valid = jnp.zeros((1, 4), jnp.int32), jnp.arange(4)[None], jnp.ones((1, 4), bool)
        t = dict(t_model.init(kt, ids, pos, valid)["params"])
        if teacher.tie_embeddings:
            emb = t["embedding"]
            head = nn.LogicallyPartitioned(emb.value.T, names=("embed", "vocab"))
        else:
            head = t.pop("lm_head")
        s = s_model.init(ks, ids, pos, valid)["params"]
        return {"teacher": {"params": {}, "consts": {"llm": t}},
                "student": {"params": s, "consts": {"teacher_head": head}}}

    def lm_flops(c: LLMConfig, head: bool) -> float:
        layer = 2 * c.width * c.heads * c.head_dim + 2 * c.width * c.kv_heads * c.head_dim + 3 * c.width * c.mlp
        return 2 * (c.depth * layer + (c.width * c.vocab if head else 0))

    tokens = lambda s: len(s.tokens) - 1
    return SectionGraph(
        sections=(
            Section("teacher", trained=False, forward=teacher_forward, host_batch=lambda rows, routes: text_rows(rows),
                    activates=lambda s: True, work=tokens, flops_per_unit=lm_flops(teacher, head=False)),
            Section("student", trained=True, forward=student_forward, host_batch=student_batch,
                    activates=lambda s: True, work=tokens,
                    flops_per_unit=lm_flops(student, head=True) + 2 * teacher.width * teacher.vocab),
        ),
        edges=(Edge(EDGE, "teacher", "student"),),
        init=init,
        loss_count=loss_tokens,
    )
