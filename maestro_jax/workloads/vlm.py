"""VLM: `vision` (ViT + merger) -> `llm` (decoder, holds the loss).

Image embeddings replace the image-placeholder token embeddings of the LLM input (the id
`workload_settings.image_token`, default 1; a pretrained LLM's tokenizer sets its own `<image>`
id). With `workload_settings.video_token` (a Qwen-VL folder's `video_token_id` sets it) samples
may hold video clips too, frames x height x width x channels: the tower runs each temporal patch
(`models.vision.frames` frames, the Conv3d kernel's depth) as a segment of its own, as
transformers' Qwen-VL towers do, and its tokens replace the video placeholders; the edge carries
a sample's image tokens, then its video tokens. Samples without images or clips never enter the
vision section. The LLM can start from a Hugging Face folder.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import optax
from pydantic import PositiveInt

from maestro_jax.config import Config, ConfigError, Settings
from maestro_jax.core.buckets import PER_OCTAVE, bucket
from maestro_jax.core.graph import Edge, Section, SectionGraph, UnitCost
from maestro_jax.data.samples import IMAGE_TOKEN, TOKENS, Modality
from maestro_jax.data.video import SECONDS_PER_PATCH
from maestro_jax.models import DecoderLM, LLMConfig, VisionEncoder, ViTConfig, apply_with_losses
from maestro_jax.models.llm import frame_by_frame, image_blocks, mrope_positions
from maestro_jax.schedule.packing import Pack
from maestro_jax.workloads import Workload, model, settings
from maestro_jax.workloads import rows as R
from maestro_jax.workloads.costs import llm_cost, vit_cost
from maestro_jax.workloads.pretrained import load_llm_section, load_vision_section
from maestro_jax.workloads.staged import decoder_stages

EDGE = "image_embeds"  # the tower's tokens: a sample's image tokens, then its video tokens
VISUAL = ("image", "video")  # the modalities the tower reads (and a DeepStack LLM adds its sets to)


class VLMSettings(Settings):
    """`workload_settings:` of the workloads with images (vlm, vlm_kd; omni adds audio). A model
    read from a VLM checkpoint folder (`models.<s>: {hf: PATH}`: Gemma 3's, LLaVA's, Qwen2.5-VL's)
    fills in `image_token` from its config.json (`checkpoint_fields`); a value written beside it
    must agree."""

    checkpoint_fields: ClassVar[dict[str, str | tuple[str, ...]]] = {
        "image_token": ("image_token_index", "image_token_id"),
        "video_token": "video_token_id",
    }
    image_token: PositiveInt = IMAGE_TOKEN  # the LLM input id of an image token: the tokenizer's `<image>` id
    # the LLM input id of a video token (Qwen-VL's `<|video_pad|>`); None: the workload takes no video
    video_token: PositiveInt | None = None
    video_max_frames: PositiveInt = 768  # the most frames a clip may hold (the Qwen-VL processors' max_frames)


def image_modality(cfg: Config) -> Modality:
    """Images as the config's ViT (`models.vision`) takes them, on the configured placeholder id."""
    vit = model(cfg, "vision", "vit")
    unit = vit.patch * vit.merge
    return Modality("image", settings(cfg).image_token, (unit, unit), vit.channels, (vit.max_grid * vit.patch,) * 2)


def video_modality(cfg: Config) -> Modality | None:
    """Video clips as the config's ViT takes them (frames x height x width x channels, each
    temporal patch of `frames` frames one segment of the tower), on the configured placeholder;
    None where `workload_settings.video_token` is unset (then synthetic clips are refused, naming it)."""
    video_token = settings(cfg).video_token
    if video_token is None:
        return None
    vit = model(cfg, "vision", "vit")
    unit = vit.patch * vit.merge
    bound = (settings(cfg).video_max_frames, vit.max_grid * vit.patch, vit.max_grid * vit.patch)
    return Modality("video", video_token, (vit.frames, unit, unit), vit.channels, bound)


def visual_modalities(cfg: Config) -> tuple[Modality, ...]:
    """What the tower reads, in the order its tokens go down the edge: images, then clips."""
    video = video_modality(cfg)
    return (image_modality(cfg),) if video is None else (image_modality(cfg), video)


def patchify(image: np.ndarray, patch: int, merge: int, frames: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Image H x W x C -> (patches N x C', grid N x 2), each merge x merge window contiguous; with
    `frames` > 1 (a tower whose patch spans frames in time, `ViTConfig.frames`) each patch is the
    still image's frame repeated, C' = frames x patch x patch x C; a temporal patch of a clip,
    `frames` x H x W x C, gives each patch its frames' patches in frame order."""
    if image.ndim == 4:
        if len(image) != frames:
            raise ValueError(f"a temporal patch of {len(image)} frames; the tower's patches span {frames}")
        cuts = [patchify(f, patch, merge) for f in image]
        return np.concatenate([p for p, _ in cuts], axis=1), cuts[0][1]
    h, w, c = image.shape
    if h % (patch * merge) or w % (patch * merge):
        raise ValueError(f"image of size {h}x{w} is not a multiple of patch*merge = {patch * merge}")
    gh, gw = h // patch, w // patch
    order = (0, 3, 1, 4, 2, 5, 6)
    blocks = image.reshape(gh // merge, merge, patch, gw // merge, merge, patch, c)
    patches = blocks.transpose(order).reshape(-1, patch * patch * c)
    patches = np.tile(patches, (1, frames)) if frames > 1 else patches
    rr, cc = np.meshgrid(np.arange(gh), np.arange(gw), indexing="ij")
    grid = np.stack([rr, cc], -1).reshape(gh // merge, merge, 1, gw // merge, merge, 1, 2)
    return patches, grid.transpose(order).reshape(-1, 2)


def segments_of(sample, vit: ViTConfig) -> list[tuple[np.ndarray, np.ndarray]]:
    """What the tower attends within, in the order its tokens go down the edge: each image, then
    each temporal patch of each clip (transformers' Qwen-VL towers cut a clip so), as patches
    and their grid positions (`patchify`)."""
    out = [patchify(im, vit.patch, vit.merge, vit.frames) for im in sample.of("image")]
    for clip in sample.of("video"):
        out += [
            patchify(clip[t : t + vit.frames], vit.patch, vit.merge, vit.frames)
            for t in range(0, len(clip), vit.frames)
        ]
    return out


def visual_patches(sample, vit: ViTConfig) -> int:
    """The tower's work on a sample: the patches of its images and of its clips' temporal patches."""
    images = sum((h // vit.patch) * (w // vit.patch) for h, w, _ in sample.shapes("image"))
    return images + sum(
        (t // vit.frames) * (h // vit.patch) * (w // vit.patch) for t, h, w, _ in sample.shapes("video")
    )


def vision_section(
    vit: ViTConfig,
    llm: LLMConfig,
    mean_patches: float,
    name: str = "vision",
    edges: tuple[str, ...] = (EDGE,),
    *,
    per_octave: int,
    video: bool = False,
) -> Section:
    """The ViT section: packed patches of a sample's images (and, with `video`, of each temporal
    patch of its clips, `segments_of`) in, merged tokens out on `edges` (with a DeepStack tower's
    feature sets after each token's own, `ViTConfig.token_width`: the language model `llm` takes
    them apart, `spliced_embeddings`); its patch and class-slot counts bucketed at `per_octave`
    (`compile.buckets_per_octave`)."""
    if vit.out_width != llm.width:
        raise ValueError(f"models.{name}.out_width ({vit.out_width}) must equal the LLM width ({llm.width})")
    if len(vit.deepstack_layers) != llm.deepstack_layers:
        raise ValueError(
            f"models.{name}.deepstack_layers={list(vit.deepstack_layers)}: the tower sends {len(vit.deepstack_layers)} "
            f"DeepStack feature sets and the LLM takes deepstack_layers={llm.deepstack_layers}; valid: as many"
        )
    encoder = VisionEncoder(vit)
    window = vit.merge * vit.merge

    def host_batch(rows, routes):
        b = R.pack_segments(
            rows, lambda s: segments_of(s, vit), vit.patch_features, minimum=4 * window, per_octave=per_octave
        )
        out = {"patches": b["pieces"], "segments": b["segments"], "grid": b["positions"]}
        if "segment_lengths" in b:
            out["segment_lengths"] = b["segment_lengths"]
        if vit.class_token:  # a class token per image (models/vit.py), the slot count bucketed
            out["class_segments"] = class_segments(b["segments"], per_octave)
        return out

    def forward(variables, inputs, batch):
        out = encoder.apply(
            {"params": variables["params"]},
            batch["patches"],
            batch["segments"],
            batch["grid"],
            batch.get("class_segments"),
            batch.get("segment_lengths"),
        )
        return dict.fromkeys(edges, out)

    return Section(
        name,
        trained=True,
        forward=forward,
        host_batch=host_batch,
        activates=lambda s: s.has("image") or s.has("video"),
        work=lambda s: visual_patches(s, vit),
        cost=vit_cost(vit, mean_patches),
        reads=VISUAL if video else ("image",),
    )


def image_bytes_per_patch(vit: ViTConfig) -> float:
    """What the image edge carries per patch, in bf16: a merged token's features (DeepStack's too)
    over the merge window's patches."""
    return 2 * vit.token_width / (vit.merge * vit.merge)


def class_segments(segments_BP: np.ndarray, per_octave: int = PER_OCTAVE) -> np.ndarray:
    """The images of each row's class token slots (`models.vit` `class_token`): slot i holds
    image i + 1 where the row has one, else 0; the slot count is bucketed from 8, so a row's
    patches plus slots stay a multiple of 8 for a split sequence (`per_octave` buckets an octave)."""
    k = bucket(int(segments_BP.max(initial=0)), 8, per_octave)
    slots = np.arange(1, k + 1, dtype=np.int32)
    return np.where(slots[None] <= segments_BP.max(axis=1, keepdims=True), slots[None], 0).astype(np.int32)


def init_vision(vit: ViTConfig, key):
    window = vit.merge * vit.merge
    return VisionEncoder(vit).init(
        key,
        jnp.zeros((1, 4 * window, vit.patch_features)),
        jnp.ones((1, 4 * window), jnp.int32),
        jnp.zeros((1, 4 * window, 2), jnp.int32),
        jnp.ones((1, 8), jnp.int32) if vit.class_token else None,
    )


def init_llm(llm: LLMConfig, key):
    positions = jnp.arange(4)[None]
    if llm.mrope_section is not None:  # the order and the three M-RoPE axes (`DecoderLM.body`)
        positions = jnp.repeat(positions[..., None], 4, axis=-1)
    return DecoderLM(llm).init(key, jnp.zeros((1, 4), jnp.int32), positions, jnp.ones((1, 4), bool))


def sample_positions(llm: LLMConfig, spliced: Mapping[str, R.Carried]) -> R.Positions | None:
    """An M-RoPE LLM's positions for each sample (`models.llm.mrope_positions`), from the merged
    grid of each of its images (the image modality's `unit` is patch * merge pixels) and of each
    of its clips (`video_grids`); None for an LLM with plain positions."""
    by_name = {m.name: m for m in R.flat(tuple(spliced.values()))}
    image, video = by_name.get("image"), by_name.get("video")
    if llm.mrope_section is None or image is None:
        return None

    def positions(s):
        grids = [(h // image.unit[0], w // image.unit[1]) for h, w, *_ in s.shapes("image")]
        if video is None:
            return mrope_positions(s.tokens[:-1], image.placeholder, grids)
        clips = video_grids(llm, video, s)
        return mrope_positions(s.tokens[:-1], image.placeholder, grids, video.placeholder, clips)

    return positions


def video_grids(llm: LLMConfig, video: Modality, sample) -> list[tuple[int, int, int, float]]:
    """A sample's clips as `mrope_positions` takes them: Qwen2.5-VL's `(temporal patches, rows,
    columns, interval)`, the interval `video_tokens_per_second` times the clip's seconds per
    temporal patch (the sample's `video_seconds_per_patch` tag, else 1.0); Qwen3-VL's
    (`video_timestamps`) one entry per temporal patch (`frame_by_frame`)."""
    t_unit, h_unit, w_unit = video.unit
    grids = [(t // t_unit, h // h_unit, w // w_unit) for t, h, w, *_ in sample.shapes("video")]
    if llm.video_timestamps:
        return frame_by_frame(grids)
    tag = sample.tags.get(SECONDS_PER_PATCH)
    seconds = [float(x) for x in tag.split()] if tag else [1.0] * len(grids)
    if len(seconds) != len(grids):
        raise ValueError(
            f"sample id={sample.id}: tag {SECONDS_PER_PATCH}={tag!r} gives {len(seconds)} values for {len(grids)} clips"
        )
    return [(t, r, c, llm.video_tokens_per_second * sec) for (t, r, c), sec in zip(grids, seconds)]


def mean_patches(cfg: Config, vit: ViTConfig) -> float:
    """Patches per segment the tower attends within (an image, a clip's temporal patch) over the
    configured synthetic image and clip sizes, each checked against the ViT first: a multiple of
    patch * merge (a clip's frames of `frames`) and within its position grid."""
    unit, side = vit.patch * vit.merge, vit.max_grid * vit.patch
    taken = {m.name for m in visual_modalities(cfg)}
    sizes = {name: [tuple(x) for x in m.sizes] for name, m in cfg.data.modalities.items() if name in taken}
    for name, shapes in sizes.items():
        for shape in shapes:
            *t, h, w = shape
            if (
                len(shape) != 2 + (name == "video")
                or h % unit
                or w % unit
                or max(h, w) > side
                or (t and t[0] % vit.frames)
            ):
                frames = (
                    f"frames x height x width, frames a multiple of models.vision frames={vit.frames}, " if t else ""
                )
                raise ConfigError(
                    f"error: data.modalities.{name}.sizes={[list(x) for x in shapes]}: {'x'.join(map(str, shape))}; "
                    f"valid: {frames or 'height x width, '}each side a multiple of models.vision patch*merge={unit} "
                    f"and at most max_grid*patch={side}"
                )
    per = [(s[-2] // vit.patch) * (s[-1] // vit.patch) for shapes in sizes.values() for s in shapes]
    return sum(per) / len(per) if per else vit.max_grid**2 / 4


def multimodal_rows(
    rows,
    routes,
    spliced: Mapping[str, R.Carried],
    images: bool = False,
    positions: R.Positions | None = None,
    *,
    per_octave: int,
    prefix: bool = False,
) -> dict:
    """Text rows with placeholder indices per modality, and a route per spliced edge; with
    `images` (the LLM's `bidirectional_images`), each token's image block (`with_image_blocks`),
    with `prefix` (its `prefix_lm`) each sample's prefix block (`with_prefix_blocks`);
    with `positions` (`sample_positions`), each sample's own. Lengths bucketed at `per_octave`
    (`R.text_rows`)."""
    text = R.text_rows(rows, tuple(spliced.values()), positions, per_octave=per_octave)
    out = {**text, **{f"{e}_row": R.route(routes, e, rows) for e in spliced}}
    return _with_blocks(out, images, prefix)


def packed_multimodal_rows(
    rows,
    routes,
    shards: int,
    pack: Pack,
    spliced: Mapping[str, R.Carried],
    gathered: tuple[str, ...] = (),
    images: bool = False,
    positions: R.Positions | None = None,
    *,
    per_octave: int,
    prefix: bool = False,
) -> dict:
    """`multimodal_rows` with sequence packing (`rows.packed_text_rows`): each position routes to
    its own sample's producer row, on every spliced edge and every edge in `gathered`; each
    sample keeps its own positions (M-RoPE's too)."""
    edges = {e: R.route(routes, e, rows) for e in (*spliced, *gathered)}
    out = R.packed_text_rows(
        rows, edges, shards, pack, tuple(spliced.values()), positions=positions, per_octave=per_octave
    )
    return _with_blocks(out, images, prefix)


def _with_blocks(batch: dict, images: bool, prefix: bool) -> dict:
    """`batch` with the LLM's attention blocks: its images' (`bidirectional_images`) or each
    sample's prefix (`prefix_lm`), or as it is."""
    return with_prefix_blocks(batch) if prefix else with_image_blocks(batch) if images else batch


def with_prefix_blocks(batch: dict) -> dict:
    """`batch` with `images` marking each sample's prefix as one block (an LLM with `prefix_lm`,
    PaliGemma's): its positions up to the first whose target carries loss (the image and the
    prompt; a sample with no such position is prefix whole), numbered by the sample's segment
    (packed rows) or 1, 0 elsewhere: `body`'s causal OR same block is then the prefix-LM mask."""
    samples = batch.get("segments", batch["valid"].astype(np.int32))
    loss = batch["loss_mask"] > 0
    blocks = np.zeros(samples.shape, np.int32)
    for sample in np.unique(samples[samples > 0]):
        own = samples == sample
        before = np.cumsum(loss & own, axis=1) - (loss & own)  # the sample's loss positions before each
        blocks = np.where(own & (before == 0), sample, blocks)
    return {**batch, "images": blocks}


def with_image_blocks(batch: dict) -> dict:
    """`batch` with `images`: each position's image block (`models.llm.image_blocks`: runs of
    image placeholders numbered from 1, 0 elsewhere), so that an LLM with `bidirectional_images`
    lets each image's tokens attend to the whole image. Packed samples need no care: attention
    stays inside each sample whatever the blocks say."""
    return {**batch, "images": image_blocks(batch["image_tok"] >= 0)} if "image_tok" in batch else batch


def _mask_inputs(batch) -> tuple:
    """The decoder's optional mask inputs of `batch` (`DecoderLM.body`'s segments and images)."""
    return batch.get("segments"), batch.get("images")


def spliced_embeddings(decoder: DecoderLM, v, inputs, batch, spliced: Mapping[str, R.Carried]):
    """The LLM's input embeddings with each edge's embeddings in its modalities' placeholder
    positions (per position in a packed batch, with `segments`), and, for an LLM with
    `deepstack_layers` J, its DeepStack features `J x B x L x D` (None without): what the tower's
    edge carries after each image or video token's own D features, at the same positions, zero
    elsewhere."""
    x = decoder.apply(v, batch["input_ids"], method=DecoderLM.embed)
    j, (b, length, d) = decoder.cfg.deepstack_layers, x.shape
    splice = R.splice_tokens if "segments" in batch else R.splice
    carried = [(edge, m) for edge, c in spliced.items() for m in R.flat((c,))]
    for edge, m in carried:
        if not (j and m.name in VISUAL):
            x = splice(x, inputs, edge, batch[f"{edge}_row"], batch[f"{m.name}_tok"])
    if not j:
        return x, None
    x = jnp.concatenate([x, jnp.zeros((b, length, j * d), x.dtype)], axis=-1)  # DeepStack's sets ride along
    for edge, m in carried:
        if m.name in VISUAL:
            x = splice(x, inputs, edge, batch[f"{edge}_row"], batch[f"{m.name}_tok"])
    return x[..., :d], jnp.moveaxis(x[..., d:].reshape(b, length, j, d), 2, 0)


def spliced_logits(decoder: DecoderLM, variables, inputs, batch, spliced: Mapping[str, R.Carried]):
    """The LLM's logits with each edge's embeddings in its modality's placeholder positions (and
    DeepStack's features added in its first blocks), and the sum of its auxiliary losses (MoE
    load balancing). A packed batch (with `segments`) splices per position and keeps attention
    inside each sample."""
    v = {"params": variables["params"]}
    x, deepstack = spliced_embeddings(decoder, v, inputs, batch, spliced)
    h, aux = apply_with_losses(
        decoder,
        v,
        x,
        batch["positions"],
        batch["valid"],
        *_mask_inputs(batch),
        deepstack,
        batch.get("segment_lengths"),
        method=DecoderLM.hidden,
    )
    return decoder.apply(v, h, method=DecoderLM.logits), aux


def next_token_loss(logits, batch, aux=0.0):
    """The summed next-token cross-entropy over the loss-carrying targets (plus `aux`)."""
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), batch["targets"])
    mask = batch["loss_mask"]
    return jnp.sum(ce * mask) + aux, {"tokens": jnp.sum(mask)}


def llm_section(
    llm: LLMConfig, spliced: Mapping[str, R.Carried], cost: UnitCost | None = None, *, per_octave: int
) -> Section:
    """The `llm` sink of a multimodal LLM: encoder outputs spliced in (`spliced`: each edge's
    modality, or the modalities it carries in order), next-token cross-entropy;
    `cost` its declared cost (default: the decoder's with its head, `llm_cost`). It splits into
    pipeline stages (`workloads.staged`): image embeddings spliced in the first, the loss in the
    last, each stage's cost its share of the decoder's. Its rows are bucketed at `per_octave`
    (`compile.buckets_per_octave`)."""
    decoder = DecoderLM(llm, rows_from_zero=True)  # text_rows' rows
    positions = sample_positions(llm, spliced)

    def forward(variables, inputs, batch):
        logits, aux = spliced_logits(decoder, variables, inputs, batch, spliced)
        return next_token_loss(logits, batch, aux)

    def stages(k: int, layers: tuple[int, ...] | None = None):
        return decoder_stages(
            section,
            llm,
            k,
            layers=layers,
            embed=lambda module, v, inputs, batch: spliced_embeddings(module, v, inputs, batch, spliced),
            finish=lambda module, variables, v, inputs, batch, h: next_token_loss(
                module.apply(v, h, method=DecoderLM.logits), batch
            ),
            cost=lambda c, last: llm_cost(c, head=last),
        )

    section = Section(
        "llm",
        trained=True,
        forward=forward,
        host_batch=lambda rows, routes: multimodal_rows(
            rows, routes, spliced, llm.bidirectional_images, positions, per_octave=per_octave, prefix=llm.prefix_lm
        ),
        packed_batch=lambda rows, routes, shards, pack: packed_multimodal_rows(
            rows,
            routes,
            shards,
            pack,
            spliced,
            images=llm.bidirectional_images,
            positions=positions,
            per_octave=per_octave,
            prefix=llm.prefix_lm,
        ),
        activates=lambda s: True,
        work=R.next_token_units,
        cost=llm_cost(llm, head=True) if cost is None else cost,
        reads=(TOKENS,),
        stages=stages,
    )
    return section


def build(cfg: Config) -> SectionGraph:
    vit, llm = model(cfg, "vision", "vit"), model(cfg, "llm", "llm")
    visual = visual_modalities(cfg)

    def init(key):
        kv, kl = jax.random.split(key)
        return {
            "vision": {"params": init_vision(vit, kv)["params"], "consts": {}},
            "llm": {"params": init_llm(llm, kl)["params"], "consts": {}},
        }

    return SectionGraph(
        sections=(
            vision_section(
                vit, llm, mean_patches(cfg, vit), per_octave=cfg.compile.buckets_per_octave, video=len(visual) > 1
            ),
            llm_section(llm, {EDGE: visual}, per_octave=cfg.compile.buckets_per_octave),
        ),
        edges=(Edge(EDGE, "vision", "llm", bytes_per_unit=image_bytes_per_patch(vit)),),
        init=init,
        loss_count=R.loss_tokens(visual),
    )


WORKLOAD = Workload(
    "vlm",
    build,
    vocab=lambda cfg: model(cfg, "llm", "llm").vocab,
    modalities=visual_modalities,
    pretrained={"vision": load_vision_section, "llm": load_llm_section},
    settings=VLMSettings,
)
