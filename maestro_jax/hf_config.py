"""A Hugging Face folder's config.json read as the fields of `models.<s>`, without JAX.

The config reads it (`models.<s>: {hf: PATH}` takes the architecture from the folder), and so do
the weight mappings (`models.hf`, `models.hf_encoders`), which load the tensors into the models
these fields describe: the one module of maestro_jax the models import, so that the config
layer, below them, reads the same fields. What no model here computes is refused with an
`HFError` naming the file, the field and what is supported.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

ROPE_SCALINGS = ("linear", "llama3", "yarn")  # what `models.layers.rope_frequencies` computes
# `models.<s>.rope_scaling`'s fields a type leaves at these (the other types' fields; llama3's and
# yarn's own defaults where config.json leaves them out, as transformers fills them in)
ROPE_DEFAULTS = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "attention_factor": None,  # yarn: None is 0.1 ln(factor) + 1 (`models.layers.rope_attention_factor`)
    "truncate": True,
}


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """transformers' `get_mscale` of `_compute_yarn_parameters`."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "gemma": "GemmaForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
}
# model types whose language model imports from the `text_config` (its tensors under a prefix,
# `models.hf`); a Gemma 3 of 4B or more is one, its vision tower beside the LLM
MULTIMODAL = {
    "gemma3": "gemma3_text",
    "qwen2_audio": "qwen2",
    "paligemma": "gemma2",
    "llava_onevision": "qwen2",
    "smolvlm": "llama",
    "idefics3": "llama",
}
# the other language models such a folder may hold (PaliGemma 1's is Gemma's)
MULTIMODAL_ALSO = {"paligemma": ("gemma",)}
# where such a folder's config.json says nothing of tied embeddings: its class's default
MULTIMODAL_TIED = {
    "gemma3": True,
    "qwen2_audio": False,
    "paligemma": True,
    "llava_onevision": False,
    "smolvlm": False,
    "idefics3": False,
}
# VLM folders whose language model is Qwen2's with multimodal RoPE (M-RoPE): the Hub's config.json keeps its
# text fields at the top level, transformers 5 saves them under `text_config`
QWEN_VL = {"qwen2_5_vl": "qwen2", "qwen3_vl": "qwen3"}
# where rope_scaling (rope_parameters) names none: Qwen2_5_VLTextConfig's, Qwen3VLTextRotaryEmbedding's
QWEN_MROPE_SECTION = {"qwen2_5_vl": (16, 24, 24), "qwen3_vl": (24, 20, 20)}
# Gemma3TextConfig's defaults (transformers), which a Hub config.json, saving only what differs,
# leaves out (a `gemma3` folder's text_config most of all)
GEMMA3_DEFAULTS = {
    "vocab_size": 262208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "rms_norm_eps": 1e-6,
    "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "sliding_window_pattern": 6,
    "tie_word_embeddings": True,
    "attn_logit_softcapping": None,
    "final_logit_softcapping": None,
}


# Gemma2Config's defaults (transformers), which a config.json saving only what differs leaves out
# GemmaConfig's defaults (transformers 5.25), for fields a Gemma (1) config.json leaves out
GEMMA_DEFAULTS = {
    "vocab_size": 256000,
    "hidden_size": 3072,
    "intermediate_size": 24576,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "head_dim": 256,
    "hidden_act": "gelu_pytorch_tanh",
    "rms_norm_eps": 1e-6,
    "rope_theta": 10_000.0,
    "tie_word_embeddings": True,
}
GEMMA2_DEFAULTS = {
    "vocab_size": 256000,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "rms_norm_eps": 1e-6,
    "rope_theta": 10_000.0,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "final_logit_softcapping": 30.0,
    "attn_logit_softcapping": 50.0,
    "tie_word_embeddings": True,
}


class HFError(ValueError):
    """A checkpoint folder this importer cannot read; the message names the file and field."""


def read_config(path: str | Path) -> dict:
    f = Path(path) / "config.json"
    if not f.is_file():
        raise HFError(f"{path}: no config.json; expected a Hugging Face checkpoint folder")
    try:
        config = json.loads(f.read_bytes())
    except (OSError, ValueError) as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise HFError(
            f"{f}: not a readable JSON file ({type(err).__name__}: {err}); expected a Hugging Face config.json"
        ) from None
    if not isinstance(config, dict):
        raise HFError(f"{f}: holds a JSON {type(config).__name__}, not an object of config fields")
    return config


def _rope_scaling(path, block: dict, max_positions: int | None = None) -> dict | None:
    """config.json's `rope_scaling` (transformers 4) or `rope_parameters` (5) as
    `models.<s>.rope_scaling`'s fields, every one filled (None for plain RoPE). `max_positions`:
    config.json's `max_position_embeddings`, yarn's original context where the block names none
    (as transformers reads it)."""
    rope_type = block.get("rope_type", block.get("type")) or "default"
    if rope_type in ("default", "mrope"):  # mrope: plain RoPE over M-RoPE's sections (`_mrope_section`)
        return None
    if rope_type not in ROPE_SCALINGS:
        raise HFError(f"{path}/config.json: rope_type={rope_type!r}; supported: default, {', '.join(ROPE_SCALINGS)}")
    if block.get("partial_rotary_factor", 1.0) != 1.0:
        raise HFError(
            f"{path}/config.json: partial_rotary_factor={block['partial_rotary_factor']}; RoPE rotates the whole head"
        )
    original = block.get("original_max_position_embeddings") or max_positions
    if rope_type == "yarn" and block.get("factor") is None and original:  # DeepSeek-V3's: the context ratio
        block = {**block, "factor": max_positions / original}
    fields = {"rope_type": rope_type, "factor": float(block["factor"]), **ROPE_DEFAULTS}
    if rope_type == "llama3":
        for k in ("low_freq_factor", "high_freq_factor"):
            fields[k] = float(block.get(k, ROPE_DEFAULTS[k]))
        fields["original_max_position_embeddings"] = int(block["original_max_position_embeddings"])
    if rope_type == "yarn":
        if not original:
            raise HFError(
                f"{path}/config.json: yarn needs original_max_position_embeddings (or max_position_embeddings)"
            )
        fields["original_max_position_embeddings"] = int(original)
        fields["beta_fast"] = float(block.get("beta_fast") or ROPE_DEFAULTS["beta_fast"])
        fields["beta_slow"] = float(block.get("beta_slow") or ROPE_DEFAULTS["beta_slow"])
        fields["truncate"] = bool(block.get("truncate", True))
        factor, mscale, all_dim = fields["factor"], block.get("mscale"), block.get("mscale_all_dim")
        if block.get("attention_factor") is not None:
            fields["attention_factor"] = float(block["attention_factor"])
        elif mscale and all_dim:  # DeepSeek's
            fields["attention_factor"] = yarn_mscale(factor, mscale) / yarn_mscale(factor, all_dim)
    return fields


