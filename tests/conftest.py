"""Every test runs on 8 virtual CPU devices; the flag must be set before JAX starts."""

import atexit
import contextlib
import functools
import importlib.metadata
import os
import shutil

# The tests' programs are tiny, so compiling them costs far more than running them: XLA:CPU's
# LLVM backend runs unoptimised (its HLO passes, sharding and buffer assignment, which the tests
# check, are untouched), about halving a compile. Every side of every comparison compiles alike;
# training runs the tests start (subprocesses) inherit the flags. On jaxlib 0.10 the fusions are
# emitted by XLA:CPU's elemental emitters rather than its MLIR fusion emitters and without
# XNNPACK's fusions, which compile about 40% faster (three equivalence tests, 52.9 s of compiles
# -> 26.2 s, 2026-12-06; docs/testing.md); jaxlib 0.12's XLA has no such flag (an unknown flag
# aborts), and there the same tests compile in 38.6 s as they are.
os.environ["XLA_FLAGS"] = " ".join(
    [
        os.environ.get("XLA_FLAGS", ""),
        "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true",
        "--xla_cpu_use_fusion_emitters=false --xla_cpu_use_xnnpack=false"
        if tuple(map(int, importlib.metadata.version("jaxlib").split(".")[:2])) < (0, 11)
        else "",
        "--xla_force_host_platform_device_count=8",
    ]
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("PJRT_NPROC", "32")  # 4 client threads per device, as the CLI sets (cli._ensure_host_devices)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # XLA's SPMD performance notes are noise in tests

import pathlib
import random
import socket
import tempfile

import jax
import pytest
from jax._src import lru_cache

# Tests build many runtimes with identical programs; XLA's persistent cache compiles each once.
# Programs this process compiles outside a training run (builds, verify) go to `jit/`, one folder
# that every test process (xdist worker) of the session shares, so a program both workers need
# compiles once. jax writes an entry in place (jax/_src/lru_cache.py; its size cap adds a lock
# but rereads every entry's time stamp on each write, which made the quick tier twice as slow),
# so here each entry is written whole to a temporary name and renamed (`_write_whole`): a worker
# reads an entry whole or not at all. Training runs (`train`, the CLI, every subprocess) use
# `runs/<worker>`, named by JAX_COMPILATION_CACHE_DIR, which `train` honours and the subprocesses
# inherit, one per worker: a run writes as jax does and moves aside the entries it cannot check
# (runtime/compile_cache.py), so no run looks in `jit/`. The cache is the session's temporary
# folder, made by the first process (the controller, whose environment the workers inherit) and
# removed when it exits, so a run of the suite leaves no cache behind in /tmp; MAESTRO_TEST_CACHE
# names a folder to keep and reuse across runs instead.
if os.environ.get("MAESTRO_TEST_CACHE"):
    _ROOT_CACHE = pathlib.Path(os.environ["MAESTRO_TEST_CACHE"])
elif os.environ.get("_MAESTRO_SESSION_CACHE"):  # a worker: the controller's folder
    _ROOT_CACHE = pathlib.Path(os.environ["_MAESTRO_SESSION_CACHE"])
else:
    _ROOT_CACHE = pathlib.Path(tempfile.mkdtemp("-xla"))
    os.environ["_MAESTRO_SESSION_CACHE"] = str(_ROOT_CACHE)
    atexit.register(shutil.rmtree, _ROOT_CACHE, ignore_errors=True)
os.environ["JAX_COMPILATION_CACHE_DIR"] = str(_ROOT_CACHE / "runs" / os.environ.get("PYTEST_XDIST_WORKER", "main"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")


def _write_whole(cache, key: str, value: bytes) -> None:
    """jax's `LRUCache.put` without a size cap, written to a temporary name and renamed, which is
    atomic on one filesystem; with a cap (a run's `compile.cache_max_gb`), jax's own."""
    path = cache.path / f"{key}{lru_cache._CACHE_SUFFIX}"
    if cache.eviction_enabled:
        _jax_put(cache, key, value)
    elif not path.exists():
        partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
        partial.write_bytes(value)
        os.replace(partial, path)


_jax_put, lru_cache.LRUCache.put = lru_cache.LRUCache.put, _write_whole
jax.config.update("jax_compilation_cache_dir", str(_ROOT_CACHE / "jit"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Shrinks the shipped configs so that tests compile fast; the plans under test stay as given.
TINY_VLM = [
    "global_batch=8",
    "models.vision.depth=1",
    "models.llm.depth=1",
    "data.text_len=[6,14]",
    "models.vision.width=32",
    "models.vision.mlp=64",
    "models.vision.out_width=48",
    "models.llm.width=48",
    "models.llm.head_dim=8",
    "models.llm.mlp=96",
    "data.modalities.image.sizes=[[8,8],[16,8]]",
    "data.modalities.image.max_items=2",
    "data.modalities.video.sizes=[[2,8,8],[4,8,16]]",  # each frame a segment of the tower (frames: 1)
]
TINY_KD = [
    "global_batch=8",
    "models.teacher.depth=1",
    "models.student.depth=1",
    "data.text_len=[6,14]",
    "models.teacher.width=64",
    "models.teacher.heads=4",
    "models.teacher.kv_heads=2",
    "models.teacher.mlp=128",
    "models.student.width=32",
    "models.student.head_dim=8",
    "models.student.mlp=64",
    "sections.teacher.micro_batch=2",
    "sections.student.micro_batch=1",
]

TINY_OMNI = [
    "global_batch=8",
    "models.vision.depth=1",
    "models.audio.depth=1",
    "models.llm.depth=1",
    "data.text_len=[6,14]",
    "models.vision.width=32",
    "models.vision.mlp=64",
    "models.vision.out_width=48",
    "models.audio.width=32",
    "models.audio.mlp=64",
    "models.audio.out_width=48",
    "models.llm.width=48",
    "models.llm.head_dim=6",
    "models.llm.mlp=96",
    "data.modalities.image.sizes=[[8,8],[16,8]]",
    "data.modalities.audio.sizes=[[8],[16]]",
]
TINY_VLM_KD = [
    "global_batch=8",
    "models.teacher.depth=1",
    "models.vision.depth=1",
    "models.student.depth=1",
    "data.text_len=[6,14]",
    "models.teacher.width=64",
    "models.teacher.heads=4",
    "models.teacher.kv_heads=2",
    "models.teacher.mlp=128",
    "models.vision.width=32",
    "models.vision.mlp=64",
    "models.vision.out_width=32",
    "models.student.width=32",
    "models.student.head_dim=8",
    "models.student.mlp=64",
    "sections.teacher.micro_batch=2",
    "data.modalities.image.sizes=[[8,8],[16,8]]",
]


@functools.cache
def paper_spec(name: str):
    """`configs/<name>_paper_scale.yaml`'s planning view (`workloads.describe`), traced once per
    test process: describing a paper-scale graph traces its whole init (seconds), and many
    planner tests price it at several sizes (`planner_for(..., spec=paper_spec(name))`)."""
    from maestro_jax.config import load_config
    from maestro_jax.workloads import describe

    return describe(load_config(ROOT / "configs" / f"{name}_paper_scale.yaml"))


@pytest.fixture
def config_path():
    return lambda name: ROOT / "configs" / name


def free_ports(count: int) -> int:
    """The first of `count` consecutive free ports, for a multi-process run's coordinator (the base)
    and its cross-process transfer sockets (base + 1 + process id, `runtime.distributed`).

    Drawn below the kernel's ephemeral range: a port the OS hands out (`bind(0)`) lies inside it,
    where any process's outgoing connection (the coordination service's clients, another test's
    workers) may take the next ports between this check and the workers binding them. Each port
    of the block is bound at once, then released."""
    low = int(pathlib.Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(10000, low - count)
        sockets = []
        try:
            for port in range(base, base + count):
                s = socket.socket()
                sockets.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise RuntimeError(f"no {count} consecutive free ports below {low}")


def first_forward(rt, states, section: str):
    """`section`'s forward program on its first micro-step of the runtime's first batch (its
    outputs on its own mesh): what a test reads to see the dtypes an edge carries."""
    samples = rt.batches()[0]
    schedule = rt.schedule(samples)
    step = schedule.steps[section][0]
    host = rt.executor.host_batches(samples, schedule)[(section, step.index)]
    return rt.programs[section].forward(states[section], {}, rt.programs[section].put_batch(host))


BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"  # jax 0.10: one event per XLA compile request


@contextlib.contextmanager
def compiles(when=lambda: True):
    """The names of the functions XLA compiles inside the block (those compiled while `when()`)."""
    names: list[str] = []

    def listen(event: str, duration: float, **kwargs) -> None:
        if event == BACKEND_COMPILE and when():
            names.append(str(kwargs.get("fun_name")))

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield names
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


def pytest_addoption(parser):
    parser.addoption(
        "--extended",
        action="store_true",
        help="also run the tests marked `extended` (the README's test command leaves them out)",
    )


# Variants of a parametrised test in the extended tier, their siblings (another layout, the other
# process, the other precision) kept in CI; whole tests carry `@pytest.mark.extended` themselves.
EXTENDED_VARIANTS = {
    "tests/test_workloads.py::test_each_workload_matches_the_monolithic_step[naive-vlm_kd]",
    "tests/test_planner.py::test_memory_model_tracks_the_compiled_programs[vlm]",
    "tests/test_planner.py::test_pruned_search_returns_the_exhaustive_optimum[kd6]",
    "tests/test_equivalence.py::test_kd_plans[fsdp_student_6dev]",
    "tests/test_equivalence.py::test_kd_plans[fanout4]",
    "tests/test_equivalence.py::test_vlm_plans[fanout2_tensor_vision]",
    "tests/test_equivalence.py::test_vlm_plans[fanout4_fsdp_remat]",
    "tests/test_faults.py::test_stuck_peer_is_named_within_the_timeout[0]",
    "tests/test_faults.py::test_dead_peer_ends_the_survivor[1]",
    "tests/test_faults.py::test_a_peer_lost_or_stuck_while_the_other_saves_is_named[19]",
    "tests/test_checkpoint.py::test_resume_is_exact[bfloat16]",
    "tests/test_edges.py::test_any_degrees_verify[kd_fan_in_6_to_2-naive]",
    "tests/test_edges.py::test_any_degrees_verify[kd_fan_in_6_to_2-wavefront]",
    "tests/test_edges.py::test_any_degrees_verify[kd_fan_out_2_to_6-naive]",
    "tests/test_edges.py::test_any_degrees_verify[kd_fan_out_2_to_6-wavefront]",
    "tests/test_stages.py::test_the_pipelined_baselines_layout_is_a_plan_that_runs_as_the_monolithic_step[kd]",
    "tests/test_qwen_vl.py::test_check_hf_fails_when_maestro_holds_a_weight_transformers_does_not[qwen3_vl-deepstack-verdicts2]",
}


# Variants of a parametrised test in the slow tier, a sibling kept in the quick check (its
# contract: the other size, scheduler or layout runs the same code); each names that sibling.
SLOW_VARIANTS = {
    # the [32] variants: the declared flops at one width
    "tests/test_workloads.py::test_llm_declared_flops_match_xla[128]",
    "tests/test_workloads.py::test_moe_declared_flops_match_xla[128-dense]",
    "tests/test_workloads.py::test_moe_declared_flops_match_xla[128-sparse]",
    # [kd_tiny.yaml-tiny0]: the executor's threads on the other workload
    "tests/test_executor.py::test_threaded_equals_sequential[vlm_tiny.yaml-tiny1]",
    # [vlm_paper_scale.yaml-overrides1]: the balanced cut at paper scale
    "tests/test_pipeline_baseline.py::test_the_balanced_cut_evens_the_stages_work[kd_paper_scale.yaml-overrides0]",
}


def _check_variants_exist(config, items):
    """A listed variant whose test was collected must be one of its variants: a renamed test or
    parameter would otherwise leave its variant in the faster tier without a word. Not checked
    when the command line names single tests (`file::test[variant]`): their siblings are not
    collected then."""
    if any("::" in arg for arg in config.args):
        return
    ids = {item.nodeid for item in items}
    functions = {item.nodeid.split("[")[0] for item in items}
    stale = sorted(v for v in EXTENDED_VARIANTS | SLOW_VARIANTS if v.split("[")[0] in functions and v not in ids)
    if stale:
        raise pytest.UsageError(f"tests/conftest.py lists variants no test has: {stale}")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """The README's test command (CI's) leaves out the `extended` tier; `--extended` runs it too, and
    an explicit `-m` expression chooses for itself (`-m extended`: that tier alone). An extended
    test counts as `slow` too, so the quick check (`-m "not slow"`) holds none."""
    _check_variants_exist(config, items)
    for item in items:
        if item.nodeid in EXTENDED_VARIANTS:
            item.add_marker(pytest.mark.extended)
        if item.nodeid in SLOW_VARIANTS:
            item.add_marker(pytest.mark.slow)
        if item.get_closest_marker("extended"):  # never in the quick check (`-m "not slow"`)
            item.add_marker(pytest.mark.slow)
    if config.getoption("--extended") or config.getoption("markexpr"):
        return
    extended = [item for item in items if item.get_closest_marker("extended")]
    if extended:
        config.hook.pytest_deselected(items=extended)
        items[:] = [item for item in items if not item.get_closest_marker("extended")]
