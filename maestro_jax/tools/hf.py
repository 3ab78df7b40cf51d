"""Hugging Face export for the CLI (`maestro-jax export`): a trained section written as a folder
that `transformers` loads. An LLM section exports as Llama, Mistral, Qwen2/Qwen3/Qwen3-MoE, Gemma 2
or Gemma 3 (`--model-type`; one with a `sliding_window` as Mistral only, one with Gemma's block as
`gemma3_text` with query and key norms, else `gemma2`),
a vision section as SigLIP or CLIP (the layout its model has: `class_token` is CLIP's), an audio
section as Whisper's encoder; a VLM's vision and llm sections together as one Gemma 3 VLM folder
(`gemma3`: a SigLIP tower with `projector: avg_pool` and a Gemma 3 language model), or one
Qwen2.5-VL or Qwen3-VL folder (`qwen2_5_vl`, `qwen3_vl`: the tower's layout says which); an
omni model's audio and llm sections as one Qwen2-Audio folder (`qwen2_audio`).

The weight mappings themselves (import and export) live beside the models they convert, in
`models/hf.py` and `models/hf_encoders.py`; the workloads' `init.hf_path` loaders import them from
there. This module keeps the names the CLI's `export` calls and picks the mapping by the model's kind.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from maestro_jax.models.hf import ARCHITECTURES, HFError, save_llm
from maestro_jax.models.hf_encoders import (
    save_audio,
    save_gemma3_vlm,
    save_paligemma,
    save_qwen2_audio,
    save_qwen_vl,
    save_smolvlm,
    save_vit,
)

__all__ = [
    "EXPORT_TYPES",
    "HFError",
    "check_export_folder",
    "export_gemma3_vlm",
    "export_paligemma",
    "export_qwen2_audio",
    "export_qwen_vl",
    "export_section",
    "export_smolvlm",
    "export_type",
    "save_audio",
    "save_llm",
    "save_section",
    "save_vit",
]

# what a loader reads as a model's weights or their index: an export removes these from a folder
# it overwrites, so no old shard or index is read beside the new weights
WEIGHT_FILES = ("*.safetensors", "*.safetensors.index.json", "*.bin", "*.bin.index.json", "*.pt", "*.pth", "*.msgpack")

# model kind -> the Hugging Face model types a section of that kind exports as (the first: the default)
EXPORT_TYPES = {
    "llm": ("llama", *sorted(set(ARCHITECTURES) - {"llama"})),
    "vit": ("siglip", "clip"),
    "audio": ("whisper",),
}


# The LLM fields only GPT-OSS has (its attention sinks and output bias, its experts' biases and
# clamped SwiGLU): a model with sinks and expert biases exports as gpt_oss, one with some of them
# only as no type (`export_type`)
GPT_OSS_FIELDS = ("attention_sinks", "out_bias", "expert_bias", "swiglu_limit")


def export_type(fields: dict, model_type: str | None, section: str = "<s>") -> str:
    """The Hugging Face type a model with `fields` (the `models.<section>` entry) exports as:
    `model_type` if given and fitting, else the model's own (an LLM: llama, mistral with a
    sliding window, gemma3_text or gemma2 with Gemma's block (gemma with Gemma 1's), olmo2 with OLMo 2's, gpt_oss with
    GPT-OSS's sinks and expert biases, qwen3_moe or mixtral with experts;
    a tower: its layout).
    Raises HFError with the `error:` line, before any weight is read, for a combination no
    exporter writes."""
    kind, where = fields["kind"], f"models.{section}"
    if kind == "vit":
        if fields.get("pos_embed") != "table":
            raise HFError(
                f"error: {where}.pos_embed={fields.get('pos_embed')!r}: no Hugging Face vision tower has this "
                f"layout; a tower with pos_embed='table' exports as SigLIP (or CLIP with class_token)"
            )
        own = "clip" if fields.get("class_token") else "siglip"
    elif kind == "audio":
        if fields.get("stem") != "conv":
            raise HFError(
                f"error: {where}.stem={fields.get('stem')!r}: no Hugging Face audio encoder has this stem; "
                f"an encoder with stem='conv' exports as Whisper"
            )
        own = "whisper"
    elif fields.get("attention_sinks") and fields.get("expert_bias"):  # GPT-OSS's block
        own = "gpt_oss"
    elif gpt_oss := [k for k in GPT_OSS_FIELDS if fields.get(k)]:
        k = gpt_oss[0]
        raise HFError(
            f"error: {where}.{k}={fields[k]}: only GPT-OSS's block (attention sinks and experts with biases "
            f"together) holds it; no Hugging Face type holds this model"
        )
    elif fields.get("mrope_section"):
        raise HFError(
            f"error: {where}.mrope_section={list(fields['mrope_section'])}: no Hugging Face language model alone has "
            f"M-RoPE; export it with its tower as one qwen2_5_vl or qwen3_vl folder (--section vision,llm)"
        )
    elif not fields.get("pre_norms", True):  # norms after the attention and the MLP only: OLMo 2's block
        own = "olmo2"
    elif fields.get("post_norms"):  # Gemma's block (its norms, GeGLU, scaled embeddings): Gemma 3's, or 2's
        own = "gemma3_text" if fields.get("qk_norm") else "gemma2"
    elif fields.get("embed_scale"):  # Gemma's norms and scaled embeddings without its post-norms: Gemma 1's
        own = "gemma"
    elif fields.get("experts"):  # a mixture of experts: Qwen3-MoE's (query and key norms), Qwen2-MoE's (a
        # shared expert) or Mixtral's block
        own = "qwen3_moe" if fields.get("qk_norm") else "qwen2_moe" if fields.get("shared_expert_mlp") else "mixtral"
    elif fields.get("sliding_window") is not None:  # of the other LLM types, only Mistral has the window
        own = "mistral"
    else:
        own = "llama"
    llama_like = tuple(
        t for t in EXPORT_TYPES["llm"] if t not in ("gemma", "gemma2", "gemma3_text", "olmo2", "gpt_oss")
    )
    fits = llama_like if kind == "llm" and own == "llama" else ("mistral", "phi3") if own == "mistral" else (own,)
    if model_type is not None and model_type not in fits:
        raise HFError(
            f"error: --model-type={model_type}: section {section!r} ({kind}) does not export as it; valid: {list(fits)}"
        )
    return model_type or own


def save_section(path: str | Path, params: dict, fields: dict, model_type: str) -> None:
    """Write a section's `params` (its model's `fields`) as a Hugging Face folder of `model_type`
    (an `export_type` answer)."""
    kind = fields["kind"]
    if kind == "vit":
        save_vit(path, params, fields)
    elif kind == "audio":
        save_audio(path, params, fields)
    else:
        save_llm(path, params, fields, model_type=model_type)


def check_export_folder(path: str | Path, overwrite: bool) -> None:
    """Before anything is read: `path` is new or empty, or `overwrite` allows replacing what it
    holds (an export beside another model's shards and index would have a loader read those)."""
    path = Path(path)
    held = sorted(p.name for p in path.iterdir()) if path.is_dir() else []
    if path.exists() and not path.is_dir():
        raise HFError(f"error: --out={path}: is a file; valid: a new or empty folder")
    if held and not overwrite:
        shown = ", ".join(held[:5]) + (f" and {len(held) - 5} more" if len(held) > 5 else "")
        raise HFError(
            f"error: --out={path}: holds files this export did not write ({shown}); valid: a new or empty "
            f"folder, or --overwrite to replace its weights and config (other files, a tokenizer, stay)"
        )


def export_section(path: str | Path, params: dict, fields: dict, model_type: str, overwrite: bool = False) -> None:
    """`save_section` into `path`, owning the folder (`_export_into`)."""
    _export_into(path, lambda staging: save_section(staging, params, fields, model_type), overwrite)


def export_gemma3_vlm(
    path: str | Path, vision: tuple[dict, dict], llm: tuple[dict, dict], image_token: int, overwrite: bool = False
) -> None:
    """A VLM's vision and llm sections (each `(params, fields)`) written into `path` as one Gemma 3
    VLM folder (`save_gemma3_vlm`), owning the folder (`_export_into`)."""
    _export_into(path, lambda staging: save_gemma3_vlm(staging, *vision, *llm, image_token), overwrite)


def export_paligemma(
    path: str | Path, vision: tuple[dict, dict], llm: tuple[dict, dict], image_token: int, overwrite: bool = False
) -> None:
    """A VLM's vision and llm sections (each `(params, fields)`) written into `path` as one
    PaliGemma 2 folder (`save_paligemma`), owning the folder (`_export_into`)."""
    _export_into(path, lambda staging: save_paligemma(staging, *vision, *llm, image_token), overwrite)


def export_smolvlm(
    path: str | Path, vision: tuple[dict, dict], llm: tuple[dict, dict], image_token: int, overwrite: bool = False
) -> None:
    """A VLM's vision and llm sections (each `(params, fields)`) written into `path` as one SmolVLM
    folder (`save_smolvlm`), owning the folder (`_export_into`)."""
    _export_into(path, lambda staging: save_smolvlm(staging, *vision, *llm, image_token), overwrite)


def export_qwen_vl(
    path: str | Path,
    vision: tuple[dict, dict],
    llm: tuple[dict, dict],
    image_token: int,
    overwrite: bool = False,
    video_token: int | None = None,
) -> None:
    """A VLM's vision and llm sections (each `(params, fields)`) written into `path` as one
    Qwen2.5-VL or Qwen3-VL folder, as its tower is (`save_qwen_vl`), owning the folder (`_export_into`)."""
    _export_into(path, lambda staging: save_qwen_vl(staging, *vision, *llm, image_token, video_token), overwrite)


def export_qwen2_audio(
    path: str | Path, audio: tuple[dict, dict], llm: tuple[dict, dict], audio_token: int, overwrite: bool = False
) -> None:
    """An audio LLM's audio and llm sections (each `(params, fields)`) written into `path` as one
    Qwen2-Audio folder (`save_qwen2_audio`), owning the folder (`_export_into`)."""
    _export_into(path, lambda staging: save_qwen2_audio(staging, *audio, *llm, audio_token), overwrite)


def _export_into(path: str | Path, write, overwrite: bool) -> None:
    """`write(folder)` into `path`, owning the folder: the export is written into a fresh sibling
    first, so a failure leaves `path` as it was; then, under `overwrite`, every weight file and
    index `path` held is removed (`WEIGHT_FILES`) before the new files move in (a crash in
    between leaves no weights, never two models' mixed), and the sibling is removed."""
    path = Path(path).absolute()
    check_export_folder(path, overwrite)
    staging = path.parent / f".{path.name}.export-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        write(staging)
        if not path.exists() or not any(path.iterdir()):
            if path.exists():
                path.rmdir()
            staging.rename(path)
            return
        for pattern in WEIGHT_FILES:
            for old in path.glob(pattern):
                old.unlink()
        for new in sorted(staging.iterdir()):
            os.replace(new, path / new.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
