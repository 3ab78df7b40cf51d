"""Hugging Face checkpoints: Llama, Mistral and Qwen2/Qwen3 decoders in and out of
`models.llm.DecoderLM` (SigLIP and Whisper encoder towers: `models.hf_encoders`, on this module's
folder reading and placement).

The weight mapping lives beside the model it converts; the fields a folder's config.json gives
(`llm_fields`) come from `maestro_jax.hf_config`, JAX-free, which the config reads too. The
workloads' `init.hf_path` loaders (`maestro_jax.workloads.pretrained`) and the CLI's `export`
(through `maestro_jax.tools.hf`) both call this module.

Import reads a local folder (`config.json` and safetensors shards, with or without
`model.safetensors.index.json`) one tensor at a time, memory-mapped, and places each weight
straight into its target sharding with `jax.make_array_from_callback`: every device receives
only its own slice, so a large model never sits whole on one device. Export writes a folder
that `transformers` loads (`AutoModelForCausalLM.from_pretrained`).

The layout maps 1:1 (HF `Linear` weights are `out x in`, Flax kernels `in x out`):
  model.embed_tokens.weight [V, D]               -> embedding [V, D]
  layers.i.self_attn.{q,k,v}_proj.weight [H*K, D] -> block_i.{q,k,v}.kernel [D, H, K] (+ bias [H, K])
  layers.i.self_attn.o_proj.weight [D, H*K]       -> block_i.o.kernel [H, K, D]
  layers.i.self_attn.{q,k}_norm.weight [K]        -> block_i.{q,k}_norm.scale (Qwen3)
  layers.i.mlp.{gate,up}_proj.weight [F, D]       -> block_i.{gate,up}.kernel [D, F]
  layers.i.mlp.down_proj.weight [D, F]            -> block_i.down.kernel [F, D]
  layers.i.{input,post_attention}_layernorm       -> block_i.{attn,mlp}_norm.scale
  model.norm.weight                               -> final_norm.scale
  lm_head.weight [V, D]                           -> lm_head [D, V] (absent when tied)
Qwen3-MoE (`qwen3_moe`) replaces each layer's MLP by routed experts, stacked on a leading axis:
  layers.i.mlp.gate.weight [E, D]                 -> block_i.moe.router [D, E]
  layers.i.mlp.experts.j.{gate,up}_proj.weight    -> block_i.moe.{gate,up}[j] [D, F]
  layers.i.mlp.experts.j.down_proj.weight         -> block_i.moe.down[j] [F, D]
Qwen2-MoE (`qwen2_moe`) names its experts as Qwen3-MoE does, and adds a shared expert and its gate:
  layers.i.mlp.shared_expert.{gate,up,down}_proj  -> block_i.shared_{gate,up,down}.kernel
  layers.i.mlp.shared_expert_gate.weight [1, D]   -> block_i.shared_expert_gate.kernel [D, 1]
Phi-3 (`phi3`) fuses the projections of each attention and each MLP (q, k, v in that order; the
gate, then the up projection), otherwise Llama's (found in the folder; export fuses them back):
  layers.i.self_attn.qkv_proj.weight [(H+2G)K, D] -> block_i.{q,k,v}.kernel
  layers.i.mlp.gate_up_proj.weight [2F, D]        -> block_i.{gate,up}.kernel
Mixtral (`mixtral`) names the same tensors as the Hub's checkpoints do (transformers 5 saves them
so too, fusing them only in memory):
  layers.i.block_sparse_moe.gate.weight [E, D]    -> block_i.moe.router [D, E]
  layers.i.block_sparse_moe.experts.j.w1/w3.weight -> block_i.moe.gate[j] / up[j] [D, F]
  layers.i.block_sparse_moe.experts.j.w2.weight   -> block_i.moe.down[j] [F, D]
Gemma 2 (`gemma2`, without query and key norms) and Gemma 3 (`gemma3_text`, and the language
model of a multimodal `gemma3` folder, whose tensors
sit under `language_model.model.` or `model.language_model.`) norm each block's input, the
attention's output, the MLP's input and its output, and scales every norm by `1 + weight`; the
model here scales by `scale`, so a norm imports as `weight + 1` and exports as `scale - 1`:
  layers.i.input_layernorm                        -> block_i.attn_norm.scale
  layers.i.post_attention_layernorm               -> block_i.post_attn_norm.scale
  layers.i.pre_feedforward_layernorm              -> block_i.mlp_norm.scale
  layers.i.post_feedforward_layernorm             -> block_i.post_mlp_norm.scale
OLMo 2 (`olmo2`) norms only each block's attention output and MLP output (weights as they are),
and its query and key norms span the whole projection (`qk_norm_over: projection`):
  layers.i.post_attention_layernorm               -> block_i.post_attn_norm.scale
  layers.i.post_feedforward_layernorm             -> block_i.post_mlp_norm.scale
  layers.i.self_attn.{q,k}_norm.weight [H*K]      -> block_i.{q,k}_norm.scale [H*K]
A scanned model (`scan_layers`) stacks every `block_i` leaf on a leading layer axis under
`blocks/layer`.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np
from maestro_jax.models.configs import LLMConfig
from maestro_jax.models.fp8 import Fp8Weight, quantize
from maestro_jax.models.llm import windowed_layer

from maestro_jax.hf_config import ARCHITECTURES, HFError
from maestro_jax.hf_config import llm_fields as llm_fields  # the folder's fields: this module's API too
from maestro_jax.hf_config import read_config as read_config

# Gemma's decoders: norms scale by 1 + weight, scaled embeddings; Gemma 2's and 3's norms after the attention
# and the MLP too (post-norms), Gemma (1)'s only before them
GEMMAS = ("gemma", "gemma2", "gemma3_text")


def weight_files(path: str | Path) -> list[Path]:
    """The folder's safetensors files (from `model.safetensors.index.json` when present), each
    checked to exist and to have a readable safetensors header (cheap: no tensor is read)."""
    from safetensors import safe_open

    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_bytes())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise HFError(f"{index}: not a readable safetensors index ({type(err).__name__}: {err})") from None
    else:
        names = sorted(p.name for p in path.glob("*.safetensors"))
    if not names:
        raise HFError(f"{path}: no *.safetensors files; expected the weights beside config.json")
    for name in names:
        try:
            with safe_open(str(path / name), framework="numpy"):
                pass
        except Exception as err:  # noqa: BLE001 - safetensors raises its own SafetensorError, or OSError
            raise HFError(f"{path / name}: not a readable safetensors file ({type(err).__name__}: {err})") from None
    return [path / n for n in names]


def require_tensors(path: str | Path, names) -> None:
    """Every one of `names` (None: a leaf the checkpoint does not hold) is in the folder's
    safetensors headers, read without loading a tensor: a folder that lacks some is an `HFError`
    naming how many and the first, before anything is built or compiled."""
    tensors = _Tensors(Path(path))
    wanted = [n for n in names if n is not None]
    missing = [n for n in wanted if n not in tensors]
    if missing:
        shown = ", ".join(repr(n) for n in missing[:3]) + (", ..." if len(missing) > 3 else "")
        raise HFError(
            f"{path}: {len(missing)} of the {len(wanted)} tensors the model reads are missing from its "
            f"safetensors files: {shown}"
        )


def llm_tensors(path: str | Path, fields: dict) -> list[str]:
    """The tensors a decoder with `fields` reads from the folder (`load_llm` with the output layer,
    what a KD teacher's body and head read too)."""
    mapping = _folder_mapping(Path(path), _Tensors(Path(path)), fields, with_head=True)
    return list(dict.fromkeys(name for name, _ in mapping.values()))


def _folder_mapping(path: Path, tensors: _Tensors, fields: dict, with_head: bool) -> dict:
    """`_mapping` as the folder lays its tensors out, read off the headers it already opened
    (`tensors`): where the language model sits, Mixtral's expert names, Phi-3's fused projections."""
    prefix = _prefix_in(tensors, path)
    mixtral = f"{prefix}layers.0.block_sparse_moe.gate.weight" in tensors
    fused = f"{prefix}layers.0.self_attn.qkv_proj.weight" in tensors
    return _mapping(fields, with_head, prefix, mixtral, fused)


class _Tensors:
    """Lazy, memory-mapped access to every tensor of the folder's safetensors files."""

    def __init__(self, path: Path):
        from safetensors import safe_open

        self._where = {}
        self._handles = [safe_open(str(f), framework="numpy") for f in weight_files(path)]
        for h in self._handles:
            for k in h.keys():
                self._where[k] = h

    def __contains__(self, key: str) -> bool:
        return key in self._where

    def get(self, key: str) -> np.ndarray:
        if key not in self._where:
            raise HFError(f"tensor {key!r} is missing from the checkpoint")
        return self._where[key].get_tensor(key)


# where a folder's LLM tensors sit (SmolVLM and Idefics3 keep theirs under `model.text_model.`)
PREFIXES = ("model.", "model.language_model.", "language_model.model.", "model.text_model.")


def text_prefix(path: str | Path) -> str:
    """The prefix of the folder's language-model tensors (`model.`, or a multimodal folder's)."""
    return _prefix_in(_Tensors(Path(path)), path)


def _prefix_in(tensors: _Tensors, path) -> str:
    """`text_prefix` of a folder whose headers are open (`tensors`)."""
    for prefix in PREFIXES:
        if f"{prefix}embed_tokens.weight" in tensors:
            return prefix
    raise HFError(
        f"{path}: no {' or '.join(p + 'embed_tokens.weight' for p in PREFIXES)}; not a language model's weights"
    )


QWEN_EXPERTS = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}  # an expert's tensors, by family
MIXTRAL_EXPERTS = {"gate": "w1", "up": "w3", "down": "w2"}
MOE_TYPES = ("qwen3_moe", "qwen2_moe", "mixtral", "gpt_oss")  # the model types a mixture-of-experts model exports as


