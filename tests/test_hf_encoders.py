"""Hugging Face encoder towers (`models/hf_encoders.py`): SigLIP's and CLIP's vision towers and
Whisper's encoder against transformers' own float32 outputs, stored by scripts/make_hf_fixtures.py in
tests/fixtures/hf/{siglip,clip,whisper}/reference.npz (no torch needed); the export round trip through
`from_pretrained` runs only where torch and transformers are installed."""

import json
import pathlib
import re
import shutil

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ROOT, TINY_OMNI, TINY_VLM
from maestro_jax.models import AudioConfig, AudioEncoder, VisionEncoder, ViTConfig, hf_encoders
from maestro_jax.models.hf import HFError

from maestro_jax.config import ConfigError, load_config
from maestro_jax.core.plan import SectionPlan, mesh_shape
from maestro_jax.runtime.build import build_runtime
from maestro_jax.runtime.sharding import section_mesh, variable_shardings
from maestro_jax.runtime.step import TrainState
from maestro_jax.tools.check_hf import packed_images
from maestro_jax.workloads.costs import audio_cost
from maestro_jax.workloads.omni import frame_groups
from maestro_jax.workloads.vlm import class_segments

FIXTURES = ROOT / "tests" / "fixtures" / "hf"
ATOL = 1e-4


def fixture(tmp_path, name):
    """A copy of the fixture's HF folder (tests may damage it) and its reference arrays."""
    path = tmp_path / name
    shutil.copytree(FIXTURES / name, path)
    return path, dict(np.load(path / "reference.npz"))


def model_of(kind, fields, scan=False, **extra):
    own = {"out_width": 48} | {k: v for k, v in fields.items() if k != "kind"} | extra
    if kind == "vit":
        return VisionEncoder(ViTConfig(**own, scan_layers=scan))
    return AudioEncoder(AudioConfig(**own, scan_layers=scan))


def placed_params(model, inputs, devices=(0,), mesh=None):
    """The model's initialised params, each leaf in its sharding over `devices` (as a section holds them)."""
    variables = model.init(jax.random.key(0), *inputs)
    mesh = section_mesh(SectionPlan(tuple(devices), mesh if mesh is not None else mesh_shape(), 1))
    shardings = variable_shardings({"params": variables["params"]}, mesh, "default")["params"]
    return jax.device_put(nn.unbox(variables["params"]), shardings)


def siglip_inputs(pixels, cfg: ViTConfig):
    """Both images packed into one row (segments 1 and 2) in the VLM's merge-window patch order,
    and for each patch the index of the same patch in SigLIP's output (image, row-major cell):
    what `check-hf` feeds a tower."""
    return packed_images(pixels, cfg)


def whisper_inputs(features):
    """Both clips ([mel, frames] each, as Whisper takes them) packed into one row of two-frame tokens."""
    tokens, positions, segments = [], [], []
    for i, clip in enumerate(features):
        t, p = frame_groups(clip.T, 2)
        tokens.append(t)
        positions.append(p)
        segments.append(np.full(len(t), i + 1, np.int32))
    return tuple(jnp.asarray(np.concatenate(x))[None] for x in (tokens, segments, positions))


def siglip_features(path, ref, scan=False, devices=(0,), mesh=None):
    fields = hf_encoders.vit_fields(path)
    model = model_of("vit", fields, scan)
    inputs, where = siglip_inputs(ref["pixels"], model.cfg)
    params = hf_encoders.load_vit(path, placed_params(model, inputs, devices, mesh), fields)
    hidden, post = model.apply({"params": params}, *inputs, method=VisionEncoder.features)
    return np.asarray(hidden[0]), np.asarray(post[0]), where, params, fields


def whisper_features(path, ref, scan=False, devices=(0,), mesh=None):
    fields = hf_encoders.audio_fields(path)
    model = model_of("audio", fields, scan)
    inputs = whisper_inputs(ref["features"])
    params = hf_encoders.load_audio(path, placed_params(model, inputs, devices, mesh), fields)
    out = model.apply({"params": params}, *inputs, method=AudioEncoder.features)
    return np.asarray(out[0]).reshape(ref["last_hidden_state"].shape), params, fields


def max_err(a, b):
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))))


@pytest.mark.slow
@pytest.mark.parametrize("scan", [False, True])
def test_siglip_matches_transformers(tmp_path, scan):
    """Two 16x16 images packed in one row: the last block's output (`hidden_states[-1]`) and the
    post-layernorm features (`last_hidden_state`) are SigLIP's, patch for patch."""
    path, ref = fixture(tmp_path, "siglip")
    hidden, post, where, _, fields = siglip_features(path, ref, scan)
    assert fields["pos_embed"] == "table" and fields["max_grid"] == 4 and fields["act"] == "gelu_pytorch_tanh"
    assert max_err(hidden, ref["hidden"][where]) < ATOL
    assert max_err(post, ref["last_hidden_state"][where]) < ATOL


@pytest.mark.parametrize("scan", [False, True])
@pytest.mark.slow
def test_whisper_matches_transformers(tmp_path, scan):
    """Two full clips (16 frames of 8 mel bins) packed in one row: the conv stem stops at each
    clip's edge, and the encoder's `last_hidden_state` is Whisper's (read from a whole
    `WhisperModel` checkpoint, tensors under `encoder.`)."""
    path, ref = fixture(tmp_path, "whisper")
    out, _, fields = whisper_features(path, ref, scan)
    assert fields["stem"] == "conv" and fields["norm_eps"] == 1e-5 and fields["act"] == "gelu"
    assert max_err(out, ref["last_hidden_state"]) < ATOL


def test_qwen2_audio_encoder_and_projector_match_transformers(tmp_path):
    """A Qwen2-Audio folder's encoder (`kind: audio`): two full clips packed in one row leave as
    half their tokens each (pooled in pairs, `pool: 2`), equal to its `audio_tower`'s
    `last_hidden_state`, and through `out_proj` (its `multi_modal_projector`, loaded) to the
    audio features its language model's placeholders take."""
    path, ref = fixture(tmp_path, "qwen2_audio")
    fields = hf_encoders.audio_fields(path)
    model = model_of("audio", fields)
    inputs = whisper_inputs(ref["features"])
    params = hf_encoders.load_audio(path, placed_params(model, inputs), fields)
    hidden = model.apply({"params": params}, *inputs, method=AudioEncoder.features)
    assert hidden.shape == (1, 8, 32), "16 two-frame tokens pooled to 8"
    assert max_err(np.asarray(hidden[0]).reshape(2, 4, 32), ref["last_hidden_state"]) < ATOL
    projected = model.apply({"params": params}, *inputs)
    assert max_err(np.asarray(projected[0]).reshape(2, 4, 32), ref["audio_features"]) < ATOL


@pytest.mark.slow
def test_towers_load_sharded_slices(tmp_path):
    """Into a 2x2 (fsdp x tensor) sharding on devices 4-7 each device holds its slice of a weight,
    and the features are still the references'."""
    mesh = mesh_shape(fsdp=2, tensor=2)
    path, ref = fixture(tmp_path, "siglip")
    _, post, where, params, _ = siglip_features(path, ref, devices=(4, 5, 6, 7), mesh=mesh)
    assert max_err(post, ref["last_hidden_state"][where]) < ATOL
    fc1 = params["block_0"]["fc1"]["kernel"]  # [D, F] over (fsdp, tensor)
    assert {d.id for d in fc1.sharding.device_set} == {4, 5, 6, 7}
    assert all(s.data.shape == (16, 32) for s in fc1.addressable_shards)
    path, ref = fixture(tmp_path, "whisper")
    out, params, _ = whisper_features(path, ref, devices=(4, 5, 6, 7), mesh=mesh)
    assert max_err(out, ref["last_hidden_state"]) < ATOL
    assert all(s.data.shape == (16, 32) for s in params["block_1"]["fc1"]["kernel"].addressable_shards)


