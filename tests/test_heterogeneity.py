"""Where maestro's gain comes from (scripts/heterogeneity_sweep.py, benchmarks/RESULTS.md): the
high-resolution multi-image VLM config is what its header says and its plan fits, and with
nothing uneven (a VLM with no images) the planner's best plan ties the monolithic layout."""

import importlib.util
import sys

import pytest
from conftest import ROOT

from maestro_jax import workloads
from maestro_jax.config import load_config
from maestro_jax.planning.layout import peak_memory
from maestro_jax.tools.plan import planner_for
from maestro_jax.workloads.vlm import image_modality

HIGHRES = ROOT / "configs/vlm_highres_paper_scale.yaml"


def _sweep():
    spec = importlib.util.spec_from_file_location("heterogeneity_sweep", ROOT / "scripts/heterogeneity_sweep.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_highres_vlm_config_images_fit_the_vit_and_its_plan_fits_80gb():
    cfg = load_config(HIGHRES)
    vit, images = cfg.models["vision"], cfg.data.modalities["image"]
    assert max(max(s) for s in images.sizes) <= vit.max_grid * vit.patch, "max_grid covers the largest image"
    tokens = image_modality(cfg).tokens
    assert tokens((1344, 1344)) == 2304 and tokens((1792, 1792)) == 4096  # thousands of tokens per image
    source = workloads.source_from_config(cfg)
    infos = [source.info(i) for i in range(512)]
    counts = [len(i.shapes("image")) for i in infos]
    assert min(counts) >= 1 and max(counts) == images.max_items == 8  # every sample has 1..8 images
    longest = cfg.data.text_len[1] + images.max_items * 4096
    assert max(i.length for i in infos) <= longest <= 48 * 1024, "text + image tokens within ~40K"
    spec = workloads.describe(cfg)
    assert 0.5e9 < spec.sections["vision"].param_count < 0.8e9, "a ~0.6B ViT"
    assert spec.sections["llm"].has_experts
    # the config's own plan (what `simulate` prices) passes every constraint, memory included
    # (co-located: the two sections share the devices, `peak_memory` adds them up as they share)
    plan = cfg.plan()
    assert peak_memory(plan, planner_for(cfg, 64, 80.0, batches=1).check(plan)) <= 80 * 2**30


@pytest.mark.slow
def test_text_only_vlm_plans_the_monolithic_layout_and_images_never_lose():
    """The sweep's own point function, at 16 devices: no images leave the ViT idle and nothing
    uneven, so maestro's best plan is the fair monolithic layout (ratio 1); with images on every
    sample the ViT has work and maestro's plan space (which holds the monolithic layout) does at
    least as well."""
    sweep = _sweep()
    small = {"global_batch": 16}
    text = sweep.run_point(
        sweep.Point("t", "text only", sweep.VLM, 16, {**small, "data.modalities.image.fraction": 0.0}),
        batches=1,
        split=False,
    )
    assert text["sections"]["vision"]["active_share"] == 0 and text["sections"]["vision"]["flops_share"] == 0
    assert "vision 0:16 idle" in text["maestro_plan_short"]
    assert text["ratio"] == pytest.approx(1.0, abs=1e-6)
    assert text["same_as_monolithic"]
    images = sweep.run_point(
        sweep.Point("i", "all images", sweep.VLM, 16, {**small, "data.modalities.image.fraction": 1.0}),
        batches=1,
        split=True,
    )
    assert images["sections"]["vision"]["active_share"] == 1 and images["sections"]["vision"]["flops_share"] > 0
    assert images["ratio"] >= 1 - 1e-9
    assert images["maestro_step_s"] > text["maestro_step_s"], "images add work"
    # the split search keeps each section on devices of its own: at 16 devices of 80 GB the LLM
    # fits only on all of them (`plan` says 83.6 GB for a split), so only co-located plans fit and
    # a split search that let one in would report it
    assert images["split_step_s"] is None and images["split_plan_short"] == "no split plan fits", images
