"""A model's config dataclass is its one schema.

Each built-in model (`ViTConfig`, `AudioConfig`, `LLMConfig`) declares its fields once, on its
frozen dataclass: the type (choices as `Literal`, bounds as pydantic constraints inside
`Annotated`), the default and the comment that says what the field does. What involves more than
one field is a `Rule` in the dataclass's `RULES`, which the dataclass enforces when it is built
(`enforce`, from `__post_init__`). The launch config's `models.<name>` entry is generated from
the same dataclass (`maestro_jax.config.model_schema`: every field with its type and default, the
rules as validators naming their field), so a new field is written in one place and reaches the
config file, the module and `workloads.model()`'s conversion; `tests/test_model_schema.py`
checks that by introspection. Fields the config does not hold (`SECTION_FIELDS`: set from the
section that runs the model) are left out of the config's schema.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Annotated, Any

from pydantic import Field, NonNegativeInt, PositiveInt

__all__ = ["SECTION_FIELDS", "NonNegativeFloat", "NonNegativeInt", "PositiveFloat", "PositiveInt", "Rule", "enforce"]

PositiveFloat = Annotated[float, Field(gt=0)]
NonNegativeFloat = Annotated[float, Field(ge=0)]

# model fields the launch config sets from the section that runs the model, not from
# `models.<name>`: `remat` is `sections.<name>.layer_remat`
SECTION_FIELDS = ("remat",)


@dataclasses.dataclass(frozen=True)
class Rule:
    """A constraint across fields: `check(values)` returns what is wrong (one sentence) or None.
    `field` is the field the error names (its value is the one refused), None for the whole
    config; the fields `check` reads come before `field` in the dataclass, so the config's
    validator of `field` sees them validated."""

    field: str | None
    check: Callable[[Mapping[str, Any]], str | None]


def enforce(config) -> None:
    """ValueError naming the field and value of the first rule `config` breaks (its class's
    `RULES`)."""
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    for rule in type(config).RULES:
        message = rule.check(values)
        if message:
            where = f".{rule.field}={values[rule.field]!r}" if rule.field else ""
            raise ValueError(f"{type(config).__name__}{where}: {message}")