def _head_name(prefix: str) -> str:
    return "language_model.lm_head.weight" if prefix == "language_model.model." else "lm_head.weight"


def _norm_in(w: np.ndarray) -> np.ndarray:  # Gemma's `1 + weight`
    return w.astype(np.float32) + np.float32(1)


def _mapping(
    c: dict, with_head: bool, prefix: str = "model.", mixtral: bool = False, fused: bool = False
) -> dict[tuple[str, ...], tuple[str, Callable]]:
    """Flax path -> (HF tensor name, HF array -> Flax array); `mixtral`: the experts under
    Mixtral's names; `fused`: Phi-3's fused projections, each path reading its rows of one tensor."""
    norm = _norm_in if _gemma_norms(c) else _same
    out = {
        ("embedding",): (f"{prefix}embed_tokens.weight", _same),
        ("final_norm", "scale"): (f"{prefix}norm.weight", norm),
    }
    for i in range(c["depth"]):
        b, hf = f"block_{i}", f"{prefix}layers.{i}"
        out.update(_norm_mapping(c, b, hf, norm))
        out.update(_attention_mapping(c, b, hf, fused))
        out.update(_mlp_mapping(c, b, hf, mixtral, fused))
        if c["qkv_bias"]:
            h, g, k = c["heads"], c["kv_heads"], c["head_dim"]
            for name, n in (("q", h), ("k", g), ("v", g)):
                out[(b, name, "bias")] = (f"{hf}.self_attn.{name}_proj.bias", lambda w, n=n, k=k: w.reshape(n, k))
        if c.get("out_bias"):
            out[(b, "o", "bias")] = (f"{hf}.self_attn.o_proj.bias", _same)
        if c.get("attention_sinks"):
            out[(b, "sinks")] = (f"{hf}.self_attn.sinks", _same)
        if c["qk_norm"]:
            out[(b, "q_norm", "scale")] = (f"{hf}.self_attn.q_norm.weight", norm)
            out[(b, "k_norm", "scale")] = (f"{hf}.self_attn.k_norm.weight", norm)
    if with_head and not c["tie_embeddings"]:
        out[("lm_head",)] = (_head_name(prefix), np.transpose)
    return out


