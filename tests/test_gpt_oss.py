"""GPT-OSS's pieces in the decoder (issue 78): attention sinks, the attention's output bias, the
experts' biases and clamped SwiGLU, each against a reference written from transformers'
GptOssAttention / GptOssExperts / GptOssTopKRouter (transformers 5.25), and their refusals."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from maestro_jax.models import DecoderLM, LLMConfig
from maestro_jax.models.layers import attention
from maestro_jax.models.llm import MoE

GPT_OSS = dict(
    qkv_bias=True,
    out_bias=True,
    attention_sinks=True,
    sliding_window=4,
    global_every=2,  # GPT-OSS's layer_types: sliding, full, sliding, full...
    experts=4,
    experts_per_token=2,
    expert_mlp=16,
    expert_bias=True,
    swiglu_limit=0.5,  # low, so that the clamps bite on these weights
    router_aux_loss=0.0,
)


def sink_attention_reference(q_BLHK, k_BSGK, v_BSGK, mask_BLS, sinks_H):
    """transformers' eager_attention_forward for GPT-OSS: scores (masked out where the mask is
    false), the head's sink as one more column, softmax, the sink's column dropped."""
    b, lq, h, d = q_BLHK.shape
    g = k_BSGK.shape[2]
    out = np.zeros((b, lq, h, d))
    for i in range(b):
        for head in range(h):
            kv = head // (h // g)  # repeat_kv: key/value head j serves query heads j*H/G .. (j+1)*H/G - 1
            s = q_BLHK[i, :, head] @ k_BSGK[i, :, kv].T / np.sqrt(d)
            s = np.where(mask_BLS[i], s, -np.inf)
            s = np.concatenate([s, np.full((lq, 1), sinks_H[head])], axis=1)
            p = np.exp(s - s.max(axis=1, keepdims=True))
            p = p / p.sum(axis=1, keepdims=True)
            out[i, :, head] = p[:, :-1] @ v_BSGK[i, :, kv]
    return out


def test_attention_sinks_take_weight_from_every_key_as_transformers_does():
    """Each query head's sink joins its rows' softmax: a large sink leaves the row little weight
    for its keys, a very negative one changes nothing, and the output equals transformers' eager
    attention's on grouped-query heads with padded causal rows."""
    rng = np.random.default_rng(0)
    b, length, h, g, d = 2, 6, 4, 2, 8
    q, k, v = (rng.normal(size=(b, length, n, d)).astype(np.float32) for n in (h, g, g))
    causal = np.tril(np.ones((length, length), bool))
    mask = np.stack([causal, causal & (np.arange(length) < 4)[None, :]])
    sinks = np.array([0.5, -1.0, 2.0, 0.0], np.float32)
    got = attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(mask), sinks_H=jnp.asarray(sinks))
    np.testing.assert_allclose(np.asarray(got), sink_attention_reference(q, k, v, mask, sinks), rtol=1e-5, atol=1e-6)
    plain = attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(mask))
    far = attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(mask), sinks_H=jnp.full((h,), -80.0))
    np.testing.assert_allclose(np.asarray(far), np.asarray(plain), rtol=1e-5, atol=1e-6)
    heavy = attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(mask), sinks_H=jnp.full((h,), 30.0))
    assert np.abs(np.asarray(heavy)).max() < 1e-6 < np.abs(np.asarray(plain)).max()


def moe_reference(x_TD, p, c: LLMConfig):
    """transformers' GptOssMLP per token: router logits plus bias, top k, softmax over the k
    logits; each chosen expert's gate_up (plus bias), clamped SwiGLU, down (plus bias)."""
    out = np.zeros_like(x_TD)
    for t, x in enumerate(x_TD):
        logits = x @ p["router"] + p["router_bias"]
        top = np.argsort(-logits, kind="stable")[: c.experts_per_token]
        w = np.exp(logits[top] - logits[top].max())
        w = w / w.sum()
        for e, weight in zip(top, w):
            gate = np.minimum(x @ p["gate"][e] + p["gate_bias"][e], c.swiglu_limit)
            up = np.clip(x @ p["up"][e] + p["up_bias"][e], -c.swiglu_limit, c.swiglu_limit)
            glu = gate / (1 + np.exp(-c.swiglu_alpha * gate))
            out[t] += weight * (((up + 1) * glu) @ p["down"][e] + p["down_bias"][e])
    return out


