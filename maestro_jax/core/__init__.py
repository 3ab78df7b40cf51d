"""The vocabulary of the framework (no JAX): section graphs, plans and their constraint checks,
shape buckets."""