def _global_every(path, layer_types: list) -> int:
    """transformers' `layer_types` as `global_every` (0: every layer windowed), or refused."""
    full = [i for i, t in enumerate(layer_types) if t == "full_attention"]
    if set(layer_types) - {"full_attention", "sliding_attention"}:
        raise HFError(
            f"{path}/config.json: layer_types holds {sorted(set(layer_types))}; supported: full_attention, sliding_attention"
        )
    if not full:
        return 0
    every = full[0] + 1
    if full != list(range(every - 1, len(layer_types), every)):
        raise HFError(
            f"{path}/config.json: layer_types has full_attention at layers {full}; supported: every k-th layer "
            f"(k-1, 2k-1, ...), the others sliding_attention"
        )
    return every


def _gemma3_fields(path, hf: dict) -> dict:
    """A Gemma 3 text model's config (a `gemma3_text` folder, or a `gemma3` folder's
    `text_config`) as `models.<s>`'s fields: Gemma's block (`_gemma_block`) with query and key
    norms, windowed layers with their own RoPE base and every `sliding_window_pattern`-th layer
    global."""
    c = _with_defaults(hf, GEMMA3_DEFAULTS)
    params = hf.get("rope_parameters") or {}
    full, local = params.get("full_attention") or {}, params.get("sliding_attention") or {}
    if _rope_scaling(path, local):
        raise HFError(
            f"{path}/config.json: rope_parameters.sliding_attention={local}; the windowed layers' RoPE is unscaled"
        )
    types = hf.get("layer_types")
    if types is None:
        pattern = hf.get("sliding_window_pattern", hf.get("_sliding_window_pattern", c["sliding_window_pattern"]))
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(c["num_hidden_layers"])]
    every = _global_every(path, types)
    windowed = every != 1  # 1: every layer global
    global_theta = float(full.get("rope_theta", c["rope_theta"]))
    local_theta = float(local.get("rope_theta", c["rope_local_base_freq"]))
    scaling = _rope_scaling(path, hf.get("rope_scaling") or full, hf.get("max_position_embeddings"))
    if every == 0:  # every layer windowed: each at the windowed layers' RoPE
        global_theta, scaling = local_theta, None
    return {
        **_gemma_block(path, hf, c, "Gemma 3"),
        "rope_theta": global_theta,
        "rope_scaling": scaling,
        "sliding_window": c["sliding_window"] if windowed else None,
        "global_every": every if windowed else 0,
        "rope_local_theta": local_theta if windowed and every else None,
        "qk_norm": True,
    }


def _gemma_block(path, hf: dict, c: dict, family: str) -> dict:
    """What Gemma 2's and 3's configs (`c`: `hf` over the family's defaults) share as
    `models.<s>`'s fields: a causal decoder without attention biases, norms after attention and
    the MLP, GeGLU, scaled embeddings, `query_pre_attn_scalar` and the logit soft-caps."""
    if hf.get("use_bidirectional_attention") or hf.get("attention_bias"):
        raise HFError(
            f"{path}/config.json: use_bidirectional_attention={hf.get('use_bidirectional_attention')}, attention_bias="
            f"{hf.get('attention_bias')}; the decoder is causal without attention biases"
        )
    if c["hidden_activation"] != "gelu_pytorch_tanh":
        raise HFError(
            f"{path}/config.json: hidden_activation={c['hidden_activation']!r}; {family}'s is 'gelu_pytorch_tanh'"
        )
    heads = c["num_attention_heads"]
    return {
        "kind": "llm",
        "vocab": c["vocab_size"],
        "width": c["hidden_size"],
        "depth": c["num_hidden_layers"],
        "heads": heads,
        "kv_heads": c["num_key_value_heads"] or heads,
        "head_dim": c["head_dim"],
        "mlp": c["intermediate_size"],
        "norm_eps": float(c["rms_norm_eps"]),
        "tie_embeddings": bool(c["tie_word_embeddings"]),
        "qkv_bias": False,
        "act": "gelu_pytorch_tanh",
        "post_norms": True,
        "embed_scale": True,
        "query_pre_attn_scalar": int(c["query_pre_attn_scalar"]),
        "attn_softcap": _cap(c["attn_logit_softcapping"]),
        "final_softcap": _cap(c["final_logit_softcapping"]),
        "experts": 0,
        "experts_per_token": 0,
        "expert_mlp": 0,
    }


def _cap(value) -> float | None:
    """A soft-capping value of config.json (None: none)."""
    return None if value is None else float(value)


