"""What the GPU check times for a section program's speed, beside the cost model's kernel rows
(`tools.kernels`): attention in each fast form against the mask path it replaces, the MoE layer in
each dispatch, small decoder layers with and without CUDA graphs, and k micro-steps of a small
layer issued as k launches against one scanned program (`compile.scan_micro_steps`).

Every row says whether it ran (`available`, else the `error`: cuDNN's kernels are absent on the
CPU, tokamax is absent where it is not installed), its median time, and for attention and the MoE
its largest difference from the reference path on the rows the loss reads and whether every value
and gradient is finite (cuDNN returns NaN for a query row without keys). `summary` turns the rows
into the ratios the issue's goals name. `dry_run`: the same rows at tiny sizes in float32, on the
CPU, so the check is kept working between GPU windows (tests/test_gpu_check.py).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from maestro_jax.fast_paths import LEVERS
from maestro_jax.models import LLMConfig
from maestro_jax.models.attention import Kernel, Mask, compute_capability, fast_attention, segment_lengths
from maestro_jax.models.layers import item_mask, rows_with_keys
from maestro_jax.models.llm import MoE, decoder_mask, grouped_gemm_missing
from maestro_jax.runtime.programs import scanned_forward
from maestro_jax.tools.kernels import DRY_ARCHS, GPU_ARCHS, Shape, _builder, compile_program, passes, time_program

# ---- attention ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class AttentionShape:
    """Rows of `length` positions, each holding the items `items` lists (their lengths, laid
    from position 0, padding after); `causal` text or bidirectional (a ViT's images)."""

    name: str
    items: tuple[tuple[int, ...], ...]
    length: int
    heads: int
    kv_heads: int
    head_dim: int
    causal: bool

    def segments(self) -> np.ndarray:
        out = np.zeros((len(self.items), self.length), np.int32)
        for r, row in enumerate(self.items):
            at = 0
            for i, n in enumerate(row, start=1):
                out[r, at : at + n] = i
                at += n
        return out

    def mask(self) -> Mask:
        """The mask the models build for such rows, with the structure they send beside it."""
        seg = self.segments()
        if not self.causal:
            return item_mask(jnp.asarray(seg), jnp.asarray(segment_lengths(seg)))
        valid = jnp.asarray(seg > 0)
        if all(len(row) == 1 for row in self.items):
            return decoder_mask(jnp.broadcast_to(jnp.arange(self.length), seg.shape), valid, from_zero=True)[0]
        starts = np.maximum.accumulate(np.where(np.diff(seg, prepend=-1, axis=1) != 0, np.arange(self.length), 0), 1)
        positions = jnp.asarray(np.arange(self.length)[None] - starts)  # each sample's own, from 0
        return decoder_mask(positions, valid, None, jnp.asarray(seg), None, jnp.asarray(segment_lengths(seg)))[0]


def attention_shapes(dry_run: bool) -> list[AttentionShape]:
    """Causal rows (a Llama-3.1-8B-shaped layer, 4096 and 8192 tokens), packed text rows (four
    samples a row), SigLIP-So400M-shaped image rows (729 patches, one image a row and three)."""
    if dry_run:
        return [
            AttentionShape("causal", ((128,), (96,)), 128, 4, 2, 16, True),
            AttentionShape("packed", ((40, 30, 20, 10), (64, 50)), 128, 4, 2, 16, True),
            AttentionShape("vit_padded", ((49,), (49,)), 64, 4, 4, 16, False),
            AttentionShape("vit_packed", ((49, 49, 16),), 128, 4, 4, 16, False),
        ]
    return [
        AttentionShape("llama8b_causal", ((4096,), (3072,)), 4096, 32, 8, 128, True),
        AttentionShape("long_causal", ((8192,),), 8192, 16, 4, 128, True),
        AttentionShape("llama8b_packed", ((1500, 1200, 900, 400), (2048, 1024, 700)), 4096, 32, 8, 128, True),
        AttentionShape("siglip_padded", ((729,),) * 8, 768, 16, 16, 72, False),
        AttentionShape("siglip_packed", ((729, 729, 400),) * 4, 2048, 16, 16, 72, False),
    ]


def _attention(kernel: Kernel) -> Callable:
    def run(q, k, v, mask: Mask):
        if kernel.form == "mask":
            dense = rows_with_keys(mask.dense)[:, None]
            return jax.nn.dot_product_attention(q, k, v, mask=dense, implementation=kernel.implementation)
        return fast_attention(q, k, v, mask, kernel, None)

    return run


def _plain_causal(impl: str) -> Callable:
    """Causal over the whole row, no lengths: the speed a packed form is held against."""
    return lambda q, k, v, mask: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)


