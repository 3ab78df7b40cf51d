"""The naive schedule holds every dependency; validate catches every kind of broken schedule."""

import dataclasses
import random

import pytest

from maestro_jax.core.plan import EdgeInfo
from maestro_jax.schedule import MicroStep, Problem, SampleMeta, Schedule, ScheduleError, naive, validate, wavefront
from maestro_jax.schedule.ops import delivered, feeders, feeds, shard_of

VLM = Problem(
    order=("vision", "llm"),
    sink="llm",
    trained=frozenset({"vision", "llm"}),
    edges=(EdgeInfo("img", "vision", "llm"),),
    rows={"vision": 4, "llm": 4},
    dp={"vision": 2, "llm": 2},
)
KD = Problem(
    order=("teacher", "student"),
    sink="student",
    trained=frozenset({"student"}),
    edges=(EdgeInfo("h", "teacher", "student"),),
    rows={"teacher": 8, "student": 4},
    dp={"teacher": 1, "student": 4},
)


def edge_problem(dp_p, mb_p, dp_c, mb_c, kd=False, bound=4):
    """One edge between any data-parallel degrees: vision -> llm (both trained), or a frozen teacher -> student."""
    src, dst, edge = ("teacher", "student", "h") if kd else ("vision", "llm", "img")
    return Problem(
        order=(src, dst),
        sink=dst,
        trained=frozenset({dst} if kd else {src, dst}),
        edges=(EdgeInfo(edge, src, dst),),
        rows={src: dp_p * mb_p, dst: dp_c * mb_c},
        dp={src: dp_p, dst: dp_c},
        max_in_flight=bound,
    )


# fan-out, fan-in and uneven degrees (DP(producer) -> DP(consumer)), micro-batches of any size
ANY_DP = {
    "fan_out_2_6": (2, 3, 6, 1),
    "fan_in_6_2": (6, 1, 2, 2),
    "uneven_3_4": (3, 2, 4, 1),
    "uneven_6_4": (6, 1, 4, 2),
    "uneven_4_3": (4, 1, 3, 1),
    "uneven_5_3": (5, 2, 3, 2),
}


def metas(n, seed, image_p=0.5, kd=False):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        if kd:
            out.append(SampleMeta(frozenset({"teacher", "student"}), {"teacher": 10, "student": 10}))
        elif rng.random() < image_p:
            out.append(SampleMeta(frozenset({"vision", "llm"}), {"vision": rng.choice([16, 32, 64]), "llm": 20}))
        else:
            out.append(SampleMeta(frozenset({"llm"}), {"llm": rng.randint(5, 40)}))
    return out


@pytest.mark.parametrize("seed", range(20))
def test_naive_validates(seed):
    m = metas(16, seed)
    validate(naive(m, VLM), m, VLM)
    k = metas(16, seed, kd=True)
    validate(naive(k, KD), k, KD)


