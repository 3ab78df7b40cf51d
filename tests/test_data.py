"""Data: sample validation names the bad sample; the ArrayRecord path trains end to end."""

import subprocess
import sys

import numpy as np
import pytest
from conftest import ROOT, TINY_VLM
from PIL import Image

from maestro_jax import workloads
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


def good(images=(np.zeros((8, 8, 3), np.float32),), **kw):  # noqa: B008 - never mutated
    base = dict(id=7, tokens=np.array([IMAGE_TOKEN] * 1 + [5, 6, 7], np.int32), items={"image": images})
    base.update(kw)
    return Sample(**base)


@pytest.mark.parametrize(
    "sample,text",
    [
        (good(tokens=np.array([1.0, 5.0, 6.0], np.float32)), "1-D integer"),
        (
            good(tokens=np.array([IMAGE_TOKEN, IMAGE_TOKEN, 5, 6], np.int32)),
            "2 image-placeholder tokens but its image items need 1",
        ),
        (good(tokens=np.array([IMAGE_TOKEN, 5], np.int32)), "at least 2 text tokens"),
        (good(images=(np.full((8, 8, 3), np.nan, np.float32),)), "NaN or inf"),
        (
            good(images=(np.zeros((8, 6, 3), np.float32),)),
            "8x6; each side must be a positive multiple of 8x8, at most 32x32",
        ),
        (
            good(images=(np.zeros((0, 8, 3), np.float32),)),
            "0x8; each side must be a positive multiple of 8x8, at most 32x32",
        ),
        (
            good(images=(np.zeros((8, 0, 3), np.float32),)),
            "8x0; each side must be a positive multiple of 8x8, at most 32x32",
        ),
        (
            good(images=(np.zeros((8, 8), np.float32),)),
            "must have 2 spatial dims and 3 channels last, got shape [8, 8]",
        ),
        (
            good(images=(np.zeros((8, 8, 4), np.float32),)),
            "image 0 has 4 channels (shape [8, 8, 4]); the model takes 3",
        ),
        (good(images=(np.zeros((8, 8, 3), np.float64),)), "image 0 must be float32, got float64"),
        (good(images=(np.zeros((40, 8, 3), np.float32),)), "larger than the model takes (32x32)"),
        (good(tokens=np.array([IMAGE_TOKEN, 5, -6, 7], np.int32)), "token id -6 is outside the valid ids [0, 300)"),
        (good(tokens=np.array([IMAGE_TOKEN, 5, 600, 7], np.int32)), "token id 600 is outside the valid ids [0, 300)"),
        (
            good(items={"image": (np.zeros((8, 8, 3), np.float32),), "video": (np.zeros((8, 8, 3), np.float32),)}),
            "has video items, but this workload takes ['audio', 'image']",
        ),
        (good(tokens=np.array([IMAGE_TOKEN, AUDIO_TOKEN, 5, 6], np.int32)), "1 audio-placeholder tokens but its audio"),
        (
            good(loss_mask=np.ones(3, np.uint8)),
            "loss_mask has 3 entries but the sample has 4 tokens; give one per token",
        ),
        (good(loss_mask=np.array([0, 1, 2, 1], np.uint8)), "loss_mask holds 2; valid entries are 0 (no loss) and 1"),
        (
            good(loss_mask=np.ones(4, np.float32)),
            "loss_mask must be a 1-D array of 0/1 (bool or integer), got float32[4]",
        ),
    ],
)
def test_bad_samples_rejected_with_id(sample, text):
    with pytest.raises(DataError, match="sample id=7") as info:
        validate_sample(sample, (IMAGE, AUDIO), vocab=300)
    assert text in str(info.value)


def test_good_sample_with_two_modalities_passes():
    s = good(
        tokens=np.array([IMAGE_TOKEN, 5, AUDIO_TOKEN, AUDIO_TOKEN, 6], np.int32),
        items={"image": (np.zeros((8, 8, 3), np.float32),), "audio": (np.zeros((8, 16), np.float32),)},
    )
    assert validate_sample(s, (IMAGE, AUDIO), vocab=300) is s


def test_too_long_rejected():
    with pytest.raises(DataError, match="exceed the largest bucket"):
        validate_sample(good(), (IMAGE,), max_tokens=3)


