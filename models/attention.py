"""Attention masks kept in the form the host built the rows in, and the one place that picks the
kernel and the form it takes them in.

A dense boolean mask (B x Q x K) says everything, but a fused kernel handed one turns it into an
additive bias: cuDNN's flash attention then reads B x Q x K values and computes every block
(on an H200, the llama8b shape of 2 x 4096 causal tokens took 6.59 ms forward+backward with the
mask against 2.13 ms with `is_causal`, benchmarks/RESULTS.md). The rows the workloads build have a
structure the kernels take directly:

- **causal**: one sample a row from position 0, padding after it (`workloads.rows.text_rows`):
  `jax.nn.dot_product_attention(is_causal=True, key_value_seq_lengths=)`, and a left window
  (`local_window_size`) for Mistral's and Gemma's windowed layers;
- **padded**: one item a row from position 0, bidirectional (a ViT row holding one image):
  `key_value_seq_lengths=` alone;
- **packed**: several samples or items a row, each contiguous, numbered from 1 (sequence packing,
  `workloads.rows.packed_text_rows`; a ViT row of several images, `pack_items`): cuDNN's packed
  layout (per-segment lengths and offsets; causal within each segment for text), which only the
  private `jax._src.cudnn.fused_attention_stablehlo.dot_product_attention` takes, on Hopper or
  newer, and correctly under grouped-query attention only from jax 0.11.2 (0.10.2 and 0.11.0 scale
  the key offsets by the query head count: wrong results, no error).

`Mask` carries the dense mask (what every path means, and the fallback) beside the structure;
`choose_kernel` decides, from the backend, dtype, head size, lengths, compute capability, the
installed jax and the context split, which form runs, and logs each choice once. Where a fast form
runs, the dense mask is not computed: XLA removes what nothing reads.

Rows past a sample's end (padding) get other values from a fast form than from the mask (their
keys differ), but no row the loss reads attends to them, so loss and gradients are the mask's up to
float rounding; each form keeps every query row at least one key, so no kernel returns NaN there
(cuDNN does for a row without keys, seen on an H200). That is why the causal and padded forms
pass `key_value_seq_lengths` and never `query_seq_lengths`: query lengths would leave the padding
queries with no key (NaN under cuDNN) and change no row the loss reads. Rows padded on the left
(valid positions at the end) are not laid from position 0: they offer no fast form and keep the
dense mask (`tests/test_attention_forms.py`)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from maestro_jax import fast_paths

log = logging.getLogger(__name__)

CUDNN_DTYPES = ("bfloat16", "float16")
PACKED_MIN_JAX = (0, 11, 2)  # jax commit be78ee0f15: packed key offsets right under grouped-query attention
PACKED_MIN_CAPABILITY = 9.0  # "Packed layout requires a GPU with at least Hopper architecture" (jax's check)
FORMS = ("mask", "causal", "padded", "packed")


@struct.dataclass
class Mask:
    """What each query row may attend to: `dense` (B x Q x K booleans, the meaning every form
    must equal on the rows the loss reads) and, where the rows were built with one, their
    structure: `lengths` ([B] int32, one sample or item a row from position 0) or
    `segment_lengths` ([B, M] int32, each row's M segments laid one after another from position
    0, -1 past a row's last), `causal` (within the sample or segment) and `window` (a key at most
    `window - 1` positions behind its query, Mistral's `sliding_window`)."""

    dense: jax.Array
    lengths: jax.Array | None = None
    segment_lengths: jax.Array | None = None
    causal: bool = struct.field(pytree_node=False, default=False)
    window: int | None = struct.field(pytree_node=False, default=None)

    @classmethod
    def of(cls, mask) -> Mask:
        """`mask` itself, or a bare boolean array as a `Mask` with no structure."""
        return mask if isinstance(mask, Mask) else cls(mask)

    @property
    def row_lengths(self):
        """[B]: each row's one sample or item, where the rows hold at most one (`lengths`, or
        `segment_lengths` of one column); None where they may hold several."""
        if self.lengths is not None:
            return self.lengths
        if self.segment_lengths is not None and self.segment_lengths.shape[1] == 1:
            return self.segment_lengths[:, 0]
        return None

    @property
    def offered(self) -> str:
        """The fast form the structure allows (one of FORMS; "mask": none)."""
        if self.row_lengths is not None:
            return "causal" if self.causal else "padded" if self.window is None else "mask"
        if self.segment_lengths is not None and self.window is None:
            return "packed"
        return "mask"

    def windowed(self, window_BQK, window: int) -> Mask:
        """This mask and a left window of `window` positions (`window_BQK`, its dense form)."""
        return dataclasses.replace(self, dense=self.dense & window_BQK, window=window)

    def windowed_where(self, windowed, window_BQK) -> Mask:
        """The window where `windowed` (a traced per-layer flag, a scanned stack's) holds: only
        the dense form can say that."""
        return Mask(jnp.where(windowed, self.dense & window_BQK, self.dense))

    def implied(self, form: str, q_len: int, kv_len: int) -> jax.Array:
        """The B x Q x K mask `form` makes a kernel compute with (its documented semantics, built
        here so tests can hold it against `dense`)."""
        q, k = jnp.arange(q_len)[:, None], jnp.arange(kv_len)[None, :]
        if form == "causal":
            m = (k <= q)[None] & (k < key_lengths(self.row_lengths, self.window)[:, None, None])
            return m & (q - k < self.window)[None] if self.window is not None else m
        if form == "padded":
            lengths = key_lengths(self.row_lengths)[:, None, None]
            return jnp.broadcast_to(k < lengths, (self.dense.shape[0], q_len, kv_len))
        if form == "packed":
            lengths = with_padding_segment(self.segment_lengths, q_len)
            seg_q, seg_k = (segment_of(lengths, n) for n in (q_len, kv_len))
            m = (seg_q[:, :, None] == seg_k[:, None, :]) & (seg_q[:, :, None] >= 0)
            return m & (k <= q)[None] if self.causal else m
        return self.dense


def key_lengths(lengths_B, window: int | None = None):
    """The key lengths a causal or padded form hands the kernel: at least 1, so an empty row's
    queries keep a key; none (every key: causality alone keeps padding out of the real rows, and
    each padding query keeps its own position) under a window, where a length could leave a
    padding query past the window with no key."""
    if window is not None:
        return jnp.full_like(lengths_B, jnp.iinfo(jnp.int32).max)
    return jnp.maximum(lengths_B, 1).astype(jnp.int32)


def with_padding_segment(segment_lengths_BM, length: int):
    """[B, M+1]: the rows' segments and, right after each row's last, its trailing padding as one
    more segment (-1 where a row has none): a padding query then attends the padding keys before
    it, never a real sample's, and no query row is left without a key (cuDNN's packed layout
    would otherwise leave the padding outside every segment)."""
    real = jnp.maximum(segment_lengths_BM, 0)
    pad = length - jnp.sum(real, axis=1)
    count = jnp.sum(segment_lengths_BM > 0, axis=1)
    column = jnp.arange(segment_lengths_BM.shape[1] + 1)[None]
    wide = jnp.concatenate([segment_lengths_BM, jnp.full_like(segment_lengths_BM[:, :1], -1)], axis=1)
    return jnp.where((column == count[:, None]) & (pad[:, None] > 0), pad[:, None], wide).astype(jnp.int32)


def segment_of(segment_lengths_BM, length: int):
    """Each position's segment (0 .. M-1) under `segment_lengths_BM`, -1 past a row's last."""
    sizes = jnp.maximum(segment_lengths_BM, 0)
    ends = jnp.cumsum(sizes, axis=1)
    pos = jnp.arange(length)
    seg = jnp.sum(pos[None, :, None] >= ends[:, None, :], axis=-1)
    return jnp.where(pos[None] < ends[:, -1:], seg, -1)


def packed_offsets(segment_lengths_BM):
    """cuDNN's packed-layout offsets ([B, M+1]): each segment's first position, -1 past a row's
    last segment (jax's `test_sdpa_packed_layout` layout)."""
    starts = jnp.cumsum(jnp.maximum(segment_lengths_BM, 0), axis=1) - jnp.maximum(segment_lengths_BM, 0)
    starts = jnp.where(segment_lengths_BM > 0, starts, -1)
    return jnp.concatenate([starts, jnp.full_like(starts[:, :1], -1)], axis=1).astype(jnp.int32)


def segment_lengths(segments_BL: np.ndarray) -> np.ndarray:
    """The host's [B, M] segment lengths of rows whose segments (numbered from 1, laid one after
    another from position 0, 0 padding after) the row builders made; M the most segments of a
    row rounded up to a power of two (few shapes to compile), -1 past a row's last."""
    segments_BL = np.asarray(segments_BL)
    most = int(segments_BL.max(initial=0))
    m = 1 << max(most - 1, 0).bit_length()
    out = np.full((segments_BL.shape[0], m), -1, np.int32)
    for s in range(1, most + 1):
        n = np.count_nonzero(segments_BL == s, axis=1)
        out[:, s - 1] = np.where(n > 0, n, -1)
    return out


# ---- the choice -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Kernel:
    """How one attention call runs: `implementation` ("cudnn" | "xla", jax's names), `form` (one
    of FORMS) and `why` (the rule that decided, for the log line)."""

    implementation: str
    form: str
    why: str


_FORCED: list[bool] = [False]  # a process-wide switch (host batches are built on other threads)


@contextlib.contextmanager
def fast_forms_forced():
    """Take each offered fast form on any backend that can run it (XLA's runs `causal` and
    `padded`; only cuDNN's runs `packed`), so a CPU test or the GPU check can hold a fast form
    against the mask path."""
    before = _FORCED[0]
    _FORCED[0] = True
    try:
        yield
    finally:
        _FORCED[0] = before


def segment_lengths_wanted() -> bool:
    """Whether the row builders should send `segment_lengths`: on a GPU (where the packed form may
    run) or with the fast forms forced; elsewhere the extra input would only add compiled shapes."""
    return _FORCED[0] or jax.default_backend() in ("gpu", "cuda")


def cudnn_takes(platform: str, dtype, head_dim: int, q_len: int, kv_len: int, compute_capability: float) -> bool:
    """cuDNN's fused flash attention runs: an NVIDIA GPU, bfloat16 or float16 inputs (not float32),
    a head dimension a multiple of 8 up to 128 (256 from Hopper, compute capability 9.0, on), and
    even query and key lengths (its rule for a masked backward)."""
    head_max = 256 if compute_capability >= 9.0 else 128
    return (
        platform in ("gpu", "cuda")
        and np.dtype(dtype).name in CUDNN_DTYPES
        and head_dim % 8 == 0
        and head_dim <= head_max
        and q_len % 2 == 0
        and kv_len % 2 == 0
    )


def choose_kernel(
    platform: str,
    dtype,
    head_dim: int,
    q_len: int,
    kv_len: int,
    compute_capability: float = 0.0,
    jax_version: tuple[int, ...] = (0, 0, 0),
    offered: str = "mask",
    context_split: int = 1,
    forced: bool = False,
) -> Kernel:
    """The implementation (`cudnn_takes`, else XLA's) and the form: the offered fast form where
    the implementation takes it, else the mask. XLA builds the same mask from any form, so it
    keeps the mask unless `forced`; a sequence split over `context` keeps it too (a kernel's
    causal and length forms would count from each device's first query); a form the fast-path
    table (`maestro_jax.fast_paths`, decided by GPU measurement) keeps off takes the mask unless
    `forced`; the packed form needs jax >= 0.11.2 and compute capability >= 9.0."""
    impl = "cudnn" if cudnn_takes(platform, dtype, head_dim, q_len, kv_len, compute_capability) else "xla"
    if offered == "mask":
        return Kernel(impl, "mask", "the rows offer no fast form")
    if context_split > 1:
        return Kernel(impl, "mask", f"the sequence is split over {context_split} context devices")
    if impl == "xla" and not forced:
        return Kernel(impl, "mask", "XLA builds the same mask from any form")
    if not forced and fast_paths.default(f"attention.{offered}") != offered:
        return Kernel(
            impl, "mask", f"the fast-path table keeps the mask for the {offered} form (maestro_jax.fast_paths)"
        )
    if offered != "packed":
        return Kernel(impl, offered, f"{impl} takes the {offered} form")
    if impl != "cudnn":
        return Kernel(impl, "mask", "only cuDNN takes the packed layout")
    if tuple(jax_version) < PACKED_MIN_JAX:
        version = ".".join(map(str, jax_version))
        return Kernel(impl, "mask", f"jax {version} < 0.11.2 mis-offsets packed keys under grouped-query attention")
    if compute_capability < PACKED_MIN_CAPABILITY:
        return Kernel(impl, "mask", f"compute capability {compute_capability} < 9.0 (the packed layout needs Hopper)")
    return Kernel(impl, "packed", "cuDNN takes the packed layout (jax >= 0.11.2, Hopper or newer)")


def kernel_for(q_BLHK, k_BLGK, mask: Mask, context_split: int) -> Kernel:
    """`choose_kernel` for these arrays on this process's backend and device, logged once."""
    kernel = choose_kernel(
        jax.default_backend(),
        q_BLHK.dtype,
        q_BLHK.shape[-1],
        q_BLHK.shape[1],
        k_BLGK.shape[1],
        compute_capability(),
        jax.__version_info__,
        mask.offered,
        context_split,
        _FORCED[0],
    )
    _log_choice(jax.default_backend(), np.dtype(q_BLHK.dtype).name, q_BLHK.shape[-1], mask.offered, kernel)
    return kernel


@functools.cache
def _log_choice(platform: str, dtype: str, head_dim: int, offered: str, kernel: Kernel) -> None:
    log.info(
        "attention on %s, %s, head_dim %d, rows offering %s: %s with the %s form (%s)",
        platform,
        dtype,
        head_dim,
        offered,
        kernel.implementation,
        kernel.form,
        kernel.why,
    )


def compute_capability() -> float:
    """The default device's CUDA compute capability (9.0 for Hopper); 0 elsewhere."""
    return float(getattr(jax.devices()[0], "compute_capability", 0) or 0)


# ---- the fast forms -------------------------------------------------------------------------


def fast_attention(q_BLHK, k_BLGK, v_BLGK, mask: Mask, kernel: Kernel, scale: float | None):
    """Attention in `kernel`'s fast form (not "mask"), no B x Q x K tensor built."""
    if kernel.form in ("causal", "padded"):
        return jax.nn.dot_product_attention(
            q_BLHK,
            k_BLGK,
            v_BLGK,
            scale=scale,
            is_causal=kernel.form == "causal",
            key_value_seq_lengths=None if mask.window is not None else key_lengths(mask.row_lengths),
            local_window_size=None if mask.window is None else (mask.window - 1, 0),
            implementation=kernel.implementation,
        )
    if kernel.form != "packed":
        raise ValueError(f"form={kernel.form!r}: fast forms are {', '.join(FORMS[1:])}")
    from jax._src.cudnn import fused_attention_stablehlo as cudnn  # private, GPU-only (see the module doc)

    lengths = with_padding_segment(mask.segment_lengths.astype(jnp.int32), q_BLHK.shape[1])
    offsets = packed_offsets(lengths)
    return cudnn.dot_product_attention(
        q_BLHK,
        k_BLGK,
        v_BLGK,
        None,
        None,
        lengths,
        lengths,
        offsets,
        offsets,
        scale=q_BLHK.shape[-1] ** -0.5 if scale is None else scale,
        mask_type=cudnn.MaskType.PADDING_CAUSAL if mask.causal else cudnn.MaskType.NO_MASK,
        qkv_layout="BTNH",
    )
