"""The recipes in examples/ run end to end, as a user runs them (tiny random Hugging Face folders
made offline, tiny generated data, a few steps), and what they promise holds: the LLaVA-style
VLM's converted data puts loss on the assistant's tokens only, its loss falls over two stages
and its frozen parts keep their checkpoints' values; every export reloads (with the project's own
loader, no torch) equal to the trained weights in the run's checkpoint."""

import importlib.util
import json
import sys

import jax
import numpy as np
import pytest
from conftest import ROOT
from maestro_jax.models import hf, hf_encoders

from maestro_jax.config import load_config
from maestro_jax.data import IMAGE_TOKEN, ArrayRecordSource
from maestro_jax.runtime.build import build_runtime
from maestro_jax.runtime.optimizer import param_path
from maestro_jax.training.checkpoint import reading_checkpoints

pytestmark = pytest.mark.slow
EXAMPLES = ROOT / "examples"


def recipe(name: str):
    """examples/<name>.py as a module (the recipes import `tiny_hf` from beside them)."""
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def checkpointed(config, overrides: list[str]) -> dict:
    """Every section's state in the run's latest checkpoint (as `maestro-jax export` reads it)."""
    cfg = load_config(config, overrides)
    with reading_checkpoints(cfg) as ckpt:
        restored = ckpt.restore_latest(build_runtime(cfg).init_states())
    assert restored is not None and restored[0] == cfg.steps
    return restored[1]


def leaves(tree) -> dict:
    return {param_path(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(tree)}


def assert_equal(got, want, only=lambda path: True) -> None:
    got, want = leaves(got), leaves(want)
    assert set(got) == set(want)
    compared = [p for p in want if only(p)]
    assert compared
    for p in compared:
        np.testing.assert_array_equal(got[p], want[p], err_msg=p)


def assert_export_reloads(export, params) -> None:
    """The exported folder, read back by `models.hf.load_llm`, is `params` exactly."""
    assert_equal(hf.load_llm(export, params, hf.llm_fields(export)), params)


def runs(flags):
    edges = np.diff(np.concatenate([[0], flags.astype(np.int8), [0]]))
    return list(zip(np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)))


@pytest.mark.extended  # an end-to-end recipe; CI keeps distill_llama3
def test_llava_vlm_two_stages(tmp_path):
    vlm = recipe("llava_vlm")
    out = vlm.main(tmp_path)
    stage1, stage2 = out["stage1"], out["stage2"]
    assert stage2[-1]["train/loss"] < stage2[0]["train/loss"] and stage2[-1]["train/loss"] < stage1[0]["train/loss"], (
        stage1,
        stage2,
    )

    # the converted data: placeholders for each image, loss on exactly the assistant's turns
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(out["data"].parent / "tokenizer/tokenizer.json"))
    records = json.loads((out["data"].parent / "llava.json").read_text())
    src = ArrayRecordSource((str(out["data"]),))
    assert len(src) == len(records) == 48
    assert {len(r["image"]) for r in records} == {1, 2, 3}
    for i, record in enumerate(records):
        s = src[i]
        mask = s.loss_mask.astype(bool)
        assert len(runs(s.tokens == IMAGE_TOKEN)) == len(record["image"]) and not mask[s.tokens == IMAGE_TOKEN].any()
        said = [t["value"] for t in record["conversations"] if t["from"] == "gpt"]
        decoded = [tok.decode(s.tokens[a:b].tolist(), skip_special_tokens=True) for a, b in runs(mask)]
        assert decoded == [f"{x}\n" for x in said]  # each answer, its <|im_end|> (special) and newline

    # frozen stays frozen: stage 1's LLM is the Qwen2 folder's, both stages' tower the SigLIP folder's
    config = vlm.CONFIG
    first = checkpointed(config, out["stage1_overrides"])
    second = checkpointed(config, out["stage2_overrides"])
    qwen, siglip = out["hf"]["llm"], out["hf"]["vision"]
    assert_equal(first["llm"].params, hf.load_llm(qwen, first["llm"].params, hf.llm_fields(qwen)))
    tower = hf_encoders.load_vit(siglip, second["vision"].params, hf_encoders.vit_fields(siglip))
    assert_equal(second["vision"].params, tower, only=lambda p: not p.startswith("merger_"))
    # stage 2 trained the projector and the LLM further from stage 1's
    for s in ("vision", "llm"):
        before, after = leaves(first[s].params), leaves(second[s].params)
        assert any(not np.array_equal(after[p], before[p]) for p in before), s

    assert_export_reloads(out["export"], second["llm"].params)


