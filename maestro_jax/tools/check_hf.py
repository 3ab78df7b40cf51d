"""`maestro-jax check-hf`: a Hugging Face folder through transformers and through maestro, side by
side, so a user can check an import without this repository's fixtures.

The same random inputs go through both: rows of token ids of different lengths (padded on the
right; the padding is masked on both sides and left out of the comparison), each longer than the
folder's sliding window where it has one, so the window is exercised. transformers runs the
PyTorch model (the `reference` extra: torch and transformers, on the CPU, float32); maestro loads
the folder with the same mapping `init.hf_path` uses (`models.hf`) and runs its `DecoderLM`.
The result is the largest absolute difference of the logits and that difference relative to the
largest reference logit; within `tolerance` (relative) the check passes.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from maestro_jax.hf_config import ARCHITECTURES, HFError, kind_of, llm_fields

DEFAULT_TOLERANCE = 1e-4  # float32 on both sides: rounding of different summation orders


@dataclasses.dataclass(frozen=True)
class CheckResult:
    model_type: str
    lengths: tuple[int, ...]
    max_abs: float
    max_rel: float
    tolerance: float

    @property
    def passed(self) -> bool:
        return self.max_rel <= self.tolerance


def _lengths(fields: dict) -> tuple[int, ...]:
    """Three rows, the longest past the sliding window (when there is one), all different."""
    longest = max(24, 2 * (fields.get("sliding_window") or 0) + 3)
    return (longest, longest - 5, longest // 2 + 1)


def check_llm(path: str | Path, tolerance: float = DEFAULT_TOLERANCE, seed: int = 0) -> CheckResult:
    """The logits of the LLM folder at `path` through transformers and through maestro."""
    from maestro_jax.models import DecoderLM, LLMConfig, hf

    path = Path(path)
    if kind_of(path) != "llm":
        raise HFError(f"{path}/config.json: not a decoder; check-hf compares {sorted(ARCHITECTURES)} folders")
    fields = llm_fields(path)
    lengths = _lengths(fields)
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, fields["vocab"], size=(len(lengths), lengths[0]))
    valid = np.arange(lengths[0])[None] < np.array(lengths)[:, None]
    ids = np.where(valid, ids, 0)
    reference = _transformers_logits(path, ids, valid)
    model = DecoderLM(LLMConfig.from_fields(fields))
    pos = jnp.broadcast_to(jnp.arange(lengths[0]), ids.shape)
    args = (jnp.asarray(ids, jnp.int32), pos, jnp.asarray(valid))
    abstract = jax.eval_shape(lambda: model.init(jax.random.key(0), *args)["params"])
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=one),
        jax.tree.map(lambda a: a.value if hasattr(a, "value") else a, abstract, is_leaf=lambda x: hasattr(x, "value")),
    )
    params = hf.load_llm(path, target, fields)
    ours = np.asarray(model.apply({"params": params}, *args))
    diff = np.abs(ours - reference)[valid]
    scale = float(np.abs(reference[valid]).max())
    return CheckResult(
        model_type=str(hf.read_config(path)["model_type"]),
        lengths=lengths,
        max_abs=float(diff.max()),
        max_rel=float(diff.max()) / scale,
        tolerance=tolerance,
    )


def _transformers_logits(path: Path, ids: np.ndarray, valid: np.ndarray) -> np.ndarray:
    try:
        import torch
        import transformers
    except ImportError as err:
        raise HFError(
            f"check-hf runs the folder through transformers too, and {err.name} is not installed; install the "
            f"reference extra: pip install 'maestro-jax[reference]'"
        ) from None
    model = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        out = model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(valid.astype(np.int64)))
    return out.logits.float().numpy()
