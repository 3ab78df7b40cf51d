"""Shape buckets: pad dynamic sizes to a few static ones so each section compiles a few programs.

Buckets are geometric, `per_octave` steps to an octave, each a multiple of the caller's
`minimum`: sizes up to `minimum` pad to `minimum`; a size n in [2**e, 2**(e+1)) pads to the next
multiple of max(minimum, 2**e / per_octave). Past `minimum * per_octave` that is less than
1 / per_octave of padding (12.5% at the default 8); below it, less than `minimum`. The number
of distinct shapes (compiled programs) grows only logarithmically with the largest size, and
with `per_octave`: a section fed several producers' micro-steps compiles one program per
combination of their buckets, so coarser buckets cut the count faster than linearly.

The granularity is an argument, never ambient state: `bucket(n, minimum, per_octave)`. The
config's `compile.buckets_per_octave` (default `PER_OCTAVE`; 1, 2 or 4 for a small model, whose
run is mostly compiling) reaches each place that pads or prices as data:
  runtime   a built-in workload's sections are built from the config (`workload.build(cfg)`),
            so each section's `host_batch`/`packed_batch` passes the config's granularity to
            the packing helpers (`workloads.rows`: `text_rows`, `packed_text_rows`,
            `pack_items`; `workloads.vlm.class_segments`). A user's own section picks its own
            buckets: the helpers and `bucket` default to `PER_OCTAVE` unless given `per_octave`.
  planning  `workloads.describe(cfg)` records it on the `WorkloadSpec` (`buckets_per_octave`),
            the section costs made from that spec carry it (`SectionCost.per_octave`), and every
            pricing site pads with `SectionCost.padded`; the memory model takes it from the spec
            too (`layout.section_memory`). So a Python caller of the planner or the simulator
            (`tools.plan.planner_for`, `tools.simulate.simulate_config`) prices the config's
            buckets with nothing to set up.
"""

from __future__ import annotations

PER_OCTAVE = 8  # the default granularity: at most 12.5% padding past the minimum's octaves
VALID = (1, 2, 4, 8, 16, 32)  # the granularities `compile.buckets_per_octave` accepts


def bucket(n: int, minimum: int = 16, per_octave: int = PER_OCTAVE) -> int:
    """Smallest bucket >= n: `minimum`, then multiples of max(minimum, 2**floor(log2 n) /
    per_octave); `per_octave` one of `VALID`."""
    if per_octave not in VALID:
        raise ValueError(f"buckets per octave must be one of {', '.join(map(str, VALID))}, got {per_octave}")
    if n <= minimum:
        return minimum
    octave, shift = n.bit_length() - 1, per_octave.bit_length() - 1  # 2**octave <= n; per_octave = 2**shift
    step = max(minimum, 1 << max(octave - shift, 0))
    return -(-n // step) * step
