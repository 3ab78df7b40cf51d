"""Converters (maestro_jax.data.convert, scripts/convert_dataset.py): conversations with images,
plain text and datasets on disk become ArrayRecord samples with the right placeholders and loss
masks, tokenised by a real Hugging Face tokenizer (trained here, offline); bad records are named
and skipped, or stop the conversion; a tokenizer the model cannot take is refused up front."""

import json
import subprocess
import sys

import numpy as np
import pytest
from conftest import ROOT, TINY_KD, TINY_OMNI, TINY_VLM
from PIL import Image

from maestro_jax.config import load_config
from maestro_jax.data import IMAGE_TOKEN, ArrayRecordSource
from maestro_jax.data import convert as C
from maestro_jax.training.loop import train
from maestro_jax.workloads import modalities_of, resolve, sample_check

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<pad>", "<image>", "<audio>", "<|im_start|>", "<|im_end|>"]  # ids 0..4: <image> on IMAGE_TOKEN
CORPUS = [
    "what is in the picture? describe the image please.",
    "a cat sits on a mat next to the dog, and the dog runs.",
    "compare these two images and tell me which one is brighter.",
    "the first image shows a red square; the second a blue one.",
] * 4
SCRIPT = [sys.executable, str(ROOT / "scripts/convert_dataset.py")]