def test_experts_with_biases_and_the_clamped_swiglu_match_transformers_per_token():
    """The dense dispatch with GPT-OSS's expert biases and clamped SwiGLU gives, token by token,
    what GptOssMLP computes; every bias is a parameter of the expert axis, and the clamps bite."""
    c = LLMConfig(vocab=32, width=8, depth=1, heads=2, kv_heads=1, head_dim=4, mlp=16, **GPT_OSS)
    assert c.moe_dispatch == "dense", "auto resolves to the dispatch that runs them"
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(2, 5, c.width)), jnp.float32)
    valid = jnp.ones((2, 5), bool)
    params = nn.meta.unbox(MoE(c).init(jax.random.key(0), x, valid)["params"])
    assert {n: params[n].shape for n in ("router_bias", "gate_bias", "up_bias", "down_bias")} == {
        "router_bias": (4,),
        "gate_bias": (4, 16),
        "up_bias": (4, 16),
        "down_bias": (4, 8),
    }
    params = {
        n: jnp.asarray(rng.normal(size=a.shape), jnp.float32) * (0.5 if "bias" in n else 1.0) for n, a in params.items()
    }
    got = MoE(c).apply({"params": params}, x, valid)
    host = {n: np.asarray(a, np.float64) for n, a in params.items()}
    want = moe_reference(np.asarray(x, np.float64).reshape(-1, c.width), host, c).reshape(x.shape)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-5)
    gate = np.einsum("td,edf->tef", np.asarray(x).reshape(-1, c.width), host["gate"]) + host["gate_bias"]
    assert (gate > c.swiglu_limit).any(), "the gate's clamp is exercised"


def test_a_decoder_with_gpt_oss_blocks_trains_its_sinks_and_biases():
    """A DecoderLM with every GPT-OSS piece: each block holds its sinks and its output bias, and
    the loss's gradient reaches them (nonzero) and every expert bias."""
    c = LLMConfig(vocab=32, width=8, depth=1, heads=2, kv_heads=1, head_dim=4, mlp=16, **GPT_OSS)
    model = DecoderLM(c)
    ids = jnp.asarray(np.arange(12).reshape(2, 6) % c.vocab, jnp.int32)
    positions, valid = jnp.broadcast_to(jnp.arange(6), (2, 6)), jnp.ones((2, 6), bool)
    init = jax.jit(lambda: nn.meta.unbox(model.init(jax.random.key(0), ids, positions, valid)["params"]))
    block = init()["block_0"]
    assert block["sinks"].shape == (2,) and block["o"]["bias"].shape == (8,)

    @jax.jit
    def grads(p):
        def loss(p):
            logp = jax.nn.log_softmax(model.apply({"params": p}, ids, positions, valid))
            return -jnp.mean(jnp.take_along_axis(logp, ids[..., None], -1))

        return jax.grad(loss)(p)["block_0"]

    g = grads(init())
    assert np.abs(np.asarray(g["sinks"])).max() > 0 and np.abs(np.asarray(g["o"]["bias"])).max() > 0
    for name in ("router_bias", "gate_bias", "up_bias", "down_bias"):
        assert np.abs(np.asarray(g["moe"][name])).max() > 0, name


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(expert_bias=True), "expert_bias=True: GPT-OSS's expert biases and clamped SwiGLU are a mixture"),
        (dict(swiglu_limit=7.0), "swiglu_limit=7.0: GPT-OSS's expert biases and clamped SwiGLU are a mixture"),
        (
            dict(experts=4, experts_per_token=2, expert_mlp=8, expert_bias=True, moe_dispatch="sparse"),
            "expert_bias=True: runs on moe_dispatch: dense only so far (moe_dispatch=sparse's",
        ),
        (
            dict(experts=4, experts_per_token=2, expert_mlp=8, swiglu_limit=7.0, moe_dispatch="ragged"),
            "swiglu_limit=7.0: runs on moe_dispatch: dense only so far (moe_dispatch=ragged's",
        ),
    ],
)
def test_gpt_oss_experts_are_refused_where_they_cannot_run(fields, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        LLMConfig(vocab=32, width=8, depth=1, heads=2, kv_heads=1, head_dim=4, mlp=16, **fields)


@pytest.mark.slow  # a 4-device ring compiled beside the one-device reference
def test_sinks_under_ring_attention_equal_one_device():
    """A GPT-OSS decoder on context 2 x tensor 2 (ring attention, each device's query heads' sinks
    sharded with them) gives one device's loss and gradients, sinks' included."""
    from test_layers import ring_against_one_device

    c = LLMConfig(vocab=64, width=32, depth=2, heads=4, kv_heads=2, head_dim=8, mlp=64, **GPT_OSS)
    away = functools.partial(jax.tree.map, lambda a: a + 0.3 if a.ndim == 1 else a)  # sinks, biases off 0
    hlo = ring_against_one_device(c, dict(context=2, tensor=2), length=16, lengths=(16, 11, 5, 1), shift=away)
    assert "collective-permute" in hlo, "the ring ran"


@pytest.mark.parametrize(
    "key, value", [("attention_sinks", True), ("out_bias", True), ("expert_bias", True), ("swiglu_limit", 7.0)]
)
def test_a_model_with_some_gpt_oss_pieces_is_refused_by_export_in_one_line(key, value):
    """Only gpt_oss holds GPT-OSS's pieces, and only together (sinks and expert biases): `export`
    refuses a section with one alone before reading a weight, naming the field, rather than write
    a folder without it."""
    from maestro_jax.tools.hf import HFError, export_type

    with pytest.raises(HFError, match=rf"^error: models.teacher.{key}={value}: only GPT-OSS's block .* holds it"):
        export_type({"kind": "llm", "experts": 4, key: value}, None, "teacher")


def test_a_gpt_oss_folder_describes_its_model_and_mxfp4_weights_are_refused(tmp_path):
    """`models.<s>: {hf: DIR}` of a GPT-OSS folder: every GPT-OSS piece from config.json (its
    `layer_types` as a window every other layer); the Hub's MXFP4-quantized folders are refused in
    one line naming `quantization_config`; it exports as gpt_oss, and a llama does not."""
    import json
    import shutil
    from pathlib import Path

    from maestro_jax.hf_config import HFError, llm_fields
    from maestro_jax.tools.hf import export_type

    fixture = Path(__file__).parent / "fixtures" / "hf" / "gpt_oss"
    fields = llm_fields(fixture)
    keys = [k for k in GPT_OSS if k != "router_aux_loss"]  # the fixture's shape is GPT_OSS's, its limit 0.1
    assert {k: fields[k] for k in keys} == {**{k: GPT_OSS[k] for k in keys}, "swiglu_limit": 0.1}
    assert fields["swiglu_alpha"] == 1.702 and fields["moe_dispatch"] == "dense"
    assert export_type(fields, None) == "gpt_oss"
    with pytest.raises(HFError, match=r"--model-type=gpt_oss: .* does not export as it"):
        export_type(llm_fields(fixture.parent / "llama_untied"), "gpt_oss")
    quantized = tmp_path / "mxfp4"
    shutil.copytree(fixture, quantized)
    config = json.loads((quantized / "config.json").read_text())
    (quantized / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "mxfp4"}}))
    with pytest.raises(HFError) as err:
        llm_fields(quantized)
    assert "quantization_config.quant_method='mxfp4'" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("scan", [False, True])