@pytest.mark.extended  # an end-to-end recipe; CI keeps distill_llama3
def test_omni_towers_frozen_llm_exported(tmp_path):
    omni = recipe("omni")
    out = omni.main(tmp_path)
    assert all(np.isfinite(h["train/loss"]) for h in out["history"])
    states = checkpointed(omni.CONFIG, out["overrides"])
    siglip, whisper = out["hf"]["vision"], out["hf"]["audio"]
    tower = hf_encoders.load_vit(siglip, states["vision"].params, hf_encoders.vit_fields(siglip))
    assert_equal(states["vision"].params, tower, only=lambda p: not p.startswith("merger_"))
    encoder = hf_encoders.load_audio(whisper, states["audio"].params, hf_encoders.audio_fields(whisper))
    assert_equal(states["audio"].params, encoder, only=lambda p: not p.startswith("out_proj/"))
    assert_export_reloads(out["export"], states["llm"].params)


@pytest.mark.reference
@pytest.mark.extended  # an end-to-end recipe; CI keeps distill_llama3
def test_qwen_vl_fine_tune_exports_a_folder_transformers_reads(tmp_path):
    """The Qwen2.5-VL recipe: the converted data frames each image's <|image_pad|>s (one per merged
    token of the image as Qwen's processor sizes it) by <|vision_start|> and <|vision_end|>; the
    loss falls; the frozen tower keeps the folder's weights, its merger and the LLM train; the
    export reads back as the run's checkpoint, and (where transformers is installed) check-hf
    passes on it."""
    qwen = recipe("qwen_vl")
    out = qwen.main(tmp_path)
    history = out["history"]
    assert history[-1]["train/loss"] < history[0]["train/loss"], history
    src = ArrayRecordSource((str(out["data"]),))
    for i in range(len(src)):
        s = src[i]
        spans = runs(s.tokens == qwen.IMAGE_TOKEN)
        assert [b - a for a, b in spans] == [h * w // 64 for h, w, _ in s.shapes("image")]
        assert all(s.tokens[a - 1] == 3 and s.tokens[b] == 4 for a, b in spans)  # vision start, vision end
    states = checkpointed(qwen.CONFIG, out["overrides"])
    folder, export = out["hf"], out["export"]
    tower = hf_encoders.load_vit(folder, states["vision"].params, hf_encoders.vit_fields(folder))
    assert_equal(states["vision"].params, tower, only=lambda p: not p.startswith(("merger_", "merge_norm")))
    start = hf.load_llm(folder, states["llm"].params, hf.llm_fields(folder))
    assert not np.array_equal(leaves(states["llm"].params)["embedding"], leaves(start)["embedding"])
    assert_equal(hf_encoders.load_vit(export, tower, hf_encoders.vit_fields(export)), states["vision"].params)
    assert_export_reloads(export, states["llm"].params)
    assert out["checked"] in (0, None) and (out["checked"] == 0) == (importlib.util.find_spec("torch") is not None)


@pytest.mark.reference
def test_distill_llama3_student_exported(tmp_path):
    """The Llama 3 recipe: both models' architecture from their folders (Llama 3.1's RoPE scaling
    read, no field by hand), the student trained from its folder, exported, read back exactly, and
    (where transformers is installed) giving transformers' logits."""
    kd = recipe("distill_llama3")
    out = kd.main(tmp_path)
    assert all(np.isfinite(h["train/loss"]) for h in out["history"])
    cfg = load_config(kd.CONFIG, out["overrides"])
    teacher, student = cfg.models["teacher"], cfg.models["student"]
    assert teacher.rope_scaling.rope_type == student.rope_scaling.rope_type == "llama3"
    assert (teacher.kv_heads, student.kv_heads, student.tie_embeddings) == (2, 1, True)
    states = checkpointed(kd.CONFIG, out["overrides"])
    start = hf.load_llm(out["hf"]["student"], states["student"].params, hf.llm_fields(out["hf"]["student"]))
    assert not np.array_equal(leaves(states["student"].params)["embedding"], leaves(start)["embedding"])
    assert_export_reloads(out["export"], states["student"].params)
    assert out["checked"] in (0, None) and (out["checked"] == 0) == (importlib.util.find_spec("torch") is not None)


def test_llava_vlm_without_tokenizers_says_which_extra_in_one_line(tmp_path, monkeypatch, capsys):
    """The README's install has no `tokenizers` (the convert extra): the example stops with one
    line naming the extra, before anything runs, not with a ModuleNotFoundError traceback."""
    import runpy

    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tokenizers" else find(name, *a))
    monkeypatch.setattr(sys, "argv", ["llava_vlm.py", "--workdir", str(tmp_path / "w")])
    with pytest.raises(SystemExit) as stop:
        runpy.run_path(str(EXAMPLES / "llava_vlm.py"), run_name="__main__")
    assert stop.value.code == 2
    assert capsys.readouterr().err.strip() == (
        "error: this example needs the `tokenizers` package; install the convert extra: pip install "
        "'maestro-jax[convert]'"
    )
    assert not (tmp_path / "w").exists()
