"""Edges between any data-parallel degrees: fan-out, fan-in and uneven M:N, each verified against
the monolithic step (the `maestro-jax verify` path) under both schedulers; the consumer's gather
compiles to no collective; a declared fanout that contradicts the plan is one `error:` line."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ROOT, TINY_KD, TINY_VLM

from maestro_jax import cli
from maestro_jax.config import load_config
from maestro_jax.core.plan import SectionPlan, mesh_shape
from maestro_jax.runtime.build import build_runtime
from maestro_jax.runtime.sharding import edge_sharding, on_mesh, row_sharding, section_mesh
from maestro_jax.tools.verify import verify
from maestro_jax.workloads import rows as R

RTOL = 1e-5
KD, VLM = ROOT / "configs/kd_tiny.yaml", ROOT / "configs/vlm_tiny.yaml"
FAN_IN = TINY_KD + [
    "sections.teacher.devices=0:6",
    "sections.teacher.mesh={data: 6}",
    "sections.student.devices=6:8",
    "sections.student.mesh={data: 2}",
]
PLANS = {
    # fan-in: six teacher shards feed two student shards, three each (12 teacher rows per step)
    "kd_fan_in_6_to_2": (KD, FAN_IN),
    # uneven: 6 vision rows (3 shards of 2) over 4 LLM shards; LLM shards 1 and 2 are fed by two
    # vision shards each (delivered padded to 2 blocks per shard); vision is trained, so its
    # cotangent comes back summed from the LLM shards that hold its rows
    "vlm_uneven_3_to_4": (
        VLM,
        TINY_VLM
        + [
            "sections.vision.devices=0:3",
            "sections.vision.mesh={data: 3}",
            "sections.vision.micro_batch=2",
            "sections.llm.devices=4:8",
            "sections.llm.mesh={data: 4}",
            "sections.llm.micro_batch=1",
        ],
    ),
    # fan-out 2 -> 6 with a producer micro-batch that 3 does not divide
    "kd_fan_out_2_to_6": (
        KD,
        TINY_KD
        + [
            "global_batch=12",
            "sections.teacher.devices=0:2",
            "sections.teacher.mesh={data: 2}",
            "sections.teacher.micro_batch=2",
            "sections.student.devices=2:8",
            "sections.student.mesh={data: 6}",
        ],
    ),
}
COLLECTIVE = re.compile(r"\b(all-gather|all-reduce|collective-permute|all-to-all|reduce-scatter)(-start)?\(")


def check(cfg, rt=None):
    diffs = verify(cfg, rt)
    for d in diffs:
        assert d.max_rel <= RTOL, f"{d.name}: relative difference {d.max_rel:.3e} > {RTOL}"
    return diffs


@pytest.mark.slow
@pytest.mark.parametrize("scheduler", ["naive", "wavefront"])
@pytest.mark.parametrize("plan", list(PLANS))
def test_any_degrees_verify(plan, scheduler):
    path, overrides = PLANS[plan]
    cfg = load_config(path, overrides + [f"schedule.scheduler={scheduler}"])
    rt = build_runtime(cfg)
    samples = rt.batches()[0]
    schedule = rt.schedule(samples)
    assert schedule.name == scheduler
    (edge,) = rt.problem.edges
    dp_p, dp_c = rt.problem.dp[edge.src], rt.problem.dp[edge.dst]
    old_rule = dp_c % dp_p == 0 and rt.problem.micro_batch(edge.src) % (dp_c // dp_p) == 0
    assert not old_rule, "a plan the block-map rule refused"
    names = {d.name for d in check(cfg, rt)}
    assert "loss" in names and f"{rt.graph.sink}/grads" in names
    if edge.src in rt.problem.trained:
        assert f"{edge.src}/grads" in names


@pytest.mark.slow
def test_fan_in_consumer_program_gathers_without_collectives():
    """The student's compiled loss-and-grad (fan-in 6 -> 2) holds one collective, the gradient and
    metric all-reduce over its data shards: no all-gather or all-reduce of the teacher's rows,
    which a plain `jnp.take` over the delivered rows compiles to (`f32[rows, length, width]`)."""
    cfg = load_config(KD, FAN_IN)
    rt = build_runtime(cfg)
    check(cfg, rt)
    texts = [p.executable.as_text() for (kind, _), p in rt.programs["student"].cache.items() if kind == "loss_and_grad"]
    assert texts, "the student's loss_and_grad was compiled"
    width = cfg.models["teacher"].width
    gathered = [
        line
        for text in texts
        for line in text.splitlines()
        if COLLECTIVE.search(line) and re.search(rf"f32\[\d+,\d+,{width}\]", line)
    ]
    assert not gathered, gathered


def test_gather_is_local_and_exact():
    """`mj.rows.gather` on a mesh with 4 data shards (x 2 tensor replicas): routes into two joined
    producer parts of different lengths, each pointing at the reading row's own shard, gather
    the right rows with no collective in the forward or in its gradient; a plain take needs them."""
    mesh = section_mesh(SectionPlan(tuple(range(8)), mesh_shape(data=4, tensor=2), 1))
    rows = row_sharding(mesh)
    rng = np.random.default_rng(0)
    parts = [rng.standard_normal((8, 3, 5)).astype(np.float32), rng.standard_normal((12, 2, 5)).astype(np.float32)]
    joined = np.concatenate([parts[0], np.pad(parts[1], [(0, 0), (0, 1), (0, 0)])])
    route = np.full(8, -1, np.int32)
    for r in range(8):  # consumer row r (shard r // 2) reads a row of its own shard of either part
        shard = r // 2
        route[r] = -1 if r == 5 else (shard * 2 + r % 2 if r % 3 else 8 + shard * 3 + r % 3)
    dev_parts = tuple(jax.device_put(p, rows) for p in parts)
    dev_route = jax.device_put(route, rows)

    def take(ps, rt):
        return R.gather({"e": ps}, "e", rt)

    with on_mesh(mesh, "default"):
        out = jax.jit(take)(dev_parts, dev_route)
        fwd = jax.jit(take).lower(dev_parts, dev_route).compile().as_text()
        grad = jax.jit(jax.grad(lambda ps, rt: jnp.sum(take(ps, rt) ** 2))).lower(dev_parts, dev_route).compile()
        plain = jax.jit(lambda ps, rt: jnp.take(R.join(ps), jnp.maximum(rt, 0), axis=0)).lower(dev_parts, dev_route)
    used = route >= 0
    np.testing.assert_array_equal(np.asarray(out)[used], joined[route[used]])
    assert not COLLECTIVE.search(fwd), [line for line in fwd.splitlines() if COLLECTIVE.search(line)]
    assert not COLLECTIVE.search(grad.as_text())
    assert COLLECTIVE.search(plain.compile().as_text()), "detector: a global take compiles to collectives"
    assert R.gather({"e": tuple(parts)}, "e", route).shape == (8, 3, 5)  # no mesh: a plain take


def test_declared_fanout_must_match_the_plan(capsys):
    """A fanout the config still sets is checked, never ignored: 6 -> 2 with fanout 2 is one
    `error:` line naming the key, the derived value and what is valid; the consistent one runs."""
    status = cli.main(["verify", "--config", str(KD), *FAN_IN, "edges.teacher_hidden.fanout=2"])
    err = capsys.readouterr().err.strip()
    assert status == 2
    assert err.startswith("error: edges.teacher_hidden.fanout=2") and "\n" not in err, err
    assert "DP(student)=2 / DP(teacher)=6" in err and "valid: no fanout key" in err, err
    cfg = load_config(KD, TINY_KD + ["edges.teacher_hidden.fanout=2"])  # shipped 2 -> 4: consistent
    assert cfg.plan().fanout == {"teacher_hidden": 2}
    build_runtime(cfg)
    assert load_config(KD, TINY_KD).plan().fanout == {}


@pytest.mark.slow
@pytest.mark.parametrize("scheduler", ["naive", "wavefront"])
def test_padded_last_sink_step_and_odd_micro_batch_verify(scheduler):
    """A global batch of 10 over a sink of 4 rows per micro-step: a micro-step holds padded rows
    (masked out of the loss, as they carry no tokens); the teacher's micro-batch is 3."""
    cfg = load_config(
        KD, TINY_KD + ["global_batch=10", "sections.teacher.micro_batch=3", f"schedule.scheduler={scheduler}"]
    )
    rt = build_runtime(cfg)
    sink = rt.problem.sink
    assert cfg.global_batch % rt.problem.rows[sink]
    schedule = rt.schedule(rt.batches()[0])
    assert any(-1 in st.positions for st in schedule.steps[sink]), "a sink micro-step is padded"
    check(cfg, rt)


