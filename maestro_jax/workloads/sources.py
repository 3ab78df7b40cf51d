"""The workload's samples: the configured source (ArrayRecord files, the workload's own, or
synthetic samples of its modalities over its vocabulary) and the checks every sample passes
before it is trained on."""

from __future__ import annotations

from collections.abc import Callable

from maestro_jax.config import Config, ConfigError
from maestro_jax.workloads import checks
from maestro_jax.workloads.checks import modalities_of
from maestro_jax.workloads.registry import Workload


def source_from_config(cfg: Config, key: str = "data", checked: Workload | None = None):
    """The configured sample source (`data.kind`), each sample with its cached teacher outputs
    where the config trains from a teacher cache (`distill.cache`: `data.teacher_cache`). `key`:
    where the config holds `cfg.data` (`eval.data` for a held-out source), for the errors;
    `checked` as `build_graph`'s."""
    source = _data_source(cfg, key, checked)
    if cfg.distill.cache is None:
        return source
    from maestro_jax.data.teacher_cache import checked_source

    return checked_source(source, cfg.distill.cache)


def _data_source(cfg: Config, key: str = "data", checked: Workload | None = None):
    """The ArrayRecord files as they are, the workload's own source (`workload`:
    `Workload.source`), or a seeded synthetic source over the workload's vocabulary whose items
    are the workload's modalities that `data.modalities` gives sizes to (each name and size
    checked against the workload); its text avoids every placeholder id of the workload."""
    from maestro_jax.data.sources import ArrayRecordSource, SyntheticItems, SyntheticSource

    if cfg.data.kind == "array_record":
        return ArrayRecordSource(tuple(cfg.data.paths), key=f"{key}.paths")
    workload = checked or checks.check_config(cfg)
    if cfg.data.kind == "workload":
        if workload.source is None:
            raise ConfigError(
                f"error: data.kind='workload': workload {cfg.workload!r} brings no sample source "
                f"(Workload.source); valid: synthetic, array_record"
            )
        return workload.source(cfg)
    modalities = modalities_of(cfg, workload)
    known = {m.name: m for m in modalities}
    fields = workload.settings.model_fields if workload.settings is not None else {}
    for name in cfg.data.modalities:
        if name not in known:
            hint = f" (with workload_settings.{name}_token set, {name} too)" if f"{name}_token" in fields else ""
            raise ConfigError(
                f"error: data.modalities.{name}: workload {cfg.workload!r} takes {sorted(known) or 'text only'}{hint}"
            )
    items = []
    for name, m in known.items():
        d = cfg.data.modalities.get(name)
        if d is None or not d.sizes:
            continue
        for size in d.sizes:
            if len(size) != len(m.unit):
                raise ConfigError(
                    f"error: data.modalities.{name}.sizes={d.sizes}: each size has {len(m.unit)} "
                    f"spatial dims for {name}"
                )
        items.append(SyntheticItems(m, d.fraction, d.max_items, tuple(tuple(s) for s in d.sizes)))
    return SyntheticSource(
        num_samples=cfg.data.num_samples,
        vocab=workload.vocab(cfg),
        text_len=tuple(cfg.data.text_len),
        items=tuple(items),
        seed=cfg.seed,
        reserved=tuple(m.placeholder for m in modalities),
        tags=tuple((name, tuple(values)) for name, values in cfg.data.tags.items()),
    )


def sample_check(cfg: Config, checked: Workload | None = None):
    """`check(sample, parts=None)`: the validation every sample passes before it is trained on
    (`data.samples.validate_sample` against the workload's modalities, its vocabulary and
    `data.max_tokens`)."""
    import functools

    from maestro_jax.data.samples import validate_sample

    workload = checked or checks.check_config(cfg)
    check = functools.partial(
        validate_sample,
        modalities=modalities_of(cfg, workload),
        max_tokens=cfg.data.max_tokens,
        vocab=workload.vocab(cfg),
    )
    return _with_rule(check, workload.sample_rule(cfg))


def info_check(cfg: Config, checked: Workload | None = None):
    """The metadata half of `sample_check` (`data.samples.validate_info`: length, modalities, item
    shapes; no vocabulary, which needs the tokens), run on every process before scheduling."""
    import functools

    from maestro_jax.data.samples import validate_info

    workload = checked or checks.check_config(cfg)
    check = functools.partial(validate_info, modalities=modalities_of(cfg, workload), max_tokens=cfg.data.max_tokens)
    return _with_rule(check, workload.sample_rule(cfg))


def _with_rule(check, rule):
    """`check` followed by the workload's `rule` (`Workload.sample_rule`) on the same sample."""
    if rule is None:
        return check

    def checked(sample, *args, **kwargs):
        out = check(sample, *args, **kwargs)
        rule(sample)
        return out

    return checked


def mean_item_units(cfg: Config, modality: str, per_item: Callable[[tuple[int, ...]], float], default: float) -> float:
    """The mean work units of one item of `modality` over the sizes `data.modalities.<modality>`
    lists (`default` when it lists none), for the attention context a cost declaration assumes."""
    d = cfg.data.modalities.get(modality)
    sizes = [tuple(s) for s in d.sizes] if d else []
    return sum(per_item(s) for s in sizes) / len(sizes) if sizes else default