def _same(w):
    return w


def _gemma_norms(c: dict) -> bool:
    """Gemma's norms (its scaled embeddings say the family: Gemma 2's and 3's four a block, Gemma
    1's two) each scale by 1 + weight; OLMo 2's and every other family's by the weight."""
    return bool(c.get("embed_scale", False))


def _norm_mapping(c: dict, b: str, hf: str, norm: Callable) -> dict:
    """Block `b`'s norms: Gemma's four (`post_norms`), OLMo 2's two after the attention and the MLP
    (`pre_norms: false`), else the input and post-attention ones."""
    if not c.get("pre_norms", True):
        return {
            (b, "post_attn_norm", "scale"): (f"{hf}.post_attention_layernorm.weight", norm),
            (b, "post_mlp_norm", "scale"): (f"{hf}.post_feedforward_layernorm.weight", norm),
        }
    if c.get("post_norms", False):
        return {
            (b, "attn_norm", "scale"): (f"{hf}.input_layernorm.weight", norm),
            (b, "post_attn_norm", "scale"): (f"{hf}.post_attention_layernorm.weight", norm),
            (b, "mlp_norm", "scale"): (f"{hf}.pre_feedforward_layernorm.weight", norm),
            (b, "post_mlp_norm", "scale"): (f"{hf}.post_feedforward_layernorm.weight", norm),
        }
    return {
        (b, "attn_norm", "scale"): (f"{hf}.input_layernorm.weight", norm),
        (b, "mlp_norm", "scale"): (f"{hf}.post_attention_layernorm.weight", norm),
    }


def _attention_mapping(c: dict, b: str, hf: str, fused: bool) -> dict:
    """Block `b`'s q, k, v and o projections (`fused`: Phi-3's q, k and v as rows of one tensor)."""
    h, g, k, d = c["heads"], c["kv_heads"], c["head_dim"], c["width"]

    def proj(n):
        return lambda w: w.T.reshape(d, n, k)

    out = {
        (b, "q", "kernel"): (f"{hf}.self_attn.q_proj.weight", proj(h)),
        (b, "k", "kernel"): (f"{hf}.self_attn.k_proj.weight", proj(g)),
        (b, "v", "kernel"): (f"{hf}.self_attn.v_proj.weight", proj(g)),
        (b, "o", "kernel"): (f"{hf}.self_attn.o_proj.weight", lambda w: w.T.reshape(h, k, d)),
    }
    if fused:
        rows = {"q": (0, h * k), "k": (h * k, (h + g) * k), "v": ((h + g) * k, (h + 2 * g) * k)}
        for name, (lo, hi) in rows.items():
            n = h if name == "q" else g
            out[(b, name, "kernel")] = (
                f"{hf}.self_attn.qkv_proj.weight",
                lambda w, lo=lo, hi=hi, n=n: proj(n)(w[lo:hi]),
            )
    return out