def _gemma2_fields(path, hf: dict) -> dict:
    """A Gemma 2 model's config as `models.<s>`'s fields: Gemma's block (`_gemma_block`) without
    query and key norms, one RoPE base for every layer, every other layer windowed
    (`layer_types`), its attention scores and output logits soft-capped."""
    c = _with_defaults(hf, GEMMA2_DEFAULTS)
    params = hf.get("rope_parameters") or {}
    scaling = _rope_scaling(path, hf.get("rope_scaling") or params, hf.get("max_position_embeddings"))
    types = hf.get("layer_types") or [
        "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(c["num_hidden_layers"])
    ]
    every = _global_every(path, types)
    windowed = every != 1 and c["sliding_window"] is not None
    return {
        **_gemma_block(path, hf, c, "Gemma 2"),
        "rope_theta": float(params.get("rope_theta", c["rope_theta"])),
        "rope_scaling": scaling,
        "sliding_window": c["sliding_window"] if windowed else None,
        "global_every": every if windowed else 0,
        "rope_local_theta": None,
        "qk_norm": False,
    }


def _gemma1_fields(path, hf: dict) -> dict:
    """A Gemma (1) model's config (PaliGemma 1's language model) as `models.<s>`'s fields: Gemma's
    scaled embeddings and norms scaling by 1 + weight, but a norm only before the attention and the
    MLP, no soft-caps, no window, the query scaled by head_dim; GeGLU with the tanh GELU, which
    transformers 5 runs for the Hub's legacy `hidden_act: gelu` too (GemmaConfig rewrites it)."""
    c = _with_defaults(hf, GEMMA_DEFAULTS)
    params = hf.get("rope_parameters") or {}
    scaling = _rope_scaling(path, hf.get("rope_scaling") or params, hf.get("max_position_embeddings"))
    if c["hidden_act"] not in ("gelu_pytorch_tanh", "gelu"):
        raise HFError(f"{path}/config.json: hidden_act={c['hidden_act']!r}; Gemma's is 'gelu_pytorch_tanh' (or 'gelu')")
    own = {"hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 0}  # Gemma 2's keys, unread here
    block = _gemma_block(
        path, hf, {**c, **own, "attn_logit_softcapping": None, "final_logit_softcapping": None}, "Gemma"
    )
    return {
        **block,
        "post_norms": False,
        "query_pre_attn_scalar": None,
        "attn_softcap": None,
        "final_softcap": None,
        "rope_theta": float(params.get("rope_theta", c["rope_theta"])),
        "rope_scaling": scaling,
        "sliding_window": None,
        "global_every": 0,
        "rope_local_theta": None,
        "qk_norm": False,
    }


def llm_fields(path: str | Path) -> dict:
    """The fields of the config's `models.<name>` entry (kind llm; `LLMConfig`'s fields plus `kind`)
    that describe the checkpoint at `path` (of a multimodal folder, its language model)."""
    hf = read_config(path)
    kind = hf.get("model_type")
    if kind == "gemma3":  # its image tokens attend to their whole image (models/llm.py, body)
        return {**_text_fields(path, hf), "bidirectional_images": True}
    if kind == "paligemma":  # its image and prompt attend to each other (PaliGemmaModel's mask, not the text model's)
        text = {k: v for k, v in (hf.get("text_config") or {}).items() if k != "use_bidirectional_attention"}
        return {**_text_fields(path, {**hf, "text_config": text}), "prefix_lm": True}
    return _text_fields(path, hf)


def _mrope_section(path, hf: dict, kind: str) -> tuple[int, ...]:
    """A `kind` (Qwen-VL) text config's `mrope_section`: how many of each head's rotated pairs turn
    with the temporal, row and column position (`models.layers.mrope_axes`)."""
    block = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    section = tuple(block.get("mrope_section") or QWEN_MROPE_SECTION[kind])
    half = (hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]) // 2
    if len(section) != 3 or sum(section) != half:
        raise HFError(
            f"{path}/config.json: mrope_section={list(section)}; three sections (temporal, row, column) adding up "
            f"to head_dim / 2 = {half}"
        )
    return section


def _tokens_per_second(path, hf: dict) -> dict:
    """Qwen2.5-VL's `vision_config.tokens_per_second` (its class default, 4, where the folder
    omits it) as `video_tokens_per_second`; not a positive number: one line naming it."""
    value = (hf.get("vision_config") or {}).get("tokens_per_second", 4)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
        raise HFError(f"{path}/config.json: vision_config.tokens_per_second={value!r}; valid: a positive number")
    return {"video_tokens_per_second": float(value)}


def _text_fields(path: str | Path, hf: dict) -> dict:
    """`llm_fields` of the config `hf`: a language model's, or a multimodal one's `text_config`."""
    kind = hf.get("model_type")
    if kind in QWEN_VL:
        return _qwen_vl_text_fields(path, hf, kind)
    if kind in MULTIMODAL:
        hf, kind = _multimodal_text(path, hf, kind)
    if kind not in ARCHITECTURES:
        raise HFError(
            f"{path}/config.json: model_type={kind!r}; supported: {sorted([*ARCHITECTURES, *MULTIMODAL, *QWEN_VL])}"
        )
    if kind == "gemma3_text":
        return _gemma3_fields(path, hf)
    if kind == "gemma2":
        return _gemma2_fields(path, hf)
    if kind == "gemma":
        return _gemma1_fields(path, hf)
    params = hf.get("rope_parameters") or {}
    rope_scaling = _rope_scaling(path, hf.get("rope_scaling") or params, hf.get("max_position_embeddings"))
    _check_swiglu_rope(path, hf, params)
    fields = _llama_fields(hf, kind, params, rope_scaling)
    if kind == "mixtral":
        return {**fields, **_mixtral_experts(path, hf)}
    if kind in ("qwen3_moe", "qwen2_moe"):
        return {**fields, **_qwen_moe_experts(path, hf, kind)}
    if kind == "gpt_oss":
        return {**fields, **_gpt_oss_fields(path, hf)}
    if kind == "olmo2":  # norms after the attention and the MLP only; q and k normed over the whole projection
        return {**fields, "pre_norms": False, "post_norms": True, "qk_norm": True, "qk_norm_over": "projection"}
    return fields


