"""Hugging Face import/export (`models/hf.py`) against transformers' own PyTorch forward, in fp32.

The references are fixtures (scripts/make_hf_fixtures.py): tiny random models built by transformers
from its config classes, saved with their logits on TOKENS in tests/fixtures/hf/<case>/reference.npz,
so the import tests need no torch. The tests that load an export back into transformers are skipped
without torch and transformers."""

import json
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ROOT, TINY_KD
from maestro_jax.models import DecoderLM, LLMConfig, RopeScaling, fp8, hf, softcap

from maestro_jax.config import ConfigError, LLMModelConfig, load_config
from maestro_jax.core.plan import SectionPlan, mesh_shape
from maestro_jax.runtime.build import build_runtime
from maestro_jax.runtime.sharding import section_mesh, variable_shardings
from maestro_jax.tools.verify import compare

FIXTURES = ROOT / "tests" / "fixtures" / "hf"
TIED = {
    "llama_untied": False,
    "llama3_rope": False,  # Llama 3.1's `llama3` RoPE scaling, one key/value head, head_dim 16
    "llama_linear_rope": True,
    "mistral_window": False,  # Mistral, a sliding window of 4 over 12 tokens
    "llama_tied": True,
    "qwen2_untied": False,
    "qwen2_tied": True,
    "qwen3": False,
    "qwen3_moe": False,
    "phi3": False,  # Phi-3: fused qkv_proj and gate_up_proj, a sliding window of 4
    "olmo2": False,  # OLMo 2: norms after the attention and the MLP only, q/k norms over the whole projection
    "qwen2_moe": False,  # Qwen2-MoE: top 2 of 4 not renormalised, a shared expert behind its gate, q/k/v biases
    "mixtral": False,  # Mixtral: 4 experts, top 2, the Hub's block_sparse_moe / w1 w2 w3 names
    "qwen3_yarn": False,  # YaRN: frequencies kept, blended and divided; cos/sin scaled
    "gemma3_text": False,  # Gemma 3: window 4 on layers 0 and 2, layer 1 global with linear scaling
    "gemma3_tied": True,  # both layers windowed (the default pattern of 6), one key/value head
    "gemma2": True,  # Gemma 2: every other layer windowed, attention scores and logits soft-capped
    # Gemma (1): Gemma's norms (1 + weight) and scaled embeddings, a norm only before the attention and the MLP
    "gemma": True,
    # GPT-OSS: sinks, q/k/v/o biases, window 4 and full layers alternating, 4 experts with biases
    # and the clamped SwiGLU (limit 0.1: it bites), YaRN without truncation
    "gpt_oss": False,
    # a whole Qwen2-Audio folder's language model (Qwen2's, under language_model.): its text logits
    "qwen2_audio": False,
    # a whole PaliGemma 2 folder's language model (Gemma 2's, under language_model.): text alone, causal
    "paligemma2": True,
    # a whole PaliGemma (1) folder's language model (Gemma's): text alone, causal
    "paligemma1": True,
    # a whole LLaVA-OneVision folder's language model (Qwen2's, under language_model.): its text logits
    "llava_onevision": False,
    # a whole SmolVLM folder's language model (Llama's, under model.text_model.): its text logits
    "smolvlm": False,
}
TOKENS = np.array([[5, 17, 3, 88, 41, 9, 60, 2, 33, 71, 12, 4]], np.int64)


def make_hf(tmp_path, case):
    """A copy of the case's checkpoint folder (tests may damage it) and transformers' logits on TOKENS."""
    out = tmp_path / case
    shutil.copytree(FIXTURES / case, out)
    ref = np.load(out / "reference.npz")
    assert np.array_equal(ref["tokens"], TOKENS)
    return ref["logits"], out


def live_transformers():
    """torch and transformers, or the test is skipped (they are only the dev extra's reference)."""
    torch = pytest.importorskip("torch", reason="torch is a test dependency (the dev extra)")
    return torch, pytest.importorskip("transformers", reason="transformers is a test dependency (the dev extra)")


def torch_logits(model, tokens=TOKENS):
    torch, _ = live_transformers()
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.float().numpy()


def llm_config(fields: dict, **extra) -> LLMConfig:
    """The model's config from `hf.llm_fields` (as `workloads.model_config` makes it)."""
    return LLMConfig.from_fields(fields, **extra)


def _inputs():
    """TOKENS as the model takes them: ids, positions, validity."""
    ids = jnp.asarray(TOKENS, jnp.int32)
    return ids, jnp.arange(ids.shape[1])[None], jnp.ones(ids.shape, bool)


def flax_logits(path, mesh=None, devices=(0,), scan=False):
    mesh = mesh if mesh is not None else mesh_shape()
    fields = hf.llm_fields(path)
    cfg = llm_config(fields, scan_layers=scan)
    model = DecoderLM(cfg)
    ids, pos, valid = _inputs()
    abstract = jax.eval_shape(lambda: model.init(jax.random.key(0), ids, pos, valid)["params"])
    mesh = section_mesh(SectionPlan(tuple(devices), mesh, 1))
    shardings = variable_shardings({"params": abstract}, mesh, "default")["params"]
    target = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        jax.tree.map(lambda a: a.value if hasattr(a, "value") else a, abstract, is_leaf=lambda x: hasattr(x, "value")),
        shardings,
    )
    params = hf.load_llm(path, target, fields)
    host = jax.tree.map(np.asarray, params)
    return np.asarray(model.apply({"params": host}, ids, pos, valid)), params, fields


@pytest.mark.parametrize("case", sorted(TIED))
def test_import_matches_transformers(tmp_path, case):
    reference, path = make_hf(tmp_path, case)
    ours, _, fields = flax_logits(path)
    assert fields["tie_embeddings"] == TIED[case]
    assert fields["kv_heads"] < fields["heads"], "grouped-query attention is exercised"
    np.testing.assert_allclose(ours, reference, atol=1e-4, rtol=0)


def test_gemma2_caps_each_change_the_logits(tmp_path, monkeypatch):
    """The gemma2 fixture's caps bend its scores and logits: without either, maestro's logits leave
    transformers' by more than the 1e-4 the import test holds them to."""
    reference, path = make_hf(tmp_path, "gemma2")
    read = hf.llm_fields
    assert (read(path)["attn_softcap"], read(path)["final_softcap"]) == (0.05, 1.5)
    for cap in ("attn_softcap", "final_softcap"):
        monkeypatch.setattr(hf, "llm_fields", lambda p, cap=cap: {**read(p), cap: None})
        ours, _, _ = flax_logits(path)
        assert np.abs(ours - reference).max() > 2e-4, cap