def make_tokenizer(folder, specials=SPECIALS, vocab_size=300):
    """A byte-level BPE tokenizer trained on CORPUS, saved as a Hugging Face tokenizer folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"chat_template": TEMPLATE, "eos_token": "<|im_end|>", "pad_token": "<pad>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


# vlm_tiny's video placeholder (id 2) is a special token of these tokenizers: the model converted
# for takes no video (the converter refuses a tokenizer whose text would fill a placeholder id)
NO_VIDEO = ["workload_settings.video_token=null"]
TINY_CONFIG = ["--config", str(ROOT / "configs/vlm_tiny.yaml"), "--set", NO_VIDEO[0]]


def target(config, overrides):
    video = config == "vlm_tiny.yaml" and not any(o.startswith("workload_settings.video_token=") for o in overrides)
    cfg = load_config(ROOT / "configs" / config, [*overrides, *NO_VIDEO] if video else overrides)
    w = resolve(cfg.workload)
    return C.Target(w.vocab(cfg), "vocab", modalities_of(cfg), cfg.data.max_tokens, cfg.workload)


VLM = target("vlm_tiny.yaml", TINY_VLM)
SIZES = [(8, 8), (16, 8), (16, 24), (40, 20)]  # (h, w) pixels; 40x20 is scaled to 32x16 by max_side 32


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    folder = tmp_path_factory.mktemp("img")
    rng = np.random.default_rng(0)
    for i, (h, w) in enumerate(SIZES):
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(folder / f"im{i}.png")
    return folder


def llava(i):
    """Record i: 1 to 3 images (sizes cycling), single, several in one turn, or interleaved over
    two rounds of turns."""
    names = [f"im{(i + k) % len(SIZES)}.png" for k in range(1 + i % 3)]
    answer = [f"it shows the cat {i}.", f"the dog runs {i} times.", f"a red square and {i} more."]
    if len(names) == 1:
        turns = [("human", "<image>\nwhat is in the picture?"), ("gpt", answer[0])]
    elif len(names) == 2:
        turns = [("human", "compare <image> and <image>, please."), ("gpt", answer[1])]
    else:
        turns = [
            ("system", "describe images."),
            ("human", "<image>\nwhat is in the picture?"),
            ("gpt", answer[0]),
            ("human", "and these two: <image> then <image>?"),
            ("gpt", answer[2]),
        ]
    return {"id": f"r{i}", "image": names, "conversations": [{"from": f, "value": v} for f, v in turns]}


def runs(flags):
    """(start, stop) of each run of True in `flags`."""
    edges = np.diff(np.concatenate([[0], flags.astype(np.int8), [0]]))
    return list(zip(np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)))


def expected_shape(h, w, side=32, unit=8):
    scale = min(1.0, side / max(h, w))
    return (max(unit, int(h * scale) // unit * unit), max(unit, int(w * scale) // unit * unit), 3)


def check_sample(s, record, tok):
    """Placeholders: one run per image, in order, as many tokens as the image's size gives; loss:
    exactly the assistant turns (what each says and its end of turn), no placeholder."""
    names = record.get("image", [])
    shapes = [expected_shape(*SIZES[int(n[2:-4])]) for n in names]
    assert list(s.shapes("image")) == shapes
    image = VLM.modality("image")
    placeholder_runs = runs(s.tokens == IMAGE_TOKEN)
    assert [b - a for a, b in placeholder_runs] == [image.tokens(sh[:2]) for sh in shapes]
    mask = s.loss_mask.astype(bool)
    assert not mask[s.tokens == IMAGE_TOKEN].any()
    turns = record.get("conversations") or record["messages"]
    said = [t.get("value", t.get("content")) for t in turns if t.get("from", t.get("role")) in ("gpt", "assistant")]
    decoded = [tok.decode(s.tokens[a:b].tolist(), skip_special_tokens=True) for a, b in runs(mask)]
    assert decoded == [f"{x}\n" for x in said]  # the answer, its <|im_end|> (special: not shown) and newline


def test_llava_and_openai_conversations_become_masked_samples(tokenizer, images, tmp_path):
    records = [llava(i) for i in range(6)]
    records.append(  # OpenAI style: parts, an image part naming its file, one fed from the record's list
        {
            "image": ["im1.png"],
            "messages": [
                {"role": "user", "content": [{"type": "image", "image": "im2.png"}, {"type": "text", "text": "and"}]},
                {"role": "assistant", "content": "a red square."},
                {"role": "user", "content": [{"type": "text", "text": "now?"}, {"type": "image"}]},
                {"role": "assistant", "content": "the dog."},
            ],
        }
    )
    data = tmp_path / "llava.json"
    data.write_text(json.dumps(records, indent=1))
    tok = C.ChatTokenizer.load(tokenizer)
    out = tmp_path / "data.array_record"
    assert C.convert([data], out, C.Converter(tok, VLM, images, max_side=32), strict=True) == (7, 0)
    assert (tmp_path / "data.array_record.index.json").is_file() and not (
        tmp_path / "data.array_record.partial"
    ).exists()
    src = ArrayRecordSource((str(out),))
    assert [src.info(i).id for i in range(len(src))] == list(range(7))
    last = dict(records[-1], image=["im2.png", "im1.png"])  # its images in marker order
    for i, record in enumerate(records[:-1] + [last]):
        check_sample(src[i], record, tok.tokenizer)


def test_json_array_is_streamed_through_a_small_window(tokenizer, images, tmp_path, monkeypatch):
    """A JSON array is decoded element by element from a window of the file (here 7 characters,
    so records straddle refills) and gives what the same records as JSONL give; a syntax error
    stops the reading, naming the record."""
    records = [llava(i) for i in range(4)]
    (tmp_path / "a.json").write_text(" [\n" + ",\n".join(json.dumps(r) for r in records) + "\n]\n")
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    monkeypatch.setattr(C, "CHUNK", 7)
    assert (
        [r for _, r in C.read_records(tmp_path / "a.json")]
        == records
        == [r for _, r in C.read_records(tmp_path / "a.jsonl")]
    )
    (tmp_path / "bad.json").write_text("[" + json.dumps(records[0]) + ', {"id": oops}]')
    with pytest.raises(C.ConvertError, match=r"bad.json: record 1 of its JSON array is not JSON"):
        list(C.read_records(tmp_path / "bad.json"))


def test_bad_records_are_named_and_skipped_and_strict_stops(tokenizer, images, tmp_path):
    good = llava(0)
    lines = [
        json.dumps(good),
        '{"id": "broken", "conversations": [',
        json.dumps(dict(good, id="lost", image=["nowhere.png"])),
        json.dumps(dict(good, id="more", image=["im0.png", "im1.png"])),
        json.dumps({"id": "mute", "conversations": [{"from": "human", "value": "hello"}]}),
        json.dumps({"id": "who", "conversations": [{"from": "robot", "value": "hi"}, {"from": "gpt", "value": "x"}]}),
        json.dumps({"id": "fake", "image": "fake.png", "conversations": good["conversations"]}),
        json.dumps(llava(1)),
    ]
    (images / "fake.png").write_bytes(b"not a png")
    data = tmp_path / "mixed.jsonl"
    data.write_bytes(("\n".join(lines) + "\n").encode() + b'{"text": "caf\xe9"}\n')
    out = tmp_path / "out.array_record"
    cmd = SCRIPT + [str(data), str(out), "--tokenizer", str(tokenizer), *TINY_CONFIG]
    cmd += ["--image-root", str(images)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "wrote 2 samples" in proc.stdout and "skipped 7 bad record(s)" in proc.stdout
    skipped = [line for line in proc.stderr.splitlines() if line.startswith("skipped ")]
    for where, why in [
        (f"{data}:2", "not JSON"),
        (f"{data}:3 (id 'lost')", f"image {images / 'nowhere.png'} does not exist"),
        (f"{data}:4 (id 'more')", "lists 2 image(s) but its turns hold 1 <image> markers"),
        (f"{data}:5 (id 'mute')", "has no assistant turn"),
        (f"{data}:6 (id 'who')", "turn 0 is from 'robot'; valid: human, user, gpt, assistant, system"),
        (f"{data}:7 (id 'fake')", "not a readable image"),
        (f"{data}:9", "not UTF-8 (invalid continuation byte"),
    ]:
        assert sum(line.startswith(f"skipped {where}: ") and why in line for line in skipped) == 1, (where, skipped)
    assert len(skipped) == 7
    src = ArrayRecordSource((str(out),))
    assert [src[i].id for i in range(len(src))] == [0, 7]  # ids: positions in the input
    out.unlink()
    proc = subprocess.run(cmd + ["--strict"], capture_output=True, text=True)
    assert proc.returncode == 2
    errors = proc.stderr.strip().splitlines()
    assert len(errors) == 1 and errors[0].startswith(f"error: {data}:2: not JSON ("), errors
    assert not out.exists() and not (tmp_path / "out.array_record.partial").exists()


@pytest.mark.parametrize(
    "case, said",
    [
        ("missing_input", "error: INPUT={tmp}/none.jsonl: no such file or folder"),
        (
            "no_out_folder",
            "error: OUT={tmp}/nowhere/out.array_record: its folder {tmp}/nowhere does not exist; create it first",
        ),
        ("out_is_a_folder", "error: OUT={tmp}: is a folder; valid: the name of the ArrayRecord file to write"),
        (
            "no_image_root",
            "error: --image-root={tmp}/pics: not a folder; valid: the folder relative image paths start in",
        ),
    ],
)
def test_the_converters_paths_are_named_by_argument_before_any_work(tokenizer, tmp_path, case, said):
    """An INPUT that is not there, an OUT in a folder that is not there or that is a folder, an
    `--image-root` that is no folder: one `error:` line naming the argument as written, status 2,
    before the tokenizer loads or a record is read, and nothing written (an OUT in a missing folder
    used to end in ArrayRecord's RuntimeError traceback, status 1)."""
    data = tmp_path / "in.jsonl"
    data.write_text(json.dumps(llava(0)) + "\n")
    paths = {
        "missing_input": [tmp_path / "none.jsonl", tmp_path / "out.array_record"],
        "no_out_folder": [data, tmp_path / "nowhere" / "out.array_record"],
        "out_is_a_folder": [data, tmp_path],
        "no_image_root": [data, tmp_path / "out.array_record", "--image-root", tmp_path / "pics"],
    }[case]
    cmd = SCRIPT + [str(p) for p in paths] + ["--tokenizer", str(tokenizer), *TINY_CONFIG]
    before = sorted(tmp_path.iterdir())
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [said.format(tmp=tmp_path)], proc.stderr
    assert sorted(tmp_path.iterdir()) == before, "nothing written"


def test_a_tokenizer_the_model_cannot_take_is_refused_before_any_record(tokenizer, tmp_path):
    unread = tmp_path / "unread.jsonl"
    unread.write_text("not JSON\n")  # had it been read, its line would be named as skipped
    cmd = SCRIPT + [str(unread), str(tmp_path / "o"), "--tokenizer", str(tokenizer)]
    cmd += [*TINY_CONFIG, "--set", "models.llm.vocab=256"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"error: models.llm.vocab=256: the tokenizer in {tokenizer} has ids up to 299 (token "
        f"{C.ChatTokenizer.load(tokenizer).tokenizer.id_to_token(299)!r}); valid: a vocabulary of at least 300, "
        f"or a tokenizer of at most 256 tokens"
    ]
    tok = C.ChatTokenizer.load(tokenizer)
    with pytest.raises(C.ConvertError, match=r"^error: --image-token='<img>': not one token of the tokenizer"):
        C.check_tokenizer(tok, VLM, "<img>")
    shifted = C.ChatTokenizer.load(make_tokenizer(tmp_path / "shifted", ["<pad>", "<|im_start|>", "<image>"]))
    with pytest.raises(C.ConvertError) as err:
        C.check_tokenizer(shifted, VLM)
    assert str(err.value) == (
        f"error: workload_settings.image_token=1: the tokenizer in {tmp_path / 'shifted'} has '<image>' at id 2, "
        f"and image tokens take the id of the tokenizer's marker; valid: workload_settings.image_token=2"
    )
    C.check_tokenizer(shifted, C.Target(400, "vocab", (), None, "kd"))  # text only: ids 1 and 2 are text
    omni = target("omni_tiny.yaml", TINY_OMNI)  # <audio> takes id 2, where this tokenizer has <x>
    swapped = make_tokenizer(tmp_path / "swapped", ["<pad>", "<image>", "<x>", "<audio>"])
    with pytest.raises(C.ConvertError) as err:
        C.check_tokenizer(C.ChatTokenizer.load(swapped), omni)
    assert str(err.value) == (
        f"error: workload_settings.audio_token=2: the tokenizer in {swapped} has '<audio>' at id 3, and audio "
        f"tokens take the id of the tokenizer's marker; valid: workload_settings.audio_token=3"
    )
    with pytest.raises(C.ConvertError, match=r"^error: --max-side=4: valid: 8 \(patch \* merge.*\) to 256 \(the"):
        C.Converter(tok, VLM, tmp_path, max_side=4)


def test_text_and_conversations_for_distillation(tokenizer, tmp_path):
    """KD takes text only: plain text carries loss everywhere (no mask), a conversation on its
    assistant turns; a record with an image is refused naming the workload."""
    kd = C.Target(
        320, "vocab", resolve("kd").modalities(load_config(ROOT / "configs/kd_tiny.yaml", TINY_KD)), None, "kd"
    )
    rows = [
        {"text": "a cat sits on a mat."},
        {"messages": [{"role": "user", "content": "what runs?"}, {"role": "assistant", "content": "the dog."}]},
        llava(0),
        {"text": 5},
    ]
    data = tmp_path / "kd.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tok = C.ChatTokenizer.load(tokenizer)
    log = tmp_path / "log.txt"
    with open(log, "w") as f:
        assert C.convert([data], tmp_path / "kd.array_record", C.Converter(tok, kd, tmp_path), log=f) == (2, 2)
    assert log.read_text().splitlines() == [
        f"skipped {data}:3 (id 'r0'): has 1 image(s), but the kd workload takes text only",
        f"skipped {data}:4: text is a int, not a string",
    ]
    src = ArrayRecordSource((str(tmp_path / "kd.array_record"),))
    text, chat = src[0], src[1]
    assert text.loss_mask is None and tok.tokenizer.decode(text.tokens.tolist()) == rows[0]["text"]
    said = [
        tok.tokenizer.decode(chat.tokens[a:b].tolist(), skip_special_tokens=True) for a, b in runs(chat.loss_mask == 1)
    ]
    assert said == ["the dog.\n"]


def test_dataset_on_disk(tokenizer, images, tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = [llava(i) for i in range(3)]
    import pyarrow as pa

    # fingerprint given: otherwise datasets hashes the table with dill, which fails on some pyarrow/dill pairs
    table = datasets.Dataset(pa.Table.from_pylist(rows), fingerprint="rows")
    datasets.DatasetDict({"train": table}).save_to_disk(str(tmp_path / "ds"))
    tok = C.ChatTokenizer.load(tokenizer)
    out = tmp_path / "ds.array_record"
    assert C.convert([tmp_path / "ds"], out, C.Converter(tok, VLM, images, max_side=32), strict=True) == (3, 0)
    src = ArrayRecordSource((str(out),))
    for i, record in enumerate(rows):
        check_sample(src[i], record, tok.tokenizer)


@pytest.mark.slow
def test_converted_conversations_train(tokenizer, images, tmp_path):
    data = tmp_path / "llava.jsonl"
    data.write_text("".join(json.dumps(llava(i)) + "\n" for i in range(12)))
    out = tmp_path / "train.array_record"
    cmd = SCRIPT + [str(data), str(out), "--tokenizer", str(tokenizer), *TINY_CONFIG]
    proc = subprocess.run(cmd + ["--image-root", str(images), "--max-side", "32"], capture_output=True, text=True)
    assert proc.returncode == 0 and "wrote 12 samples" in proc.stdout, proc.stderr
    cfg = load_config(
        ROOT / "configs/vlm_tiny.yaml",
        TINY_VLM + NO_VIDEO + ["data.kind=array_record", f"data.paths=[{out}]", "steps=2"],
    )
    history = train(cfg, progress=False)
    assert len(history) == 2 and all(np.isfinite(h["train/loss"]) for h in history)


def test_image_placeholder_id_is_the_tokenizers_own(images, tmp_path):
    """A Llama-like tokenizer (`<s>` on id 1) whose `<image>` is id 7: with the default image_token
    the conversion is refused before any record is read; with workload_settings.image_token=7 the
    samples carry id 7 on exactly their image tokens (no loss there) and pass the workload's checks."""
    specials = ["<unk>", "<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>", "<audio>", "<image>"]
    folder = make_tokenizer(tmp_path / "tok7", specials)
    records = [llava(i) for i in range(3)]
    data = tmp_path / "llava.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "seven.array_record"
    unread = tmp_path / "unread.jsonl"
    unread.write_text("not JSON\n")  # had it been read, its line would be named as skipped
    cmd = SCRIPT + [str(unread), str(out), "--tokenizer", str(folder)]
    cmd += [*TINY_CONFIG, "--image-root", str(images), "--max-side", "32"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"error: workload_settings.image_token=1: the tokenizer in {folder} has '<image>' at id 7, and image "
        f"tokens take the id of the tokenizer's marker; valid: workload_settings.image_token=7"
    ]
    cmd[len(SCRIPT)] = str(data)
    proc = subprocess.run(
        cmd + ["--set", "workload_settings.image_token=7", "--strict"], capture_output=True, text=True
    )
    assert proc.returncode == 0 and "wrote 3 samples" in proc.stdout, proc.stderr
    cfg = load_config(ROOT / "configs/vlm_tiny.yaml", ["workload_settings.image_token=7", *NO_VIDEO])
    (image,) = modalities_of(cfg)
    check, src = sample_check(cfg), ArrayRecordSource((str(out),))
    for i, record in enumerate(records):
        s = check(src[i])
        shapes = [expected_shape(*SIZES[int(n[2:-4])]) for n in record["image"]]
        assert [b - a for a, b in runs(s.tokens == 7)] == [image.tokens(sh[:2]) for sh in shapes]
        assert not s.loss_mask[s.tokens == 7].any()


FRONT_END = ROOT / "tests" / "fixtures" / "hf" / "whisper_features"  # scripts/make_hf_fixtures.py


def test_whisper_front_end_matches_transformers():
    """A 16-bit WAV read with `wave` and its log-mel frames equal `WhisperFeatureExtractor`'s (80 and
    8 mel bins, the clip unpadded), stored by scripts/make_hf_fixtures.py."""
    from maestro_jax.data.audio import log_mel, read_audio

    ref = np.load(FRONT_END / "reference.npz")
    samples = read_audio(FRONT_END / "clip.wav")
    assert np.array_equal(samples, ref["samples"])
    for n in (80, 8):
        frames = log_mel(samples, n)
        assert frames.shape == ref[f"mel{n}"].T.shape == (len(samples) // 160, n)
        assert float(np.max(np.abs(frames - ref[f"mel{n}"].T))) < 1e-4


@pytest.mark.parametrize("width", [1, 3, 4])
def test_wav_sample_widths_read_alike(tmp_path, width):
    """8-bit (unsigned), 24-bit and 32-bit PCM read as the same clip as 16-bit, to their precision."""
    import wave

    from maestro_jax.data.audio import read_audio

    x = np.load(FRONT_END / "reference.npz")["samples"][:1000].astype(np.float64)
    if width == 1:
        raw = np.round(x * 127 + 128).astype(np.uint8).tobytes()
    else:
        ints = np.round(x * (2 ** (8 * width - 1) - 1)).astype("<i4")
        raw = (
            ints.tobytes()
            if width == 4
            else np.stack([(ints >> s) & 255 for s in (0, 8, 16)], 1).astype(np.uint8).tobytes()
        )
    with wave.open(str(tmp_path / "w.wav"), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(width)
        w.setframerate(16000)
        w.writeframes(raw)
    assert float(np.max(np.abs(read_audio(tmp_path / "w.wav") - x))) < (1 / 100 if width == 1 else 1e-6)


def _wav(path, samples, rate=16000, width=2, channels=1):
    import wave

    pcm = np.round(np.repeat(samples[:, None], channels, 1) * 32767).astype("<i2")
    with wave.open(str(path), "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(width)
        w.setframerate(rate)
        w.writeframes(pcm.tobytes())


def test_conversations_with_audio_become_samples(tokenizer, images, tmp_path):
    """`<audio>` markers (LLaVA style, with the record's `audio` list) and OpenAI `input_audio`
    parts (base64 WAV) become the clip's Whisper frames, cut to whole tokens, and one audio
    placeholder per `frames_per_token` frames, in marker order beside images; a clip that is not
    16 kHz WAV is a bad record, named and skipped."""
    import base64
    import shutil

    from maestro_jax.data import AUDIO_TOKEN

    omni = target("omni_tiny.yaml", [*TINY_OMNI, "models.audio.mel=8"])
    audio = omni.modality("audio")
    shutil.copy(FRONT_END / "clip.wav", images / "clip.wav")
    _wav(images / "stereo.wav", np.load(FRONT_END / "reference.npz")["samples"][:3200], channels=2)
    _wav(images / "slow.wav", np.zeros(800), rate=8000)
    (images / "noise.wav").write_bytes(b"RIFF not really")
    data = base64.b64encode((images / "stereo.wav").read_bytes()).decode()
    records = [
        {
            "id": "a",
            "audio": "clip.wav",
            "image": "im0.png",
            "conversations": [
                {"from": "human", "value": "<audio> then <image>: what is said?"},
                {"from": "gpt", "value": "the cat."},
            ],
        },
        {
            "id": "b",
            "messages": [
                {"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": data, "format": "wav"}}]},
                {"role": "assistant", "content": "a dog."},
            ],
        },
        {
            "id": "slow",
            "audio": ["slow.wav"],
            "conversations": [{"from": "human", "value": "<audio>"}, {"from": "gpt", "value": "x"}],
        },
        {
            "id": "noise",
            "audio": "noise.wav",
            "conversations": [{"from": "human", "value": "<audio>"}, {"from": "gpt", "value": "x"}],
        },
    ]
    path = tmp_path / "omni.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    tok = C.ChatTokenizer.load(tokenizer)
    log = tmp_path / "log"
    with log.open("w") as f:
        n = C.convert([path], tmp_path / "omni.array_record", C.Converter(tok, omni, images, 8), log=f)
    assert n == (2, 2)
    assert log.read_text().splitlines() == [
        f"skipped {path}:3 (id 'slow'): {images}/slow.wav: sample rate 8000 Hz; valid: 16000 Hz (Whisper's), "
        "resample it first",
        f"skipped {path}:4 (id 'noise'): {images}/noise.wav: not a readable WAV file (not a WAVE file); "
        "valid: integer PCM WAV",
    ]
    src = ArrayRecordSource((str(tmp_path / "omni.array_record"),))
    ref = np.load(FRONT_END / "reference.npz")["mel8"].T
    fpt = audio.unit[0]
    first, second = src[0], src[1]
    (clip,) = first.of("audio")
    assert np.array_equal(clip, first.of("audio")[0]) and clip.shape == (len(ref) - len(ref) % fpt, 8)
    assert float(np.max(np.abs(clip - ref[: len(clip)]))) < 1e-4
    audio_runs, image_runs = runs(first.tokens == AUDIO_TOKEN), runs(first.tokens == IMAGE_TOKEN)
    assert [b - a for a, b in audio_runs] == [len(clip) // fpt] and audio_runs[0][1] < image_runs[0][0]
    assert not first.loss_mask.astype(bool)[first.tokens == AUDIO_TOKEN].any()
    (stereo,) = second.of("audio")  # channels averaged: the mono clip's frames
    assert stereo.shape == (20 - 20 % fpt, 8) and np.count_nonzero(second.tokens == AUDIO_TOKEN) == 20 // fpt
    with pytest.raises(C.BadRecord, match=r"id 'slow'.*sample rate 8000 Hz"):
        C.convert([path], tmp_path / "strict.array_record", C.Converter(tok, omni, images, 8), strict=True)


# Qwen2-Audio's chat template, as Qwen/Qwen2-Audio-7B-Instruct ships it (chat_template.json)
QWEN2_AUDIO_TEMPLATE = (
    "{% set audio_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "<|im_end|>\n{% else %}{% for content in message['content'] %}{% if 'audio' in content or 'audio_url' in content %}"
    "{% set audio_count.value = audio_count.value + 1 %}Audio {{ audio_count.value }}: <|audio_bos|><|AUDIO|>"
    "<|audio_eos|>\n{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QWEN2_AUDIO_SPECIALS = [
    "<|endoftext|>",
    "<image>",
    "<|im_start|>",
    "<|im_end|>",
    "<|audio_bos|>",
    "<|AUDIO|>",
    "<|audio_eos|>",
]
# omni_tiny with Qwen2-Audio's encoder shape (two frames a token, pooled in pairs: a token per 4 frames), <|AUDIO|> id 5
QWEN2_AUDIO_OMNI = [
    *TINY_OMNI,
    "models.audio.mel=8",
    "models.audio.frames_per_token=2",
    "models.audio.stem=conv",
    "models.audio.pool=2",
    "workload_settings.audio_token=5",
]


def make_qwen2_audio_folder(folder):
    """A Qwen2-Audio checkpoint's tokenizer files: a byte-level BPE trained on CORPUS with its
    audio tokens, its chat template in chat_template.json, config.json naming the model."""
    make_tokenizer(folder, QWEN2_AUDIO_SPECIALS)
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}))
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": QWEN2_AUDIO_TEMPLATE}))
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2_audio"}))
    return folder