def _mlp_mapping(c: dict, b: str, hf: str, mixtral: bool, fused: bool) -> dict:
    """Block `b`'s MLP: its experts (a trailing int: that expert's slice of the stacked leaf; under
    Mixtral's names with `mixtral`) and any shared expert, else the dense gate, up and down
    projections (`fused`: Phi-3's gate rows, then up rows, of one tensor)."""
    out = {}
    if c.get("experts") and c.get("expert_bias"):
        return _gpt_oss_expert_tensors(b, hf)
    if c.get("experts"):
        moe, own = (f"{hf}.block_sparse_moe", MIXTRAL_EXPERTS) if mixtral else (f"{hf}.mlp", QWEN_EXPERTS)
        out[(b, "moe", "router")] = (f"{moe}.gate.weight", np.transpose)
        for j in range(c["experts"]):
            for name in ("gate", "up", "down"):
                out[(b, "moe", name, j)] = (f"{moe}.experts.{j}.{own[name]}.weight", np.transpose)
        if c.get("shared_expert_mlp"):
            for name in ("gate", "up", "down"):
                out[(b, f"shared_{name}", "kernel")] = (f"{hf}.mlp.shared_expert.{name}_proj.weight", np.transpose)
            out[(b, "shared_expert_gate", "kernel")] = (f"{hf}.mlp.shared_expert_gate.weight", np.transpose)
        return out
    out.update({(b, name, "kernel"): (f"{hf}.mlp.{name}_proj.weight", np.transpose) for name in ("gate", "up", "down")})
    if fused:
        f = c["mlp"]
        out[(b, "gate", "kernel")] = (f"{hf}.mlp.gate_up_proj.weight", lambda w, f=f: w[:f].T)
        out[(b, "up", "kernel")] = (f"{hf}.mlp.gate_up_proj.weight", lambda w, f=f: w[f:].T)
    return out


def _gpt_oss_expert_tensors(b: str, hf: str) -> dict:
    """Block `b`'s GPT-OSS experts, stored stacked: the router's weight and bias, `gate_up_proj`
    ([experts, width, 2 x expert_mlp], gate and up interleaved: gate the even columns, up the odd)
    with its bias, `down_proj` ([experts, expert_mlp, width], already the Flax layout) with its."""
    experts = f"{hf}.mlp.experts"
    return {
        (b, "moe", "router"): (f"{hf}.mlp.router.weight", np.transpose),
        (b, "moe", "router_bias"): (f"{hf}.mlp.router.bias", _same),
        (b, "moe", "gate"): (f"{experts}.gate_up_proj", lambda w: w[..., ::2]),
        (b, "moe", "up"): (f"{experts}.gate_up_proj", lambda w: w[..., 1::2]),
        (b, "moe", "gate_bias"): (f"{experts}.gate_up_proj_bias", lambda w: w[..., ::2]),
        (b, "moe", "up_bias"): (f"{experts}.gate_up_proj_bias", lambda w: w[..., 1::2]),
        (b, "moe", "down"): (f"{experts}.down_proj", _same),
        (b, "moe", "down_bias"): (f"{experts}.down_proj_bias", _same),
    }


def _put(value: np.ndarray, like) -> jax.Array | Fp8Weight:
    """`value` in `like`'s sharding and dtype, each device filled with its own slice only; where
    `like` is a float8 kernel (`fp8.Fp8Weight`, a frozen section at precision fp8), `value`
    quantized with its own per-tensor scales (per layer where `like` stacks layers) first."""
    if isinstance(like, Fp8Weight):
        q = quantize(np.asarray(value, np.float32), like.scale.ndim)
        return Fp8Weight(_put(q.value, like.value), _put(q.scale, like.scale))
    if tuple(value.shape) != tuple(like.shape):
        raise HFError(f"shape {tuple(value.shape)} does not match the model's {tuple(like.shape)}")
    value = value.astype(like.dtype)
    return jax.make_array_from_callback(value.shape, like.sharding, lambda idx: value[idx])


def _scanned_path(flax_path: tuple[str, ...]) -> tuple[tuple[str, ...], int | None]:
    """`block_i/...` -> (`blocks/layer/...`, i) in a scanned model's tree (`models.layers.layer_stack`)."""
    if flax_path[0].startswith("block_"):
        return ("blocks", "layer", *flax_path[1:]), int(flax_path[0][len("block_") :])
    return flax_path, None


def _at(tree, path):
    for p in path:
        tree = tree[p]
    return tree


def _set(tree: dict, path, value) -> None:
    for p in path[:-1]:
        tree = tree.setdefault(p, {})
    tree[path[-1]] = value


