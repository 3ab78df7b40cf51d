"""Converters: common dataset formats -> the ArrayRecord samples maestro_jax trains from.

Records are read one at a time and written as they come (a dataset never sits in memory):
  conversations  LLaVA style `{"id", "image": path | [paths], "conversations": [{"from":
                 "human" | "gpt" | "system", "value": "...<image>..."}]}` or OpenAI style
                 `{"messages": [{"role", "content": text | [parts]}]}` (parts `{"type": "text",
                 "text"}`, `{"type": "image" | "image_url", ...}`): rendered with the tokenizer's
                 chat template, each image marker replaced by that image's placeholder tokens
                 (single, several, interleaved; the marker's token id is the config's image
                 placeholder id, `workload_settings.image_token`; a Gemma 3 or Qwen-VL checkpoint's
                 folder: its own image tokens, `ImageSequence`; a SmolVLM one: each image's tiles and
                 global view, `split_image`), loss only on the assistant's turns
                 (`Sample.loss_mask`), so the model learns to answer, not to write prompts; with a
                 Qwen2.5-VL or Qwen3-VL folder, `<video>` markers (`video` lists, `video` parts)
                 become its processor's clip tokens and the clip its sampled frames (`data.video`);
  plain text     `{"text": ...}`: every token carries loss (the KD teacher and student read text).
  prefix/suffix  PaliGemma's `{"image", "prefix", "suffix"}` with a PaliGemma folder's tokenizer, as its
                 processor writes them (`Converter._prefix_suffix`): loss on the suffix only.
from JSONL, a JSON array (streamed), or a Hugging Face `datasets` dataset saved to disk.

The tokenizer is a Hugging Face tokenizer folder (`tokenizer.json`, `tokenizer_config.json` with
its chat template and special tokens, or `chat_template.jinja`), read with the `tokenizers`
library and its template rendered by jinja2 as `transformers` renders it: the ids are the ones a
pretrained LLM of that tokenizer knows. `Target` is what the model takes (its caller reads it off
the config); `check_tokenizer` refuses a tokenizer the model cannot take before any record is
read. A record that cannot become a sample is a `BadRecord` naming it (file and line or record,
and its `id`) and why; `convert` skips it, or stops there (`strict`).
"""

from __future__ import annotations

import base64
import dataclasses
import datetime
import io
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from maestro_jax.data.audio import HOP, AudioError, log_mel, read_audio
from maestro_jax.data.samples import DataError, Modality, Sample, encode_sample, validate_sample
from maestro_jax.data.sources import write_index
from maestro_jax.data.video import FAMILIES as VIDEO_FAMILIES
from maestro_jax.data.video import (
    SECONDS_PER_PATCH,
    Clip,
    VideoError,
    VideoSampling,
    fit_pixels,
    read_frames,
    read_video,
)

IMAGE_MARKER = "<image>"  # LLaVA's marker of where an image goes in a turn's text
AUDIO_MARKER = "<audio>"  # and of where an audio clip goes
VIDEO_MARKER = "<video>"  # and of where a video clip goes (LLaVA-Video's)
LISTED = {
    "image": ("image", "images"),
    "audio": ("audio", "audios"),
    "video": ("video", "videos"),
}  # a record's list of each
NOUNS = {"image": "image(s)", "audio": "audio clip(s)", "video": "video(s)"}
ON_LONG = ("skip", "truncate")
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
CHUNK = 1 << 20  # characters a JSON array is read by
MAX_RECORD_CHARS = 64 << 20  # a JSON array element longer than this is taken for damage, not a record


class ConvertError(Exception):
    """The conversion cannot start or go on (a tokenizer the model cannot take, an input that
    cannot be read at all); the message is one `error:` line."""


def check_paths(inputs: list[Path], out: Path, image_root: Path | None = None) -> None:
    """The paths a conversion reads and writes, before a tokenizer loads or a record is read: each
    INPUT there, `--image-root` a folder, OUT a file name in a folder that exists and can be
    written. A `ConvertError` naming the argument as the user wrote it."""
    for path in inputs:
        check_input(path, "INPUT")
    if image_root is not None and not image_root.is_dir():
        raise ConvertError(
            f"error: --image-root={image_root}: not a folder; valid: the folder relative image paths start in"
        )
    check_out(out)


def check_input(path: Path, name: str, folder: bool = False) -> None:
    """A converter's input `name` (as its usage line writes it) is there (and a folder, with `folder`)."""
    if not path.exists():
        raise ConvertError(f"error: {name}={path}: no such {'folder' if folder else 'file or folder'}")
    if folder and not path.is_dir():
        raise ConvertError(f"error: {name}={path}: not a folder; valid: a folder of images and their captions")


def check_out(out: Path) -> None:
    """A converter's OUT names a file to write in a folder that exists and can be written."""
    import os

    if out.is_dir():
        raise ConvertError(f"error: OUT={out}: is a folder; valid: the name of the ArrayRecord file to write")
    if not out.parent.is_dir():
        raise ConvertError(f"error: OUT={out}: its folder {out.parent} does not exist; create it first")
    if not os.access(out.parent, os.W_OK | os.X_OK):
        raise ConvertError(f"error: OUT={out}: its folder {out.parent} is not writable")


class BadRecord(Exception):
    """One input record that cannot become a sample; the message names the record and why."""


@dataclasses.dataclass(frozen=True)
class Target:
    """What the model takes, read off its config: the vocabulary (and the config field(s) that
    set it, for messages), the modalities its samples may carry, the longest sequence."""

    vocab: int
    vocab_field: str
    modalities: tuple[Modality, ...] = ()
    max_tokens: int | None = None
    workload: str = "this"

    def modality(self, name: str) -> Modality | None:
        return next((m for m in self.modalities if m.name == name), None)


