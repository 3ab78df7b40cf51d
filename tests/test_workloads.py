"""Built-in workloads and the plug-in registry: each is described once (its graph gives the
runtime, the planner and the simulator their shapes and costs), and the new omni and vlm_kd
workloads verify, train, plan and simulate like vlm and kd."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ROOT, TINY_KD, TINY_OMNI, TINY_VLM, TINY_VLM_KD
from maestro_jax.models import AudioConfig, AudioEncoder, DecoderLM, LLMConfig, VisionEncoder, ViTConfig

from maestro_jax import workloads
from maestro_jax.config import ConfigError, load_config
from maestro_jax.tools.verify import verify
from maestro_jax.training.loop import train
from maestro_jax.workloads.costs import audio_cost, llm_cost, vit_cost
from maestro_jax.workloads.omni import frame_groups

CONFIGS = {
    "vlm": ("vlm_tiny.yaml", TINY_VLM),
    "kd": ("kd_tiny.yaml", TINY_KD),
    "omni": ("omni_tiny.yaml", TINY_OMNI),
    "vlm_kd": ("vlm_kd_tiny.yaml", TINY_VLM_KD),
}


def cfg_of(name, *extra):
    file, tiny = CONFIGS[name]
    return load_config(ROOT / "configs" / file, [*tiny, *extra])


def xla_flops(fn, *args) -> float:
    return jax.jit(fn).lower(*args).compile().cost_analysis()["flops"]


@pytest.mark.parametrize("length", [32, 128])
def test_llm_declared_flops_match_xla(length):
    """Within 15%: XLA also counts norms, softmax and the masked half of causal attention
    (computed here, skipped by fused kernels, which is what the declaration prices)."""
    c = LLMConfig(vocab=512, width=128, depth=2, heads=4, kv_heads=2, head_dim=32, mlp=512)
    m, ids, pos, valid = (
        DecoderLM(c),
        jnp.zeros((1, length), jnp.int32),
        jnp.arange(length)[None],
        jnp.ones((1, length), bool),
    )
    params = m.init(jax.random.key(0), ids, pos, valid)
    u = llm_cost(c, head=True)
    ratio = xla_flops(lambda p: m.apply(p, ids, pos, valid), params) / (
        u.flops * length + u.attention_flops * length**2
    )
    assert 1.0 <= ratio <= 1.15


@pytest.mark.parametrize("dispatch", ["dense", "sparse"])
@pytest.mark.parametrize("length", [32, 128])
def test_moe_declared_flops_match_xla(dispatch, length):
    """A mixture-of-experts LLM is priced by what its dispatch runs: every expert on every token
    (dense) or each token's experts_per_token experts (sparse; the tile padding the declaration
    leaves out, up to expert_mlp - 1 rows per expert and layer, is added here). Within 20%: XLA
    also counts the router's softmax and top-k and the sparse dispatch's sorts and scatters.
    `ragged` is not compared: XLA:CPU lowers ragged_dot to a product masked per expert."""
    c = LLMConfig(
        vocab=512,
        width=128,
        depth=2,
        heads=4,
        kv_heads=2,
        head_dim=32,
        mlp=512,
        experts=4,
        experts_per_token=2,
        expert_mlp=32,
        moe_dispatch=dispatch,
    )
    m, ids, pos, valid = (
        DecoderLM(c),
        jnp.zeros((1, length), jnp.int32),
        jnp.arange(length)[None],
        jnp.ones((1, length), bool),
    )
    params = m.init(jax.random.key(0), ids, pos, valid)
    u = llm_cost(c, head=True)
    rows, tile = length * c.experts_per_token, c.expert_mlp
    padding = (rows + c.experts * (tile - 1)) // tile * tile - rows if dispatch == "sparse" else 0
    declared = u.flops * length + u.attention_flops * length**2 + c.depth * 3 * 2 * c.width * c.expert_mlp * padding
    assert 1.0 <= xla_flops(lambda p: m.apply(p, ids, pos, valid), params) / declared <= 1.2


def test_encoder_declared_flops_match_xla():
    vit = ViTConfig(patch=4, channels=3, width=64, depth=2, heads=2, mlp=256, out_width=96)
    n = 64
    args = (jnp.zeros((1, n, 48)), jnp.ones((1, n), jnp.int32), jnp.zeros((1, n, 2), jnp.int32))
    params = VisionEncoder(vit).init(jax.random.key(0), *args)
    u = vit_cost(vit, n)
    got = xla_flops(lambda p: VisionEncoder(vit).apply(p, *args), params)
    assert 1.0 <= got / ((u.flops + u.attention_flops * u.attention_span) * n) <= 1.1
    aud = AudioConfig(mel=16, frames_per_token=4, width=64, depth=2, heads=2, mlp=256, out_width=96)
    args = (jnp.zeros((1, n, 64)), jnp.ones((1, n), jnp.int32), jnp.zeros((1, n, 1), jnp.int32))
    params = AudioEncoder(aud).init(jax.random.key(0), *args)
    u = audio_cost(aud, n)
    got = xla_flops(lambda p: AudioEncoder(aud).apply(p, *args), params)
    assert 1.0 <= got / ((u.flops + u.attention_flops * u.attention_span) * n) <= 1.1


@pytest.mark.parametrize("name", list(CONFIGS))
def test_planning_reads_the_graph_the_runtime_runs(name):
    """The planner's parameter leaves are the runtime's, leaf for leaf (one description)."""
    from maestro_jax.runtime.build import build_runtime
    from maestro_jax.runtime.sharding import param_infos

    cfg = cfg_of(name)
    spec = workloads.describe(cfg)
    rt = build_runtime(cfg)
    assert spec.order == rt.graph.topological_order() and spec.sink == rt.graph.sink
    for s, sec in spec.sections.items():
        assert list(sec.leaves) == param_infos(rt.abstract[s]["params"]) + param_infos(rt.abstract[s]["consts"])
        assert sec.cost == rt.graph.section(s).cost and sec.cost.flops > 0
        assert sec.trained == rt.graph.section(s).trained


@pytest.mark.parametrize(
    "scheduler,name",
    [
        *(("wavefront", name) for name in CONFIGS),
        pytest.param("naive", "omni", marks=pytest.mark.slow),
        pytest.param("naive", "vlm_kd", marks=pytest.mark.slow),
    ],
)
def test_each_workload_matches_the_monolithic_step(scheduler, name):
    """Every built-in workload on its shipped plan (tiny sizes): the sectioned step's loss, gradient
    norm and each trained section's gradients equal the monolithic step's. Under the default
    (wavefront) scheduler this is the quick tier's equivalence check, one per workload; the naive
    scheduler's run is slow (`tests/test_equivalence.py` holds the plans' variants)."""
    diffs = verify(cfg_of(name, f"schedule.scheduler={scheduler}"))
    sections = {
        "vlm": ("vision", "llm"),
        "kd": ("student",),
        "omni": ("vision", "audio", "llm"),
        "vlm_kd": ("vision", "student"),
    }[name]
    assert {d.name.split("/")[0] for d in diffs} == {"loss", "grad_norm", *sections}
    for d in diffs:
        assert d.max_rel < 1e-5, d


def test_omni_batches_mix_every_modality_combination():
    from maestro_jax.runtime.build import build_runtime

    rt = build_runtime(cfg_of("omni", "global_batch=32"))
    samples = rt.batches()[0]
    kinds = {(s.has("image"), s.has("audio")) for s in samples}
    assert kinds == {(False, False), (True, False), (False, True), (True, True)}
    schedule = rt.schedule(samples)
    for section, modality in (("vision", "image"), ("audio", "audio")):
        held = {x for st in schedule.steps[section] for x in st.samples}
        assert held == {i for i, s in enumerate(samples) if s.has(modality)}, "an encoder runs only for its samples"


def test_pooled_audio_tokens_are_each_clips_own_runs_averaged():
    """`models.audio.pool: 2` (Qwen2-Audio's avg_pooler): two clips packed in one row leave the
    encoder as half their tokens each, token j of a clip the mean of its blocks' outputs 2j and
    2j + 1 (the same encoder unpooled, clip by clip), then out_norm and out_proj; the omni
    workload asks one placeholder per pooled token."""
    from maestro_jax.models.layers import item_mask

    from maestro_jax.workloads.omni import audio_modality

    fields = dict(mel=4, frames_per_token=2, stem="conv", width=16, depth=1, heads=2, mlp=32, out_width=8)
    pooled, plain = AudioEncoder(AudioConfig(**fields, pool=2)), AudioEncoder(AudioConfig(**fields))
    clips = [np.random.default_rng(i).normal(size=(t, 4)).astype(np.float32) for i, t in enumerate((8, 14))]
    groups = [frame_groups(c, 2, pool=2) for c in clips]
    assert [len(t) for t, _ in groups] == [4, 6], "whole pooled tokens: 14 frames keep 12"
    n = 16  # 4 + 6 tokens, then padding
    frames, segments, positions = (
        np.zeros((1, n, 8), np.float32),
        np.zeros((1, n), np.int32),
        np.zeros((1, n, 1), np.int32),
    )
    off = 0
    for i, (tokens, pos) in enumerate(groups):
        frames[0, off : off + len(tokens)], segments[0, off : off + len(tokens)] = tokens, i + 1
        positions[0, off : off + len(tokens)] = pos
        off += len(tokens)
    params = pooled.init(jax.random.key(0), frames, segments, positions)
    got = np.asarray(pooled.apply(params, frames, segments, positions))
    assert got.shape == (1, n // 2, 8)

    def blocks(m, frames, segments, positions):
        x = m.stem(frames, segments) + jnp.take(m.pos, positions[..., 0], axis=0)
        return m.blocks(x, item_mask(segments))

    off = 0
    for tokens, pos in groups:
        alone = plain.apply(params, tokens[None], np.ones((1, len(tokens)), np.int32), pos[None], method=blocks)
        pairs = np.asarray(alone)[0].reshape(-1, 2, 16).mean(axis=1)
        want = plain.apply(params, pairs, method=lambda m, x: m.out_proj(m.out_norm(x)))
        np.testing.assert_allclose(got[0, off // 2 : off // 2 + len(pairs)], want, atol=2e-6)
        off += len(tokens)

    audio = audio_modality(cfg_of("omni", "models.audio.pool=2"))
    assert audio.unit == (8,) and audio.tokens((16,)) == audio.tokens((23,)) == 2, "4 frames a token x pool 2"


def test_each_packed_samples_prefix_is_its_own_block():
    """`prefix_lm` rows (`with_prefix_blocks`): in a row packing two samples, each sample's
    positions up to the first whose target carries loss are one block numbered by its segment, the
    rest of it and the padding 0; a sample that carries no loss is prefix whole."""
    from maestro_jax.workloads.vlm import with_prefix_blocks

    segments = np.array([[1, 1, 1, 1, 1, 2, 2, 2, 2, 0, 0], [1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0]])
    loss = np.array([[0, 0, 1, 1, 0, 0, 0, 0, 1, 0, 0], [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]], np.float32)
    got = with_prefix_blocks({"loss_mask": loss, "valid": segments > 0, "segments": segments})["images"]
    np.testing.assert_array_equal(got, [[1, 1, 1, 0, 0, 2, 2, 2, 2, 0, 0], [1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0]])
    one = with_prefix_blocks({"loss_mask": loss[:1, :5], "valid": segments[:1, :5] > 0})["images"]
    np.testing.assert_array_equal(one, [[1, 1, 1, 0, 0]])


def test_a_prefix_lm_in_text_only_rows_is_refused():
    """kd's rows are text only and place no prefix: a `prefix_lm` teacher or student (a PaliGemma
    language model) is refused naming the key, before anything is built."""
    from maestro_jax.config import ConfigError

    with pytest.raises(ConfigError, match=r"error: models\.teacher\.prefix_lm=true: kd's text rows for it place no"):
        workloads.build_graph(cfg_of("kd", "models.teacher.prefix_lm=true"))


@pytest.mark.slow  # the unpooled omni verify above holds the path; this adds the pooled rows' sizes
def test_omni_with_a_pooled_audio_encoder_matches_the_monolithic_step():
    """Qwen2-Audio's shape of encoder (`pool: 2`) in the omni workload: the LLM's placeholders
    take half the encoder's tokens, sectioned and monolithic alike."""
    diffs = verify(cfg_of("omni", "models.audio.pool=2"))
    assert {d.name.split("/")[0] for d in diffs} == {"loss", "grad_norm", "vision", "audio", "llm"}
    for d in diffs:
        assert d.max_rel < 1e-5, d


