"""Calibrated cost model: time each section's compiled programs on the machine at hand.

Runs a few global batches in timed mode (every operation waited for), then fits, per section
and kind of program, t = overhead + per_unit * (micro_batch * B) + per_unit2 * (micro_batch * B**2)
over the shape buckets B that occurred, by non-negative least squares.
"""

from __future__ import annotations

import dataclasses
import time
from collections import defaultdict

import jax
import numpy as np

from maestro_jax.core.buckets import bucket
from maestro_jax.planning.cost import CostModel, SectionCost
from maestro_jax.runtime.step import StepBatch, TrainState
from maestro_jax.schedule import sample_metas


@dataclasses.dataclass(frozen=True)
class HostWork:
    """`measure`'s row of the host's packing of a batch of `samples` (its time: seconds)."""

    samples: int


@dataclasses.dataclass(frozen=True)
class UpdateWork:
    """`measure`'s row of `section`'s optimizer update (its time: seconds)."""

    section: str


def measure(rt, state, batches, repeats: int = 2) -> tuple[list[tuple], TrainState]:
    """(op, schedule, metas, seconds) for every op of `batches`, best of `repeats` (after a warm-up),
    from the step's measured timeline (`SectionedStep.timeline`) starting at `state` (a
    `TrainState`), and the state after the timed updates: each update takes the state it follows
    (with `compile.donate`, as on accelerators, it consumes its input's buffers, so the caller
    goes on from the returned state, never the one it passed in).

    Host work is measured too, in rows of its own kind (never an op): `HostWork(n_samples)` for
    packing a batch's micro-steps and `UpdateWork(section)` for each optimizer update, each with
    its seconds. An op's time is (device seconds, issue seconds).
    """
    out = []
    for samples in batches:
        metas = sample_metas(rt.graph, samples)
        schedule = rt.schedule(samples)
        best: dict = {}
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            host = rt.executor.host_batches(samples, schedule)
            t_host = time.perf_counter() - t0
            grads, record = rt.step.timeline(state, StepBatch(samples, schedule, host=host))
            sections = dict(state.sections)
            for s, g in grads.items():
                t0 = time.perf_counter()
                sections[s] = rt.programs[s].update(sections[s], g)
                jax.block_until_ready(sections[s].params)
                if i:
                    best[UpdateWork(s)] = min(best.get(UpdateWork(s), np.inf), time.perf_counter() - t0)
            state = dataclasses.replace(state, sections=sections)
            if i == 0:
                continue  # compiles
            best[HostWork(len(samples))] = min(best.get(HostWork(len(samples)), np.inf), t_host)
            for op, t0, t1, issue in record:
                # device time = waited time - host time to issue; both are fitted separately
                prev = best.get(op, (np.inf, np.inf))
                best[op] = (min(prev[0], t1 - t0 - issue), min(prev[1], issue))
        out += [(op, schedule, metas, t) for op, t in best.items()]
    return out, state


def _nnls(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with non-negative coefficients (tiny active-set loop over 3 columns)."""
    active = list(range(x.shape[1]))
    while True:
        coef = np.zeros(x.shape[1])
        sol = np.linalg.lstsq(x[:, active], y, rcond=None)[0]
        coef[active] = sol
        if (sol >= 0).all() or len(active) == 1:
            return np.maximum(coef, 0)
        active.pop(int(np.argmin(sol)))


def _section_cost(s: str, sink: bool, coefs: dict, points: dict, per_octave: int) -> SectionCost:
    """Section `s`'s fitted forward (the sink's loss-and-grad) coefficients, and its backward's
    cost relative to the forward from the fitted totals at a typical bucket (2 where unmeasured)."""
    base_kind = "L" if sink else "F"
    o, u, u2 = coefs.get((s, base_kind), (0.0, 0.0, 0.0))
    back = coefs.get((s, "B"))
    typical = np.mean([r[1] for r in points.get((s, base_kind), [(0, 1, 1, 0)])])
    fwd_t = o + u * typical
    factor = float((back[0] + back[1] * typical) / fwd_t) if back is not None and fwd_t > 0 else 2.0
    return SectionCost(
        per_unit_s=float(u),
        per_unit2_s=float(u2),
        overhead_s=float(o),
        backward_factor=factor,
        sink_factor=1.0,
        per_octave=per_octave,
    )


def fit(rt, measurements) -> CostModel:
    p = rt.problem
    points = defaultdict(list)
    transfers = defaultdict(list)
    host, updates, dispatch = [], defaultdict(list), defaultdict(list)
    per_octave = rt.cfg.compile.buckets_per_octave  # the buckets the measured steps ran at
    for op, schedule, metas, t in measurements:
        if isinstance(op, HostWork):
            host.append(t / op.samples)
            continue
        if isinstance(op, UpdateWork):
            updates[op.section].append(t)
            continue
        t, issue = t
        dispatch[op.kind].append(issue)
        if op.kind == "U":
            continue
        st = schedule.steps[op.section][op.step]
        units = [metas[x].work.get(op.section, 0) for x in st.samples]
        if op.kind in ("X", "XB"):
            transfers[op.edge].append((sum(units), t))
            continue
        kind = "L" if op.section == p.sink else op.kind
        mb = p.micro_batch(op.section)
        b = bucket(max(units, default=0), 16, per_octave)
        points[(op.section, kind)].append((1.0, mb * b, mb * b * b, t))
    coefs = {}
    for key, rows in points.items():
        a = np.asarray(rows)
        coefs[key] = _nnls(a[:, :3], a[:, 3])
    sections = {s: _section_cost(s, s == p.sink, coefs, points, per_octave) for s in p.order}
    per_unit, overhead = {}, []
    for edge, rows in transfers.items():
        a = np.asarray(rows, dtype=float)
        c = _nnls(np.stack([np.ones(len(a)), a[:, 0]], 1), a[:, 1])
        overhead.append(c[0])
        per_unit[edge] = float(c[1])
    return CostModel(
        sections,
        per_unit,
        float(np.mean(overhead)) if overhead else 0.0,
        source="calibrated",
        host_s_per_sample=float(np.median(host)) if host else 0.0,
        update_s={s: float(np.median(v)) for s, v in updates.items()},
        dispatch_s={k: float(np.median(v)) for k, v in dispatch.items()},
    )
