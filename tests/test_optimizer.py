"""The optimizer as users configure it: a warm-up then cosine schedule, clipping by the global
gradient norm over every trained section (sections on different meshes), a weight-decay mask and
a lower rate for the vision tower. The step equals the monolithic step (loss, grads, the clipped
global norm, the updated params) under both schedulers; the logged rates follow the schedule;
frozen parameters (`freeze`) get no update and no share of the clip norm, alike in both; bad
settings are refused before any compute."""

import json
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import yaml
from conftest import ROOT, TINY_KD, TINY_VLM

from maestro_jax.config import ConfigError, LRScheduleConfig, OptimizerConfig, load_config
from maestro_jax.runtime.build import build_runtime
from maestro_jax.runtime.optimizer import learning_rate, param_path, section_optimizer
from maestro_jax.tools.verify import verify
from maestro_jax.training.loop import train

VLM = ROOT / "configs/vlm_tiny.yaml"
CLIP = 1e-3  # far below the tiny models' gradient norm: every step clips
USER = TINY_VLM + [
    "optimizer.learning_rate=0.01",
    "optimizer.weight_decay=0.1",
    "optimizer.lr_schedule={kind: cosine, warmup_steps: 2, decay_steps: 6, final_fraction: 0.1}",
    f"optimizer.clip_norm={CLIP}",
    "optimizer.sections={vision: {learning_rate: 0.001}}",
]


@pytest.mark.slow
@pytest.mark.parametrize("scheduler", ["naive", "wavefront"])
def test_clipped_scheduled_step_equals_the_monolithic_step(scheduler):
    cfg = load_config(VLM, USER + [f"schedule.scheduler={scheduler}"])
    diffs = {d.name: d for d in verify(cfg)}
    assert {"vision/params_after_update", "llm/params_after_update", "grad_norm"} <= set(diffs)
    for d in diffs.values():
        assert d.max_rel < 1e-5, d
    # the norm clipping reads is the model's, over both sections' grads: clipping is on
    rt = build_runtime(cfg)
    samples = rt.batches()[0]
    _, grads, _ = rt.step.gradients(rt.step.init(), samples)
    norms = {s: float(n[0]) for s, n in rt.step.squared_norms(grads).items()}
    whole = sum(float(jnp.sum(jnp.square(x))) for g in grads.values() for x in jax.tree.leaves(g))
    assert set(norms) == {"vision", "llm"} and all(n > 0 for n in norms.values())
    assert sum(norms.values()) == pytest.approx(whole, rel=1e-5)
    assert math.sqrt(whole) > 10 * CLIP


@pytest.mark.slow
def test_clipping_changes_the_update():
    """The same step with and without clipping moves the params differently (clipping is not a no-op)."""
    moved = {}
    for clip in (CLIP, None):
        overrides = [o for o in USER if not o.startswith("optimizer.clip_norm")]
        cfg = load_config(VLM, overrides + ([f"optimizer.clip_norm={clip}"] if clip else []))
        rt = build_runtime(cfg)
        states = rt.step.init()
        new, _ = rt.step(states, rt.batches()[0])
        moved[clip] = np.concatenate(
            [
                np.ravel(np.asarray(a) - np.asarray(b))
                for a, b in zip(jax.tree.leaves(new["llm"].params), jax.tree.leaves(states["llm"].params))
            ]
        )
    assert not np.allclose(moved[CLIP], moved[None])


