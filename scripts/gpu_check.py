"""The GPU check's steps, run by `scripts/gpu_check.sh` (which installs carried wheels first).

Every step runs as its own process (`python -m maestro_jax.cli ...`, or a short `python -c`), so
that each sets up XLA as a user's run does, a failure or a hang in one is one failed step with
its log, and no process here holds GPU memory that another needs (`XLA_PYTHON_CLIENT_PREALLOCATE`
is off for all). `DIR/gpu_check.json` is rewritten after every step, so a check cut short by the
machine's time limit still leaves what it measured, and no step starts or runs past
`--deadline-s` (default DEADLINE_S), so the whole check ends inside one device call. Steps, in
order, what no GPU run has measured yet first (benchmarks/log/gpu.md, "Running on a GPU": four
H200 runs passed verify of both configs in bfloat16 and kd_tiny in float32, benched the tiny
configs and timed the kernels; vlm_tiny in float32 compiled past 420 s there, before `verify`
turned GEMM autotuning off for float32 sections):

  env       jax, jaxlib, the CUDA plugin, CUDA, cuDNN, the driver, the device and its memory,
            whether tokamax imports (the gpu extra);
  levers    attention in each fast form (causal, packed, a ViT's padded and packed rows) against
            the mask path, the MoE layer in every dispatch (grouped: tokamax's GEMM), small
            decoder layers with and without CUDA graphs, 8 micro-steps of one as 8 launches
            against one scanned program (`compile.scan_micro_steps`), each ratio in the summary
            (`maestro_jax.tools.levers`);
  verify    the tiny configs (vlm_tiny and kd_tiny by default; `--configs` takes omni_tiny and
            vlm_kd_tiny too) with all sections on device 0 (each section its own one-device
            mesh, co-located), maestro vs the monolithic step, in float32 (matmuls at precision
            `highest`, tolerance 1e-5) and in bfloat16 (its documented 2e-2); run side by side,
            since they are compiles more than compute;
  real-size `--real-size kd_one_gpu,vlm_one_gpu` (none by default): scripts/real_size_bench.py on
            the real-size configs, MFU per section, host share, peak memory;
  bench     monolithic vs naive vs wavefront on the one device, with host overhead per step;
  compile   `train` of vlm_tiny for 2 steps twice on one compile cache: cold, then warm;
  kernels   decoder (dense, MoE), ViT and attention blocks at realistic widths and token counts,
            forward and forward+backward, beside the cost model's prediction for each shape;
            cuDNN against XLA attention; compiled against measured peak memory
            (`maestro_jax.tools.kernels`).

`--dry-run` runs the same steps on the CPU (8 virtual devices, the configs shrunk to one layer
each, the kernels at tiny widths) in a few minutes: how the script is kept working between GPU
windows (tests/test_gpu_check.py).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ("vlm_tiny", "kd_tiny", "omni_tiny", "vlm_kd_tiny")
VERIFY_CONFIGS = ("vlm_tiny", "kd_tiny")  # the default: see DEADLINE_S
PRECISIONS = ("float32", "bfloat16")
BENCH_CONFIGS = ("vlm_tiny", "kd_tiny")
REAL_SIZE = ("kd_one_gpu", "vlm_one_gpu")  # scripts/real_size_bench.py, one config a call of its own
STEP_TIMEOUT_S = 420  # one process
# The whole check stops starting steps past this (a step then runs to the deadline at most), so
# that it ends inside one device call (10 minutes, the machine's start aside). Measured on an
# H200 (benchmarks/log/gpu.md, "Running on a GPU"): one `verify` of vlm_tiny takes about 3 minutes beside a
# second one, and eight side by side ran past 7 minutes; hence two configs and four workers.
DEADLINE_S = 480
# the dry run's configs: one layer per model, short rows, small batches (compiles dominate on CPU)
DRY_RUN = ["global_batch=8", "data.text_len=[6,14]"]

ENV_PROBE = r"""
import importlib.metadata as md, json, subprocess, sys
import jax
out = {"python": sys.version.split()[0], "packages": {}}
for p in ("jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda13-plugin", "jax-cuda13-pjrt", "flax", "optax",
          "orbax-checkpoint", "grain", "numpy", "pydantic"):
    try:
        out["packages"][p] = md.version(p)
    except md.PackageNotFoundError:
        pass