def test_record_round_trip_and_info_without_payload():
    src = SyntheticSource(
        num_samples=8,
        vocab=300,
        text_len=(5, 9),
        items=(SyntheticItems(IMAGE, 1.0, 2, ((8, 8), (16, 8))), SyntheticItems(AUDIO, 1.0, 2, ((8,),))),
    )
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
    src = SyntheticSource(
        num_samples=8,
        vocab=300,
        text_len=(5, 9),
        items=(SyntheticItems(IMAGE, 1.0, 2, ((8, 8), (16, 8))), SyntheticItems(AUDIO, 1.0, 2, ((8,),))),
    )
    whole = src[5]
    record = encode_sample(whole)
    stored = decode_sample(record)  # images come back quantised to uint8 (and clipped to [-1, 1])
    info = record_info(record)
    assert (info.id, info.length, dict(info.item_shapes)) == (
        5,
        whole.length,
        {m: whole.shapes(m) for m in whole.items},
    )
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


def test_loss_mask_is_stored_with_the_tokens_and_counted_where_they_are_decoded(tmp_path):
    """The mask goes into the record and comes back with the `tokens` part (not with an image
    part: a hollow sample has none); metadata ignores it. Per process, the normaliser is
    counted by the reader that decodes the tokens, and equals the count over whole samples."""
    from array_record.python.array_record_module import ArrayRecordWriter

    from maestro_jax.data import BatchReader, ReadPlan
    from maestro_jax.workloads.rows import loss_tokens

    src = SyntheticSource(num_samples=8, vocab=300, text_len=(5, 9), items=(SyntheticItems(IMAGE, 1.0, 2, ((8, 8),)),))
    masked = []
    for i in range(8):
        s = src[i]
        mask = (np.arange(s.length) % 3 != 0).astype(np.uint8)
        masked.append(Sample(s.id, s.tokens, s.items, loss_mask=mask))
    record = encode_sample(masked[2])
    whole, tokens, image = (
        decode_sample(record, parts) for parts in (None, frozenset({"tokens"}), frozenset({"image"}))
    )
    assert whole.loss_mask.dtype == np.uint8 and (whole.loss_mask == masked[2].loss_mask).all()
    assert (tokens.loss_mask == masked[2].loss_mask).all() and image.loss_mask is None
    assert record_info(record).length == masked[2].length
    assert decoded_bytes(whole, frozenset({"tokens"})) == masked[2].tokens.nbytes + masked[2].length
    assert validate_sample(whole, (IMAGE,), vocab=300) is whole
    with pytest.raises(DataError, match="sample id=7: loss_mask holds 2"):  # never cast into a valid-looking mask
        encode_sample(good(loss_mask=np.array([0, 1, 2, 1], np.int64)))

    path = tmp_path / "masked.array_record"
    writer = ArrayRecordWriter(str(path), "group_size:1")
    for s in masked:
        writer.write(encode_sample(s))
    writer.close()
    write_index(str(path))
    stored = ArrayRecordSource((str(path),))
    count = loss_tokens((IMAGE,))
    full = count([stored[i] for i in range(8)])
    assert 0 < full < count([Sample(s.id, s.tokens, s.items) for s in masked])

    def read(parts, counts):
        reader = BatchReader(
            stored, 8, 0, False, plan=lambda infos: ReadPlan([parts] * 8, [counts] * 8, None), loss_count=count
        )
        return next(reader)

    assert read(frozenset({"tokens"}), True).loss_count == full  # the process holding the LLM's rows
    held = read(frozenset({"image"}), False)  # the process holding only vision rows
    assert held.loss_count == 0 and all(s.loss_mask is None for s in held.samples)


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
    with pytest.raises(DataError, match=r"d.array_record.index.json lists 0 records but .*d.array_record holds 6"):
        ArrayRecordSource((str(path),))


def test_shuffle_is_seeded_and_batches_deterministic():
    src = SyntheticSource(num_samples=64, vocab=50, text_len=(3, 6))
    a = [s.id for s in global_batches(src, 8, seed=3)[2]]
    b = [s.id for s in global_batches(src, 8, seed=3)[2]]
    c = [s.id for s in global_batches(src, 8, seed=4)[2]]
    assert a == b and a != c and len(set(a)) == 8


