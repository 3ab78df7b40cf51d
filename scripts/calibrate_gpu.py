"""Refit the cost model's efficiency curve with kernel timings measured on an H100 or H200.

`cost.efficiency` is fitted to published H100 training runs (scripts/calibrate_published.py) that all
do at least 512 tokens and 1536 weight columns per device per micro-step; below that the curve is an
extrapolation. The GPU check times the project's own blocks over that range
(`maestro_jax.tools.kernels.measure`, rows under "kernels" in its JSON); this script adds those rows
to the published ones and refits (peak, half_tokens, half_width).

A kernel row's prediction is the one `kernels.measure` records, recomputed for any constants:
    predicted_s = flops / (DEVICES[device]["flops"] * efficiency(tokens / tensor, width_per_device))
(flops: the rank's share of one layer from the workload cost functions, a forward-backward
counting 1 + backward_factor forwards; see maestro_jax/tools/kernels.py). Its log error is
log(measured_s / predicted_s) = log(predicted rate / measured rate), the same sign as the
published rows' log(predicted / published throughput), so one peak shifts both alike.

How the two sources combine (least squares on log error, as calibrate_published.fit): each of the
published "fit" rows weighs 1; the kernel rows together weigh `--kernel-weight` (default 1) times
the published rows together, i.e. each kernel row weighs kernel_weight * n_published / n_kernels.
So a few hundred kernel rows of one machine do not drown the nine training runs that set the level
(the peak), while they alone say how the curve falls at small work. One peak serves both: a layer
timed alone (no communication, no optimizer, no data loading) may run above what whole training
runs reach, and that offset shows as the kernels' median error after the refit. `--kernels-only`
fits the kernel rows alone (the published rows are then only reported).

The halves are searched on a log grid over [1, 65536] and refined by Nelder-Mead (the published
script's own `_nelder_mead`); for given halves the peak is the weighted mean shift.

Besides the one-curve refit it fits a model with a term per kind of work and reports its
held-out error (`per_kind`): the dense curve exactly as cost.py has it, times a fitted rate
factor per kernel kind other than the dense decoder (attention, the MoE layer, the ViT block:
each kind's own kernels' efficiency relative to the dense curve), and one fitted per-program
floor (small programs are launch-bound: the H200's 256-token layers took 0.18-0.26 ms forward
whatever their FLOPs; an added constant instead of a floor fitted worse, held out):
    predicted_s = max(launch_s, flops / (peak_flops * efficiency(...) * factor[kind]))
The published runs' micro-steps are far above the floor and their layers are dense decoders, so
their predictions are the one-curve model's.
Held out by leave-one-out: every row is predicted by the model fitted to all the other rows, so
each error is of a row the fit did not see; the report gives the median and worst of those beside
the one-curve model's on the same rows. The attention rows timed so far are the mask path's (the
fast forms' rows come with the next GPU check), so `factor["attention"]` prices that path only.

It does not change cost.py: it prints the refitted constants and the exact lines to change, which a
human applies in a commit that cites the run. Outputs: by default benchmarks/calibration_gpu.json
and .md (the published calibration, benchmarks/calibration.{json,md}, stays what its own script
writes); `--json`/`--md` name others. Kernel rows from a CPU (the dry run) are refused, status 2,
unless `--allow-cpu` (for testing: predictions then use DEVICES["cpu"], and nothing is written
unless `--json`/`--md` are named).

    PYTHONPATH=. python scripts/calibrate_gpu.py gpu_check/gpu_check.json

Plain Python; imports only maestro_jax.planning (no JAX).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import re
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from maestro_jax.planning import cost


def _load_published():
    """scripts/calibrate_published.py as a module (scripts/ is not a package)."""
    name = "calibrate_published"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parent / "calibrate_published.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # its dataclasses resolve their annotations through it
    spec.loader.exec_module(mod)
    return mod


cp = _load_published()

DEFAULT_JSON = ROOT / "benchmarks" / "calibration_gpu.json"
DEFAULT_MD = ROOT / "benchmarks" / "calibration_gpu.md"
COST_PY = ROOT / "maestro_jax" / "planning" / "cost.py"
NAMES = ("peak", "half_tokens", "half_width")
ROW_NUMBERS = ("tokens", "tensor", "width_per_device", "flops", "measured_s")
KINDS = ("decoder", "decoder_moe", "vit", "attention")


class InputError(ValueError):
    """A field of the input with a bad value: reported as one `error:` line, status 2."""

    def __init__(self, field: str, value, valid: str):
        super().__init__(f"{field}={value!r}: {valid}")


def device_of(device_kind: str) -> str:
    """The cost.DEVICES entry of a JAX device_kind (as maestro_jax.tools.kernels.device_key)."""
    kind = device_kind.upper()
    return "h200" if "H200" in kind else "h100" if "H100" in kind else "cpu"


def load(path: Path, allow_cpu: bool) -> tuple[str, str, list[dict]]:
    """(device, device_kind, kernel rows) of a GPU check's JSON, validated."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise InputError("input", str(path), f"a readable JSON file written by the GPU check ({e})") from None
    if not isinstance(data, dict):
        raise InputError("input", type(data).__name__, 'a JSON object with keys "env" and "kernels"')
    env = data.get("env")
    kind = env.get("device_kind") if isinstance(env, dict) else None
    if not isinstance(kind, str) or not kind:
        raise InputError(
            "env.device_kind", kind, 'the JAX device_kind of the measuring device, e.g. "NVIDIA H100 80GB HBM3"'
        )
    device = device_of(kind)
    if device == "cpu" and not allow_cpu:
        raise InputError(
            "env.device_kind",
            kind,
            'kernel rows must come from an NVIDIA H100 or H200 (a device_kind containing "H100" or "H200"); '
            "--allow-cpu takes a CPU dry run, for testing only",
        )
    rows = data.get("kernels")
    if not isinstance(rows, list) or not rows:
        raise InputError("kernels", rows, "a non-empty list of rows from maestro_jax.tools.kernels.measure")
    for i, r in enumerate(rows):
        if not isinstance(r, dict):
            raise InputError(f"kernels[{i}]", r, "a row object")
        if not isinstance(r.get("kernel"), str):
            raise InputError(f"kernels[{i}].kernel", r.get("kernel"), "decoder | decoder_moe | vit | attention")
        for key in ROW_NUMBERS:
            v = r.get(key)
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v <= 0:
                raise InputError(f"kernels[{i}].{key}", v, "a positive finite number")
    return device, kind, rows


