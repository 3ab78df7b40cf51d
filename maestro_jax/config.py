"""Typed, frozen launch configuration, loaded from YAML with dotted `key=value` overrides.

pydantic does the validation (`extra="forbid"`: unknown keys are errors); `ConfigError`
turns its report into one line naming the key, the value and what would be valid.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

import pydantic
import yaml
from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, PositiveInt

from maestro_jax import fast_paths, hf_config
from maestro_jax.core.buckets import PER_OCTAVE
from maestro_jax.core.buckets import VALID as BUCKET_GRANULARITIES
from maestro_jax.core.plan import Plan, SectionPlan
from maestro_jax.core.stages import stage_name
from maestro_jax.meshes import MESH_AXES
from maestro_jax.models.configs import AudioConfig, LLMConfig, ViTConfig
from maestro_jax.models.schema import SECTION_FIELDS, Rule


class ConfigError(ValueError):
    """A config that cannot be used; the message is one line naming the key."""


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Settings(_Frozen):
    """Base of a plug-in's typed settings: a workload's `workload_settings:` block
    (`Workload.settings`) and the fields of a model kind it declares (`Workload.model_kinds`).
    Frozen, and unknown keys are refused, as everywhere in the config (`validate_block`)."""


class MeshConfig(_Frozen):
    """Sizes of the section mesh axes; their product must equal the section's device count."""

    data: PositiveInt = 1
    fsdp: PositiveInt = 1
    expert: PositiveInt = 1
    context: PositiveInt = 1
    tensor: PositiveInt = 1

    @property
    def shape(self) -> tuple[int, ...]:
        """Sizes in `meshes.MESH_AXES` order."""
        return tuple(getattr(self, a) for a in MESH_AXES)


def _devices(value):
    """Accept `[0, 1, 2]` or a half-open range string `"2:8"`. YAML 1.1 reads an unquoted `4:8`
    as the base-60 integer 248: an integer here is named with the range it came from."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value >= 60:
            lo, hi = divmod(value, 60)
            raise ValueError(
                f'YAML reads an unquoted {lo}:{hi} as the base-60 number {value}; quote the range: devices: "{lo}:{hi}"'
            )
        raise ValueError('a list of device ids like [0, 1] or a quoted range like "0:4" (start:stop)')
    if isinstance(value, str):
        try:
            lo, hi = (int(v) for v in value.split(":"))
        except ValueError as err:
            raise ValueError(f"device range must look like 'start:stop', got {value!r}") from err
        return list(range(lo, hi))
    return value


class InitConfig(_Frozen):
    """Where a section's weights start from (default: random): one of the two."""

    # a local Hugging Face folder (config.json + safetensors): a Llama/Qwen2/Qwen3(-MoE) decoder for
    # an llm section, a SigLIP or CLIP (LLaVA) vision tower for a vit one, a Whisper encoder for an audio one
    hf_path: str | None = None
    # another run's checkpoints (its checkpoint_dir, default <output_dir>/checkpoints): this trained
    # section's params from the newest committed step there, a fresh optimizer (a next training
    # stage; `training.checkpoint.start_from_checkpoints`); `train` applies it on a fresh start
    checkpoint_dir: str | None = None

    @pydantic.model_validator(mode="after")
    def _one_source(self):
        if (self.hf_path is None) == (self.checkpoint_dir is None):
            raise ValueError(
                "give exactly one of hf_path (a Hugging Face folder) and checkpoint_dir (another run's "
                "checkpoints: the section's params, a fresh optimizer)"
            )
        return self


class PackTokens(_Frozen):
    """Token-budget packing (`sections.<name>.pack: {tokens: N}`): a micro-step's samples fill
    rows of at most N tokens, first-fit decreasing, a sample never split (`schedule.packing`)."""

    tokens: PositiveInt

    def __str__(self) -> str:
        return f"{{tokens: {self.tokens}}}"


PACK_VALID = (
    "valid: a sample count P >= 1 (P samples per row on average; 1: no packing) or {tokens: N} "
    "(rows of at most N tokens, N a positive integer)"
)


def _pack(value):
    """`pack` is a positive int or a `{tokens: N}` mapping; anything else is refused in one line
    (pydantic's own report of a failed union would name each member's failure)."""
    if isinstance(value, PackTokens):
        return value
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    tokens = value.get("tokens") if isinstance(value, dict) and set(value) == {"tokens"} else None
    if isinstance(tokens, int) and not isinstance(tokens, bool) and tokens >= 1:
        return PackTokens(tokens=tokens)
    raise ValueError(f"neither a sample count nor a token budget; {PACK_VALID}")


