"""The step as one object (`runtime/step.py`): `step(state, batch) -> (state, metrics)`.

The plan's step and the monolithic one take the same state and batch and give the same numbers;
the state is a pytree that carries the step number; the metrics are read once, with the names the
docs give (`docs/training.md`, `docs/configuration.md`); and no file outside `runtime/step.py`
assembles a step from the executor's parts."""

import dataclasses
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


def test_both_steps_implement_one_protocol_with_the_same_signatures_and_types(kd):
    """Every method of `Step` is on both steps with its signature; `gradients` gives both the
    executor's `StepResult` third (the sink's metrics and the loss normaliser); what the monolithic
    step cannot offer raises `StepUnsupported` naming the method."""
    import inspect

    from maestro_jax.runtime.executor import StepResult
    from maestro_jax.runtime.step import Step, StepUnsupported

    methods = [m for m in vars(Step) if not m.startswith("_") or m == "__call__"]
    assert {"gradients", "apply", "compile", "run_ahead", "evaluate", "timeline"} <= set(methods)
    for cls in (SectionedStep, MonolithicStep):
        for m in methods:
            want = list(inspect.signature(getattr(Step, m)).parameters)
            assert list(inspect.signature(getattr(cls, m)).parameters) == want, (cls.__name__, m)
    samples = kd.batches()[0]
    results = {}
    for step in (kd.step, kd.monolithic.step):
        loss, _, result = step.gradients(step.init(), samples)
        assert isinstance(result, StepResult) and set(result.metrics) == {"kl", "ce"}
        results[type(step).__name__] = (float(loss), result.norm, float(result.metrics["kl"]))
    (a_loss, a_norm, a_kl), (b_loss, b_norm, b_kl) = results.values()
    assert a_norm == b_norm > 1 and a_loss == pytest.approx(b_loss, rel=1e-5) and a_kl == pytest.approx(b_kl, rel=1e-5)
    state = kd.monolithic.step.init()
    for call in (
        lambda s: s.compile(range(1)),
        lambda s: s.run_ahead(state, samples),
        lambda s: s.timeline(state, samples),
        lambda s: s.memory_analysis(),
        lambda s: s.abstract_state(),
    ):
        with pytest.raises(StepUnsupported, match=r"^MonolithicStep\.\w+: .*SectionedStep offers it"):
            call(kd.monolithic.step)


def test_the_monolithic_update_clips_with_the_norms_it_is_given(kd):
    """`apply(state, grads, norms_sq)`: global-norm clipping (0.5 here) reads the given squared
    norms (the step's own, once), as the sectioned update does: the same update as without them,
    and another one from other norms."""
    step = kd.monolithic.step
    state = step.init()
    _, grads, _ = step.gradients(state, kd.batches()[0])
    norms = step.squared_norms(grads)
    plain, given = step.apply(state, grads), step.apply(state, grads, norms)
    assert compare("student", plain["student"].params, given["student"].params).max_rel == 0.0
    doubled = step.apply(state, grads, {s: 4 * v for s, v in norms.items()})  # a norm twice as large
    assert compare("student", plain["student"].params, doubled["student"].params).max_rel > 1e-6


def test_a_steps_metrics_are_read_in_one_transfer(kd, monkeypatch):
    """`read` fetches the step's device values (loss, norms, rates, the sink's metrics, the
    finiteness flags) as one pytree: one `jax.device_get` through `Coordinator.fetch_all`, and
    the record is the one a read value by value gives."""
    step = kd.step
    _, metrics = step(step.init(), kd.batches()[0])
    twin = dataclasses.replace(metrics)
    calls, real = [], jax.device_get

    def counted(tree):
        calls.append(len(jax.tree.leaves(tree)))
        return real(tree)

    monkeypatch.setattr(jax, "device_get", counted)
    record = step.read(metrics)
    # loss; student's norm, rate and finiteness; KD's kl and ce
    assert calls == [6], calls
    monkeypatch.setattr(jax, "device_get", real)
    by_value = twin.read(kd.coordinator.fetch)  # 0.3.0's read: one value at a time
    assert by_value.keys() == record.keys()
    assert all(by_value[k] == record[k] for k in record if not k.endswith("_s")), (by_value, record)