# ---- predictions and errors ----------------------------------------------------------------


def kernel_predicted_s(row: dict, device: str, params) -> float:
    """The cost model's time of a kernel row under efficiency constants `params` (module docstring)."""
    eff = cost.efficiency(row["tokens"] / row["tensor"], row["width_per_device"], *params)
    return row["flops"] / (cost.DEVICES[device]["flops"] * eff)


def kernel_log_errors(rows: list[dict], device: str, params) -> list[float]:
    """log(measured_s / predicted_s): > 0 where the model predicts too fast."""
    return [math.log(r["measured_s"] / kernel_predicted_s(r, device, params)) for r in rows]


def kernel_error_summary(rows: list[dict], device: str, params) -> dict:
    """Per kernel kind and pass, and over all rows: n, median and max |log error|."""
    errs = kernel_log_errors(rows, device, params)
    groups: dict[str, list[float]] = {"all": errs}
    for r, e in zip(rows, errs):
        groups.setdefault(r["kernel"], []).append(e)
        groups.setdefault(f"{r['kernel']}/{r.get('pass', '?')}", []).append(e)
    return {
        k: {
            "n": len(v),
            "median_abs_log_error": statistics.median(abs(e) for e in v),
            "max_abs_log_error": max(abs(e) for e in v),
            "median_log_error": statistics.median(v),
        }
        for k, v in groups.items()
    }


# ---- the fit -------------------------------------------------------------------------------