def _qwen2_audio_record(images):
    """Two clips in one user turn (the fixture's 0.55 s clip, and its first 8801 samples: 56
    frames by the processor's count, 55 by the front end's) between text parts."""
    import shutil

    shutil.copy(FRONT_END / "clip.wav", images / "clip.wav")
    _wav(images / "cut.wav", np.load(FRONT_END / "reference.npz")["samples"][:8801])
    return {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "audio", "audio": "clip.wav"},
                    {"type": "text", "text": "and"},
                    {"type": "audio", "audio": "cut.wav"},
                    {"type": "text", "text": "what is said?"},
                ],
            },
            {"role": "assistant", "content": "the cat."},
        ]
    }


def test_a_qwen2_audio_folder_writes_its_audio_lines_and_counts(images, tmp_path):
    """From a Qwen2-Audio folder each clip becomes its template's line, `Audio k: <|audio_bos|>`,
    one <|AUDIO|> per token its encoder gives (the processor's count: 55 frames give 14, one frame
    of log-mel floor added for the model's 4 frames a token), `<|audio_eos|>` and a newline; the
    clip's frames are the front end's; placeholders carry no loss. A folder of that model whose
    tokenizer lacks the audio tokens is refused in one line."""
    folder = make_qwen2_audio_folder(tmp_path / "qwen2_audio")
    tok = C.ChatTokenizer.load(folder)
    omni = target("omni_tiny.yaml", QWEN2_AUDIO_OMNI)
    converter = C.Converter(tok, omni, images)
    s = converter.sample(0, _qwen2_audio_record(images))
    clips = s.of("audio")
    assert [len(x) for x in clips] == [56, 56]
    ref = np.load(FRONT_END / "reference.npz")["mel8"].T  # [55, 8]
    assert float(np.max(np.abs(clips[0][:55] - ref))) < 1e-4
    np.testing.assert_allclose(clips[0][55], np.full(8, clips[0].max() - 2.0))
    assert [b - a for a, b in runs(s.tokens == 5)] == [14, 14]
    text = tok.tokenizer.decode(s.tokens.tolist(), skip_special_tokens=False)
    line = "Audio {k}: <|audio_bos|>" + "<|AUDIO|>" * 14 + "<|audio_eos|>\n"
    assert f"<|im_start|>user\n{line.format(k=1)}and{line.format(k=2)}what is said?<|im_end|>" in text
    assert not s.loss_mask.astype(bool)[s.tokens == 5].any()
    other = make_tokenizer(tmp_path / "other")  # a Qwen2-Audio config.json beside a tokenizer without its tokens
    (other / "config.json").write_text(json.dumps({"model_type": "qwen2_audio"}))
    with pytest.raises(C.ConvertError, match=r"a Qwen2-Audio checkpoint's folder whose tokenizer has no '<\|audio_bos"):
        C.ChatTokenizer.load(other)


