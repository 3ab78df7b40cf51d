"""A clip's frames, grid, tokens and placeholder text as Qwen2.5-VL's and Qwen3-VL's processors
make them (`data.video`), against what transformers 5.25's processors wrote for 24 clips
(tests/fixtures/hf/qwen_video/cases.json, `scripts/make_video_fixtures.py`): frame sampling at
2 frames a second, the frame size within the pixel budget with and without the per-frame cap,
the temporal patches, Qwen2.5-VL's seconds per temporal patch and Qwen3-VL's timestamps."""

import json

import numpy as np
import pytest
from conftest import ROOT
from maestro_jax.models.llm import frame_by_frame, mrope_positions

from maestro_jax.data.video import VideoError, VideoSampling

FOLDER = ROOT / "tests/fixtures/hf/qwen_video"
FIXTURE = json.loads((FOLDER / "cases.json").read_text())
PIXELS = np.load(FOLDER / "pixels.npz")
START, TOKEN, END = "<|vision_start|>", "<|video_pad|>", "<|vision_end|>"


def processor_rows_in_tower_order(rows, sampling):
    """The processor's patch rows (channels x frames x patch x patch) in the tower's order (frames x
    patch x patch x channels, `VideoSampling.patches`): the same values, moved."""
    p, t = sampling.patch, sampling.temporal
    return rows.reshape(len(rows), -1, t, p, p).transpose(0, 2, 3, 4, 1).reshape(len(rows), -1)


def _id(case) -> str:
    capped = "capped" if case["settings"]["cap_pixels_per_frame"] else "uncapped"
    return f"{case['family']}-{capped}-{case['frames']}x{case['height']}x{case['width']}@{case['fps']:g}"


@pytest.mark.parametrize("case", FIXTURE["cases"], ids=_id)
def test_a_clip_is_what_the_processor_makes_of_it(case):
    sampling = VideoSampling.from_processor(case["family"], case["settings"])
    clip = sampling.clip(case["frames"], case["fps"], case["height"], case["width"])
    assert list(clip.indices) == case["indices"]
    assert list(clip.grid) == case["grid"]
    assert clip.size == (case["grid"][1] * sampling.patch, case["grid"][2] * sampling.patch)
    assert sampling.text(clip, START, TOKEN, END) == case["text"]
    assert sampling.tokens(clip) == case["text"].count(TOKEN)
    if "second_per_grid_ts" in case:  # Qwen2.5-VL's M-RoPE temporal step
        assert clip.seconds_per_patch == pytest.approx(case["second_per_grid_ts"], rel=1e-12)


@pytest.mark.parametrize("case", [c for c in FIXTURE["cases"] if "pixels" in c], ids=_id)
def test_a_clips_patches_are_the_processors_pixel_values(case):
    """The sampled frames resized, normalised and laid out in the tower's patch order as the
    processor's `pixel_values_videos` (frames shrunk on one side and grown on the other, grown,
    shrunk and kept; an odd frame count's last patch filled): equal up to one uint8 level of
    the resize's rounding (torchvision's fixed point against PIL's), and almost all exactly."""
    key, family = case["pixels"], case["family"]
    sampling = VideoSampling.from_processor(family, case["settings"])
    clip = sampling.clip(case["frames"], case["fps"], case["height"], case["width"])
    got, want = (
        sampling.patches(PIXELS[f"{key}-frames"], clip),
        processor_rows_in_tower_order(PIXELS[f"{key}-pixels"], sampling),
    )
    assert got.shape == want.shape and got.dtype == np.float32
    level = 1 / 255 / min(sampling.std)
    diff = np.abs(got - want)
    assert diff.max() <= level * 1.001, diff.max()
    assert np.mean(diff < 1e-5) > 0.99


def test_the_cases_reach_each_branch_of_the_arithmetic():
    """The fixture's clips are not all alike: some are sampled below their frame count and some
    lifted to min_frames, an odd count is padded to a whole temporal patch, the per-frame cap
    changes some grids and not others, small frames grow and wide ones shrink."""
    cases = FIXTURE["cases"]
    assert any(len(c["indices"]) < c["frames"] for c in cases), "a clip sampled below its frames"
    assert any(len(c["indices"]) > c["frames"] / c["fps"] * 2 for c in cases), "min_frames lifting the count"
    assert any(len(c["indices"]) % 2 for c in cases), "an odd frame count"
    by_clip = {}
    for c in cases:
        by_clip.setdefault((c["family"], c["frames"], c["height"], c["width"]), set()).add(tuple(c["grid"]))
    assert any(len(g) == 2 for g in by_clip.values()) and any(len(g) == 1 for g in by_clip.values())
    sizes = [(c["grid"][1] * 4, c["grid"][2] * 4, c["height"], c["width"]) for c in cases]
    assert any(h * w > ch * cw for h, w, ch, cw in sizes) and any(h * w < ch * cw for h, w, ch, cw in sizes)


