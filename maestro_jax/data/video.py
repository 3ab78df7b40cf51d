"""Video clips -> what a Qwen-VL tower and its LLM read of them, as transformers' processors make it.

A clip of `frames` frames recorded at `video_fps` is sampled at the family's `fps` (at least
`min_frames`, at most `max_frames` and the clip's own frames), each sampled frame is resized to
one size for the whole clip (each side a multiple of `patch * merge`, within a pixel budget), and
`temporal` consecutive frames make one temporal patch (the last frame repeated to fill the last
one; `patches` lays out the tower's input): the clip's grid `(t, h, w)` in patches, `t * h * w / merge**2` tokens. The two families
differ in each step, and `VideoSampling` follows each one's video processor (transformers 5.25,
read from its source; tests/test_video.py compares with what the processors wrote for 24 clips,
`scripts/make_video_fixtures.py`):

  Qwen2.5-VL (`Qwen2VLVideoProcessor`): `n = frames / video_fps * fps` clamped to
             [min_frames, max_frames, frames] and floored to a multiple of `temporal`, the
             indices `arange(0, frames, frames / n)` truncated; the frame size by the image
             `smart_resize` within (min_pixels, max_pixels) per frame, and with
             `cap_pixels_per_frame` each frame's share of `max_video_tokens` tokens' pixels; one
             placeholder run for the clip, and `second_per_grid_ts = temporal / sampled fps`
             (the M-RoPE temporal step, times the model's `tokens_per_second`).
  Qwen3-VL   (`Qwen3VLVideoProcessor`): `n = int(frames / video_fps * fps)` clamped alike (not
             floored), the indices `linspace(0, frames - 1, n)` rounded; the frame size by the
             video `smart_resize`, whose pixel budget covers the whole clip (frames times
             pixels, so a longer clip gets smaller frames); and the processor writes each
             temporal patch as `<{seconds:.1f} seconds>` (the mean time of its first and last
             frame) followed by its own vision markers and tokens (`models.llm.frame_by_frame`).

A clip these arithmetics cannot take (fewer frames than one temporal patch, an aspect over 200, a
frame rate that is not positive) is a `VideoError` naming it; the converter makes it a bad record.

`read_video` decodes a video file with PyAV (the optional `video` extra; without it, one line
naming the extra) into its RGB frames and frame rate; `read_frames` reads a folder of frame
images, in name order, at a frame rate the caller gives. Either counts the frames it decoded (a
container's own frame count is often missing or wrong), and a file that cannot be decoded is a
`VideoError` naming it.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

FAMILIES = ("qwen2_5_vl", "qwen3_vl")
# each family's video processor default normalisation (transformers 5.25): Qwen2-VL's CLIP
# statistics, Qwen3-VL's 0.5 for every channel
MEAN_STD = {
    "qwen2_5_vl": ((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)),
    "qwen3_vl": ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5)),
}
# each family's video processor default for `max_video_tokens` (transformers 5.25): Qwen2-VL's is
# the whole clip's (a context of 128k tokens), Qwen3-VL's one frame's (qwen-vl-utils' VIDEO_MAX_TOKEN_NUM)
MAX_VIDEO_TOKENS = {"qwen2_5_vl": 128_000, "qwen3_vl": 768}


class VideoError(ValueError):
    """A clip that cannot become a tower's patches; the message says which and why."""


FRAME_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
# a sample tag giving each clip's seconds per temporal patch (space-separated, in clip order: the
# processor's `second_per_grid_ts`), which the converter writes and Qwen2.5-VL's M-RoPE reads
# (`workloads.vlm.video_grids`; without it, 1.0: 2 frames a patch sampled at 2 fps)
SECONDS_PER_PATCH = "video_seconds_per_patch"


def read_video(path) -> tuple[np.ndarray, float]:
    """A video file's frames (frames x height x width x 3, uint8 RGB) and frames per second, every
    frame of its first video stream decoded by PyAV (FFmpeg)."""
    try:
        import av
    except ImportError:
        raise VideoError(
            f"{path}: reading a video file needs PyAV, the `video` extra: pip install 'maestro-jax[video]'"
        ) from None
    try:
        with av.open(str(path)) as container:
            streams = container.streams.video
            rate = streams[0].average_rate or streams[0].guessed_rate if streams else None
            frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(streams[0])] if streams else None
    except (av.FFmpegError, OSError, ValueError) as err:
        raise VideoError(f"{path}: cannot be decoded as a video ({type(err).__name__}: {err})") from None
    if frames is None:
        raise VideoError(f"{path}: holds no video stream")
    if not frames:
        raise VideoError(f"{path}: its video stream holds no frame")
    if not rate or rate <= 0:
        raise VideoError(f"{path}: its video stream states no frame rate")
    return np.stack(frames), float(rate)


