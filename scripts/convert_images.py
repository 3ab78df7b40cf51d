"""Convert a folder of images and captions into ArrayRecord files maestro_jax trains from.

Input: FOLDER/<name>.<png|jpg|jpeg> with an optional FOLDER/<name>.txt caption, and
optionally FOLDER/*.txt files with no image (text-only samples). Each image is resized
down to a multiple of patch*merge pixels (at most --max-side). Captions are tokenised
byte-level (token = byte + 3, so the vocabulary needs 259+ entries); for a real tokenizer,
conversations or plain text, use scripts/convert_dataset.py. The image's placeholder tokens
come before its caption.

    python scripts/convert_images.py FOLDER OUT.array_record --patch 4 --merge 2
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

from maestro_jax.data import (
    FIRST_TEXT_TOKEN,
    IMAGE_TOKEN,
    DataError,
    Modality,
    Sample,
    encode_sample,
    image_tokens,
    validate_sample,
    write_index,
)
from maestro_jax.data.convert import BadRecord as BadFile  # names the file at fault and why
from maestro_jax.data.convert import load_image

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg"}


def tokenize(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32) + FIRST_TEXT_TOKEN


def load_caption(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8").strip()
    except UnicodeDecodeError as err:
        raise BadFile(f"{path}: caption is not UTF-8 ({err.reason} at byte {err.start})") from err


def make_sample(
    index: int, stem: str, image_path: Path | None, caption_path: Path, patch: int, merge: int, max_side: int
) -> Sample:
    """The sample of one stem (an image, its caption, or both); BadFile naming the file at fault."""
    unit = patch * merge
    caption = load_caption(caption_path) if caption_path.exists() else stem
    images = (load_image(image_path, unit, max_side),) if image_path else ()
    placeholders = np.full(sum(image_tokens(im.shape[:2], patch, merge) for im in images), IMAGE_TOKEN, np.int32)
    sample = Sample(id=index, tokens=np.concatenate([placeholders, tokenize(caption)]), items={"image": images})
    try:
        return validate_sample(sample, (Modality("image", IMAGE_TOKEN, (unit, unit), 3),))
    except DataError as err:
        raise BadFile(f"{caption_path if caption_path.exists() else image_path or stem}: {err}") from err


def convert(folder: Path, out: Path, patch: int, merge: int, max_side: int, strict: bool = False) -> tuple[int, int]:
    """Write every good sample; a bad file is reported on stderr and skipped (with `strict`, its
    BadFile stops the conversion). Returns (samples written, files skipped)."""
    files = sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES | {".txt"})
    stems = sorted({p.stem for p in files})
    writer = ArrayRecordWriter(str(out), "group_size:1")
    count = skipped = 0
    for i, stem in enumerate(stems):
        image_path = next((p for p in files if p.stem == stem and p.suffix.lower() in IMAGE_SUFFIXES), None)
        try:
            sample = make_sample(i, stem, image_path, folder / f"{stem}.txt", patch, merge, max_side)
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
    ap.add_argument("folder", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--patch", type=int, default=4)
    ap.add_argument("--merge", type=int, default=2)
    ap.add_argument("--max-side", type=int, default=32)
    ap.add_argument(
        "--strict", action="store_true", help="stop at the first bad file (status 2) instead of skipping it"
    )
    args = ap.parse_args()
    try:
        n, skipped = convert(args.folder, args.out, args.patch, args.merge, args.max_side, args.strict)
    except BadFile as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {n} samples to {args.out}" + (f"; skipped {skipped} bad file(s), listed above" if skipped else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
