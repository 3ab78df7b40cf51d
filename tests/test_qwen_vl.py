"""Qwen2.5-VL and Qwen3-VL: their vision towers, their language models with M-RoPE (Qwen3-VL's
interleaved, with DeepStack) and whole folders, against transformers' own numbers stored in
`tests/fixtures/hf/qwen2_5_vl` and `tests/fixtures/hf/qwen3_vl` (`scripts/make_hf_fixtures.py`)."""

import dataclasses
import shutil

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ROOT
from maestro_jax.models import VisionEncoder, ViTConfig, hf_encoders

from maestro_jax.workloads.vlm import patchify

FIXTURES = ROOT / "tests" / "fixtures" / "hf"
RTOL = 1e-4  # of the reference's largest magnitude, float32


def fixture(tmp_path, name: str = "qwen2_5_vl"):
    path = tmp_path / name
    shutil.copytree(FIXTURES / name, path)
    return path, dict(np.load(path / "reference.npz"))


def packed(images, cfg: ViTConfig):
    """Both images' patches in one row (segments 1 and 2), each in the merge-window order."""
    cuts = [patchify(im, cfg.patch, cfg.merge, cfg.frames) for im in images]
    patches = np.concatenate([p for p, _ in cuts])[None]
    segments = np.concatenate([np.full(len(p), i + 1, np.int32) for i, (p, _) in enumerate(cuts)])[None]
    grid = np.concatenate([g for _, g in cuts])[None].astype(np.int32)
    return jnp.asarray(patches), jnp.asarray(segments), jnp.asarray(grid)


def tower(path, ref, scan=False, moved=None, **change):
    """The folder's tower loaded into the native ViT, its image tokens for both fixture images
    (`moved`: a change to the loaded params first)."""
    fields = {k: v for k, v in hf_encoders.vit_fields(path).items() if k != "kind"}
    cfg = dataclasses.replace(ViTConfig(**fields, scan_layers=scan), **change)
    model = VisionEncoder(cfg)
    inputs = packed([ref["image0"], ref["image1"]], cfg)
    target = nn.unbox(model.init(jax.random.key(0), *inputs)["params"])
    params = hf_encoders.load_vit(path, target, fields)
    params = params if moved is None else moved(params)
    return np.asarray(model.apply({"params": params}, *inputs)[0]), params, cfg


def rel_err(a, b):
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))) / np.abs(np.asarray(b)).max())


# slow: the quick tier's test_the_whole_model_on_text_an_image_and_a_clip_equals_transformers checks the tower and LLM end to end
@pytest.mark.slow
@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scan"])
def test_tower_equals_transformers_on_two_images_of_different_sizes(tmp_path, scan):
    """The Qwen2.5-VL tower (2-D rotary, RMSNorm and gated-MLP blocks, window attention in blocks 0
    and 2 and whole-image attention in block 1, the `ln_q` merger) loaded from the folder gives
    transformers' `visual(pixel_values, grid_thw)` for an 8x12-patch and a 6x4-patch image packed
    in one row; without the windows (every block over whole images) the tokens differ."""
    path, ref = fixture(tmp_path)
    fields = hf_encoders.vit_fields(path)
    assert (fields["block"], fields["pos_embed"], fields["projector"]) == ("rmsnorm_glu", "rope2d", "patch_merger")
    assert (fields["window"], fields["full_layers"], fields["out_width"]) == (4, (1,), 32)
    tokens, _, _ = tower(path, ref, scan)
    want = ref["image_features"]
    assert tokens.shape == want.shape == (30, 32)
    assert rel_err(tokens, want) < RTOL
    unwindowed, _, _ = tower(path, ref, scan, window=0)
    assert rel_err(unwindowed, want) > 10 * RTOL


def test_mrope_positions_are_transformers_get_rope_index():
    """Text counts on, an image's tokens take (s, s + row, s + column) and the text after it resumes
    at s + max(rows, columns): the positions transformers' `get_rope_index` gives (written out here
    for a 2x3 image after two tokens, and a 1x2 one after one more)."""
    from maestro_jax.models.llm import mrope_positions

    ids = np.array([5, 6, *[7] * 6, 8, *[7] * 2, 9])
    got = mrope_positions(ids, 7, [(2, 3), (1, 2)])
    assert got[:, 0].tolist() == list(range(12))
    assert got[:, 1:].T.tolist() == [
        [0, 1, 2, 2, 2, 2, 2, 2, 5, 6, 6, 8],
        [0, 1, 2, 2, 2, 3, 3, 3, 5, 6, 6, 8],
        [0, 1, 2, 3, 4, 2, 3, 4, 5, 6, 7, 8],
    ]
    with pytest.raises(ValueError, match="an image of 2x3 tokens at position 2 has 4 placeholders"):
        mrope_positions(ids[:6], 7, [(2, 3)])