d = jax.devices()
out.update(backend=jax.default_backend(), device_count=len(d), device_kind=d[0].device_kind,
           compute_capability=getattr(d[0], "compute_capability", None))
stats = d[0].memory_stats() or {}
out["memory_bytes"] = stats.get("bytes_limit")
try:
    from jax._src.lib import cuda_versions  # private: absent or None without a CUDA plugin
    out["cuda_runtime"] = cuda_versions.cuda_runtime_get_version()
    out["cudnn"] = cuda_versions.cudnn_get_version()
except Exception as err:  # noqa: BLE001 - a CPU jaxlib has none of these
    out["cuda_runtime"] = out["cudnn"] = None
    out["cuda_versions_error"] = f"{type(err).__name__}: {err}"[:200]
try:
    q = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                       capture_output=True, text=True, timeout=30)
    out["nvidia_smi"] = q.stdout.strip() or q.stderr.strip()
except (OSError, subprocess.TimeoutExpired) as err:
    out["nvidia_smi"] = f"unavailable: {err}"
try:
    import tokamax
    out["tokamax"] = tokamax.__version__
except Exception as err:  # noqa: BLE001 - the gpu extra may be absent or fail to import: say which
    out["tokamax"] = f"unavailable: {type(err).__name__}: {err}"[:300]