@pytest.mark.reference
def test_qwen2_audio_conversations_are_written_as_its_processor_writes_them(images, tmp_path):
    """The token ids equal transformers' `Qwen2AudioProcessor` (the folder's tokenizer, Whisper's
    feature extractor at 8 mel bins) on the same conversation as OpenAI-style parts through its
    chat template, each clip's <|AUDIO|> repeated to its count."""
    pytest.importorskip("torch", reason="transformers' processors need torch (the `reference` extra)")
    import transformers
    from transformers import AutoTokenizer

    from maestro_jax.data.audio import read_audio

    folder = make_qwen2_audio_folder(tmp_path / "qwen2_audio")
    record = _qwen2_audio_record(images)
    s = C.Converter(C.ChatTokenizer.load(folder), target("omni_tiny.yaml", QWEN2_AUDIO_OMNI), images).sample(0, record)
    processor = transformers.Qwen2AudioProcessor(
        feature_extractor=transformers.WhisperFeatureExtractor(feature_size=8),
        tokenizer=AutoTokenizer.from_pretrained(folder),
        chat_template=QWEN2_AUDIO_TEMPLATE,
    )
    text = processor.apply_chat_template(record["messages"], tokenize=False)
    clips = [read_audio(images / name) for name in ("clip.wav", "cut.wav")]
    want = processor(text=text, audio=clips, sampling_rate=16000, return_tensors="np")
    np.testing.assert_array_equal(s.tokens, want["input_ids"][0])


def test_long_samples_are_truncated_between_items_or_skipped(tokenizer, images):
    """`on_long: truncate` cuts a sample over max_tokens at the limit, or, where that would split
    an image's placeholder run, before the run (the image goes too); the loss mask is cut alike.
    A cut that leaves no loss token, and `on_long: skip`, are bad records."""
    import dataclasses

    tok = C.ChatTokenizer.load(tokenizer)
    record = llava(2)  # three images over two rounds: the second round's images sit late in the sample
    full = C.Converter(tok, VLM, images, max_side=32).sample(0, record)
    image_runs = runs(full.tokens == IMAGE_TOKEN)
    first, last = image_runs[1]  # the second image's run (stop exclusive)
    assert last - first > 2
    mask = full.loss_mask.astype(bool)
    assert first > runs(mask)[0][1], "the first answer lies before the run: a cut there keeps loss"
    for limit, kept in ((first + 2, first), (last + 1, last + 1), (len(full.tokens) - 1, len(full.tokens) - 1)):
        target = dataclasses.replace(VLM, max_tokens=limit)
        cut = C.Converter(tok, target, images, max_side=32, on_long="truncate").sample(0, record)
        assert len(cut.tokens) == len(cut.loss_mask) == kept
        assert np.array_equal(cut.tokens, full.tokens[:kept]) and np.array_equal(cut.loss_mask, full.loss_mask[:kept])
        n = sum(b <= kept for _, b in image_runs)
        assert len(cut.of("image")) == n and all(
            np.array_equal(a, b) for a, b in zip(cut.of("image"), full.of("image"))
        )
    short = dataclasses.replace(VLM, max_tokens=runs(mask)[0][0])  # before the first answer
    with pytest.raises(C.BadRecord, match=r"no token left carries loss"):
        C.Converter(tok, short, images, max_side=32, on_long="truncate").sample(0, record)
    with pytest.raises(C.BadRecord, match=rf"{len(full.tokens)} tokens exceed the largest bucket \({first + 2}\)"):
        C.Converter(tok, dataclasses.replace(VLM, max_tokens=first + 2), images, max_side=32).sample(0, record)
    with pytest.raises(C.ConvertError, match=r"^error: --on-long=cut: valid: skip, truncate$"):
        C.Converter(tok, VLM, images, max_side=32, on_long="cut")


