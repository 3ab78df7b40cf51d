"""The step as one object (`runtime/step.py`): `step(state, batch) -> (state, metrics)`.

The plan's step and the monolithic one take the same state and batch and give the same numbers;
the state is a pytree that carries the step number; the metrics are read once, with the names the
docs give (`docs/training.md`, `docs/configuration.md`); and no file outside `runtime/step.py`
assembles a step from the executor's parts."""

import re

import jax
import numpy as np
import pytest
from conftest import ROOT, TINY_KD

from maestro_jax.config import load_config
from maestro_jax.runtime.build import build_runtime
from maestro_jax.runtime.step import MonolithicStep, SectionedStep, StepBatch, TrainState
from maestro_jax.tools.verify import compare


@pytest.fixture(scope="module")
def kd():
    return build_runtime(load_config(ROOT / "configs/kd_tiny.yaml", [*TINY_KD, "optimizer.clip_norm=0.5"]))


def test_the_sectioned_and_the_monolithic_step_are_one_interface_with_one_answer(kd):
    """Two steps of each from step 0: the same state numbers, loss, metrics' names and values
    (KD's `kl` and `ce` included), and updated parameters (1e-5)."""
    steps = {"sectioned": kd.step, "monolithic": kd.monolithic.step}
    assert isinstance(steps["sectioned"], SectionedStep) and isinstance(steps["monolithic"], MonolithicStep)
    records, params = {}, {}
    for name, step in steps.items():
        state = step.init()
        assert isinstance(state, TrainState) and state.step == 0
        for samples in kd.batches()[:2]:
            state, metrics = step(state, samples)
            assert not metrics.was_read  # issued: nothing waited for yet
            records.setdefault(name, []).append(step.read(metrics))
        assert state.step == 2 and [r["step"] for r in records[name]] == [1, 2]
        params[name] = state["student"].params
    keys = {"step", "train/loss", "train/grad_norm", "train/grad_norm/student", "train/lr/student"}
    keys |= {"train/student/kl", "train/student/ce"}
    for name in steps:
        assert keys <= set(records[name][0]), (name, sorted(records[name][0]))
    for a, b in zip(records["sectioned"], records["monolithic"]):
        for k in keys - {"step"}:
            assert a[k] == pytest.approx(b[k], rel=1e-5), k
        assert a["train/loss"] == pytest.approx(0.5 * 4 * a["train/student/kl"] + 0.5 * a["train/student/ce"], rel=1e-5)
    assert records["sectioned"][0]["train/grad_norm"] > 0.5  # clipping is on in both
    assert compare("student", params["sectioned"], params["monolithic"]).max_rel <= 1e-5


def test_the_state_is_a_pytree_that_carries_the_step(kd):
    state = kd.step.init()
    leaves = jax.tree.leaves(state)
    assert len(leaves) == len(
        jax.tree.leaves({s: (st.params, st.consts, st.opt_state) for s, st in state.sections.items()})
    )
    later = jax.tree.map(lambda x: x, TrainState(7, state.sections))
    assert later.step == 7 and isinstance(later, TrainState)  # the step number is the tree's static part
    new, _ = kd.step(later, StepBatch(kd.batches()[0]))
    assert new.step == 8


def test_gradients_then_apply_is_the_step(kd):
    """The step's halves (what `verify` compares) give the step's own parameters, bit for bit."""
    step = kd.step
    state, samples = step.init(), kd.batches()[0]
    whole, metrics = step(state, samples)
    loss, grads, _ = step.gradients(state, samples)
    halves = step.apply(state, grads)
    assert float(loss) == float(metrics.loss) and halves.step == whole.step == 1
    for a, b in zip(jax.tree.leaves(halves["student"].params), jax.tree.leaves(whole["student"].params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


ASSEMBLED = re.compile(r"\.(executor|model)\.update\(|\bissue_step\(|\btrain_step\(")


def test_no_step_is_assembled_outside_the_step_module():
    """An optimizer update issued from the executor's or the monolithic model's parts anywhere but
    `runtime/step.py`: a second way to make a step, which would drift from the first."""
    found = []
    for folder in ("maestro_jax", "scripts", "tests", "examples"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path == ROOT / "maestro_jax/runtime/step.py" or path == ROOT / "tests/test_step.py":
                continue
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if ASSEMBLED.search(line):
                    found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not found, "\n".join(found)