def test_a_gpt_oss_export_holds_the_folders_tensors_and_reloads_to_its_logits(tmp_path, scan):
    """Export of the GPT-OSS fixture (unrolled or scanned layers): the same tensor names and
    shapes as transformers wrote, gate and up interleaved back into gate_up_proj exactly, the
    config's layer_types, window and RoPE as the folder's; reloaded, the same logits."""
    import json
    from pathlib import Path

    from maestro_jax.models import hf
    from safetensors.numpy import load_file
    from test_hf import flax_logits

    fixture = Path(__file__).parent / "fixtures" / "hf" / "gpt_oss"
    ours, params, fields = flax_logits(fixture, scan=scan)
    out = tmp_path / "exported"
    hf.save_llm(out, params, fields, model_type="gpt_oss")
    stored, written = load_file(fixture / "model.safetensors"), load_file(out / "model.safetensors")
    assert {k: v.shape for k, v in written.items()} == {k: v.shape for k, v in stored.items()}
    for name in ("model.layers.1.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.gate_up_proj_bias"):
        np.testing.assert_array_equal(written[name], stored[name].astype(np.float32))
    config, theirs = (json.loads((p / "config.json").read_text()) for p in (out, fixture))
    assert config["model_type"] == "gpt_oss" and config["architectures"] == ["GptOssForCausalLM"]
    for key in ("layer_types", "sliding_window", "num_local_experts", "intermediate_size", "swiglu_limit"):
        assert config[key] == theirs[key], key
    assert config["rope_parameters"] == theirs["rope_parameters"]
    back, _, _ = flax_logits(out, scan=scan)
    np.testing.assert_allclose(back, ours, rtol=0, atol=1e-6)


def test_export_offers_every_type_an_exporter_writes():
    """`maestro-jax export --model-type` offers each LLM, tower and whole-model type an exporter
    writes (`tools.hf.EXPORT_TYPES`, gpt_oss among them), and no other."""
    from maestro_jax.cli import _parser
    from maestro_jax.tools.hf import EXPORT_TYPES

    parser = _parser()
    export = next(a for a in parser._subparsers._group_actions[0].choices.values() if a.prog.endswith(" export"))
    (model_type,) = [a for a in export._actions if "--model-type" in a.option_strings]
    whole_models = {
        "gemma3",
        "qwen2_5_vl",
        "qwen3_vl",
        "qwen2_audio",
        "paligemma",
        "smolvlm",
    }  # two sections each (--section a,b)
    assert set(model_type.choices) == {*(t for types in EXPORT_TYPES.values() for t in types), *whole_models}
    assert "gpt_oss" in model_type.choices
