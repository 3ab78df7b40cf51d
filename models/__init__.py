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

from maestro_jax.models.audio import AudioConfig, AudioEncoder
from maestro_jax.models.layers import RopeScaling, apply_with_losses, apply_with_row_losses
from maestro_jax.models.llm import DecoderLM, LLMConfig, softcap
from maestro_jax.models.vit import VisionEncoder, ViTConfig

__all__ = [
    "AudioConfig",
    "AudioEncoder",
    "DecoderLM",
    "LLMConfig",
    "RopeScaling",
    "ViTConfig",
    "VisionEncoder",
    "apply_with_losses",
    "apply_with_row_losses",
    "softcap",
]