@dataclasses.dataclass(frozen=True)
class ImageSequence:
    """How a checkpoint family writes an image into its token stream, as its processor does:
    each image marker of the rendered chat becomes `before`, `token` once per image token, then
    `after`, before the text is tokenised. Gemma 3 resizes every image to exactly `size` (height,
    width) pixels and writes `count` image tokens for it (the model must take as many for an
    image of that size); Qwen-VL (`size` None) resizes each by `smart_resize` (each side a
    multiple of `factor`, patch * merge, the area within `pixels`, min and max) and writes one
    token per `factor` x `factor` pixels. Pixels are resized with `resample` (PIL's filter) and,
    as values in [0, 1], normalised by the processor's `mean` and `std` per channel."""

    family: str
    before: str
    token: str
    after: str
    size: tuple[int, int] | None
    count: int = 0
    factor: int = 0
    pixels: tuple[int, int] = (0, 0)
    resample: str = "bilinear"
    mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    std: tuple[float, ...] = (0.5, 0.5, 0.5)
    # SmolVLM's and Idefics3's (family "smolvlm"): each image's longest side first resized to
    # `longest` (0: not resized), then, with `split`, cut into tiles of `size` and a global view
    # (`split_image`), each tile `count` tokens (`split_text`)
    longest: int = 0
    split: bool = False

    def fit(self, height: int, width: int) -> tuple[int, int]:
        """The size (height, width) the processor resizes an image of `height` x `width` to."""
        return self.size or smart_resize(height, width, self.factor, *self.pixels)

    def tokens(self, height: int, width: int) -> int:
        """How many image tokens the processor writes for an image resized to `height` x `width`."""
        return self.count if self.size else (height // self.factor) * (width // self.factor)

    def text(self, count: int) -> str:
        return self.before + self.token * count + self.after

    def split_text(self, rows: int, cols: int) -> str:
        """What SmolVLM's (and Idefics3's) processor writes for an image cut into `rows` x `cols`
        tiles and its global view (0 x 0: the image alone, as its global view)."""
        fake, image = IDEFICS3_TOKENS[0], self.token * self.count
        tiles = "".join(
            "".join(f"{fake}<row_{r + 1}_col_{c + 1}>{image}" for c in range(cols)) + "\n" for r in range(rows)
        )
        return tiles + ("\n" if rows else "") + f"{fake}{IDEFICS3_TOKENS[1]}{image}{fake}"


IDEFICS3_TOKENS = ("<fake_token_around_image>", "<global-img>")  # SmolVLM's and Idefics3's, around each image's tokens
QWEN2_AUDIO_TOKENS = ("<|audio_bos|>", "<|AUDIO|>", "<|audio_eos|>")


@dataclasses.dataclass(frozen=True)
class AudioSequence:
    """How Qwen2-Audio's processor writes a clip into its token stream (its chat template's
    `Audio k: <|audio_bos|><|AUDIO|><|audio_eos|>` line, k counting the conversation's clips from
    1, the `<|AUDIO|>` then repeated by `Qwen2AudioProcessor` once per token its encoder gives).
    A clip of L mel frames (one per started hop of 160 samples, as the processor's attention mask
    counts them) gives `(L - 1) // 2 + 1` tokens after the encoder's stride-2
    convolution and `(that - 2) // 2 + 1` after pooling pairs; the model takes one per `unit`
    frames (4), so a clip keeps that many whole units of frames, one frame of silence (the
    log-mel floor the processor pads with) added where the count rounds up."""

    token: str = QWEN2_AUDIO_TOKENS[1]

    @staticmethod
    def tokens(frames: int) -> int:
        return ((frames - 1) // 2 + 1 - 2) // 2 + 1

    def text(self, k: int, count: int) -> str:
        bos, _, eos = QWEN2_AUDIO_TOKENS
        return f"Audio {k}: {bos}{self.token * count}{eos}\n"

    def frames(self, mel: np.ndarray, unit: int, length: int) -> np.ndarray:
        """The clip's frames for its tokens: `tokens(length) * unit` of them (`length`: the frames
        the processor counts, one per started hop of samples), cut or padded with the log-mel floor
        (`data.audio.log_mel`: 2 below the clip's largest value)."""
        n = self.tokens(length) * unit
        if n <= len(mel):
            return mel[:n]
        return np.concatenate([mel, np.full((n - len(mel), mel.shape[1]), mel.max() - 2.0, mel.dtype)])


def _qwen2_audio_sequence(folder: Path, tok) -> AudioSequence | None:
    """Qwen2-Audio's audio tokens, for a folder of its checkpoint (config.json's model_type, or a
    processor_config.json naming `Qwen2AudioProcessor`) whose tokenizer holds them; None otherwise."""
    if not _folder_of(folder, ("qwen2_audio",), ("Qwen2AudioProcessor",)):
        return None
    _require_tokens(folder, tok, QWEN2_AUDIO_TOKENS, "Qwen2-Audio")
    return AudioSequence()


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen2-VL's image processor's size for an image of `height` x `width` (transformers'
    `smart_resize`, the same arithmetic): each side rounded to a multiple of `factor`, then both
    scaled, keeping the aspect, into `min_pixels` to `max_pixels` of area. BadRecord for an aspect
    over 200, which the processor refuses."""
    if max(height, width) / min(height, width) > 200:
        raise BadRecord(
            f"an image of {height}x{width} pixels: its aspect is over 200, which Qwen-VL's processor refuses"
        )
    return fit_pixels(height, width, factor, min_pixels, max_pixels)


@dataclasses.dataclass(frozen=True)
class ChatTokenizer:
    """A Hugging Face tokenizer folder: the tokenizer, its chat template (compiled; None where the
    folder has none), the special tokens chat templates read (`bos_token`, `eos_token`, ...) and,
    for a checkpoint family with its own image tokens, how it writes an image (`image_sequence`)."""

    folder: Path
    tokenizer: object  # tokenizers.Tokenizer
    template: object  # jinja2.Template | None
    special: dict[str, str]
    image_sequence: ImageSequence | None = None
    video: VideoSampling | None = None  # a Qwen2.5-VL / Qwen3-VL folder's video processor (`_qwen_video`)
    audio_sequence: AudioSequence | None = None  # a Qwen2-Audio folder's (`_qwen2_audio_sequence`)

    @classmethod
    def load(cls, folder: str | Path) -> ChatTokenizer:
        try:
            import tokenizers
        except ImportError:
            raise ConvertError(
                "error: --tokenizer: needs the `tokenizers` package; install the convert extra: "
                "pip install 'maestro-jax[convert]'"
            ) from None
        folder = Path(folder)
        if not (folder / "tokenizer.json").is_file():
            raise ConvertError(
                f"error: --tokenizer={folder}: has no tokenizer.json; valid: a Hugging Face tokenizer folder "
                f"(save_pretrained writes one)"
            )
        try:
            tok = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
        except Exception as err:  # noqa: BLE001 - tokenizers raises a bare Exception for a file it cannot parse
            raise ConvertError(f"error: --tokenizer={folder}: tokenizer.json cannot be read ({err})") from None
        config_path = folder / "tokenizer_config.json"
        try:
            config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
        except (OSError, ValueError) as err:
            raise ConvertError(f"error: --tokenizer={folder}: tokenizer_config.json cannot be read ({err})") from None
        source = config.get("chat_template")
        if isinstance(source, list):  # named templates: the default one
            source = next((t["template"] for t in source if t.get("name") == "default"), None)
        if (folder / "chat_template.json").is_file():  # a processor's (Qwen-VL's), over the tokenizer's
            source = _read_json(folder, "chat_template.json").get("chat_template", source)
        if (folder / "chat_template.jinja").is_file():  # transformers >= 4.43 saves it on its own
            source = (folder / "chat_template.jinja").read_text(encoding="utf-8")
        special = {
            key: value["content"] if isinstance(value, dict) else value
            for key, value in config.items()
            if key.endswith("_token") and (isinstance(value, str) or (isinstance(value, dict) and "content" in value))
        }
        template = None if source is None else _compile_template(folder, source)
        sequence = (
            _qwen_vl_sequence(folder, tok)
            or _paligemma_sequence(folder, tok)
            or _split_image_sequence(folder, tok)
            or _image_sequence(folder, special)
        )
        video = _qwen_video(folder, tok) if sequence is not None and sequence.family == "qwen_vl" else None
        return cls(folder, tok, template, special, sequence, video, _qwen2_audio_sequence(folder, tok))

    def render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        from jinja2.exceptions import TemplateError

        if self.template is None:
            raise ConvertError(
                f"error: --tokenizer={self.folder}: has no chat template (tokenizer_config.json "
                f"chat_template or chat_template.jinja); valid: a tokenizer folder with one, for conversations"
            )
        try:
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt, **self.special)
        except TemplateError as err:
            raise BadRecord(f"the chat template refuses it ({err})") from None


def _compile_template(folder: Path, source: str):
    """A chat template compiled as `transformers` compiles it: sandboxed, trimmed blocks, loop
    controls, and the helpers templates call (`raise_exception`, `strftime_now`, `tojson`)."""
    try:
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise ConvertError(
            "error: --tokenizer: rendering its chat template needs jinja2; install the convert extra: "
            "pip install 'maestro-jax[convert]'"
        ) from None

    def raise_exception(message):
        raise TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except TemplateError as err:
        raise ConvertError(f"error: --tokenizer={folder}: its chat template is not valid jinja ({err})") from None


GEMMA3_IMAGE_TOKENS = 256  # transformers' Gemma3Processor: image_seq_length when processor_config.json has none


def _read_json(folder: Path, name: str) -> dict:
    path = folder / name
    try:
        return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except (OSError, ValueError) as err:
        raise ConvertError(f"error: --tokenizer={folder}: {name} cannot be read ({err})") from None


def _folder_of(folder: Path, model_types: tuple[str, ...], processors: tuple[str, ...]) -> bool:
    """Whether `folder` is a checkpoint of a family: config.json's model_type one of `model_types`,
    or a processor or image processor of `processors` named in processor_config.json or
    preprocessor_config.json (as the Hub's folders name them)."""
    pre = _read_json(folder, "preprocessor_config.json")
    named = {
        _read_json(folder, "processor_config.json").get("processor_class"),
        pre.get("processor_class"),
        pre.get("image_processor_type"),
    }
    return _read_json(folder, "config.json").get("model_type") in model_types or bool(named & set(processors))


def _require_tokens(folder: Path, tok, tokens: tuple[str, ...], family: str) -> None:
    """A `family` checkpoint's tokenizer holds its own `tokens`; else one `error:` line naming the first missing."""
    vocab = tok.get_vocab(with_added_tokens=True)
    missing = [t for t in tokens if t not in vocab]
    if missing:
        raise ConvertError(
            f"error: --tokenizer={folder}: a {family} checkpoint's folder whose tokenizer has no {missing[0]!r}; "
            f"valid: the checkpoint's own tokenizer, which holds {list(tokens)}"
        )


def _image_sequence(folder: Path, special: dict[str, str]) -> ImageSequence | None:
    """The folder's own image tokens, where its family has them (None: the LLaVA marker alone).

    Gemma 3: a tokenizer that declares `boi_token`, `eoi_token` and `image_token` (its
    tokenizer_config.json, as Google's checkpoints ship it) is written as transformers'
    `Gemma3Processor` writes it, `"\n\n" + boi + image_token * image_seq_length + eoi + "\n\n"`
    (processor_config.json's `image_seq_length`), each image resized to preprocessor_config.json's
    `size` with pixels normalised by mean and std 0.5 (what `load_image` gives; another
    normalisation is refused). Pan and scan (`do_pan_and_scan`, off by default) is not done."""
    if not all(special.get(k) for k in ("boi_token", "eoi_token", "image_token")):
        return None
    pre = _read_json(folder, "preprocessor_config.json")
    size = pre.get("size") or {}
    if not (isinstance(size, dict) and isinstance(size.get("height"), int) and isinstance(size.get("width"), int)):
        raise ConvertError(
            f"error: --tokenizer={folder}: declares Gemma 3's image tokens but its preprocessor_config.json gives no "
            f"size {{height, width}} (got {size!r}); valid: the checkpoint's folder, which holds Gemma 3's "
            f"preprocessor_config.json"
        )
    for key in ("image_mean", "image_std"):
        if any(abs(v - 0.5) > 1e-6 for v in pre.get(key, [0.5])):
            raise ConvertError(
                f"error: --tokenizer={folder}: preprocessor_config.json {key}={pre[key]}; valid: 0.5 per channel "
                f"(pixels in [-1, 1], as the converter writes them)"
            )
    if pre.get("do_pan_and_scan"):
        raise ConvertError(
            f"error: --tokenizer={folder}: preprocessor_config.json do_pan_and_scan=true; valid: false or null "
            f"(the converter writes one view of each image)"
        )
    count = _read_json(folder, "processor_config.json").get("image_seq_length", GEMMA3_IMAGE_TOKENS)
    return ImageSequence(
        "gemma3",
        "\n\n" + special["boi_token"],
        special["image_token"],
        special["eoi_token"] + "\n\n",
        (size["height"], size["width"]),
        int(count),
    )


PALIGEMMA_IMAGE_TOKEN = "<image>"  # PaliGemmaProcessor's IMAGE_TOKEN (and LLaVA's marker)
PIL_FILTERS = {1: "lanczos", 2: "bilinear", 3: "bicubic"}  # preprocessor_config.json's resample (PIL's numbers) by name


def _paligemma_sequence(folder: Path, tok) -> ImageSequence | None:
    """PaliGemma's (1 and 2) image tokens, for a folder of its checkpoint (config.json's
    model_type, or `PaliGemmaProcessor` named in processor_config.json or
    preprocessor_config.json, as Google's folders name it); None otherwise. Each image is
    `<image>` image_seq_length times (preprocessor_config.json's), resized to its `size` with its
    `resample` (SigLIP's bicubic) and normalised by its mean and std; where they go in a sample and
    what follows them is `Converter._prefix_and_suffix`'s."""
    if not _folder_of(folder, ("paligemma",), ("PaliGemmaProcessor",)):
        return None
    _require_tokens(folder, tok, (PALIGEMMA_IMAGE_TOKEN,), "PaliGemma")
    pre = _read_json(folder, "preprocessor_config.json")
    size, count, resample = pre.get("size") or {}, pre.get("image_seq_length"), pre.get("resample", 3)
    if not (isinstance(size, dict) and isinstance(size.get("height"), int) and isinstance(size.get("width"), int)):
        bad = ("size", size, "{height, width} in pixels")
    elif not (isinstance(count, int) and count > 0):
        bad = ("image_seq_length", count, "a positive integer: the image tokens a PaliGemma image is written as")
    elif resample not in PIL_FILTERS:
        bad = ("resample", resample, f"one of {sorted(PIL_FILTERS)} (PIL's {', '.join(PIL_FILTERS.values())})")
    else:
        return ImageSequence(
            "paligemma",
            "",
            PALIGEMMA_IMAGE_TOKEN,
            "",
            (size["height"], size["width"]),
            count,
            resample=PIL_FILTERS[resample],
            mean=tuple(pre.get("image_mean", (0.5, 0.5, 0.5))),
            std=tuple(pre.get("image_std", (0.5, 0.5, 0.5))),
        )
    key, value, valid = bad
    raise ConvertError(f"error: --tokenizer={folder}: preprocessor_config.json {key}={value!r}; valid: {valid}")


SPLIT_IMAGE_FAMILY = {  # SmolVLM's and Idefics3's: config.json's model_type, or the processor their files name
    "models": ("smolvlm", "idefics3"),
    "processors": ("SmolVLMProcessor", "Idefics3Processor", "SmolVLMImageProcessor", "Idefics3ImageProcessor"),
}
# their image processors' defaults (transformers 5.25), where preprocessor_config.json leaves a field out
IDEFICS3_DEFAULTS = {"longest_edge": 4 * 364, "max_image_size": 364, "resample": 1, "image_seq_len": 169}


def _split_image_sequence(folder: Path, tok) -> ImageSequence | None:
    """SmolVLM's or Idefics3's image tokens, for a folder of such a checkpoint; None otherwise. Its
    image processor resizes each image's longest side to `size.longest_edge`, then (with
    `do_image_splitting`) to multiples of `max_image_size.longest_edge` and cuts it into tiles of
    that side and a global view (`split_image`), LANCZOS; its processor writes each tile's
    image_seq_len `<image>`s after `<fake_token_around_image><row_r_col_c>` and the global view's
    between `<fake_token_around_image><global-img>` and `<fake_token_around_image>`
    (`ImageSequence.split_text`)."""
    if not _folder_of(folder, SPLIT_IMAGE_FAMILY["models"], SPLIT_IMAGE_FAMILY["processors"]):
        return None
    _require_tokens(folder, tok, (PALIGEMMA_IMAGE_TOKEN, *IDEFICS3_TOKENS), "SmolVLM or Idefics3")
    pre = _read_json(folder, "preprocessor_config.json")
    fields = {
        "longest_edge": (pre.get("size") or {}).get("longest_edge", IDEFICS3_DEFAULTS["longest_edge"]),
        "max_image_size": (pre.get("max_image_size") or {}).get("longest_edge", IDEFICS3_DEFAULTS["max_image_size"]),
        "image_seq_len": _read_json(folder, "processor_config.json").get(
            "image_seq_len", IDEFICS3_DEFAULTS["image_seq_len"]
        ),
    }
    bad = next((k for k, v in fields.items() if not (isinstance(v, int) and v > 0)), None)
    resample = pre.get("resample", IDEFICS3_DEFAULTS["resample"])
    if bad or resample not in PIL_FILTERS:
        key, value = (bad, fields[bad]) if bad else ("resample", resample)
        raise ConvertError(
            f"error: --tokenizer={folder}: {key}={value!r} (preprocessor_config.json or processor_config.json); "
            f"valid: a positive integer{'' if bad else f', or resample one of {sorted(PIL_FILTERS)}'}"
        )
    side = fields["max_image_size"]
    return ImageSequence(
        "smolvlm",
        "",
        PALIGEMMA_IMAGE_TOKEN,
        "",
        (side, side),
        fields["image_seq_len"],
        resample=PIL_FILTERS[resample],
        mean=tuple(pre.get("image_mean", (0.5, 0.5, 0.5))),
        std=tuple(pre.get("image_std", (0.5, 0.5, 0.5))),
        longest=fields["longest_edge"] if pre.get("do_resize", True) else 0,
        split=bool(pre.get("do_image_splitting", True)),
    )


QWEN_VL_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")
QWEN_VL_PROCESSORS = ("Qwen2VLImageProcessor", "Qwen2VLImageProcessorFast", "Qwen2VLImageProcessorPil")
QWEN_VL_MODELS = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")  # Qwen3-VL's processor writes images as Qwen2.5-VL's
# Qwen2VLImageProcessor's defaults, where preprocessor_config.json leaves them out
QWEN_VL_DEFAULTS = {"patch_size": 14, "merge_size": 2, "min_pixels": 56 * 56, "max_pixels": 28 * 28 * 1280}
OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)  # Qwen-VL's normalisation (transformers' constants)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def _qwen_vl_sequence(folder: Path, tok) -> ImageSequence | None:
    """Qwen-VL's image tokens, for a folder of a Qwen2-VL, Qwen2.5-VL or Qwen3-VL checkpoint (its
    preprocessor_config.json names Qwen2-VL's image processor, or its config.json the model)
    whose tokenizer holds them; None otherwise. As `Qwen2_5_VLProcessor` (and `Qwen3VLProcessor`,
    on Qwen3-VL's patches of 16 and mean and std of 0.5, read from its files) writes it after the chat
    template: `<|vision_start|>`, `<|image_pad|>` once per merged token, `<|vision_end|>`; each
    image `smart_resize`d (min_pixels and max_pixels from preprocessor_config.json, or
    transformers 5's `size` {shortest_edge, longest_edge}; the processor's defaults where it has
    none), bicubic, normalised by its image_mean and image_std (CLIP's by default).

    Where it differs from the processor: images are resized by PIL, as `Qwen2VLImageProcessorPil`
    (and transformers 4's processor) resize them; transformers 5's default, torchvision-backed
    processor resizes by torch, whose bicubic filter can give slightly different pixels (the tokens
    are the same). A still image is written once, not repeated `temporal_patch_size` times: the
    tower repeats it (`workloads.vlm.patchify`). Clips: `_qwen_video`. The template's
    `add_vision_id` ("Picture k: ") is not written."""
    pre = _read_json(folder, "preprocessor_config.json")
    if pre.get("image_processor_type") not in QWEN_VL_PROCESSORS and not (
        (folder / "config.json").is_file() and _read_json(folder, "config.json").get("model_type") in QWEN_VL_MODELS
    ):
        return None
    _require_tokens(folder, tok, QWEN_VL_TOKENS, "Qwen-VL")
    size = pre.get("size") if isinstance(pre.get("size"), dict) else {}
    fields = {
        **QWEN_VL_DEFAULTS,
        **{k: v for k, v in (("min_pixels", size.get("shortest_edge")), ("max_pixels", size.get("longest_edge"))) if v},
        **{k: pre[k] for k in QWEN_VL_DEFAULTS if pre.get(k) is not None},
    }
    bad = next((k for k, v in fields.items() if not (isinstance(v, int) and v > 0)), None)
    if bad or fields["min_pixels"] > fields["max_pixels"]:
        key = bad or "min_pixels"
        raise ConvertError(
            f"error: --tokenizer={folder}: preprocessor_config.json {key}={fields[key]!r}; valid: a positive integer "
            f"(and min_pixels at most max_pixels={fields['max_pixels']!r})"
        )
    start, pad, end = QWEN_VL_TOKENS
    return ImageSequence(
        "qwen_vl",
        start,
        pad,
        end,
        None,
        factor=fields["patch_size"] * fields["merge_size"],
        pixels=(fields["min_pixels"], fields["max_pixels"]),
        resample="bicubic",
        mean=tuple(pre.get("image_mean", OPENAI_CLIP_MEAN)),
        std=tuple(pre.get("image_std", OPENAI_CLIP_STD)),
    )


QWEN_VIDEO_TOKEN = "<|video_pad|>"


def _qwen_video(folder: Path, tok) -> VideoSampling | None:
    """A Qwen2.5-VL or Qwen3-VL checkpoint folder's video processor (`VideoSampling.from_folder`:
    config.json's model_type, video_preprocessor_config.json), where its tokenizer holds
    `<|video_pad|>`; None for another folder (Qwen2-VL's included: its clips are not written)."""
    config = _read_json(folder, "config.json") if (folder / "config.json").is_file() else {}
    if config.get("model_type") not in VIDEO_FAMILIES or QWEN_VIDEO_TOKEN not in tok.get_vocab(with_added_tokens=True):
        return None
    try:
        return VideoSampling.from_folder(folder)
    except VideoError as err:
        raise ConvertError(f"error: --tokenizer={folder}: {err}") from None


def check_tokenizer(tok: ChatTokenizer, target: Target, image_marker: str = IMAGE_MARKER) -> None:
    """Refuse, before any record is read, a tokenizer whose ids the model cannot take: an id at
    or beyond the vocabulary, no single token for a modality's marker (`<image>`, `<audio>`, where
    the model takes that modality), a marker on another id than the config's placeholder
    (`workload_settings.<modality>_token`: the marker's id is the placeholder, as the pretrained
    LLM of that tokenizer knows it), or a text token on an id the model reserves for a modality's
    placeholders (every such token would be read as an embedding slot)."""
    vocab = tok.tokenizer.get_vocab(with_added_tokens=True)
    own = _placeholder_tokens(tok, image_marker)
    _check_markers(tok, target, vocab, own)
    _check_vocabulary(tok, target, vocab)
    _check_reserved_ids(tok, target, vocab, own)
    _check_video_unit(tok, target)
    _check_image_unit(tok, target)


def _check_markers(tok: ChatTokenizer, target: Target, vocab: dict, own: dict[str, str]) -> None:
    """Each modality the model takes has its marker as one token, on the config's placeholder id."""
    for name, marker in own.items():
        m = target.modality(name)
        if m is None:
            continue
        marker_id = vocab.get(marker)
        if marker_id is None or tok.tokenizer.encode(marker, add_special_tokens=False).ids != [marker_id]:
            added = [t.content for t in tok.tokenizer.get_added_tokens_decoder().values()]
            flag = "--image-token" if name == "image" else f"{name} marker"
            if name == "image" and tok.image_sequence is not None:
                flag = f"{tok.folder}/tokenizer_config.json image_token"
            raise ConvertError(
                f"error: {flag}={marker!r}: not one token of the tokenizer in {tok.folder}; valid: one of its added "
                f"tokens {added[:12]}, or add {marker!r} to it as a special token"
            )
        if marker_id != m.placeholder:
            raise ConvertError(
                f"error: workload_settings.{name}_token={m.placeholder}: the tokenizer in {tok.folder} has "
                f"{marker!r} at id {marker_id}, and {name} tokens take the id of the tokenizer's marker; "
                f"valid: workload_settings.{name}_token={marker_id}"
            )


def _check_vocabulary(tok: ChatTokenizer, target: Target, vocab: dict) -> None:
    """No id of the tokenizer at or beyond the model's vocabulary."""
    if vocab:
        top = max(vocab, key=vocab.get)
        if vocab[top] >= target.vocab:
            raise ConvertError(
                f"error: {target.vocab_field}={target.vocab}: the tokenizer in {tok.folder} has ids up to "
                f"{vocab[top]} (token {top!r}); valid: a vocabulary of at least {vocab[top] + 1}, or a "
                f"tokenizer of at most {target.vocab} tokens"
            )


def _check_reserved_ids(tok: ChatTokenizer, target: Target, vocab: dict, own: dict[str, str]) -> None:
    """No text token on an id the model reserves for a modality's placeholders."""
    for m in target.modalities:
        taken = sorted(t for t, i in vocab.items() if i == m.placeholder and t != own.get(m.name))
        if taken and m.name not in own:  # video: the converter writes no clips yet, so any id will do
            raise ConvertError(
                f"error: workload_settings.{m.name}_token={m.placeholder}: the tokenizer in {tok.folder} has token "
                f"{taken[0]!r} at that id, which the {target.workload} workload reserves for {m.name} placeholders; "
                f"valid: an id the tokenizer leaves unused, or null (a model without {m.name})"
            )
        if taken:
            raise ConvertError(
                f"error: --tokenizer={tok.folder}: token {taken[0]!r} has id {m.placeholder}, which the "
                f"{target.workload} workload reserves for {m.name} placeholders; valid: a tokenizer whose id "
                f"{m.placeholder} is its {own[m.name]!r} token or unused"
            )


def _check_video_unit(tok: ChatTokenizer, target: Target) -> None:
    """The tokenizer's video processor writes one token per the video unit the model takes."""
    video, sampling = target.modality("video"), tok.video
    if (
        video is not None
        and sampling is not None
        and video.unit != (sampling.temporal, sampling.factor, sampling.factor)
    ):
        raise ConvertError(
            f"error: --tokenizer={tok.folder}: its {sampling.family} video processor writes one token per "
            f"{sampling.temporal} frames of {sampling.factor}x{sampling.factor} pixels (temporal_patch_size, patch_size "
            f"* merge_size), but the model takes one per {'x'.join(map(str, video.unit))}; valid: the vision model of "
            f"that checkpoint (models.<vision>: {{hf: ...}})"
        )


def _check_image_unit(tok: ChatTokenizer, target: Target) -> None:
    """The tokenizer's image processor writes as many tokens for an image as the model takes."""
    image, sequence = target.modality("image"), tok.image_sequence
    if image is not None and sequence is not None and sequence.size is None:
        if tuple(image.unit) != (sequence.factor, sequence.factor):
            raise ConvertError(
                f"error: --tokenizer={tok.folder}: its {sequence.family} processor writes one token per "
                f"{sequence.factor}x{sequence.factor} pixels (preprocessor_config.json patch_size * merge_size), but "
                f"the model takes one per {'x'.join(map(str, image.unit))}; valid: the vision model of that checkpoint "
                f"(models.<vision>: {{hf: ...}})"
            )
    elif image is not None and sequence is not None:
        h, w = sequence.size
        if len(image.unit) != 2 or h % image.unit[0] or w % image.unit[1] or image.tokens((h, w)) != sequence.count:
            took = image.tokens((h, w)) if len(image.unit) == 2 else "no"
            raise ConvertError(
                f"error: --tokenizer={tok.folder}: its {sequence.family} processor writes {sequence.count} tokens for "
                f"an image of {h}x{w} pixels (processor_config.json image_seq_length, preprocessor_config.json size), "
                f"but the model takes {took} for one (units of {image.unit} pixels); valid: the vision model of "
                f"that checkpoint (models.<vision>: {{hf: ...}})"
            )


def _placeholder_tokens(tok: ChatTokenizer, image_marker: str) -> dict[str, str]:
    """The token each modality's placeholders are: the image marker itself, or the family's own
    image token where it has one (`ChatTokenizer.image_sequence`); `<audio>` for audio, or the
    family's own audio token (`ChatTokenizer.audio_sequence`)."""
    image = image_marker if tok.image_sequence is None else tok.image_sequence.token
    audio = AUDIO_MARKER if tok.audio_sequence is None else tok.audio_sequence.token
    return {"image": image, "audio": audio, **({"video": QWEN_VIDEO_TOKEN} if tok.video else {})}


def load_image(image, unit: int, max_side: int) -> np.ndarray:
    """An image file (or a PIL image) as the ViT section takes it: RGB, scaled down to at most
    `max_side` a side, each side cut to a multiple of `unit` (patch * merge, at least one),
    pixels in [-1, 1] (float32)."""
    from PIL import Image

    img = _rgb(image)
    scale = min(1.0, max_side / max(img.size))
    w = max(unit, int(img.size[0] * scale) // unit * unit)
    h = max(unit, int(img.size[1] * scale) // unit * unit)
    pixels = np.asarray(img.resize((w, h), Image.BICUBIC), np.float32)
    return pixels / 127.5 - 1.0


RESAMPLE = {"lanczos": 1, "bilinear": 2, "bicubic": 3}  # PIL's filters by name (Image.LANCZOS, ...)


def load_image_as(image, sequence: ImageSequence) -> np.ndarray:
    """An image resized as the checkpoint family's processor resizes it (`ImageSequence.fit`:
    Gemma 3's fixed size whatever the aspect, bilinear; Qwen-VL's `smart_resize`, bicubic), its
    pixels as values in [0, 1] normalised by the processor's mean and std (float32; Gemma 3's
    0.5 and 0.5 give [-1, 1])."""
    img = _rgb(image)
    height, width = sequence.fit(img.size[1], img.size[0])
    pixels = np.asarray(img.resize((width, height), RESAMPLE[sequence.resample]), np.float32) / 255.0
    return ((pixels - np.float32(sequence.mean)) / np.float32(sequence.std)).astype(np.float32)


MAX_IMAGE_SIDE = 4096  # SmolVLM's and Idefics3's image processors' MAX_IMAGE_SIZE


def split_image(image, sequence: ImageSequence) -> tuple[list[np.ndarray], int, int]:
    """An image as SmolVLM's (Idefics3's) image processor cuts it: its longest side resized to
    `sequence.longest` (the other keeping the aspect, rounded up to even, within 4096), then to
    multiples of the tile side and cut into rows x cols tiles, row by row, and the whole resized to
    one tile (the global view, last); an image of one tile is itself alone (0 rows, 0 cols). Each
    normalised as `load_image_as` normalises. Returns (tiles, rows, cols)."""
    img, filt, side = _rgb(image), RESAMPLE[sequence.resample], sequence.size[0]
    if sequence.longest:
        img = img.resize(_longest_to(img.size, sequence.longest), filt)
    if not sequence.split:
        views, rows, cols = [img.resize((side, side), filt)], 0, 0
    else:
        img = img.resize(_tile_multiples(img.size, side), filt)
        rows, cols = (img.size[1] - side) // side + 1, (img.size[0] - side) // side + 1
        if rows * cols == 1:
            views, rows, cols = [img], 0, 0
        else:
            crops = [
                img.crop((c * side, r * side, (c + 1) * side, (r + 1) * side)) for r in range(rows) for c in range(cols)
            ]
            views = [*crops, img.resize((side, side), filt)]
    mean, std = np.float32(sequence.mean), np.float32(sequence.std)
    return [((np.asarray(v, np.float32) / 255.0 - mean) / std).astype(np.float32) for v in views], rows, cols


def _longest_to(size: tuple[int, int], longest: int) -> tuple[int, int]:
    """(width, height) with the longest side `longest`, as the processor's arithmetic gives it."""
    width, height = size
    aspect = width / height
    if width >= height:
        width, height = longest, int(longest / aspect)
        height += height % 2
    else:
        height, width = longest, int(longest * aspect)
        width += width % 2
    width, height = max(width, 1), max(height, 1)
    aspect = width / height
    if width >= height and width > MAX_IMAGE_SIDE:
        width, height = MAX_IMAGE_SIDE, int(MAX_IMAGE_SIDE / aspect)
    elif height > width and height > MAX_IMAGE_SIDE:
        height, width = MAX_IMAGE_SIDE, int(MAX_IMAGE_SIDE * aspect)
    return max(width, 1), max(height, 1)


def _tile_multiples(size: tuple[int, int], side: int) -> tuple[int, int]:
    """(width, height) rounded up to whole tiles of `side`, as `resize_for_vision_encoder` does."""
    import math

    width, height = size
    aspect = width / height
    if width >= height:
        width = math.ceil(width / side) * side
        height = math.ceil(int(width / aspect) / side) * side
    else:
        height = math.ceil(height / side) * side
        width = math.ceil(int(height * aspect) / side) * side
    return width, height


def _rgb(image):
    """An image file (or a PIL image) in RGB; BadRecord where it cannot be read."""
    from PIL import Image

    try:
        if isinstance(image, Image.Image):
            return image.convert("RGB")
        with Image.open(image) as opened:
            return opened.convert("RGB")
    except (OSError, SyntaxError, ValueError) as err:  # PIL: UnidentifiedImageError (an OSError), truncated data
        raise BadRecord(f"{image}: not a readable image ({err})") from err


# -- reading records ------------------------------------------------------------------------------
def read_records(path: str | Path, split: str | None = None) -> Iterator[tuple[str, object]]:
    """(where, record) per record of `path`, in order: a JSONL file (a line that is not JSON
    comes as a BadRecord), a JSON array (streamed element by element), or a folder holding a
    Hugging Face dataset saved with `save_to_disk` (`split` picks one of a DatasetDict)."""
    path = Path(path)
    if path.is_dir():
        yield from _dataset_rows(path, split)
        return
    try:
        f = open(path, "rb")
    except OSError as err:
        raise ConvertError(f"error: {path}: cannot be read ({err.strerror})") from None
    with f:
        first = f.read(1)
        while first.isspace():
            first = f.read(1)
        if first == b"[":
            try:
                yield from _json_array(path, io.TextIOWrapper(f, encoding="utf-8"))
            except UnicodeDecodeError as err:
                raise ConvertError(
                    f"error: {path}: not UTF-8 text ({err.reason}); the records after it cannot be read"
                ) from None
            return
        f.seek(0)
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield f"{path}:{n}", json.loads(line.decode("utf-8"))
            except UnicodeDecodeError as err:
                yield f"{path}:{n}", BadRecord(f"{path}:{n}: not UTF-8 ({err.reason} at byte {err.start})")
            except json.JSONDecodeError as err:
                yield f"{path}:{n}", BadRecord(f"{path}:{n}: not JSON ({err.msg} at column {err.colno})")


def _json_array(path: Path, f) -> Iterator[tuple[str, object]]:
    """The elements of a JSON array whose `[` was just read from `f`, decoded one by one from a
    window of the file. A syntax error stops the reading (no later element can be found)."""
    decoder, buf, pos, n = json.JSONDecoder(), "", 0, 0
    while True:
        while True:  # the next non-space character, reading on where the window runs out
            while pos < len(buf) and buf[pos] in " \t\r\n":
                pos += 1
            if pos < len(buf):
                break
            buf, pos = f.read(CHUNK), 0
            if not buf:
                raise ConvertError(f"error: {path}: the JSON array ends without ']' after {n} records")
        if buf[pos] == "]":
            return
        if n and buf[pos] == ",":
            pos += 1
            continue
        try:
            record, end = decoder.raw_decode(buf, pos)
        except json.JSONDecodeError as err:
            more = f.read(CHUNK) if len(buf) - pos < MAX_RECORD_CHARS else ""
            if more:
                buf, pos = buf[pos:] + more, 0
                continue
            raise ConvertError(
                f"error: {path}: record {n} of its JSON array is not JSON ({err.msg}); the records after it "
                f"cannot be found"
            ) from None
        yield f"{path} record {n}", record
        n, pos = n + 1, end


def _dataset_rows(path: Path, split: str | None) -> Iterator[tuple[str, object]]:
    try:
        import datasets
    except ImportError:
        raise ConvertError(
            f"error: {path}: a folder is read as a Hugging Face dataset, which needs the `datasets` package "
            f"(pip install datasets); valid otherwise: a JSON or JSONL file"
        ) from None
    try:
        ds = datasets.load_from_disk(str(path))
    except (FileNotFoundError, ValueError) as err:
        raise ConvertError(f"error: {path}: not a dataset saved with save_to_disk ({err})") from None
    if isinstance(ds, datasets.DatasetDict):
        if split is None and len(ds) == 1:
            split = next(iter(ds))
        if split not in ds:
            raise ConvertError(
                f"error: --split={split}: the dataset in {path} has splits {sorted(ds)}; valid: one of them"
            )
        ds = ds[split]
    elif split is not None:
        raise ConvertError(f"error: --split={split}: the dataset in {path} has no splits; valid: leave it out")
    for i, row in enumerate(ds):  # Arrow-backed: rows are read from the memory-mapped files one by one
        yield f"{path} row {i}", row


# -- records to samples ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Converter:
    """Turns records into samples for `target`, tokenised by `tok` (checked against `target`
    on construction). Images are read from `image_root` (relative paths), scaled to at most
    `max_side` pixels a side."""

    tok: ChatTokenizer
    target: Target
    image_root: Path
    max_side: int | None = None  # None: the largest side the model takes
    image_marker: str = IMAGE_MARKER
    on_long: str = "skip"  # a sample over target.max_tokens: skip (a bad record) | truncate (`truncate_sample`)

    def __post_init__(self):
        """A converter exists only for a tokenizer and image size the model takes."""
        check_tokenizer(self.tok, self.target, self.image_marker)
        if self.on_long not in ON_LONG:
            raise ConvertError(f"error: --on-long={self.on_long}: valid: {', '.join(ON_LONG)}")
        image = self.target.modality("image")
        sequence = self.tok.image_sequence
        if image is not None and sequence is not None and self.max_side is not None:
            how = (
                f"every image to {sequence.size[0]}x{sequence.size[1]} pixels"
                if sequence.size
                else f"each image to {sequence.pixels[0]} to {sequence.pixels[1]} pixels of area (preprocessor_config.json "
                f"min_pixels, max_pixels)"
            )
            raise ConvertError(
                f"error: --max-side={self.max_side}: the {sequence.family} processor of {self.tok.folder} resizes "
                f"{how}; valid: leave it out"
            )
        if image is not None and self.max_side is not None:
            top = image.max_shape[0] if image.max_shape else self.max_side
            if not image.unit[0] <= self.max_side <= top:
                raise ConvertError(
                    f"error: --max-side={self.max_side}: valid: {image.unit[0]} (patch * merge: one image "
                    f"token) to {top} (the largest image side the model takes)"
                )

    def sample(self, index: int, record) -> Sample:
        """The sample of one record (its id: `index`, the record's position in the input);
        BadRecord saying why not."""
        if not isinstance(record, dict):
            raise BadRecord(f"is a JSON {type(record).__name__}, not an object")
        sequence = self.tok.image_sequence
        if sequence is not None and sequence.family == "paligemma" and "text" not in record:
            sample = self._prefix_suffix(index, record)
        elif "conversations" in record or "messages" in record:
            sample = self._chat(index, record)
        elif "text" in record:
            if not isinstance(record["text"], str):
                raise BadRecord(f"text is a {type(record['text']).__name__}, not a string")
            ids = self.tok.tokenizer.encode(record["text"], add_special_tokens=True).ids
            sample = Sample(index, np.asarray(ids, np.int32))
        else:
            raise BadRecord(f"has none of the keys conversations, messages, text (keys: {sorted(record)[:8]})")
        limit = self.target.max_tokens
        if self.on_long == "truncate" and limit is not None and len(sample.tokens) > limit:
            sample = truncate_sample(sample, self.target.modalities, limit)
        try:
            return validate_sample(sample, self.target.modalities, self.target.max_tokens, self.target.vocab)
        except DataError as err:
            raise BadRecord(str(err)) from None

    def _markers(self) -> dict[str, str]:
        return {"image": self.image_marker, "audio": AUDIO_MARKER, "video": VIDEO_MARKER}

    def _chat(self, index: int, record: dict) -> Sample:
        messages, refs = self._messages(record)
        self._check_taken(refs)
        image = self.target.modality("image")
        sequence = self.tok.image_sequence if image is not None else None
        # a family's own image tokens replace each marker before tokenising, as its processor does:
        # as many as the processor writes for the image as it resizes it; a clip's likewise
        own_images, pieces = self._own_images(sequence, refs["image"])
        clips = [self._load_clip(r, record) for r in refs["video"]]
        audio, spoken = self.target.modality("audio"), self.tok.audio_sequence
        own_clips = tuple(self._load("audio", audio, r) for r in refs["audio"]) if audio and spoken else ()
        if own_clips:
            pieces[AUDIO_MARKER] = [spoken.text(k + 1, len(x) // audio.unit[0]) for k, x in enumerate(own_clips)]
        if clips:
            start, _, end = QWEN_VL_TOKENS
            pieces[VIDEO_MARKER] = [self.tok.video.text(clip, start, QWEN_VIDEO_TOKEN, end) for _, clip in clips]
        full, spans = self._assistant_spans(messages, pieces)
        enc = self.tok.tokenizer.encode(full, add_special_tokens=False)
        ids = np.asarray(enc.ids, np.int64)
        starts = np.asarray([a for a, _ in enc.offsets], np.int64)
        mask = np.zeros(len(ids), bool)
        for a, b in spans:
            mask |= (starts >= a) & (starts < b)
        repeat = np.ones(len(ids), np.int64)
        items = {}
        if clips:
            self._check_clip_tokens(ids, [clip for _, clip in clips])
            items["video"] = tuple(pixels for pixels, _ in clips)
            mask[ids == self.tok.tokenizer.token_to_id(QWEN_VIDEO_TOKEN)] = False
        items.update(self._placed_items(ids, refs, {"image": own_images, "audio": own_clips}, mask, repeat))
        if not mask.any():
            raise BadRecord("its assistant turns hold no token")
        seconds = " ".join(repr(clip.seconds_per_patch) for _, clip in clips)
        return Sample(
            index,
            np.repeat(ids, repeat).astype(np.int32),
            items,
            loss_mask=np.repeat(mask, repeat).astype(np.uint8),
            tags={SECONDS_PER_PATCH: seconds} if clips else {},
        )

    def _prefix_suffix(self, index: int, record: dict) -> Sample:
        """A PaliGemma sample as `PaliGemmaProcessor(images, text=prefix, suffix=suffix)` writes it:
        the prefix (the images' tokens, the tokenizer's bos, the prompt and "\\n"; a prompt holding
        `<image>` markers keeps its text up to the last one before the bos, as the processor does),
        then the suffix and eos, the only tokens carrying loss (the processor's labels: its
        token_type_ids 1). The prefix is what `models.<llm>.prefix_lm` reads bidirectionally."""
        prefix, suffix, refs = self._prefix_and_suffix(record)
        self._check_taken(refs)
        sequence, marker = self.tok.image_sequence, PALIGEMMA_IMAGE_TOKEN
        images = tuple(self._load("image", self.target.modality("image"), r) for r in refs["image"])
        bos, eos = self.tok.special.get("bos_token", ""), self.tok.special.get("eos_token", "")
        if marker in prefix:
            cut = prefix.rfind(marker) + len(marker)
            head = prefix[:cut] + bos + prefix[cut:] + "\n"
        else:
            head = marker * len(images) + bos + prefix + "\n"
        head = head.replace(marker, sequence.token * sequence.count)
        encode = self.tok.tokenizer.encode
        read, said = encode(head, add_special_tokens=False).ids, encode(suffix + eos, add_special_tokens=False).ids
        ids = np.asarray(read + said, np.int32)
        found = int(np.count_nonzero(ids == self.tok.tokenizer.token_to_id(sequence.token)))
        if found != sequence.count * len(images):
            raise BadRecord(
                f"holds {found} {sequence.token} tokens, but its {len(images)} image(s) are "
                f"{sequence.count * len(images)} (is {sequence.token!r} in its suffix?)"
            )
        if not said:
            raise BadRecord("its suffix holds no token")
        mask = np.concatenate([np.zeros(len(read), np.uint8), np.ones(len(said), np.uint8)])
        return Sample(index, ids, {"image": images} if images else {}, loss_mask=mask)

    def _prefix_and_suffix(self, record: dict) -> tuple[str, str, dict[str, list]]:
        """A PaliGemma record's prefix, suffix and items: big_vision's fields (`prefix`, `suffix`,
        `image`/`images`) or a conversation of one user turn and one assistant turn (its markers
        and image parts as `<image>` in the prefix)."""
        if "conversations" in record or "messages" in record:
            messages, refs = self._messages(record)
            if [m["role"] for m in messages] != ["user", "assistant"]:
                raise BadRecord(
                    f"has turns {[m['role'] for m in messages]}; PaliGemma's processor writes one prefix and one "
                    f"suffix: valid: a user turn, then an assistant turn"
                )
            return messages[0]["content"], messages[1]["content"], refs
        for key in ("prefix", "suffix"):
            if not isinstance(record.get(key), str):
                raise BadRecord(
                    f"has no {key} text (got {type(record.get(key)).__name__}); a PaliGemma tokenizer's records "
                    f"are {{image, prefix, suffix}}, a user and an assistant turn, or text"
                )
        given = record.get("image", record.get("images"))
        listed = [] if given is None else list(given) if isinstance(given, list | tuple) else [given]
        markers = record["prefix"].count(PALIGEMMA_IMAGE_TOKEN)
        if markers not in (0, len(listed)):
            raise BadRecord(f"its prefix holds {markers} {PALIGEMMA_IMAGE_TOKEN} markers for {len(listed)} image(s)")
        return record["prefix"], record["suffix"], {"image": listed, "audio": [], "video": []}

    def _own_images(self, sequence: ImageSequence | None, refs: list) -> tuple[tuple, dict[str, list[str]]]:
        """A family's own images, loaded as its processor sends them (SmolVLM's: each image's tiles
        and global view, `split_image`), and what each image marker becomes (its tokens)."""
        if sequence is None:
            return (), {}
        if sequence.family == "smolvlm":
            split = [split_image(self._resolve(r), sequence) for r in refs]
            views = tuple(v for tiles, _, _ in split for v in tiles)
            return views, {self.image_marker: [sequence.split_text(rows, cols) for _, rows, cols in split]}
        images = tuple(self._load("image", self.target.modality("image"), r) for r in refs)
        return images, {self.image_marker: [sequence.text(sequence.tokens(*x.shape[:2])) for x in images]}

    def _check_taken(self, refs: dict) -> None:
        """A record with items of a modality the workload does not take is a bad record."""
        for name, items in refs.items():
            if items and self.target.modality(name) is None:
                takes = f"no {name}" if self.target.modalities else "text only"
                raise BadRecord(
                    f"has {len(items)} {NOUNS[name]}, but the {self.target.workload} workload takes {takes}"
                )

    def _assistant_spans(self, messages: list[dict], pieces: dict) -> tuple[str, list[tuple[int, int]]]:
        """The chat rendered whole (each marker expanded to `pieces`), and each assistant turn's
        characters in it: what it says and how it ends its turn."""

        sequence = self.tok.image_sequence
        as_parts = sequence is not None and sequence.family == "smolvlm"  # its template reads content parts only

        def render(turns: list[dict], add_generation_prompt: bool) -> str:
            if as_parts:
                turns = [{**m, "content": _content_parts(m["content"], self.image_marker)} for m in turns]
            return _expand(self.tok.render(turns, add_generation_prompt), pieces)

        full = render(messages, add_generation_prompt=False)
        spans = []
        for k, m in enumerate(messages):
            if m["role"] == "assistant":
                before = render(messages[:k], add_generation_prompt=True)
                through = render(messages[: k + 1], add_generation_prompt=False)
                if not (full.startswith(through) and through.startswith(before)):
                    raise BadRecord(
                        f"the chat template does not render message {k} as a continuation of the ones "
                        f"before it, so its assistant turn cannot be located"
                    )
                spans.append((len(before), len(through)))
        if not spans:
            raise BadRecord("has no assistant turn: no token would carry loss")
        return full, spans

    def _placed_items(self, ids, refs: dict, owned: dict[str, tuple], mask, repeat) -> dict:
        """Each image and audio item of the record, checked against its placeholders in `ids`
        (a marker, or a run of the family's own image or audio tokens, for the items in `owned`,
        already loaded): a marker repeated to its item's token count (`repeat`), placeholders
        never carrying loss (`mask`)."""
        items = {}
        placeholders = _placeholder_tokens(self.tok, self.image_marker)
        families = {"image": self.tok.image_sequence, "audio": self.tok.audio_sequence}
        for name, marker in self._markers().items():
            m = self.target.modality(name)
            if m is None or name == "video":
                continue
            own = families[name]
            found = ids == self.tok.tokenizer.token_to_id(placeholders[name])  # the placeholder id (`check_tokenizer`)
            at = [a for a, _ in _runs(found)] if own else np.flatnonzero(found)
            wanted = len(owned[name]) if own else len(refs[name])  # an own family's views (SmolVLM: tiles)
            if len(at) != wanted:
                what = f"runs of {own.token}" if own else f"{marker} markers"
                views = f" ({wanted} views)" if wanted != len(refs[name]) else ""
                raise BadRecord(
                    f"has {len(at)} {what} after its chat template, but {len(refs[name])} {NOUNS[name]}{views}"
                )
            # an image as its family's processor counts it; a clip's frames are already its tokens' (`AudioSequence`)
            counts = [own.tokens(*x.shape[:2]) if name == "image" else m.tokens(x.shape[:1]) for x in owned[name]]
            if own and [b - a for a, b in _runs(found)] != counts:
                raise BadRecord(f"holds {own.token} tokens of its own beside its {NOUNS[name]}' {counts}")
            loaded = owned[name] if own else tuple(self._load(name, m, r) for r in refs[name])
            for pos, x in zip(at, loaded) if not own else ():  # the marker stands for its item's tokens
                repeat[pos] = m.tokens(x.shape[: len(m.unit)])
            mask[found] = False
            if loaded:
                items[name] = loaded
        return items

    def _load_clip(self, ref, record: dict) -> tuple[np.ndarray, Clip]:
        """A video as its sample holds it (`VideoSampling.pixels`: the frames the folder's video
        processor samples, resized and normalised) and its `Clip`: a file decoded by PyAV, or a
        folder of frame images at the record's `video_fps`."""
        sampling = self.tok.video
        if sampling is None:
            raise BadRecord(
                f"has a video, but the tokenizer folder {self.tok.folder} has no Qwen2.5-VL or Qwen3-VL video "
                f"processor (config.json model_type, video_preprocessor_config.json): only such a folder writes clips"
            )
        if not isinstance(ref, str):
            raise BadRecord(f"a video is a {type(ref).__name__}; valid: a file path or a folder of frames")
        path = Path(ref) if Path(ref).is_absolute() else self.image_root / ref
        try:
            if path.is_dir():
                fps = record.get("video_fps")
                if not isinstance(fps, int | float) or isinstance(fps, bool):
                    raise BadRecord(f"video {path} is a folder of frames, and the record gives no video_fps (a number)")
                frames, rate = read_frames(path, float(fps))
            elif path.is_file():
                _require_pyav()
                frames, rate = read_video(path)
            else:
                raise BadRecord(f"video {path} does not exist")
            clip = sampling.clip(len(frames), rate, frames.shape[1], frames.shape[2])
            return sampling.pixels(frames, clip), clip
        except VideoError as err:
            raise BadRecord(str(err)) from None

    def _check_clip_tokens(self, ids: np.ndarray, clips: list[Clip]) -> None:
        """The clips' `<|video_pad|>` tokens as the processor writes them: a run per clip (Qwen3-VL:
        a run per temporal patch), each as long as its share of the clip's tokens."""
        sampling = self.tok.video
        runs = [b - a for a, b in _runs(ids == self.tok.tokenizer.token_to_id(QWEN_VIDEO_TOKEN))]
        if sampling.family == "qwen2_5_vl":
            want = [sampling.tokens(clip) for clip in clips]
        else:
            want = [sampling.tokens(clip) // clip.grid[0] for clip in clips for _ in range(clip.grid[0])]
        if runs != want:
            raise BadRecord(
                f"holds runs of {QWEN_VIDEO_TOKEN} tokens {runs} after its chat template, but its clips' are {want}"
            )

    def _load(self, name: str, m: Modality, ref) -> np.ndarray:
        """One item as its section takes it: an image's pixels, an audio clip's log-mel frames
        (Whisper's front end, `data.audio`; cut to whole tokens)."""
        if name == "image":
            if self.tok.image_sequence is not None:
                return load_image_as(self._resolve(ref), self.tok.image_sequence)
            return load_image(self._resolve(ref), m.unit[0], self._side(m))
        try:
            source = self._resolve(ref, "audio clip")
            samples = read_audio(source, None if isinstance(ref, str) else "its input_audio data")
            frames = log_mel(samples, m.channels)
        except AudioError as err:
            raise BadRecord(str(err)) from None
        if self.tok.audio_sequence is not None:  # as many frames as its processor writes tokens
            frames = self.tok.audio_sequence.frames(frames, m.unit[0], -(-len(samples) // HOP))
        n = len(frames) - len(frames) % m.unit[0]
        if not n:
            raise BadRecord(f"audio clip {ref}: {len(frames)} frames, fewer than one token's {m.unit[0]}")
        return frames[:n]

    def _messages(self, record: dict) -> tuple[list[dict], dict[str, list]]:
        """The record's turns as `{"role", "content": text}` (image and audio parts as markers in
        the text), and per modality its items in marker order: the record's `image`/`images`
        (`audio`/`audios`) list feeds the markers of its text in order; a part that names its
        own item takes that."""
        markers = self._markers()
        listed, pending, refs = {}, {}, {name: [] for name in markers}
        for name, keys in LISTED.items():
            given = record.get(keys[0], record.get(keys[1]))
            listed[name] = [] if given is None else list(given) if isinstance(given, list | tuple) else [given]
            pending[name] = iter(listed[name])

        def next_listed(name):
            ref = next(pending[name], None)
            if ref is None:
                raise BadRecord(f"has more {markers[name]} markers than its {len(listed[name])} listed {NOUNS[name]}")
            return ref

        turns = record.get("conversations", record.get("messages"))
        if not isinstance(turns, list) or not turns:
            raise BadRecord("conversations/messages must be a non-empty list of turns")
        messages = []
        for k, turn in enumerate(turns):
            if not isinstance(turn, dict):
                raise BadRecord(f"turn {k} is a {type(turn).__name__}, not an object")
            speaker = turn.get("from", turn.get("role"))
            if speaker not in ROLES:
                raise BadRecord(f"turn {k} is from {speaker!r}; valid: {', '.join(ROLES)}")
            content = turn.get("value", turn.get("content"))
            if isinstance(content, list):
                content = _parts_text(k, content, markers, refs, next_listed)
            elif isinstance(content, str):
                # markers in the order they appear, whatever their modality
                found = sorted((i, n) for n, mk in markers.items() for i in _find_all(content, mk))
                for _, name in found:
                    refs[name].append(next_listed(name))
            else:
                raise BadRecord(f"turn {k}'s content is a {type(content).__name__}, not text or a list of parts")
            messages.append({"role": ROLES[speaker], "content": content})
        for name in markers:
            if next(pending[name], None) is not None:
                raise BadRecord(
                    f"lists {len(listed[name])} {NOUNS[name]} but its turns hold {len(refs[name])} "
                    f"{markers[name]} markers"
                )
        return messages, refs

    def _side(self, image: Modality) -> int:
        """The largest side images are scaled to: `max_side`, else the largest the model takes."""
        if self.max_side is not None:
            return self.max_side
        if image.max_shape is None:
            raise ConvertError("error: --max-side: missing; the model sets no largest image, so give one")
        return image.max_shape[0]

    def _resolve(self, ref, what: str = "image"):
        if isinstance(ref, str):
            path = Path(ref) if Path(ref).is_absolute() else self.image_root / ref
            if not path.is_file():
                raise BadRecord(f"{what} {path} does not exist")
            return path
        if what != "image":
            if isinstance(ref, bytes):  # an OpenAI `input_audio` part's decoded data
                return io.BytesIO(ref)
            raise BadRecord(f"an {what} is a {type(ref).__name__}; valid: a file path or WAV data")
        from PIL import Image

        if not isinstance(ref, Image.Image):
            raise BadRecord(f"an image is a {type(ref).__name__}; valid: a file path or a decoded image")
        return ref


def truncate_sample(sample: Sample, modalities: tuple[Modality, ...], max_tokens: int) -> Sample:
    """`sample` cut to at most `max_tokens` tokens, never inside an item's placeholder run: a cut
    that would split one moves back to the run's start, and the item goes with the rest. The
    loss mask is cut alike; BadRecord if no token carrying loss remains (nothing to learn)."""
    cut, runs = max_tokens, []
    for m in modalities:
        at = np.flatnonzero(sample.tokens == m.placeholder)
        ends = np.cumsum([m.tokens(x.shape[: len(m.unit)]) for x in sample.of(m.name)])
        runs += [(m.name, int(at[e - n]), int(at[e - 1])) for e, n in zip(ends, np.diff(ends, prepend=0))]
    for _, first, last in runs:  # runs are disjoint: one move back settles it
        if first < cut <= last:
            cut = first
    items = {
        m.name: tuple(
            x for x, (_, first, last) in zip(sample.of(m.name), [r for r in runs if r[0] == m.name]) if last < cut
        )
        for m in modalities
    }
    mask = None if sample.loss_mask is None else sample.loss_mask[:cut]
    if mask is not None and not mask[1:].any():
        raise BadRecord(f"{len(sample.tokens)} tokens, cut to {cut} (max {max_tokens}): no token left carries loss")
    return dataclasses.replace(
        sample, tokens=sample.tokens[:cut], items={k: v for k, v in items.items() if v}, loss_mask=mask
    )


def _runs(flags: np.ndarray) -> list[tuple[int, int]]:
    """(start, stop) of each run of True in `flags`."""
    edges = np.diff(np.concatenate([[0], flags.astype(np.int8), [0]]))
    return list(zip(np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)))


def _require_pyav() -> None:
    """Stop the conversion (every video file would fail alike) where PyAV is missing."""
    import importlib.util

    if importlib.util.find_spec("av") is None:
        raise ConvertError(
            "error: a record holds a video file: decoding it needs PyAV, the `video` extra: pip install 'maestro-jax[video]'"
        )


def _expand(text: str, pieces: dict[str, list[str]]) -> str:
    """`text` with its k-th occurrence of each marker in `pieces` replaced by that marker's k-th
    piece (a family's own image or video tokens); a marker with no piece left: BadRecord."""
    if not pieces:
        return text
    import re

    used = dict.fromkeys(pieces, 0)

    def piece(match) -> str:
        marker = match.group(0)
        if used[marker] >= len(pieces[marker]):
            raise BadRecord(f"its chat template writes more {marker} markers than its {len(pieces[marker])} items")
        used[marker] += 1
        return pieces[marker][used[marker] - 1]

    return re.sub("|".join(re.escape(m) for m in pieces), piece, text)


def _content_parts(text: str, marker: str) -> list[dict]:
    """A turn's text as content parts, as a chat template that reads only parts (SmolVLM's) takes
    it: each image marker an `{"type": "image"}` part, the text between them text parts (none
    empty)."""
    parts = []
    for k, piece in enumerate(text.split(marker)):
        if k:
            parts.append({"type": "image"})
        if piece:
            parts.append({"type": "text", "text": piece})
    return parts


def _find_all(text: str, marker: str) -> list[int]:
    at, out = text.find(marker), []
    while at >= 0:
        out.append(at)
        at = text.find(marker, at + len(marker))
    return out


def _parts_text(k: int, parts: list, markers: dict[str, str], refs: dict[str, list], next_listed) -> str:
    """Turn `k`'s content parts as text, each image, audio or video part as its modality's marker
    and its item appended to `refs` (the part's own, else the record's next listed one)."""
    text = ""
    for part in parts:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            text += str(part.get("text", ""))
        elif kind in ("image", "image_url", "audio", "input_audio", "video"):
            name = "image" if kind.startswith("image") else "video" if kind == "video" else "audio"
            own = _part_item(kind, part)
            refs[name].append(own if own is not None else next_listed(name))
            text += markers[name]
        else:
            raise BadRecord(
                f"turn {k} has a part of type {kind!r}; valid: text, image, image_url, audio, input_audio, video"
            )
    return text


def _part_item(kind: str, part: dict):
    """The item an OpenAI-style content part names itself (None: the record's list supplies it):
    a path (`image`, `image_url` `file://` or path, `audio`), or `input_audio`'s base64 WAV data."""
    if kind == "input_audio":
        data = (part.get("input_audio") or {}).get("data")
        if data is None:
            return None
        try:
            return base64.b64decode(data, validate=True)
        except (ValueError, TypeError) as err:
            raise BadRecord(f"an input_audio part's data is not base64 ({err})") from None
    own = (part.get("image_url") or {}).get("url") if kind == "image_url" else part.get(kind)
    return own.removeprefix("file://") if isinstance(own, str) else own


def convert(
    inputs: list[str | Path],
    out: str | Path,
    converter: Converter,
    strict: bool = False,
    split: str | None = None,
    log=sys.stderr,
) -> tuple[int, int]:
    """Write every good record of `inputs` (in order) to `out` and its index (`write_index`, what
    every process reads metadata from); a bad one is named on `log` (`skipped WHERE: why`) and
    skipped, or with `strict` stops the conversion (BadRecord). Sample ids are the records'
    positions over all inputs, so an id in a training error leads back to its record. The file
    appears at `out` only once complete. Returns (samples written, records skipped)."""
    from array_record.python.array_record_module import ArrayRecordWriter

    out = Path(out)
    partial = out.with_name(out.name + ".partial")
    writer = ArrayRecordWriter(str(partial), "group_size:1")
    written = skipped = index = 0
    done = False
    try:
        for path in inputs:
            for where, record in read_records(path, split):
                try:
                    if isinstance(record, BadRecord):
                        raise record
                    name = f"{where} (id {record['id']!r})" if isinstance(record, dict) and "id" in record else where
                    try:
                        sample = converter.sample(index, record)
                    except BadRecord as err:
                        raise BadRecord(f"{name}: {err}") from None
                except BadRecord as err:
                    if strict:
                        raise
                    print(f"skipped {err}", file=log)
                    skipped += 1
                else:
                    writer.write(encode_sample(sample))
                    written += 1
                index += 1
        done = True
    finally:
        writer.close()
        if not done:
            partial.unlink(missing_ok=True)
    partial.replace(out)
    write_index(str(out))
    return written, skipped
