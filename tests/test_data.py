"""Data: sample validation names the bad sample; the ArrayRecord path trains end to end."""

import subprocess
import sys

import numpy as np
import pytest
from conftest import ROOT, TINY_VLM
from PIL import Image

from maestro_jax.config import load_config
from maestro_jax.data import (
    IMAGE_TOKEN,
    ArrayRecordSource,
    DataError,
    Sample,
    SyntheticSource,
    decode_sample,
    encode_sample,
    global_batches,
    validate_sample,
)
from maestro_jax.training.loop import train


def good(**kw):
    base = dict(id=7, tokens=np.array([IMAGE_TOKEN] * 1 + [5, 6, 7], np.int32),
                images=(np.zeros((8, 8, 3), np.float32),))
    base.update(kw)
    return Sample(**base)


@pytest.mark.parametrize("sample,text", [
    (good(tokens=np.array([1.0, 5.0, 6.0], np.float32)), "1-D integer"),
    (good(tokens=np.array([IMAGE_TOKEN, IMAGE_TOKEN, 5, 6], np.int32)), "2 image-placeholder tokens but its images need 1"),
    (good(tokens=np.array([IMAGE_TOKEN, 5], np.int32)), "at least 2 text tokens"),
    (good(images=(np.full((8, 8, 3), np.nan, np.float32),)), "NaN or inf"),
    (good(images=(np.zeros((8, 6, 3), np.float32),)), "multiples of patch*merge = 8"),
    (good(images=(np.zeros((8, 8), np.float32),)), "float32 H x W x C"),
])
def test_bad_samples_rejected_with_id(sample, text):
    with pytest.raises(DataError, match="sample id=7") as info:
        validate_sample(sample, patch=4, merge=2)
    assert text in str(info.value)


def test_too_long_rejected():
    with pytest.raises(DataError, match="exceed the largest bucket"):
        validate_sample(good(), 4, 2, max_tokens=3)


def test_record_round_trip():
    s = SyntheticSource(num_samples=8, vocab=300, text_len=(5, 9), image_fraction=1.0, max_images=2,
                        image_sizes=((8, 8), (16, 8)), patch=4, merge=2)[3]
    r = decode_sample(encode_sample(s))
    assert r.id == s.id and (r.tokens == s.tokens).all()
    assert len(r.images) == len(s.images) and all(a.shape == b.shape for a, b in zip(r.images, s.images))


def test_shuffle_is_seeded_and_batches_deterministic():
    src = SyntheticSource(num_samples=64, vocab=50, text_len=(3, 6))
    a = [s.id for s in global_batches(src, 8, seed=3)[2]]
    b = [s.id for s in global_batches(src, 8, seed=3)[2]]
    c = [s.id for s in global_batches(src, 8, seed=4)[2]]
    assert a == b and a != c and len(set(a)) == 8


def test_convert_folder_and_train(tmp_path):
    folder = tmp_path / "imgs"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for i in range(12):
        if i % 3:
            Image.fromarray(rng.integers(0, 255, (20 + 4 * i, 24, 3), dtype=np.uint8)).save(folder / f"s{i}.png")
        (folder / f"s{i}.txt").write_text(f"caption number {i} of a test image")
    out = tmp_path / "data.array_record"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts/convert_images.py"), str(folder), str(out),
                           "--patch", "4", "--merge", "2", "--max-side", "16"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "wrote 12 samples" in proc.stdout
    src = ArrayRecordSource((str(out),), patch=4, merge=2)
    assert len(src) == 12 and sum(s.has_image for s in (src[i] for i in range(12))) == 8
    cfg = load_config(ROOT / "configs/vlm_tiny.yaml", TINY_VLM + [
        "data.kind=array_record", f"data.paths=[{out}]", "steps=2", "models.llm.vocab=258"])
    history = train(cfg, progress=False)
    assert len(history) == 2 and all(np.isfinite(h["loss"]) for h in history)