def read_frames(folder, fps: float) -> tuple[np.ndarray, float]:
    """A clip stored as a folder of frame images (PNG, JPEG, WebP, BMP), in file-name order, at
    `fps` frames per second: its frames (frames x height x width x 3, uint8 RGB) and `fps`."""
    from pathlib import Path

    from PIL import Image

    folder = Path(folder)
    if fps <= 0:
        raise VideoError(f"{folder}: a folder of frames at {fps} frames per second: the rate must be positive")
    names = sorted(p for p in folder.iterdir() if p.suffix.lower() in FRAME_SUFFIXES) if folder.is_dir() else []
    if not names:
        raise VideoError(f"{folder}: no frame images ({', '.join(FRAME_SUFFIXES)}) in this folder")
    frames = []
    for name in names:
        try:
            with Image.open(name) as image:
                frames.append(np.asarray(image.convert("RGB")))
        except OSError as err:
            raise VideoError(f"{name}: cannot be read as a frame ({err})") from None
        if frames[-1].shape != frames[0].shape:
            raise VideoError(
                f"{name}: a frame of {frames[-1].shape[1]}x{frames[-1].shape[0]} pixels in a clip of "
                f"{frames[0].shape[1]}x{frames[0].shape[0]}: every frame of a clip has one size"
            )
    return np.stack(frames), float(fps)


@dataclasses.dataclass(frozen=True)
class Clip:
    """One clip as the processor makes it: the sampled frame `indices`, the `size` (height,
    width) each is resized to, the `grid` (temporal patches, rows, columns) in patches, the
    seconds one temporal patch spans (`seconds_per_patch`: Qwen2.5-VL's `second_per_grid_ts`) and
    each temporal patch's time in seconds (`timestamps`: what Qwen3-VL's processor writes)."""

    indices: tuple[int, ...]
    size: tuple[int, int]
    grid: tuple[int, int, int]
    seconds_per_patch: float
    timestamps: tuple[float, ...]


