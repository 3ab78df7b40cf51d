"""Hugging Face export for the CLI (`maestro-jax export`): a trained section written as a folder
that `transformers` loads. An LLM section exports as Llama, Mistral or Qwen2/Qwen3/Qwen3-MoE (`--model-type`;
one with a `sliding_window` as Mistral only),
a vision section as SigLIP or CLIP (the layout its model has: `class_token` is CLIP's), an audio
section as Whisper's encoder.

The weight mappings themselves (import and export) live beside the models they convert, in
`models/hf.py` and `models/hf_encoders.py`; the workloads' `init.hf_path` loaders import them from
there. This module keeps the names the CLI's `export` calls and picks the mapping by the model's kind.
"""

from __future__ import annotations

from pathlib import Path

from maestro_jax.models.hf import ARCHITECTURES, HFError, save_llm
from maestro_jax.models.hf_encoders import save_audio, save_vit

__all__ = ["EXPORT_TYPES", "HFError", "export_type", "save_audio", "save_llm", "save_section", "save_vit"]

# model kind -> the Hugging Face model types a section of that kind exports as (the first: the default)
EXPORT_TYPES = {
    "llm": ("llama", *sorted(set(ARCHITECTURES) - {"llama"})),
    "vit": ("siglip", "clip"),
    "audio": ("whisper",),
}


def export_type(fields: dict, model_type: str | None, section: str = "<s>") -> str:
    """The Hugging Face type a model with `fields` (the `models.<section>` entry) exports as:
    `model_type` if given and fitting, else the model's own (an LLM: llama, or mistral with a
    sliding window; a tower: its layout).
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
    elif fields.get("sliding_window") is not None:  # of the LLM types, only Mistral has the window
        own = "mistral"
    else:
        own = "llama"
    fits = EXPORT_TYPES[kind] if kind == "llm" and own == "llama" else (own,)
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
