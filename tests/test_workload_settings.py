"""A workload's own settings, model kinds and sample source (`Workload.settings`, `model_kinds`,
`source`), validated like every key of the config; and the built-in workloads' placeholder ids
(`workload_settings.image_token` / `audio_token`), read by every path that makes or checks
samples."""

import dataclasses
import subprocess
import sys

import numpy as np
import pytest
from conftest import ROOT, TINY_OMNI, TINY_VLM
from maestro_jax.models import LLMConfig
from pydantic import PositiveInt

from maestro_jax import workloads
from maestro_jax.config import ConfigError, Settings, load_config, parse_overrides
from maestro_jax.core.graph import SectionGraph
from maestro_jax.data import FIRST_TEXT_TOKEN, Sample, text_ids
from maestro_jax.tools.verify import verify
from maestro_jax.training.loop import train
from maestro_jax.workloads import rows as R
from maestro_jax.workloads.costs import llm_cost
from maestro_jax.workloads.vlm import init_llm, llm_section

PLUGIN_NAME = "test_workload_settings:COUNTING"


# -- a plug-in, as a user writes it: its settings, a model kind of its own, its own source ----------
class CountingSettings(Settings):
    """Samples count up from `first_token`, wrapping after `period` ids."""

    first_token: PositiveInt = FIRST_TEXT_TOKEN
    period: PositiveInt = 5
    length: PositiveInt = 12


class SmallLM(Settings):
    """A decoder given by three numbers (the plug-in derives the rest)."""

    vocab: PositiveInt
    width: PositiveInt
    depth: PositiveInt = 1


@dataclasses.dataclass(frozen=True)
class CountingSource:
    num_samples: int
    settings: CountingSettings

    def __len__(self):
        return self.num_samples

    def __getitem__(self, i):
        s = self.settings
        return Sample(int(i), (s.first_token + (np.arange(s.length) + int(i)) % s.period).astype(np.int32))


def small_llm(cfg) -> LLMConfig:
    m = workloads.model(cfg, "llm", "small_llm")
    return LLMConfig(
        vocab=m.vocab, width=m.width, depth=m.depth, heads=2, kv_heads=1, head_dim=m.width // 2, mlp=2 * m.width
    )


def build(cfg) -> SectionGraph:
    llm = small_llm(cfg)
    return SectionGraph(
        sections=(llm_section(llm, {}, llm_cost(llm, head=True), per_octave=cfg.compile.buckets_per_octave),),
        edges=(),
        init=lambda key: {"llm": {"params": init_llm(llm, key)["params"], "consts": {}}},
        loss_count=R.loss_tokens(),
    )


COUNTING = workloads.Workload(
    "counting",
    build,
    vocab=lambda cfg: workloads.model(cfg, "llm", "small_llm").vocab,
    settings=CountingSettings,
    model_kinds={"small_llm": SmallLM},
    source=lambda cfg: CountingSource(cfg.data.num_samples, workloads.settings(cfg)),
)


def plugin_cfg(*overrides):
    """The plug-in's config, with dotted `key=value` overrides as the command line gives them."""
    base = {
        "workload": PLUGIN_NAME,
        "global_batch": 8,
        "steps": 4,
        "models.llm": {"kind": "small_llm", "vocab": 64, "width": 16},
        "workload_settings": {"period": 7},
        "data": {"kind": "workload", "num_samples": 64},
        "optimizer.learning_rate": 0.01,
        "sections.llm": {"devices": "0:4", "mesh": {"data": 4}},
    }
    return load_config(None, {**base, **parse_overrides(list(overrides))})


@pytest.mark.slow
def test_plugin_settings_model_kind_and_source_verify_and_train():
    cfg = plugin_cfg()
    source = workloads.source_from_config(cfg)
    assert isinstance(source, CountingSource) and source.settings == CountingSettings(period=7)
    assert set(source[0].tokens) == set(range(FIRST_TEXT_TOKEN, FIRST_TEXT_TOKEN + 7))  # the configured period
    assert isinstance(workloads.model(cfg, "llm", "small_llm"), SmallLM)
    for d in verify(cfg):
        assert d.max_rel < 1e-5, d
    losses = [h["train/loss"] for h in train(cfg, progress=False)]
    assert len(losses) == 4 and all(np.isfinite(losses)) and losses[-1] < losses[0]


def checked_error(load) -> str:
    """The one-line ConfigError of loading a config and checking it against its workload."""
    with pytest.raises(ConfigError) as err:
        workloads.check_config(load())
    return str(err.value)


@pytest.mark.parametrize(
    "override,message",
    [
        (
            "workload_settings.perod=3",
            "error: workload_settings.perod: unknown key; did you mean 'period'? valid keys: first_token, length, period",
        ),
        ("workload_settings.period=-2", "error: workload_settings.period=-2: Input should be greater than 0"),
        (
            "models.llm.widht=8",
            "error: models.llm.widht: unknown key; did you mean 'width'? valid keys: depth, vocab, width",
        ),
        (
            "models.llm.depth=deep",
            "error: models.llm.depth='deep': Input should be a valid integer, unable to parse string as an integer",
        ),
        (
            "models.llm.kind=cnn",
            f"error: models.llm.kind='cnn': unknown; valid: vit, audio, llm, small_llm (the built-in kinds and "
            f"those workload {PLUGIN_NAME!r} declares)",
        ),
    ],
)
def test_plugin_settings_errors_are_one_line(override, message):
    assert checked_error(lambda: plugin_cfg(override)) == message