class SectionConfig(_Frozen):
    init: InitConfig | None = None
    devices: Annotated[list[int], pydantic.BeforeValidator(_devices)]
    mesh: MeshConfig = MeshConfig()
    micro_batch: PositiveInt = 1
    residuals: Literal["vjp", "remat"] = "vjp"
    rules: str = "default"
    # bfloat16: float32 master weights, bf16 compute; fp8 (frozen sections only): bf16 with the Dense
    # kernels stored and multiplied in float8 e4m3 (`runtime.precision`)
    precision: Literal["float32", "bfloat16", "fp8"] = "float32"
    layer_remat: Literal["none", "full", "dots"] = "none"  # per-layer activation checkpointing in the model
    # sequence packing: P samples per row on average (micro_batch x P per shard and micro-step, laid
    # into rows by length, attention kept within each sample); 1: one sample per row; {tokens: N}:
    # micro_batch samples per shard and micro-step in as few rows of at most N tokens as first-fit
    # decreasing finds. Sections that pack: the LLM of vlm/omni/vlm_kd, teachers and students of
    # kd/vlm_kd (`runtime.build.check_packing`)
    pack: Annotated[int | PackTokens, pydantic.BeforeValidator(_pack)] = 1
    # pipeline stages: K programs, stage i on the i-th consecutive K-th of `devices`, each running
    # `mesh` with its data axis divided by K (`core.stages`), each a consecutive run of the layers.
    # Sections that split: the LLM of vlm/omni/vlm_kd, teachers and students of kd/vlm_kd; with
    # unrolled layers (scan_layers: false), not yet with pack
    stages: PositiveInt = 1

    @pydantic.field_validator("stages")
    @classmethod
    def _stages_fit(cls, stages: int, info):
        if stages == 1 or "mesh" not in info.data or "devices" not in info.data:
            return stages
        mesh, devices = info.data["mesh"], info.data["devices"]
        size = math.prod(mesh.shape)
        if size != len(devices):
            raise ValueError(
                f"the mesh's axes multiply to {size} but the section has {len(devices)} devices; valid: a mesh "
                f"over all the section's devices, whose data axis the stages divide"
            )
        if mesh.data % stages:
            raise ValueError(
                f"the mesh's data axis ({mesh.data}) does not divide into {stages} stages; valid: a stage count "
                f"that divides mesh.data (each stage runs the mesh with data / stages on its consecutive share "
                f"of the devices)"
            )
        if info.data.get("pack", 1) != 1:
            raise ValueError(f"not with pack={info.data['pack']} yet; valid: 1, or pack: 1")
        return stages

    # each stage's layer count (default: as even as they come, earlier stages taking the extra ones),
    # as Megatron-LM's --decoder-first/last-pipeline-num-layers; the first and the last stage may
    # hold none (the embedding; the final norm, output layer and loss), the others at least one
    stage_layers: list[NonNegativeInt] | None = None

    @pydantic.field_validator("stage_layers")
    @classmethod
    def _one_count_a_stage(cls, layers: list[int] | None, info):
        stages = info.data.get("stages", 1)
        if layers is not None and stages == 1:
            raise ValueError("a cut of an unstaged section; valid: stage_layers with stages > 1, or none")
        if layers is not None and len(layers) != stages:
            raise ValueError(
                f"{len(layers)} layer counts for {stages} stage(s); valid: one count a stage (sections.<s>.stages "
                f"gives {stages}), or no stage_layers for an even cut"
            )
        return layers

    def stage_mesh(self) -> tuple[int, ...]:
        """The mesh each of the section's pipeline stages runs: `mesh` with data / stages."""
        return tuple(n // self.stages if a == "data" else n for a, n in zip(MESH_AXES, self.mesh.shape))


class EdgeConfig(_Frozen):
    """An edge joins any data-parallel degrees (fan-out, fan-in, uneven); nothing to set. `fanout`,
    if given, only states DP(consumer) / DP(producer) and is checked against the plan."""

    fanout: PositiveInt | None = None


class _FromFolder(_Frozen):
    """A model entry that may take its architecture from a Hugging Face folder: with `hf: PATH`
    every field the folder's config.json gives (`hf_config`) is filled in, and a field written
    beside it must agree with the folder's, or the config is refused naming both values."""

    hf: str | None = None

    @classmethod
    def folder_fields(cls, path: str) -> dict:
        raise NotImplementedError

    @classmethod
    def _read(cls, path: str) -> dict:
        try:
            return cls.folder_fields(path)
        except hf_config.HFError as err:
            raise ValueError(f"hf={path!r}: {err}") from None
        except KeyError as err:
            raise ValueError(f"hf={path!r}: {path}/config.json has no {err} field") from None

    @pydantic.model_validator(mode="before")
    @classmethod
    def _fill(cls, data):
        if not isinstance(data, dict) or not data.get("hf"):
            return data
        return {**cls._read(data["hf"]), **data}

    @pydantic.model_validator(mode="after")
    def _agree(self):
        if self.hf is None:
            return self
        for k, theirs in self._read(self.hf).items():
            mine = getattr(self, k)
            mine = dataclasses.asdict(mine) if dataclasses.is_dataclass(mine) else mine
            if mine != theirs:
                raise ValueError(
                    f"{k}={mine!r}: the checkpoint {self.hf} has {k}={theirs!r}; leave {k} out (hf fills "
                    f"it in) or write the checkpoint's value"
                )
        return self


def _rule_validator(rule: Rule):
    """A `models.schema.Rule` as a pydantic validator: of its field (the error names that key and
    the value written), or of the whole entry."""
    if rule.field is None:

        def whole(self):
            message = rule.check(dict(self))
            if message:
                raise ValueError(message)
            return self

        return pydantic.model_validator(mode="after")(whole)

    def one(cls, value, info):
        message = rule.check({**info.data, rule.field: value})
        if message:
            raise ValueError(message)
        return value

    return pydantic.field_validator(rule.field)(classmethod(one))


def model_schema(name: str, module_config: type, kind: str, base: type[BaseModel], **extra) -> type[BaseModel]:
    """`models.<name>` of a built-in `kind`, generated from the model's own config dataclass (its
    one schema, `models.schema`): every field but the section's (`SECTION_FIELDS`) with its type,
    constraints and default, each of its `RULES` a validator; `extra`: the config's own fields
    beside them, as pydantic field definitions (type, default)."""
    hints = typing.get_type_hints(module_config, include_extras=True)
    fields: dict[str, Any] = {"kind": (Literal[kind], ...)}
    ruled = {rule.field for rule in module_config.RULES}
    for f in dataclasses.fields(module_config):
        if f.name in SECTION_FIELDS:
            continue
        default = f.default if f.default is not dataclasses.MISSING else ...
        if f.default_factory is not dataclasses.MISSING:
            default = Field(default_factory=f.default_factory)
        elif f.name in ruled:  # a rule holds for a value left out too (experts_per_token: 0 with experts)
            default = Field(default, validate_default=True)
        fields[f.name] = (hints[f.name], default)
    validators = {f"_rule_{i}": _rule_validator(rule) for i, rule in enumerate(module_config.RULES)}
    return pydantic.create_model(name, __base__=base, __module__=__name__, __validators__=validators, **fields, **extra)


class _ViTEntry(_FromFolder):
    """A `models.<name>` of kind vit; its fields are `models.configs.ViTConfig`'s (`model_schema`)."""

    @classmethod
    def folder_fields(cls, path: str) -> dict:
        return hf_config.vit_fields(path)


class _AudioEntry(_FromFolder):
    """A `models.<name>` of kind audio; its fields are `models.configs.AudioConfig`'s (`model_schema`)."""

    @classmethod
    def folder_fields(cls, path: str) -> dict:
        return hf_config.audio_fields(path)


ViTModelConfig = model_schema("ViTModelConfig", ViTConfig, "vit", _ViTEntry)
AudioModelConfig = model_schema("AudioModelConfig", AudioConfig, "audio", _AudioEntry)


class _LLMEntry(_FromFolder):
    """A `models.<name>` of kind llm; its fields are `models.configs.LLMConfig`'s (`model_schema`),
    and `moe_dispatch_strict`, how the config resolves `moe_dispatch` (no part of the model)."""

    @classmethod
    def folder_fields(cls, path: str) -> dict:
        return hf_config.llm_fields(path)


LLMModelConfig = model_schema(
    "LLMModelConfig",
    LLMConfig,
    "llm",
    _LLMEntry,
    # grouped where its kernel is missing here (no NVIDIA Hopper GPU, jax < 0.11.1, no tokamax) runs
    # sparse, the same dispatch without the kernel, said in one log line; true: refused instead
    moe_dispatch_strict=(bool, False),
)


class PluginModelConfig(BaseModel):
    """`models.<name>` of a kind other than the built-in ones: a kind a plug-in workload declares
    (`Workload.model_kinds`), kept as written here and validated against the plug-in's class when
    the workload is resolved (`workloads.check_config`)."""

    model_config = ConfigDict(extra="allow", frozen=True)
    kind: str


def _model_kind(entry) -> str | None:
    """The union member a `models` entry validates as: its built-in kind, or `plugin`."""
    kind = entry.get("kind") if isinstance(entry, dict) else getattr(entry, "kind", None)
    return None if kind is None else kind if isinstance(kind, str) and kind in MODEL_KINDS else "plugin"


ModelConfig = Annotated[
    Annotated[ViTModelConfig, pydantic.Tag("vit")]
    | Annotated[AudioModelConfig, pydantic.Tag("audio")]
    | Annotated[LLMModelConfig, pydantic.Tag("llm")]
    | Annotated[PluginModelConfig, pydantic.Tag("plugin")],
    pydantic.Discriminator(_model_kind),
]


class CombineConfig(_Frozen):
    """How several teachers' distributions make the one the student learns from.

    `mean`: their tempered distributions averaged with `weights` (teacher -> weight; a teacher
    left out weighs 1, so the default is the plain mean; normalised to sum to 1).
    `route`: each sample learns from one teacher, the one its tag `field` names
    (`data.samples.Sample.tags`): through `routes` (tag value -> teacher) where the value is
    listed there, else the teacher of that name; a sample without the tag goes to `default`
    (None: such a sample is a bad sample). A teacher no sample of a batch routes to runs nothing
    for that batch."""

    mode: Literal["mean", "route"] = "mean"
    weights: dict[str, Annotated[float, Field(ge=0.0, allow_inf_nan=False)]] = {}
    field: str | None = None
    routes: dict[str, str] = {}
    default: str | None = None


class DistillConfig(_Frozen):
    alpha: float = Field(0.5, ge=0.0, le=1.0)
    temperature: float = Field(2.0, gt=0.0)
    # the teacher models' names, in order; empty: the one `models.teacher`. Written by
    # `models.teachers: {name: {...}}` (`Config._teachers_group`), which is how a config says it
    teachers: tuple[str, ...] = ()
    combine: CombineConfig = CombineConfig()
    # the KL over the teachers' k likeliest tokens and the rest as one outcome (`kd.sparse_kl`,
    # what a teacher cache holds); unset: over the whole vocabulary
    top_k: PositiveInt | None = None
    # a teacher cache (`maestro-jax teacher-cache --out DIR`) to train from instead of running the
    # teacher: no teacher section then; models.teacher names the teacher the cache must hold
    cache: str | None = None


class LRScheduleConfig(_Frozen):
    """The learning rate over the run: a linear warm-up over `warmup_steps` (its first update at
    peak / warmup_steps, its last at the peak), then the peak held (`constant`) or decayed to
    `final_fraction` of it by update `decay_steps` (warm-up included; default: the run's `steps`),
    along a cosine or a line: optax's own schedules read at the update's number counted from 1
    (`runtime.optimizer.learning_rate`). Counted in applied updates (a skipped non-finite step
    does not advance it)."""

    kind: Literal["constant", "cosine", "linear"] = "constant"
    warmup_steps: NonNegativeInt = 0
    decay_steps: PositiveInt | None = None
    final_fraction: float = Field(0.0, ge=0.0, le=1.0)


class SectionOptimizerConfig(_Frozen):
    """One trained section's own settings (a lower rate for a pretrained tower); unset: the optimizer's."""

    learning_rate: float | None = Field(None, gt=0.0)
    lr_schedule: LRScheduleConfig | None = None
    weight_decay: float | None = Field(None, ge=0.0)
    # parameters to freeze: a parameter whose path (its keys joined by "/", e.g.
    # "block_0/attn/q/kernel") fully matches one of these regular expressions gets no update, no
    # weight decay, no optimizer state, and no share of the clip norm (`runtime.optimizer`); ".*"
    # freezes the whole section. Each must match some parameter (checked before compute).
    freeze: list[str] = []

    @pydantic.field_validator("freeze")
    @classmethod
    def _regexes(cls, v):
        for pattern in v:
            try:
                re.compile(pattern)
            except re.error as err:
                raise ValueError(
                    f"{pattern!r} is not a regular expression ({err}); give Python regexes over parameter "
                    f"paths such as 'block_0/.*' or '.*/kernel'"
                ) from None
        return v


class OptimizerConfig(_Frozen):
    """One optax optimizer per trained section, with gradients clipped by their global norm over
    ALL trained sections (`clip_norm`), as one optimizer over the whole model would clip them."""

    name: Literal["adamw", "sgd"] = "adamw"
    learning_rate: float = Field(1e-3, gt=0.0)
    lr_schedule: LRScheduleConfig = LRScheduleConfig()
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = Field(0.0, ge=0.0)
    # what weight decay applies to: every parameter but biases and norm scales, whatever their
    # rank (the name is historical), or all
    decay: Literal["matrices", "all"] = "matrices"
    clip_norm: float | None = Field(None, gt=0.0)
    sections: dict[str, SectionOptimizerConfig] = {}

    def for_section(self, section: str) -> tuple[float, LRScheduleConfig, float]:
        """`section`'s learning rate, schedule and weight decay, its overrides applied."""
        own = self.sections.get(section, SectionOptimizerConfig())
        return (
            own.learning_rate or self.learning_rate,
            own.lr_schedule or self.lr_schedule,
            self.weight_decay if own.weight_decay is None else own.weight_decay,
        )


class ModalityDataConfig(_Frozen):
    """Synthetic items of one modality: `fraction` of samples carry 1..`max_items` of them."""

    fraction: float = Field(0.5, ge=0.0, le=1.0)
    max_items: PositiveInt = 2
    # spatial sizes: (height, width) of images, (frames, height, width) of video clips, (frames,) of audio clips
    sizes: list[list[PositiveInt]] = []


class DataConfig(_Frozen):
    # synthetic: seeded samples of the workload's modalities; array_record: `paths`; workload: the
    # plug-in workload's own source (`Workload.source`), which may read its `workload_settings`
    kind: Literal["synthetic", "array_record", "workload"] = "synthetic"
    paths: list[str] = Field([], validate_default=True)  # array_record: files written by scripts/convert_*.py
    num_samples: PositiveInt = 4096
    text_len: tuple[PositiveInt, PositiveInt] = (8, 48)
    modalities: dict[str, ModalityDataConfig] = {}  # synthetic items by modality name (image, audio, ...)
    # synthetic: tag name -> the values it takes, one drawn per sample (`data.samples.Sample.tags`)
    tags: dict[str, Annotated[list[str], Field(min_length=1)]] = {}
    shuffle: bool = True
    max_tokens: PositiveInt | None = None  # the largest sequence bucket; longer samples are bad samples
    on_bad_sample: Literal["error", "skip"] = "error"  # skip: drop, count and report bad samples (never train on them)

    @pydantic.field_validator("paths")
    @classmethod
    def _files(cls, v, info):
        if info.data.get("kind") == "array_record" and not v:
            raise ValueError(
                "kind: array_record reads these files, and none is given; valid: a list of ArrayRecord files "
                "(scripts/convert_dataset.py writes them)"
            )
        return v

    @pydantic.field_validator("text_len")
    @classmethod
    def _ordered(cls, v):
        if v[0] > v[1]:
            raise ValueError(f"the shortest text ({v[0]}) is longer than the longest ({v[1]}); give [min, max]")
        return v


class EvalConfig(_Frozen):
    """A held-out loss through the training plan: the first `batches` global
    batches of `data` (in order, the same batches each time), every `every` steps and after the
    last. Synthetic data draws with `seed + 1`, so it does not repeat training's samples;
    without `data`, that is the training data's settings (synthetic training data only)."""

    data: DataConfig | None = None
    every: PositiveInt = 100
    batches: PositiveInt = 2


class ProfileConfig(_Frozen):
    """A `jax.profiler` trace of steps start_step..start_step+steps-1, written into
    `<output_dir>/profile` (TensorBoard's profile plugin or Perfetto read it). The window opens
    before its first step is issued and closes once its last step's results are read, so the
    trace holds that device work whole."""

    start_step: PositiveInt
    steps: PositiveInt = 1


class WandbConfig(_Frozen):
    """The `wandb` tracker's run: under `<output_dir>/wandb`, given the resolved config as its
    hyper-parameters. `offline` writes files only (`wandb sync DIR` uploads them later); the
    package is an optional extra: `pip install 'maestro-jax[wandb]'`."""

    project: str = "maestro_jax"
    name: str | None = None  # W&B's own run name when None
    mode: Literal["offline", "online"] = "offline"


TRACKERS = ("jsonl", "tensorboard", "wandb")


class CompileConfig(_Frozen):
    """Compiling before step 1, and keeping what was compiled for the next run."""

    ahead: bool = True  # compile every program the run's batches need before step 1 (`SectionedStep.compile`)
    max_batches: PositiveInt = 256  # global batches scanned for shapes; a longer run is sampled (`runtime.ahead`)
    # shape buckets per octave (`core.buckets`): each section compiles one program per bucket (per
    # combination of its producers' buckets); 8 pads at most 12.5% past the smallest buckets, 1
    # pads to powers of two: fewer programs where compiling dominates (a small model). The
    # planner and simulator price the same buckets
    buckets_per_octave: Annotated[int, Field(strict=True)] = PER_OCTAVE

    @pydantic.field_validator("buckets_per_octave")
    @classmethod
    def _a_granularity(cls, v):
        if v not in BUCKET_GRANULARITIES:
            raise ValueError(
                f"valid: one of {', '.join(map(str, BUCKET_GRANULARITIES))} (a power of two: buckets per octave of size)"
            )
        return v

    cache: bool = True  # jax's persistent compilation cache: a resume or a rerun loads its executables
    # where the cache lives; default JAX_COMPILATION_CACHE_DIR where set, else the user's cache
    # ($XDG_CACHE_HOME/maestro_jax/xla, ~/.cache/maestro_jax/xla), shared safely by runs
    cache_dir: str | None = None
    # the cache's size cap in GB: past it jax removes the least recently used entries
    # (`jax_compilation_cache_max_size`), so the user's cache never grows without bound; null: no cap
    cache_max_gb: pydantic.PositiveFloat | None = 10.0
    # on NVIDIA GPUs, XLA flags for overlapping collectives with compute (runtime/xla_flags.py
    # GPU_FLAGS), each unless XLA_FLAGS names it already; false: none
    gpu_flags: bool = True
    # on NVIDIA GPUs, a program of at least this many thunks runs as one CUDA graph
    # (`xla_gpu_graph_min_graph_size`; 1: every program, for launch-bound small ones); null:
    # XLA's default (5). runtime/xla_flags.py graph_flags; its default: maestro_jax/fast_paths.py
    cuda_graph_min_thunks: PositiveInt | None = fast_paths.default("compile.cuda_graph_min_thunks")
    # the most consecutive micro-steps of one shape a frozen producer's forward or the sink's
    # loss-and-grad runs as one program (a scan: one launch instead of k, for launch-bound small
    # micro-steps); a consumer of the first waits for the whole run. 1: one program each;
    # its default: maestro_jax/fast_paths.py
    scan_micro_steps: PositiveInt = fast_paths.default("compile.scan_micro_steps")
    # the update program reuses the params' and optimizer state's buffers for its outputs (and
    # backward the grad accumulator's); null: on accelerators only (on CPU a state stays readable)
    donate: bool | None = None


class MonolithicConfig(_Frozen):
    """The baseline: the whole graph as one program over `devices` with one layout."""

    devices: Annotated[list[int], pydantic.BeforeValidator(_devices)] = list(range(8))
    mesh: MeshConfig = MeshConfig(data=8)
    micro_batch: PositiveInt = 1


class SimulateConfig(_Frozen):
    """Cluster the analytic cost model describes (`maestro-jax simulate`)."""

    device: Literal["h100", "h200", "cpu"] = "h100"
    batches: PositiveInt = 4  # global batches simulated
    link_gbps: float = Field(50.0, gt=0.0)  # per-device cross-section bandwidth, GB/s (inter-node IB)


class ScheduleConfig(_Frozen):
    scheduler: Literal["naive", "wavefront"] = "naive"
    max_in_flight: PositiveInt = 4
    # 1: frozen sections that read only data (a teacher, a frozen encoder) compute the next global
    # batch while this step's trained sections run; 0: each step computes its own (schedule.ops.Problem.ahead)
    run_ahead: Literal[0, 1] = 0
    # the wavefront's sink-first schedules also deal each sink micro-step's samples to its shards
    # so that the producers' shards get even work (`schedule.wavefront._balanced`); false leaves
    # that variant out (`maestro-jax bench --balance` times both)
    balance_shards: bool = True


class DistributedConfig(_Frozen):
    """Bounded waits in multi-process runs: a dead or stuck peer becomes an error naming it."""

    timeout_s: float = Field(300.0, gt=0.0)  # longest wait for a peer at a step boundary or for a shared value
    # the same before the first step: processes start and finish compiling minutes apart on a cluster
    startup_timeout_s: float = Field(900.0, gt=0.0)
    heartbeat_timeout_s: PositiveInt = 100  # the coordination service declares a silent process dead


class Config(_Frozen):
    workload: str | None = None  # built-in (vlm, kd, omni, vlm_kd), a plug-in "package.module:NAME", or None
    # when a Python caller hands its own graph to `Trainer`
    seed: int = Field(0, ge=0, lt=2**32)  # jax.random.key takes a uint32 seed
    steps: Annotated[int, Field(strict=True, gt=0)] = 10  # strict: `steps=true` is not 1
    global_batch: Annotated[int, Field(strict=True, gt=0)]
    host_devices: PositiveInt = 8
    device_memory_gb: float | None = Field(None, gt=0.0)
    # one device's peak FLOP/s for the records' MFU (perf/mfu, planning/mfu.py); null: the card's
    # datasheet dense bf16 peak, or on a CPU one float32 matmul timed at the start (runtime/mfu.py)
    peak_flops: float | None = Field(None, gt=0.0)
    output_dir: str | None = None  # metrics.jsonl, TensorBoard events, checkpoints/; re-running resumes
    checkpoint_dir: str | None = None  # default <output_dir>/checkpoints; may be other storage
    checkpoint_every: PositiveInt | None = None  # save every K steps (and always at the end)
    keep_checkpoints: int = Field(3, ge=0)  # 0: no checkpoints (metrics only)
    async_checkpoint: bool = True
    on_nonfinite: Literal["skip", "stop"] = "stop"  # NaN/inf loss or grads: skip the step, or stop the run
    models: dict[str, ModelConfig] = {}
    # the workload's own settings (e.g. vlm's image_token), validated against the class it
    # declares (`Workload.settings`) when the workload is resolved: `workloads.settings(cfg)`
    workload_settings: dict[str, Any] = {}
    distill: DistillConfig = DistillConfig()
    sections: dict[str, SectionConfig]
    edges: dict[str, EdgeConfig] = {}
    optimizer: OptimizerConfig = OptimizerConfig()
    data: DataConfig = DataConfig()
    eval: EvalConfig | None = None
    # where each step's record goes (with output_dir; process 0): metrics.jsonl, TensorBoard
    # events (tb/), a W&B run (wandb/); each is given the resolved config (config.yaml beside)
    trackers: tuple[Literal[TRACKERS], ...] = ("jsonl", "tensorboard")
    wandb: WandbConfig = WandbConfig()
    profile: ProfileConfig | None = None  # {start_step: 2, steps: 2}: a jax.profiler trace in <output_dir>/profile
    compile: CompileConfig = CompileConfig()
    monolithic: MonolithicConfig = MonolithicConfig()
    schedule: ScheduleConfig = ScheduleConfig()
    simulate: SimulateConfig = SimulateConfig()
    distributed: DistributedConfig = DistributedConfig()
    verify_rtol: float | None = Field(None, gt=0.0)  # None: 1e-5, or 2e-2 with any bfloat16 section

    @pydantic.model_validator(mode="before")
    @classmethod
    def _from_folders(cls, data):
        """`models.<s>: {hf: PATH}`: its kind from the folder when not written, and section <s>
        (the section that runs the model of its name) starts from the folder's weights unless
        its `init` is written (`init: null`: random weights of the folder's architecture).
        A `models.teachers` group is first read as the models it names (`_teachers_group`)."""
        data = _cached_teachers_run_nowhere(_teachers_group(data))
        if not isinstance(data, dict) or not isinstance(data.get("models"), dict):
            return data
        models, sections = dict(data["models"]), dict(data.get("sections") or {})
        for name, m in models.items():
            if not isinstance(m, dict) or not m.get("hf"):
                continue
            if "kind" not in m:
                try:
                    models[name] = {**m, "kind": hf_config.kind_of(m["hf"])}
                except hf_config.HFError as err:
                    raise ValueError(f"models.{name}.hf={m['hf']!r}: {err}") from None
            section = sections.get(name)
            if isinstance(section, dict) and "init" not in section:
                sections[name] = {**section, "init": {"hf_path": m["hf"]}}
        return {**data, "models": models, **({"sections": sections} if "sections" in data else {})}

    @pydantic.model_validator(mode="after")
    def _cache_is_kds(self):
        """`distill.cache` replaces kd's teacher sections; no other workload reads a teacher cache."""
        if self.distill.cache is not None and self.workload != "kd":
            raise ValueError(
                f"distill.cache={self.distill.cache}: workload {self.workload!r} does not train from a teacher "
                "cache; valid: workload kd, or leave distill.cache out"
            )
        return self

    @pydantic.model_validator(mode="after")
    def _teacher_weights(self):
        """`distill.combine.weights` weighs teachers the config has, with a positive sum."""
        names = self.distill.teachers or ("teacher",)
        if len(set(names)) < len(names):
            raise ValueError(f"distill.teachers={list(names)}: a name given twice; valid: each teacher once")
        weights = self.distill.combine.weights
        for name in weights:
            if name not in names:
                raise ValueError(
                    f"distill.combine.weights.{name}: not a teacher; valid: {', '.join(names)} (the names under "
                    f"models.teachers)"
                )
        if sum(weights.get(n, 1.0) for n in names) <= 0:
            raise ValueError(
                f"distill.combine.weights={dict(weights)}: they sum to 0; valid: weights >= 0 with a positive sum "
                f"(a teacher left out weighs 1)"
            )
        if self.distill.combine.mode == "route":
            self._check_routes(names)
        return self

    def _check_routes(self, names: tuple[str, ...]) -> None:
        """`route` names a tag the data has and sends each value to a teacher the config has."""
        combine, valid = self.distill.combine, ", ".join(names)
        if combine.weights:
            raise ValueError("distill.combine.weights: mode 'route' takes no weights; valid: mode: mean with weights")
        if combine.field is None:
            raise ValueError("distill.combine.field: missing; mode 'route' needs the sample tag naming each teacher")
        for key, teacher in [*((f"routes.{v}", t) for v, t in combine.routes.items()), ("default", combine.default)]:
            if teacher is not None and teacher not in names:
                raise ValueError(f"distill.combine.{key}={teacher!r}: not a teacher; valid: {valid}")
        held_out = self.eval.data if self.eval is not None else None
        for key, data in [("data", self.data), ("eval.data", held_out)]:
            if data is not None and data.kind == "synthetic":
                self._check_synthetic_tags(key, data, names)

    def _check_synthetic_tags(self, key: str, data: DataConfig, names: tuple[str, ...]) -> None:
        """Synthetic data (`key`) draws the routing tag, and each of its values routes to a teacher."""
        combine = self.distill.combine
        if combine.field not in data.tags:
            raise ValueError(
                f"distill.combine.field={combine.field!r}: the synthetic {key} gives no such tag; valid: "
                f"{', '.join(data.tags) or f'a tag of {key}.tags (none given)'}"
            )
        for value in data.tags[combine.field]:
            if combine.routes.get(value, value) not in names:
                raise ValueError(
                    f"{key}.tags.{combine.field}: {value!r} routes to no teacher; valid: {', '.join(names)}, or a "
                    f"value distill.combine.routes sends to one"
                )

    @pydantic.model_validator(mode="after")
    def _held_out(self):
        if self.eval is not None and self.eval.data is None and self.data.kind != "synthetic":
            raise ValueError(
                f"eval.data: not set, and the training data (data.kind={self.data.kind}) is no "
                f"held-out source; give eval.data (e.g. kind: array_record with other paths)"
            )
        return self

    @pydantic.model_validator(mode="after")
    def _trackers(self):
        if len(set(self.trackers)) < len(self.trackers):
            raise ValueError(f"trackers={list(self.trackers)}: named twice; valid: each of {', '.join(TRACKERS)} once")
        if "wandb" in self.trackers and self.output_dir is None:
            raise ValueError(
                "trackers: wandb writes its run under <output_dir>/wandb, and output_dir is not set; "
                "valid: set output_dir, or leave wandb out"
            )
        return self

    @pydantic.model_validator(mode="after")
    def _profile_window(self):
        if self.profile is not None and self.output_dir is None:
            raise ValueError(
                f"profile: {{start_step: {self.profile.start_step}, steps: {self.profile.steps}}} writes into "
                "<output_dir>/profile, and output_dir is not set; valid: set output_dir, or leave profile out"
            )
        if self.profile is not None and self.profile.start_step > self.steps:
            raise ValueError(
                f"profile.start_step={self.profile.start_step}: after the run's last step (steps={self.steps}); "
                f"valid: 1..{self.steps}"
            )
        return self

    @pydantic.model_validator(mode="after")
    def _plugin_parts(self):
        """Only a plug-in workload (`package.module:NAME`) may declare model kinds of its own;
        settings need a workload to validate them."""
        plugin = self.workload is not None and ":" in self.workload
        for name, m in self.models.items():
            if isinstance(m, PluginModelConfig) and not plugin:
                raise ValueError(
                    f"models.{name}.kind={m.kind!r}: unknown; valid: {', '.join(MODEL_KINDS)} (a plug-in "
                    f"workload, 'package.module:NAME', may declare kinds of its own)"
                )
        if self.workload is None and self.workload_settings:
            raise ValueError(
                "workload_settings: given, but no workload is named to take them; valid: name a workload, "
                "or leave workload_settings out"
            )
        return self

    @property
    def verify_tolerance(self) -> float:
        """`verify_rtol`, else the default for the plan's precision. bfloat16 keeps 8 mantissa
        bits (unit roundoff 2^-9 = 2e-3); a different micro-batching puts different rows in each
        bf16 matmul and changes summation order, which moves results by a few such units. 2e-2
        (10 units) passes that and still fails any real error (a lost micro-step or a wrong
        cotangent moves grads by more than 10%). fp8 (a frozen section's weight matmuls in e4m3)
        takes the same 2e-2: each input row is quantized with its own scale (`models.fp8`), so the
        two steps differ only where a bf16-sized difference moves a value across an e4m3 rounding
        boundary (one e4m3 step, 2^-3, for that element); on kd_tiny with an fp8 teacher that
        moves the student's grads by 7.4e-5 and its updated params by 4.3e-4, far inside 2e-2."""
        if self.verify_rtol is not None:
            return self.verify_rtol
        return 2e-2 if any(s.precision in ("bfloat16", "fp8") for s in self.sections.values()) else 1e-5

    def section(self, name: str) -> SectionConfig:
        """The config of the section named `name`, or of the section it is a pipeline stage of."""
        return self.sections[self.section_of(name)]

    def section_of(self, name: str) -> str:
        """The section `name` is a pipeline stage of (`core.stages.stage_name`), or `name`."""
        for n, s in self.sections.items():
            if s.stages > 1 and name in (stage_name(n, i) for i in range(s.stages)):
                return n
        return name

    def plan(self) -> Plan:
        """Each section's plan; a section in K stages gives K, stage i on the i-th consecutive
        K-th of its devices, its mesh's data axis divided by K (`core.stages.stage_name`)."""
        sections = {}
        for n, s in self.sections.items():
            cut = len(s.devices) // s.stages
            for i in range(s.stages):
                name = n if s.stages == 1 else stage_name(n, i)
                devices = tuple(s.devices[i * cut : (i + 1) * cut])
                sections[name] = SectionPlan(
                    devices, s.stage_mesh(), s.micro_batch, s.residuals, s.rules, s.precision, s.layer_remat
                )
        return Plan(
            sections=sections,
            fanout={n: e.fanout for n, e in self.edges.items() if e.fanout is not None},
            global_batch=self.global_batch,
        )

    def monolithic_plan(self) -> SectionPlan:
        m = self.monolithic
        return SectionPlan(tuple(m.devices), m.mesh.shape, m.micro_batch)


def set_dotted(tree: dict, key: str, value) -> None:
    parts = key.split(".")
    node = tree
    for p in parts[:-1]:
        nxt = node.get(p)
        if nxt is None:
            nxt = node[p] = {}
        if not isinstance(nxt, dict):
            raise ConfigError(f"error: {key}: {p!r} is {nxt!r}, not a mapping, so it has no field {parts[-1]!r}")
        node = nxt
    node[parts[-1]] = value


# the built-in model kinds; a plug-in workload may declare others (`Workload.model_kinds`)
MODEL_KINDS = {"vit": ViTModelConfig, "audio": AudioModelConfig, "llm": LLMModelConfig}


def _cached_teachers_run_nowhere(data):
    """With `distill.cache` the teachers run nowhere: their `sections.<name>` entries (a config
    written for the online run keeps them) are left out, their `models.<name>` kept (what the
    cache is checked against)."""
    if not isinstance(data, dict) or not isinstance(data.get("distill"), dict) or not data["distill"].get("cache"):
        return data
    names = data["distill"].get("teachers") or ["teacher"]
    sections = data.get("sections")
    if not isinstance(sections, dict):
        return data
    return {**data, "sections": {k: v for k, v in sections.items() if k not in names}}


def _teachers_group(data):
    """`models.teachers: {name: {model}, ...}` (distillation from several teachers) as the models it
    names, each `models.<name>` as any model is, and their order as `distill.teachers`, so every
    reader of `models` and `sections` sees a teacher as a model and a section of its own."""
    if not isinstance(data, dict) or not isinstance(data.get("models"), dict) or "teachers" not in data["models"]:
        return data
    models = dict(data["models"])
    group = models.pop("teachers")
    if not isinstance(group, dict) or not group or not all(isinstance(k, str) for k in group):
        raise ValueError(
            f"models.teachers={group!r}: not a mapping of teacher names to models; valid: {{name: {{kind: llm, ...}}, "
            f"...}}, one entry per teacher"
        )
    for name in group:
        if name in models:
            raise ValueError(f"models.teachers.{name}: models.{name} is another model; valid: a name of its own")
    if "teacher" in models:
        raise ValueError(
            "models.teacher and models.teachers: both given; valid: one teacher as models.teacher, or each one "
            "under models.teachers"
        )
    distill = data.get("distill")
    distill = dict(distill) if isinstance(distill, dict) else {}
    if distill.get("teachers") not in (None, list(group)):
        raise ValueError(
            f"distill.teachers={distill['teachers']!r}: differs from the names under models.teachers "
            f"({', '.join(group)}); valid: leave distill.teachers out"
        )
    return {**data, "models": {**models, **group}, "distill": {**distill, "teachers": list(group)}}


def _format_error(err: pydantic.ValidationError, root: type[BaseModel] | None = None, prefix: str = "") -> str:
    """The one line of a validation error of `root` (default: `Config`), whose keys sit under
    `prefix` in the config (a plug-in's block: `workload_settings`, `models.<name>`)."""
    root = root or Config
    errors = err.errors()
    # a misspelt key shows up twice (unknown key, and the real one missing): name the misspelling
    e = next((x for x in errors if x["type"] == "extra_forbidden"), errors[0])
    parts = [str(p) for p in e["loc"]]
    tagged = root is Config and len(parts) > 2 and parts[0] == "models" and parts[2] in (*MODEL_KINDS, "plugin")
    if tagged:
        del parts[2]  # pydantic's union tag, not a config key
    loc = ".".join([prefix, *parts] if prefix else parts)
    if e["type"] == "extra_forbidden":
        parent_model = (
            _model_at(MODEL_KINDS[str(e["loc"][2])], [str(p) for p in e["loc"][3:-1]])
            if tagged
            else _model_at(root, [str(p) for p in e["loc"][:-1]])
        )
        field = str(e["loc"][-1])
        options = sorted(parent_model.model_fields) if parent_model else []
        close = difflib.get_close_matches(field, options, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ";"
        return f"error: {loc}: unknown key{hint} valid keys: {', '.join(options)}"
    message = e["msg"].removeprefix("Value error, ")
    if e["type"] == "union_tag_not_found":  # a `models` entry without `kind`
        return f"error: {loc}.kind: missing; valid: {', '.join(MODEL_KINDS)}, or a kind the plug-in workload declares"
    if not parts:  # a check across keys: the message names them
        return f"error: {prefix + ': ' if prefix else ''}{message}"
    if e["type"] == "missing":  # its input is the block around the key, not a value of it
        folder = _folder_kind(e.get("input"), ".".join(parts[:2])) if tagged else ""
        return f"error: {loc}: missing; this key is required{folder}"
    return f"error: {loc}={e.get('input')!r}: {message}"


def _folder_kind(block, key: str) -> str:
    """For a `models` entry with `hf`: the kind its folder holds, so that a folder of the wrong
    kind for the model (a vision tower as a KD student) reads as such, not as a key left out."""
    if not isinstance(block, dict) or not block.get("hf"):
        return ""
    try:
        model_type = hf_config.read_config(block["hf"]).get("model_type")
    except hf_config.HFError:
        model_type = None
    return (
        f" of kind {block.get('kind')!r}, which {key}.hf={block['hf']!r} holds (config.json model_type "
        f"{model_type!r}); a model of another kind needs a folder of its kind"
    )


def validate_block(model: type[BaseModel], raw: dict, key: str) -> BaseModel:
    """`raw`, the config's `key` block (`workload_settings`, `models.<name>` of a plug-in kind),
    as `model`; refused like every other key of the config: a ConfigError of one line naming
    `key.<field>`, its value and what is valid."""
    try:
        return model.model_validate(raw)
    except pydantic.ValidationError as err:
        raise ConfigError(_format_error(err, model, key)) from None


def _model_at(model, path):
    for p in path:
        if model is None:
            return None
        field = model.model_fields.get(p)
        if field is None:
            continue  # dict key (section name) or union tag
        ann = field.annotation
        model = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else _dict_value_model(ann)
    return model


def _dict_value_model(ann):
    args = getattr(ann, "__args__", ())
    for a in args:
        if isinstance(a, type) and issubclass(a, BaseModel):
            return a
    return None


def parse_overrides(overrides: list[str]) -> dict[str, object]:
    out = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"error: override {item!r} must look like key=value (e.g. steps=4)")
        key, raw = item.split("=", 1)
        if not key.strip():
            raise ConfigError(f"error: override {item!r}: the key before '=' is empty; write key=value, e.g. steps=4")
        # "2:8" is a device range; YAML 1.1 would read it as the base-60 integer 128
        if re.fullmatch(r"\d+:\d+", raw) or not raw:
            out[key.strip()] = raw
            continue
        try:
            out[key.strip()] = yaml.safe_load(raw)
        except yaml.YAMLError as err:
            problem = str(err).splitlines()[0]
            raise ConfigError(
                f"error: override {item!r}: the value is not valid YAML ({problem}); quote it or "
                f'write a YAML value, e.g. {key.strip()}=4 or "{key.strip()}=[1, 2]"'
            ) from None
    return out


def load_config(path: str | Path | None = None, overrides: list[str] | dict | None = None) -> Config:
    """Read YAML, apply dotted overrides, validate. Raises ConfigError with a one-line message."""
    raw: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"error: --config={str(path)!r}: no such file")
        try:
            raw = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
        except UnicodeDecodeError as err:
            raise ConfigError(
                f"error: --config={str(path)!r}: not UTF-8 text (byte {err.start}: "
                f"{err.object[err.start : err.start + 1]!r}); save the config as UTF-8"
            ) from None
        except yaml.YAMLError as err:
            raise ConfigError(f"error: --config={str(path)!r}: invalid YAML ({err})".replace("\n", " ")) from err
        if not isinstance(raw, dict):
            raise ConfigError(
                f"error: --config={str(path)!r}: the file holds a YAML {type(raw).__name__} "
                f"({str(raw)[:40]!r}), not a mapping of config keys (workload, sections, ...)"
            )
    items = parse_overrides(overrides) if isinstance(overrides, list) else dict(overrides or {})
    for key, value in items.items():
        set_dotted(raw, key, value)
    try:
        return Config.model_validate(raw)
    except pydantic.ValidationError as err:
        raise ConfigError(_format_error(err)) from None


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