@dataclasses.dataclass(frozen=True)
class VideoSampling:
    """A Qwen-VL family's video processor settings (`video_preprocessor_config.json`'s names in
    `from_processor`): `patch` pixels a side, `merge` x `merge` patches a token, `temporal` frames
    a temporal patch, the pixel budget (`min_pixels`, `max_pixels`: per frame for Qwen2.5-VL, per
    clip for Qwen3-VL), frames sampled at `fps` within `min_frames` and `max_frames`, and the
    per-frame cap (`cap_pixels_per_frame`, `max_video_tokens`), and the normalisation (`mean`,
    `std` per channel, of values in [0, 1]; None: the family's default)."""

    family: str
    patch: int
    merge: int
    temporal: int
    min_pixels: int
    max_pixels: int
    fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 768
    cap_pixels_per_frame: bool = False
    max_video_tokens: int | None = None
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None
    sample: bool = True  # False: every frame of the clip (the processor's `do_sample_frames: false`)

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"video family {self.family!r}: valid: {', '.join(FAMILIES)}")
        mean, std = MEAN_STD[self.family]
        object.__setattr__(self, "mean", tuple(self.mean or mean))
        object.__setattr__(self, "std", tuple(self.std or std))

    @classmethod
    def from_processor(cls, family: str, settings: dict) -> VideoSampling:
        """From a video processor's settings as transformers saves them (`size`'s
        `shortest_edge` and `longest_edge` are the pixel budget; `min_pixels` and `max_pixels`
        name it too), each missing one at the family's class default."""
        qwen3 = family == "qwen3_vl"
        size = settings.get("size") or {}
        factor = 32 if qwen3 else 28
        return cls(
            family=family,
            patch=settings.get("patch_size", 16 if qwen3 else 14),
            merge=settings.get("merge_size", 2),
            temporal=settings.get("temporal_patch_size", 2),
            min_pixels=settings.get("min_pixels", size.get("shortest_edge", 128 * factor * factor)),
            max_pixels=settings.get("max_pixels", size.get("longest_edge", 768 * factor * factor)),
            fps=settings.get("fps") or 2.0,  # unread where `sample` is off
            min_frames=settings.get("min_frames", 4),
            max_frames=settings.get("max_frames", 768),
            cap_pixels_per_frame=bool(settings.get("cap_pixels_per_frame")),
            max_video_tokens=settings.get("max_video_tokens"),
            mean=settings.get("image_mean"),
            std=settings.get("image_std"),
            # Qwen2-VL's processor samples only when told to (its default False, kept for older
            # callers) and given a rate (none by default: every frame); Qwen3-VL's by default, at 2
            sample=bool(settings.get("do_sample_frames", qwen3)) and bool(settings.get("fps") or qwen3),
        )

    @classmethod
    def from_folder(cls, folder) -> VideoSampling:
        """A Qwen2.5-VL or Qwen3-VL checkpoint folder's video processor: the family from
        `config.json`'s `model_type`, the settings from `video_preprocessor_config.json` (older
        folders keep them in `preprocessor_config.json`), each missing one at its class default."""
        import json
        from pathlib import Path

        folder = Path(folder)
        try:
            family = json.loads((folder / "config.json").read_text()).get("model_type")
        except (OSError, ValueError) as err:
            raise VideoError(f"{folder}/config.json: cannot be read ({err})") from None
        if family not in FAMILIES:
            raise VideoError(
                f"{folder}/config.json: model_type={family!r} has no video processor here; valid: {', '.join(FAMILIES)}"
            )
        for name in ("video_preprocessor_config.json", "preprocessor_config.json"):
            if (folder / name).is_file():
                try:
                    return cls.from_processor(family, json.loads((folder / name).read_text()))
                except ValueError as err:
                    raise VideoError(f"{folder}/{name}: cannot be read ({err})") from None
        return cls.from_processor(family, {})

    @property
    def factor(self) -> int:
        """A frame's sides are multiples of this many pixels: one merged token's side."""
        return self.patch * self.merge

    def clip(self, frames: int, video_fps: float, height: int, width: int) -> Clip:
        """The clip of `frames` frames of `height` x `width` recorded at `video_fps`."""
        if video_fps <= 0:
            raise VideoError(f"a video at {video_fps} frames per second: its frame rate must be positive")
        if frames < self.temporal:
            raise VideoError(
                f"a video of {frames} frame(s): fewer than one temporal patch of the tower ({self.temporal} frames)"
            )
        if max(height, width) / max(min(height, width), 1) > 200:
            raise VideoError(f"a video of {height}x{width} frames: its aspect is over 200, which Qwen-VL refuses")
        indices = self._indices(frames, video_fps)
        size = self._size(len(indices), height, width)
        t = -(-len(indices) // self.temporal)
        grid = (t, size[0] // self.patch, size[1] // self.patch)
        sampled_fps = len(indices) / frames * video_fps
        return Clip(indices, size, grid, self.temporal / sampled_fps, self._timestamps(indices, video_fps))

    def pixels(self, frames: np.ndarray, clip: Clip) -> np.ndarray:
        """The clip as a sample holds it (a `video` item): of `frames` (the whole clip, frames x
        height x width x 3, uint8 RGB), the sampled ones resized to `clip.size` (bicubic with
        antialiasing, the width first, then the height, each pass rounded to uint8, as torchvision
        resizes the processor's uint8 frames), scaled to [0, 1] and normalised, the last one
        repeated to fill the last temporal patch: float32, `t * temporal` x height x width x 3,
        within one uint8 level of the processor's values (their fixed-point rounding and PIL's
        differ)."""
        from PIL import Image

        height, width = clip.size
        resized = []
        for i in clip.indices:
            image = Image.fromarray(np.asarray(frames[i], np.uint8))
            image = image.resize((width, image.height), Image.BICUBIC).resize((width, height), Image.BICUBIC)
            resized.append(np.asarray(image, np.float32))
        x = (np.stack(resized) / 255.0 - np.float32(self.mean)) / np.float32(self.std)
        x = x.astype(np.float32)  # frames, height, width, channels
        return np.concatenate([x, np.repeat(x[-1:], -len(x) % self.temporal, 0)])

    def patches(self, frames: np.ndarray, clip: Clip) -> np.ndarray:
        """The tower's input for `clip` of `frames` (`pixels`), one row per patch in merge-window
        order as the processor orders them, each row `temporal` frames x patch x patch x channels:
        the tower's own order (`workloads.vlm.patchify`'s, frame by frame; the processor's rows
        hold the same values as channels x frames x patch x patch)."""
        x = self.pixels(frames, clip)
        t, h, w = clip.grid
        p, m, tp, c = self.patch, self.merge, self.temporal, x.shape[-1]
        cut = x.reshape(t, tp, h // m, m, p, w // m, m, p, c)
        return cut.transpose(0, 2, 5, 3, 6, 1, 4, 7, 8).reshape(t * h * w, tp * p * p * c)

    def tokens(self, clip: Clip) -> int:
        """The LLM tokens of `clip`: one per merged patch of every temporal patch."""
        t, h, w = clip.grid
        return t * h * w // self.merge**2

    def text(self, clip: Clip, start: str, token: str, end: str) -> str:
        """What the processor writes for the clip in place of the chat template's `start` +
        `token` + `end`: Qwen2.5-VL one run of `tokens` tokens between the markers; Qwen3-VL per
        temporal patch its timestamp, then the markers around that patch's tokens."""
        if self.family == "qwen2_5_vl":
            return start + token * self.tokens(clip) + end
        per_patch = clip.grid[1] * clip.grid[2] // self.merge**2
        return "".join(f"<{s:.1f} seconds>{start}{token * per_patch}{end}" for s in clip.timestamps)

    def position_grids(self, clip: Clip, tokens_per_second: float = 2.0) -> list[tuple[int, int, int, float]]:
        """The clip as `models.llm.mrope_positions` takes it (`video_grids`): Qwen2.5-VL one
        entry, (temporal patches, merged rows, merged columns, `tokens_per_second` *
        `second_per_grid_ts`); Qwen3-VL one entry a temporal patch (`models.llm.frame_by_frame`),
        each its own block after its timestamp."""
        t, h, w = clip.grid
        rows, cols = h // self.merge, w // self.merge
        if self.family == "qwen2_5_vl":
            return [(t, rows, cols, tokens_per_second * clip.seconds_per_patch)]
        return [(1, rows, cols, 0.0)] * t

    # -- each family's arithmetic, as its processor's --------------------------------------------
    def _indices(self, frames: int, video_fps: float) -> tuple[int, ...]:
        if not self.sample:
            return tuple(range(frames))
        if self.family == "qwen2_5_vl":
            cap = math.floor(min(self.max_frames, frames) / self.temporal) * self.temporal
            n = min(max(frames / video_fps * self.fps, self.min_frames), cap, frames)
            n = math.floor(n / self.temporal) * self.temporal
            # torch.arange(0, frames, frames / n).int(): a float32 tensor whose values are computed
            # in double, as many as ceil(frames / step)
            step = frames / n
            values = (np.arange(math.ceil(frames / step), dtype=np.float64) * step).astype(np.float32)
            return tuple(int(v) for v in values.astype(np.int32))
        n = int(frames / video_fps * self.fps)
        n = min(max(n, self.min_frames), self.max_frames, frames)
        return tuple(int(i) for i in np.linspace(0, frames - 1, n).round().astype(int))

    def _size(self, sampled: int, height: int, width: int) -> tuple[int, int]:
        factor, budget = self.factor, self.max_pixels
        if self.family == "qwen2_5_vl":
            if self.cap_pixels_per_frame:
                total = int((self.max_video_tokens or MAX_VIDEO_TOKENS[self.family]) * factor * factor * 0.9)
                budget = max(min(budget, total * self.temporal // sampled), int(self.min_pixels * 1.05))
            return fit_pixels(height, width, factor, self.min_pixels, budget, frames=1, rounded_frames=1)
        if self.cap_pixels_per_frame:
            frame_cap = (self.max_video_tokens or MAX_VIDEO_TOKENS[self.family]) * factor * factor
            budget = max(min(frame_cap, budget // sampled), int(self.min_pixels * 1.05)) * sampled
        if height < factor or width < factor:  # the video smart_resize first scales a small frame up
            scale = max(factor / height, factor / width)
            height, width = int(height * scale), int(width * scale)
        rounded = round(sampled / self.temporal) * self.temporal
        return fit_pixels(height, width, factor, self.min_pixels, budget, frames=sampled, rounded_frames=rounded)

    def _timestamps(self, indices: tuple[int, ...], video_fps: float) -> tuple[float, ...]:
        """Each temporal patch's time: the mean of its first and last frame's (the last frame
        repeated to fill the last patch), as Qwen3-VL's processor computes it."""
        padded = list(indices) + [indices[-1]] * (-len(indices) % self.temporal)
        times = [i / video_fps for i in padded]
        return tuple((times[i] + times[i + self.temporal - 1]) / 2 for i in range(0, len(times), self.temporal))


def fit_pixels(
    height: int, width: int, factor: int, min_pixels: int, max_pixels: int, frames: int = 1, rounded_frames: int = 1
) -> tuple[int, int]:
    """transformers' `smart_resize` (the image one with `frames` 1, as `data.convert.smart_resize`
    calls it; Qwen3-VL's video one otherwise): each side rounded to a multiple of `factor`, then both scaled, keeping the
    aspect, so that `rounded_frames` frames of that size hold `min_pixels` to `max_pixels`."""
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if rounded_frames * h * w > max_pixels:
        beta = math.sqrt(frames * height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif rounded_frames * h * w < min_pixels:
        beta = math.sqrt(min_pixels / (frames * height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w