def test_qwen3_vl_writes_each_temporal_patch_with_its_time_and_positions_it_alone():
    """Qwen3-VL: 7 frames at 2 fps sampled whole, padded to 4 temporal patches, each written as
    `<t seconds>` + markers + its tokens, and positioned frame by frame (`models.llm.frame_by_frame`):
    the text after the clip resumes past the last patch's block."""
    sampling = VideoSampling("qwen3_vl", patch=4, merge=2, temporal=2, min_pixels=256, max_pixels=4096)
    clip = sampling.clip(7, 2.0, 20, 30)
    assert clip.timestamps == (0.25, 1.25, 2.25, 3.0)
    assert sampling.position_grids(clip) == frame_by_frame([(4, clip.grid[1] // 2, clip.grid[2] // 2)])
    assert sampling.text(clip, "S", "v", "E").startswith("<0.2 seconds>S")


def test_qwen2_5_vl_positions_a_clip_by_its_seconds_per_temporal_patch():
    """Qwen2.5-VL: 8 frames of a 24 fps clip sampled at 2 fps, one temporal patch a second;
    with the model's `tokens_per_second` 2, each temporal patch moves the temporal position by 2."""
    sampling = VideoSampling("qwen2_5_vl", patch=4, merge=2, temporal=2, min_pixels=128, max_pixels=1024)
    clip = sampling.clip(96, 24.0, 48, 64)
    assert clip.seconds_per_patch == 1.0
    (grid,) = sampling.position_grids(clip, tokens_per_second=2)
    t, rows, cols, interval = grid
    ids = np.array([1] + [9] * (t * rows * cols) + [2])
    positions = mrope_positions(ids, image_token=8, grids=[], video_token=9, video_grids=[grid])
    firsts = positions[1 : 1 + t * rows * cols : rows * cols, 1]
    assert list(firsts) == [1 + 2 * f for f in range(t)] and interval == 2.0


@pytest.mark.parametrize(
    "family,frames,fps,height,width,said",
    [
        ("qwen2_5_vl", 1, 2.0, 16, 16, "a video of 1 frame(s): fewer than one temporal patch of the tower (2 frames)"),
        ("qwen3_vl", 1, 2.0, 16, 16, "a video of 1 frame(s): fewer than one temporal patch of the tower (2 frames)"),
        ("qwen3_vl", 8, 0.0, 16, 16, "a video at 0.0 frames per second: its frame rate must be positive"),
        ("qwen2_5_vl", 8, 2.0, 8, 2000, "a video of 8x2000 frames: its aspect is over 200, which Qwen-VL refuses"),
    ],
)
def test_a_clip_the_processor_cannot_take_is_named(family, frames, fps, height, width, said):
    sampling = VideoSampling(family, patch=4, merge=2, temporal=2, min_pixels=128, max_pixels=1024)
    with pytest.raises(VideoError) as err:
        sampling.clip(frames, fps, height, width)
    assert str(err.value) == said


def test_an_unknown_family_is_refused():
    with pytest.raises(ValueError, match="video family 'llava': valid: qwen2_5_vl, qwen3_vl"):
        VideoSampling("llava", patch=4, merge=2, temporal=2, min_pixels=128, max_pixels=1024)


def _write_video(path, frames, fps, codec="png", pix_fmt="rgb24"):
    """`frames` (N x H x W x 3 uint8) as a video file through PyAV (PNG frames in a .mov: lossless)."""
    import av

    with av.open(str(path), "w") as out:
        stream = out.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], pix_fmt
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)


def test_a_video_file_decodes_to_its_frames_and_rate(tmp_path):
    """PyAV reads back every frame of a lossless clip exactly, and its frame rate; a clip whose
    container states no frame count (FFV1 in Matroska) is counted by its decoded frames, and a
    lossy one (MPEG-4) keeps its count, size and rate."""
    from maestro_jax.data.video import read_video

    frames = np.random.default_rng(0).integers(0, 256, (5, 24, 32, 3), dtype=np.uint8)
    _write_video(tmp_path / "clip.mov", frames, 6)
    got, fps = read_video(tmp_path / "clip.mov")
    assert fps == 6.0 and got.dtype == np.uint8 and np.array_equal(got, frames)
    _write_video(tmp_path / "clip.mkv", frames, 12, codec="ffv1", pix_fmt="bgr0")
    got, fps = read_video(tmp_path / "clip.mkv")
    assert fps == 12.0 and np.array_equal(got, frames)
    _write_video(tmp_path / "clip.mp4", frames, 25, codec="mpeg4", pix_fmt="yuv420p")
    got, fps = read_video(tmp_path / "clip.mp4")
    assert fps == 25.0 and got.shape == frames.shape


def test_a_folder_of_frames_is_a_clip_in_name_order(tmp_path):
    from PIL import Image

    from maestro_jax.data.video import read_frames

    frames = np.random.default_rng(1).integers(0, 256, (3, 8, 10, 3), dtype=np.uint8)
    for i, name in enumerate(["a_00.png", "a_01.png", "a_02.png"]):
        Image.fromarray(frames[i]).save(tmp_path / name)
    (tmp_path / "notes.txt").write_text("not a frame")
    got, fps = read_frames(tmp_path, 2.0)
    assert fps == 2.0 and np.array_equal(got, frames)
    Image.fromarray(frames[0][:4]).save(tmp_path / "a_03.png")
    with pytest.raises(VideoError, match=r"a_03.png: a frame of 10x4 pixels in a clip of 10x8: every frame"):
        read_frames(tmp_path, 2.0)


@pytest.mark.parametrize(
    "make,said",
    [
        (lambda p: p.write_bytes(b"\x00\x01 not a video" * 50), "cannot be decoded as a video (InvalidDataError"),
        (lambda p: None, "cannot be decoded as a video (FileNotFoundError"),
    ],
    ids=["garbage", "missing"],
)
def test_a_file_that_is_no_video_is_one_video_error_naming_it(tmp_path, make, said):
    from maestro_jax.data.video import read_video

    path = tmp_path / "clip.mp4"
    make(path)
    with pytest.raises(VideoError) as err:
        read_video(path)
    assert str(err.value).startswith(f"{path}: {said}") and "\n" not in str(err.value)


def test_without_pyav_reading_a_video_names_the_extra(tmp_path, monkeypatch):
    import sys

    from maestro_jax.data.video import read_video

    monkeypatch.setitem(sys.modules, "av", None)  # as if PyAV were not installed
    with pytest.raises(VideoError, match=r"needs PyAV, the `video` extra: pip install 'maestro-jax\[video\]'"):
        read_video(tmp_path / "clip.mp4")


def test_a_checkpoint_folder_names_its_video_processor(tmp_path):
    """`from_folder`: the family from config.json, the settings from the saved video processor
    (or the older preprocessor_config.json); Qwen2-VL's processor takes every frame unless told
    to sample at a rate, Qwen3-VL's samples at 2 fps by default; another model type is refused
    in one line naming it."""
    import json

    folder = tmp_path / "qwen"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl"}))
    assert VideoSampling.from_folder(folder).clip(12, 4.0, 56, 56).indices == tuple(range(12))
    settings = {"patch_size": 4, "merge_size": 2, "temporal_patch_size": 2, "do_sample_frames": True, "fps": 2}
    (folder / "preprocessor_config.json").write_text(json.dumps({**settings, "min_pixels": 128, "max_pixels": 1024}))
    older = VideoSampling.from_folder(folder)
    assert (older.patch, older.min_pixels, older.max_pixels, older.sample) == (4, 128, 1024, True)
    assert older.clip(12, 4.0, 16, 16).indices == (0, 2, 4, 6, 8, 10)
    saved = {**settings, "size": {"shortest_edge": 256, "longest_edge": 4096}}
    (folder / "video_preprocessor_config.json").write_text(json.dumps(saved))
    assert (VideoSampling.from_folder(folder).min_pixels, VideoSampling.from_folder(folder).max_pixels) == (256, 4096)
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3_vl"}))
    for name in ("video_preprocessor_config.json", "preprocessor_config.json"):
        (folder / name).unlink()
    qwen3 = VideoSampling.from_folder(folder)
    assert (qwen3.patch, qwen3.fps, qwen3.sample, qwen3.mean) == (16, 2.0, True, (0.5, 0.5, 0.5))
    (folder / "config.json").write_text(json.dumps({"model_type": "llava"}))
    with pytest.raises(
        VideoError, match=r"config.json: model_type='llava' has no video processor here; valid: qwen2_5_vl, qwen3_vl"
    ):
        VideoSampling.from_folder(folder)