def _qwen_vl_text_fields(path: str | Path, hf: dict, kind: str) -> dict:
    """A Qwen-VL folder's language model: its `text_config` (or the top level) as the Qwen text
    model it is, with the multimodal RoPE sections, DeepStack taps and video positions."""
    text = hf.get("text_config") or hf
    tied = bool(hf.get("tie_word_embeddings", False) or text.get("tie_word_embeddings", False))
    text = {**text, "model_type": QWEN_VL[kind], "tie_word_embeddings": tied}
    qwen3 = kind == "qwen3_vl"
    return {
        **_text_fields(path, text),
        "mrope_section": _mrope_section(path, text, kind),
        # Qwen3-VL's text model interleaves its sections whatever `mrope_interleaved` says (transformers
        # reads no flag), and adds one DeepStack feature set per tapped vision block
        "mrope_interleaved": qwen3,
        "deepstack_layers": len(_qwen3_vl_vision_config(hf)["deepstack_visual_indexes"]) if qwen3 else 0,
        # get_rope_index's video positions: Qwen2.5-VL's step per second of video, Qwen3-VL's timestamps
        **({"video_timestamps": True} if qwen3 else _tokens_per_second(path, hf)),
    }


def _multimodal_text(path: str | Path, hf: dict, kind: str) -> tuple[dict, str]:
    """A multimodal folder's `text_config` and its model type (the one `MULTIMODAL` maps `kind` to)."""
    text = hf.get("text_config") or {}
    own = text.get("model_type", MULTIMODAL[kind])
    if own not in (MULTIMODAL[kind], *MULTIMODAL_ALSO.get(kind, ())):
        raise HFError(
            f"{path}/config.json: text_config.model_type={own!r}; a {kind} folder's is "
            f"{' or '.join(repr(t) for t in (MULTIMODAL[kind], *MULTIMODAL_ALSO.get(kind, ())))}"
        )
    return {"tie_word_embeddings": hf.get("tie_word_embeddings", MULTIMODAL_TIED[kind]), **text}, own


def _check_swiglu_rope(path: str | Path, hf: dict, params: dict) -> None:
    """What the LLM is: SwiGLU without MLP biases, RoPE over whole heads, no Qwen2 sliding window."""
    if hf.get("mlp_bias") or hf.get("hidden_act", "silu") != "silu":
        raise HFError(
            f"{path}/config.json: hidden_act={hf.get('hidden_act')!r}, mlp_bias={hf.get('mlp_bias')}; "
            f"the LLM is SwiGLU (silu) without MLP biases"
        )
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1.0:  # Phi-3's (and others'): RoPE over part of each head
        raise HFError(f"{path}/config.json: partial_rotary_factor={partial}; valid: 1.0 (RoPE over the whole head)")
    if hf.get("use_sliding_window"):  # Qwen2's, with its per-layer max_window_layers
        raise HFError(f"{path}/config.json: use_sliding_window=true is not supported (Mistral's sliding_window is)")


def _llama_fields(hf: dict, kind: str, params: dict, rope_scaling) -> dict:
    """The fields of a Llama-family model of type `kind` (dense; its experts added by the caller)."""
    heads = hf["num_attention_heads"]
    return {
        "kind": "llm",
        "vocab": hf["vocab_size"],
        "width": hf["hidden_size"],
        "depth": hf["num_hidden_layers"],
        "heads": heads,
        "kv_heads": hf.get("num_key_value_heads") or heads,
        "head_dim": hf.get("head_dim") or hf["hidden_size"] // heads,
        "mlp": hf["intermediate_size"],
        "rope_theta": float(params.get("rope_theta", hf.get("rope_theta", 10000.0))),
        "rope_scaling": rope_scaling,
        "sliding_window": hf.get("sliding_window") if kind in ("mistral", "mixtral", "phi3") else None,
        "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "qkv_bias": kind in ("qwen2", "qwen2_moe") or bool(hf.get("attention_bias", False)),
        "qk_norm": kind in ("qwen3", "qwen3_moe"),
        "experts": 0,
        "experts_per_token": 0,
        "expert_mlp": 0,
        "moe_renormalize": True,
        "shared_expert_mlp": 0,
        "global_every": 0,
        "rope_local_theta": None,
        "act": "silu",
        "post_norms": False,
        "pre_norms": True,
        "qk_norm_over": "head",
        "embed_scale": False,
        "query_pre_attn_scalar": None,
        "attn_softcap": None,
        "final_softcap": None,
    }


def _qwen_moe_experts(path: str | Path, hf: dict, kind: str) -> dict:
    """A Qwen2-MoE or Qwen3-MoE model's expert fields; every layer must be a mixture-of-experts one."""
    if hf.get("decoder_sparse_step", 1) != 1 or hf.get("mlp_only_layers"):
        raise HFError(
            f"{path}/config.json: decoder_sparse_step={hf.get('decoder_sparse_step')}, mlp_only_layers="
            f"{hf.get('mlp_only_layers')}; every layer must be a mixture-of-experts layer"
        )
    return {
        "experts": hf.get("num_local_experts") or hf["num_experts"],
        "experts_per_token": hf["num_experts_per_tok"],
        "expert_mlp": hf["moe_intermediate_size"],
        "moe_renormalize": bool(hf.get("norm_topk_prob", False)),
        "shared_expert_mlp": hf.get("shared_expert_intermediate_size", 0) if kind == "qwen2_moe" else 0,
    }