def test_projector_keeps_its_initial_values(tmp_path):
    """The merger (no SigLIP tensor holds it) is the section's own, untouched by the import."""
    path, ref = fixture(tmp_path, "siglip")
    fields = hf_encoders.vit_fields(path)
    model = model_of("vit", fields)
    inputs, _ = siglip_inputs(ref["pixels"], model.cfg)
    target = placed_params(model, inputs)
    loaded = hf_encoders.load_vit(path, target, fields)
    for name in ("merger_fc1", "merger_fc2"):
        assert all(np.array_equal(loaded[name][k], target[name][k]) for k in ("kernel", "bias"))
    assert not np.array_equal(loaded["pos"], target["pos"])


def _rewrite(path, change):
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(path / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def test_missing_or_misshapen_tensor_is_refused(tmp_path):
    path, ref = fixture(tmp_path, "siglip")
    name = "encoder.layers.1.mlp.fc1.weight"
    _rewrite(path, lambda t: t.update({name: t[name].T.copy()}))
    with pytest.raises(
        HFError, match=rf"tensor '{name}' has shape \(32, 64\); the model's block_1.fc1.kernel needs \(64, 32\)"
    ):
        siglip_features(path, ref)
    _rewrite(path, lambda t: t.pop(name))
    with pytest.raises(HFError, match=rf"tensor '{name}' is missing"):
        siglip_features(path, ref)
    path, ref = fixture(tmp_path, "whisper")
    name = "encoder.conv1.weight"
    _rewrite(path, lambda t: t.update({name: t[name][:, :4]}))  # 4 mel bins where config.json says 8
    with pytest.raises(HFError, match=rf"tensor '{name}' has shape \(32, 4, 3\); .* needs \(32, 8, 3\)"):
        whisper_features(path, ref)


def test_configs_that_are_not_towers_are_refused(tmp_path):
    with pytest.raises(
        HFError,
        match=r"model_type='llama'; a vision tower is one of \['siglip_vision_model', 'siglip', 'clip_vision_model'",
    ):
        hf_encoders.vit_fields(FIXTURES / "llama_tied")
    with pytest.raises(HFError, match=r"model_type='siglip_vision_model'; an audio encoder is 'whisper'"):
        hf_encoders.audio_fields(FIXTURES / "siglip")
    path, _ = fixture(tmp_path, "siglip")
    text = (path / "config.json").read_text().replace('"gelu_pytorch_tanh"', '"relu"')
    (path / "config.json").write_text(text)
    with pytest.raises(HFError, match=r"hidden_act='relu'; the encoder blocks support"):
        hf_encoders.vit_fields(path)


@pytest.mark.parametrize("scan", [False, True])
@pytest.mark.slow
def test_export_reimports_without_torch(tmp_path, scan):
    """save_vit / save_audio then load: the same tower (this half of the round trip needs no torch)."""
    path, ref = fixture(tmp_path, "siglip")
    _, post, _, params, fields = siglip_features(path, ref, scan)
    hf_encoders.save_vit(tmp_path / "siglip_out", params, fields, max_shard_bytes=20_000)
    assert (tmp_path / "siglip_out" / "model.safetensors.index.json").is_file()
    assert hf_encoders.vit_fields(tmp_path / "siglip_out") == fields
    assert max_err(siglip_features(tmp_path / "siglip_out", ref, scan)[1], post) == 0
    path, ref = fixture(tmp_path, "whisper")
    out, params, fields = whisper_features(path, ref, scan)
    hf_encoders.save_audio(tmp_path / "whisper_out", params, fields)
    assert hf_encoders.audio_fields(tmp_path / "whisper_out") == fields
    assert max_err(whisper_features(tmp_path / "whisper_out", ref, scan)[0], out) == 0


@pytest.mark.reference
@pytest.mark.slow  # the export's quick check: test_clip_export_round_trip_in_transformers
def test_export_round_trip_in_transformers(tmp_path):
    """Exported towers load in transformers (`SiglipVisionModel`, `WhisperEncoder`) with nothing
    missing or left over, and give the references' features again."""
    torch = pytest.importorskip("torch", reason="torch is a test dependency (the dev extra)")
    transformers = pytest.importorskip("transformers", reason="transformers is a test dependency (the dev extra)")
    path, ref = fixture(tmp_path, "siglip")
    *_, params, fields = siglip_features(path, ref, scan=True)
    hf_encoders.save_vit(tmp_path / "siglip_out", params, fields)
    back, info = transformers.SiglipVisionModel.from_pretrained(
        tmp_path / "siglip_out", torch_dtype=torch.float32, output_loading_info=True
    )
    assert not any(info.values()), info
    with torch.no_grad():
        out = back.eval()(torch.tensor(ref["pixels"]), output_hidden_states=True)
    assert max_err(out.last_hidden_state.numpy(), ref["last_hidden_state"]) < ATOL
    assert max_err(out.hidden_states[-1].numpy(), ref["hidden"]) < ATOL
    path, ref = fixture(tmp_path, "whisper")
    _, params, fields = whisper_features(path, ref)
    hf_encoders.save_audio(tmp_path / "whisper_out", params, fields)
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    back, info = WhisperEncoder.from_pretrained(
        tmp_path / "whisper_out", torch_dtype=torch.float32, output_loading_info=True
    )
    assert not any(info.values()), info
    with torch.no_grad():
        out = back.eval()(torch.tensor(ref["features"])).last_hidden_state.numpy()
    assert max_err(out, ref["last_hidden_state"]) < ATOL


@pytest.mark.slow
def test_conv_stem_declared_flops_match_xla():
    """The audio section's declared cost prices Whisper's stem (within 10% of XLA's count; with the
    tanh GELU, as XLA counts exact GELU's erf as dozens of flops an element, which no declaration prices)."""
    aud = AudioConfig(mel=80, frames_per_token=2, width=64, depth=2, heads=2, mlp=256, out_width=96, stem="conv")
    n = 64
    args = (jnp.zeros((1, n, 160)), jnp.ones((1, n), jnp.int32), jnp.zeros((1, n, 1), jnp.int32))
    params = AudioEncoder(aud).init(jax.random.key(0), *args)
    u = audio_cost(aud, n)
    got = jax.jit(lambda p: AudioEncoder(aud).apply(p, *args)).lower(params).compile().cost_analysis()["flops"]
    assert 1.0 <= got / ((u.flops + u.attention_flops * u.attention_span) * n) <= 1.1


def _tower_overrides(kind: str, name: str, path) -> list[str]:
    fields = {"vit": hf_encoders.vit_fields, "audio": hf_encoders.audio_fields}[kind](path)
    return [f"models.{name}.{k}={v}" for k, v in fields.items() if k != "kind"] + [
        f"sections.{name}.init.hf_path={path}"
    ]


@pytest.mark.slow
@pytest.mark.extended
def test_omni_towers_start_from_hf_folders(tmp_path):
    """The omni workload's vision and audio sections start from the SigLIP and Whisper folders
    (`sections.<s>.init.hf_path`): the sections' params give the references' features, and a
    training step runs."""
    siglip, sref = fixture(tmp_path, "siglip")
    whisper, wref = fixture(tmp_path, "whisper")
    overrides = [
        *TINY_OMNI,
        *_tower_overrides("vit", "vision", siglip),
        *_tower_overrides("audio", "audio", whisper),
        "data.modalities.image.sizes=[[16,16],[8,16]]",
        "data.modalities.audio.sizes=[[16],[8]]",
    ]
    cfg = load_config(ROOT / "configs/omni_tiny.yaml", overrides)
    rt = build_runtime(cfg)
    states = rt.step.init()
    vision = model_of("vit", hf_encoders.vit_fields(siglip))
    inputs, where = siglip_inputs(sref["pixels"], vision.cfg)
    host = {"params": jax.tree.map(np.asarray, states["vision"].params)}
    _, post = vision.apply(host, *inputs, method=VisionEncoder.features)
    assert max_err(post[0], sref["last_hidden_state"][where]) < ATOL
    audio = model_of("audio", hf_encoders.audio_fields(whisper))
    host = {"params": jax.tree.map(np.asarray, states["audio"].params)}
    out = audio.apply(host, *whisper_inputs(wref["features"]), method=AudioEncoder.features)
    assert max_err(np.asarray(out[0]).reshape(wref["last_hidden_state"].shape), wref["last_hidden_state"]) < ATOL
    _, metrics = rt.step(states, rt.batches()[0])  # a training step
    assert np.isfinite(rt.step.read(metrics)["train/loss"])


def test_vlm_tower_that_does_not_match_is_rejected_before_compiling(tmp_path):
    path, _ = fixture(tmp_path, "siglip")
    overrides = [*TINY_VLM, *_tower_overrides("vit", "vision", path), "data.modalities.image.sizes=[[16,16]]"]
    cfg = load_config(ROOT / "configs/vlm_tiny.yaml", [*overrides, "models.vision.pos_embed=row_col"])
    with pytest.raises(
        ConfigError, match=r"models.vision.pos_embed='row_col': the checkpoint .* has pos_embed='table'"
    ):
        build_runtime(cfg)
    cfg = load_config(ROOT / "configs/vlm_tiny.yaml", [*overrides, "models.vision.width=64"])
    with pytest.raises(ConfigError, match=r"models.vision.width=64: the checkpoint .* has width=32"):
        build_runtime(cfg)


def clip_features(path, ref, scan=False, **extra):
    """The CLIP tower's patch features (the selected hidden state, class token dropped) of both
    images packed in one row, the class-token slots padded as the VLM's host batch pads them."""
    fields = hf_encoders.vit_fields(path) | extra
    model = model_of("vit", fields, scan)
    (patches, segments, grid), where = siglip_inputs(ref["pixels"], model.cfg)
    inputs = (patches, segments, grid, jnp.asarray(class_segments(np.asarray(segments))))
    params = hf_encoders.load_vit(path, placed_params(model, inputs), fields)
    hidden, post = model.apply({"params": params}, *inputs, method=VisionEncoder.features)
    return np.asarray(hidden[0]), np.asarray(post[0]), where, params, fields


def test_default_vit_parameter_tree_is_unchanged():
    """The CLIP options leave the default tower's parameters as they were; CLIP's layout adds the
    class embedding and pre-norm, drops the patch bias, and holds only the blocks up to its layer."""
    cfg = ViTConfig(patch=4, channels=3, width=32, depth=3, heads=4, mlp=64, out_width=48)
    args = (jnp.zeros((1, 16, 48)), jnp.ones((1, 16), jnp.int32), jnp.zeros((1, 16, 2), jnp.int32))
    tree = jax.eval_shape(VisionEncoder(cfg).init, jax.random.key(0), *args)["params"]
    assert set(tree) == {"patch_embed", "pos_row", "pos_col", "block_0", "block_1", "block_2"} | {
        "merge_norm",
        "merger_fc1",
        "merger_fc2",
    }
    assert set(tree["patch_embed"]) == {"kernel", "bias"}
    clip = ViTConfig(**{**cfg.__dict__, "pos_embed": "table", "class_token": True, "feature_layer": -2})
    tree = jax.eval_shape(VisionEncoder(clip).init, jax.random.key(0), *args, jnp.ones((1, 8), jnp.int32))["params"]
    assert {"class_embed", "pre_norm", "block_1"} <= set(tree) and "block_2" not in tree
    assert set(tree["patch_embed"]) == {"kernel"} and nn.unbox(tree)["pos"].shape == (64 * 64 + 1, 32)


@pytest.mark.parametrize("scan,feature_layer", [(False, -1), (True, -2), (False, 2)])
def test_clip_matches_transformers(tmp_path, scan, feature_layer):
    """Two 16x16 images packed in one row with their class tokens: the patch features of the
    selected layer are CLIP's `hidden_states[feature_layer][:, 1:]` (what LLaVA hands its
    projector), patch for patch; only the blocks up to that layer are held."""
    path, ref = fixture(tmp_path, "clip")
    hidden, _, (image, cell), params, fields = clip_features(path, ref, scan, feature_layer=feature_layer)
    assert fields["class_token"] and fields["act"] == "quick_gelu" and fields["norm_eps"] == 1e-5
    assert max_err(hidden, ref["hidden_states"][feature_layer][image, 1 + cell]) < ATOL
    held = 3 if feature_layer == -1 else 2
    assert (params["blocks"]["layer"]["fc1"]["kernel"].shape[0] if scan else sum("block_" in k for k in params)) == held


def _llava_folder(tmp_path, strategy="default"):
    """The CLIP fixture as a LLaVA checkpoint's tower: a `llava` config.json, tensors under
    `model.vision_tower.vision_model.` (as transformers >= 4.52 saves them)."""
    import json

    path, ref = fixture(tmp_path, "clip")
    vision = json.loads((path / "config.json").read_text())
    llava = {
        "model_type": "llava",
        "vision_config": vision,
        "vision_feature_layer": -2,
        "vision_feature_select_strategy": strategy,
    }
    (path / "config.json").write_text(json.dumps(llava))
    _rewrite(path, lambda t: t.update({f"model.vision_tower.vision_model.{k}": t.pop(k) for k in list(t)}))
    return path, ref


def test_llava_tower_imports_its_feature_layer(tmp_path):
    path, ref = _llava_folder(tmp_path)
    hidden, _, (image, cell), _, fields = clip_features(path, ref)
    assert fields["feature_layer"] == -2
    assert max_err(hidden, ref["hidden_states"][-2][image, 1 + cell]) < ATOL
    path, _ = _llava_folder(tmp_path / "full", strategy="full")
    with pytest.raises(HFError, match=r"vision_feature_select_strategy='full'; .* without its class token"):
        hf_encoders.vit_fields(path)


# Where a Gemma 3 checkpoint's tower sits: as transformers 5.24 saves it (the fixture), as the Hub's
# checkpoints and transformers 4 hold it, and under transformers 5's module names
GEMMA3_LAYOUTS = {
    "saved": {},
    "hub": {"vision_tower.": "vision_tower.vision_model."},
    "modules": {
        "vision_tower.": "model.vision_tower.vision_model.",
        "multi_modal_projector.": "model.multi_modal_projector.",
        "language_model.model.": "model.language_model.",
    },
}


def _gemma3_layout(path, layout: str) -> None:
    renames = GEMMA3_LAYOUTS[layout]

    def rename(tensors):
        for k in list(tensors):
            old = next((o for o in renames if k.startswith(o)), None)
            if old is not None:
                tensors[renames[old] + k.removeprefix(old)] = tensors.pop(k)

    _rewrite(path, rename)


@pytest.mark.parametrize("layout", list(GEMMA3_LAYOUTS))
@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scan"])
def test_gemma3_folder_gives_its_tower_and_projector(tmp_path, layout, scan):
    """A Gemma 3 VLM folder (`gemma3`: the tower's config under `vision_config`, its tensors in any
    of the layouts transformers reads) imports its SigLIP tower and its average-pooling projector
    (`projector: avg_pool`, the pool's kernel as the merge window): each image's tokens equal
    transformers' `get_image_features` (the fixture's 4x4 patches pooled to 2x2 tokens)."""
    path, ref = fixture(tmp_path, "gemma3_vlm")
    _gemma3_layout(path, layout)
    fields = hf_encoders.vit_fields(path)
    assert (fields["projector"], fields["merge"], fields["out_width"], fields["pos_embed"]) == (
        "avg_pool",
        2,
        32,
        "table",
    )
    model = model_of("vit", fields, scan)
    inputs, _ = siglip_inputs(ref["pixels"], model.cfg)
    params = hf_encoders.load_vit(path, placed_params(model, inputs), fields)
    tokens = np.asarray(model.apply({"params": params}, *inputs)[0])  # image 1's tokens, then image 2's
    want = ref["image_features"].reshape(-1, 32)
    assert tokens.shape == want.shape and max_err(tokens, want) < ATOL * np.abs(want).max()
    # the projector's norm is Gemma's `1 + weight`: imported without it, the tokens move
    norm = params["proj_norm"]["scale"]
    wrong = {**params, "proj_norm": {"scale": norm - 1}}
    assert max_err(np.asarray(model.apply({"params": wrong}, *inputs)[0]), want) > 10 * ATOL


@pytest.mark.slow
def test_gemma3_vlm_logits_equal_transformers_with_each_image_attending_to_itself(tmp_path):
    """The whole Gemma 3 VLM: the tower and projector's image tokens spliced (unscaled) into the
    scaled text embeddings, and each image's tokens attending to all of their image
    (`bidirectional_images`, the blocks from `image_blocks`), give transformers' logits on a row
    holding both images; the fixture's windowed layer (window 3) cuts each 4-token image, so both
    the window and the image blocks are exercised. Causal alone, the logits differ."""
    from maestro_jax.models import DecoderLM, LLMConfig, hf
    from maestro_jax.models.llm import image_blocks

    path, ref = fixture(tmp_path, "gemma3_vlm")
    vfields, lfields = hf_encoders.vit_fields(path), hf.llm_fields(path)
    assert lfields["bidirectional_images"] and lfields["tie_embeddings"]
    tower = model_of("vit", vfields)
    inputs, _ = siglip_inputs(ref["pixels"], tower.cfg)
    vparams = hf_encoders.load_vit(path, placed_params(tower, inputs), vfields)
    features = tower.apply({"params": vparams}, *inputs)[0]
    decoder = DecoderLM(LLMConfig.from_fields(lfields))
    ids = jnp.asarray(ref["tokens"], jnp.int32)
    is_image = np.asarray(ref["tokens"]) == 7  # the fixture's image_token_index
    pos, valid = jnp.arange(ids.shape[1])[None], jnp.ones(ids.shape, bool)
    lparams = hf.load_llm(path, placed_params(decoder, (ids, pos, valid)), lfields)
    v = {"params": lparams}
    x = decoder.apply(v, ids, method=DecoderLM.embed)
    x = x.at[0, np.flatnonzero(is_image[0])].set(features)
    blocks = jnp.asarray(image_blocks(is_image))
    assert np.asarray(blocks).tolist() == [[0, 0, 0, 1, 1, 1, 1, 0, 0, 2, 2, 2, 2, 0, 0, 0]]

    def logits(images):
        h = decoder.apply(v, x, pos, valid, None, images, method=DecoderLM.hidden)
        return np.asarray(decoder.apply(v, h, method=DecoderLM.logits))

    want = ref["logits"]
    assert max_err(logits(blocks), want) < ATOL * np.abs(want).max()
    assert max_err(logits(None), want) > 10 * ATOL * np.abs(want).max()


@pytest.mark.slow
def test_a_gemma3_vlm_folder_gives_both_sections_and_verifies(tmp_path):
    """`models.vision: {hf: DIR, kind: vit}` and `models.llm: {hf: DIR, kind: llm}` on one Gemma 3 VLM
    folder: the tower with its projector and the language model with `bidirectional_images` (no
    other field by hand; without `kind` the entry is refused, naming both kinds), both
    sections start from the folder, the host batch carries each token's image block, and the
    sectioned step equals the monolithic one."""
    from maestro_jax.config import load_config
    from maestro_jax.tools.verify import verify

    path, _ = fixture(tmp_path, "gemma3_vlm")
    cfg = load_config(ROOT / "configs/vlm_tiny.yaml", _vlm_folder_overrides(path))
    assert cfg.models["vision"].projector == "avg_pool" and cfg.models["llm"].bidirectional_images
    with pytest.raises(
        ConfigError, match=r"model_type='gemma3' holds a model of each kind \['llm', 'vit'\]; write kind"
    ):
        load_config(ROOT / "configs/vlm_tiny.yaml", [f"models.vision={{hf: {path}}}"])
    assert cfg.sections["vision"].init.hf_path == cfg.sections["llm"].init.hf_path == str(path)
    rt = build_runtime(cfg)
    samples = [s for s in rt.batches()[0] if s.has("image")]
    host = next(s for s in rt.graph.sections if s.name == "llm").host_batch(samples, {})
    want = [np.where(row == 7, 1, 0) for row in host["input_ids"]]  # each sample's images: one run of placeholders
    assert samples and np.array_equal(host["images"], want)
    diffs = verify(cfg, rt)
    assert {d.name for d in diffs} >= {"loss", "vision/grads", "llm/grads"}
    assert all(d.max_rel <= 1e-4 for d in diffs), diffs


@pytest.mark.reference
@pytest.mark.slow
def test_check_hf_compares_a_gemma3_vlms_image_tokens_and_logits(capsys):
    """`check-hf` on a Gemma 3 VLM folder: its image tokens and the logits of a row holding both
    images, each a line, both within the tolerance."""
    pytest.importorskip("torch", reason="check-hf runs transformers (the reference extra)")
    from maestro_jax import cli

    assert cli.main(["check-hf", "--hf", str(FIXTURES / "gemma3_vlm")]) == 0
    lines = capsys.readouterr().out.strip().splitlines()[-2:]
    assert "(gemma3): 2 images of 16x16; image tokens" in lines[0] and lines[0].endswith("PASS"), lines
    assert "2 images of 16x16 in a row of 29 tokens; logits" in lines[1] and lines[1].endswith("PASS"), lines


def _saved_moved(cfg, sections: tuple[str, ...]) -> tuple[dict, dict]:
    """The config's initial states, and `sections`' params each weight moved by its own amount,
    saved as step 1 in `output_dir` (what an export reads): (initial states, moved params). One
    shift for every weight (+0.25) drives Qwen2-Audio's encoder activations to ~150 before its
    final norm, where the two sides' float32 rounding (3e-5 of that, measured) exceeds check-hf's
    1e-4 once the norm divides by a token's small spread."""
    import dataclasses

    from maestro_jax.training.checkpoint import Checkpointer

    initial = build_runtime(cfg).init_states()
    moved = {
        s: jax.tree.map(lambda x: x + 0.05 * jnp.cos(jnp.arange(x.size).reshape(x.shape)), initial[s].params)
        for s in sections
    }
    ckpt = Checkpointer(pathlib.Path(cfg.output_dir) / "checkpoints")
    ckpt.save(1, {**initial, **{s: dataclasses.replace(initial[s], params=p) for s, p in moved.items()}}, {}, {})
    ckpt.close()
    return initial, moved


def _qwen2_audio_overrides(path) -> list[str]:
    return [
        *TINY_OMNI,
        f"models.audio={{hf: {path}, kind: audio}}",
        f"models.llm={{hf: {path}, kind: llm}}",
        "models.vision.out_width=32",
        "data.modalities.audio.sizes=[[16],[8]]",
    ]


@pytest.mark.reference
@pytest.mark.slow
def test_qwen2_audio_exports_whole_and_reimports(tmp_path, capsys):
    """`maestro-jax export --section audio,llm` writes an omni model trained from a Qwen2-Audio
    folder back as one Qwen2-Audio folder (the checkpoint's weights, moved off the folder's): the
    same architecture and audio token read back, the tensors are the folder's by name, the weights
    import back equal, and (with transformers) check-hf passes on it. A section pair that is not
    one audio and one llm, or the pooled encoder alone as Whisper, is refused in one line."""
    import importlib.util

    from maestro_jax.models import hf
    from safetensors import safe_open

    from maestro_jax import cli

    path, _ = fixture(tmp_path, "qwen2_audio")
    overrides = [*_qwen2_audio_overrides(path), f"output_dir={tmp_path / 'run'}"]
    config = ROOT / "configs/omni_tiny.yaml"
    initial, moved = _saved_moved(load_config(config, overrides), ("audio", "llm"))

    def export(section, *extra):
        argv = ["export", "--config", str(config), "--section", section, "--out", str(tmp_path / "back")]
        return cli.main([*argv, *extra, *overrides])

    assert export("audio,llm") == 0 and "sections 'audio' and 'llm' at step 1 (qwen2_audio)" in capsys.readouterr().out
    back = tmp_path / "back"
    assert hf_encoders.audio_fields(back) == hf_encoders.audio_fields(path)
    assert hf.llm_fields(back) == hf.llm_fields(path)
    assert json.loads((back / "config.json").read_text())["audio_token_index"] == 95
    names = [set(safe_open(str(f), "np").keys()) for f in (path / "model.safetensors", back / "model.safetensors")]
    assert names[0] == names[1]
    audio = hf_encoders.load_audio(back, initial["audio"].params, hf_encoders.audio_fields(back))
    llm = hf.load_llm(back, initial["llm"].params, hf.llm_fields(back))
    for got, want, keyless in ((audio, moved["audio"], True), (llm, moved["llm"], False)):
        for (where, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want), strict=True):
            keys = tuple(k.key for k in where)
            if keyless and keys[-2:] == ("k", "bias"):  # Whisper's key has no bias: none written, zeros read
                assert not np.any(a), keys
            else:
                assert np.allclose(a, b, atol=1e-6), keys
    assert export("audio,vision", "--overwrite") == 2
    assert "a whole audio LLM folder is one audio and one llm section" in capsys.readouterr().err
    assert export("audio", "--overwrite") == 2, "a pooled encoder alone is no Whisper folder"
    assert "pool=2: Whisper's encoder does not pool its tokens" in capsys.readouterr().err
    if importlib.util.find_spec("torch") is not None:  # check-hf runs transformers (the reference extra)
        assert cli.main(["check-hf", "--hf", str(back)]) == 0
        assert capsys.readouterr().out.count("PASS") == 3


