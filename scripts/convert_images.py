"""Convert a folder of images and captions into ArrayRecord files maestro_jax trains from.

Input: FOLDER/<name>.<png|jpg|jpeg> with an optional FOLDER/<name>.txt caption, and
optionally FOLDER/*.txt files with no image (text-only samples). Each image is resized
down to a multiple of patch*merge pixels (at most --max-side). Captions are tokenised
byte-level (byte b is the b-th id from 3 up that is not the image placeholder: byte + 3 with
the default placeholder 1, so the vocabulary needs 259+ entries); for a real tokenizer,
conversations or plain text, use scripts/convert_dataset.py. The image's placeholder tokens
come before its caption.

    python scripts/convert_images.py FOLDER OUT.array_record --patch 4 --merge 2
    python scripts/convert_images.py FOLDER OUT.array_record --config CONFIG [--set KEY=VALUE ...]
With --config, the image placeholder id (`workload_settings.image_token`), patch * merge and the
largest image side (the --max-side default) come from the config's workload, and the byte ids are
checked against its vocabulary before any file is read; without it, the placeholder is the
default id 1 and --max-side defaults to 32.
It also writes OUT.array_record.index.json (each record's length and image shapes).
A file that cannot become a sample (not a readable image, a caption that is not UTF-8 or too
short: a sample needs 2 text tokens) is skipped with one line on stderr naming it and why; `--strict`
stops there instead, with one `error:` line and status 2.
Then set `data: {kind: array_record, paths: [OUT.array_record]}` in the config.
"""

import argparse
import sys
from pathlib import Path

import numpy as np
from array_record.python.array_record_module import ArrayRecordWriter

from maestro_jax.config import ConfigError, load_config
from maestro_jax.data import (
    FIRST_TEXT_TOKEN,
    IMAGE_TOKEN,
    DataError,
    Modality,
    Sample,
    encode_sample,
    text_ids,
    validate_sample,
    write_index,
)
from maestro_jax.data.convert import BadRecord as BadFile  # names the file at fault and why
from maestro_jax.data.convert import ConvertError, check_input, check_out, load_image

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg"}


def byte_ids(image: Modality) -> np.ndarray:
    """The id of each byte value (256): the first text ids that are not the image placeholder."""
    return text_ids(FIRST_TEXT_TOKEN + 256 + 1, (image.placeholder,))[:256].astype(np.int32)


def tokenize(text: str, ids: np.ndarray) -> np.ndarray:
    return ids[np.frombuffer(text.encode("utf-8"), np.uint8)]


def load_caption(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8").strip()
    except UnicodeDecodeError as err:
        raise BadFile(f"{path}: caption is not UTF-8 ({err.reason} at byte {err.start})") from err


def make_sample(
    index: int, stem: str, image_path: Path | None, caption_path: Path, image: Modality, max_side: int
) -> Sample:
    """The sample of one stem (an image, its caption, or both); BadFile naming the file at fault."""
    caption = load_caption(caption_path) if caption_path.exists() else stem
    images = (load_image(image_path, image.unit[0], max_side),) if image_path else ()
    placeholders = np.full(sum(image.tokens(im.shape[:2]) for im in images), image.placeholder, np.int32)
    tokens = np.concatenate([placeholders, tokenize(caption, byte_ids(image))])
    sample = Sample(id=index, tokens=tokens, items={"image": images})
    try:
        return validate_sample(sample, (image,))
    except DataError as err:
        raise BadFile(f"{caption_path if caption_path.exists() else image_path or stem}: {err}") from err


def image_of(config: Path, overrides: list[str]) -> Modality:
    """The image modality of the config's workload (its placeholder id checked against the
    vocabulary), with the byte ids checked to fit that vocabulary too."""
    from maestro_jax.workloads import check_config, modalities_of

    cfg = load_config(config, overrides)
    workload = check_config(cfg)
    image = next((m for m in modalities_of(cfg, workload) if m.name == "image"), None)
    if image is None:
        raise ConfigError(
            f"error: workload={cfg.workload!r}: takes no images; valid: a workload with an image modality"
        )
    top, vocab = int(byte_ids(image)[-1]), workload.vocab(cfg)
    if top >= vocab:
        raise ConfigError(
            f"error: vocab={vocab}: byte-level captions take ids up to {top}; valid: a vocabulary of at least {top + 1}"
        )
    return image


def convert(folder: Path, out: Path, image: Modality, max_side: int, strict: bool = False) -> tuple[int, int]:
    """Write every good sample; a bad file is reported on stderr and skipped (with `strict`, its
    BadFile stops the conversion). Returns (samples written, files skipped)."""
    files = sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES | {".txt"})
    stems = sorted({p.stem for p in files})
    writer = ArrayRecordWriter(str(out), "group_size:1")
    count = skipped = 0
    for i, stem in enumerate(stems):
        image_path = next((p for p in files if p.stem == stem and p.suffix.lower() in IMAGE_SUFFIXES), None)
        try:
            sample = make_sample(i, stem, image_path, folder / f"{stem}.txt", image, max_side)
        except BadFile as err:
            if strict:
                writer.close()
                raise
            print(f"skipped {err}", file=sys.stderr)
            skipped += 1
            continue
        writer.write(encode_sample(sample))
        count += 1
    writer.close()
    write_index(str(out))  # every process reads metadata from the index, payload only where needed
    return count, skipped


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path, metavar="FOLDER")
    ap.add_argument("out", type=Path, metavar="OUT")
    ap.add_argument("--patch", type=int, help="the ViT's patch side (default 4; not with --config)")
    ap.add_argument(
        "--merge", type=int, help="patches merged a side into one image token (default 2; not with --config)"
    )
    ap.add_argument("--max-side", type=int, help="scale images to at most this many pixels a side")
    ap.add_argument("--config", type=Path, help="the training config: image placeholder id, patch * merge, vocabulary")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config overrides")
    ap.add_argument(
        "--strict", action="store_true", help="stop at the first bad file (status 2) instead of skipping it"
    )
    args = ap.parse_args()
    if args.config is not None and (args.patch or args.merge):
        print("error: --patch/--merge: the config sets them (models.vision); valid: leave them out", file=sys.stderr)
        return 2
    try:
        check_input(args.folder, "FOLDER", folder=True)
        check_out(args.out)
        if args.config is not None:
            image = image_of(args.config, args.set)
            if args.max_side is None and image.max_shape is None:
                raise ConfigError("error: --max-side: missing; the model sets no largest image, so give one")
            max_side = args.max_side or image.max_shape[0]
        else:
            unit = (args.patch or 4) * (args.merge or 2)
            image, max_side = Modality("image", IMAGE_TOKEN, (unit, unit), 3), args.max_side or 32
        n, skipped = convert(args.folder, args.out, image, max_side, args.strict)
    except (ConfigError, ConvertError) as err:
        print(str(err), file=sys.stderr)
        return 2
    except BadFile as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {n} samples to {args.out}" + (f"; skipped {skipped} bad file(s), listed above" if skipped else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