def test_gather_takes_rows_of_split_positions_slice_by_slice():
    """Producer parts of the consumer's length arrive with their positions split over context x
    tensor (`edge_sharding`): `mj.rows.gather` takes the rows slice by slice, exact and with no
    collective, and the rows it returns keep the split."""
    mesh = section_mesh(SectionPlan(tuple(range(8)), mesh_shape(data=2, context=2, tensor=2), 1))
    rng = np.random.default_rng(1)
    parts = [rng.standard_normal((4, 8, 5)).astype(np.float32), rng.standard_normal((6, 8, 5)).astype(np.float32)]
    joined = np.concatenate(parts)
    # consumer rows 0-3 (shard 0) read joined rows 0-1 or 4-6, rows 4-7 (shard 1) rows 2-3 or 7-9
    route = np.array([1, -1, 4, 5, 3, 9, 8, 2], np.int32)
    dev_parts = tuple(jax.device_put(p, edge_sharding(mesh, p.shape)) for p in parts)
    dev_route = jax.device_put(route, row_sharding(mesh))

    def take(ps, rt):
        return R.gather({"e": ps}, "e", rt, length=8)

    with on_mesh(mesh, "default"):
        out = jax.jit(take)(dev_parts, dev_route)
        fwd = jax.jit(take).lower(dev_parts, dev_route).compile().as_text()
    used = route >= 0
    np.testing.assert_array_equal(np.asarray(out)[used], joined[route[used]])
    assert out.sharding.is_equivalent_to(edge_sharding(mesh, out.shape), 3)
    assert not COLLECTIVE.search(fwd), [line for line in fwd.splitlines() if COLLECTIVE.search(line)]
