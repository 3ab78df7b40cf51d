"""`maestro-jax check-hf`: a Hugging Face folder through transformers and through maestro, side by
side, so a user can check an import without this repository's fixtures.

The same random inputs go through both. A decoder gets rows of token ids of different lengths
(padded on the right; the padding is masked on both sides and left out of the comparison), each
longer than the folder's sliding window where it has one, so the window is exercised; its
logits are compared. A vision tower (SigLIP, CLIP, a LLaVA folder's) gets two random images of
its size, packed in one row as the VLM packs them, and its features are compared: SigLIP's
`last_hidden_state`, CLIP's `hidden_states[feature_layer]` without the class token. A Whisper
encoder gets two random clips of its length, and its `last_hidden_state` is compared. A whole
Gemma 3 VLM gets two random images and a row of text holding both: its image tokens (tower and
projector) and its logits are compared. A whole Qwen2.5-VL or Qwen3-VL gets three random images of
different sizes (grids that Qwen2.5-VL's attention windows do not divide), a random clip of two
temporal patches, and two rows of different lengths, the longer holding two of the images between
text, the shorter the third and the clip: the merged image tokens and video tokens (Qwen3-VL's
DeepStack features too) and the logits (with each row's M-RoPE positions, the clip's as
`get_rope_index` gives them, and Qwen3-VL's DeepStack features added in its first layers) are
compared.
transformers runs the PyTorch model (the `reference` extra: torch and transformers, on the CPU,
float32); maestro loads the folder with the same mappings `init.hf_path` uses (`models.hf`,
`models.hf_encoders`). The result is the largest absolute difference and that difference
relative to the largest reference value; within `tolerance` (relative) the check passes.
"""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from maestro_jax.hf_config import MULTI_MODEL, HFError, audio_fields, kind_of, llm_fields, read_config, vit_fields

DEFAULT_TOLERANCE = 1e-4  # float32 on both sides: rounding of different summation orders


@dataclasses.dataclass(frozen=True)
class CheckResult:
    model_type: str
    inputs: str  # what went through both, e.g. "3 rows of [24, 19, 13] tokens"
    compared: str  # what was compared: logits, features
    max_abs: float
    max_rel: float
    tolerance: float

    @property
    def passed(self) -> bool:
        return self.max_rel <= self.tolerance


def _lengths(fields: dict) -> tuple[int, ...]:
    """Three rows, the longest past the sliding window (when there is one), all different."""
    longest = max(24, 2 * (fields.get("sliding_window") or 0) + 3)
    return (longest, longest - 5, longest // 2 + 1)


def check_llm(path: str | Path, tolerance: float = DEFAULT_TOLERANCE, seed: int = 0) -> CheckResult:
    """The logits of the LLM folder at `path` through transformers and through maestro."""
    from maestro_jax.models import DecoderLM, LLMConfig, hf

    path = Path(path)
    fields = llm_fields(path)
    lengths = _lengths(fields)
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, fields["vocab"], size=(len(lengths), lengths[0]))
    valid = np.arange(lengths[0])[None] < np.array(lengths)[:, None]
    ids = np.where(valid, ids, 0)
    reference = _transformers_logits(path, ids, valid)
    model = DecoderLM(LLMConfig.from_fields(fields))
    pos = jnp.broadcast_to(jnp.arange(lengths[0]), ids.shape)
    args = (jnp.asarray(ids, jnp.int32), pos, jnp.asarray(valid))
    abstract = jax.eval_shape(lambda: model.init(jax.random.key(0), *args)["params"])
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=one),
        jax.tree.map(lambda a: a.value if hasattr(a, "value") else a, abstract, is_leaf=lambda x: hasattr(x, "value")),
    )
    params = hf.load_llm(path, target, fields)
    ours = np.asarray(model.apply({"params": params}, *args))
    inputs = f"{len(lengths)} rows of {list(lengths)} tokens"
    return _result(path, inputs, "logits", ours[valid], reference[valid], tolerance)


def _result(path: Path, inputs: str, compared: str, ours: np.ndarray, reference: np.ndarray, tolerance: float):
    diff = float(np.abs(ours - reference).max())
    return CheckResult(
        model_type=str(read_config(path)["model_type"]),
        inputs=inputs,
        compared=compared,
        max_abs=diff,
        max_rel=diff / float(np.abs(reference).max()),
        tolerance=tolerance,
    )


