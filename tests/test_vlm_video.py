"""Video clips in the VLM workload (issue 72): the tower runs each temporal patch as a segment, the
edge carries a sample's image tokens then its video tokens, the LLM splices both and positions
clips as Qwen2.5-VL's and Qwen3-VL's `get_rope_index` do; every path gives the monolithic step."""

import dataclasses

import numpy as np
import pytest
from conftest import ROOT, TINY_VLM
from maestro_jax.models import LLMConfig
from maestro_jax.models.llm import frame_by_frame, mrope_positions

from maestro_jax.config import ConfigError, load_config
from maestro_jax.data import DataError, Sample
from maestro_jax.data.samples import Modality
from maestro_jax.workloads import rows as R
from maestro_jax.workloads.vlm import (
    EDGE,
    SECONDS_PER_PATCH,
    patchify,
    sample_positions,
    segments_of,
    visual_patches,
)

IMAGE = Modality("image", 1, (8, 8), 3)
VIDEO = Modality("video", 2, (2, 8, 8), 3)  # a tower whose patches span 2 frames
VLM = ROOT / "configs/vlm_tiny.yaml"
TEMPORAL = [*TINY_VLM, "models.vision.frames=2", "data.modalities.video.sizes=[[2,8,8],[4,8,16]]"]


def _mixed(sample_id=0, video_first=True):
    """Text, a clip of 4 frames (2 temporal patches of 1 token) and an image (1 token), the clip's
    placeholders before the image's in the text."""
    clip = np.random.default_rng(0).standard_normal((4, 8, 8, 3)).astype(np.float32)
    image = np.random.default_rng(1).standard_normal((8, 8, 3)).astype(np.float32)
    runs = [[2, 2], [1]] if video_first else [[1], [2, 2]]
    tokens = np.array([5, *runs[0], 6, *runs[1], 7, 8], np.int32)
    return Sample(sample_id, tokens, {"image": (image,), "video": (clip,)})


def test_video_tokens_are_indexed_after_the_samples_image_tokens():
    """The edge carries a sample's image tokens, then its clips': a video placeholder's index counts
    on from the sample's image tokens wherever the clip stands in the text, in plain rows and in
    packed ones (each sample counted on its own); a modality alone on its edge counts from 0."""
    s = _mixed()
    rows = R.text_rows([s, _mixed(1, video_first=False)], [(IMAGE, VIDEO)])
    assert rows["video_tok"][0].tolist()[:6] == [-1, 1, 2, -1, -1, -1]
    assert rows["image_tok"][0].tolist()[:6] == [-1, -1, -1, -1, 0, -1]
    assert rows["video_tok"][1].tolist()[:6] == [-1, -1, -1, 1, 2, -1]
    alone = R.text_rows([s], [IMAGE, VIDEO])
    assert alone["video_tok"][0].tolist()[:4] == [-1, 0, 1, -1]
    packed = R.packed_text_rows([s, s], {}, 1, 2, [(IMAGE, VIDEO)])
    assert packed["video_tok"][0][packed["video_tok"][0] >= 0].tolist() == [1, 2, 1, 2]


def test_the_tower_reads_each_image_then_each_temporal_patch_of_each_clip():
    """`segments_of`: the image first (whatever the text's order), then the clip's two temporal
    patches, each patch's features its frames' patches in frame order; a still image enters as
    its frame repeated, which is a temporal patch of two equal frames."""
    from maestro_jax.models import ViTConfig

    vit = ViTConfig(patch=4, channels=3, width=8, depth=1, heads=1, mlp=8, out_width=8, merge=2, frames=2)
    s = _mixed()
    segments = segments_of(s, vit)
    assert len(segments) == 3 and visual_patches(s.info(), vit) == 3 * 4
    clip, image = s.of("video")[0], s.of("image")[0]
    np.testing.assert_array_equal(segments[0][0], patchify(image, 4, 2, 2)[0])
    for k, (pieces, grid) in enumerate(segments[1:]):
        first, second = patchify(clip[2 * k], 4, 2)[0], patchify(clip[2 * k + 1], 4, 2)[0]
        np.testing.assert_array_equal(pieces, np.concatenate([first, second], axis=1))
        np.testing.assert_array_equal(grid, patchify(image, 4, 2)[1])
    still = np.stack([image, image])
    np.testing.assert_array_equal(patchify(still, 4, 2, 2)[0], patchify(image, 4, 2, 2)[0])
    with pytest.raises(ValueError, match="a temporal patch of 3 frames; the tower's patches span 2"):
        patchify(clip[:3], 4, 2, 2)


def _llm(**kw):
    return LLMConfig(vocab=16, width=8, depth=1, heads=1, kv_heads=1, head_dim=8, mlp=8, mrope_section=(2, 1, 1), **kw)


def test_clips_are_positioned_as_qwen2_5_vl_and_qwen3_vl_do():
    """Qwen2.5-VL: a clip's temporal patch f at f * tokens_per_second * its seconds per temporal
    patch (the sample's tag, else 1.0); Qwen3-VL (`video_timestamps`): each temporal patch
    positioned on its own. A tag giving another number of values than clips is one line."""
    s = _mixed()
    grids_image, clip = [(1, 1)], (2, 1, 1)
    ids = s.tokens[:-1]
    plain = sample_positions(_llm(video_tokens_per_second=4.0), {EDGE: (IMAGE, VIDEO)})
    np.testing.assert_array_equal(plain(s), mrope_positions(ids, 1, grids_image, 2, [(*clip, 4.0)]))
    tagged = dataclasses.replace(s, tags={SECONDS_PER_PATCH: "0.5"})
    want = mrope_positions(ids, 1, grids_image, 2, [(*clip, 2.0)])
    np.testing.assert_array_equal(plain(tagged), want)
    assert not np.array_equal(want, plain(s))
    stamped = sample_positions(_llm(video_timestamps=True), {EDGE: (IMAGE, VIDEO)})
    np.testing.assert_array_equal(stamped(s), mrope_positions(ids, 1, grids_image, 2, frame_by_frame([clip])))
    with pytest.raises(ValueError, match=f"tag {SECONDS_PER_PATCH}='1 2' gives 2 values for 1 clips"):
        plain(dataclasses.replace(s, tags={SECONDS_PER_PATCH: "1 2"}))


