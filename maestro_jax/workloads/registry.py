"""The workload registry: a `Workload` describes a plug-in once, `resolve` finds it by name (a
built-in module of this package, or a user's `package.module:NAME`)."""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping

from maestro_jax.config import MODEL_KINDS, Config, ConfigError, Settings
from maestro_jax.core.graph import SectionGraph
from maestro_jax.data.samples import Modality

BUILTIN = ("vlm", "kd", "omni", "vlm_kd")


@dataclasses.dataclass(frozen=True)
class Workload:
    """A workload plug-in.

    build(cfg): the section graph (models from `cfg.models`, costs declared on each section).
    modalities(cfg): the modalities its samples carry besides text (validated, synthesised).
    vocab(cfg): the token vocabulary samples must stay inside, read off the model configs (every
      embedding table the ids index).
    pretrained: section -> loader(section, path, states, programs) -> states, for sections that
      can start from a Hugging Face folder (`sections.<s>.init.hf_path`); checked before compiling
      by `pretrained.check_pretrained`, called by the runtime after its sections initialise. Or a
      function of the config giving that mapping, for sections the config names (KD's teachers);
      `loaders(cfg)` reads either.
    settings: the class (a `config.Settings`) the config's `workload_settings:` block is validated
      against; its defaults apply where the block leaves a field out. `settings(cfg)` reads it.
      None: the workload takes no settings.
    model_kinds: kind -> its fields' class (a `config.Settings`, without `kind`), for `models:`
      entries of kinds of the plug-in's own; `model(cfg, name, kind)` reads one.
    source: cfg -> a random-access sample source (`data.sources`), used for `data.kind: workload`
      (it reads `cfg.data`; under `eval`, that is `eval.data`, with `seed + 1`).
    sample_rule: cfg -> a check of a sample's metadata (its `SampleInfo`, or the `Sample`) of the
      workload's own, raising `data.samples.DataError` naming the sample, or None where the
      config needs none; run beside `validate_info` on every sample (KD routing by tag: every
      sample's tag must name a teacher), so a bad one is refused or skipped by
      `data.on_bad_sample` before any section sees it.
    """

    name: str
    build: Callable[[Config], SectionGraph]
    vocab: Callable[[Config], int]
    modalities: Callable[[Config], tuple[Modality, ...]] = lambda cfg: ()
    pretrained: Mapping[str, Callable] | Callable[[Config], Mapping[str, Callable]] = dataclasses.field(
        default_factory=dict
    )
    settings: type[Settings] | None = None
    model_kinds: Mapping[str, type[Settings]] = dataclasses.field(default_factory=dict)
    source: Callable[[Config], object] | None = None
    sample_rule: Callable[[Config], Callable[[object], None] | None] = lambda cfg: None

    def __post_init__(self):
        """A settings or model class that let unknown keys through would drop a misspelt key silently."""
        for what, cls in [
            ("settings", self.settings),
            *((f"model_kinds[{k!r}]", c) for k, c in self.model_kinds.items()),
        ]:
            if cls is not None and not (isinstance(cls, type) and issubclass(cls, Settings)):
                raise TypeError(
                    f"Workload {self.name!r}: {what} must be a maestro_jax.config.Settings subclass, not {cls!r}"
                )
        clash = sorted(set(self.model_kinds) & set(MODEL_KINDS))
        if clash:
            raise TypeError(f"Workload {self.name!r}: model_kinds {clash} are built-in kinds; name the plug-in's own")

    def loaders(self, cfg: Config) -> Mapping[str, Callable]:
        """The Hugging Face loader of each section that has one, under `cfg`."""
        return self.pretrained(cfg) if callable(self.pretrained) else self.pretrained


def resolve(name: str | None) -> Workload:
    """The workload a config names (a built-in name, or `package.module:NAME` imported); ConfigError
    naming the valid choices when it is missing, unknown, unimportable or not a `Workload`."""
    if name is None:
        raise ConfigError(
            f"error: workload: missing; valid: {', '.join(BUILTIN)}, or a plug-in "
            f"'package.module:NAME' (a Python caller may instead pass its own graph to Trainer)"
        )
    if name in BUILTIN:
        return importlib.import_module(f"maestro_jax.workloads.{name}").WORKLOAD
    module, _, attr = name.partition(":")
    if not attr:
        raise ConfigError(
            f"error: workload={name!r}: unknown; valid: {', '.join(BUILTIN)}, or a plug-in "
            f"'package.module:NAME' naming a maestro_jax.workloads.Workload"
        )
    try:
        found = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as err:
        raise ConfigError(
            f"error: workload={name!r}: cannot import it ({err}); valid: {', '.join(BUILTIN)}, or 'package.module:NAME'"
        ) from None
    if not isinstance(found, Workload):
        raise ConfigError(
            f"error: workload={name!r}: is a {type(found).__name__}, not a maestro_jax.workloads.Workload"
        )
    return found
