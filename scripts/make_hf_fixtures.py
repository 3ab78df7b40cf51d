"""Write the Hugging Face reference fixtures of tests/test_hf.py and tests/test_hf_encoders.py.

Each tiny model is a real `transformers` class built from its own config class (no download),
with random weights (biases and norms moved off their 0/1 init, so a wrong bias or norm mapping
cannot hide), saved with `save_pretrained` to `tests/fixtures/hf/<name>/` beside `reference.npz`:
the inputs and transformers' float32 outputs on them. The weights are rounded to float16 before
the reference runs and saved in float16 (half the bytes, as real checkpoints store bf16/fp16):
the float32 forward on either side sees exactly the same values. The tests compare against the npz and so
need neither torch nor transformers; rerun this (it needs both) only to change a fixture.

    python scripts/make_hf_fixtures.py [--out tests/fixtures/hf]
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import numpy as np
import torch
import transformers

ROOT = Path(__file__).resolve().parents[1]

LLM_BASE = {
    "vocab_size": 96,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
}
LLM_CASES = {
    "llama_untied": ("LlamaConfig", "LlamaForCausalLM", {"tie_word_embeddings": False}),
    "llama_tied": ("LlamaConfig", "LlamaForCausalLM", {"tie_word_embeddings": True}),
    # Llama 3.1's RoPE scaling on a head of 16 (not width / heads) and one key/value head: with
    # an original context of 32, the 8 frequencies fall in all three of llama3's bands
    "llama3_rope": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {
            "tie_word_embeddings": False,
            "head_dim": 16,
            "num_key_value_heads": 1,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        },
    ),
    "llama_linear_rope": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {"tie_word_embeddings": True, "rope_scaling": {"rope_type": "linear", "factor": 4.0}},
    ),
    # Mistral with a window of 4 positions, shorter than TOKENS' 12
    "mistral_window": ("MistralConfig", "MistralForCausalLM", {"tie_word_embeddings": False, "sliding_window": 4}),
    "qwen2_untied": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": False}),
    "qwen2_tied": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"tie_word_embeddings": False, "head_dim": 8}),
    # Gemma 3's text model: a window of 4 on layers 0 and 2 and a global layer 1 (every 2nd), each
    # kind with its own RoPE base, linear scaling on the global one, a query scalar other than
    # head_dim, untied so the head is checked apart from the scaled embedding
    "gemma3_text": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {
            "tie_word_embeddings": False,
            "num_hidden_layers": 3,
            "head_dim": 16,
            "sliding_window": 4,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
            "query_pre_attn_scalar": 24,
            "rope_parameters": {
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            },
        },
    ),
    "gemma3_tied": (  # tied, one key/value head, both layers windowed (the default pattern of 6)
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {
            "tie_word_embeddings": True,
            "num_key_value_heads": 1,
            "head_dim": 8,
            "sliding_window": 3,
            "num_hidden_layers": 2,
        },
    ),
    # Gemma 2: every other layer windowed (4), one RoPE base, no query/key norms, and both caps low
    # enough that the tanh bends these scores and logits
    # Gemma (1), PaliGemma 1's language model: Gemma's norms and scaled embeddings, no post-norms, soft-caps or
    # window; `hidden_act: gelu` as the Hub's Gemma checkpoints say it (GemmaConfig rewrites it to the tanh GELU)
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {"tie_word_embeddings": True, "head_dim": 16, "hidden_act": "gelu"}),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        {
            "tie_word_embeddings": True,
            "num_hidden_layers": 3,
            "head_dim": 16,
            "sliding_window": 4,
            "query_pre_attn_scalar": 24,
            "attn_logit_softcapping": 0.05,
            "final_logit_softcapping": 1.5,
        },
    ),
    # Qwen3's long-context recipe, YaRN: an original context of 1024 puts the ramp over dimensions
    # 1..5 of 8 (some frequencies kept, some divided, some blended), and cos/sin scaled by
    # 0.1 ln(4) + 1
    "qwen3_yarn": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        {
            "tie_word_embeddings": False,
            "head_dim": 16,
            "max_position_embeddings": 4096,
            "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
        },
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {
            "tie_word_embeddings": False,
            "head_dim": 8,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 16,
            "norm_topk_prob": True,
        },
    ),
    # Phi-3: fused q/k/v and gate/up projections (qkv_proj, gate_up_proj), a sliding window of 4
    "phi3": (
        "Phi3Config",
        "Phi3ForCausalLM",
        {"tie_word_embeddings": False, "sliding_window": 4, "pad_token_id": 0},
    ),
    # OLMo 2: norms after the attention and the MLP only, query and key norms over the whole
    # projection (32 and 16 scales), untied; pad and end ids inside the small vocabulary
    "olmo2": (
        "Olmo2Config",
        "Olmo2ForCausalLM",
        {"tie_word_embeddings": False, "pad_token_id": 0, "eos_token_id": 2, "bos_token_id": 1},
    ),
    # Qwen2-MoE (Qwen1.5-MoE): 4 experts of 16, top 2 without renormalising, a shared expert of 24
    # behind its sigmoid gate, Qwen2's q/k/v biases
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        {
            "tie_word_embeddings": False,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 16,
            "shared_expert_intermediate_size": 24,
            "norm_topk_prob": False,
            "use_sliding_window": False,
        },
    ),
    # Mixtral: 4 experts of 16, top 2, the Hub's tensor names (block_sparse_moe, w1/w2/w3), no window
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        {
            "tie_word_embeddings": False,
            "head_dim": 8,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "intermediate_size": 16,
            "sliding_window": None,
        },
    ),
    # GPT-OSS: attention sinks, q/k/v/o biases, windowed and full layers alternating (a window of
    # 4, shorter than TOKENS' 12), 4 experts of 16 with biases, top 2, the clamped SwiGLU at a
    # limit low enough to bite on these weights, YaRN without truncation (GPT-OSS's own RoPE)
    "gpt_oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        {
            "tie_word_embeddings": False,
            "head_dim": 8,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "intermediate_size": 16,
            "sliding_window": 4,
            "swiglu_limit": 0.1,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 16,
            },
            "attn_implementation": "eager",  # the sinks run in transformers' eager attention
        },
    ),
}
TOKENS = np.array([[5, 17, 3, 88, 41, 9, 60, 2, 33, 71, 12, 4]], np.int64)

SIGLIP = {  # 16x16 images of 4x4 patches: a 4x4 grid, 16 positions
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_channels": 3,
    "image_size": 16,
    "patch_size": 4,
}
CLIP = {  # SigLIP's shape with 3 layers (a LLaVA tower reads layer -2), CLIP's quick_gelu and 1e-5 epsilon
    **SIGLIP,
    "num_hidden_layers": 3,
}
WHISPER = {  # 8 mel bins, 8 positions: clips of 16 frames; a one-layer decoder the encoder ignores
    "num_mel_bins": 8,
    "d_model": 32,
    "encoder_layers": 2,
    "encoder_attention_heads": 4,
    "encoder_ffn_dim": 64,
    "max_source_positions": 8,
    "decoder_layers": 1,
    "decoder_attention_heads": 4,
    "decoder_ffn_dim": 64,
    "max_target_positions": 8,
    "vocab_size": 16,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "decoder_start_token_id": 1,
}


def _perturbed(model: torch.nn.Module) -> torch.nn.Module:
    """`model` with biases and norms moved off their init, every weight a float16 value (in float32)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            p.copy_(p.half().float())
    return model.eval()


