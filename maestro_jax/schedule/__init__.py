"""Scheduling a global batch (no JAX): which samples form each section's micro-steps, and one
total order of operations that keeps every cross-section dependency and the stash bound."""

from maestro_jax.schedule.naive import naive
from maestro_jax.schedule.ops import (
    MicroStep,
    Op,
    Problem,
    SampleMeta,
    Schedule,
    ScheduleError,
    required_ops,
    sample_metas,
)
from maestro_jax.schedule.timing import micro_step_rows, op_duration, op_units, resource_of, steady_order
from maestro_jax.schedule.validate import validate
from maestro_jax.schedule.wavefront import list_schedule, wavefront

__all__ = [
    "MicroStep",
    "Op",
    "Problem",
    "SampleMeta",
    "Schedule",
    "ScheduleError",
    "list_schedule",
    "micro_step_rows",
    "naive",
    "op_duration",
    "op_units",
    "required_ops",
    "resource_of",
    "sample_metas",
    "steady_order",
    "validate",
    "wavefront",
]