# Gemma 3's chat template, as google/gemma-3-4b-it ships it
GEMMA3_TEMPLATE = (
    "{{ bos_token }}{%- if messages[0]['role'] == 'system' -%}{%- if messages[0]['content'] is string -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}{%- else -%}"
    "{%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}{%- endif -%}"
    '{%- set loop_messages = messages[1:] -%}{%- else -%}{%- set first_user_prefix = "" -%}'
    "{%- set loop_messages = messages -%}{%- endif -%}{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    '{{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}{%- endif -%}'
    "{%- if (message['role'] == 'assistant') -%}{%- set role = \"model\" -%}{%- else -%}"
    "{%- set role = message['role'] -%}{%- endif -%}"
    "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else \"\") }}"
    "{%- if message['content'] is string -%}{{ message['content'] | trim }}"
    "{%- elif message['content'] is iterable -%}{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' -%}{{ '<start_of_image>' }}{%- elif item['type'] == 'text' -%}"
    "{{ item['text'] | trim }}{%- endif -%}{%- endfor -%}{%- else -%}"
    "{{ raise_exception(\"Invalid content type\") }}{%- endif -%}{{ '<end_of_turn>\\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{'<start_of_turn>model\\n'}}{%- endif -%}"
)
GEMMA3_SPECIALS = [
    "<pad>",
    "<eos>",
    "<bos>",
    "<unk>",
    "<start_of_turn>",
    "<end_of_turn>",
    "<start_of_image>",
    "<end_of_image>",
    "<image_soft_token>",  # id 8: the model's image token
]


def make_gemma_tokenizer(folder, specials, images: dict[str, str]) -> None:
    """A byte-level BPE trained on CORPUS saved as Gemma's tokenizers are (transformers'
    tokenizer_config: bos, eos, pad and unk, and the family's image tokens as named specials)."""
    from transformers import PreTrainedTokenizerFast

    make_tokenizer(folder, specials)
    tok = PreTrainedTokenizerFast(
        tokenizer_file=str(folder / "tokenizer.json"),
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        extra_special_tokens=images,
    )
    (folder / "tokenizer_config.json").unlink()
    tok.save_pretrained(folder)


def make_gemma3_folder(folder, size=16, count=4, **preprocessor):
    """A Gemma 3 checkpoint's tokenizer and processor files as Google ships them (tokenizer_config
    declaring boi, eoi and image tokens; processor_config's image_seq_length; preprocessor_config's
    size and normalisation), with a byte-level BPE trained on CORPUS."""
    images = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
    make_gemma_tokenizer(folder, GEMMA3_SPECIALS, images)
    (folder / "chat_template.jinja").write_text(GEMMA3_TEMPLATE)
    pre = {"image_processor_type": "Gemma3ImageProcessor", "size": {"height": size, "width": size}, "resample": 2}
    pre |= {"image_mean": [0.5] * 3, "image_std": [0.5] * 3, "do_pan_and_scan": None, **preprocessor}
    (folder / "preprocessor_config.json").write_text(json.dumps(pre))
    (folder / "processor_config.json").write_text(json.dumps({"image_seq_length": count}))
    return folder


GEMMA3_VLM = target("vlm_tiny.yaml", [*TINY_VLM, "workload_settings.image_token=8"])


@pytest.mark.reference
def test_gemma3_conversations_are_written_as_its_processor_writes_them(images, tmp_path):
    """From a Gemma 3 folder, each image becomes "\\n\\n<start_of_image>", its image_seq_length
    `<image_soft_token>`s and "<end_of_image>\\n\\n", resized to the processor's square: the token
    ids and pixels equal transformers' Gemma3Processor (OpenAI-style parts through
    `apply_chat_template`, LLaVA's `<image>` where the template puts `<start_of_image>`), and only
    the model's turns carry loss."""
    pytest.importorskip("torch", reason="transformers' processors need torch (the `reference` extra)")
    from transformers import AutoTokenizer, Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    folder = make_gemma3_folder(tmp_path / "gemma3")
    tok = C.ChatTokenizer.load(folder)
    assert tok.image_sequence == C.ImageSequence(
        "gemma3", "\n\n<start_of_image>", "<image_soft_token>", "<end_of_image>\n\n", (16, 16), 4
    )
    converter = C.Converter(tok, GEMMA3_VLM, images)
    processor = Gemma3Processor(
        image_processor=Gemma3ImageProcessorPil(size={"height": 16, "width": 16}),
        tokenizer=AutoTokenizer.from_pretrained(folder),
        chat_template=GEMMA3_TEMPLATE,
        image_seq_length=4,
    )
    parts = {
        "messages": [
            {"role": "system", "content": "describe images."},
            {
                "role": "user",
                "content": [
                    {"type": "image", "image": "im1.png"},
                    {"type": "text", "text": "compare it with"},
                    {"type": "image", "image": "im3.png"},
                ],
            },
            {"role": "assistant", "content": "the first image shows a red square."},
        ]
    }
    opened = {name: Image.open(images / name).convert("RGB") for name in ("im1.png", "im3.png", "im2.png")}
    reference = [
        {
            **m,
            "content": [{**p, "image": opened[p["image"]]} if p["type"] == "image" else p for p in m["content"]]
            if isinstance(m["content"], list)
            else m["content"],
        }
        for m in parts["messages"]
    ]
    want = processor.apply_chat_template(reference, tokenize=True, return_dict=True, return_tensors="np")
    llava = {"image": "im2.png", "conversations": [{"from": "human", "value": "<image>what is in the picture?"}]}
    llava["conversations"].append({"from": "gpt", "value": "a cat sits on a mat."})
    text = processor.tokenizer.apply_chat_template(
        [
            {"role": "user", "content": "<start_of_image>what is in the picture?"},
            {"role": "assistant", "content": "a cat sits on a mat."},
        ],
        tokenize=False,
    )
    want_llava = processor(text=text, images=[[opened["im2.png"]]], add_special_tokens=False, return_tensors="np")
    for record, expected, said in (
        (parts, want, ["the first image shows a red square."]),
        (llava, want_llava, ["a cat sits on a mat."]),
    ):
        s = converter.sample(0, record)
        np.testing.assert_array_equal(s.tokens, expected["input_ids"][0])
        pixels = np.stack(s.items["image"]).transpose(0, 3, 1, 2)  # (images, h, w, 3) -> the processor's layout
        np.testing.assert_allclose(pixels, expected["pixel_values"], atol=1e-5)
        assert [b - a for a, b in runs(s.tokens == 8)] == [4] * len(s.items["image"])
        mask = s.loss_mask.astype(bool)
        decoded = [tok.tokenizer.decode(s.tokens[a:b].tolist(), skip_special_tokens=True) for a, b in runs(mask)]
        assert decoded == [f"{x}\n" for x in said]  # the answer, its <end_of_turn> (special) and newline


@pytest.mark.reference
def test_a_gemma3_folder_the_model_cannot_take_is_refused_in_one_line(images, tmp_path):
    """Gemma 3's processor writes image_seq_length tokens an image of its size; a vision model that
    takes another count, a normalisation other than [-1, 1], pan and scan, or --max-side (the
    processor fixes the size) are refused before any record is read."""
    pytest.importorskip(
        "transformers", reason="the folders' tokenizers are written with transformers (the `reference` extra)"
    )
    cases = [
        (make_gemma3_folder(tmp_path / "a", count=16), {}, "writes 16 tokens for an image of 16x16 pixels"),
        (make_gemma3_folder(tmp_path / "b", image_mean=[0.48, 0.45, 0.4]), {}, "image_mean=[0.48, 0.45, 0.4]"),
        (make_gemma3_folder(tmp_path / "c", do_pan_and_scan=True), {}, "do_pan_and_scan=true"),
        (make_gemma3_folder(tmp_path / "d"), {"max_side": 32}, "--max-side=32: the gemma3 processor"),
    ]
    for folder, kwargs, message in cases:
        with pytest.raises(C.ConvertError) as err:
            C.Converter(C.ChatTokenizer.load(folder), GEMMA3_VLM, images, **kwargs)
        assert str(err.value).startswith("error: ") and "\n" not in str(err.value)
        assert message in str(err.value), str(err.value)


PALIGEMMA_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<image>"]  # <image> on id 4


def make_paligemma_folder(folder, size=16, count=4, **preprocessor):
    """A PaliGemma checkpoint's tokenizer and processor files as Google ships them (no chat
    template; preprocessor_config naming PaliGemmaProcessor, with SigLIP's size, bicubic filter,
    normalisation and the image_seq_length), with a byte-level BPE trained on CORPUS."""
    make_gemma_tokenizer(folder, PALIGEMMA_SPECIALS, {"image_token": "<image>"})
    pre = {"image_processor_type": "SiglipImageProcessor", "processor_class": "PaliGemmaProcessor", "resample": 3}
    pre |= {"size": {"height": size, "width": size}, "image_seq_length": count, "image_mean": [0.5] * 3}
    (folder / "preprocessor_config.json").write_text(json.dumps({**pre, "image_std": [0.5] * 3, **preprocessor}))
    return folder


