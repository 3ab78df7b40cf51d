"""VLM section graph: `vision` (ViT + merger) -> `llm` (decoder, holds the loss).

Image embeddings replace the image-placeholder token embeddings of the LLM input. Samples
without images never enter the vision section.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax

from maestro_jax.core.buckets import bucket
from maestro_jax.core.graph import Edge, Section, SectionGraph
from maestro_jax.workloads.text import loss_tokens, route, text_rows
from models.llm import DecoderLM, LLMConfig
from models.vit import VisionEncoder, ViTConfig

EDGE = "image_embeds"


def patchify(image: np.ndarray, patch: int, merge: int) -> tuple[np.ndarray, np.ndarray]:
    """Image H x W x C -> (patches N x C', grid N x 2), each merge x merge window contiguous."""
    h, w, c = image.shape
    if h % (patch * merge) or w % (patch * merge):
        raise ValueError(f"image of size {h}x{w} is not a multiple of patch*merge = {patch * merge}")
    gh, gw = h // patch, w // patch
    order = (0, 3, 1, 4, 2, 5, 6)
    blocks = image.reshape(gh // merge, merge, patch, gw // merge, merge, patch, c)
    patches = blocks.transpose(order).reshape(-1, patch * patch * c)
    rr, cc = np.meshgrid(np.arange(gh), np.arange(gw), indexing="ij")
    grid = np.stack([rr, cc], -1).reshape(gh // merge, merge, 1, gw // merge, merge, 1, 2)
    return patches, grid.transpose(order).reshape(-1, 2)


def concat_rows(parts, length: int | None = None):
    """Concatenate producer outputs along rows, padding or cutting dim 1 to a common size."""
    length = length or max(p.shape[1] for p in parts)
    fixed = []
    for p in parts:
        if p.shape[1] < length:
            p = jnp.pad(p, [(0, 0), (0, length - p.shape[1])] + [(0, 0)] * (p.ndim - 2))
        fixed.append(p[:, :length])
    return jnp.concatenate(fixed, axis=0)


def build(vit: ViTConfig, llm: LLMConfig) -> SectionGraph:
    if vit.out_width != llm.width:
        raise ValueError(f"models.vision.out_width ({vit.out_width}) must equal models.llm.width ({llm.width})")
    encoder, decoder = VisionEncoder(vit), DecoderLM(llm)
    window = vit.merge * vit.merge

    def vision_batch(rows, routes):
        counts = [sum(len(patchify(im, vit.patch, vit.merge)[0]) for im in s.images) if s else 0 for s in rows]
        p = bucket(max(counts, default=0), minimum=4 * window)
        out = {"patches": np.zeros((len(rows), p, vit.patch_features), np.float32),
               "segments": np.zeros((len(rows), p), np.int32), "grid": np.zeros((len(rows), p, 2), np.int32)}
        for r, s in enumerate(rows):
            off = 0
            for i, im in enumerate(s.images if s else ()):
                pt, gr = patchify(im, vit.patch, vit.merge)
                out["patches"][r, off:off + len(pt)] = pt
                out["segments"][r, off:off + len(pt)] = i + 1
                out["grid"][r, off:off + len(pt)] = gr
                off += len(pt)
        return out

    def vision_forward(variables, inputs, batch):
        return {EDGE: encoder.apply({"params": variables["params"]}, batch["patches"], batch["segments"],
                                    batch["grid"])}

    def llm_batch(rows, routes):
        return {**text_rows(rows), "image_row": route(routes, EDGE, rows)}

    def llm_forward(variables, inputs, batch):
        v = {"params": variables["params"]}
        x = decoder.apply(v, batch["input_ids"], method=DecoderLM.embed)
        if inputs.get(EDGE) is not None:
            images_RTD = concat_rows(inputs[EDGE])
            rows_BTD = jnp.take(images_RTD, jnp.maximum(batch["image_row"], 0), axis=0)
            tok = batch["image_tok"]
            picked = jnp.take_along_axis(rows_BTD, jnp.maximum(tok, 0)[..., None], axis=1)
            use = (tok >= 0) & (batch["image_row"] >= 0)[:, None]
            x = jnp.where(use[..., None], picked.astype(x.dtype), x)
        h = decoder.apply(v, x, batch["positions"], batch["valid"], method=DecoderLM.hidden)
        logits = decoder.apply(v, h, method=DecoderLM.logits)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), batch["targets"])
        mask = batch["loss_mask"]
        return jnp.sum(ce * mask), {"tokens": jnp.sum(mask)}

    def init(key):
        kv, kl = jax.random.split(key)
        p = vit.patch_features
        vis = encoder.init(kv, jnp.zeros((1, 4 * window, p)), jnp.ones((1, 4 * window), jnp.int32),
                           jnp.zeros((1, 4 * window, 2), jnp.int32))
        lm = decoder.init(kl, jnp.zeros((1, 4), jnp.int32), jnp.arange(4)[None], jnp.ones((1, 4), bool))
        return {"vision": {"params": vis["params"], "consts": {}}, "llm": {"params": lm["params"], "consts": {}}}

    vision_flops = 2 * (vit.depth * 12 * vit.width**2 + 4 * vit.width * 2 * llm.width / window)
    llm_flops = 2 * (llm.depth * (2 * llm.width * llm.heads * llm.head_dim
                                  + 2 * llm.width * llm.kv_heads * llm.head_dim + 3 * llm.width * llm.mlp)
                     + llm.width * llm.vocab)
    patches_of = lambda s: sum(len(patchify(im, vit.patch, vit.merge)[0]) for im in s.images)
    return SectionGraph(
        sections=(
            Section("vision", trained=True, forward=vision_forward, host_batch=vision_batch,
                    activates=lambda s: s.has_image, work=patches_of, flops_per_unit=vision_flops),
            Section("llm", trained=True, forward=llm_forward, host_batch=llm_batch,
                    activates=lambda s: True, work=lambda s: len(s.tokens) - 1, flops_per_unit=llm_flops),
        ),
        edges=(Edge(EDGE, "vision", "llm"),),
        init=init,
        loss_count=loss_tokens,
    )


__all__ = ["build", "concat_rows", "patchify"]