def _mixtral_experts(path, hf: dict) -> dict:
    """Mixtral's MoE: every layer `num_local_experts` SwiGLU experts of `intermediate_size`, the
    router's softmax over all of them cut to the top `num_experts_per_tok` and renormalised (as
    Qwen3-MoE's with `norm_topk_prob`); a router that adds training noise is refused."""
    if hf.get("router_jitter_noise", 0.0):
        raise HFError(
            f"{path}/config.json: router_jitter_noise={hf['router_jitter_noise']}; valid: 0 (the router's "
            f"training noise is not implemented)"
        )
    return {
        "experts": hf.get("num_local_experts", 8),
        "experts_per_token": hf.get("num_experts_per_tok", 2),
        "expert_mlp": hf["intermediate_size"],
    }


def _gpt_oss_fields(path, hf: dict) -> dict:
    """GPT-OSS's block: attention sinks, biases on q, k, v and o (`attention_bias`), windowed and
    full layers (`layer_types`), every layer `num_local_experts` experts of `intermediate_size`
    with biases, top `num_experts_per_tok` softmaxed over their logits (the renormalised top k of
    the softmax), the clamped SwiGLU. The Hub's MXFP4-quantized experts are refused (no
    dequantizing loader yet): a bfloat16 copy of the weights loads."""
    if hf.get("quantization_config"):
        method = hf["quantization_config"].get("quant_method", "?")
        raise HFError(
            f"{path}/config.json: quantization_config.quant_method={method!r}; GPT-OSS loads from unquantized "
            f"weights only (dequantize the MXFP4 experts to bfloat16 first)"
        )
    types = hf.get("layer_types") or [
        "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(hf["num_hidden_layers"])
    ]
    every = _global_every(path, types)
    windowed = every != 1 and hf.get("sliding_window") is not None
    bias = bool(hf.get("attention_bias", True))
    return {
        "qkv_bias": bias,
        "out_bias": bias,
        "attention_sinks": True,
        "sliding_window": hf["sliding_window"] if windowed else None,
        "global_every": every if windowed else 0,
        "experts": hf.get("num_local_experts", 128),
        "experts_per_token": hf.get("num_experts_per_tok", 4),
        "expert_mlp": hf["intermediate_size"],
        "expert_bias": True,
        "swiglu_limit": float(hf.get("swiglu_limit", 7.0)),
        "swiglu_alpha": float(hf.get("swiglu_alpha", 1.702)),
        "moe_dispatch": "dense",
    }


ACTIVATIONS = ("gelu", "gelu_pytorch_tanh")  # models.layers.ACTIVATIONS the audio encoder takes, by HF's names
VIT_ACTIVATIONS = (*ACTIVATIONS, "quick_gelu")  # and the vision tower (quick_gelu: CLIP's)

# The config classes' defaults, which an older config.json may leave out (it saved only what differed).
SIGLIP_DEFAULTS = {
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_channels": 3,
    "image_size": 224,
    "patch_size": 16,
    "hidden_act": "gelu_pytorch_tanh",
    "layer_norm_eps": 1e-6,
}
CLIP_DEFAULTS = {
    **SIGLIP_DEFAULTS,
    "patch_size": 32,
    "hidden_act": "quick_gelu",
    "layer_norm_eps": 1e-5,
}
WHISPER_DEFAULTS = {
    "num_mel_bins": 80,
    "d_model": 384,
    "encoder_layers": 4,
    "encoder_attention_heads": 6,
    "encoder_ffn_dim": 1536,
    "max_source_positions": 1500,
    "activation_function": "gelu",
}
WHISPER_LAYER_NORM_EPS = 1e-5  # torch.nn.LayerNorm's default, which every Whisper LayerNorm uses


def _with_defaults(hf: dict, defaults: dict) -> dict:
    return {k: hf.get(k, v) for k, v in defaults.items()}


def _check_act(path, key: str, act, supported: tuple[str, ...] = ACTIVATIONS) -> None:
    if act not in supported:
        raise HFError(f"{path}/config.json: {key}={act!r}; the encoder blocks support {list(supported)}")


VISION_TOWERS = ("siglip_vision_model", "siglip", "clip_vision_model", "clip", "llava", "qwen2_5_vl", "qwen3_vl")
# Qwen2_5_VLVisionConfig's defaults, which a config.json may leave out
QWEN2_5_VL_VISION_DEFAULTS = {
    "depth": 32,
    "hidden_size": 3584,
    "hidden_act": "silu",
    "intermediate_size": 3420,
    "num_heads": 16,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "window_size": 112,
    "out_hidden_size": 3584,
    "fullatt_block_indexes": [7, 15, 23, 31],
}