def _save(model, out: Path, **arrays) -> None:
    if out.exists():
        shutil.rmtree(out)
    model.to(torch.float16).save_pretrained(out, safe_serialization=True)
    np.savez_compressed(out / "reference.npz", **{k: np.asarray(v) for k, v in arrays.items()})


def llm(out: Path, case: str) -> None:
    config_cls, model_cls, extra = LLM_CASES[case]
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**{**LLM_BASE, **extra})
    model = _perturbed(getattr(transformers, model_cls)(config))
    with torch.no_grad():
        logits = model(torch.tensor(TOKENS)).logits.float().numpy()
    _save(model, out / case, tokens=TOKENS, logits=logits)


def siglip(out: Path) -> None:
    """pixels [2, C, 16, 16]; `hidden` is the last layer's output, `last_hidden_state` the same
    through `post_layernorm` (SigLIP's features)."""
    torch.manual_seed(1)
    model = _perturbed(transformers.SiglipVisionModel(transformers.SiglipVisionConfig(**SIGLIP, vision_use_head=False)))
    pixels = torch.randn(2, SIGLIP["num_channels"], SIGLIP["image_size"], SIGLIP["image_size"])
    with torch.no_grad():
        o = model(pixels, output_hidden_states=True)
    _save(model, out / "siglip", pixels=pixels, hidden=o.hidden_states[-1], last_hidden_state=o.last_hidden_state)


