"""NaN/inf is detected per section: the step is skipped (state untouched) or the run stops."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ROOT, TINY_VLM

from maestro_jax.config import load_config
from maestro_jax.runtime.build import build_runtime
from maestro_jax.runtime.programs import SectionState
from maestro_jax.runtime.step import NonFiniteError, SectionedStep, TrainState


@pytest.fixture(scope="module")
def setup():
    cfg = load_config(ROOT / "configs/vlm_tiny.yaml", TINY_VLM + ["data.modalities.image.fraction=1.0"])
    rt = build_runtime(cfg)
    states = rt.init_states()
    # a real fault: one vision weight becomes NaN (as after an overflow); vision and llm grads go NaN
    v = states["vision"]
    params = jax.tree.map(lambda x: x, v.params)
    params["patch_embed"]["kernel"] = params["patch_embed"]["kernel"].at[0, 0].set(jnp.nan)
    poisoned = {**states, "vision": SectionState(params, v.consts, v.opt_state)}
    return rt, states, poisoned


def test_stop_names_step_and_sections(setup):
    rt, _, poisoned = setup
    step = SectionedStep(rt, on_nonfinite="stop")
    new, metrics = step(TrainState(2, poisoned), rt.batches()[0])  # issued at once, raised when read
    assert new.step == 3
    with pytest.raises(NonFiniteError, match=r"step 3: non-finite .* section\(s\) llm \(loss\), vision"):
        step.read(metrics)


def test_skip_leaves_state_untouched(setup):
    rt, _, poisoned = setup
    new, metrics = SectionedStep(rt, on_nonfinite="skip")(TrainState(4, poisoned), rt.batches()[0])
    rec = metrics.read(rt.coordinator.fetch)
    assert new.step == 5 and rec["step"] == 5
    assert rec["skipped_nonfinite"] == ["llm (loss)", "vision"] and rec["wait_reason"] == "on_nonfinite=skip"
    for s in poisoned:
        for a, b in zip(jax.tree.leaves(new[s].params), jax.tree.leaves(poisoned[s].params)):
            assert a is b


def test_healthy_step_updates(setup):
    rt, states, _ = setup
    step = SectionedStep(rt, on_nonfinite="stop")
    new, metrics = step(TrainState(0, states), rt.batches()[0])
    rec = step.read(metrics)
    assert "skipped_nonfinite" not in rec and np.isfinite(rec["train/loss"])
    a, b = jax.tree.leaves(new["llm"].params)[0], jax.tree.leaves(states["llm"].params)[0]
    assert not np.array_equal(np.asarray(a), np.asarray(b))
