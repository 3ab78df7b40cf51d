"""Kernel timings: the project's own blocks, one layer at a time, beside the cost model's prediction.

Why: `planning/cost.efficiency` is fitted to published H100 training runs that all do at least 512
tokens and 1536 weight columns per device per micro-step (scripts/calibrate_published.py), so below
that the curve is an extrapolation. These rows measure that range on the GPU at hand, with the
layers the project really runs, so that `scripts/calibrate_gpu.py` can refit the curve.

What runs: one layer of `models.llm.DecoderBlock` (dense SwiGLU, and the mixture-of-experts FFN with
the `sparse` dispatch that configs/vlm_paper_scale.yaml uses; on one device without a mesh that is
`ragged_experts` with `tiled_ffn`), one `models.layers.EncoderBlock` (the ViT block), and
`models.layers.attention` alone. Each shape is jitted twice: `forward` (the block's output) and
`forward_backward` (`jax.value_and_grad` of the sum of the output in float32, with respect to the
parameters and the block's input, as a layer inside a stack needs both). Parameters, inputs and the
(causal, for decoders; full, for the ViT) mask are made on the device by one jitted program per
shape; bfloat16 on accelerators, float32 in the CPU dry run (each row records its dtype).

A tensor-parallel rank is emulated as it computes (Megatron-style column/row slicing): a block of
the full `width` whose query heads, key/value heads and MLP (or expert MLP) width are divided by
`tensor`; the all-reduce after the attention output and the MLP is not run (one device). The ViT
block derives its head dimension as width / heads, so a block with heads / tensor is not a rank's
slice: ViT rows run at tensor 1 only.

What a row predicts, through the project's functions:
  * flops: forward FLOPs of the rank's share of one layer, from the workload cost functions the
    planner reads: decoder and decoder_moe `workloads.costs.llm_cost(LLMConfig(depth=1, sliced),
    head=False)` (for the dense decoder equal to `cost.transformer_flops(width, 1, heads/t, kv/t,
    head_dim, mlp/t)`'s linear term, attention halved for causal), per row of L tokens
    `flops * L + attention_flops * L**2`; vit `vit_cost(depth 2) - vit_cost(depth 1)` (one block,
    full attention within an image of L patches); attention the attention term alone. A
    `forward_backward` row counts (1 + backward_factor) forwards, backward_factor =
    `cost.SectionCost.backward_factor` (2.0: the backward costs two forwards).
  * predicted_s = flops / (DEVICES[device]["flops"] * cost.efficiency(tokens / tensor, width /
    tensor)): `cost.analytic_section`'s compute time for these FLOPs (it evaluates efficiency at
    micro_batch * units / tensor tokens per device and width / tensor columns, and divides the
    layer's FLOPs over `tensor` ranks), without its per-micro-step `overhead_s` (a program-level
    constant, not a layer's) and with cost.py's current efficiency constants. `tokens` is the rows x
    positions of the micro-step, all of which a tensor rank processes; `tokens_per_device` is the
    efficiency's argument, tokens / tensor, the convention the fitted curve is used with.
Timing: compiled ahead of time (`compile_s`), one warm-up call, then the median over `repeats`
samples of wall-clock time, each sample `inner` back-to-back calls waited for once (so that host
dispatch overlaps device work, as in a training step) divided by `inner`. No test asserts a time.

The full grid is pruned to fit about 4 minutes on one H100 including compiles (`grid`): fewer token
counts at width 8192, MoE at two tensor degrees, ViT at tensor 1, shapes over a memory budget skipped,
and a time budget after which the remaining (lowest-tier) shapes are skipped; every skipped shape is
reported with its reason. `kernel_report` runs everything the GPU check needs.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from maestro_jax.models import LLMConfig, ViTConfig
from maestro_jax.models import attention as attention_forms
from maestro_jax.models.layers import EncoderBlock, attention
from maestro_jax.models.llm import DecoderBlock
from maestro_jax.planning import cost
from maestro_jax.workloads.costs import llm_cost, vit_cost

KINDS = ("decoder", "decoder_moe", "vit", "attention")
PASSES = ("forward", "forward_backward")
BACKWARD_FACTOR = cost.SectionCost.backward_factor  # the backward costs this many forwards (2.0)
# measure's time budget on an accelerator: with memory_rows and attention_implementations (about
# 30-40 s together on an H100) the whole kernel_report stays near 4 minutes
GPU_BUDGET_S = 150.0


@dataclasses.dataclass(frozen=True)
class Arch:
    """A full (unsliced) layer: the model a kernel row's block is a rank of."""

    width: int
    heads: int
    kv_heads: int
    head_dim: int
    mlp: int  # dense MLP width, or each expert's MLP width under MoE
    experts: int = 0
    experts_per_token: int = 0
    source: str = ""