def test_naive_order_is_arrival_order():
    """The sink takes the samples as they arrive; each vision shard takes, in arrival order, the
    image samples whose LLM row it feeds."""
    m = metas(12, 3)
    s = naive(m, VLM)
    assert [x for st in s.steps["llm"] for x in st.samples] == list(range(12))
    llm_shard = {x: r // 2 for st in s.steps["llm"] for r, x in enumerate(st.positions) if x >= 0}
    for shard in range(2):
        got = [x for st in s.steps["vision"] for x in st.positions[2 * shard : 2 * shard + 2] if x >= 0]
        assert got == [i for i, x in enumerate(m) if "vision" in x.sections and llm_shard[i] == shard]


def test_feeders_overlap_shares_of_the_batch():
    """Producer shard i feeds consumer shard j when their shares of the batch overlap: the block
    map for fan-out, DP(p)/DP(c) whole feeders for fan-in, and a shard on a boundary fed twice
    for uneven degrees; `shard_of` always lands on a shard fed by every section's shard."""
    assert [list(feeders(2, 6, j)) for j in range(6)] == [[0], [0], [0], [1], [1], [1]]
    assert [list(feeders(6, 2, j)) for j in range(2)] == [[0, 1, 2], [3, 4, 5]]
    assert [list(feeders(3, 4, j)) for j in range(4)] == [[0], [0, 1], [1, 2], [2]]
    assert [list(feeders(6, 4, j)) for j in range(4)] == [[0, 1], [1, 2], [3, 4], [4, 5]]
    assert delivered(2, 6)[1] == 1 and delivered(6, 2)[1] == 3 and delivered(3, 4)[1] == 2
    for a in range(1, 9):
        for b in range(1, 9):
            for i in range(a):
                assert [j for j in range(b) if feeds(a, i, b, j)] == list(feeders(b, a, i))
            for c in range(8):
                for x in range(40):
                    shards = {d: shard_of(8, d, c, x) for d in (a, b, 8)}
                    assert shards[8] == c
                    assert feeds(a, shards[a], b, shards[b]) and feeds(a, shards[a], 8, c)
                    if 8 % a == 0:
                        assert shards[a] == c // (8 // a)


@pytest.mark.parametrize("case", list(ANY_DP))
def test_any_data_parallel_degrees_schedule_validly(case):
    """Naive and wavefront keep the placement rule for any degrees, and every route points at a row
    its consumer shard receives (`delivered`)."""
    dp_p, mb_p, dp_c, mb_c = ANY_DP[case]
    for kd in (False, True):
        problem = edge_problem(dp_p, mb_p, dp_c, mb_c, kd=kd)
        src, dst = problem.order
        (edge,) = problem.edges
        for seed in range(8):
            m = metas(random.Random(seed).choice([7, 12, 24, 40]), seed)
            m = (
                [
                    SampleMeta(frozenset({"teacher", "student"}), {"teacher": x.work["llm"], "student": x.work["llm"]})
                    for x in m
                ]
                if kd
                else m
            )
            for sched in (naive(m, problem), wavefront(m, problem)):
                validate(sched, m, problem, in_flight=sched.name == "wavefront", block_map=True)
                feeding, width = delivered(dp_p, dp_c)
                for st in sched.steps[dst]:
                    routes = sched.routes(problem, dst, st.index)[edge.name]
                    deps = st.deps.get(edge.name, ())
                    for r, x in enumerate(st.positions):
                        if x < 0 or src not in m[x].sections:
                            assert routes[r] == -1
                            continue
                        pos, rest = divmod(routes[r], dp_c * width * mb_p)
                        j, rest = divmod(rest, width * mb_p)
                        t, o = divmod(rest, mb_p)
                        assert j == r // mb_c, "a row's producer output must sit on its own shard"
                        i = feeding[j].start + t
                        assert i in feeding[j]
                        assert sched.steps[src][deps[pos]].positions[i * mb_p + o] == x


def test_validate_catches_a_row_its_producer_shard_does_not_feed():
    """Fan-in 6 -> 2: a sample of teacher shards 0..2 on student shard 1 breaks the placement rule."""
    problem = edge_problem(6, 1, 2, 2, kd=True)
    m = [SampleMeta(frozenset({"teacher", "student"}), {"teacher": 5, "student": 5}) for _ in range(4)]
    good = naive(m, problem)
    validate(good, m, problem, block_map=True)
    st = good.steps["student"][0]
    swapped = dataclasses.replace(st, positions=(st.positions[2], st.positions[1], st.positions[0], st.positions[3]))
    bad = Schedule({**good.steps, "student": (swapped,)}, good.ops, good.num_samples)
    validate(bad, m, problem)  # the samples and dependencies still hold
    with pytest.raises(ScheduleError, match="feeds student shards"):
        validate(bad, m, problem, block_map=True)
    with pytest.raises(ScheduleError, match="does not feed"):
        bad.routes(problem, "student", 0)


def test_routes_point_at_producer_rows():
    m = metas(16, 5)
    s = naive(m, VLM)
    for st in s.steps["llm"]:
        routes = s.routes(VLM, "llm", st.index)["img"]
        deps = st.deps.get("img", ())
        for r, x in enumerate(st.positions):
            if x >= 0 and "vision" in m[x].sections:
                pos, q = divmod(routes[r], VLM.rows["vision"])
                assert s.steps["vision"][deps[pos]].positions[q] == x
            else:
                assert routes[r] == -1


def mutate(schedule, kind):
    steps = {k: list(v) for k, v in schedule.steps.items()}
    ops = list(schedule.ops)
    if kind == "drop_sample":
        st = steps["llm"][0]
        steps["llm"][0] = dataclasses.replace(st, positions=(-1,) + st.positions[1:])
    elif kind == "duplicate_sample":
        st = steps["llm"][1]
        steps["llm"][1] = dataclasses.replace(st, positions=(steps["llm"][0].positions[0],) + st.positions[1:])
    elif kind == "text_in_vision":
        st = steps["vision"][0]
        steps["vision"][0] = dataclasses.replace(st, positions=st.positions[:-1] + (0,))
    elif kind == "missing_dep":
        i = next(i for i, st in enumerate(steps["llm"]) if st.deps)
        steps["llm"][i] = dataclasses.replace(steps["llm"][i], deps={})
    elif kind == "op_order":
        i = next(i for i, op in enumerate(ops) if op.kind == "F" and op.section == "llm")
        ops.insert(0, ops.pop(i))
    elif kind == "missing_op":
        ops = [op for op in ops if op.kind != "U"]
    elif kind == "backward_before_cotangent":
        i = next(i for i, op in enumerate(ops) if op.kind == "B")
        j = next(j for j, op in enumerate(ops) if op.kind == "XB")
        ops[i], ops[j] = ops[j], ops[i]
    return Schedule({k: tuple(v) for k, v in steps.items()}, tuple(ops), schedule.num_samples)


@pytest.mark.parametrize(
    "kind",
    [
        "drop_sample",
        "duplicate_sample",
        "text_in_vision",
        "missing_dep",
        "op_order",
        "missing_op",
        "backward_before_cotangent",
    ],
)
def test_validate_catches(kind):
    m = [
        SampleMeta(frozenset({"llm"}), {"llm": 5})
        if i % 3 == 0
        else SampleMeta(frozenset({"vision", "llm"}), {"vision": 16, "llm": 5})
        for i in range(12)
    ]
    good = naive(m, VLM)
    validate(good, m, VLM)
    with pytest.raises(ScheduleError):
        validate(mutate(good, kind), m, VLM)


def test_in_flight_bound_is_checked():
    m = metas(32, 1, image_p=1.0)
    s = naive(m, dataclasses.replace(VLM, max_in_flight=2))
    with pytest.raises(ScheduleError, match="stashes"):
        validate(s, m, dataclasses.replace(VLM, max_in_flight=2), in_flight=True)


def test_microstep_samples_skip_padding():
    assert MicroStep("x", 0, (3, -1, 5), {}).samples == (3, 5)
