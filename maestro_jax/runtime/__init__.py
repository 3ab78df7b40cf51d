"""The section runtime: per-section meshes and jitted programs, device-to-device transfers,
the executor that walks a schedule, the monolithic baseline, multi-process set-up."""