def load_llm(path: str | Path, target: dict, fields: dict, with_head: bool = True) -> dict:
    """The checkpoint's weights as a Flax param tree shaped and sharded like `target` (unrolled
    `block_i` layers, or scanned `blocks` whose leaves stack the layers on a leading axis)."""
    path = Path(path)
    tensors = _Tensors(path)
    scanned = "blocks" in target
    leaves: dict[tuple[str, ...], np.ndarray] = {}  # unrolled paths; experts stacked
    experts: dict[tuple[str, ...], dict[int, np.ndarray]] = {}
    for flax_path, (name, convert) in _folder_mapping(path, tensors, fields, with_head).items():
        try:
            value = convert(tensors.get(name))
        except HFError as err:
            raise HFError(f"{path}: {name} -> {'.'.join(map(str, flax_path))}: {err}") from None
        if isinstance(flax_path[-1], int):
            experts.setdefault(flax_path[:-1], {})[flax_path[-1]] = value
        else:
            leaves[flax_path] = value
    leaves.update({p: np.stack([e[j] for j in range(len(e))]) for p, e in experts.items()})
    layers: dict[tuple[str, ...], dict[int, np.ndarray]] = {}
    out: dict = {}
    for flax_path, value in leaves.items():
        where, layer = _scanned_path(flax_path) if scanned else (flax_path, None)
        if layer is None:
            _set(out, where, _placed(value, target, where, path))
        else:
            layers.setdefault(where, {})[layer] = value
    for where, stack in layers.items():
        _set(out, where, _placed(np.stack([stack[i] for i in range(len(stack))]), target, where, path))
    return out


def _placed(value: np.ndarray, target: dict, where: tuple[str, ...], path: Path) -> jax.Array:
    try:
        return _put(value, _at(target, where))
    except HFError as err:
        raise HFError(f"{path}: {'.'.join(where)}: {err}") from None


def output_layer(path: str | Path, fields: dict, like) -> jax.Array:
    """The checkpoint's output layer as a [D, V] matrix (the embedding's transpose when tied)."""
    tensors = _Tensors(Path(path))
    prefix = _prefix_in(tensors, path)
    w = tensors.get(f"{prefix}embed_tokens.weight" if fields["tie_embeddings"] else _head_name(prefix))
    return _put(np.ascontiguousarray(w.T), like)


def write_weights(path: Path, tensors: dict[str, np.ndarray], max_shard_bytes: int = 4 << 30) -> None:
    """`tensors` as `model.safetensors`, or as shards of at most `max_shard_bytes` with the
    `model.safetensors.index.json` that `transformers` reads them through."""
    from safetensors.numpy import save_file

    shards, current, size = [], {}, 0
    for name, w in tensors.items():
        if current and size + w.nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = w
        size += w.nbytes
    shards.append(current)
    if len(shards) == 1:
        save_file(shards[0], str(path / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(path / fname), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, fname))
        (path / "model.safetensors.index.json").write_text(
            json.dumps(
                {"metadata": {"total_size": sum(w.nbytes for w in tensors.values())}, "weight_map": weight_map},
                indent=2,
            )
        )


def _moe_config(fields: dict, model_type: str) -> dict:
    """The config.json fields of an MoE `model_type`'s experts (none for another type)."""
    config: dict = {}
    if model_type in ("qwen3_moe", "qwen2_moe"):
        config.update(
            num_experts=fields["experts"],
            num_experts_per_tok=fields["experts_per_token"],
            moe_intermediate_size=fields["expert_mlp"],
            norm_topk_prob=fields.get("moe_renormalize", True),
            decoder_sparse_step=1,
            mlp_only_layers=[],
            router_aux_loss_coef=fields.get("router_aux_loss", 0.001),
        )
    if model_type == "qwen2_moe":
        config.update(shared_expert_intermediate_size=fields["shared_expert_mlp"], qkv_bias=True)
    if model_type in ("mixtral", "gpt_oss"):  # both name their experts alike
        config.update(
            num_local_experts=fields["experts"],
            num_experts_per_tok=fields["experts_per_token"],
            intermediate_size=fields["expert_mlp"],
            router_aux_loss_coef=fields.get("router_aux_loss", 0.001),
        )
        own = {"router_jitter_noise": 0.0}
        if model_type == "gpt_oss":
            own = {"swiglu_limit": fields["swiglu_limit"], "swiglu_alpha": fields.get("swiglu_alpha", 1.702)}
        config.update(own)
    return config


def _fuse_phi3(tensors: dict, fields: dict, prefix: str) -> None:
    """Llama's per-projection tensors fused as Phi-3 holds them (`qkv_proj`, `gate_up_proj`)."""
    for i in range(fields["depth"]):
        at = f"{prefix}layers.{i}"
        qkv = [tensors.pop(f"{at}.self_attn.{n}_proj.weight") for n in ("q", "k", "v")]
        tensors[f"{at}.self_attn.qkv_proj.weight"] = np.concatenate(qkv)
        gate_up = [tensors.pop(f"{at}.mlp.{n}_proj.weight") for n in ("gate", "up")]
        tensors[f"{at}.mlp.gate_up_proj.weight"] = np.concatenate(gate_up)


def save_llm(
    path: str | Path, params: dict, fields: dict, model_type: str = "llama", max_shard_bytes: int = 4 << 30
) -> None:
    """Write `params` (a Flax LLM param tree) as a Hugging Face folder `transformers` loads."""
    tensors, config = llm_checkpoint(params, fields, model_type)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    write_weights(path, tensors, max_shard_bytes)
    (path / "config.json").write_text(json.dumps(config, indent=2))