@pytest.mark.slow
@pytest.mark.extended
def test_convert_folder_and_train(tmp_path):
    folder = tmp_path / "imgs"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for i in range(12):
        if i % 3:
            Image.fromarray(rng.integers(0, 255, (20 + 4 * i, 24, 3), dtype=np.uint8)).save(folder / f"s{i}.png")
        (folder / f"s{i}.txt").write_text(f"caption number {i} of a test image")
    out = tmp_path / "data.array_record"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts/convert_images.py"),
            str(folder),
            str(out),
            "--patch",
            "4",
            "--merge",
            "2",
            "--max-side",
            "16",
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert "wrote 12 samples" in proc.stdout
    src = ArrayRecordSource((str(out),))
    assert len(src) == 12 and sum(s.has("image") for s in (src[i] for i in range(12))) == 8
    cfg = load_config(
        ROOT / "configs/vlm_tiny.yaml",
        TINY_VLM + ["data.kind=array_record", f"data.paths=[{out}]", "steps=2", "models.llm.vocab=261"],
    )
    history = train(cfg, progress=False)
    assert len(history) == 2 and all(np.isfinite(h["train/loss"]) for h in history)


def test_convert_folder_with_the_configs_image_id(tmp_path):
    """With --config, convert_images.py puts the config's image id (7 here) on the image tokens,
    and byte-level text skips it (byte 4 would be id 7 under the default layout)."""
    folder = tmp_path / "imgs"
    folder.mkdir()
    Image.fromarray(np.zeros((16, 8, 3), np.uint8)).save(folder / "a.png")
    (folder / "a.txt").write_text("four \x04 and seven")
    out = tmp_path / "seven.array_record"
    settings = ["--set", "workload_settings.image_token=7"]
    script = [sys.executable, str(ROOT / "scripts/convert_images.py"), str(folder), str(out), "--max-side", "16"]
    proc = subprocess.run(
        script + ["--config", str(ROOT / "configs/vlm_tiny.yaml"), *settings], capture_output=True, text=True
    )
    assert proc.returncode == 0 and "wrote 1 samples" in proc.stdout, proc.stderr
    cfg = load_config(ROOT / "configs/vlm_tiny.yaml", ["workload_settings.image_token=7"])
    s = workloads.sample_check(cfg)(ArrayRecordSource((str(out),))[0])
    assert np.count_nonzero(s.tokens == 7) == workloads.modalities_of(cfg)[0].tokens((16, 8)) == 2
    assert s.tokens[s.tokens != 7].tolist() == [3 + b if 3 + b < 7 else 4 + b for b in b"four \x04 and seven"]
    proc = subprocess.run(
        script + ["--config", str(ROOT / "configs/vlm_tiny.yaml"), "--patch", "4"], capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: --patch/--merge: the config sets them (models.vision); valid: leave them out"
    ]


# -- bad values in stored samples: caught against the model's own limits, named by file and record --
def write_array_record(path, records, options="group_size:1"):
    from array_record.python.array_record_module import ArrayRecordWriter

    writer = ArrayRecordWriter(str(path), options)
    for record in records:
        writer.write(record)
    writer.close()


def raw_record(sample_id, tokens, image=None):
    """A record as stored, without `encode_sample`'s casts (tokens of any dtype, any image)."""
    import io

    buf = io.BytesIO()
    np.savez(buf, id=np.int64(sample_id), tokens=tokens, **({} if image is None else {"image_0": image}))
    return buf.getvalue()


def good_records(count, first_id=0, seed=0):
    rng = np.random.default_rng(seed)
    return [
        encode_sample(
            Sample(
                first_id + i,
                np.array([IMAGE_TOKEN, *rng.integers(3, 200, 9)], np.int32),
                {"image": (rng.uniform(-1, 1, (8, 8, 3)).astype(np.float32),)},
            )
        )
        for i in range(count)
    ]