@pytest.mark.slow  # the pooled omni verify (tests/test_workloads.py) and the folder's features hold each half
def test_an_omni_config_from_a_qwen2_audio_folder_verifies(tmp_path):
    """`models.audio: {hf: DIR, kind: audio}` and `models.llm: {hf: DIR, kind: llm}` on one
    Qwen2-Audio folder (the vision section a tiny random ViT): the encoder pools in pairs and
    projects onto the language model's width, the folder's audio_token_index is the workload's
    audio placeholder, both sections start from the folder and the sectioned step equals the
    monolithic one."""
    from maestro_jax.config import load_config
    from maestro_jax.tools.verify import verify
    from maestro_jax.workloads import settings

    path, _ = fixture(tmp_path, "qwen2_audio")
    cfg = load_config(ROOT / "configs/omni_tiny.yaml", _qwen2_audio_overrides(path))
    assert (cfg.models["audio"].pool, cfg.models["audio"].out_width, settings(cfg).audio_token) == (2, 32, 95)
    assert cfg.sections["audio"].init.hf_path == cfg.sections["llm"].init.hf_path == str(path)
    diffs = verify(cfg)
    assert {d.name for d in diffs} >= {"loss", "audio/grads", "llm/grads"}
    assert all(d.max_rel <= 1e-4 for d in diffs), diffs


