"""What each workload's section graph looks like, as plain data (no models, no JAX).

The runtime builds the real graph from `models/`; the simulator and planner only need this
shape: sections (trained or frozen), the edge between them, and per-sample work units.
"""

from __future__ import annotations

import dataclasses

from maestro_jax.config import Config
from maestro_jax.core.plan import EdgeInfo
from maestro_jax.data import image_tokens, source_from_config
from maestro_jax.planning.cost import transformer_flops
from maestro_jax.schedule import Problem, SampleMeta


@dataclasses.dataclass(frozen=True)
class WorkloadShape:
    sections: dict[str, bool]  # name -> trained
    edge: EdgeInfo
    sink: str


SHAPES = {
    "vlm": WorkloadShape({"vision": True, "llm": True}, EdgeInfo("image_embeds", "vision", "llm"), "llm"),
    "kd": WorkloadShape({"teacher": False, "student": True}, EdgeInfo("teacher_hidden", "teacher", "student"),
                        "student"),
}


def problem(cfg: Config, plan=None) -> Problem:
    shape, plan = SHAPES[cfg.workload], plan or cfg.plan()
    return Problem(order=(shape.edge.src, shape.edge.dst), sink=shape.sink,
                   trained=frozenset(s for s, t in shape.sections.items() if t), edges=(shape.edge,),
                   rows={s: plan.sections[s].rows for s in shape.sections},
                   dp={s: plan.sections[s].dp for s in shape.sections}, fanout=dict(plan.fanout),
                   max_in_flight=cfg.schedule.max_in_flight)


def metas(cfg: Config, batch_index: int) -> list[SampleMeta]:
    """Sample metadata of one global batch, from sizes alone (no pixels, no tokens)."""
    src = source_from_config(cfg)
    order = _order(cfg, src)
    out = []
    for i in order[batch_index * cfg.global_batch:(batch_index + 1) * cfg.global_batch]:
        length, images = src.sizes(i)
        if cfg.workload == "vlm":
            v = cfg.models["vision"]
            tokens = length - 1 + sum(image_tokens(hw, v.patch, v.merge) for hw in images)
            patches = sum((h // v.patch) * (w // v.patch) for h, w in images)
            sections = frozenset({"vision", "llm"} if images else {"llm"})
            out.append(SampleMeta(sections, {"llm": tokens, **({"vision": patches} if images else {})}))
        else:
            out.append(SampleMeta(frozenset({"teacher", "student"}), {"teacher": length - 1, "student": length - 1}))
    return out


def _order(cfg: Config, src) -> list[int]:
    import numpy as np

    idx = np.arange(len(src))
    if cfg.data.shuffle:
        np.random.default_rng(cfg.seed).shuffle(idx)
    return [int(i) for i in np.tile(idx, 1 + (cfg.simulate.batches * cfg.global_batch) // len(src))]


def flops(cfg: Config, section: str) -> tuple[float, float, int]:
    """(forward FLOPs per work unit, attention FLOPs per unit per unit of context, width)."""
    name = {"vision": "vision", "llm": "llm", "teacher": "teacher", "student": "student"}[section]
    m = cfg.models[name]
    if m.kind == "vit":
        w, out = m.width, m.out_width
        per_layer = 2 * w * 4 * w + 2 * 2 * w * m.mlp  # q, k, v, o projections; GELU MLP (2 matmuls)
        merger = (2 * m.merge**2 * w * 2 * out + 2 * 2 * out * out) / m.merge**2  # per patch
        linear = m.depth * per_layer + 2 * m.patch**2 * m.channels * w + merger
        return float(linear), float(m.depth * 4 * w), w  # attention runs within each image
    active = (m.experts_per_token * m.expert_mlp / m.mlp) if m.experts else 1.0
    vocab = m.vocab if section in ("llm", "student") else 0
    linear, attn = transformer_flops(m.width, m.depth, m.heads, m.kv_heads, m.head_dim, m.mlp, vocab, active)
    if section == "student":
        t = cfg.models["teacher"]
        linear += 2 * t.width * t.vocab  # the teacher's output layer runs in the student section
    return linear, attn / 2, m.width  # causal attention: half the pairs