def test_each_section_starts_from_the_graphs_init_traced_once(kd):
    """`runtime.initial.TracedInit`: the graph's `init` is traced once; each section's program (and
    the monolithic reference's one program for all) evaluates that trace. Every variable equals
    `graph.init`'s own, run eagerly, on both sides (to float rounding: XLA may fuse the compiled
    programs' arithmetic otherwise; bit for bit on jax 0.12), and so do the shapes it reports."""
    import flax.linen as nn

    key = jax.random.key(kd.cfg.seed)
    eager = nn.meta.unbox(kd.graph.init(key))
    sectioned, monolithic = kd.init_states(), kd.monolithic.init_states()
    assert set(sectioned) == set(monolithic) == set(eager) == set(kd.graph.names)
    for s in kd.graph.names:
        for state in (sectioned[s], monolithic[s]):
            got_tree = {"params": state.params, "consts": state.consts}
            assert jax.tree.structure(got_tree) == jax.tree.structure(eager[s])
            for got, want in zip(jax.tree.leaves(got_tree), jax.tree.leaves(eager[s]), strict=True):
                np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-9)
    shapes = jax.eval_shape(kd.graph.init, key)
    assert jax.tree.map(lambda a: (a.shape, a.dtype), shapes) == jax.tree.map(
        lambda a: (a.shape, a.dtype), kd.traced_init.abstract
    )
    assert monolithic["teacher"].opt_state is None  # frozen: no optimizer state on either side
    assert sectioned["teacher"].opt_state is None
    for got, want in zip(
        jax.tree.leaves(monolithic["student"].opt_state), jax.tree.leaves(sectioned["student"].opt_state), strict=True
    ):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-9)


def test_the_reference_starts_from_the_sectioned_steps_own_weights(kd):
    """`MonolithicStep.start_from` (what `verify` starts the reference from): each section's params
    and constants are the sectioned state's values, now on the monolithic mesh in the reference's
    own shardings, and a trained section's optimizer state is the one `init` gives there; moved
    weights that differ from the initialisation (as pretrained ones do) are kept, not drawn again."""
    from maestro_jax.runtime.stages import whole_states

    sectioned = kd.step.init()
    moved = jax.tree.map(lambda x: x + 1.0, sectioned.sections["student"].params)  # not what init draws
    sections = dict(sectioned.sections, student=dataclasses.replace(sectioned.sections["student"], params=moved))
    state = kd.monolithic.step.start_from(whole_states(kd.graph, kd.programs, sections))
    fresh = kd.monolithic.step.init()
    assert state.step == 0 and set(state.sections) == set(kd.graph.names)
    for s in kd.graph.names:
        got, want = state.sections[s], sections[s]
        for a, b in zip(jax.tree.leaves(got.variables), jax.tree.leaves(want.variables), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        for a, b in zip(jax.tree.leaves(got.variables), jax.tree.leaves(fresh.sections[s].variables), strict=True):
            assert a.sharding == b.sharding
    for a, b in zip(
        jax.tree.leaves(state.sections["student"].opt_state),
        jax.tree.leaves(fresh.sections["student"].opt_state),
        strict=True,
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert state.sections["teacher"].opt_state is None


def test_the_sectioned_step_holds_a_frozen_view_of_its_runtime_not_the_runtime(kd):
    """`SectionedStep` keeps a `RuntimeView` (the graph, programs, executor, coordinator, shapes,
    layouts and the runtime's four functions it calls), frozen, and never the `Runtime` itself;
    a step built from the view alone gives the runtime's step's loss to the bit, and `rt` still
    reads (as the view) for a version."""
    from maestro_jax.runtime.step import RuntimeView

    step = kd.step
    assert isinstance(step.view, RuntimeView) and step.rt is step.view
    assert not any(value is kd for value in vars(step).values())
    assert not any(value is kd for value in vars(step.view).values())
    with pytest.raises(dataclasses.FrozenInstanceError):
        step.view.programs = {}
    assert (step.view.graph, step.view.executor, step.view.programs) == (kd.graph, kd.executor, kd.programs)
    batch = kd.batches()[0]
    state = kd.step.init()
    alone = SectionedStep(RuntimeView.of(kd))
    assert float(alone.gradients(state, batch)[0]) == float(step.gradients(state, batch)[0])