@pytest.mark.slow
@pytest.mark.parametrize("name", ["omni", "vlm_kd"])
@pytest.mark.extended
def test_new_workloads_train(name):
    history = train(cfg_of(name, "steps=6"), progress=False)
    losses = [h["train/loss"] for h in history]
    assert len(losses) == 6 and all(np.isfinite(losses)) and losses[-1] < losses[0]


@pytest.mark.parametrize("name", ["omni", "vlm_kd"])
def test_plan_and_simulate_report_every_section(name, capsys):
    """`simulate` and `plan` on the workload's config name every one of its sections (the commands
    run in this process, `cli.main`: what they print is the subject, not the process)."""
    from maestro_jax import cli

    for command in (
        ["simulate", "simulate.batches=1"],
        ["plan", "--devices", "8", "--memory-gb", "1", "--top", "2", "simulate.device=cpu", "simulate.batches=1"],
    ):
        file, tiny = CONFIGS[name]
        status = cli.main([command[0], "--config", str(ROOT / "configs" / file), *command[1:], *tiny])
        out = capsys.readouterr()
        assert status == 0, out.err
        for s in load_config(ROOT / "configs" / file).sections:
            assert s in out.out, (command[0], s, out.out)


@pytest.mark.slow
@pytest.mark.extended
def test_plugin_by_import_path_is_the_same_workload():
    a = verify(cfg_of("kd"))
    b = verify(cfg_of("kd", "workload=maestro_jax.workloads.kd:WORKLOAD"))
    assert [(d.name, d.max_abs) for d in a] == [(d.name, d.max_abs) for d in b]