def clip(out: Path) -> None:
    """pixels [2, C, 16, 16]; `hidden_states` [layers + 1, 2, 1 + 16, D] is every hidden state
    (class token first: what LLaVA selects from), `last_hidden_state` the last of them."""
    torch.manual_seed(3)
    model = _perturbed(transformers.CLIPVisionModel(transformers.CLIPVisionConfig(**CLIP)))
    pixels = torch.randn(2, CLIP["num_channels"], CLIP["image_size"], CLIP["image_size"])
    with torch.no_grad():
        o = model(pixels, output_hidden_states=True)
    _save(model, out / "clip", pixels=pixels, hidden_states=torch.stack(o.hidden_states), pooled=o.pooler_output)


# A Gemma 3 VLM: the SigLIP shape (a 4x4 patch grid) pooled to 2x2 tokens an image (kernel 2), and a
# two-layer Gemma 3 text model, windowed (3) then global, so an image block of 4 tokens is cut by the window
GEMMA3_TEXT = {
    **LLM_BASE,
    "head_dim": 8,
    "sliding_window": 3,
    "layer_types": ["sliding_attention", "full_attention"],
    "tie_word_embeddings": True,
}
GEMMA3_IMAGE_TOKEN = 7
# one row: text, an image's 4 tokens, text, the other image's, text (the ids between image blocks as Gemma 3's
# processor puts them: every image its own block)
GEMMA3_TOKENS = np.array([[5, 17, 3, *[GEMMA3_IMAGE_TOKEN] * 4, 88, 41, *[GEMMA3_IMAGE_TOKEN] * 4, 9, 60, 2]], np.int64)


def gemma3_vlm(out: Path) -> None:
    """A whole `Gemma3ForConditionalGeneration`: pixels [2, C, 16, 16]; `image_features` [2, 4, text
    width], the projector's output (`get_image_features`); `logits` of `tokens` (one row holding
    both images) with `token_type_ids`, so that each image's tokens attend to each other."""
    torch.manual_seed(5)
    config = transformers.Gemma3Config(
        text_config=transformers.Gemma3TextConfig(**GEMMA3_TEXT),
        vision_config=transformers.SiglipVisionConfig(**SIGLIP, vision_use_head=False),
        mm_tokens_per_image=4,
        image_token_index=GEMMA3_IMAGE_TOKEN,
        boi_token_index=94,
        eoi_token_index=95,
    )
    model = transformers.Gemma3ForConditionalGeneration(config)
    with torch.no_grad():  # transformers initialises the projection to zeros
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, 0.2)
    model = _perturbed(model)
    pixels = torch.randn(2, SIGLIP["num_channels"], SIGLIP["image_size"], SIGLIP["image_size"])
    tokens = torch.tensor(GEMMA3_TOKENS)
    with torch.no_grad():
        features = model.get_image_features(pixels).pooler_output
        logits = model(
            input_ids=tokens, pixel_values=pixels, token_type_ids=(tokens == GEMMA3_IMAGE_TOKEN).long()
        ).logits
    _save(model, out / "gemma3_vlm", pixels=pixels, tokens=GEMMA3_TOKENS, image_features=features, logits=logits)


# A PaliGemma 2 row: one image (16 tokens of id 95) and a prompt (the prefix, bidirectional), then the
# answer (the suffix, causal)
PALIGEMMA_IMAGE_TOKEN = 95
PALIGEMMA_PREFIX = [PALIGEMMA_IMAGE_TOKEN] * 16 + [2, 17, 41, 9, 3]
PALIGEMMA_TOKENS = np.array([PALIGEMMA_PREFIX + [60, 33, 71, 12, 1]], np.int64)


