"""Convert conversations (with images and audio) or plain text into ArrayRecord files maestro_jax trains from.

Inputs, any mix, in order: JSONL or JSON-array files of records, or folders holding a Hugging
Face `datasets` dataset saved with `save_to_disk` (needs `datasets`; `--split` picks a split).
A record is a conversation, LLaVA style `{"id", "image": path | [paths], "conversations":
[{"from": "human" | "gpt" | "system", "value": "...<image>..."}]}` or OpenAI style
`{"messages": [{"role", "content"}]}`, or plain text `{"text": ...}`. Conversations are
rendered with the tokenizer's chat template; each `<image>` marker becomes that image's
placeholder tokens (from a Gemma 3 checkpoint's folder, what its processor writes: boi, its
image tokens, eoi, each image resized to its processor's size; from a Qwen2.5-VL one,
<|vision_start|>, one <|image_pad|> per merged token, <|vision_end|>, each image resized by the
processor's smart_resize within preprocessor_config.json's min_pixels and max_pixels and
normalised as it normalises), and only the assistant's turns carry loss. Image paths are relative to
--image-root (default: the input's folder; videos too); images are scaled to at most --max-side pixels a
side (default: the largest the model takes), each side a multiple of patch * merge. Each
`<audio>` marker (the record's `audio`: path | [paths], or an OpenAI `audio` / `input_audio`
part) becomes a 16 kHz WAV clip's Whisper log-mel frames (maestro_jax/data/audio.py) and one
placeholder per frames_per_token frames. A sample over --max-tokens (default: data.max_tokens)
is skipped, or with `--on-long truncate` cut short, never inside an image's or clip's tokens.

    python scripts/convert_dataset.py llava.json OUT.array_record --tokenizer TOKENIZER_DIR \\
        --config configs/vlm_tiny.yaml [--set models.llm.vocab=32000 ...]
It also writes OUT.array_record.index.json. The config says what the model takes (vocabulary,
images or text only, the image placeholder id `workload_settings.image_token`, data.max_tokens):
the tokenizer is checked against it before any record is read (an id beyond the vocabulary, no
single `<image>` token, an `<image>` on another id than the config's image_token, a text token on
a placeholder id are refused with one `error:` line and status 2). A record that cannot become a sample (not JSON,
a missing image, markers that do not match its images, too long, ...) is skipped with one
`skipped WHERE: why` line on stderr; `--strict` stops there instead, with one `error:` line and
status 2. Sample ids are the records' positions over all inputs.
"""

import argparse
import dataclasses
import sys
from pathlib import Path

from maestro_jax.config import ConfigError, load_config
from maestro_jax.data.convert import (
    IMAGE_MARKER,
    ON_LONG,
    BadRecord,
    ChatTokenizer,
    Converter,
    ConvertError,
    Target,
    check_paths,
    convert,
)


def target_of(config: Path, overrides: list[str]) -> Target:
    """What the config's model takes: its workload's vocabulary and modalities, data.max_tokens."""
    from maestro_jax.workloads import check_config, modalities_of

    cfg = load_config(config, overrides)
    workload = check_config(cfg)
    vocab = workload.vocab(cfg)
    fields = [f"models.{n}.vocab" for n, m in cfg.models.items() if getattr(m, "vocab", None) == vocab]
    return Target(vocab, "=".join(fields) or "vocab", modalities_of(cfg, workload), cfg.data.max_tokens, cfg.workload)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("inputs", type=Path, nargs="+", metavar="INPUT")
    ap.add_argument("out", type=Path, metavar="OUT")
    ap.add_argument("--tokenizer", type=Path, required=True, help="a Hugging Face tokenizer folder")
    ap.add_argument("--config", type=Path, required=True, help="the training config (what the model takes)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config overrides")
    ap.add_argument("--image-root", type=Path, help="where relative image paths start (default: the input's folder)")
    ap.add_argument("--image-token", default=IMAGE_MARKER, help="the marker of an image in the text")
    ap.add_argument("--max-side", type=int, help="scale images to at most this many pixels a side")
    ap.add_argument(
        "--max-tokens",
        type=int,
        help="the longest sample, in tokens (default: the config's data.max_tokens; at most that)",
    )
    ap.add_argument(
        "--on-long",
        choices=ON_LONG,
        default="skip",
        help="a longer sample: skip it (a bad record), or truncate it (never inside an image's or clip's tokens)",
    )
    ap.add_argument("--split", help="the split of a Hugging Face DatasetDict")
    ap.add_argument("--strict", action="store_true", help="stop at the first bad record (status 2)")
    args = ap.parse_args()
    try:
        check_paths(args.inputs, args.out, args.image_root)
        target = target_of(args.config, args.set)
        if args.max_tokens is not None:
            top = target.max_tokens
            if not 2 <= args.max_tokens <= (top or args.max_tokens):
                raise ConvertError(
                    f"error: --max-tokens={args.max_tokens}: valid: 2 to {top or 'any'} (the config's data.max_tokens)"
                )
            target = dataclasses.replace(target, max_tokens=args.max_tokens)
        root = args.image_root or (args.inputs[0] if args.inputs[0].is_dir() else args.inputs[0].parent)
        converter = Converter(
            ChatTokenizer.load(args.tokenizer), target, root, args.max_side, args.image_token, args.on_long
        )
        n, skipped = convert(args.inputs, args.out, converter, args.strict, args.split)
    except (ConfigError, ConvertError) as err:
        print(str(err) if str(err).startswith("error:") else f"error: {err}", file=sys.stderr)
        return 2
    except BadRecord as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if not n:
        print(f"error: no record became a sample ({skipped} skipped, listed above)", file=sys.stderr)
        return 2
    print(f"wrote {n} samples to {args.out}" + (f"; skipped {skipped} bad record(s), listed above" if skipped else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
