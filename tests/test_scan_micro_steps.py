"""`compile.scan_micro_steps`: a frozen producer's forwards and the sink's loss-and-grad over
consecutive micro-steps of one shape run as one scanned program (one launch instead of k). The
scanned programs equal their micro-steps one by one; a step issued that way is the step issued one
launch each (and the monolithic step), launches fewer programs, and finds every one of them
compiled ahead; run-ahead work scans too."""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ROOT, TINY_KD, TINY_VLM

from maestro_jax.config import load_config
from maestro_jax.runtime.build import build_runtime
from maestro_jax.runtime.programs import SectionPrograms, scanned_forward, scanned_loss_and_grad
from maestro_jax.runtime.step import StepBatch
from maestro_jax.tools.verify import compare


def _forward(variables, inputs, batch):
    return {"out": jnp.tanh(batch["x"] @ variables["w"]) + (0 if inputs is None else inputs["y"][0])}


def _loss_and_grad(variables, inputs, batch, norm, acc):
    def loss(w, y):
        out = _forward({"w": w}, {"y": (y,)}, batch)["out"]
        return jnp.sum(out**2) / norm, {"rows": jnp.float32(out.shape[0])}

    (value, metrics), (g, dy) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(variables["w"], inputs["y"][0])
    return value, metrics, acc + g, {"y": (dy,)}


def test_scanned_programs_equal_their_micro_steps_one_by_one():
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((4, 3)), jnp.float32)
    batches = tuple({"x": jnp.asarray(rng.standard_normal((2, 4)), jnp.float32)} for _ in range(3))
    inputs = tuple({"y": (jnp.asarray(rng.standard_normal((2, 3)), jnp.float32),)} for _ in range(3))
    outs = jax.jit(scanned_forward(_forward))({"w": w}, inputs, batches)
    for out, i, b in zip(outs, inputs, batches, strict=True):
        np.testing.assert_allclose(out["out"], _forward({"w": w}, i, b)["out"], rtol=1e-6)

    losses, metrics, acc, d_inputs = jax.jit(scanned_loss_and_grad(_loss_and_grad))(
        {"w": w}, inputs, batches, 4.0, jnp.zeros_like(w)
    )
    one_acc = jnp.zeros_like(w)
    for k, (i, b) in enumerate(zip(inputs, batches, strict=True)):
        loss, m, one_acc, d = _loss_and_grad({"w": w}, i, b, 4.0, one_acc)
        np.testing.assert_allclose(losses[k], loss, rtol=1e-6)
        np.testing.assert_allclose(d_inputs[k]["y"][0], d["y"][0], rtol=1e-6)
        assert float(metrics[k]["rows"]) == float(m["rows"])
    np.testing.assert_allclose(acc, one_acc, rtol=1e-6)


def _launches(monkeypatch) -> collections.Counter:
    """Every program a step launches, by kind (the abstract twin's visits are not launches)."""
    counts, call = collections.Counter(), SectionPrograms._call

    def counted(self, kind, key, *args):
        if self.dry is None:
            counts[self.name, kind] += 1
        return call(self, kind, key, *args)

    monkeypatch.setattr(SectionPrograms, "_call", counted)
    return counts


def _step(config, overrides, scan, monkeypatch):
    """Step 1's loss, grads and launches with `compile.scan_micro_steps=scan`, compiled ahead first."""
    cfg = load_config(ROOT / f"configs/{config}.yaml", [*overrides, f"compile.scan_micro_steps={scan}"])
    rt = build_runtime(cfg)
    rt.step.compile(range(1), say=lambda _: None)
    launches = _launches(monkeypatch)
    loss, grads, _ = rt.step.gradients(rt.step.init(), rt.batches()[0])
    monkeypatch.undo()
    lazily = [(s, k) for s, prog in rt.programs.items() for (k, _), entry in prog.cache.items() if entry.lazily]
    return rt, loss, grads, launches, lazily


@pytest.mark.slow
@pytest.mark.parametrize(
    ("config", "overrides", "scheduler", "scanned"),
    [
        ("kd_tiny", TINY_KD, "wavefront", {("teacher", "forward_run"), ("student", "loss_and_grad_run")}),
        pytest.param(
            "vlm_tiny", TINY_VLM, "wavefront", {("llm", "loss_and_grad_run")}, marks=pytest.mark.extended
        ),  # a trained producer never scans
    ],
)
def test_a_scanned_step_is_the_step_issued_one_launch_each(config, overrides, scheduler, scanned, monkeypatch):
    overrides = [*overrides, f"schedule.scheduler={scheduler}"]
    rt, loss, grads, launches, lazily = _step(config, overrides, 4, monkeypatch)
    _, one_loss, one_grads, one_launches, _ = _step(config, overrides, 1, monkeypatch)
    assert {key for key in launches if key[1].endswith("_run")} == scanned
    assert not any(kind.endswith("_run") for _, kind in one_launches)
    assert sum(launches.values()) < sum(one_launches.values())
    assert lazily == [], "every scanned program was compiled ahead"
    assert compare("loss", loss, one_loss).max_rel <= 1e-6
    for s in grads:
        assert compare(s, grads[s], one_grads[s]).max_rel <= 1e-6
    mono = rt.monolithic.step
    m_loss, m_grads, _ = mono.gradients(mono.init(), rt.batches()[0])
    assert compare("loss", loss, m_loss).max_rel <= 1e-5
    for s in grads:
        assert compare(s, grads[s], m_grads[s]).max_rel <= 1e-5


@pytest.mark.slow
def test_run_ahead_work_scans_and_feeds_the_step_it_would_compute_itself():
    cfg = load_config(ROOT / "configs/kd_tiny.yaml", [*TINY_KD, "schedule.run_ahead=1", "compile.scan_micro_steps=4"])
    rt = build_runtime(cfg)
    step, batches = rt.step, rt.batches()
    state = step.init()
    ahead = step.run_ahead(state, batches[1])
    assert "forward_run" in {k for k, _ in rt.programs["teacher"].cache}
    fed_loss, fed, _ = step.gradients(state, StepBatch(batches[1], ahead=ahead))
    plain_loss, plain, _ = step.gradients(state, batches[1])
    assert compare("loss", fed_loss, plain_loss).max_rel <= 1e-6
    assert compare("student", fed["student"], plain["student"]).max_rel <= 1e-6