@pytest.mark.reference
def test_check_hf_compares_a_qwen2_audio_folders_text_audio_tokens_and_logits(monkeypatch, capsys):
    """`check-hf` on a Qwen2-Audio folder: its language model on text, its audio tokens (encoder,
    pooling, projector) and the logits of a row holding both clips' tokens, a line each, within
    the tolerance; a projector bias moved on maestro's side fails the audio tokens and the row."""
    pytest.importorskip("torch", reason="check-hf runs transformers (the reference extra)")
    from maestro_jax import cli

    path = str(FIXTURES / "qwen2_audio")
    assert cli.main(["check-hf", "--hf", path]) == 0
    lines = capsys.readouterr().out.strip().splitlines()[-3:]
    assert "(qwen2_audio): 3 rows of [24, 19, 13] tokens; logits" in lines[0], lines
    assert "2 clips of 16 frames; audio tokens" in lines[1], lines
    assert "2 clips of 16 frames in a row of 29 tokens; logits" in lines[2], lines
    assert all(line.endswith("PASS") for line in lines), lines
    load = hf_encoders.load_audio

    def moved(*args, **kwargs):
        params = load(*args, **kwargs)
        return {**params, "out_proj": {**params["out_proj"], "bias": params["out_proj"]["bias"].at[5].add(0.05)}}

    monkeypatch.setattr(hf_encoders, "load_audio", moved)
    assert cli.main(["check-hf", "--hf", path]) == 1
    lines = capsys.readouterr().out.strip().splitlines()[-3:]
    assert [line.endswith("PASS") for line in lines] == [True, False, False], lines


