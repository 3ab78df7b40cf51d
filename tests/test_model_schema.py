"""Each built-in model's config dataclass is its one schema (`models/schema.py`): the launch
config's `models.<name>` entries are generated from it, so a field is declared once (its type,
bounds, default and cross-field rules) and reaches the config file, the module and the Hugging
Face mapping from there."""

import dataclasses
import typing
from typing import Annotated, Literal

import pytest
from conftest import ROOT
from maestro_jax.models.configs import AudioConfig, LLMConfig, ViTConfig
from maestro_jax.models.schema import SECTION_FIELDS
from pydantic import Field
from pydantic.fields import FieldInfo

from maestro_jax import hf_config
from maestro_jax.config import MODEL_KINDS, ConfigError, _FromFolder, load_config, model_schema

SCHEMAS = {"vit": ViTConfig, "audio": AudioConfig, "llm": LLMConfig}
CONFIG_ONLY = {"llm": {"moe_dispatch_strict"}}  # how the config resolves a field, no part of the model
FOLDERS = {
    "vit": ("siglip", "clip", "qwen2_5_vl", "qwen3_vl", "gemma3_vlm", "paligemma2"),
    "audio": ("whisper", "qwen2_audio"),
    "llm": tuple(
        p.name
        for p in sorted((ROOT / "tests/fixtures/hf").iterdir())
        if p.name not in ("siglip", "clip", "whisper", "whisper_features", "qwen_video")
    ),
}


@pytest.mark.parametrize("kind", sorted(SCHEMAS))
def test_the_config_entry_is_the_models_dataclass_field_for_field(kind):
    """Every field of the dataclass but the section's (`remat`) is a key of `models.<name>` with
    the same type (bounds and choices included) and the same default; the entry adds only
    `kind` and `hf` (and for the LLM `moe_dispatch_strict`, how the config resolves `moe_dispatch`)."""
    module, entry = SCHEMAS[kind], MODEL_KINDS[kind]
    hints = typing.get_type_hints(module, include_extras=True)
    own = {f.name: f for f in dataclasses.fields(module) if f.name not in SECTION_FIELDS}
    assert set(entry.model_fields) == {*own, "kind", "hf", *CONFIG_ONLY.get(kind, ())}
    for name, f in own.items():
        field = entry.model_fields[name]
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        assert field.is_required() == required, name
        if not required:
            want = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            assert field.get_default(call_default_factory=True) == want, name
        want = FieldInfo.from_annotation(hints[name])
        assert (field.annotation, field.metadata) == (want.annotation, want.metadata), name


def test_a_field_added_to_the_dataclass_reaches_the_config_entry_with_its_bounds_and_rules():
    """A new field written once (type, bound, default) is a key of the generated entry, refused
    out of its bound naming the key; the entry's values build the dataclass (what
    `workloads.model()` does); the dataclass's rules refuse in the entry as in the dataclass."""

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class WithDropout(ViTConfig):
        dropout: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0  # the new field, written once
        pool: Literal["mean", "cls"] = "mean"

    class Entry(_FromFolder):
        pass

    schema = model_schema("WithDropoutEntry", WithDropout, "vit", Entry)
    base = {"kind": "vit", "patch": 4, "width": 8, "depth": 2, "heads": 2, "mlp": 8, "out_width": 8}
    entry = schema(**base, dropout=0.25, pool="cls")
    built = WithDropout(**{k: v for k, v in entry.model_dump().items() if k not in ("kind", "hf")})
    assert (built.dropout, built.pool, built.channels) == (0.25, "cls", 3)
    assert schema(**base).dropout == 0.0
    for bad, key in (({"dropout": 1.5}, "dropout"), ({"pool": "max"}, "pool"), ({"feature_layer": 3}, "feature_layer")):
        with pytest.raises(ValueError, match=key):
            schema(**base, **bad)
    with pytest.raises(ValueError, match=r"WithDropout.feature_layer=3: a tower of depth 2"):
        WithDropout(**{k: v for k, v in base.items() if k != "kind"}, feature_layer=3)


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "models.vision.feature_layer=9",
            "error: models.vision.feature_layer=9: a tower of depth 2 has block outputs -2..-1 or 1..2",
        ),
        (
            "models.vision.class_token=true",
            "error: models.vision.class_token=True: CLIP's layout needs pos_embed='table'",
        ),
        ("models.vision.pos_embed=grid", "error: models.vision.pos_embed='grid'"),
        (
            "models.vision.projector_bias=false",
            "error: models.vision.projector_bias=False: only projector='linear' goes without a bias, not 'merger'",
        ),
        ("models.vision.norm_eps=0", "error: models.vision.norm_eps=0"),
        ("models.llm.kv_heads=4", "error: models.llm.kv_heads=4: must divide heads=6"),
        ("models.llm.experts=4", "error: models.llm.experts_per_token=0: with experts=4 each token goes to 1..4"),
        ("models.llm.moe_dispatch=fast", "error: models.llm.moe_dispatch='fast'"),
        (
            "models.llm.pre_norms=false",
            "error: models.llm.pre_norms=False: a block without norms before its attention and MLP norms their "
            "outputs: set post_norms: true",
        ),
        ("models.llm.qk_norm_over=projection", "error: models.llm.qk_norm_over='projection': qk_norm_over says"),
    ],
)
def test_a_rule_or_bound_of_the_dataclass_is_one_config_error_naming_the_key(override, message):
    with pytest.raises(ConfigError) as err:
        load_config(ROOT / "configs/vlm_tiny.yaml", [override])
    assert str(err.value).startswith(message), str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("kind", sorted(FOLDERS))
def test_every_field_a_hugging_face_folder_gives_is_a_field_of_the_schema(kind):
    """`hf_config`'s mapping of each stored fixture folder writes only the dataclass's fields
    (and `kind`), and the dataclass takes them as they are (with `out_width`, the consuming LLM's
    width, which no tower's folder holds)."""
    read = {"vit": hf_config.vit_fields, "audio": hf_config.audio_fields, "llm": hf_config.llm_fields}[kind]
    module = SCHEMAS[kind]
    names = {f.name for f in dataclasses.fields(module)}
    for folder in FOLDERS[kind]:
        fields = read(ROOT / "tests/fixtures/hf" / folder)
        assert set(fields) - {"kind"} <= names, (folder, set(fields) - names - {"kind"})
        if kind == "llm":
            module.from_fields(fields)
        else:
            module(**{"out_width": 16, **{k: v for k, v in fields.items() if k != "kind"}})
