"""Data: sample validation names the bad sample; the ArrayRecord path trains end to end."""

import subprocess
import sys

import numpy as np
import pytest
from conftest import ROOT, TINY_VLM
from PIL import Image

from maestro_jax.config import load_config
from maestro_jax.data import (
    AUDIO_TOKEN,
    IMAGE_TOKEN,
    ArrayRecordSource,
    DataError,
    Modality,
    Sample,
    SyntheticItems,
    SyntheticSource,
    decode_sample,
    encode_sample,
    global_batches,
    validate_sample,
    write_index,
)
from maestro_jax.data.samples import decoded_bytes, record_info
from maestro_jax.training.loop import train

IMAGE = Modality("image", IMAGE_TOKEN, (8, 8), 3, max_shape=(32, 32))
AUDIO = Modality("audio", AUDIO_TOKEN, (4,), 16)


def good(images=(np.zeros((8, 8, 3), np.float32),), **kw):
    base = dict(id=7, tokens=np.array([IMAGE_TOKEN] * 1 + [5, 6, 7], np.int32), items={"image": images})
    base.update(kw)
    return Sample(**base)


@pytest.mark.parametrize("sample,text", [
    (good(tokens=np.array([1.0, 5.0, 6.0], np.float32)), "1-D integer"),
    (good(tokens=np.array([IMAGE_TOKEN, IMAGE_TOKEN, 5, 6], np.int32)), "2 image-placeholder tokens but its image items need 1"),
    (good(tokens=np.array([IMAGE_TOKEN, 5], np.int32)), "at least 2 text tokens"),
    (good(images=(np.full((8, 8, 3), np.nan, np.float32),)), "NaN or inf"),
    (good(images=(np.zeros((8, 6, 3), np.float32),)), "positive multiple of 8x8"),
    (good(images=(np.zeros((0, 8, 3), np.float32),)), "positive multiple of 8x8"),
    (good(images=(np.zeros((8, 8), np.float32),)), "float32 with 2 spatial dims and 3 channels"),
    (good(images=(np.zeros((8, 8, 4), np.float32),)), "float32 with 2 spatial dims and 3 channels"),
    (good(images=(np.zeros((40, 8, 3), np.float32),)), "larger than the model takes (32x32)"),
    (good(tokens=np.array([IMAGE_TOKEN, 5, -6, 7], np.int32)), "token id -6 is outside the vocabulary"),
    (good(tokens=np.array([IMAGE_TOKEN, 5, 600, 7], np.int32)), "token id 600 is outside the vocabulary"),
    (good(items={"image": (np.zeros((8, 8, 3), np.float32),), "video": (np.zeros((8, 8, 3), np.float32),)}),
     "has video items, but this workload takes ['audio', 'image']"),
    (good(tokens=np.array([IMAGE_TOKEN, AUDIO_TOKEN, 5, 6], np.int32)), "1 audio-placeholder tokens but its audio"),
])
def test_bad_samples_rejected_with_id(sample, text):
    with pytest.raises(DataError, match="sample id=7") as info:
        validate_sample(sample, (IMAGE, AUDIO), vocab=300)
    assert text in str(info.value)


def test_good_sample_with_two_modalities_passes():
    s = good(tokens=np.array([IMAGE_TOKEN, 5, AUDIO_TOKEN, AUDIO_TOKEN, 6], np.int32),
             items={"image": (np.zeros((8, 8, 3), np.float32),), "audio": (np.zeros((8, 16), np.float32),)})
    assert validate_sample(s, (IMAGE, AUDIO), vocab=300) is s


def test_too_long_rejected():
    with pytest.raises(DataError, match="exceed the largest bucket"):
        validate_sample(good(), (IMAGE,), max_tokens=3)


