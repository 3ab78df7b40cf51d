"""Distillation over the teacher's top-k tokens (`distill.top_k`, `kd.sparse_kl`): the KL of both
distributions coarsened to the teacher's k likeliest tokens and one outcome for the rest of the
vocabulary, what a teacher cache holds; online here, from the live teachers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ROOT, TINY_KD
from test_teachers import _by_hand, _coarsened_kl, two

from maestro_jax.config import load_config
from maestro_jax.runtime.build import build_runtime
from maestro_jax.tools.verify import verify
from maestro_jax.workloads.kd import sparse_kl, top_k_of


def test_sparse_kl_is_the_kl_over_k_plus_one_outcomes_and_at_most_the_full_one():
    """Against the coarsened KL in float64 numpy: equal for every k; never above the full
    vocabulary's KL; equal to it when the tail is a single token (k = vocab - 1)."""
    rng = np.random.default_rng(0)
    vocab = 40
    t_logp, s_logp = (jax.nn.log_softmax(jnp.asarray(rng.normal(0, 3, (6, vocab)), jnp.float32)) for _ in range(2))
    p, q = np.exp(np.asarray(t_logp, np.float64)), np.exp(np.asarray(s_logp, np.float64))
    full = np.sum(p * np.log(p / q), -1)
    for k in (1, 4, 16, vocab - 1):
        got = np.asarray(sparse_kl(top_k_of(t_logp, k), s_logp))
        np.testing.assert_allclose(got, _coarsened_kl(p, q, k), rtol=1e-4, atol=1e-6)
        assert np.all(got <= full + 1e-5), k
    np.testing.assert_allclose(np.asarray(sparse_kl(top_k_of(t_logp, vocab - 1), s_logp)), full, rtol=1e-4)
    tail = np.asarray(top_k_of(t_logp, 4).log_tail)
    np.testing.assert_allclose(np.exp(tail), 1 - np.sort(p, -1)[:, -4:].sum(-1), rtol=1e-4)


# slow: its parts stay quick, test_a_top_k_step_matches_the_monolithic_step and
# test_teachers.py::test_the_loss_is_the_weighted_mean_of_the_teachers_distributions_by_hand
@pytest.mark.slow
def test_the_top_k_loss_of_two_mixed_teachers_is_the_one_by_hand():
    """`distill.top_k: 8` with two teachers mixed 2:1: the step's loss is the one computed by hand
    from whole models, the KL over the mixture's 8 likeliest tokens and the rest, and it is below the
    full vocabulary's loss on the same batch (the coarsened KL is never more)."""
    cfg = two("distill.top_k=8")
    rt = build_runtime(cfg)
    state, samples = rt.step.init(), rt.batches()[0]
    loss = float(rt.step.evaluate(state, samples))
    host = {s: jax.device_get(st) for s, st in state.sections.items()}
    assert loss == pytest.approx(_by_hand(cfg, host, samples), rel=1e-5)
    assert loss < _by_hand(two(), host, samples)


@pytest.mark.parametrize("scheduler", ["wavefront", pytest.param("naive", marks=pytest.mark.slow)])
def test_a_top_k_step_matches_the_monolithic_step(scheduler):
    """kd_tiny with `distill.top_k: 16`: the sectioned step's loss, gradient norm, the student's
    gradients and updated parameters equal the monolithic step's."""
    cfg = load_config(
        ROOT / "configs" / "kd_tiny.yaml", [*TINY_KD, "distill.top_k=16", f"schedule.scheduler={scheduler}"]
    )
    diffs = verify(cfg)
    assert {d.name for d in diffs} == {"loss", "grad_norm", "student/grads", "student/params_after_update"}
    assert all(d.max_rel < 1e-5 for d in diffs), diffs