# The layers measured on an accelerator (Hugging Face configs of the models named).
GPU_ARCHS = {
    ("decoder", 2048): Arch(2048, 16, 8, 128, 8192, source="Llama-3.2-1B-like width and MLP, head_dim 128"),
    ("decoder", 4096): Arch(4096, 32, 8, 128, 14336, source="meta-llama/Llama-3.1-8B"),
    ("decoder", 8192): Arch(8192, 64, 8, 128, 28672, source="meta-llama/Llama-3.1-70B"),
    ("decoder_moe", 2048): Arch(2048, 32, 4, 128, 768, 128, 8, source="Qwen/Qwen3-30B-A3B (configs/vlm_paper_scale)"),
    ("vit", 1152): Arch(1152, 16, 16, 72, 4304, source="google/siglip-so400m-patch14-384"),
    ("attention", 4096): Arch(4096, 32, 8, 128, 14336, source="meta-llama/Llama-3.1-8B's attention"),
}
# The CPU dry run: the same blocks, tiny.
DRY_ARCHS = {
    ("decoder", 128): Arch(128, 8, 4, 16, 512),
    ("decoder_moe", 64): Arch(64, 4, 4, 16, 64, 4, 2),
    ("vit", 64): Arch(64, 4, 4, 16, 256),
    ("attention", 128): Arch(128, 8, 4, 16, 512),
}