def test_llama3_and_yarn_fixtures_reach_every_band_and_other_scalings_are_refused(tmp_path):
    """The llama3_rope fixture's frequencies fall in all three of `llama3`'s bands (kept,
    blended, divided by the factor), so its logits check each branch, and so do qwen3_yarn's
    (YaRN's ramp, and its attention factor, without which the logits differ); a scaling the model
    does not compute (dynamic NTK, LongRoPE) is one line naming what is supported."""
    from maestro_jax.models.layers import rope_frequencies

    f = hf.llm_fields(FIXTURES / "llama3_rope")
    s = RopeScaling(**f["rope_scaling"])
    plain = rope_frequencies(f["head_dim"] // 2, f["rope_theta"])
    scaled = rope_frequencies(f["head_dim"] // 2, f["rope_theta"], s)
    ratio = plain / scaled
    kept, divided = np.isclose(ratio, 1.0), np.isclose(ratio, s.factor)
    assert kept.any() and divided.any() and (~kept & ~divided).any()
    _, path = make_hf(tmp_path, "llama_untied")
    config = json.loads((path / "config.json").read_text())
    config["rope_scaling"] = {"rope_type": "dynamic", "factor": 4.0}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(hf.HFError, match=r"rope_type='dynamic'; supported: default, linear, llama3, yarn"):
        hf.llm_fields(path)

    reference, path = make_hf(tmp_path, "qwen3_yarn")
    f = hf.llm_fields(path)
    s = RopeScaling(**f["rope_scaling"])
    ratio = rope_frequencies(f["head_dim"] // 2, f["rope_theta"]) / rope_frequencies(
        f["head_dim"] // 2, f["rope_theta"], s
    )
    kept, divided = np.isclose(ratio, 1.0), np.isclose(ratio, s.factor)
    assert kept.any() and divided.any() and (~kept & ~divided).any()
    ours, params, _ = flax_logits(path)
    np.testing.assert_allclose(ours, reference, atol=1e-4, rtol=0)
    unscaled = {**f, "rope_scaling": {**f["rope_scaling"], "attention_factor": 1.0}}
    other = DecoderLM(llm_config(unscaled)).apply({"params": jax.tree.map(np.asarray, params)}, *_inputs())
    assert np.abs(np.asarray(other) - reference).max() > 1e-3, "the attention factor shows in the logits"


def test_mistral_window_binds_and_exports_as_mistral_only(tmp_path):
    """The fixture's window (4 of 12 tokens) changes transformers' logits, so matching them
    checks the window; a model with a window exports as Mistral (or Phi-3, whose attention has the
    window too), and is refused as another type (no silent full attention in the folder)."""
    from maestro_jax.tools.hf import export_type

    reference, path = make_hf(tmp_path, "mistral_window")
    fields = hf.llm_fields(path)
    assert fields["sliding_window"] == 4
    model = DecoderLM(llm_config({**fields, "sliding_window": None}))
    ours, params, _ = flax_logits(path)
    full = np.asarray(model.apply({"params": jax.tree.map(np.asarray, params)}, *_inputs()))
    np.testing.assert_allclose(ours, reference, atol=1e-4, rtol=0)
    assert np.abs(full - reference).max() > 1e-2  # without the window: other logits
    assert export_type(fields, None) == "mistral"
    with pytest.raises(hf.HFError, match="does not export as it; valid: \\['mistral', 'phi3'\\]"):
        export_type(fields, "llama")
    with pytest.raises(hf.HFError, match="a model with a sliding_window exports as 'mistral'"):
        hf.save_llm(tmp_path / "out", params, fields, model_type="llama")


def test_gemma_exports_as_gemma_only(tmp_path):
    """A Gemma (1) folder's model (Gemma's norms and scaled embeddings, no post-norms) exports as
    `gemma` by default and is refused as Llama or Gemma 2 (whose blocks it is not)."""
    from maestro_jax.tools.hf import export_type

    fields = hf.llm_fields(FIXTURES / "gemma")
    assert (fields["embed_scale"], fields["post_norms"], fields["act"]) == (True, False, "gelu_pytorch_tanh")
    assert export_type(fields, None) == "gemma"
    for other in ("llama", "gemma2"):
        with pytest.raises(hf.HFError, match=r"does not export as it; valid: \['gemma'\]"):
            export_type(fields, other)


GEMMA3_FEATURES = {  # each of Gemma 3's departures from Llama, turned off
    "window": {"sliding_window": None, "global_every": 0, "rope_local_theta": None},
    # every layer windowed at the local base, unscaled: what global_every 0 computed beside
    # rope_local_theta before the model refused that pair (the config always did)
    "global layer": {"global_every": 0, "rope_local_theta": None, "rope_theta": 100.0, "rope_scaling": None},
    "local RoPE base": {"rope_local_theta": None},
    "RoPE scaling": {"rope_scaling": None},
    "query scalar": {"query_pre_attn_scalar": None},
    "GeGLU": {"act": "silu"},
    "embedding scale": {"embed_scale": False},
}


def test_gemma3_fixture_binds_every_feature_and_exports_as_gemma3_only(tmp_path):
    """Each Gemma 3 feature the fixture holds changes transformers' logits (so matching them
    checks it); a norm imports as 1 + weight; Gemma's block exports as gemma3_text only, and no
    other model exports as gemma3_text."""
    from maestro_jax.tools.hf import export_type

    reference, path = make_hf(tmp_path, "gemma3_text")
    ours, params, fields = flax_logits(path)
    np.testing.assert_allclose(ours, reference, atol=1e-4, rtol=0)
    assert (fields["global_every"], fields["sliding_window"], fields["rope_local_theta"]) == (2, 4, 100.0)
    host = jax.tree.map(np.asarray, params)
    for feature, off in GEMMA3_FEATURES.items():
        other = np.asarray(DecoderLM(llm_config({**fields, **off})).apply({"params": host}, *_inputs()))
        assert np.abs(other - reference).max() > 1e-3, f"the fixture does not check Gemma 3's {feature}"
    from safetensors.numpy import load_file

    raw = load_file(path / "model.safetensors")["model.layers.0.post_feedforward_layernorm.weight"]
    np.testing.assert_array_equal(host["block_0"]["post_mlp_norm"]["scale"], raw.astype(np.float32) + 1)
    assert export_type(fields, None) == "gemma3_text"
    with pytest.raises(hf.HFError, match="does not export as it; valid: \\['gemma3_text'\\]"):
        export_type(fields, "mistral")
    _, path = make_hf(tmp_path, "llama_untied")
    with pytest.raises(hf.HFError, match="does not export as it"):
        export_type(hf.llm_fields(path), "gemma3_text")


@pytest.mark.parametrize("prefix", ["model.language_model.", "language_model.model."])
def test_gemma3_multimodal_folder_loads_its_language_model(tmp_path, prefix):
    """A `gemma3` folder (Gemma 3 4B and up) holds its language model under a prefix (transformers
    5 writes `model.language_model.`, 4 wrote `language_model.model.`) and its config under
    `text_config`; the gemma3_text fixture rewritten so gives transformers' logits, its head too."""
    from safetensors.numpy import load_file, save_file

    reference, path = make_hf(tmp_path, "gemma3_text")
    text = json.loads((path / "config.json").read_text())
    head = "language_model.lm_head.weight" if prefix == "language_model.model." else "lm_head.weight"
    tensors = {
        (head if k == "lm_head.weight" else prefix + k.removeprefix("model.")): v
        for k, v in load_file(path / "model.safetensors").items()
    }
    save_file(tensors, path / "model.safetensors")
    (path / "config.json").write_text(
        json.dumps({"model_type": "gemma3", "tie_word_embeddings": False, "text_config": text, "vision_config": {}})
    )
    ours, _, fields = flax_logits(path)
    assert fields["post_norms"] and not fields["tie_embeddings"]
    np.testing.assert_allclose(ours, reference, atol=1e-4, rtol=0)


def test_gemma3_hub_configs_read_as_transformers_reads_them(tmp_path):
    """Hub configs as transformers 4 wrote them: gemma-3-1b's (rope_local_base_freq,
    sliding_window_pattern) and gemma-3-4b's multimodal one, whose text_config gives only what
    differs from Gemma3TextConfig's defaults; an unsupported variant is refused naming the field."""
    from maestro_jax import hf_config

    def fields(config: dict) -> dict:
        (tmp_path / "config.json").write_text(json.dumps(config))
        return hf_config.llm_fields(tmp_path)

    one_b = {
        "model_type": "gemma3_text", "vocab_size": 262144, "hidden_size": 1152, "intermediate_size": 6912,
        "num_hidden_layers": 26, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
        "query_pre_attn_scalar": 256, "rope_theta": 1000000, "rope_local_base_freq": 10000, "rope_scaling": None,
        "sliding_window": 512, "sliding_window_pattern": 6, "hidden_activation": "gelu_pytorch_tanh",
        "attn_logit_softcapping": None, "final_logit_softcapping": None,
    }  # fmt: skip
    f = fields(one_b)
    assert (f["global_every"], f["sliding_window"], f["rope_theta"], f["rope_local_theta"]) == (6, 512, 1e6, 1e4)
    assert f["tie_embeddings"] and f["qk_norm"] and f["post_norms"] and f["embed_scale"] and f["rope_scaling"] is None
    four_b = {
        "model_type": "gemma3",
        "text_config": {
            "model_type": "gemma3_text", "hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 34,
            "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024,
        },
        "vision_config": {"model_type": "siglip_vision_model"},
    }  # fmt: skip
    f = fields(four_b)
    assert (f["width"], f["depth"], f["heads"], f["kv_heads"], f["head_dim"], f["vocab"]) == (
        2560,
        34,
        8,
        4,
        256,
        262208,
    )
    assert f["rope_scaling"]["rope_type"] == "linear" and f["rope_scaling"]["factor"] == 8.0
    assert (f["global_every"], f["sliding_window"], f["query_pre_attn_scalar"]) == (6, 1024, 256)
    LLMModelConfig.model_validate(f)  # the config takes what the reader gives
    capped = fields({**one_b, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0})
    assert (capped["attn_softcap"], capped["final_softcap"]) == (50.0, 30.0) and f["attn_softcap"] is None
    for bad, text in (
        ({"layer_types": ["full_attention", "sliding_attention"] * 13}, "layer_types has full_attention at layers"),
        ({"hidden_activation": "silu"}, "hidden_activation='silu'"),
    ):
        with pytest.raises(hf_config.HFError, match=re.escape(text)):
            fields({**one_b, **bad})


@pytest.mark.parametrize("scan", [False, True])
def test_import_places_each_shard_only(tmp_path, scan):
    """Loaded into a 2x2 (fsdp x tensor) sharding: each device holds a slice, and the logits still
    match; into a scanned model (`scan_layers`), the layers stack on a leading axis."""
    reference, path = make_hf(tmp_path, "qwen2_untied")
    ours, params, fields = flax_logits(path, mesh=mesh_shape(fsdp=2, tensor=2), devices=(4, 5, 6, 7), scan=scan)
    np.testing.assert_allclose(ours, reference, atol=1e-4, rtol=0)
    gate = params["blocks"]["layer"]["gate"]["kernel"] if scan else params["block_0"]["gate"]["kernel"]
    assert {d.id for d in gate.sharding.device_set} == {4, 5, 6, 7}
    shard = (fields["depth"], 16, 32) if scan else (16, 32)  # [(layers,) D, F] over (fsdp, tensor)
    assert all(s.data.shape == shard for s in gate.addressable_shards)


@pytest.mark.reference
@pytest.mark.parametrize(
    "case,model_type,scan",
    [
        ("llama_untied", "llama", False),
        ("llama3_rope", "llama", True),
        ("llama_linear_rope", "llama", False),
        ("mistral_window", "mistral", True),
        ("qwen2_tied", "qwen2", False),
        ("qwen3", "qwen3", True),
        ("qwen3_moe", "qwen3_moe", True),
        ("mixtral", "mixtral", False),
        ("qwen2_moe", "qwen2_moe", True),
        ("phi3", "phi3", False),
        ("olmo2", "olmo2", True),
        ("qwen3_yarn", "qwen3", False),
        ("gemma3_text", "gemma3_text", True),
        ("gemma3_tied", "gemma3_text", False),
        ("gemma2", "gemma2", True),
        ("gemma", "gemma", False),
        ("gpt_oss", "gpt_oss", True),
    ],
)
def test_export_round_trip_in_transformers(tmp_path, case, model_type, scan):
    torch, transformers = live_transformers()
    reference, path = make_hf(tmp_path, case)
    ours, params, fields = flax_logits(path, scan=scan)
    out = tmp_path / "exported"
    hf.save_llm(out, params, fields, model_type=model_type, max_shard_bytes=20_000)  # several shards + index
    assert (out / "model.safetensors.index.json").is_file()
    back = transformers.AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
    np.testing.assert_allclose(torch_logits(back), ours, atol=1e-4, rtol=0)
    np.testing.assert_allclose(torch_logits(back), reference, atol=1e-4, rtol=0)
    if model_type in (
        "mixtral",
        "qwen2_moe",
        "phi3",
        "olmo2",
        "gpt_oss",
    ):  # the export under the Hub's names, as check-hf reads it
        from maestro_jax import cli

        assert cli.main(["check-hf", "--hf", str(out)]) == 0


def test_cli_export_names_are_the_models_mapping():
    """`maestro-jax export` calls `maestro_jax.tools.hf`, whose exporters are the very objects of
    `models.hf` and `models.hf_encoders` (one mapping for import and export)."""
    from maestro_jax.models import hf_encoders

    from maestro_jax.tools import hf as tools_hf

    assert tools_hf.save_llm is hf.save_llm and tools_hf.HFError is hf.HFError
    assert tools_hf.save_vit is hf_encoders.save_vit and tools_hf.save_audio is hf_encoders.save_audio


def _overrides(path, **extra):
    """kd_tiny with the checkpoint as teacher: models.teacher copied from its config.json."""
    f = hf.llm_fields(path)
    out = dict(o.split("=", 1) for o in TINY_KD if not o.startswith("models.teacher"))
    # as YAML reads them (a dict as JSON: its null and true)
    out.update(
        {
            f"models.teacher.{k}": json.dumps(v) if isinstance(v, dict) else v
            for k, v in f.items()
            if k != "kind" and v is not None
        }
    )
    out.update({"models.student.vocab": f["vocab"], "sections.teacher.init.hf_path": path, **extra})
    return out.items()


def _teacher_cfg(path, **extra):
    return load_config(ROOT / "configs/kd_tiny.yaml", [f"{k}={v}" for k, v in _overrides(path, **extra)])


@pytest.mark.parametrize(
    "case,mesh",
    [
        ("llama_untied", "{data: 2, tensor: 2}"),
        ("llama3_rope", "{data: 4}"),  # one kv head: no tensor split
        ("gemma3_text", "{data: 2, tensor: 2}"),
        ("gemma2", "{data: 2, tensor: 2}"),  # its output logits capped: the student's loss applies the cap
    ],
)
@pytest.mark.slow
def test_kd_teacher_from_hf_folder(tmp_path, case, mesh):
    """The KD teacher section starts from the folder: its hidden states and output layer give
    transformers' logits, sharded over the teacher's mesh, and a training step runs (with a
    Llama 3.1-style teacher too, the usual distillation's: its `rope_scaling` read into
    `models.teacher`; and a Gemma 3 teacher, its windowed and global layers)."""
    reference, path = make_hf(tmp_path, case)
    cfg = _teacher_cfg(path, **{"sections.teacher.mesh": mesh})
    rt = build_runtime(cfg)
    states = rt.step.init()
    body, head = states["teacher"].consts["llm"], states["student"].consts["teacher_head"]
    assert {d.id for d in head.sharding.device_set} == set(cfg.sections["student"].devices)
    f = hf.llm_fields(path)
    lm = DecoderLM(llm_config(f), with_head=False)
    ids = jnp.asarray(TOKENS, jnp.int32)
    pos, valid = jnp.arange(ids.shape[1])[None], jnp.ones(ids.shape, bool)
    v = {"params": jax.tree.map(np.asarray, body)}
    hidden = lm.apply(v, lm.apply(v, ids, method=DecoderLM.embed), pos, valid, method=DecoderLM.hidden)
    logits = softcap(np.asarray(hidden) @ np.asarray(head), f.get("final_softcap"))
    np.testing.assert_allclose(logits, reference, atol=1e-4, rtol=0)
    _, metrics = rt.step(states, rt.batches()[0])  # a training step
    assert np.isfinite(rt.step.read(metrics)["train/loss"])


@pytest.mark.slow
def test_kd_teacher_from_hf_folder_in_fp8(tmp_path):
    """A frozen teacher at `precision: fp8` quantizes the checkpoint's Dense kernels as it loads
    them (each with its own per-tensor scale, placed as the runtime shards it): its logits stay
    within 0.1 (relative L2) of transformers' (measured 2.0e-2; the bf16 teacher's, 5.2e-3), and a
    training step runs."""
    reference, path = make_hf(tmp_path, "llama_untied")
    cfg = _teacher_cfg(path, **{"sections.teacher.mesh": "{data: 2, tensor: 2}", "sections.teacher.precision": "fp8"})
    rt = build_runtime(cfg)
    states = rt.step.init()
    body, head = states["teacher"].consts["llm"], states["student"].consts["teacher_head"]
    q = body["block_0"]["q"]["kernel"]
    assert isinstance(q, fp8.Fp8Weight) and (q.value.dtype, q.scale.dtype) == (fp8.E4M3, jnp.float32)
    assert q.value.sharding == rt.shardings["teacher"]["consts"]["llm"]["block_0"]["q"]["kernel"].value
    f = hf.llm_fields(path)
    lm = DecoderLM(llm_config(f), with_head=False)
    ids = jnp.asarray(TOKENS, jnp.int32)
    pos, valid = jnp.arange(ids.shape[1])[None], jnp.ones(ids.shape, bool)
    v = {"params": body}
    hidden = lm.apply(v, lm.apply(v, ids, method=DecoderLM.embed), pos, valid, method=DecoderLM.hidden)
    logits = np.asarray(hidden, np.float32) @ np.asarray(head)
    assert compare("logits", logits, reference).max_rel < 0.1
    _, metrics = rt.step(states, rt.batches()[0])
    assert np.isfinite(rt.step.read(metrics)["train/loss"])


def _from_folder(path, teacher: str, *extra: str):
    """kd_tiny (TINY_KD) with `models.teacher` given as `teacher` (a YAML mapping naming `path`)."""
    own = [o for o in TINY_KD if not o.startswith("models.teacher")]
    return load_config(ROOT / "configs/kd_tiny.yaml", [*own, f"models.teacher={teacher}", *extra])


def test_architecture_comes_from_the_folder_and_the_section_starts_from_it(tmp_path):
    """`models.teacher: {hf: DIR}` alone: the kind and every architecture field from config.json
    (a Llama 3.1-style folder: RoPE scaling, one key/value head, head_dim 16), the teacher section
    starting from the folder's weights, and a training step; `init: null` keeps the architecture
    with random weights."""
    reference, path = make_hf(tmp_path, "llama3_rope")
    vocab = hf.llm_fields(path)["vocab"]
    cfg = _from_folder(path, f"{{hf: {path}}}", f"models.student.vocab={vocab}", "sections.teacher.mesh={data: 4}")
    model = cfg.models["teacher"].model_dump()
    assert {k: model[k] for k in hf.llm_fields(path)} == hf.llm_fields(path) and model["hf"] == str(path)
    assert cfg.sections["teacher"].init.hf_path == str(path)
    rt = build_runtime(cfg)
    states = rt.step.init()
    lm = DecoderLM(llm_config(hf.llm_fields(path)), with_head=False)
    ids, pos, valid = _inputs()
    v = {"params": jax.tree.map(np.asarray, states["teacher"].consts["llm"])}
    hidden = lm.apply(v, lm.apply(v, ids, method=DecoderLM.embed), pos, valid, method=DecoderLM.hidden)
    head = np.asarray(states["student"].consts["teacher_head"])
    np.testing.assert_allclose(np.asarray(hidden) @ head, reference, atol=1e-4, rtol=0)
    _, metrics = rt.step(states, rt.batches()[0])  # a training step
    assert np.isfinite(rt.step.read(metrics)["train/loss"])
    random = _from_folder(path, f"{{hf: {path}}}", f"models.student.vocab={vocab}", "sections.teacher.init=null")
    assert random.sections["teacher"].init is None and random.models["teacher"] == cfg.models["teacher"]


def test_a_field_written_beside_hf_must_agree_with_the_folder(tmp_path):
    _, path = make_hf(tmp_path, "llama_untied")
    same = _from_folder(path, f"{{hf: {path}, width: 32, rope_theta: 10000.0}}", "models.student.vocab=96")
    assert same.models["teacher"].width == 32
    with pytest.raises(ConfigError) as err:
        _from_folder(path, f"{{hf: {path}, width: 64}}", "models.student.vocab=96")
    text = str(err.value)
    assert text.startswith("error: models.teacher") and "\n" not in text
    assert f"width=64: the checkpoint {path} has width=32" in text
    (path / "config.json").write_text(json.dumps({**hf.read_config(path), "model_type": "gpt2"}))
    with pytest.raises(ConfigError, match=r"models.teacher.hf=.*model_type='gpt2'; supported: \[.*'llama'.*\(llm\)"):
        _from_folder(path, f"{{hf: {path}}}", "models.student.vocab=96")


def test_mismatched_model_config_is_rejected_before_compiling(tmp_path):
    _, path = make_hf(tmp_path, "llama_untied")
    cfg = _teacher_cfg(path, **{"models.teacher.width": 64})
    with pytest.raises(ConfigError, match=r"models.teacher.width=64: the checkpoint .* has width=32"):
        build_runtime(cfg)
    with pytest.raises(ConfigError, match=r"sections.teacher.init.hf_path=.*no config.json"):
        build_runtime(_teacher_cfg(path, **{"sections.teacher.init.hf_path": str(tmp_path / "nowhere")}))
    moe = {"models.teacher.experts": 4, "models.teacher.experts_per_token": 2, "models.teacher.expert_mlp": 16}
    with pytest.raises(ConfigError, match=r"models.teacher.experts=4: the checkpoint .* has experts=0"):
        build_runtime(_teacher_cfg(path, **moe))


@pytest.mark.reference
@pytest.mark.slow
def test_distilled_student_exports_to_transformers(tmp_path):
    """Distil one step from a Hugging Face teacher, then `maestro-jax export` the student:
    transformers loads it and gives the logits of the checkpointed student params."""
    from maestro_jax import cli
    from maestro_jax.training.checkpoint import Checkpointer
    from maestro_jax.training.loop import train

    torch, transformers = live_transformers()
    _, path = make_hf(tmp_path, "qwen2_tied")
    out = tmp_path / "run"
    cfg = _teacher_cfg(path, output_dir=out, steps=1)
    train(cfg, progress=False)
    assert (
        cli.main(
            [
                "export",
                "--config",
                str(ROOT / "configs/kd_tiny.yaml"),
                "--section",
                "student",
                "--out",
                str(tmp_path / "student"),
                *[f"{k}={v}" for k, v in _overrides(path, output_dir=out)],
            ]
        )
        == 0
    )
    rt = build_runtime(cfg)
    ckpt = Checkpointer(out / "checkpoints")
    step, states, _, _ = ckpt.restore_latest(rt.init_states())
    ckpt.close()
    assert step == 1
    s = cfg.models["student"]
    model = DecoderLM(LLMConfig.from_fields(s.model_dump()))
    ids = jnp.asarray(TOKENS, jnp.int32)
    ours = model.apply(
        {"params": jax.tree.map(np.asarray, states["student"].params)},
        ids,
        jnp.arange(ids.shape[1])[None],
        jnp.ones(ids.shape, bool),
    )
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "student", torch_dtype=torch.float32).eval()
    np.testing.assert_allclose(torch_logits(back), np.asarray(ours), atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    "damage,text",
    [
        ("config_not_json", "config.json: not a readable JSON file (JSONDecodeError"),
        ("no_safetensors", "no *.safetensors files"),
        ("bad_safetensors", "model.safetensors: not a readable safetensors file"),
        (
            "missing_tensor",
            "1 of the 21 tensors the model reads are missing from its safetensors files: "
            "'model.layers.0.mlp.up_proj.weight'",
        ),
    ],
)
def test_damaged_hf_folder_exits_2_before_compiling(tmp_path, damage, text, capsys):
    """A config.json that is not JSON, no (readable) weights, or weights short of a tensor the
    model reads (the safetensors headers, no tensor loaded): one line, status 2, nothing
    compiled (it used to fail after 5 compilations)."""
    from test_plan import COUNTER

    from maestro_jax import cli

    _, path = make_hf(tmp_path, "llama_untied")
    overrides = [f"{k}={v}" for k, v in _overrides(path)]
    if damage == "config_not_json":
        (path / "config.json").write_text('{"model_type": "llama", "hidden_size": 32,')  # cut short
    elif damage == "no_safetensors":
        for f in path.glob("*.safetensors"):
            f.unlink()
    elif damage == "missing_tensor":
        _drop_tensor(path / "model.safetensors", "model.layers.0.mlp.up_proj.weight")
    else:
        (path / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{not js")
    capsys.readouterr()
    before = COUNTER.count
    status = cli.main(["train", "--config", str(ROOT / "configs/kd_tiny.yaml"), *overrides, "steps=1"])
    err = capsys.readouterr().err.strip()
    assert status == 2 and err.startswith("error: sections.teacher.init.hf_path=") and "\n" not in err, err
    assert text in err, err
    assert COUNTER.count == before, "rejected before any compilation"


def _drop_tensor(weights, name):
    """`weights` (a safetensors file) rewritten without the tensor `name`."""
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(weights))
    del tensors[name]
    save_file(tensors, str(weights), metadata={"format": "pt"})


@pytest.mark.parametrize(
    "damage,text",
    [
        ("cut_short", "model.safetensors: not a readable safetensors file (SafetensorError"),
        ("no_weights", "no *.safetensors files; expected the weights beside config.json"),
        ("index_names_a_missing_shard", "model-00002-of-00002.safetensors: not a readable safetensors file"),
        (
            "missing_tensor",
            "2 of the 21 tensors the model reads are missing from its safetensors files: "
            "'model.norm.weight', 'lm_head.weight'",
        ),
    ],
)
def test_check_hf_on_a_damaged_folder_is_one_line_before_compute(tmp_path, damage, text, capsys):
    """`check-hf` on weights cut short, no weights file, an index naming a shard that is not
    there, or weights short of tensors the model reads: status 2, one `error:` line naming the
    file, nothing compiled and no model built (it used to print safetensors' or transformers'
    traceback, status 1, after 12 s)."""
    from test_plan import COUNTER

    from maestro_jax import cli

    path = tmp_path / "llama"
    shutil.copytree(FIXTURES / "llama3_rope", path)
    weights = path / "model.safetensors"
    if damage == "cut_short":
        with open(weights, "r+b") as f:
            f.truncate(weights.stat().st_size // 2)
    elif damage == "no_weights":
        weights.unlink()
    elif damage == "missing_tensor":
        _drop_tensor(weights, "model.norm.weight")
        _drop_tensor(weights, "lm_head.weight")
    else:
        index = {"metadata": {}, "weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}
        (path / "model.safetensors.index.json").write_text(json.dumps(index))
    capsys.readouterr()
    before = COUNTER.count
    assert cli.main(["check-hf", "--hf", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --hf={path}: ") and err.count("\n") == 1 and text in err, err
    assert COUNTER.count == before, "refused before any compilation"


@pytest.mark.parametrize(
    "folder,dropped",
    [
        ("siglip", "encoder.layers.0.mlp.fc1.weight"),
        ("whisper", "encoder.layers.0.fc1.weight"),
        ("qwen2_5_vl", "visual.blocks.0.mlp.up_proj.weight"),  # a whole VLM: its tower's tensors
        ("qwen2_5_vl", "model.layers.1.mlp.up_proj.weight"),  # and its decoder's
    ],
)
def test_check_hf_names_a_tensor_a_tower_or_vlm_folder_lacks(tmp_path, folder, dropped, capsys):
    """A vision tower, an audio encoder or a whole VLM whose weights lack a tensor its model reads:
    `check-hf` names it in one line, status 2, before anything is built or compiled."""
    from test_plan import COUNTER

    from maestro_jax import cli

    path = tmp_path / folder
    shutil.copytree(FIXTURES / folder, path)
    _drop_tensor(path / "model.safetensors", dropped)
    capsys.readouterr()
    before = COUNTER.count
    assert cli.main(["check-hf", "--hf", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --hf={path}: ") and err.count("\n") == 1, err
    assert "1 of the " in err and f"tensors the model reads are missing from its safetensors files: {dropped!r}" in err
    assert COUNTER.count == before, "refused before any compilation"


@pytest.mark.parametrize(
    "config,name,folder,said",
    [
        (
            "kd_tiny.yaml",
            "student",
            "siglip",
            "error: models.student.out_width: missing; this key is required of kind 'vit', which "
            "models.student.hf='{path}' holds (config.json model_type 'siglip_vision_model')",
        ),
        (
            "vlm_tiny.yaml",
            "vision",
            "llama3_rope",
            "error: models.vision.hf='{path}': holds a model of kind 'llm'; workload 'vlm' needs kind 'vit' for "
            "models.vision",
        ),
    ],
    ids=["vision-tower-as-student", "decoder-as-vision-tower"],
)
def test_a_folder_of_another_kind_than_its_model_is_named(tmp_path, capsys, config, name, folder, said):
    """`models.<s>: {hf: DIR}` with a folder of another kind than the workload needs there: one
    line naming the folder and the kind it holds, status 2, nothing compiled (a vision tower as a
    KD student used to read `models.student.out_width: missing`, as if a key were left out)."""
    import yaml
    from test_plan import COUNTER

    from maestro_jax import cli

    raw = yaml.safe_load((ROOT / "configs" / config).read_text())
    raw["models"][name] = {"hf": str(FIXTURES / folder)}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw))
    capsys.readouterr()
    before = COUNTER.count
    assert cli.main(["train", "--config", str(tmp_path / "c.yaml"), "steps=1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(said.format(path=FIXTURES / folder)) and err.count("\n") == 1, err
    assert COUNTER.count == before, "refused before any compilation"


@pytest.mark.reference
@pytest.mark.parametrize(
    "case",
    [
        "llama3_rope",
        "mistral_window",
        "phi3",
        "olmo2",
        "qwen3_moe",
        "qwen2_moe",
        "mixtral",
        "gemma3_text",
        "gemma2",
        "gemma",
        "gpt_oss",
        "llava_onevision",  # its language model, through the whole LLaVA-OneVision model on text
    ],
)
def test_check_hf_compares_a_folder_through_transformers_and_maestro(tmp_path, case, capsys):
    """`maestro-jax check-hf --hf DIR`: rows of different lengths, longer than Mistral's window;
    0 within the tolerance, 1 over it (a tolerance below float32 rounding), 2 with one `error:`
    line for a folder that is not a decoder."""
    live_transformers()
    from maestro_jax import cli

    path = FIXTURES / case
    assert cli.main(["check-hf", "--hf", str(path)]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.endswith("PASS") and "3 rows of [24, 19, 13] tokens" in line
    assert cli.main(["check-hf", "--hf", str(path), "--tolerance", "1e-12"]) == 1
    assert capsys.readouterr().out.strip().endswith("FAIL")
    bert = tmp_path / "bert"
    bert.mkdir()
    (bert / "config.json").write_text(json.dumps({"model_type": "bert"}))
    assert cli.main(["check-hf", "--hf", str(bert)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --hf=") and "model_type='bert'; supported:" in err and "\n" not in err


@pytest.mark.reference
@pytest.mark.parametrize(
    "case,inputs",
    [("siglip", "2 images of 16x16"), ("clip", "2 images of 16x16"), ("whisper", "2 clips of 16 frames")],
)
def test_check_hf_compares_a_tower_folder(case, inputs, capsys):
    """`check-hf` on a SigLIP or CLIP vision tower or a Whisper encoder: random images (clips) of
    its size through both, the features compared; 1 under a tolerance below float32 rounding."""
    live_transformers()
    from maestro_jax import cli

    path = FIXTURES / case
    assert cli.main(["check-hf", "--hf", str(path)]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.endswith("PASS") and f"{inputs}; features max abs diff" in line, line
    assert cli.main(["check-hf", "--hf", str(path), "--tolerance", "1e-12"]) == 1


@pytest.mark.slow
def test_an_export_owns_its_folder(tmp_path, capsys):
    """`export --out F` where F holds another model's shards and index: refused, one line naming
    what is there, F untouched (a loader would read the old index beside the new weights); with
    `--overwrite` F holds exactly the new export, byte for byte as into an empty folder, plus the
    files that are no weights (a tokenizer); no staging folder is left."""
    from maestro_jax import cli

    args = ["export", "--config", str(ROOT / "configs/kd_tiny.yaml"), "--section", "student", *TINY_KD]
    clean = tmp_path / "clean"
    assert cli.main([*args, "--out", str(clean)]) == 0
    other = tmp_path / "other"
    other.mkdir()
    old = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json"]
    for name in [*old, "config.json", "tokenizer.json"]:
        (other / name).write_text(f"another model's {name}")
    capsys.readouterr()
    assert cli.main([*args, "--out", str(other)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: --out={other}: holds files this export did not write (config.json, model-0000"), err
    assert "\n" not in err and (other / old[2]).read_text() == f"another model's {old[2]}"
    assert cli.main([*args, "--out", str(other), "--overwrite"]) == 0
    assert sorted(p.name for p in other.iterdir()) == sorted([*(p.name for p in clean.iterdir()), "tokenizer.json"])
    for p in clean.iterdir():
        assert (other / p.name).read_bytes() == p.read_bytes(), p.name
    assert (other / "tokenizer.json").read_text() == "another model's tokenizer.json"
    assert not [p for p in tmp_path.iterdir() if ".export-" in p.name]


@pytest.mark.reference
@pytest.mark.parametrize("case", ["mixtral", "phi3", "olmo2", "gpt_oss", "qwen2_audio"])
def test_check_hf_fails_a_folder_whose_weight_maestro_reads_moved(monkeypatch, capsys, case):
    """One weight moved on maestro's side only (after its import of the folder: a Mixtral expert's,
    the up projection Phi-3 fuses with its gate, OLMo 2's query-norm scale of a feature past the
    first head, a GPT-OSS head's attention sink, a query bias of a Qwen2-Audio folder's language
    model): the logits differ from transformers' and check-hf exits 1."""
    live_transformers()
    from maestro_jax import cli

    load = hf.load_llm

    def moved(*args, **kwargs):
        params = load(*args, **kwargs)
        block = params["block_1"]
        if case == "mixtral":
            return {**params, "block_1": {**block, "moe": {**block["moe"], "up": block["moe"]["up"].at[3].add(0.05)}}}
        if case == "olmo2":
            return {**params, "block_1": {**block, "q_norm": {"scale": block["q_norm"]["scale"].at[20].add(0.5)}}}
        if case == "gpt_oss":
            return {**params, "block_1": {**block, "sinks": block["sinks"].at[3].add(0.5)}}
        if case == "qwen2_audio":  # a query bias of its language model's fourth head
            return {**params, "block_1": {**block, "q": {**block["q"], "bias": block["q"]["bias"].at[3, 5].add(0.5)}}}
        return {**params, "block_1": {**block, "up": {"kernel": block["up"]["kernel"].at[0].add(0.05)}}}

    monkeypatch.setattr(hf, "load_llm", moved)
    assert cli.main(["check-hf", "--hf", str(FIXTURES / case)]) == 1
    assert capsys.readouterr().out.strip().endswith("FAIL")


def test_a_mixtral_whose_router_adds_noise_is_refused_in_one_line(tmp_path):
    """`router_jitter_noise` (the router's training noise) is not implemented: the folder is
    refused naming the field and what is valid; an MoE model exports as mixtral by default."""
    from maestro_jax.tools.hf import export_type

    path = tmp_path / "mixtral"
    shutil.copytree(FIXTURES / "mixtral", path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "router_jitter_noise": 0.01}))
    with pytest.raises(hf.HFError, match=r"config.json: router_jitter_noise=0.01; valid: 0 \(the router's training"):
        hf.llm_fields(path)
    fields = hf.llm_fields(FIXTURES / "mixtral")
    assert export_type(fields, None) == "mixtral" and export_type({**fields, "qk_norm": True}, None) == "qwen3_moe"
    assert export_type(hf.llm_fields(FIXTURES / "qwen2_moe"), None) == "qwen2_moe"


@pytest.mark.slow  # two sections and the monolithic step compiled
@pytest.mark.parametrize("case", ["mixtral", "gpt_oss"])
def test_an_moe_teacher_with_its_experts_on_the_expert_axis_verifies(case):
    """`models.teacher: {hf: <a Mixtral or GPT-OSS folder>}` beside a Llama-style student, the
    teacher on data 2 x expert 2 (each device holding 2 of the 4 experts of every layer, and
    GPT-OSS's their biases): the teacher starts from the folder (its experts split over the expert
    axis) and the sectioned step equals the monolithic one (data 2 x expert 2 x fsdp 2)."""
    from maestro_jax.tools.verify import verify

    path = FIXTURES / case
    cfg = _from_folder(
        path,
        f"{{hf: {path}}}",
        "models.student.vocab=96",
        "sections.teacher.mesh={data: 2, expert: 2}",
        "monolithic.mesh={data: 2, expert: 2, fsdp: 2}",
    )
    assert cfg.models["teacher"].experts == 4 and cfg.sections["teacher"].init.hf_path == str(path)
    assert cfg.models["teacher"].attention_sinks == (case == "gpt_oss")
    rt = build_runtime(cfg)
    moe = rt.step.init()["teacher"].consts["llm"]["block_0"]["moe"]
    for name in ("up", "up_bias", "down_bias") if case == "gpt_oss" else ("up",):
        assert moe[name].shape[0] == 4 and moe[name].sharding.shard_shape(moe[name].shape)[0] == 2, name
    diffs = verify(cfg, rt)
    assert [d.name for d in diffs] == ["loss", "grad_norm", "student/grads", "student/params_after_update"]
    assert all(d.max_rel <= 1e-5 for d in diffs), diffs


def test_an_olmo2_folder_norms_its_blocks_outputs_and_whole_projections(tmp_path):
    """OLMo 2: each block norms only its attention's and its MLP's outputs (`pre_norms: false`, the
    weights as they are, not Gemma's 1 + weight), and its query and key norms span the whole
    projection (`qk_norm_over: projection`: one scale per projected feature); export writes
    olmo2's tensors and reloads to the same logits. Another type refuses the block in one line,
    and olmo2 refuses a block that is not OLMo 2's."""
    from safetensors.numpy import load_file

    from maestro_jax.tools.hf import export_type

    reference, path = make_hf(tmp_path, "olmo2")
    ours, params, fields = flax_logits(path)
    np.testing.assert_allclose(ours, reference, atol=1e-4, rtol=0)
    assert (fields["pre_norms"], fields["post_norms"], fields["qk_norm_over"]) == (False, True, "projection")
    block = params["block_0"]
    assert block["q_norm"]["scale"].shape == (4 * 8,) and block["k_norm"]["scale"].shape == (2 * 8,)
    assert not {"attn_norm", "mlp_norm"} & set(block)
    assert export_type(fields, None) == "olmo2"
    out = tmp_path / "exported"
    hf.save_llm(out, params, fields, model_type="olmo2")
    names = set(load_file(out / "model.safetensors"))
    assert "model.layers.1.post_feedforward_layernorm.weight" in names
    assert not any("input_layernorm" in n or "pre_feedforward" in n for n in names)
    back, _, _ = flax_logits(out)
    np.testing.assert_allclose(back, ours, rtol=0, atol=1e-6)
    with pytest.raises(hf.HFError, match="OLMo 2's block exports as model_type='olmo2'"):
        hf.save_llm(tmp_path / "as_llama", params, fields, model_type="llama")
    with pytest.raises(hf.HFError, match=r"does not export as it; valid: \['olmo2'\]"):
        export_type(fields, "llama")
    _, llama_params, llama_fields = flax_logits(FIXTURES / "llama_untied")
    with pytest.raises(hf.HFError, match="an olmo2 checkpoint has"):
        hf.save_llm(tmp_path / "as_olmo2", llama_params, llama_fields, model_type="olmo2")


def test_a_phi3_folder_fuses_its_projections_and_refuses_partial_rotary(tmp_path):
    """Phi-3's fused tensors: each of q, k, v (and gate, up) reads its rows of qkv_proj (gate_up_proj),
    and export writes them fused again, no per-projection tensor left; a partial rotary factor (RoPE
    over part of each head) is refused naming the field."""
    from safetensors.numpy import load_file

    ours, params, fields = flax_logits(FIXTURES / "phi3")
    out = tmp_path / "exported"
    hf.save_llm(out, params, fields, model_type="phi3")
    names = set(load_file(out / "model.safetensors"))
    assert "model.layers.1.self_attn.qkv_proj.weight" in names and "model.layers.1.mlp.gate_up_proj.weight" in names
    assert not any(n.endswith((".q_proj.weight", ".gate_proj.weight", ".up_proj.weight")) for n in names)
    back, _, _ = flax_logits(out)
    np.testing.assert_allclose(back, ours, rtol=0, atol=1e-6)
    path = tmp_path / "phi3"
    shutil.copytree(FIXTURES / "phi3", path)
    config = json.loads((path / "config.json").read_text())
    config["rope_parameters"]["partial_rotary_factor"] = 0.5
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(hf.HFError, match=r"config.json: partial_rotary_factor=0.5; valid: 1.0"):
        hf.llm_fields(path)


@pytest.mark.parametrize("case,qkv_bias", [("llava_onevision", True), ("smolvlm", False)])
def test_a_vlm_folder_gives_its_language_model(case, qkv_bias):
    """`models.<s>: {hf: <a LLaVA-OneVision or SmolVLM folder>, kind: llm}` takes its Qwen2 or Llama
    language model (the import test above checks its logits); without `kind` the folder's two
    models are named. LLaVA-OneVision's `kind: vit` is refused in one line until the rows place its
    any-resolution tiles and image newlines (issue 80); SmolVLM's tower loads
    (tests/test_hf_encoders.py)."""
    from maestro_jax.hf_config import kind_of, vit_fields

    path = FIXTURES / case
    fields = hf.llm_fields(path)
    assert (fields["qkv_bias"], fields["tie_embeddings"], fields["vocab"]) == (qkv_bias, False, 96)
    with pytest.raises(hf.HFError, match=r"holds a model of each kind \['llm', 'vit'\]; write kind: llm or kind: vit"):
        kind_of(path)
    if case == "llava_onevision":
        with pytest.raises(hf.HFError, match=r"model_type='llava_onevision': its vision tower \(SigLIP over any-res"):
            vit_fields(path)
    cfg = _from_folder(path, f"{{hf: {path}, kind: llm}}", "models.student.vocab=96")
    assert cfg.models["teacher"].qkv_bias == qkv_bias and cfg.sections["teacher"].init.hf_path == str(path)


def test_a_qwen2_audio_folder_gives_its_language_model_and_its_pooled_encoder():
    """`models.<s>: {hf: <a Qwen2-Audio folder>, kind: llm}` takes its Qwen2 language model (the
    import test above checks its logits); without `kind` the folder's two models are named;
    `kind: audio` takes its Whisper-style encoder, pooled in pairs, with its projector onto the
    language model's width (tests/test_hf_encoders.py checks its features)."""
    from maestro_jax.hf_config import audio_fields, kind_of

    path = FIXTURES / "qwen2_audio"
    fields = hf.llm_fields(path)
    assert (fields["qkv_bias"], fields["tie_embeddings"], fields["vocab"]) == (True, False, 96)
    with pytest.raises(
        hf.HFError, match=r"holds a model of each kind \['llm', 'audio'\]; write kind: llm or kind: audio"
    ):
        kind_of(path)
    audio = audio_fields(path)
    assert {k: audio[k] for k in ("pool", "out_width", "mel", "max_tokens", "stem", "frames_per_token")} == {
        "pool": 2,
        "out_width": 32,
        "mel": 8,
        "max_tokens": 8,
        "stem": "conv",
        "frames_per_token": 2,
    }
    cfg = _from_folder(path, f"{{hf: {path}, kind: llm}}", "models.student.vocab=96")
    assert cfg.models["teacher"].qkv_bias and cfg.sections["teacher"].init.hf_path == str(path)