def check_folder(path: str | Path, tolerance: float = DEFAULT_TOLERANCE, seed: int = 0) -> list[CheckResult]:
    """The folder at `path` checked by its kind: a decoder's logits, a tower's features; a whole
    Gemma 3, PaliGemma, Qwen2.5-VL, Qwen3-VL, SmolVLM or Idefics3 VLM's image tokens and logits, a Qwen2-Audio folder's text
    logits, audio tokens and logits. A folder whose weights are
    missing, cut short, unreadable or short of a tensor the model reads is an `HFError` naming the
    file, before anything runs."""
    from maestro_jax.models.hf import weight_files

    model_type = read_config(path).get("model_type")
    whole = {
        "gemma3": check_gemma3_vlm,
        "qwen2_audio": check_qwen2_audio,
        "paligemma": check_paligemma,
        **dict.fromkeys(QWEN_VL_MODELS, check_qwen_vl),
        **dict.fromkeys(SPLIT_IMAGE_MODELS, check_split_image_vlm),
    }.get(model_type)
    kinds = MULTI_MODEL[model_type] if whole else ("llm",) if model_type in LANGUAGE_MODEL_IN else (kind_of(path),)
    check = whole or {"llm": check_llm, "vit": check_vision, "audio": check_audio}[kinds[0]]
    weight_files(path)  # the model type first: a folder of an unsupported one is named as such
    _require_tensors(path, kinds)
    return check(path, tolerance, seed) if whole else [check(path, tolerance, seed)]


def _require_tensors(path: str | Path, kinds: tuple[str, ...]) -> None:
    """Every tensor the folder's models of `kinds` read is in its safetensors headers (no tensor is
    loaded): a folder short of one is named before transformers or maestro builds anything."""
    from maestro_jax.models import hf, hf_encoders

    fields_of = {"llm": llm_fields, "vit": vit_fields, "audio": audio_fields}
    for kind in kinds:
        hf.require_tensors(path, hf_encoders.tensors_read(kind, path, fields_of[kind](path)))


def _spliced_logits(path: Path, lfields: dict, row: np.ndarray, at: np.ndarray, tokens, blocks=None) -> np.ndarray:
    """The folder's language model on one row of ids, `tokens` (an encoder's) in place of the
    embeddings at positions `at`, with `blocks` (`DecoderLM.body`'s images_BL) where given: its logits."""
    from maestro_jax.models import DecoderLM, LLMConfig, hf

    ids, pos, valid = jnp.asarray(row[None], jnp.int32), jnp.arange(len(row))[None], jnp.ones((1, len(row)), bool)
    decoder = DecoderLM(LLMConfig.from_fields(lfields))
    v = {"params": hf.load_llm(path, _placed(decoder, (ids, pos, valid)), lfields)}
    x = decoder.apply(v, ids, method=DecoderLM.embed).at[0, at].set(tokens)
    images = None if blocks is None else jnp.asarray(blocks)
    h = decoder.apply(v, x, pos, valid, None, images, method=DecoderLM.hidden)
    return np.asarray(decoder.apply(v, h, method=DecoderLM.logits))


def _tower_on_two_images(path: Path, vfields: dict, seed: int) -> tuple:
    """Two random images of the tower's size packed in one row through the folder's tower and
    projector: (pixels, image tokens, each patch's (image, cell) as `packed_images` gives them,
    the side in pixels, the generator the checks draw their text from next)."""
    from maestro_jax.models import VisionEncoder, ViTConfig, hf_encoders

    vcfg = ViTConfig(**{k: v for k, v in vfields.items() if k != "kind"})
    size, rng = vcfg.max_grid * vcfg.patch, np.random.default_rng(seed)
    pixels = rng.standard_normal((2, vcfg.channels, size, size)).astype(np.float32)
    inputs, where = packed_images(pixels, vcfg)
    tower = VisionEncoder(vcfg)
    features = tower.apply({"params": hf_encoders.load_vit(path, _placed(tower, inputs), vfields)}, *inputs)[0]
    return pixels, features, where, size, rng


def _row_with_two_images(rng, lfields: dict, image_token: int, per_image: int) -> np.ndarray:
    """A row of random text (no image token) holding two images' `per_image` tokens apart."""
    text = [t for t in range(lfields["vocab"]) if t != image_token]
    pieces = [rng.choice(text, n) for n in (_lengths(lfields)[-1], 3, 5)]
    return np.concatenate([pieces[0], [image_token] * per_image, pieces[1], [image_token] * per_image, pieces[2]])