def _monolithic_loss(rt, samples):
    step = rt.monolithic.step
    loss, _, _ = step.gradients(step.init(), samples)
    return float(np.asarray(loss))


def test_a_clip_is_its_temporal_patches_as_images():
    """The monolithic step (one program, every section) on a batch whose first sample holds an
    image and a clip of 4 frames, each temporal patch two equal frames, gives the loss of the same
    batch with the clip's two patches given as two more images on image placeholders: the tower
    runs each temporal patch as a segment, its tokens go where the clip's placeholders are. With
    the clip's last frame changed, the loss changes (the clip reaches the loss)."""
    from maestro_jax.runtime.build import build_runtime

    rt = build_runtime(load_config(VLM, TEMPORAL))
    batch = list(rt.batches()[0])
    image = np.random.default_rng(1).standard_normal((8, 8, 3)).astype(np.float32)
    frames = np.random.default_rng(2).standard_normal((2, 8, 8, 3)).astype(np.float32)
    clip = np.repeat(frames, 2, axis=0)  # f0 f0 f1 f1
    text = [5, 6, 7, 8, 9, 10]
    as_clip = Sample(
        batch[0].id, np.array([*text[:3], 1, 2, 2, *text[3:]], np.int32), {"image": (image,), "video": (clip,)}
    )
    as_images = Sample(batch[0].id, np.array([*text[:3], 1, 1, 1, *text[3:]], np.int32), {"image": (image, *frames)})
    changed = clip.copy()
    changed[3] += 1.0
    moved = dataclasses.replace(as_clip, items={"image": (image,), "video": (changed,)})
    losses = [_monolithic_loss(rt, [s, *batch[1:]]) for s in (as_clip, as_images, moved)]
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)
    assert abs(losses[2] - losses[0]) > 1e-4


# slow: the quick tier holds its parts, test_a_clip_is_its_temporal_patches_as_images (temporal patches in the
# monolithic step) and test_workloads.py::test_each_workload_matches_the_monolithic_step[wavefront-vlm] (clips verified)
@pytest.mark.slow
@pytest.mark.parametrize("scheduler", ["naive", "wavefront"])
def test_a_batch_of_text_images_and_clips_verifies(scheduler):
    """`verify` on a batch mixing text-only samples, images and clips of 2 and 4 frames under a
    tower of temporal patches (Qwen-VL's layout): the sectioned step is the monolithic one."""
    from maestro_jax.runtime.build import build_runtime
    from maestro_jax.tools.verify import verify

    cfg = load_config(VLM, [*TEMPORAL, "data.modalities.video.fraction=0.5", f"schedule.scheduler={scheduler}"])
    rt = build_runtime(cfg)
    batch = rt.batches()[0]
    assert any(s.has("video") for s in batch) and any(s.has("image") for s in batch)
    assert any(not (s.has("video") or s.has("image")) for s in batch)
    diffs = verify(cfg, rt)
    assert {d.name for d in diffs} >= {"loss", "vision/grads", "llm/grads"}
    assert all(d.max_rel <= 1e-5 for d in diffs), diffs


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["workload_settings.video_token=null"],
            "error: data.modalities.video: workload 'vlm' takes ['image'] (with workload_settings.video_token set, "
            "video too)",
        ),
        (
            ["models.vision.frames=2", "data.modalities.video.sizes=[[3,8,8]]"],
            "error: data.modalities.video.sizes=[[3, 8, 8]]: 3x8x8; valid: frames x height x width, frames a "
            "multiple of models.vision frames=2, each side a multiple of models.vision patch*merge=8",
        ),
        (
            ["workload_settings.video_token=1"],
            "error: workload_settings.video_token=1",
        ),
    ],
)
def test_a_video_setting_the_model_cannot_take_is_one_line(overrides, message):
    from maestro_jax.runtime.build import build_runtime

    with pytest.raises(ConfigError) as err:
        build_runtime(load_config(VLM, [*TINY_VLM, *overrides]))
    assert str(err.value).startswith(message) and "\n" not in str(err.value), str(err.value)


def test_a_clip_the_tower_cannot_take_is_a_bad_sample():
    """A clip whose frames do not fill its temporal patches, or longer than video_max_frames, is a
    DataError naming the sample and what is valid."""
    from maestro_jax.workloads import sample_check

    check = sample_check(load_config(VLM, [*TEMPORAL, "workload_settings.video_max_frames=4"]))
    odd = dataclasses.replace(
        _mixed(), items={"image": _mixed().of("image"), "video": (np.zeros((3, 8, 8, 3), np.float32),)}
    )
    with pytest.raises(
        DataError, match=r"sample id=0: video 0 is 3x8x8; each side must be a positive multiple of 2x8x8"
    ):
        check(odd)
    long = dataclasses.replace(
        _mixed(), items={"image": _mixed().of("image"), "video": (np.zeros((6, 8, 8, 3), np.float32),)}
    )
    with pytest.raises(DataError, match=r"sample id=0: video 0 is 6x8x8, larger than the model takes \(4x"):
        check(long)
