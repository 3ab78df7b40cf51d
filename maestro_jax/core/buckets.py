"""Shape buckets: pad dynamic sizes to a few static ones so each section compiles a few programs.

Buckets are geometric with eight steps per octave: at most 12.5% padding, and a number of
distinct shapes (compiled programs) that grows only logarithmically with the largest size.
"""

import math


def bucket(n: int, minimum: int = 16) -> int:
    """Smallest bucket >= n: `minimum`, then multiples of max(minimum, 2**(floor(log2 n) - 3))."""
    if n <= minimum:
        return minimum
    step = max(minimum, 2 ** (math.floor(math.log2(n)) - 3))
    return -(-n // step) * step