@dataclasses.dataclass(frozen=True)
class Shape:
    """One measured shape: a kernel at `tokens` per micro-step (rows of `seq_len`) on a rank of a
    `tensor`-way split. `tier`: the order of importance under the time budget (0 first)."""

    kernel: str
    arch: Arch
    tensor: int
    tokens: int
    seq_len: int
    tier: int = 0

    @property
    def rows(self) -> int:
        return self.tokens // self.seq_len

    @property
    def width_per_device(self) -> float:
        return self.arch.width / self.tensor

    def sliced(self) -> Arch:
        """The rank's share: heads, key/value heads and MLP divided by `tensor` (key/value heads
        replicated when fewer than `tensor`, as Megatron does)."""
        a, t = self.arch, self.tensor
        return dataclasses.replace(a, heads=a.heads // t, kv_heads=max(a.kv_heads // t, 1), mlp=a.mlp // t)

    def llm_config(self) -> LLMConfig:
        s = self.sliced()
        moe = self.kernel == "decoder_moe"
        return LLMConfig(
            vocab=1,  # no embedding or head in a block
            width=s.width,
            depth=1,
            heads=s.heads,
            kv_heads=s.kv_heads,
            head_dim=s.head_dim,
            mlp=s.mlp,
            experts=s.experts if moe else 0,
            experts_per_token=s.experts_per_token if moe else 0,
            expert_mlp=s.mlp if moe else 0,
            moe_dispatch="sparse",
        )

    def vit_config(self, depth: int = 1) -> ViTConfig:
        a = self.arch
        return ViTConfig(patch=14, channels=3, width=a.width, depth=depth, heads=a.heads, mlp=a.mlp, out_width=a.width)


def _row_pairs(shape: Shape) -> float:
    """Attention pairs per token-row unit: rows x L**2 (the cost functions' per-pair coefficient
    already halves causal attention)."""
    return shape.rows * shape.seq_len**2


def forward_flops(shape: Shape) -> float:
    """Forward FLOPs of the rank's share of one layer, from the workload cost functions (module
    docstring)."""
    if shape.kernel == "vit":
        one, two = vit_cost(shape.vit_config(1), shape.seq_len), vit_cost(shape.vit_config(2), shape.seq_len)
        linear, attn = two.flops - one.flops, two.attention_flops - one.attention_flops
    else:
        c = llm_cost(shape.llm_config(), head=False)
        linear, attn = (0.0 if shape.kernel == "attention" else c.flops), c.attention_flops
    return linear * shape.tokens + attn * _row_pairs(shape)


def predicted_seconds(
    flops: float, tokens: float, tensor: int, width_per_device: float, device: str, params: Sequence[float] = ()
) -> float:
    """The cost model's time for `flops` on one device (module docstring): `params` replaces
    cost.efficiency's (peak, half_tokens, half_width) when given."""
    eff = cost.efficiency(tokens / tensor, width_per_device, *params)
    return flops / (cost.DEVICES[device]["flops"] * eff)


def device_key(device_kind: str) -> str:
    """The `cost.DEVICES` entry for a JAX `device_kind` ("NVIDIA H100 80GB HBM3" -> "h100");
    "cpu" for anything else (predictions then use the rough CPU entry)."""
    kind = device_kind.upper()
    return "h200" if "H200" in kind else "h100" if "H100" in kind else "cpu"


# ---- the grid --------------------------------------------------------------------------------


def grid(dry_run: bool) -> list[Shape]:
    """The shapes measured, in order of importance (tier 0 first; the time budget cuts the tail).

    Accelerator (about 50 shapes, 2 compiles each): decoder widths 2048 and 4096 at tensor 1, 2, 4,
    8 and tokens 4096 (tier 0), 256 and 16384 (tier 1), 1024 (tier 2); width 8192 only at 8192
    (tier 0) and 1024 (tier 1) tokens; 32768 tokens at width 2048, tensor 1 and 8 (tier 2). MoE
    (Qwen3-30B-A3B layer) at tensor 1 and 4, 8192 tokens (tier 0 / 1) and 2048 tokens at tensor 1
    (tier 2). ViT (SigLIP so400m block, 1024-patch images) at tensor 1: 4096 (tier 0), 256 and
    16384 (tier 1), 1024 (tier 2). Attention alone at 4096-token sequences, tensor 1 and 8: 4096
    (tier 0) and 16384 (tier 1) tokens. Decoder rows are 2048-token sequences (shorter micro-steps
    one sequence): the project's attention may take XLA's path, which holds rows x heads x L**2
    float32 scores.

    Dry run (CPU, float32; compiles are most of its time): decoder width 128 at tensor 1, 2, 4
    (64 and 32 columns per device) with 256 tokens, and at tensor 1 with 64 and 512 tokens; MoE
    width 64, ViT width 64 (64-patch images) and attention, each at tensor 1 with 256 tokens;
    sequences of at most 128 tokens."""
    shapes: list[Shape] = []
    archs = DRY_ARCHS if dry_run else GPU_ARCHS

    def add(kind: str, width: int, tensor: int, tokens: int, tier: int, seq: int) -> None:
        shapes.append(Shape(kind, archs[kind, width], tensor, tokens, min(tokens, seq), tier))

    (_dry_run_grid if dry_run else _gpu_grid)(add)
    return sorted(shapes, key=lambda s: s.tier)  # stable: within a tier, the order they were added


def _dry_run_grid(add: Callable) -> None:
    """`grid`'s dry run: 8 shapes, compiles (a few seconds each on 2 CPU cores) are its time."""
    for t in (1, 2, 4):
        add("decoder", 128, t, 256, 0, 128)
    add("decoder", 128, 1, 64, 1, 128)
    add("decoder", 128, 1, 512, 1, 128)
    add("decoder_moe", 64, 1, 256, 0, 128)
    add("vit", 64, 1, 256, 0, 64)
    add("attention", 128, 1, 256, 0, 128)


def _gpu_grid(add: Callable) -> None:
    """`grid` on an accelerator (its docstring says which shapes, by tier)."""
    for w in (2048, 4096):
        for t in (1, 2, 4, 8):
            for tokens, tier in ((4096, 0), (256, 1), (16384, 1), (1024, 2)):
                add("decoder", w, t, tokens, tier, 2048)
    for t in (1, 2, 4, 8):
        add("decoder", 8192, t, 8192, 0, 2048)
        add("decoder", 8192, t, 1024, 1, 2048)
    for t in (1, 8):
        add("decoder", 2048, t, 32768, 2, 2048)
    add("decoder_moe", 2048, 1, 8192, 0, 2048)
    add("decoder_moe", 2048, 4, 8192, 1, 2048)
    add("decoder_moe", 2048, 1, 2048, 2, 2048)
    for tokens, tier in ((4096, 0), (256, 1), (16384, 1), (1024, 2)):
        add("vit", 1152, 1, tokens, tier, 1024)
    for t in (1, 8):
        add("attention", 4096, t, 4096, 0, 4096)
        add("attention", 4096, t, 16384, 1, 4096)


def estimate_bytes(shape: Shape, itemsize: int) -> int:
    """A rough upper estimate of a forward-backward's device memory, to skip shapes that would not
    fit: parameters three times (weights, gradients, a temporary), activations kept for the backward
    and their gradients, and XLA attention's float32 scores (rows x heads x L**2, about 16 bytes a
    score with the probabilities and their gradient), whichever implementation runs."""
    s, t = shape.sliced(), shape.tokens
    w, qkv = s.width, (s.heads + 2 * s.kv_heads) * s.head_dim
    attn_params = w * qkv + s.heads * s.head_dim * w
    if shape.kernel == "attention":
        params, act = 0, 4 * qkv
    elif shape.kernel == "decoder_moe":
        tile = max(8, s.mlp)
        pair_rows = t * s.experts_per_token + s.experts * (tile - 1)  # tiled_ffn's padded rows
        params = attn_params + w * s.experts + 3 * s.experts * w * s.mlp
        gathered = 3 * (pair_rows // tile + 1) * w * s.mlp  # each tile's expert weights
        act = 10 * w + 2 * qkv + (pair_rows / t) * (3 * w + 3 * s.mlp) + gathered / t
    elif shape.kernel == "vit":
        params, act = 4 * w * w + 2 * w * s.mlp, 16 * w + 2 * s.mlp
    else:
        params, act = attn_params + 3 * w * s.mlp, 10 * w + 2 * qkv + 3 * s.mlp
    scores = shape.rows * s.heads * shape.seq_len**2 * 16
    return int(itemsize * (3 * params + 2 * t * act) + scores)


# ---- building and timing ---------------------------------------------------------------------


def _project_attention(dtype, head_dim: int, length: int) -> str:
    """The implementation `models.layers.attention` takes for a causal decoder row of these
    inputs (`models.attention.choose_kernel`), with the form: e.g. "cudnn/causal"."""
    k = attention_forms.choose_kernel(
        jax.default_backend(),
        dtype,
        head_dim,
        length,
        length,
        attention_forms.compute_capability(),
        jax.__version_info__,
        "causal",
    )
    return f"{k.implementation}/{k.form}"


@dataclasses.dataclass(frozen=True)
class _Kernel:
    """A shape made runnable: `fn(*diff, *const)` runs it; `make(flat)` cuts (diff, const) from one
    flat vector of `size` standard normal values (the inputs; parameters scaled to the models'
    0.02 init); the backward differentiates the `n_diff` leading arguments."""

    fn: Callable
    make: Callable
    size: int
    n_diff: int

    def arguments(self, dtype, dry_run: bool) -> tuple:
        """(diff, const) on the default device. One random draw: a single random op keeps the
        program quick to compile (one per parameter leaf takes seconds on CPU); the dry run draws
        on the host (tiny) and only cuts on the device."""
        if dry_run:
            flat = jnp.asarray(np.random.default_rng(0).standard_normal(self.size, np.float32).astype(dtype))
        else:
            flat = jax.jit(lambda key: jax.random.normal(key, (self.size,), dtype))(jax.random.key(0))
        return compile_program(self.make, (flat,), dry_run)(flat)

    def abstract_arguments(self, dtype) -> tuple:
        return jax.eval_shape(self.make, jax.ShapeDtypeStruct((self.size,), dtype))


def _cut(flat, shapes: Sequence[tuple[int, ...]]) -> list[jax.Array]:
    sizes = [math.prod(shape) for shape in shapes]
    parts = jnp.split(flat, np.cumsum(sizes)[:-1].tolist())
    return [p.reshape(shape) for p, shape in zip(parts, shapes)]


def _builder(shape: Shape, dtype) -> _Kernel:
    """The kernel of `shape` in `dtype` (`_Kernel`)."""
    b, length = shape.rows, shape.seq_len
    if shape.kernel == "attention":
        s = shape.sliced()
        q = (b, length, s.heads, s.head_dim)
        kv = (b, length, s.kv_heads, s.head_dim)

        def make_attention(flat):
            return tuple(_cut(flat, [q, kv, kv])), (_causal(b, length),)

        return _Kernel(attention, make_attention, math.prod(q) + 2 * math.prod(kv), 3)
    if shape.kernel == "vit":
        a = shape.arch
        module = EncoderBlock(a.width, a.heads, a.mlp)

        def const():
            return (jnp.ones((b, length, length), bool),)  # one image per row: full attention

    else:
        module = DecoderBlock(shape.llm_config())

        def const():
            positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (b, length))
            causal = _causal(b, length)  # every layer alike (no window): `windowed` is read from the config
            return False, positions, causal, causal, jnp.ones((b, length), bool)

    x_shape = (b, length, shape.arch.width)
    abstract = jax.eval_shape(
        lambda: nn.meta.unbox(module.init(jax.random.key(0), jnp.zeros(x_shape, dtype), *const()))["params"]
    )
    leaves, tree = jax.tree.flatten(abstract)
    shapes = [x_shape] + [leaf.shape for leaf in leaves]

    def make(flat):
        x, *params = _cut(flat, shapes)
        return (jax.tree.unflatten(tree, [0.02 * p for p in params]), x), const()

    def fn(params, x, *rest):
        return module.apply({"params": params}, x, *rest)

    return _Kernel(fn, make, sum(math.prod(s) for s in shapes), 2)


def _causal(rows: int, length: int):
    i = jnp.arange(length)
    return jnp.broadcast_to(i[:, None] >= i[None, :], (rows, length, length))


def passes(fn: Callable, n_diff: int) -> dict[str, Callable]:
    def forward_backward(*args):
        def loss(diff):
            return jnp.sum(fn(*diff, *args[n_diff:]).astype(jnp.float32))

        return jax.value_and_grad(loss)(args[:n_diff])

    return {"forward": fn, "forward_backward": forward_backward}


# The dry run checks the plumbing, not the CPU's speed: XLA's LLVM optimisation off cuts its
# compiles (which dominate it) about 2.5x on 2 cores. Accelerator runs compile with the defaults.
DRY_COMPILER_OPTIONS = {"xla_backend_optimization_level": 0}


def compile_program(f: Callable, args, dry_run: bool):
    lowered = jax.jit(f).lower(*args)
    return lowered.compile(compiler_options=DRY_COMPILER_OPTIONS) if dry_run else lowered.compile()


def time_program(compiled, args, repeats: int, min_sample_s: float) -> tuple[float, int]:
    """(median seconds per call, calls per sample): module docstring."""
    jax.block_until_ready(compiled(*args))  # warm-up, waited for: the timing starts on an idle device
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(*args))  # one call's time sizes the samples
    one = time.perf_counter() - t0
    inner = max(1, min(64, math.ceil(min_sample_s / max(one, 1e-6))))
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            out = compiled(*args)
        jax.block_until_ready(out)  # the sample ends when its last call has run
        samples.append((time.perf_counter() - t0) / inner)
    return statistics.median(samples), inner


