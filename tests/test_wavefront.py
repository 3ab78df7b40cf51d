"""Wavefront scheduling over many random batches, on one edge and on any section DAG with one
sink: valid, block-mapped, within the in-flight bound, never (or, against a naive that is not
block-mapped, barely) slower than naive in simulation and strictly faster on mixed batches."""

import itertools
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from maestro_jax.core.plan import EdgeInfo
from maestro_jax.planning.cost import CostModel, SectionCost
from maestro_jax.planning.simulator import simulate
from maestro_jax.schedule import Problem, SampleMeta, Schedule, ScheduleError, list_schedule, naive, validate, wavefront
from maestro_jax.schedule.ops import link


def vlm_problem(dp_v, fanout, mb_v, mb_l, bound=4):
    return Problem(
        order=("vision", "llm"),
        sink="llm",
        trained=frozenset({"vision", "llm"}),
        edges=(EdgeInfo("img", "vision", "llm"),),
        rows={"vision": dp_v * mb_v, "llm": dp_v * fanout * mb_l},
        dp={"vision": dp_v, "llm": dp_v * fanout},
        max_in_flight=bound,
    )


def kd_problem(dp_t, fanout, mb_t, mb_s):
    return Problem(
        order=("teacher", "student"),
        sink="student",
        trained=frozenset({"student"}),
        edges=(EdgeInfo("h", "teacher", "student"),),
        rows={"teacher": dp_t * mb_t, "student": dp_t * fanout * mb_s},
        dp={"teacher": dp_t, "student": dp_t * fanout},
    )


PROBLEMS = [vlm_problem(1, 4, 4, 1), vlm_problem(2, 1, 2, 2), vlm_problem(2, 2, 2, 1), vlm_problem(1, 2, 4, 2, bound=2)]


def random_batch(rng, n, image_p):
    out = []
    for _ in range(n):
        if rng.random() < image_p:
            out.append(
                SampleMeta(
                    frozenset({"vision", "llm"}), {"vision": rng.choice([16, 64, 256]), "llm": rng.randint(20, 300)}
                )
            )
        else:
            out.append(SampleMeta(frozenset({"llm"}), {"llm": rng.randint(5, 300)}))
    return out


@pytest.mark.parametrize("problem", PROBLEMS, ids=lambda p: f"dp{p.dp['vision']}_{p.dp['llm']}_b{p.max_in_flight}")
def test_random_batches(problem):
    rng = random.Random(0)
    cost = CostModel(
        {"vision": SectionCost(1e-3, overhead_s=0.01), "llm": SectionCost(2e-3, 1e-6, 0.02)},
        {"img": 1e-5},
        source="test",
    )
    strictly_better = mixed = 0
    for _ in range(60):
        metas = random_batch(rng, rng.choice([8, 12, 16, 24, 32]), rng.choice([0.0, 0.3, 0.5, 0.8, 1.0]))
        for c in (None, cost):
            nv, wf = naive(metas, problem), wavefront(metas, problem, c)
            validate(nv, metas, problem)
            validate(wf, metas, problem, in_flight=True, block_map=True)
            t_naive, t_wave = simulate(nv, problem, metas, c).makespan, simulate(wf, problem, metas, c).makespan
            try:
                validate(nv, metas, problem, in_flight=True)
                naive_fits = True
            except ScheduleError:
                naive_fits = False  # naive stashes more forwards than memory allows: not a fair bar
            if naive_fits:
                assert t_wave <= t_naive * (1 + 1e-9), (t_wave, t_naive)
            n_img = sum("vision" in m.sections for m in metas)
            if 0 < n_img < len(metas):
                mixed += 1
                strictly_better += t_wave < t_naive
    assert mixed > 30
    assert strictly_better / mixed > 0.9, f"wavefront strictly faster on only {strictly_better}/{mixed} mixed batches"


def test_kd_random_batches():
    rng = random.Random(1)
    for problem in (kd_problem(2, 2, 4, 2), kd_problem(1, 4, 8, 2), kd_problem(4, 1, 2, 2)):
        for _ in range(20):
            metas = [
                SampleMeta(frozenset({"teacher", "student"}), {"teacher": n, "student": n})
                for n in (rng.randint(8, 400) for _ in range(16))
            ]
            nv, wf = naive(metas, problem), wavefront(metas, problem)
            validate(wf, metas, problem, in_flight=True, block_map=True)
            assert simulate(wf, problem, metas).makespan <= simulate(nv, problem, metas).makespan * (1 + 1e-9)


def test_figure7_vlm_fanout4_batch12():
    """The paper's Fig. 7: VLM, fanout 4, a global batch of 12 (6 with images, 6 text-only)."""
    problem = vlm_problem(dp_v=1, fanout=4, mb_v=4, mb_l=1)
    kinds = "ITITTIITITIT"  # arrival order: I = with image, T = text only
    metas = [
        SampleMeta(frozenset({"vision", "llm"}), {"vision": 64, "llm": 100})
        if k == "I"
        else SampleMeta(frozenset({"llm"}), {"llm": 100})
        for k in kinds
    ]
    wf, nv = wavefront(metas, problem), naive(metas, problem)
    validate(wf, metas, problem, in_flight=True, block_map=True)
    # every vision micro-step's 4 rows (one vision shard) spread over the 4 LLM shards it feeds
    assert all(len(st.positions) == 4 for st in wf.steps["vision"])
    t_wf, t_nv = simulate(wf, problem, metas), simulate(nv, problem, metas)
    spans = {str(i.op): i for i in t_wf.intervals}
    # the LLM (critical section) starts as soon as anything it can run is ready
    assert spans["F(llm,0)"].start <= spans["F(vision,0)"].end
    llm = sorted((i for i in t_wf.intervals if i.resource == "llm" and i.op.kind == "F"), key=lambda i: i.start)
    assert all(b.start == a.end for a, b in itertools.pairwise(llm)), "no bubble inside the LLM once it started"
    assert t_wf.makespan < t_nv.makespan
    assert t_wf.bubble_ratio < t_nv.bubble_ratio
    assert t_wf.lower_bound <= t_wf.makespan