PALIGEMMA_VLM = target("vlm_tiny.yaml", [*TINY_VLM, "workload_settings.image_token=4"])


@pytest.mark.reference
def test_paligemma_records_are_written_as_its_processor_writes_them(images, tmp_path):
    """From a PaliGemma folder, `{image, prefix, suffix}` and a user-then-assistant conversation
    become image_seq_length `<image>`s per image, bos, the prefix and "\\n", then the suffix and
    eos: ids and pixels equal transformers' PaliGemmaProcessor(images, text, suffix), and the loss
    mask is its token_type_ids (the suffix: its labels). A prompt holding `<image>` markers keeps
    its text before the last one ahead of the bos, as the processor does; three turns are refused."""
    pytest.importorskip("torch", reason="transformers' processors need torch (the `reference` extra)")
    from transformers import AutoTokenizer, PaliGemmaProcessor
    from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

    folder = make_paligemma_folder(tmp_path / "paligemma")
    tok = C.ChatTokenizer.load(folder)
    assert tok.image_sequence == C.ImageSequence("paligemma", "", "<image>", "", (16, 16), 4, resample="bicubic")
    converter = C.Converter(tok, PALIGEMMA_VLM, images)
    processor = PaliGemmaProcessor(
        image_processor=SiglipImageProcessorPil(size={"height": 16, "width": 16}, image_seq_length=4, resample=3),
        tokenizer=AutoTokenizer.from_pretrained(folder),
    )
    opened = {name: Image.open(images / name).convert("RGB") for name in ("im1.png", "im2.png", "im3.png")}
    chat = {"image": "im3.png", "conversations": [{"from": "human", "value": "what is in the picture?"}]}
    chat["conversations"].append({"from": "gpt", "value": "a cat sits on a mat."})
    chat["conversations"][0]["value"] = "<image>" + chat["conversations"][0]["value"]
    cases = [  # (record, the processor's images, text and suffix)
        ({"image": "im1.png", "prefix": "caption en", "suffix": "a red square."}, ["im1.png"], "caption en"),
        ({"images": ["im1.png", "im2.png"], "prefix": "compare", "suffix": "two dogs."}, ["im1.png", "im2.png"], None),
        ({"image": "im2.png", "prefix": "<image>what is it?", "suffix": "a dog."}, ["im2.png"], None),
        (chat, ["im3.png"], "<image>what is in the picture?"),
    ]
    for record, names, text in cases:
        suffix = record.get("suffix", "a cat sits on a mat.")
        prompt = record.get("prefix", text) if text is None else text
        want = processor(images=[[opened[n] for n in names]], text=[prompt], suffix=[suffix], return_tensors="np")
        s = converter.sample(0, record)
        np.testing.assert_array_equal(s.tokens, want["input_ids"][0])
        np.testing.assert_array_equal(s.loss_mask, want["token_type_ids"][0])
        pixels = np.stack(s.items["image"]).transpose(0, 3, 1, 2)
        np.testing.assert_allclose(pixels, want["pixel_values"], atol=1e-5)
    three = {"image": "im1.png", "conversations": [*chat["conversations"], {"from": "human", "value": "and?"}]}
    three["conversations"][0] = {"from": "human", "value": "<image>what?"}
    with pytest.raises(C.BadRecord, match="valid: a user turn, then an assistant turn"):
        converter.sample(0, three)
    with pytest.raises(C.BadRecord, match="has no suffix text"):
        converter.sample(0, {"image": "im1.png", "prefix": "caption en"})


# SmolVLM's chat template, as HuggingFaceTB/SmolVLM-256M-Instruct ships it: it reads content parts only
SMOLVLM_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
SMOLVLM_SPECIALS = [
    "<pad>",
    "<|im_start|>",
    "<end_of_utterance>",
    "<image>",  # id 3: the model's image token
    "<fake_token_around_image>",
    "<global-img>",
    *(f"<row_{r}_col_{c}>" for r in (1, 2, 3) for c in (1, 2, 3)),
]


def make_smolvlm_folder(folder, **preprocessor):
    """A SmolVLM checkpoint's tokenizer and processor files (its image tokens as special tokens; a
    preprocessor_config resizing each image's longest side to 48 and cutting it into tiles of 16;
    a processor_config of 4 tokens a tile), with a byte-level BPE trained on CORPUS."""
    make_tokenizer(folder, SMOLVLM_SPECIALS)
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<end_of_utterance>", "pad_token": "<pad>"}))
    (folder / "chat_template.jinja").write_text(SMOLVLM_TEMPLATE)
    pre = {"image_processor_type": "SmolVLMImageProcessor", "size": {"longest_edge": 48}, "resample": 1}
    pre |= {"max_image_size": {"longest_edge": 16}, "do_image_splitting": True, **preprocessor}
    (folder / "preprocessor_config.json").write_text(json.dumps(pre))
    (folder / "processor_config.json").write_text(
        json.dumps({"image_seq_len": 4, "processor_class": "SmolVLMProcessor"})
    )
    return folder


@pytest.mark.reference
@pytest.mark.parametrize(
    ("processor", "family"), [("PaliGemmaProcessor", "PaliGemma"), ("SmolVLMProcessor", "SmolVLM")]
)
def test_a_family_folder_whose_tokenizer_lacks_its_image_tokens_is_refused(tmp_path, processor, family):
    """A folder naming PaliGemma's or SmolVLM's processor whose tokenizer lacks `<image>` (here
    Gemma 3's tokenizer) is refused in one line naming the token, before any record is read."""
    pytest.importorskip(
        "transformers", reason="the folders' tokenizers are written with transformers (the `reference` extra)"
    )
    folder = make_gemma3_folder(tmp_path / "f")
    (folder / "processor_config.json").write_text(json.dumps({"processor_class": processor}))
    with pytest.raises(C.ConvertError) as err:
        C.ChatTokenizer.load(folder)
    assert str(err.value).startswith(f"error: --tokenizer={folder}: a {family}") and "\n" not in str(err.value)
    assert "whose tokenizer has no '<image>'" in str(err.value), str(err.value)


SMOLVLM_VLM = target("vlm_tiny.yaml", [*TINY_VLM, "workload_settings.image_token=3"])


@pytest.mark.reference
@pytest.mark.parametrize("splitting", [True, False])
def test_smolvlm_conversations_are_written_as_its_processor_writes_them(images, tmp_path, splitting):
    """From a SmolVLM folder each image is resized (its longest side 48), cut into 16x16 tiles and a
    global view, and written as `<fake_token_around_image><row_r_col_c>` and 4 `<image>`s a tile, a
    newline a row, then the global view's tokens (without splitting: the global view alone); the
    chat is rendered through its template as content parts: ids and pixels equal transformers'
    Idefics3Processor (SmolVLM's processor writes the same strings; its video processor needs
    torchvision), and only the model's turns carry loss."""
    pytest.importorskip("torch", reason="transformers' processors need torch (the `reference` extra)")
    from transformers import AutoTokenizer, Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil
    from transformers.models.smolvlm.processing_smolvlm import get_image_prompt_string

    folder = make_smolvlm_folder(tmp_path / "smolvlm", do_image_splitting=splitting)
    tok = C.ChatTokenizer.load(folder)
    assert (tok.image_sequence.family, tok.image_sequence.size, tok.image_sequence.split) == (
        "smolvlm",
        (16, 16),
        splitting,
    )
    assert tok.image_sequence.split_text(2, 3) == get_image_prompt_string(
        2, 3, 4, "<fake_token_around_image>", "<image>", "<global-img>"
    )
    converter = C.Converter(tok, SMOLVLM_VLM, images)
    processor = Idefics3Processor(
        image_processor=Idefics3ImageProcessorPil(
            size={"longest_edge": 48}, max_image_size={"longest_edge": 16}, resample=1, do_image_splitting=splitting
        ),
        tokenizer=AutoTokenizer.from_pretrained(folder),
        image_seq_len=4,
        chat_template=SMOLVLM_TEMPLATE,
    )
    opened = {name: Image.open(images / name).convert("RGB") for name in ("im0.png", "im1.png", "im3.png")}
    parts = {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image", "image": "im3.png"},
                    {"type": "text", "text": "compare it with"},
                    {"type": "image", "image": "im1.png"},
                ],
            },
            {"role": "assistant", "content": [{"type": "text", "text": "the first shows a red square."}]},
            {"role": "user", "content": [{"type": "text", "text": "and this?"}, {"type": "image", "image": "im0.png"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "a cat."}]},
        ]
    }
    reference = [
        {**m, "content": [{**p, "image": opened[p["image"]]} if p["type"] == "image" else p for p in m["content"]]}
        for m in parts["messages"]
    ]
    want = processor.apply_chat_template(reference, tokenize=True, return_dict=True, return_tensors="np")
    s = converter.sample(0, parts)
    np.testing.assert_array_equal(s.tokens, want["input_ids"][0])
    pixels = np.stack(s.items["image"]).transpose(0, 3, 1, 2)  # (views, h, w, 3) -> the processor's layout
    np.testing.assert_allclose(pixels, want["pixel_values"][0], atol=1e-5)
    views = (6 + 1) + (6 + 1) + (9 + 1) if splitting else 3
    assert len(s.items["image"]) == views and [b - a for a, b in runs(s.tokens == 3)] == [4] * views
    mask = s.loss_mask.astype(bool)
    decoded = [tok.tokenizer.decode(s.tokens[a:b].tolist(), skip_special_tokens=True) for a, b in runs(mask)]
    assert decoded == [" the first shows a red square.\n", " a cat.\n"]  # after "Assistant:" (the prompt)


