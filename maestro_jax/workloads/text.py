"""Host-side packing of token rows shared by the LLM-backed sections (numpy only)."""

import numpy as np

from maestro_jax.core.buckets import bucket
from maestro_jax.data import IMAGE_TOKEN


def text_rows(rows) -> dict[str, np.ndarray]:
    """Next-token rows: inputs are tokens[:-1], targets tokens[1:]; image placeholders carry no loss."""
    length = bucket(max((len(s.tokens) - 1 for s in rows if s is not None), default=1))
    r = len(rows)
    out = {
        "input_ids": np.zeros((r, length), np.int32),
        "targets": np.zeros((r, length), np.int32),
        "loss_mask": np.zeros((r, length), np.float32),
        "positions": np.zeros((r, length), np.int32),
        "valid": np.zeros((r, length), bool),
        "image_tok": np.full((r, length), -1, np.int32),
    }
    for i, s in enumerate(rows):
        if s is None:
            continue
        t = s.tokens
        n = len(t) - 1
        out["input_ids"][i, :n] = t[:-1]
        out["targets"][i, :n] = t[1:]
        out["loss_mask"][i, :n] = t[1:] != IMAGE_TOKEN
        out["positions"][i, :n] = np.arange(n)
        out["valid"][i, :n] = True
        is_img = t[:-1] == IMAGE_TOKEN
        out["image_tok"][i, :n] = np.where(is_img, np.cumsum(is_img) - 1, -1)
    return out


def loss_tokens(samples) -> int:
    """Global count of target tokens that carry loss (the sink's normaliser)."""
    return int(sum(np.count_nonzero(s.tokens[1:] != IMAGE_TOKEN) for s in samples))


def route(routes, edge: str, rows) -> np.ndarray:
    return np.asarray(routes.get(edge, np.full(len(rows), -1)), np.int32)