def fit(published: list, kernels: list[dict], device: str, kernel_weight: float = 1.0) -> dict:
    """Weighted least squares on log error over published Row objects and kernel rows (module
    docstring): {"peak", "half_tokens", "half_width", "sse", "rms_log_error", "weights"}."""
    n_p, n_k = len(published), len(kernels)
    w_k = (kernel_weight * n_p / n_k if n_p else 1.0) if n_k else 0.0
    total_w = n_p + w_k * n_k
    if total_w <= 0:
        raise ValueError("nothing to fit: no published rows and no kernel rows")

    def errors(params) -> list[tuple[float, float]]:
        return [(1.0, e) for e in cp.log_errors(published, params)] + [
            (w_k, e) for e in kernel_log_errors(kernels, device, params)
        ]

    def best_peak(half_tokens: float, half_width: float) -> tuple[float, float]:
        peak = 1.0
        for _ in range(3):  # published predictions scale with peak up to their small overhead
            we = errors((peak, half_tokens, half_width))
            peak *= math.exp(-sum(w * e for w, e in we) / total_w)
        we = errors((peak, half_tokens, half_width))
        return peak, sum(w * e * e for w, e in we)

    lo, hi = (math.log2(v) for v in cp.HALF_RANGE)

    def clamp(x: float) -> float:
        return min(max(x, lo), hi)

    def sse(x) -> float:
        return best_peak(2 ** clamp(x[0]), 2 ** clamp(x[1]))[1]

    grid = [lo + k * (hi - lo) / 32 for k in range(33)]
    x0 = min(([a, b] for a in grid for b in grid), key=sse)
    x, _ = cp._nelder_mead(sse, x0, step=(hi - lo) / 64, iters=300)
    ht, hw = 2 ** clamp(x[0]), 2 ** clamp(x[1])
    peak, best = best_peak(ht, hw)
    return {
        "peak": peak,
        "half_tokens": ht,
        "half_width": hw,
        "sse": best,
        "rms_log_error": math.sqrt(best / total_w),
        "weights": {"published_row": 1.0 if n_p else 0.0, "kernel_row": w_k, "n_published": n_p, "n_kernels": n_k},
    }


# ---- the per-kind model -------------------------------------------------------------------

DENSE_KIND = "decoder"  # the kind the dense curve prices as it is (factor 1)
LAUNCH_GRID = [0.0] + [1e-6 * 2 ** (k / 4) for k in range(41)]  # 1 us .. 1 ms, quarter octaves


def _dense_s(row: dict, device: str) -> float:
    """A row's time on the dense curve as cost.py has it, no launch term."""
    return kernel_predicted_s(row, device, cp.current_params())


def per_kind_fit(rows: list[dict], device: str) -> dict:
    """`launch_s` (the floor) and each kind's rate factor minimising the squared log error over
    `rows`: for a given floor, each kind's best factor is searched on a log grid (its rows alone
    set it); the floor is searched on LAUNCH_GRID."""
    return _fit_timed([(r["kernel"], r["measured_s"], _dense_s(r, device)) for r in rows])


FACTOR_GRID = [2 ** (k / 16) for k in range(-96, 33)]  # 1/64 .. 4


def _fit_timed(timed: list[tuple[str, float, float]]) -> dict:
    """`per_kind_fit` over (kind, measured_s, dense-curve s) triples."""
    kinds = sorted({k for k, _, _ in timed} - {DENSE_KIND})

    def sse(of_kind, launch, factor):
        return sum(math.log(m / max(launch, d / factor)) ** 2 for m, d in of_kind)

    def fitted(launch):
        factors, total = {}, sse([(m, d) for k, m, d in timed if k == DENSE_KIND], launch, 1.0)
        for kind in kinds:
            of_kind = [(m, d) for k, m, d in timed if k == kind]
            factors[kind] = min(FACTOR_GRID, key=lambda f: sse(of_kind, launch, f))
            total += sse(of_kind, launch, factors[kind])
        return total, factors

    launch = min(LAUNCH_GRID, key=lambda t: fitted(t)[0])
    return {"launch_s": launch, "factors": {DENSE_KIND: 1.0, **fitted(launch)[1]}}


def per_kind_predicted_s(row: dict, device: str, model: dict) -> float:
    factor = model["factors"].get(row["kernel"])
    if factor is None:  # a kind the fit had no other row of: the dense curve's rate
        factor = 1.0
    return max(model["launch_s"], _dense_s(row, device) / factor)


def _abs_errors(errors: list[float]) -> dict:
    return {
        "n": len(errors),
        "median_abs_log_error": statistics.median(abs(e) for e in errors),
        "max_abs_log_error": max(abs(e) for e in errors),
    }