def llm_checkpoint(params: dict, fields: dict, model_type: str = "llama", prefix: str = "model.") -> tuple[dict, dict]:
    """`params` (a Flax LLM param tree) as a Hugging Face checkpoint of `model_type`: its tensors
    by name (the body's under `prefix`; the head, when untied, as `_head_name` names it) and its
    config.json."""
    _check_exportable(fields, model_type)
    tensors = _checkpoint_tensors(params, fields, model_type, prefix)
    if model_type == "phi3":
        _fuse_phi3(tensors, fields, prefix)
    return tensors, _checkpoint_config(fields, model_type)


def _check_exportable(fields: dict, model_type: str) -> None:
    """HFError where `model_type`'s checkpoint cannot hold a model with `fields`, before any weight
    is read (a window, experts, a shared expert, biases, norms or Gemma's block it lacks)."""
    if model_type not in ARCHITECTURES:
        raise HFError(f"model_type={model_type!r}; supported: {sorted(ARCHITECTURES)}")
    _check_gpt_oss(fields, model_type)
    if fields.get("experts") and model_type not in MOE_TYPES:
        raise HFError(f"model_type={model_type!r}: a mixture-of-experts model exports as {' or '.join(MOE_TYPES)}")
    if bool(fields.get("shared_expert_mlp")) != (model_type == "qwen2_moe") or (
        model_type == "qwen2_moe" and not fields["qkv_bias"]
    ):
        raise HFError(
            f"shared_expert_mlp={fields.get('shared_expert_mlp')}, qkv_bias={fields['qkv_bias']}: a qwen2_moe "
            f"checkpoint (and only it) has a shared expert, and q/k/v biases"
        )
    if model_type == "mixtral" and not fields.get("moe_renormalize", True):
        raise HFError("moe_renormalize=false: a mixtral router renormalises its top-k weights")
    if model_type == "mixtral" and (not fields.get("experts") or fields["qkv_bias"] or fields["qk_norm"]):
        raise HFError(
            f"experts={fields.get('experts')}, qkv_bias={fields['qkv_bias']}, qk_norm={fields['qk_norm']}: a mixtral "
            f"checkpoint has experts and neither q/k/v biases nor query/key norms"
        )
    if fields.get("sliding_window") is not None and model_type not in (
        "mistral",
        "mixtral",
        "phi3",
        "gpt_oss",
        *GEMMAS,
    ):
        raise HFError(
            f"model_type={model_type!r}: a model with a sliding_window exports as 'mistral' (or Gemma's as 'gemma2' "
            f"or 'gemma3_text')"
        )
    if model_type == "mistral" and fields["qkv_bias"]:
        raise HFError("a mistral checkpoint has no q/k/v biases; export this model with model_type='llama'")
    _check_olmo2(fields, model_type)
    _check_gemma(fields, model_type)
    if model_type == "phi3" and (fields["qkv_bias"] or fields["qk_norm"] or fields.get("experts")):
        raise HFError(
            f"qkv_bias={fields['qkv_bias']}, qk_norm={fields['qk_norm']}, experts={fields.get('experts')}: a phi3 "
            f"checkpoint has no q/k/v biases, query/key norms or experts"
        )
    if not fields["qkv_bias"] and model_type == "qwen2":
        raise HFError("a qwen2 checkpoint has q/k/v biases; export this model with model_type='llama'")


def _check_gemma(fields: dict, model_type: str) -> None:
    """Gemma's block in a Gemma checkpoint only, and whole there: Gemma 2's and 3's post-norms,
    Gemma 1's none, its window, soft-caps and query scale only in Gemma 2 and 3."""
    gemma = {"post_norms": model_type != "gemma", "embed_scale": True, "qkv_bias": False}
    gemma |= {"act": "gelu_pytorch_tanh", "qk_norm": model_type == "gemma3_text"}
    if model_type == "gemma":  # no window, soft-caps or query scale of its own
        gemma |= {"sliding_window": None, "global_every": 0, "attn_softcap": None, "final_softcap": None}
        gemma |= {"query_pre_attn_scalar": None}
    gemma |= {"rope_local_theta": None} if model_type == "gemma2" else {}
    differs = {k: fields.get(k) for k, v in gemma.items() if fields.get(k, False if v is not None else None) != v}
    if model_type in GEMMAS and differs:
        raise HFError(f"a {model_type} checkpoint has {gemma}; this model has {differs}")
    own = ("embed_scale", "global_every", "attn_softcap", "final_softcap")
    # Gemma's fields another type may hold: OLMo 2 its norms after the blocks' parts, GPT-OSS its
    # window every other layer (layer_types)
    own = {"olmo2": own, "gpt_oss": ("post_norms", "embed_scale", "attn_softcap", "final_softcap")}.get(
        model_type, ("post_norms", *own)
    )
    if model_type not in GEMMAS and any(fields.get(k) for k in own):
        raise HFError(
            f"model_type={model_type!r}: a model with Gemma's post_norms, embed_scale, global_every or soft-capping "
            f"exports as 'gemma', 'gemma2' or 'gemma3_text'"
        )


