"""Omni: `vision` (ViT) and `audio` (audio encoder) -> `llm` (decoder, holds the loss).

Each encoder runs only for the samples that carry its modality (a sample may carry images,
audio clips, both or neither); their tokens replace the matching placeholders of the LLM
input (ids `workload_settings.image_token` and `audio_token`, default 1 and 2). Two producers
into one section: the shape of Qwen2.5-Omni-style training.
"""

from __future__ import annotations

from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from pydantic import PositiveInt

from maestro_jax.config import Config
from maestro_jax.core.graph import Edge, Section, SectionGraph
from maestro_jax.data.samples import AUDIO_TOKEN, Modality
from maestro_jax.models import AudioConfig, AudioEncoder
from maestro_jax.workloads import Workload, mean_item_units, model, settings
from maestro_jax.workloads import rows as R
from maestro_jax.workloads.costs import audio_cost
from maestro_jax.workloads.pretrained import load_audio_section, load_llm_section, load_vision_section
from maestro_jax.workloads.vlm import (
    VLMSettings,
    image_bytes_per_patch,
    image_modality,
    init_llm,
    init_vision,
    llm_section,
    mean_patches,
    vision_section,
)

IMAGES, AUDIO = "image_embeds", "audio_embeds"


class OmniSettings(VLMSettings):
    """`workload_settings:` of omni: the image and the audio placeholder ids; a Qwen2-Audio folder
    (`models.<s>: {hf: PATH}`) fills in `audio_token` from its `audio_token_index`."""

    checkpoint_fields: ClassVar[dict[str, str | tuple[str, ...]]] = {
        **VLMSettings.checkpoint_fields,
        "audio_token": ("audio_token_index", "audio_token_id"),
    }

    audio_token: PositiveInt = AUDIO_TOKEN  # the LLM input id of an audio token: the tokenizer's `<audio>` id


def audio_modality(cfg: Config) -> Modality:
    """Clips as the config's audio encoder (`models.audio`) takes them, on the configured
    placeholder id: one placeholder per token it sends on (`frames_per_output`: pooled tokens)."""
    a = model(cfg, "audio", "audio")
    return Modality(
        "audio", settings(cfg).audio_token, (a.frames_per_output,), a.mel, (a.max_tokens * a.frames_per_token,)
    )


def frame_groups(clip: np.ndarray, frames_per_token: int, pool: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """A clip T x mel -> (tokens N x frames_per_token*mel, positions N x 1): whole pooled tokens
    only (N a multiple of `pool`, the frames after them left out, as the placeholders count them:
    `Modality.tokens` of `audio_modality`), so no pooled token takes the next clip's."""
    n = clip.shape[0] // (frames_per_token * pool) * pool
    return clip[: n * frames_per_token].reshape(n, -1), np.arange(n)[:, None]


def encoder_tokens(a: AudioConfig, frames: int) -> int:
    """The tokens the encoder's blocks run on for a clip of `frames` (`frame_groups`)."""
    return frames // a.frames_per_output * a.pool


def audio_section(a: AudioConfig, llm_width: int, mean_tokens: float, *, per_octave: int) -> Section:
    """The audio encoder section: a sample's clips packed per row (the frame-group count bucketed
    at `per_octave`, `compile.buckets_per_octave`), audio tokens out."""
    if a.out_width != llm_width:
        raise ValueError(f"models.audio.out_width ({a.out_width}) must equal the LLM width ({llm_width})")
    encoder = AudioEncoder(a)

    def host_batch(rows, routes):
        b = R.pack_items(
            rows,
            "audio",
            lambda clip: frame_groups(clip, a.frames_per_token, a.pool),
            a.token_features,
            per_octave=per_octave,
        )
        out = {"frames": b["pieces"], "segments": b["segments"], "positions": b["positions"]}
        return {**out, "segment_lengths": b["segment_lengths"]} if "segment_lengths" in b else out

    def forward(variables, inputs, batch):
        return {
            AUDIO: encoder.apply(
                {"params": variables["params"]},
                batch["frames"],
                batch["segments"],
                batch["positions"],
                batch.get("segment_lengths"),
            )
        }

    return Section(
        "audio",
        trained=True,
        forward=forward,
        host_batch=host_batch,
        activates=lambda s: s.has("audio"),
        work=lambda s: sum(encoder_tokens(a, t) for t, _ in s.shapes("audio")),
        cost=audio_cost(a, mean_tokens),
        reads=("audio",),
    )


def init_audio(a: AudioConfig, key):
    return AudioEncoder(a).init(
        key, jnp.zeros((1, 16, a.token_features)), jnp.ones((1, 16), jnp.int32), jnp.zeros((1, 16, 1), jnp.int32)
    )


def build(cfg: Config) -> SectionGraph:
    vit, aud, llm = model(cfg, "vision", "vit"), model(cfg, "audio", "audio"), model(cfg, "llm", "llm")
    modalities = (image_modality(cfg), audio_modality(cfg))

    def init(key):
        kv, ka, kl = jax.random.split(key, 3)
        return {
            "vision": {"params": init_vision(vit, kv)["params"], "consts": {}},
            "audio": {"params": init_audio(aud, ka)["params"], "consts": {}},
            "llm": {"params": init_llm(llm, kl)["params"], "consts": {}},
        }

    mean_tokens = mean_item_units(cfg, "audio", lambda t: encoder_tokens(aud, t[0]), aud.max_tokens / 4)
    per_octave = cfg.compile.buckets_per_octave
    return SectionGraph(
        sections=(
            vision_section(vit, llm, mean_patches(cfg, vit), edges=(IMAGES,), per_octave=per_octave),
            audio_section(aud, llm.width, mean_tokens, per_octave=per_octave),
            llm_section(llm, dict(zip((IMAGES, AUDIO), modalities)), per_octave=per_octave),
        ),
        edges=(
            Edge(IMAGES, "vision", "llm", bytes_per_unit=image_bytes_per_patch(vit)),
            Edge(AUDIO, "audio", "llm", bytes_per_unit=2 * llm.width / aud.pool),  # a unit: a token before pooling
        ),
        init=init,
        loss_count=R.loss_tokens(modalities),
    )


WORKLOAD = Workload(
    "omni",
    build,
    vocab=lambda cfg: model(cfg, "llm", "llm").vocab,
    modalities=lambda cfg: (image_modality(cfg), audio_modality(cfg)),
    pretrained={"vision": load_vision_section, "audio": load_audio_section, "llm": load_llm_section},
    settings=OmniSettings,
)
