"""A config's `models.<name>` as the model's own config: the Flax model's config dataclass for a
built-in kind (with its section's activation checkpointing and an MoE dispatch that runs on
this backend), the plug-in's class for a kind the workload declares."""

from __future__ import annotations

import dataclasses
import functools
import logging

from maestro_jax.config import MODEL_KINDS, Config, ConfigError, validate_block
from maestro_jax.workloads.registry import resolve

log = logging.getLogger("maestro_jax")


def model(cfg: Config, name: str, kind: str):
    """`models.<name>` as the model's own config: for a built-in kind the Flax model's config
    dataclass, with the activation checkpointing (`remat`) of the section named like it; for a
    kind the plug-in declares (`Workload.model_kinds`) its class's instance. ConfigError when
    missing, of another kind, or (a plug-in's kind) with fields its class refuses."""
    from maestro_jax.models import AudioConfig, LLMConfig, ViTConfig

    m = cfg.models.get(name)
    if m is None:
        raise ConfigError(
            f"error: models.{name}: missing; workload {cfg.workload!r} needs a model of kind {kind!r} named {name!r}"
        )
    if m.kind != kind and getattr(m, "hf", None) is not None:  # the kind came from the folder, or agrees with it
        raise ConfigError(
            f"error: models.{name}.hf={m.hf!r}: holds a model of kind {m.kind!r}; workload {cfg.workload!r} needs "
            f"kind {kind!r} for models.{name}"
        )
    if m.kind != kind:
        raise ConfigError(f"error: models.{name}.kind={m.kind!r}: workload {cfg.workload!r} needs kind {kind!r} here")
    fields = {k: v for k, v in m.model_dump().items() if k not in ("kind", "hf")}
    if kind not in MODEL_KINDS:
        own = resolve(cfg.workload).model_kinds
        if kind not in own:
            raise ConfigError(
                f"error: models.{name}.kind={kind!r}: unknown; valid: {', '.join([*MODEL_KINDS, *own])} "
                f"(the built-in kinds and those workload {cfg.workload!r} declares)"
            )
        return validate_block(own[kind], fields, f"models.{name}")
    if name in cfg.sections:  # the section that runs this model sets its activation checkpointing
        fields["remat"] = cfg.sections[name].layer_remat
    if kind == "llm":
        strict = fields.pop("moe_dispatch_strict", False)
        return _with_runnable_dispatch(LLMConfig.from_fields(fields), name, strict)
    return {"vit": ViTConfig, "audio": AudioConfig}[kind](**fields)


def _with_runnable_dispatch(llm, name: str, strict: bool = False):
    """`llm` with an MoE dispatch that runs on this process's backend: `grouped` where its kernel
    is missing here becomes `sparse` (the same dispatch, each device's experts through tiled
    matmuls instead of tokamax's grouped GEMM), said in one log line; with `strict`
    (`models.<name>.moe_dispatch_strict`), a ConfigError naming `models.<name>.moe_dispatch`."""
    import jax

    from maestro_jax.models.attention import compute_capability
    from maestro_jax.models.llm import grouped_gemm_missing

    if llm.experts and llm.moe_dispatch == "grouped":
        missing = grouped_gemm_missing(jax.default_backend(), compute_capability(), jax.__version_info__)
        if missing and strict:
            raise ConfigError(
                f"error: models.{name}.moe_dispatch='grouped' with moe_dispatch_strict: tokamax's grouped GEMM "
                f"needs {missing}; valid here: auto, dense, ragged, sparse (or moe_dispatch_strict: false, which "
                "runs sparse)"
            )
        if missing:
            _said_grouped_fallback(name, missing)
            return dataclasses.replace(llm, moe_dispatch="sparse")
    return llm


@functools.cache
def _said_grouped_fallback(name: str, missing: str) -> None:
    """One log line a section and reason, however often the model is built."""
    log.warning(
        "models.%s.moe_dispatch: grouped needs %s; running sparse, the same dispatch without tokamax's "
        "grouped GEMM (moe_dispatch_strict: true refuses instead)",
        name,
        missing,
    )