def test_a_paligemma2_folder_gives_its_tower_with_its_linear_projector():
    """`models.vision: {hf: <a PaliGemma 2 folder>, kind: vit}`: SigLIP with `projector: linear`
    (merge 1: a token a patch) onto the language model's width; two 16x16 images packed in one row
    give transformers' `get_image_features` (the projector's output) patch for patch."""
    path = FIXTURES / "paligemma2"
    ref = dict(np.load(path / "reference.npz"))
    fields = hf_encoders.vit_fields(path)
    assert (fields["projector"], fields["merge"], fields["out_width"], fields["pos_embed"]) == (
        "linear",
        1,
        32,
        "table",
    )
    model = model_of("vit", fields)
    inputs, where = siglip_inputs(ref["pixels"], model.cfg)
    params = hf_encoders.load_vit(path, placed_params(model, inputs), fields)
    tokens = np.asarray(model.apply({"params": params}, *inputs)[0])
    assert max_err(tokens, ref["image_features"][where]) < ATOL


def test_a_smolvlm_folder_gives_its_tower_with_its_pixel_shuffle_connector(tmp_path):
    """`models.vision: {hf: <a SmolVLM folder>, kind: vit}`: SigLIP's layout under
    `model.vision_model.`, its connector's pixel shuffle of `scale_factor` 2 as the merge window and
    `modality_projection.proj` as a bias-free linear projector onto the language model's width;
    two whole 16x16 tiles packed in one row give transformers' `get_image_features` token for token
    (a token per 2x2 window, the windows row by row). A scale_factor that does not divide the
    tower's grid is refused naming it."""
    path = FIXTURES / "smolvlm"
    ref = dict(np.load(path / "reference.npz"))
    fields = hf_encoders.vit_fields(path)
    got = tuple(fields[k] for k in ("projector", "projector_bias", "merge", "out_width", "pos_embed", "max_grid"))
    assert got == ("linear", False, 2, 32, "table", 4)
    model = model_of("vit", fields)
    inputs, _ = siglip_inputs(ref["pixels"], model.cfg)
    params = hf_encoders.load_vit(path, placed_params(model, inputs), fields)
    assert "bias" not in params["proj"]
    tokens = np.asarray(model.apply({"params": params}, *inputs)[0])
    assert tokens.shape == (8, 32)
    assert max_err(tokens, ref["image_features"].reshape(8, 32)) < ATOL
    bad = fixture(tmp_path, "smolvlm")[0]
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "scale_factor": 3}))
    with pytest.raises(HFError, match=r"config.json: scale_factor=3; .* valid: a positive integer dividing 4"):
        hf_encoders.vit_fields(bad)


@pytest.mark.parametrize("case", ["paligemma1", "paligemma2"])
def test_a_paligemma_row_attends_bidirectionally_over_its_prefix_as_transformers_does(case):
    """`kind: llm` of a PaliGemma 2 folder has `prefix_lm`: the rows mark each sample's prefix
    (its image's 16 tokens and the prompt: the positions up to the first whose target carries
    loss) as one block (`workloads.vlm.with_prefix_blocks`), and the decoder's logits on a row
    holding the tower's image tokens equal transformers' with `token_type_ids` 0 over that prefix
    and 1 over the answer (its prefix-LM mask); one block short, they do not."""
    from maestro_jax.models import DecoderLM, LLMConfig, hf

    from maestro_jax.workloads.vlm import with_prefix_blocks

    path = FIXTURES / case
    ref = dict(np.load(path / "reference.npz"))
    vfields, lfields = hf_encoders.vit_fields(path), hf.llm_fields(path)
    assert lfields["prefix_lm"] and not lfields.get("bidirectional_images")
    tower = model_of("vit", vfields)
    inputs, where = siglip_inputs(ref["pixels"][:1], tower.cfg)
    image = np.asarray(
        tower.apply({"params": hf_encoders.load_vit(path, placed_params(tower, inputs), vfields)}, *inputs)[0]
    )
    row = ref["prefix_tokens"]
    prefix = int((ref["token_type_ids"] == 0).sum())
    loss = (np.arange(row.shape[1]) >= prefix - 1)[None].astype(
        np.float32
    )  # the answer's targets, from position prefix - 1
    blocks = with_prefix_blocks({"loss_mask": loss, "valid": np.ones(row.shape, bool)})["images"]
    np.testing.assert_array_equal(blocks[0], [1] * prefix + [0] * (row.shape[1] - prefix))
    decoder = DecoderLM(LLMConfig.from_fields(lfields))
    ids, pos, valid = jnp.asarray(row, jnp.int32), jnp.arange(row.shape[1])[None], jnp.ones(row.shape, bool)
    v = {"params": hf.load_llm(path, placed_params(decoder, (ids, pos, valid)), lfields)}
    x = (
        decoder.apply(v, ids, method=DecoderLM.embed)
        .at[0, np.flatnonzero(row[0] == 95)]
        .set(image[np.argsort(where[1])])
    )

    def logits(images):
        h = decoder.apply(v, x, pos, valid, None, jnp.asarray(images), method=DecoderLM.hidden)
        return np.asarray(decoder.apply(v, h, method=DecoderLM.logits))

    assert max_err(logits(blocks), ref["prefix_logits"]) < ATOL
    short = np.where(np.arange(row.shape[1]) < prefix - 1, blocks, 0)
    assert max_err(logits(short), ref["prefix_logits"]) > 1e-3