@pytest.mark.reference
def test_video_mrope_positions_are_transformers_get_rope_index():
    """A row of text, an image, a clip, text, a second clip and text, each clip with its own
    seconds per temporal patch (0.5 s, and 0.3 s whose 0.6 token steps truncate): the positions
    are those transformers' Qwen2.5-VL `get_rope_index` computes for the same ids and grids (its
    own method, run on a config of spatial merge 2 and 2 tokens per second)."""
    import types

    from maestro_jax.models.llm import mrope_positions
    from test_hf import live_transformers

    torch, transformers = live_transformers()
    model = transformers.models.qwen2_5_vl.modeling_qwen2_5_vl.Qwen2_5_VLModel
    image, video, merge, per_second = 7, 9, 2, 2
    images = [(2, 3)]  # merged grids
    videos = [(3, 2, 2), (5, 1, 3)]  # temporal patches, merged rows, merged columns
    seconds = [0.5, 0.3]
    ids = [5, 6, *[image] * 6, 8, *[video] * 12, 4, 3, *[video] * 15, 2]
    types_ = [1 if t == image else 2 if t == video else 0 for t in ids]
    me = types.SimpleNamespace(
        config=types.SimpleNamespace(
            vision_config=types.SimpleNamespace(spatial_merge_size=merge, tokens_per_second=per_second)
        )
    )
    me.get_vision_position_ids = lambda *a, **k: model.get_vision_position_ids(me, *a, **k)
    want, _ = model.get_rope_index(
        me,
        torch.tensor([ids]),
        torch.tensor([types_]),
        image_grid_thw=torch.tensor([(1, r * merge, c * merge) for r, c in images]),
        video_grid_thw=torch.tensor([(t, r * merge, c * merge) for t, r, c in videos]),
        second_per_grid_ts=torch.tensor(seconds, dtype=torch.float32),
    )
    clips = [(t, r, c, per_second * s) for (t, r, c), s in zip(videos, seconds, strict=True)]
    got = mrope_positions(np.array(ids), image, images, video, clips)
    assert got[:, 0].tolist() == list(range(len(ids)))
    np.testing.assert_array_equal(got[:, 1:].T, want[:, 0].numpy())
    frames = (got[23:38:3, 1] - got[23, 1]).tolist()  # the second clip: one entry per temporal patch
    assert frames == [0, 0, 1, 1, 2]  # 0, 0.6, 1.2, 1.8, 2.4 tokens, truncated
    with pytest.raises(ValueError, match="a video of 3x2x2 tokens at position 9 has 11 placeholders"):
        mrope_positions(np.array(ids[:20]), image, images, video, clips)


@pytest.mark.reference
def test_qwen3_vl_video_positions_are_its_get_rope_index_frame_by_frame():
    """Qwen3-VL: a clip of 3 temporal patches written with a timestamp before each (its processor's
    `<t> <|vision_start|> frame <|vision_end|>`), beside an image: `frame_by_frame`'s grids give
    the positions transformers' Qwen3-VL `get_rope_index` computes (its own method; it splits the
    clip's grid into one temporal patch a block)."""
    import types

    from maestro_jax.models.llm import frame_by_frame, mrope_positions
    from test_hf import live_transformers

    torch, transformers = live_transformers()
    model = transformers.models.qwen3_vl.modeling_qwen3_vl.Qwen3VLModel
    image, video, merge = 7, 9, 2
    frame = [3, 4, *[video] * 4, 5]  # a timestamp token, <|vision_start|>, a 2x2 frame, <|vision_end|>
    ids = [1, 2, *[image] * 6, 8, *frame, *frame, *frame, 6]
    kinds = [1 if t == image else 2 if t == video else 0 for t in ids]
    me = types.SimpleNamespace(
        config=types.SimpleNamespace(vision_config=types.SimpleNamespace(spatial_merge_size=merge))
    )
    me.get_vision_position_ids = lambda *a, **k: model.get_vision_position_ids(me, *a, **k)
    want, _ = model.get_rope_index(
        me,
        torch.tensor([ids]),
        torch.tensor([kinds]),
        image_grid_thw=torch.tensor([(1, 2 * merge, 3 * merge)]),
        video_grid_thw=torch.tensor([(3, 2 * merge, 2 * merge)]),
    )
    got = mrope_positions(np.array(ids), image, [(2, 3)], video, frame_by_frame([(3, 2, 2)]))
    np.testing.assert_array_equal(got[:, 1:].T, want[:, 0].numpy())