def per_kind_report(rows: list[dict], device: str) -> dict:
    """The per-kind model fitted to every row, and its leave-one-out errors beside the one-curve
    model's (cost.py's constants) on the same rows, over all rows and per kind."""
    held, curve, timed = [], [], [(r["kernel"], r["measured_s"], _dense_s(r, device)) for r in rows]
    for i, r in enumerate(rows):
        model = _fit_timed(timed[:i] + timed[i + 1 :])
        held.append(math.log(r["measured_s"] / per_kind_predicted_s(r, device, model)))
        curve.append(math.log(r["measured_s"] / _dense_s(r, device)))
    groups = {"all": range(len(rows))}
    for i, r in enumerate(rows):
        groups.setdefault(r["kernel"], []).append(i)
    return {
        "model": per_kind_fit(rows, device),
        "held_out": {
            k: {"one_curve": _abs_errors([curve[i] for i in ix]), "per_kind": _abs_errors([held[i] for i in ix])}
            for k, ix in groups.items()
        },
    }


def per_kind_table(rep: dict) -> list[str]:
    lines = [
        "| kernels | n | one curve (cost.efficiency): median (max) abs log error | per kind, held out: median (max) |",
        "| --- | --- | --- | --- |",
    ]
    for k, e in sorted(rep["per_kind"]["held_out"].items(), key=lambda kv: (kv[0] != "all", kv[0])):
        a, b = e["one_curve"], e["per_kind"]
        lines.append(
            f"| {k} | {a['n']} | {a['median_abs_log_error']:.3f} ({a['max_abs_log_error']:.3f}) | "
            f"{b['median_abs_log_error']:.3f} ({b['max_abs_log_error']:.3f}) |"
        )
    return lines


# ---- what to change in cost.py -------------------------------------------------------------


def _rounded(name: str, value: float) -> float:
    return round(value, 3) if name == "peak" else float(f"{value:.3g}")


def cost_py_change(params) -> list[tuple[str, str]]:
    """(the line in cost.py now, the line to put there) for each efficiency default."""
    text = COST_PY.read_text()
    out = []
    for name, value in zip(NAMES, params):
        m = re.search(rf"^(\s*{name}: float = )([0-9.eE+-]+)(,.*)$", text, re.MULTILINE)
        if m is None:
            out.append((f"(no `{name}: float = ...` line found in {COST_PY.relative_to(ROOT)})", ""))
            continue
        out.append((m.group(0), f"{m.group(1)}{_rounded(name, value)!r}{m.group(3)}"))
    return out


# ---- report --------------------------------------------------------------------------------


def report(
    path: Path,
    device: str,
    device_kind: str,
    kernels: list[dict],
    kernel_weight: float = 1.0,
    kernels_only: bool = False,
    fit_kinds: tuple[str, ...] = KINDS,
    argv: list[str] | None = None,
) -> dict:
    """The refit and every error before and after it (module docstring); kernel rows whose kind is
    not in `fit_kinds` are reported but not fitted."""
    before = cp.current_params()
    published = [r for r in cp.ROWS if r.group == "fit"]
    fitted_rows = [r for r in kernels if r["kernel"] in fit_kinds]
    fitted = fit([] if kernels_only else published, fitted_rows, device, kernel_weight)
    after = (fitted["peak"], fitted["half_tokens"], fitted["half_width"])
    kernel_rows = []
    for r in kernels:
        rec = {k: r.get(k) for k in ("kernel", "pass", "width", "tensor", "width_per_device", "tokens", "seq_len")}
        rec |= {k: r.get(k) for k in ("dtype", "flops", "measured_s", "achieved_flops_per_s")}
        rec["efficiency_measured"] = r["flops"] / r["measured_s"] / cost.DEVICES[device]["flops"]
        for key, params in (("before", before), ("after", after)):
            p = kernel_predicted_s(r, device, params)
            rec[key] = {"predicted_s": p, "log_error": math.log(r["measured_s"] / p)}
        kernel_rows.append(rec)
    published_rows = []
    for r in cp.ROWS:
        rec = {"name": r.name, "group": r.group, "layout": r.layout, "tokens_per_s_per_gpu": r.tokens_per_gpu}
        for key, params in (("before", before), ("after", after)):
            p = cp.predict(r, params)
            rec[key] = {"tokens_per_s_per_gpu": p, "error": p / r.tokens_per_gpu - 1}
        published_rows.append(rec)
    groups = {}
    for g in ("fit", "held_out", "reported"):
        rows = [r for r in cp.ROWS if r.group == g]
        groups[g] = {"before": cp.summary(rows, before), "after": cp.summary(rows, after)}
    return {
        "command": " ".join(
            ["PYTHONPATH=. python scripts/calibrate_gpu.py", *(sys.argv[1:] if argv is None else argv)]
        ),
        "input": str(path),
        "device": device,
        "device_kind": device_kind,
        "kernel_weight": kernel_weight,
        "kernels_only": kernels_only,
        "fit_kinds": list(fit_kinds),
        "constants": {"before": dict(zip(NAMES, before)), "after": dict(zip(NAMES, after))},
        "fit": fitted,
        "kernel_errors": {
            "before": kernel_error_summary(kernels, device, before),
            "after": kernel_error_summary(kernels, device, after),
        },
        "published_errors": groups,
        "cost_py_change": [{"now": a, "new": b} for a, b in cost_py_change(after)],
        "kernel_rows": kernel_rows,
        "published_rows": published_rows,
        "per_kind": per_kind_report(kernels, device),
    }