def _paths(tree) -> dict:
    return {param_path(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(tree)}


TOWER = "'(?!merger_).*'"  # the vision section but its projector (merger_fc1, merger_fc2)
PARTS = "[embedding, 'block_0/(q|k)/.*']"  # the LLM's embedding and first queries and keys


@pytest.mark.slow
@pytest.mark.parametrize(
    "scheduler,llm_freeze,llm_frozen",
    [
        ("naive", PARTS, lambda p: p == "embedding" or p.startswith(("block_0/q/", "block_0/k/"))),
        ("wavefront", "['.*']", lambda p: True),  # the whole LLM: its share of the clip norm is 0
    ],
)
def test_frozen_parameters_match_the_monolithic_step_and_stay_put(scheduler, llm_freeze, llm_frozen):
    """A frozen tower and frozen LLM parts (or the whole LLM): maestro's step equals the
    monolithic one (clipping on), the frozen parameters keep their values, the rest moves, and
    the clip norm is the norm of the trained parameters' gradients only."""
    sections = (
        f"optimizer.sections={{vision: {{learning_rate: 0.001, freeze: [{TOWER}]}}, llm: {{freeze: {llm_freeze}}}}}"
    )
    cfg = load_config(VLM, USER + [sections, f"schedule.scheduler={scheduler}"])
    diffs = {d.name: d for d in verify(cfg)}
    assert {"vision/params_after_update", "llm/params_after_update", "grad_norm"} <= set(diffs)
    for d in diffs.values():
        assert d.max_rel < 1e-5, d
    rt = build_runtime(cfg)
    states = rt.step.init()
    samples = rt.batches()[0]
    _, grads, _ = rt.step.gradients(states, samples)
    new = rt.step.apply(states, grads)
    frozen = {"vision": lambda p: not p.startswith("merger_"), "llm": llm_frozen}
    kept_sq = 0.0
    for s in ("vision", "llm"):
        before, after, g = _paths(states[s].params), _paths(new[s].params), _paths(grads[s])
        assert any(frozen[s](p) for p in before)
        for p in before:
            if frozen[s](p):
                np.testing.assert_array_equal(after[p], before[p], err_msg=p)
                assert np.any(g[p] != 0), p  # frozen by the optimizer, not by a zero gradient
            else:
                assert not np.allclose(after[p], before[p]), p
                kept_sq += float(np.sum(np.square(g[p], dtype=np.float64)))
    norms = rt.step.squared_norms(grads)
    assert sum(float(n[0]) for n in norms.values()) == pytest.approx(kept_sq, rel=1e-5)
    assert math.sqrt(kept_sq) > 10 * CLIP  # clipping is on


def test_a_frozen_parameter_has_no_optimizer_state_and_no_weight_decay():
    params = {"tower": {"kernel": jnp.ones((3, 2))}, "head": {"kernel": jnp.ones((3, 2))}}
    cfg = OptimizerConfig(learning_rate=0.5, weight_decay=0.1, sections={"vision": {"freeze": ["tower/.*"]}})
    opt = section_optimizer(cfg, "vision", 10)
    state = opt.init(params)
    moments = [x for x in jax.tree.leaves(state) if getattr(x, "shape", ()) == (3, 2)]
    assert len(moments) == 2  # Adam's mu and nu for the head alone
    zero = jax.tree.map(jnp.zeros_like, params)  # zero grads: only weight decay could move anything
    new = optax.apply_updates(params, opt.update(zero, state, params)[0])
    np.testing.assert_array_equal(new["tower"]["kernel"], params["tower"]["kernel"])
    assert not np.allclose(new["head"]["kernel"], params["head"]["kernel"])


def expected_rate(peak: float, step: int, warmup: int = 2, end: int = 6, final: float = 0.1) -> float:
    """Update `step` (from 1) uses optax's own warm-up cosine schedule at `step`."""
    return float(optax.warmup_cosine_decay_schedule(0.0, peak, warmup, end, peak * final)(step))


@pytest.mark.slow
def test_logged_rates_and_norms_follow_the_schedule(tmp_path):
    cfg = load_config(VLM, USER + ["steps=7"])
    history = train(cfg, progress=False)
    assert [h["step"] for h in history] == list(range(1, 8))
    for h in history:
        assert h["train/lr/llm"] == pytest.approx(expected_rate(0.01, h["step"]), rel=1e-6), h["step"]
        assert h["train/lr/vision"] == pytest.approx(expected_rate(0.001, h["step"]), rel=1e-6), h["step"]
        parts = math.sqrt(h["train/grad_norm/llm"] ** 2 + h["train/grad_norm/vision"] ** 2)
        assert h["train/grad_norm"] == pytest.approx(parts, rel=1e-6) and h["train/grad_norm"] > CLIP


# slow: a 6-step run; the quick tier holds its parts, test_schedules_by_kind (the same rates from the
# schedule) and test_step.py::test_the_sectioned_and_the_monolithic_step_are_one_interface_with_one_answer
# (KD's kl and ce logged by the step)
@pytest.mark.slow
def test_kd_logs_its_distillation_metrics_and_the_readmes_schedule(tmp_path):
    """kd_tiny, 6 steps under docs/configuration.md's cosine example: `train/lr/student` is 0.005, 0.01,
    0.00868, 0.0055, 0.00232, 0.001 (the peak once, the final rate at update decay_steps), and
    the step logs the sink's own metrics, KD's `student/kl` and `student/ce`, per loss token as
    the loss is, so that loss = alpha T^2 kl + (1 - alpha) ce (alpha 0.5, T 2) step by step."""
    schedule = "optimizer.lr_schedule={kind: cosine, warmup_steps: 2, decay_steps: 6, final_fraction: 0.1}"
    overrides = [*TINY_KD, "steps=6", "optimizer.learning_rate=0.01", schedule, f"output_dir={tmp_path}"]
    train(load_config(ROOT / "configs/kd_tiny.yaml", overrides), progress=False)
    logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rates = [h["train/lr/student"] for h in logged]
    assert rates == pytest.approx([0.005, 0.01, 0.00868198, 0.0055, 0.00231802, 0.001], rel=1e-5)
    for h in logged:
        assert h["train/student/kl"] > 0 and h["train/student/ce"] > 0, h
        assert h["train/loss"] == pytest.approx(
            0.5 * 4 * h["train/student/kl"] + 0.5 * h["train/student/ce"], rel=1e-5
        ), h


def test_weight_decay_skips_norms_and_biases():
    """By role, not rank: a `[heads, head_dim]` attention bias is a bias (Qwen2's q/k/v)."""
    params = {"kernel": jnp.ones((3, 2)), "bias": jnp.ones((4, 2)), "scale": jnp.ones((2,)), "class_embed": jnp.ones(2)}
    zero = jax.tree.map(jnp.zeros_like, params)
    for decay, decayed in (("matrices", {"kernel", "class_embed"}), ("all", set(params))):
        opt = section_optimizer(OptimizerConfig(learning_rate=0.5, weight_decay=0.1, decay=decay), "llm", 10)
        updates, _ = opt.update(zero, opt.init(params), params)
        new = optax.apply_updates(params, updates)
        assert {k for k in params if not np.allclose(new[k], params[k])} == decayed


def test_schedules_by_kind():
    """The rate of update k (counted from 1; the schedule is read at the k - 1 updates applied
    before it) is optax's own schedule at k: the first warm-up update at peak / warmup_steps, the
    peak once, at update warmup_steps, the final rate at update decay_steps (docs/configuration.md, "The optimizer")."""
    cosine = learning_rate(
        0.01, LRScheduleConfig(kind="cosine", warmup_steps=2, decay_steps=6, final_fraction=0.1), 9, ""
    )
    rates = [float(cosine(k - 1)) for k in range(1, 8)]
    assert rates == pytest.approx([0.005, 0.01, 0.00868198, 0.0055, 0.00231802, 0.001, 0.001], rel=1e-5)
    reference = optax.warmup_cosine_decay_schedule(0.0, 0.01, 2, 6, 0.001)
    assert rates == pytest.approx([float(reference(k)) for k in range(1, 8)], rel=1e-6)
    constant = learning_rate(1.0, LRScheduleConfig(warmup_steps=4), 10, "")
    assert [float(constant(k - 1)) for k in range(1, 7)] == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0, 1.0])
    linear = learning_rate(2.0, LRScheduleConfig(kind="linear", warmup_steps=1, decay_steps=5), 10, "")
    assert [float(linear(k - 1)) for k in range(1, 7)] == pytest.approx([2.0, 1.5, 1.0, 0.5, 0.0, 0.0])
    no_warmup = learning_rate(1.0, LRScheduleConfig(kind="cosine", final_fraction=0.5), 4, "")  # over the run
    assert [float(no_warmup(k - 1)) for k in range(1, 6)] == pytest.approx([0.9267767, 0.75, 0.5732233, 0.5, 0.5])