def test_simulator_numbers():
    """Two sections, hand-computed timeline: producer F=4, sink L=3*mb*units, B=2*F."""
    problem = vlm_problem(dp_v=1, fanout=1, mb_v=1, mb_l=1)
    metas = [
        SampleMeta(frozenset({"vision", "llm"}), {"vision": 4, "llm": 2}),
        SampleMeta(frozenset({"llm"}), {"llm": 2}),
    ]
    t = simulate(naive(metas, problem), problem, metas)
    # naive: F(v,0)=[0,4]; F(llm,0)=[4,10]; F(llm,1)=[10,16]; B(v,0)=[10,18]
    spans = {str(i.op): (i.start, i.end) for i in t.intervals}
    assert spans["F(vision,0)"] == (0, 4)
    assert spans["F(llm,0)"] == (4, 10)
    assert spans["F(llm,1)"] == (10, 16)
    assert spans["B(vision,0)"] == (10, 18)
    assert t.makespan == 18
    assert t.busy == {"vision": 12, "llm": 12}
    assert t.lower_bound == 12
    assert abs(t.bubble_ratio - (1 - 24 / 36)) < 1e-12
    w = simulate(wavefront(metas, problem), problem, metas)
    assert w.makespan == 18  # image step first, then text-only while the vision backward runs


# --- any section DAG with one sink -------------------------------------------------------------


def dag_problem(order, sink, trained, edges, dp, mb, bound):
    """edges: (name, src, dst)."""
    return Problem(
        order=order,
        sink=sink,
        trained=frozenset(trained),
        edges=tuple(EdgeInfo(*e) for e in edges),
        rows={s: dp[s] * mb[s] for s in order},
        dp=dp,
        max_in_flight=bound,
    )


def omni_problem(dp_v, mb_v, dp_a, mb_a, dp_l, mb_l, bound=4, audio_trained=True):
    """vision -> llm <- audio."""
    return dag_problem(
        ("vision", "audio", "llm"),
        "llm",
        {"vision", "llm"} | ({"audio"} if audio_trained else set()),
        (("img", "vision", "llm"), ("aud", "audio", "llm")),
        {"vision": dp_v, "audio": dp_a, "llm": dp_l},
        {"vision": mb_v, "audio": mb_a, "llm": mb_l},
        bound,
    )


def chain_problem(dp_v, mb_v, dp_p, mb_p, dp_l, mb_l, bound=4, skip=False):
    """vision -> projector -> llm, all trained; `skip`: vision -> llm too (a producer with two consumers)."""
    edges = (("v2p", "vision", "projector"), ("p2l", "projector", "llm")) + (
        (("v2l", "vision", "llm"),) if skip else ()
    )
    return dag_problem(
        ("vision", "projector", "llm"),
        "llm",
        {"vision", "projector", "llm"},
        edges,
        {"vision": dp_v, "projector": dp_p, "llm": dp_l},
        {"vision": mb_v, "projector": mb_p, "llm": mb_l},
        bound,
    )


def vlm_kd_problem(dp_t, mb_t, dp_v, mb_v, dp_s, mb_s, bound=4):
    """teacher (frozen, every sample) -> student <- vision (trained, image samples)."""
    return dag_problem(
        ("teacher", "vision", "student"),
        "student",
        {"vision", "student"},
        (("h", "teacher", "student"), ("img", "vision", "student")),
        {"teacher": dp_t, "vision": dp_v, "student": dp_s},
        {"teacher": mb_t, "vision": mb_v, "student": mb_s},
        bound,
    )


MODALITIES = {
    "omni": ((), ({"vision"}, {"audio"})),
    "chain": ((), ({"vision", "projector"},)),
    "vlm_kd": (("teacher",), ({"vision"},)),
}