def _pct(e: float) -> str:
    return f"{100 * e:+.0f}%"


def error_table(rep: dict) -> list[str]:
    b, a = rep["kernel_errors"]["before"], rep["kernel_errors"]["after"]
    lines = [
        "| kernels | n | before: median (max) abs log error | after: median (max) | after: median signed |",
        "| --- | --- | --- | --- | --- |",
    ]
    for k in sorted(b, key=lambda k: (k != "all", k)):
        lines.append(
            f"| {k} | {b[k]['n']} | {b[k]['median_abs_log_error']:.3f} ({b[k]['max_abs_log_error']:.3f}) | "
            f"{a[k]['median_abs_log_error']:.3f} ({a[k]['max_abs_log_error']:.3f}) | {a[k]['median_log_error']:+.3f} |"
        )
    return lines


def markdown(rep: dict) -> str:
    b, a, f = rep["constants"]["before"], rep["constants"]["after"], rep["fit"]
    w = f["weights"]
    lines = [
        f"# Cost-model calibration: published H100 runs and kernels measured on {rep['device_kind']}",
        "",
        "Generated by `scripts/calibrate_gpu.py` (see its docstring for the accounting); do not edit by hand. The "
        "published rows' sources and quotes: benchmarks/calibration.md.",
        "",
        "```bash",
        rep["command"],
        "```",
        "",
        f"Input: `{rep['input']}`; kernel predictions at the `{rep['device']}` peak "
        f"({cost.DEVICES[rep['device']]['flops']:.4g} FLOP/s). Weights: each published fit row "
        f"{w['published_row']:g} ({w['n_published']} rows), each kernel row {w['kernel_row']:.4g} ({w['n_kernels']} "
        f"rows of kinds {', '.join(rep['fit_kinds'])}; kernel_weight {rep['kernel_weight']:g}"
        f"{', kernels only' if rep['kernels_only'] else ''}).",
        "",
        "| constant | before (cost.py) | after (refit) |",
        "| --- | --- | --- |",
        *(f"| {n} | {b[n]:.4g} | {a[n]:.4g} |" for n in NAMES),
        "",
        f"Weighted rms log error of the refit: {f['rms_log_error']:.3f}.",
        "",
        "Kernel rows (log error = log(measured / predicted time); 0.1 is about 10%):",
        "",
        *error_table(rep),
        "",
        "A term per kind of work, held out: the dense curve as cost.py has it, a fitted per-program floor "
        f"({1e6 * rep['per_kind']['model']['launch_s']:.1f} us: launch-bound small programs) and a rate factor per kind ("
        + ", ".join(f"{k} {v:.3g}" for k, v in rep["per_kind"]["model"]["factors"].items())
        + "), fitted to every kernel row; the errors are leave-one-out (each row predicted by the fit to the "
        "others). The attention rows are the mask path's. cost.py applies the factors of the section kinds whose held-out error they lower (`cost.KIND_RATE`: decoder_moe, vit), not the floor (a section's micro-step carries its own overhead) nor attention's (no section is attention alone).",
        "",
        *per_kind_table(rep),
        "",
        "Published rows, median |error| (max) of the predicted per-GPU throughput:",
        "",
        "| rows | n | before | after |",
        "| --- | --- | --- | --- |",
    ]
    for g, s in rep["published_errors"].items():
        sb, sa = s["before"], s["after"]
        lines.append(
            f"| {g} | {sb['n']} | {100 * sb['median_abs_error']:.1f}% ({100 * sb['max_abs_error']:.0f}%) | "
            f"{100 * sa['median_abs_error']:.1f}% ({100 * sa['max_abs_error']:.0f}%) |"
        )
    lines += [
        "",
        "To apply the refit (not done by this script), in `maestro_jax/planning/cost.py`, `def efficiency`:",
        "",
        "```diff",
        *(f"-{c['now']}\n+{c['new']}" for c in rep["cost_py_change"]),
        "```",
        "",
        "## Published rows",
        "",
        "| model | layout | group | tok/s/GPU | before err | after err |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in rep["published_rows"]:
        lines.append(
            f"| {r['name']} | {r['layout']} | {r['group']} | {r['tokens_per_s_per_gpu']:,.0f} | "
            f"{_pct(r['before']['error'])} | {_pct(r['after']['error'])} |"
        )
    lines += [
        "",
        "## Kernel rows",
        "",
        "One layer per row (a tensor-parallel rank's slice; no collectives). `eff`: achieved FLOP/s over the peak.",
        "",
        "| kernel | pass | width | TP | cols/dev | tokens | seq | dtype | TFLOP/s | eff | before err | after err |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rep["kernel_rows"]:
        lines.append(
            f"| {r['kernel']} | {r['pass']} | {r['width']} | {r['tensor']} | {r['width_per_device']:g} | {r['tokens']} "
            f"| {r['seq_len']} | {r['dtype']} | {r['flops'] / r['measured_s'] / 1e12:.1f} | "
            f"{100 * r['efficiency_measured']:.1f}% | {_pct(math.exp(-r['before']['log_error']) - 1)} | "
            f"{_pct(math.exp(-r['after']['log_error']) - 1)} |"
        )
    lines += [
        "",
        "Errors in the kernel table are of the predicted rate, (predicted / measured time)^-1 - 1, as for the "
        "published rows' throughput.",
    ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("input", type=Path, help="gpu_check.json written by the GPU check (keys env, kernels)")
    ap.add_argument("--json", type=Path, help=f"write the report as JSON (default {DEFAULT_JSON.relative_to(ROOT)})")
    ap.add_argument("--md", type=Path, help=f"write the markdown table (default {DEFAULT_MD.relative_to(ROOT)})")
    ap.add_argument("--allow-cpu", action="store_true", help="accept kernel rows from a CPU (dry run; testing only)")
    ap.add_argument(
        "--kernel-weight",
        type=float,
        default=1.0,
        help="total weight of the kernel rows relative to the published fit rows together (default 1)",
    )
    ap.add_argument("--kernels-only", action="store_true", help="fit the kernel rows alone")
    ap.add_argument(
        "--fit-kinds",
        default=",".join(KINDS),
        help="comma-separated kernel kinds that enter the fit (the others are reported only; default all)",
    )
    args = ap.parse_args(argv)
    try:
        if not (args.kernel_weight > 0 and math.isfinite(args.kernel_weight)):
            raise InputError("--kernel-weight", args.kernel_weight, "a positive finite number")
        fit_kinds = tuple(k for k in args.fit_kinds.split(",") if k)
        if not fit_kinds or set(fit_kinds) - set(KINDS):
            raise InputError("--fit-kinds", args.fit_kinds, f"a comma-separated subset of {','.join(KINDS)}")
        device, kind, kernels = load(args.input, args.allow_cpu)
        if not any(r["kernel"] in fit_kinds for r in kernels):
            raise InputError("--fit-kinds", args.fit_kinds, "kinds that some kernel row has")
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rep = report(args.input, device, kind, kernels, args.kernel_weight, args.kernels_only, fit_kinds, argv)
    md = markdown(rep)
    print(md)
    print("kernel errors before/after the refit (|log error|, median and max):")
    for line in error_table(rep):
        print(line)
    print("\nrefitted cost.efficiency: " + ", ".join(f"{n} {rep['constants']['after'][n]:.4g}" for n in NAMES))
    print("lines to change in maestro_jax/planning/cost.py (apply by hand, in a commit citing the run):")
    for c in rep["cost_py_change"]:
        print(f"  - {c['now'].strip()}\n  + {c['new'].strip()}")
    if device == "cpu":
        print("note: CPU kernel rows (--allow-cpu): predictions at DEVICES['cpu']; not a calibration.")
    json_out = args.json or (None if device == "cpu" else DEFAULT_JSON)
    md_out = args.md or (None if device == "cpu" else DEFAULT_MD)
    if json_out:
        json_out.write_text(json.dumps(rep, indent=1) + "\n")
        print(f"wrote {json_out}")
    if md_out:
        md_out.write_text(md)
        print(f"wrote {md_out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
