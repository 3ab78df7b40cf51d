"""Sequence packing (`sections.<name>.pack`): rows of several samples give each sample what it gets
alone, on one device and under ring attention, and a packed run is the unpacked monolithic step."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ROOT, TINY_KD, TINY_VLM
from maestro_jax.models import DecoderLM, LLMConfig

from maestro_jax.config import ConfigError, load_config
from maestro_jax.runtime.build import build_runtime
from maestro_jax.runtime.step import StepBatch
from maestro_jax.schedule import naive, sample_metas, wavefront
from maestro_jax.schedule.packing import pack_rows
from maestro_jax.tools.verify import compare

LLM = LLMConfig(vocab=64, width=32, depth=2, heads=4, kv_heads=2, head_dim=8, mlp=64)


def test_pack_rows_balances_each_shards_rows_and_keeps_slots_on_their_shard():
    lengths = [9, 3, None, 7, 2, 8, 8, 1] + [5, None, None, None, 4, 6, 2, 2]
    rows = pack_rows(lengths, shards=2, pack=4)
    assert len(rows) == 4
    assert sorted(x for r in rows for x in r) == [i for i, n in enumerate(lengths) if n is not None]
    for r, row in enumerate(rows):  # rows 0-1 hold shard 0's slots 0-7, rows 2-3 shard 1's
        assert all(x // 8 == r // 2 for x in row)
    loads = [sum(lengths[x] for x in row) for row in rows]
    assert loads == [19, 19, 10, 9]  # LPT: 9, 8, 8, 7, 3, 2, 1 -> {9, 7, 2, 1}, {8, 8, 3}
    with pytest.raises(ValueError):
        pack_rows(lengths[:6], shards=2, pack=4)


def _packed(lengths, width):
    """One packed row of random samples with these lengths (then padding), and each sample alone."""
    rng = np.random.default_rng(0)
    ids = [rng.integers(0, LLM.vocab, n) for n in lengths]
    row_ids, positions, segments = np.zeros(width, np.int32), np.zeros(width, np.int32), np.zeros(width, np.int32)
    at = 0
    for i, x in enumerate(ids):
        row_ids[at : at + len(x)], positions[at : at + len(x)], segments[at : at + len(x)] = x, np.arange(len(x)), i + 1
        at += len(x)
    alone = np.zeros((len(ids), width), np.int32)
    for i, x in enumerate(ids):
        alone[i, : len(x)] = x
    packed = tuple(jnp.asarray(a[None]) for a in (row_ids, positions, segments > 0, segments))
    apart = (
        jnp.asarray(alone),
        jnp.broadcast_to(jnp.arange(width), alone.shape),
        jnp.arange(width)[None] < jnp.array(lengths)[:, None],
    )
    return packed, apart


def _per_sample(packed_out, lengths):
    starts = np.cumsum([0, *lengths])
    return [np.asarray(packed_out[0, starts[i] : starts[i] + n]) for i, n in enumerate(lengths)]


@pytest.mark.slow
def test_a_packed_rows_samples_get_what_each_gets_alone():
    """Segment ids keep attention inside each sample and positions restart (RoPE): each sample's
    logits in the packed row are those of the sample run alone; without the segment ids they are not."""
    lengths = [5, 9, 3]
    packed, apart = _packed(lengths, 20)
    model = DecoderLM(LLM)
    params = model.init(jax.random.key(0), *apart)
    apply = jax.jit(model.apply)
    got = _per_sample(apply(params, *packed), lengths)
    ref = apply(params, *apart)
    for i, n in enumerate(lengths):
        np.testing.assert_allclose(got[i], np.asarray(ref[i, :n]), rtol=1e-5, atol=1e-5)
    mixed = _per_sample(apply(params, *packed[:3]), lengths)  # no segments: later samples see earlier ones
    assert not np.allclose(mixed[1], np.asarray(ref[1, : lengths[1]]), atol=1e-3)


@pytest.mark.slow
def test_a_packed_rows_moe_balancing_loss_is_its_samples_losses_alone():
    """The mixture-of-experts load-balancing loss is taken per sequence: in a packed row per sample,
    so the row's sum is the samples' sum alone (and the logits are theirs too)."""
    from maestro_jax.models import apply_with_losses

    lengths = [6, 10, 3]
    packed, apart = _packed(lengths, 20)
    moe = dataclasses.replace(LLM, experts=4, experts_per_token=2, expert_mlp=16, router_aux_loss=0.1)
    model = DecoderLM(moe)
    params = model.init(jax.random.key(0), *apart)
    run = jax.jit(lambda *b: apply_with_losses(model, params, *b))
    (got, got_aux), (ref, ref_aux) = run(*packed), run(*apart)
    np.testing.assert_allclose(float(got_aux), float(ref_aux), rtol=1e-5)
    for i, (g, n) in enumerate(zip(_per_sample(got, lengths), lengths)):
        np.testing.assert_allclose(g, np.asarray(ref[i, :n]), rtol=1e-5, atol=1e-5)
    as_one = run(*packed[:3], packed[2].astype(jnp.int32))[1]  # the row as one sequence: another loss
    assert abs(float(as_one) - float(ref_aux)) > 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("axes", [dict(context=4), dict(data=2, context=2)])
def test_ring_attention_keeps_packed_samples_apart(axes):
    """Under ring attention over `context` (balanced order, skipped blocks), a packed row gives each
    sample its logits alone on one device, and the program passes keys round the ring."""
    from maestro_jax.core.plan import SectionPlan, mesh_shape
    from maestro_jax.runtime.sharding import on_mesh, row_sharding, section_mesh, variable_shardings

    lengths, width = [11, 4, 9, 2], 32
    packed, apart = _packed(lengths, width)
    packed = tuple(jnp.concatenate([a, jnp.zeros_like(a)]) for a in packed)  # 2 rows: the second all padding
    model = DecoderLM(LLM)
    boxed = jax.eval_shape(lambda: model.init(jax.random.key(0), *apart))
    params = nn.meta.unbox(model.init(jax.random.key(0), *apart)["params"])
    ref = jax.jit(model.apply)({"params": params}, *apart)
    mesh = section_mesh(SectionPlan((0, 1, 2, 3), mesh_shape(**axes), 1))
    shard, rows_sh = variable_shardings(boxed, mesh, "default")["params"], row_sharding(mesh)
    run = jax.jit(lambda p, *b: model.apply({"params": p}, *b), in_shardings=(shard,) + (rows_sh,) * 4)
    with on_mesh(mesh, "default"):
        placed = jax.device_put(params, shard)
        out = run(placed, *packed)
        hlo = run.lower(placed, *packed).compile().as_text()
    for i, (got, n) in enumerate(zip(_per_sample(out, lengths), lengths)):
        np.testing.assert_allclose(got, np.asarray(ref[i, :n]), rtol=1e-5, atol=1e-5)
    assert "collective-permute" in hlo


def test_pack_is_refused_where_it_cannot_hold():
    base = ROOT / "configs/vlm_tiny.yaml"
    with pytest.raises(ConfigError, match=r"^error: sections\.vision\.pack=2: section vision does not pack"):
        build_runtime(load_config(base, TINY_VLM + ["sections.vision.pack=2"]))
    with pytest.raises(ConfigError, match=r"sections\.llm\.pack"):
        load_config(base, TINY_VLM + ["sections.llm.pack=0"])


@pytest.mark.slow
@pytest.mark.parametrize(
    "workload,packing",
    [
        ("vlm", ["sections.llm.pack=2"]),
        ("kd", ["sections.teacher.pack=2", "sections.student.pack=3"]),
    ],
)
def test_packed_step_is_the_unpacked_monolithic_step_under_both_schedulers(workload, packing):
    """Samples of varied lengths, packed several per row in the LLM (vlm; the ViT keeps its rows)
    or in teacher and student (kd): loss and gradients of the naive and the wavefront schedule
    both equal the monolithic step, which never packs."""
    path, tiny = ("vlm_tiny.yaml", TINY_VLM) if workload == "vlm" else ("kd_tiny.yaml", TINY_KD)
    cfg = load_config(ROOT / "configs" / path, tiny + ["data.text_len=[3,32]"] + packing)
    rt = build_runtime(cfg)
    samples = rt.batches()[0]
    assert len({len(s.tokens) for s in samples}) > 4
    state = rt.step.init()
    mono = rt.monolithic.step
    m_loss, m_grads, _ = mono.gradients(mono.init(), samples)
    metas = sample_metas(rt.graph, samples)
    for schedule in (naive(metas, rt.problem), wavefront(metas, rt.problem)):
        host = rt.executor.host_batches(samples, schedule)
        for s in rt.executor.pack:
            segments = [host[(s, st.index)]["segments"] for st in schedule.steps[s]]
            assert all(seg.shape[0] < len(st.positions) for seg, st in zip(segments, schedule.steps[s]))
            assert max(seg.max() for seg in segments) >= 2  # some row holds several samples
        loss, grads, _ = rt.step.gradients(state, StepBatch(samples, schedule, host=host))
        diffs = [compare("loss", loss, m_loss)]
        diffs += [compare(f"{s}/grads", grads[s], m_grads[s]) for s in grads]
        for d in diffs:
            assert d.max_rel <= 1e-5, f"{schedule.name}: {d.name} differs by {d.max_rel:.3e}"


def test_bench_refuses_a_pack_it_cannot_time(capsys):
    from maestro_jax.cli import main

    assert main(["bench", "--config", str(ROOT / "configs/vlm_tiny.yaml"), "--pack", "1", *TINY_VLM]) == 2
    assert capsys.readouterr().err.startswith("error: --pack=1: must be 2 or more")
