"""Flax models for maestro_jax workloads.

Models speak logical axes only; `meshes/` maps them onto mesh axes.

Shape-suffix glossary used across `models/` and `maestro_jax/`:
  B  batch rows of one micro-step       L  text length (tokens)
  P  image patches (packed per row)     T  merged image tokens (P / merge**2)
  D  model width                        V  vocabulary
  H  query heads   G  key/value heads   K  head dimension
  F  MLP hidden width                   C  patch feature size (patch*patch*channels)
  N  audio tokens (frame groups, packed per row)   F  features of a frame group
  J  DeepStack feature sets (Qwen3-VL's image features from intermediate vision blocks)
"""

import importlib

# name -> the module that defines it, imported when the name is first read: the configs
# (`models.configs`, JAX-free) can be read by the launch config without importing Flax
_HOME = {
    "AudioConfig": "configs",
    "AudioEncoder": "audio",
    "DecoderLM": "llm",
    "LLMConfig": "llm",
    "RopeScaling": "layers",
    "ViTConfig": "configs",
    "VisionEncoder": "vit",
    "apply_with_losses": "layers",
    "apply_with_row_losses": "layers",
    "softcap": "llm",
}

__all__ = sorted(_HOME)


def __getattr__(name: str):
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)


def __dir__():
    return sorted([*globals(), *_HOME])
