"""Write tests/fixtures/hf/qwen_video/cases.json: what transformers' Qwen2.5-VL and Qwen3-VL
processors make of a video clip, the reference of `maestro_jax.data.video` (tests/test_video.py).

For each family and each clip (its frame count, frame rate and frame size) under tiny processor
settings (patches of 4 merged 2 x 2, two frames a temporal patch, small pixel budgets, with and
without the per-frame pixel cap): the frame indices the video processor samples at 2 frames a
second, the clip's grid (t, h, w), the size each frame is resized to, Qwen2.5-VL's seconds per
temporal patch (`second_per_grid_ts`) and the text the processor expands the chat template's
`<|vision_start|><|video_pad|><|vision_end|>` into (Qwen3-VL: a timestamp before each temporal
patch). For the clips in PIXELS, pixels.npz holds the clip's frames and the processor's
`pixel_values_videos` (`<name>-frames`, `<name>-pixels`, the case's `pixels` naming them). The tests read these files and so
need neither torch nor transformers; rerun this (it needs both, and torchvision, which the video
processors import) only to change a case.

towers.npz holds what each family's tower makes of one clip (TOWER_CLIP: 5 frames, so the last
temporal patch repeats the last frame; frames already a multiple of the merged patch, so nothing
is resized): the tiny Qwen2.5-VL and Qwen3-VL of tests/fixtures/hf (their stored weights, read by
transformers in float32) on the video processor's `pixel_values_videos` and `video_grid_thw`:
`<family>-frames`, `-pixels`, `-grid`, `-features` (`visual(...).pooler_output`) and for Qwen3-VL
`-deepstack` (its DeepStack mergers' outputs).

whole.npz holds each family's whole model on one row of text, an image and a clip (`_whole`): the
row's ids (`<family>-tokens`; Qwen3-VL's with a timestamp token and markers before each temporal
patch), the image and the clip as a sample holds them (`image`, `clip`: normalised pixels, H x W x
C and T x H x W x C), Qwen2.5-VL's seconds per temporal patch (`seconds`) and the logits
(`<family>-logits`); the processors' rows are made from them as the Qwen2-VL video processor lays
them out (`maestro_jax.tools.check_hf.qwen_video_pixel_values`). It needs no torchvision: `python -c "..._whole(...)"` writes it alone.

torchvision's PyPI wheel is a CUDA build: beside torch's CPU build its C++ operators do not load,
and its import then fails registering fake kernels for two of them (`nms`, `qnms`), which the
video processors never call. This script declares those two so that the import goes through;
the resizing the processors do is torch's own.

    pip install torchvision --no-deps   # beside the `reference` extra
    python scripts/make_video_fixtures.py [--out tests/fixtures/hf/qwen_video]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>"]
SPECIALS += ["<|image_pad|>", "<|video_pad|>"]
WRAPPER = "<|vision_start|><|video_pad|><|vision_end|>"

# (frames, frames per second, height, width): a short clip below the frame minimum, an odd frame
# count (the last frame repeated to fill a temporal patch), a long clip past the frame cap, frames
# smaller than a merged patch, a wide clip the pixel budget shrinks, a clip whose count at 2 fps
# is fractional (7.67: Qwen3-VL truncates it)
CLIPS = [(5, 10.0, 16, 24), (7, 2.0, 20, 30), (96, 24.0, 48, 64), (12, 4.0, 6, 10), (30, 30.0, 40, 160)]
CLIPS += [(23, 6.0, 24, 32)]
# the clips whose pixels are stored (uncapped): one shrunk on one side and grown on the other, one
# grown, one shrunk (Qwen3-VL) and one kept (Qwen2.5-VL)
PIXELS = {("qwen2_5_vl", 1), ("qwen2_5_vl", 3), ("qwen2_5_vl", 5), ("qwen3_vl", 1), ("qwen3_vl", 5)}
FAMILIES = {
    # the video processor's settings; `size` is transformers' pixel budget (Qwen2-VL: per frame;
    # Qwen3-VL: the whole clip, frames included)
    "qwen2_5_vl": {"size": {"shortest_edge": 128, "longest_edge": 1024}, "max_video_tokens": 16},
    "qwen3_vl": {"size": {"shortest_edge": 256, "longest_edge": 4096}, "max_video_tokens": 6},
}
COMMON = {"patch_size": 4, "merge_size": 2, "temporal_patch_size": 2, "min_frames": 4, "max_frames": 16}


def _import_torchvision() -> None:
    """torchvision's Python transforms beside torch's CPU build (module docstring)."""
    try:
        import torchvision
    except RuntimeError:
        lib = torch.library.Library("torchvision", "DEF")  # kept alive below: the ops live as long as it
        lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        lib.define("qnms(Tensor qdets, Tensor scores, float iou_threshold) -> Tensor")
        _import_torchvision.lib = lib
        import torchvision  # noqa: F401


def _tokenizer(folder: Path):
    """A byte-level BPE holding Qwen's special tokens (the timestamps are plain text)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(["<0.5 seconds> a clip of 12.3 seconds"], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.save_pretrained(folder)
    return PreTrainedTokenizerFast.from_pretrained(folder)