def check_gemma3_vlm(path: str | Path, tolerance: float = DEFAULT_TOLERANCE, seed: int = 0) -> list[CheckResult]:
    """A Gemma 3 VLM folder: two random images of its size through the tower and the projector
    (transformers' `get_image_features`), then one row of random text holding both images'
    tokens (each image its own block, attending to itself) through the whole model; the image
    tokens and the logits compared."""
    from maestro_jax.models.llm import image_blocks

    path = Path(path)
    config, vfields, lfields = read_config(path), vit_fields(path), llm_fields(path)
    pixels, features, _, size, rng = _tower_on_two_images(path, vfields, seed)
    image_token, per_image = config.get("image_token_index", 262144), len(features) // 2
    row = _row_with_two_images(rng, lfields, image_token, per_image)
    is_image = row[None] == image_token
    logits = _spliced_logits(path, lfields, row, np.flatnonzero(is_image[0]), features, image_blocks(is_image))
    torch, transformers = _reference_modules()
    model = transformers.Gemma3ForConditionalGeneration.from_pretrained(path, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        want_features = model.get_image_features(torch.tensor(pixels)).pooler_output.float().numpy()
        tokens = torch.tensor(row[None].astype(np.int64))
        types = torch.tensor(is_image.astype(np.int64))
        want_logits = model(input_ids=tokens, pixel_values=torch.tensor(pixels), token_type_ids=types).logits.float()
    images = f"2 images of {size}x{size}"
    return [
        _result(path, images, "image tokens", np.asarray(features), want_features.reshape(features.shape), tolerance),
        _result(path, f"{images} in a row of {len(row)} tokens", "logits", logits, want_logits.numpy(), tolerance),
    ]


def check_paligemma(path: str | Path, tolerance: float = DEFAULT_TOLERANCE, seed: int = 0) -> list[CheckResult]:
    """A PaliGemma 2 folder: two random images of its size through the tower and the linear
    projector (transformers' `get_image_features`), then one row through the whole model: the
    first image's tokens and a random prompt (the prefix, `token_type_ids` 0: attending
    bidirectionally, `workloads.vlm.with_prefix_blocks` on our side) and a random answer (the
    suffix, 1: causal); the image tokens and the logits compared."""
    from maestro_jax.workloads.vlm import with_prefix_blocks

    path = Path(path)
    config, vfields, lfields = read_config(path), vit_fields(path), llm_fields(path)
    pixels, features, (image, cell), size, rng = _tower_on_two_images(path, vfields, seed)
    image_token, per_image = config.get("image_token_index", PALIGEMMA_IMAGE_TOKEN), len(features) // 2
    text = [t for t in range(lfields["vocab"]) if t != image_token]
    prompt, answer = rng.choice(text, 5), rng.choice(text, _lengths(lfields)[-1])
    row = np.concatenate([[image_token] * per_image, prompt, answer])
    prefix = per_image + len(prompt)
    loss = (np.arange(len(row)) >= prefix - 1)[None].astype(np.float32)  # the answer's targets
    blocks = with_prefix_blocks({"loss_mask": loss, "valid": np.ones((1, len(row)), bool)})["images"]
    first = np.asarray(features)[:per_image][np.argsort(cell[:per_image])]  # the first image's, in its grid's order
    logits = _spliced_logits(path, lfields, row, np.arange(per_image), first, blocks)
    torch, transformers = _reference_modules()
    model = transformers.PaliGemmaForConditionalGeneration.from_pretrained(path, torch_dtype=torch.float32).eval()
    types = torch.tensor((np.arange(len(row)) >= prefix)[None].astype(np.int64))
    with torch.no_grad():
        want_features = model.get_image_features(torch.tensor(pixels)).pooler_output.float().numpy()
        tokens = torch.tensor(row[None].astype(np.int64))
        want_logits = model(input_ids=tokens, pixel_values=torch.tensor(pixels[:1]), token_type_ids=types).logits
    images = f"2 images of {size}x{size}"
    prefixed = f"the first in a row of {len(row)} tokens, its prefix {prefix}"
    return [
        _result(path, images, "image tokens", np.asarray(features), want_features[image, cell], tolerance),
        _result(path, prefixed, "logits", logits, want_logits.float().numpy(), tolerance),
    ]


PALIGEMMA_IMAGE_TOKEN = 257152  # PaliGemmaConfig's default image_token_index

# the SmolVLM / Idefics3 folders check-hf runs whole, by model_type: transformers' class of each
SPLIT_IMAGE_MODELS = {
    "smolvlm": "SmolVLMForConditionalGeneration",
    "idefics3": "Idefics3ForConditionalGeneration",
}
IDEFICS3_IMAGE_TOKEN = 128257  # Idefics3Config's and SmolVLMConfig's default image_token_id


def check_split_image_vlm(path: str | Path, tolerance: float = DEFAULT_TOLERANCE, seed: int = 0) -> list[CheckResult]:
    """A SmolVLM or Idefics3 folder: two random whole tiles through the tower and the pixel-shuffle
    connector (transformers' `get_image_features`: a token per scale x scale window, the windows
    row by row), then one row of random text holding both tiles' tokens through the whole model
    (causal: these models give image tokens no mask of their own); the image tokens and the logits
    compared."""
    path = Path(path)
    config, vfields, lfields = read_config(path), vit_fields(path), llm_fields(path)
    pixels, features, _, size, rng = _tower_on_two_images(path, vfields, seed)
    image_token, per_image = config.get("image_token_id", IDEFICS3_IMAGE_TOKEN), len(features) // 2
    row = _row_with_two_images(rng, lfields, image_token, per_image)
    logits = _spliced_logits(path, lfields, row, np.flatnonzero(row == image_token), features)
    torch, transformers = _reference_modules()
    cls = getattr(transformers, SPLIT_IMAGE_MODELS[config["model_type"]])
    model = cls.from_pretrained(path, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        want_features = torch.cat(model.get_image_features(torch.tensor(pixels[None])).pooler_output).numpy()
        tokens = torch.tensor(row[None].astype(np.int64))
        want_logits = model(input_ids=tokens, pixel_values=torch.tensor(pixels[None])).logits.float().numpy()
    tiles = f"2 tiles of {size}x{size}"
    return [
        _result(path, tiles, "image tokens", np.asarray(features), want_features.reshape(features.shape), tolerance),
        _result(path, f"{tiles} in a row of {len(row)} tokens", "logits", logits, want_logits, tolerance),
    ]


# the Qwen-VL folders check-hf runs whole, by model_type: transformers' class of each
QWEN_VL_MODELS = {
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    "qwen3_vl": "Qwen3VLForConditionalGeneration",
}


def check_qwen_vl(path: str | Path, tolerance: float = DEFAULT_TOLERANCE, seed: int = 0) -> list[CheckResult]:
    """A Qwen2.5-VL or Qwen3-VL folder: three random images through the tower and the patch merger
    (transformers' `visual(pixel_values, grid_thw)`: its merged tokens, and Qwen3-VL's DeepStack
    features after each token's own), of (w+1)x(2w+1), 2x(w+1) and (w+2)x1 merged tokens for
    attention windows of w tokens a side (w = 1 without windows), so windows are cut at the
    images' edges; then two rows of random text of different lengths (right-padded, the padding
    masked on both sides and left out of the comparison), the first holding two images, the second
    the third, each image's placeholders between the vision start and end tokens (where the
    vocabulary holds them), and the second a clip of two temporal patches after its image (Qwen3-VL:
    a text token as its timestamp before each patch's markers, as its processor writes them), through
    the whole model with each row's M-RoPE positions (`models.llm.mrope_positions`, transformers'
    `get_rope_index`; the clip at 1 s a temporal patch) and Qwen3-VL's DeepStack features at the
    image and video positions; the image tokens, the clip's video tokens (the tower on each temporal
    patch, transformers' `visual(pixel_values_videos, video_grid_thw)`) and the logits compared."""
    from maestro_jax.models import ViTConfig

    path = Path(path)
    config, vfields, lfields = read_config(path), vit_fields(path), llm_fields(path)
    vcfg = ViTConfig(**{k: v for k, v in vfields.items() if k != "kind"})
    case = _qwen_vl_case(config, vcfg, lfields, np.random.default_rng(seed))
    features, clip_features, logits = _qwen_vl_ours(path, case, vcfg, vfields, lfields)
    want_features, want_clip, want_logits = _qwen_vl_reference(path, config, case, vcfg)
    side, (_, r, c) = vcfg.patch * vcfg.merge, case.clip_grid
    sizes = ", ".join(f"{r * side}x{c * side}" for r, c in case.grids)
    clip_size = f"a clip of {len(case.clip)} frames of {r * side}x{c * side}"
    valid = case.valid
    return [
        _result(path, f"3 images of {sizes}", "image tokens", features, want_features, tolerance),
        _result(path, clip_size, "video tokens", clip_features, want_clip, tolerance),
        _result(
            path,
            f"3 images{' and a clip' if case.video else ''} in 2 rows of {case.lengths} tokens",
            "logits",
            logits[valid],
            want_logits[valid],
            tolerance,
        ),
    ]


@dataclasses.dataclass(frozen=True)
class _QwenVLCase:
    """What `check_qwen_vl` feeds both sides: the images (channels x height x width) and their
    merged-token grids, the clip (frames x channels x height x width) and its grid (temporal
    patches, rows, columns), and the two rows: ids, M-RoPE positions, what is valid, image and
    video placeholders, whether a clip is in them (`video`) and their lengths."""

    images: list
    grids: list
    clip: np.ndarray
    clip_grid: tuple
    ids: np.ndarray
    positions: np.ndarray
    valid: np.ndarray
    is_image: np.ndarray
    is_video: np.ndarray
    video: bool
    lengths: list


def _qwen_vl_case(config: dict, vcfg, lfields: dict, rng) -> _QwenVLCase:
    """`check_qwen_vl`'s images, clip and rows (its docstring), drawn from `rng`."""
    from maestro_jax.models.llm import frame_by_frame, mrope_positions

    w = max(1, vcfg.window // vcfg.merge)  # the attention window, in merged tokens a side
    grids = [(w + 1, 2 * w + 1), (2, w + 1), (w + 2, 1)]  # merged tokens, rows x columns
    side = vcfg.patch * vcfg.merge
    images = [rng.standard_normal((vcfg.channels, r * side, c * side)).astype(np.float32) for r, c in grids]
    clip_grid = (2, w + 1, 2)  # temporal patches, merged rows x columns
    clip = rng.standard_normal((clip_grid[0] * vcfg.frames, vcfg.channels, clip_grid[1] * side, clip_grid[2] * side))
    image_token, vocab = config.get("image_token_id", 151655), lfields["vocab"]
    video_token = config.get("video_token_id", 151656)
    ids_around = [config.get(k, d) for k, d in (("vision_start_token_id", 151652), ("vision_end_token_id", 151653))]
    # transformers' defaults, out of a small exported model's vocabulary: then text tokens hold the images
    start, end = ([t] if t < vocab else [] for t in ids_around)
    text = np.array([t for t in range(vocab) if t not in {image_token, *ids_around, video_token}])

    def image(k):
        return [*start, *[image_token] * (grids[k][0] * grids[k][1]), *end]

    t, r, c = clip_grid
    if video_token >= vocab:  # a folder whose clips' id its vocabulary lacks: transformers embeds no clip
        video, clips = [], []
    elif lfields.get("video_timestamps"):  # Qwen3-VL: each temporal patch after its timestamp, positioned alone
        video = [x for _ in range(t) for x in (*rng.choice(text, 1), *start, *[video_token] * (r * c), *end)]
        clips = frame_by_frame([clip_grid])
    else:
        video, clips = [*start, *[video_token] * (t * r * c), *end], [(*clip_grid, lfields["video_tokens_per_second"])]
    rows = [
        np.concatenate([rng.choice(text, 9), image(0), rng.choice(text, 3), image(1), rng.choice(text, 5)]),
        np.concatenate([rng.choice(text, 4), image(2), rng.choice(text, 2), video, rng.choice(text, 3)]),
    ]
    lengths = [len(r) for r in rows]
    ids = np.zeros((len(rows), max(lengths)), np.int64)
    positions = np.zeros((*ids.shape, 4), np.int32)
    for i, (row, row_grids, row_clips) in enumerate(zip(rows, (grids[:2], grids[2:]), ([], clips))):
        ids[i, : len(row)] = row
        positions[i, : len(row)] = mrope_positions(row, image_token, row_grids, video_token, row_clips)
    valid = np.arange(ids.shape[1])[None] < np.array(lengths)[:, None]
    return _QwenVLCase(
        images,
        grids,
        clip.astype(np.float32),
        clip_grid,
        ids,
        positions,
        valid,
        ids == image_token,
        ids == video_token,
        bool(video),
        lengths,
    )


def _qwen_vl_ours(path: Path, case: _QwenVLCase, vcfg, vfields: dict, lfields: dict) -> tuple:
    """The folder loaded here: the tower's image and clip tokens, and the whole model's logits on
    the case's rows (the tokens spliced in at their placeholders, Qwen3-VL's DeepStack sets at the
    image and video positions)."""
    from maestro_jax.models import DecoderLM, LLMConfig, VisionEncoder, hf, hf_encoders

    inputs, _ = packed_images(case.images, vcfg)
    tower = VisionEncoder(vcfg)
    tower_params = hf_encoders.load_vit(path, _placed(tower, inputs), vfields)
    features = np.asarray(tower.apply({"params": tower_params}, *inputs)[0])
    clip_features = np.asarray(tower.apply({"params": tower_params}, *packed_clip(case.clip, vcfg))[0])
    decoder = DecoderLM(LLMConfig.from_fields(lfields))
    args = (jnp.asarray(case.ids, jnp.int32), jnp.asarray(case.positions), jnp.asarray(case.valid))
    v = {"params": hf.load_llm(path, _placed(decoder, args), lfields)}
    width, sets = lfields["width"], lfields["deepstack_layers"]
    is_image, is_video = np.nonzero(case.is_image), np.nonzero(case.is_video)
    x = decoder.apply(v, args[0], method=DecoderLM.embed)
    x = x.at[is_image].set(features[:, :width]).at[is_video].set(clip_features[:, :width])
    deepstack = None
    if sets:  # DeepStack's feature sets at the image and video positions, zero elsewhere
        deepstack = jnp.zeros((sets, *x.shape), x.dtype)
        for where, tokens in ((is_image, features), (is_video, clip_features)):
            own = tokens[:, width:].reshape(len(tokens), sets, width).transpose(1, 0, 2)
            deepstack = deepstack.at[(slice(None), *where)].set(own)
    h = decoder.apply(v, x, *args[1:], None, None, deepstack, method=DecoderLM.hidden)
    return features, clip_features, np.asarray(decoder.apply(v, h, method=DecoderLM.logits))


def _qwen_vl_reference(path: Path, config: dict, case: _QwenVLCase, vcfg) -> tuple:
    """transformers' model of the folder on the same case: `visual` on the images and on the clip,
    and the logits of the rows (positions from its own `get_rope_index`)."""
    torch, transformers = _reference_modules()
    reference = getattr(transformers, QWEN_VL_MODELS[config["model_type"]])
    model = reference.from_pretrained(path, torch_dtype=torch.float32).eval()
    temporal = (config.get("vision_config") or {}).get("temporal_patch_size", 2)
    pixels = torch.tensor(
        np.concatenate([qwen_pixel_values(im, vcfg.patch, vcfg.merge, temporal) for im in case.images])
    )
    grid_thw = torch.tensor([[1, r * vcfg.merge, c * vcfg.merge] for r, c in case.grids])
    t, r, c = case.clip_grid
    video_pixels = torch.tensor(qwen_video_pixel_values(case.clip, vcfg.patch, vcfg.merge, temporal))
    video_thw = torch.tensor([[t, r * vcfg.merge, c * vcfg.merge]])
    kwargs = {"input_ids": torch.tensor(case.ids), "attention_mask": torch.tensor(case.valid.astype(np.int64))}
    kwargs |= {"pixel_values": pixels, "image_grid_thw": grid_thw}
    if case.video:
        kwargs |= {"pixel_values_videos": video_pixels, "video_grid_thw": video_thw}
    forward = inspect.signature(model.forward).parameters
    if case.video and "second_per_grid_ts" in forward:  # Qwen2.5-VL's clip at 1 s a temporal patch
        kwargs["second_per_grid_ts"] = torch.tensor([1.0])
    if "mm_token_type_ids" in forward:  # transformers 5 places images and clips by it
        types = case.is_image.astype(np.int64) + 2 * case.is_video.astype(np.int64)
        kwargs["mm_token_type_ids"] = torch.tensor(types)
    with torch.no_grad():
        visual = model.model.visual if hasattr(model.model, "visual") else model.visual  # newer ones nest it
        want_features, want_clip = (
            _merged(visual(p, grid_thw=g)) for p, g in ((pixels, grid_thw), (video_pixels, video_thw))
        )
        want_logits = model(**kwargs).logits.float().numpy()
    return want_features, want_clip, want_logits


def _merged(out) -> np.ndarray:
    """A Qwen-VL `visual`'s merged tokens, with Qwen3-VL's DeepStack features after each token's own
    (transformers 4 returns the tensor itself)."""
    import torch

    merged = [getattr(out, "pooler_output", out), *(getattr(out, "deepstack_features", None) or [])]
    return torch.cat(merged, dim=-1).float().numpy()


def packed_clip(clip: np.ndarray, cfg) -> tuple:
    """A clip (T x C x H x W) as the VLM's tower takes it (`workloads.vlm.segments_of`): each
    temporal patch of `cfg.frames` frames a segment, its patches' features the frames' in order."""
    from maestro_jax.workloads.vlm import patchify

    cuts = [
        patchify(clip[k : k + cfg.frames].transpose(0, 2, 3, 1), cfg.patch, cfg.merge, cfg.frames)
        for k in range(0, len(clip), cfg.frames)
    ]
    patches = np.concatenate([p for p, _ in cuts])
    segments = np.concatenate([np.full(len(p), i + 1, np.int32) for i, (p, _) in enumerate(cuts)])
    grid = np.concatenate([g for _, g in cuts])
    return tuple(jnp.asarray(x)[None] for x in (patches, segments, grid))


def qwen_pixel_values(image: np.ndarray, patch: int, merge: int, temporal: int) -> np.ndarray:
    """An image C x H x W as Qwen2-VL's image processor lays it out for the tower: the still image
    repeated `temporal` times in time, one row per patch in merge-window order, each row
    C x temporal x patch x patch."""
    return qwen_video_pixel_values(np.broadcast_to(image[None], (temporal, *image.shape)), patch, merge, temporal)


def qwen_video_pixel_values(clip: np.ndarray, patch: int, merge: int, temporal: int) -> np.ndarray:
    """A clip T x C x H x W as Qwen2-VL's video processor lays it out (video_processing_qwen2_vl.py,
    its view and permute): one row per patch, temporal patch by temporal patch, each in
    merge-window order, each row C x temporal x patch x patch."""
    t, c, h, w = clip.shape
    gh, gw = h // patch, w // patch
    cut = clip.reshape(t // temporal, temporal, c, gh // merge, merge, patch, gw // merge, merge, patch)
    return cut.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8).reshape(t // temporal * gh * gw, c * temporal * patch * patch)


def _placed(model, inputs):
    """The model's initialised params on the first device (what the loaders take as target)."""
    import flax.linen as nn

    params = nn.unbox(jax.eval_shape(lambda: model.init(jax.random.key(0), *inputs))["params"])
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=one), params)


def check_vision(path: str | Path, tolerance: float = DEFAULT_TOLERANCE, seed: int = 0) -> CheckResult:
    """The features of the vision tower at `path` (SigLIP, CLIP, a LLaVA folder's CLIP) on two
    random images of its size."""
    from maestro_jax.models import VisionEncoder, ViTConfig, hf_encoders
    from maestro_jax.workloads.vlm import class_segments

    path = Path(path)
    fields = vit_fields(path)
    cfg = ViTConfig(**{"out_width": fields["width"], **{k: v for k, v in fields.items() if k != "kind"}})
    size = cfg.max_grid * cfg.patch
    pixels = np.random.default_rng(seed).standard_normal((2, cfg.channels, size, size)).astype(np.float32)
    inputs, (segment, cell) = packed_images(pixels, cfg)
    if cfg.class_token:
        inputs = (*inputs, jnp.asarray(class_segments(np.asarray(inputs[1]))))
    model = VisionEncoder(cfg)
    params = hf_encoders.load_vit(path, _placed(model, inputs), fields)
    hidden, post = model.apply({"params": params}, *inputs, method=VisionEncoder.features)
    tower = _transformers_tower(path)
    torch = _reference_modules()[0]
    with torch.no_grad():
        out = tower(pixel_values=torch.tensor(pixels), output_hidden_states=True)
    if cfg.class_token:  # the selected layer, class token dropped: what LLaVA hands its projector
        reference, ours = out.hidden_states[cfg.feature_layer][:, 1:].float().numpy(), np.asarray(hidden[0])
    else:
        reference, ours = out.last_hidden_state.float().numpy(), np.asarray(post[0])
    return _result(path, f"2 images of {size}x{size}", "features", ours, reference[segment, cell], tolerance)


def packed_images(pixels: np.ndarray, cfg) -> tuple[tuple, tuple[np.ndarray, np.ndarray]]:
    """Images (C x H x W each, of one size or several) packed into one row as the VLM packs them (`workloads.vlm.patchify`:
    each merge window contiguous, image i+1 its segment): the tower's (patches, segments, grid),
    and for each patch its image and its cell in a row-major tower output (transformers')."""
    from maestro_jax.workloads.vlm import patchify

    patches, grids, segments = [], [], []
    for i, image in enumerate(pixels):
        p, g = patchify(image.transpose(1, 2, 0), cfg.patch, cfg.merge, cfg.frames)
        patches.append(p)
        grids.append(g)
        segments.append(np.full(len(p), i + 1, np.int32))
    grid, segment = np.concatenate(grids), np.concatenate(segments)
    inputs = tuple(jnp.asarray(x)[None] for x in (np.concatenate(patches), segment, grid))
    return inputs, (segment - 1, grid[:, 0] * cfg.max_grid + grid[:, 1])


def packed_clips(clips: np.ndarray, cfg) -> tuple:
    """Clips ([mel, frames] each, as Whisper takes them) packed into one row of the encoder's
    tokens: (frames, segments, positions), a batch of one."""
    from maestro_jax.workloads.omni import frame_groups

    tokens, positions, segments = [], [], []
    for i, clip in enumerate(clips):
        t, p = frame_groups(clip.T, cfg.frames_per_token, cfg.pool)
        tokens.append(t)
        positions.append(p)
        segments.append(np.full(len(t), i + 1, np.int32))
    return tuple(jnp.asarray(np.concatenate(x))[None] for x in (tokens, segments, positions))


def check_audio(path: str | Path, tolerance: float = DEFAULT_TOLERANCE, seed: int = 0) -> CheckResult:
    """The encoder output of the Whisper folder at `path` on two random clips of its length."""
    from maestro_jax.models import AudioConfig, AudioEncoder, hf_encoders

    path = Path(path)
    fields = audio_fields(path)
    cfg = AudioConfig(**{k: v for k, v in fields.items() if k != "kind"}, out_width=fields["width"])
    frames = 2 * cfg.max_tokens
    features = np.random.default_rng(seed).standard_normal((2, cfg.mel, frames)).astype(np.float32)
    inputs = packed_clips(features, cfg)
    model = AudioEncoder(cfg)
    params = hf_encoders.load_audio(path, _placed(model, inputs), fields)
    ours = np.asarray(model.apply({"params": params}, *inputs, method=AudioEncoder.features)[0])
    torch, transformers = _reference_modules()
    encoder = transformers.WhisperModel.from_pretrained(path, torch_dtype=torch.float32).eval().encoder
    with torch.no_grad():
        reference = encoder(torch.tensor(features)).last_hidden_state.float().numpy()
    return _result(path, f"2 clips of {frames} frames", "features", ours, reference.reshape(ours.shape), tolerance)


def _transformers_tower(path: Path):
    """The vision tower of the folder, as transformers builds it (a whole model's tower)."""
    torch, transformers = _reference_modules()
    config = read_config(path)
    model_type = config["model_type"]
    if model_type == "llava":  # its CLIP tower alone, from the tower's tensors (no language model built)
        from safetensors.torch import load_file

        from maestro_jax.models.hf import weight_files
        from maestro_jax.models.hf_encoders import CLIP_PREFIXES

        tower = transformers.CLIPVisionModel(transformers.CLIPVisionConfig(**config["vision_config"]))
        tensors = {k: v for f in weight_files(path) for k, v in load_file(f).items()}
        prefix = next(p for p in CLIP_PREFIXES if f"{p}embeddings.patch_embedding.weight" in tensors)
        # transformers 4 nests the tower under `vision_model.`, 5 holds it at the top
        inner = "vision_model." if any(k.startswith("vision_model.") for k in tower.state_dict()) else ""
        own = {inner + k.removeprefix(prefix): v.float() for k, v in tensors.items() if k.startswith(prefix)}
        missing = tower.load_state_dict(own, strict=False).missing_keys
        if missing:  # a LLaVA folder may drop the layers past its feature layer: those never run
            held = [k for k in missing if ".layers." not in k]
            if held:
                raise HFError(f"{path}: the vision tower's {held[0]} is missing from the checkpoint")
        return tower.eval()
    cls = transformers.SiglipVisionModel if model_type.startswith("siglip") else transformers.CLIPVisionModel
    return cls.from_pretrained(path, torch_dtype=torch.float32).eval()


def _reference_modules():
    try:
        import torch
        import transformers
    except ImportError as err:
        raise HFError(
            f"check-hf runs the folder through transformers too, and {err.name} is not installed; install the "
            f"reference extra: pip install 'maestro-jax[reference]'"
        ) from None
    return torch, transformers


# Whole multimodal folders whose language model check-hf also compares on text alone, by the
# transformers class that holds it
LANGUAGE_MODEL_IN = {
    "qwen2_audio": "Qwen2AudioForConditionalGeneration",
    # its tower does not load yet (any-resolution tiles): check-hf compares the language model alone
    "llava_onevision": "LlavaOnevisionForConditionalGeneration",
}
QWEN2_AUDIO_TOKEN = 151646  # Qwen2AudioConfig's default audio_token_index


def check_qwen2_audio(path: str | Path, tolerance: float = DEFAULT_TOLERANCE, seed: int = 0) -> list[CheckResult]:
    """A Qwen2-Audio folder: its language model on rows of text (`check_llm`); two random clips of
    its length (2 x max_source_positions frames: 30 s for the Hub's, which its processor pads every
    clip to) through the encoder, pooled in pairs, and the projector (transformers' `audio_tower`
    and `multi_modal_projector`); then one row of random text holding both clips' tokens (one
    audio token per pooled token, as its processor expands them) through the whole model. The
    text logits, the audio tokens and the row's logits compared, a line each."""
    from maestro_jax.models import AudioConfig, AudioEncoder, hf_encoders

    path = Path(path)
    config, afields, lfields = read_config(path), audio_fields(path), llm_fields(path)
    acfg = AudioConfig(**{k: v for k, v in afields.items() if k != "kind"})
    rng = np.random.default_rng(seed)
    frames = 2 * acfg.max_tokens
    clips = rng.standard_normal((2, acfg.mel, frames)).astype(np.float32)
    inputs = packed_clips(clips, acfg)
    encoder = AudioEncoder(acfg)
    features = encoder.apply({"params": hf_encoders.load_audio(path, _placed(encoder, inputs), afields)}, *inputs)[0]
    audio_token, per_clip = config.get("audio_token_index", QWEN2_AUDIO_TOKEN), len(features) // 2
    text = [t for t in range(lfields["vocab"]) if t != audio_token]
    pieces = [rng.choice(text, n) for n in (_lengths(lfields)[-1], 3, 5)]
    row = np.concatenate([pieces[0], [audio_token] * per_clip, pieces[1], [audio_token] * per_clip, pieces[2]])
    logits = _spliced_logits(path, lfields, row, np.flatnonzero(row == audio_token), features)
    torch, transformers = _reference_modules()
    model = transformers.Qwen2AudioForConditionalGeneration.from_pretrained(path, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        want_features = model.model.multi_modal_projector(
            model.model.audio_tower(torch.tensor(clips)).last_hidden_state
        )
        want_logits = model(
            input_ids=torch.tensor(row[None].astype(np.int64)),
            input_features=torch.tensor(clips),
            feature_attention_mask=torch.ones((2, frames), dtype=torch.int64),
        ).logits.float()
    audio = f"2 clips of {frames} frames"
    return [
        check_llm(path, tolerance, seed),
        _result(
            path,
            audio,
            "audio tokens",
            np.asarray(features),
            want_features.float().numpy().reshape(features.shape),
            tolerance,
        ),
        _result(path, f"{audio} in a row of {len(row)} tokens", "logits", logits, want_logits.numpy(), tolerance),
    ]


def _transformers_logits(path: Path, ids: np.ndarray, valid: np.ndarray) -> np.ndarray:
    torch, transformers = _reference_modules()
    whole = LANGUAGE_MODEL_IN.get(read_config(path).get("model_type"))
    cls = getattr(transformers, whole) if whole else transformers.AutoModelForCausalLM
    model = cls.from_pretrained(path, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        out = model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(valid.astype(np.int64)))
    return out.logits.float().numpy()