@pytest.mark.parametrize(
    "file,tiny,override,message",
    [
        (
            "vlm_tiny.yaml",
            TINY_VLM,
            "workload_settings.image_token=384",
            "error: workload_settings.image_token=384: outside the vocabulary; valid: 1 to 383 (0 is padding; the "
            "model's vocab is 384)",
        ),
        (
            "vlm_tiny.yaml",
            TINY_VLM,
            "workload_settings.image_tokn=7",
            "error: workload_settings.image_tokn: unknown key; did you mean 'image_token'? valid keys: image_token, "
            "video_max_frames, video_token",
        ),
        (
            "vlm_tiny.yaml",
            TINY_VLM,
            "workload_settings.image_token=0",
            "error: workload_settings.image_token=0: Input should be greater than 0",
        ),
        (
            "omni_tiny.yaml",
            TINY_OMNI,
            "workload_settings.audio_token=1",
            "error: workload_settings.audio_token=1: the image placeholder has this id too; valid: an id of its own",
        ),
        (
            "kd_tiny.yaml",
            [],
            "workload_settings.image_token=7",
            "error: workload_settings.image_token: unknown key; workload 'kd' takes no settings",
        ),
        (
            "vlm_tiny.yaml",
            TINY_VLM,
            "data.kind=workload",
            "error: data.kind='workload': workload 'vlm' brings no sample source (Workload.source); valid: "
            "synthetic, array_record",
        ),
    ],
)
def test_builtin_settings_errors_are_one_line(file, tiny, override, message):
    def load():
        cfg = load_config(ROOT / "configs" / file, [*tiny, override])
        workloads.source_from_config(cfg)
        return cfg

    assert checked_error(load) == message


def test_settings_errors_exit_2_with_one_line_from_the_command_line():
    cmd = [sys.executable, "-m", "maestro_jax.cli", "simulate", "--config", str(ROOT / "configs/vlm_tiny.yaml")]
    proc = subprocess.run(cmd + ["workload_settings.image_token=999"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: workload_settings.image_token=999: outside the vocabulary; valid: 1 to 383 (0 is padding; the "
        "model's vocab is 384)"
    ]


def test_plugin_kinds_and_settings_need_a_plugin_workload():
    with pytest.raises(ConfigError) as err:
        load_config(ROOT / "configs/vlm_tiny.yaml", ["models.llm.kind=small_llm"])
    assert str(err.value) == (
        "error: models.llm.kind='small_llm': unknown; valid: vit, audio, llm (a plug-in workload, "
        "'package.module:NAME', may declare kinds of its own)"
    )
    with pytest.raises(TypeError, match=r"settings must be a maestro_jax\.config\.Settings subclass"):
        workloads.Workload("loose", build, vocab=lambda cfg: 8, settings=dict)


# -- the built-in workloads' placeholder ids ------------------------------------------------------
@pytest.mark.slow
def test_vlm_with_its_own_image_id_makes_checks_and_verifies():
    """Image id 7: synthetic text skips 7, every sample's 7s are exactly its image tokens (and its
    2s, vlm_tiny's video id, its clips' tokens), and the section runtime matches the monolithic step."""
    cfg = load_config(ROOT / "configs/vlm_tiny.yaml", [*TINY_VLM, "workload_settings.image_token=7"])
    image, video = workloads.modalities_of(cfg)
    assert (image.placeholder, video.placeholder) == (7, 2)
    source, check = workloads.source_from_config(cfg), workloads.sample_check(cfg)
    samples = [check(source[i]) for i in range(32)]
    assert any(s.has("image") for s in samples) and any(not s.has("image") for s in samples)
    assert any(s.has("video") for s in samples)
    for s in samples:
        assert np.count_nonzero(s.tokens == 7) == sum(image.tokens(x.shape[:2]) for x in s.of("image"))
        assert np.count_nonzero(s.tokens == 2) == sum(video.tokens(x.shape[:3]) for x in s.of("video"))
        assert not np.isin(s.tokens, [1]).any()  # the default image id is no placeholder here, nor used as text
    for d in verify(cfg):
        assert d.max_rel < 1e-5, d


def test_text_ids_skip_the_placeholders_and_keep_the_default_layout():
    """Generated text takes the ids from FIRST_TEXT_TOKEN up, minus the placeholders: with the
    default ids (1, 2) that is every id from 3, as synthetic and byte-level text always were."""
    assert np.array_equal(text_ids(384, (1, 2)), np.arange(FIRST_TEXT_TOKEN, 384))
    assert text_ids(11, (7, 9)).tolist() == [3, 4, 5, 6, 8, 10]


@pytest.mark.parametrize(
    "schema, model",
    [
        ("LLMModelConfig", "LLMConfig"),
        ("ViTModelConfig", "ViTConfig"),
        ("AudioModelConfig", "AudioConfig"),
    ],
)
def test_each_model_has_one_schema(schema, model):
    """`models.<s>` in a config and the model's own dataclass describe one model: every field of
    the model is in the config (but `remat`, which the section's `layer_remat` sets), and a
    default both declare is the same (`router_aux_loss` once was 0.001 in the config and 0.0 in
    `LLMConfig`, so a model built in Python trained without the balance loss)."""
    import maestro_jax.models as M
    from pydantic_core import PydanticUndefined

    import maestro_jax.config as C

    fields = C.__dict__[schema].model_fields
    own = {f.name: f for f in dataclasses.fields(getattr(M, model))}
    assert set(own) - set(fields) == {"remat"}
    differ = {
        name: (fields[name].default, f.default)
        for name, f in own.items()
        if name in fields and f.default is not dataclasses.MISSING and fields[name].default is not PydanticUndefined
        if fields[name].default != f.default
    }
    assert not differ, f"defaults that differ (config, model): {differ}"
