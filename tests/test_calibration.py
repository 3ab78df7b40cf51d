"""The analytic cost model against published H100 training runs (scripts/calibrate_published.py)."""

import importlib.util
import math
import statistics
import sys
from pathlib import Path

import pytest

from maestro_jax.planning import cost

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "calibrate_published.py"
ROOT_BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture(scope="module")
def cal():
    spec = importlib.util.spec_from_file_location("calibrate_published", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses resolve their annotations through it
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def fitted(cal):
    return cal.fit(r for r in cal.ROWS if r.group == "fit")


def test_every_row_names_its_source(cal):
    assert {r.group for r in cal.ROWS} == {"fit", "held_out", "reported"}
    for r in cal.ROWS:
        # a repository pinned to a commit (40 hex digits) and a file in it, and the quoted row
        assert "github.com/" in r.source and " @ " in r.source and ": " in r.source, r.name
        commit = r.source.split(" @ ")[1].split()[0].rstrip(":")
        assert len(commit) == 40 and all(c in "0123456789abcdef" for c in commit), r.name
        assert r.quote.strip() and r.published > 0, r.name
        assert r.arch in cal.ARCHS and cal.ARCHS[r.arch].source, r.name
    assert all(v.strip() for v in cal.DATASHEETS.values())


def test_fit_generalises_to_held_out_rows(cal, fitted):
    """The held-out rows (larger pipelines, other sources, multi-node data parallelism) are not
    in the fit. Bound: twice the fit's own rms log error, i.e. the held-out rows may scatter as
    much as two standard deviations of what the fitted rows already do (the spread between
    frameworks on alike layouts, not measurement noise); the fit must also beat the hand-set
    constants it replaced on those rows."""
    params = (fitted["peak"], fitted["half_tokens"], fitted["half_width"])
    held = [r for r in cal.ROWS if r.group == "held_out"]
    assert len(held) >= 4

    def median_abs(p):
        return statistics.median(abs(math.log(cal.predict(r, p) / r.tokens_per_gpu)) for r in held)

    bound = 2 * fitted["rms_log_error"]
    assert median_abs(params) < bound, (median_abs(params), bound)
    assert median_abs(params) < median_abs(cal.HAND_SET)
    assert 0 < fitted["peak"] <= 1


def test_cost_py_holds_the_fit(cal, fitted):
    """cost.efficiency's defaults are the fit, up to rounding: they predict every stored row
    within 1% of the unrounded fit (so a new row or a model change that moves the fit shows)."""
    params = (fitted["peak"], fitted["half_tokens"], fitted["half_width"])
    current = cost.efficiency.__defaults__
    for r in cal.ROWS:
        assert cal.predict(r, current) == pytest.approx(cal.predict(r, params), rel=0.01), r.name


def test_prediction_runs_cost_py_unpatched(cal):
    """The prediction evaluates cost.analytic_section under other constants and restores them."""
    before = cost.efficiency.__defaults__
    r = cal.ROWS[0]
    assert cal.predict(r, (0.5, 1.0, 1.0)) == pytest.approx(2 * cal.predict(r, (0.25, 1.0, 1.0)), rel=1e-3)
    assert cost.efficiency.__defaults__ == before


def _load_script(name):
    spec = importlib.util.spec_from_file_location(name, SCRIPT.parent / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_kind_rates_are_the_held_out_better_per_kind_fit_of_the_stored_gpu_rows(cal):
    """`cost.KIND_RATE` is scripts/calibrate_gpu.py's per-kind fit of the stored H200 kernel rows
    (benchmarks/gpu_check_h200.json), refitted here, to 3 significant figures; a kind other than
    the dense decoder gets a factor only where, held out (leave-one-out), the per-kind model's
    median error on its rows is below the one curve's; every kind a section can declare
    (`core.graph.RATE_KINDS`) has one, and both GPUs price with them."""
    from maestro_jax.core.graph import RATE_KINDS

    gpu = _load_script("calibrate_gpu")
    device, _, rows = gpu.load(ROOT_BENCH / "gpu_check_h200.json", allow_cpu=False)
    report = gpu.per_kind_report(rows, device)
    assert set(cost.KIND_RATE) == set(RATE_KINDS)
    assert cost.KIND_RATE["decoder"] == 1.0
    for kind, rate in cost.KIND_RATE.items():
        fitted = report["model"]["factors"][kind]
        assert rate == pytest.approx(fitted, rel=5e-3), kind
        held = report["held_out"][kind]
        if kind != "decoder":
            assert held["per_kind"]["median_abs_log_error"] < held["one_curve"]["median_abs_log_error"], kind
    assert cost.DEVICES["h100"]["kind_rate"] is cost.KIND_RATE is cost.DEVICES["h200"]["kind_rate"]


def test_a_section_is_priced_at_its_kinds_rate_on_a_gpu_and_the_dense_curve_on_the_cpu():
    """The same FLOPs on a mixture-of-experts decoder take 1/KIND_RATE as long as on a dense one
    on an H100; the CPU entry (rough magnitudes, never measured per kind) prices every kind alike.
    An unknown kind is refused where the cost is declared, naming the field."""
    from maestro_jax.core.graph import GraphError, UnitCost

    def per_unit(kind, device):
        return cost.analytic_section(1e9, 1e4, 4, 1, 512, device=device, rate_kind=kind).per_unit_s

    for kind in ("decoder_moe", "vit"):
        assert per_unit(kind, "h100") == pytest.approx(per_unit("decoder", "h100") / cost.KIND_RATE[kind])
        assert per_unit(kind, "cpu") == per_unit("decoder", "cpu")
    with pytest.raises(GraphError, match=r"UnitCost.rate_kind='encoder': unknown; valid: decoder, decoder_moe, vit"):
        UnitCost(flops=1.0, rate_kind="encoder")