VLM = ROOT / "configs/vlm_tiny.yaml"
# vocab 261 and max_grid 4 (patch 4: images up to 16x16) are the limits every record is checked against
LIMITS = ["models.llm.vocab=261", "models.vision.max_grid=4"]
TEXT = [5, 6, 7, 8]
BAD_VALUES = {  # record -> (the record, what its error must say)
    3: (
        raw_record(3, np.array([IMAGE_TOKEN, 5, -5, 7], np.int32), np.zeros((8, 8, 3), np.uint8)),
        "token id -5 is outside the valid ids [0, 261) (the model's vocabulary)",
    ),
    4: (
        raw_record(4, np.array([5, 6, 2**32 + 7, 8], np.int64)),  # an int32 cast would make it id 7
        "token id 4294967303 is outside the valid ids [0, 261) (the model's vocabulary)",
    ),
    6: (raw_record(6, np.array([5.5, 6, 7, 8], np.float32)), "tokens must be a 1-D integer array, got float32[4]"),
    10: (
        raw_record(10, np.array(TEXT, np.int32), np.zeros((0, 8, 3), np.uint8)),
        "image 0 is 0x8; each side must be a positive multiple of 8x8, at most 16x16",
    ),
    12: (
        raw_record(12, np.array(TEXT, np.int32), np.zeros((8, 0, 3), np.uint8)),
        "image 0 is 8x0; each side must be a positive multiple of 8x8, at most 16x16",
    ),
    14: (
        raw_record(14, np.array([IMAGE_TOKEN, *TEXT], np.int32), np.zeros((8, 8, 4), np.uint8)),  # RGBA
        "image 0 has 4 channels (shape [8, 8, 4]); the model takes 3",
    ),
    17: (
        raw_record(17, np.array([IMAGE_TOKEN] * 3 + TEXT, np.int32), np.zeros((24, 8, 3), np.uint8)),
        "image 0 is 24x8, larger than the model takes (16x16)",
    ),
    19: (
        raw_record(19, np.array([5, 6, 261, 8], np.int32)),
        "token id 261 is outside the valid ids [0, 261) (the model's vocabulary)",
    ),
}