def _processor(family: str, capped: bool, tokenizer):
    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    settings = {**COMMON, **FAMILIES[family], "cap_pixels_per_frame": capped, "do_sample_frames": True, "fps": 2}
    video = (transformers.Qwen2VLVideoProcessor if family == "qwen2_5_vl" else transformers.Qwen3VLVideoProcessor)(
        **settings
    )
    cls = transformers.Qwen2_5_VLProcessor if family == "qwen2_5_vl" else transformers.Qwen3VLProcessor
    image = Qwen2VLImageProcessorPil(patch_size=4, merge_size=2, min_pixels=128, max_pixels=512)
    return cls(image_processor=image, tokenizer=tokenizer, video_processor=video), settings


def _case(processor, clip: tuple, seed: int, pixels: dict | None) -> dict:
    from transformers.video_utils import VideoMetadata

    frames, fps, height, width = clip
    video = np.random.default_rng(seed).integers(0, 256, (frames, height, width, 3), dtype=np.uint8)
    meta = VideoMetadata(total_num_frames=frames, fps=fps, width=width, height=height)
    out = processor(text=[WRAPPER], videos=[video], video_metadata=[meta], return_metadata=True, return_tensors="np")
    sampled = out["video_metadata"][0]
    case = {
        "frames": frames,
        "fps": fps,
        "height": height,
        "width": width,
        "indices": [int(i) for i in sampled.frames_indices],
        "grid": [int(g) for g in out["video_grid_thw"][0]],
        "text": processor.tokenizer.decode(out["input_ids"][0], skip_special_tokens=False),
    }
    if "second_per_grid_ts" in out:
        case["second_per_grid_ts"] = float(out["second_per_grid_ts"][0])
    patches = out["pixel_values_videos"]
    assert patches.shape[0] == int(np.prod(case["grid"])), (patches.shape, case["grid"])
    if pixels is not None:
        pixels["frames"], pixels["pixels"] = video, patches.astype(np.float32)
    return case


TOWER_CLIP = (5, 8, 16)  # frames, height, width: 2 x 2 merged patches of 2 pixels, 4 x 8 patches a frame
TOWER_MODELS = {"qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration", "qwen3_vl": "Qwen3VLForConditionalGeneration"}


def _towers(fixtures: Path) -> dict:
    """Each family's tower on TOWER_CLIP (module docstring)."""
    import transformers

    arrays = {}
    frames = np.random.default_rng(11).integers(0, 256, (*TOWER_CLIP, 3), dtype=np.uint8)
    for family, cls in TOWER_MODELS.items():
        model = getattr(transformers, cls).from_pretrained(fixtures / family, dtype=torch.float32).eval()
        video = (transformers.Qwen2VLVideoProcessor if family == "qwen2_5_vl" else transformers.Qwen3VLVideoProcessor)(
            **{**COMMON, "patch_size": 2, "do_resize": False, "do_sample_frames": False, "cap_pixels_per_frame": False}
        )
        out = video(videos=[frames], return_tensors="pt")
        with torch.no_grad():
            visual = model.model.visual(out["pixel_values_videos"], grid_thw=out["video_grid_thw"])
        arrays |= {
            f"{family}-frames": frames,
            f"{family}-pixels": out["pixel_values_videos"].numpy().astype(np.float32),
            f"{family}-grid": out["video_grid_thw"].numpy()[0],
            f"{family}-features": visual.pooler_output.numpy().astype(np.float32),
        }
        if getattr(visual, "deepstack_features", None):
            arrays[f"{family}-deepstack"] = torch.stack(visual.deepstack_features).numpy().astype(np.float32)
    return arrays