@pytest.mark.reference
def test_check_hf_compares_a_smolvlm_folders_image_tokens_and_logits(monkeypatch, capsys):
    """`check-hf` on a SmolVLM folder: two whole tiles' image tokens, and the logits of a row of
    text holding both, a line each, within the tolerance; a connector weight moved on maestro's
    side fails both."""
    pytest.importorskip("torch", reason="check-hf runs transformers (the reference extra)")
    from maestro_jax import cli

    path = str(FIXTURES / "smolvlm")
    assert cli.main(["check-hf", "--hf", path]) == 0
    lines = capsys.readouterr().out.strip().splitlines()[-2:]
    assert "(smolvlm): 2 tiles of 16x16; image tokens" in lines[0], lines
    assert "2 tiles of 16x16 in a row of" in lines[1] and "logits" in lines[1], lines
    assert all(line.endswith("PASS") for line in lines), lines
    load = hf_encoders.load_vit

    def moved(*args, **kwargs):
        params = load(*args, **kwargs)
        return {**params, "proj": {"kernel": params["proj"]["kernel"].at[3, 1].add(0.05)}}

    monkeypatch.setattr(hf_encoders, "load_vit", moved)
    assert cli.main(["check-hf", "--hf", path]) == 1
    lines = capsys.readouterr().out.strip().splitlines()[-2:]
    assert [line.endswith("PASS") for line in lines] == [False, False], lines


@pytest.mark.reference
@pytest.mark.parametrize("case", ["paligemma1", "paligemma2"])
def test_check_hf_compares_a_paligemma_folders_image_tokens_and_prefix_lm_logits(monkeypatch, capsys, case):
    """`check-hf` on a PaliGemma 2 folder: its image tokens, and the logits of a row holding the
    first image, a prompt and an answer with transformers' prefix-LM mask, a line each, within the
    tolerance; a projector bias moved on maestro's side fails both."""
    pytest.importorskip("torch", reason="check-hf runs transformers (the reference extra)")
    from maestro_jax import cli

    path = str(FIXTURES / case)
    assert cli.main(["check-hf", "--hf", path]) == 0
    lines = capsys.readouterr().out.strip().splitlines()[-2:]
    assert "(paligemma): 2 images of 16x16; image tokens" in lines[0], lines
    assert "the first in a row of" in lines[1] and "its prefix 21; logits" in lines[1], lines
    assert all(line.endswith("PASS") for line in lines), lines
    load = hf_encoders.load_vit

    def moved(*args, **kwargs):
        params = load(*args, **kwargs)
        return {**params, "proj": {**params["proj"], "bias": params["proj"]["bias"].at[3].add(0.05)}}

    monkeypatch.setattr(hf_encoders, "load_vit", moved)
    assert cli.main(["check-hf", "--hf", path]) == 1
    lines = capsys.readouterr().out.strip().splitlines()[-2:]
    assert [line.endswith("PASS") for line in lines] == [False, False], lines


@pytest.mark.reference
@pytest.mark.slow
@pytest.mark.parametrize("case", ["paligemma1", "paligemma2"])
def test_paligemma_exports_whole_and_reimports(tmp_path, capsys, case):
    """`maestro-jax export --section vision,llm` writes a VLM trained from a PaliGemma 2 folder back
    as one PaliGemma 2 folder (the checkpoint's weights, moved off the folder's): the same
    architecture, image token and tensor names read back, the weights import back equal, and
    (with transformers) check-hf passes on it."""
    import importlib.util

    from maestro_jax.models import hf
    from safetensors import safe_open

    from maestro_jax import cli

    path, _ = fixture(tmp_path, case)
    overrides = [*_vlm_folder_overrides(path), f"output_dir={tmp_path / 'run'}"]
    config = ROOT / "configs/vlm_tiny.yaml"
    initial, moved = _saved_moved(load_config(config, overrides), ("vision", "llm"))
    argv = ["export", "--config", str(config), "--section", "vision,llm", "--out", str(tmp_path / "back")]
    assert cli.main([*argv, *overrides]) == 0 and "(paligemma)" in capsys.readouterr().out
    back = tmp_path / "back"
    assert hf_encoders.vit_fields(back) == hf_encoders.vit_fields(path)
    assert hf.llm_fields(back) == hf.llm_fields(path)
    assert json.loads((back / "config.json").read_text())["image_token_index"] == 95
    names = [set(safe_open(str(f), "np").keys()) for f in (path / "model.safetensors", back / "model.safetensors")]
    assert {n.replace("vision_tower.", "vision_tower.vision_model.", 1) for n in names[0]} == names[1]
    vision = hf_encoders.load_vit(back, initial["vision"].params, hf_encoders.vit_fields(back))
    llm = hf.load_llm(back, initial["llm"].params, hf.llm_fields(back))
    for got, want in ((vision, moved["vision"]), (llm, moved["llm"])):
        assert jax.tree.all(jax.tree.map(lambda a, b: bool(np.allclose(a, b, atol=1e-6)), got, want))
    if importlib.util.find_spec("torch") is not None:  # check-hf runs transformers (the reference extra)
        assert cli.main(["check-hf", "--hf", str(back)]) == 0
        assert capsys.readouterr().out.count("PASS") == 2


@pytest.mark.reference
@pytest.mark.slow
def test_smolvlm_exports_whole_verifies_and_reimports(tmp_path, capsys):
    """A vlm config from one SmolVLM folder verifies (the sectioned step is the monolithic one, the
    folder's image_token_id the workload's image token); `maestro-jax export --section vision,llm`
    writes it back as one SmolVLM folder (the checkpoint's weights, moved off the folder's): the
    same architecture and tensor names read back, the weights import back equal, and (with
    transformers) check-hf passes on it."""
    import importlib.util

    from maestro_jax.models import hf
    from safetensors import safe_open

    from maestro_jax import cli
    from maestro_jax.tools.verify import verify
    from maestro_jax.workloads import settings

    path, _ = fixture(tmp_path, "smolvlm")
    overrides = [*_vlm_folder_overrides(path), f"output_dir={tmp_path / 'run'}"]
    config = ROOT / "configs/vlm_tiny.yaml"
    cfg = load_config(config, overrides)
    assert settings(cfg).image_token == 95 and not cfg.models["vision"].projector_bias
    diffs = verify(cfg, build_runtime(cfg))
    assert {d.name for d in diffs} >= {"loss", "vision/grads", "llm/grads"}
    assert all(d.max_rel <= 1e-4 for d in diffs), diffs
    initial, moved = _saved_moved(cfg, ("vision", "llm"))
    argv = ["export", "--config", str(config), "--section", "vision,llm", "--out", str(tmp_path / "back")]
    assert cli.main([*argv, *overrides]) == 0 and "(smolvlm)" in capsys.readouterr().out
    back = tmp_path / "back"
    assert hf_encoders.vit_fields(back) == hf_encoders.vit_fields(path)
    assert hf.llm_fields(back) == hf.llm_fields(path)
    assert json.loads((back / "config.json").read_text())["image_token_id"] == 95
    names = [set(safe_open(str(f), "np").keys()) for f in (path / "model.safetensors", back / "model.safetensors")]
    assert names[0] == names[1]
    vision = hf_encoders.load_vit(back, initial["vision"].params, hf_encoders.vit_fields(back))
    llm = hf.load_llm(back, initial["llm"].params, hf.llm_fields(back))
    for got, want in ((vision, moved["vision"]), (llm, moved["llm"])):
        assert jax.tree.all(jax.tree.map(lambda a, b: bool(np.allclose(a, b, atol=1e-6)), got, want))
    if importlib.util.find_spec("torch") is not None:  # check-hf runs transformers (the reference extra)
        assert cli.main(["check-hf", "--hf", str(back)]) == 0
        assert capsys.readouterr().out.count("PASS") == 2