def _check_gpt_oss(fields: dict, model_type: str) -> None:
    """GPT-OSS's pieces only in a gpt_oss checkpoint, and its whole block there: sinks, biases on
    q, k, v and o, experts with biases and the clamped SwiGLU, renormalised top k, norms before
    the attention and MLP only, one RoPE."""
    if (model_type == "gpt_oss") != bool(fields.get("attention_sinks")):
        raise HFError(
            f"attention_sinks={fields.get('attention_sinks', False)}: a gpt_oss checkpoint has attention sinks, "
            f"and only gpt_oss has them"
        )
    if model_type != "gpt_oss":
        if extra := {k: fields[k] for k in ("out_bias", "expert_bias", "swiglu_limit") if fields.get(k)}:
            raise HFError(f"{extra}: only a gpt_oss checkpoint has GPT-OSS's output bias, expert biases and clamp")
        return
    want = {
        "qkv_bias": True,
        "out_bias": True,
        "expert_bias": True,
        "moe_renormalize": True,
        "pre_norms": True,
        "post_norms": False,
        "qk_norm": False,
        "shared_expert_mlp": 0,
        "embed_scale": False,
        "attn_softcap": None,
        "final_softcap": None,
        "rope_local_theta": None,
    }
    wrong = {k: _field(fields, k) for k, v in want.items() if _field(fields, k) != v}
    if not fields.get("experts") or fields.get("swiglu_limit") is None:
        wrong.update(experts=fields.get("experts"), swiglu_limit=fields.get("swiglu_limit"))
    if wrong:
        shown = ", ".join(f"{k}={v}" for k, v in wrong.items())
        raise HFError(f"{shown}: a gpt_oss checkpoint has GPT-OSS's block (want {want}, experts > 0 and swiglu_limit)")


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(LLMConfig)}


def _field(fields: dict, key: str):
    """`fields[key]`, or LLMConfig's default where `fields` omits it."""
    return fields.get(key, _DEFAULTS[key])


def _check_olmo2(fields: dict, model_type: str) -> None:
    """OLMo 2's block (norms after the attention and the MLP only, query and key norms over the
    whole projection) exports as `olmo2`, and `olmo2` holds only that block."""
    olmo2 = {"pre_norms": False, "post_norms": True, "qk_norm": True, "qk_norm_over": "projection", "qkv_bias": False}
    got = {k: _field(fields, k) for k in olmo2}
    if model_type == "olmo2" and (got != olmo2 or fields.get("experts") or fields.get("sliding_window")):
        raise HFError(
            f"an olmo2 checkpoint has {olmo2}, no experts and no sliding window; this model has {got}, "
            f"experts={fields.get('experts')}, sliding_window={fields.get('sliding_window')}"
        )
    if model_type != "olmo2" and (not got["pre_norms"] or got["qk_norm_over"] != "head"):
        raise HFError(
            f"pre_norms={got['pre_norms']}, qk_norm_over={got['qk_norm_over']!r}: OLMo 2's block exports as "
            f"model_type='olmo2'"
        )


def _checkpoint_tensors(params: dict, fields: dict, model_type: str, prefix: str) -> dict[str, np.ndarray]:
    """Each tensor of `model_type`'s checkpoint by name, from `params` (`_mapping` read backwards)."""
    h, g, k, d = fields["heads"], fields["kv_heads"], fields["head_dim"], fields["width"]
    unproj = {"q": h, "k": g, "v": g}
    tensors = {}
    halves: dict[str, dict[str, np.ndarray]] = {}  # GPT-OSS's gate_up_proj (and bias): gate and up, to interleave
    scanned = "blocks" in params
    for flax_path, (name, _) in _mapping(fields, True, prefix, model_type == "mixtral").items():
        if name.endswith((".gate_up_proj", ".gate_up_proj_bias")):
            where, layer = _scanned_path(flax_path) if scanned else (flax_path, None)
            w = np.asarray(jax.device_get(_at(params, where)), np.float32)
            halves.setdefault(name, {})[flax_path[-1].removesuffix("_bias")] = w if layer is None else w[layer]
            continue
        expert = flax_path[-1] if isinstance(flax_path[-1], int) else None
        flax_path = flax_path[:-1] if expert is not None else flax_path
        where, layer = _scanned_path(flax_path) if scanned else (flax_path, None)
        w = np.asarray(jax.device_get(_at(params, where)), np.float32)
        w = w if layer is None else w[layer]
        if expert is not None or flax_path[-1] == "router":
            tensors[name] = np.ascontiguousarray((w if expert is None else w[expert]).T)
            continue
        kind = flax_path[1] if len(flax_path) == 3 else flax_path[0]
        if flax_path[-1] == "kernel" and kind in unproj:
            w = w.reshape(d, unproj[kind] * k).T
        elif flax_path[-1] == "kernel" and kind == "o":
            w = w.reshape(h * k, d).T
        elif flax_path[-1] == "kernel" or flax_path == ("lm_head",):
            w = w.T
        elif flax_path[-1] == "bias":
            w = w.reshape(-1)
        elif flax_path[-1] == "scale" and model_type in GEMMAS:
            w = w - np.float32(1)  # Gemma's norms scale by 1 + weight
        tensors[name] = np.ascontiguousarray(w)
    for name, half in halves.items():  # gate the even columns, up the odd (`_gpt_oss_experts`)
        both = np.empty((*half["gate"].shape[:-1], 2 * half["gate"].shape[-1]), np.float32)
        both[..., ::2], both[..., 1::2] = half["gate"], half["up"]
        tensors[name] = both
    return tensors


