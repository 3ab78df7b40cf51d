"""The naive schedule holds every dependency; validate catches every kind of broken schedule."""

import dataclasses
import random

import pytest

from maestro_jax.core.plan import EdgeInfo
from maestro_jax.schedule import MicroStep, Problem, SampleMeta, Schedule, ScheduleError, naive, validate

VLM = Problem(order=("vision", "llm"), sink="llm", trained=frozenset({"vision", "llm"}),
              edges=(EdgeInfo("img", "vision", "llm"),), rows={"vision": 4, "llm": 4}, dp={"vision": 2, "llm": 2},
              fanout={"img": 1})
KD = Problem(order=("teacher", "student"), sink="student", trained=frozenset({"student"}),
             edges=(EdgeInfo("h", "teacher", "student"),), rows={"teacher": 8, "student": 4},
             dp={"teacher": 1, "student": 4}, fanout={"h": 4})


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
    m = metas(12, 3)
    s = naive(m, VLM)
    assert [x for st in s.steps["llm"] for x in st.samples] == list(range(12))
    assert [x for st in s.steps["vision"] for x in st.samples] == [i for i, x in enumerate(m) if "vision" in x.sections]


def test_routes_point_at_producer_rows():
    m = metas(16, 5)
    s = naive(m, VLM)
    for st in s.steps["llm"]:
        routes = s.routes(VLM, "llm", st.index)["img"]
        deps = st.deps.get("img", ())
        for r, x in enumerate(st.rows):
            if x >= 0 and "vision" in m[x].sections:
                pos, q = divmod(routes[r], VLM.rows["vision"])
                assert s.steps["vision"][deps[pos]].rows[q] == x
            else:
                assert routes[r] == -1


def mutate(schedule, kind):
    steps = {k: list(v) for k, v in schedule.steps.items()}
    ops = list(schedule.ops)
    if kind == "drop_sample":
        st = steps["llm"][0]
        steps["llm"][0] = dataclasses.replace(st, rows=(-1,) + st.rows[1:])
    elif kind == "duplicate_sample":
        st = steps["llm"][1]
        steps["llm"][1] = dataclasses.replace(st, rows=(steps["llm"][0].rows[0],) + st.rows[1:])
    elif kind == "text_in_vision":
        st = steps["vision"][0]
        steps["vision"][0] = dataclasses.replace(st, rows=st.rows[:-1] + (0,))
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


@pytest.mark.parametrize("kind", ["drop_sample", "duplicate_sample", "text_in_vision", "missing_dep", "op_order",
                                  "missing_op", "backward_before_cotangent"])
def test_validate_catches(kind):
    m = [SampleMeta(frozenset({"llm"}), {"llm": 5}) if i % 3 == 0 else
         SampleMeta(frozenset({"vision", "llm"}), {"vision": 16, "llm": 5}) for i in range(12)]
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
