"""What only the workload can validate of a config, before anything is built (`check_config`):
its typed settings (`workload_settings:`, filled from the checkpoints' folders), the `models:`
entries of its own kinds and its modalities' placeholder ids."""

from __future__ import annotations

from maestro_jax.config import Config, ConfigError, PluginModelConfig, Settings, validate_block
from maestro_jax.data.samples import Modality
from maestro_jax.workloads.model_configs import model
from maestro_jax.workloads.registry import Workload, resolve


def settings(cfg: Config) -> Settings | None:
    """The config's `workload_settings` as the workload's own settings class (its defaults where
    the block is silent); ConfigError of one line naming the key, as for any key of the config.
    None for a workload that takes no settings (and then the block must be empty)."""
    workload = resolve(cfg.workload)
    if workload.settings is None:
        if cfg.workload_settings:
            key = next(iter(cfg.workload_settings))
            raise ConfigError(
                f"error: workload_settings.{key}: unknown key; workload {cfg.workload!r} takes no settings"
            )
        return None
    given = _from_checkpoints(cfg, workload.settings)
    for key, (value, folder, field) in given.items():
        mine = cfg.workload_settings.get(key, value)
        if mine != value:
            raise ConfigError(
                f"error: workload_settings.{key}={mine!r}: the checkpoint {folder} has {field}={value!r}; leave "
                f"{key} out (the checkpoint fills it in) or write the checkpoint's value"
            )
    block = {**{k: v for k, (v, _, _) in given.items()}, **cfg.workload_settings}
    return validate_block(workload.settings, block, "workload_settings")


def _from_checkpoints(cfg: Config, cls: type[Settings]) -> dict[str, tuple[object, str, str]]:
    """The settings a `models.<s>.hf` folder gives (`Settings.checkpoint_fields`: setting -> the
    config.json field, as a VLM's `image_token` is its folder's `image_token_index`, or the first
    of several a family may name it by: Qwen-VL's `image_token_id`): setting -> (value, folder,
    field). Two folders that disagree are a ConfigError naming both."""
    from maestro_jax import hf_config

    fields = getattr(cls, "checkpoint_fields", {})
    out: dict[str, tuple[object, str, str]] = {}
    for folder in dict.fromkeys(m.hf for m in cfg.models.values() if getattr(m, "hf", None)):
        config = hf_config.read_config(folder)
        for key, names in fields.items():
            field = next((f for f in ((names,) if isinstance(names, str) else names) if f in config), None)
            if field is None:
                continue
            if key in out and out[key][0] != config[field]:
                raise ConfigError(
                    f"error: workload_settings.{key}: the checkpoints {out[key][1]} ({field}={out[key][0]!r}) and "
                    f"{folder} ({field}={config[field]!r}) disagree; valid: models from checkpoints that agree"
                )
            out.setdefault(key, (config[field], folder, field))
    return out


def check_config(cfg: Config) -> Workload:
    """The config's workload, with what only it can validate checked (its settings, `models:`
    entries of its own kinds, its modalities' placeholder ids): before anything is built."""
    workload = resolve(cfg.workload)
    settings(cfg)
    for name, m in cfg.models.items():
        if isinstance(m, PluginModelConfig):
            model(cfg, name, m.kind)
    modalities_of(cfg, workload)
    return workload


def modalities_of(cfg: Config, workload: Workload | None = None) -> tuple[Modality, ...]:
    """The workload's modalities, their placeholder ids checked: each inside the vocabulary (not
    0, the padding id) and no two alike, or a text token or another modality's item would be
    taken for one. ConfigError naming the setting (`workload_settings.<modality>_token` where the
    workload's settings have it)."""
    workload = workload or resolve(cfg.workload)
    modalities, vocab = workload.modalities(cfg), workload.vocab(cfg)
    fields = workload.settings.model_fields if workload.settings is not None else {}
    seen: dict[int, str] = {}
    for m in modalities:
        key = f"workload_settings.{m.name}_token" if f"{m.name}_token" in fields else f"the {m.name} placeholder id"
        if not 1 <= m.placeholder < vocab:
            raise ConfigError(
                f"error: {key}={m.placeholder}: outside the vocabulary; valid: 1 to {vocab - 1} (0 is padding; "
                f"the model's vocab is {vocab})"
            )
        if m.placeholder in seen:
            raise ConfigError(
                f"error: {key}={m.placeholder}: the {seen[m.placeholder]} placeholder has this id too; valid: "
                f"an id of its own"
            )
        seen[m.placeholder] = m.name
    return modalities
