"""Equivalence check: one global batch through the section runtime and the monolithic baseline."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import numpy as np

from maestro_jax.config import Config
from maestro_jax.runtime.ahead import trace_batches
from maestro_jax.runtime.build import Runtime, build_runtime
from maestro_jax.runtime.stages import whole_params, whole_states


@dataclasses.dataclass(frozen=True)
class Diff:
    name: str
    max_abs: float
    max_rel: float  # ||a - b||_2 / ||b||_2 over all leaves of the quantity


def compare(name: str, a, b) -> Diff:
    """Max absolute and L2-relative difference over a whole tree.

    Relative error is taken over the tree, not per element or per leaf: some leaves have a true
    value of exactly zero (a key-projection bias gets no gradient through softmax) and hold pure
    rounding noise in both runs, which any per-leaf ratio would blow up.
    """
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    if len(la) != len(lb):
        raise ValueError(f"{name}: {len(la)} leaves vs {len(lb)}")
    worst_abs, diff_sq, ref_sq = 0.0, 0.0, 0.0
    for x, y in zip(la, lb):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        if x.shape != y.shape:
            raise ValueError(f"{name}: leaf shapes differ, {x.shape} vs {y.shape}")
        if x.size:
            worst_abs = max(worst_abs, float(np.max(np.abs(x - y))))
        diff_sq += float(np.sum((x - y) ** 2))
        ref_sq += float(np.sum(y**2))
    rel = np.sqrt(diff_sq / ref_sq) if ref_sq > 0 else (0.0 if diff_sq == 0 else float("inf"))
    return Diff(name, worst_abs, float(rel))


def matmul_precision(platform: str, cfg: Config) -> str | None:
    """The float32 matmul precision `verify` needs: on a GPU, where a section computes in float32,
    "highest" (jax's default there runs float32 matmuls in TF32, 10 mantissa bits, and the two
    sides' different summation orders would then differ by about 1e-3, not float rounding). None
    where the default already computes in full float32 (CPU), or where every section computes in
    bfloat16 or fp8 (their own tolerance covers the rounding; fp8's products name their own)."""
    if platform != "gpu" or all(s.precision in ("bfloat16", "fp8") for s in cfg.sections.values()):
        return None
    return "highest"


def verify(
    cfg: Config, rt: Runtime | None = None, step: int = 0, progress: Callable[[str], None] | None = None
) -> list[Diff]:
    """Loss, every trained section's grads and updated params: maestro vs monolithic, at the
    float32 matmul precision `matmul_precision` names (said once on stdout where it is set).
    `progress`, when given, receives one line before each phase (building, each step)."""
    precision = matmul_precision(jax.default_backend(), cfg)
    if precision is None:
        return _verify(cfg, rt, step, progress or (lambda _: None))
    print(f"verify: float32 matmuls at precision {precision!r} on {jax.default_backend()} (TF32 otherwise)", flush=True)
    with jax.default_matmul_precision(precision):
        return _verify(cfg, rt, step, progress or (lambda _: None))


def _verify(cfg: Config, rt: Runtime | None, step: int, say: Callable[[str], None]) -> list[Diff]:
    if rt is None:
        say(f"building the runtime of {cfg.workload} ({len(cfg.sections)} sections) and its batches")
        rt = build_runtime(cfg)
    samples = rt.batches()[step]
    trace_batches(rt.step, [samples])  # a section whose code does not fit its shapes is named before any compile
    sections = ", ".join(rt.problem.order)
    say(f"one step of the sectioned plan ({sections}) on batch {step}: compiling its programs, then running")
    sectioned = rt.step
    state = sectioned.init()
    loss, grads, _ = sectioned.gradients(state, samples)
    norms = sectioned.squared_norms(grads)
    updated = sectioned.apply(state, grads, norms)

    say("the monolithic step on the same batch: compiling its program, then running")
    mono = rt.monolithic.step
    m_state = mono.start_from(whole_states(rt.graph, rt.programs, state.sections))  # the same weights
    m_loss, m_grads, _ = mono.gradients(m_state, samples)
    m_norms = mono.squared_norms(m_grads)
    m_updated = mono.apply(m_state, m_grads)

    diffs = [
        compare("loss", loss, m_loss),
        compare("grad_norm", global_norm(norms, rt.coordinator.fetch), global_norm(m_norms, rt.coordinator.fetch)),
    ]
    whole_grads = whole_params(rt.graph, grads)  # a section in pipeline stages compared whole
    params = whole_params(rt.graph, {s: updated[s].params for s in grads})
    for s in sorted(whole_grads):
        diffs.append(compare(f"{s}/grads", whole_grads[s], m_grads[s]))
        diffs.append(compare(f"{s}/params_after_update", params[s], m_updated[s].params))
    return diffs


def global_norm(norms_sq, fetch) -> float:
    """The gradient norm over every section, from each one's squared norm (read by `fetch`,
    `Coordinator.fetch`: a section may live on other processes' devices)."""
    return math.sqrt(sum(float(fetch(n)[0]) for _, n in sorted(norms_sq.items())))


def report(diffs: list[Diff], rtol: float) -> tuple[str, bool]:
    lines = [f"{'quantity':32s} {'max_abs_diff':>14s} {'rel_l2_diff':>14s}"]
    ok = True
    for d in diffs:
        flag = "" if d.max_rel <= rtol else "  <-- over tolerance"
        ok &= d.max_rel <= rtol
        lines.append(f"{d.name:32s} {d.max_abs:14.3e} {d.max_rel:14.3e}{flag}")
    lines.append(f"{'PASS' if ok else 'FAIL'}: relative tolerance {rtol:g}")
    return "\n".join(lines), ok
