"""Mixed precision per section: bf16 compute with float32 master weights (trained) or bf16
weights only (frozen); maestro against the same-precision monolithic step."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ROOT, TINY_KD, TINY_VLM, first_forward

from maestro_jax.config import load_config
from maestro_jax.core.graph import UnitCost
from maestro_jax.core.plan import ParamInfo, SectionPlan, mesh_shape
from maestro_jax.planning.layout import section_memory
from maestro_jax.planning.spec import SectionSpec
from maestro_jax.runtime.build import build_runtime
from maestro_jax.tools.verify import compare, verify

BF16_VLM = TINY_VLM + ["sections.vision.precision=bfloat16", "sections.llm.precision=bfloat16"]


@pytest.mark.slow
def test_bf16_maestro_matches_bf16_monolithic_closer_than_float32_does():
    """Reordering rows (maestro's micro-batching) moves bf16 results by less than bf16 itself
    moves them from float32, and by less than the stated tolerance (Config.verify_tolerance)."""
    cfg = load_config(ROOT / "configs/vlm_tiny.yaml", BF16_VLM)
    assert cfg.verify_tolerance == 2e-2
    rt16, rt32 = build_runtime(cfg), build_runtime(load_config(ROOT / "configs/vlm_tiny.yaml", TINY_VLM))
    diffs = {d.name: d.max_rel for d in verify(cfg, rt16)}
    assert all(v <= cfg.verify_tolerance for v in diffs.values()), diffs

    samples = rt16.batches()[0]
    m16, m32 = rt16.monolithic.step, rt32.monolithic.step
    loss16, grads16, _ = m16.gradients(m16.init(), samples)
    loss32, grads32, _ = m32.gradients(m32.init(), samples)
    for s in ("vision", "llm"):
        precision_error = compare(s, grads16[s], grads32[s]).max_rel
        assert diffs[f"{s}/grads"] < precision_error, (s, diffs[f"{s}/grads"], precision_error)
    assert abs(float(loss16) - float(loss32)) > 0  # bf16 really ran


@pytest.mark.slow
def test_bf16_dtypes_master_weights_frozen_weights_and_edges():
    overrides = TINY_KD + ["sections.teacher.precision=bfloat16", "sections.student.precision=bfloat16"]
    cfg = load_config(ROOT / "configs/kd_tiny.yaml", overrides)
    rt = build_runtime(cfg)
    states = rt.step.init()
    floats = lambda tree: {x.dtype for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)}
    assert floats(states["teacher"].consts) == {jnp.dtype(jnp.bfloat16)}  # frozen: bf16 only
    assert floats(states["student"].params) == {jnp.dtype(jnp.float32)}  # master weights
    assert floats(states["student"].opt_state) == {jnp.dtype(jnp.float32)}
    out = first_forward(rt, states, "teacher")
    assert {v.dtype for v in out.values()} == {jnp.dtype(jnp.bfloat16)}  # edges carry bf16: half the bytes
    loss, grads, _ = rt.step.gradients(states, rt.batches()[0])
    assert loss.dtype == jnp.float32 and np.isfinite(float(loss))
    assert floats(grads["student"]) == {jnp.dtype(jnp.float32)}


@pytest.mark.parametrize("trained", [True, False])
def test_memory_model_halves_bf16_activations_and_frozen_weights(trained):
    weights = (ParamInfo("w", (1024, 1024), ("embed", "mlp"), 4),)
    spec = SectionSpec(
        "s",
        trained,
        weights if trained else (),
        UnitCost(flops=1.0, width=1024, layer_bytes=4096, layers=4),
        () if trained else weights,
    )
    f32 = section_memory(spec, SectionPlan((0,), mesh_shape(), 2), False, 64, 2)
    b16 = section_memory(spec, SectionPlan((0,), mesh_shape(), 2, precision="bfloat16"), False, 64, 2)
    assert b16["activations"] == pytest.approx(f32["activations"] / 2)
    w = 1024 * 1024 * 4
    # trained: float32 master, grads and two moments, plus a bf16 compute copy; frozen: bf16 only
    assert (f32["state"], b16["state"]) == ((4 * w, 4.5 * w) if trained else (w, w / 2))


@pytest.mark.slow
def test_layer_remat_changes_nothing_in_the_results():
    """Per-layer activation checkpointing (`full` in the ViT, `dots` in the LLM) recomputes
    what it does not keep: the same loss and grads as keeping everything, within float32
    rounding. (What it saves is the memory model's business: the test below and
    test_planner's comparison with XLA's memory analysis.)"""
    overrides = TINY_VLM + ["sections.vision.layer_remat=full", "sections.llm.layer_remat=dots"]
    plain, checkpointed = (build_runtime(load_config(ROOT / "configs/vlm_tiny.yaml", o)) for o in (TINY_VLM, overrides))
    state = plain.step.init()
    samples = plain.batches()[0]
    a_loss, a, _ = plain.step.gradients(state, samples)
    b_loss, b, _ = checkpointed.step.gradients(state, samples)
    assert compare("loss", a_loss, b_loss).max_rel <= 1e-6
    assert all(compare(s, a[s], b[s]).max_rel <= 1e-5 for s in a)


def test_memory_model_layer_remat_keeps_less():
    spec = SectionSpec(
        "s",
        True,
        (ParamInfo("w", (64, 64), ("embed", "mlp"), 4),),
        UnitCost(flops=1.0, width=64, layer_bytes=6 * 64 * 4, layer_bytes_sharded=3 * 256 * 4, layers=8),
    )
    act = {
        r: section_memory(spec, SectionPlan((0,), mesh_shape(), 2, layer_remat=r), False, 64, 3)["activations"]
        for r in ("none", "dots", "full")
    }
    assert act["none"] > act["dots"] > act["full"]