@pytest.mark.parametrize(
    "value,text",
    [
        ("nope", "workload='nope': unknown; valid: vlm, kd, omni, vlm_kd"),
        ("no_such_pkg.mod:W", "workload='no_such_pkg.mod:W': cannot import it"),
        ("maestro_jax.workloads:BUILTIN", "is a tuple, not a maestro_jax.workloads.Workload"),
    ],
)
def test_unknown_workloads_exit_2_with_one_line(value, text, capfd):
    """In this process (`cli.main`), its output read at the file descriptors, so anything XLA or
    Python writes besides the error line is seen; `tests/test_train.py`'s refusal runs the command
    as a process."""
    from maestro_jax import cli

    for command in ("verify", "simulate"):
        status = cli.main([command, "--config", str(ROOT / "configs/kd_tiny.yaml"), f"workload={value}"])
        err = capfd.readouterr().err
        assert status == 2, err
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and text in lines[0], err


def test_config_sections_must_match_the_workload():
    with pytest.raises(ConfigError, match=r"workload 'omni' has sections \['audio', 'llm', 'vision'\]"):
        workloads.build_graph(
            load_config(
                ROOT / "configs/vlm_tiny.yaml",
                [
                    "workload=omni",
                    "models.audio.kind=audio",
                    "models.audio.width=8",
                    "models.audio.depth=1",
                    "models.audio.heads=1",
                    "models.audio.mlp=8",
                    "models.audio.out_width=96",
                ],
            )
        )


def test_one_build_checks_the_config_once(monkeypatch):
    """`build_runtime` runs the workload's config check (`workloads.check_config`) once and hands
    the checked workload to the graph, the source and the sample checks (each checked it again)."""
    from maestro_jax.runtime.build import build_runtime

    calls, check = [], workloads.check_config
    counted = lambda cfg: calls.append(cfg.workload) or check(cfg)
    monkeypatch.setattr(workloads, "check_config", counted)
    monkeypatch.setattr(workloads.checks, "check_config", counted)  # where the graph and source call it
    build_runtime(cfg_of("kd"))
    assert calls == ["kd"]