def attention_forms(dry_run: bool, repeats: int | None = None) -> list[dict]:
    """For each shape: the mask path (XLA's and cuDNN's), the form the rows offer on cuDNN (and on
    XLA where XLA takes it), and, for text, plain `is_causal` over the whole row; forward and
    forward+backward. `max_abs_diff`: the forward's largest difference from XLA's mask path on the
    rows the loss reads (float32)."""
    dtype = jnp.float32 if dry_run else jnp.bfloat16
    out = []
    for shape in attention_shapes(dry_run):
        mask = shape.mask()
        read = np.asarray(shape.segments() > 0)
        keys = jax.random.split(jax.random.key(3), 3)
        b, n = read.shape
        q = jax.random.normal(keys[0], (b, n, shape.heads, shape.head_dim), dtype)
        k, v = (jax.random.normal(keys[i], (b, n, shape.kv_heads, shape.head_dim), dtype) for i in (1, 2))
        variants = [
            ("mask", "xla", _attention(Kernel("xla", "mask", ""))),
            ("mask", "cudnn", _attention(Kernel("cudnn", "mask", ""))),
        ]
        form = mask.offered
        if form in ("causal", "padded"):
            variants.append((form, "xla", _attention(Kernel("xla", form, ""))))
        variants.append((form, "cudnn", _attention(Kernel("cudnn", form, ""))))
        if shape.causal:
            variants += [("is_causal", impl, _plain_causal(impl)) for impl in ("xla", "cudnn")]
        reference = None
        for variant, impl, fn in variants:
            for pass_name, f in passes(fn, 3).items():
                row = {"shape": shape.name, "rows": b, "seq_len": n, "heads": shape.heads, "kv_heads": shape.kv_heads}
                row |= {"head_dim": shape.head_dim, "form": variant, "implementation": impl, "pass": pass_name}
                row |= {"dtype": jnp.dtype(dtype).name}
                result = _timed(f, (q, k, v, mask), dry_run, repeats)
                if result.get("available") and pass_name == "forward":
                    y = np.asarray(result.pop("value"), np.float32)
                    reference = y if (variant, impl) == ("mask", "xla") else reference
                    same = variant != "is_causal" or all(len(row) == 1 for row in shape.items)  # else: speed only
                    if reference is not None and same:
                        result["max_abs_diff"] = float(np.max(np.abs(y - reference)[read]))
                result.pop("value", None)
                out.append(row | result)
    return out


def _timed(f: Callable, args: tuple, dry_run: bool, repeats: int | None, options: dict | None = None) -> dict:
    """Compile and time `f(*args)`: {"available", "measured_s", "compile_s", "inner", "finite",
    "value"} or {"available": False, "error"}."""
    repeats = repeats or (3 if dry_run else 5)
    try:
        t0 = time.perf_counter()
        if options is None:
            compiled = compile_program(f, args, dry_run)
        else:
            compiled = jax.jit(f).lower(*args).compile(compiler_options=options)
        compile_s = time.perf_counter() - t0
        measured, inner = time_program(compiled, args, repeats, 0.002 if dry_run else 0.01)
        value = compiled(*args)
    except Exception as e:  # noqa: BLE001 - cuDNN and tokamax are absent on CPU, and refuse some shapes: say so, go on
        msg = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        if jax.default_backend() == "cpu" and "cudnn" in msg.lower():
            msg = f"cuDNN is unavailable on the cpu backend ({msg})"
        return {"available": False, "error": f"{type(e).__name__}: {msg}"}
    finite = all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(value))
    first = value[0] if isinstance(value, tuple) else value  # forward+backward: (loss, gradients)
    return {"available": True, "measured_s": measured, "compile_s": compile_s, "inner": inner, "finite": finite} | {
        "value": first
    }


# ---- the MoE layer --------------------------------------------------------------------------


def moe_config(dry_run: bool) -> tuple[LLMConfig, int]:
    """The MoE layer timed and its token count: the kernels step's `decoder_moe` arch (Qwen3-30B-A3B's:
    128 experts, top 8, width 2048, expert MLP 768) at 4096 tokens, or its tiny one at 256."""
    arch, tokens = (DRY_ARCHS["decoder_moe", 64], 256) if dry_run else (GPU_ARCHS["decoder_moe", 2048], 4096)
    cfg = Shape("decoder_moe", arch, 1, tokens, tokens).llm_config()
    return dataclasses.replace(cfg, router_aux_loss=0.0), tokens