def paligemma1(out: Path) -> None:
    """A whole PaliGemma (1) folder: PaliGemma 2's case (`paligemma2`) with a Gemma (1) language model."""
    paligemma2(out, "gemma", "paligemma1")


def paligemma2(out: Path, text_case: str = "gemma2", name: str = "paligemma2") -> None:
    """A whole PaliGemma 2 folder (`PaliGemmaForConditionalGeneration`: a SigLIP tower, its linear
    projector, a Gemma 2 language model): pixels [2, C, 16, 16]; `image_features` [2, 16, text
    width] (`get_image_features`: the projector's output); `logits` of TOKENS alone (text, causal: one suffix)
    and `prefix_logits` of PALIGEMMA_TOKENS with the first image and `token_type_ids` 0 over the
    prefix (image and prompt, attending bidirectionally) and 1 over the suffix."""
    torch.manual_seed(7)
    config_cls, _, extra = LLM_CASES[text_case]
    text = getattr(transformers, config_cls)(**{**LLM_BASE, **extra})
    config = transformers.PaliGemmaConfig(
        text_config=text,
        vision_config=transformers.SiglipVisionConfig(**SIGLIP, vision_use_head=False),
        image_token_index=PALIGEMMA_IMAGE_TOKEN,
        projection_dim=text.hidden_size,
    )
    config.vision_config.projection_dim = text.hidden_size
    model = _perturbed(transformers.PaliGemmaForConditionalGeneration(config))
    pixels = torch.randn(2, SIGLIP["num_channels"], SIGLIP["image_size"], SIGLIP["image_size"])
    row = torch.tensor(PALIGEMMA_TOKENS)
    types = torch.tensor([[0] * len(PALIGEMMA_PREFIX) + [1] * (row.shape[1] - len(PALIGEMMA_PREFIX))])
    with torch.no_grad():
        features = model.get_image_features(pixels).pooler_output
        # text alone as one suffix (token_type_ids 1: causal); with no mask at all, transformers' sdpa path
        # lets PaliGemma 1's Gemma attend both ways (its text config's use_bidirectional_attention)
        text_row = torch.tensor(TOKENS)
        logits = model(input_ids=text_row, token_type_ids=torch.ones_like(text_row)).logits
        prefix_logits = model(input_ids=row, pixel_values=pixels[:1], token_type_ids=types).logits
    _save(
        model,
        out / name,
        pixels=pixels,
        image_features=features,
        tokens=TOKENS,
        logits=logits,
        prefix_tokens=PALIGEMMA_TOKENS,
        token_type_ids=types,
        prefix_logits=prefix_logits,
    )


def llava_onevision(out: Path) -> None:
    """A whole LLaVA-OneVision folder (a SigLIP tower, its two-layer projector, the image newline,
    a Qwen2 language model); `logits` are the model's on TOKENS alone (no image): what its
    language model computes."""
    torch.manual_seed(8)
    text = transformers.Qwen2Config(**{**LLM_BASE, "tie_word_embeddings": False})
    config = transformers.LlavaOnevisionConfig(
        text_config=text,
        vision_config=transformers.SiglipVisionConfig(**SIGLIP, vision_use_head=False),
        image_token_index=95,
        video_token_index=94,
    )
    model = _perturbed(transformers.LlavaOnevisionForConditionalGeneration(config))
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(TOKENS)).logits.float().numpy()
    _save(model, out / "llava_onevision", tokens=TOKENS, logits=logits)


