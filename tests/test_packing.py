"""Sequence packing (`sections.<name>.pack`, a sample count or a token budget): rows of several
samples give each sample what it gets alone, on one device and under ring attention, a packed run is
the unpacked monolithic step and resumes bit for bit, and the planner and simulator price packed rows."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ROOT, TINY_KD, TINY_VLM
from maestro_jax.models import DecoderLM, LLMConfig

from maestro_jax.config import ConfigError, load_config
from maestro_jax.core.buckets import bucket
from maestro_jax.runtime.build import build_runtime
from maestro_jax.runtime.step import StepBatch
from maestro_jax.schedule import naive, sample_metas, wavefront
from maestro_jax.schedule.packing import TokenBudget, first_fit_decreasing, pack_rows, packed_shape
from maestro_jax.tools.verify import compare, verify

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


@pytest.mark.parametrize("shards,pack", [(1, 2), (4, 2), (3, 3), (8, 4)])
def test_packed_shape_of_one_row_a_shard_is_what_pack_rows_lays(shards, pack):
    """The count form with one row a shard (every shard's slots in that row, the pricing's fast
    path) against `pack_rows` itself, on random micro-steps with padding slots, and one with
    fewer units than slots; two rows a shard take `pack_rows`' path and agree too."""
    import random

    rng = random.Random(shards * 10 + pack)
    for per_shard in (pack, 2 * pack):
        for n in (shards * per_shard, shards * per_shard - 1):
            units = tuple(rng.choice([0, 1, 5, 17, 40]) for _ in range(n))
            lengths = [u or None for u in units] + [None] * (shards * per_shard - n)
            rows = pack_rows(lengths, shards, pack)
            longest = max((sum(lengths[x] for x in row) for row in rows), default=0)
            assert packed_shape(units, shards, per_shard, pack) == (len(rows) // shards, longest)


def test_token_budget_rows_hold_every_sample_once_whole_within_the_budget():
    """Random lengths over several shards, with padding slots: every row holds at most the budget,
    every sample sits in exactly one row, whole (one slot, one sample), on its own shard, and every
    shard has as many rows as the fullest one needs."""
    rng = np.random.default_rng(0)
    for shards, per_shard, budget in [(1, 9, 40), (2, 8, 32), (4, 6, 64), (3, 5, 13)]:
        lengths = [None if rng.random() < 0.2 else int(rng.integers(1, budget + 1)) for _ in range(shards * per_shard)]
        rows = pack_rows(lengths, shards, TokenBudget(budget))
        assert sorted(x for r in rows for x in r) == [i for i, n in enumerate(lengths) if n is not None]
        assert all(sum(lengths[x] for x in row) <= budget for row in rows)
        assert len(rows) % shards == 0
        per = len(rows) // shards
        for r, row in enumerate(rows):
            assert all(x // per_shard == r // per for x in row)  # slots stay on their shard
        filled = [sum(1 for row in rows[j * per : (j + 1) * per] if row) for j in range(shards)]
        assert per == max(1, *filled)  # empty rows only pad a shard to the fullest one's
    with pytest.raises(ValueError, match="does not fit"):  # never split
        pack_rows([5, 41], 1, TokenBudget(40))


def test_first_fit_decreasing_matches_the_hand_worked_rows():
    """Budget 10, lengths 5, 7, 3, 4, 2, 6: longest first (7, 6, 5, 4, 3, 2), each into the first
    row with room: 7 -> row 0 (3 left); 6 -> row 1 (4 left); 5 -> row 2 (5 left); 4 -> not row 0,
    row 1 (0 left); 3 -> row 0 (0 left); 2 -> row 2 (3 left)."""
    lengths = [5, 7, 3, 4, 2, 6]
    assert first_fit_decreasing(range(6), lengths, 10) == [[1, 2], [5, 3], [0, 4]]
    # two shards of 4 slots: shard 0 (9, -, 3, 4) -> [9], [4, 3]; shard 1 (2, 2, 5, 1) -> one row
    # [5, 2, 2, 1], and an empty row so that both shards have two
    assert pack_rows([9, None, 3, 4, 2, 2, 5, 1], 2, TokenBudget(10)) == [[0], [3, 2], [6, 4, 5, 7], []]


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


# packed by tokens: kd's teacher and student, vlm's LLM; each budget holds the longest sample of
# data.text_len=[3,32] (and vlm's 4 image placeholders) and rows of several samples
TOKEN_PACKED = {
    "vlm": ("vlm_tiny.yaml", TINY_VLM, ["sections.llm.micro_batch=4", "sections.llm.pack={tokens: 48}"]),
    "kd": (
        "kd_tiny.yaml",
        TINY_KD,
        ["sections.teacher.pack={tokens: 64}", "sections.student.micro_batch=2", "sections.student.pack={tokens: 64}"],
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("scheduler", ["naive", "wavefront"])
@pytest.mark.parametrize("workload", ["vlm", "kd"])
def test_token_packed_step_verifies_against_the_monolithic_step(workload, scheduler):
    """Rows filled to a token budget (fewer rows than samples, several samples in some row, none
    over the budget): `verify`'s loss, gradients and updated parameters equal the monolithic step's
    at 1e-5 under both schedulers."""
    path, tiny, packing = TOKEN_PACKED[workload]
    cfg = load_config(
        ROOT / "configs" / path, tiny + ["data.text_len=[3,32]", f"schedule.scheduler={scheduler}"] + packing
    )
    rt = build_runtime(cfg)
    samples = rt.batches()[0]
    schedule = {"naive": naive, "wavefront": wavefront}[scheduler](sample_metas(rt.graph, samples), rt.problem)
    host = rt.executor.host_batches(samples, schedule)
    assert set(rt.executor.pack) == {s for s, sc in cfg.sections.items() if sc.pack != 1}
    for s, budget in rt.executor.pack.items():
        segments = [host[(s, st.index)]["segments"] for st in schedule.steps[s]]
        assert all(seg.shape[1] == bucket(budget.tokens, per_octave=cfg.compile.buckets_per_octave) for seg in segments)
        assert sum(seg.shape[0] for seg in segments) < sum(len(st.positions) for st in schedule.steps[s])
        assert max(seg.max() for seg in segments) >= 2  # some row holds several samples
        for seg in segments:
            assert all((row > 0).sum() <= budget.tokens for row in seg)
    diffs = verify(cfg, rt)
    assert {d.name for d in diffs} >= {"loss", *(f"{s}/grads" for s in rt.graph.names if s in rt.problem.trained)}
    for d in diffs:
        assert d.max_rel <= 1e-5, f"{scheduler}: {d.name} differs by {d.max_rel:.3e}"


@pytest.mark.slow
def test_a_token_packed_run_resumes_bit_for_bit(tmp_path):
    """kd_tiny with its student packed by tokens: 4 steps straight, and 2 steps then a resume to 4
    in the same output_dir, give the same losses bit for bit."""
    from maestro_jax.training.loop import train

    base = TINY_KD + ["checkpoint_every=2", "schedule.scheduler=wavefront"] + TOKEN_PACKED["kd"][2][1:]
    cfg = lambda out, steps: load_config(ROOT / "configs/kd_tiny.yaml", base + [f"output_dir={out}", f"steps={steps}"])
    straight = train(cfg(tmp_path / "a", 4), progress=False)
    first = train(cfg(tmp_path / "b", 2), progress=False)
    resumed = train(cfg(tmp_path / "b", 4), progress=False)
    assert [r["step"] for r in first + resumed] == [1, 2, 3, 4]
    assert [r["train/loss"] for r in first + resumed] == [r["train/loss"] for r in straight]
    assert len({r["train/loss"] for r in straight}) == 4  # it trains: the check compares moving losses


@pytest.mark.parametrize(
    "value",
    ["{tokens: 0}", "{tokens: -3}", "{tokens: many}", "{tokens: 8, rows: 2}", "{budget: 8}", "0", "[8]", "true"],
)
def test_a_pack_that_is_neither_form_is_refused_in_one_line(value):
    with pytest.raises(ConfigError) as err:
        load_config(ROOT / "configs/kd_tiny.yaml", TINY_KD + [f"sections.student.pack={value}"])
    (line,) = str(err.value).splitlines()
    assert line.startswith("error: sections.student.pack=")
    assert "valid: a sample count P >= 1" in line and "{tokens: N}" in line


def test_a_token_budget_below_the_longest_sample_is_refused_before_compiling():
    """The budget must hold whole the longest sample the section can receive: from the synthetic
    data's settings (text_len up to 14: 13 tokens of a row), or `data.max_tokens`; data whose
    longest sample is not known is refused too. `build_runtime` compiles nothing."""
    from maestro_jax.runtime.build import check_pack_budget

    kd = ROOT / "configs/kd_tiny.yaml"
    with pytest.raises(ConfigError) as err:
        build_runtime(load_config(kd, TINY_KD + ["sections.student.pack={tokens: 12}"]))
    (line,) = str(err.value).splitlines()
    assert line.startswith("error: sections.student.pack={tokens: 12}: smaller than the longest sample")
    assert "valid: {tokens: N} with N >= 13" in line
    build_runtime(load_config(kd, TINY_KD + ["sections.student.pack={tokens: 13}"]))  # the longest fits
    capped = load_config(kd, TINY_KD + ["data.max_tokens=40", "sections.teacher.pack={tokens: 32}"])
    with pytest.raises(ConfigError, match=r"^error: sections\.teacher\.pack=\{tokens: 32\}: .* N >= 39$"):
        build_runtime(capped)
    cfg = load_config(kd, TINY_KD + ["sections.student.pack={tokens: 64}"])
    with pytest.raises(ConfigError, match=r"^error: sections\.student\.pack=\{tokens: 64\}: .*set data\.max_tokens"):
        check_pack_budget(cfg, source=[])  # a source of unknown longest sample
    vlm = ROOT / "configs/vlm_tiny.yaml"
    with pytest.raises(ConfigError, match=r"^error: sections\.vision\.pack=\{tokens: 64\}: section vision does not"):
        build_runtime(load_config(vlm, TINY_VLM + ["sections.vision.pack={tokens: 64}"]))


def _toy(pack):
    """One trained section (the sink) with `pack`, 8 activation bytes a unit and layer, no weights."""
    from maestro_jax.core.graph import UnitCost
    from maestro_jax.planning.spec import SectionSpec, WorkloadSpec

    cost = UnitCost(flops=1.0, width=1, layer_bytes=8.0, layers=1)
    packing = {} if pack == 1 else {"llm": pack}
    return WorkloadSpec("toy", {"llm": SectionSpec("llm", True, (), cost)}, (), {}, "llm", pack=packing)


@pytest.mark.parametrize(
    "pack,micro_batch,step_s,rows_units",
    [
        # unpacked, 2 rows: micro-steps (30, 10) and (20, 4), each 2 rows of bucket 32
        (1, 2, 2 * (2 * (32e-3 + 32**2 * 1e-5)), 2 * 32),
        # unpacked, 4 rows: one micro-step of 4 rows of 32
        (1, 4, 4 * (32e-3 + 32**2 * 1e-5), 4 * 32),
        # 2 a row, 2 rows: LPT 30 | 20, then 10 -> the 20 row (30), 4 -> row 0 (34): 2 rows of bucket 48;
        # memory: 2 rows of two 30s (bucket 64)
        (2, 2, 2 * (48e-3 + 48**2 * 1e-5), 2 * 64),
        # 64 tokens a row, 4 samples: FFD puts all four (64 tokens) in one row of 64;
        # memory: two 30s a row of 64, so 2 rows for 4 samples
        (TokenBudget(64), 4, 64e-3 + 64**2 * 1e-5, 2 * 64),
        # 40 tokens a row: 30 + 4 | 20 + 10: 2 rows of bucket 48; memory: one 30 a row, 4 rows of 48
        (TokenBudget(40), 4, 2 * (48e-3 + 48**2 * 1e-5), 4 * 48),
    ],
)
def test_packed_rows_are_priced_as_packed(pack, micro_batch, step_s, rows_units):
    """Samples of 30, 10, 20 and 4 tokens on one device, 1 ms a unit of a row and 10 µs a pair of
    positions of a row (attention is masked to each sample but computed over the whole row): the
    simulated step (the naive schedule, the sink's loss-and-grad at one forward) and the planner's
    activation memory (a forward's 2 layers' worth and the sink's residuals: 3 x 8 bytes a unit of
    a row) are those of the packed rows, worked by hand. Packed, the 4 samples take less time than
    unpacked with as many samples a micro-step (0.169 s): fewer, fuller rows; the count form's
    micro-step holds twice the samples of its 2 rows, and twice the memory of 2 unpacked rows."""
    from maestro_jax.core.plan import Plan, SectionPlan, mesh_shape
    from maestro_jax.planning.cost import CostModel, SectionCost
    from maestro_jax.planning.planner import Planner
    from maestro_jax.planning.simulator import simulate
    from maestro_jax.schedule import SampleMeta

    spec = _toy(pack)
    metas = [SampleMeta(frozenset({"llm"}), {"llm": u}) for u in (30, 10, 20, 4)]
    plan = Plan({"llm": SectionPlan((0,), mesh_shape(data=1), micro_batch)}, {}, 4)
    problem = spec.problem(plan, max_in_flight=4)
    cost = CostModel({"llm": SectionCost(per_unit_s=1e-3, per_unit2_s=1e-5, sink_factor=1.0)})
    assert simulate(naive(metas, problem), problem, metas, cost).makespan == pytest.approx(step_s, rel=1e-12)
    memory = Planner(spec, [metas], 1, 1.0, global_batch=4, device="cpu").check(plan)
    assert memory["llm"]["activations"] == rows_units * 3 * 8
    unpacked = Planner(_toy(1), [metas], 1, 1.0, global_batch=4, device="cpu")
    if pack != 1:  # the planner's own (analytic) price: packed rows are faster than as many samples unpacked
        alike = Plan({"llm": SectionPlan((0,), mesh_shape(data=1), problem.rows["llm"])}, {}, 4)
        planner = Planner(spec, [metas], 1, 1.0, global_batch=4, device="cpu")
        assert planner.step_time(plan) < unpacked.step_time(alike)


def test_a_section_that_packs_is_never_planned_in_stages():
    """The runtime's pipeline stages do not pack (`sections.<s>.stages` refuses `pack`), so the
    planner never offers a plan that cuts a packing section: neither its stage search nor the
    pipelined baseline's layout as a maestro plan. The pipelined baseline is still priced."""
    from maestro_jax.planning.pipeline import pipelined_best
    from maestro_jax.planning.planner import STAGE_COUNTS
    from maestro_jax.tools.plan import planner_for

    h100 = ["simulate.device=h100"]
    plain = planner_for(load_config(ROOT / "configs/kd_tiny.yaml", h100), 8, 1.0, stage_counts=STAGE_COUNTS)
    assert plain._pipelined_point(pipelined_best(plain)) is not None, "unpacked, the layout is a maestro plan"
    cfg = load_config(ROOT / "configs/kd_tiny.yaml", [*h100, "sections.student.pack=2"])
    planner = planner_for(cfg, 8, 1.0, stage_counts=STAGE_COUNTS)
    assert planner._pipelined_point(pipelined_best(planner)) is None
    report = planner.search(top=5)
    assert report.pipelined is not None
    for c in report.top:
        assert not any(name.startswith("student.") for name in c.plan.sections), c.plan.sections