# slow: the quick tier's test_the_whole_model_on_text_an_image_and_a_clip_equals_transformers checks the M-RoPE language model end to end
@pytest.mark.slow
def test_language_model_with_mrope_equals_transformers(tmp_path):
    """The folder's language model (Qwen2 with M-RoPE, sections 2+3+3) with the tower's image tokens
    spliced in gives transformers' logits on a row of text and two images of different grids;
    with plain 1-D positions the logits differ."""
    from maestro_jax.models import DecoderLM, LLMConfig, hf
    from maestro_jax.models.llm import mrope_positions

    path, ref = fixture(tmp_path)
    fields = hf.llm_fields(path)
    assert fields["mrope_section"] == (2, 3, 3) and fields["qkv_bias"] and not fields["tie_embeddings"]
    features, _, _ = tower(path, ref)
    decoder = DecoderLM(LLMConfig.from_fields(fields))
    ids = jnp.asarray(ref["tokens"], jnp.int32)
    positions = mrope_positions(ref["tokens"][0], 7, [(4, 6), (3, 2)])[None]
    valid = jnp.ones(ids.shape, bool)
    target = nn.unbox(decoder.init(jax.random.key(0), ids, jnp.asarray(positions), valid)["params"])
    v = {"params": hf.load_llm(path, target, fields)}
    x = decoder.apply(v, ids, method=DecoderLM.embed)
    x = x.at[0, np.flatnonzero(ref["tokens"][0] == 7)].set(features)

    def logits(pos):
        h = decoder.apply(v, x, jnp.asarray(pos), valid, method=DecoderLM.hidden)
        return np.asarray(decoder.apply(v, h, method=DecoderLM.logits))

    want = ref["logits"]
    assert rel_err(logits(positions), want) < RTOL
    flat = np.repeat(positions[..., :1], 4, axis=-1)  # every axis the token's index: 1-D RoPE
    assert rel_err(logits(flat), want) > 10 * RTOL


def _overrides(path) -> list[str]:
    return [
        "global_batch=8",
        "data.text_len=[6,14]",
        f"models.vision={{hf: {path}, kind: vit}}",
        f"models.llm={{hf: {path}, kind: llm}}",
        "data.modalities.image.sizes=[[16,24],[12,8]]",
        "workload_settings.video_token=93",  # the folder's video_token_id (vlm_tiny's own is 3)
        "data.modalities.video.sizes=[[2,8,8],[4,8,12]]",
        "sections.llm.mesh={data: 6}",
    ]