def moe_dispatches(dry_run: bool, repeats: int | None = None, peak_flops: float | None = None) -> list[dict]:
    """The MoE layer in every dispatch (dense, ragged, sparse, grouped), forward and
    forward+backward. `flops`: the sparse FLOPs (each token's experts_per_token experts, SwiGLU),
    what MFU counts whatever the dispatch runs; `of_peak`: those over the time and `peak_flops`;
    `max_abs_diff`: the forward's largest difference from the dense dispatch's."""
    cfg, tokens = moe_config(dry_run)
    dtype = jnp.float32 if dry_run else jnp.bfloat16
    h = jax.random.normal(jax.random.key(4), (1, tokens, cfg.width), dtype)
    valid = jnp.ones((1, tokens), bool)
    params = nn.meta.unbox(MoE(cfg).init(jax.random.key(5), h, valid)["params"])
    params = jax.tree.map(lambda p: p.astype(dtype), params)
    fwd_flops = tokens * cfg.experts_per_token * 3 * 2 * cfg.width * cfg.expert_mlp
    missing = grouped_gemm_missing(jax.default_backend(), compute_capability(), jax.__version_info__)
    out, reference = [], None
    for dispatch in ("dense", "ragged", "sparse", "grouped"):
        layer = MoE(dataclasses.replace(cfg, moe_dispatch=dispatch))

        def fn(p, x, layer=layer):
            return layer.apply({"params": p}, x, valid)

        for pass_name, f in passes(fn, 2).items():
            row = {"dispatch": dispatch, "pass": pass_name, "tokens": tokens, "experts": cfg.experts}
            row |= {"experts_per_token": cfg.experts_per_token, "width": cfg.width, "expert_mlp": cfg.expert_mlp}
            row |= {"dtype": jnp.dtype(dtype).name, "flops": fwd_flops * (1 if pass_name == "forward" else 3)}
            if dispatch == "grouped" and missing:
                out.append(row | {"available": False, "error": f"the grouped GEMM needs {missing}"})
                continue
            result = _timed(f, (params, h), dry_run, repeats)
            if result.get("available"):
                value = np.asarray(result.pop("value"), np.float32)
                if pass_name == "forward":
                    reference = value if dispatch == "dense" else reference
                    result["max_abs_diff"] = float(np.max(np.abs(value - reference)))
                if peak_flops:
                    result["of_peak"] = row["flops"] / result["measured_s"] / peak_flops
            result.pop("value", None)
            out.append(row | result)
    return out


# ---- small programs and CUDA graphs ---------------------------------------------------------

GRAPH_OPTIONS = {"xla_gpu_graph_min_graph_size": 1}  # every program one CUDA graph (XLA's default: 5 thunks)


def cuda_graphs(dry_run: bool, repeats: int | None = None) -> list[dict]:
    """A decoder layer (the kernels step's 2048-wide arch) at 256 and 1024 tokens, forward, compiled
    with XLA's default CUDA-graph threshold and with GRAPH_OPTIONS. On CPU the option does not
    exist: those rows say so."""
    dtype = jnp.float32 if dry_run else jnp.bfloat16
    arch = DRY_ARCHS["decoder", 128] if dry_run else GPU_ARCHS["decoder", 2048]
    out = []
    for tokens in (256, 1024) if not dry_run else (64,):
        kernel = _builder(Shape("decoder", arch, 1, tokens, tokens), dtype)
        diff, const = kernel.arguments(dtype, dry_run)
        for graphs, options in (("default", None), ("min_graph_size_1", GRAPH_OPTIONS)):
            row = {"kernel": "decoder", "width": arch.width, "tokens": tokens, "graphs": graphs, "pass": "forward"}
            if options is not None and jax.default_backend() == "cpu":
                out.append(row | {"available": False, "error": "xla_gpu_graph_min_graph_size is an XLA:GPU option"})
                continue
            result = _timed(kernel.fn, (*diff, *const), dry_run, repeats, options)
            result.pop("value", None)
            out.append(row | result)
    return out


SCAN_MICRO_STEPS = 8  # micro-steps a section issues back to back in the scan rows