def _qwen2_5_vl_vision(path, hf: dict) -> dict:
    """A Qwen2.5-VL folder's `vision_config` as a tower's fields (models/vit.py: `block: rmsnorm_glu`,
    `pos_embed: rope2d`, `projector: patch_merger`). A patch spans `temporal_patch_size` frames
    (`frames`: a still image's frame repeated, a clip's own; the patch embedding keeps each
    frame's kernel, `models.hf_encoders`). Windows of `window_size` pixels cover whole merged tokens, as
    transformers counts them; `max_grid` is no part of the checkpoint (no position table) and
    stays the config's."""
    v = _with_defaults(hf.get("vision_config") or {}, QWEN2_5_VL_VISION_DEFAULTS)
    _check_act(path, "vision_config.hidden_act", v["hidden_act"], ("silu", *VIT_ACTIVATIONS))
    patch, merge, heads = v["patch_size"], v["spatial_merge_size"], v["num_heads"]
    window = v["window_size"] // merge // patch * merge
    if v["hidden_size"] % heads or (v["hidden_size"] // heads) % 4 or not window:
        raise HFError(
            f"{path}/config.json: vision_config hidden_size={v['hidden_size']}, num_heads={heads}, window_size="
            f"{v['window_size']}; the heads must divide the width into heads of a multiple of 4 and a window hold "
            f"at least one merged token (spatial_merge_size * patch_size = {merge * patch} pixels)"
        )
    theta = (v.get("rope_parameters") or {}).get("rope_theta", v.get("rope_theta", 10000.0))
    return {
        "kind": "vit",
        "patch": patch,
        "channels": v.get("in_channels", v.get("in_chans", 3)),
        "width": v["hidden_size"],
        "depth": v["depth"],
        "heads": heads,
        "mlp": v["intermediate_size"],
        "out_width": v["out_hidden_size"],
        "merge": merge,
        "frames": v.get("temporal_patch_size", 2),
        "pos_embed": "rope2d",
        "block": "rmsnorm_glu",
        "projector": "patch_merger",
        "rope_theta": float(theta),
        "window": window,
        "full_layers": tuple(v["fullatt_block_indexes"]),
        "norm_eps": 1e-6,  # every RMSNorm of the tower, transformers' constant
        "act": v["hidden_act"],
        "class_token": False,
    }


# Qwen3VLVisionConfig's defaults, which a config.json may leave out
QWEN3_VL_VISION_DEFAULTS = {
    "depth": 27,
    "hidden_size": 1152,
    "hidden_act": "gelu_pytorch_tanh",
    "intermediate_size": 4304,
    "num_heads": 16,
    "in_channels": 3,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "out_hidden_size": 3584,
    "num_position_embeddings": 2304,
    "deepstack_visual_indexes": [8, 16, 24],
}


def _qwen3_vl_vision_config(hf: dict) -> dict:
    """A Qwen3-VL folder's `vision_config` over `Qwen3VLVisionConfig`'s defaults."""
    return _with_defaults(hf.get("vision_config") or {}, QWEN3_VL_VISION_DEFAULTS) | {
        "rope_parameters": (hf.get("vision_config") or {}).get("rope_parameters") or {}
    }


def _qwen3_vl_vision(path, hf: dict) -> dict:
    """A Qwen3-VL folder's `vision_config` as a tower's fields (models/vit.py: `block: layernorm`,
    `pos_embed: table_rope2d`, `projector: patch_merger`, `deepstack_layers`). The learned position
    table is `num_position_embeddings` cells, a square (`table_grid` a side); a patch spans
    `temporal_patch_size` frames, as for Qwen2.5-VL (`_qwen2_5_vl_vision`); `max_grid` is no part of the
    checkpoint (the table is resampled to any grid) and stays the config's."""
    v = _qwen3_vl_vision_config(hf)
    _check_act(path, "vision_config.hidden_act", v["hidden_act"], VIT_ACTIVATIONS)
    heads, cells, taps = v["num_heads"], v["num_position_embeddings"], list(v["deepstack_visual_indexes"])
    side = math.isqrt(cells)
    if v["hidden_size"] % heads or (v["hidden_size"] // heads) % 4 or side * side != cells or side < 2:
        raise HFError(
            f"{path}/config.json: vision_config hidden_size={v['hidden_size']}, num_heads={heads}, "
            f"num_position_embeddings={cells}; the heads must divide the width into heads of a multiple of 4 and the "
            f"position table be a square of 2 or more a side"
        )
    if taps != sorted(set(taps)) or not all(0 <= i < v["depth"] for i in taps):
        raise HFError(
            f"{path}/config.json: vision_config deepstack_visual_indexes={taps}; increasing blocks of 0..{v['depth'] - 1}"
        )
    theta = v["rope_parameters"].get("rope_theta", 10000.0)
    return {
        "kind": "vit",
        "patch": v["patch_size"],
        "channels": v["in_channels"],
        "width": v["hidden_size"],
        "depth": v["depth"],
        "heads": heads,
        "mlp": v["intermediate_size"],
        "out_width": v["out_hidden_size"],
        "merge": v["spatial_merge_size"],
        "frames": v.get("temporal_patch_size", 2),
        "pos_embed": "table_rope2d",
        "table_grid": side,
        "block": "layernorm",
        "projector": "patch_merger",
        "rope_theta": float(theta),
        "deepstack_layers": tuple(taps),
        "norm_eps": 1e-6,  # every LayerNorm of the tower and its mergers, transformers' constant
        "act": v["hidden_act"],
        "class_token": False,
    }


def _llava_feature_layer(path, hf: dict) -> int:
    """A LLaVA config's `vision_feature_layer`: one layer, its features without the class token."""
    layer, strategy = hf.get("vision_feature_layer", -2), hf.get("vision_feature_select_strategy", "default")
    if not isinstance(layer, int) or strategy != "default":
        raise HFError(
            f"{path}/config.json: vision_feature_layer={layer!r}, vision_feature_select_strategy={strategy!r}; "
            f"the vision tower reads one layer (an integer) without its class token ('default')"
        )
    return layer


GEMMA3_MM_TOKENS_PER_IMAGE = 256  # Gemma3Config's default


def _gemma3_projector(path, hf: dict) -> dict:
    """A Gemma 3 VLM's projector as a tower's fields: the average pool's kernel (the tower's patches
    a side over the square root of `mm_tokens_per_image`) is the merge window, and the projection
    lands on the language model's width."""
    vision = _with_defaults(hf.get("vision_config") or {}, SIGLIP_DEFAULTS)
    side, tokens = (
        vision["image_size"] // vision["patch_size"],
        hf.get("mm_tokens_per_image", GEMMA3_MM_TOKENS_PER_IMAGE),
    )
    per_side = math.isqrt(tokens)
    if per_side * per_side != tokens or side % per_side:
        raise HFError(
            f"{path}/config.json: mm_tokens_per_image={tokens}; a Gemma 3 projector pools the tower's {side}x{side} "
            f"patches into a square grid that divides it (e.g. {(side // 2) ** 2 if side % 2 == 0 else side * side})"
        )
    text = _with_defaults(hf.get("text_config") or {}, GEMMA3_DEFAULTS)
    return {"projector": "avg_pool", "merge": side // per_side, "out_width": text["hidden_size"]}


# SmolVLMVisionConfig's and Idefics3VisionConfig's defaults (transformers 5.25), for fields a folder leaves out
IDEFICS3_VISION_DEFAULTS = {
    **SIGLIP_DEFAULTS,
    "hidden_size": 1152,
    "num_attention_heads": 16,
    "patch_size": 32,
}
IDEFICS3_SCALE_FACTOR = 2  # SmolVLMConfig's and Idefics3Config's default scale_factor


def _pixel_shuffle_connector(path, hf: dict, kind: str) -> dict:
    """A SmolVLM or Idefics3 connector as a tower's fields: its pixel shuffle of `scale_factor`
    concatenates each scale x scale window of patches (the merge window), and its
    `modality_projection.proj` (no bias) lands on the language model's width."""
    vision = _with_defaults(hf.get("vision_config") or {}, IDEFICS3_VISION_DEFAULTS)
    side, scale = vision["image_size"] // vision["patch_size"], hf.get("scale_factor", IDEFICS3_SCALE_FACTOR)
    if not isinstance(scale, int) or scale < 1 or side % scale:
        raise HFError(
            f"{path}/config.json: scale_factor={scale!r}; its pixel shuffle cuts the tower's {side}x{side} patches "
            f"into scale x scale windows: valid: a positive integer dividing {side}"
        )
    text = _multimodal_text(path, hf, kind)[0]
    width = text.get("hidden_size", 4096)  # LlamaConfig's default
    return {"projector": "linear", "projector_bias": False, "merge": scale, "out_width": width}


def _vision_tower(path: str | Path, hf: dict, kind: str) -> tuple[dict, str, dict]:
    """The SigLIP or CLIP tower's own config inside a folder's `hf` of type `kind`, its type, and
    the fields the folder adds (LLaVA's feature layer, Gemma 3's projector)."""
    extra = {}
    if kind == "llava":
        extra["feature_layer"] = _llava_feature_layer(path, hf)
        hf = hf.get("vision_config") or {}
        if hf.get("model_type") != "clip_vision_model":
            raise HFError(
                f"{path}/config.json: vision_config.model_type={hf.get('model_type')!r}; a LLaVA vision tower "
                f"imports as 'clip_vision_model'"
            )
        kind = "clip"
    elif kind in ("siglip", "clip"):
        hf = hf.get("vision_config") or {}
    elif kind == "gemma3":  # a Gemma 3 VLM's tower: SigLIP and the checkpoint's average-pooling projector
        extra = _gemma3_projector(path, hf)
        hf = hf.get("vision_config") or {}
        if hf.get("model_type", "siglip_vision_model") != "siglip_vision_model":
            raise HFError(
                f"{path}/config.json: vision_config.model_type={hf.get('model_type')!r}; a Gemma 3 vision tower "
                f"imports as 'siglip_vision_model'"
            )
    elif kind == "llava_onevision":  # issue 80: its any-resolution tiles and image newline are not placed yet
        raise HFError(
            f"{path}/config.json: model_type='llava_onevision': its vision tower (SigLIP over any-resolution tiles, "
            f"with an image newline token per row) does not load yet; kind: llm takes its language model"
        )
    elif kind in ("smolvlm", "idefics3"):  # SigLIP's layout, its pixel-shuffle connector a bias-free linear projector
        extra = _pixel_shuffle_connector(path, hf, kind)
        hf = _with_defaults(hf.get("vision_config") or {}, IDEFICS3_VISION_DEFAULTS)
        if hf.get("model_type", f"{kind}_vision") != f"{kind}_vision":
            raise HFError(
                f"{path}/config.json: vision_config.model_type={hf.get('model_type')!r}; a {kind} vision tower "
                f"imports as '{kind}_vision'"
            )
        kind = "siglip"
    elif kind == "paligemma":  # PaliGemma's tower: SigLIP and the checkpoint's linear projector, a token a patch
        vision = hf.get("vision_config") or {}
        width = (
            hf.get("projection_dim")
            or vision.get("projection_dim")
            or _multimodal_text(path, hf, kind)[0]["hidden_size"]
        )
        extra = {"projector": "linear", "merge": 1, "out_width": width}
        hf = vision
        if hf.get("model_type", "siglip_vision_model") != "siglip_vision_model":
            raise HFError(
                f"{path}/config.json: vision_config.model_type={hf.get('model_type')!r}; a PaliGemma vision tower "
                f"imports as 'siglip_vision_model'"
            )
        kind = "siglip"
    elif kind not in VISION_TOWERS:
        raise HFError(f"{path}/config.json: model_type={kind!r}; a vision tower is one of {list(VISION_TOWERS)}")
    return hf, kind, extra


def vit_fields(path: str | Path) -> dict:
    """The fields of the config's `models.<name>` entry (kind vit) that describe the vision tower at
    `path`: SigLIP (a `siglip_vision_model` config, or a `siglip` one's `vision_config`; a `gemma3` one's
    with its projector, `_gemma3_projector`) or CLIP (a `clip_vision_model` config, a `clip` one's
    `vision_config`, or a `llava` one's, with its `vision_feature_layer`) or Qwen2.5-VL's
    (`_qwen2_5_vl_vision`) or Qwen3-VL's (`_qwen3_vl_vision`)."""
    hf = read_config(path)
    kind = hf.get("model_type")
    if kind == "qwen2_5_vl":
        return _qwen2_5_vl_vision(path, hf)
    if kind == "qwen3_vl":
        return _qwen3_vl_vision(path, hf)
    hf, kind, extra = _vision_tower(path, hf, kind)
    clip = kind.startswith("clip")
    c = _with_defaults(hf, CLIP_DEFAULTS if clip else SIGLIP_DEFAULTS)
    _check_act(path, "hidden_act", c["hidden_act"], VIT_ACTIVATIONS)
    if c["image_size"] % c["patch_size"] or c["hidden_size"] % c["num_attention_heads"]:
        raise HFError(
            f"{path}/config.json: image_size={c['image_size']}, patch_size={c['patch_size']}, hidden_size="
            f"{c['hidden_size']}, num_attention_heads={c['num_attention_heads']}; the patch must divide the "
            f"image and the heads the width"
        )
    return {
        "kind": "vit",
        "patch": c["patch_size"],
        "channels": c["num_channels"],
        "width": c["hidden_size"],
        "depth": c["num_hidden_layers"],
        "heads": c["num_attention_heads"],
        "mlp": c["intermediate_size"],
        "max_grid": c["image_size"] // c["patch_size"],
        "pos_embed": "table",
        "norm_eps": float(c["layer_norm_eps"]),
        "act": c["hidden_act"],
        "class_token": clip,
        **extra,
    }


# Qwen2AudioEncoderConfig's defaults (transformers 5.25), for fields its `audio_config` leaves out
QWEN2_AUDIO_DEFAULTS = {
    "num_mel_bins": 128,
    "d_model": 1280,
    "encoder_layers": 32,
    "encoder_attention_heads": 20,
    "encoder_ffn_dim": 5120,
    "max_source_positions": 1500,
    "activation_function": "gelu",
}
QWEN2_AUDIO_POOL = 2  # Qwen2AudioEncoder's avg_pooler: AvgPool1d(2, stride=2) after the last layer


def audio_fields(path: str | Path) -> dict:
    """The fields of the config's `models.<name>` entry (kind audio) that describe the Whisper
    encoder at `path`, or a Qwen2-Audio folder's encoder (Whisper's, its tokens pooled in pairs
    before its final norm) with its projector onto the language model's width (`out_proj`)."""
    hf = read_config(path)
    if hf.get("model_type") == "qwen2_audio":
        audio = hf.get("audio_config") or {}
        if audio.get("model_type", "qwen2_audio_encoder") != "qwen2_audio_encoder":
            raise HFError(
                f"{path}/config.json: audio_config.model_type={audio.get('model_type')!r}; a Qwen2-Audio encoder "
                f"imports as 'qwen2_audio_encoder'"
            )
        width = llm_fields(path)["width"]  # the projector's output: the language model's hidden size
        encoder = _whisper_layout(path, _with_defaults(audio, QWEN2_AUDIO_DEFAULTS))
        return {**encoder, "pool": QWEN2_AUDIO_POOL, "out_width": width}
    if hf.get("model_type") != "whisper":
        raise HFError(
            f"{path}/config.json: model_type={hf.get('model_type')!r}; an audio encoder is 'whisper' or "
            f"'qwen2_audio' (its encoder)"
        )
    return _whisper_layout(path, _with_defaults(hf, WHISPER_DEFAULTS))


def _whisper_layout(path: str | Path, c: dict) -> dict:
    """A Whisper-layout encoder's fields from its config `c` (defaults filled in)."""
    _check_act(path, "activation_function", c["activation_function"])
    if c["d_model"] % c["encoder_attention_heads"]:
        raise HFError(
            f"{path}/config.json: d_model={c['d_model']} is not a multiple of encoder_attention_heads="
            f"{c['encoder_attention_heads']}"
        )
    return {
        "kind": "audio",
        "mel": c["num_mel_bins"],
        "frames_per_token": 2,
        "width": c["d_model"],
        "depth": c["encoder_layers"],
        "heads": c["encoder_attention_heads"],
        "mlp": c["encoder_ffn_dim"],
        "max_tokens": c["max_source_positions"],
        "stem": "conv",
        "norm_eps": WHISPER_LAYER_NORM_EPS,
        "act": c["activation_function"],
    }


# Folders that hold more than one model: a config entry names the one it takes with `kind`
MULTI_MODEL = {
    "gemma3": ("llm", "vit"),
    "qwen2_5_vl": ("llm", "vit"),
    "qwen3_vl": ("llm", "vit"),
    "qwen2_audio": ("llm", "audio"),
    "paligemma": ("llm", "vit"),
    "llava_onevision": ("llm", "vit"),
    "smolvlm": ("llm", "vit"),
    "idefics3": ("llm", "vit"),
}


def kind_of(path: str | Path) -> str:
    """The `models.<s>.kind` of the folder at `path`: llm, vit or audio, by its `model_type`; a
    folder holding several (a Gemma 3 VLM's language model and vision tower) is refused, as the
    entry must say which it takes."""
    model_type = read_config(path).get("model_type")
    if model_type in MULTI_MODEL:
        kinds = MULTI_MODEL[model_type]
        raise HFError(
            f"{path}/config.json: model_type={model_type!r} holds a model of each kind {list(kinds)}; write "
            f"kind: {kinds[0]} or kind: {kinds[1]} beside hf"
        )
    for kind, types in (("llm", (*ARCHITECTURES, *MULTIMODAL)), ("vit", VISION_TOWERS), ("audio", ("whisper",))):
        if model_type in types:
            return kind
    raise HFError(
        f"{path}/config.json: model_type={model_type!r}; supported: {sorted([*ARCHITECTURES, *MULTIMODAL])} (llm), "
        f"{list(VISION_TOWERS)} (vit), ['whisper'] (audio)"
    )