def test_record_round_trip_and_info_without_payload():
    src = SyntheticSource(num_samples=8, vocab=300, text_len=(5, 9),
                          items=(SyntheticItems(IMAGE, 1.0, 2, ((8, 8), (16, 8))), SyntheticItems(AUDIO, 1.0, 2, ((8,),))))
    s = src[3]
    r = decode_sample(encode_sample(s))
    assert r.id == s.id and (r.tokens == s.tokens).all()
    for m in ("image", "audio"):
        assert r.shapes(m) == s.shapes(m) and len(s.of(m)) >= 1
    assert np.allclose(r.of("audio")[0], s.of("audio")[0])
    info = src.info(3)
    assert info.length == s.length and info.item_shapes == {m: s.shapes(m) for m in ("image", "audio")}
    assert validate_sample(s, (IMAGE, AUDIO), vocab=300) is s


def test_parts_decode_alone_and_the_rest_stays_hollow():
    """Synthetic and encoded samples give each part (`tokens`, a modality) without the others;
    the hollow parts have the right shapes and are zeros; metadata comes from npy headers."""
    src = SyntheticSource(num_samples=8, vocab=300, text_len=(5, 9),
                          items=(SyntheticItems(IMAGE, 1.0, 2, ((8, 8), (16, 8))), SyntheticItems(AUDIO, 1.0, 2, ((8,),))))
    whole = src[5]
    record = encode_sample(whole)
    stored = decode_sample(record)  # images come back quantised to uint8 (and clipped to [-1, 1])
    info = record_info(record)
    assert (info.id, info.length, dict(info.item_shapes)) == (5, whole.length, {m: whole.shapes(m) for m in whole.items})
    for part in ("tokens", "image", "audio"):
        synthetic, read = src.read(5, frozenset({part}))
        decoded = decode_sample(record, frozenset({part}))
        assert read == 0
        for got, ref in ((synthetic, whole), (decoded, stored)):
            assert got.length == whole.length and all(got.shapes(m) == whole.shapes(m) for m in whole.items)
            assert (got.tokens == whole.tokens).all() if part == "tokens" else not got.tokens.any()
            for m in ("image", "audio"):
                expected = ref.of(m) if m == part else [np.zeros_like(x) for x in ref.of(m)]
                assert all(np.array_equal(g, e) for g, e in zip(got.of(m), expected))
        assert decoded_bytes(synthetic, frozenset({part})) == decoded_bytes(whole, frozenset({part})) > 0
    assert decoded_bytes(whole) == sum(decoded_bytes(whole, frozenset({p})) for p in ("tokens", "image", "audio"))


def test_array_record_index_gives_metadata_without_reading_records(tmp_path):
    from array_record.python.array_record_module import ArrayRecordWriter

    src = SyntheticSource(num_samples=6, vocab=300, text_len=(5, 9), items=(SyntheticItems(IMAGE, 0.5, 2, ((8, 8),)),))
    path = tmp_path / "d.array_record"
    writer = ArrayRecordWriter(str(path), "group_size:1")
    for i in range(6):
        writer.write(encode_sample(src[i]))
    writer.close()
    headers = [ArrayRecordSource((str(path),)).info(i) for i in range(6)]  # no index: npy headers
    write_index(str(path))
    indexed = ArrayRecordSource((str(path),))
    for i in range(6):
        for info in (headers[i], indexed.info(i)):
            assert (info.id, info.length, dict(info.item_shapes)) == (i, src[i].length, dict(src.info(i).item_shapes))
    sample, read = indexed.read(2, frozenset({"tokens"}))
    assert read > 0 and (sample.tokens == src[2].tokens).all()
    (tmp_path / "d.array_record.index.json").write_text("[]")
    with pytest.raises(DataError, match="index files list 0 records but the files hold 6"):
        ArrayRecordSource((str(path),))


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
    src = ArrayRecordSource((str(out),))
    assert len(src) == 12 and sum(s.has("image") for s in (src[i] for i in range(12))) == 8
    cfg = load_config(ROOT / "configs/vlm_tiny.yaml", TINY_VLM + [
        "data.kind=array_record", f"data.paths=[{out}]", "steps=2", "models.llm.vocab=261"])
    history = train(cfg, progress=False)
    assert len(history) == 2 and all(np.isfinite(h["loss"]) for h in history)