def smolvlm(out: Path) -> None:
    """A whole SmolVLM folder (`SmolVLMForConditionalGeneration`: a SigLIP-style tower, its
    pixel-shuffle connector, a Llama language model under `model.text_model.`); `logits` are the
    model's on TOKENS alone (no image): what its language model computes; pixels [2, C, 16, 16]
    (two whole tiles) and `image_features` [2, 4, text width] (`get_image_features`: the connector's
    output, a token per 2x2 window of patches)."""
    torch.manual_seed(9)
    config = transformers.SmolVLMConfig(
        text_config=transformers.LlamaConfig(**{**LLM_BASE, "tie_word_embeddings": False}),
        vision_config=transformers.SmolVLMVisionConfig(**SIGLIP),
        image_token_id=95,
        scale_factor=2,
    )
    model = _perturbed(transformers.SmolVLMForConditionalGeneration(config))
    pixels = torch.randn(2, SIGLIP["num_channels"], SIGLIP["image_size"], SIGLIP["image_size"])
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(TOKENS)).logits.float().numpy()
        features = torch.stack(model.get_image_features(pixels[None]).pooler_output)
    tokens_per_image = (SIGLIP["image_size"] // SIGLIP["patch_size"] // 2) ** 2
    features = features.reshape(2, tokens_per_image, -1)
    _save(model, out / "smolvlm", tokens=TOKENS, logits=logits, pixels=pixels, image_features=features)


# A Qwen2.5-VL: a three-block tower (head 16, window attention in blocks 0 and 2, block 1 over whole
# images) on patches of 2 px merged 2x2, windows of 8 px (4x4 patches); a two-layer Qwen2 text model with
# M-RoPE (one key/value head of 16, sections 2+3+3 of its 8 frequencies)
QWEN2_5_VL_VISION = {
    "depth": 3,
    "hidden_size": 48,
    "num_heads": 3,
    "intermediate_size": 40,
    "hidden_act": "silu",
    "in_channels": 3,
    "patch_size": 2,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "window_size": 8,
    "fullatt_block_indexes": [1],
    "out_hidden_size": 32,
}
QWEN2_5_VL_TEXT = {
    **LLM_BASE,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 128,
    "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
    "bos_token_id": 1,
    "eos_token_id": 2,
}
QWEN2_5_VL_IMAGE_TOKEN = 7
# two images (H x W px) of different shapes, each cut by the windows: 8x12 patches (4x6 merged
# tokens, windows of 4x4 patches: 2x3 of them) and 6x4 (3x2 tokens; a window row of 4 and one of 2)
QWEN2_5_VL_SIZES = ((16, 24), (12, 8))
QWEN2_5_VL_TOKENS = np.array(
    [[5, 17, 94, *[QWEN2_5_VL_IMAGE_TOKEN] * 24, 95, 88, 41, 94, *[QWEN2_5_VL_IMAGE_TOKEN] * 6, 95, 9, 60, 2]],
    np.int64,
)


def _qwen_vl_inputs(v: dict, seed: int):
    """Images, pixels, grids and token ids of a Qwen-VL fixture: the `QWEN2_5_VL_SIZES` images drawn from
    `seed` and cut into patches as the processor does (`v`: the vision config's fields)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    rng = np.random.default_rng(seed)
    images = [rng.standard_normal((h, w, v["in_channels"])).astype(np.float32) for h, w in QWEN2_5_VL_SIZES]
    cut = [
        Qwen2VLImageProcessorPil().patchify(
            im.transpose(2, 0, 1), v["patch_size"], v["spatial_merge_size"], v["temporal_patch_size"]
        )
        for im in images
    ]
    pixels = torch.tensor(np.concatenate([p for p, _, _ in cut]))
    grid = torch.tensor([[1, gh, gw] for _, gh, gw in cut])
    return images, pixels, grid, torch.tensor(QWEN2_5_VL_TOKENS)


def qwen2_5_vl(out: Path) -> None:
    """A whole `Qwen2_5_VLForConditionalGeneration`: `images` (H x W x C each, `image0`, `image1`),
    laid out as its image processor does (`pixel_values`: every image's patches in merge-window
    order, each patch C x T x p x p with the frame repeated in time); `image_features` [30, text
    width], the tower's merged output of both (`visual(...).pooler_output`); `logits` of `tokens`
    (one row holding both images, vision start/end tokens around each) with the M-RoPE positions
    transformers computes from `image_grid_thw`."""
    torch.manual_seed(6)
    v = QWEN2_5_VL_VISION
    config = transformers.Qwen2_5_VLConfig(
        text_config=QWEN2_5_VL_TEXT,
        vision_config=v,
        image_token_id=QWEN2_5_VL_IMAGE_TOKEN,
        video_token_id=93,
        vision_start_token_id=94,
        vision_end_token_id=95,
        tie_word_embeddings=False,
    )
    model = transformers.Qwen2_5_VLForConditionalGeneration(config)
    with torch.no_grad():  # queries and keys large enough that where attention looks (positions, windows) shows
        for name, p in model.named_parameters():
            if any(k in name for k in ("q_proj.weight", "k_proj.weight", "attn.qkv.weight")):
                p.normal_(0.0, 0.15)
        model.model.visual.merger.ln_q.weight.add_(0.1 * torch.randn_like(model.model.visual.merger.ln_q.weight))
    model = _perturbed(model)
    images, pixels, grid, tokens = _qwen_vl_inputs(v, seed=6)
    with torch.no_grad():
        features = model.model.visual(pixels, grid_thw=grid).pooler_output
        logits = model(
            input_ids=tokens,
            pixel_values=pixels,
            image_grid_thw=grid,
            mm_token_type_ids=(tokens == QWEN2_5_VL_IMAGE_TOKEN).int(),
        ).logits
    arrays = {f"image{i}": im for i, im in enumerate(images)}
    _save(model, out / "qwen2_5_vl", **arrays, tokens=QWEN2_5_VL_TOKENS, image_features=features, logits=logits)


# A Qwen3-VL: a four-block tower (LayerNorm and GELU blocks, head 16) on patches of 2 px merged 2x2, a
# 4x4 learned position table resampled to each image's grid (both images larger than it on one side
# and the second smaller on the other), DeepStack taps after blocks 0 and 2; a four-layer Qwen3 text
# model (query/key norms, one key/value head of 16, not width / heads) with interleaved M-RoPE sections
# 4+2+2 of its 8 frequencies, the two DeepStack feature sets added after its layers 0 and 1
QWEN3_VL_VISION = {
    "depth": 4,
    "hidden_size": 48,
    "num_heads": 3,
    "intermediate_size": 40,
    "hidden_act": "gelu_pytorch_tanh",
    "in_channels": 3,
    "patch_size": 2,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "out_hidden_size": 32,
    "num_position_embeddings": 16,
    "deepstack_visual_indexes": [0, 2],
}
QWEN3_VL_TEXT = {
    **LLM_BASE,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "max_position_embeddings": 128,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "mrope_section": [4, 2, 2],
        "mrope_interleaved": True,
    },
}


def qwen3_vl(out: Path) -> None:
    """A whole `Qwen3VLForConditionalGeneration`, as `qwen2_5_vl`'s fixture (the same images, sizes
    and token row): `image_features` [30, text width], the tower's merged output of both images
    (`visual(...).pooler_output`), `deepstack_features` [2, 30, text width] (its DeepStack mergers'
    outputs), `logits` of `tokens` with the interleaved M-RoPE positions and DeepStack features
    transformers computes."""
    torch.manual_seed(7)
    v = QWEN3_VL_VISION
    config = transformers.Qwen3VLConfig(
        text_config=QWEN3_VL_TEXT,
        vision_config=v,
        image_token_id=QWEN2_5_VL_IMAGE_TOKEN,
        video_token_id=93,
        vision_start_token_id=94,
        vision_end_token_id=95,
        tie_word_embeddings=False,
    )
    model = transformers.Qwen3VLForConditionalGeneration(config)
    with torch.no_grad():  # queries, keys and the position table large enough that where attention looks shows
        for name, p in model.named_parameters():
            if any(k in name for k in ("q_proj.weight", "k_proj.weight", "attn.qkv.weight", "pos_embed.weight")):
                p.normal_(0.0, 0.3 if "pos_embed" in name else 0.15)
    model = _perturbed(model)
    images, pixels, grid, tokens = _qwen_vl_inputs(v, seed=7)
    with torch.no_grad():
        visual = model.model.visual(pixels, grid_thw=grid)
        logits = model(
            input_ids=tokens,
            pixel_values=pixels,
            image_grid_thw=grid,
            mm_token_type_ids=(tokens == QWEN2_5_VL_IMAGE_TOKEN).int(),
        ).logits
    arrays = {f"image{i}": im for i, im in enumerate(images)}
    deepstack = torch.stack(visual.deepstack_features)
    _save(
        model,
        out / "qwen3_vl",
        **arrays,
        tokens=QWEN2_5_VL_TOKENS,
        image_features=visual.pooler_output,
        deepstack_features=deepstack,
        logits=logits,
    )


def whisper(out: Path) -> None:
    """A whole `WhisperModel` (its tensors under `encoder.`), features [2, mel, 16] and its
    encoder's `last_hidden_state` [2, 8, d_model]."""
    torch.manual_seed(2)
    model = _perturbed(transformers.WhisperModel(transformers.WhisperConfig(**WHISPER)))
    features = torch.randn(2, WHISPER["num_mel_bins"], 2 * WHISPER["max_source_positions"])
    with torch.no_grad():
        hidden = model.encoder(features).last_hidden_state
    _save(model, out / "whisper", features=features, last_hidden_state=hidden)