def _gemma_config(fields: dict, model_type: str) -> dict:
    """A Gemma 2 or 3 config's own keys: its activation, query scale, windowed and global layers
    with their RoPE, and its softcaps."""
    window, every = fields.get("sliding_window"), fields.get("global_every", 0)
    windowed = [windowed_layer(i, window, every) for i in range(fields["depth"])]
    global_rope = {"rope_type": "default", "rope_theta": fields["rope_theta"]}
    local_rope = {"rope_type": "default", "rope_theta": fields.get("rope_local_theta") or fields["rope_theta"]}
    return dict(
        hidden_activation="gelu_pytorch_tanh",
        query_pre_attn_scalar=fields.get("query_pre_attn_scalar") or fields["head_dim"],
        sliding_window=fields.get("sliding_window") or 4096,
        layer_types=["sliding_attention" if w else "full_attention" for w in windowed],
        rope_parameters=global_rope
        if model_type == "gemma2"
        else {"full_attention": global_rope, "sliding_attention": local_rope},
        attention_bias=False,
        attn_logit_softcapping=fields.get("attn_softcap"),
        final_logit_softcapping=fields.get("final_softcap"),
    )


def _add_rope_scaling(config: dict, scaling: dict, model_type: str) -> None:
    """`scaling` in `config` under transformers' own keys for its type, no others (it warns on
    unknown ones): Gemma 3's global layers' (its windowed layers' RoPE is unscaled), Gemma 2's
    RoPE, else `rope_scaling`."""
    own = {
        "llama3": ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
        "yarn": ("original_max_position_embeddings", "beta_fast", "beta_slow", "truncate")
        + (("attention_factor",) if scaling.get("attention_factor") is not None else ()),
    }
    keep = ("rope_type", "factor", *own.get(scaling["rope_type"], ()))
    if model_type == "gemma3_text":
        config["rope_parameters"]["full_attention"].update({k: scaling[k] for k in keep})
    elif model_type == "gemma2":
        config["rope_parameters"].update({k: scaling[k] for k in keep})
    else:
        config["rope_scaling"] = {k: scaling[k] for k in keep}


def _checkpoint_config(fields: dict, model_type: str) -> dict:
    """`model_type`'s config.json for a model with `fields`."""
    h, g, k, d = fields["heads"], fields["kv_heads"], fields["head_dim"], fields["width"]
    config = {
        "architectures": [ARCHITECTURES[model_type]],
        "model_type": model_type,
        "vocab_size": fields["vocab"],
        "hidden_size": d,
        "num_hidden_layers": fields["depth"],
        "num_attention_heads": h,
        "num_key_value_heads": g,
        "head_dim": k,
        "intermediate_size": fields["mlp"],
        "rope_theta": fields["rope_theta"],
        "rms_norm_eps": fields["norm_eps"],
        "tie_word_embeddings": fields["tie_embeddings"],
        "hidden_act": "silu",
        "max_position_embeddings": 32768,
        "torch_dtype": "float32",
    }
    if model_type == "gemma":
        config.update(hidden_act="gelu_pytorch_tanh", attention_bias=False)
    elif model_type in GEMMAS:
        del config["hidden_act"], config["rope_theta"]
        config.update(_gemma_config(fields, model_type))
    if scaling := fields.get("rope_scaling"):
        _add_rope_scaling(config, scaling, model_type)
    config.update(_moe_config(fields, model_type))
    if model_type in ("mistral", "mixtral", "phi3"):
        config["sliding_window"] = fields.get("sliding_window")
    if model_type == "phi3":
        config["pad_token_id"] = None  # Phi3Config's default (32000) is past a smaller vocabulary's embedding
    if model_type in ("llama", "olmo2", "gpt_oss"):
        config["attention_bias"] = fields["qkv_bias"]
    if model_type == "gpt_oss":
        config.update(_gpt_oss_layers(fields, config.pop("rope_scaling", None), config.pop("rope_theta")))
    return config


def _gpt_oss_layers(fields: dict, scaling: dict | None, theta: float) -> dict:
    """A gpt_oss config.json's attention pattern and RoPE: `layer_types` (windowed and full, from
    `global_every`), the window, and `rope_parameters` written whole (GptOssConfig fills in its own
    YaRN where none is given)."""
    window, every = fields.get("sliding_window"), fields.get("global_every", 0)
    types = [
        "sliding_attention" if window is not None and (not every or (i + 1) % every) else "full_attention"
        for i in range(fields["depth"])
    ]
    rope = {"rope_type": "default", **(scaling or {}), "rope_theta": theta}
    return {"layer_types": types, "sliding_window": window, "rope_parameters": rope}