# Qwen2.5-VL's chat template, as Qwen/Qwen2.5-VL-7B-Instruct ships it (chat_template.json)
QWEN_VL_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture {{ image_count.value }}: "
    "{% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QWEN_VL_SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",  # id 5: the model's image token
    "<|video_pad|>",
]
QWEN_VL_VLM = target("vlm_tiny.yaml", [*TINY_VLM, "workload_settings.image_token=5"])


def make_qwen_vl_folder(folder, **preprocessor):
    """A Qwen2.5-VL checkpoint's tokenizer and processor files (a byte-level BPE trained on
    CORPUS with Qwen's special tokens, its chat template in chat_template.json, a
    preprocessor_config.json for patches of 4 merged 2 x 2: one token per 8 x 8 pixels, the
    vlm_tiny tower's), min_pixels 128 and max_pixels 512 so that small images grow and large ones
    shrink."""
    make_tokenizer(folder, QWEN_VL_SPECIALS)
    config = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": QWEN_VL_TEMPLATE}))
    pre = {"image_processor_type": "Qwen2VLImageProcessor", "patch_size": 4, "merge_size": 2}
    pre |= {"temporal_patch_size": 2, "min_pixels": 128, "max_pixels": 512, **preprocessor}
    (folder / "preprocessor_config.json").write_text(json.dumps(pre))
    return folder