def scanned_micro_steps(dry_run: bool, repeats: int | None = None) -> list[dict]:
    """The CUDA-graph rows' decoder layer, forward, over SCAN_MICRO_STEPS micro-steps: issued as
    one launch each (the executor without `compile.scan_micro_steps`) and as the one scanned
    program the executor issues with it (`runtime.programs.scanned_forward`, the same function).
    `max_abs_diff`: the scanned outputs against the launches'."""
    arch = DRY_ARCHS["decoder", 128] if dry_run else GPU_ARCHS["decoder", 2048]
    out = []
    for tokens in (256, 1024) if not dry_run else (64,):
        row = {"kernel": "decoder", "width": arch.width, "tokens": tokens, "micro_steps": SCAN_MICRO_STEPS}
        row["pass"] = "forward"
        try:
            times, diff = _launches_and_scan(Shape("decoder", arch, 1, tokens, tokens), dry_run, repeats)
        except Exception as e:  # noqa: BLE001 - a shape a backend refuses: say so, go on
            out.append(row | {"available": False, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"})
            continue
        for issue, t in times.items():
            out.append(row | {"issue": issue, "available": True, "measured_s": t, "max_abs_diff": diff})
    return out


def _launches_and_scan(shape: Shape, dry_run: bool, repeats: int | None) -> tuple[dict[str, float], float]:
    """{"launches": s, "scanned": s} for SCAN_MICRO_STEPS forwards of `shape`'s layer, and the
    largest difference between the two ways' outputs."""
    dtype = jnp.float32 if dry_run else jnp.bfloat16
    kernel = _builder(shape, dtype)
    (params, x), const = kernel.arguments(dtype, dry_run)
    k = SCAN_MICRO_STEPS
    xs, nones = tuple(x + i for i in range(k)), (None,) * k  # k micro-steps of one shape
    one = compile_program(lambda p, x: kernel.fn(p, x, *const), (params, x), dry_run)
    run = compile_program(scanned_forward(lambda p, _, x: kernel.fn(p, x, *const)), (params, nones, xs), dry_run)
    repeats, min_s = repeats or (3 if dry_run else 5), 0.002 if dry_run else 0.01
    times = {
        "launches": time_program(lambda p, xs: [one(p, x) for x in xs], (params, xs), repeats, min_s)[0],
        "scanned": time_program(run, (params, nones, xs), repeats, min_s)[0],
    }
    diff = max(float(jnp.max(jnp.abs(a - one(params, x)))) for a, x in zip(run(params, nones, xs), xs))
    return times, diff


# ---- the ratios -----------------------------------------------------------------------------


def _times(rows: list[dict], *keys: str) -> dict[tuple, float]:
    return {tuple(r[k] for k in keys): r["measured_s"] for r in rows if r.get("available")}


def summary(attention: list[dict], moe: list[dict], graphs: list[dict], scan: list[dict]) -> list[str]:
    """The ratios the goals name, one line each: each fast form against the mask path on cuDNN
    (and a packed form against plain `is_causal`), each MoE dispatch's share of the peak, CUDA
    graphs on against off, and scanned micro-steps against one launch each."""
    lines = []
    t = _times(attention, "shape", "form", "implementation", "pass")
    for (shape, form, impl, pass_name), s in sorted(t.items()):
        if impl != "cudnn" or form in ("mask", "is_causal"):
            continue
        masked, plain = t.get((shape, "mask", "cudnn", pass_name)), t.get((shape, "is_causal", "cudnn", pass_name))
        text = f"attention {shape} {pass_name}: {form} {masked / s:.2f}x the mask path" if masked else ""
        text += f", {s / plain:.2f}x is_causal's time" if plain and form == "packed" else ""
        lines += [text] if text else []
    for r in moe:
        if r.get("available") and "of_peak" in r:
            lines.append(f"moe {r['dispatch']} {r['pass']}: {100 * r['of_peak']:.1f}% of the bf16 peak")
    g = _times(graphs, "tokens", "graphs")
    for (tokens, graphs_), s in sorted(g.items()):
        if graphs_ != "default" and (tokens, "default") in g:
            lines.append(f"decoder {tokens} tokens forward: CUDA graphs {g[tokens, 'default'] / s:.2f}x")
    t = _times(scan, "tokens", "issue")
    for (tokens, issue), s in sorted(t.items()):
        if issue == "scanned" and (tokens, "launches") in t:
            lines.append(
                f"decoder {tokens} tokens forward x{SCAN_MICRO_STEPS}: one scanned program {t[tokens, 'launches'] / s:.2f}x"
            )
    return lines


def _slowest_ratio(times: dict[tuple, float], baseline: str, candidate: str) -> float | None:
    """baseline time / candidate time at the shape where the candidate gains least, over the
    shapes (the keys' first fields) where both ran; None where none did."""
    ratios = [
        t / times[(*key, candidate)] for (*key, v), t in times.items() if v == baseline and (*key, candidate) in times
    ]
    return min(ratios) if ratios else None


def measured_speedups(attention: list[dict], moe: list[dict], graphs: list[dict], scan: list[dict]) -> dict:
    """Each fast-path lever's (`maestro_jax.fast_paths`) candidate against its baseline in these rows,
    forward+backward where the rows hold it: `Lever.name` -> speedup, or None where the rows do
    not hold both sides (cuDNN, tokamax or CUDA graphs absent)."""
    cudnn = {
        (r["shape"], r["form"]): r["measured_s"]
        for r in attention
        if r.get("available") and r["implementation"] == "cudnn" and r["pass"] == "forward_backward"
    }
    out = {}
    for form in ("causal", "padded", "packed"):
        pairs = {(shape, v): t for (shape, v), t in cudnn.items() if v in ("mask", form)}
        pairs = {k: t for k, t in pairs.items() if (k[0], form) in cudnn}  # only shapes that offer the form
        out[f"attention.{form}"] = _slowest_ratio(pairs, "mask", form)
    moe_t = {(r["pass"], r["dispatch"]): r["measured_s"] for r in moe if r.get("available") and r["pass"] != "forward"}
    out["moe_dispatch auto (NVIDIA)"] = _slowest_ratio(moe_t, "sparse", "grouped")
    out["compile.cuda_graph_min_thunks"] = _slowest_ratio(
        _times(graphs, "tokens", "graphs"), "default", "min_graph_size_1"
    )
    out["compile.scan_micro_steps"] = _slowest_ratio(_times(scan, "tokens", "issue"), "launches", "scanned")
    return out


def decisions(speedups: dict, backend: str) -> list[dict]:
    """For each lever of the fast-path table: the speedup measured here, the rule, the default the
    code runs now and the one this measurement implies (`changes`: the table's entry would change,
    so `maestro_jax/fast_paths.py` wants this run's `Measured`). A measurement off a GPU decides nothing
    (`applies` false): the table holds GPU figures only."""
    gpu = backend in ("gpu", "cuda")
    out = []
    for lever in LEVERS:
        speedup = speedups.get(lever.name)
        implied = lever.decide(speedup) if gpu and speedup is not None else lever.default
        out.append(
            {
                "lever": lever.name,
                "speedup": speedup,
                "applies": gpu and speedup is not None,
                "rule": lever.rule,
                "default": lever.default,
                "implied": implied,
                "changes": implied != lever.default,
                "now": lever.why(),
            }
        )
    return out


def decision_lines(rows: list[dict]) -> list[str]:
    """One summary line a lever: the default, and what this run's measurement says of it."""
    lines = []
    for r in rows:
        if r["speedup"] is None:
            seen = "not timed here"
        else:
            seen = f"{r['speedup']:.2f}x here" + ("" if r["applies"] else " (not a GPU: decides nothing)")
        verdict = f"-> {r['implied']!r}: update maestro_jax/fast_paths.py" if r["changes"] else "(unchanged)"
        lines.append(f"default {r['lever']} = {r['default']!r}; {seen} {verdict}")
    return lines


def lever_report(dry_run: bool, peak_flops: float | None = None) -> dict:
    """Every row, the summary, the fast-path table's decisions (`decisions`) and each part's wall
    time."""
    wall, parts = {}, {}
    for name, run in (
        ("attention_forms", lambda: attention_forms(dry_run)),
        ("moe_dispatches", lambda: moe_dispatches(dry_run, peak_flops=peak_flops)),
        ("cuda_graphs", lambda: cuda_graphs(dry_run)),
        ("scanned_micro_steps", lambda: scanned_micro_steps(dry_run)),
    ):
        t0 = time.perf_counter()
        parts[name] = run()
        wall[name] = time.perf_counter() - t0
    made = decisions(measured_speedups(*parts.values()), jax.default_backend())
    lines = summary(*parts.values()) + decision_lines(made)
    return parts | {"summary": lines, "decisions": made, "wall_s": wall}
