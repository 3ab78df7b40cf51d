"""Planning (no JAX): cost model, simulator, memory model, plan search and cluster-scale
prediction. Reads a workload's description as plain data, so it can be tested as algorithms."""
