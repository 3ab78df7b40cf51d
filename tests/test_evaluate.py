"""The evaluation path (`Executor.evaluate`): a batch's loss forward only, through the training
plan's sections, meshes and schedule; equal to the training step's loss and the monolithic loss;
its programs compiled ahead for batches of another source (`SectionedStep.compile(evaluate=...)`)."""

import jax
import numpy as np
import pytest
from conftest import ROOT, TINY_KD, TINY_VLM, compiles

from maestro_jax import workloads
from maestro_jax.config import load_config
from maestro_jax.data import global_batches
from maestro_jax.runtime.build import build_runtime
from maestro_jax.tools.verify import compare

FORWARD_ONLY = {"forward", "loss", "add", "init_opt"}  # init_opt: the abstract states' optimizer layout


@pytest.mark.parametrize(
    "path,overrides",
    [
        ("vlm_tiny.yaml", TINY_VLM),
        ("kd_tiny.yaml", TINY_KD + ["schedule.scheduler=wavefront", "schedule.run_ahead=1"]),
    ],
    ids=["vlm", "kd-wavefront-run-ahead"],
)
@pytest.mark.slow
def test_evaluate_is_the_training_loss_forward_only(path, overrides):
    cfg = load_config(ROOT / "configs" / path, overrides)
    rt = build_runtime(cfg)
    # held-out batches: another source (the config's data with the next seed), read in order
    eval_source = workloads.source_from_config(cfg.model_copy(update={"seed": cfg.seed + 1}))
    held_out = rt.batch_infos([0, 1], source=eval_source, seed=cfg.seed + 1, shuffle=False)
    said: list[str] = []
    n = rt.step.compile([], said.append, evaluate=[*rt.batch_infos([0]), *held_out])
    assert n > 0 and said[1].startswith(f"compiling {n} programs")
    kinds = {kind for p in rt.programs.values() for kind, _ in p.cache}
    assert kinds <= FORWARD_ONLY and "loss" in kinds  # no vjp, backward, grads nor update

    step = rt.step
    state = step.init()
    samples = rt.batches()[0]
    evals = global_batches(eval_source, cfg.global_batch, cfg.seed + 1, shuffle=False)
    with compiles() as during:  # every evaluation was compiled ahead, from metadata alone
        loss = step.evaluate(state, samples)
        held = [step.evaluate(state, b) for b in (evals[0], evals[1])]
        jax.block_until_ready((loss, held))
    assert during == []
    assert loss.shape == () and all(np.isfinite(float(x)) for x in held)

    state, metrics = step(state, samples)  # the training step (compiled now, lazily)
    assert compare("loss", loss, metrics.loss).max_rel <= 1e-6
    mono = rt.monolithic.step
    assert compare("loss", loss, mono.evaluate(mono.init(), samples)).max_rel <= 1e-6

    # after an update, evaluation follows the new weights and still equals the step's loss
    _, again = step(state, samples)
    assert compare("loss", step.evaluate(state, samples), again.loss).max_rel <= 1e-6
    assert float(again.loss) != float(metrics.loss)