@pytest.mark.slow  # two sections and the monolithic step compiled (the quick tier verifies each workload: test_workloads.py)
def test_a_qwen2_5_vl_folder_gives_both_sections_and_verifies(tmp_path):
    """`models.vision: {hf: DIR, kind: vit}` and `models.llm: {hf: DIR, kind: llm}` on one Qwen2.5-VL
    folder: the tower and the M-RoPE language model with no field by hand, the image token from
    `image_token_id`; the LLM's rows carry each sample's M-RoPE positions (packed rows too, each
    sample its own) and the sectioned step equals the monolithic one."""
    from maestro_jax.models.llm import mrope_positions

    from maestro_jax.config import load_config
    from maestro_jax.runtime.build import build_runtime
    from maestro_jax.schedule.packing import TokenBudget
    from maestro_jax.tools.verify import verify
    from maestro_jax.workloads import settings
    from maestro_jax.workloads.vlm import packed_multimodal_rows

    path, _ = fixture(tmp_path)
    cfg = load_config(ROOT / "configs/vlm_tiny.yaml", _overrides(path))
    assert cfg.models["vision"].block == "rmsnorm_glu" and cfg.models["llm"].mrope_section == (2, 3, 3)
    assert settings(cfg).image_token == 7
    assert settings(cfg).video_token == 93 and cfg.models["llm"].video_tokens_per_second == 4.0
    rt = build_runtime(cfg)
    assert any(s.has("video") for s in rt.batches()[0])
    samples = [s for s in rt.batches()[0] if s.has("image") or s.has("video")]
    llm = next(s for s in rt.graph.sections if s.name == "llm")
    host = llm.host_batch(samples, {})
    assert host["positions"].shape[-1] == 4
    for row, s in zip(host["positions"], samples):
        grids = [(h // 4, w // 4) for h, w, _ in s.shapes("image")]
        clips = [(t // 2, h // 4, w // 4, 4.0) for t, h, w, _ in s.shapes("video")]  # 4 tokens a second, 1 s a patch
        want = mrope_positions(s.tokens[:-1], 7, grids, 93, clips)
        assert np.array_equal(row[: len(want)], want)
        assert (want[:, 1] < want[:, 0]).any()  # an image's (a clip's) tokens share a temporal position
    from maestro_jax.workloads.vlm import visual_modalities

    packed = packed_multimodal_rows(
        samples,
        {},
        1,
        TokenBudget(64),
        {"image_embeds": visual_modalities(cfg)},
        positions=llm_positions(cfg),
        per_octave=cfg.compile.buckets_per_octave,
    )
    for row, seg in zip(packed["positions"], packed["segments"]):
        for k in range(1, seg.max() + 1):
            own = row[seg == k]
            assert own[0].tolist() == [0, 0, 0, 0]  # each sample's positions start again
    diffs = verify(cfg, rt)
    assert {d.name for d in diffs} >= {"loss", "vision/grads", "llm/grads"}
    assert all(d.max_rel <= 1e-4 for d in diffs), diffs


def llm_positions(cfg):
    from maestro_jax.workloads import model
    from maestro_jax.workloads.vlm import sample_positions, visual_modalities

    return sample_positions(model(cfg, "llm", "llm"), {"image_embeds": visual_modalities(cfg)})


@pytest.mark.reference
@pytest.mark.slow  # the export's quick check: test_hf.py::test_export_round_trip_in_transformers
@pytest.mark.parametrize("name", ["qwen2_5_vl", "qwen3_vl"])
def test_export_writes_a_qwen_vl_folder_that_reimports_and_transformers_loads(tmp_path, name):
    """`save_qwen_vl` (what `maestro-jax export --section vision,llm` writes for this tower) gives
    a folder of the tower's type (Qwen2.5-VL's or Qwen3-VL's, DeepStack mergers and interleaved
    M-RoPE included) with the same fields and weights back; transformers loads it with nothing
    missing, its logits on the fixture's row are the reference's, and check-hf passes it (where
    torch is installed)."""
    from maestro_jax.models import DecoderLM, LLMConfig, hf

    from maestro_jax.tools.check_hf import QWEN_VL_MODELS

    path, ref = fixture(tmp_path, name)
    _, vparams, _ = tower(path, ref)
    vfields, lfields = hf_encoders.vit_fields(path), hf.llm_fields(path)
    decoder = DecoderLM(LLMConfig.from_fields(lfields))
    ids = jnp.zeros((1, 4), jnp.int32)
    target = nn.unbox(decoder.init(jax.random.key(0), ids, jnp.zeros((1, 4, 4), jnp.int32), ids > -1)["params"])
    lparams = hf.load_llm(path, target, lfields)
    out = tmp_path / "out"
    hf_encoders.save_qwen_vl(out, vparams, vfields, lparams, lfields, image_token=7, video_token=93)
    assert hf.read_config(out)["model_type"] == name and hf.read_config(out)["video_token_id"] == 93
    assert hf_encoders.vit_fields(out) == vfields and hf.llm_fields(out) == lfields
    again = hf_encoders.load_vit(out, vparams, vfields)
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(np.allclose(a, b, atol=1e-6)), again, vparams))
    # the patch kernel goes back as the checkpoint holds it, each of its frames' own (not their mean)
    from safetensors.numpy import load_file

    key = "model.visual.patch_embed.proj.weight"
    read = {k.removeprefix("model."): v for f in path.glob("*.safetensors") for k, v in load_file(f).items()}
    written = {k.removeprefix("model."): v for f in out.glob("*.safetensors") for k, v in load_file(f).items()}
    kernel = key.removeprefix("model.")
    assert written[kernel].shape[2] == vfields["frames"] == 2
    assert np.array_equal(written[kernel].astype(np.float32), read[kernel].astype(np.float32))
    assert not np.allclose(read[kernel][:, :, 0], read[kernel][:, :, 1]), "the fixture's frames differ"
    torch = pytest.importorskip("torch", reason="transformers' reload needs torch (the reference extra)")
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    model, info = getattr(transformers, QWEN_VL_MODELS[name]).from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    cut = [Qwen2VLImageProcessorPil().patchify(ref[f"image{i}"].transpose(2, 0, 1), 2, 2, 2) for i in range(2)]
    tokens = torch.tensor(ref["tokens"])
    with torch.no_grad():
        logits = model.eval()(
            input_ids=tokens,
            pixel_values=torch.tensor(np.concatenate([p for p, _, _ in cut])),
            image_grid_thw=torch.tensor([[1, gh, gw] for _, gh, gw in cut]),
            mm_token_type_ids=(tokens == 7).int(),
        ).logits.numpy()
    assert rel_err(logits, ref["logits"]) < RTOL
    from maestro_jax import cli

    assert cli.main(["check-hf", "--hf", str(out)]) == 0  # the clip in its row too: the video id is the VLM's


@pytest.mark.reference
def test_check_hf_compares_a_qwen2_5_vl_folders_image_tokens_and_logits(capsys):
    """`check-hf` on a Qwen2.5-VL folder: three images of different grids (windows cut at their
    edges) and two rows of different lengths holding them; the image tokens and the logits, a
    line each, both within the tolerance."""
    pytest.importorskip("torch", reason="check-hf runs transformers (the reference extra)")
    from maestro_jax import cli

    assert cli.main(["check-hf", "--hf", str(FIXTURES / "qwen2_5_vl")]) == 0
    lines = capsys.readouterr().out.strip().splitlines()[-3:]
    assert "(qwen2_5_vl): 3 images of 12x20, 8x12, 16x4; image tokens" in lines[0] and lines[0].endswith("PASS"), lines
    assert "a clip of 4 frames of 12x8; video tokens" in lines[1] and lines[1].endswith("PASS"), lines
    assert "3 images and a clip in 2 rows of [42, 29] tokens; logits" in lines[2] and lines[2].endswith("PASS"), lines


@pytest.mark.reference
@pytest.mark.parametrize(
    "name,side,verdicts",
    [
        ("qwen2_5_vl", "vision", ("FAIL", "FAIL", "FAIL")),
        ("qwen2_5_vl", "llm", ("PASS", "PASS", "FAIL")),
        ("qwen3_vl", "deepstack", ("FAIL", "FAIL", "FAIL")),
    ],
)
def test_check_hf_fails_when_maestro_holds_a_weight_transformers_does_not(monkeypatch, capsys, name, side, verdicts):
    """One weight moved on maestro's side only (after its import of the folder; a folder whose
    weight is moved goes through both sides moved, and passes): check-hf exits 1, the tower's
    weight failing both comparisons, the language model's the logits alone; a Qwen3-VL DeepStack
    merger's weight both (its features are image tokens' and reach the logits)."""
    pytest.importorskip("torch", reason="check-hf runs transformers (the reference extra)")
    from maestro_jax.models import hf

    from maestro_jax import cli

    module, load_name = (hf, "load_llm") if side == "llm" else (hf_encoders, "load_vit")
    load = getattr(module, load_name)

    def moved(*args, **kwargs):
        params = load(*args, **kwargs)
        if side == "deepstack":
            fc2 = params["deepstack_1"]["fc2"]
            return {**params, "deepstack_1": {**params["deepstack_1"], "fc2": {**fc2, "bias": fc2["bias"] + 0.05}}}
        leaves, tree = jax.tree.flatten(params)
        leaves[0] = leaves[0].at[(0,) * leaves[0].ndim].add(0.05)
        return jax.tree.unflatten(tree, leaves)

    monkeypatch.setattr(module, load_name, moved)
    assert cli.main(["check-hf", "--hf", str(FIXTURES / name)]) == 1
    lines = capsys.readouterr().out.strip().splitlines()[-3:]
    assert tuple(line.rsplit(" ", 1)[-1] for line in lines) == verdicts, lines


# slow: the quick tier's test_the_whole_model_on_text_an_image_and_a_clip_equals_transformers checks Qwen3-VL's tower and DeepStack end to end
@pytest.mark.slow
def test_qwen3_vl_tower_equals_transformers_with_its_deepstack_features(tmp_path):
    """The Qwen3-VL tower (LayerNorm and GELU blocks with 2-D rotary, a 4x4 position table
    resampled to an 8x12-patch and a 6x4-patch image packed in one row, the LayerNorm merger) gives
    transformers' `pooler_output`, and its two DeepStack mergers (after blocks 0 and 2) its
    `deepstack_features`, each after the tokens' own features; without the position table the
    tokens differ."""
    path, ref = fixture(tmp_path, "qwen3_vl")
    fields = hf_encoders.vit_fields(path)
    assert (fields["block"], fields["pos_embed"], fields["projector"]) == ("layernorm", "table_rope2d", "patch_merger")
    assert (fields["table_grid"], fields["deepstack_layers"], fields["out_width"]) == (4, (0, 2), 32)
    tokens, _, cfg = tower(path, ref)
    assert tokens.shape == (30, cfg.token_width) == (30, 96)
    want = [ref["image_features"], *ref["deepstack_features"]]
    for k, part in enumerate(want):
        assert rel_err(tokens[:, 32 * k : 32 * (k + 1)], part) < RTOL, k
    unplaced, _, _ = tower(path, ref, moved=lambda p: {**p, "pos": p["pos"] * 0})
    assert rel_err(unplaced[:, :32], want[0]) > 10 * RTOL


# slow: the quick tier's test_the_whole_model_on_text_an_image_and_a_clip_equals_transformers checks Qwen3-VL's language model end to end
@pytest.mark.slow
@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scan"])
def test_qwen3_vl_language_model_with_interleaved_mrope_and_deepstack_equals_transformers(tmp_path, scan):
    """The Qwen3-VL folder's language model (Qwen3 with query/key norms, M-RoPE sections 4+2+2
    interleaved, DeepStack) with the tower's image tokens spliced in and its two DeepStack feature
    sets added after blocks 0 and 1 gives transformers' logits (unrolled, and scanned: each block
    finds its features by its traced index); with the sections in runs (Qwen2.5-VL's), or without
    DeepStack, the logits differ."""
    from maestro_jax.models import DecoderLM, LLMConfig, hf
    from maestro_jax.models.llm import mrope_positions

    path, ref = fixture(tmp_path, "qwen3_vl")
    fields = hf.llm_fields(path)
    assert (fields["mrope_section"], fields["mrope_interleaved"], fields["deepstack_layers"]) == ((4, 2, 2), True, 2)
    assert fields["qk_norm"] and fields["head_dim"] == 16 != fields["width"] // fields["heads"]
    features, _, _ = tower(path, ref)
    ids = jnp.asarray(ref["tokens"], jnp.int32)
    positions = jnp.asarray(mrope_positions(ref["tokens"][0], 7, [(4, 6), (3, 2)])[None])
    valid = jnp.ones(ids.shape, bool)
    at = np.flatnonzero(ref["tokens"][0] == 7)

    def logits(**change):
        decoder = DecoderLM(LLMConfig.from_fields({**fields, "scan_layers": scan, **change}))
        target = nn.unbox(decoder.init(jax.random.key(0), ids, positions, valid)["params"])
        v = {"params": hf.load_llm(path, target, fields)}
        x = decoder.apply(v, ids, method=DecoderLM.embed).at[0, at].set(features[:, :32])
        sets = features[:, 32:].reshape(len(at), 2, 32).transpose(1, 0, 2)
        deepstack = jnp.zeros((2, *x.shape)).at[:, 0, at].set(sets) if change.get("deepstack_layers", 2) else None
        h = decoder.apply(v, x, positions, valid, None, None, deepstack, method=DecoderLM.hidden)
        return np.asarray(decoder.apply(v, h, method=DecoderLM.logits))

    want = ref["logits"]
    assert rel_err(logits(), want) < RTOL
    if not scan:
        assert rel_err(logits(mrope_interleaved=False), want) > 10 * RTOL
        assert rel_err(logits(deepstack_layers=0), want) > 10 * RTOL


def _qwen3_overrides(path, *more) -> list[str]:
    return [
        *_overrides(path),
        "data.modalities.image.sizes=[[16,24],[12,8],[8,8]]",
        *more,
    ]


@pytest.mark.extended  # ~40 s on 2 cores: two sections and the monolithic step compiled
def test_a_qwen3_vl_folder_gives_both_sections_whose_deepstack_crosses_the_edge_and_verifies(tmp_path):
    """`models.vision` and `models.llm` from one Qwen3-VL folder: the tower with its position table
    and DeepStack taps, the language model with interleaved M-RoPE and two DeepStack layers, no
    field by hand; the image edge carries each token's three feature sets (its own and DeepStack's,
    priced so), the LLM adds the DeepStack ones at its image positions, and the sectioned step
    (the LLM's rows packed too) equals the monolithic one."""
    from maestro_jax.config import load_config
    from maestro_jax.runtime.build import build_runtime
    from maestro_jax.tools.verify import verify
    from maestro_jax.workloads import build_graph, settings

    path, _ = fixture(tmp_path, "qwen3_vl")
    cfg = load_config(ROOT / "configs/vlm_tiny.yaml", _qwen3_overrides(path, "sections.llm.pack=2"))
    vision, llm = cfg.models["vision"], cfg.models["llm"]
    assert (vision.pos_embed, vision.table_grid, vision.deepstack_layers) == ("table_rope2d", 4, (0, 2))
    assert (llm.mrope_interleaved, llm.deepstack_layers, settings(cfg).image_token) == (True, 2, 7)
    edge = next(e for e in build_graph(cfg).edges if e.name == "image_embeds")
    assert edge.bytes_per_unit == 2 * 3 * 32 / 4
    diffs = verify(cfg, build_runtime(cfg))
    assert {d.name for d in diffs} >= {"loss", "vision/grads", "llm/grads"}
    assert all(d.max_rel <= 1e-4 for d in diffs), diffs


@pytest.mark.extended  # ~40 s on 2 cores, as the unstaged one above
def test_a_qwen3_vl_llm_in_pipeline_stages_adds_deepstack_in_its_first_and_verifies(tmp_path):
    """The Qwen3-VL language model in 2 pipeline stages cut 2/2: its first stage, which receives
    the image edge, holds both DeepStack blocks and adds the features there; the second takes the
    hidden states over the stage edge; the step equals the unstaged monolithic one."""
    from maestro_jax.config import load_config
    from maestro_jax.runtime.build import build_runtime
    from maestro_jax.tools.verify import verify

    path, _ = fixture(tmp_path, "qwen3_vl")
    cfg = load_config(
        ROOT / "configs/vlm_tiny.yaml",
        _qwen3_overrides(path, "sections.llm.stages=2", "sections.llm.stage_layers=[2,2]"),
    )
    assert list(cfg.plan().sections) == ["vision", "llm.0", "llm.1"]
    diffs = verify(cfg, build_runtime(cfg))
    assert {d.name for d in diffs} >= {"loss", "vision/grads", "llm/grads"}
    assert all(d.max_rel <= 1e-4 for d in diffs), diffs


@pytest.mark.parametrize(
    "more,message",
    [
        (
            ["sections.llm.stages=2", "sections.llm.stage_layers=[1,3]"],
            "error: sections.llm.stage_layers=[1, 3]: the model adds DeepStack image features in blocks 0..1 "
            "(deepstack_layers: 2) and the first stage, which alone receives the images, holds 1 blocks; valid: a "
            "first stage of at least 2 blocks (stage_layers)",
        ),
        (
            [
                "models.vision={patch: 2, width: 32, depth: 3, heads: 2, mlp: 64, out_width: 32, kind: vit, pos_embed: "
                "table_rope2d, table_grid: 4, projector: patch_merger, deepstack_layers: [0, 1]}"
            ],
            "error: workload='vlm': models.vision.deepstack_layers=[0, 1]: the tower sends 2 DeepStack feature sets "
            "and the LLM takes deepstack_layers=1; valid: as many",
        ),
    ],
)
def test_a_qwen3_vl_llm_whose_deepstack_does_not_fit_is_refused_in_one_line(tmp_path, more, message):
    """DeepStack's features reach the LLM's first pipeline stage only: a cut whose first stage
    holds fewer blocks than `deepstack_layers` is refused naming the stages, before anything
    compiles; so is an LLM taking another number of DeepStack sets than the tower sends."""
    from maestro_jax.config import ConfigError, load_config
    from maestro_jax.workloads import build_graph

    path, _ = fixture(tmp_path, "qwen3_vl")
    llm = (
        [
            "models.llm={vocab: 96, width: 32, depth: 2, heads: 2, kv_heads: 1, head_dim: 16, mlp: 64, kind: llm, "
            "mrope_section: [4, 2, 2], deepstack_layers: 1}"
        ]
        if "models.vision" in more[0]
        else []
    )
    with pytest.raises(ConfigError) as err:
        build_graph(load_config(ROOT / "configs/vlm_tiny.yaml", [*_qwen3_overrides(path, *more), *llm]))
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


# slow: the quick tier's test_the_whole_model_on_text_an_image_and_a_clip_equals_transformers checks each family's tower on a clip end to end
@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen2_5_vl", "qwen3_vl"])
def test_the_tower_on_a_clip_equals_transformers_video_features(tmp_path, name):
    """A 5-frame clip through the folder's tower, each temporal patch a segment of its own (as
    transformers' `visual` attends within each frame's patches, windows included) and its rows
    laid out by `data.video` (each of the 2 frames' kernels on its own frame; the last patch
    repeating the last frame): the tokens, and Qwen3-VL's DeepStack sets, equal transformers'
    `visual(pixel_values_videos, video_grid_thw)` (tests/fixtures/hf/qwen_video/towers.npz), and the
    rows its video processor's. With the frames' kernels summed (the still-image shortcut) they differ."""
    from maestro_jax.data.video import Clip, VideoSampling

    ref = np.load(FIXTURES / "qwen_video" / "towers.npz")
    path, _ = fixture(tmp_path, name)
    fields = {k: v for k, v in hf_encoders.vit_fields(path).items() if k != "kind"}
    cfg = ViTConfig(**fields)
    frames, (t, h, w) = ref[f"{name}-frames"], ref[f"{name}-grid"].tolist()
    assert (cfg.frames, t) == (2, 3) and len(frames) == 5
    sampling = VideoSampling(name, patch=cfg.patch, merge=cfg.merge, temporal=cfg.frames, min_pixels=1, max_pixels=1)
    clip = Clip(tuple(range(len(frames))), (h * cfg.patch, w * cfg.patch), (t, h, w), 1.0, ())
    rows = sampling.patches(frames, clip)
    processor = ref[f"{name}-pixels"].reshape(len(rows), cfg.channels, cfg.frames, cfg.patch, cfg.patch)
    np.testing.assert_allclose(rows, processor.transpose(0, 2, 3, 4, 1).reshape(len(rows), -1), rtol=0, atol=1e-6)
    _, grid = patchify(np.zeros((h * cfg.patch, w * cfg.patch, cfg.channels)), cfg.patch, cfg.merge)
    segments = np.repeat(np.arange(1, t + 1, dtype=np.int32), h * w)
    inputs = (jnp.asarray(rows)[None], jnp.asarray(segments)[None], jnp.asarray(np.tile(grid, (t, 1)), jnp.int32)[None])
    model = VisionEncoder(cfg)
    params = hf_encoders.load_vit(path, nn.unbox(model.init(jax.random.key(0), *inputs)["params"]), fields)
    tokens = np.asarray(model.apply({"params": params}, *inputs)[0])
    want = (
        [ref[f"{name}-features"], *ref.get(f"{name}-deepstack", [])]
        if f"{name}-deepstack" in ref
        else [ref[f"{name}-features"]]
    )
    assert tokens.shape == (t * h * w // 4, cfg.token_width)
    for k, part in enumerate(want):
        assert rel_err(tokens[:, 32 * k : 32 * (k + 1)], part) < RTOL, k
    kernel = params["patch_embed"]["kernel"]
    half = kernel.shape[0] // 2
    summed = {
        **params,
        "patch_embed": {**params["patch_embed"], "kernel": jnp.concatenate([kernel[:half] + kernel[half:]] * 2) / 2},
    }
    assert rel_err(np.asarray(model.apply({"params": summed}, *inputs)[0])[:, :32], want[0]) > 10 * RTOL


def _whole_logits(path, name: str, tags: dict) -> np.ndarray:
    """The vlm workload's two sections, as the folder's config builds them and with its weights, on
    one sample holding the fixture row's text, image and clip: the tower's host batch and forward
    (the image, then each temporal patch a segment), then the LLM's host batch (its M-RoPE
    positions, the video tokens indexed after the image's) and its logits with the tokens spliced in."""
    from maestro_jax.models import DecoderLM, hf

    from maestro_jax.config import load_config
    from maestro_jax.data import Sample
    from maestro_jax.workloads import build_graph, model
    from maestro_jax.workloads.vlm import EDGE, spliced_logits, visual_modalities

    ref = np.load(FIXTURES / "qwen_video" / "whole.npz")
    cfg = load_config(ROOT / "configs/vlm_tiny.yaml", _overrides(path))
    graph = build_graph(cfg)
    vision, llm = (next(s for s in graph.sections if s.name == n) for n in ("vision", "llm"))
    tokens = np.append(ref[f"{name}-tokens"], 11).astype(np.int32)  # the inputs are tokens[:-1]: the fixture's row
    sample = Sample(0, tokens, {"image": (ref["image"],), "video": (ref["clip"],)}, tags=tags)
    init = nn.unbox(graph.init(jax.random.key(0)))
    vit_fields = {k: v for k, v in hf_encoders.vit_fields(path).items() if k != "kind"}
    vparams = hf_encoders.load_vit(path, init["vision"]["params"], vit_fields)
    lparams = hf.load_llm(path, init["llm"]["params"], hf.llm_fields(path))
    edge = vision.forward({"params": vparams}, {}, vision.host_batch([sample], {}))[EDGE]
    batch = llm.host_batch([sample], {EDGE: [0]})
    decoder = DecoderLM(model(cfg, "llm", "llm"), rows_from_zero=True)
    logits, _ = spliced_logits(decoder, {"params": lparams}, {EDGE: (edge,)}, batch, {EDGE: visual_modalities(cfg)})
    return np.asarray(logits)[0, : len(tokens) - 1]


@pytest.mark.parametrize("name", ["qwen2_5_vl", "qwen3_vl"])
def test_the_whole_model_on_text_an_image_and_a_clip_equals_transformers(tmp_path, name):
    """The vlm workload on a Qwen2.5-VL / Qwen3-VL folder, one sample of text, an 8x8 image and a
    4-frame clip of 8x12 (tests/fixtures/hf/qwen_video/whole.npz, `scripts/make_video_fixtures.py`):
    its logits are transformers' on the same row (Qwen2.5-VL's clip at 0.5 s a temporal patch,
    the sample's `video_seconds_per_patch` tag; Qwen3-VL's written with a timestamp before each
    temporal patch, DeepStack on the image and video tokens). Qwen2.5-VL's without the tag (1 s a
    patch: other temporal positions) differ."""
    from maestro_jax.workloads.vlm import SECONDS_PER_PATCH

    ref = np.load(FIXTURES / "qwen_video" / "whole.npz")
    path, _ = fixture(tmp_path, name)
    tags = {SECONDS_PER_PATCH: str(float(ref["seconds"]))} if name == "qwen2_5_vl" else {}
    want = ref[f"{name}-logits"]
    assert rel_err(_whole_logits(path, name, tags), want) < RTOL
    if name == "qwen2_5_vl":
        assert rel_err(_whole_logits(path, name, {}), want) > 10 * RTOL
