"""Convert a folder of images and captions into ArrayRecord files maestro_jax trains from.

Input: FOLDER/<name>.<png|jpg|jpeg> with an optional FOLDER/<name>.txt caption, and
optionally FOLDER/*.txt files with no image (text-only samples). Each image is resized
down to a multiple of patch*merge pixels (at most --max-side). Captions are tokenised
byte-level (token = byte + 3, so the vocabulary needs 259+ entries); bring your own tokenizer
by replacing `tokenize`. The image's placeholder tokens come before its caption.

    python scripts/convert_images.py FOLDER OUT.array_record --patch 4 --merge 2
It also writes OUT.array_record.index.json (each record's length and image shapes).
Then set `data: {kind: array_record, paths: [OUT.array_record]}` in the config.
"""

import argparse
from pathlib import Path

import numpy as np
from array_record.python.array_record_module import ArrayRecordWriter
from PIL import Image

from maestro_jax.data import (
    FIRST_TEXT_TOKEN,
    IMAGE_TOKEN,
    Modality,
    Sample,
    encode_sample,
    image_tokens,
    validate_sample,
    write_index,
)

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg"}


def tokenize(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32) + FIRST_TEXT_TOKEN


def load_image(path: Path, unit: int, max_side: int) -> np.ndarray:
    img = Image.open(path).convert("RGB")
    scale = min(1.0, max_side / max(img.size))
    w = max(unit, int(img.size[0] * scale) // unit * unit)
    h = max(unit, int(img.size[1] * scale) // unit * unit)
    pixels = np.asarray(img.resize((w, h), Image.BICUBIC), np.float32)
    return pixels / 127.5 - 1.0


def convert(folder: Path, out: Path, patch: int, merge: int, max_side: int) -> int:
    unit = patch * merge
    files = sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES | {".txt"})
    stems = sorted({p.stem for p in files})
    writer = ArrayRecordWriter(str(out), "group_size:1")
    count = 0
    for i, stem in enumerate(stems):
        image_path = next((p for p in files if p.stem == stem and p.suffix.lower() in IMAGE_SUFFIXES), None)
        caption_path = folder / f"{stem}.txt"
        caption = caption_path.read_text().strip() if caption_path.exists() else stem
        images = (load_image(image_path, unit, max_side),) if image_path else ()
        placeholders = np.full(sum(image_tokens(im.shape[:2], patch, merge) for im in images), IMAGE_TOKEN, np.int32)
        sample = Sample(id=i, tokens=np.concatenate([placeholders, tokenize(caption)]), items={"image": images})
        writer.write(encode_sample(validate_sample(sample, (Modality("image", IMAGE_TOKEN, (unit, unit), 3),))))
        count += 1
    writer.close()
    write_index(str(out))  # every process reads metadata from the index, payload only where needed
    return count


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--patch", type=int, default=4)
    ap.add_argument("--merge", type=int, default=2)
    ap.add_argument("--max-side", type=int, default=32)
    args = ap.parse_args()
    n = convert(args.folder, args.out, args.patch, args.merge, args.max_side)
    print(f"wrote {n} samples to {args.out}")


if __name__ == "__main__":
    main()