# The whole model on one row of text, an image and a clip (whole.npz): ids of the tiny fixtures'
# tokenizer (image 7, video 93, vision start 94 and end 95), the image 8x8 (2 x 2 merged tokens),
# the clip 4 frames of 8x12 (2 temporal patches of 2 x 3 tokens), Qwen2.5-VL's clip at 0.5 s a
# temporal patch (so its positions step by tokens_per_second x 0.5, not the default 1 s)
WHOLE_IMAGE, WHOLE_CLIP, WHOLE_SECONDS = (8, 8), (4, 8, 12), 0.5
IMAGE_ID, VIDEO_ID, START, END = 7, 93, 94, 95


def _whole_ids(family: str) -> list[int]:
    """Text, the image's 4 tokens, text, the clip (Qwen2.5-VL: one run of 12 tokens; Qwen3-VL: a
    timestamp token and markers before each temporal patch's 6, as its processor writes it), text."""
    image = [START, *[IMAGE_ID] * 4, END]
    if family == "qwen2_5_vl":
        clip = [START, *[VIDEO_ID] * 12, END]
    else:
        clip = [30, START, *[VIDEO_ID] * 6, END, 31, START, *[VIDEO_ID] * 6, END]
    return [11, 12, 13, *image, 14, 15, *clip, 16, 17, 18]


def _whole(fixtures: Path) -> dict:
    """Each family's whole model (its stored tiny weights in float32) on `_whole_ids`, the image
    and the clip given as the processors' rows of normalised pixels: the logits, with the inputs
    (the image H x W x C, the clip T x H x W x C) as a sample holds them."""
    import transformers

    from maestro_jax.tools.check_hf import qwen_video_pixel_values  # the Qwen2-VL video processor's layout

    rng = np.random.default_rng(21)
    image = rng.standard_normal((*WHOLE_IMAGE, 3)).astype(np.float32)
    clip = rng.standard_normal((*WHOLE_CLIP, 3)).astype(np.float32)
    arrays = {"image": image, "clip": clip, "seconds": np.float32(WHOLE_SECONDS)}
    for family, cls in TOWER_MODELS.items():
        model = getattr(transformers, cls).from_pretrained(fixtures / family, dtype=torch.float32).eval()
        ids = _whole_ids(family)
        still = np.repeat(image.transpose(2, 0, 1)[None], 2, axis=0)
        kinds = [1 if i == IMAGE_ID else 2 if i == VIDEO_ID else 0 for i in ids]
        inputs = {
            "input_ids": torch.tensor([ids]),
            "mm_token_type_ids": torch.tensor([kinds]),
            "pixel_values": torch.from_numpy(qwen_video_pixel_values(still, 2, 2, 2)),
            "image_grid_thw": torch.tensor([[1, WHOLE_IMAGE[0] // 2, WHOLE_IMAGE[1] // 2]]),
            "pixel_values_videos": torch.from_numpy(qwen_video_pixel_values(clip.transpose(0, 3, 1, 2), 2, 2, 2)),
            "video_grid_thw": torch.tensor([[WHOLE_CLIP[0] // 2, WHOLE_CLIP[1] // 2, WHOLE_CLIP[2] // 2]]),
        }
        if family == "qwen2_5_vl":
            inputs["second_per_grid_ts"] = torch.tensor([WHOLE_SECONDS])
        with torch.no_grad():
            logits = model(**inputs).logits
        arrays |= {
            f"{family}-tokens": np.array(ids, np.int32),
            f"{family}-logits": logits[0].numpy().astype(np.float32),
        }
    return arrays


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "tests" / "fixtures" / "hf" / "qwen_video")
    args = parser.parse_args()
    _import_torchvision()
    import transformers

    with tempfile.TemporaryDirectory() as folder:
        tokenizer = _tokenizer(Path(folder))
        cases, arrays = [], {}
        for family in FAMILIES:
            for capped in (False, True):
                processor, settings = _processor(family, capped, tokenizer)
                for i, clip in enumerate(CLIPS):
                    pixels = {} if (family, i) in PIXELS and not capped else None
                    case = {"family": family, "settings": settings, **_case(processor, clip, i, pixels)}
                    if pixels is not None:  # the case names its arrays
                        case["pixels"] = f"{family}-{i}"
                        arrays |= {f"{family}-{i}-{k}": v for k, v in pixels.items()}
                    cases.append(case)
    args.out.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(args.out / "pixels.npz", **arrays)
    np.savez_compressed(args.out / "towers.npz", **_towers(args.out.parent))
    np.savez_compressed(args.out / "whole.npz", **_whole(args.out.parent))
    record = {"transformers": transformers.__version__, "wrapper": WRAPPER, "cases": cases}
    (args.out / "cases.json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {len(cases)} cases to {args.out / 'cases.json'}")


if __name__ == "__main__":
    main()