def test_adamw_update_is_optax_adamw_bit_for_bit():
    """Only the rate is injected: b1, b2, eps and the weight decay stay Python floats, as
    optax.adamw takes them (as float32 arrays 1 - b2 rounds otherwise: 6.8e-6 relative)."""
    rng = np.random.default_rng(0)
    params = {"kernel": jnp.asarray(rng.standard_normal((5, 3)), jnp.float32), "embedding": jnp.ones((4, 3))}
    cfg = OptimizerConfig(learning_rate=0.01, weight_decay=0.1, b2=0.95)
    ours, theirs = section_optimizer(cfg, "llm", 10), optax.adamw(0.01, cfg.b1, cfg.b2, cfg.eps, weight_decay=0.1)
    mine, ref = (params, ours.init(params)), (params, theirs.init(params))
    for _ in range(3):
        grads = jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape), jnp.float32), params)
        (p, s), (q, t) = mine, ref
        u, s = ours.update(grads, s, p)
        v, t = theirs.update(grads, t, q)
        mine, ref = (optax.apply_updates(p, u), s), (optax.apply_updates(q, v), t)
    for a, b in zip(jax.tree.leaves(mine[0]), jax.tree.leaves(ref[0]), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_no_bias_or_norm_scale_of_any_built_in_model_is_decayed():
    """Every parameter of the built-in models (LLM with Qwen2's q/k/v biases and MoE experts, the
    SigLIP-style ViT, the Whisper-style audio encoder): zero gradients, one AdamW step with weight
    decay; what moved is exactly what is not a bias or a norm's scale."""
    from maestro_jax.training.trainer import Trainer

    cfg = load_config(
        ROOT / "configs/omni_tiny.yaml",
        [
            "models.llm.qkv_bias=true",
            "models.llm.experts=4",
            "models.llm.experts_per_token=2",
            "models.llm.expert_mlp=8",
        ],
    )
    params = nn.meta.unbox(Trainer(cfg).graph.init(jax.random.key(0)))
    opt = section_optimizer(OptimizerConfig(learning_rate=0.1, weight_decay=0.5), "llm", 10)
    kinds = set()
    for section, variables in params.items():
        tree = variables["params"]
        new = optax.apply_updates(tree, opt.update(jax.tree.map(jnp.zeros_like, tree), opt.init(tree), tree)[0])
        for (path, before), after in zip(jax.tree_util.tree_leaves_with_path(tree), jax.tree.leaves(new), strict=True):
            name = param_path(path).rsplit("/", 1)[-1]
            exempt = name in ("bias", "scale") or name.endswith("_bias")
            kinds.add((name, exempt, np.ndim(before)))
            assert np.array_equal(before, after) == exempt, (section, param_path(path))
    assert ("bias", True, 2) in kinds and ("kernel", False, 3) in kinds  # [heads, head_dim] biases; q/k/v kernels


@pytest.mark.parametrize(
    "override,message",
    [
        ("optimizer.sections={visoin: {learning_rate: 0.001}}", "optimizer.sections.visoin: not a trained section"),
        (
            "optimizer.lr_schedule={kind: cosine, warmup_steps: 8, decay_steps: 8}",
            "optimizer.lr_schedule.decay_steps=8",
        ),
        (
            "optimizer.sections={llm: {freeze: ['block_9/.*']}}",
            "optimizer.sections.llm.freeze='block_9/.\\*': matches no parameter of section 'llm'",
        ),
        (
            "optimizer.sections={llm: {freeze: ['block_(0']}}",
            "optimizer.sections.llm.freeze=.*'block_\\(0'.*not a regular",
        ),
    ],
)
def test_bad_settings_are_refused_before_compute(override, message):
    with pytest.raises(ConfigError, match=message) as err:
        build_runtime(load_config(VLM, TINY_VLM + [override]))
    assert str(err.value).startswith("error: ") and "\n" not in str(err.value)


def test_docs_optimizer_block_is_a_valid_config():
    text = (ROOT / "docs/configuration.md").read_text().split("## The optimizer", 1)[1]
    block = text.split("```yaml", 1)[1].split("```", 1)[0]
    cfg = OptimizerConfig.model_validate(yaml.safe_load(block)["optimizer"])
    assert cfg.clip_norm == 1.0 and cfg.for_section("vision")[0] == 3.0e-5 and cfg.for_section("llm")[0] == 3.0e-4