@pytest.mark.slow  # the prefix-LM logits against transformers (above) hold the mask; this the whole step
def test_a_paligemma2_vlm_verifies_with_its_prefix_blocks(tmp_path):
    """`models.vision` and `models.llm` from one PaliGemma 2 folder: the llm's rows carry each
    sample's prefix block (image and prompt), sectioned and monolithic alike, and the sectioned
    step equals the monolithic one (the folder's image_token_index the workload's image token)."""
    from maestro_jax.config import load_config
    from maestro_jax.tools.verify import verify
    from maestro_jax.workloads import settings

    path, _ = fixture(tmp_path, "paligemma2")
    cfg = load_config(ROOT / "configs/vlm_tiny.yaml", _vlm_folder_overrides(path))
    assert cfg.models["llm"].prefix_lm and settings(cfg).image_token == 95
    rt = build_runtime(cfg)
    host = next(s for s in rt.graph.sections if s.name == "llm").host_batch(rt.batches()[0], {})
    assert (host["images"][host["valid"][:, 0], 0] == 1).all(), "every sample starts with its prefix block"
    diffs = verify(cfg, rt)
    assert {d.name for d in diffs} >= {"loss", "vision/grads", "llm/grads"}
    assert all(d.max_rel <= 1e-4 for d in diffs), diffs


def test_a_whole_vlm_folder_refuses_a_tower_it_cannot_hold(tmp_path):
    """A SmolVLM or Gemma 3 VLM folder holds its own projector: a PaliGemma tower (a linear projector
    with a bias, merge 1) is refused naming the fields, before any weight is read or written."""
    from maestro_jax.models import hf

    tower, llm = hf_encoders.vit_fields(FIXTURES / "paligemma2"), hf.llm_fields(FIXTURES / "smolvlm")
    said = "projector='linear', projector_bias=True, class_token=False, max_grid=4, merge=1: "
    with pytest.raises(
        HFError, match=re.escape(said + "a SmolVLM tower is SigLIP's with projector='linear', projector_bias=False")
    ):
        hf_encoders.save_smolvlm(tmp_path / "s", {}, tower, {}, llm, 95)
    with pytest.raises(
        HFError, match=re.escape("merge=1: a Gemma 3 VLM's tower is SigLIP's with projector='avg_pool'")
    ):
        hf_encoders.save_gemma3_vlm(tmp_path / "g", {}, tower, {}, llm, 95)
    assert not (tmp_path / "s").exists() and not (tmp_path / "g").exists()


def test_a_gemma3_vlm_folder_gives_the_image_token_and_a_written_one_must_agree():
    """The folder's `image_token_index` is the workload's `image_token` (as its architecture fields
    are the models'); a value written beside it that differs is refused naming both, before
    anything is built."""
    from maestro_jax.config import load_config
    from maestro_jax.workloads import check_config, modalities_of, settings

    overrides = _vlm_folder_overrides(FIXTURES / "gemma3_vlm")
    cfg = load_config(ROOT / "configs/vlm_tiny.yaml", overrides)
    assert settings(cfg).image_token == 7 and modalities_of(cfg)[0].placeholder == 7
    assert settings(load_config(ROOT / "configs/vlm_tiny.yaml", [*overrides, "workload_settings.image_token=7"]))
    wrong = load_config(ROOT / "configs/vlm_tiny.yaml", [*overrides, "workload_settings.image_token=1"])
    with pytest.raises(ConfigError) as err:
        check_config(wrong)
    assert str(err.value) == (
        f"error: workload_settings.image_token=1: the checkpoint {FIXTURES / 'gemma3_vlm'} has "
        "image_token_index=7; leave image_token out (the checkpoint fills it in) or write the checkpoint's value"
    )


def _vlm_folder_overrides(path) -> list[str]:
    """vlm_tiny with both sections from one whole VLM folder (Gemma 3's, PaliGemma 2's, SmolVLM's)."""
    return [
        "global_batch=8",
        "data.text_len=[6,14]",
        f"models.vision={{hf: {path}, kind: vit}}",
        f"models.llm={{hf: {path}, kind: llm}}",
        "data.modalities.image.sizes=[[16,16],[8,16]]",
        "data.modalities.video.sizes=[[2,16,16]]",  # vlm_tiny's clips, each frame an image of the tower's size
        "sections.llm.mesh={data: 3, tensor: 2}",
    ]


@pytest.mark.reference
@pytest.mark.slow
def test_gemma3_vlm_exports_whole_and_reimports(tmp_path, capsys):
    """`maestro-jax export --section vision,llm` writes a VLM trained from a Gemma 3 folder back as
    one Gemma 3 VLM folder (the checkpoint's weights, moved off the folder's): the same
    architecture reads back, the weights import back equal, and (with transformers) check-hf
    passes on it. Anything but a vit and an llm section, or another type, is refused in one line."""
    import dataclasses
    import importlib.util

    from maestro_jax.models import hf

    from maestro_jax import cli
    from maestro_jax.training.checkpoint import Checkpointer

    path, _ = fixture(tmp_path, "gemma3_vlm")
    out = tmp_path / "run"
    overrides = [*_vlm_folder_overrides(path), f"output_dir={out}"]
    config = ROOT / "configs/vlm_tiny.yaml"
    cfg = load_config(config, overrides)
    initial = build_runtime(cfg).init_states()
    moved = {s: jax.tree.map(lambda x: x * 1.5 + 0.25, initial[s].params) for s in ("vision", "llm")}
    ckpt = Checkpointer(out / "checkpoints")
    ckpt.save(1, {**initial, **{s: dataclasses.replace(initial[s], params=p) for s, p in moved.items()}}, {}, {})
    ckpt.close()

    def export(section, *extra):
        argv = ["export", "--config", str(config), "--section", section, "--out", str(tmp_path / "vlm")]
        return cli.main([*argv, *extra, *overrides])

    assert export("vision,llm") == 0 and "sections 'vision' and 'llm' at step 1 (gemma3)" in capsys.readouterr().out
    back = tmp_path / "vlm"
    assert hf_encoders.vit_fields(back) == hf_encoders.vit_fields(path)
    assert hf.llm_fields(back) == hf.llm_fields(path)
    vision = hf_encoders.load_vit(back, initial["vision"].params, hf_encoders.vit_fields(back))
    llm = hf.load_llm(back, initial["llm"].params, hf.llm_fields(back))
    for got, want in ((vision, moved["vision"]), (llm, moved["llm"])):
        assert jax.tree.all(jax.tree.map(lambda a, b: bool(np.allclose(a, b, atol=1e-6)), got, want))
    assert export("llm,vision", "--model-type", "llama", "--overwrite") == 2
    assert "a whole VLM folder is one vit and one llm section" in capsys.readouterr().err
    if importlib.util.find_spec("torch") is not None:  # check-hf runs transformers (the reference extra)
        assert cli.main(["check-hf", "--hf", str(back)]) == 0
        assert capsys.readouterr().out.count("PASS") == 2


def test_gemma3_projector_kernel_must_divide_the_grid(tmp_path):
    import json

    path, _ = fixture(tmp_path, "gemma3_vlm")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "mm_tokens_per_image": 9}))
    with pytest.raises(HFError, match=r"mm_tokens_per_image=9; a Gemma 3 projector pools the tower's 4x4 patches"):
        hf_encoders.vit_fields(path)