@pytest.fixture(scope="module")
def bad_values(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "values.array_record"
    records = good_records(24)
    for r, (record, _) in BAD_VALUES.items():
        records[r] = record
    write_array_record(path, records)
    write_index(str(path))
    return path, TINY_VLM + LIMITS + ["data.kind=array_record", f"data.paths=[{path}]", "data.shuffle=false", "steps=2"]


@pytest.mark.slow
def test_bad_values_are_skipped_and_reported_by_file_and_record(bad_values, tmp_path):
    """Negative, wrapped (beyond int32) or float token ids, ids at the vocabulary, empty, RGBA or
    too large images: under `skip` none is trained on, each is reported in metrics.jsonl with
    its file, record, field and valid range, from limits read off the model configs."""
    import json

    path, overrides = bad_values
    history = train(load_config(VLM, overrides + ["data.on_bad_sample=skip", f"output_dir={tmp_path}"]), progress=False)
    trained = [i for r in history for i in r["sample_ids"]]
    assert trained == [i for i in range(24) if i not in BAD_VALUES]
    logged = [
        m for line in (tmp_path / "metrics.jsonl").read_text().splitlines() for m in json.loads(line)["skipped_samples"]
    ]
    assert sorted(logged) == sorted(
        f"record {r} of {path}: sample id={r}: {text}" for r, (_, text) in BAD_VALUES.items()
    )
    assert all(np.isfinite(r["train/loss"]) for r in history)


@pytest.mark.slow
def test_bad_value_under_error_is_one_line_naming_file_and_record(bad_values, capsys):
    from maestro_jax import cli

    path, overrides = bad_values
    assert cli.main(["train", "--config", str(VLM), *overrides]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert errors == [f"error: record 3 of {path}: sample id=3: {BAD_VALUES[3][1]}"]


def test_limits_come_from_the_model_configs():
    """The vocabulary and the image grid are the models' own: changing `models.*` moves them;
    for KD both the teacher's and the student's embedding take the ids, so they must agree."""
    from maestro_jax.config import ConfigError
    from maestro_jax.workloads import sample_check

    check = sample_check(load_config(VLM, TINY_VLM + ["models.llm.vocab=300", "models.vision.max_grid=6"]))
    tokens = np.array([IMAGE_TOKEN] * 3 + [5, 299], np.int32)
    assert check(Sample(1, tokens, {"image": (np.zeros((24, 8, 3), np.float32),)})).id == 1  # 24 = 6 patches of 4
    with pytest.raises(DataError, match="image 0 is 32x8, larger than the model takes \\(24x24\\)"):
        check(Sample(1, np.array([IMAGE_TOKEN] * 4 + [5, 6], np.int32), {"image": (np.zeros((32, 8, 3), np.float32),)}))
    with pytest.raises(DataError, match=r"token id 300 is outside the valid ids \[0, 300\)"):
        check(Sample(1, np.array([5, 300], np.int32)))
    kd = ROOT / "configs/kd_tiny.yaml"
    check = sample_check(load_config(kd, ["models.teacher.vocab=77", "models.student.vocab=77"]))
    with pytest.raises(DataError, match=r"token id 77 is outside the valid ids \[0, 77\)"):
        check(Sample(1, np.array([5, 77], np.int32)))
    with pytest.raises(ConfigError, match=r"^error: models.teacher.vocab=80: differs from models.student.vocab=77 "):
        sample_check(load_config(kd, ["models.teacher.vocab=80", "models.student.vocab=77"]))


# -- damaged ArrayRecord files -------------------------------------------------------------------
def damaged_file(path, seed=0):
    """12 good records (ids 100..111), stored uncompressed so that each record's bytes can be
    found in the file: one bit of record 3 flipped, 16 random bytes over the middle of record 7."""
    records = good_records(12, first_id=100, seed=seed)
    write_array_record(path, records, "group_size:1,uncompressed")
    data = bytearray(path.read_bytes())
    at3, at7 = data.find(records[3]), data.find(records[7])
    assert at3 > 0 and at7 > 0
    data[at3 + len(records[3]) // 2] ^= 0x04
    middle = at7 + len(records[7]) // 2
    data[middle : middle + 16] = np.random.default_rng(seed).integers(0, 256, 16, dtype=np.uint8).tobytes()
    path.write_bytes(bytes(data))
    return path


@pytest.mark.slow
def test_damaged_records_are_bad_samples_named_by_file_and_record(tmp_path, capsys):
    """Damaged records in the second of two files (no index: found when metadata is read, on
    every process): `skip` trains on the rest and reports each with its file and record;
    `error` stops with one line naming them, status 2."""
    import json

    from maestro_jax import cli

    first, second = tmp_path / "first.array_record", damaged_file(tmp_path / "second.array_record")
    write_array_record(first, good_records(12))
    overrides = TINY_VLM + [
        "data.kind=array_record",
        f"data.paths=[{first},{second}]",
        "data.shuffle=false",
        "models.llm.vocab=261",
        "steps=2",
    ]
    history = train(
        load_config(VLM, overrides + ["data.on_bad_sample=skip", f"output_dir={tmp_path / 'run'}"]), progress=False
    )
    assert [i for r in history for i in r["sample_ids"]] == [*range(12), 100, 101, 102, 104]
    logged = [
        m
        for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
        for m in json.loads(line)["skipped_samples"]
    ]
    assert len(logged) == 1 and logged[0].startswith(f"record 3 of {second}: cannot be read (")
    assert cli.main(["train", "--config", str(VLM), *overrides]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(f"error: record 3 of {second}: cannot be read (")
    source = ArrayRecordSource((str(first), str(second)))
    with pytest.raises(DataError, match=f"record 7 of {second}: cannot be read"):
        source[12 + 7]


def test_any_damage_inside_a_record_is_a_bad_sample(tmp_path):
    """One bit flipped anywhere inside a sample's npz, with the file's own checksums intact (the
    damage happened before the record was written): reading the record, its metadata or only
    some of its parts either decodes or fails as a DataError naming the record (a bad sample,
    skipped under `skip`), never another exception (a `zipfile.BadZipFile` traceback before)."""
    record = good_records(1, first_id=100)[0]
    flips = range(0, len(record), max(1, len(record) // 300))
    damaged = []
    for at in flips:
        b = bytearray(record)
        b[at] ^= 0x10
        damaged.append(bytes(b))
    path = tmp_path / "flipped.array_record"
    write_array_record(path, damaged, "group_size:1,uncompressed")
    source = ArrayRecordSource((str(path),))
    bad = 0
    for i in range(len(damaged)):
        for read, args in ((source.__getitem__, ()), (source.info, ()), (source.read, (frozenset({"tokens"}),))):
            try:
                read(i, *args)
            except DataError as err:
                assert str(err).startswith(f"record {i} of {path}: cannot be decoded ("), err
                bad += 1
    assert bad > len(damaged), "most flips land in zip headers or checksummed array bytes"


@pytest.mark.parametrize("damage", ["truncated", "random bytes over a block header", "zero bytes"])
@pytest.mark.parametrize("policy", ["skip", "error"])
def test_unopenable_file_stops_with_one_line_naming_it(tmp_path, capsys, damage, policy):
    """A file whose records cannot even be counted (cut short, a damaged block header, empty)
    cannot be skipped record by record: under either policy one `error:` line names it, status 2."""
    from maestro_jax import cli

    path = tmp_path / "d.array_record"
    write_array_record(path, good_records(16))
    data = path.read_bytes()
    damaged = {
        "truncated": data[: len(data) // 2],
        "zero bytes": b"",
        "random bytes over a block header": data[: 65536 - 8] + bytes(range(64)) + data[65536 + 56 :],
    }[damage]
    path.write_bytes(damaged)
    overrides = TINY_VLM + ["data.kind=array_record", f"data.paths=[{path}]", f"data.on_bad_sample={policy}"]
    assert cli.main(["train", "--config", str(VLM), *overrides]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(f"error: data.paths: {path} ")
    assert ("is empty" if damage == "zero bytes" else "cannot be opened as ArrayRecord") in errors[0]


# -- scripts/convert_images.py: bad input files are skipped and named, or stop it with --strict -----
@pytest.mark.parametrize(
    "case, said",
    [
        ("missing_folder", "error: FOLDER={tmp}/none: no such folder"),
        (
            "folder_is_a_file",
            "error: FOLDER={tmp}/caption.txt: not a folder; valid: a folder of images and their captions",
        ),
        (
            "no_out_folder",
            "error: OUT={tmp}/nowhere/out.array_record: its folder {tmp}/nowhere does not exist; create it first",
        ),
        ("out_is_a_folder", "error: OUT={tmp}/imgs: is a folder; valid: the name of the ArrayRecord file to write"),
    ],
)
def test_convert_images_names_a_path_that_is_not_there_before_any_work(tmp_path, case, said):
    """FOLDER missing or a file, OUT in a missing folder or a folder itself: one `error:` line naming
    the argument, status 2, nothing written (each used to end in a traceback, status 1; an OUT in
    a missing folder only after converting every image)."""
    folder = tmp_path / "imgs"
    folder.mkdir()
    Image.fromarray(np.zeros((16, 16, 3), np.uint8)).save(folder / "good.png")
    (folder / "good.txt").write_text("a good caption")
    (tmp_path / "caption.txt").write_text("a caption")
    out = tmp_path / "out.array_record"
    args = {
        "missing_folder": [tmp_path / "none", out],
        "folder_is_a_file": [tmp_path / "caption.txt", out],
        "no_out_folder": [folder, tmp_path / "nowhere" / "out.array_record"],
        "out_is_a_folder": [folder, folder],
    }[case]
    before = sorted(tmp_path.rglob("*"))
    script = [sys.executable, str(ROOT / "scripts/convert_images.py"), *map(str, args), "--max-side", "16"]
    proc = subprocess.run(script, capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [said.format(tmp=tmp_path)], proc.stderr
    assert sorted(tmp_path.rglob("*")) == before, "nothing written"


def test_convert_skips_bad_files_and_names_them(tmp_path):
    folder = tmp_path / "imgs"
    folder.mkdir()
    Image.fromarray(np.zeros((16, 16, 3), np.uint8)).save(folder / "good.png")
    (folder / "good.txt").write_text("a good caption")
    (folder / "text.txt").write_text("a text-only sample")
    (folder / "empty.txt").write_text("")
    (folder / "one.txt").write_text("x")
    (folder / "latin.txt").write_bytes(b"caf\xe9 au lait")
    (folder / "fake.png").write_bytes(b"this is not a png")
    out = tmp_path / "data.array_record"
    script = [sys.executable, str(ROOT / "scripts/convert_images.py"), str(folder), str(out), "--max-side", "16"]
    proc = subprocess.run(script, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "wrote 2 samples" in proc.stdout and "skipped 4 bad file(s)" in proc.stdout
    lines = [line for line in proc.stderr.splitlines() if line.startswith("skipped ")]
    assert len(lines) == 4, proc.stderr
    for name, why in [
        ("empty.txt", "needs at least 2 text tokens, got 0"),
        ("one.txt", "got 1"),
        ("latin.txt", "caption is not UTF-8"),
        ("fake.png", "not a readable image"),
    ]:
        assert any(line.startswith(f"skipped {folder / name}: ") and why in line for line in lines), (name, lines)
    assert len(ArrayRecordSource((str(out),))) == 2
    proc = subprocess.run(script + ["--strict"], capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"error: {folder / 'empty.txt'}: sample id=0: needs at least 2 text tokens, got 0"
    ], proc.stderr