def _memory_budget(dry_run: bool) -> int:
    stats = jax.devices()[0].memory_stats() or {}
    if dry_run or "bytes_limit" not in stats:
        return 2 * 2**30
    return int(0.7 * stats["bytes_limit"])


def measure(
    dry_run: bool,
    device: str,
    *,
    shapes: Sequence[Shape] | None = None,
    budget_s: float | None = None,
    repeats: int | None = None,
    skipped: list[dict] | None = None,
    progress: Callable[[str], None] | None = None,
) -> list[dict]:
    """Time `grid(dry_run)` (or `shapes`) on the default JAX device; one row per shape and pass.

    `device` is the `cost.DEVICES` entry the predictions use ("h100", "h200"; the dry run: "cpu";
    `device_key` maps a device_kind). `budget_s` (default GPU_BUDGET_S on an accelerator, none in the
    dry run): once spent, the remaining shapes are skipped. `skipped`, when given, receives
    {"kernel", "width", "tensor", "tokens", "reason"} for every shape not measured (memory
    budget, time budget, or an error such as running out of memory). Row keys: kernel, pass,
    width, tensor, width_per_device, tokens, seq_len, dtype, flops, predicted_s, measured_s,
    achieved_flops_per_s, plus tokens_per_device, rows, heads, kv_heads, head_dim, mlp, experts,
    experts_per_token, device, peak_flops, efficiency_predicted, efficiency_measured,
    attention_implementation, compile_s, inner, repeats."""
    dtype = jnp.float32 if dry_run else jnp.bfloat16
    shapes = grid(dry_run) if shapes is None else list(shapes)
    budget_s = budget_s if budget_s is not None else (None if dry_run else GPU_BUDGET_S)
    repeats = repeats or (3 if dry_run else 5)
    min_sample_s = 0.002 if dry_run else 0.01
    memory = _memory_budget(dry_run)
    itemsize = jnp.dtype(dtype).itemsize
    start = time.perf_counter()
    rows: list[dict] = []
    skipped = [] if skipped is None else skipped

    def skip(shape: Shape, reason: str) -> None:
        skipped.append(
            {"kernel": shape.kernel, "width": shape.arch.width, "tensor": shape.tensor, "tokens": shape.tokens}
            | {"reason": reason}
        )

    for shape in shapes:
        need = estimate_bytes(shape, itemsize)
        if need > memory:
            skip(shape, f"memory: estimated {need / 2**30:.1f} GiB > budget {memory / 2**30:.1f} GiB")
            continue
        if budget_s is not None and time.perf_counter() - start > budget_s:
            skip(shape, f"time budget of {budget_s:.0f} s spent (tier {shape.tier})")
            continue
        try:
            rows += _measure_shape(shape, device, dtype, repeats, min_sample_s, dry_run)
        except Exception as e:  # noqa: BLE001 - one shape failing on the GPU (out of memory) must not lose the others
            skip(shape, f"error: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
        if progress:
            progress(f"kernels: {len(rows)} rows, {len(skipped)} skipped, {time.perf_counter() - start:.0f} s")
    return rows


def _measure_shape(shape: Shape, device: str, dtype, repeats: int, min_sample_s: float, dry_run: bool) -> list[dict]:
    kernel = _builder(shape, dtype)
    diff, const = kernel.arguments(dtype, dry_run)
    args = (*diff, *const)
    fwd = forward_flops(shape)
    s = shape.sliced()
    out = []
    for name, f in passes(kernel.fn, kernel.n_diff).items():
        t0 = time.perf_counter()
        compiled = compile_program(f, args, dry_run)
        compile_s = time.perf_counter() - t0
        measured, inner = time_program(compiled, args, repeats, min_sample_s)
        flops = fwd * (1.0 if name == "forward" else 1.0 + BACKWARD_FACTOR)
        peak = cost.DEVICES[device]["flops"]
        eff = cost.efficiency(shape.tokens / shape.tensor, shape.width_per_device)
        out.append(
            {
                "kernel": shape.kernel,
                "pass": name,
                "width": shape.arch.width,
                "tensor": shape.tensor,
                "width_per_device": shape.width_per_device,
                "tokens": shape.tokens,
                "seq_len": shape.seq_len,
                "dtype": jnp.dtype(dtype).name,
                "flops": flops,
                "predicted_s": predicted_seconds(flops, shape.tokens, shape.tensor, shape.width_per_device, device),
                "measured_s": measured,
                "achieved_flops_per_s": flops / measured,
                "tokens_per_device": shape.tokens / shape.tensor,
                "rows": shape.rows,
                "heads": s.heads,
                "kv_heads": s.kv_heads,
                "head_dim": s.head_dim,
                "mlp": s.mlp,
                "experts": s.experts,
                "experts_per_token": s.experts_per_token,
                "device": device,
                "peak_flops": peak,
                "efficiency_predicted": eff,
                "efficiency_measured": flops / measured / peak,
                "attention_implementation": _project_attention(dtype, s.head_dim, shape.seq_len),
                "tier": shape.tier,
                "compile_s": compile_s,
                "compiler_options": DRY_COMPILER_OPTIONS if dry_run else {},
                "inner": inner,
                "repeats": repeats,
            }
        )
        del compiled
    return out


# ---- attention implementations ---------------------------------------------------------------


def attention_implementations(dry_run: bool, repeats: int | None = None) -> list[dict]:
    """`jax.nn.dot_product_attention` with `implementation="xla"` and `"cudnn"` side by side, forward
    and forward-backward, each with the project's explicit boolean mask (`models.layers.attention`
    passes one, which cuDNN takes as an additive bias) and, for causal shapes, with `is_causal=True`
    and no mask tensor (what cuDNN's causal kernel skips). A row per (shape, mask, implementation,
    pass); where an implementation does not run (cuDNN on CPU) the row has "available": False and
    the error, and the function goes on. `max_abs_diff_vs_xla`: the forward outputs' largest
    difference from XLA's (float32)."""
    dtype = jnp.float32 if dry_run else jnp.bfloat16
    repeats = repeats or (3 if dry_run else 5)
    min_sample_s = 0.002 if dry_run else 0.01
    out = []
    for name, b, length, h, g, k, causal in ATTENTION_SHAPES[dry_run]:
        keys = jax.random.split(jax.random.key(1), 3)
        q = jax.random.normal(keys[0], (b, length, h, k), dtype)
        kk = jax.random.normal(keys[1], (b, length, g, k), dtype)
        v = jax.random.normal(keys[2], (b, length, g, k), dtype)
        mask = _causal(b, length)[:, None] if causal else jnp.ones((b, 1, length, length), bool)
        pairs = b * length * length / (2 if causal else 1)
        fwd_flops = 2 * 2 * h * k * pairs
        variants = [("mask", {"mask": mask})] + ([("is_causal", {"is_causal": True})] if causal else [])
        for variant, kw in variants:
            reference = None
            for impl in ("xla", "cudnn"):

                def fn(q, kk, v, impl=impl, kw=kw):
                    return jax.nn.dot_product_attention(q, kk, v, implementation=impl, **kw)

                for pass_name, f in passes(fn, 3).items():
                    row = {
                        "shape": name,
                        "rows": b,
                        "seq_len": length,
                        "heads": h,
                        "kv_heads": g,
                        "head_dim": k,
                        "causal": causal,
                        "mask": variant,
                        "implementation": impl,
                        "pass": pass_name,
                        "dtype": jnp.dtype(dtype).name,
                        "flops": fwd_flops * (1.0 if pass_name == "forward" else 1.0 + BACKWARD_FACTOR),
                    }
                    reference = _timed_attention(row, f, (q, kk, v), reference, dry_run, repeats, min_sample_s)
                    out.append(row)
    return out


# (name, rows, length, heads, kv_heads, head_dim, causal) `attention_implementations` times, by dry run
ATTENTION_SHAPES = {
    True: [("causal", 2, 128, 4, 2, 16, True)],
    False: [
        ("llama8b_causal", 2, 4096, 32, 8, 128, True),
        ("long_causal", 1, 8192, 16, 4, 128, True),
        ("siglip_full", 8, 1024, 16, 16, 72, False),
    ],
}


def _timed_attention(row: dict, f, args: tuple, reference, dry_run: bool, repeats: int, min_sample_s: float):
    """`row` filled with `f`'s time on `args` (and, for a forward, its largest difference from
    XLA's output, which an XLA forward becomes: the `reference` returned), or with why it does
    not run (cuDNN is absent on CPU and refuses some shapes: said, and the caller goes on)."""
    try:
        compiled = compile_program(f, args, dry_run)
        measured, inner = time_program(compiled, args, repeats, min_sample_s)
        diff = None
        if row["pass"] == "forward":
            y = np.asarray(compiled(*args), np.float32)
            reference = y if row["implementation"] == "xla" else reference
            if reference is not None:
                diff = float(np.max(np.abs(y - reference)))
        row |= {
            "available": True,
            "measured_s": measured,
            "achieved_flops_per_s": row["flops"] / measured,
            "inner": inner,
            "max_abs_diff_vs_xla": diff,
        }
    except Exception as e:  # noqa: BLE001 - cuDNN is absent on CPU and refuses some shapes: say so, go on
        msg = str(e).splitlines()[0][:300] if str(e) else type(e).__name__
        row |= {"available": False, "error": f"{type(e).__name__}: {msg}"}
        if jax.default_backend() == "cpu":
            row["error"] = f"cuDNN is unavailable on the {jax.default_backend()} backend ({msg})"
    return reference


# ---- compiled memory against the measured peak -----------------------------------------------


def _memory_shapes(dry_run: bool) -> list[Shape]:
    """The decoder-block shapes `memory_rows` measures."""
    if dry_run:
        return [Shape("decoder", DRY_ARCHS["decoder", 128], 2, 128, 128)]
    a2, a4 = GPU_ARCHS["decoder", 2048], GPU_ARCHS["decoder", 4096]
    return [
        Shape("decoder", a2, 1, 4096, 2048),
        Shape("decoder", a4, 1, 4096, 2048),
        Shape("decoder", a4, 1, 8192, 2048),
    ]


def _compiled_blocks(dry_run: bool, dtype) -> list[tuple]:
    """Each shape's passes compiled, with their `memory_analysis()` and its total (arguments +
    outputs + temporaries - aliased; None where the backend has none): (total or 0, shape, pass,
    kernel, compiled, analysis, total) each."""
    plans = []
    for shape in _memory_shapes(dry_run):
        kernel = _builder(shape, dtype)
        diff, const = kernel.abstract_arguments(dtype)
        for name, f in passes(kernel.fn, kernel.n_diff).items():
            compiled = compile_program(f, (*diff, *const), dry_run)
            m = compiled.memory_analysis()
            total = (
                None
                if m is None
                else m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
            )
            plans.append((total or 0, shape, name, kernel, compiled, m, total))
    return plans


def memory_rows(dry_run: bool) -> list[dict]:
    """For a few decoder-block shapes and both passes: the compiled program's `memory_analysis()`
    (arguments + outputs + temporaries - aliased, the figure `runtime.programs` gives the planner)
    beside the device's measured peak (`memory_stats()["peak_bytes_in_use"]`; None where the
    backend has no memory stats, as on CPU).

    The peak is the process's, since its start: programs are run in increasing compiled size, so
    each can raise it, and a row's `measured_peak_bytes` is peak_after - in_use_before +
    argument bytes (what the run added over the live arrays, plus its own arguments, already
    resident) when the run raised the peak, None when it did not (not attributable). Call this
    before `measure` in a fresh process, which leaves larger peaks behind."""
    dtype = jnp.float32 if dry_run else jnp.bfloat16
    dev = jax.devices()[0]
    plans = _compiled_blocks(dry_run, dtype)
    out = []
    for _, shape, name, kernel, compiled, m, total in sorted(plans, key=lambda p: p[0]):
        diff, const = kernel.arguments(dtype, dry_run)
        jax.block_until_ready((diff, const))  # the arguments are resident before the baseline is read
        before = dev.memory_stats()
        jax.block_until_ready(compiled(*diff, *const))  # the run is over before the peak is read
        after = dev.memory_stats()
        row = {
            "kernel": shape.kernel,
            "pass": name,
            "width": shape.arch.width,
            "tensor": shape.tensor,
            "tokens": shape.tokens,
            "seq_len": shape.seq_len,
            "dtype": jnp.dtype(dtype).name,
            "argument_bytes": None if m is None else m.argument_size_in_bytes,
            "output_bytes": None if m is None else m.output_size_in_bytes,
            "temp_bytes": None if m is None else m.temp_size_in_bytes,
            "alias_bytes": None if m is None else m.alias_size_in_bytes,
            "compiled_bytes": total,
            "in_use_before": None if before is None else before.get("bytes_in_use"),
            "peak_before": None if before is None else before.get("peak_bytes_in_use"),
            "peak_after": None if after is None else after.get("peak_bytes_in_use"),
            "measured_peak_bytes": None,
        }
        if None not in (row["in_use_before"], row["peak_before"], row["peak_after"], row["argument_bytes"]):
            if row["peak_after"] > row["peak_before"]:
                row["measured_peak_bytes"] = row["peak_after"] - row["in_use_before"] + row["argument_bytes"]
        if row["measured_peak_bytes"] and total:
            row["measured_over_compiled"] = row["measured_peak_bytes"] / total
        out.append(row)
        del diff, const
    return out


# ---- everything the GPU check needs ----------------------------------------------------------


def kernel_report(
    dry_run: bool, device: str, budget_s: float | None = None, progress: Callable[[str], None] | None = None
) -> dict:
    """memory_rows, then measure (`budget_s`: its time budget, default GPU_BUDGET_S on an
    accelerator), then attention_implementations (that order: see memory_rows), as one dict: {"device", "device_kind", "backend", "dtype", "kernels": [measure's rows], "skipped":
    [...], "memory": [...], "attention_implementations": [...], "wall_s": {...}}."""
    wall = {}
    t0 = time.perf_counter()
    memory = memory_rows(dry_run)
    wall["memory"] = time.perf_counter() - t0
    skipped: list[dict] = []
    t0 = time.perf_counter()
    kernels = measure(dry_run, device, budget_s=budget_s, skipped=skipped, progress=progress)
    wall["kernels"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    attn = attention_implementations(dry_run)
    wall["attention_implementations"] = time.perf_counter() - t0
    return {
        "device": device,
        "device_kind": jax.devices()[0].device_kind,
        "backend": jax.default_backend(),
        "dtype": "float32" if dry_run else "bfloat16",
        "kernels": kernels,
        "skipped": skipped,
        "memory": memory,
        "attention_implementations": attn,
        "wall_s": wall,
    }