print(json.dumps(out))
"""

KERNELS = r"""
import json, sys
import jax
from maestro_jax.tools import kernels
device = "cpu" if {dry_run} else kernels.device_key(jax.devices()[0].device_kind)
report = kernels.kernel_report(dry_run={dry_run}, device=device, progress=lambda m: print(m, file=sys.stderr, flush=True))
json.dump(report, open({path!r}, "w"), indent=1)
"""

LEVERS = r"""
import json
import jax
from maestro_jax.planning import cost
from maestro_jax.tools import kernels, levers
peak = None if {dry_run} else cost.DEVICES.get(kernels.device_key(jax.devices()[0].device_kind), {{}}).get("flops")
json.dump(levers.lever_report(dry_run={dry_run}, peak_flops=peak), open({path!r}, "w"), indent=1)
"""


class Check:
    """The check's state: where it writes, what it found so far, how it runs a step."""

    def __init__(self, out: Path, dry_run: bool, deadline_s: float = DEADLINE_S):
        self.out, self.dry_run = out, dry_run
        self.deadline = time.perf_counter() + deadline_s
        self.report: dict = {"dry_run": dry_run, "env": {}, "levers": {}, "verify": [], "real_size": [], "bench": []}
        self.report["compile"] = {}
        self.report["kernels"] = []
        self.failures: list[str] = []
        self.env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false", "PYTHONUNBUFFERED": "1"}
        if dry_run:  # the configs' 8 virtual CPU devices (the CLI sets them; the probes here too)
            self.env["JAX_PLATFORMS"] = "cpu"
            flags = self.env.get("XLA_FLAGS", "")
            if "xla_force_host_platform_device_count" not in flags:
                self.env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8".strip()

    def run(self, name: str, cmd: list[str], timeout: float = STEP_TIMEOUT_S) -> tuple[int, str, float]:
        """Run `cmd`, its output to `DIR/logs/NAME.log`; (status, output, seconds). A timeout is
        status 124, as `timeout(1)` reports it; a step the deadline leaves no time for is not
        started (status 124, "skipped")."""
        logs = self.out / "logs"
        logs.mkdir(exist_ok=True)
        t0 = time.perf_counter()
        timeout = min(timeout, self.deadline - t0)
        if timeout < 10:
            self.failures.append(f"{name}: skipped, the check's deadline (--deadline-s) has passed")
            print(f"[   0.0 s] {name}: skipped (deadline)", flush=True)
            return 124, "skipped: deadline", 0.0
        try:
            # run from DIR, not the source tree: there `maestro_jax` would shadow the installed
            # package, which alone maps models/ to maestro_jax.models
            proc = subprocess.run(cmd, cwd=self.out, env=self.env, capture_output=True, text=True, timeout=timeout)
            status, text = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as err:
            status = 124  # the partial output comes as bytes, even with text=True
            parts = [p.decode(errors="replace") if isinstance(p, bytes) else p for p in (err.stdout, err.stderr)]
            text = "".join(p or "" for p in parts) + f"\ntimed out after {timeout:.0f} s"
        seconds = time.perf_counter() - t0
        (logs / f"{name}.log").write_text(f"+ {' '.join(cmd)}\n{text}")
        if status:
            self.failures.append(f"{name}: status {status} (log: {logs / (name + '.log')})")
        print(f"[{seconds:6.1f} s] {name}: {'ok' if status == 0 else f'status {status}'}", flush=True)
        return status, text, seconds

    def save(self) -> None:
        self.report["failures"] = self.failures
        (self.out / "gpu_check.json").write_text(json.dumps(self.report, indent=1, default=str))

    # -- the steps -------------------------------------------------------------------------

    def probe_env(self) -> None:
        status, text, _ = self.run("env", [sys.executable, "-c", ENV_PROBE], timeout=120)
        if status == 0:
            self.report["env"] = json.loads(text.strip().splitlines()[-1])

    @staticmethod
    def _config(config: str):
        # the installed package (gpu_check.sh puts it first on PYTHONPATH): the source tree alone
        # lacks maestro_jax.models and maestro_jax.meshes, which pyproject maps from models/, meshes/
        from maestro_jax.config import load_config  # JAX-free

        return load_config(ROOT / "configs" / f"{config}.yaml", [])

    def overrides(self, config: str) -> list[str]:
        """Every section and the monolithic baseline on device 0, each with a one-device mesh; in
        the dry run, one layer per model and small batches too."""
        cfg = self._config(config)
        out = []
        for s in cfg.sections:
            out += [f"sections.{s}.devices=0:1", f"sections.{s}.mesh={{data: 1}}"]
        out += ["monolithic.devices=0:1", "monolithic.mesh={data: 1}", "monolithic.micro_batch=1"]
        if self.dry_run:
            out += DRY_RUN + [f"models.{m}.depth=1" for m in cfg.models]
        return out

    def verify(self, configs, precisions, workers: int) -> None:
        def one(config: str, precision: str):
            extra = [f"sections.{s}.precision={precision}" for s in self._config(config).sections]
            path = self.out / f"verify_{config}_{precision}.json"
            cmd = [
                sys.executable,
                "-m",
                "maestro_jax.cli",
                "verify",
                "--config",
                str(ROOT / "configs" / f"{config}.yaml"),
            ]
            cmd += ["--json", str(path), *self.overrides(config), *extra]
            status, text, seconds = self.run(f"verify_{config}_{precision}", cmd)
            row = {"config": config, "precision": precision, "status": status, "seconds": round(seconds, 1)}
            if path.exists():
                result = json.loads(path.read_text())
                row.update(passed=result["passed"], tolerance=result["tolerance"], diffs=result["diffs"])
                row["max_rel"] = max(d["max_rel"] for d in result["diffs"])
            row["precision_line"] = next((ln for ln in text.splitlines() if ln.startswith("verify: float32")), None)
            return row

        jobs = [(c, p) for c in configs for p in precisions]
        with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
            self.report["verify"] = list(pool.map(lambda job: one(*job), jobs))

    def compile_times(self, config: str) -> None:
        """`train` twice on one compile cache: the second loads what the first compiled."""
        cache = self.out / "compile_cache"
        rows = {}
        for phase in ("cold", "warm"):
            cmd = [
                sys.executable,
                "-m",
                "maestro_jax.cli",
                "train",
                "--config",
                str(ROOT / "configs" / f"{config}.yaml"),
            ]
            cmd += [*self.overrides(config), "steps=2", f"compile.cache_dir={cache}", "keep_checkpoints=0"]
            status, text, seconds = self.run(f"train_{config}_{phase}", cmd)
            found = re.search(r"compiled (\d+) programs in ([\d.]+) s", text)
            rows[phase] = {
                "status": status,
                "seconds": round(seconds, 1),
                "programs": int(found.group(1)) if found else None,
                "compile_s": float(found.group(2)) if found else None,
            }
        self.report["compile"] = {"config": config, **rows}

    def bench(self, configs) -> None:
        for config in configs:
            path = self.out / f"bench_{config}.json"
            cmd = [
                sys.executable,
                "-m",
                "maestro_jax.cli",
                "bench",
                "--config",
                str(ROOT / "configs" / f"{config}.yaml"),
            ]
            cmd += [
                "--json",
                str(path),
                "--reps",
                "1" if self.dry_run else "5",
                "--batches",
                "1" if self.dry_run else "2",
            ]
            status, _, seconds = self.run(f"bench_{config}", cmd + self.overrides(config))
            row = {"config": config, "status": status, "seconds": round(seconds, 1)}
            if path.exists():
                r = json.loads(path.read_text())
                keep = (
                    "samples_per_s",
                    "tokens_per_s",
                    "ratios",
                    "host_overhead_fraction",
                    "host_time_s",
                    "host_per_op",
                )
                row.update({k: r[k] for k in keep if k in r})
                row["step_time_s"] = {m: t["median"] for m, t in r.get("step_time_s", {}).items()}
            self.report["bench"].append(row)

    def real_size(self, configs) -> None:
        """scripts/real_size_bench.py on each real-size config (`--dry-run` in the dry run)."""
        for config in configs:
            cmd = [
                sys.executable,
                str(ROOT / "scripts/real_size_bench.py"),
                "--config",
                str(ROOT / f"configs/{config}.yaml"),
            ]
            cmd += ["--out", str(self.out), *(["--dry-run", "--reps", "1", "--batches", "1"] if self.dry_run else [])]
            status, _, seconds = self.run(f"real_size_{config}", cmd)
            path = self.out / f"{config}.json"
            row = {"config": config, "status": status, "seconds": round(seconds, 1)}
            if path.exists():
                r = json.loads(path.read_text())
                row.update(
                    {k: r[k] for k in ("ratios", "mfu", "host_overhead_fraction", "memory", "samples_per_s") if k in r}
                )
            self.report["real_size"].append(row)

    def levers(self) -> None:
        path = self.out / "levers.json"
        self.run("levers", [sys.executable, "-c", LEVERS.format(dry_run=self.dry_run, path=str(path))])
        if path.exists():
            self.report["levers"] = json.loads(path.read_text())

    def kernels(self) -> None:
        path = self.out / "kernels.json"
        code = KERNELS.format(dry_run=self.dry_run, path=str(path))
        self.run("kernels", [sys.executable, "-c", code])
        if path.exists():
            report = json.loads(path.read_text())
            self.report["kernels"] = report.pop("kernels", [])
            self.report["kernel_checks"] = report  # skipped shapes, memory, cuDNN vs XLA attention

    # -- the summary -----------------------------------------------------------------------

    def summary(self) -> list[str]:
        env = self.report["env"]
        lines = [
            f"device: {env.get('device_count')} x {env.get('device_kind')} ({env.get('backend')}), "
            f"jax {env.get('packages', {}).get('jax')}, cuDNN {env.get('cudnn')}, driver/smi: {env.get('nvidia_smi')}, "
            f"tokamax {env.get('tokamax')}"
        ]
        for v in self.report["verify"]:
            verdict = "PASS" if v.get("passed") else f"FAIL (status {v['status']})"
            rel = f"max rel {v['max_rel']:.2e} (tolerance {v['tolerance']:g})" if "max_rel" in v else "no result"
            lines.append(f"verify {v['config']} {v['precision']}: {verdict}, {rel}, {v['seconds']} s")
        lines += self.report["levers"].get("summary", [])
        c = self.report["compile"]
        if c:
            lines.append(
                f"compile {c['config']}: cold {c['cold']['programs']} programs in {c['cold']['compile_s']} s, "
                f"warm {c['warm']['programs']} in {c['warm']['compile_s']} s"
            )
        for r in self.report["real_size"]:
            if "ratios" in r:
                u = r["mfu"]
                lines.append(
                    f"real size {r['config']}: wavefront {r['ratios']['wavefront_vs_monolithic']:.3f}x the fair "
                    f"monolithic; MFU wavefront {u['wavefront']:.1%}, monolithic {u['monolithic']:.1%}; "
                    f"{', '.join(f'{s} {v:.1%}' for s, v in u['by_section']['wavefront'].items())}"
                )
            else:
                lines.append(f"real size {r['config']}: status {r['status']}")
        for b in self.report["bench"]:
            ratios = ", ".join(f"{k} {v:.3f}" for k, v in b.get("ratios", {}).items()) or f"status {b['status']}"
            host = b.get("host_time_s", {}).get("wavefront")
            if host:
                ratios += (
                    f"; wavefront host per step: schedule {host['schedule'] * 1e3:.1f} ms, dispatch "
                    f"{host['dispatch'] * 1e3:.1f} ms, blocked {host['blocked'] * 1e3:.1f} ms"
                )
            lines.append(f"bench {b['config']}: {ratios}")
        rows = [k for k in self.report["kernels"] if k.get("measured_s") and k.get("predicted_s")]
        if rows:
            errs = [abs(math.log(k["predicted_s"] / k["measured_s"])) for k in rows]
            lines.append(
                f"kernels: {len(rows)} rows, cost model |log(predicted/measured)| median {statistics.median(errs):.2f}, "
                f"max {max(errs):.2f} (calibrate: python scripts/calibrate_gpu.py {self.out}/gpu_check.json)"
            )
        checks = self.report.get("kernel_checks", {})
        attn = {}
        for a in checks.get("attention_implementations", []):
            if a.get("available") and a.get("measured_s"):
                attn.setdefault((a["shape"], a["mask"], a["pass"]), {})[a["implementation"]] = a["measured_s"]
        pairs = [(k, v["xla"] / v["cudnn"]) for k, v in attn.items() if {"xla", "cudnn"} <= set(v)]
        lines.append(
            "attention cuDNN vs XLA: " + ", ".join(f"{'/'.join(k)} {x:.2f}x" for k, x in pairs)
            if pairs
            else "attention cuDNN vs XLA: cuDNN unavailable on this backend"
        )
        mem = [m for m in checks.get("memory", []) if m.get("measured_peak_bytes")]
        if mem:
            ratios = [m["measured_peak_bytes"] / m["compiled_bytes"] for m in mem]
            lines.append(f"memory measured/compiled: {min(ratios):.2f}-{max(ratios):.2f} over {len(mem)} programs")
        else:
            lines.append("memory measured/compiled: no measured peak on this backend")
        if checks.get("skipped"):
            lines.append(f"kernels skipped: {len(checks['skipped'])} shapes (see kernel_checks.skipped)")
        lines += [f"FAILED {f}" for f in self.failures]
        lines.append("gpu check: " + ("ok" if not self.failures else f"{len(self.failures)} step(s) failed"))
        return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="everything is written under this folder")
    ap.add_argument("--dry-run", action="store_true", help="the same steps on the CPU, small")
    ap.add_argument("--configs", default=",".join(VERIFY_CONFIGS), help="tiny configs to verify (comma-separated)")
    ap.add_argument("--precisions", default=",".join(PRECISIONS), help="verify's precisions (comma-separated)")
    ap.add_argument("--bench-configs", default=",".join(BENCH_CONFIGS), help="tiny configs to bench")
    ap.add_argument("--real-size", default="", help="real-size configs to benchmark (kd_one_gpu, vlm_one_gpu)")
    ap.add_argument("--workers", type=int, default=4, help="verify processes side by side")
    ap.add_argument("--deadline-s", type=float, default=DEADLINE_S, help="no step starts, or runs, past this")
    args = ap.parse_args(argv)
    configs, benches = args.configs.split(","), [c for c in args.bench_configs.split(",") if c]
    precisions = args.precisions.split(",")
    real = [c for c in args.real_size.split(",") if c]
    for name in real:
        if name not in REAL_SIZE:
            print(
                f"error: --real-size: {name!r} is not a real-size config; valid: {', '.join(REAL_SIZE)}",
                file=sys.stderr,
            )
            return 2
    for p in precisions:
        if p not in PRECISIONS:
            print(f"error: --precisions: {p!r} is not a precision; valid: {', '.join(PRECISIONS)}", file=sys.stderr)
            return 2
    for name in configs + benches:
        if name not in CONFIGS:
            print(f"error: --configs: {name!r} is not a tiny config; valid: {', '.join(CONFIGS)}", file=sys.stderr)
            return 2
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    check = Check(out, args.dry_run, args.deadline_s)
    # the unmeasured first: a deadline cuts the tail (see the docstring)
    steps = [
        check.probe_env,
        check.levers,
        lambda: check.verify(configs, precisions, args.workers),
        lambda: check.real_size(real),
        lambda: check.bench(benches),
        lambda: check.compile_times(configs[0]),
        check.kernels,
    ]
    for step in steps:
        step()
        check.save()
    check.report["summary"] = check.summary()
    check.save()
    print(f"=== summary ({out / 'gpu_check.json'})")
    print("\n".join(check.report["summary"]))
    return 1 if check.failures else 0


if __name__ == "__main__":
    sys.exit(main())
