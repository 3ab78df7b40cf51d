"""Shape buckets: pad dynamic sizes to a few static ones so each section compiles a few programs."""


def bucket(n: int, minimum: int = 16) -> int:
    """Smallest power of two >= max(n, minimum)."""
    size = minimum
    while size < n:
        size *= 2
    return size
