"""Each plan constraint raises its own error, naming key, value and what is valid, before compiling;
`maestro-jax plan` says what it searches as it goes."""

import re

import jax
import pytest
from conftest import ROOT, TINY_KD, TINY_VLM

from maestro_jax.config import ConfigError, load_config
from maestro_jax.core import plan as plan_lib
from maestro_jax.runtime.build import build_runtime

VLM = ROOT / "configs/vlm_tiny.yaml"


class CompileCounter:
    """Counts XLA backend compilations through jax.monitoring (a real event, not a mock)."""

    def __init__(self):
        self.count = 0
        jax.monitoring.register_event_duration_secs_listener(self._on)

    def _on(self, event, duration, **kwargs):
        if "backend_compile" in event:
            self.count += 1


COUNTER = CompileCounter()

CASES = [
    (["sections.llm.devices=1:7"], plan_lib.ResourceError, "sections.llm.devices", "also used by section 'vision'"),
    (
        ["sections.llm.devices=4:10", "sections.vision.devices=0:2"],
        plan_lib.ResourceError,
        "sections.llm.devices",
        "valid device ids are 0..7",
    ),
    (
        ["sections.llm.mesh={data: 2, tensor: 2}"],
        plan_lib.MeshShapeError,
        "sections.llm.mesh",
        "must multiply to the device count",
    ),
    (["edges.image_embeds.fanout=2"], plan_lib.FanoutError, "edges.image_embeds.fanout", "valid: fanout 1"),
    (
        ["sections.llm.mesh={data: 6}", "sections.llm.micro_batch=1", "global_batch=12", "edges.image_embeds.fanout=2"],
        plan_lib.FanoutError,
        "edges.image_embeds.fanout",
        "valid: fanout 3",
    ),
    (
        [
            "sections.vision.mesh={data: 4}",
            "sections.vision.devices=0:4",
            "sections.llm.devices=4:7",
            "sections.llm.mesh={data: 3}",
            "sections.llm.micro_batch=1",
            "global_batch=12",
            "edges.image_embeds.fanout=1",
        ],
        plan_lib.FanoutError,
        "edges.image_embeds.fanout",
        "uneven edge",
    ),
    (
        ["sections.llm.mesh={data: 1, tensor: 6}", "edges.image_embeds.fanout=1", "sections.vision.mesh={tensor: 2}"],
        plan_lib.DivisibilityError,
        "sections.llm.mesh",
        "does not divide",
    ),
    (["device_memory_gb=0.0001"], plan_lib.MemoryBudgetError, "sections.", "exceeds device_memory_gb"),
]


@pytest.mark.parametrize("overrides,error,key,text", CASES, ids=[c[1].__name__ + str(i) for i, c in enumerate(CASES)])
def test_constraint_violation_raises_before_compiling(overrides, error, key, text):
    cfg = load_config(VLM, TINY_VLM + overrides)
    before = COUNTER.count
    with pytest.raises(error) as info:
        build_runtime(cfg)
    assert COUNTER.count == before, "the plan must be rejected before any compilation"
    assert info.value.key.startswith(key)
    assert text in str(info.value)
    assert repr(info.value.value) in str(info.value) or str(info.value.value) in str(info.value)


def test_compile_counter_sees_compiles():
    before = COUNTER.count
    jax.jit(lambda x: x * 3 + 1)(jax.numpy.ones(7)).block_until_ready()
    assert COUNTER.count > before


def test_monolithic_layout_checked():
    cfg = load_config(VLM, TINY_VLM + ["monolithic.mesh={data: 4, tensor: 2}"])
    rt = build_runtime(cfg)
    with pytest.raises(plan_lib.DivisibilityError, match=r"monolithic\.mesh"):
        rt.monolithic  # noqa: B018


@pytest.mark.parametrize(
    "overrides,text",
    [
        (["sections.llm.micro_bach=2"], "did you mean 'micro_batch'"),
        (["steps=many"], "steps='many'"),
        (["sections.llm.mesh.tensor=0"], "sections.llm.mesh.tensor=0"),
        (["models.llm.kind=cnn"], "models.llm"),
        (["models.llm.widht=3"], "models.llm.widht: unknown key; did you mean 'width'?"),
        (["sections.llm.init.hf_pth=x"], "sections.llm.init.hf_pth: unknown key; did you mean 'hf_path'?"),
        (["steps=true"], "steps=True: Input should be a valid integer"),
        (["seed=-1"], "seed=-1"),
        (["seed=4294967296"], "seed=4294967296"),
        (["data.text_len=[40,10]"], "data.text_len=[40, 10]: the shortest text (40) is longer than the longest (10)"),
        (["models.llm.kv_heads=4"], "models.llm.kv_heads=4: must divide heads=6"),
        (["models.llm.experts=4"], "models.llm.experts_per_token=0: with experts=4 each token goes to 1..4 experts"),
        (["models.llm.experts=4", "models.llm.experts_per_token=2"], "models.llm.expert_mlp=0: a mixture-of-experts"),
    ],
)
def test_bad_config_one_line_error(overrides, text):
    with pytest.raises(ConfigError) as info:
        load_config(VLM, overrides)
    msg = str(info.value)
    assert msg.startswith("error: ") and "\n" not in msg
    assert text in msg


def test_image_sizes_are_checked_against_the_vit_at_their_key():
    from maestro_jax.workloads import build_graph

    for sizes, ok in (("[[16,12]]", False), ("[[512,256]]", False), ("[[16,8]]", True)):
        cfg = load_config(VLM, TINY_VLM + [f"data.modalities.image.sizes={sizes}"])
        if ok:
            build_graph(cfg)
            continue
        with pytest.raises(
            ConfigError,
            match=r"^error: data\.modalities\.image\.sizes=.*; valid: height x width, each side a multiple of "
            r"models\.vision patch\*merge=8 and at most max_grid\*patch=256$",
        ):
            build_graph(cfg)


def test_plan_says_what_it_searches(capsys):
    """One line per pass of the search (a stash bound each: 4, 2, 1) and one before the baselines,
    on stdout ahead of the report (stderr holds nothing but a failure's `error:` line)."""
    from maestro_jax import cli
    from maestro_jax.planning.planner import Planner
    from maestro_jax.tools.plan import planner_for

    assert (
        cli.main(
            [
                "plan",
                "--config",
                str(ROOT / "configs/kd_tiny.yaml"),
                "--devices",
                "8",
                "--memory-gb",
                "1",
                "--top",
                "1",
                *TINY_KD,
                "simulate.device=cpu",
                "simulate.batches=1",
                "schedule.max_in_flight=4",
            ]
        )
        == 0
    )
    said = capsys.readouterr()
    lines = said.out.splitlines()
    progress = lines[: next(i for i, line in enumerate(lines) if line.startswith("workload kd:"))]
    assert all(line.startswith("plan: ") for line in progress), progress
    assert progress[0].startswith("plan: describing workload kd")
    passes = [line for line in progress if line.startswith("plan: searching plans on 8 devices with 1 GB each")]
    assert [re.search(r"max_in_flight (\d+)", line).group(1) for line in passes] == ["4", "2", "1"], progress
    assert progress[-1].startswith("plan: baselines on 8 devices") and len(progress) == 5, progress
    assert said.err == ""
    quiet = planner_for(load_config(ROOT / "configs/kd_tiny.yaml", TINY_KD), 8, 1.0)
    assert type(quiet) is Planner, "without `progress` the planner is the library's own (scripts print nothing)"
