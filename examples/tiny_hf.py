"""Tiny random Hugging Face checkpoints, made offline: the stand-in for the folders the recipes
would otherwise download (a Qwen2 LLM, a SigLIP vision tower, a Whisper encoder).

The weights are a recipe config's own random initialisation, written with the project's
exporters (`maestro_jax.models.hf.save_llm`, `maestro_jax.models.hf_encoders.save_vit` /
`save_audio`), so the folders match the config's `models.<section>` field for field, as
`sections.<s>.init.hf_path` requires. With real checkpoints, skip this step and point
`init.hf_path` at them (and set `models.<section>` to their shapes).
"""

from __future__ import annotations

from pathlib import Path

import flax.linen as nn
import jax
from maestro_jax.models import hf, hf_encoders

import maestro_jax as mj


def write_random_folders(config: mj.Config, folders: dict[str, Path], seed: int = 0) -> None:
    """Each section in `folders` (a trained section of `config`'s graph) written as a Hugging Face
    folder of its random initial weights: an `llm` model as Qwen2, a `vit` as SigLIP (`pos_embed:
    table`), an `audio` model as a Whisper encoder (`stem: conv`); projectors are left out, as the
    checkpoints have none. `config` must not itself start those sections from the folders."""
    params = nn.meta.unbox(mj.Trainer(config).graph.init(jax.random.key(seed)))
    for section, folder in folders.items():
        model = config.models[section].model_dump()
        weights = jax.device_get(params[section]["params"])
        if model["kind"] == "llm":
            hf.save_llm(folder, weights, model, model_type="qwen2")
        elif model["kind"] == "vit":
            hf_encoders.save_vit(folder, weights, model)
        else:
            hf_encoders.save_audio(folder, weights, model)