@pytest.mark.reference
def test_check_hf_compares_a_llava_folders_tower(tmp_path, capsys):
    """`check-hf` on a LLaVA folder checks its CLIP tower at the folder's feature layer."""
    pytest.importorskip("torch", reason="check-hf runs transformers (the reference extra)")
    from maestro_jax import cli

    path, _ = _llava_folder(tmp_path)
    assert cli.main(["check-hf", "--hf", str(path)]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert "(llava): 2 images of 16x16; features" in line and line.endswith("PASS"), line


def test_clip_export_reimports_without_torch(tmp_path):
    """A tower cut at layer -2 exports its 2 held blocks as a 2-layer CLIP, whose last hidden
    state is the cut tower's features, exactly."""
    path, ref = fixture(tmp_path, "clip")
    hidden, post, _, params, fields = clip_features(path, ref, feature_layer=-2)
    hf_encoders.save_vit(tmp_path / "clip_out", params, fields)
    back = hf_encoders.vit_fields(tmp_path / "clip_out")
    assert back == {k: v for k, v in fields.items() if k != "feature_layer"} | {"depth": 2}
    again = clip_features(tmp_path / "clip_out", ref)
    assert max_err(again[0], hidden) == 0 and max_err(again[1], post) == 0


@pytest.mark.reference
def test_clip_export_round_trip_in_transformers(tmp_path):
    """An exported CLIP tower loads in `CLIPVisionModel` with nothing missing or left over: every
    hidden state and the pooled output (the class token through `post_layernorm`) are the
    reference's; a tower cut at -2 loads as the 2-layer tower giving hidden state -2."""
    torch = pytest.importorskip("torch", reason="torch is a test dependency (the reference extra)")
    transformers = pytest.importorskip("transformers", reason="transformers is a test dependency (the reference extra)")
    path, ref = fixture(tmp_path, "clip")
    for feature_layer, states in ((-1, ref["hidden_states"]), (-2, ref["hidden_states"][:-1])):
        *_, params, fields = clip_features(path, ref, scan=True, feature_layer=feature_layer)
        out = tmp_path / f"clip_out{feature_layer}"
        hf_encoders.save_vit(out, params, fields)
        back, info = transformers.CLIPVisionModel.from_pretrained(
            out, torch_dtype=torch.float32, output_loading_info=True
        )
        assert not any(info.values()), info
        with torch.no_grad():
            o = back.eval()(torch.tensor(ref["pixels"]), output_hidden_states=True)
        assert max_err(torch.stack(o.hidden_states).numpy(), states) < ATOL
        if feature_layer == -1:
            assert max_err(o.pooler_output.numpy(), ref["pooled"]) < ATOL


def _mapped_leaves(params, mapping):
    """Every leaf a tower's Hugging Face mapping covers, by HF tensor name (scanned layers unstacked)."""
    return hf_encoders._tensors(params, mapping)


@pytest.mark.slow
@pytest.mark.extended
def test_cli_exports_towers_from_the_latest_checkpoint(tmp_path, capsys):
    """Omni with a CLIP vision tower cut at -2 and a Whisper encoder, both from Hugging Face folders
    (a training step runs), checkpointed at step 1 with moved weights: `maestro-jax export --section vision|audio` writes
    the checkpointed towers (CLIP's and Whisper's layouts), which import back equal to them. A
    section or type no exporter writes is refused with one `error:` line."""
    import dataclasses

    from maestro_jax import cli
    from maestro_jax.training.checkpoint import Checkpointer

    clip, _ = fixture(tmp_path, "clip")
    whisper, _ = fixture(tmp_path, "whisper")
    out = tmp_path / "run"
    overrides = [
        *TINY_OMNI,
        *_tower_overrides("vit", "vision", clip),
        *_tower_overrides("audio", "audio", whisper),
        "models.vision.feature_layer=-2",
        "data.modalities.image.sizes=[[16,16],[8,16]]",
        "data.modalities.audio.sizes=[[16],[8]]",
        f"output_dir={out}",
    ]
    config = ROOT / "configs/omni_tiny.yaml"
    cfg = load_config(config, overrides)
    rt = build_runtime(cfg)
    initial = rt.init_states()
    batch = rt.batches()[0]  # a training step's gradients: every image's class token reaches the loss
    loss, grads, _ = rt.step.gradients(TrainState(0, initial), batch)
    assert np.isfinite(float(loss)) and np.any(np.asarray(grads["vision"]["class_embed"]) != 0)
    moved = {s: jax.tree.map(lambda x: x * 1.5 + 0.25, initial[s].params) for s in ("vision", "audio")}
    trained = {**initial, **{s: dataclasses.replace(initial[s], params=p) for s, p in moved.items()}}
    ckpt = Checkpointer(out / "checkpoints")
    ckpt.save(1, trained, {}, {"seed": cfg.seed, "workload": cfg.workload})
    ckpt.close()

    def export(section, *extra):
        argv = ["export", "--config", str(config), "--section", section, "--out", str(tmp_path / section)]
        return cli.main([*argv, *extra, *overrides])

    assert export("vision") == 0 and "'vision' at step 1 (clip)" in capsys.readouterr().out
    assert export("audio") == 0 and "'audio' at step 1 (whisper)" in capsys.readouterr().out
    for section, fields_of, load, mapping in (
        ("vision", hf_encoders.vit_fields, hf_encoders.load_vit, hf_encoders.vit_mapping),
        ("audio", hf_encoders.audio_fields, hf_encoders.load_audio, hf_encoders.audio_mapping),
    ):
        fields = fields_of(tmp_path / section)
        if section == "vision":
            assert fields["class_token"] and fields["depth"] == 2  # the 2 blocks the cut tower holds
        back = load(tmp_path / section, initial[section].params, fields)
        want, got = (_mapped_leaves(p, mapping(fields)) for p in (trained[section].params, back))
        assert want.keys() == got.keys() and all(np.array_equal(want[k], got[k]) for k in want)
        start = _mapped_leaves(initial[section].params, mapping(fields))
        assert not any(np.array_equal(want[k], start[k]) for k in want)  # the checkpoint's, not the initial

    for section, extra, line in (
        ("llm", ["--model-type", "clip"], r"--model-type=clip: section 'llm' \(llm\) .*; valid: \['llama'"),
        ("vision", ["--model-type", "siglip"], r"--model-type=siglip: section 'vision' .*; valid: \['clip'\]$"),
        ("nowhere", [], r"--section='nowhere': not a section with a model here; valid: \['audio', 'llm', 'vision'\]"),
    ):
        assert export(section, *extra) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and re.search(line, err[0]), err


def test_cli_refuses_a_tower_without_a_hugging_face_layout(tmp_path, capsys):
    from maestro_jax import cli

    argv = ["export", "--config", str(ROOT / "configs/omni_tiny.yaml"), "--out", str(tmp_path / "x"), *TINY_OMNI]
    assert cli.main([*argv, "--section", "vision"]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: models.vision.pos_embed='row_col': no Hugging Face vision tower has this layout; a tower with "
        "pos_embed='table' exports as SigLIP (or CLIP with class_token)"
    )
    assert cli.main([*argv, "--section", "audio"]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: models.audio.stem='dense': no Hugging Face audio encoder has this stem; an encoder with "
        "stem='conv' exports as Whisper"
    )
    assert not (tmp_path / "x").exists()


def test_clip_options_are_checked_in_the_config():
    vlm = ROOT / "configs/vlm_tiny.yaml"
    with pytest.raises(ConfigError, match=r"^error: models.vision.feature_layer=5: a tower of depth 1 has block"):
        load_config(vlm, [*TINY_VLM, "models.vision.feature_layer=5"])
    with pytest.raises(ConfigError, match=r"^error: models.vision.class_token=True: CLIP's layout needs pos_embed"):
        load_config(vlm, [*TINY_VLM, "models.vision.class_token=true"])


@pytest.mark.parametrize(
    "case,name,read", [("siglip", "vision", hf_encoders.vit_fields), ("whisper", "audio", hf_encoders.audio_fields)]
)
def test_a_tower_takes_its_architecture_from_the_folder(case, name, read):
    """`models.<s>: {hf: DIR, out_width: W}`: the kind (vit, audio) and every field the folder
    gives, filled in; the section starts from the folder."""
    path = FIXTURES / case
    cfg = load_config(ROOT / "configs/omni_tiny.yaml", [f"models.{name}={{hf: {path}, out_width: 48}}"])
    model = cfg.models[name].model_dump()
    assert {k: model[k] for k in read(path)} == read(path) and model["out_width"] == 48
    assert cfg.sections[name].init.hf_path == str(path)
