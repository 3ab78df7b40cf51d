"""Shape buckets: pad dynamic sizes to a few static ones so each section compiles a few programs.

Buckets are geometric, `per_octave` steps to an octave, each a multiple of the caller's
`minimum`: sizes up to `minimum` pad to `minimum`; a size n in [2**e, 2**(e+1)) pads to the next
multiple of max(minimum, 2**e / per_octave). Past `minimum * per_octave` that is less than
1 / per_octave of padding (12.5% at the default 8); below it, less than `minimum`. The number
of distinct shapes (compiled programs) grows only logarithmically with the largest size, and
with `per_octave`: a section fed several producers' micro-steps compiles one program per
combination of their buckets, so coarser buckets cut the count faster than linearly.

`per_octave` is the config's `compile.buckets_per_octave` (default `PER_OCTAVE`; 1, 2 or 4 for
a small model, whose run is mostly compiling). `bucket` reads the granularity in force, which
`granularity(k)` sets for a block: the runtime enters it wherever it packs batches
(`Executor.host_batches`, the monolithic model's) and the command line around every command, so
the runtime pads and the planner and simulator price (`planning.cost`, `planning.layout`,
`planning.pipeline`) with the one setting, and the packing code (`workloads.rows`, a user's own
`host_batch`) calls `bucket` without passing it around. `tools.simulate.simulate_config` enters
the config's granularity itself; a Python caller of the planner (`tools.plan.planner_for`,
`planning.planner.Planner`) prices at the one in force, so enters
`granularity(cfg.compile.buckets_per_octave)` around its use.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

PER_OCTAVE = 8  # the default granularity: at most 12.5% padding past the minimum's octaves
VALID = (1, 2, 4, 8, 16, 32)  # the granularities `compile.buckets_per_octave` accepts

_per_octave: contextvars.ContextVar[int] = contextvars.ContextVar("maestro_jax_buckets_per_octave", default=PER_OCTAVE)


def bucket(n: int, minimum: int = 16) -> int:
    """Smallest bucket >= n: `minimum`, then multiples of max(minimum, 2**floor(log2 n) /
    per_octave), `per_octave` the granularity in force (`granularity`, default 8)."""
    if n <= minimum:
        return minimum
    octave, shift = n.bit_length() - 1, per_octave().bit_length() - 1  # 2**octave <= n; per_octave = 2**shift
    step = max(minimum, 1 << max(octave - shift, 0))
    return -(-n // step) * step


def per_octave() -> int:
    """The granularity in force: buckets per octave."""
    return _per_octave.get()


@contextlib.contextmanager
def granularity(per_octave: int) -> Iterator[None]:
    """`bucket` with `per_octave` buckets an octave inside the block (this thread or task only;
    a thread the block starts begins at the default)."""
    if per_octave not in VALID:
        raise ValueError(f"buckets per octave must be one of {', '.join(map(str, VALID))}, got {per_octave}")
    token = _per_octave.set(per_octave)
    try:
        yield
    finally:
        _per_octave.reset(token)