def whisper_features(out: Path) -> None:
    """A 0.55 s 16 kHz 16-bit WAV clip (two tones and noise) and `WhisperFeatureExtractor`'s
    log-mel frames of it, unpadded (`padding="longest"`), for 80 and 8 mel bins: [mel, frames]."""
    import wave

    rng = np.random.default_rng(4)
    t = np.arange(8800) / 16000
    clip = 0.4 * np.sin(2 * np.pi * 440 * t) + 0.2 * np.sin(2 * np.pi * 2900 * t) + 0.05 * rng.standard_normal(len(t))
    pcm = np.round(np.clip(clip, -1, 1) * 32767).astype("<i2")
    folder = out / "whisper_features"
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    with wave.open(str(folder / "clip.wav"), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(pcm.tobytes())
    samples = pcm.astype(np.float32) / 32768
    features = {
        f"mel{n}": transformers.WhisperFeatureExtractor(feature_size=n)(
            samples, sampling_rate=16000, padding="longest", return_tensors="np"
        ).input_features[0]
        for n in (80, 8)
    }
    np.savez_compressed(folder / "reference.npz", samples=samples, **features)


def qwen2_audio(out: Path) -> None:
    """A whole Qwen2-Audio folder (Whisper-style encoder, its projector, a Qwen2 language model);
    `logits` are the model's on TOKENS alone (no audio): what its language model computes;
    `features` [2, mel, 16] two full-length clips, `last_hidden_state` [2, 4, d_model] the audio
    tower's (pooled in pairs, through its layer_norm) and `audio_features` [2, 4, hidden] the same
    through the projector: what the language model's audio placeholders take."""
    torch.manual_seed(6)
    audio = transformers.Qwen2AudioEncoderConfig(
        num_mel_bins=8,
        d_model=32,
        encoder_layers=2,
        encoder_attention_heads=4,
        encoder_ffn_dim=64,
        max_source_positions=8,
    )
    text = transformers.Qwen2Config(**{**LLM_BASE, "tie_word_embeddings": False})
    config = transformers.Qwen2AudioConfig(audio_config=audio, text_config=text, audio_token_index=95)
    model = _perturbed(transformers.Qwen2AudioForConditionalGeneration(config))
    features = torch.randn(2, audio.num_mel_bins, 2 * audio.max_source_positions)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(TOKENS)).logits.float().numpy()
        hidden = model.model.audio_tower(features).last_hidden_state
        projected = model.model.multi_modal_projector(hidden)
    _save(
        model,
        out / "qwen2_audio",
        tokens=TOKENS,
        logits=logits,
        features=features,
        last_hidden_state=hidden,
        audio_features=projected,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "tests" / "fixtures" / "hf")
    towers = {
        "siglip": siglip,
        "clip": clip,
        "whisper": whisper,
        "whisper_features": whisper_features,
        "gemma3_vlm": gemma3_vlm,
        "qwen2_5_vl": qwen2_5_vl,
        "qwen3_vl": qwen3_vl,
        "qwen2_audio": qwen2_audio,
        "paligemma1": paligemma1,
        "paligemma2": paligemma2,
        "llava_onevision": llava_onevision,
        "smolvlm": smolvlm,
    }
    parser.add_argument("--cases", nargs="*", choices=[*LLM_CASES, *towers], help="only these (default: all)")
    args = parser.parse_args()
    cases = args.cases or [*LLM_CASES, *towers]
    for case in cases:
        llm(args.out, case) if case in LLM_CASES else towers[case](args.out)
    total = sum(f.stat().st_size for f in args.out.rglob("*") if f.is_file())
    print(f"wrote {len(cases)} fixtures to {args.out} ({total / 1024:.0f} KiB in all)")


if __name__ == "__main__":
    main()