def dag_batch(rng, problem, shape, n, p):
    """The sink (and every `base` section) for every sample; each modality's sections with probability p."""
    base, modalities = MODALITIES[shape]
    out = []
    for _ in range(n):
        vision = rng.choice([16, 64, 256])
        work = {"vision": vision, "projector": vision // 4, "audio": rng.choice([32, 128, 512])}
        text = rng.randint(5, 300)
        secs = {problem.sink, *base}.union(*(m for m in modalities if rng.random() < p))
        out.append(SampleMeta(frozenset(secs), {s: work.get(s, text) for s in secs}))
    return out


DAG_COST = CostModel(
    {
        "vision": SectionCost(1e-3, overhead_s=0.01),
        "audio": SectionCost(5e-4, overhead_s=0.01),
        "projector": SectionCost(2e-4, overhead_s=0.002),
        "teacher": SectionCost(1e-3, 1e-6, 0.01),
        "llm": SectionCost(2e-3, 1e-6, 0.02),
        "student": SectionCost(2e-3, 1e-6, 0.02),
    },
    dict.fromkeys(("img", "aud", "v2p", "p2l", "v2l", "h"), 1e-05),
    source="test",
)

DAG_CASES = {
    "omni": ("omni", omni_problem(1, 4, 2, 2, 2, 2)),
    "omni_frozen_audio_b2": ("omni", omni_problem(2, 2, 4, 2, 4, 1, bound=2, audio_trained=False)),
    "chain": ("chain", chain_problem(1, 4, 2, 2, 4, 1)),
    "chain_b1": ("chain", chain_problem(2, 2, 2, 2, 2, 2, bound=1)),
    "chain_small_producer_b2": ("chain", chain_problem(1, 2, 2, 2, 2, 4, bound=2)),  # a sink step overfills vision
    "chain_skip": ("chain", chain_problem(1, 4, 2, 2, 4, 1, skip=True)),
    "chain_skip_b2": ("chain", chain_problem(2, 2, 2, 2, 4, 1, bound=2, skip=True)),
    "vlm_kd": ("vlm_kd", vlm_kd_problem(1, 4, 2, 2, 4, 1)),
    "vlm_kd_b1": ("vlm_kd", vlm_kd_problem(2, 2, 1, 2, 2, 2, bound=1)),
}


@pytest.mark.parametrize("case", list(DAG_CASES))
def test_dag_random_batches(case):
    """Graphs the scheduler used to refuse: valid, block-mapped, within the bound, never more than
    5% slower than naive (naive is not block-mapped, so it can pack better by luck) and, with room
    to overlap (bound 4), strictly faster on mixed batches. Naive that stashes more forwards than
    the bound allows is no bar: with bound 1 a trained producer must wait for each backward."""
    shape, problem = DAG_CASES[case]
    rng = random.Random(sorted(DAG_CASES).index(case))
    strictly_better = mixed = 0
    for _ in range(25):
        metas = dag_batch(rng, problem, shape, rng.choice([8, 16, 24, 32]), rng.choice([0.0, 0.3, 0.5, 0.8, 1.0]))
        for c in (None, DAG_COST):
            nv, wf = naive(metas, problem), wavefront(metas, problem, c)
            assert wf.name == "wavefront"
            validate(wf, metas, problem, in_flight=True, block_map=True)
            t_naive, t_wave = simulate(nv, problem, metas, c).makespan, simulate(wf, problem, metas, c).makespan
            try:
                validate(nv, metas, problem, in_flight=True)
                assert t_wave <= t_naive * 1.05, (t_wave, t_naive)
            except ScheduleError:
                pass
            if len({m.sections for m in metas}) > 1:
                mixed += 1
                strictly_better += t_wave < t_naive
    assert mixed > 20
    if problem.max_in_flight >= 4:
        assert strictly_better / mixed > 0.9, f"wavefront strictly faster on only {strictly_better}/{mixed}"


def stash_peaks(schedule, problem):
    """Per trained non-sink section, the most forwards stashed at once in the schedule's op order."""
    peaks = {}
    for s in problem.order:
        if problem.needs_backward(s):
            stash = peak = 0
            for op in schedule.ops:
                if op.section == s and op.kind in ("F", "B"):
                    stash += 1 if op.kind == "F" else -1
                    peak = max(peak, stash)
            peaks[s] = peak
    return peaks


@pytest.mark.parametrize("bound", [1, 2])
def test_chain_stash_peak(bound):
    """On chains the projector both receives cotangents (from the LLM) and sends them (to vision);
    its forwards and vision's stay within the bound, which naive exceeds on the same batches."""
    rng = random.Random(bound)
    for problem in (
        chain_problem(2, 2, 2, 2, 2, 2, bound),
        chain_problem(1, 4, 2, 2, 4, 1, bound, skip=True),
        chain_problem(1, 2, 2, 2, 2, 4, bound),
    ):
        most = {"vision": 0, "projector": 0}
        for _ in range(15):
            metas = dag_batch(rng, problem, "chain", rng.choice([16, 24, 32]), 0.8)
            wf = wavefront(metas, problem, rng.choice([None, DAG_COST]))
            peaks = stash_peaks(wf, problem)
            assert max(peaks.values()) <= bound, peaks
            most = {s: max(most[s], peaks[s]) for s in most}
            kinds = {(op.kind, op.edge) for op in wf.ops}
            assert {("XB", "p2l"), ("XB", "v2p")} <= kinds
            assert max(stash_peaks(naive(metas, problem), problem).values()) > bound
        assert most == {"vision": bound, "projector": bound}


def test_single_edge_tight_bound():
    """With bound 1 and several data shards, micro-steps cut per shard independently can leave a
    sink step waiting on two producer steps: such variants are dropped, never relaxed past the bound."""
    rng = random.Random(3)
    for problem in (
        vlm_problem(2, 2, 2, 1, bound=1),
        vlm_problem(4, 1, 2, 2, bound=1),
        vlm_problem(2, 2, 4, 2, bound=1),
    ):
        for _ in range(40):
            metas = random_batch(rng, rng.choice([16, 32, 64]), rng.choice([0.3, 0.5, 0.8]))
            validate(wavefront(metas, problem), metas, problem, in_flight=True, block_map=True)


def test_list_schedule_refuses_to_exceed_the_bound():
    """One LLM micro-step needs two vision micro-steps: with bound 1 vision cannot hold both."""
    metas = [SampleMeta(frozenset({"vision", "llm"}), {"vision": 4, "llm": 2}) for _ in range(2)]
    for bound, fits in ((1, False), (2, True)):
        problem = vlm_problem(dp_v=1, fanout=1, mb_v=1, mb_l=2, bound=bound)
        steps = link(problem, {"vision": [(0,), (1,)], "llm": [(0, 1)]})
        if fits:
            ops, _ = list_schedule(problem, steps, metas)
            assert stash_peaks(Schedule(steps, ops, 2), problem) == {"vision": 2}
        else:
            with pytest.raises(ScheduleError, match="in-flight"):
                list_schedule(problem, steps, metas)


def test_omni_text_fills_while_encoders_work():
    """Arrival order puts media first: naive's LLM waits for both encoders; the wavefront runs a
    text-only step while they work, the audio-only step among the media and the last text step at
    the end, so the LLM never idles and the backwards hide behind it: makespan = LLM busy time."""
    problem = omni_problem(1, 2, 1, 2, 1, 2)
    modality = {"B": {"vision", "audio"}, "V": {"vision"}, "A": {"audio"}, "T": set()}
    metas = [
        SampleMeta(frozenset({"llm"} | modality[k]), dict.fromkeys({"llm"} | modality[k], 10)) for k in "BBVVAATTTT"
    ]
    wf, nv = wavefront(metas, problem), naive(metas, problem)
    validate(wf, metas, problem, in_flight=True, block_map=True)
    t_wf, t_nv = simulate(wf, problem, metas), simulate(nv, problem, metas)
    # unit costs: encoder F = 2 rows * 10 = 20, B = 40; LLM step = 3 * 2 * 10 = 60, five of them
    assert t_wf.busy["llm"] == 300
    assert t_nv.makespan == 320  # the LLM starts when vision and audio finish their first steps
    assert t_wf.makespan == 300
    assert {str(i.op): i.start for i in t_wf.intervals}["F(llm,0)"] == 0


def test_vlm_kd_text_first_while_vision_works():
    """Teacher (frozen, cheap) for all, vision for the first four: the student starts on text as
    soon as the teacher's first step is done and ends on text while vision runs its backward."""
    problem = vlm_kd_problem(1, 2, 1, 2, 1, 2)
    metas = [
        SampleMeta(frozenset({"teacher", "vision", "student"}), {"teacher": 1, "vision": 15, "student": 10})
        if k == "I"
        else SampleMeta(frozenset({"teacher", "student"}), {"teacher": 1, "student": 10})
        for k in "IIIITTTT"
    ]
    wf, nv = wavefront(metas, problem), naive(metas, problem)
    validate(wf, metas, problem, in_flight=True, block_map=True)
    # unit costs: teacher F = 2, vision F = 30, B = 60, student step = 60 (four of them)
    assert simulate(nv, problem, metas).makespan == 30 + 240
    assert simulate(wf, problem, metas).makespan == 2 + 240


def random_dag(rng, any_dp=False):
    """2 to 5 sections in topological order, the last the sink; every section reaches it; data
    parallelism divides along edges (with `any_dp`: any degrees from 1 to 8, any micro-batches);
    a trained section feeds only trained sections or the sink."""
    names = [f"s{i}" for i in range(rng.randint(2, 5))]
    sink = names[-1]
    edges = [
        (a, names[j])
        for i, a in enumerate(names[:-1])
        for j in sorted(rng.sample(range(i + 1, len(names)), rng.randint(1, min(2, len(names) - 1 - i))))
    ]
    dp, mb, trained = {sink: rng.choice([1, 2, 4, 8] if not any_dp else range(1, 9))}, {}, {sink}
    for s in reversed(names[:-1]):
        g = math.gcd(*(dp[b] for a, b in edges if a == s))
        dp[s] = rng.choice([d for d in range(1, g + 1) if g % d == 0] if not any_dp else range(1, 9))
        if all(b in trained for a, b in edges if a == s) and rng.random() < 0.7:
            trained.add(s)
    for s in names:
        whole = 1 if any_dp else math.lcm(1, *(dp[b] // dp[s] for a, b in edges if a == s))
        mb[s] = whole * rng.choice([1, 2, 3])
    problem = dag_problem(
        tuple(names), sink, trained, tuple((f"{a}>{b}", a, b) for a, b in edges), dp, mb, rng.choice([1, 2, 4])
    )
    return problem


def test_random_dags():
    """Random graphs, plans and activations (some samples skip the sink): always a valid schedule."""
    rng = random.Random(7)
    for _ in range(30):
        problem = random_dag(rng)
        for _ in range(3):
            odds = {s: rng.random() for s in problem.order}
            metas = []
            for _ in range(rng.randint(1, 30)):
                secs = {s for s in problem.order if rng.random() < odds[s]} | (
                    {problem.sink} if rng.random() < 0.9 else set()
                )
                metas.append(SampleMeta(frozenset(secs), {s: rng.randint(1, 300) for s in secs}))
            validate(wavefront(metas, problem), metas, problem, in_flight=True, block_map=True)


def test_random_dags_any_data_parallel_degrees():
    """Random graphs whose edges join any data-parallel degrees (fan-out, fan-in, uneven: 3 -> 4,
    6 -> 4, 5 -> 7) and micro-batches: naive and wavefront schedules keep the placement rule and
    (wavefront) the bound, and the wavefront is never slower than naive where naive keeps the
    bound."""
    rng = random.Random(13)
    uneven = 0
    for _ in range(40):
        problem = random_dag(rng, any_dp=True)
        uneven += any(problem.dp[e.dst] % problem.dp[e.src] for e in problem.edges)
        for _ in range(3):
            odds = {s: rng.random() for s in problem.order}
            metas = []
            for _ in range(rng.randint(1, 30)):
                secs = {s for s in problem.order if rng.random() < odds[s]} | (
                    {problem.sink} if rng.random() < 0.9 else set()
                )
                metas.append(SampleMeta(frozenset(secs), {s: rng.randint(1, 300) for s in secs}))
            nv, wf = naive(metas, problem), wavefront(metas, problem)
            validate(nv, metas, problem, block_map=True)
            validate(wf, metas, problem, in_flight=True, block_map=True)
            try:
                validate(nv, metas, problem, in_flight=True)
            except ScheduleError:
                continue  # naive stashes more forwards than the bound allows: no bar
            assert simulate(wf, problem, metas).makespan <= simulate(nv, problem, metas).makespan * (1 + 1e-9)
    assert uneven > 20


def test_deterministic_across_hash_seeds():
    """Same batch and plan, same schedule, whatever the process's string hashing."""
    code = (
        "import random, test_wavefront as t; rng = random.Random(0); p = t.DAG_CASES['omni'][1]; "
        "m = t.dag_batch(rng, p, 'omni', 24, 0.5); w = t.wavefront(m, p, t.DAG_COST); "
        "print([st.positions for s in p.order for st in w.steps[s]], [str(o) for o in w.ops])"
    )
    outs = {
        subprocess.run(
            [sys.executable, "-c", code],
            cwd=Path(__file__).parent,
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONHASHSEED": seed},
            check=True,
        ).stdout
        for seed in ("1", "2")
    }
    assert len(outs) == 1


def test_lpt_heap_matches_the_linear_scan():
    """The heap-based LPT packs exactly as the definition (least-loaded bin with room, lowest
    index on ties), including ties among equal weights, full bins and one row per bin; the
    two-sort `_longest_first` orders as the (-weight, index) key."""
    from maestro_jax.schedule.wavefront import _longest_first, _lpt

    def scan(items, bins, capacity, weight):
        loads, slots = [0.0] * bins, [[] for _ in range(bins)]
        for x in sorted(items, key=lambda i: (-weight(i), i)):
            b = min((i for i in range(bins) if len(slots[i]) < capacity), key=lambda i: (loads[i], i))
            slots[b].append(x)
            loads[b] += weight(x)
        return slots

    rng = random.Random(0)
    for _ in range(300):
        bins, capacity = rng.randint(1, 9), rng.randint(1, 5)
        items = rng.sample(range(1000), rng.randint(0, bins * capacity))
        weights = {i: rng.choice([1, 2, 3, 0.5, rng.random() * 10]) for i in items}
        ordered = _longest_first(items, weights.get)
        assert ordered == sorted(items, key=lambda i: (-weights[i], i))
        assert _lpt(ordered, bins, capacity, weights.get) == scan(items, bins, capacity, weights.get)


def test_column_heap_places_as_the_linear_scan(monkeypatch):
    """`_Column.place` keeps its open shards in a heap; it must choose exactly what the
    definition does (least loaded shard with a free row and room in every capped section,
    lowest index on ties): the same schedules on every DAG case and the VLM problems."""
    import sys

    module = sys.modules["maestro_jax.schedule.wavefront"]

    def scan(self, x):
        caps = [(s, cap, where) for s, (cap, where, _) in self.caps.items() if s in self.metas[x].sections]
        room = [
            c
            for c, sh in enumerate(self.shards)
            if len(sh) < self.mb and all(self.used.get((s, where(c, x)), 0) < cap for s, cap, where in caps)
        ]
        if not room:
            return False
        c = min(room, key=lambda c: (self.loads[c], c))
        self.shards[c].append(x)
        self.loads[c] += self.weight(x)
        self.free -= 1
        for s, _, where in caps:
            self.used[(s, where(c, x))] = self.used.get((s, where(c, x)), 0) + 1
        return True

    rng = random.Random(7)
    cases = [(lambda r, p=p: random_batch(r, r.choice([8, 16, 24, 32]), r.random()), p) for p in PROBLEMS]
    cases += [
        (lambda r, s=s, p=p: dag_batch(r, p, s, r.choice([8, 16, 32]), r.random()), p) for s, p in DAG_CASES.values()
    ]
    heap = module._Column.place
    for make, problem in cases:
        for _ in range(10):
            metas = make(rng)
            for cost in (None, DAG_COST):  # work units, then a cost model
                monkeypatch.setattr(module._Column, "place", heap)
                fast = wavefront(metas, problem, cost)
                monkeypatch.setattr(module._Column, "place", scan)
                slow = wavefront(metas, problem, cost)
                assert (fast.ops, fast.steps) == (slow.ops, slow.steps)


# --- the linear-time rewrite against the scheduler it replaced -----------------------------------


def reference_cases():
    """(batch maker, problem): the VLM problems, two shaped like configs/vlm_paper_scale.yaml
    (vision data 8, LLM data 16, fanout 2, one row per sink shard; the ViT's micro-batch 2, no
    section capped, as the config was, and 1, capped, as it is), every DAG case
    (`chain_small_producer_b2` is capped) and random DAGs."""
    cases = [(lambda r, p=p: random_batch(r, r.choice([8, 16, 24, 32]), r.random()), p) for p in PROBLEMS]
    paper = vlm_problem(dp_v=8, fanout=2, mb_v=2, mb_l=1)
    cases.append((lambda r: random_batch(r, r.choice([48, 144]), 0.5), paper))
    # the config's plan today: one image a ViT shard, so the sink's columns are capped
    # (`wavefront._OneRowColumn`)
    capped = vlm_problem(dp_v=8, fanout=2, mb_v=1, mb_l=1)
    cases.append((lambda r: random_batch(r, r.choice([48, 144]), r.choice([0.3, 0.5, 0.8])), capped))
    cases += [
        (lambda r, s=s, p=p: dag_batch(r, p, s, r.choice([8, 16, 32]), r.random()), p) for s, p in DAG_CASES.values()
    ]
    rng = random.Random(11)
    for _ in range(8):
        problem = random_dag(rng)

        def make(r, problem=problem):
            odds = {s: r.random() for s in problem.order}
            out = []
            for _ in range(r.randint(1, 30)):
                secs = {s for s in problem.order if r.random() < odds[s]} | (
                    {problem.sink} if r.random() < 0.9 else set()
                )
                out.append(SampleMeta(frozenset(secs), {s: r.randint(1, 300) for s in secs}))
            return out

        cases.append((make, problem))
    return cases


@pytest.mark.slow
def test_schedules_identical_to_the_reference():
    """The scheduler made linear in the batch (memoised durations and placements, one-pass
    validation, sort and packing fast paths) returns, op by op and row by row, the schedule of
    the implementation it replaced (`wavefront_reference.py`), which stays within the bound; the
    producer-balancing variant added since (`schedule.balance_shards`), which the reference does
    not have, left out."""
    import dataclasses

    import wavefront_reference as ref

    rng = random.Random(5)
    for make, problem in reference_cases():
        problem = dataclasses.replace(problem, balance_shards=False)
        for _ in range(6):
            metas = make(rng)
            for cost in (None, DAG_COST) if set(problem.order) <= set(DAG_COST.sections) else (None,):
                new, old = wavefront(metas, problem, cost), ref.wavefront(metas, problem, cost)
                assert (new.ops, new.steps) == (old.ops, old.steps)
                validate(new, metas, problem, in_flight=True, block_map=True)
                assert ref.list_schedule(problem, new.steps, metas, cost) == list_schedule(
                    problem, new.steps, metas, cost
                )


def corrupted(schedule, problem, rng):
    """A copy of the schedule broken in one random way: two rows of a step swapped (off its block
    map), a sample duplicated or dropped, a dependency dropped or added, an op moved."""
    from dataclasses import replace

    steps = {s: list(v) for s, v in schedule.steps.items()}
    ops = list(schedule.ops)
    s = rng.choice([s for s in problem.order if steps[s]])
    k = rng.randrange(len(steps[s]))
    st = steps[s][k]
    rows = list(st.positions)
    how = rng.choice(["swap", "duplicate", "drop", "deps", "op"])
    if how == "swap":
        i, j = rng.randrange(len(rows)), rng.randrange(len(rows))
        rows[i], rows[j] = rows[j], rows[i]
    elif how == "duplicate" and any(x >= 0 for x in rows) and -1 in rows:
        rows[rows.index(-1)] = rng.choice([x for x in rows if x >= 0])
    elif how == "drop" and any(x >= 0 for x in rows):
        rows[rng.choice([i for i, x in enumerate(rows) if x >= 0])] = -1
    elif how == "deps" and problem.in_edges(s):
        e = rng.choice(problem.in_edges(s))
        deps = dict(st.deps)
        if deps.get(e.name) and rng.random() < 0.5:
            deps[e.name] = deps[e.name][1:]
        elif steps[e.src]:  # a producer step that exists (the reference fails with IndexError on others)
            deps[e.name] = tuple(sorted({*deps.get(e.name, ()), rng.randrange(len(steps[e.src]))}))
        st = replace(st, deps=deps)
    elif how == "op":
        op = ops.pop(rng.randrange(len(ops)))
        ops.insert(rng.randrange(len(ops) + 1), op)
    steps[s][k] = replace(st, positions=tuple(rows))
    return Schedule({s: tuple(v) for s, v in steps.items()}, tuple(ops), schedule.num_samples, schedule.name)


def test_validate_and_required_ops_match_the_reference():
    """One-pass validation raises exactly where (and with the message) the reference does, on
    good schedules and on corrupted ones; `required_ops` and `link` agree too, and so do the
    wavefront's arrival-order candidate and the reference's `naive`. (`naive` itself now places
    producers by the sink's rows, so that any data-parallel degrees keep the placement rule: it
    is checked to keep it here, not compared.)"""
    import wavefront_reference as ref

    from maestro_jax.schedule import required_ops
    from maestro_jax.schedule.wavefront import _arrival

    rng = random.Random(9)
    checked = 0
    for make, problem in reference_cases():
        for _ in range(4):
            metas = make(rng)
            good = wavefront(metas, problem)
            assert required_ops(good, problem) == ref.required_ops(good, problem)
            nv = naive(metas, problem)
            validate(nv, metas, problem, block_map=True)
            assert _arrival(metas, problem).steps == ref.naive(metas, problem).steps
            rows = {s: [st.positions for st in good.steps[s]] for s in problem.order}
            assert link(problem, rows) == ref.link(problem, rows)
            for sched in [good, nv] + [corrupted(good, problem, rng) for _ in range(6)]:
                for flags in ({}, {"in_flight": True, "block_map": True}):
                    outcome = []
                    for check in (validate, ref.validate):
                        try:
                            check(sched, metas, problem, **flags)
                            outcome.append(None)
                        except (ScheduleError, KeyError, IndexError) as err:
                            outcome.append((type(err), str(err)))
                    assert outcome[0] == outcome[1], (outcome, flags)
                    checked += outcome[0] is not None
    assert checked > 100  # the corruptions are caught, not just passed through


def test_pipeline_stages_are_also_scheduled_in_1f1b_order():
    """A KD teacher and student each in 4 stages, stage i of both on one device group (the
    pipelined layout as a plan). Earliest start first, a teacher stage runs its forwards ahead of
    the student stage's forward of an earlier micro-step, which the stages after it wait on; the
    wavefront list-schedules such a plan in 1F1B's order too (oldest micro-step first, each
    group's update after its backwards) and keeps the faster: here it is, within the stash
    bounds."""
    from maestro_jax.schedule.ops import pipeline_bounds

    k = 4
    teacher, student = [f"teacher.{i}" for i in range(k)], [f"student.{i}" for i in range(k)]
    edges = [
        EdgeInfo(f"{s}>{i + 1}", s, chain[i + 1]) for chain in (teacher, student) for i, s in enumerate(chain[:-1])
    ]
    order = (*teacher, *student)
    problem = Problem(
        order=order,
        sink=student[-1],
        trained=frozenset(student),
        edges=(*edges, EdgeInfo("hidden", teacher[-1], student[-1])),
        rows=dict.fromkeys(order, 2),
        dp=dict.fromkeys(order, 1),
        max_in_flight=k,
        groups={s: f"stage{i}" for chain in (teacher, student) for i, s in enumerate(chain)},
        bounds=pipeline_bounds({"teacher": teacher, "student": student}),
    )
    cost = CostModel(dict.fromkeys(order, SectionCost(1e-3)))
    rng = random.Random(0)
    metas = [SampleMeta(frozenset(order), dict.fromkeys(order, rng.choice([32, 48, 64, 96, 128]))) for _ in range(16)]
    chosen = wavefront(metas, problem, cost)
    _, earliest_first = list_schedule(problem, chosen.steps, metas, cost)
    assert simulate(chosen, problem, metas, cost).makespan < 0.95 * earliest_first
    assert all(peak <= problem.in_flight(s) for s, peak in stash_peaks(chosen, problem).items())
    validate(chosen, metas, problem, in_flight=True)


def test_a_first_stage_beside_an_encoder_keeps_1f1b_sequence():
    """A ViT beside the first of 4 LLM stages (the pipelined VLM layout as a plan), a third of
    the samples text only. Earliest start first or oldest micro-step first, the first stage's
    last forwards wait behind the backwards of earlier micro-steps (the ViT's among them), and
    every later stage waits on them; in 1F1B's sequence (a forward's age is its micro-step less
    its stage's warm-up) they do not. The wavefront keeps that schedule, within the bounds."""
    from maestro_jax.schedule.ops import pipeline_bounds
    from maestro_jax.schedule.wavefront import _Batch, _list_schedule

    k = 4
    llm = [f"llm.{i}" for i in range(k)]
    order = ("vision", *llm)
    edges = [EdgeInfo("image", "vision", llm[0])] + [
        EdgeInfo(f"{s}>{i + 1}", s, llm[i + 1]) for i, s in enumerate(llm[:-1])
    ]
    problem = Problem(
        order=order,
        sink=llm[-1],
        trained=frozenset(order),
        edges=tuple(edges),
        rows=dict.fromkeys(order, 2),
        dp=dict.fromkeys(order, 1),
        max_in_flight=2 * k,
        groups={"vision": "stage0", **{s: f"stage{i}" for i, s in enumerate(llm)}},
        bounds=pipeline_bounds({"llm": llm}),
    )
    cost = CostModel({**dict.fromkeys(llm, SectionCost(1e-3)), "vision": SectionCost(4e-3)})
    rng = random.Random(0)
    metas = []
    for i in range(20):
        work = dict.fromkeys(llm, rng.choice([32, 48, 64, 96, 128]))
        if i % 3:
            work["vision"] = rng.choice([16, 32])
        metas.append(SampleMeta(frozenset(work), work))
    chosen = wavefront(metas, problem, cost)
    batch = _Batch(metas, problem, cost)
    spans = {p: _list_schedule(batch, chosen.steps, p)[1] for p in ("earliest", "oldest", "1f1b")}
    assert spans["1f1b"] < 0.95 * min(spans["earliest"], spans["oldest"]), spans
    assert simulate(chosen, problem, metas, cost).makespan == pytest.approx(spans["1f1b"])
    assert all(peak <= problem.in_flight(s) for s, peak in stash_peaks(chosen, problem).items())
    validate(chosen, metas, problem, in_flight=True)


def test_the_sink_rows_deal_an_encoders_work_evenly_over_its_shards():
    """`_balanced`: a ViT and an LLM co-located on 4 data shards each (one row a shard), a quarter
    of the samples holding images, the heaviest among the longest texts. Sorted by the LLM's
    tokens alone the image samples crowd the first shards; dealt anew inside each of the sink's
    micro-steps (which costs the LLM nothing: its rows are padded to the longest either way),
    every ViT shard gets the same number of them, and the ViT's micro-steps fall from 2 to 1.
    The wavefront keeps the faster schedule, which is this one, and it is valid."""
    from maestro_jax.schedule.wavefront import _balanced, _Batch, _pack

    order = ("vision", "llm")
    problem = Problem(
        order=order,
        sink="llm",
        trained=frozenset(order),
        edges=(EdgeInfo("image", "vision", "llm"),),
        rows=dict.fromkeys(order, 4),
        dp=dict.fromkeys(order, 4),
        groups=dict.fromkeys(order, "all"),
    )
    cost = CostModel({"vision": SectionCost(2e-3), "llm": SectionCost(1e-3)})
    metas = []
    for i in range(16):
        work = {"llm": 256 - 8 * i}
        if i in (0, 1, 4, 5):  # two images in each of the first two micro-steps' first two rows
            work["vision"] = 96
        metas.append(SampleMeta(frozenset(work), work))
    batch = _Batch(metas, problem, cost)
    sorted_columns = _pack(batch.active, 4, 4, batch.work["llm"].__getitem__)
    dealt = _balanced(batch, sorted_columns)
    assert [sorted(c) for c in dealt] == [sorted(c) for c in sorted_columns]  # the same micro-steps
    for columns, shards in ((sorted_columns, [2, 2, 0, 0]), (dealt, [1, 1, 1, 1])):
        placed = [sum(1 for c in columns for x in batch.placed(c, "vision")[j]) for j in range(4)]
        assert placed == shards
    chosen = wavefront(metas, problem, cost)
    assert len(chosen.steps["vision"]) == 1
    assert (
        simulate(chosen, problem, metas, cost).makespan
        < list_schedule(
            problem, link(problem, {"llm": sorted_columns, "vision": _vision_rows(batch, sorted_columns)}), metas, cost
        )[1]
    )
    validate(chosen, metas, problem, in_flight=True)


def _vision_rows(batch, columns):
    """The ViT's micro-steps of the sink's `columns`: each shard's samples in column order, one a step."""
    streams = [[x for c in columns for x in batch.placed(c, "vision")[j]] for j in range(4)]
    return [tuple(s[k] if k < len(s) else -1 for s in streams) for k in range(max(map(len, streams)))]


def test_one_row_columns_are_the_heaps_columns():
    """The sink's capped columns with one row a sink shard and one capped section
    (`_OneRowColumn`, O(1) a sample) are `_Column`'s, sample for sample, over random batches,
    fan-outs, caps and orders."""
    import functools

    from maestro_jax.schedule.wavefront import _caps, _Column, _columns, _OneRowColumn

    rng = random.Random(3)
    for _ in range(200):
        dp_v, fanout, mb_v = rng.choice([1, 2, 4, 8]), rng.choice([1, 2, 4]), rng.choice([1, 2])
        problem = vlm_problem(dp_v, fanout, mb_v, 1)
        caps = _caps(problem)
        if not caps:
            continue
        metas = random_batch(rng, rng.randint(1, 80), rng.random())
        ordered = rng.sample(range(len(metas)), len(metas))
        sections = [m.sections for m in metas]
        fast = _columns(ordered, functools.partial(_OneRowColumn, sections, "vision", fanout, mb_v, dp_v * fanout))
        weight = [m.work.get("llm", 0) for m in metas].__getitem__
        assert fast == _columns(ordered, functools.partial(_Column, problem, metas, weight, caps))


def test_shared_candidate_work_leaves_the_schedules_as_they_were():
    """The wavefront with its per-candidate work shared (each candidate's op graph built once for
    its list schedules and its naive order's makespan, the naive orders checked only until one
    wins, candidates whose busiest device group alone outlasts the best skipped, ops as named
    tuples) returns, op by op and row by row, what it returned before (`wavefront_previous.py`,
    the scheduler at 45843ff), producer-balancing included, on every reference case under unit
    costs and a cost model, and on the paper's VLM shape at 144 samples. Where no sample of a
    batch reaches the sink it failed (IndexError, dealing no columns); it now schedules it."""
    import wavefront_previous as previous

    rng = random.Random(13)
    cases = reference_cases()
    paper = vlm_problem(dp_v=8, fanout=2, mb_v=1, mb_l=1)
    cases.append((lambda r: random_batch(r, 144, r.choice([0.3, 0.5, 0.8])), paper))
    compared = fixed = 0
    for make, problem in cases:
        for _ in range(3):
            metas = make(rng)
            for cost in (None, DAG_COST) if set(problem.order) <= set(DAG_COST.sections) else (None,):
                new = wavefront(metas, problem, cost)
                try:
                    old = previous.wavefront(metas, problem, cost)
                except IndexError:  # it failed on a batch none of whose samples reach the sink
                    assert not any(problem.sink in m.sections for m in metas)
                    validate(new, metas, problem, in_flight=True, block_map=True)
                    fixed += 1
                    continue
                assert (new.ops, new.steps) == (old.ops, old.steps)
                compared += 1
    assert compared > 100 and fixed


@pytest.mark.slow  # a subprocess importing jax; the schedules' equality is quick-tier in the test above
def test_schedule_tiny_script_times_both_schedulers_on_the_same_schedules(tmp_path):
    """`scripts/schedule_tiny.py` (RESULTS' tiny-config scheduling figures) times today's
    wavefront and the previous one on a config's batches, both ways it is called, and exits 0
    only when their schedules are the same."""
    import json

    out = tmp_path / "tiny.json"
    script = Path(__file__).resolve().parent.parent / "scripts" / "schedule_tiny.py"
    args = [sys.executable, str(script), "--batches", "2", "--configs", "kd_tiny", "--json", str(out)]
    done = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    (row,) = json.loads(out.read_text())
    assert row["config"] == "kd_tiny" and row["identical"] is True
    for way in ("training", "bench"):
        assert row[f"{way}_previous_ms"] > 0 and row[f"{way}_today_ms"] > 0
        assert row[f"{way}_ratio"] == row[f"{way}_previous_ms"] / row[f"{way}_today_ms"]