@pytest.mark.reference
@pytest.mark.parametrize("processor_class", ["Qwen2_5_VLProcessor", "Qwen3VLProcessor"])
def test_qwen_vl_conversations_are_written_as_its_processor_writes_them(images, tmp_path, processor_class):
    """From a Qwen2.5-VL or Qwen3-VL folder, each image becomes <|vision_start|>, one <|image_pad|>
    per merged token of the image as the processor resizes it (`smart_resize`: 8x8 grows to 16x16,
    40x20 shrinks to 32x16) and <|vision_end|>: the token ids, the pixels (normalised by the
    folder's mean and std: CLIP's, Qwen3-VL's 0.5, in the tower's patch layout) and the grids equal
    transformers' processor (OpenAI-style parts through `apply_chat_template`, LLaVA's `<image>`
    where the template puts its vision tokens), and only the assistant's turns carry loss."""
    pytest.importorskip("torch", reason="transformers' processors need torch (the `reference` extra)")
    import transformers
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from maestro_jax.tools.check_hf import qwen_pixel_values

    qwen3 = processor_class == "Qwen3VLProcessor"
    normalised = {"image_mean": [0.5] * 3, "image_std": [0.5] * 3} if qwen3 else {}
    folder = make_qwen_vl_folder(tmp_path / "qwen", **normalised)
    if qwen3:  # its config.json names the model (the converter reads the processor's files either way)
        (folder / "config.json").write_text(json.dumps({"model_type": "qwen3_vl"}))
    tok = C.ChatTokenizer.load(folder)
    assert (tok.image_sequence.family, tok.image_sequence.factor, tok.image_sequence.pixels) == (
        "qwen_vl",
        8,
        (128, 512),
    )
    converter = C.Converter(tok, QWEN_VL_VLM, images)

    # the processor built by its own constructor, which reads the vision tokens and their ids from
    # the tokenizer: the folder's tokenizer, the image processor its preprocessor_config describes
    # (the PIL one) and no video processor (these records hold no video). transformers checks each
    # sub-processor's class, and the video processors' base class needs torchvision, which the
    # reference extra leaves out: that one check lets an absent video processor through.
    class ImageOnly(getattr(transformers, processor_class)):
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument is None and argument_name == "video_processor":
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    processor = ImageOnly(
        image_processor=Qwen2VLImageProcessorPil(
            patch_size=4, merge_size=2, min_pixels=128, max_pixels=512, **normalised
        ),
        tokenizer=AutoTokenizer.from_pretrained(folder),
        video_processor=None,
        chat_template=QWEN_VL_TEMPLATE,
    )
    assert (processor.image_token, processor.image_token_id, processor.video_token_id) == ("<|image_pad|>", 5, 6)
    parts = {
        "messages": [
            {"role": "system", "content": "describe images."},
            {
                "role": "user",
                "content": [
                    {"type": "image", "image": "im0.png"},
                    {"type": "text", "text": "compare it with"},
                    {"type": "image", "image": "im3.png"},
                    {"type": "image", "image": "im2.png"},
                ],
            },
            {"role": "assistant", "content": "the first image shows a red square."},
        ]
    }
    opened = {f"im{i}.png": Image.open(images / f"im{i}.png").convert("RGB") for i in range(4)}
    reference = [
        {
            **m,
            "content": [{**p, "image": opened[p["image"]]} if p["type"] == "image" else p for p in m["content"]]
            if isinstance(m["content"], list)
            else m["content"],
        }
        for m in parts["messages"]
    ]
    want = processor.apply_chat_template(reference, tokenize=True, return_dict=True, return_tensors="np")
    llava = {"image": "im1.png", "conversations": [{"from": "human", "value": "<image>what is in the picture?"}]}
    llava["conversations"].append({"from": "gpt", "value": "a cat sits on a mat."})
    text = processor.tokenizer.apply_chat_template(
        [
            {"role": "user", "content": "<|vision_start|><|image_pad|><|vision_end|>what is in the picture?"},
            {"role": "assistant", "content": "a cat sits on a mat."},
        ],
        chat_template=QWEN_VL_TEMPLATE,
        tokenize=False,
    )
    want_llava = processor(text=text, images=[[opened["im1.png"]]], return_tensors="np")
    for record, expected, said, shapes in (
        (parts, want, ["the first image shows a red square."], [(16, 16), (32, 16), (16, 24)]),
        (llava, want_llava, ["a cat sits on a mat."], [(16, 8)]),
    ):
        s = converter.sample(0, record)
        np.testing.assert_array_equal(s.tokens, expected["input_ids"][0])
        assert [x.shape[:2] for x in s.items["image"]] == shapes
        grids = [(1, h // 4, w // 4) for h, w in shapes]
        np.testing.assert_array_equal(expected["image_grid_thw"], grids)
        pixels = np.concatenate([qwen_pixel_values(x.transpose(2, 0, 1), 4, 2, 2) for x in s.items["image"]])
        np.testing.assert_allclose(pixels, expected["pixel_values"], atol=1e-5)
        assert [b - a for a, b in runs(s.tokens == 5)] == [h * w // 64 for h, w in shapes]
        mask = s.loss_mask.astype(bool)
        decoded = [tok.tokenizer.decode(s.tokens[a:b].tolist(), skip_special_tokens=True) for a, b in runs(mask)]
        assert decoded == [f"{x}\n" for x in said]  # the answer, its <|im_end|> (special) and newline


def test_a_qwen_vl_folder_the_model_cannot_take_is_refused_in_one_line(images, tmp_path):
    """A Qwen-VL folder is known by its preprocessor_config.json (or its config.json alone, the
    processor's defaults then: patches of 14 merged 2 x 2); a vision model whose token covers other
    pixels than patch_size * merge_size, --max-side (the processor sizes images), a tokenizer
    without Qwen's vision tokens or min_pixels over max_pixels are refused before any record."""
    bare = make_tokenizer(tmp_path / "bare", QWEN_VL_SPECIALS)
    (bare / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl"}))
    sequence = C.ChatTokenizer.load(bare).image_sequence
    assert (sequence.factor, sequence.pixels, sequence.mean) == (28, (56 * 56, 28 * 28 * 1280), C.OPENAI_CLIP_MEAN)
    plain = make_tokenizer(tmp_path / "plain")
    (plain / "preprocessor_config.json").write_text(json.dumps({"image_processor_type": "Qwen2VLImageProcessor"}))
    cases = [
        (
            bare,
            {},
            "writes one token per 28x28 pixels (preprocessor_config.json patch_size * merge_size), but the model",
        ),
        (make_qwen_vl_folder(tmp_path / "a"), {"max_side": 32}, "--max-side=32: the qwen_vl processor"),
        (make_qwen_vl_folder(tmp_path / "b", min_pixels=1024), {}, "min_pixels=1024; valid: a positive integer"),
    ]
    for folder, kwargs, message in cases:
        with pytest.raises(C.ConvertError) as err:
            C.Converter(C.ChatTokenizer.load(folder), QWEN_VL_VLM, images, **kwargs)
        assert str(err.value).startswith("error: ") and "\n" not in str(err.value)
        assert message in str(err.value), str(err.value)
    with pytest.raises(
        C.ConvertError, match=r"^error: --tokenizer=.*plain: a Qwen-VL checkpoint's folder whose tokenizer"
    ):
        C.ChatTokenizer.load(plain)


VIDEO_CASES = json.loads((ROOT / "tests/fixtures/hf/qwen_video/cases.json").read_text())["cases"]
VIDEO_VLM = [*TINY_VLM, "workload_settings.image_token=5", "workload_settings.video_token=6", "models.vision.frames=2"]


def _video_folder(tmp_path, family: str, settings: dict):
    """A Qwen2.5-VL or Qwen3-VL checkpoint's tokenizer and processor files (`make_qwen_vl_folder`),
    its config.json naming the model and its video processor's `settings`."""
    normalised = {"image_mean": [0.5] * 3, "image_std": [0.5] * 3} if family == "qwen3_vl" else {}
    folder = make_qwen_vl_folder(tmp_path / "qwen", **normalised)
    (folder / "config.json").write_text(json.dumps({"model_type": family}))
    (folder / "video_preprocessor_config.json").write_text(json.dumps(settings))
    return folder


def _clip_file(path, frames, fps):
    from fractions import Fraction

    from test_video import _write_video

    _write_video(path, frames, Fraction(fps).limit_denominator(1000))
    return path


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_a_video_record_is_written_as_its_processor_writes_it(tmp_path, family):
    """A LLaVA-style record whose turn holds `<video>` and a Qwen-style one with a `video` part,
    the clip a lossless video file of the stored case's 7 frames at 2 fps (20x30): the clip's
    text is what transformers' processor wrote for it (tests/fixtures/hf/qwen_video/cases.json:
    Qwen2.5-VL one run of 24 <|video_pad|>, Qwen3-VL a timestamp and markers before each temporal
    patch), the sample's clip is the sampled frames resized and normalised as `VideoSampling`
    gives them (equal to the processor's pixel values within one uint8 level: tests/test_video.py),
    its `video_seconds_per_patch` the processor's second_per_grid_ts, its M-RoPE positions
    `get_rope_index`'s for that grid, and only the assistant's answer carries loss."""
    pytest.importorskip("av", reason="decoding a video file needs PyAV (the video extra)")
    from maestro_jax.models import LLMConfig
    from maestro_jax.models.llm import mrope_positions

    from maestro_jax.data.video import SECONDS_PER_PATCH, VideoSampling
    from maestro_jax.workloads.vlm import EDGE, sample_positions

    case = next(c for c in VIDEO_CASES if c.get("pixels") == f"{family}-1")
    frames = np.load(ROOT / "tests/fixtures/hf/qwen_video/pixels.npz")[f"{family}-1-frames"]
    folder = _video_folder(tmp_path, family, case["settings"])
    _clip_file(tmp_path / "clip.mov", frames, case["fps"])
    tok = C.ChatTokenizer.load(folder)
    video_target = target("vlm_tiny.yaml", VIDEO_VLM)
    converter = C.Converter(tok, video_target, tmp_path)
    llava = {
        "video": "clip.mov",
        "conversations": [{"from": "human", "value": "<video>\nwhat moves?"}, {"from": "gpt", "value": "a ball"}],
    }
    parts = {
        "messages": [
            {
                "role": "user",
                "content": [{"type": "video", "video": "clip.mov"}, {"type": "text", "text": "what moves?"}],
            },
            {"role": "assistant", "content": "a ball"},
        ]
    }
    sampling = VideoSampling.from_processor(family, case["settings"])
    clip = sampling.clip(case["frames"], case["fps"], case["height"], case["width"])
    for record in (llava, parts):
        s = converter.sample(0, record)
        (item,) = s.of("video")
        np.testing.assert_array_equal(item, sampling.pixels(frames, clip))
        assert item.shape[:3] == (case["grid"][0] * 2, case["grid"][1] * 4, case["grid"][2] * 4)
        text = tok.tokenizer.encode(case["text"], add_special_tokens=False).ids
        ids = s.tokens.tolist()
        assert any(ids[i : i + len(text)] == text for i in range(len(ids))), "the processor's text for the clip"
        assert np.count_nonzero(s.tokens == 6) == case["text"].count("<|video_pad|>")
        assert not s.loss_mask[s.tokens == 6].any() and s.loss_mask.any()
        if family == "qwen2_5_vl":
            assert float(s.tags[SECONDS_PER_PATCH]) == pytest.approx(case["second_per_grid_ts"], rel=1e-12)
        llm = LLMConfig(
            vocab=300,
            width=8,
            depth=1,
            heads=1,
            kv_heads=1,
            head_dim=8,
            mlp=8,
            mrope_section=(2, 1, 1),
            video_tokens_per_second=2.0,
            video_timestamps=family == "qwen3_vl",
        )
        positions = sample_positions(llm, {EDGE: video_target.modalities})(s)
        grids = sampling.position_grids(clip, tokens_per_second=2.0)
        np.testing.assert_array_equal(positions, mrope_positions(s.tokens[:-1], 5, [], 6, grids))


def test_a_video_the_converter_cannot_take_is_a_bad_record(tmp_path):
    """A file that is no video, a folder of frames without the record's video_fps, a missing file
    and a video for a model without video are bad records naming what is wrong (skipped, or the
    conversion stopped under --strict); a folder of frames with video_fps converts."""
    case = next(c for c in VIDEO_CASES if c.get("pixels") == "qwen2_5_vl-1")
    folder = _video_folder(tmp_path, "qwen2_5_vl", case["settings"])
    (tmp_path / "junk.mp4").write_bytes(b"not a video")
    frames_dir = tmp_path / "frames"
    frames_dir.mkdir()
    frames = np.load(ROOT / "tests/fixtures/hf/qwen_video/pixels.npz")["qwen2_5_vl-1-frames"]
    for i, frame in enumerate(frames):
        Image.fromarray(frame).save(frames_dir / f"{i:03d}.png")
    tok = C.ChatTokenizer.load(folder)
    converter = C.Converter(tok, target("vlm_tiny.yaml", VIDEO_VLM), tmp_path)

    def record(ref, **more):
        return {
            "video": ref,
            "conversations": [{"from": "human", "value": "<video> hi"}, {"from": "gpt", "value": "ok"}],
            **more,
        }

    for ref, more, said in (
        ("junk.mp4", {}, "junk.mp4: cannot be decoded as a video"),
        ("frames", {}, "is a folder of frames, and the record gives no video_fps"),
        ("gone.mp4", {}, "gone.mp4 does not exist"),
    ):
        if ref == "junk.mp4":
            pytest.importorskip("av", reason="decoding a video file needs PyAV (the video extra)")
        with pytest.raises(C.BadRecord, match=said):
            converter.sample(0, record(ref, **more))
    s = converter.sample(0, record("frames", video_fps=case["fps"]))
    assert s.of("video")[0].shape == (6, 16, 32, 3)
    no_video = C.Converter(tok, target("vlm_tiny.yaml", [*TINY_VLM, "workload_settings.image_token=5"]), tmp_path)
    with pytest.raises(C.BadRecord, match="has 1 video\\(s\\), but the vlm workload takes no video"):
        no_video.sample(0, record("frames", video_fps=2))
